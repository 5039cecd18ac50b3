"""The ETTR simulator reproduces both papers' figures, then projects ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from matplotlib.image import imread

from ft_launch.launcher.reporting.ettr import (
    JobModel,
    RecoveryParts,
    Strategy,
    job_ettr,
    node_failures,
    periodic_failures,
    recovery_cost,
)

from .helpers import load_benchmark

MIN = 60.0


def test_reproduces_fthsdp_synchronous_44_and_asynchronous_80_percent() -> None:
    figures = load_benchmark("ettr_sim").reproduce()
    assert figures["sync"] == pytest.approx(8 / 18, abs=1e-6)           # paper: 44%
    assert figures["fthsdp"] == pytest.approx(0.80, abs=0.01)            # paper: about 80%


def test_strategies_from_recovery_parts() -> None:
    parts = RecoveryParts(detection=10, eviction=5, promotion=20, restart=60, restore=30,
                          lost_work=15, fetch=4, rejoin=6, first_step=8, healthy_stall=3,
                          queue_wait=600, reschedule_wait=300)
    sync_tail = 60 + 30 + 15 + 6 + 8
    assert recovery_cost(Strategy.REQUEUE, parts).stall == 10 + 600 + sync_tail
    assert recovery_cost(Strategy.RESCHEDULE, parts).stall == 10 + 5 + 300 + sync_tail
    warm = recovery_cost(Strategy.WARM_STANDBY_SYNC, parts)
    assert (warm.stall, warm.fallback_stall) == (10 + 5 + 20 + sync_tail, 10 + 5 + 300 + sync_tail)
    ours = recovery_cost(Strategy.ASYNC_REPLICA, parts)
    out = 10 + 5 + 20 + 60 + 4 + 6 + 8          # the failed replica, standby promoted
    assert (ours.stall, ours.degraded) == (3, out - 3)
    assert ours.fallback_degraded == out - 20 + 300 - 3


def test_asynchronous_recovery_keeps_most_capacity_where_synchronous_does_not() -> None:
    horizon = 50 * 18 * MIN
    failures = periodic_failures(18 * MIN, horizon, first=0.0)
    parts = RecoveryParts(detection=30, promotion=60, restart=8 * MIN, rejoin=60,
                          healthy_stall=20)
    job = JobModel(12, horizon)
    ours = job_ettr(Strategy.ASYNC_REPLICA, parts, failures, job).ettr
    sync = job_ettr(Strategy.WARM_STANDBY_SYNC, parts, failures, job).ettr
    period = 18 * MIN
    degraded = 30 + 60 + 8 * MIN + 60 - 20       # replica out, after the 20 s stall
    assert ours == pytest.approx((period - 20 - degraded / 12) / period, abs=1e-3)
    assert sync == pytest.approx((period - 30 - 60 - 8 * MIN - 60) / period, abs=1e-3)
    assert sync < 0.6 and ours > 0.9


def test_per_node_failure_processes_add_up_to_the_job_rate() -> None:
    times = node_failures([0.5] * 200 + [0.0] * 50, horizon=40 * 86_400, seed=2)
    assert len(times) == pytest.approx(0.5 * 200 * 40, rel=0.1)
    assert times == sorted(times)


def test_the_script_projects_ours_above_target_and_writes_its_summary(tmp_path: Path) -> None:
    out = tmp_path / "ettr.json"
    fault = tmp_path / "fault.json"
    fault.write_text(json.dumps({"summary": {"max_healthy_stall_s": 1.5, "rejoin_s": 4.0}}))
    sim = load_benchmark("ettr_sim")
    assert sim.main(["--fault-json", str(fault), "--days", "5", "--png",
                     str(tmp_path / "e.png"), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["reproduced_sync_ettr"] == pytest.approx(0.444, abs=0.001)
    assert summary["reproduced_fthsdp_ettr"] == pytest.approx(0.80, abs=0.01)
    assert summary["projected_ettr_ours"] >= 0.90
    assert summary["inputs"]["healthy_stall"]["seconds"] == 1.5
    assert "measured" in summary["inputs"]["healthy_stall"]["source"]
    assert "fallback" in summary["inputs"]["fetch"]["source"]
    image = imread(tmp_path / "e.png")                  # a PNG matplotlib reads back
    assert image.shape[:2] == (500, 800) and (image[..., :3] < 0.9).any()   # not blank
