"""Hang diagnosis in a real ``ft-launch run`` on the lab cluster.

Three replicas of two nodes, one rank on each (FSDP2 across the two nodes of a
replica), no standby: the allocation is the whole cluster. At step 40 rank 1 of
replica 1 deadlocks in its own code (``hang@before_commit:40/1@NODE``); rank 0
waits for it in the commit vote, the process lives on and the replica's quorum
agent keeps its heartbeat, so nothing but the missing commits tells. The other
two replicas train on without it. The controller finds the replica stalled,
takes the stacks of both ranks with py-spy (``srun --overlap`` on each of its
nodes) before it cancels anything, names rank 1 and its node, drains that node
alone (the stall rule by itself blamed the replica's first node), and the job
completes on the two replicas left, identical and exactly once.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ft_launch.launcher.controller.diagnosis import HangDiagnosisReported
from ft_launch.launcher.controller.events import ActionTaken, NodeFaultDetected
from ft_launch.launcher.reporting.runlog import commits
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.slurm.test_run import FAST_DETECTION, REPO, whole_cluster_job
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(900)]

STEPS, HANG_STEP = 240, 40
DIAGNOSIS_TIMEOUT = 30.0


@pytest.fixture
def whole_cluster_run(slurm_cluster, tmp_path):
    """Submit the example on all six nodes; afterwards cancel it and heal the nodes."""
    nodes = slurm_cluster.nodes
    assert len(nodes) >= 6, nodes
    # the batch host trains (replica 0); the hang goes to replica 1's second node
    hung_node = nodes[3]
    runs = tmp_path / "runs"
    exports = {"PYTHON": sys.executable, "STEPS": str(STEPS), "SIZE": "small",
               "REPLICAS": "3", "STANDBY": "0", "TASKS_PER_NODE": "1",
               "FTL_JOB_NODES_PER_REPLICA": "2", "FTL_JOB_BATCH_HOST": "replica",
               "FTL_RECOVERY_DIAGNOSIS_TIMEOUT": str(DIAGNOSIS_TIMEOUT),
               "FTL_WORKER_INJECT": f"hang@before_commit:{HANG_STEP}/1@{hung_node}",
               "FTL_RUN_LOG_DIR": str(runs), **FAST_DETECTION,
               # six ranks on this machine's cores: a leader late by a second is not lost
               # (that would evict a healthy replica, which is not what this test is about)
               "FTL_QUORUM_MEMBER_TIMEOUT": "6", "FTL_QUORUM_ELECTION_TIMEOUT": "3"}
    with whole_cluster_job(slurm_cluster, tmp_path, exports, 3, STEPS) as run:
        yield run, hung_node


def test_a_deadlocked_rank_is_found_in_its_stacks_and_only_its_node_drained(
        whole_cluster_run, slurm_cluster):
    run, hung_node = whole_cluster_run
    (reported,) = wait_until(lambda: run.events(HangDiagnosisReported), 300,
                             "the hang diagnosis")
    assert reported.replica_id == 1 and reported.suspects == [hung_node], reported
    assert reported.outliers == [1] and "injected_deadlock" in reported.summary, reported
    run.end_early()
    assert slurm_cluster.wait_job_done(run.job_id, timeout=400) == "COMPLETED", \
        run.out.read_text()[-3000:]
    assert slurm_cluster.slurm.job(run.job_id).restarts == 0

    # the stacks were taken before anything of the replica was cancelled
    log = run.events(object)
    cancels = [i for i, e in enumerate(log) if isinstance(e, ActionTaken)
               and e.action == "CancelReplica" and e.replica_id == 1]
    assert cancels and log.index(reported) < cancels[0]
    faults = run.events(NodeFaultDetected)
    assert [(f.node, f.replica_id) for f in faults] == [(hung_node, 1)]

    # only the hung rank's node is drained, with the diagnosis as its reason
    healthy_peer = slurm_cluster.nodes[2]          # rank 0 of replica 1
    (bad,) = slurm_cluster.slurm.nodes((hung_node,))
    assert bad.drained and bad.reason.startswith(f"ft: hang: rank 1 on {hung_node}"), \
        bad.reason
    (peer,) = slurm_cluster.slurm.nodes((healthy_peer,))
    assert not peer.drained, peer.reason

    # the report: every rank's stack; rank 0 waits for rank 1 in the commit vote
    report = (run.run_dir / "diagnosis").glob("hang-1-*/report.json")
    (details,) = [json.loads(p.read_text()) for p in report]
    rows = {r["rank"]: r for r in details["ranks"]}
    assert rows[0]["node"] == healthy_peer and rows[1]["node"] == hung_node
    assert details["waiting"] == [0] and "all_true" in rows[0]["signature"]
    assert "injected_deadlock" in rows[1]["where"]

    # ft-launch status shows it
    status = subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", "status",
                             str(run.run_dir)], cwd=REPO, capture_output=True, text=True,
                            timeout=60, check=True).stdout
    assert "hang diagnoses:" in status and reported.report in status

    # the two replicas left trained on to the end, identical, every sample once
    finals = [json.loads(p.read_text()) for p in (run.run_dir / "final").glob("*.json")]
    survivors = [f for f in finals if f["replica_id"] in (0, 2)]
    assert len(survivors) == 4 and all(f["step"] == run.steps - 1 for f in survivors)
    for rank in (0, 1):
        assert len({f["state_sha256"] for f in survivors if f["rank"] == rank}) == 1
    check_exactly_once(run.run_dir, 3, run.steps)

    # fault -> diagnosis: from the first commit of the hung step by another replica
    hung_at = min(e.time for r in (0, 2) for e in commits(run.run_dir)[r]
                  if e.step == HANG_STEP)
    took = reported.time - hung_at
    lost = float(FAST_DETECTION["FTL_RECOVERY_LOST_TIMEOUT"])
    # stalled after lost_timeout, the others steady for as long, then the capture
    assert 0 < took < 2 * lost + DIAGNOSIS_TIMEOUT, took
    print(f"hang -> diagnosis {took:.1f} s (capture {details['duration_s']:.1f} s)")
