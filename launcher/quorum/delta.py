"""Pure rules on quorum values: ids, compact announcements, standing steps.

**Ids.** ``quorum_id`` changes exactly when the membership changes (a replica
joined, left, or came back at a new address) or a member reports a failed
commit, and one id always names one membership, even across leaders.

**Compact announcements.** In steady state every round has the same roster and
only the steps move; after a failure it loses one member. A full announcement
carries every member's address to every member (at 1,000 members, each
advertising its ranks' endpoints, megabytes), so the leader sends the difference
against the previous quorum (``QuorumDeltaAnnounced``) to the members that hold
it (it knows which from their joins' ``last_quorum_id``) and the full form to the
rest; a member checks the digest of the roster it holds and asks again if it
differs (the leader repeats an answered bid in full).
"""

from __future__ import annotations

from collections.abc import Iterable

from .model import (
    SEQ_MASK,
    JoinRequested,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
)

#: Quorum ids that a leader of term T creates start at (T - 1) * stride + 1.
QUORUM_ID_STRIDE = 1_000_000_000


def next_quorum_id(previous: Quorum | None, members: tuple[QuorumMember, ...],
                   joins: Iterable[JoinRequested], term: int) -> int:
    """Keep the id iff nothing changed; otherwise one more than the newest seen,
    and at least the first id of this leader's term.

    A member that reports an older id than the newest missed that quorum (it was
    not in it, or its answer was lost), so for it the membership did change.

    Why a range per term: a deposed leader that has not heard of its successor
    yet may still form a quorum from joins sent to it earlier, and some of its
    members may still accept it; the successor cannot know that quorum's id.
    Ids from disjoint ranges keep "one id, one membership", so the all-reduce
    handshake (which compares quorum ids) turns the stale members away.
    """
    joins = list(joins)
    latest = max([previous.quorum_id if previous else 0] + [j.last_quorum_id for j in joins])
    unchanged = (previous is not None and previous.quorum_id == latest
                 and previous.roster == tuple((m.replica_id, m.address) for m in members)
                 and all(j.last_quorum_id == latest and not j.commit_failed for j in joins))
    return latest if unchanged else max(latest + 1, (term - 1) * QUORUM_ID_STRIDE + 1)


def compact(announce: QuorumAnnounced, base: Quorum) -> QuorumDeltaAnnounced | None:
    """The compact form of ``announce`` for members holding ``base``, or None
    when it would not be much smaller (most of the roster changed)."""
    q = announce.quorum
    known = dict(base.roster)
    removed = tuple(r for r in known if not q.includes(r))
    added = tuple((r, a) for r, a in q.roster if known.get(r) != a)
    if 2 * len(added) > len(q.members):
        return None
    seqs = tuple(announce.answered.get(r, 0) & SEQ_MASK for r in q.replica_ids)
    behind = tuple((m.replica_id, m.next_step) for m in q.members if m.next_step != q.max_step)
    return QuorumDeltaAnnounced(announce.term, q.quorum_id, q.leader_id, q.max_step,
                                base.digest, removed, added, behind, seqs)


def expand(delta: QuorumDeltaAnnounced, base: Quorum) -> Quorum:
    """The quorum ``delta`` describes, given a ``base`` with its digest."""
    gone = set(delta.removed) | {r for r, _ in delta.added}
    roster = sorted([e for e in base.roster if e[0] not in gone] + list(delta.added))
    steps = dict(delta.behind)
    members = tuple(QuorumMember(r, steps.get(r, delta.max_step), a) for r, a in roster)
    return Quorum(delta.quorum_id, members, delta.max_step, tuple(sorted(steps)), delta.term,
                  delta.leader_id)


def answers(delta: QuorumDeltaAnnounced, quorum: Quorum, me: int, join_seq: int) -> bool:
    """Whether ``delta`` (expanded to ``quorum``) answers ``me``'s bid ``join_seq``."""
    index = quorum.index_of.get(me)
    return index is not None and index < len(delta.seqs) and \
        delta.seqs[index] == join_seq & SEQ_MASK


def advance(quorum: Quorum, step: int) -> Quorum:
    """``quorum`` one step on, as a standing quorum: the same id and members,
    every member at ``step``. Each member works out the same value."""
    return Quorum(quorum.quorum_id, tuple(QuorumMember(r, step, a) for r, a in quorum.roster),
                  step, (), quorum.term, quorum.leader_id)
