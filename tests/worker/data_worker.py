"""Test plumbing for ``test_data.py``: a user's loop that reads a map-style dataset
through ``FtDataLoader`` (one worker process, read-ahead), a plain model, started by
``LocalJob`` as one rank of a replica.

Before each ``optimizer.step()`` it appends to ``<out>/r<replica>.jsonl`` what it is
about to commit: the step and its kind (the quorum's plan), the position the batch
was taken at, and the dataset indices it trained. Written before the commit, so a
replica killed right after it has the line too; a step discarded and trained again
has a later line. At the end ``<out>/r<replica>-final.json`` holds the positions and
the loader's rewinds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from ft_launch import FtDataLoader, FtOptimizer, configure_logging, ft_manager
from ft_launch.env import ENV_NUM_REPLICAS

FEATURES = 4


class Samples(torch.utils.data.Dataset):
    """Sample ``i``: its index, and features drawn from ``i`` alone."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, torch.randn(FEATURES, generator=torch.Generator().manual_seed(index))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--samples", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    configure_logging("INFO")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    replicas = int(os.environ[ENV_NUM_REPLICAS])
    manager = ft_manager(model, torch.optim.SGD(model.parameters(), lr=0.01),
                         batch_size=args.global_batch_size // replicas)
    loader = FtDataLoader(Samples(args.samples), manager,
                          global_batch_size=args.global_batch_size, shuffle=True,
                          seed=args.seed, num_workers=1, persistent_workers=True)
    manager.register_state("data", loader)
    optimizer = FtOptimizer(manager)
    me = manager.identity
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        batches = iter(loader)
        with (args.out / f"r{me.replica_id}.jsonl").open("a") as trained:
            while manager.next_step < args.steps:
                optimizer.zero_grad()
                position = manager.data_position
                ids, features = next(batches)
                model(features).pow(2).mean().backward()
                plan = manager.plan
                trained.write(json.dumps({"step": plan.step, "kind": plan.kind.value,
                                          "position": position, "ids": ids.tolist()}) + "\n")
                trained.flush()
                optimizer.step()
        final = {"positions": manager.positions, "rewinds": loader.rewinds}
        (args.out / f"r{me.replica_id}-final.json").write_text(json.dumps(final))
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
