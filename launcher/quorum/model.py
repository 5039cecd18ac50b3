"""Values of the replica quorum: roles, the quorum itself, wire messages, voters, timing.

Frozen values with no behaviour beyond derived fields, shared by the core
(``election``, ``core``, ``delta``) and the shell (``wire``, ``agent``).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from ft_launch.config import QuorumConfig


class Role(enum.Enum):
    """Raft's roles, plus the pre-vote stage that keeps a cut-off member from
    inflating terms and deposing a healthy leader when it comes back."""

    FOLLOWER = "follower"
    PRE_CANDIDATE = "pre_candidate"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclass(frozen=True)
class QuorumMember:
    replica_id: int
    next_step: int
    address: str


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
    def of(cls, quorum_id: int, members: Iterable[QuorumMember], *, term: int = 0,
           leader_id: int = -1) -> Quorum:
        """Build a quorum, deriving ``max_step`` and ``behind`` from the members."""
        ordered = tuple(sorted(members, key=lambda m: m.replica_id))
        max_step = max((m.next_step for m in ordered), default=0)
        behind = tuple(m.replica_id for m in ordered if m.next_step < max_step)
        return cls(quorum_id, ordered, max_step, behind, term, leader_id)

    # Derived views, computed once per quorum (a leader of 1,000 looks members up often).
    @cached_property
    def replica_ids(self) -> tuple[int, ...]:
        return tuple(m.replica_id for m in self.members)

    @cached_property
    def index_of(self) -> Mapping[int, int]:
        """Position of each member's replica id in ``members``."""
        return {r: i for i, r in enumerate(self.replica_ids)}

    @cached_property
    def roster(self) -> tuple[tuple[int, str], ...]:
        """Who the members are, without their steps: ``(replica_id, address)``. A
        compact announcement refers to a roster the recipient holds (``delta``)."""
        return tuple((m.replica_id, m.address) for m in self.members)

    @cached_property
    def digest(self) -> bytes:
        """A 16-byte BLAKE2b digest of ``roster``."""
        text = "\x01".join(f"{r}\x00{len(a)}\x00{a}" for r, a in self.roster)
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def includes(self, replica_id: int) -> bool:
        return replica_id in self.index_of


# --------------------------------------------------------------------------- wire messages
# Every message carries the sender's Raft term; the sender's id is in the envelope.


@dataclass(frozen=True)
class VoteRequested:
    """A (pre-)candidate asks for a vote; ``term`` is the term it would run in."""

    term: int
    pre_vote: bool = False


@dataclass(frozen=True)
class VoteAnswered:
    term: int
    granted: bool
    pre_vote: bool = False


@dataclass(frozen=True)
class Standing:
    """The leader's grant: the members of quorum ``quorum_id`` may go on with it,
    without a round, up to step ``through`` (``core``, standing quorums).
    ``ended_by``: the member whose join for step ``through + 1`` ended it there
    (its ring would wait for that member in vain beyond it); None while it stands."""

    quorum_id: int
    through: int
    ended_by: int | None = None


@dataclass(frozen=True)
class Heartbeat:
    """The leader's lease renewal; ``suspects`` are voters it has not heard from
    within ``member_timeout``; ``standing``: its grant for its last quorum, if any."""

    term: int
    suspects: tuple[int, ...] = ()
    standing: Standing | None = None


@dataclass(frozen=True)
class HeartbeatAcked:
    term: int


@dataclass(frozen=True)
class JoinRequested:
    """A member's bid for the next quorum; ``join_seq`` matches the answer to the
    bid. ``address`` is empty when the leader already has it (``core``)."""

    term: int
    next_step: int
    address: str
    last_quorum_id: int = 0
    join_seq: int = 0
    commit_failed: bool = False


@dataclass(frozen=True)
class QuorumAnnounced:
    """The leader's answer to one round; ``answered`` maps every member to the
    ``join_seq`` of the join it answers."""

    term: int
    quorum: Quorum
    answered: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class QuorumDeltaAnnounced:
    """The compact answer to one round, for members holding the previous quorum
    (the base, known by its roster's ``digest``): the base's roster without
    ``removed`` and with ``added`` (new ids, or new addresses); every member at
    ``max_step`` except ``behind`` (``(replica_id, next_step)``); ``seqs[i]`` the
    ``join_seq`` answered for the i-th member, modulo 2**32."""

    term: int
    quorum_id: int
    leader_id: int
    max_step: int
    digest: bytes
    removed: tuple[int, ...] = ()
    added: tuple[tuple[int, str], ...] = ()
    behind: tuple[tuple[int, int], ...] = ()
    seqs: tuple[int, ...] = ()


@dataclass(frozen=True)
class EndorseRequested:
    """The leader asks the witnesses to endorse the quorum it formed for ``step``.
    ``required``: its members alone are short of a majority of all votes, so the
    announcement waits for the answers; otherwise the witnesses are only told."""

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

Message = (VoteRequested | VoteAnswered | Heartbeat | HeartbeatAcked | JoinRequested
           | QuorumAnnounced | QuorumDeltaAnnounced | EndorseRequested | EndorseAnswered)

# --------------------------------------------------------------------------- voters

#: Witness ``k`` votes as ``WITNESS_BASE + k``: far above any replica id, inside the
#: wire's 32-bit ids. Witness 0 is the controller.
WITNESS_BASE = 1_000_000


def witness_ids(count: int) -> tuple[int, ...]:
    return tuple(WITNESS_BASE + k for k in range(count))


def voter_weights(replicas: Iterable[int], witnesses: Iterable[int]) -> dict[int, int]:
    """Votes per voter: one per replica; the witnesses share ``replicas - 1`` votes
    (as evenly as integers allow, the lower ids first). So all replicas together
    are a majority without any witness, and one replica with every witness is one
    too; the README explains why that is safe."""
    replica_list, witness_list = sorted(set(replicas)), sorted(set(witnesses))
    weights = dict.fromkeys(replica_list, 1)
    share = max(len(replica_list) - 1, 0)
    for index, witness in enumerate(witness_list):
        weights[witness] = share // len(witness_list) + (index < share % len(witness_list))
    return weights


@dataclass(frozen=True)
class Memory:
    """What a voter must not forget across a restart, or it could vote twice in a
    term (two leaders) or, a witness, endorse the other side of a partition: its
    term, its vote in it, and the members of the last round it endorsed or was told
    of (None: none yet; an empty set: unknown, endorse nothing until told of a
    round whose members alone are a majority)."""

    term: int = 0
    voted_for: int | None = None
    endorsed: frozenset[int] | None = None


class MemoryStore(Protocol):
    def load(self) -> Memory: ...

    def save(self, memory: Memory) -> None: ...


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class QuorumParams:
    """The timing and size rules the core applies (seconds), derived from the
    product's ``QuorumConfig`` (``from_config``), the one place with defaults."""

    min_replicas: int
    join_timeout: float
    heartbeat_interval: float
    election_timeout: float
    election_spread: float
    member_timeout: float
    #: Followers answer heartbeats at most this often: liveness needs a few
    #: answers per ``member_timeout``, not one per heartbeat.
    ack_interval: float
    #: Members may go on with the last quorum while the leader grants it.
    standing: bool

    @classmethod
    def from_config(cls, config: QuorumConfig, voters: int) -> QuorumParams:
        return cls(
            min_replicas=config.min_replicas,
            join_timeout=config.join_timeout,
            heartbeat_interval=config.heartbeat_interval,
            election_timeout=config.election_timeout,
            # Raft's split-vote argument needs the timers' spread to be large
            # against one broadcast: stretched to ``voters * election_slot`` so
            # that about one timer fires per slot even with 1,000 voters. The
            # first timer still fires after about ``election_timeout + spread /
            # voters``, so failover does not get slower with N.
            election_spread=max(config.election_timeout, voters * config.election_slot),
            member_timeout=config.member_timeout,
            ack_interval=max(config.heartbeat_interval, config.member_timeout / 4),
            standing=config.standing,
        )
