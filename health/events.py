"""Health events for the JSON-lines event log (past tense, ``ft_launch.events``)."""

from __future__ import annotations

from dataclasses import dataclass

from ft_launch.events import Event


@dataclass(frozen=True)
class HealthCheckFailed(Event):
    node: str
    profile: str
    check: str
    reason: str


@dataclass(frozen=True)
class DetectionAlarmRaised(Event):
    kind: str               # AlarmKind value
    detail: str
    rank: int | None = None
    node: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class OverEvictionDecided(Event):
    trigger: str            # "hang" | "fail_slow"
    group: str              # "pp:3"
    nodes: list[str]
    outlier_ranks: list[int]


@dataclass(frozen=True)
class ReplayConcluded(Event):
    status: str             # ReplayStatus value
    suspects: list[str]
