"""Dual-phase replay in the controller's decision
(``ft_launch.launcher.controller.replay_rule`` through ``lifecycle.decide``): when a
replica of several nodes is replayed, what each verdict evicts, and the fallbacks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ft_launch.health.drain import drain_reason
from ft_launch.launcher.controller import lifecycle, recovery, replay_rule
from ft_launch.launcher.controller.events import NodeFaultDetected, SdcReplayOrdered
from ft_launch.launcher.controller.run_state import ReplicaState, RunState

LIMIT = 3
POLICY = lifecycle.Policy(lost_timeout=10.0, start_timeout=60.0, nonfinite_limit=LIMIT,
                          replay_timeout=50.0)


def at(t: float) -> lifecycle.Now:
    return lifecycle.Now(elapsed=t, wall=1000.0 + t)


def started(replicas: int = 3, standby: tuple[str, ...] = ("s1", "s2"),
            policy: lifecycle.Policy = POLICY) -> lifecycle.ControllerState:
    """Replicas of two nodes each (``nXa``, ``nXb``), all launched, started, training."""
    run = RunState.initial(("python", "train.py"), "a" * 64,
                           {r: (f"n{r}a", f"n{r}b") for r in range(replicas)}, 1000.0,
                           standby=standby, nodes_per_replica=2)
    state = lifecycle.decide(lifecycle.ControllerState.initial(run, policy),
                             lifecycle.RunStarted(), at(0)).state
    for r in range(replicas):
        state = lifecycle.decide(state, lifecycle.ProcessStarted(r), at(0)).state
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(0.5)).state
    return state


def nonfinite(state: lifecycle.ControllerState, steps: int, t: float = 1.0,
              replica: int = 1) -> lifecycle.Decision:
    """``steps`` discards of ``replica`` naming both its nodes (they mix gradients)."""
    nodes = state.run.replica(replica).nodes
    for _ in range(steps):
        decision = lifecycle.decide(state, lifecycle.GradientsNonFinite(replica, nodes), at(t))
        state = decision.state
    return decision


def kinds(decision: lifecycle.Decision, kind: type) -> list:
    return [a for a in decision.actions if isinstance(a, kind)]


def replaying(steps: int = LIMIT) -> tuple[lifecycle.ControllerState, replay_rule.RunReplay]:
    decision = nonfinite(started(), steps)
    (order,) = kinds(decision, replay_rule.RunReplay)
    return decision.state, order


def test_a_multi_node_replica_is_cancelled_and_replayed_at_the_limit_not_evicted():
    state = started()
    early = nonfinite(state, LIMIT - 1)
    assert not early.actions and "2 step(s)" in early.reason
    decision = nonfinite(early.state, 1)
    (cancel,) = kinds(decision, recovery.CancelReplica)
    (order,) = kinds(decision, replay_rule.RunReplay)
    (record,) = kinds(decision, SdcReplayOrdered)
    assert cancel.replica_id == 1 and not kinds(decision, recovery.EvictNode)
    assert decision.actions.index(cancel) < decision.actions.index(order)
    # the standbys are the references; the other training replicas the state's source
    assert (order.suspects, order.references, order.sources) == (
        ("n1a", "n1b"), ("s1", "s2"), (0, 2))
    assert order.command == ("python", "train.py") and "dual-phase replay" in order.reason
    assert record.suspects == ["n1a", "n1b"] and record.steps == LIMIT
    assert not decision.state.watch[1].live          # its step is cancelled
    assert decision.state.run.replica(1).state is ReplicaState.RUNNING


def test_references_come_from_training_replicas_when_standbys_are_short():
    decision = nonfinite(started(standby=("s1",)), LIMIT)
    (order,) = kinds(decision, replay_rule.RunReplay)
    assert order.references == ("s1", "n0a")


def test_the_node_found_alone_is_evicted_and_the_replica_relaunched_with_a_standby():
    state, _ = replaying()
    located = replay_rule.ReplayLocated(1, "found", ("n1b",), (1,), (0,), "replay found")
    decision = lifecycle.decide(state, located, at(20))
    (evict,) = kinds(decision, recovery.EvictNode)
    assert evict.node == "n1b"
    assert drain_reason(evict.reason) == ("ft: sdc: n1b computes NaN/Inf gradients "
                                          "(dual-phase replay: row 1 and column 0 failed)")
    assert [f.node for f in kinds(decision, NodeFaultDetected)] == ["n1b"]
    (relaunch,) = kinds(decision, recovery.RelaunchReplica)
    assert relaunch.nodes == ("n1a", "s1") and relaunch.command == ("python", "train.py")
    assert decision.state.watch[1].live and not decision.state.replays.running
    assert decision.state.run.replica(1).failures == 1


@pytest.mark.parametrize("status, suspects, evicted", [
    ("not_reproduced", (), ("n1a", "n1b")),
    ("ambiguous", ("n1a", "s1"), ("n1a",)),      # a reference node is not the replica's
    ("failed", ("n1b",), ("n1a", "n1b")),        # a failed replay clears nothing
])
def test_no_single_verdict_over_evicts_the_replica_once(status, suspects, evicted):
    state, _ = replaying()
    decision = lifecycle.decide(
        state, replay_rule.ReplayLocated(1, status, suspects, summary="why"), at(20))
    assert tuple(e.node for e in kinds(decision, recovery.EvictNode)) == evicted
    assert f"dual-phase replay {status}" in decision.reason
    assert len(kinds(decision, recovery.RelaunchReplica)
               + kinds(decision, recovery.PromoteStandby)) <= 1
    assert decision.state.run.replica(1).failures == 1       # one failure, not one per node


def test_a_replay_never_answered_fails_after_twice_its_bound_and_a_late_answer_is_moot():
    state, _ = replaying()
    quiet = lifecycle.decide(state, lifecycle.Tick(), at(1 + 2 * POLICY.replay_timeout - 1))
    assert not kinds(quiet, recovery.EvictNode)
    overdue = lifecycle.decide(quiet.state, lifecycle.Tick(), at(2 + 2 * POLICY.replay_timeout))
    assert sorted(e.node for e in kinds(overdue, recovery.EvictNode)) == ["n1a", "n1b"]
    assert "no answer within" in overdue.reason
    late = lifecycle.decide(
        overdue.state, replay_rule.ReplayLocated(1, "found", ("n1b",), (1,), (0,)), at(200))
    assert not late.actions and "given up on" in late.reason


def test_lines_a_cancelled_process_wrote_count_for_nothing():
    state, _ = replaying()
    stale = nonfinite(state, LIMIT)
    assert not stale.actions and stale.state.replays == state.replays
    # relaunched for another fault, its new process not started yet: the old one's lines
    relaunched = lifecycle.decide(
        started(), lifecycle.NodesReported((("n1a", "Slurm reports DOWN"),)), at(1)).state
    assert relaunched.watch[1].awaiting_start
    old_lines = nonfinite(relaunched, LIMIT, t=2)
    assert not old_lines.actions and not old_lines.state.replays.nonfinite


def test_without_a_healthy_replica_or_reference_nodes_every_node_goes_at_once():
    alone = nonfinite(started(replicas=1, standby=("s1", "s2")), LIMIT, replica=0)
    assert sorted(e.node for e in kinds(alone, recovery.EvictNode)) == ["n0a", "n0b"]
    assert not kinds(alone, replay_rule.RunReplay) and "no training replica" in alone.reason
    reservation = replace(POLICY, replay_on_standby=False)   # standbys in their own jobs
    short = nonfinite(started(replicas=2, standby=("s1",), policy=reservation), LIMIT)
    (order,) = kinds(short, replay_rule.RunReplay)
    assert order.references == ("n0a", "n0b")


def test_off_or_on_one_node_replicas_the_per_node_rule_still_holds():
    off = nonfinite(started(policy=replace(POLICY, sdc_replay=False)), LIMIT)
    assert sorted(e.node for e in kinds(off, recovery.EvictNode)) == ["n1a", "n1b"]
    assert not kinds(off, replay_rule.RunReplay)
    run = RunState.initial(("python", "train.py"), "a" * 64, {r: (f"n{r}",) for r in range(3)},
                           1000.0, standby=("s1",))
    state = lifecycle.decide(lifecycle.ControllerState.initial(run, POLICY),
                             lifecycle.RunStarted(), at(0)).state
    for r in range(3):
        state = lifecycle.decide(state, lifecycle.ProcessStarted(r), at(0)).state
    single = nonfinite(state, LIMIT)
    assert [e.node for e in kinds(single, recovery.EvictNode)] == ["n1"]
