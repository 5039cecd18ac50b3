"""Check results, profiles (order, budget, warn_only, crashing checks) and drain reasons."""

import pytest

from ft_launch.health.context import CheckContext
from ft_launch.health.drain import drain_node, drain_reason
from ft_launch.health.profile import BoundCheck, Profile, ProfileReport, run_profile
from ft_launch.health.result import (
    CheckResult,
    CheckStatus,
    failed,
    format_bytes,
    from_problems,
    passed,
    worst,
)


def test_from_problems_summarises_the_first_and_keeps_all():
    assert from_problems("x", []).status is CheckStatus.PASS
    result = from_problems("gpu_xid", ["gpu3 xid 79", "gpu5 xid 48"])
    assert result.status is CheckStatus.FAIL
    assert result.reason == "gpu3 xid 79 (+1 more)"
    assert result.evidence["problems"] == ["gpu3 xid 79", "gpu5 xid 48"]


def test_result_round_trips_through_dict():
    result = failed("disk", "disk / free 0B<1GiB", free_bytes={"/": 0})
    assert CheckResult.from_dict(result.to_dict()) == result
    assert worst([passed("a"), result]) is CheckStatus.FAIL


@pytest.mark.parametrize("value, text", [(0, "0B"), (1536, "1.5KiB"), (1 << 30, "1GiB"),
                                         (3 << 40, "3TiB")])
def test_format_bytes(value, text):
    assert format_bytes(value) == text


def _check(name, result=None, error=None, ticks=None):
    def run(ctx):
        if ticks is not None:
            ticks.append(name)
        if error:
            raise error
        return result or passed(name)
    return BoundCheck(name, run)


def test_profile_runs_in_order_and_reports_first_failure():
    ran = []
    profile = Profile("p", (_check("a", ticks=ran), _check("b", failed("b", "bad b"), ticks=ran),
                            _check("c", failed("c", "bad c"), ticks=ran)))
    report = run_profile(profile, CheckContext(node="n1"))
    assert ran == ["a", "b", "c"]
    assert report.status is CheckStatus.FAIL and report.failure.reason == "bad b"
    assert ProfileReport.from_dict(report.to_dict()).results == report.results


def test_budget_spent_skips_the_rest_as_warnings():
    now = iter([0.0, 0.0, 10.0, 10.0, 10.0])
    profile = Profile("p", (_check("slow"), _check("late", failed("late", "x"))), budget=5.0)
    report = run_profile(profile, CheckContext(node="n1"), clock=lambda: next(now))
    assert [r.status for r in report.results] == [CheckStatus.PASS, CheckStatus.WARN]
    assert "budget" in report.results[1].reason
    assert report.failure is None


def test_warn_only_downgrades_and_a_crashing_check_warns():
    profile = Profile("p", (_check("load", failed("load", "load 9/cpu>2")),
                            _check("buggy", error=KeyError("oops"))),
                      warn_only=frozenset({"load"}))
    report = run_profile(profile, CheckContext(node="n1"))
    assert [r.status for r in report.results] == [CheckStatus.WARN, CheckStatus.WARN]
    assert "KeyError" in report.results[1].reason
    assert report.failure is None


def test_drain_reason_is_one_short_safe_line():
    assert drain_reason("gpu3 xid 79") == "ft: gpu3 xid 79"
    reason = drain_reason('evil "quote"\n$(rm -rf /); `x` ' + "y" * 300)
    assert reason.startswith("ft: evil quote")
    assert not set(reason) & set('"\n$`;')
    assert len(reason) <= 100


class FakeSlurm:
    def __init__(self, drained=False):
        self.calls = []
        self.drained = drained

    def nodes(self, names):
        from ft_launch.slurm.parse import NodeInfo
        from ft_launch.slurm.states import NodeState
        flags = frozenset({"DRAIN"}) if self.drained else frozenset()
        return [NodeInfo(names[0], NodeState.parse("IDLE"), flags, "admin note", "")]

    def set_node_state(self, node, state, reason=None):
        self.calls.append((node, state, reason))


def test_drain_node_keeps_an_existing_drain_reason():
    slurm = FakeSlurm(drained=True)
    assert drain_node(slurm, "n1", "gpu0 lost") is False and slurm.calls == []
    slurm = FakeSlurm()
    assert drain_node(slurm, "n1", "gpu0 lost") is True
    assert slurm.calls == [("n1", "drain", "ft: gpu0 lost")]
