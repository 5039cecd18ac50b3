"""The pure core's vocabulary: its state, the events it reacts to, the actions it asks for.

``decide(state, event, now) -> (state, actions)`` (in ``core``) is the only thing
that changes a ``QuorumState``; the shell performs the actions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .model import (
    Health,
    JoinFailure,
    JoinRequested,
    Message,
    Quorum,
    QuorumAnnounced,
    QuorumParams,
    Role,
    Standing,
)

NEVER = -math.inf

# --------------------------------------------------------------------------- events (inputs)


@dataclass(frozen=True)
class TimerFired:
    """Time has passed; the shell sends it at ``next_deadline(state)``."""


@dataclass(frozen=True)
class MessageReceived:
    """An authenticated, non-replayed message from a configured replica.
    ``from_feed``: it came on the sender's feed, which every follower of the
    sender receives, so it may answer others than this replica."""

    sender: int
    message: Message
    from_feed: bool = False


@dataclass(frozen=True)
class MessagesReceived:
    """Messages the shell took from its socket at one instant, handled in
    order; timers are looked at once after the batch instead of after each."""

    messages: tuple[MessageReceived, ...]


@dataclass(frozen=True)
class QuorumRequested:
    """The local replica asks to join the quorum for ``next_step``."""

    next_step: int
    address: str
    health: Health = Health.OK


@dataclass(frozen=True)
class CommitFailureReported:
    """The local replica's last commit failed: the next quorum gets a new id."""


@dataclass(frozen=True)
class LeadershipTransferRequested:
    """Hand leadership to ``target`` (ignored unless this replica leads)."""

    target: int


Input = (TimerFired | MessageReceived | MessagesReceived | QuorumRequested |
         CommitFailureReported | LeadershipTransferRequested)

# --------------------------------------------------------------------------- actions (outputs)


@dataclass(frozen=True)
class Send:
    """Send one message (signed once) to each replica in ``to``."""

    to: tuple[int, ...]
    message: Message


@dataclass(frozen=True)
class DeliverQuorum:
    """Answer the local quorum request."""

    quorum: Quorum


@dataclass(frozen=True)
class FailQuorumRequest:
    reason: JoinFailure
    reachable: tuple[int, ...]


@dataclass(frozen=True)
class NotifyLeaderElected:
    term: int
    leader_id: int


@dataclass(frozen=True)
class NotifyLeadershipLost:
    term: int
    reason: str


@dataclass(frozen=True)
class NotifyQuorumFormed:
    quorum: Quorum
    #: How long the join window was open (first join of the round -> formed).
    window: float = 0.0


@dataclass(frozen=True)
class NotifyStandingEnded:
    """The grant for ``quorum_id`` ended at step ``through``: member ``ended_by``
    asked for a round (the leader ended it), so a ring of that quorum for a later
    step waits for it in vain and must give up now; or the leader changed and
    ``ended_by`` is this member, whose own ring of a later step gives up (the
    others may have learned of the change first and asked for a round)."""

    quorum_id: int
    through: int
    ended_by: int


@dataclass(frozen=True)
class NotifyLivenessChanged:
    """Which members are alive changed: the leader's own view, or at a follower
    the suspects the leader's heartbeats carry."""

    lost: tuple[int, ...]
    recovered: tuple[int, ...]


@dataclass(frozen=True)
class NotifyMajorityLost:
    reachable: tuple[int, ...]


@dataclass(frozen=True)
class NotifyMajorityRegained:
    leader_id: int


Action = (Send | DeliverQuorum | FailQuorumRequest | NotifyLeaderElected |
          NotifyLeadershipLost | NotifyQuorumFormed | NotifyLivenessChanged |
          NotifyStandingEnded | NotifyMajorityLost | NotifyMajorityRegained)

# --------------------------------------------------------------------------- state


@dataclass(frozen=True)
class Election:
    """Raft's election state (no log: the quorum is recomputed every step)."""

    role: Role = Role.FOLLOWER
    term: int = 0
    voted_for: int | None = None
    leader_id: int | None = None
    #: The leader whose silence started the current election: a new leader
    #: presumes every member alive except this one and the known suspects.
    previous_leader: int | None = None
    #: Last valid contact with a leader (for a leader: when it took office).
    leader_seen_at: float = NEVER
    had_leader: bool = False
    deadline: float = 0.0
    draws: int = 0
    #: The random part of the timeout last drawn: kept while the same leader
    #: stays in contact.
    jitter: float = 0.0
    votes: frozenset[int] = frozenset()
    heartbeat_due: float = 0.0
    acked_at: float = NEVER
    suspects: frozenset[int] = frozenset()
    majority_lost: bool = False


@dataclass(frozen=True)
class Round:
    """Joins the leader has collected since the first of them (``opened_at``).

    The join window opens at ``formable_at``: the first instant the joins could
    make a quorum (enough members for ``min_replicas`` and, with the witnesses,
    a majority), not at the first join. A member that joined long before the
    others (it started late and missed a round, or finished its step early)
    would otherwise have the window closed already when the next member joins,
    which formed a quorum without the live members a moment behind, every step
    (quorums alternating between two halves of the replicas)."""

    opened_at: float
    joins: Mapping[int, JoinRequested]
    formable_at: float | None = None


@dataclass(frozen=True)
class Leadership:
    """What only the leader keeps."""

    live: frozenset[int] = frozenset()
    round: Round | None = None
    #: Highest join_seq answered per member: a late resend of an answered join
    #: must not linger in the next round as a member that is not waiting.
    answered_seq: Mapping[int, int] = field(default_factory=dict)
    last_announce: QuorumAnnounced | None = None
    last_formed: Quorum | None = None
    #: Members sent an announcement since the last heartbeat tick: that was
    #: leader contact as recent as the tick's heartbeat would be, so while
    #: rounds run faster than ``heartbeat_interval`` they get no heartbeats
    #: (a third of all messages at 1,000 members) unless the suspects change.
    contacted: frozenset[int] = frozenset()
    suspects_sent: tuple[int, ...] | None = None
    #: Each member's address from its joins of this term: a member whose last
    #: quorum this leader formed leaves it out of its next join.
    addresses: Mapping[int, str] = field(default_factory=dict)
    #: A formed quorum whose members alone are short of a majority of the
    #: votes, waiting for the witnesses' endorsements before it is announced.
    pending: Pending | None = None
    #: The grant for ``last_formed`` (``standing``), the one the last heartbeat
    #: carried, and this replica's own step at the last tick, with the time.
    standing: Standing | None = None
    standing_sent: Standing | None = None
    step_clock: tuple[int, float, float] | None = None
    #: Members sent the grant again for a join that only missed it, by join_seq
    #: (the same join once more ends the grant: the member could not use it).
    granted_late: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Pending:
    """A formed, not yet announced quorum (see ``witness``)."""

    announce: QuorumAnnounced
    base: Quorum | None
    joined: Mapping[int, JoinRequested]
    opened_at: float
    asked_at: float
    granted: frozenset[int] = frozenset()
    refused: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Membership:
    """The local replica's side: its outstanding request and last quorum."""

    request: JoinRequested | None = None
    sent_at: float = NEVER
    sent_to: int | None = None
    join_seq: int = 0
    commit_failed: bool = False
    last_quorum: Quorum | None = None
    #: The leader's grant for ``last_quorum`` (``standing``), heard since it came.
    standing: Standing | None = None
    #: The step of the last quorum a round answered: later steps of it came from
    #: the grant.
    round_step: int = -1


@dataclass(frozen=True)
class QuorumState:
    me: int
    voters: frozenset[int]
    params: QuorumParams
    seed: int
    started_at: float
    #: False: votes and joins but never campaigns (MongoDB's priority-0 member),
    #: for replicas that should not carry the leader.
    electable: bool = True
    election: Election = field(default_factory=Election)
    #: Last authenticated message from each peer (any kind counts as alive).
    heard: Mapping[int, float] = field(default_factory=dict)
    leadership: Leadership = field(default_factory=Leadership)
    member: Membership = field(default_factory=Membership)
    #: Voters that never train (``witness``); they never join a quorum.
    witnesses: frozenset[int] = frozenset()
    #: Votes of each witness (a replica has one); see ``model.voter_weights``.
    witness_weights: Mapping[int, int] = field(default_factory=dict)
    #: At a witness: the members of the last quorum it endorsed (or was told of).
    endorsed: frozenset[int] | None = None

    @property
    def others(self) -> tuple[int, ...]:
        return tuple(sorted(self.voters - {self.me}))

    @property
    def replicas(self) -> frozenset[int]:
        return self.voters - self.witnesses if self.witnesses else self.voters

    @property
    def total_weight(self) -> int:
        return self.weight_of(self.voters)

    @property
    def majority(self) -> int:
        """Votes a strict majority of every voter's votes needs."""
        return self.total_weight // 2 + 1

    def weight_of(self, voters: frozenset[int] | set[int]) -> int:
        """The votes ``voters`` (a subset of ``self.voters``) carry together."""
        if not self.witnesses:
            return len(voters)
        inside = [w for w in self.witnesses if w in voters]
        return len(voters) - len(inside) + sum(self.witness_weights.get(w, 1) for w in inside)

    @property
    def role(self) -> Role:
        return self.election.role

    @property
    def term(self) -> int:
        return self.election.term

    @property
    def leader_id(self) -> int | None:
        return self.election.leader_id

    def fresh(self, now: float) -> frozenset[int]:
        """Members heard from within ``member_timeout``, this one included."""
        horizon = now - self.params.member_timeout
        return frozenset(p for p, t in self.heard.items()
                         if t > horizon and p in self.voters) | {self.me}
