"""A loss spike in a real ``ft-launch run`` on the lab cluster, rolled back.

Three replicas (one node, one rank each) and a warm standby. At ``SPIKE`` every
rank's loss and gradients are scaled up (``spike@loss``: the weights of every
replica are really hurt, through the all-reduce). The controller averages the
replicas' losses per step, finds the spike, records ``LossSpiked`` and, under the
default ``recovery.spike_policy = "rollback"``, restarts every replica in place: no
node drained, no standby promoted, no requeue. They resume from the newest peer
backup from before the spike that their nodes' tmpfs kept (the persistent tier
holds nothing here), train the steps after it again, and the job completes with
every replica identical; the audit records the rollback and, in the history that
supersedes the rolled-back steps, every sample is trained exactly once.
"""

from __future__ import annotations

import pytest

from ft_launch.ckpt.restore import TierKind
from ft_launch.launcher.controller import events as controller_events
from ft_launch.launcher.reporting.runlog import commits
from ft_launch.launcher.worker import events as worker_events
from ft_launch.launcher.worker.audit import check_exactly_once
from tests.slurm.test_run import Training, training  # noqa: F401 (fixture)
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]

STEPS, SPIKE, BACKUP_EVERY = 300, 85, 20


def test_a_loss_spike_is_rolled_back_to_the_backup_before_it_and_trained_again(
        training):  # noqa: F811 (the fixture imported above)
    run: Training = training(
        replicas=3, standby=1, steps=STEPS, FTL_WORKER_INJECT=f"spike@loss:{SPIKE}",
        FTL_CKPT_BACKUP_EVERY=str(BACKUP_EVERY),
        # three replicas start again at once, each through the health gate, on 2 cores
        FTL_RECOVERY_START_TIMEOUT="120")
    (spiked,) = wait_until(lambda: run.events(controller_events.LossSpiked), 300,
                           "the controller to find the loss spike")
    assert (spiked.step, spiked.action, spiked.replicas) == (SPIKE, "rollback", 3), spiked
    assert spiked.loss > 5 * spiked.baseline, spiked
    summary = run.finish()               # completed, no requeue, identical, exactly once
    assert summary["nodes_drained"] == [] and summary["promotions"] == 0, summary
    assert summary["full_restarts"] == 0
    assert run.events(controller_events.NodeFaultDetected) == []
    assert len(run.events(controller_events.LossSpiked)) == 1
    relaunched = [e for e in run.events(controller_events.ReplicaLaunched)
                  if e.how == "relaunch"]
    assert sorted(e.replica_id for e in relaunched) == [0, 1, 2]

    # each restarted from the newest backup its nodes held from before the spike
    # (a replica that started late on a busy machine may also have restored the
    # others' first persisted step before the spike)
    restored = [e for e in run.worker_events(worker_events.StateRestored)
                if e.time > spiked.time]
    assert len(restored) == 3 and all(e.tier == TierKind.PEER.value for e in restored), restored
    assert all(SPIKE - 2 * BACKUP_EVERY <= e.step < SPIKE for e in restored), restored
    newest = max(e.step for e in restored)
    by_replica = commits(run.run_dir)
    for replica in range(3):
        old = [e for e in by_replica[replica] if e.history == 0]
        new = [e for e in by_replica[replica] if e.history == 1]
        assert old[-1].step >= SPIKE, old[-1]
        # it went on from a restored state, or caught up from a replica that did
        assert new[0].step <= newest + 1 or new[0].caught_up, new[0]
        again = [e for e in new if e.step == SPIKE and not e.caught_up]
        spike = [e for e in old if e.step == SPIKE and not e.caught_up]
        if again and spike:         # trained again unspiked: the fault fired once a run
            assert spike[0].loss > 5 * again[0].loss, (spike[0], again[0])
    audit = check_exactly_once(run.run_dir, 3, run.steps)
    assert audit.rollbacks == 1 and audit.rolled_back > 0, audit

    first_spike = min(e.time for r in range(3) for e in by_replica[r]
                      if e.step == SPIKE and e.history == 0)
    back = max(next(e.time for e in by_replica[r] if e.history == 1) for r in range(3))
    print(f"spike -> LossSpiked {spiked.time - first_spike:.2f} s; spike -> every replica "
          f"training again {back - first_spike:.1f} s; rolled back to step {newest}; "
          f"{audit.rolled_back} audit lines superseded")
