"""Test plumbing: one rank of the example GPT's first training steps, either as
native torch HSDP (``--mode native``: one torch world, 2-D mesh replicate x shard)
or as ft-launch FT-HSDP (``--mode ft``: a replica's world, FSDP2 over its ranks,
FTAR across replicas; started by ``LocalJob``). Each rank writes its gradient
shards and, after the optimizer step, its parameter shards to
``<out>/<mode>-r<replica>-k<rank>-s<step>.npz`` (float32: bf16 widens exactly), so
the test compares them without importing torch."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "etc" / "examples" / "gpt"))

from corpus import Corpus, replica_sample_ids
from model import Gpt, GptConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIZE = {"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16}


def local(tensor: torch.Tensor) -> np.ndarray:
    part = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return part.detach().float().numpy().copy()


def build(mesh: object, reduce_dtype: str) -> tuple[Gpt, Corpus]:
    torch.manual_seed(0)
    corpus = Corpus(context=SIZE["context"], n_sentences=2000)
    model = Gpt(GptConfig(vocab_size=corpus.vocab_size, **SIZE))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=DTYPES[reduce_dtype])
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model, corpus


def batch(corpus: Corpus, replica: int, replicas: int, position: int, rank: int, ranks: int,
          size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = replica_sample_ids(replica, replicas, position, size)[rank::ranks]
    tokens, targets = corpus.batch(ids)
    return torch.from_numpy(tokens), torch.from_numpy(targets)


def save(out: Path, name: str, model: torch.nn.Module, grads: bool) -> None:
    arrays = {f"{'grad' if grads else 'param'}/{n}": local(p.grad if grads else p)
              for n, p in model.named_parameters()}
    np.savez(out / f"{name}.npz", **arrays)


def native(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (args.replicas, args.ranks),
                            mesh_dim_names=("replicate", "shard"))
    replica, rank = divmod(dist.get_rank(), args.ranks)
    model, corpus = build(mesh, args.reduce_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    for step in range(args.steps):
        tokens, targets = batch(corpus, replica, args.replicas, step * args.batch_size, rank,
                                args.ranks, args.batch_size)
        model(tokens, targets).backward()
        save(args.out, f"native-r{replica}-k{rank}-s{step}-grad", model, grads=True)
        optimizer.step()
        optimizer.zero_grad()
        save(args.out, f"native-r{replica}-k{rank}-s{step}-param", model, grads=False)
    dist.destroy_process_group()


def ft(args: argparse.Namespace) -> None:
    from ft_launch.launcher.worker.torch_api import ft_manager

    dist.init_process_group("gloo")          # the replica's world, from the env
    model, corpus = build(init_device_mesh("cpu", (args.ranks,)), args.reduce_dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    manager = ft_manager(model, optimizer, batch_size=args.batch_size)
    me = manager.identity
    try:
        while manager.next_step < args.steps:
            manager.start_step()
            tokens, targets = batch(corpus, me.replica_id, me.num_replicas,
                                    manager.data_position, me.rank, me.ranks, args.batch_size)
            model(tokens, targets).backward()
            manager.allreduce_gradients()
            name = f"ft-r{me.replica_id}-k{me.rank}-s{manager.plan.step}"
            save(args.out, f"{name}-grad", model, grads=True)
            if manager.commit():
                save(args.out, f"{name}-param", model, grads=False)
    finally:
        manager.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "ft"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--reduce-dtype", choices=sorted(DTYPES), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    (native if args.mode == "native" else ft)(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
