"""The post-run timeline: ``render_timeline(run_dir, out)`` writes a PNG.

Top panel, one band per replica, coloured by its state over time:

* starting: launched at the start of the run, no step committed yet;
* training: committing steps;
* down: from a fault (``NodeFaultDetected``), a failed exit or a relaunch until
  its next committed step (so recovery time is red);
* finished: exited with 0.

Marks above a band: relaunched (retry, relaunch, full restart, update restart),
promoted (a warm standby took over), and code version changed (hot update or
rollback, from ``launcher.versions``).

Bottom panel: the training loss against time per replica, when the training
script hands it to ``commit(loss=...)`` (it lands in ``StepCommitted``), else the
committed step (progress). Time is in seconds from ``RunStarted`` (or the first
event).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ftcore.errors import UsageError
from ftcore.events import Event, RunStarted
from launcher.worker.events import StepCommitted

from . import events as controller_events
from . import versions
from .pngplot import Axes, Canvas, legend, span, text_width, write_png
from .report import commits


class BandState(enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    DOWN = "down"
    FINISHED = "finished"


class MarkKind(enum.Enum):
    RELAUNCHED = "relaunched"
    PROMOTED = "promoted"
    UPDATED = "code version"


STATE_COLOURS = {BandState.STARTING: (190, 190, 190), BandState.TRAINING: (44, 160, 44),
                 BandState.DOWN: (214, 39, 40), BandState.FINISHED: (31, 119, 180)}
MARK_COLOURS = {MarkKind.RELAUNCHED: (255, 127, 14), MarkKind.PROMOTED: (148, 103, 189),
                MarkKind.UPDATED: (0, 0, 0)}


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
    states: dict[int, tuple[BandState, float]] = {}
    segments: list[Segment] = []
    marks: list[Mark] = []
    versions_seen: dict[int, int] = {}
    for event in found:
        replica_id = getattr(event, "replica_id", None)
        if replica_id is None or event.time > end:
            continue
        at = max(event.time, start) - start
        state, mark = _reading(event, versions_seen)
        if mark is not None:
            marks.append(Mark(replica_id, at, mark))
        previous = states.get(replica_id)
        if state is not None and (previous is None or previous[0] is not state):
            if previous is not None and at > previous[1]:
                segments.append(Segment(replica_id, previous[1], at, previous[0]))
            states[replica_id] = (state, at)
    for replica_id, (state, since) in states.items():
        if end - start > since:
            segments.append(Segment(replica_id, since, end - start, state))
    # Loss when the training script reports it (steps a replica only caught up on have
    # none), else the committed step.
    with_loss = any(e.loss is not None for es in committed.values() for e in es)
    steps = {r: [(e.time - start, float(e.loss) if with_loss else float(e.step)) for e in es
                 if start <= e.time <= end and (e.loss is not None or not with_loss)]
             for r, es in committed.items()}
    replicas = tuple(sorted(set(states) | set(steps)))
    return Timeline(end - start, replicas, tuple(segments), tuple(marks), steps,
                    "loss" if with_loss else "committed step")


def _reading(event: Event, versions_seen: dict[int, int]
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
        return BandState.DOWN, None
    if isinstance(event, controller_events.ReplicaExited):
        return BandState.FINISHED if event.exit_code == 0 else BandState.DOWN, None
    if isinstance(event, versions.CodeVersionApplied):
        before = versions_seen.get(event.replica_id)
        versions_seen[event.replica_id] = event.version
        return None, MarkKind.UPDATED if before not in (None, event.version) else None
    return None, None


def read_timeline(run_dir: Path) -> Timeline:
    # EventTail skips event types it does not know (``report.controller_log`` would
    # drop the whole log): a newer event in an old run must not blank the plot.
    control = controller_events.EventTail(run_dir / "controller.jsonl").read()
    try:
        return build_timeline(control, commits(run_dir))
    except ValueError as error:
        raise UsageError(f"{run_dir}: nothing to plot ({error})",
                         hint="is this an ft-launch run directory?") from error


# --------------------------------------------------------------------------- drawing

LEFT, RIGHT_MARGIN, TOP = 90, 30, 50
BAND, PITCH, MARK_ROOM = 22, 34, 12
LEGEND_ROOM, STEPS_HEIGHT, BOTTOM_ROOM = 72, 240, 60


@dataclass(frozen=True)
class Layout:
    """Where things go: ``bands.px(t)`` is the column of time ``t`` in both panels."""

    width: int
    height: int
    bands: Axes
    steps: Axes
    band_top: dict[int, int]


def layout(timeline: Timeline, width: int = 900) -> Layout:
    right = width - RIGHT_MARGIN
    x_range = span(0.0, timeline.duration)
    band_top = {r: TOP + MARK_ROOM + i * PITCH for i, r in enumerate(timeline.replicas)}
    bands_bottom = TOP + MARK_ROOM + len(timeline.replicas) * PITCH
    steps_top = bands_bottom + LEGEND_ROOM
    steps_bottom = steps_top + STEPS_HEIGHT
    values = [s for points in timeline.steps.values() for _, s in points]
    steps = Axes(LEFT, right, steps_top, steps_bottom, x_range,
                 span(min(values, default=0), max(values, default=1), 0.05))
    return Layout(width, steps_bottom + BOTTOM_ROOM,
                  Axes(LEFT, right, TOP, bands_bottom, x_range, (0.0, 1.0)), steps, band_top)


def render_timeline(run_dir: Path, out: Path, *, width: int = 900) -> Path:
    """Draw the run in ``run_dir`` as a PNG at ``out``; returns ``out``."""
    timeline = read_timeline(run_dir)
    where = layout(timeline, width)
    canvas = Canvas(width, where.height)
    _draw_bands(canvas, timeline, where)
    series = [_step_series(timeline, r, points)
              for r, points in sorted(timeline.steps.items()) if points]
    where.steps.grid(canvas)
    where.steps.plot(canvas, series)
    if series:
        box = where.steps
        legend(canvas, [label for label, _, _ in series], "lower right",
               (box.left, box.right, box.top, box.bottom))
    title = f"REPLICA STATES AND {timeline.metric.upper()}"
    canvas.text((LEFT + where.steps.right - text_width(title, 3)) // 2, 12, title, scale=3)
    canvas.text(8, where.steps.top - 24, timeline.metric.upper())
    xlabel = "SECONDS SINCE RUN START"
    canvas.text((LEFT + where.steps.right - text_width(xlabel)) // 2,
                where.steps.bottom + 32, xlabel)
    write_png(out, canvas.pixels)
    return out


def _step_series(timeline: Timeline, replica_id: int, points: list[tuple[float, int]]
                 ) -> tuple[str, list[float], list[float]]:
    """A replica's committed steps, the line broken (NaN) where it was down."""
    xs: list[float] = []
    ys: list[float] = []
    outages = sorted(s.start for s in timeline.segments
                     if s.replica_id == replica_id and s.state is BandState.DOWN)
    for at, step in points:
        while outages and outages[0] <= at:
            xs.append(outages.pop(0))
            ys.append(math.nan)
        xs.append(at)
        ys.append(float(step))
    return f"replica {replica_id}", xs, ys


def _draw_bands(canvas: Canvas, timeline: Timeline, where: Layout) -> None:
    axes = where.bands
    axes.grid(canvas, x_labels=False, y_labels=False)
    for replica_id, top in where.band_top.items():
        label = f"R{replica_id}"
        canvas.text(LEFT - 8 - text_width(label), top + 5, label)
    for segment in timeline.segments:
        top = where.band_top[segment.replica_id]
        canvas.rect(axes.px(segment.start), top, axes.px(segment.end), top + BAND,
                    STATE_COLOURS[segment.state])
    placed: dict[int, list[float]] = {}
    for mark in timeline.marks:
        x, tip = axes.px(mark.time), where.band_top[mark.replica_id] - 2
        while any(abs(x - other) < 10 for other in placed.setdefault(mark.replica_id, [])):
            x += 10             # marks at the same moment side by side, not on top
        placed[mark.replica_id].append(x)
        for row in range(5):    # a small downward triangle in the gap above the band
            canvas.rect(x - row, tip - row - 1, x + row + 1, tip - row,
                        MARK_COLOURS[mark.kind])
    _key(canvas, axes.bottom + 14, [(s.value, c) for s, c in STATE_COLOURS.items()]
         + [(k.value, c) for k, c in MARK_COLOURS.items()])


def _key(canvas: Canvas, y: int, entries: Iterable[tuple[str, tuple[int, int, int]]]) -> None:
    x = LEFT
    for label, colour in entries:
        canvas.rect(x, y, x + 12, y + 12, colour)
        x = canvas.text(x + 18, y + 1, label) + 16
