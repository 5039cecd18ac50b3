"""A native HSDP training script, and the same script adopted to ft-launch by
swapping its mesh call (``test_mesh.py``).

The script, as a user writes it natively: a 2-D ``("replicate", "shard")`` mesh
from ``init_device_mesh``, FSDP2 on it (each block, then the root), its own data
split by the mesh (``DistributedSampler`` over ``replicas x shards`` data ranks,
rank ``replica * shards + shard``), AdamW. ``--mode native``: one torch world of
``replicas x shards`` ranks. ``--mode ft`` (started by ``LocalJob``, each replica
a world of its own): the mesh call swapped for ``ft_init_device_mesh``, plus
the ft-launch lines (``ft_manager``, ``FtOptimizer``, the loop bounded by
``manager.next_step``); every other line is the same.

Each rank writes ``<out>/<mode>-r<replica>-k<shard>.json`` (a digest of its state
after each committed step) and ``.npz`` (its final local shards of the parameters
and the optimizer state; float32, bf16 widens exactly), and replica 0 the whole
final model, ``<out>/<mode>-full.npz`` (a full state dict), so the test compares
them without importing torch. A run is shortened while it trains by a number in
``<run_dir>/end-step`` (as the example's, ``end_step_at``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data.distributed import DistributedSampler

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "etc" / "examples" / "gpt"))

from corpus import Corpus
from model import Gpt, GptConfig

SIZE = {"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16}
#: FSDP2's mixed precision: none (fp32), or bf16 parameters and gradient reduction
POLICIES = {"fp32": MixedPrecisionPolicy(),
            "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                         reduce_dtype=torch.bfloat16)}


class StepBatches:
    """The script's own data split: this data rank's samples of each step, epoch
    after epoch, as a ``DataLoader`` over a ``DistributedSampler`` reads them."""

    def __init__(self, corpus: Corpus, data_rank: int, data_ranks: int, global_batch: int):
        self.corpus = corpus
        self.sampler = DistributedSampler(range(corpus.num_samples), num_replicas=data_ranks,
                                          rank=data_rank, shuffle=True, seed=0, drop_last=True)
        self.size = global_batch // data_ranks
        self.per_epoch = len(self.sampler) // self.size
        self.epoch, self.order = -1, list[int]()

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, index = divmod(step, self.per_epoch)
        if epoch != self.epoch:
            self.sampler.set_epoch(epoch)
            self.epoch, self.order = epoch, list(self.sampler)
        ids = self.order[index * self.size:(index + 1) * self.size]
        tokens, targets = self.corpus.batch(ids)
        return torch.from_numpy(tokens), torch.from_numpy(targets)


def end_step_at(run_dir: Path, steps: int) -> int:
    """``steps``, or the smaller count ``<run_dir>/end-step`` names (written whole)."""
    path = run_dir / "end-step"
    return min(steps, int(path.read_text())) if path.exists() else steps


def local_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> dict[str, np.ndarray]:
    """This rank's shards: parameters and optimizer state, float32."""
    def local(t: torch.Tensor) -> np.ndarray:
        part = t.to_local() if hasattr(t, "to_local") else t
        return part.detach().float().numpy().copy()
    arrays = {f"param/{n}": local(p) for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for param, values in optimizer.state.items():
        arrays |= {f"optim/{names[id(param)]}/{k}": local(v) for k, v in values.items()
                   if isinstance(v, torch.Tensor) and v.dim() > 0}
    return arrays


def digest(arrays: dict[str, np.ndarray]) -> str:
    sha = hashlib.sha256()
    for name in sorted(arrays):
        sha.update(name.encode())
        sha.update(arrays[name].tobytes())
    return sha.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "ft"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--dtype", choices=sorted(POLICIES), default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ft = args.mode == "ft"

    dist.init_process_group("gloo")
    if ft:                                                   # the swap
        from ft_launch import FtOptimizer, ft_init_device_mesh, ft_manager
        make_mesh = ft_init_device_mesh
    else:
        make_mesh = init_device_mesh
    mesh = make_mesh("cpu", (args.replicas, args.shards), mesh_dim_names=("replicate", "shard"))
    replica, replicas = mesh.get_local_rank("replicate"), mesh["replicate"].size()
    shard, shards = mesh.get_local_rank("shard"), mesh["shard"].size()
    corpus = Corpus(context=SIZE["context"], n_sentences=2000)
    batch = StepBatches(corpus, replica * shards + shard, replicas * shards, args.global_batch)

    torch.manual_seed(0)
    model = Gpt(GptConfig(vocab_size=corpus.vocab_size, **SIZE))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=POLICIES[args.dtype])
    fully_shard(model, mesh=mesh, mp_policy=POLICIES[args.dtype])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    inner = optimizer
    digests: dict[int, str] = {}
    name = f"{args.mode}-r{replica}-k{shard}"

    if not ft:
        for step in range(args.steps):
            model(*batch(step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            digests[step] = digest(local_state(model, inner))
    else:
        manager = ft_manager(model, optimizer, batch_size=args.global_batch // replicas)
        optimizer = FtOptimizer(manager)
        with manager:
            while manager.next_step < end_step_at(manager.identity.run_dir, args.steps):
                model(*batch(manager.next_step)).backward()
                if optimizer.step():    # committed: trained, or caught up to a later step
                    digests[manager.next_step - 1] = digest(local_state(model, inner))
                optimizer.zero_grad()
    state = local_state(model, inner)
    np.savez(args.out / f"{name}.npz", **state)
    (args.out / f"{name}.json").write_text(json.dumps(
        {"steps": {str(s): d for s, d in sorted(digests.items())}, "final": digest(state)}))
    # The final model as one file, from one replica (every rank of it gathers; under
    # ft-launch each replica's rank 0 is a rank 0: the replicate index picks one).
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if replica == 0 and shard == 0:
        np.savez(args.out / f"{args.mode}-full.npz",
                 **{key: value.float().numpy() for key, value in full.items()})
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
