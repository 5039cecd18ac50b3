"""The worker's replay mode on loopback, end to end but for Slurm: a replica of two
FSDP2 ranks trains; its state is captured from its state servers as the controller
does; then the example script, unchanged, replays one step in every group of a
2 x 2 grid of named "nodes", one of them corrupting its gradients (the simulated
GPU's ``sdc`` fault file). Healthy groups on other nodes compute the same bits;
the corrupting node's groups count NaN/Inf; the verdict names that node alone."""

from __future__ import annotations

import json
import sys

import pytest

from ft_launch.health.replay import ReplayStatus, judge, plan_replay_grid
from ft_launch.health.replay_runner import LocalGroupLauncher, run_phases
from ft_launch.launcher.controller.sdc_replay import capture_state, group_result
from ft_launch.launcher.worker.local import free_port
from ft_launch.launcher.worker.replay_files import ReplaySpec, read_result, write_spec
from tests.waiting import patience, wait_until

from .harness import TRAIN, loopback_job

pytestmark = [pytest.mark.timeout(300)]

RANKS = 2
BAD = "nb"


@pytest.fixture
def captured(tmp_path):
    """A training replica's state of some step, captured while it trains on."""
    job = loopback_job(tmp_path / "run", replicas=1, steps=100_000, ranks=RANKS)
    try:
        job.start_all()
        # step 3's snapshot is taken when step 4 starts and is complete before step 4
        # commits (its optimizer step waits for the copy)
        wait_until(lambda: job.last_committed_step(0) >= 4, patience(120),
                   "the replica to train a few steps")
        state_dir = tmp_path / "run" / "replay" / "t" / "state"
        source, step = capture_state(job.run_dir, "local", job.secret, [0], RANKS,
                                     state_dir, timeout=patience(30))
    finally:
        job.stop_everything()
    assert source == 0 and step >= 3
    return job, step, state_dir


def test_healthy_groups_replay_the_same_bits_and_the_corrupting_node_is_found(
        captured, tmp_path):
    job, step, state_dir = captured
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / f"{BAD}.json").write_text(json.dumps([{"sdc": True}]))
    config = tmp_path / "ft-launch.toml"
    config.write_text(f'[health]\nbackend = "simulated"\nsim_fault_dir = "{faults}"\n')
    spec = ReplaySpec("t", 0, step, RANKS, str(state_dir), str(tmp_path / "results"))
    spec_path = write_spec(tmp_path / "spec.json", spec)
    # each process's rank comes from its place in the group (SLURM_PROCID), as in a step
    env = {**{k: v for k, v in job.env(0, "").items() if k != "FTL_WORKER_RANK"},
           "FTL_CONFIG": str(config), "FTL_WORKER_REPLAY": str(spec_path)}
    launcher = LocalGroupLauncher(
        [sys.executable, str(TRAIN), "--steps", "100000", "--size", "tiny",
         "--batch-size", "8", "--threads", "1"], env=env, timeout=patience(120),
        group=lambda label, nodes: {"MASTER_PORT": str(free_port())})
    grid = plan_replay_grid(["na", BAD, "nc", "nd"], pp=2, dp=2)   # column 0: the suspects
    rows, columns = run_phases(grid, launcher)
    assert all(o.ok for o in rows + columns), [o.detail for o in rows + columns]

    results = {o.label: [read_result(spec.result_file(o.label, rank)) for rank in range(RANKS)]
               for o in rows + columns}
    # row0 (na, nc) and the reference col1 (nc, nd): other nodes, the same bits
    assert [r.digest for r in results["row0"]] == [r.digest for r in results["col1"]]
    assert all(r.step == step + 1 and r.reductions > 0 and not r.nonfinite
               for r in results["row0"] + results["col1"])
    # the corrupting node's groups: every rank's shard is off after the reduce-scatter
    for label in ("row1", "col0"):
        assert all(r.nonfinite > 0 for r in results[label]), results[label]
        assert [r.digest for r in results[label]] != [r.digest for r in results["col1"]]

    found = judge(grid, [group_result(spec, o) for o in rows],
                  [group_result(spec, o) for o in columns], reference_columns=[1])
    assert found.verdict is not None, found.error
    assert (found.verdict.status, found.verdict.suspects) == (ReplayStatus.FOUND, (BAD,))
    assert (found.verdict.failed_rows, found.verdict.failed_columns) == ((1,), (0,))
    # a replay is no training: nothing in the replica's event files, no final record
    assert not (job.run_dir / "final").exists()
