"""Train the small GPT with ft-launch's fault-tolerant step protocol.

Run by ``ft-launch run`` (one process per rank of each replica; identity from the
environment), or by the loopback tests and ``benchmarks/fault_run.py``.
Prints one line per committed step; at the end writes
``<run_dir>/final/replica-<r>.json`` with the loss and a hash of the model and
optimizer state, so runs can be compared bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import Corpus, replica_sample_ids
from model import Gpt, GptConfig

from ckpt.resident import ResidentAdamW
from ftcore.logs import configure_logging
from launcher.worker.protocol import StepKind
from launcher.worker.torch_api import ft_manager

SIZES = {"tiny": {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32},
         "small": {"d_model": 64, "n_layers": 2, "n_heads": 4, "context": 64},
         "default": {"d_model": 192, "n_layers": 6, "n_heads": 6, "context": 64}}

log = logging.getLogger("train")


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().contiguous().numpy().tobytes())
    for param_id, values in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(values.items()):
            digest.update(f"{param_id}/{key}".encode())
            if isinstance(value, torch.Tensor):
                digest.update(value.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--optimizer", choices=("resident-adamw", "adamw"),
                        default="resident-adamw",
                        help="AdamW with its state in the snapshot buffers (default), or torch's")
    parser.add_argument("--code-tag", default="",
                        help="a label for this code version, kept in the final record")
    args = parser.parse_args()
    configure_logging("INFO")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)  # every replica starts from the same weights
    size = SIZES[args.size]
    corpus = Corpus(context=size["context"])
    model = Gpt(GptConfig(vocab_size=corpus.vocab_size, **size))
    # The same numbers either way; resident-adamw keeps its state in the snapshot
    # buffers, so a snapshot every step copies nothing big (ckpt/resident.py).
    optimizer = (ResidentAdamW(model.parameters(), lr=args.lr) if args.optimizer == "resident-adamw"
                 else torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False))
    manager = ft_manager(model, optimizer, batch_size=args.batch_size)
    me = manager.identity
    loss_value = float("nan")
    started = time.monotonic()
    try:
        while manager.next_step < args.steps:
            plan = manager.start_step()
            loss = None
            if plan.kind is StepKind.TRAIN:
                ids = replica_sample_ids(me.replica_id, me.num_replicas, manager.data_position,
                                         args.batch_size)[me.rank::me.ranks]
                tokens, targets = (torch.from_numpy(a) for a in corpus.batch(ids))
                loss = model.loss(tokens, targets)
                loss.backward()
            manager.allreduce_gradients()
            step_loss = loss.item() if loss is not None else None
            if manager.commit(loss=step_loss):
                if step_loss is not None:
                    loss_value = step_loss
                elapsed = time.monotonic() - started
                log.info("replica %d step %d loss %.4f quorum %d %s %.2f steps/s",
                         me.replica_id, plan.step, loss_value, plan.quorum_id,
                         plan.kind.value, (plan.step + 1) / max(elapsed, 1e-9))
        final = {"replica_id": me.replica_id, "step": manager.next_step - 1,
                 "loss": loss_value, "state_sha256": state_hash(model, optimizer),
                 "positions": manager.ledger.positions, "code_tag": args.code_tag}
        out = me.run_dir / "final" / f"replica-{me.replica_id}-rank-{me.rank}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(final))
    finally:
        manager.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
