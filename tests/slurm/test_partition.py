"""A network partition on the real cluster: {replica 0} | {replicas 1, 2, witness 0}.

Three replicas on separate nodes and one standby, submitted from the login node:
the controller runs there and votes as witness 0 (the default). Replica 0's node
is cut off the network (its link down inside its namespace; its processes run
on and still share the machine's files). Replicas 1 and 2 with the witness hold
4 of the 5 votes and train on; replica 0 alone holds 1 and commits none of the
steps they commit without it, and finds its majority lost. The controller finds
replica 0 lost (its peers' quorum reports it, and it commits nothing while they
go on), drains its node and promotes the standby, which catches up from a
survivor and rejoins, usually before the cut heals; the cut-off process is
cancelled once its node is back. The audit shows one history in which
every sample was trained exactly once, and the three replicas end identical.
"""

from __future__ import annotations

import time

import pytest

from ft_launch.launcher.controller import events as controller_events
from ft_launch.launcher.quorum.events import MajorityLost
from ft_launch.launcher.reporting.runlog import commits
from ft_launch.launcher.worker.events import WorkerStarted
from tests.cluster import labcluster
from tests.slurm.login import submitted, wait_controller
from tests.waiting import wait_until

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(400)]

STEPS = 400
#: Steps the majority side commits after the cut before it heals.
CUT_STEPS = 30


def test_only_the_majority_side_of_a_partition_trains_and_the_cut_replica_is_replaced(
        slurm_cluster, tmp_path):
    with submitted(slurm_cluster, tmp_path, replicas=3, standby=1, steps=STEPS) as (run, pid):
        run.wait_training(40)
        (chosen,) = run.events(controller_events.ControllerWitnessChosen)
        assert chosen.voting, chosen
        cut = run.replica_nodes()[0]
        with labcluster.partition_node(cut):
            cut_at, last_before, majority_at = time.time(), run.last_step(0), run.last_step(1)

            def cut_off_knows() -> bool:
                return any(e.replica_id == 0 and e.time > cut_at
                           for e in run.worker_events(MajorityLost))
            wait_until(lambda: run.last_step(1) >= majority_at + CUT_STEPS and cut_off_knows(),
                       120, f"replicas 1 and 2 to commit {CUT_STEPS} steps and replica 0 to "
                            "find its majority lost")
            healed_at = time.time()
        run.end_early()
        wait_controller(run, pid, 300)
    by_replica = commits(run.run_dir)
    without_zero = {e.step for r in (1, 2) for e in by_replica[r]
                    if e.time > cut_at and e.contributors == 2}
    assert without_zero, "the majority side never trained without replica 0"
    # Replica 0 trained none of the steps the majority side trained without it (a
    # caught-up commit takes the majority's state: that is the same history).
    trained = {e.step for e in by_replica[0] if not e.caught_up}
    assert not trained & without_zero, sorted(trained & without_zero)
    # and committed nothing past the step it was in when cut off, until it was replaced
    restarted_at = max(e.time for e in run.worker_events(WorkerStarted) if e.replica_id == 0)
    during = [e.step for e in by_replica[0] if cut_at <= e.time < min(healed_at, restarted_at)]
    assert all(step <= last_before + 1 for step in during), (last_before, during)
    # the controller replaced it: drained its node, promoted the standby, which caught up
    (fault,) = run.events(controller_events.NodeFaultDetected)
    assert fault.node == cut and fault.replica_id == 0, fault
    (promoted,) = run.events(controller_events.StandbyPromoted)
    assert promoted.replica_id == 0 and promoted.node != cut
    rejoined = [e for e in by_replica[0] if e.caught_up]
    assert rejoined and rejoined[0].step > last_before + 1
    assert by_replica[0][-1].step == run.steps - 1
    summary = run.check_results()        # identical finals, one history, every sample once
    assert summary["promotions"] == 1 and summary["nodes_drained"] == [cut]
