"""Peer backup in the product path: the example training as replica processes on
loopback, each replica on a "node" of its own (its own loopback address and node
name, so the placement and the node-local backup files work as on a cluster).

Every process of every replica is killed at once (a lost job: nothing in any
process's memory survives). The next incarnation restores from the peer copies
its nodes hold: a newer step than the persistent tier's, and every replica ends
identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from ft_launch.ckpt.held import HeldFiles
from ft_launch.ckpt.persist import PersistentStore
from ft_launch.ckpt.restore import TierKind
from ft_launch.launcher.worker import events as worker_events
from ft_launch.launcher.worker.audit import check_exactly_once
from ft_launch.launcher.worker.identity import ENV_HOST
from ft_launch.launcher.worker.local import LocalJob
from tests.waiting import patience, wait_until
from tests.worker.harness import loopback_job

pytestmark = [pytest.mark.timeout(300)]

PERSIST_EVERY = 40
BACKUP_EVERY = 5


class NodesJob(LocalJob):
    """Replica r on "node" ``lnode{r}`` at 127.0.0.{r + 2}."""

    def env(self, replica_id: int, inject: str, rank: int = 0, incarnation: str = "0",
            master_port: int = 0) -> dict[str, str]:
        env = super().env(replica_id, inject, rank, incarnation, master_port)
        env[ENV_HOST] = f"127.0.0.{replica_id + 2}"
        env["SLURMD_NODENAME"] = f"lnode{replica_id}"
        return env


def nodes_job(run_dir: Path, steps: int) -> NodesJob:
    base = loopback_job(run_dir, replicas=3, steps=steps,
                        FTL_CKPT_PERSIST_EVERY=str(PERSIST_EVERY),
                        FTL_CKPT_BACKUP_EVERY=str(BACKUP_EVERY),
                        FTL_CKPT_BACKUP_DIR=str(run_dir / "shm"))
    return NodesJob(base.run_dir, base.replicas, base.command, base.config_env,
                    secret=base.secret)


def test_a_job_that_lost_every_replica_resumes_from_the_peer_copies(tmp_path):
    (tmp_path / "shm").mkdir()
    steps = 90
    job = nodes_job(tmp_path, steps)
    job.start_all()
    try:
        # kill when the newest persistent step is well behind the newest backup
        wait_until(lambda: all(10 <= job.last_committed_step(r) % PERSIST_EVERY <= 30
                               and job.last_committed_step(r) >= PERSIST_EVERY
                               for r in range(3)), patience(120),
                   "the replicas to train between two persistent checkpoints")
    finally:
        job.stop_everything()          # SIGKILL: every replica lost at once
    persisted = PersistentStore(tmp_path / "ftl-ckpt", rank=0, world_size=1).complete_steps()
    lost_at = max(job.last_committed_step(r) for r in range(3))
    held = sorted(p.name for p in (tmp_path / "shm").iterdir())
    assert held == sorted(HeldFiles.dir_name("local", f"lnode{r}", str(tmp_path))
                          for r in range(3))
    started = len(job.events(0))
    job.start_all()                    # the next incarnation, on the same nodes
    try:
        codes = job.wait_all(patience(240))
        assert codes == {0: 0, 1: 0, 2: 0}, {r: job.log(r)[-3000:] for r in codes}
    finally:
        job.stop_everything()
    restored = [e for r in range(3) for e in job.events(r)
                if isinstance(e, worker_events.StateRestored)]
    assert restored and all(e.tier == TierKind.PEER.value for e in restored), restored
    newest = max(e.step for e in restored)
    # newer than the persistent tier, within one backup interval (and the push) of the loss
    assert max(persisted, default=-1) < newest <= lost_at
    assert lost_at - newest <= 2 * BACKUP_EVERY
    resumed = [e for e in job.events(0)[started:] if isinstance(e, worker_events.WorkerStarted)]
    assert resumed and resumed[0].next_step > max(persisted, default=-1) + 1
    finals = job.finals()
    assert len({f["state_sha256"] for f in finals.values()}) == 1, finals
    positions = list(check_exactly_once(tmp_path, 3, steps).positions)
    assert all(f["positions"] == positions for f in finals.values())
    # the run finished: the nodes' held backups are gone
    assert not any((tmp_path / "shm").iterdir())
