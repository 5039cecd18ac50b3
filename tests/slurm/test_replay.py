"""Dual-phase replay in a real ``ft-launch run`` on the lab cluster.

Two replicas of two nodes, one rank on each (FSDP2 across the two nodes of a
replica), and two warm standby nodes: the allocation is the whole cluster. Mid-run
one node of replica 1 starts corrupting: its simulated GPU's fault file says
``sdc``, and from then on one bit of the loss gradient flips on that node before
the reduce-scatter, so every rank of replica 1 finds its shard non-finite and the
replica names both its nodes. Every replica discards those steps (no weights ever
hold the NaN). After ``recovery.nonfinite_limit`` of them the controller cancels
replica 1 and replays a step captured from replica 0 with the training script in
replay mode: rows (each suspect with a standby), then columns (the replica, the
standbys). Only the bad node's row and column fail; that node alone is drained
with the replay's reason, replica 1 comes back with a standby in its place, and the
job completes, identical and exactly once, without a requeue.

Two replicas cannot form a quorum with one (no witness here): replica 0 waits for
replica 1 to come back, which is what makes the replica count small enough to fit.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from ft_launch.events import NodeDrained
from ft_launch.launcher.controller.events import (
    NodeFaultDetected,
    ReplicaLaunched,
    SdcReplayOrdered,
    SdcReplayReported,
)
from ft_launch.launcher.worker import events as worker_events
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.slurm.test_run import FAST_DETECTION, REPO, simulated_gpus, whole_cluster_job

__all__ = ["simulated_gpus"]    # a fixture of this module's tests too
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

STEPS, CORRUPT_AFTER = 160, 30
NONFINITE_LIMIT = 3
REPLAY_TIMEOUT = 240.0


@pytest.fixture
def replayed_run(slurm_cluster, simulated_gpus, tmp_path):
    """Submit the example on all six nodes with simulated GPUs (their fault files in
    ``faults``); afterwards cancel it and heal the nodes."""
    faults, config = simulated_gpus
    runs = tmp_path / "runs"
    exports = {"PYTHON": sys.executable, "STEPS": str(STEPS), "SIZE": "small",
               "REPLICAS": "2", "STANDBY": "2", "TASKS_PER_NODE": "1",
               "FTL_JOB_NODES_PER_REPLICA": "2", "FTL_CONFIG": str(config),
               # inspection steps would not see it (no check replays training), but they
               # cost CPU the replay needs on this machine
               "FTL_HEALTH_INSPECTION": "false",
               "FTL_RECOVERY_NONFINITE_LIMIT": str(NONFINITE_LIMIT),
               "FTL_RECOVERY_REPLAY_TIMEOUT": str(REPLAY_TIMEOUT),
               "FTL_RUN_LOG_DIR": str(runs), **FAST_DETECTION,
               # replica 0 waits in the quorum while replica 1 is replayed (paced, ~1 s
               # a try): its budget must outlast the replay. With the controller's
               # witness it would train on alone and finish before replica 1 is back,
               # and the two replicas' final states could not be compared.
               "FTL_QUORUM_CONTROLLER_WITNESS": "false",
               "FTL_RUNTIME_MAX_CONSECUTIVE_FAILURES": str(int(2 * REPLAY_TIMEOUT)),
               # relaunched cold (health gate, torch, FSDP2, catch-up) beside the others
               "FTL_RECOVERY_START_TIMEOUT": "90",
               # four ranks and the replay's on this machine's cores: a leader late by a
               # second is not lost
               "FTL_QUORUM_MEMBER_TIMEOUT": "6", "FTL_QUORUM_ELECTION_TIMEOUT": "3"}
    with whole_cluster_job(slurm_cluster, tmp_path, exports, 2, STEPS, ranks=2) as run:
        yield run, faults


def test_the_node_that_corrupts_gradients_is_found_by_replay_and_alone_drained(
        replayed_run, slurm_cluster):
    run, faults = replayed_run
    run.wait_training(CORRUPT_AFTER)
    launched = {e.replica_id: e.nodes for e in run.events(ReplicaLaunched)}
    healthy_peer, bad = launched[1]
    job = slurm_cluster.slurm.job(run.job_id)
    standbys = sorted((n for n in job.nodes if all(n not in ns for ns in launched.values())),
                      key=lambda n: n == job.batch_host)      # promotion order
    (faults / f"{bad}.json").write_text(json.dumps([{"sdc": True}]))
    injected_at = time.time()

    (reported,) = wait_until(lambda: run.events(SdcReplayReported), 2 * REPLAY_TIMEOUT,
                             "the dual-phase replay's verdict")
    assert (reported.status, reported.suspects) == ("found", [bad]), reported
    # column 0 is the replica, its second node's row holds the bad one
    assert (reported.failed_rows, reported.failed_columns) == ([1], [0]), reported
    (ordered,) = run.events(SdcReplayOrdered)
    assert ordered.suspects == [healthy_peer, bad] and ordered.references == standbys[:2]
    assert ordered.steps == NONFINITE_LIMIT

    run.end_early()
    assert slurm_cluster.wait_job_done(run.job_id, timeout=400) == "COMPLETED", \
        run.out.read_text()[-3000:]
    assert slurm_cluster.slurm.job(run.job_id).restarts == 0

    # the bad node alone is drained, with the replay's rows and columns as its reason
    (info,) = slurm_cluster.slurm.nodes((bad,))
    assert info.drained and info.reason.startswith(   # Slurm adds who and when
        f"ft: sdc: {bad} computes NaN/Inf gradients (dual-phase replay: row 1 and column 0 "
        "failed)"), info.reason
    (peer,) = slurm_cluster.slurm.nodes((healthy_peer,))
    assert not peer.drained, peer.reason
    assert [(f.node, f.replica_id) for f in run.events(NodeFaultDetected)] == [(bad, 1)]
    # replica 1 came back on its good node and the first standby
    relaunched = [e for e in run.events(ReplicaLaunched) if e.replica_id == 1][-1]
    assert relaunched.how == "relaunch" and relaunched.nodes == [healthy_peer, standbys[0]]

    # the NaN never entered a replica: every commit had finite gradients, replicas of
    # the same rank ended bit-identical, and every sample was trained once
    commits = run.worker_events(worker_events.StepCommitted)
    assert commits and all(math.isfinite(c.grad_norm) for c in commits
                       if c.grad_norm is not None)
    discarded = [e for e in run.worker_events(worker_events.StepDiscarded)
                 if e.nonfinite_nodes]
    assert discarded and all(set(e.nonfinite_nodes) == {healthy_peer, bad}
                             for e in discarded)
    finals = [json.loads(p.read_text()) for p in (run.run_dir / "final").glob("*.json")]
    assert len(finals) == 4 and all(f["step"] == run.steps - 1 and math.isfinite(f["loss"])
                                    for f in finals)
    for rank in (0, 1):
        assert len({f["state_sha256"] for f in finals if f["rank"] == rank}) == 1
    check_exactly_once(run.run_dir, 2, run.steps)

    # the report, and ft-launch status shows the verdict
    report = json.loads((run.run_dir / "replay" / "replica-1-1" / "report.json").read_text())
    assert report["grid"] == [[healthy_peer, standbys[0]], [bad, standbys[1]]]
    status = subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", "status",
                             str(run.run_dir)], cwd=REPO, capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert "sdc replays:" in status and reported.report in status
    # fault -> drained: the NaN/Inf steps, then the replay within its bound
    (drained,) = [e for e in run.events(NodeDrained) if e.node == bad]
    took = drained.time - injected_at
    assert 0 < took < 2 * REPLAY_TIMEOUT, took      # where the rule would give up
    print(f"sdc: fault -> {bad} drained {took:.1f} s (replay of step {reported.step}: "
          f"{reported.duration_s:.1f} s)")
