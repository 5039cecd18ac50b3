"""Loss spike -> rollback, the pure parts: the job-level detector, the controller's
decision (through ``lifecycle.decide``), what a worker may restore and whom it may
train with after a rollback, and the ``spike@loss`` fault."""

from __future__ import annotations

import pytest

from ft_launch.config import SpikePolicy, load_config
from ft_launch.errors import ConfigError, UsageError
from ft_launch.health.anomaly import StepLossSpikes
from ft_launch.launcher.controller import lifecycle, recovery, rollback
from ft_launch.launcher.controller.events import LossSpiked
from ft_launch.launcher.controller.run_state import ReplicaState, RunState
from ft_launch.launcher.worker.protocol import (
    OtherHistoryError,
    QuorumView,
    ReplicaEndpoints,
    plan_step,
)
from ft_launch.launcher.worker.rollbacks import Rollbacks, history_of
from tests.faults.injector import FaultAction, FaultInjector, FaultPoint, parse_faults

# --------------------------------------------------------------------------- detector


def feed(spikes: StepLossSpikes, steps: range, losses: dict[int, float] | None = None,
         replicas: int = 3, history: int = 0) -> list:
    """Every replica reports every step (loss 2.0 unless ``losses`` says otherwise)."""
    found = []
    for step in steps:
        for _ in range(replicas):
            spike = spikes.observe(step, (losses or {}).get(step, 2.0), replicas, history)
            if spike is not None:
                found.append(spike)
    return found


def test_a_step_whose_mean_loss_spikes_is_found_once_all_replicas_reported_it():
    spikes = StepLossSpikes(factor=5.0, window=10)
    assert feed(spikes, range(30)) == []
    assert spikes.observe(30, 40.0, 3) is None      # one replica's batch is not the job's
    assert spikes.observe(30, 2.0, 3) is None
    spike = spikes.observe(30, 2.0, 3)
    assert spike is not None and spike.step == 30 and spike.replicas == 3
    assert spike.loss == pytest.approx(44.0 / 3) and spike.baseline == pytest.approx(2.0)
    assert "step 30" in spike.describe() and "7.3x" in spike.describe()


def test_below_the_factor_during_warm_up_or_not_finite_is_no_spike():
    warm = StepLossSpikes(factor=5.0, window=10)
    # the first window of steps is never judged (losses fall fast at the start)
    assert feed(warm, range(10), {0: 10.0, 9: 100.0}) == []
    assert feed(warm, range(10, 40), {20: 9.9}) == []       # 4.95x: under the factor
    assert warm.observe(40, float("nan"), 1) is None
    assert warm.observe(40, float("inf"), 1) is None


def test_a_replica_that_never_reports_holds_its_step_back_for_two_steps_only():
    spikes = StepLossSpikes(factor=5.0, window=5)
    feed(spikes, range(10))
    # replica 2 died in step 10: the two others' mean is judged once the job is 2 on
    assert spikes.observe(10, 50.0, 3) is None and spikes.observe(10, 50.0, 3) is None
    assert spikes.observe(11, 2.0, 2) is None
    spike = spikes.observe(12, 2.0, 2)
    assert spike is not None and (spike.step, spike.replicas) == (10, 2)
    assert spikes.observe(10, 2.0, 3) is None               # its late line: passed over


def test_a_spike_stays_out_of_the_baseline_and_a_new_history_starts_the_steps_again():
    spikes = StepLossSpikes(factor=5.0, window=5)
    feed(spikes, range(10))
    # spiking values are not the baseline: the next spike is judged against 2.0 too
    assert [s.step for s in feed(spikes, range(10, 13), {10: 30.0, 11: 30.0})] == [10, 11]
    # rolled back to step 5: the new history's steps are judged again, from step 6 on
    assert [s.step for s in feed(spikes, range(6, 12), {10: 30.0}, history=1)] == [10]
    # and lines of the old history, read late, are passed over
    assert feed(spikes, range(12, 20), {14: 30.0}, history=0) == []


# --------------------------------------------------------------------------- config


def test_the_spike_keys_are_validated_and_reach_the_controller_policy():
    config = load_config(env={"FTL_RECOVERY_SPIKE_POLICY": "report",
                              "FTL_RECOVERY_SPIKE_WINDOW": "50"},
                         overrides=["recovery.spike_factor=3", "recovery.max_rollbacks=1"])
    expected = rollback.SpikeRules(SpikePolicy.REPORT, 1, 50)
    assert lifecycle.Policy.from_config(config).spikes == expected
    assert load_config(env={}).recovery.spike_policy is SpikePolicy.ROLLBACK
    for override, expected in (("recovery.spike_policy=undo", "'rollback', 'report', 'off'"),
                               ("recovery.spike_factor=1", r"at most 1000 \(got 1.0\)"),
                               ("recovery.spike_window=2", "at least 3"),
                               ("recovery.max_rollbacks=-1", "at least 0")):
        with pytest.raises(ConfigError, match=expected):
            load_config(env={}, overrides=[override])


# --------------------------------------------------------------------------- decision

RULES = rollback.SpikeRules(SpikePolicy.ROLLBACK, max_rollbacks=2, window=20)


def running(replicas: int = 3, rules: rollback.SpikeRules = RULES) -> lifecycle.ControllerState:
    run = RunState.initial(("python", "train.py"), "a" * 64,
                           {r: (f"n{r}",) for r in range(replicas)}, 1000.0, standby=("s1",))
    state = lifecycle.decide(lifecycle.ControllerState.initial(run, lifecycle.Policy(spikes=rules)),
                             lifecycle.RunStarted(), at(0)).state
    for r in range(replicas):
        state = lifecycle.decide(state, lifecycle.ProcessStarted(r), at(0)).state
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(1)).state
    return state


def at(t: float) -> lifecycle.Now:
    return lifecycle.Now(elapsed=t, wall=1000.0 + t)


def spike(step: int, history: int = 0) -> rollback.LossSpikeFound:
    return rollback.LossSpikeFound(step, 30.0, 2.0, 3, history)


def test_a_spike_restarts_every_replica_in_place_all_cancelled_before_any_launch():
    state = running()
    decision = lifecycle.decide(state, spike(85), at(2))
    (record,) = [a for a in decision.actions if isinstance(a, LossSpiked)]
    assert (record.step, record.action, record.replicas) == (85, "rollback", 3)
    assert "15.0x the median 2" in record.reason and "before step 85" in record.reason
    orders = [a for a in decision.actions if isinstance(a, recovery.RecoveryAction)]
    assert [type(a).__name__ for a in orders] == ["CancelReplica"] * 3 + ["RelaunchReplica"] * 3
    assert [(a.replica_id, a.nodes) for a in orders[3:]] == [(r, (f"n{r}",)) for r in range(3)]
    assert all(a.command == ("python", "train.py") and a.reason for a in orders[3:])
    # a rollback is no failure: nothing evicted, nothing counted, the standby kept
    after = decision.state
    assert after.rolled_back == (85,)
    assert all(r.state is ReplicaState.RECOVERING and r.failures == 0
               for r in after.run.replicas)
    assert after.run.evicted == () and after.run.standby == ("s1",)
    assert all(w.live and w.awaiting_start for w in after.watch)


def test_a_spike_recurring_after_its_rollback_and_rollbacks_past_the_limit_are_reported():
    state = lifecycle.decide(running(), spike(85), at(2)).state
    # lines of the history rolled back, read late: nothing at all
    stale = lifecycle.decide(state, spike(90, history=0), at(3))
    assert stale.actions == [] and stale.state.rolled_back == (85,)
    for r in range(3):
        state = lifecycle.decide(state, lifecycle.ProcessStarted(r), at(4)).state
        state = lifecycle.decide(state, lifecycle.StepsCommitted(r), at(5)).state
    again = lifecycle.decide(state, spike(85 + 20, history=1), at(6))
    (record,) = again.actions
    assert isinstance(record, LossSpiked) and record.action == "report"
    assert "came back within 20 steps of the spike at step 85" in record.reason
    second = lifecycle.decide(state, spike(200, history=1), at(6))
    assert second.state.rolled_back == (85, 200)
    third = lifecycle.decide(second.state, spike(400, history=2), at(7))
    assert [a.action for a in third.actions] == ["report"]
    assert "2 rollback(s) already" in third.actions[0].reason


def test_the_report_policy_and_a_finished_run_roll_nothing_back():
    reported = lifecycle.decide(running(rules=rollback.SpikeRules(SpikePolicy.REPORT)), spike(85),
                                at(2))
    assert [type(a) for a in reported.actions] == [LossSpiked]
    assert reported.actions[0].action == "report" and reported.state.rolled_back == ()
    state = running()
    state = lifecycle.decide(state, lifecycle.StepExited(0, 0), at(2)).state   # replica 0 finished
    finished = lifecycle.decide(state, spike(85), at(3))
    assert [a.action for a in finished.actions] == ["report"]
    assert "training finished" in finished.actions[0].reason


# --------------------------------------------------------------------------- worker side


def test_only_states_no_rollback_went_back_before_are_restorable():
    rollbacks = Rollbacks.parse("85,200")
    assert rollbacks.history == 2 and rollbacks.to_env() == "85,200"
    assert rollbacks.restorable(84, 0) and not rollbacks.restorable(85, 0)
    assert rollbacks.restorable(199, 1) and not rollbacks.restorable(150, 2 + 1)
    assert not rollbacks.restorable(200, 1) and rollbacks.restorable(500, 2)
    assert Rollbacks.from_env({}).restorable(10**6, 0)
    for bad in ("x", "1,-2"):
        with pytest.raises(UsageError, match="FTL_WORKER_ROLLBACKS"):
            Rollbacks.parse(bad)
    assert history_of({"loader_state": {"positions": [0], "history": 2}}) == 2
    assert history_of({"loader_state": {"positions": [0]}}) == 0 == history_of({})
    assert history_of({"loader_state": {"history": "2"}}) == -1


def members(histories: dict[int, int], behind: tuple[int, ...] = ()) -> QuorumView:
    return QuorumView(5, 90, tuple(
        (r, ReplicaEndpoints(((f"h{r}", 1),), ((f"h{r}", 2),), h).encode())
        for r, h in sorted(histories.items())), behind)


def test_replicas_of_two_histories_never_share_a_ring():
    with pytest.raises(OtherHistoryError, match=r"replica\(s\) \[2\]"):
        plan_step(members({0: 1, 1: 1, 2: 0}), 0, 0, None, 90)
    with pytest.raises(OtherHistoryError, match=r"\[0, 1\]"):
        plan_step(members({0: 1, 1: 1, 2: 0}), 2, 0, None, 90)
    plan = plan_step(members({0: 1, 1: 1}, behind=(1,)), 1, 0, None, 86)
    assert plan.kind.value == "catch_up" and plan.step == 90
    old = ReplicaEndpoints.decode('{"ftar": [["h", 1]], "state": [["h", 2]]}')
    assert old.history == 0


def test_a_spike_fault_is_handed_over_once_per_run(tmp_path):
    (fault,) = parse_faults("spike@loss:85/0@n2")
    assert (fault.action, fault.point, fault.step, fault.rank, fault.node) == (
        FaultAction.SPIKE, FaultPoint.LOSS, 85, 0, "n2")
    for bad in ("spike@gradients:85", "nan@loss:85"):
        with pytest.raises(UsageError, match="spike at loss only"):
            parse_faults(bad)
    fired = tmp_path / "faults" / "replica-0-rank-0"
    first = FaultInjector(parse_faults("spike@loss:85,nan@gradients:90+"), fired)
    assert first.check(FaultPoint.LOSS, 85) and not first.check(FaultPoint.LOSS, 85)
    # the next incarnation (restarted by the rollback) trains step 85 again, unspiked
    again = FaultInjector(parse_faults("spike@loss:85,nan@gradients:90+"), fired)
    assert not again.check(FaultPoint.LOSS, 85)
    assert again.check(FaultPoint.GRADIENTS, 91)    # one from a step on is no one-shot
