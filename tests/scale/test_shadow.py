"""Shadow mode end to end at toy scale (real agents, sockets, FTAR handshakes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ft_launch.config import QuorumConfig

from .helpers import load_benchmark


def test_growth_fit_recovers_a_power_law() -> None:
    shadow = load_benchmark("shadow_bench")
    a, b = shadow.fit_power([10, 100, 1000], [3 * n ** 0.5 for n in (10, 100, 1000)])
    assert (a, b) == (pytest.approx(3.0), pytest.approx(0.5))


def test_a_rank_decides_its_step_from_the_view_it_is_sent() -> None:
    shadow = load_benchmark("shadow_bench")
    full, compact = shadow.views(replicas=6, ranks=3)
    assert len(full.members) == 6 and all(text for _, text in full.members)
    assert [r for r, _ in compact.members] == list(range(6))
    times = shadow.time_rank_decision(full, reps=1)
    assert times["plan_step_ms"] > 0 and times["unpickle_ms"] > 0


def quorum_patience() -> float:
    """The agents' own patience for a quorum: the join window, a member's silence, elections."""
    config = QuorumConfig()
    return config.join_timeout + config.member_timeout + 4 * config.election_timeout


def run_shadow(tmp_path: Path, *args: str) -> dict:
    """shadow_bench with ``args``, required to succeed; what it wrote."""
    out = tmp_path / "shadow.json"
    code = load_benchmark("shadow_bench").main(
        [*args, "--png", str(tmp_path / "c.png"), "--json", str(out)])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
def test_shadow_mode_measures_rounds_failures_fanout_and_rings(tmp_path: Path) -> None:
    result = run_shadow(tmp_path, "--replicas", "3,4", "--ranks", "4", "--rounds", "2",
                        "--failures", "1", "--rings", "3")
    summary = result["summary"]
    assert (summary["replicas"], summary["ranks"]) == (4, 16)
    assert 0 < summary["quorum_round_ms_100k_ranks"] < 10_000
    # No lower bound: the survivors' report of the broken step may start the round
    # that drops it before the join window would close.
    assert 0 < summary["formation_after_failure_s_at_replicas"]["4"] < quorum_patience()
    assert summary["ring_rebuild_ms"]["3"] > 0
    assert {r["replicas"] for r in result["rows"]} == {3, 4}
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.timeout(180)
def test_shadow_mode_measures_a_failure_on_a_standing_quorum(tmp_path: Path) -> None:
    """Enough rounds for the leader to grant its quorum ahead (``quorum.standing``, the
    default): the step after a crash may still be answered with the crashed member
    in it; its all-reduce fails, the survivors report it, and the next quorum leaves
    the member out, within the agents' own patience for a quorum. Before, the bench
    required the first step after the crash to drop it and failed."""
    summary = run_shadow(tmp_path, "--replicas", "5", "--ranks", "2", "--rounds", "15",
                         "--failures", "2", "--rings", "")["summary"]
    assert 0 < summary["formation_after_failure_s_at_replicas"]["5"] < quorum_patience()
