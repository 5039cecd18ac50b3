"""The pure parts of the worker runtime: step planning, ledger, LR scaling, faults."""

import math

import numpy as np
import pytest

from ft_launch.config import LrScaling
from ft_launch.errors import FatalError, RecoverableError, UsageError
from ft_launch.launcher.worker.ledger import DataLedger
from ft_launch.launcher.worker.lr import lr_factor
from ft_launch.launcher.worker.protocol import (
    FailureBudget,
    QuorumView,
    ReplicaEndpoints,
    StepKind,
    plan_step,
)
from tests.faults.injector import FaultAction, FaultInjector, FaultPoint, parse_faults


def endpoints(replica: int, ranks: int = 2) -> str:
    return ReplicaEndpoints(tuple(("h", 1000 + 10 * replica + k) for k in range(ranks)),
                            tuple(("h", 2000 + 10 * replica + k) for k in range(ranks))).encode()


def view(quorum_id=7, max_step=10, replicas=(0, 1, 2), behind=()):
    return QuorumView(quorum_id, max_step, tuple((r, endpoints(r)) for r in replicas),
                      tuple(behind))


def test_healthy_replica_trains_and_reconfigures_on_new_quorum():
    plan = plan_step(view(), replica_id=1, rank=1, last_quorum_id=6, next_step=10)
    assert plan.kind is StepKind.TRAIN and plan.step == 10 and plan.reconfigure
    assert plan.ring == (("h", 1001), ("h", 1011), ("h", 1021))  # rank 1 of each replica
    assert plan.my_index == 1 and plan.fetch_from == ()
    again = plan_step(view(), replica_id=1, rank=1, last_quorum_id=7, next_step=10)
    assert not again.reconfigure


def test_behind_replica_catches_up_from_same_rank_of_healthy_replicas():
    plan = plan_step(view(behind=(2,)), replica_id=2, rank=0, last_quorum_id=None,
                     next_step=3)
    assert plan.kind is StepKind.CATCH_UP and plan.step == 10
    assert set(plan.fetch_from) == {("h", 2000), ("h", 2010)}  # rank 0 of replicas 0 and 1
    other_rank = plan_step(view(behind=(2,)), replica_id=2, rank=1, last_quorum_id=None,
                           next_step=3)
    assert other_rank.fetch_from[0] != ("h", 2000 + 1)  # ranks spread over sources
    assert other_rank.fetch_from[0][1] % 10 == 1


def test_not_in_quorum_is_recoverable_and_ahead_is_fatal():
    with pytest.raises(RecoverableError, match="not in the quorum"):
        plan_step(view(replicas=(0, 1)), replica_id=2, rank=0, last_quorum_id=None,
                  next_step=10)
    with pytest.raises(FatalError, match="ahead"):
        plan_step(view(), replica_id=0, rank=0, last_quorum_id=None, next_step=11)


def test_ledger_decodes_who_contributed():
    ledger = DataLedger(3, [5, 5, 2])
    summed = sum(DataLedger(3).contribution_vector(r, 4 if r != 2 else 0) for r in range(3))
    contribution = ledger.decode(9, summed)
    assert contribution.counts == (4, 4, 0) and contribution.contributors == 2
    ledger.commit(contribution)
    assert ledger.positions == [9, 9, 2]
    with pytest.raises(ValueError):
        ledger.decode(9, np.array([0.5, 0, 0]))


@pytest.mark.parametrize("policy, expected", [
    (LrScaling.NONE, 1.0), (LrScaling.LINEAR, 2 / 3), (LrScaling.SQRT, math.sqrt(2 / 3))])
def test_lr_factor(policy, expected):
    assert lr_factor(policy, 2, 3) == pytest.approx(expected)


def test_failure_budget_turns_fatal():
    budget = FailureBudget(2)
    budget.failed(RecoverableError("x"), 1)
    budget.succeeded()
    budget.failed(RecoverableError("x"), 2)
    with pytest.raises(FatalError, match="2 consecutive"):
        budget.failed(RecoverableError("y"), 3)


def test_fault_spec_parsing():
    (fault,) = parse_faults("kill@mid_allreduce:7")
    assert (fault.action, fault.point, fault.step) == (FaultAction.KILL,
                                                       FaultPoint.MID_ALLREDUCE, 7)
    assert fault.rank is None                      # every rank of the replica
    assert parse_faults("") == ()
    with pytest.raises(UsageError, match="ACTION@POINT:STEP"):
        parse_faults("kill@nowhere:1")


def test_a_data_fault_is_handed_to_the_caller_once():
    injector = FaultInjector(parse_faults("nan@gradients:9/1"))
    assert not injector.check(FaultPoint.GRADIENTS, 8)
    assert injector.check(FaultPoint.GRADIENTS, 9)      # the caller corrupts its data
    assert not injector.check(FaultPoint.GRADIENTS, 9)  # once


def test_a_fault_from_a_step_on_fires_every_step_on_its_node_only(monkeypatch):
    from tests.faults.injector import ENV_INJECT

    monkeypatch.setenv(ENV_INJECT, "nan@gradients:30+@n3")
    assert FaultInjector.from_env(0, "n1").pending == []
    broken = FaultInjector.from_env(0, "n3")
    assert [broken.check(FaultPoint.GRADIENTS, s) for s in (29, 30, 30, 31)] == [
        False, True, True, True]
    for bad in ("nan@gradients:3@", "nan@gradients:3@a@b", "nan@gradients:x+"):
        with pytest.raises(UsageError, match="ACTION@POINT:STEP"):
            parse_faults(bad)


def test_a_fault_for_one_rank_fires_on_that_rank_only(monkeypatch):
    from tests.faults.injector import ENV_INJECT, FaultInjector

    monkeypatch.setenv(ENV_INJECT, "raise@start_step:3/1,stop@after_commit:4")
    assert [f.point for f in FaultInjector.from_env(0).pending] == [FaultPoint.AFTER_COMMIT]
    on_rank1 = FaultInjector.from_env(1)
    assert on_rank1.armed(FaultPoint.START_STEP, 3)
    with pytest.raises(RuntimeError, match="injected fault at start_step of step 3"):
        on_rank1.check(FaultPoint.START_STEP, 3)
