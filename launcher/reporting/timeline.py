"""The post-run timeline, read from a run's event files (pure; ``plots`` draws it).

Each replica is in one state at a time:

* starting: launched at the start of the run, no step committed yet;
* training: committing steps;
* down: from a fault (``NodeFaultDetected``), a failed exit or a relaunch until
  its next committed step (so recovery time is red); a replica that was training
  is down from its last committed step, not from when the fault was found;
* finished: exited with 0.

Marks: failed (a node fault or a failed exit), relaunched (retry, relaunch,
full restart, update restart), promoted (a warm standby took over), and code
version changed (hot update or rollback, from ``ft_launch.launcher.controller.versions``).

The metric: the training loss against time per replica, when the training
script hands it to ``commit(loss=...)`` (it lands in ``StepCommitted``), else the
committed step (progress). Time is in seconds from ``RunStarted`` (or the first
event). ``replica_state`` is the same reading for one event, for the live status.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ft_launch.errors import ExitCode, UsageError
from ft_launch.events import Event, RunStarted
from ft_launch.launcher.worker.events import StepCommitted

from ..controller import events as controller_events
from ..controller import versions
from .runlog import commits, controller_log


class BandState(enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    DOWN = "down"
    FINISHED = "finished"


class MarkKind(enum.Enum):
    FAILED = "failed"
    RELAUNCHED = "relaunched"
    PROMOTED = "promoted"
    UPDATED = "code version"


# One palette for the plot and the live view (matplotlib's tab10, as TensorBoard and W&B).
STATE_COLOURS = {BandState.STARTING: "#c7c7c7", BandState.TRAINING: "#2ca02c",
                 BandState.DOWN: "#d62728", BandState.FINISHED: "#1f77b4"}
MARK_COLOURS = {MarkKind.FAILED: "#7f0000", MarkKind.RELAUNCHED: "#ff7f0e",
                MarkKind.PROMOTED: "#9467bd", MarkKind.UPDATED: "#17becf"}


@dataclass(frozen=True)
class Segment:
    """One replica in one state, from ``start`` to ``end``."""

    replica_id: int
    start: float
    end: float
    state: BandState


@dataclass(frozen=True)
class Mark:
    """Something that happened to a replica at an instant (drawn above its band)."""

    replica_id: int
    time: float
    kind: MarkKind


@dataclass(frozen=True)
class Timeline:
    """A run read back from its event files; times in seconds from the run start."""

    duration: float
    replicas: tuple[int, ...]
    segments: tuple[Segment, ...]
    marks: tuple[Mark, ...]
    steps: dict[int, list[tuple[float, float]]]  # replica -> (time, metric) per commit
    metric: str = "committed step"              # or "loss", when the commits carry it


# --------------------------------------------------------------------------- building (pure)


def build_timeline(control: Sequence[Event], committed: dict[int, list[StepCommitted]]
                   ) -> Timeline:
    """States and marks per replica from the controller log and rank 0's commits."""
    found = sorted([*control, *(e for es in committed.values() for e in es)],
                   key=lambda e: e.time)
    if not found:
        raise ValueError("no controller or worker events")
    start = next((e.time for e in control if isinstance(e, RunStarted)), found[0].time)
    end = next((e.time for e in control if isinstance(e, controller_events.RunFinished)),
               found[-1].time)
    bands = _Bands()
    marks: list[Mark] = []
    versions_seen: dict[int, int] = {}
    failed: dict[int, bool] = {}        # replica -> its last mark was a failure
    for event in found:
        replica_id = getattr(event, "replica_id", None)
        if replica_id is None or event.time > end:
            continue
        at = max(event.time, start) - start
        state, mark = replica_state(event, versions_seen)
        if mark is MarkKind.FAILED and bands.state(replica_id) is BandState.DOWN \
                and failed.get(replica_id, False):
            mark = None     # the exit of a step whose node was already found faulty
        if mark is not None:
            marks.append(Mark(replica_id, at, mark))
            failed[replica_id] = mark is MarkKind.FAILED
        bands.enter(replica_id, state, at, committed=isinstance(event, StepCommitted))
    # Loss when the training script reports it (steps a replica only caught up on have
    # none), else the committed step.
    with_loss = any(e.loss is not None for es in committed.values() for e in es)
    steps = {r: [(e.time - start, float(e.step) if e.loss is None else e.loss) for e in es
                 if start <= e.time <= end and (e.loss is not None or not with_loss)]
             for r, es in committed.items()}
    replicas = tuple(sorted(set(bands.since) | set(steps)))
    return Timeline(end - start, replicas, bands.close(end - start), tuple(marks), steps,
                    "loss" if with_loss else "committed step")


class _Bands:
    """Each replica's segments as its state changes. A replica that goes down while
    training is down from its last committed step: it made no progress since (a dead
    node is only found ``recovery.lost_timeout`` later)."""

    def __init__(self) -> None:
        self.since: dict[int, tuple[BandState, float]] = {}
        self.segments: list[Segment] = []
        self.last_commit: dict[int, float] = {}

    def state(self, replica_id: int) -> BandState | None:
        current = self.since.get(replica_id)
        return current[0] if current else None

    def enter(self, replica_id: int, state: BandState | None, at: float, *,
              committed: bool) -> None:
        previous = self.since.get(replica_id)
        if state is not None and (previous is None or previous[0] is not state):
            if previous is not None and previous[0] is BandState.TRAINING \
                    and state is BandState.DOWN:
                at = max(previous[1], self.last_commit.get(replica_id, at))
            if previous is not None and at > previous[1]:
                self.segments.append(Segment(replica_id, previous[1], at, previous[0]))
            self.since[replica_id] = (state, at)
        if committed:
            self.last_commit[replica_id] = at

    def close(self, end: float) -> tuple[Segment, ...]:
        last = [Segment(r, since, end, state) for r, (state, since) in self.since.items()
                if end > since]
        return (*self.segments, *last)


def replica_state(event: Event, versions_seen: dict[int, int]
                  ) -> tuple[BandState | None, MarkKind | None]:
    """What one event says about its replica: a new state, a mark, or both."""
    if isinstance(event, StepCommitted):
        return BandState.TRAINING, None
    if isinstance(event, controller_events.ReplicaLaunched):
        if event.how == "initial":
            return BandState.STARTING, None
        return BandState.DOWN, MarkKind.PROMOTED if event.how == "promoted" \
            else MarkKind.RELAUNCHED
    if isinstance(event, controller_events.NodeFaultDetected):
        return BandState.DOWN, MarkKind.FAILED
    if isinstance(event, controller_events.ReplicaExited):
        if event.exit_code in (ExitCode.OK, ExitCode.RUN_FINISHED):  # 77: nothing to join
            return BandState.FINISHED, None
        return BandState.DOWN, MarkKind.FAILED
    if isinstance(event, versions.CodeVersionApplied):
        before = versions_seen.get(event.replica_id)
        versions_seen[event.replica_id] = event.version
        return None, MarkKind.UPDATED if before not in (None, event.version) else None
    return None, None


def read_timeline(run_dir: Path) -> Timeline:
    try:
        return build_timeline(controller_log(run_dir), commits(run_dir))
    except ValueError as error:
        raise UsageError(f"{run_dir}: nothing to plot ({error})",
                         hint="is this an ft-launch run directory?") from error


def metric_series(timeline: Timeline, replica_id: int) -> tuple[list[float], list[float]]:
    """A replica's metric against time, broken (a NaN, matplotlib's gap) where it
    went down, so a line does not join the values across an outage."""
    xs: list[float] = []
    ys: list[float] = []
    outages = sorted(s.start for s in timeline.segments
                     if s.replica_id == replica_id and s.state is BandState.DOWN)
    for at, value in timeline.steps.get(replica_id, []):
        while outages and outages[0] < at:
            xs.append(outages.pop(0))
            ys.append(math.nan)
        xs.append(at)
        ys.append(value)
    return xs, ys
