"""Where a run stands: each replica's state, step and speed, the standby pool and
the latest events, each event in a short form a person reads at a glance.

``run_status`` is pure (events in, a ``RunStatus`` out); ``StatusReader`` feeds it
from a run directory as the logs grow; ``status_text`` is the plain form
(``ft-launch status`` when stdout is not a terminal, and tests); ``live`` draws
the same in a terminal, in place.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ft_launch.events import Event, NodeDrained, RunStarted
from ft_launch.launcher.worker.events import StepCommitted
from ft_launch.slurm.hostlist import compress

from ..controller.diagnosis import HangDiagnosisReported
from ..controller.events import (
    ActionTaken,
    ControllerWitnessChosen,
    FullRestartOrdered,
    LossSpiked,
    NodeDrainRequested,
    NodeFaultDetected,
    ReplicaExited,
    ReplicaLaunched,
    RunFinished,
    SdcReplayOrdered,
    SdcReplayReported,
    StandbyPromoted,
)
from ..controller.versions import CodeRolledBack, CodeUpdateRequested, CodeVersionApplied
from .runlog import RunTail
from .timeline import BandState, replica_state

RATE_WINDOW = 10.0      # seconds of commits that steps/s is measured over
KEPT_COMMITS = 512      # per replica: all that the rate and the state need
SHOWN_DIAGNOSES = 3     # the latest hang diagnoses the status lists
COMMAND_WIDTH = 40      # characters of a training command shown in an event


@dataclass(frozen=True)
class ReplicaProgress:
    replica_id: int
    nodes: tuple[str, ...]          # of its latest launch; () before the log says
    how: str                        # how it was launched: initial, promoted, retry, ...
    state: BandState
    step: int | None                # its last committed step
    contributors: int | None        # replicas that contributed to that step
    steps_per_s: float


@dataclass(frozen=True)
class StandbyPool:
    warm: tuple[str, ...]           # ready and not promoted
    promoted: tuple[str, ...]


@dataclass(frozen=True)
class RunStatus:
    run_dir: Path
    started: float | None           # RunStarted's time
    now: float                      # the time the rates are measured at
    replicas: tuple[ReplicaProgress, ...]
    standby: StandbyPool
    recent: tuple[Event, ...]       # the latest controller events, oldest first
    finished: RunFinished | None
    #: the latest hang diagnoses, oldest first (they stay listed after ``recent`` moved on)
    diagnoses: tuple[HangDiagnosisReported, ...] = ()
    #: the latest dual-phase replays' verdicts, oldest first (listed like the diagnoses)
    replays: tuple[SdcReplayReported, ...] = ()
    #: whether the controller votes as witness 0 (None: the log does not say)
    witness: ControllerWitnessChosen | None = None

    @property
    def leading_step(self) -> int:
        return max((r.step for r in self.replicas if r.step is not None), default=0)


# --------------------------------------------------------------------------- pure


def run_status(run_dir: Path, control: Sequence[Event],
               committed: Mapping[int, Sequence[StepCommitted]], standby: StandbyPool,
               now: float, recent: int = 8) -> RunStatus:
    """The status at ``now`` (a finished run: at its end) from the controller log and
    rank 0's commits (the latest ``KEPT_COMMITS`` per replica are enough)."""
    finished = next((e for e in reversed(control)
                     if isinstance(e, RunFinished)), None)
    now = min(now, finished.time) if finished is not None else now
    launches: dict[int, ReplicaLaunched] = {}
    states: dict[int, BandState] = {}
    versions_seen: dict[int, int] = {}
    found = sorted([*control, *(e for es in committed.values() for e in es)],
                   key=lambda e: e.time)
    for event in found:
        replica_id = getattr(event, "replica_id", None)
        if replica_id is None:
            continue
        if isinstance(event, ReplicaLaunched):
            launches[replica_id] = event
        state, _ = replica_state(event, versions_seen)
        if state is not None:
            states[replica_id] = state
    rows = []
    for replica_id in sorted(set(launches) | set(committed)):
        launch = launches.get(replica_id)
        last = committed[replica_id][-1] if committed.get(replica_id) else None
        rows.append(ReplicaProgress(
            replica_id, tuple(launch.nodes) if launch else (), launch.how if launch else "?",
            states.get(replica_id, BandState.STARTING), last.step if last else None,
            last.contributors if last else None,
            steps_per_s(committed.get(replica_id, ()), now)))
    started = next((e.time for e in control if isinstance(e, RunStarted)), None)
    diagnoses = [e for e in control if isinstance(e, HangDiagnosisReported)]
    replays = [e for e in control if isinstance(e, SdcReplayReported)]
    witness = next((e for e in reversed(control) if isinstance(e, ControllerWitnessChosen)),
                   None)
    return RunStatus(run_dir, started, now, tuple(rows), standby,
                     tuple(control[-recent:]) if recent > 0 else (), finished,
                     tuple(diagnoses[-SHOWN_DIAGNOSES:]), tuple(replays[-SHOWN_DIAGNOSES:]),
                     witness)


def steps_per_s(commits: Sequence[StepCommitted], now: float,
                window: float = RATE_WINDOW) -> float:
    """Steps committed per second over the ``window`` before ``now``: it falls to 0 while
    a replica stops committing, rather than keeping its last speed."""
    inside = [e for e in commits if now - window <= e.time <= now]
    if len(inside) < 2 or now <= inside[0].time:
        return 0.0
    return (inside[-1].step - inside[0].step) / (now - inside[0].time)


def describe_event(event: Event) -> str:
    """One event in a few words: ids, nodes as a hostlist, commands shortened."""
    match event:
        case RunStarted():
            return f"run started: job {event.job_id}, {event.replicas} replicas on " \
                   f"{_nodes(event.nodes)}"
        case ReplicaLaunched():
            return f"replica {event.replica_id} launched on {_nodes(event.nodes)} ({event.how})"
        case ReplicaExited():
            return f"replica {event.replica_id} exited {event.exit_code}"
        case NodeFaultDetected():
            whose = f" (replica {event.replica_id})" if event.replica_id is not None else ""
            return f"node {event.node} failed{whose}: {event.reason}"
        case StandbyPromoted():
            return f"standby {event.node} promoted to replica {event.replica_id}"
        case NodeDrainRequested():
            return f"node {event.node} drain requested: {event.reason}"
        case NodeDrained():
            return f"node {event.node} drained"
        case FullRestartOrdered():
            return "full restart: " + ", ".join(f"replica {r} on {_nodes(nodes)}"
                                                for r, nodes in sorted(event.placements.items()))
        case RunFinished():
            return f"run finished, exit {event.exit_code}: {event.reason}"
        case ControllerWitnessChosen():
            return f"controller witness: {witness_text(event)}"
        case ActionTaken():
            subject = " ".join(part for part in (
                f"replica {event.replica_id}" if event.replica_id is not None else "",
                f"node {event.node}" if event.node else "") if part)
            return f"decided {event.action}{' ' + subject if subject else ''}: " \
                   f"{event.reason}"
        case CodeVersionApplied():
            return f"replica {event.replica_id} runs code v{event.version} " \
                   f"({short_command(event.command)}, {event.digest[:8]})"
        case CodeUpdateRequested():
            outcome = f"ignored, {event.ignored}" if event.ignored else \
                f"v{event.version}{' urgent' if event.urgent else ''}"
            return f"update {event.request} requested: {outcome}"
        case CodeRolledBack():
            return f"replica {event.replica_id} rolled back v{event.from_version} -> " \
                   f"v{event.to_version}: {event.reason}"
        case LossSpiked():
            return f"loss spiked at step {event.step}: {event.loss:.4g} against " \
                   f"{event.baseline:.4g} -> {event.action}"
        case HangDiagnosisReported():
            return f"replica {event.replica_id} hung: {event.summary} -> evict " \
                   f"{_nodes(event.suspects)}"
        case SdcReplayOrdered():
            return f"replica {event.replica_id} replayed on {_nodes(event.suspects)} + " \
                   f"{_nodes(event.references)}: NaN/Inf in {event.steps} steps"
        case SdcReplayReported():
            found = f"{_nodes(event.suspects)} computes NaN/Inf" \
                if event.status == "found" else f"{event.status}: {event.summary}"
            return f"replica {event.replica_id} replay {found} (step {event.step}, " \
                   f"{event.duration_s:.1f} s)"
    fields = {k: _short(value) for k, value in asdict(event).items() if k != "time"}
    return f"{type(event).__name__} " + " ".join(f"{k}={value}" for k, value in fields.items())


def witness_text(event: ControllerWitnessChosen) -> str:
    """``votes at 10.0.0.1`` or ``NOT voting (why)``."""
    return f"votes at {event.address}" if event.voting else f"NOT voting ({event.reason})"


def short_command(argv: Sequence[str], width: int = COMMAND_WIDTH) -> str:
    """A training command without its directories (``/usr/bin/python3 /x/train.py
    --steps 9`` reads ``python3 train.py --steps 9``), cut to ``width``."""
    text = " ".join(os.path.basename(arg) if "/" in arg and not arg.startswith("-")
                    else arg for arg in argv)
    return text if len(text) <= width else text[:width - 1] + "…"


def _short(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return short_command(value)
    return str(value)


def _nodes(nodes: Sequence[str]) -> str:
    return compress(list(nodes)) or "-"


def event_line(event: Event, started: float | None) -> str:
    """``+45.1s  node n3 failed (replica 1): ...``: the time from the run start."""
    at = f"+{event.time - started:.1f}s" if started is not None else time.strftime(
        "%H:%M:%S", time.localtime(event.time))
    return f"{at:>9}  {describe_event(event)}"


def status_text(status: RunStatus) -> str:
    """The plain status: a table of replicas, the standby pool, the latest events."""
    lines = [f"run {status.run_dir}"]
    lines.append("  replica  nodes        how        state     last step  steps/s  "
                 "contributors")
    for r in status.replicas:
        lines.append(f"  {r.replica_id:<7d}  {_nodes(r.nodes) if r.nodes else '?':<11s}  "
                     f"{r.how:<9s}  {r.state.value:<8s}  "
                     f"{r.step if r.step is not None else '-':>9}  {r.steps_per_s:7.2f}  "
                     f"{r.contributors if r.contributors is not None else '-':>12}")
    lines.append(f"  standby warm: {', '.join(status.standby.warm) or '-'}"
                 f"   promoted: {', '.join(status.standby.promoted) or '-'}")
    if status.witness is not None:
        lines.append(f"  controller witness: {witness_text(status.witness)}")
    if status.diagnoses:
        lines.append("hang diagnoses:")
        for report in status.diagnoses:
            lines.append(f"  {event_line(report, status.started)}")
            lines.append(f"  {'':>9}  report: {report.report or '(none written)'}")
    if status.replays:
        lines.append("sdc replays:")
        for verdict in status.replays:
            lines.append(f"  {event_line(verdict, status.started)}")
            lines.append(f"  {'':>9}  report: {verdict.report or '(none written)'}")
    lines.append("recent events:")
    lines += [f"  {event_line(e, status.started)}" for e in status.recent]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- shell


def read_standby(run_dir: Path) -> StandbyPool:
    """The pool from the standby agents' files: ``NODE.ready``, ``NODE.activate``."""
    ready = sorted(p.stem for p in (run_dir / "standby").glob("*.ready"))
    used = sorted(p.stem for p in (run_dir / "standby").glob("*.activate"))
    return StandbyPool(tuple(n for n in ready if n not in used), tuple(used))


class StatusReader:
    """``RunStatus`` of a run directory as its logs grow: each ``read`` parses only the
    lines added since the last one."""

    def __init__(self, run_dir: Path, recent: int = 8) -> None:
        self.run_dir = run_dir
        self.recent = recent
        self._tail = RunTail(run_dir)
        self._control: list[Event] = []
        self._commits: dict[int, deque[StepCommitted]] = {}

    def read(self, now: float) -> RunStatus:
        control, found = self._tail.read()
        self._control += control
        for replica_id, new in found.items():
            self._commits.setdefault(replica_id, deque(maxlen=KEPT_COMMITS)).extend(new)
        return run_status(self.run_dir, self._control,
                          {r: list(c) for r, c in self._commits.items()},
                          read_standby(self.run_dir), now, self.recent)

    def new_events(self, since: int) -> list[Event]:
        """The controller events from the ``since``-th on (for a log of them)."""
        return self._control[since:]
