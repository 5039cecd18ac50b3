"""Quorum events (facts for the controller, the status view and tests).

``replica_id`` is always the replica whose agent observed the fact.
"""

from __future__ import annotations

from dataclasses import dataclass

from ft_launch.events import Event


@dataclass(frozen=True)
class LeaderElected(Event):
    replica_id: int
    leader_id: int
    term: int


@dataclass(frozen=True)
class LeadershipLost(Event):
    replica_id: int
    term: int
    reason: str


@dataclass(frozen=True)
class QuorumFormed(Event):
    """Emitted by the leader that formed the quorum."""

    replica_id: int
    quorum_id: int
    members: list[int]
    max_step: int
    behind: list[int]
    term: int
    #: How long the leader's join window was open (first join -> formed).
    window_s: float = 0.0


@dataclass(frozen=True)
class QuorumJoined(Event):
    """Emitted by each member when its request is answered."""

    replica_id: int
    quorum_id: int
    members: list[int]
    max_step: int
    behind: list[int]


@dataclass(frozen=True)
class MembersLivenessChanged(Event):
    """The leader stopped (``lost``) or started again (``recovered``) hearing
    from these replicas within ``member_timeout`` (``replica_id`` learnt it as
    leader, or from the leader's heartbeats)."""

    replica_id: int
    lost: list[int]
    recovered: list[int]


@dataclass(frozen=True)
class StandingEnded(Event):
    """The grant for ``quorum_id`` ended at step ``through`` (``standing``):
    replica ``ended_by`` asked for a round instead, so the all-reduce of a later
    step of that quorum waits for it in vain; ``ended_by`` this replica: its
    leader changed, and it leaves such an all-reduce itself."""

    replica_id: int
    quorum_id: int
    through: int
    ended_by: int


@dataclass(frozen=True)
class MajorityLost(Event):
    replica_id: int
    reachable: list[int]
    configured: int


@dataclass(frozen=True)
class MajorityRegained(Event):
    replica_id: int
    leader_id: int
