"""Standing quorums: while nothing changes, the members of the last quorum go on
with it from step to step without a round (``quorum.standing``).

A round costs every member a join and an answer, and the leader a thousand
joins at 1,000 members; yet in steady state each round has the same members as
the last, each one step further. So the leader grants its last quorum a few
steps ahead on its heartbeats (``Standing(quorum_id, through)``), and a member
whose request continues that quorum exactly (the step after its last one, the
same address, healthy, no failed commit) and is within the grant is answered on
the spot: the same quorum one step on (same id and members, every member at the
step asked, none behind). Each member works out the same answer, so they all
stay in one ring.

The leader extends the grant at its heartbeat ticks, and only while nothing
asks for a round: it formed the quorum in its current term and is one of its
members, every member is live, no join and no endorsement is pending. It grants
as many steps beyond its own as it makes in ``horizon`` (the shorter of three
heartbeat intervals and half the join window), at the pace of its last steps;
none when that is under one step, since a round costs nothing beside slow steps.
A grant grows, so once it stops growing every member runs out of it at the
same step and joins the round there: a newcomer waits about ``horizon``, and the
round forms in one go. A member whose grant is stale (a heartbeat came late)
joins early: the leader sends it the grant at once and it answers itself by it.

A member of the quorum that joins for a step the grant covers, and cannot be
answered by it (a commit only it failed, a new address or health, the same join
again), would leave the others waiting for it in that step's all-reduce: the
leader ends the grant before that step (``Standing.ended_by``) and tells every
member at once; each worker gives up such a ring (``StandingEnded``) and retries
the step in the round. A late join the grant answers leaves the round (it would
stop the grant growing, and a round would count it at its old step). A member
found silent revokes the grant (no one steps with it again) and is reported lost
as without standing. A grant dies with its leader: each member that learns of a
new term, or loses its leader, leaves its ring of a standing step, since others
may have learned first and asked the new leader for that step.

Safety: a standing answer forms no quorum. It continues one that voters with a
majority of the votes stood behind, with exactly its members, and a step
commits only through the all-reduce ring of all of them (``ftar``). A replica
cut off from the others may still be answered with its standing quorum until its
grant runs out or its leader contact lapses (``election_timeout``), but its ring
needs the members on the other side, which train in another ring: it commits
nothing. Off (``quorum.standing = false``), every step runs a round and a
replica cut off is never answered at all.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from .delta import share_views
from .model import (
    Health,
    Heartbeat,
    JoinRequested,
    Quorum,
    QuorumMember,
    Role,
    Standing,
    evolve,
)
from .state import Action, DeliverQuorum, NotifyStandingEnded, QuorumState, Round, Send

Outcome = tuple[QuorumState, list[Action]]

#: Advanced quorums by what determines them, so the agents hosted by one
#: process build the 1,000 members of a step once (as ``delta.expand``).
_ADVANCED: OrderedDict[tuple[object, ...], Quorum] = OrderedDict()
_ADVANCED_SIZE = 8
_ADVANCED_LOCK = threading.Lock()
_LAST: tuple[object, int, Quorum | None] = (None, 0, None)


def horizon(s: QuorumState) -> float:
    """How far ahead, in time, the leader grants."""
    return min(3 * s.params.heartbeat_interval, s.params.join_timeout / 2)


# --------------------------------------------------------------------------- member side


def answer(s: QuorumState, next_step: int, address: str, health: Health,
           commit_failed: bool = False) -> Quorum | None:
    """The standing quorum for this request, or None when it needs a round."""
    m = s.member
    grant, last = m.standing, m.last_quorum
    if grant is None or last is None or commit_failed or m.commit_failed \
            or health is not Health.OK:
        return None
    if grant.quorum_id != last.quorum_id or next_step != last.max_step + 1 \
            or next_step > grant.through:
        return None
    if s.leader_id is None or last.term != s.term or last.leader_id != s.leader_id:
        return None  # another leader, or none: its rounds decide
    if s.role is not Role.LEADER and not s.election.suspects.isdisjoint(last.replica_ids):
        return None  # a member its leader finds silent: the round goes on without it
    index = last.index_of.get(s.me)
    if index is None:
        return None
    mine = last.members[index]
    if mine.address != address or mine.health is not Health.OK:
        return None
    return advance(last, next_step)


def deliver(s: QuorumState, quorum: Quorum) -> Outcome:
    """Answer the request with the standing quorum; the grant stays."""
    m = s.member
    return evolve(s, member=evolve(m, request=None, sent_to=None, last_quorum=quorum)), \
        [DeliverQuorum(quorum)]


def on_grant(s: QuorumState, grant: Standing | None) -> Outcome:
    """A heartbeat of our leader: keep its grant if it is for our last quorum (none:
    it revoked it), and answer a join we sent on a stale one if the grant now covers it."""
    m = s.member
    last = m.last_quorum
    if grant is None:
        return (s, []) if m.standing is None else (evolve(s, member=evolve(m, standing=None)), [])
    if last is None or grant.quorum_id != last.quorum_id or not s.params.standing:
        return s, []
    actions: list[Action] = []
    changed = m.standing != grant
    if changed:
        s = evolve(s, member=evolve(m, standing=grant))
        if grant.ended_by is not None:
            actions.append(NotifyStandingEnded(grant.quorum_id, grant.through, grant.ended_by))
    request = s.member.request
    if request is None:
        return s, actions
    quorum = answer(s, request.next_step, request.address, request.health,
                    request.commit_failed)
    if quorum is None:
        if grant.ended_by is None and request.next_step <= grant.through \
                and s.leader_id is not None and s.leader_id != s.me:
            # The grant covers this join, yet does not answer it here (the leader may
            # have sent it for this join): the same join again tells the leader to
            # end the grant (on_joins), or the others may wait for this member.
            actions.append(Send((s.leader_id,), request))
        return s, actions
    s, delivered = deliver(s, quorum)
    return s, actions + delivered


def on_leader_change(before: QuorumState, s: QuorumState) -> Outcome:
    """The grant goes with the leader (a new term, or no leader now). Members learn
    of the change at different moments: one that learned first asks for a round
    for a step the grant covered, while the others may already be in that step's
    ring, waiting for it. So each member, as it learns, gives up its own ring of
    any step after the last a round answered (``NotifyStandingEnded`` ended by
    itself) and asks the new leader's round for it; the rings give up one after
    the other, and no one waits for ``ftar.timeout``."""
    grant = before.member.standing  # the new leader's first heartbeat may have dropped it
    if grant is None or (s.term == before.term and s.leader_id == before.leader_id):
        return s, []
    m = s.member
    if m.standing == grant:
        s = evolve(s, member=evolve(m, standing=None))
    if grant.ended_by is not None:
        return s, []  # ended already: the rings after it gave up then
    return s, [NotifyStandingEnded(grant.quorum_id, m.round_step, s.me)]


def advance(q: Quorum, step: int) -> Quorum:
    """``q`` one step on: the same id and members, every member at ``step``."""
    global _LAST
    last_base, last_step, last = _LAST
    if last_base is q and last_step == step and last is not None:
        return last  # the agents of one process continue the same quorum object
    key = (q.quorum_id, q.digest, q.term, q.leader_id, step)
    with _ADVANCED_LOCK:
        found = _ADVANCED.get(key)
    if found is None:
        found = Quorum(q.quorum_id, tuple(QuorumMember(r, step, a, h) for r, a, h in q.roster),
                       step, (), q.term, q.leader_id)
        share_views(found, q)
        with _ADVANCED_LOCK:
            _ADVANCED[key] = found
            if len(_ADVANCED) > _ADVANCED_SIZE:
                _ADVANCED.popitem(last=False)
    _LAST = (q, step, found)  # one assignment: safe to read from any thread
    return found


# --------------------------------------------------------------------------- leader side


def extend(s: QuorumState, fresh: frozenset[int], now: float) -> QuorumState:
    """The leader's grant at a heartbeat tick, ``fresh`` the members heard within
    ``member_timeout``: grown while nothing asks for a round, kept otherwise, and
    revoked as soon as a member falls silent (nobody may step with it again)."""
    lead = s.leadership
    own = s.member.last_quorum
    if not s.params.standing or own is None:
        return s
    step = own.max_step
    clock = lead.step_clock
    if clock is None or step < clock[0]:
        clock = (step, now, 0.0)
    elif step > clock[0]:
        clock = (step, now, (step - clock[0]) / max(now - clock[1], 1e-9))
    all_live = fresh.issuperset(own.replica_ids)
    grant = lead.standing if all_live else None
    ahead = math.floor(clock[2] * horizon(s))
    if ahead >= 1 and all_live and _steady(s, own):
        through = step + ahead
        if grant is None or through > grant.through:
            grant = Standing(own.quorum_id, through)
    member = s.member
    if member.standing != grant:
        member = evolve(member, standing=grant)  # the leader answers itself by it too
    return evolve(s, member=member, leadership=evolve(lead, standing=grant, step_clock=clock))


def on_joins(s: QuorumState, joins: Iterable[tuple[int, JoinRequested]]) -> Outcome:
    """The leader took these joins. One from a member of the standing quorum for a
    step the grant covers means the others may be in that step's all-reduce (or a
    later one) waiting for it. If the member looks as if it only missed the grant
    (a heartbeat late), it is sent the grant at once and answers itself by it.
    Otherwise it needs a round (a commit only it failed, a new address or health),
    or it missed the grant and still joins: then the others wait in vain. The
    grant ends before that step and every member is told at once; their rings of
    later steps give up and they join the round too. The step is retried."""
    lead = s.leadership
    grant, own = lead.standing, s.member.last_quorum
    if grant is None or grant.ended_by is not None or own is None:
        return s, []
    first: tuple[int, int] | None = None
    late: list[tuple[int, int]] = []
    for sender, join in joins:
        index = own.index_of.get(sender)
        if index is None or join.join_seq <= lead.answered_seq.get(sender, -1) \
                or join.next_step > grant.through:
            continue
        if sender != s.me and lead.granted_late.get(sender) != join.join_seq \
                and _only_late(join, own.members[index], grant):
            late.append((sender, join.join_seq))
        elif first is None or join.next_step < first[1]:
            first = (sender, join.next_step)
    if first is None:
        if not late:
            return s, []
        granted = {**lead.granted_late, **dict(late)}
        return evolve(s, leadership=evolve(lead, granted_late=granted,
                                           round=_without(lead.round, dict(late)))), [
            Send(tuple(r for r, _ in late), Heartbeat(s.term, lead.suspects_sent, grant))]
    ended = Standing(grant.quorum_id, first[1] - 1, first[0])
    s = evolve(s, member=evolve(s.member, standing=ended),
               leadership=evolve(lead, standing=ended, standing_sent=ended, granted_late={}))
    return s, [Send(s.others, Heartbeat(s.term, lead.suspects_sent, ended)),
               NotifyStandingEnded(ended.quorum_id, ended.through, first[0])]


def _without(current: Round | None, answered: Mapping[int, int]) -> Round | None:
    """The round less the joins the grant answers: left in it, such a join would
    keep the grant from growing, and a later round would count the member at the
    step it asked for then while it waits for the answer to its next join."""
    if current is None:
        return None
    joins = {r: j for r, j in current.joins.items() if answered.get(r) != j.join_seq}
    if len(joins) == len(current.joins):
        return current
    return evolve(current, joins=joins) if joins else None


def _only_late(join: JoinRequested, member: QuorumMember, grant: Standing) -> bool:
    """The join would have been answered by the grant had it arrived in time (the
    member alone checks its step; if it still cannot, its resent join ends it)."""
    return (join.last_quorum_id == grant.quorum_id and not join.commit_failed
            and join.health is Health.OK and member.health is Health.OK
            and join.address in ("", member.address))


def _steady(s: QuorumState, own: Quorum) -> bool:
    """Nothing else asks for a round: the leader formed its own last quorum in
    this term, no join or endorsement is pending."""
    lead = s.leadership
    formed = lead.last_formed
    if formed is None or formed.quorum_id != own.quorum_id or formed.term != s.term \
            or formed.leader_id != s.me or s.me not in own.index_of:
        return False
    return lead.pending is None and (lead.round is None or not lead.round.joins)
