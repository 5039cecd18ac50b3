"""``ft-launch submit`` from the lab's login node, for black-box tests.

The controller then runs in the login node's namespace (``ftlctl``), detached, as
it would on a real login node: no node of the allocation carries it, and its
hostname is the machine's, which resolves to loopback there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.cluster import labcluster
from tests.slurm.test_run import FAST_DETECTION, REPO, Training, train_command
from tests.waiting import wait_until


@contextmanager
def submitted(cluster, tmp_path: Path, *, replicas: int, standby: int, steps: int,
              **settings: str) -> Iterator[tuple[Training, int]]:
    """The example training submitted from the login node: ``(run, controller pid)``.
    Afterwards the controller is stopped if it still runs, the allocation cancelled
    and every node the test crashed or cut off brought back."""
    runs = tmp_path / "runs"
    env = {**labcluster.client_env(), **FAST_DETECTION, "FTL_RUN_LOG_DIR": str(runs),
           **settings}
    done = subprocess.run(
        [*labcluster.ctl_prefix(), sys.executable, "-m", "ft_launch.launcher.cli", "submit",
         "--replicas", str(replicas), "--standby", str(standby), "--job-name", "ftl-login",
         "--", *train_command(steps, pace_s=0)],
        check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    job_id, pid = re.search(r"^job (\d+): controller running here \(pid (\d+)\)",
                            done.stdout).groups()
    run = Training(cluster, job_id, runs / job_id, runs / job_id / "controller.out",
                   replicas, steps)
    try:
        yield run, int(pid)
    finally:
        if labcluster.pid_alive(int(pid)):
            os.kill(int(pid), signal.SIGTERM)
        cluster.cancel(job_id)
        for node in cluster.nodes:
            cluster.ensure_node_up(node)


def wait_controller(run: Training, pid: int, timeout: float) -> None:
    """The detached controller ends (the run is over and its report written)."""
    wait_until(lambda: not labcluster.pid_alive(pid), timeout,
               "the detached controller to finish")
    assert "summary" in run.out.read_text(), run.out.read_text()[-3000:]
