"""The controller's one decision, ``lifecycle.decide`` (pure): observation rules, the
composition of the recovery and code-version tables, and the reasons it gives."""

from __future__ import annotations

from ft_launch.errors import ExitCode
from ft_launch.launcher.controller import lifecycle, recovery, versions
from ft_launch.launcher.controller.events import NodeFaultDetected
from ft_launch.launcher.controller.run_state import ReplicaState, RunState

POLICY = lifecycle.Policy(lost_timeout=10.0, start_timeout=60.0, finish_grace=30.0)


def at(t: float) -> lifecycle.Now:
    return lifecycle.Now(elapsed=t, wall=1000.0 + t)


def started(replicas=3, standby=("s1",)):
    """Every replica launched (t=0) and its process started."""
    run = RunState.initial(("python", "train.py"), "a" * 64,
                           {r: (f"n{r}",) for r in range(replicas)}, 1000.0, standby=standby)
    decision = lifecycle.decide(lifecycle.ControllerState.initial(run, POLICY),
                                lifecycle.RunStarted(), at(0))
    state = decision.state
    for r in range(replicas):
        state = lifecycle.decide(state, lifecycle.ProcessStarted(r), at(0)).state
    return state, decision


def orders(decision):
    return [a for a in decision.actions if not isinstance(a, versions.Event)]


def test_the_run_starts_every_replica_on_version_1_with_a_reason():
    state, decision = started()
    starts = [a for a in decision.actions if isinstance(a, lifecycle.StartReplica)]
    assert [(a.replica_id, a.nodes, a.command) for a in starts] == [
        (r, (f"n{r}",), ("python", "train.py")) for r in range(3)]
    assert all(a.reason for a in starts) and decision.reason
    assert [type(a).__name__ for a in decision.actions].count("CodeVersionApplied") == 3
    assert all(r.state is ReplicaState.STARTING for r in state.run.replicas)


def test_commits_of_a_cancelled_process_do_not_bring_its_replica_back():
    state, _ = started()
    fault = lifecycle.decide(state, lifecycle.NodesReported((("n1", "Slurm reports DOWN"),)), at(1))
    assert fault.state.run.replica(1).state is ReplicaState.RECOVERING
    stale = lifecycle.decide(fault.state, lifecycle.StepsCommitted(1), at(2))
    assert stale.state.run.replica(1).state is ReplicaState.RECOVERING
    back = lifecycle.decide(lifecycle.decide(stale.state, lifecycle.ProcessStarted(1), at(3)).state,
                            lifecycle.StepsCommitted(1), at(3))
    assert back.state.run.replica(1).state is ReplicaState.RUNNING


def test_a_node_fault_is_recorded_then_evicted_with_its_reason_on_every_action():
    state, _ = started()
    decision = lifecycle.decide(state, lifecycle.NodesReported((("n1", "Slurm reports DOWN"),
                                                                ("n9", "not ours"))), at(1))
    (record,) = [a for a in decision.actions if isinstance(a, NodeFaultDetected)]
    assert (record.node, record.replica_id, record.time) == ("n1", 1, 1001.0)
    assert orders(decision) == [recovery.EvictNode("n1", "Slurm reports DOWN"),
                                recovery.CancelReplica(1), recovery.PromoteStandby(1, "s1")]
    assert all(a.reason for a in orders(decision))
    assert orders(decision)[-1].command == ("python", "train.py")
    assert "Slurm reports DOWN" in decision.reason


def test_exit_0_with_a_failing_node_is_a_node_fault_not_a_finish():
    state, _ = started()
    decision = lifecycle.decide(state, lifecycle.StepExited(0, 0, (("n0", "Slurm reports DOWN"),)),
                                at(1))
    assert recovery.EvictNode("n0", "step ended with its node failing (Slurm reports DOWN)") \
        in decision.actions
    finished = lifecycle.decide(state, lifecycle.StepExited(0, 0), at(1))
    assert finished.state.run.replica(0).state is ReplicaState.FINISHED
    assert orders(finished) == []


def test_the_gate_exit_evicts_the_first_node_with_the_gate_reason():
    state, _ = started()
    decision = lifecycle.decide(
        state, lifecycle.StepExited(2, ExitCode.NODE_UNHEALTHY, (), "gpu3 xid 79"), at(1))
    assert recovery.EvictNode("n2", "gpu3 xid 79") in decision.actions
    unknown = lifecycle.decide(state, lifecycle.StepExited(2, ExitCode.NODE_UNHEALTHY), at(1))
    assert "health gate failed" in orders(unknown)[0].reason


def test_the_run_finishes_when_all_have_or_after_the_grace():
    state, _ = started(replicas=2)
    one = lifecycle.decide(state, lifecycle.StepExited(0, 0), at(5))
    assert not any(isinstance(a, lifecycle.FinishRun) for a in one.actions)
    waited = lifecycle.decide(one.state, lifecycle.Tick(), at(5 + POLICY.finish_grace + 1))
    assert [a for a in waited.actions if isinstance(a, lifecycle.FinishRun)] == [
        lifecycle.FinishRun("training finished")]
    both = lifecycle.decide(one.state, lifecycle.StepExited(1, 0), at(6))
    assert isinstance(both.actions[-1], lifecycle.FinishRun)


def test_a_replica_relaunched_after_the_run_finished_is_finished_not_relaunched():
    """Replica 1 crashed and was relaunched while replica 0 finished the run; the
    relaunch found nothing to join (exit 77, ``worker.exits``): no more relaunches,
    and the run finishes, successfully."""
    state, _ = started(replicas=2)
    state = lifecycle.decide(state, lifecycle.StepExited(1, 1), at(1)).state   # retried in place
    state = lifecycle.decide(state, lifecycle.StepExited(0, 0), at(2)).state   # finished the run
    late = lifecycle.decide(state, lifecycle.StepExited(1, ExitCode.RUN_FINISHED), at(3))
    assert late.state.run.replica(1).state is ReplicaState.FINISHED
    assert orders(late) == [lifecycle.FinishRun("training finished")]
    assert "nothing to join" in late.reason


def test_a_relaunched_replica_gets_the_start_timeout_alone():
    state, _ = started()
    crashed = lifecycle.decide(state, lifecycle.StepExited(0, 1), at(1)).state
    assert crashed.run.replica(0).state is ReplicaState.RECOVERING
    assert not orders(lifecycle.decide(crashed, lifecycle.Tick(), at(1 + POLICY.start_timeout)))
    late = lifecycle.decide(crashed, lifecycle.Tick(), at(2 + POLICY.start_timeout))
    assert orders(late) == [lifecycle.DiagnoseHang(0, ("n0",))]
    assert "made no progress" in late.reason
    evicted = lifecycle.decide(late.state,
                               lifecycle.HangDiagnosed(0, ("n0",), "rank 0 on n0 in load"),
                               at(3 + POLICY.start_timeout))
    assert recovery.CancelReplica(0) in evicted.actions


def test_a_crash_that_rolls_back_an_update_relaunches_in_place():
    state, _ = started(replicas=2, standby=())
    for r in range(2):
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(1)).state
    request = versions.UpdateRequest(1, ("python", "v2.py"), True, None, "v2", "b" * 64, 1000.0)
    updated = lifecycle.decide(state, versions.UpdateRequested(request), at(2))
    relaunch = [a for a in updated.actions if isinstance(a, recovery.RelaunchReplica)]
    assert [(a.replica_id, a.command) for a in relaunch] == [(0, ("python", "v2.py"))]
    state = updated.state
    for t in (3, 4):                                         # v2 fails twice, no step
        state = lifecycle.decide(state, lifecycle.ProcessStarted(0), at(t)).state
        decision = lifecycle.decide(state, lifecycle.StepExited(0, 1), at(t))
        state = decision.state
    assert state.run.current == 1 and state.run.bad == (2,)
    assert not any(isinstance(a, recovery.EvictNode) for a in decision.actions)
    (again,) = [a for a in decision.actions if isinstance(a, recovery.RelaunchReplica)]
    assert again.command == ("python", "train.py") and "code version 2" in again.reason


def test_every_replica_without_a_node_gives_up_and_nothing_follows():
    state, _ = started(replicas=1, standby=())
    decision = lifecycle.decide(state, lifecycle.InspectionAlarmed("n0", "inspection: xid 79"),
                                at(1))
    assert isinstance(decision.actions[-1], recovery.GiveUp)
    assert not any(isinstance(a, lifecycle.FinishRun) for a in decision.actions)


def test_a_node_whose_gradients_keep_holding_nan_is_evicted_as_corrupting():
    """One NaN step costs the quorum one retried step; the third from the same node
    (``nonfinite_limit``) evicts it, and only it, with an sdc reason."""
    state, _ = started()
    for t in (1, 2):
        decision = lifecycle.decide(state, lifecycle.GradientsNonFinite(1, ("n1",)), at(t))
        assert orders(decision) == [] and "NaN/Inf gradients from n1" in decision.reason
        state = decision.state
    third = lifecycle.decide(state, lifecycle.GradientsNonFinite(1, ("n1",)), at(3))
    (evict, cancel, promote) = orders(third)
    assert (evict, cancel, promote) == (recovery.EvictNode("n1", evict.reason),
                                        recovery.CancelReplica(1), recovery.PromoteStandby(1, "s1"))
    assert evict.reason == "sdc: gradients computed on n1 held NaN/Inf in 3 steps (replica 1)"
    assert dict(third.state.nonfinite_steps) == {"n1": 3}


def test_nan_gradients_never_evict_when_the_limit_is_0():
    run = RunState.initial(("python", "train.py"), "a" * 64, {0: ("n0",), 1: ("n1",)},
                           1000.0, standby=("s1",))
    policy = lifecycle.Policy(lost_timeout=10.0, start_timeout=60.0, finish_grace=30.0,
                              nonfinite_limit=0)
    state = lifecycle.decide(lifecycle.ControllerState.initial(run, policy),
                             lifecycle.RunStarted(), at(0)).state
    for t in range(1, 10):
        decision = lifecycle.decide(state, lifecycle.GradientsNonFinite(0, ("n0",)), at(t))
        assert orders(decision) == []
        state = decision.state


def test_a_replica_the_quorum_lost_is_evicted_once_the_reporter_trains_on_without_it():
    state, _ = started()
    for r in range(3):
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(1)).state
    reported = lifecycle.decide(state, lifecycle.QuorumLostMembers(0, (2,)), at(2))
    assert orders(reported) == [] and reported.state.suspects == ((2, 0),)
    # too soon: replica 2 committed less than member_timeout ago (it may be alive)
    early = lifecycle.decide(reported.state, lifecycle.StepsCommitted(0), at(2.5))
    assert orders(early) == [] and early.state.suspects == ((2, 0),)
    # the reporter commits again without it (long before lost_timeout), and replica 2
    # has been silent (since 1) for as long as the quorum waits for a member: lost
    on = lifecycle.decide(early.state, lifecycle.StepsCommitted(0),
                          at(1 + state.policy.member_timeout))
    assert on.state.suspects == ()
    assert orders(on)[:3] == [recovery.EvictNode("n2", orders(on)[0].reason),
                              recovery.CancelReplica(2), recovery.PromoteStandby(2, "s1")]
    assert orders(on)[0].reason == "the quorum of replica 0 lost replica 2, and replica 0 trained on without it"


def test_a_lost_report_is_withdrawn_when_the_replica_commits_first():
    """A partitioned leader loses everyone; the others go on committing: nobody is
    evicted on its word."""
    state, _ = started()
    for r in range(3):
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(1)).state
    state = lifecycle.decide(state, lifecycle.QuorumLostMembers(0, (1, 2)), at(2)).state
    for r in (1, 2, 0):
        decision = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(3))
        assert orders(decision) == []
        state = decision.state
    assert state.suspects == ()


def test_a_relaunched_replica_reported_lost_is_not_evicted():
    state, _ = started()
    crashed = lifecycle.decide(state, lifecycle.StepExited(1, 1), at(1)).state   # retried in place
    reported = lifecycle.decide(crashed, lifecycle.QuorumLostMembers(0, (1,)), at(2))
    assert reported.state.suspects == ()
    assert orders(lifecycle.decide(reported.state, lifecycle.StepsCommitted(0), at(3))) == []


def test_a_relaunched_replica_waiting_for_the_replicas_it_lost_is_not_blamed():
    """Two nodes crash and the third replica's process dies: relaunched, it reports the
    other two lost and cannot commit without them (too few for a quorum). Its silence
    is not its node's fault while Slurm has not yet said theirs are gone (from 24.11 a
    lab SlurmdTimeout of 30 s, in production 300 s by default); once they are
    replaced its start timeout runs from their launch."""
    state, _ = started(standby=("s1", "s2"))
    for r in range(3):
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(1)).state
    state = lifecycle.decide(state, lifecycle.StepExited(2, 137), at(2)).state   # retried in place
    state = lifecycle.decide(state, lifecycle.ProcessStarted(2), at(3)).state
    reported = lifecycle.decide(state, lifecycle.QuorumLostMembers(2, (0, 1)), at(4))
    assert reported.state.suspects == ((0, 2), (1, 2))
    waiting = lifecycle.decide(reported.state, lifecycle.Tick(), at(3 + 2 * POLICY.start_timeout))
    assert orders(waiting) == []
    gone = lifecycle.NodesReported((("n0", "Slurm reports DOWN"), ("n1", "Slurm reports DOWN")))
    replaced_at = 4 + 2 * POLICY.start_timeout
    replaced = lifecycle.decide(waiting.state, gone, at(replaced_at))
    assert [a for a in orders(replaced) if isinstance(a, recovery.PromoteStandby)] == [
        recovery.PromoteStandby(0, "s1"), recovery.PromoteStandby(1, "s2")]
    assert orders(lifecycle.decide(replaced.state, lifecycle.Tick(),
                                   at(replaced_at + POLICY.start_timeout))) == []
    late = lifecycle.decide(replaced.state, lifecycle.Tick(),
                            at(replaced_at + POLICY.start_timeout + 1))
    assert lifecycle.DiagnoseHang(2, ("n2",)) in orders(late)


# --------------------------------------------------------------------------- hang diagnosis


def two_node_replicas(standby=("s1",), policy=POLICY):
    """Three replicas of two nodes (nXa, nXb), launched at t=0 and started."""
    run = RunState.initial(("python", "train.py"), "a" * 64,
                           {r: (f"n{r}a", f"n{r}b") for r in range(3)}, 1000.0,
                           standby=standby, nodes_per_replica=2)
    state = lifecycle.decide(lifecycle.ControllerState.initial(run, policy),
                             lifecycle.RunStarted(), at(0)).state
    for r in range(3):
        state = lifecycle.decide(state, lifecycle.ProcessStarted(r), at(0)).state
    return state


def replica_2_stalls(state):
    """Replicas 0 and 1 commit every second; replica 2 never does. Returns the state and
    the first decision that ordered something, and when."""
    for t in range(1, 30):
        for r in (0, 1):
            state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(t)).state
        decision = lifecycle.decide(state, lifecycle.Tick(), at(t))
        state = decision.state
        if orders(decision):
            return state, decision, t
    raise AssertionError("replica 2 was never found stalled")


def test_a_stalled_replica_is_diagnosed_before_anything_is_cancelled():
    state, decision, t = replica_2_stalls(two_node_replicas())
    assert t > POLICY.lost_timeout
    assert orders(decision) == [lifecycle.DiagnoseHang(2, ("n2a", "n2b"))]
    assert "made no progress" in decision.reason
    assert not any(isinstance(a, NodeFaultDetected) for a in decision.actions)
    # while its stacks are taken, time passing orders nothing more
    later = lifecycle.decide(state, lifecycle.Tick(), at(t + 5))
    assert orders(later) == []
    found = lifecycle.decide(later.state, lifecycle.HangDiagnosed(
        2, ("n2b",), "rank 1 on n2b, pid 7 in injected_deadlock (faults.py:120)"), at(t + 6))
    (record,) = [a for a in found.actions if isinstance(a, NodeFaultDetected)]
    assert (record.node, record.replica_id) == ("n2b", 2)
    evict, cancel, relaunch = orders(found)
    assert evict == recovery.EvictNode("n2b", evict.reason)
    assert evict.reason.startswith("hang: rank 1 on n2b, pid 7 in injected_deadlock")
    assert "replica 2 made no progress" in evict.reason
    assert cancel == recovery.CancelReplica(2)
    assert relaunch == recovery.RelaunchReplica(2, ("n2a", "s1"))   # the healthy node stays
    assert found.state.diagnosing == ()


def test_a_failed_diagnosis_evicts_every_node_of_the_replica_relaunched_once():
    state, _, t = replica_2_stalls(two_node_replicas(standby=("s1", "s2")))
    found = lifecycle.decide(
        state, lifecycle.HangDiagnosed(2, (), error="srun on n2a did not start"), at(t + 1))
    evicted = [a.node for a in orders(found) if isinstance(a, recovery.EvictNode)]
    assert evicted == ["n2a", "n2b"]
    assert "srun on n2a did not start" in orders(found)[0].reason
    (relaunch,) = [a for a in orders(found) if isinstance(a, recovery.RelaunchReplica)]
    assert relaunch.nodes == ("s1", "s2")
    assert found.state.run.replica(2).failures == 1    # one failure, not one per node


def test_a_diagnosis_never_answered_evicts_the_replica_after_twice_its_bound():
    state, _, t = replica_2_stalls(two_node_replicas(standby=("s1", "s2")))
    limit = 2 * POLICY.diagnosis_timeout
    assert orders(lifecycle.decide(state, lifecycle.Tick(), at(t + limit))) == []
    late = lifecycle.decide(state, lifecycle.Tick(), at(t + limit + 1))
    assert [a.node for a in orders(late) if isinstance(a, recovery.EvictNode)] == ["n2a", "n2b"]
    assert "no stacks within" in orders(late)[0].reason
    assert not any(isinstance(a, lifecycle.DiagnoseHang) for a in late.actions)


def test_a_diagnosis_of_a_replica_that_moved_on_evicts_nothing():
    state, _, t = replica_2_stalls(two_node_replicas())
    state = lifecycle.decide(state, lifecycle.StepsCommitted(2), at(t + 1)).state   # slow only
    found = lifecycle.decide(state, lifecycle.HangDiagnosed(2, ("n2b",), "rank 1 in load"),
                             at(t + 2))
    assert orders(found) == [] and "moved on" in found.reason
    crashed = lifecycle.decide(replica_2_stalls(two_node_replicas())[0], lifecycle.StepExited(2, 1),
                               at(t + 1)).state                                  # or it exited
    assert orders(lifecycle.decide(crashed, lifecycle.HangDiagnosed(2, ("n2b",)), at(t + 2))) == []


def test_without_hang_diagnosis_a_stall_evicts_its_first_node_at_once():
    policy = lifecycle.Policy(lost_timeout=10.0, start_timeout=60.0, hang_diagnosis=False)
    _, decision, _ = replica_2_stalls(two_node_replicas(policy=policy))
    assert orders(decision)[:2] == [recovery.EvictNode("n2a", orders(decision)[0].reason),
                                    recovery.CancelReplica(2)]
