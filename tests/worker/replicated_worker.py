"""Test plumbing: the example GPT trained data-parallel by R processes, one per
replica, natively or under ft-launch, optionally with a ``GradScaler``.

``--mode native``: one torch world of R processes, a DDP model over all of them
(started by the test with RANK and WORLD_SIZE). ``--mode ft``: R replicas of one
rank each (started by ``LocalJob``), the model a DDP of the replica's one rank or
plain (``--parallel``), averaged across replicas by ft-launch. At step i the process
of replica r trains on ``replica_sample_ids(r, R, i * batch, batch)`` either way.
Each process writes ``<out>/<mode>-r<replica>.json``: a sha256 of its model,
optimizer and scaler state, the scale after each step, and the samples consumed."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "etc" / "examples" / "gpt"))

from corpus import Corpus, replica_sample_ids
from model import Gpt, GptConfig

SIZE = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32}
BATCH = 8


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scaler: torch.amp.GradScaler | None) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for param_id, values in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(values.items()):
            digest.update(f"{param_id}/{key}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    if scaler is not None:
        digest.update(json.dumps(scaler.state_dict(), sort_keys=True).encode())
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("native", "ft"), required=True)
    parser.add_argument("--parallel", choices=("ddp", "none"), default="ddp")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--init-scale", type=float, default=0.0,
                        help="a GradScaler with this initial scale (0: none)")
    parser.add_argument("--autocast", action="store_true",
                        help="forward and backward under autocast to float16 (parameters "
                             "and gradients stay float32): large scales overflow there")
    parser.add_argument("--accumulate", type=int, default=1,
                        help="micro-batches of the batch per step, the gradients of all but "
                             "the last accumulated under DDP's no_sync()")
    parser.add_argument("--bucket-cap-mb", default="25",
                        help="DDP's bucket_cap_mb, one per replica (comma separated) or one")
    parser.add_argument("--seed-apart", action="store_true",
                        help="each process seeds its model with its own seed (seed + RANK, "
                             "natively; seed + replica under ft-launch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "native":
        replica, replicas = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        from ft_launch.launcher.worker.identity import WorkerIdentity

        me = WorkerIdentity.from_env()
        replica, replicas = me.replica_id, me.num_replicas
    torch.manual_seed(0)
    corpus = Corpus(context=SIZE["context"], n_sentences=2000)
    torch.manual_seed(1000 + replica if args.seed_apart else 0)
    model = Gpt(GptConfig(vocab_size=corpus.vocab_size, **SIZE))
    scaler = (torch.amp.GradScaler("cpu", init_scale=args.init_scale) if args.init_scale
              else None)
    caps = [float(c) for c in args.bucket_cap_mb.split(",")]
    if args.parallel == "ddp":
        dist.init_process_group("gloo")
        model = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=caps[replica % len(caps)])
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2,
                                                         foreach=False)
    scales: list[float] = []

    batch = BATCH * args.accumulate

    def train_step(position: int) -> bool:
        ids = replica_sample_ids(replica, replicas, position, batch)
        optimizer.zero_grad()
        for k in range(args.accumulate):
            tokens, targets = (torch.from_numpy(a)
                               for a in corpus.batch(ids[k * BATCH:(k + 1) * BATCH]))
            last = k == args.accumulate - 1
            with (contextlib.nullcontext() if last or args.parallel != "ddp"
                  else model.no_sync()):
                with torch.autocast("cpu", dtype=torch.float16, enabled=args.autocast):
                    loss = model(tokens, targets) / args.accumulate
                (loss if scaler is None else scaler.scale(loss)).backward()
        if scaler is None:
            return bool(optimizer.step()) or args.mode == "native"
        stepped = scaler.step(optimizer)
        scaler.update()
        return bool(stepped) or args.mode == "native"

    if args.mode == "native":
        for step in range(args.steps):
            train_step(step * batch)
            scales.append(scaler.get_scale() if scaler is not None else 1.0)
        positions = [args.steps * batch] * replicas
        inner = optimizer
    else:
        from ft_launch import FtOptimizer, ft_manager

        manager = ft_manager(model, optimizer, batch_size=batch)
        optimizer = FtOptimizer(manager)
        inner = optimizer.optimizer
        if scaler is not None:
            manager.register_state("scaler", scaler)
        try:
            while manager.next_step < args.steps:
                if train_step(manager.data_position):
                    scales.append(scaler.get_scale() if scaler is not None else 1.0)
            positions = manager.positions
        finally:
            manager.close()
    plain = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    record = {"state_sha256": state_hash(plain, inner, scaler), "scales": scales,
              "positions": positions}
    (args.out / f"{args.mode}-r{replica}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
