"""Shared fixtures. The real Slurm cluster starts once per session, only when a test
marked ``slurm`` asks for it; a cluster already up (started by .ci/run) is reused
and left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ft_launch.errors import SlurmCommandError
from ft_launch.slurm.client import SlurmCli
from tests.cluster import labcluster
from tests.faults import lab_env
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[1]

# Every worker the tests start (loopback, and the lab cluster's jobs: they inherit
# this environment) has the fault injector as its step observer, as the tests inject
# faults through FTL_WORKER_INJECT and the simulated GPUs' fault files. Unset in
# production: there the observer is the no-op one (tests/worker/test_observer.py).
for _name, _value in lab_env().items():
    os.environ.setdefault(_name, _value)

#: --end-by and --run-first, for running part of a tier within CI's time.
pytest_plugins = ["tests.budget"]


@dataclass
class LabCluster:
    """Handle on the running lab cluster for tests."""

    nodes: list[str]
    slurm: SlurmCli  # client commands run on the login node (controller namespace)

    def sbatch(self, script: Path, *args: str) -> str:
        out = labcluster.ctl_run(["sbatch", "--parsable", *args, str(script)], timeout=30,
                                 cwd=script.parent)
        return out.stdout.strip().split(";")[0]

    def cancel(self, job_id: str) -> None:
        labcluster.ctl_run(["scancel", job_id], check=False, timeout=30)

    def job_state(self, job_id: str) -> str:
        """The job's state; "UNANSWERED" while slurmctld does not answer in time (it
        can stall for its MessageTimeout on a crashed node): the waits poll again."""
        try:
            job = self.slurm.job(job_id)
        except SlurmCommandError as error:
            if "timed out" not in str(error) and "did not answer" not in str(error):
                raise
            return "UNANSWERED"
        return job.state.value if job else "GONE"

    def wait_job_done(self, job_id: str, timeout: float = 120) -> str:
        return wait_until(lambda: (s := self.job_state(job_id)) not in
                          ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                                        "UNANSWERED") and s,
                          timeout, f"job {job_id} to end")

    def ensure_node_up(self, node: str, timeout: float = 90) -> None:
        """Bring a node back after a fault test and wait until Slurm can use it."""
        labcluster.heal_node(node, timeout)


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LabCluster]:
    if os.geteuid() != 0:
        pytest.skip("the Slurm lab cluster needs root (network namespaces, daemons)")
    already_up = labcluster.current_state() is not None
    state = labcluster.up()
    cluster = LabCluster(nodes=state.nodes, slurm=SlurmCli(env=labcluster.client_env(),
                                                           prefix=labcluster.ctl_prefix()))
    try:
        yield cluster
    finally:
        if not already_up:
            labcluster.down(keep_logs=False)


@pytest.fixture
def stack_workers() -> Iterator:
    """Start stand-in training processes (``tests/health/stack_worker.py``), each blocked
    in the named function of its own once it says so; SIGCONTed, killed and reaped
    afterwards."""

    script = Path(__file__).with_name("health") / "stack_worker.py"
    started: list[subprocess.Popen[str]] = []

    def start(function: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, str(script), function],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"ready {function}"   # blocks until it is
        return proc

    yield start
    for proc in started:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)
