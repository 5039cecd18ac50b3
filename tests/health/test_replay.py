"""Dual-phase replay: the pure grid planner and verdict, and the runner on real
processes with one node injected to compute a wrong result."""

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from ft_launch.errors import UsageError
from ft_launch.health.replay import ReplayStatus, feasible_ks, locate, plan_replay_grid
from ft_launch.health.replay_runner import LocalGroupLauncher, SrunGroupLauncher, run_replay
from ft_launch.slurm.client import SlurmCli
from tests.health.replay_job import reference_digest, workload_digest

NODES = [f"n{i:02d}" for i in range(16)]
#: the stand-in replay job, run by path as a Slurm step would run it
REPLAY_JOB = Path(__file__).with_name("replay_job.py")


def test_grid_columns_hold_whole_pipelines():
    grid = plan_replay_grid(NODES[:8], pp=2, dp=4, k=1)      # m = 2, n = 4
    assert grid.rows == (("n00", "n02", "n04", "n06"), ("n01", "n03", "n05", "n07"))
    assert grid.columns[1] == ("n02", "n03")                  # replica 1: stages 0 and 1
    grid = plan_replay_grid(NODES, pp=2, dp=8, k=2)           # m = 4, n = 4
    assert len(grid.rows) == 4 and all(len(r) == 4 for r in grid.rows)
    assert grid.columns[0] == ("n00", "n01", "n02", "n03")
    assert sorted(n for row in grid.rows for n in row) == NODES


@pytest.mark.parametrize("pp, dp, k, count, message", [
    (2, 4, 3, 8, "must divide"), (4, 2, 1, 8, "exceeds"), (2, 4, 1, 7, "need 8"),
    (0, 4, 1, 0, "at least 1")])
def test_grid_rejects_impossible_layouts(pp, dp, k, count, message):
    with pytest.raises(UsageError, match=message):
        plan_replay_grid(NODES[:count], pp, dp, k)


def test_feasible_ks_follow_m_le_n():
    assert feasible_ks(pp=2, dp=8) == [1, 2]
    assert feasible_ks(pp=1, dp=16) == [1, 2, 4]


def test_locate_the_intersection():
    grid = plan_replay_grid(NODES[:8], pp=2, dp=4, k=1)
    found = locate(grid, [1], [2])
    assert (found.status, found.suspects) == (ReplayStatus.FOUND, ("n05",))
    assert locate(grid, [], []).status is ReplayStatus.NOT_REPRODUCED
    assert locate(grid, [0, 1], [2]).status is ReplayStatus.AMBIGUOUS
    rows_only = locate(grid, [0], [])
    assert rows_only.status is ReplayStatus.AMBIGUOUS and rows_only.suspects == grid.rows[0]


def test_replay_job_digest_is_deterministic_and_corruption_shows():
    assert workload_digest() == reference_digest()
    assert workload_digest(corrupt=True) != reference_digest()


@pytest.mark.timeout(90)
def test_local_replay_finds_the_node_injected_with_silent_corruption(tmp_path):
    (tmp_path / "n05.json").write_text(json.dumps([{"sdc": True}]))
    config = tmp_path / "health.toml"
    config.write_text(f'[health]\nbackend = "simulated"\nsim_fault_dir = "{tmp_path}"\n')
    launcher = LocalGroupLauncher(
        [sys.executable, str(REPLAY_JOB), "--expect", reference_digest()],
        env={**os.environ, "FTL_CONFIG": str(config)})
    grid = plan_replay_grid(NODES[:8], pp=2, dp=4, k=1)
    verdict, outcomes = run_replay(grid, launcher)
    assert (verdict.status, verdict.suspects) == (ReplayStatus.FOUND, ("n05",))
    assert [o.label for o in outcomes if not o.ok] == ["row1", "col2"]
    assert "n05" in next(o.detail for o in outcomes if not o.ok)


def test_srun_launcher_runs_one_step_per_group(tmp_path):
    """A stand-in srun records its argv and fails the step that holds n03."""
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\necho \"$*\" >> \"$LOG\"  # one write: groups run concurrently\n"
                    "case \"$FTL_WORKER_REPLAY_NODES\" in *n03*) exit 1;; esac\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "log"
    slurm = SlurmCli(env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}",
                          "LOG": str(log)})
    launcher = SrunGroupLauncher(slurm,
                                 ["python", str(REPLAY_JOB), "--expect", "x"],
                                 job_id="77", timeout=30)
    grid = plan_replay_grid(NODES[:4], pp=1, dp=4, k=2)      # 2 x 2
    verdict, _ = run_replay(grid, launcher)
    assert verdict.suspects == ("n03",)
    lines = log.read_text().splitlines()
    assert len(lines) == 4
    assert all("--jobid=77" in line and "--job-name=ftl-replay-" in line for line in lines)
