"""Worker side shared by the native-HSDP and torchft arms: the example GPT built
as ``etc/examples/gpt/train.py`` builds it (same seed, corpus, sample streams,
AdamW), sharded with FSDP2, and one training loop that records when each step
ended. The ft-launch arms run ``train.py`` itself; these arms must match it."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "etc" / "examples" / "gpt"))

from corpus import Corpus, replica_sample_ids
from model import Gpt, GptConfig

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of one run is told (JSON on the command line)."""

    size: dict[str, int]          # GptConfig fields other than vocab_size
    steps: int
    batch_size: int               # one replica's batch, all its ranks together
    lr: float
    seed: int
    threads: int
    param_dtype: str
    reduce_dtype: str
    replicas: int
    ranks: int
    out_dir: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


def worker_args(description: str, argv: list[str] | None = None) -> argparse.Namespace:
    """``--spec`` (the run's WorkerSpec as JSON), ``--rank`` (this process in the
    arm's numbering), ``--rendezvous`` (a path private to the run)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True, type=WorkerSpec.from_json)
    parser.add_argument("--rank", required=True, type=int)
    parser.add_argument("--rendezvous", required=True, type=Path)
    parser.add_argument("--lighthouse", default="", help="torchft arm: the lighthouse address")
    return parser.parse_args(argv)


def build(spec: WorkerSpec) -> tuple[Gpt, Corpus]:
    """The model every replica starts from (same seed: same weights) and the corpus."""
    if spec.threads:
        torch.set_num_threads(spec.threads)
    torch.manual_seed(spec.seed)
    corpus = Corpus(context=spec.size["context"])
    return Gpt(GptConfig(vocab_size=corpus.vocab_size, **spec.size)), corpus


def loss_through_call() -> bool:
    """Whether ``Gpt.forward`` computes the loss itself (``model(tokens, targets)``,
    through ``__call__``: FSDP's root hooks run); an older ``Gpt.loss`` called
    ``forward`` directly and needs ``register_fsdp_forward_method``."""
    return "targets" in inspect.signature(Gpt.forward).parameters


def shard(model: Gpt, mesh: Any, spec: WorkerSpec) -> None:
    """FSDP2 per transformer block, then the root, as train.py shards it."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[spec.param_dtype],
                                  reduce_dtype=DTYPES[spec.reduce_dtype])
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if not loss_through_call():
        register_fsdp_forward_method(model, "loss")


def step_loss(model: Gpt, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(tokens, targets) if loss_through_call() else model.loss(tokens, targets)


def adamw(model: torch.nn.Module, spec: WorkerSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=spec.lr, foreach=False)


def local_numel(model: torch.nn.Module) -> int:
    """Elements of this rank's parameter shards (= its gradient shards)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel()
    return total


def train(model: Gpt, optimizer: torch.optim.Optimizer, corpus: Corpus, spec: WorkerSpec,
          replica_id: int, rank: int) -> tuple[list[float], list[float]]:
    """``spec.steps`` steps on this rank's part of its replica's stream; returns the
    wall-clock time each step ended (after the optimizer step) and the local losses.
    A wrapped optimizer (torchft's) starts its quorum in ``zero_grad`` and votes in
    ``step``, so the same loop serves both arms."""
    ended: list[float] = []
    losses: list[float] = []
    for step in range(spec.steps):
        optimizer.zero_grad()
        ids = replica_sample_ids(replica_id, spec.replicas, step * spec.batch_size,
                                 spec.batch_size, rank, spec.ranks)
        tokens, targets = (torch.from_numpy(a) for a in corpus.batch(ids))
        loss = step_loss(model, tokens, targets)
        loss.backward()
        optimizer.step()
        ended.append(time.time())
        losses.append(float(loss.detach().float().item()))
    return ended, losses


def write_result(spec: WorkerSpec, replica_id: int, rank: int, ended: Iterable[float],
                 losses: Iterable[float], model: torch.nn.Module, **extra: Any) -> None:
    record = {"replica_id": replica_id, "rank": rank, "step_ended": list(ended),
              "losses": list(losses), "local_numel": local_numel(model),
              "params": sum(p.numel() for p in model.parameters()), **extra}
    out = Path(spec.out_dir) / f"replica-{replica_id}-rank-{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out)
