"""Compact announcements (``QuorumDeltaAnnounced``): pure functions for both ends.

In steady state every round has the same roster (ids, addresses, health) and
only the steps move, and after a failure it loses one member; yet a full
announcement carries every member's address to every member: at 1,000 members
that was 45 KB sent 999 times a round (megabytes when replicas advertise their
ranks' endpoints). The leader sends the compact form, a difference against
the previous quorum, to the members that hold that quorum (it knows which from
the ``last_quorum_id`` of their joins: one id names one membership) and the
full form to the rest; a member checks the digest of the roster it holds and
asks again (answered with the full form) if it differs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping

from .model import (
    SEQ_MASK,
    Health,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
)

#: Expanded quorums by what determines them, so the agents hosted by one
#: process (sharing the decoded message and their last quorum) build the
#: 1,000 members once, not once each. A pure function's memo: same inputs,
#: same value.
_EXPANDED: OrderedDict[tuple[object, ...], Quorum] = OrderedDict()
_EXPANDED_SIZE = 8
_EXPANDED_LOCK = threading.Lock()  # agent loops of one process may share it
#: The last expansion, found by identity: the hundreds of agents of one
#: process expand the same decoded message on the same base one after another.
_LAST: tuple[object, object, Quorum | None] = (None, None, None)


def compact(announce: QuorumAnnounced, base: Quorum) -> QuorumDeltaAnnounced | None:
    """The compact form of ``announce`` for members holding ``base``, or None
    when it would not be much smaller (most of the roster changed)."""
    q = announce.quorum
    new, old = q.roster, base.roster
    removed: tuple[int, ...] = ()
    added: tuple[tuple[int, str, Health], ...] = ()
    if new == old:
        share_views(q, base)
    else:
        known = {entry[0]: entry for entry in old}
        members = q.index_of
        removed = tuple(r for r in known if r not in members)
        added = tuple(entry for entry in new if known.get(entry[0]) != entry)
        if 2 * len(added) > len(new):
            return None
    answered, members = announce.answered, q.index_of
    seqs = tuple(answered.get(r, 0) & SEQ_MASK for r in q.replica_ids)
    others = {r: seq for r, seq in answered.items() if r not in members}
    behind = tuple((m.replica_id, m.next_step) for m in q.members
                   if m.next_step != q.max_step)
    return QuorumDeltaAnnounced(announce.term, q.quorum_id, q.leader_id, q.max_step,
                                base.digest, removed, added, behind, seqs, others)


def answers(delta: QuorumDeltaAnnounced, quorum: Quorum, me: int, join_seq: int) -> bool:
    """Whether ``delta`` (expanded to ``quorum``) answers ``me``'s bid ``join_seq``."""
    index = quorum.index_of.get(me)
    if index is not None:
        return index < len(delta.seqs) and delta.seqs[index] == join_seq & SEQ_MASK
    return delta.others.get(me) == join_seq


def expand(delta: QuorumDeltaAnnounced, base: Quorum) -> Quorum:
    """The quorum ``delta`` describes, given a ``base`` with its digest."""
    last_delta, last_base, last_quorum = _LAST
    if last_delta is delta and last_base is base and last_quorum is not None:
        return last_quorum  # the agents of one process share the decoded message
    key = (delta.digest, delta.quorum_id, delta.max_step, delta.behind, delta.term,
           delta.leader_id, delta.removed, delta.added)
    with _EXPANDED_LOCK:
        found = _EXPANDED.get(key)
    if found is not None:
        _remember(delta, base, found)
        return found
    roster = base.roster
    if delta.removed or delta.added:
        gone = set(delta.removed) | {entry[0] for entry in delta.added}
        roster = tuple(sorted([e for e in roster if e[0] not in gone] + list(delta.added),
                              key=lambda entry: entry[0]))
    steps: Mapping[int, int] = dict(delta.behind)
    top = delta.max_step
    members = tuple(QuorumMember(r, steps.get(r, top), a, h) for r, a, h in roster)
    quorum = Quorum(delta.quorum_id, members, top, tuple(sorted(steps)), delta.term,
                    delta.leader_id)
    if roster is base.roster:
        share_views(quorum, base)
    with _EXPANDED_LOCK:
        _EXPANDED[key] = quorum
        if len(_EXPANDED) > _EXPANDED_SIZE:
            _EXPANDED.popitem(last=False)
    _remember(delta, base, quorum)
    return quorum


def _remember(delta: QuorumDeltaAnnounced, base: Quorum, quorum: Quorum) -> None:
    global _LAST
    _LAST = (delta, base, quorum)  # one assignment: safe to read from any thread


def share_views(quorum: Quorum, base: Quorum) -> None:
    """Seed ``quorum``'s derived views from ``base``, whose roster it has:
    equal values, computed once (they are caches, not fields)."""
    for name in ("replica_ids", "index_of", "roster", "digest"):
        quorum.__dict__[name] = getattr(base, name)
