"""Values of the replica quorum: roles, the quorum itself, wire messages, timing.

Everything here is a frozen value with no behaviour beyond derived fields, so the
pure core (``election``, ``formation``, ``core``) and the shell (``wire``,
``node``) can share it without either depending on the other.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

from ft_launch.config import QuorumConfig

T = TypeVar("T")


def evolve(value: T, **changes: Any) -> T:
    """``dataclasses.replace`` for the core's frozen values, about 6x faster: it
    copies the fields instead of re-running ``__init__`` (none of these classes
    validates or derives anything there). A 1,000-member round makes thousands
    of these per step on the leader. It takes ``changes`` on trust (a misspelt
    field would be a stray attribute): the quorum's tests run every call through
    ``checked_evolve`` instead."""
    new = object.__new__(type(value))
    fields = new.__dict__
    fields.update(value.__dict__)
    fields.update(changes)
    return new


def checked_evolve(value: T, **changes: Any) -> T:
    """``evolve`` that refuses a name that is not a field of ``value``."""
    unknown = changes.keys() - value.__dataclass_fields__.keys()  # type: ignore[attr-defined]
    if unknown:
        raise TypeError(f"{type(value).__name__} has no field {sorted(unknown)}")
    return evolve(value, **changes)


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

    # Derived views, computed once per object: agents hosted in one process
    # share the decoded quorum, so 333 of them must not each walk 1,000
    # members. (A ``Quorum`` is never ``evolve``d, which would copy them.)
    @cached_property
    def replica_ids(self) -> tuple[int, ...]:
        return tuple(m.replica_id for m in self.members)

    @cached_property
    def index_of(self) -> Mapping[int, int]:
        """Position of each member's replica id in ``members``."""
        return {r: i for i, r in enumerate(self.replica_ids)}

    @cached_property
    def roster(self) -> tuple[tuple[int, str, Health], ...]:
        """Who the members are, without their steps: ``(replica_id, address,
        health)``. A compact announcement may only refer to a roster the
        recipient already holds (see ``QuorumDeltaAnnounced``)."""
        return tuple((m.replica_id, m.address, m.health) for m in self.members)

    @cached_property
    def digest(self) -> bytes:
        """A 16-byte BLAKE2b digest of ``roster``."""
        parts = [f"{r}\x00{h.value}\x00{len(a)}\x00{a}" for r, a, h in self.roster]
        return hashlib.blake2b("\x01".join(parts).encode(), digest_size=16).digest()

    def includes(self, replica_id: int) -> bool:
        return replica_id in self.index_of

    def membership(self) -> frozenset[tuple[int, str]]:
        """What identifies the membership: a replaced replica (same id, new
        address) is a change, because the all-reduce ring must reconnect."""
        return frozenset((r, a) for r, a, _ in self.roster)

    def same_membership(self, members: tuple[QuorumMember, ...]) -> bool:
        """``membership()`` equality with ``members`` (sorted by replica id),
        by comparison rather than hashing (addresses may be kilobytes)."""
        roster = self.roster
        return len(roster) == len(members) and all(
            r == m.replica_id and a == m.address
            for (r, a, _), m in zip(roster, members, strict=True))


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
class Standing:
    """The leader's grant: the members of quorum ``quorum_id`` may go on with it,
    without a round, up to step ``through`` (``standing``). ``ended_by``: the
    member whose join for step ``through + 1`` ended it there (its ring would wait
    for that member in vain beyond it); None while the grant stands."""

    quorum_id: int
    through: int
    ended_by: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    """The leader's lease renewal; ``suspects`` are configured members it has not
    heard from within ``member_timeout`` (a next leader starts from that view);
    ``standing``: the leader's grant for its last quorum, if any."""

    term: int
    suspects: tuple[int, ...] = ()
    standing: Standing | None = None


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
    health, quorum_id it last saw)``; ``join_seq`` matches the answer to the bid.
    On the wire ``address`` is empty when the leader already has it (see
    ``formation.leader_has_address``)."""

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


@dataclass(frozen=True)
class QuorumDeltaAnnounced:
    """The leader's compact answer to one round, sent to members that hold the
    previous quorum (the "base", known by the ``digest`` of its roster): a few
    hundred bytes instead of every member's address, which at 1,000 members
    (each advertising its ranks' endpoints) is tens of kilobytes to megabytes.

    The roster is the base's without ``removed`` and with ``added`` (members
    that are new or whose address or health changed, as ``(replica_id,
    address, health)``); every member is at ``max_step`` except ``behind``
    (``(replica_id, next_step)``). ``seqs[i]`` is the ``join_seq`` answered for
    the i-th member of the new roster, modulo 2**32: a stale answer could only
    be mistaken for a current one after 2**32 requests of that member within
    ``max_message_age``. ``others`` answers joiners that were not admitted
    (unhealthy), with their full ``join_seq``. A member whose last quorum has
    another digest asks again and gets the full ``QuorumAnnounced``.
    """

    term: int
    quorum_id: int
    leader_id: int
    max_step: int
    digest: bytes
    removed: tuple[int, ...] = ()
    added: tuple[tuple[int, str, Health], ...] = ()
    behind: tuple[tuple[int, int], ...] = ()
    seqs: tuple[int, ...] = ()
    others: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EndorseRequested:
    """The leader asks the witnesses to endorse the quorum it formed for ``step``
    (``members``: its replica ids). ``required``: the members alone are short of
    a majority of all votes, so the announcement waits for the answers; otherwise
    it only tells the witnesses which round came last (see ``witness``)."""

    term: int
    step: int
    quorum_id: int
    members: tuple[int, ...]
    required: bool = True


@dataclass(frozen=True)
class EndorseAnswered:
    term: int
    quorum_id: int
    granted: bool


SEQ_MASK = 0xFFFFFFFF

Message = (VoteRequested | VoteAnswered | Heartbeat | HeartbeatAcked | TimeoutNow |
           JoinRequested | QuorumAnnounced | QuorumDeltaAnnounced | EndorseRequested |
           EndorseAnswered)

# --------------------------------------------------------------------------- voters

#: Witness ``k`` votes as ``WITNESS_BASE + k``: far above any replica id (at
#: most ``MAX_HOSTS``), inside the wire's 32-bit ids. Witness 0 is the controller.
WITNESS_BASE = 1_000_000


def witness_ids(count: int) -> tuple[int, ...]:
    return tuple(WITNESS_BASE + k for k in range(count))


def is_witness(voter: int) -> bool:
    return voter >= WITNESS_BASE


def voter_weights(replicas: Iterable[int], witnesses: Iterable[int]) -> dict[int, int]:
    """Votes per voter: one per replica; the witnesses share ``replicas - 1``
    votes between them (as evenly as integers allow, the lower ids first). So
    all replicas together are a majority without any witness, and one replica
    with every witness is a majority too; ``witness`` explains why that is safe."""
    replica_list, witness_list = sorted(set(replicas)), sorted(set(witnesses))
    weights = dict.fromkeys(replica_list, 1)
    share = max(len(replica_list) - 1, 0)
    for index, witness in enumerate(witness_list):
        weights[witness] = share // len(witness_list) + (index < share % len(witness_list))
    return weights


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
    #: Members may go on with the last quorum while the leader grants it
    #: (``standing``).
    standing: bool = False

    @classmethod
    def from_config(cls, config: QuorumConfig, voters: int) -> QuorumParams:
        return cls(
            min_replicas=config.min_replicas,
            join_timeout=config.join_timeout,
            heartbeat_interval=config.heartbeat_interval,
            election_timeout=config.election_timeout,
            # Raft's split-vote argument needs the spread of the timers to be
            # large against one broadcast: with ``election_slot`` the expected
            # time for one candidate to reach every voter and hear back, the
            # random part is stretched to ``voters * election_slot`` so that about
            # one timer fires per slot even with 1,000 voters. The *first* timer
            # still fires after about ``election_timeout + spread / voters``, so
            # failover does not get slower with N.
            election_spread=max(config.election_timeout, voters * config.election_slot),
            member_timeout=config.member_timeout,
            ack_interval=max(config.heartbeat_interval, config.member_timeout / 4),
            standing=config.standing,
        )


def majority(voters: int) -> int:
    """Smallest strict majority of ``voters``."""
    return voters // 2 + 1
