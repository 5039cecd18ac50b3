"""Figures, drawn with matplotlib: the run timeline and the benchmarks' line plots.

matplotlib is the optional ``[plot]`` extra and costs a second to import, so it
is imported inside the drawing functions, never at module import: the control
plane imports this module. No pyplot either: a ``Figure`` of its own renders with
Agg and touches no global backend or style; the style below applies only inside
``_styled``.

The look is that of a TensorBoard or W&B export: white, light grid, no top or
right frame, small grey tick labels, a left-aligned title, tab10 colours.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from ft_launch.errors import UsageError

from .timeline import (
    MARK_COLOURS,
    STATE_COLOURS,
    BandState,
    Mark,
    MarkKind,
    Timeline,
    metric_series,
    read_timeline,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Series = tuple[str, Sequence[float], Sequence[float]]

INSTALL_HINT = "pip install 'ft-launch[plot]'"
DPI = 100
TAB10 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
         "#7f7f7f", "#bcbd22", "#17becf"]
# Replicas' lines: tab10 without the green and red that mean training and down.
REPLICA_COLOURS = [c for c in TAB10 if c not in (STATE_COLOURS[BandState.TRAINING],
                                                 STATE_COLOURS[BandState.DOWN])]
STYLE: dict[str, Any] = {
    "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
    "font.family": "sans-serif", "font.size": 9,
    "axes.edgecolor": "#bdbdbd", "axes.linewidth": 0.8,
    "axes.spines.top": False, "axes.spines.right": False,
    "axes.grid": True, "grid.color": "#e8e8e8", "grid.linewidth": 0.8,
    "axes.axisbelow": True, "axes.titlesize": 11, "axes.titleweight": "normal",
    "axes.titlecolor": "#212121",
    "axes.titlelocation": "left", "axes.titlepad": 8,
    "axes.labelsize": 9, "axes.labelcolor": "#424242",
    "xtick.color": "#616161", "ytick.color": "#616161",
    "xtick.labelsize": 8, "ytick.labelsize": 8,
    "xtick.major.size": 0, "ytick.major.size": 0,
    "xtick.minor.size": 0, "ytick.minor.size": 0,
    "legend.fontsize": 8, "legend.frameon": False,
    "lines.linewidth": 1.6, "lines.markersize": 4,
}
MARK_SYMBOLS = {MarkKind.FAILED: "X", MarkKind.RELAUNCHED: "v", MarkKind.PROMOTED: "v",
                MarkKind.UPDATED: "D"}
LOSS_SMOOTHING = 0.8        # TensorBoard's slider: the weight of the running average
BAND_HEIGHT = 0.6           # of one replica's row in the state panel
MARK_LIFT = BAND_HEIGHT / 2 + 0.14      # marks other than failures sit this far above it
MARK_SPACING = 0.008        # of the time axis, between marks side by side


@contextlib.contextmanager
def _styled() -> Iterator[None]:
    try:
        import matplotlib
    except ImportError as error:
        raise UsageError("drawing a figure needs matplotlib, which is not installed",
                         hint=INSTALL_HINT) from error
    with matplotlib.rc_context(STYLE):  # type: ignore[arg-type]  # the stubs want literal keys
        yield


def _figure(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure
    return Figure(figsize=(width, height), dpi=DPI, layout="constrained")


# --------------------------------------------------------------------------- timeline


def render_timeline(run_dir: Path, out: Path) -> Path:
    """Draw the run in ``run_dir`` as a PNG at ``out``; returns ``out``."""
    draw_timeline(read_timeline(run_dir), out)
    return out


def draw_timeline(timeline: Timeline, out: Path, width: float = 10.0) -> Figure:
    """Replica states and marks above, the loss (or committed step) below, on one
    time axis, written as a PNG; the figure is returned as drawn (its transforms
    map data to the file's pixels)."""
    with _styled():
        rows = max(len(timeline.replicas), 1)
        figure = _figure(width, 1.6 + 0.42 * rows + 3.0)
        bands, metric = figure.subplots(2, 1, sharex=True,
                                        height_ratios=[0.42 * rows + 0.5, 3.0])
        _draw_bands(bands, timeline)
        _draw_metric(metric, timeline)
        bands.set_title(f"Replica states and {timeline.metric}")
        metric.set_xlim(0.0, max(timeline.duration, 1e-9))
        metric.set_xlabel("time since run start (s)")
        figure.savefig(out)
    return figure


def _draw_bands(axes: Axes, timeline: Timeline) -> None:
    from matplotlib.patches import Patch
    row = {replica_id: i for i, replica_id in enumerate(timeline.replicas)}
    for segment in timeline.segments:
        axes.broken_barh([(segment.start, segment.end - segment.start)],
                         (row[segment.replica_id] - BAND_HEIGHT / 2, BAND_HEIGHT),
                         facecolors=STATE_COLOURS[segment.state], linewidth=0)
    handles: list[Any] = [Patch(color=STATE_COLOURS[state], label=state.value)
                          for state in BandState
                          if any(s.state is state for s in timeline.segments)]
    at = _mark_positions(timeline)
    for kind in MarkKind:
        mine = [m for m in timeline.marks if m.kind is kind]
        lift = 0.0 if kind is MarkKind.FAILED else MARK_LIFT
        if mine:        # a failure on the band where it went down, the others above it
            handles.append(axes.scatter(
                [at[m] for m in mine], [row[m.replica_id] - lift for m in mine],
                marker=MARK_SYMBOLS[kind], s=40, color=MARK_COLOURS[kind],
                edgecolors="white", linewidths=0.5, zorder=3, label=kind.value))
    axes.set_yticks(range(len(timeline.replicas)),
                    [f"replica {r}" for r in timeline.replicas])
    axes.set_ylim(len(timeline.replicas) - 0.5, -0.9)      # replica 0 on top
    axes.grid(axis="y", visible=False)
    axes.spines["left"].set_visible(False)
    axes.legend(handles=handles, loc="lower right", bbox_to_anchor=(1.0, 1.0),
                ncols=len(handles), handlelength=1.2, columnspacing=1.2,
                borderaxespad=0.1)


def _mark_positions(timeline: Timeline) -> dict[Mark, float]:
    """Where each mark is drawn: at its time, moved right past the marks of its replica
    already there (a relaunch on a new code version is two marks at one instant)."""
    apart = MARK_SPACING * max(timeline.duration, 1e-9)
    placed: dict[tuple[int, bool], list[float]] = {}
    at: dict[Mark, float] = {}
    for mark in sorted(timeline.marks, key=lambda m: m.time):
        row = placed.setdefault((mark.replica_id, mark.kind is MarkKind.FAILED), [])
        x = mark.time
        while any(abs(x - other) < apart for other in row):
            x += apart
        row.append(x)
        at[mark] = x
    return at


def _draw_metric(axes: Axes, timeline: Timeline) -> None:
    smooth = timeline.metric == "loss"
    for i, replica_id in enumerate(timeline.replicas):
        xs, ys = metric_series(timeline, replica_id)
        if not xs:
            continue
        colour = REPLICA_COLOURS[i % len(REPLICA_COLOURS)]
        if smooth:      # TensorBoard: the raw values faint, the running average on top
            axes.plot(xs, ys, color=colour, alpha=0.25, linewidth=1.0)
            ys = smoothed(ys, LOSS_SMOOTHING)
        axes.plot(xs, ys, color=colour, label=f"replica {replica_id}")
    for mark in timeline.marks:     # where the metric may jump: a replica failed
        if mark.kind is MarkKind.FAILED:
            axes.axvline(mark.time, color=STATE_COLOURS[BandState.DOWN], linewidth=0.9,
                         linestyle=(0, (4, 3)), alpha=0.7, zorder=1)
    axes.set_ylabel(timeline.metric)
    if axes.get_legend_handles_labels()[0]:     # where the lines are not: a loss falls
        axes.legend(loc="upper right" if smooth else "lower right")


def smoothed(values: Sequence[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: a debiased exponential moving average; a NaN (a gap)
    stays a gap and the average goes on after it."""
    out: list[float] = []
    average, seen = 0.0, 0
    for value in values:
        if math.isnan(value):
            out.append(value)
            continue
        seen += 1
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** seen))
    return out


# --------------------------------------------------------------------------- benchmarks


LegendPlace = Literal["lower left", "upper left", "lower right", "upper right", "best"]
LEGEND_PLACES = {*get_args(LegendPlace), "below"}


def line_plot(path: str | Path, series: Sequence[Series], *, title: str, xlabel: str,
              ylabel: str, log_x: bool = False, log_y: bool = False,
              y_range: tuple[float, float] | None = None,
              legend_at: LegendPlace | Literal["below"] = "best",
              size: tuple[float, float] = (8.0, 5.0)) -> None:
    """Each series as a line with markers, written as a PNG; ``legend_at`` is a
    matplotlib corner, "best", or "below" (under the axes)."""
    if legend_at not in LEGEND_PLACES:
        raise ValueError(f"legend_at={legend_at!r}: expected one of {sorted(LEGEND_PLACES)}")
    with _styled():
        figure = _figure(*size)
        axes = figure.subplots()
        for i, (label, xs, ys) in enumerate(series):
            axes.plot(xs, ys, marker="o", color=TAB10[i % len(TAB10)], label=label)
        axes.set_xscale("log" if log_x else "linear")
        axes.set_yscale("log" if log_y else "linear")
        _grouped_digits(axes)
        if y_range is not None:
            axes.set_ylim(*y_range)
        axes.set_title(title)
        axes.set_xlabel(xlabel)
        axes.set_ylabel(ylabel)
        if legend_at == "below":
            figure.legend(loc="outside lower center", ncols=min(len(series), 4))
        else:
            axes.legend(loc=legend_at)
        figure.savefig(path)


def _grouped_digits(axes: Axes) -> None:
    """Tick labels such as 16,384 and 1,000 rather than 16384, 1.6e4 or 10^3."""
    from matplotlib.ticker import FuncFormatter
    for axis in (axes.xaxis, axes.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,g}"))
