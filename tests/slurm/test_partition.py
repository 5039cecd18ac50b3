"""A network partition on the real cluster: {replica 0} | {replicas 1, 2, witness 0}.

Three replicas on separate nodes and one standby, submitted from the login node:
the controller runs there and votes as witness 0 (the default). Replica 0's node
is cut off the network (its link down inside its namespace; its processes run
on and still share the machine's files). Replicas 1 and 2 with the witness hold
4 of the 5 votes and train on; replica 0 alone holds 1 and commits none of the
steps they commit without it. The controller finds replica 0 lost (its peers'
quorum reports it, and it commits nothing while they go on), drains its node and
promotes the standby, which catches up from a survivor and rejoins; the cut-off
process is cancelled once its node is back. The audit shows one history in which
every sample was trained exactly once, and the three replicas end identical.
"""

from __future__ import annotations

import time

import pytest

from launcher import events as controller_events
from launcher.reporting.runlog import commits
from tests.cluster import labcluster
from tests.slurm.login import submitted, wait_controller
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

STEPS = 400
#: Steps the majority side commits without replica 0 before the cut heals.
ALONE_STEPS = 30


def test_only_the_majority_side_of_a_partition_trains_and_the_cut_replica_is_replaced(
        slurm_cluster, tmp_path):
    with submitted(slurm_cluster, tmp_path, replicas=3, standby=1, steps=STEPS) as (run, pid):
        run.wait_training(40)
        (chosen,) = run.events(controller_events.ControllerWitnessChosen)
        assert chosen.voting, chosen
        cut = run.replica_nodes()[0]
        with labcluster.partition_node(cut):
            cut_at = time.time()
            last_before = run.last_step(0)

            def majority_alone() -> int:
                return sum(1 for e in commits(run.run_dir)[1]
                           if e.time > cut_at and e.contributors == 2)
            wait_until(lambda: majority_alone() >= ALONE_STEPS, 120,
                       f"replicas 1 and 2 to commit {ALONE_STEPS} steps without replica 0")
            healed_at = time.time()
        (promoted,) = run.wait_promoted(1)
        wait_controller(run, pid, 300)
    by_replica = commits(run.run_dir)
    without_zero = {e.step for r in (1, 2) for e in by_replica[r]
                    if e.time > cut_at and e.contributors == 2}
    assert len(without_zero) >= ALONE_STEPS
    # the cut-off side committed nothing the other side committed without it, and
    # nothing past the step it was in when cut off
    assert not without_zero & {e.step for e in by_replica[0]}
    during = [e.step for e in by_replica[0] if cut_at <= e.time <= healed_at]
    assert all(step <= last_before + 1 for step in during), (last_before, during)
    # the controller replaced it: drained its node, promoted the standby
    (fault,) = run.events(controller_events.NodeFaultDetected)
    assert fault.node == cut and fault.replica_id == 0, fault
    assert promoted.replica_id == 0 and promoted.node != cut
    rejoined = [e for e in by_replica[0] if e.caught_up]
    assert rejoined and rejoined[0].step > max(without_zero)
    assert by_replica[0][-1].step == STEPS - 1
    summary = run.check_results()        # identical finals, one history, every sample once
    assert summary["promotions"] == 1 and summary["nodes_drained"] == [cut]
