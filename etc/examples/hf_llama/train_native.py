"""A Hugging Face ``transformers`` causal LM trained with native HSDP: a small
``LlamaForCausalLM`` built from a ``LlamaConfig`` (no download), a 2-D
``("replicate", "shard")`` device mesh, FSDP2 (``fully_shard``) on each decoder
layer and the root in bf16 mixed precision, AdamW, ``transformers``' warmup + cosine
schedule, gradient accumulation and clipping, on the token file the token example
writes (``etc/examples/tokens/prepare.py DATA``). At the end rank 0 saves the
training state (``--out``/``state.pt``: full model and optimizer state dicts,
scheduler, step) and the model as ``save_pretrained`` writes it (``--out``/``model``).

Mixed precision as the Llama recipes of native HSDP (torchtitan's defaults):
parameters all-gathered and computed in bf16, gradients reduced in fp32, the
sharded parameters and AdamW's state fp32.

``train_native.py`` is native torch (``torchrun --nproc-per-node R*S train_native.py
DATA --replicate R --shard S``); ``train.py`` is the same script adopted for
ft-launch (``ft-launch local --replicas R --tasks-per-node S -- python train.py DATA
--replicate R --shard S``): each replica is a torch world of its own, the replicas
average their gradients with FTAR, a replica that fails catches up from the others,
and every replica's rank 0 saves its training state; replica 0 saves the model. The
README shows the difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup


class TokenWindows(Dataset):
    """Sample ``i``: tokens ``[i * T, (i + 1) * T)`` of a uint16 token file as
    ``input_ids`` and ``labels`` (the model shifts them; the file is memory-mapped)."""

    def __init__(self, path: Path, context: int) -> None:
        self.path, self.context = path, context
        self.count = path.stat().st_size // 2 // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = torch.from_numpy(tokens[i * self.context:(i + 1) * self.context]
                                  .astype(np.int64))
        return {"input_ids": window, "labels": window}


def epochs(loader: DataLoader, sampler: DistributedSampler):
    """The loader's batches, epoch after epoch (each epoch shuffled anew)."""
    for epoch in range(1_000_000):
        sampler.set_epoch(epoch)
        yield from loader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data", type=Path, help="directory of the token example's prepare.py")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas (mesh dim 0)")
    parser.add_argument("--shard", type=int, default=1, help="ranks a replica shards over")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh(
        "cpu", (args.replicate, args.shard), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(args.seed)
    meta = json.loads((args.data / "meta.json").read_text())
    config = LlamaConfig(vocab_size=meta["vocab_size"], hidden_size=args.hidden,
                         intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.context, use_cache=False)
    model = LlamaForCausalLM(config)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if rank == 0:
        print(f"{sum(p.numel() for p in model.parameters())} parameters, mesh {mesh.shape}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup, args.steps)
    train = TokenWindows(args.data / "train.bin", args.context)
    micro = args.batch_size // (mesh.size() * args.accumulation)
    # HSDP's data-parallel rank is the torch rank: the mesh lays ranks out replica-major
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    stream = epochs(DataLoader(train, batch_size=micro, sampler=sampler, num_workers=1), sampler)
    step = 0
    while step < args.steps:
        for micro_step in range(args.accumulation):
            model.set_requires_gradient_sync(micro_step == args.accumulation - 1)
            loss = model(**next(stream)).loss / args.accumulation
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip).full_tensor()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item() * args.accumulation:.4f} norm {norm:.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    # Full state dicts, gathered by every rank, held by rank 0 (on the CPU).
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    state = {"model": weights, "scheduler": scheduler.state_dict(), "step": step,
             "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out / "state.pt")
        model.save_pretrained(args.out / "model", state_dict=weights)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
