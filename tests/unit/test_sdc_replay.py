"""The controller's replay shell (``ft_launch.launcher.controller.sdc_replay``) against real
state servers and a stand-in ``srun``: the state captured from a training replica's ranks, one
Slurm step per group with the replay's environment, the groups judged against the
reference column, the report, the outcome, and what a failed capture gives."""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import ArrayState, DualBufferSnapshotter
from ft_launch.ids import new_job_secret
from ft_launch.launcher.controller.replay_rule import RunReplay
from ft_launch.launcher.controller.sdc_replay import ReplaySetup, SdcReplays
from ft_launch.launcher.worker.replay_files import load_captured, publish_state_servers
from ft_launch.slurm.client import SlurmCli
from tests.waiting import patience, wait_until

SECRET = new_job_secret()
STEP = 41
#: Stands in for srun: each task of the group writes its result as a replay rank
#: would, NaN/Inf on every rank of a group that holds n5; row0's step then fails.
FAKE_SRUN = """#!{python}
import json, os, pathlib
env = os.environ
spec = json.loads(pathlib.Path(env["FTL_WORKER_REPLAY"]).read_text())
label, nodes = env["FTL_WORKER_REPLAY_GROUP"], env["FTL_WORKER_REPLAY_NODES"].split(",")
with open(env["LOG"], "a") as log:
    log.write(json.dumps({{"label": label, "world": env["WORLD_SIZE"],
                          "replica": env["FTL_WORKER_REPLICA_ID"]}}) + "\\n")
for rank in range(spec["ranks"]):
    out = pathlib.Path(spec["results_dir"]) / label / f"rank-{{rank}}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({{"group": label, "rank": rank, "node": nodes[rank],
                               "step": spec["step"] + 1, "digest": str(rank) * 64,
                               "nonfinite": 3 if "n5" in nodes else 0, "reductions": 2}}))
if label == "row0":     # a task that aborts once its result is written: no verdict
    raise SystemExit(134)
"""


@pytest.fixture
def training_replica(tmp_path: Path) -> Iterator[Path]:
    """Replica 0's two ranks serving their snapshot of ``STEP`` (each its shard)."""
    snapshotters, servers = [], []
    for rank in range(2):
        snapshotter = DualBufferSnapshotter(rank=rank, world_size=2)
        snapshotter.start(STEP, ArrayState({"w": np.full(4, rank, dtype=np.float32)},
                                           meta={"loader": {"positions": [8, 8]}}))
        snapshotter.wait_complete()
        snapshotters.append(snapshotter)
        servers.append(StateServer(secret=SECRET, host="127.0.0.1",
                                   snapshots=snapshotter.buffers).start())
    publish_state_servers(tmp_path, 0, "77", [s.address for s in servers])
    yield tmp_path
    for server, snapshotter in zip(servers, snapshotters):
        server.close()
        snapshotter.close()


def replays(run_dir: Path, tmp_path: Path) -> tuple[SdcReplays, Path]:
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(FAKE_SRUN.format(python=sys.executable))
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "srun.log"
    slurm = SlurmCli(env={**os.environ, "PATH": f"{srun.parent}:{os.environ['PATH']}",
                          "LOG": str(log)})
    setup = ReplaySetup(slurm, run_dir, "77", SECRET, {"FTL_WORKER_SECRET": SECRET}, 2,
                        tasks_per_node=1, timeout=patience(60), fetch_timeout=patience(30))
    return SdcReplays(setup), log


def finished(running: SdcReplays) -> list:
    done: list = []
    wait_until(lambda: done.extend(running.finished()) or done, patience(60),
               "the replay to end")
    return done


def test_the_replay_captures_runs_each_group_and_names_the_node(training_replica, tmp_path):
    running, log = replays(training_replica, tmp_path)
    running.start(RunReplay(1, ("n4", "n5"), ("n6", "n1"), (0,), ("python", "train.py")))
    (outcome,) = finished(running)
    assert (outcome.status, outcome.suspects) == ("found", ("n5",)), outcome.summary
    assert (outcome.failed_rows, outcome.failed_columns, outcome.step) == ((1,), (0,), STEP + 1)
    assert "row1: NaN/Inf on rank 0 (n5, 3 values), rank 1 (n1, 3 values)" in outcome.summary
    out = training_replica / "replay" / "replica-1-1"
    for rank in range(2):        # the captured state: every rank's shard of one step
        manifest, _ = load_captured(out / "state", rank)
        assert (manifest.step, manifest.rank) == (STEP, rank)
    groups = [json.loads(line) for line in log.read_text().splitlines()]
    assert sorted(g["label"] for g in groups) == ["col0", "col1", "row0", "row1"]
    assert all(g["world"] == "2" and g["replica"] == "1" for g in groups)
    report = json.loads((out / "report.json").read_text())
    assert report["grid"] == [["n4", "n6"], ["n5", "n1"]] and report["source_replica"] == 0
    text = Path(outcome.report).read_text()
    assert outcome.report == str(out / "report.txt") and "verdict: replay found" in text
    assert "col1 on n6,n1: the reference's bits" in text and "row0 on n4,n6: the " in text
    assert report["failed"] == ["row1", "col0"]
    record, located = outcome.record(), outcome.located()
    assert record.suspects == ["n5"] and located.suspects == ("n5",)


def test_a_replay_without_a_state_to_capture_fails_and_says_why(tmp_path):
    running, log = replays(tmp_path, tmp_path)
    running.start(RunReplay(1, ("n4", "n5"), ("n6", "n1"), (0,), ("python", "train.py")))
    (outcome,) = finished(running)
    assert outcome.status == "failed" and "no state captured" in outcome.summary
    assert "replica-0.json" in outcome.summary and not log.exists()
