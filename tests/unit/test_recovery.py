"""The recovery controller's decision table (pure)."""

from dataclasses import replace

from ft_launch.launcher.controller import recovery


def state(replicas=3, standby=("s1",), nodes_per_replica=1):
    """Every replica launched and running, none has committed a step yet."""
    return recovery.RunState(
        replicas=tuple(recovery.Replica(r, tuple(f"n{r * nodes_per_replica + k}"
                                                 for k in range(nodes_per_replica)),
                                        recovery.ReplicaState.RUNNING)
                       for r in range(replicas)),
        standby=tuple(standby), nodes_per_replica=nodes_per_replica)


def test_node_fault_evicts_and_promotes_a_warm_standby():
    new, actions = recovery.decide(state(), recovery.NodeFaulted(1, "n1", "gpu lost"))
    assert actions == [recovery.EvictNode("n1", "gpu lost"), recovery.CancelReplica(1),
                       recovery.PromoteStandby(1, "s1")]
    assert new.replica(1).nodes == ("s1",)
    assert new.replica(1).state is recovery.ReplicaState.RECOVERING
    assert new.standby == () and new.evicted == ("n1",)
    progressed, _ = recovery.decide(new, recovery.ReplicaProgressed(1))
    assert progressed.replica(1).state is recovery.ReplicaState.RUNNING


def test_crash_without_cause_is_retried_in_place_then_the_node_is_evicted():
    running, _ = recovery.decide(state(), recovery.ReplicaProgressed(2))
    first, actions = recovery.decide(running, recovery.ReplicaCrashed(2, exit_code=1))
    assert actions == [recovery.RelaunchReplica(2, ("n2",))]
    _, actions = recovery.decide(first, recovery.ReplicaCrashed(2, exit_code=1))
    assert actions[0] == recovery.EvictNode("n2", actions[0].reason)
    assert "failed 2 times" in actions[0].reason
    assert recovery.PromoteStandby(2, "s1") in actions
    # progress in between resets the count: a later crash is retried in place again
    healed, _ = recovery.decide(first, recovery.ReplicaProgressed(2))
    _, actions = recovery.decide(healed, recovery.ReplicaCrashed(2, exit_code=1))
    assert actions == [recovery.RelaunchReplica(2, ("n2",))]


def test_no_standby_left_the_replica_is_dropped_and_the_others_go_on():
    new, actions = recovery.decide(state(standby=()), recovery.NodeFaulted(0, "n0", "xid 79"))
    assert actions == [recovery.EvictNode("n0", "xid 79"), recovery.CancelReplica(0)]
    assert new.replica(0).state is recovery.ReplicaState.FAILED


def test_multi_node_replica_is_relaunched_with_the_standby_in_place_of_the_bad_node():
    _, actions = recovery.decide(state(nodes_per_replica=2),
                                 recovery.NodeFaulted(1, "n3", "nic down"))
    assert recovery.RelaunchReplica(1, ("n2", "s1")) in actions


def test_losing_the_majority_restarts_everything_in_the_allocation():
    s = state(replicas=3, standby=("s1", "s2", "s3"))
    s, _ = recovery.decide(s, recovery.NodeFaulted(0, "n0", "down"))
    s = s.with_replica(replace(s.replica(0), state=recovery.ReplicaState.FAILED))
    new, actions = recovery.decide(s, recovery.NodeFaulted(1, "n1", "down"))
    restart = [a for a in actions if isinstance(a, recovery.FullRestart)]
    assert restart and new.restarts == 1
    used = [n for _, nodes in restart[0].placements for n in nodes]
    assert "n0" not in used and "n1" not in used and len(used) == len(set(used))


def test_too_few_nodes_for_a_majority_gives_up():
    s = state(replicas=3, standby=())
    s = s.with_replica(replace(s.replica(0), state=recovery.ReplicaState.FAILED, nodes=()))
    _, actions = recovery.decide(s, recovery.NodeFaulted(1, "n1", "down"))
    assert isinstance(actions[-1], recovery.GiveUp) and "requeue" in actions[-1].reason


def test_fault_on_a_standby_node_only_evicts_it():
    new, actions = recovery.decide(state(standby=("s1", "s2")),
                                   recovery.NodeFaulted(None, "s1", "gate"))
    assert actions == [recovery.EvictNode("s1", "gate")]
    assert new.standby == ("s2",)


def test_evicting_twice_is_idempotent_and_finished_replicas_are_left_alone():
    s, _ = recovery.decide(state(), recovery.ReplicaFinished(0))
    _, actions = recovery.decide(s, recovery.NodeFaulted(0, "n0", "late alarm"))
    assert actions == [recovery.EvictNode("n0", "late alarm")]
    _, actions = recovery.decide(s, recovery.ReplicaCrashed(0, 1))
    assert actions == []


def test_crashing_before_the_first_step_is_fatal_not_a_node_fault():
    first, actions = recovery.decide(state(), recovery.ReplicaCrashed(0, exit_code=2))
    assert actions == [recovery.RelaunchReplica(0, ("n0",))]
    _, actions = recovery.decide(first, recovery.ReplicaCrashed(0, exit_code=2))
    assert len(actions) == 1 and actions[0].fatal and "training command" in actions[0].reason


def test_losing_two_of_three_with_two_standbys_promotes_both_without_a_restart():
    s = state(replicas=3, standby=("s1", "s2"))
    s, actions = recovery.decide(s, recovery.NodeFaulted(1, "n1", "down"))
    assert recovery.PromoteStandby(1, "s1") in actions
    new, actions = recovery.decide(s, recovery.NodeFaulted(2, "n2", "down"))
    assert actions == [recovery.EvictNode("n2", "down"), recovery.CancelReplica(2),
                       recovery.PromoteStandby(2, "s2")]
    assert new.restarts == 0 and new.replica(0).state is recovery.ReplicaState.RUNNING


def test_two_faults_in_four_replicas_are_two_promotions_not_a_restart():
    s = state(replicas=4, standby=("s1", "s2"))
    s, _ = recovery.decide(s, recovery.NodeFaulted(1, "n1", "down"))
    new, actions = recovery.decide(s, recovery.NodeFaulted(2, "n2", "down"))
    assert actions == [recovery.EvictNode("n2", "down"), recovery.CancelReplica(2),
                       recovery.PromoteStandby(2, "s2")]
    back, _ = recovery.decide(new, recovery.ReplicaProgressed(1))
    _, actions = recovery.decide(back, recovery.NodeFaulted(3, "n3", "down"))   # no standby left
    assert not any(isinstance(a, recovery.FullRestart) for a in actions)


def test_a_requested_restart_relaunches_in_place_without_counting_a_failure():
    running, _ = recovery.decide(state(), recovery.ReplicaProgressed(1))
    new, actions = recovery.decide(running, recovery.RestartRequested(1))
    assert actions == [recovery.CancelReplica(1), recovery.RelaunchReplica(1, ("n1",))]
    assert new.replica(1).state is recovery.ReplicaState.RECOVERING and new.replica(1).failures == 0
    done, _ = recovery.decide(running, recovery.ReplicaFinished(1))
    assert recovery.decide(done, recovery.RestartRequested(1))[1] == []


def test_a_replenished_standby_joins_the_pool_once_and_an_evicted_node_never():
    s, _ = recovery.decide(state(standby=()), recovery.StandbyAdded("s9"))
    assert s.standby == ("s9",)
    again, actions = recovery.decide(s, recovery.StandbyAdded("s9"))
    assert again.standby == ("s9",) and actions == []
    evicted, _ = recovery.decide(s, recovery.NodeFaulted(None, "s9", "gate"))
    assert recovery.decide(evicted, recovery.StandbyAdded("s9"))[0].standby == ()


def test_the_batch_host_stays_the_last_standby_promoted():
    start = replace(state(standby=("s1", "bh")), last_standby="bh")
    refilled, _ = recovery.decide(start, recovery.StandbyAdded("s9"))
    assert refilled.standby == ("s1", "s9", "bh")
    first, actions = recovery.decide(refilled, recovery.NodeFaulted(0, "n0", "gpu lost"))
    assert recovery.PromoteStandby(0, "s1") in actions
    second, actions = recovery.decide(first, recovery.NodeFaulted(1, "n1", "gpu lost"))
    assert recovery.PromoteStandby(1, "s9") in actions
    _, actions = recovery.decide(second, recovery.NodeFaulted(2, "n2", "gpu lost"))
    assert recovery.PromoteStandby(2, "bh") in actions     # only when no other is left
