"""A small training script for the lifecycle tests (``test_manager_lifecycle.py``):
a plain linear model, one rank per replica, ended in one of the ways a user's
script ends.

``--end``:

* ``with``: ``with ft_manager(...) as manager:`` around the loop, no ``close()``;
* ``bare``: neither ``with`` nor ``close()`` (the interpreter's exit must close it);
* ``raise``: the ``with`` block raises ``RuntimeError("boom at step N")`` at
  ``--raise-at``;
* ``close``: ``try: ... finally: manager.close()``, as the example does.
"""

from __future__ import annotations

import argparse
import sys

import torch

from ft_launch import FtOptimizer, configure_logging, ft_manager

FEATURES = 8
BATCH = 4


def batch(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The replica's samples from ``position`` on: the same at every replica and rank."""
    generator = torch.Generator().manual_seed(position)
    inputs = torch.randn(BATCH, FEATURES, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True)


def train(manager, model: torch.nn.Module, optimizer: FtOptimizer, steps: int,
          raise_at: int) -> None:
    while manager.next_step < steps:
        optimizer.zero_grad()
        if manager.next_step == raise_at:
            raise RuntimeError(f"boom at step {raise_at}")
        inputs, targets = batch(manager.data_position)
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        if optimizer.step(loss=loss.item()):
            print(f"step {manager.plan.step} committed", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--end", choices=("with", "bare", "raise", "close"), default="with")
    parser.add_argument("--raise-at", type=int, default=-1)
    parser.add_argument("--parallel", choices=("none", "ddp"), default="none")
    parser.add_argument("--width", type=int, default=16, help="hidden units")
    args = parser.parse_args()
    configure_logging("INFO")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 1))
    if args.parallel == "ddp":     # the replica's torch world, from RANK, WORLD_SIZE, ...
        torch.distributed.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(model)
    inner = torch.optim.SGD(model.parameters(), lr=1e-4)
    if args.end in ("with", "raise"):
        with ft_manager(model, inner, batch_size=BATCH) as manager:
            train(manager, model, FtOptimizer(manager), args.steps, args.raise_at)
    elif args.end == "bare":
        manager = ft_manager(model, inner, batch_size=BATCH)
        train(manager, model, FtOptimizer(manager), args.steps, args.raise_at)
    else:
        manager = ft_manager(model, inner, batch_size=BATCH)
        try:
            train(manager, model, FtOptimizer(manager), args.steps, args.raise_at)
        finally:
            manager.close()
    if args.parallel == "ddp":     # as nanoGPT ends, say
        torch.distributed.destroy_process_group()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
