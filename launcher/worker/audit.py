"""What a run committed: the per-replica audit logs, written by each replica's rank 0
(``AuditLog``) and read back and checked (pure over files).

Each replica's rank 0 appends one line per committed step: the step, the data
positions of every replica before it, how many samples of each replica it used,
and the history of the state it trained (``worker.rollbacks``: the rollbacks it has
been through). Replicas that committed the same step in one history must agree;
together the lines must show every replica's stream consumed gaplessly from 0,
without overlap.

A rollback (``launcher.rollback``) is in the audit too: the first process of each
replica in history ``n`` appends ``{"rollback": n, "before_step": K,
"restored_step": S}``, the spiking step and the state it restarted from. The history
that follows supersedes the steps it trained again: if history ``n`` commits its
first step ``F``, every line of an older history for a step ``F`` or later is rolled
back. The check is exact about it: every history has its rollback lines, all
agreeing on ``K``; each replica restarted from before ``K``; ``K`` had been
committed; and ``F - 1`` is no newer than the newest restored state (history ``n``
went on from a state from before the spike, not from one that a stale process
handed it). In the history left, every sample is trained exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftcore.errors import FatalError


class AuditError(FatalError):
    """The audit shows a skipped, repeated or disputed sample."""


@dataclass(frozen=True)
class AuditSummary:
    steps: int
    positions: tuple[int, ...]     # samples consumed per replica
    samples: int
    rollbacks: int = 0
    rolled_back: int = 0           # step lines superseded by a later history


class AuditLog:
    """One replica's audit file (its rank 0 writes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def step(self, step: int, quorum_id: int, positions_before: list[int],
             counts: list[int], history: int) -> None:
        self._append({"step": step, "quorum_id": quorum_id, "time": time.time(),
                      "positions_before": positions_before, "counts": counts,
                      "history": history})

    def rollback(self, history: int, before_step: int, restored_step: int) -> None:
        """This replica restarted in ``history`` from ``restored_step``; once per history
        (a later relaunch in the same history restores whatever is newest)."""
        if history in self._rollbacks():
            return
        self._append({"rollback": history, "before_step": before_step,
                      "restored_step": restored_step, "time": time.time()})

    def _rollbacks(self) -> set[int]:
        """The rollbacks recorded here. Lenient, unlike the check: a line torn by a
        killed writer must not stop the next incarnation from starting."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return set()
        found = set()
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "rollback" in record:
                found.add(record["rollback"])
        return found

    def _append(self, record: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def _parse(text: str, name: str) -> Iterable[dict[str, Any]]:
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise AuditError(f"{name} line {number} is not JSON: {error}") from None
        if not isinstance(record, dict):
            raise AuditError(f"{name} line {number} is not an object")
        yield record


@dataclass(frozen=True)
class _StepLine:
    step: int
    history: int
    entry: dict[str, list[int]]
    source: str


@dataclass(frozen=True)
class _Rollback:
    history: int
    before_step: int
    restored_step: int
    source: str


def _read(run_dir: Path) -> tuple[list[_StepLine], list[_Rollback]]:
    steps, rollbacks = [], []
    for path in sorted((run_dir / "audit").glob("replica-*.jsonl")):
        for record in _parse(path.read_text(encoding="utf-8"), path.name):
            try:
                if "rollback" in record:
                    rollbacks.append(_Rollback(int(record["rollback"]),
                                               int(record["before_step"]),
                                               int(record["restored_step"]), path.name))
                    continue
                steps.append(_StepLine(
                    int(record["step"]), int(record.get("history", 0)),
                    {"positions_before": record["positions_before"],
                     "counts": record["counts"]}, path.name))
            except (KeyError, TypeError, ValueError) as error:
                raise AuditError(f"{path.name}: a line lacks {error}: {record}") from None
    return steps, rollbacks


def _first_steps(lines: list[_StepLine], rollbacks: list[_Rollback]) -> dict[int, int]:
    """Each rollback's history checked against its lines; the first step it committed."""
    count = max((r.history for r in rollbacks), default=0)
    first: dict[int, int] = {}
    for history in range(1, count + 1):
        records = [r for r in rollbacks if r.history == history]
        if not records:
            raise AuditError(f"no line records rollback {history}, yet rollback {count} is")
        bounds = {r.before_step for r in records}
        if len(bounds) != 1:
            raise AuditError(f"rollback {history}: replicas name different spiking steps "
                             f"{sorted(bounds)}")
        (bound,) = bounds
        late = [r for r in records if r.restored_step >= bound]
        if late:
            raise AuditError(f"rollback {history} to before step {bound}: {late[0].source} "
                             f"restarted from step {late[0].restored_step}", step=bound)
        if not any(line.step == bound and line.history < history for line in lines):
            raise AuditError(f"rollback {history}: its spiking step {bound} was never "
                             "committed", step=bound)
        steps = [line.step for line in lines if line.history == history]
        newest = max(r.restored_step for r in records)
        if steps:
            first[history] = min(steps)
            if first[history] - 1 > newest:
                raise AuditError(f"history {history} starts at step {first[history]}, after "
                                 f"every restored state (newest {newest}): it went on from a "
                                 "state of the history it rolled back", step=first[history])
        else:
            first[history] = newest + 1
    stray = sorted({line.history for line in lines if not 0 <= line.history <= count})
    if stray:
        raise AuditError(f"lines of history {stray[0]}, which no rollback line records")
    return first


def _history_left(lines: list[_StepLine], first: dict[int, int]
                  ) -> tuple[dict[int, dict[str, list[int]]], int]:
    """The committed steps that no later history superseded, merged by step; and how
    many lines were superseded."""
    merged: dict[int, tuple[int, dict[str, list[int]], str]] = {}
    superseded = 0
    for line in lines:
        if any(history > line.history and line.step >= start
               for history, start in first.items()):
            superseded += 1
            continue
        previous = merged.setdefault(line.step, (line.history, line.entry, line.source))
        if previous[1] != line.entry:
            raise AuditError(f"replicas disagree on step {line.step}: {previous[1]} "
                             f"({previous[2]}, history {previous[0]}) vs {line.entry} "
                             f"({line.source}, history {line.history})", step=line.step)
    return {step: entry for step, (_, entry, _) in merged.items()}, superseded


def audit_records(run_dir: Path) -> dict[int, dict[str, list[int]]]:
    """Committed steps from every replica's audit log, merged by step, without the
    ones a rollback superseded."""
    lines, rollbacks = _read(run_dir)
    return _history_left(lines, _first_steps(lines, rollbacks))[0]


def check_exactly_once(run_dir: Path, replicas: int, steps: int | None = None) -> AuditSummary:
    """Raise ``AuditError`` unless steps 0..N-1 are all committed and every replica's
    samples were consumed as one run from 0 with nothing skipped or repeated, in the
    history left after the rollbacks (each checked: module doc)."""
    lines, rollbacks = _read(run_dir)
    first = _first_steps(lines, rollbacks)
    records, superseded = _history_left(lines, first)
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
    return AuditSummary(len(expected), tuple(positions), sum(positions), len(first),
                        superseded)
