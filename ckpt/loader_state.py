"""The loader position of a rank, written every step (small, atomic, durable).

Exactly-once data needs a restarted replica to resume its own stream where
its last committed step left it; the record is a few hundred bytes of JSON, so
writing it every step costs one small fsync.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftcore.config import CkptConfig
from ftcore.files import atomic_write_text

from .errors import CheckpointCorruptError, NoCheckpointError, storage_error

_DEFAULTS = CkptConfig()


@dataclass(frozen=True)
class LoaderRecord:
    """The loader ``state`` after the step ``step`` was committed."""

    step: int
    state: Mapping[str, Any] = field(default_factory=dict)


class LoaderStateStore:
    """``ROOT/loader/rank-RRRRR.json`` for one rank."""

    def __init__(self, root: str | os.PathLike[str], *, rank: int,
                 durable: bool = _DEFAULTS.durable) -> None:
        self.rank = rank
        self.durable = durable
        self.path = Path(root) / "loader" / f"rank-{rank:05d}.json"

    def write(self, step: int, state: Mapping[str, Any]) -> None:
        text = json.dumps({"step": step, "rank": self.rank, "state": dict(state)},
                          sort_keys=True)
        try:
            atomic_write_text(self.path, text, durable=self.durable)
        except OSError as exc:
            raise storage_error("write loader state", self.path, exc, rank=self.rank,
                                step=step) from None

    def read(self) -> LoaderRecord:
        try:
            record = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise NoCheckpointError("no loader state", reasons=(f"{self.path} missing",),
                                    rank=self.rank) from None
        except (OSError, ValueError) as exc:
            raise CheckpointCorruptError(f"loader state {self.path} unreadable: {exc}",
                                         rank=self.rank) from None
        if not isinstance(record, dict) or record.get("rank") != self.rank:
            raise CheckpointCorruptError(f"loader state {self.path} is not rank {self.rank}'s",
                                         rank=self.rank)
        return LoaderRecord(int(record["step"]), dict(record["state"]))
