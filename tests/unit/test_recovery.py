"""The recovery controller's decision table (pure)."""

from dataclasses import replace

from ft_launch.launcher import recovery as rc


def state(replicas=3, standby=("s1",), nodes_per_replica=1):
    """Every replica launched and running, none has committed a step yet."""
    return rc.RunState(
        replicas=tuple(rc.Replica(r, tuple(f"n{r * nodes_per_replica + k}"
                                           for k in range(nodes_per_replica)),
                                  rc.ReplicaState.RUNNING)
                       for r in range(replicas)),
        standby=tuple(standby), nodes_per_replica=nodes_per_replica)


def test_node_fault_evicts_and_promotes_a_warm_standby():
    new, actions = rc.decide(state(), rc.NodeFaulted(1, "n1", "gpu lost"))
    assert actions == [rc.EvictNode("n1", "gpu lost"), rc.CancelReplica(1),
                       rc.PromoteStandby(1, "s1")]
    assert new.replica(1).nodes == ("s1",) and new.replica(1).state is rc.ReplicaState.RECOVERING
    assert new.standby == () and new.evicted == ("n1",)
    progressed, _ = rc.decide(new, rc.ReplicaProgressed(1))
    assert progressed.replica(1).state is rc.ReplicaState.RUNNING


def test_crash_without_cause_is_retried_in_place_then_the_node_is_evicted():
    running, _ = rc.decide(state(), rc.ReplicaProgressed(2))
    first, actions = rc.decide(running, rc.ReplicaCrashed(2, exit_code=1))
    assert actions == [rc.RelaunchReplica(2, ("n2",))]
    _, actions = rc.decide(first, rc.ReplicaCrashed(2, exit_code=1))
    assert actions[0] == rc.EvictNode("n2", actions[0].reason)
    assert "failed 2 times" in actions[0].reason
    assert rc.PromoteStandby(2, "s1") in actions
    # progress in between resets the count: a later crash is retried in place again
    healed, _ = rc.decide(first, rc.ReplicaProgressed(2))
    _, actions = rc.decide(healed, rc.ReplicaCrashed(2, exit_code=1))
    assert actions == [rc.RelaunchReplica(2, ("n2",))]


def test_no_standby_left_the_replica_is_dropped_and_the_others_go_on():
    new, actions = rc.decide(state(standby=()), rc.NodeFaulted(0, "n0", "xid 79"))
    assert actions == [rc.EvictNode("n0", "xid 79"), rc.CancelReplica(0)]
    assert new.replica(0).state is rc.ReplicaState.FAILED


def test_multi_node_replica_is_relaunched_with_the_standby_in_place_of_the_bad_node():
    _, actions = rc.decide(state(nodes_per_replica=2), rc.NodeFaulted(1, "n3", "nic down"))
    assert rc.RelaunchReplica(1, ("n2", "s1")) in actions


def test_losing_the_majority_restarts_everything_in_the_allocation():
    s = state(replicas=3, standby=("s1", "s2", "s3"))
    s, _ = rc.decide(s, rc.NodeFaulted(0, "n0", "down"))
    s = s.with_replica(replace(s.replica(0), state=rc.ReplicaState.FAILED))
    new, actions = rc.decide(s, rc.NodeFaulted(1, "n1", "down"))
    restart = [a for a in actions if isinstance(a, rc.FullRestart)]
    assert restart and new.restarts == 1
    used = [n for _, nodes in restart[0].placements for n in nodes]
    assert "n0" not in used and "n1" not in used and len(used) == len(set(used))


def test_too_few_nodes_for_a_majority_gives_up():
    s = state(replicas=3, standby=())
    s = s.with_replica(replace(s.replica(0), state=rc.ReplicaState.FAILED, nodes=()))
    _, actions = rc.decide(s, rc.NodeFaulted(1, "n1", "down"))
    assert isinstance(actions[-1], rc.GiveUp) and "requeue" in actions[-1].reason


def test_fault_on_a_standby_node_only_evicts_it():
    new, actions = rc.decide(state(standby=("s1", "s2")), rc.NodeFaulted(None, "s1", "gate"))
    assert actions == [rc.EvictNode("s1", "gate")]
    assert new.standby == ("s2",)


def test_evicting_twice_is_idempotent_and_finished_replicas_are_left_alone():
    s, _ = rc.decide(state(), rc.ReplicaFinished(0))
    _, actions = rc.decide(s, rc.NodeFaulted(0, "n0", "late alarm"))
    assert actions == [rc.EvictNode("n0", "late alarm")]
    _, actions = rc.decide(s, rc.ReplicaCrashed(0, 1))
    assert actions == []


def test_crashing_before_the_first_step_is_fatal_not_a_node_fault():
    first, actions = rc.decide(state(), rc.ReplicaCrashed(0, exit_code=2))
    assert actions == [rc.RelaunchReplica(0, ("n0",))]
    _, actions = rc.decide(first, rc.ReplicaCrashed(0, exit_code=2))
    assert len(actions) == 1 and actions[0].fatal and "training command" in actions[0].reason


def test_losing_two_of_three_with_two_standbys_promotes_both_without_a_restart():
    s = state(replicas=3, standby=("s1", "s2"))
    s, actions = rc.decide(s, rc.NodeFaulted(1, "n1", "down"))
    assert rc.PromoteStandby(1, "s1") in actions
    new, actions = rc.decide(s, rc.NodeFaulted(2, "n2", "down"))
    assert actions == [rc.EvictNode("n2", "down"), rc.CancelReplica(2),
                       rc.PromoteStandby(2, "s2")]
    assert new.restarts == 0 and new.replica(0).state is rc.ReplicaState.RUNNING


def test_two_faults_in_four_replicas_are_two_promotions_not_a_restart():
    s = state(replicas=4, standby=("s1", "s2"))
    s, _ = rc.decide(s, rc.NodeFaulted(1, "n1", "down"))
    new, actions = rc.decide(s, rc.NodeFaulted(2, "n2", "down"))
    assert actions == [rc.EvictNode("n2", "down"), rc.CancelReplica(2),
                       rc.PromoteStandby(2, "s2")]
    back, _ = rc.decide(new, rc.ReplicaProgressed(1))
    _, actions = rc.decide(back, rc.NodeFaulted(3, "n3", "down"))   # no standby left
    assert not any(isinstance(a, rc.FullRestart) for a in actions)


def test_a_requested_restart_relaunches_in_place_without_counting_a_failure():
    running, _ = rc.decide(state(), rc.ReplicaProgressed(1))
    new, actions = rc.decide(running, rc.RestartRequested(1))
    assert actions == [rc.CancelReplica(1), rc.RelaunchReplica(1, ("n1",))]
    assert new.replica(1).state is rc.ReplicaState.RECOVERING and new.replica(1).failures == 0
    done, _ = rc.decide(running, rc.ReplicaFinished(1))
    assert rc.decide(done, rc.RestartRequested(1))[1] == []


def test_a_replenished_standby_joins_the_pool_once_and_an_evicted_node_never():
    s, _ = rc.decide(state(standby=()), rc.StandbyAdded("s9"))
    assert s.standby == ("s9",)
    again, actions = rc.decide(s, rc.StandbyAdded("s9"))
    assert again.standby == ("s9",) and actions == []
    evicted, _ = rc.decide(s, rc.NodeFaulted(None, "s9", "gate"))
    assert rc.decide(evicted, rc.StandbyAdded("s9"))[0].standby == ()


def test_the_batch_host_stays_the_last_standby_promoted():
    start = replace(state(standby=("s1", "bh")), last_standby="bh")
    refilled, _ = rc.decide(start, rc.StandbyAdded("s9"))
    assert refilled.standby == ("s1", "s9", "bh")
    first, actions = rc.decide(refilled, rc.NodeFaulted(0, "n0", "gpu lost"))
    assert rc.PromoteStandby(0, "s1") in actions
    second, actions = rc.decide(first, rc.NodeFaulted(1, "n1", "gpu lost"))
    assert rc.PromoteStandby(1, "s9") in actions
    _, actions = rc.decide(second, rc.NodeFaulted(2, "n2", "gpu lost"))
    assert rc.PromoteStandby(2, "bh") in actions     # only when no other is left
