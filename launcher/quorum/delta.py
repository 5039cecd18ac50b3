"""Compact announcements (``QuorumDeltaAnnounced``): pure functions for both ends.

In steady state every round has the same roster (ids, addresses, health) and
only the steps move, yet a full announcement carries every member's address
to every member: at 1,000 members that was 45 KB sent 999 times a round. The
leader sends the compact form to the members that hold a quorum with the same
roster (it knows which from the ``last_quorum_id`` of their joins: one id
names one membership) and the full form to the rest; a member checks the
digest and falls back to asking again (answered with the full form) if its
roster differs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from .model import SEQ_MASK, Quorum, QuorumAnnounced, QuorumDeltaAnnounced, QuorumMember

#: Expanded quorums by what determines them, so the agents hosted by one
#: process (sharing the decoded message and their last quorum) build the
#: 1,000 members once, not once each. A pure function's memo: same inputs,
#: same value.
_EXPANDED: OrderedDict[tuple[object, ...], Quorum] = OrderedDict()
_EXPANDED_SIZE = 8


def compact(announce: QuorumAnnounced, base: Quorum) -> QuorumDeltaAnnounced | None:
    """The compact form of ``announce`` for members holding ``base``, or None
    if its roster is not ``base``'s."""
    q = announce.quorum
    if q.roster != base.roster:
        return None
    answered, members = announce.answered, q.index_of
    seqs = tuple(answered.get(r, 0) & SEQ_MASK for r in q.replica_ids)
    others = {r: seq for r, seq in answered.items() if r not in members}
    behind = tuple((m.replica_id, m.next_step) for m in q.members
                   if m.next_step != q.max_step)
    _share_views(q, base)
    return QuorumDeltaAnnounced(announce.term, q.quorum_id, q.leader_id, q.max_step,
                                base.digest, behind, seqs, others)


def answers(delta: QuorumDeltaAnnounced, base: Quorum, me: int, join_seq: int) -> bool:
    """Whether ``delta`` answers ``me``'s bid ``join_seq`` (``base`` has its digest)."""
    index = base.index_of.get(me)
    if index is not None:
        return index < len(delta.seqs) and delta.seqs[index] == join_seq & SEQ_MASK
    return delta.others.get(me) == join_seq


def expand(delta: QuorumDeltaAnnounced, base: Quorum) -> Quorum:
    """The quorum ``delta`` describes, given a ``base`` with its digest."""
    key = (delta.digest, delta.quorum_id, delta.max_step, delta.behind, delta.term,
           delta.leader_id)
    found = _EXPANDED.get(key)
    if found is not None:
        return found
    steps: Mapping[int, int] = dict(delta.behind)
    top = delta.max_step
    members = tuple(QuorumMember(r, steps.get(r, top), a, h) for r, a, h in base.roster)
    behind = tuple(sorted(steps))
    quorum = Quorum(delta.quorum_id, members, top, behind, delta.term, delta.leader_id)
    _share_views(quorum, base)
    _EXPANDED[key] = quorum
    if len(_EXPANDED) > _EXPANDED_SIZE:
        _EXPANDED.popitem(last=False)
    return quorum


def _share_views(quorum: Quorum, base: Quorum) -> None:
    """Seed ``quorum``'s derived views from ``base``, whose roster it has:
    equal values, computed once (they are caches, not fields)."""
    for name in ("replica_ids", "index_of", "roster", "digest"):
        quorum.__dict__[name] = getattr(base, name)
