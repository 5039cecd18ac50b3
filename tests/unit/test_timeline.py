"""The post-run timeline: states read from real event files, and the PNG drawn from them."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from ft_launch.errors import UsageError
from ft_launch.events import EventLog
from ft_launch.launcher.reporting import plots
from ft_launch.launcher.reporting import timeline as tl
from tests.unit.recorded_run import (
    BACK,
    BACK_2,
    CRASH,
    END,
    FAULT,
    LAST_1,
    LAST_2,
    PROMOTED,
    RETRY,
    commit,
    write_run,
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run")


def test_states_come_from_launches_faults_and_commits(run_dir: Path) -> None:
    timeline = tl.read_timeline(run_dir)
    assert timeline.duration == END and timeline.replicas == (0, 1, 2)
    by_replica = {r: [(s.start, s.end, s.state) for s in timeline.segments if s.replica_id == r]
                  for r in timeline.replicas}
    starting, training, down = tl.BandState.STARTING, tl.BandState.TRAINING, tl.BandState.DOWN
    # down from the last commit: no progress since, though the fault is found later
    assert by_replica[1] == [(0.5, 2.0, starting), (2.0, LAST_1, training),
                             (LAST_1, BACK, down), (BACK, END, training)]
    assert by_replica[2] == [(0.5, 2.0, starting), (2.0, LAST_2, training),
                             (LAST_2, BACK_2, down), (BACK_2, END, training)]
    assert by_replica[0][-1] == (pytest.approx(100.2), END, tl.BandState.FINISHED)
    assert sorted((m.replica_id, m.time, m.kind.value) for m in timeline.marks) == [
        (1, FAULT, "failed"), (1, PROMOTED, "promoted"),
        (2, CRASH, "failed"), (2, RETRY, "code version"), (2, RETRY, "relaunched")]
    assert timeline.steps[1][-1] == (100.0, 100)


def test_the_exit_of_a_step_on_a_failed_node_is_not_a_second_failure(run_dir: Path) -> None:
    with (run_dir / "controller.jsonl").open("a") as log:   # replica 1's old step, cancelled
        log.write('{"event": "ReplicaExited", "replica_id": 1, "exit_code": 137, '
                  f'"time": {1000.0 + FAULT + 0.2}}}\n')
    failed = [m for m in tl.read_timeline(run_dir).marks if m.kind is tl.MarkKind.FAILED]
    assert [(m.replica_id, m.time) for m in failed] == [(1, FAULT), (2, CRASH)]


def test_the_metric_line_is_broken_while_a_replica_is_down(run_dir: Path) -> None:
    xs, ys = tl.metric_series(tl.read_timeline(run_dir), 1)
    gaps = [i for i, y in enumerate(ys) if math.isnan(y)]
    assert len(gaps) == 1 and xs[gaps[0]] == LAST_1
    assert xs[gaps[0] - 1] == LAST_1 and xs[gaps[0] + 1] == BACK   # last before, first after
    assert not [x for x in xs if LAST_1 < x < BACK]


def pixel(image: np.ndarray, axes: object, x: float, y: float) -> tuple[float, ...]:
    """The RGB of the file's pixel at data point (x, y) of ``axes``."""
    px, py = axes.transData.transform((x, y))    # type: ignore[attr-defined]
    return tuple(image[image.shape[0] - 1 - round(py), round(px), :3])


def same_colour(found: tuple[float, ...], hex_colour: str) -> bool:
    return bool(np.allclose(found, to_rgb(hex_colour), atol=2 / 255))


def test_png_shows_replica_1_down_while_replica_0_trains(run_dir: Path, tmp_path: Path
                                                         ) -> None:
    figure = plots.draw_timeline(tl.read_timeline(run_dir), tmp_path / "timeline.png")
    image = imread(tmp_path / "timeline.png")
    width, height = (figure.get_size_inches() * figure.dpi).round().astype(int)
    assert image.shape[:2] == (height, width) and width >= 900 and height > 400
    bands, metric = figure.axes
    training = tl.STATE_COLOURS[tl.BandState.TRAINING]
    down = tl.STATE_COLOURS[tl.BandState.DOWN]
    assert same_colour(pixel(image, bands, 60.0, 1), down)
    assert same_colour(pixel(image, bands, 60.0, 0), training)
    assert same_colour(pixel(image, bands, 20.0, 1), training)
    assert same_colour(pixel(image, bands, 52.0, 2), down)
    assert same_colour(pixel(image, bands, 70.0, 2), training)
    # independent of where the rows are: top to bottom, the column at t = 60 crosses
    # replica 0 (training), replica 1 (down), replica 2 (training)
    column_x = round(bands.transData.transform((60.0, 0))[0])
    panel = bands.get_window_extent()
    colours = [next((c for c in (training, down) if same_colour(tuple(p[:3]), c)), None)
               for p in image[height - round(panel.y1):height - round(panel.y0), column_x]]
    runs = [c for i, c in enumerate(colours) if c and (i == 0 or c != colours[i - 1])]
    assert runs == [training, down, training]
    # the promotion mark sits just above replica 1's band
    assert same_colour(pixel(image, bands, PROMOTED, 1 - plots.MARK_LIFT),
                       tl.MARK_COLOURS[tl.MarkKind.PROMOTED])
    # the metric panel draws a line per replica, in the order of the palette
    box = metric.get_window_extent()
    inside = image[height - round(box.y1):height - round(box.y0), round(box.x0):round(box.x1)]
    for colour in plots.REPLICA_COLOURS[:3]:
        assert np.isclose(inside[..., :3], to_rgb(colour), atol=2 / 255).all(axis=2).sum() > 50


def test_without_run_started_time_counts_from_the_first_event(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events" / "replica-0-rank-0.jsonl") as log:
        for step in range(3):
            log.emit(commit(0, 10.0 + step, step))
    timeline = tl.read_timeline(tmp_path)
    assert timeline.duration == 2.0 and timeline.steps[0][0] == (0.0, 0)
    assert [(s.start, s.end, s.state) for s in timeline.segments] == [
        (0.0, 2.0, tl.BandState.TRAINING)]
    out = plots.render_timeline(tmp_path, tmp_path / "t.png")
    assert imread(out).shape[1] == 1000


def test_an_event_type_this_version_does_not_know_is_skipped(run_dir: Path) -> None:
    with (run_dir / "controller.jsonl").open("a") as log:
        log.write('{"event": "SomethingNewer", "time": 1010.0, "replica_id": 1}\n')
    assert len(tl.read_timeline(run_dir).marks) == 5     # the rest of the log still counts


def test_a_directory_without_events_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="nothing to plot"):
        plots.render_timeline(tmp_path, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_commits_that_carry_the_loss_are_plotted_as_loss(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events" / "replica-0-rank-0.jsonl") as log:
        for step, loss in enumerate([3.0, 2.5, None, 2.0]):   # step 2: caught up, no loss
            log.emit(replace(commit(0, 10.0 + step, step), loss=loss))
    timeline = tl.read_timeline(tmp_path)
    assert timeline.metric == "loss"
    assert [value for _, value in timeline.steps[0]] == [3.0, 2.5, 2.0]
    figure = plots.draw_timeline(timeline, tmp_path / "t.png")
    raw, smooth = figure.axes[1].get_lines()[:2]     # raw values faint, the average on top
    raw_ys, smooth_ys = (np.asarray(line.get_ydata(), dtype=float) for line in (raw, smooth))
    assert list(raw_ys) == [3.0, 2.5, 2.0] and (raw.get_alpha() or 1.0) < 0.5
    assert smooth_ys[0] == 3.0 and 2.0 < smooth_ys[-1] < 2.5
    assert figure.axes[1].get_ylabel() == "loss"
