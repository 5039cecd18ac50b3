"""``ft-launch run`` on the real cluster: a replica's node is killed mid-training.

The other replicas keep stepping, the warm standby is promoted with scontrol
draining the dead node, the replica rejoins, the job is never requeued, every
replica ends bit-identical and every sample is trained exactly once."""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest

from launcher import events as controller_events
from launcher.report import commits, controller_log
from launcher.worker.audit import check_exactly_once
from tests.cluster import labcluster
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 700


def submit(cluster, tmp_path: Path) -> tuple[str, Path]:
    runs = tmp_path / "runs"
    exports = ",".join([
        "ALL", f"PYTHON={sys.executable}", f"STEPS={STEPS}", "SIZE=small",
        f"FTL_RUN_LOG_DIR={runs}", "FTL_RECOVERY_LOST_TIMEOUT=4",
        "FTL_QUORUM_MEMBER_TIMEOUT=2", "FTL_QUORUM_JOIN_TIMEOUT=1",
        "FTL_CKPT_PERSIST_EVERY=100000"])
    job_id = cluster.sbatch(REPO / "etc" / "examples" / "train.sbatch", f"--chdir={REPO}",
                            f"--output={tmp_path}/job.out", f"--export={exports}")
    return job_id, runs / job_id


def last_step(run_dir: Path, replica: int) -> int:
    return max((e.step for e in commits(run_dir).get(replica, [])), default=-1)


def test_killed_replica_node_is_replaced_by_the_warm_standby(slurm_cluster, tmp_path):
    job_id, run_dir = submit(slurm_cluster, tmp_path)
    victim = None
    try:
        wait_until(lambda: all(last_step(run_dir, r) >= 60 for r in range(3)), 120,
                   "three replicas to train 60 steps")
        launches = {e.replica_id: e for e in controller_log(run_dir)
                    if isinstance(e, controller_events.ReplicaLaunched)}
        victim = launches[1].nodes[0]
        step_at_kill = last_step(run_dir, 0)
        assert labcluster.kill_node(victim)
        promoted = wait_until(lambda: [e for e in controller_log(run_dir)
                                       if isinstance(e, controller_events.StandbyPromoted)],
                              60, "the standby to be promoted")
        assert promoted[0].replica_id == 1 and promoted[0].node != victim
        (info,) = slurm_cluster.slurm.nodes((victim,))
        assert info.drained and info.reason.startswith("ft-launch:")
        assert slurm_cluster.wait_job_done(job_id, timeout=240) == "COMPLETED", \
            (tmp_path / "job.out").read_text()[-3000:]
        assert slurm_cluster.slurm.job(job_id).restarts == 0
    finally:
        slurm_cluster.cancel(job_id)
        if victim:
            slurm_cluster.ensure_node_up(victim)
    finals = [json.loads(p.read_text()) for p in (run_dir / "final").glob("*.json")]
    assert len(finals) == 3 and len({f["state_sha256"] for f in finals}) == 1
    audit = check_exactly_once(run_dir, 3, STEPS)
    assert all(f["positions"] == list(audit.positions) for f in finals)
    by_replica = commits(run_dir)
    rejoined = [e for e in by_replica[1] if e.caught_up]
    assert rejoined and rejoined[0].step > step_at_kill
    for healthy in (0, 2):   # the others never stopped for long
        times = sorted(e.time for e in by_replica[healthy])
        assert max(b - a for a, b in itertools.pairwise(times)) < 15
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["promotions"] == 1 and summary["nodes_drained"] == [victim]
