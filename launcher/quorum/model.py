"""Values of the replica quorum: roles, the quorum itself, wire messages, timing.

Everything here is a frozen value with no behaviour beyond derived fields, so the
pure core (``election``, ``formation``, ``core``) and the shell (``wire``,
``node``) can share it without either depending on the other.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ftcore.config import QuorumConfig

#: Expected time for one candidate to reach every voter and hear back. The random
#: part of the election timeout is stretched to ``voters * ELECTION_SLOT`` when that
#: is longer than ``election_timeout``, so that about one timer fires per slot even
#: with 1,000 voters (Raft's split-vote argument needs the spread of the timers to
#: be large against one broadcast). The *first* timer still fires after about
#: ``election_timeout + spread / voters``, so failover does not get slower with N.
ELECTION_SLOT = 0.02

T = TypeVar("T")


def evolve(value: T, **changes: Any) -> T:
    """``dataclasses.replace`` for the core's frozen values, about 6x faster: it
    copies the fields instead of re-running ``__init__`` (none of these classes
    validates or derives anything there). A 1,000-member round makes thousands
    of these per step on the leader."""
    assert changes.keys() <= value.__dataclass_fields__.keys(), changes  # type: ignore[attr-defined]
    new = object.__new__(type(value))
    new.__dict__.update(value.__dict__)
    new.__dict__.update(changes)
    return new


class Role(enum.Enum):
    """Raft's roles, plus the pre-vote stage that keeps a cut-off member from
    inflating terms and deposing a healthy leader when it comes back."""

    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre_candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


class Health(enum.Enum):
    """What a member says about itself when it joins. ``UNHEALTHY`` members are
    answered but not admitted, so nobody waits for or rings through them."""

    OK = "ok"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"


class JoinFailure(enum.Enum):
    """Why a member's quorum request was answered with an error instead."""

    MAJORITY_LOST = "majority_lost"


@dataclass(frozen=True)
class QuorumMember:
    replica_id: int
    next_step: int
    address: str
    health: Health = Health.OK


@dataclass(frozen=True)
class Quorum:
    """The answer every member of one round receives, identical for all of them."""

    quorum_id: int
    members: tuple[QuorumMember, ...]
    max_step: int
    behind: tuple[int, ...]
    term: int = 0
    leader_id: int = -1

    @classmethod
    def of(cls, quorum_id: int, members: tuple[QuorumMember, ...], *, term: int = 0,
           leader_id: int = -1) -> Quorum:
        """Build a quorum, deriving ``max_step`` and ``behind`` from the members."""
        ordered = tuple(sorted(members, key=lambda m: m.replica_id))
        max_step = max((m.next_step for m in ordered), default=0)
        behind = tuple(m.replica_id for m in ordered if m.next_step < max_step)
        return cls(quorum_id, ordered, max_step, behind, term, leader_id)

    @property
    def replica_ids(self) -> tuple[int, ...]:
        return tuple(m.replica_id for m in self.members)

    def includes(self, replica_id: int) -> bool:
        return any(m.replica_id == replica_id for m in self.members)

    def membership(self) -> frozenset[tuple[int, str]]:
        """What identifies the membership: a replaced replica (same id, new
        address) is a change, because the all-reduce ring must reconnect."""
        return frozenset((m.replica_id, m.address) for m in self.members)


# --------------------------------------------------------------------------- wire messages
# Every message carries the sender's Raft term. The sender's id is in the envelope.


@dataclass(frozen=True)
class VoteRequested:
    """A (pre-)candidate asks for a vote; ``term`` is the term it would run in.
    ``transfer``: the leader handed over on purpose, so leases do not apply."""

    term: int
    pre_vote: bool = False
    transfer: bool = False


@dataclass(frozen=True)
class VoteAnswered:
    term: int
    granted: bool
    pre_vote: bool = False


@dataclass(frozen=True)
class Heartbeat:
    """The leader's lease renewal; ``suspects`` are configured members it has not
    heard from within ``member_timeout`` (a next leader starts from that view)."""

    term: int
    suspects: tuple[int, ...] = ()


@dataclass(frozen=True)
class HeartbeatAcked:
    term: int


@dataclass(frozen=True)
class TimeoutNow:
    """The leader asks the receiver to start an election at once (leadership
    transfer, e.g. before the leader's node is drained)."""

    term: int


@dataclass(frozen=True)
class JoinRequested:
    """A member's bid for the next quorum: ``(replica_id, next_step, address,
    health, quorum_id it last saw)``; ``join_seq`` matches the answer to the bid."""

    term: int
    next_step: int
    address: str
    health: Health = Health.OK
    last_quorum_id: int = 0
    join_seq: int = 0
    commit_failed: bool = False


@dataclass(frozen=True)
class QuorumAnnounced:
    """The leader's answer to one round; ``answered`` maps every replica whose
    join it answers (admitted or not) to that join's ``join_seq``."""

    term: int
    quorum: Quorum
    answered: Mapping[int, int] = field(default_factory=dict)


Message = (VoteRequested | VoteAnswered | Heartbeat | HeartbeatAcked | TimeoutNow |
           JoinRequested | QuorumAnnounced)


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class QuorumParams:
    """The timing and size rules the core applies (seconds)."""

    min_replicas: int = 1
    join_timeout: float = 2.0
    heartbeat_interval: float = 0.2
    election_timeout: float = 1.0
    election_spread: float = 1.0
    member_timeout: float = 3.0
    #: Followers answer heartbeats at most this often: liveness needs a few
    #: answers per ``member_timeout``, not one per heartbeat (that would be
    #: 5,000 messages/s into the leader at 1,000 members).
    ack_interval: float = 0.75

    @classmethod
    def from_config(cls, config: QuorumConfig, voters: int) -> QuorumParams:
        return cls(
            min_replicas=config.min_replicas,
            join_timeout=config.join_timeout,
            heartbeat_interval=config.heartbeat_interval,
            election_timeout=config.election_timeout,
            election_spread=max(config.election_timeout, voters * ELECTION_SLOT),
            member_timeout=config.member_timeout,
            ack_interval=max(config.heartbeat_interval, config.member_timeout / 4),
        )


def majority(voters: int) -> int:
    """Smallest strict majority of ``voters``."""
    return voters // 2 + 1
