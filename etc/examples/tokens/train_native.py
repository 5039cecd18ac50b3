"""A token-file GPT trainer in the style of the popular single-file trainers:
DDP, a memory-mapped token file (``prepare.py`` writes one), warmup + cosine
``LambdaLR``, gradient accumulation, clipping, periodic evaluation and its own
checkpoint (rank 0 saves ``--out``'s checkpoint every ``--ckpt-every`` steps and at
the end; ``--resume`` starts from it).

``train_native.py`` is native torch (``torchrun --nproc-per-node N train_native.py
DATA``); ``train.py`` is the same script adopted for ft-launch (``ft-launch local
-- python train.py DATA``, or ``ft-launch run`` under Slurm): each replica is a DDP
world of its own, the replicas average their gradients with FTAR, a replica that
fails catches up from the others, and rank 0 of each replica saves its own
checkpoint. The README shows the difference.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpt"))

from model import Gpt, GptConfig


class TokenWindows(Dataset):
    """Sample ``i``: tokens ``[i * T, (i + 1) * T]`` of a uint16 token file, as input
    and next-token target (the file is memory-mapped, never read whole)."""

    def __init__(self, path: Path, context: int) -> None:
        self.path, self.context = path, context
        self.count = (path.stat().st_size // 2 - 1) // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = np.memmap(self.path, dtype=np.uint16, mode="r")
        window = torch.from_numpy(tokens[i * self.context:(i + 1) * self.context + 1]
                                  .astype(np.int64))
        return window[:-1], window[1:]


def lr_lambda(warmup: int, steps: int, floor: float = 0.1):
    """Linear warmup, then cosine decay to ``floor`` of the peak."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def epochs(loader: DataLoader, sampler: DistributedSampler):
    """The loader's batches, epoch after epoch (each epoch shuffled anew)."""
    for epoch in range(1_000_000):
        sampler.set_epoch(epoch)
        yield from loader


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Dataset, batches: int, batch: int) -> float:
    model.eval()
    losses = [model(*(torch.stack(t) for t in zip(*(data[i * batch + j] for j in range(batch)))))
              for i in range(batches)]
    model.train()
    return float(torch.stack(losses).mean())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("data", type=Path, help="directory of prepare.py's files")
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--ckpt-every", type=int, default=100)
    parser.add_argument("--resume", action="store_true", help="start from OUT/ckpt.pt")
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seed", type=int, default=1337)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    meta = json.loads((args.data / "meta.json").read_text())
    config = GptConfig(vocab_size=meta["vocab_size"], context=args.context,
                       d_model=args.d_model, n_layers=args.layers, n_heads=4)
    model = DistributedDataParallel(Gpt(config))
    if rank == 0:
        print(f"{sum(p.numel() for p in model.parameters())} parameters, {world} rank(s)")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = LambdaLR(optimizer, lr_lambda(args.warmup, args.steps))
    train, val = (TokenWindows(args.data / f"{s}.bin", args.context) for s in ("train", "val"))
    micro = args.batch_size // (world * args.accumulation)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    stream = epochs(DataLoader(train, batch_size=micro, sampler=sampler, num_workers=1), sampler)
    ckpt = args.out / "ckpt.pt"

    def save() -> None:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "step": step}, ckpt)

    step = 0
    if args.resume:
        saved = torch.load(ckpt, weights_only=False)
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        step = saved["step"]
    loss = torch.zeros(())
    while step < args.steps:
        for micro_step in range(args.accumulation):
            model.require_backward_grad_sync = micro_step == args.accumulation - 1
            inputs, targets = next(stream)
            loss = model(inputs, targets) / args.accumulation
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if rank == 0 and step % args.eval_every == 0:
            print(f"step {step} train {loss.item() * args.accumulation:.4f} val "
                  f"{evaluate(model.module, val, 4, 8):.4f} norm {norm:.3f} "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if rank == 0 and step % args.ckpt_every == 0:
            save()
    if rank == 0:
        save()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
