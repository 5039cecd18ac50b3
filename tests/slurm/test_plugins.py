"""The health hooks on the real lab cluster: slurmd runs ft's Prolog, Epilog and
HealthCheckProgram; faults are simulated per node (``<faults>/<node>.json``).

* a simulated GPU fault on one node: its Prolog fails, the node is drained with
  the precise reason (and Slurm requeues and holds the job, as measured);
* the HealthCheckProgram drains a node whose simulated disk is full;
* the Epilog after a failed job runs the deeper profile, after a good one the
  normal one;
* the step-level gate fails only its own step on a faulty node;
* the Epilog drains a node the job's controller evicted but could not drain;
* dual-phase replay, one srun step per row and per column, finds the node
  injected with silent data corruption.

Hooks are configured per test and removed afterwards (with hooks every
allocation takes ~3 s longer, see shared/docs/slurm-lab.md).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from ft_launch.health.drain_request import job_comment, write_request
from ft_launch.health.replay import ReplayStatus, plan_replay_grid
from ft_launch.health.replay_runner import SrunGroupLauncher, run_replay
from ft_launch.slurm.client import SlurmCli
from tests.cluster import labcluster
from tests.health.replay_job import reference_digest
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

NODE_UNHEALTHY = 76
#: the stand-in replay job (run by path: the nodes share the checkout, as for tests/slurm/jobs)
REPLAY_JOB = Path(__file__).parents[1] / "health" / "replay_job.py"


@dataclass
class HealthLab:
    faults: Path                     # <faults>/<node>.json: simulated faults of one node
    reports: Path                    # <reports>/<node>/<hook>-<job>.json: what each hook did
    tmp: Path
    env: dict[str, str]              # for Slurm clients on the login node
    wrapper: Callable[[str], str]    # hook name -> program path for slurm.conf


@pytest.fixture
def health(slurm_cluster, tmp_path):
    """A health config with simulated GPUs, hook wrappers, and cleanup of hooks,
    faults and drained nodes after the test."""
    faults, reports = tmp_path / "faults", tmp_path / "reports"
    faults.mkdir()
    reports.mkdir()
    config = tmp_path / "health.toml"
    config.write_text(f'[health]\ngpus_per_node = 8\nbackend = "simulated"\n'
                      f'sim_fault_dir = "{faults}"\nreport_dir = "{reports}"\n'
                      f'log_file = "{tmp_path / "hooks.log"}"\n'
                      f'[checks.disk]\npaths = ["/"]\nmin_free_bytes = 1048576\n'
                      f'[checks.shm]\nmin_free_bytes = 1048576\n')

    def wrapper(hook: str) -> str:
        # slurmd runs hooks with no PATH and only SLURM_* variables: the wrapper names the
        # config, the Slurm config (for scontrol) and the interpreter, nothing from the job.
        path = tmp_path / f"ft-{hook}"
        path.write_text("\n".join([
            "#!/bin/sh",
            f"export FTL_CONFIG={shlex.quote(str(config))}",
            f"export SLURM_CONF={shlex.quote(str(labcluster.state_dir() / 'slurm.conf'))}",
            f"exec {shlex.quote(sys.executable)} -m ft_launch.slurm_plugins.{hook}", ""]))
        path.chmod(0o755)
        return str(path)

    env = {**labcluster.client_env(), "FTL_CONFIG": str(config)}
    try:
        yield HealthLab(faults, reports, tmp_path, env, wrapper)
    finally:
        labcluster.configure(labcluster.Hooks())
        for fault in faults.glob("*.json"):
            fault.unlink()
        for node in slurm_cluster.nodes:
            slurm_cluster.ensure_node_up(node)


def inject(health, node: str, *faults: dict) -> None:
    (health.faults / f"{node}.json").write_text(json.dumps(list(faults)))


def node_reason(cluster, node: str) -> str:
    (info,) = cluster.slurm.nodes((node,))
    return info.reason if info.drained else ""


def batch_script(tmp_path: Path, name: str, body: str) -> Path:
    script = tmp_path / name
    script.write_text(f"#!/bin/bash\n{body}\n")
    return script


def test_prolog_drains_the_node_with_a_simulated_gpu_fault(slurm_cluster, health):
    inject(health, "n2", {"gpu": 3, "xid": 79})
    labcluster.configure(labcluster.Hooks(prolog=health.wrapper("prolog"), prolog_flags="Alloc"))
    job_id = slurm_cluster.sbatch(batch_script(health.tmp, "job.sh", "true"), "--nodes=1",
                                  "--nodelist=n2", "--output=/dev/null")
    try:
        reason = wait_until(lambda: node_reason(slurm_cluster, "n2"), 90, "n2 to be drained")
        assert reason.startswith("ft: gpu3 xid 79"), reason
        job = wait_until(lambda: (j := slurm_cluster.slurm.job(job_id)) and
                         j.state.value == "PENDING" and j, 60, "the job to be requeued")
        assert "held" in job.reason.lower() or job.restarts >= 1, job
        report = json.loads((health.reports / "n2" / f"prolog-{job_id}.json").read_text())
        assert report["status"] == "fail"
        assert not node_reason(slurm_cluster, "n1")      # the fault was n2's alone
    finally:
        slurm_cluster.cancel(job_id)


def test_healthcheck_drains_a_node_whose_disk_is_full(slurm_cluster, health):
    inject(health, "n3", {"disk_free_bytes": 0, "path": "/"})
    labcluster.configure(labcluster.Hooks(healthcheck=health.wrapper("healthcheck"),
                                          healthcheck_interval=5))
    reason = wait_until(lambda: node_reason(slurm_cluster, "n3"), 120, "n3 to be drained")
    assert reason.startswith("ft: disk / free 0B<1MiB"), reason
    wait_until(lambda: (health.reports / "n4" / "healthcheck.json").exists(), 60,
               "the healthcheck to run on n4 too")
    assert not node_reason(slurm_cluster, "n4")


def test_epilog_runs_the_deeper_profile_after_a_failed_job(slurm_cluster, health):
    labcluster.configure(labcluster.Hooks(epilog=health.wrapper("epilog")))
    profiles = {}
    for name, body in (("good", "true"), ("bad", "exit 3")):
        job_id = slurm_cluster.sbatch(batch_script(health.tmp, f"{name}.sh", body),
                                      "--nodes=1", "--nodelist=n4", "--output=/dev/null")
        slurm_cluster.wait_job_done(job_id)
        report = health.reports / "n4" / f"epilog-{job_id}.json"
        wait_until(report.exists, 60, f"the epilog of job {job_id}")
        profiles[name] = json.loads(report.read_text())["profile"]
    assert profiles == {"good": "epilog", "bad": "epilog_failure"}
    assert not node_reason(slurm_cluster, "n4")


def allocate(nodes: list[str]) -> str:
    done = labcluster.ctl_run(["salloc", "--no-shell", "--no-kill", f"--nodes={len(nodes)}",
                               f"--nodelist={','.join(nodes)}"], timeout=60)
    match = re.search(r"Granted job allocation (\d+)", done.stdout + done.stderr)
    assert match, done.stdout + done.stderr
    return match.group(1)


def test_gate_fails_only_the_step_on_the_faulty_node(slurm_cluster, health):
    inject(health, "n5", {"gpu": 0, "recovery_action": "gpu_reset"})
    job_id = allocate(["n5", "n6"])
    try:
        def gate_step(node: str) -> subprocess.CompletedProcess:
            return subprocess.run(
                [*labcluster.ctl_prefix(), "srun", f"--jobid={job_id}", "--nodes=1",
                 f"--nodelist={node}", "--ntasks=1", "--exact", sys.executable, "-m",
                 "ft_launch.slurm_plugins.gate", "--", "true"],
                check=False, capture_output=True, text=True, timeout=120, env=health.env)
        bad, good = gate_step("n5"), gate_step("n6")
        assert bad.returncode == NODE_UNHEALTHY, bad.stderr
        assert "ft-gate: n5 unhealthy: gpu0 needs gpu_reset" in bad.stderr
        assert good.returncode == 0, good.stderr
        assert slurm_cluster.job_state(job_id) == "RUNNING"   # only the step failed
    finally:
        slurm_cluster.cancel(job_id)


def test_dual_phase_replay_finds_the_corrupting_node(slurm_cluster, health):
    inject(health, "n3", {"sdc": True})
    nodes = ["n1", "n2", "n3", "n4"]
    job_id = allocate(nodes)
    try:
        slurm = SlurmCli(env=health.env, prefix=labcluster.ctl_prefix())
        launcher = SrunGroupLauncher(slurm, [sys.executable, str(REPLAY_JOB),
                                             "--expect", reference_digest()],
                                     job_id=job_id, timeout=120)
        grid = plan_replay_grid(nodes, pp=1, dp=4, k=2)          # 2 rows x 2 columns
        verdict, outcomes = run_replay(grid, launcher)
        assert (verdict.status, verdict.suspects) == (ReplayStatus.FOUND, ("n3",)), outcomes
    finally:
        slurm_cluster.cancel(job_id)


def test_epilog_drains_a_node_the_controller_evicted_without_operator_rights(
        slurm_cluster, health):
    """The controller could not drain (no rights): it left a request in its run
    directory and named that in the job's Comment; the Epilog on the node drains it."""
    labcluster.configure(labcluster.Hooks(epilog=health.wrapper("epilog")))
    job_id = allocate(["n3", "n4"])
    run_dir = health.tmp / "run"
    try:
        write_request(run_dir, job_id, "n3", "replica 1 made no progress for 12 s")
        slurm_cluster.slurm.set_comment(job_id, job_comment(run_dir))
    finally:
        slurm_cluster.cancel(job_id)
    reason = wait_until(lambda: node_reason(slurm_cluster, "n3"), 90, "n3 to be drained")
    assert f"evicted by ft-launch (job {job_id}): replica 1 made no progress for 12 s" \
        in reason, reason
    wait_until((health.reports / "n4" / f"epilog-{job_id}.json").exists, 60, "n4's epilog")
    assert not node_reason(slurm_cluster, "n4")   # the request named n3 only
