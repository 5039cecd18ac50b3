"""Reading back what a run committed: the per-replica audit logs (pure over files).

Each replica's rank 0 appends one line per committed step: the step, the data
positions of every replica before it, and how many samples of each replica it
used. Replicas that committed the same step must agree; together the lines must
show every replica's stream consumed gaplessly from 0, without overlap.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ftcore.errors import FatalError


class AuditError(FatalError):
    """The audit shows a skipped, repeated or disputed sample."""


@dataclass(frozen=True)
class AuditSummary:
    steps: int
    positions: tuple[int, ...]     # samples consumed per replica
    samples: int


def audit_records(run_dir: Path) -> dict[int, dict[str, list[int]]]:
    """Committed steps from every replica's audit log, merged by step."""
    merged: dict[int, dict[str, list[int]]] = {}
    for path in sorted((run_dir / "audit").glob("replica-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            record = json.loads(line)
            entry = {"positions_before": record["positions_before"], "counts": record["counts"]}
            previous = merged.setdefault(record["step"], entry)
            if previous != entry:
                raise AuditError(f"replicas disagree on step {record['step']}: {previous} vs "
                                 f"{entry} ({path.name})", step=record["step"])
    return merged


def check_exactly_once(run_dir: Path, replicas: int, steps: int | None = None) -> AuditSummary:
    """Raise ``AuditError`` unless steps 0..N-1 are all committed and every replica's
    samples were consumed as one run from 0 with nothing skipped or repeated."""
    records = audit_records(run_dir)
    expected = list(range(steps if steps is not None else len(records)))
    if sorted(records) != expected:
        missing = sorted(set(expected) - set(records))
        raise AuditError(f"committed steps are not 0..{len(expected) - 1}: missing {missing[:10]}"
                         f", extra {sorted(set(records) - set(expected))[:10]}")
    positions = [0] * replicas
    for step in expected:
        record = records[step]
        if record["positions_before"] != positions:
            raise AuditError(f"step {step} starts at positions {record['positions_before']}, "
                             f"but the steps before it end at {positions}: samples skipped "
                             "or trained twice", step=step)
        for replica, count in enumerate(record["counts"]):
            positions[replica] += count
    return AuditSummary(len(expected), tuple(positions), sum(positions))
