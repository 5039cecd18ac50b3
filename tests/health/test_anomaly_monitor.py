"""Metric anomalies (``ft_launch.health.anomaly``) and the detection library's monitor
(``benchmarks/detection``), on scripted series and a scripted clock."""

import math

import pytest

from benchmarks.detection.monitor import AlarmKind, DetectionMonitor, MonitorSettings
from ft_launch.health.anomaly import (
    AnomalyKind,
    MetricAnomalyDetector,
    SlowdownDetector,
    SpikeDetector,
)
from ft_launch.health.wire import Envelope, MessageKind


def test_spike_needs_warmup_and_factor_five():
    detector = SpikeDetector(factor=5, window=10, warmup=5)
    assert [detector.observe(v) for v in (100, 2, 2, 2)] == [None] * 4   # warming up
    assert detector.observe(2) is None
    assert detector.observe(9.9) is None           # < 5x the median (2)
    assert detector.observe(10.5) == 2             # > 5x
    assert detector.observe(11.0) == 2             # spikes stay out of the baseline


def test_slowdown_reports_once_per_episode():
    detector = SlowdownDetector(factor=1.5, window=10, recent=3)
    results = [detector.observe(1.0) for _ in range(10)]
    assert results == [None] * 10
    slow = [detector.observe(2.0) for _ in range(6)]
    assert [s is not None for s in slow].count(True) == 1
    assert slow[1] == (2.0, 1.0)                   # 2 of 3 recent values slow: median 2
    for _ in range(5):
        detector.observe(1.0)
    assert any(detector.observe(2.0) for _ in range(3))   # a new episode reports again


@pytest.mark.parametrize("loss, grad, kind", [
    (math.nan, 1.0, AnomalyKind.NAN_LOSS), (math.inf, 1.0, AnomalyKind.INF_LOSS),
    (2.0, math.nan, AnomalyKind.NAN_GRAD), (11.0, 1.0, AnomalyKind.LOSS_SPIKE),
    (2.0, 6.0, AnomalyKind.GRAD_SPIKE)])
def test_metric_anomalies(loss, grad, kind):
    detector = MetricAnomalyDetector()
    for step in range(10):
        assert detector.observe(step, 2.0, 1.0, 0.1) == []
    found = detector.observe(10, loss, grad, 0.1)
    assert [a.kind for a in found] == [kind] and found[0].step == 10


def test_throughput_drop_is_fail_slow_too():
    detector = MetricAnomalyDetector()
    for step in range(25):
        assert detector.observe(step, 2.0, throughput=1000.0) == []
    found = [a for step in range(25, 31) for a in detector.observe(step, 2.0, throughput=400.0)]
    assert [a.kind for a in found] == [AnomalyKind.THROUGHPUT_DROP]
    assert found[0].value == pytest.approx(400.0) and found[0].baseline == pytest.approx(1000.0)


def heartbeat(rank):
    return Envelope(MessageKind.HEARTBEAT, f"r{rank}", 1, 0.0, {"rank": rank})


def metrics(rank, step, loss=2.0):
    return Envelope(MessageKind.METRICS, f"r{rank}", step + 2, 0.0,
                    {"rank": rank, "step": step, "loss": loss, "grad_norm": 1.0,
                     "step_time": 0.5})


def test_monitor_finds_a_silent_rank_once():
    alarms = DetectionMonitor(MonitorSettings(silent_timeout=3.0))
    alarms.observe(heartbeat(0), 0.0)
    alarms.observe(heartbeat(1), 0.0)
    alarms.observe(heartbeat(0), 3.0)
    found = alarms.check(3.1)
    assert [(a.kind, a.rank) for a in found] == [(AlarmKind.RANK_SILENT, 1)]
    assert alarms.check(3.2) == []                 # reported once
    alarms.observe(heartbeat(1), 3.3)
    assert alarms.check(10.0) != []                # heard again, then silent again


def test_monitor_hang_after_a_few_step_times():
    monitor = DetectionMonitor(MonitorSettings(hang_factor=2.0, min_hang_timeout=0.1,
                                               silent_timeout=100))
    now = 0.0
    for step in range(6):
        now = step * 0.5
        for rank in (0, 1):
            monitor.observe(metrics(rank, step), now)
    assert monitor.step_interval == 0.5
    assert monitor.check(now + 0.9) == []
    hang = monitor.check(now + 1.1)
    assert [a.kind for a in hang] == [AlarmKind.HANG] and hang[0].step == 6
    assert monitor.check(now + 5) == []            # once per hang
    monitor.observe(metrics(0, 6), now + 5.5)       # progress re-arms it
    assert monitor.check(now + 5.6) == []


def test_monitor_reports_nan_at_the_step_it_appears():
    monitor = DetectionMonitor()
    for step in range(8):
        assert monitor.observe(metrics(0, step), step) == []
    alarms = monitor.observe(metrics(1, 8, loss="nan"), 8)
    assert [(a.kind, a.anomaly, a.step, a.rank) for a in alarms] == \
        [(AlarmKind.ANOMALY, "nan_loss", 8, 1)]


def test_monitor_turns_a_failed_inspection_into_one_alarm():
    monitor = DetectionMonitor()
    body = {"node": "n4", "status": "fail", "profile": "inspection", "results": [
        {"name": "gpu_xid", "status": "fail", "reason": "gpu3 xid 79", "evidence": {}}]}
    report = Envelope(MessageKind.REPORT, "agent:n4/1/a", 1, 0.0, body)
    alarms = monitor.observe(report, 1.0)
    assert [(a.kind, a.node, a.detail) for a in alarms] == \
        [(AlarmKind.NODE_FAILED, "n4", "gpu3 xid 79")]
    assert monitor.observe(report, 2.0) == []
