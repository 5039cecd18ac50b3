"""Training with a witness: two loopback replicas of the example model and one
``ft-launch witness`` process. The survivor of a killed replica trains on alone
(one replica and the witness are a majority of the votes), the replacement
catches up and rejoins, and every sample is trained exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import ft_launch.ckpt.restore  # noqa: F401  (registers CheckpointRestored: job.committed reads it)
from ft_launch.launcher.quorum.witness_service import WitnessJob
from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience, wait_until
from tests.worker.harness import check_run, loopback_job, max_gap, stall_bound

pytestmark = [pytest.mark.timeout(300)]

STEPS = 600


def start_witness(job: LocalJob, index: int) -> subprocess.Popen[bytes]:
    """``ft-launch witness`` for ``job`` (the controller's witness file, written here
    as ``ft-launch run`` writes it; LocalJob has no controller)."""
    WitnessJob("local", job.secret, job.replicas, controller=False,
               nodes=(("local", "127.0.0.1"),)).write(job.run_dir)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTL_")}
    env.update(job.config_env)
    log = (job.run_dir / f"witness-{index}.log").open("ab")
    return subprocess.Popen([sys.executable, "-m", "ft_launch.launcher.cli", "witness", "--run-dir",
                             str(job.run_dir), "--index", str(index)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def detection(job: LocalJob) -> float:
    """What the config allows a survivor to take to go on alone: the quorum notices
    the silence (member timeout), a new leader is elected if the dead one led
    (election timeout, twice for the random spread), and a join window."""
    c = job.config_env
    return (float(c["FTL_QUORUM_MEMBER_TIMEOUT"]) + 2 * float(c["FTL_QUORUM_ELECTION_TIMEOUT"])
            + float(c["FTL_QUORUM_JOIN_TIMEOUT"]))


def test_two_replicas_and_a_witness_the_survivor_trains_on_and_the_replacement_rejoins(
        tmp_path: Path) -> None:
    job = loopback_job(tmp_path, replicas=2, steps=STEPS, FTL_QUORUM_WITNESSES="1")
    tmp_path.mkdir(exist_ok=True)
    witness = start_witness(job, 1)
    job.start_all({1: "kill@after_commit:10"})
    try:
        wait_until(lambda: job.current(1).poll() is not None, 120, "replica 1 to die")
        assert job.current(1).returncode == -signal.SIGKILL
        # Alone: without the witness's votes it would wait for replica 1 (a majority
        # of 2 replicas is 2); with them it trains on.
        wait_until(lambda: job.last_committed_step(0) >= 40, 120, "replica 0 to train alone")
        alone = [e for e in job.committed(0) if 10 < e.step <= 40]
        assert alone and all(e.contributors == 1 for e in alone)
        job.start(1)
        codes = job.wait_all(patience(180))
        assert codes == {0: 0, 1: 0}, {r: job.log(r)[-3000:] for r in codes}
    finally:
        job.stop_everything()
        witness.send_signal(signal.SIGTERM)
        witness.wait(timeout=30)
    finals = job.finals()
    assert len({f["state_sha256"] for f in finals.values()}) == 1, finals
    check_run(job, STEPS)
    events = job.events(0)
    gap, bound = max_gap(events), stall_bound(detection(job), events)
    assert gap < bound, f"the survivor stalled {gap:.1f} s (bound {bound:.1f} s)"
    assert any(e.caught_up for e in job.committed(1))
    assert witness.returncode == 0, (tmp_path / "witness-1.log").read_text()
