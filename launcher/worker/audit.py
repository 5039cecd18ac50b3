"""What a run committed: the per-replica audit logs, written by each replica's rank 0
(``AuditLog``) and read back and checked (pure over files).

Each replica's rank 0 appends one line per committed step: the step, the data
positions of every replica before it, how many samples of each replica it used,
and the history of the state it trained (``worker.rollbacks``: the rollbacks it has
been through). Replicas that committed the same step in one history must agree;
together the lines must show every replica's stream consumed gaplessly from 0,
without overlap.

A rollback (``ft_launch.launcher.controller.rollback``) is in the audit too: the first
process of each replica in history ``n`` appends ``{"rollback": n, "before_step": K,
"restored_step": S}``, the spiking step and the state it restarted from. The history
that follows supersedes the steps it trained again: if history ``n`` commits its
first step ``F``, every line of an older history for a step ``F`` or later is rolled
back. The check is exact about it: every history has its rollback lines, all
agreeing on ``K``; each replica restarted from before ``K``; ``K`` had been
committed; and ``F - 1`` is no newer than the newest restored state (history ``n``
went on from a state from before the spike, not from one that a stale process
handed it).

A restore is in the audit too: every process of a replica appends ``{"restored": S,
"history": n}`` as it starts, S the state it restored (-1: none; not written at the
replica's first start). A rewind needs it. When every replica is lost at once no
live state is left; the first replacements restore the newest saved state S and
train step S + 1 on again with whichever replicas have started by then, so not
necessarily as the first time; a later one catches up from them. Then two branches
of one history committed the steps after S, and the run went on from one of them:
the lineage of the last step, followed back step by step through the data positions
(each step's positions before it plus its counts are the next step's positions
before it). The lines off it are superseded, and the check is exact about them as
well: each branch left must start just after a state that some replica restored. In
the history left, every sample is trained exactly once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_launch.errors import FatalError


class AuditError(FatalError):
    """The audit shows a skipped, repeated or disputed sample."""


@dataclass(frozen=True)
class AuditSummary:
    steps: int
    positions: tuple[int, ...]     # samples consumed per replica
    samples: int
    rollbacks: int = 0
    rolled_back: int = 0           # step lines superseded by a later history or branch


class AuditLog:
    """One replica's audit file (its rank 0 writes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def step(self, step: int, quorum_id: int, positions_before: list[int],
             counts: list[int], history: int) -> None:
        self._append({"step": step, "quorum_id": quorum_id, "time": time.time(),
                      "positions_before": positions_before, "counts": counts,
                      "history": history})

    def restored(self, step: int, history: int) -> None:
        """This process starts from the state of ``step`` (-1: from nothing). Not at the
        replica's first start, which has nothing to explain (and a dispute at step 0
        would be taken for a rewind)."""
        if step < 0 and not self.path.exists():
            return
        self._append({"restored": step, "history": history, "time": time.time()})

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


@dataclass(frozen=True)
class _Read:
    steps: list[_StepLine]
    rollbacks: list[_Rollback]
    restored: set[int]          # every state some process restored (-1: none)


def _read(run_dir: Path) -> _Read:
    steps: list[_StepLine] = []
    rollbacks: list[_Rollback] = []
    restored: set[int] = set()
    for path in sorted((run_dir / "audit").glob("replica-*.jsonl")):
        for record in _parse(path.read_text(encoding="utf-8"), path.name):
            try:
                if "restored" in record:
                    restored.add(int(record["restored"]))
                    continue
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
    return _Read(steps, rollbacks, restored)


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


def _history_left(lines: list[_StepLine], first: dict[int, int], restored: set[int]
                  ) -> tuple[dict[int, dict[str, list[int]]], int]:
    """The committed steps that no later history superseded and that the run went on
    from, by step; and how many lines were superseded."""
    kept = [line for line in lines
            if not any(history > line.history and line.step >= start
                       for history, start in first.items())]
    superseded = len(lines) - len(kept)
    by_step: dict[int, list[_StepLine]] = {}
    for line in kept:
        by_step.setdefault(line.step, []).append(line)
    lineage = _lineage(by_step)
    branch: list[_StepLine] = []            # the lines off the lineage, step by step
    for step in sorted(by_step):
        off = [line for line in by_step[step] if line.entry != lineage[step].entry]
        if off and not branch and step - 1 not in restored:
            raise AuditError(f"replicas disagree on step {step}: {_where(lineage[step])} vs "
                             f"{_where(off[0])}, and no replica restored step {step - 1}",
                             step=step)
        branch = off
        superseded += len(off)
    return {step: line.entry for step, line in lineage.items()}, superseded


def _lineage(by_step: dict[int, list[_StepLine]]) -> dict[int, _StepLine]:
    """A line of each step that the last step goes on from, followed back through the
    data positions; where the steps are not in one run the gap is left to the check."""
    lineage: dict[int, _StepLine] = {}
    after: _StepLine | None = None
    for step in sorted(by_step, reverse=True):
        entries = {json.dumps(line.entry, sort_keys=True): line for line in by_step[step]}
        if after is not None and after.step == step + 1 and len(entries) > 1:
            goes_on = {key: line for key, line in entries.items()
                       if _end(line) == after.entry["positions_before"]}
            entries = goes_on or entries
        if len(entries) > 1:
            lines = sorted(entries.values(), key=lambda line: line.source)
            raise AuditError(f"replicas disagree on step {step}: {_where(lines[0])} vs "
                             f"{_where(lines[1])}", step=step)
        lineage[step] = after = next(iter(entries.values()))
    return lineage


def _end(line: _StepLine) -> list[int]:
    return [p + c for p, c in zip(line.entry["positions_before"], line.entry["counts"],
                                  strict=False)]


def _where(line: _StepLine) -> str:
    return f"{line.entry} ({line.source}, history {line.history})"


def _history(run_dir: Path) -> tuple[dict[int, dict[str, list[int]]], int, int]:
    """The history left (``_history_left``), how many lines it superseded, and how many
    rollbacks it went through."""
    found = _read(run_dir)
    first = _first_steps(found.steps, found.rollbacks)
    records, superseded = _history_left(found.steps, first, found.restored)
    return records, superseded, len(first)


def audit_records(run_dir: Path) -> dict[int, dict[str, list[int]]]:
    """Committed steps from every replica's audit log, merged by step, without the
    ones a rollback or a rewind superseded."""
    return _history(run_dir)[0]


def check_exactly_once(run_dir: Path, replicas: int, steps: int | None = None) -> AuditSummary:
    """Raise ``AuditError`` unless steps 0..N-1 are all committed and every replica's
    samples were consumed as one run from 0 with nothing skipped or repeated, in the
    history left after the rollbacks and rewinds (each checked: module doc)."""
    records, superseded, rollbacks = _history(run_dir)
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
    return AuditSummary(len(expected), tuple(positions), sum(positions), rollbacks,
                        superseded)
