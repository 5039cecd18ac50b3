"""How a replica's process ends (``worker.exits``): leaving ``with ft_manager(...)``, an
exception, the interpreter's exit without ``close()``, SIGTERM, and a replica that can
never join (the run has finished, or no quorum is reachable). Real replica processes
on loopback (``lifecycle_worker.py``), real sockets and files; every bound is derived
from the configured timeouts or measured in the same run."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from ft_launch.ckpt.held import HeldFiles
from ft_launch.config.sections import CkptConfig
from ft_launch.errors import ExitCode
from ft_launch.launcher.worker.events import WorkerStarted, WorkerStopped
from ft_launch.launcher.worker.exits import FINISHED_FILE, TERMINATED_CODE
from ft_launch.launcher.worker.identity import WorkerIdentity
from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience, wait_until

from .harness import TEST_CONFIG

pytestmark = [pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("lifecycle_worker.py")
#: A failure budget that a replica waiting for a quorum it cannot reach spends quickly.
BUDGET = "3"


def lifecycle_job(run_dir: Path, replicas: int, steps: int, end: str,
                  extra: tuple[str, ...] = (), **config: str) -> LocalJob:
    return LocalJob(run_dir, replicas,
                    [sys.executable, str(WORKER), "--steps", str(steps), "--end", end, *extra],
                    {**TEST_CONFIG, "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": BUDGET, **config})


def held_dir(job: LocalJob) -> Path:
    """The run's directory of backups held for peers (``ckpt.held``), named as the
    workers name it: by job, node and run directory, so no other run's is counted."""
    me = WorkerIdentity.from_env(job.env(0, ""))
    return Path(CkptConfig().backup_dir) / HeldFiles.dir_name(me.job_id, me.node,
                                                               str(me.run_dir))


def quorum_attempt(job: LocalJob) -> float:
    """How long one quorum attempt may wait (``QuorumAgent.default_timeout``): a join
    window and a leader failover."""
    c = job.config_env
    return (float(c["FTL_QUORUM_JOIN_TIMEOUT"]) + float(c["FTL_QUORUM_MEMBER_TIMEOUT"])
            + 4 * float(c["FTL_QUORUM_ELECTION_TIMEOUT"]))


def stopped(job: LocalJob, replica: int) -> list[WorkerStopped]:
    return [e for e in job.events(replica) if isinstance(e, WorkerStopped)]


def finish(job: LocalJob, timeout: float = 120) -> dict[int, int]:
    return job.wait_all(patience(timeout))


def assert_closed_finished(job: LocalJob) -> None:
    codes = finish(job)
    assert codes == dict.fromkeys(range(job.replicas), 0), \
        {r: job.log(r)[-3000:] for r in codes}
    for replica in range(job.replicas):
        assert [e.finished for e in stopped(job, replica)] == [True], job.log(replica)[-3000:]
    assert (job.run_dir / FINISHED_FILE).exists()
    assert not held_dir(job).exists(), "a finished run left its held backups in /dev/shm"


def test_leaving_the_with_block_closes_and_leaves_nothing_in_dev_shm(tmp_path):
    job = lifecycle_job(tmp_path, replicas=2, steps=10, end="with")
    job.start_all()
    try:
        assert_closed_finished(job)
    finally:
        job.stop_everything()


def test_a_script_that_never_closes_exits_cleanly_every_time(tmp_path):
    """No ``with``, no ``close()``: the interpreter's exit closes the manager before its
    threads are stopped. A 20 MB model keeps the last step's snapshot copying when the
    script returns: left running, it made the process abort (SIGABRT) in about half
    the runs. Three runs, so a flaky abort shows."""
    for run in range(3):
        job = lifecycle_job(tmp_path / f"run-{run}", replicas=2, steps=4, end="bare",
                            extra=("--width", "500000"))
        job.start_all()
        try:
            assert_closed_finished(job)
        finally:
            job.stop_everything()


def test_an_exception_in_the_with_block_propagates_after_close(tmp_path):
    job = lifecycle_job(tmp_path, replicas=2, steps=10, end="raise",
                        extra=("--raise-at", "3"))
    job.start_all()
    try:
        codes = finish(job)
        assert codes == {0: 1, 1: 1}, {r: job.log(r)[-3000:] for r in codes}
        for replica in range(2):
            log = job.log(replica)
            assert "Traceback" in log and "RuntimeError: boom at step 3" in log, log[-3000:]
            assert [(e.finished, e.next_step) for e in stopped(job, replica)] == [(False, 3)]
        # not a finished run: the held backups stay for the job's next incarnation
        assert not (job.run_dir / FINISHED_FILE).exists()
        assert held_dir(job).exists()
    finally:
        job.stop_everything()
        HeldFiles(held_dir(job)).discard()


def test_sigterm_stops_a_replica_through_close_and_the_others_go_on(tmp_path):
    """SIGTERM (how Slurm and ft-launch local stop a replica) closes the manager: the
    replica's ``WorkerStopped`` comes within what closing may wait for (a ring transfer
    in flight, a quorum attempt), it exits 143, and the others train on to the end."""
    steps = 60
    job = lifecycle_job(tmp_path, replicas=3, steps=steps, end="with")
    job.start_all()
    try:
        wait_until(lambda: job.last_committed_step(2) >= 5, 120, "replica 2 to commit step 5")
        sent = time.time()
        job.current(2).send_signal(signal.SIGTERM)
        code = job.current(2).wait(patience(60))
        assert code == TERMINATED_CODE, job.log(2)[-3000:]
        (closed,) = stopped(job, 2)
        assert not closed.finished
        bound = float(job.config_env["FTL_FTAR_TIMEOUT"]) + quorum_attempt(job)
        assert closed.time - sent < bound, (closed.time - sent, bound)
        codes = finish(job)
        assert codes == {0: 0, 1: 0, 2: TERMINATED_CODE}, {r: job.log(r)[-3000:] for r in codes}
        for replica in (0, 1):
            commits = job.committed(replica)
            assert commits[-1].step == steps - 1
            assert any(e.contributors == 2 for e in commits if e.step > closed.next_step)
        assert not held_dir(job).exists()
    finally:
        job.stop_everything()


def test_a_replica_started_after_the_run_finished_exits_at_once(tmp_path):
    """It restores, finds the run's end marked and exits 77 before asking any quorum:
    sooner than its first incarnation took to start plus one quorum attempt, where it
    used to retry the quorum until its failure budget ran out (or forever)."""
    job = lifecycle_job(tmp_path, replicas=3, steps=10, end="with")
    launched = time.time()
    job.start_all()
    try:
        assert_closed_finished(job)
        (first,) = [e for e in job.events(1) if isinstance(e, WorkerStarted)]
        startup = first.time - launched
        before = len(job.log(1))
        started = time.monotonic()
        job.start(1)
        code = job.current(1).wait(patience(120))
        took = time.monotonic() - started
        late = job.log(1)[before:]
        assert code == ExitCode.RUN_FINISHED, late[-3000:]
        assert "the run finished at step 9" in late and "nothing to join" in late, late[-3000:]
        assert "no quorum for step" not in late, late[-3000:]
        assert took < startup + patience(quorum_attempt(job)), (took, startup)
        assert not held_dir(job).exists(), "the late replica left held backups in /dev/shm"
    finally:
        job.stop_everything()


def test_a_replica_with_no_quorum_to_reach_ends_within_its_failure_budget(tmp_path):
    """Replica 0 of 3 alone (the others gone): it waits for ``max_consecutive_failures``
    quorum attempts, then exits 75 saying what it waited for, how long, and the setting
    that bounds it."""
    job = lifecycle_job(tmp_path, replicas=3, steps=10, end="with")
    job.start(0)
    try:
        code = job.current(0).wait(patience(120))
        log = job.log(0)
        assert code == ExitCode.RECOVERABLE, log[-3000:]
        assert "could not join: no quorum for step 0 in" in log, log[-3000:]
        assert f"runtime.max_consecutive_failures = {BUDGET} bounds this wait" in log
        (began,) = [e for e in job.events(0) if isinstance(e, WorkerStarted)]
        (closed,) = stopped(job, 0)
        assert not closed.finished
        attempts = int(BUDGET)
        assert closed.time - began.time < (attempts + 1) * quorum_attempt(job)
        assert held_dir(job).exists()   # not finished: kept for the job's next incarnation
    finally:
        job.stop_everything()
        HeldFiles(held_dir(job)).discard()
