"""The README's real-world examples under ``ft-launch run`` on the lab cluster, a
replica's node killed mid-run: the warm standby takes its place, catches up from the
survivor, and the run completes with both replicas' own checkpoints identical and
every sample trained exactly once.

Two replicas with ``quorum.min_replicas`` 2: the survivor cannot train alone, so the
run cannot end before the replacement is back, however fast the machine (the
examples are native scripts, with no pacing of their own).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ft_launch.launcher.controller import events as controller_events
from ft_launch.launcher.reporting.runlog import commits, controller_log
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.slurm.test_run import FAST_DETECTION, REPO, crash
from tests.waiting import patience, wait_until
from tests.worker.test_examples import differing, flat

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]

REPLICAS, STANDBY = 2, 1
#: Steps of each example: long enough that the kill lands mid-run on any machine (the
#: survivor then waits for the replacement, so a slow machine only makes it longer).
STEPS = {"tokens": 300, "hf_llama": 120}
KILL_AFTER_STEP = 3
SETTINGS = {**FAST_DETECTION, "FTL_QUORUM_MIN_REPLICAS": str(REPLICAS),
            # the survivor retries its quorum about once a second until the standby is back
            "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": "600"}


EXAMPLES = REPO / "etc" / "examples"


def command(example: str, data: Path, out: Path) -> list[str]:
    """The adopted script's command line (each replica of one rank)."""
    common = [sys.executable, str(EXAMPLES / example / "train.py"), str(data), "--out",
              str(out), "--steps", str(STEPS[example]), "--batch-size", "16", "--warmup", "20"]
    if example == "tokens":
        return [*common, "--eval-every", "100", "--ckpt-every", "100000"]
    return [*common, "--replicate", str(REPLICAS), "--log-every", "100"]


def final_states(example: str, out: Path) -> list[dict[str, object]]:
    """Each replica's own checkpoint at the end (model, optimizer, scheduler, step)."""
    name = "ckpt-replica{}.pt" if example == "tokens" else "state-replica{}.pt"
    return [flat(torch.load(out / name.format(r), weights_only=False)) for r in range(REPLICAS)]


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> Path:
    """The token files both examples train on (the tokens example's prepare.py)."""
    data = tmp_path_factory.mktemp("tokens")
    subprocess.run([sys.executable, str(EXAMPLES / "tokens" / "prepare.py"), str(data)],
                   check=True, capture_output=True, timeout=patience(60))
    return data


@pytest.fixture
def submitted(slurm_cluster, tmp_path) -> Iterator[Callable[[list[str]], tuple[str, Path]]]:
    """Submit a command under ``ft-launch run`` (one node per replica, a standby);
    afterwards cancel the job and heal every node."""
    jobs: list[str] = []

    def submit(command: list[str]) -> tuple[str, Path]:
        script = tmp_path / "example.sbatch"
        script.write_text("#!/bin/bash\n#SBATCH --no-kill\n#SBATCH --exclusive\n"
                          f"exec ft-launch run --replicas {REPLICAS} --standby {STANDBY} "
                          f"--tasks-per-node 1 -- {shlex.join(command)}\n")
        runs = tmp_path / "runs"
        exports = {"FTL_RUN_LOG_DIR": str(runs), "OMP_NUM_THREADS": "1", **SETTINGS}
        job_id = slurm_cluster.sbatch(
            script, f"--chdir={REPO}", f"--nodes={REPLICAS + STANDBY}",
            f"--output={tmp_path}/job.out",
            "--export=" + ",".join(["ALL", *(f"{k}={v}" for k, v in exports.items())]))
        jobs.append(job_id)
        return job_id, runs / job_id

    yield submit
    for job_id in jobs:
        slurm_cluster.cancel(job_id)
    for node in slurm_cluster.nodes:
        slurm_cluster.ensure_node_up(node)


def last_step(run_dir: Path, replica: int) -> int:
    return max((e.step for e in commits(run_dir).get(replica, [])), default=-1)


@pytest.mark.parametrize("example", sorted(STEPS))
def test_an_example_goes_on_through_a_killed_node(example, token_data, submitted,
                                                   slurm_cluster, tmp_path):
    out, steps = tmp_path / "out", STEPS[example]
    job_id, run_dir = submitted(command(example, token_data, out))
    wait_until(lambda: all(last_step(run_dir, r) >= KILL_AFTER_STEP for r in range(REPLICAS)),
               240, f"both replicas to commit step {KILL_AFTER_STEP}")
    launched = {e.replica_id: e.nodes[0] for e in controller_log(run_dir)
                if isinstance(e, controller_events.ReplicaLaunched)}
    batch_host = slurm_cluster.slurm.job(job_id).batch_host
    victim_replica = next(r for r in sorted(launched, reverse=True)
                          if launched[r] != batch_host)
    at_kill = last_step(run_dir, victim_replica)
    assert at_kill < steps - 1, f"the run ended (step {at_kill}) before the kill"
    crash(launched[victim_replica])
    state = slurm_cluster.wait_job_done(job_id, timeout=patience(300))
    assert state == "COMPLETED", (tmp_path / "job.out").read_text()[-3000:]
    promoted = [e for e in controller_log(run_dir)
                if isinstance(e, controller_events.StandbyPromoted)]
    assert [e.replica_id for e in promoted] == [victim_replica]
    caught_up = [e.step for e in commits(run_dir)[victim_replica] if e.caught_up]
    assert caught_up and caught_up[0] > at_kill
    first, second = final_states(example, out)
    assert not differing(first, second), differing(first, second)[:10]
    assert first["/step"] == steps
    check_exactly_once(run_dir, REPLICAS, steps)
