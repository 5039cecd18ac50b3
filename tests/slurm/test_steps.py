"""Foundation tests on the real Slurm cluster: one srun step per replica, steps are
independent, and a dead node does not take the allocation down."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ft_launch.ids import StepRef
from ft_launch.slurm.commands import StepSpec, srun_argv
from tests.cluster import labcluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

JOBS = Path(__file__).parent / "jobs"


def write_batch(tmp_path: Path, replicas: int, standby: int, wait: bool) -> Path:
    """A batch script that plans with ft-launch and launches one step per replica."""
    task = [sys.executable, str(JOBS / "replica_task.py"), str(tmp_path)]
    if wait:
        task += ["--wait-for", str(tmp_path / "release")]
    script = tmp_path / "job.sbatch"
    plan = (f"{shlex.quote(sys.executable)} -m ft_launch.launcher.cli plan --replicas {replicas} "
            f"--standby {standby}")
    script.write_text("\n".join([
        "#!/bin/bash",
        "set -euo pipefail",
        f"cd {shlex.quote(str(tmp_path))}",
        f"{plan} --json -- {shlex.join(task)} > plan.json",
        f"{plan} --shell -- {shlex.join(task)} > steps.sh",
        "exec bash steps.sh",
        ""]))
    return script


def records(tmp_path: Path, suffix: str) -> dict[str, dict]:
    return {json.loads(p.read_text())["replica"]: json.loads(p.read_text())
            for p in tmp_path.glob(f"*.{suffix}")}


def replica_steps(cluster, job_id: str) -> dict[str, StepRef]:
    return {s.name: s.step for s in cluster.slurm.steps(job_id) if s.name.startswith("replica-")}


def test_plan_then_one_step_per_replica_on_disjoint_nodes(slurm_cluster, tmp_path):
    job_id = slurm_cluster.sbatch(write_batch(tmp_path, replicas=3, standby=1, wait=False),
                                  "--no-kill", "--nodes=4", "--output=job.out")
    try:
        assert slurm_cluster.wait_job_done(job_id) == "COMPLETED", \
            (tmp_path / "job.out").read_text()
    finally:
        slurm_cluster.cancel(job_id)
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["job_id"] == job_id
    done = records(tmp_path, "finished")
    assert sorted(done) == ["0", "1", "2"]
    hosts = {replica: rec["host"] for replica, rec in done.items()}
    assert len(set(hosts.values())) == 3, hosts  # disjoint nodes
    for replica in plan["replicas"]:
        assert [hosts[str(replica["replica_id"])]] == replica["nodes"]
    assert plan["standby"] and plan["standby"][0] not in hosts.values()
    assert {rec["step"] for rec in done.values()} == {"0", "1", "2"}  # one step each


def test_scancel_of_one_step_leaves_the_others_running(slurm_cluster, tmp_path):
    # 4 nodes: the batch host trains nothing by default (job.batch_host = "standby")
    job_id = slurm_cluster.sbatch(write_batch(tmp_path, replicas=3, standby=0, wait=True),
                                  "--no-kill", "--nodes=4", "--output=job.out")
    try:
        wait_until(lambda: len(records(tmp_path, "started")) == 3, 60, "3 replicas to start")
        steps = replica_steps(slurm_cluster, job_id)
        slurm_cluster.slurm.cancel_step(steps["replica-1"])
        wait_until(lambda: "replica-1" not in replica_steps(slurm_cluster, job_id), 30,
                   "the cancelled step to leave the job")
        assert set(replica_steps(slurm_cluster, job_id)) == {"replica-0", "replica-2"}
        (tmp_path / "release").touch()
        wait_until(lambda: len(records(tmp_path, "finished")) == 2, 60, "survivors to finish")
        assert sorted(records(tmp_path, "finished")) == ["0", "2"]
        slurm_cluster.wait_job_done(job_id)
        assert slurm_cluster.slurm.job(job_id).restarts == 0
    finally:
        slurm_cluster.cancel(job_id)


def test_dead_node_spares_the_job_and_a_spare_takes_a_new_step(slurm_cluster, tmp_path):
    job_id = slurm_cluster.sbatch(write_batch(tmp_path, replicas=3, standby=1, wait=True),
                                  "--no-kill", "--nodes=4", "--output=job.out")
    victim = None
    try:
        wait_until(lambda: len(records(tmp_path, "started")) == 3, 60, "3 replicas to start")
        plan = json.loads((tmp_path / "plan.json").read_text())
        victim = plan["replicas"][1]["nodes"][0]
        spare = plan["standby"][0]
        killed = labcluster.kill_node(victim)  # slurmd and the replica's task, like a crash
        assert killed
        # A replacement step on the spare node of the same allocation, from the login node.
        spec = StepSpec(nodes=(spare,), job_id=job_id, name="replica-1",
                        command=(sys.executable, str(JOBS / "replica_task.py"), str(tmp_path),
                                 "--wait-for", str(tmp_path / "release")),
                        extra_args=("--export=ALL,FTL_WORKER_REPLICA_ID=1r",))
        replacement = subprocess.Popen(labcluster.ctl_prefix() + srun_argv(spec),
                                       env=labcluster.client_env())
        wait_until(lambda: "1r" in records(tmp_path, "started"), 60, "replacement to start")
        assert records(tmp_path, "started")["1r"]["host"] == spare
        (tmp_path / "release").touch()
        assert replacement.wait(timeout=60) == 0
        wait_until(lambda: {"0", "2", "1r"} <= set(records(tmp_path, "finished")), 60,
                   "survivors and the replacement to finish")
        assert "1" not in records(tmp_path, "finished")  # the crashed replica never finished
        job = slurm_cluster.slurm.job(job_id)
        assert job.restarts == 0 and job.state.value in ("RUNNING", "COMPLETING", "COMPLETED",
                                                         "FAILED")
    finally:
        slurm_cluster.cancel(job_id)
        if victim:
            slurm_cluster.ensure_node_up(victim)
