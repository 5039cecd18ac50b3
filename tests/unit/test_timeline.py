"""The post-run timeline: states read from real event files, and the PNG drawn from them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from ftcore.errors import UsageError
from ftcore.events import EventLog, RunStarted
from launcher import timeline as tl
from launcher.events import (
    NodeFaultDetected,
    ReplicaExited,
    ReplicaLaunched,
    RunFinished,
    StandbyPromoted,
)
from launcher.pngplot import COLOURS
from launcher.versions import CodeVersionApplied
from launcher.worker.events import StepCommitted, WorkerStarted
from tests.pngread import read_png

T0 = 1_000.0
FAULT, PROMOTED, BACK = 40.5, 41.0, 80.0        # replica 1: node lost, standby, first commit
CRASH, RETRY, BACK_2 = 50.0, 51.0, 55.0          # replica 2: crash, retry on a new version
END = 100.5


def commit(replica_id: int, at: float, step: int) -> StepCommitted:
    return StepCommitted(replica_id=replica_id, rank=0, step=step, quorum_id=1,
                         contributors=3, caught_up=False, lr_factor=1.0, time=T0 + at)


def commit_times(replica_id: int) -> list[float]:
    every = [float(t) for t in range(2, 101)]
    if replica_id == 1:
        return [t for t in every if t < FAULT or t >= BACK]
    if replica_id == 2:
        return [t for t in every if t < CRASH or t >= BACK_2]
    return every


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    with EventLog(tmp_path / "controller.jsonl") as log:
        log.emit(RunStarted(job_id="42", replicas=3, nodes=["n0", "n1", "n2", "s1"], time=T0))
        for r in range(3):
            log.emit(ReplicaLaunched(replica_id=r, nodes=[f"n{r}"], how="initial",
                                     time=T0 + 0.5))
            log.emit(CodeVersionApplied(replica_id=r, version=1, command=["python", "t.py"],
                                        digest="a" * 64, time=T0 + 0.5))
        log.emit(NodeFaultDetected(node="n1", replica_id=1, reason="xid 79", time=T0 + FAULT))
        log.emit(StandbyPromoted(replica_id=1, node="s1", time=T0 + PROMOTED))
        log.emit(ReplicaLaunched(replica_id=1, nodes=["s1"], how="promoted",
                                 time=T0 + PROMOTED))
        log.emit(ReplicaExited(replica_id=2, exit_code=1, time=T0 + CRASH))
        log.emit(ReplicaLaunched(replica_id=2, nodes=["n2"], how="retry", time=T0 + RETRY))
        log.emit(CodeVersionApplied(replica_id=2, version=2, command=["python", "t2.py"],
                                    digest="b" * 64, time=T0 + RETRY))
        log.emit(ReplicaExited(replica_id=0, exit_code=0, time=T0 + 100.2))
        log.emit(RunFinished(exit_code=0, reason="training finished", time=T0 + END))
    for r in range(3):
        with EventLog(tmp_path / "events" / f"replica-{r}-rank-0.jsonl") as log:
            log.emit(WorkerStarted(replica_id=r, rank=0, next_step=0, time=T0 + 1))
            for step, at in enumerate(commit_times(r)):
                log.emit(commit(r, at, step if r != 1 or at < FAULT else int(at)))
    return tmp_path


def test_states_come_from_launches_faults_and_commits(run_dir: Path) -> None:
    timeline = tl.read_timeline(run_dir)
    assert timeline.duration == END and timeline.replicas == (0, 1, 2)
    by_replica = {r: [(s.start, s.end, s.state) for s in timeline.segments if s.replica_id == r]
                  for r in timeline.replicas}
    starting, training, down = tl.BandState.STARTING, tl.BandState.TRAINING, tl.BandState.DOWN
    assert by_replica[1] == [(0.5, 2.0, starting), (2.0, FAULT, training),
                             (FAULT, BACK, down), (BACK, END, training)]
    assert by_replica[2] == [(0.5, 2.0, starting), (2.0, CRASH, training),
                             (CRASH, BACK_2, down), (BACK_2, END, training)]
    assert by_replica[0][-1] == (pytest.approx(100.2), END, tl.BandState.FINISHED)
    assert sorted((m.replica_id, m.time, m.kind.value) for m in timeline.marks) == [
        (1, PROMOTED, "promoted"), (2, RETRY, "code version"), (2, RETRY, "relaunched")]
    assert timeline.steps[1][-1] == (100.0, 100)


def test_png_shows_replica_1_down_while_replica_0_trains(run_dir: Path, tmp_path: Path
                                                         ) -> None:
    out = tl.render_timeline(run_dir, tmp_path / "timeline.png")
    pixels = read_png(out)
    where = tl.layout(tl.read_timeline(run_dir))
    assert pixels.shape == (where.height, 900, 3) and where.height > 400

    def band(replica_id: int, at: float) -> tuple[int, ...]:
        row = where.band_top[replica_id] + tl.BAND // 2
        return tuple(int(v) for v in pixels[row, round(where.bands.px(at))])

    training = tl.STATE_COLOURS[tl.BandState.TRAINING]
    down = tl.STATE_COLOURS[tl.BandState.DOWN]
    assert band(1, 60.0) == down and band(0, 60.0) == training
    assert band(1, 20.0) == training and band(2, 52.0) == down
    assert band(0, 100.4) == tl.STATE_COLOURS[tl.BandState.FINISHED]
    # independent of the layout's rows: top to bottom, the column at t = 60 crosses
    # replica 0 (training), replica 1 (down), replica 2 (training)
    column = pixels[:where.bands.bottom, round(where.bands.px(60.0))]
    runs = [tuple(int(v) for v in c) for c in column
            if tuple(int(v) for v in c) in (training, down)]
    changes = [c for i, c in enumerate(runs) if i == 0 or c != runs[i - 1]]
    assert changes == [training, down, training]
    # the promotion mark sits above replica 1's band
    x = round(where.bands.px(PROMOTED))
    above = pixels[where.band_top[1] - tl.MARK_ROOM:where.band_top[1], x - 2:x + 3]
    assert (above == tl.MARK_COLOURS[tl.MarkKind.PROMOTED]).all(axis=2).any()
    # the step panel draws each replica's series
    steps = pixels[where.steps.top:where.steps.bottom]
    assert all((steps == colour).all(axis=2).sum() > 50 for colour in COLOURS[:3])
    # replica 1's step line (second colour) is broken while it was down, not joined over

    def drawn(at: float) -> bool:
        x = round(where.steps.px(at))
        return bool((steps[:, x - 1:x + 2] == COLOURS[1]).all(axis=2).any())

    assert drawn(90.0) and not drawn(60.0)


def test_an_event_type_this_version_does_not_know_is_skipped(run_dir: Path) -> None:
    with (run_dir / "controller.jsonl").open("a") as log:
        log.write('{"event": "SomethingNewer", "time": 1010.0, "replica_id": 1}\n')
    assert len(tl.read_timeline(run_dir).marks) == 3     # the rest of the log still counts


def test_without_run_started_time_counts_from_the_first_event(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events" / "replica-0-rank-0.jsonl") as log:
        for step in range(3):
            log.emit(commit(0, 10.0 + step, step))
    timeline = tl.read_timeline(tmp_path)
    assert timeline.duration == 2.0 and timeline.steps[0][0] == (0.0, 0)
    assert [(s.start, s.end, s.state) for s in timeline.segments] == [
        (0.0, 2.0, tl.BandState.TRAINING)]
    assert read_png(tl.render_timeline(tmp_path, tmp_path / "t.png")).shape[1] == 900


def test_a_directory_without_events_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="nothing to plot"):
        tl.render_timeline(tmp_path, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()



def test_commits_that_carry_the_loss_are_plotted_as_loss(tmp_path: Path) -> None:
    with EventLog(tmp_path / "events" / "replica-0-rank-0.jsonl") as log:
        for step, loss in enumerate([3.0, 2.5, None, 2.0]):   # step 2: caught up, no loss
            log.emit(replace(commit(0, 10.0 + step, step), loss=loss))
    timeline = tl.read_timeline(tmp_path)
    assert timeline.metric == "loss"
    assert [value for _, value in timeline.steps[0]] == [3.0, 2.5, 2.0]
    assert read_png(tl.render_timeline(tmp_path, tmp_path / "t.png")).shape[1] == 900
