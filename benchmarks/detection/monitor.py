"""The detection library's core (pure): feed it what ranks and agents report, ask it
at any time what is wrong.

* ``RANK_SILENT``: no heartbeat or step from a rank for ``silent_timeout`` s
  (killed, or stopped: its heartbeat thread stops too).
* ``HANG``: no rank finished a step for ``hang_factor`` times the usual step
  interval (at least ``min_hang_timeout``).
* metric anomalies per rank (NaN/Inf, x5 spikes, fail-slow), and failed node
  inspections.

Each condition is reported once, and again only after it cleared.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ft_launch.health.anomaly import AnomalySettings, MetricAnomalyDetector
from ft_launch.health.wire import Envelope, MessageKind, read_number


class AlarmKind(enum.Enum):
    RANK_SILENT = "rank_silent"
    HANG = "hang"
    ANOMALY = "anomaly"
    NODE_FAILED = "node_failed"


@dataclass(frozen=True)
class Alarm:
    kind: AlarmKind
    detail: str
    rank: int | None = None
    node: str | None = None
    step: int | None = None
    anomaly: str | None = None     # AnomalyKind value for ANOMALY alarms
    at: float = 0.0


@dataclass(frozen=True)
class MonitorSettings:
    silent_timeout: float = 3.0
    hang_factor: float = 2.0
    min_hang_timeout: float = 1.0
    hang_warmup: int = 3           # step intervals needed before hangs are judged
    anomalies: AnomalySettings = field(default_factory=AnomalySettings)


class DetectionMonitor:
    def __init__(self, settings: MonitorSettings = MonitorSettings()) -> None:
        self.settings = settings
        self._last_seen: dict[int, float] = {}
        self._silent: set[int] = set()
        self._detectors: dict[int, MetricAnomalyDetector] = {}
        self._max_step = -1
        self._last_progress: float | None = None
        self._intervals: deque[float] = deque(maxlen=20)
        self._hung = False
        self._failed_nodes: set[str] = set()

    # ------------------------------------------------------------------ inputs

    def observe(self, envelope: Envelope, now: float) -> list[Alarm]:
        body = envelope.body
        if envelope.kind is MessageKind.HEARTBEAT and "rank" in body:
            self.heartbeat(int(body["rank"]), now)
        elif envelope.kind is MessageKind.METRICS:
            step_time, tokens = read_number(body.get("step_time")), body.get("tokens")
            throughput = tokens / step_time if tokens and step_time else None
            return self.step(int(body["rank"]), int(body["step"]), read_number(body["loss"]),
                             read_number(body.get("grad_norm")), step_time, now, throughput)
        elif envelope.kind is MessageKind.REPORT:
            return self.node_report(str(body["node"]), body, now)
        return []

    def heartbeat(self, rank: int, now: float) -> None:
        self._last_seen[rank] = now
        self._silent.discard(rank)

    def step(self, rank: int, step: int, loss: float | None, grad_norm: float | None,
             step_time: float | None, now: float,
             throughput: float | None = None) -> list[Alarm]:
        self.heartbeat(rank, now)
        if step > self._max_step:
            if self._last_progress is not None and self._max_step >= 0:
                self._intervals.append(now - self._last_progress)
            self._max_step, self._last_progress, self._hung = step, now, False
        detector = self._detectors.setdefault(rank, MetricAnomalyDetector(
            self.settings.anomalies))
        return [Alarm(AlarmKind.ANOMALY, f"rank {rank} {a.describe()}", rank=rank, step=step,
                      anomaly=a.kind.value, at=now)
                for a in detector.observe(step, loss, grad_norm, step_time, throughput)]

    def node_report(self, node: str, body: Mapping[str, Any], now: float) -> list[Alarm]:
        if body.get("status") != "fail":
            self._failed_nodes.discard(node)
            return []
        if node in self._failed_nodes:
            return []
        self._failed_nodes.add(node)
        reason = next((r["reason"] for r in body.get("results", []) if r["status"] == "fail"), "")
        return [Alarm(AlarmKind.NODE_FAILED, reason, node=node, at=now)]

    # ------------------------------------------------------------------ judgement

    @property
    def max_step(self) -> int:
        """The highest step any rank finished (-1 before the first)."""
        return self._max_step

    @property
    def step_interval(self) -> float | None:
        if len(self._intervals) < self.settings.hang_warmup:
            return None
        return statistics.median(self._intervals)

    def hang_timeout(self) -> float | None:
        interval = self.step_interval
        if interval is None:
            return None
        return max(self.settings.hang_factor * interval, self.settings.min_hang_timeout)

    def check(self, now: float) -> list[Alarm]:
        alarms = []
        for rank, seen in self._last_seen.items():
            if rank not in self._silent and now - seen > self.settings.silent_timeout:
                self._silent.add(rank)
                alarms.append(Alarm(AlarmKind.RANK_SILENT,
                                    f"rank {rank} silent for {now - seen:.1f}s", rank=rank,
                                    at=now))
        timeout = self.hang_timeout()
        if timeout is not None and self._last_progress is not None and not self._hung \
                and now - self._last_progress > timeout:
            self._hung = True
            alarms.append(Alarm(AlarmKind.HANG, f"no step after {self._max_step} for "
                                f"{now - self._last_progress:.1f}s (>{timeout:.2f}s)",
                                step=self._max_step + 1, at=now))
        return alarms
