"""Peer backup on the real cluster: a majority lost, and no process left that holds
the state.

Three replicas (one node, one rank each) back up every ``BACKUP_EVERY`` steps to
the next replica's node, into its tmpfs (``ckpt.backup_dir``). At one moment two
replica nodes crash whole (``kill_node``) and the third replica's training
processes are killed; its node lives on, and in its tmpfs the backup of one of
the crashed replicas. The persistent tier is up to ``PERSIST_EVERY`` steps old.

The third replica is relaunched in place and restores that peer copy; the two
promoted standbys restore the persistent tier and catch up from it. So the job
resumes from the peer copy, at a newer step than the persistent tier's, and
completes without a requeue, every replica identical and every sample trained
once in the history that survives (the steps after the restored one are trained
again: the audit's newest commit of each step wins).

``quorum.min_replicas = 3``: the promoted replicas wait for the relaunched one
instead of training on from the persistent tier, which makes the outcome
independent of which comes back first (with the default of 1 they would be
caught up only if the relaunched replica returned before they passed its step).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from ft_launch.ckpt.held import HeldFiles
from ft_launch.ckpt.persist import PersistentStore
from ft_launch.ckpt.restore import TierKind
from ft_launch.launcher.reporting.runlog import commits
from ft_launch.launcher.worker import events as worker_events
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.cluster import labcluster
from tests.slurm.test_run import Training, crash, training  # noqa: F401 (fixture)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(500)]

PERSIST_EVERY = 100
BACKUP_EVERY = 5
SHM = Path("/dev/shm")        # the default ckpt.backup_dir: every lab node's own tmpfs


def kill_training(node: str) -> list[int]:
    """SIGKILL the training processes on ``node`` (its slurmd and the node live on)."""
    killed = []
    for pid in labcluster.namespace_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"etc/examples/gpt/train.py") for arg in argv):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
    return killed


def persisted_steps(run: Training) -> list[int]:
    root = run.run_dir / "ftl-ckpt"
    return PersistentStore(root, rank=0, world_size=1).complete_steps() if root.exists() else []


def test_a_lost_majority_resumes_from_the_peer_copy_newer_than_the_persistent_tier(
        training):  # noqa: F811 (the fixture imported above)
    run = training(replicas=3, standby=2, steps=300,
                   FTL_CKPT_PERSIST_EVERY=str(PERSIST_EVERY),
                   FTL_CKPT_BACKUP_EVERY=str(BACKUP_EVERY), FTL_QUORUM_MIN_REPLICAS="3")
    try:
        # between two persistent checkpoints, far from both
        wait_until(lambda: all(PERSIST_EVERY <= run.last_step(r)
                               and 30 <= run.last_step(r) % PERSIST_EVERY <= 80
                               for r in range(3)), 200,
                   "the replicas to train between two persistent checkpoints")
        nodes = run.replica_nodes()
        victims = run.victims(2)
        (kept,) = [n for n in nodes.values() if n not in victims]
        survivor = next(r for r, n in nodes.items() if n == kept)
        crash(*victims)
        assert kill_training(kept), f"no training process found on {kept}"
        lost_at = max(run.last_step(r) for r in range(3))
        persisted = persisted_steps(run)      # nobody is left to write more
        held = SHM / HeldFiles.dir_name(run.job_id, kept, str(run.run_dir))
        assert any(held.glob("src-*.json")), f"no backup held on {kept}"

        restored = wait_until(lambda: [e for e in run.worker_events(worker_events.StateRestored)
                                       if e.replica_id == survivor], 120,
                              f"replica {survivor} to restore on {kept}")
        run.wait_promoted(2)
        run.end_early()
        assert run.cluster.wait_job_done(run.job_id, timeout=400) == "COMPLETED", \
            run.out.read_text()[-3000:]
        assert run.cluster.slurm.job(run.job_id).restarts == 0
    finally:
        for node in run.cluster.nodes:     # the crashed nodes' directories
            path = SHM / HeldFiles.dir_name(run.job_id, node, str(run.run_dir))
            if path.is_dir():
                for item in path.iterdir():
                    item.unlink()
                path.rmdir()

    (event,) = restored
    assert event.tier == TierKind.PEER.value, event
    # newer than the persistent tier, at most a backup interval (and the push) before the loss
    assert max(persisted) < event.step <= lost_at
    assert lost_at - event.step <= 2 * BACKUP_EVERY + 5, (lost_at, event.step)
    after = [e for e in commits(run.run_dir)[survivor] if e.time > event.time]
    assert after and after[0].step == event.step + 1          # resumed from the peer copy
    for replica in (r for r in range(3) if r != survivor):
        resumed = [e for e in commits(run.run_dir)[replica] if e.time > event.time]
        # the promoted replicas never trained from the persistent tier: they caught up
        assert resumed[0].caught_up and resumed[0].step == event.step + 1, resumed[0]
    finals = [json.loads(p.read_text()) for p in (run.run_dir / "final").glob("*.json")]
    assert len(finals) == 3 and len({f["state_sha256"] for f in finals}) == 1, finals
    positions = list(check_exactly_once(run.run_dir, 3, run.steps).positions)
    assert all(f["positions"] == positions for f in finals)
    # the run finished: the live nodes' workers freed the backups they held
    assert not held.exists()
