"""Workers and a lost controller: the heartbeat watch (pure) and how the allocation is
ended, against a scripted Slurm backend (the real path is tests/slurm/test_run.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ft_launch.errors import SlurmCommandError
from ft_launch.launcher.heartbeat import (
    ControllerWatch,
    ControllerWatchThread,
    HeartbeatWriter,
    beat_interval,
    read_beat,
)
from ft_launch.launcher.worker.controller_loss import end_allocation, saver_of, wait_job_ended
from ft_launch.slurm.parse import JobInfo
from ft_launch.slurm.states import JobState
from tests.waiting import wait_until


def test_the_controller_is_lost_only_after_timeout_without_a_change():
    watch = ControllerWatch(timeout=10.0, now=0.0)
    assert watch.observe("1 bh", 1.0) is None
    assert watch.observe("1 bh", 10.9) is None          # unchanged, but not for 10 s yet
    assert watch.observe("2 bh", 11.5) is None          # a new beat restarts the count
    assert watch.observe(None, 21.0) is None             # unreadable counts as unchanged
    silence = watch.observe("2 bh", 21.6)
    assert silence is not None and silence.silent_s == pytest.approx(10.1)
    assert "no controller heartbeat for 10.1 s" in silence.describe(Path("hb"))


def test_a_file_that_never_appears_is_a_lost_controller_too():
    watch = ControllerWatch(timeout=5.0, now=0.0)
    assert watch.observe(None, 4.0) is None
    assert watch.observe(None, 5.5) is not None


def test_beats_are_several_per_timeout_and_at_most_one_a_second():
    assert beat_interval(20.0) == 1.0 and beat_interval(2.0) == pytest.approx(0.4)


def test_a_writer_keeps_the_watch_quiet_and_silence_after_it_stops_is_seen(tmp_path):
    timeout = 1.0
    writer = HeartbeatWriter(tmp_path, timeout).start()
    assert read_beat(writer.path).startswith("1 ")
    reasons: list[str] = []
    watch = ControllerWatchThread(writer.path, timeout, on_lost=reasons.append).start()
    try:
        wait_until(lambda: read_beat(writer.path).startswith(("4 ", "5 ", "6 ")), 30,
                   "several heartbeats")
        assert not watch.lost.is_set()
        writer.stop()
        wait_until(watch.lost.is_set, 30 * timeout, "the silence to be noticed")
        assert reasons == [watch.reason] and str(writer.path) in watch.reason
    finally:
        writer.stop()
        watch.stop()


def test_a_heartbeat_file_is_read_with_a_bound(tmp_path):
    huge = tmp_path / "controller.heartbeat"
    huge.write_bytes(b"9" * 1_000_000)
    assert len(read_beat(huge)) == 256


def test_the_lowest_replica_of_the_last_quorum_saves_the_state():
    assert saver_of((1, 2, 4), 1) and not saver_of((1, 2, 4), 2)
    assert saver_of((), 3)       # never in a quorum: it saves (what it has) itself


class ScriptedSlurm:
    """The part of ``SlurmBackend`` a worker uses, with scripted answers."""

    def __init__(self, *, requeue_fails: bool = False, cancel_fails: bool = False,
                 states: list[str] | None = None) -> None:
        self.calls: list[tuple[str, str]] = []
        self.requeue_fails, self.cancel_fails = requeue_fails, cancel_fails
        self.states = list(states or [])

    def requeue_job(self, job_id: str) -> None:
        self.calls.append(("requeue", job_id))
        if self.requeue_fails:
            raise SlurmCommandError("Requested operation is presently disabled")

    def cancel_job(self, job_id: str) -> None:
        self.calls.append(("cancel", job_id))
        if self.cancel_fails:
            raise SlurmCommandError("slurmctld unreachable")

    def job(self, job_id: str) -> JobInfo:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return JobInfo(job_id, "train", JobState(state), ("n2",), "n1", "", 0, 0)


def test_the_job_is_requeued_and_cancelled_only_if_it_cannot_be():
    slurm = ScriptedSlurm()
    assert end_allocation(slurm, "7") == "job 7 requeued" and slurm.calls == [("requeue", "7")]
    slurm = ScriptedSlurm(requeue_fails=True)
    assert "cancelled" in end_allocation(slurm, "7")
    assert slurm.calls == [("requeue", "7"), ("cancel", "7")]
    slurm = ScriptedSlurm(requeue_fails=True, cancel_fails=True)
    assert "neither requeued nor cancelled" in end_allocation(slurm, "7")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


def test_a_replica_waits_a_bounded_time_for_another_to_end_the_job():
    clock = FakeClock()
    ended = ScriptedSlurm(states=["RUNNING", "RUNNING", "COMPLETING"])
    assert wait_job_ended(ended, "7", 10.0, clock=clock, pause=clock.pause)
    assert clock.now == pytest.approx(2.0)
    clock = FakeClock()
    stuck = ScriptedSlurm(states=["RUNNING"])
    assert not wait_job_ended(stuck, "7", 10.0, clock=clock, pause=clock.pause)
    assert clock.now == pytest.approx(10.0)
