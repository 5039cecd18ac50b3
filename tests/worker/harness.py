"""The example training as local replica processes, with test settings."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

from ft_launch.files import atomic_write_text
from ft_launch.launcher.worker.audit import check_exactly_once
from ft_launch.launcher.worker.local import LocalJob, free_port
from tests.waiting import patience, wait_until

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "etc" / "examples" / "gpt" / "train.py"

#: Fast failure detection for tests (seconds), through the real config path (FTL_*).
TEST_CONFIG = {
    "FTL_QUORUM_HEARTBEAT_INTERVAL": "0.1", "FTL_QUORUM_ELECTION_TIMEOUT": "0.5",
    "FTL_QUORUM_MEMBER_TIMEOUT": "1.0", "FTL_QUORUM_JOIN_TIMEOUT": "1.0",
    "FTL_FTAR_TIMEOUT": "3", "FTL_FTAR_CONNECT_TIMEOUT": "3",
    "FTL_CKPT_FETCH_TIMEOUT": "30", "FTL_CKPT_PERSIST_EVERY": "1000",
    "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": "50",
}
BATCH = 8


def loopback_job(run_dir: Path, replicas: int, steps: int, size: str = "tiny",
                 ranks: int = 1, parallel: str = "fsdp", **config: str) -> LocalJob:
    """``config``: FTL_* settings over ``TEST_CONFIG``; ``parallel``: inside a replica,
    FSDP2 (the example's default), DDP or by hand (``none``)."""
    return LocalJob(run_dir, replicas,
                    [sys.executable, str(TRAIN), "--steps", str(steps), "--size", size,
                     "--batch-size", str(BATCH), "--threads", "1", "--parallel", parallel],
                    {**TEST_CONFIG, **config}, ranks=ranks)


def restored_states(job: LocalJob) -> list:
    """Every ``StateRestored`` of every replica's rank 0, replica by replica."""
    return [e for r in range(job.replicas) for e in job.events(r)
            if type(e).__name__ == "StateRestored"]


def check_run(job: LocalJob, steps: int) -> list[int]:
    """Exactly-once audit; returns the final positions."""
    summary = check_exactly_once(job.run_dir, job.replicas, steps)
    assert all(p % BATCH == 0 for p in summary.positions)
    return list(summary.positions)


#: Slack in a stall bound, in this run's own steps: whatever else a recovery costs
#: (a step redone, the newcomer's catch-up served), as slow as the machine is now.
STALL_SLACK_STEPS = 50


def commit_gaps(events: list, start_step: int = 1) -> list[float]:
    """Wall-clock gaps between consecutive commits (from ``start_step``), sorted."""
    times = sorted(e.time for e in events if type(e).__name__ == "StepCommitted"
                   and e.step >= start_step)
    return sorted(b - a for a, b in itertools.pairwise(times))


def max_gap(events: list, start_step: int = 1) -> float:
    """Longest wall-clock gap between consecutive commits (from ``start_step``)."""
    return max(commit_gaps(events, start_step), default=0.0)


def stall_bound(detection_s: float, events: list) -> float:
    """The longest pause a healthy replica may take over a fault: the detection the
    config allows (``detection_s``), twice over, and ``STALL_SLACK_STEPS`` of the
    replica's median step in the same run, so that a loaded machine, which slows
    every step, widens the bound and an idle one keeps it tight."""
    gaps = commit_gaps(events)
    assert gaps, "no steps to measure"
    return 2 * detection_s + STALL_SLACK_STEPS * gaps[len(gaps) // 2]


def restart_and_end_once_caught_up(job: LocalJob, replica: int, ahead: int,
                                   timeout: float = 120) -> int:
    """Start ``replica`` again once its kill took it down, then ``end_once_caught_up``;
    returns that end step. However slow the restart, the others still train then."""
    wait_until(lambda: job.current(replica).poll() is not None, timeout,
               f"replica {replica} to die")
    job.start(replica)
    return end_once_caught_up(job, replica, ahead, timeout)


def end_once_caught_up(job: LocalJob, replica: int, ahead: int, timeout: float = 120,
                       at_least: int = 0) -> int:
    """Wait for ``replica`` (started again, or resumed) to catch up, then end the run
    (the example's ``end-step`` file) ``ahead`` steps past the newest commit, or at
    step ``at_least`` if that is later; returns that end step. A run sized so stays
    long enough to watch a recovery however slow the machine is."""
    wait_until(lambda: any(e.caught_up for e in job.committed(replica)), timeout,
               f"replica {replica} to catch up")
    end = max(at_least, max(job.last_committed_step(r) for r in range(job.replicas)) + ahead)
    atomic_write_text(job.run_dir / "end-step", str(end), durable=False)
    return end


def logs_of_a_failed_run(job: LocalJob, timeout: float = 180) -> list[str]:
    """Start every replica, require each to fail, and return each replica's log."""
    job.start_all()
    try:
        codes = job.wait_all(timeout=patience(timeout))
    finally:
        job.stop_everything()
    assert all(code != 0 for code in codes.values()), codes
    return [job.log(replica) for replica in range(job.replicas)]


def run_torch_world(command: list[str], processes: int, timeout: float = 180) -> None:
    """``command`` as one native torch world of ``processes`` processes (what torchrun
    sets: RANK, WORLD_SIZE, MASTER_ADDR/PORT), each required to exit 0."""
    port = free_port()
    procs = [subprocess.Popen(
        command, env={**os.environ, "RANK": str(rank), "WORLD_SIZE": str(processes),
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "OMP_NUM_THREADS": "1"})
        for rank in range(processes)]
    assert [p.wait(timeout=patience(timeout)) for p in procs] == [0] * processes
