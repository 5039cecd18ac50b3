"""A rollback on real replica processes (loopback, a "node" each): what ``ft-launch
run`` does on a loss spike (``ft_launch.launcher.controller.rollback``), the controller's
part played by the test.

Every rank spikes its loss (and gradients) at ``SPIKE``, and stops itself after
``STOP_AT``. Replica 0 is restarted first with the rollback in its environment,
while the two others train on in the old history: it must not train with them (it
would catch up from them and take the spike back). Then they are restarted too.
All three resume from the newest peer backup before the spike, train the steps
after it again (unspiked: the fault fires once per run), end identical, and the
audit, exact about the rollback, finds every sample trained once."""

from __future__ import annotations

import pytest

from ft_launch.ckpt.restore import TierKind
from ft_launch.env import ENV_ROLLBACKS
from ft_launch.launcher.worker import events as worker_events
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.ckpt.test_peer_backup_run import NodesJob
from tests.waiting import patience, wait_until
from tests.worker.harness import loopback_job, restored_states

pytestmark = [pytest.mark.timeout(300)]

STEPS, SPIKE, STOP_AT, BACKUP_EVERY = 90, 45, 50, 10


def test_replicas_rolled_back_resume_from_before_the_spike_and_never_from_the_old_history(
        tmp_path):
    (tmp_path / "shm").mkdir()
    base = loopback_job(tmp_path, replicas=3, steps=STEPS,
                        FTL_CKPT_BACKUP_EVERY=str(BACKUP_EVERY),
                        FTL_CKPT_BACKUP_DIR=str(tmp_path / "shm"))
    job = NodesJob(base.run_dir, base.replicas, base.command, base.config_env,
                   secret=base.secret)
    job.start_all({r: f"spike@loss:{SPIKE},stop@after_commit:{STOP_AT}" for r in range(3)})
    try:
        wait_until(lambda: all(job.last_committed_step(r) == STOP_AT for r in range(3)),
                   patience(120), f"every replica to stop after step {STOP_AT}")
        job.current(0).kill()
        job.current(0).wait(timeout=30)
        job.config_env = {**job.config_env, ENV_ROLLBACKS: str(SPIKE)}
        started = len(job.events(0))
        job.start(0)                               # history 1, beside two of history 0
        wait_until(lambda: any(isinstance(e, worker_events.WorkerStarted)
                               for e in job.events(0)[started:]), patience(120),
                   "replica 0 to start again")
        for replica in (1, 2):
            job.resume(replica)
        wait_until(lambda: all("another history" in job.log(r) for r in range(3)),
                   patience(120), "the replicas to find two histories in their quorum")
        assert job.current(0).poll() is None
        for replica in (1, 2):
            job.current(replica).kill()
            job.current(replica).wait(timeout=30)
            job.start(replica)
        ended = job.wait_all(patience(240))
    finally:
        job.stop_everything()
    assert set(ended.values()) == {0}, {r: job.log(r)[-3000:] for r in ended}
    restored = restored_states(job)
    assert len(restored) == 3 and all(e.tier == TierKind.PEER.value for e in restored)
    # the newest state before the spike that the tmpfs kept: a backup interval back at most
    assert all(SPIKE - BACKUP_EVERY <= e.step < SPIKE for e in restored), restored
    newest = max(e.step for e in restored)
    for replica in range(3):
        commits = job.committed(replica)
        old = [e for e in commits if e.history == 0]
        new = [e for e in commits if e.history == 1]
        assert old[-1].step >= STOP_AT and new, old[-1]
        if replica == 0:
            # beside the old history it trained nothing, caught up from nobody: it went
            # on from its own state once the old processes were gone
            assert not new[0].caught_up and new[0].step == newest + 1, new[0]
        spiked = next(e for e in old if e.step == SPIKE)
        again = next((e for e in new if e.step == SPIKE and not e.caught_up), None)
        if again is not None:   # trained again, not caught up past it: the fault fired once
            assert spiked.loss > 10 * again.loss, (spiked, again)
    finals = job.finals()
    assert len({f["state_sha256"] for f in finals.values()}) == 1, finals
    audit = check_exactly_once(tmp_path, 3, STEPS)
    assert audit.rollbacks == 1 and audit.rolled_back >= 3 * (STOP_AT - newest)
    assert all(f["positions"] == list(audit.positions) for f in finals.values())
    # the run finished: the nodes' held backups are gone
    assert not any((tmp_path / "shm").iterdir())
