"""The status view: replicas, standby pool and events read from a run directory, in
plain text, in the live (rich) view, and as the logs grow."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
from rich.console import Console

from ft_launch.events import EventLog
from ft_launch.launcher import cli
from ft_launch.launcher.controller.events import ActionTaken, NodeFaultDetected, RunFinished
from ft_launch.launcher.reporting.live import StatusDisplay, status_view
from ft_launch.launcher.reporting.status import (
    StatusReader,
    describe_event,
    short_command,
    status_text,
    steps_per_s,
)
from ft_launch.launcher.reporting.timeline import BandState
from tests.unit.recorded_run import (
    BACK,
    FAULT,
    T0,
    commit,
    write_commits,
    write_controller_log,
    write_run,
    write_standby,
)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run")


@pytest.fixture
def live_run(tmp_path: Path) -> Path:
    """The run at T0 + 60 s: replica 1 is down (its node failed at 40.5 s)."""
    run_dir = tmp_path / "live"
    write_controller_log(run_dir, finished=False)
    write_commits(run_dir, until=60.0)
    write_standby(run_dir)
    return run_dir


def plain(renderable: object, width: int = 130) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined, no-any-return]


def test_each_replica_shows_its_state_step_and_speed(live_run: Path) -> None:
    status = StatusReader(live_run).read(T0 + 60.5)
    rows = {r.replica_id: r for r in status.replicas}
    assert rows[0].state is BandState.TRAINING and rows[0].step == 58
    assert rows[0].steps_per_s == pytest.approx(1.0, rel=0.1)      # one commit a second
    assert rows[1].state is BandState.DOWN and rows[1].nodes == ("s1",)
    assert rows[1].how == "promoted" and rows[1].steps_per_s == 0.0  # nothing for 20 s
    assert status.standby.warm == ("s2",) and status.standby.promoted == ("s1",)
    assert status.finished is None and status.leading_step == 58


def test_speed_falls_while_a_replica_stops_committing() -> None:
    commits = [commit(0, float(t), t) for t in range(10)]
    assert steps_per_s(commits, T0 + 9.0) == pytest.approx(1.0)
    assert 0 < steps_per_s(commits, T0 + 14.0) < 1.0
    assert steps_per_s(commits, T0 + 30.0) == 0.0


def test_a_finished_run_is_measured_at_its_end(run_dir: Path) -> None:
    status = StatusReader(run_dir).read(T0 + 10_000)
    assert status.finished is not None and status.now == status.finished.time
    assert {r.replica_id: r.state for r in status.replicas} == {
        0: BandState.FINISHED, 1: BandState.TRAINING, 2: BandState.TRAINING}
    assert all(r.steps_per_s > 0.5 for r in status.replicas)


def test_events_read_in_a_few_words_without_paths() -> None:
    fault = NodeFaultDetected(node="n1", replica_id=1, reason="xid 79", time=T0)
    assert describe_event(fault) == "node n1 failed (replica 1): xid 79"
    evict = ActionTaken(action="EvictNode", replica_id=1, node="n1", reason="xid 79", time=T0)
    assert describe_event(evict) == "decided EvictNode replica 1 node n1: xid 79"
    finish = ActionTaken(action="FinishRun", replica_id=None, node=None, reason="done", time=T0)
    assert describe_event(finish) == "decided FinishRun: done"
    assert short_command(["/opt/venv/bin/python3", "/home/me/train.py", "--out", "/a/b"]) \
        == "python3 train.py --out b"
    long = short_command(["python3", "train.py", *["--flag"] * 20])
    assert len(long) == 40 and long.endswith("…")


def test_plain_status_has_a_row_per_replica_and_the_latest_events(live_run: Path) -> None:
    text = status_text(StatusReader(live_run, recent=3).read(T0 + 60.5))
    lines = text.splitlines()
    assert lines[0] == f"run {live_run}"
    assert lines[3].split()[:4] == ["1", "s1", "promoted", "down"]
    assert "standby warm: s2   promoted: s1" in text
    assert lines[-3:] == ["     +50.0s  replica 2 exited 1",
                          "     +51.0s  replica 2 launched on n2 (retry)",
                          ("     +51.0s  replica 2 runs code v2 (python3 train2.py --lr 3e-4, "
                           "bbbbbbbb)")]
    assert "/opt/venv" not in text and "/home/me" not in text


def test_the_live_view_has_a_bar_per_replica_the_pool_and_the_events(live_run: Path) -> None:
    text = plain(status_view(StatusReader(live_run).read(T0 + 60.5), total_steps=100))
    replica_lines = [line for line in text.splitlines() if "replica " in line
                     and "steps/s" in line]
    assert len(replica_lines) == 3
    assert "down" in replica_lines[1] and "step 38/100" in replica_lines[1]
    # 9 steps in the 9.5 s since its first commit after the window's start
    assert "step 58/100" in replica_lines[0] and "0.95 steps/s" in replica_lines[0]
    assert "warm: s2" in text and "promoted: s1" in text
    assert f"+{FAULT:.1f}s  node n1 failed (replica 1): xid 79" in text
    assert max(len(line) for line in text.splitlines()) <= 130


def test_reading_again_parses_only_what_was_appended(live_run: Path) -> None:
    reader = StatusReader(live_run)
    assert {r.replica_id: r.step for r in reader.read(T0 + 60.5).replicas}[1] == 38
    with EventLog(live_run / "events" / "replica-1-rank-0.jsonl") as log:
        log.emit(commit(1, BACK, 80))
    with (live_run / "events" / "replica-1-rank-0.jsonl").open("a") as log:
        log.write('{"event": "StepCommitted", "replica_id": 1, "step": 8')   # still being written
    status = reader.read(T0 + BACK + 0.5)
    row = {r.replica_id: r for r in status.replicas}[1]
    assert row.step == 80 and row.state is BandState.TRAINING


def test_off_a_terminal_the_display_prints_new_events_not_the_view_again(live_run: Path
                                                                         ) -> None:
    out = io.StringIO()
    console = Console(file=out, width=120)
    assert not console.is_terminal
    with StatusDisplay(live_run, console, clock=lambda: T0 + 60.5) as display:
        display.refresh()
        with EventLog(live_run / "controller.jsonl") as log:
            log.emit(RunFinished(exit_code=0, reason="training finished", time=T0 + 61))
        display.refresh()
    text = out.getvalue()
    assert text.count("recent events:") == 2              # at the start and at the end
    assert text.count("run finished, exit 0: training finished") == 2  # new, then in the end
    assert text.count("    steps: replica 0 58") == 0     # a progress line only every 30 s
    assert "━" not in text                                 # no bars


def test_off_a_terminal_a_progress_line_comes_every_30_s(live_run: Path) -> None:
    out = io.StringIO()
    now = [T0 + 60.5]
    with StatusDisplay(live_run, Console(file=out, width=120), clock=lambda: now[0]) as display:
        for at in (70.0, 90.0, 91.0, 121.0):
            now[0] = T0 + at
            display.refresh()
    progress = [line for line in out.getvalue().splitlines() if "steps: " in line]
    assert len(progress) == 2                  # at 91 s and 121 s: 30 s after the start, then on
    assert progress[0].startswith("    steps: replica 0 58 (") and "replica 1 38 (0.00/s, down)" \
        in progress[0]


def test_on_a_terminal_the_display_is_the_live_view(live_run: Path) -> None:
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=True, color_system=None)
    with StatusDisplay(live_run, console, total_steps=100, clock=lambda: T0 + 60.5) as display:
        display.note("== a note above the view")
        display.refresh()
    text = out.getvalue()
    assert "== a note above the view" in text and "step 58/100" in text
    assert "recent events:" not in text


def status_main(*argv: str) -> int:
    """``ft-launch status`` in-process; its ``main`` configures logging onto this test's
    captured stderr, so the root logger is put back after it (else later tests' log
    lines go to a closed stream: "--- Logging error ---")."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return cli.main(["status", *argv])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_cli_status_prints_plain_text_when_not_on_a_terminal(
        run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert status_main(str(run_dir)) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"run {run_dir}"
    assert status_main("--watch", str(run_dir)) == 0     # finished: ends at once
    out = capsys.readouterr().out
    assert out.count("recent events:") == 2 and "run finished, exit 0" in out


def test_a_hang_diagnosis_stays_listed_with_its_report(live_run: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """``ft-launch status`` shows the verdict and where the report is, even once newer
    events have pushed it out of the recent ones."""
    from ft_launch.launcher.controller.diagnosis import HangDiagnosisReported
    report = live_run / "diagnosis" / "hang-2-1" / "report.txt"
    with EventLog(live_run / "controller.jsonl") as log:
        log.emit(HangDiagnosisReported(
            replica_id=2, suspects=["n2"], outliers=[1], report=str(report),
            summary="rank 1 on n2, pid 812 in injected_deadlock (faults.py:121)",
            time=T0 + 55.0))
        for t in range(8):
            log.emit(ActionTaken(action="DiagnoseHang", replica_id=0, node=None,
                                 reason="x", time=T0 + 56.0 + t))
    text = status_text(StatusReader(live_run, recent=3).read(T0 + 70.0))
    head, _, recent = text.partition("recent events:")
    assert ("+55.0s  replica 2 hung: rank 1 on n2, pid 812 in injected_deadlock "
            "(faults.py:121) -> evict n2") in head
    assert f"report: {report}" in head and "hung" not in recent
    assert status_main(str(live_run)) == 0
    assert f"report: {report}" in capsys.readouterr().out


def test_a_replay_verdict_stays_listed_with_its_report(live_run: Path) -> None:
    """A dual-phase replay's verdict is listed with its report, as a diagnosis is."""
    from ft_launch.launcher.controller.events import SdcReplayOrdered, SdcReplayReported
    report = live_run / "replay" / "replica-1-1" / "report.txt"
    with EventLog(live_run / "controller.jsonl") as log:
        log.emit(SdcReplayOrdered(replica_id=1, suspects=["n4", "n5"],
                                  references=["n1", "n6"], steps=3, reason="x",
                                  time=T0 + 50.0))
        log.emit(SdcReplayReported(replica_id=1, status="found", suspects=["n5"],
                                   failed_rows=[1], failed_columns=[0], step=41,
                                   summary="replay found", report=str(report),
                                   duration_s=21.5, time=T0 + 72.0))
        for t in range(8):
            log.emit(ActionTaken(action="EvictNode", replica_id=1, node="n5", reason="x",
                                 time=T0 + 73.0 + t))
    text = status_text(StatusReader(live_run, recent=3).read(T0 + 90.0))
    head, _, recent = text.partition("recent events:")
    assert "sdc replays:" in head and f"report: {report}" in head
    assert "+72.0s  replica 1 replay n5 computes NaN/Inf (step 41, 21.5 s)" in head
    assert "replay" not in recent
