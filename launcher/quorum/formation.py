"""Quorum formation: the leader's rounds and the member's side of them.

The leader collects joins for a round. It forms the quorum as soon as every
replica it believes alive has joined (the fast path: everyone present), or when
the join window (``join_timeout``) has expired, with at least ``min_replicas``
admitted members. The window opens once the joins could make a quorum
(``Round.formable_at``), so each live member has ``join_timeout`` to join from
then, however long an early member has been waiting. The leader announces the
quorum only once voters holding a strict majority of all votes stand behind it:
the members themselves, and when they are too few, the witnesses' endorsements
(``witness``). A minority can never announce one, so two quorums cannot both
train (the package docstring has the argument).

``quorum_id`` changes exactly when the membership changes (a replica joined,
left, or came back at a new address) or a member reports a failed commit, and
one id always names one membership, even across leaders (see ``next_quorum_id``).

All functions are pure: ``(state, ..., now) -> (state, actions)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from . import standing, witness
from .delta import answers, compact, expand
from .model import (
    Health,
    JoinRequested,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
    Role,
    evolve,
)
from .pmap import with_items
from .state import (
    NEVER,
    Action,
    DeliverQuorum,
    Leadership,
    Membership,
    NotifyQuorumFormed,
    Pending,
    QuorumRequested,
    QuorumState,
    Round,
    Send,
)

Outcome = tuple[QuorumState, list[Action]]

#: Quorum ids that a leader of term T creates start at (T - 1) * stride + 1.
QUORUM_ID_STRIDE = 1_000_000_000

# --------------------------------------------------------------------------- leader side


def on_join(s: QuorumState, sender: int, join: JoinRequested, now: float) -> Outcome:
    return on_joins(s, ((sender, join),), now)


def on_joins(s: QuorumState, joins: Sequence[tuple[int, JoinRequested]], now: float, *,
             heard_before: float = NEVER) -> Outcome:
    """``(sender, join)`` pairs in order, as many ``on_join`` would take them:
    the same state and actions, but the round is rebuilt once per batch (and
    at a formation) rather than several state copies per join; a leader takes
    a thousand joins a round, a few hundred per read of its socket. A sender
    last heard before ``heard_before`` is marked heard ``now`` as its join is
    taken (as ``core`` does for any message), not sooner: whether a member
    that already joined is still alive decides whether a formation admits it."""
    if s.role is not Role.LEADER:
        return s, []  # the member re-sends to whoever it learns is leader
    actions: list[Action] = []
    lead = s.leadership
    batch = _JoinBatch(lead, now)
    live = _live_replicas(s, lead)
    enough = _joins_needed(s)
    for sender, join in joins:
        if sender not in batch.heard and s.heard.get(sender, NEVER) < heard_before:
            batch.heard[sender] = now
        if join.join_seq <= lead.answered_seq.get(sender, -1):
            # A re-sent join we already answered: the answer was probably lost.
            last = lead.last_announce
            if last is not None and last.answered.get(sender) == join.join_seq \
                    and sender != s.me:
                actions.append(Send((sender,), last))
            continue
        known = batch.address(sender)
        if not join.address:
            if known is None:
                continue  # cannot happen by the member's rule; its resend is in full
            join = evolve(join, address=known)
        elif known != join.address:
            batch.addresses[sender] = join.address
        batch.add(sender, join)
        # Cheap test first (as in ``try_form``): the full one runs once the
        # count can match everyone live, when the window may open (once), or
        # once it has closed, which keeps a 1,000-member round linear.
        if batch.count >= live or (batch.count >= enough if batch.formable_at is None
                                   else now >= batch.formable_at + s.params.join_timeout):
            s, more = try_form(batch.apply(s), now)
            actions += more
            lead = s.leadership
            batch = _JoinBatch(lead, now)
            live = _live_replicas(s, lead)
    s, more = standing.on_joins(batch.apply(s), joins)
    return s, actions + more


def _live_replicas(s: QuorumState, lead: Leadership) -> int:
    """How many of the live voters may join (witnesses never do)."""
    return len(lead.live) - sum(1 for w in s.witnesses if w in lead.live)


def _joins_needed(s: QuorumState) -> int:
    """The fewest joins that can make a quorum: ``min_replicas``, and with every
    witness's vote a majority."""
    return max(s.params.min_replicas, s.majority - s.weight_of(s.witnesses))


class _JoinBatch:
    """Joins and addresses taken since the state was last rebuilt."""

    def __init__(self, lead: Leadership, now: float) -> None:
        self.lead = lead
        self.base = lead.round.joins if lead.round is not None else {}
        self.opened_at = lead.round.opened_at if lead.round is not None else now
        self.formable_at = lead.round.formable_at if lead.round is not None else None
        self.count = len(self.base)
        self.joins: dict[int, JoinRequested] = {}
        self.addresses: dict[int, str] = {}
        self.heard: dict[int, float] = {}

    def address(self, sender: int) -> str | None:
        known = self.addresses.get(sender)
        return known if known is not None else self.lead.addresses.get(sender)

    def add(self, sender: int, join: JoinRequested) -> None:
        if sender not in self.joins and sender not in self.base:
            self.count += 1
        self.joins[sender] = join

    def apply(self, s: QuorumState) -> QuorumState:
        if self.heard:
            s = evolve(s, heard=with_items(s.heard, self.heard))
        if not self.joins:
            return s
        lead = self.lead
        addresses = with_items(lead.addresses, self.addresses) if self.addresses \
            else lead.addresses
        joins = with_items(self.base, self.joins)
        return evolve(s, leadership=evolve(lead, addresses=addresses,
                                           round=Round(self.opened_at, joins, self.formable_at)))


def try_form(s: QuorumState, now: float) -> Outcome:
    lead = s.leadership
    current = lead.round
    if s.role is not Role.LEADER or current is None or lead.pending is not None:
        return s, []
    live = lead.live - s.witnesses if s.witnesses else lead.live
    # Cheap tests first: the subset test only runs once the count can match,
    # which keeps a 1,000-member round linear rather than quadratic.
    everyone = len(current.joins) >= len(live) and live.issubset(current.joins)
    opened = current.formable_at
    if not everyone and opened is not None and now < opened + s.params.join_timeout:
        return s, []  # the window is open: wait for the live members
    needed = _joins_needed(s)
    joined: dict[int, JoinRequested] = {}
    if len(current.joins) >= needed:
        horizon = now - s.params.member_timeout
        joined = {m: j for m, j in current.joins.items()
                  if m == s.me or s.heard.get(m, NEVER) > horizon}
    admitted = sum(1 for j in joined.values() if j.health is not Health.UNHEALTHY)
    if admitted < needed:
        # Not (or no longer: a member fell silent) enough for a quorum: the
        # window opens again when there are.
        return (s if opened is None else _with_round(s, evolve(current, formable_at=None))), []
    if not everyone and opened is None and s.params.join_timeout > 0:
        return _with_round(s, evolve(current, formable_at=now)), []  # the window opens
    return form(s, joined, now)


def _with_round(s: QuorumState, current: Round) -> QuorumState:
    return evolve(s, leadership=evolve(s.leadership, round=current))


def form(s: QuorumState, joined: Mapping[int, JoinRequested], now: float) -> Outcome:
    lead = s.leadership
    opened_at = lead.round.opened_at if lead.round is not None else now
    admitted = {m: j for m, j in joined.items() if j.health is not Health.UNHEALTHY}
    members = tuple(QuorumMember(m, j.next_step, j.address, j.health)
                    for m, j in sorted(admitted.items()))
    base = previous_quorum(s)
    quorum_id = next_quorum_id(base, members, admitted.values(), s.term)
    quorum = Quorum.of(quorum_id, members, term=s.term, leader_id=s.me)
    answered = {m: j.join_seq for m, j in joined.items()}
    announce = QuorumAnnounced(s.term, quorum, answered)
    pending = Pending(announce, base, joined, opened_at, now)
    s = evolve(s, leadership=evolve(lead, round=None))
    if len(members) >= s.majority or not s.witnesses:
        # The members alone are a majority: the witnesses only hear of the round.
        s, actions = publish(s, pending, now)
        return s, actions + witness.tell_witnesses(s, quorum, required=False)
    return evolve(s, leadership=evolve(s.leadership, pending=pending)), \
        witness.tell_witnesses(s, quorum, required=True)


def publish(s: QuorumState, pending: Pending, now: float) -> Outcome:
    """Announce a formed quorum that a majority of the votes stands behind."""
    lead = s.leadership
    announce, joined = pending.announce, pending.joined
    quorum = announce.quorum
    answered_seq = {**lead.answered_seq, **announce.answered}
    recipients = tuple(m for m in sorted(joined) if m != s.me)
    s = evolve(s, leadership=evolve(lead, pending=None, answered_seq=answered_seq,
                                      last_announce=announce, last_formed=quorum,
                                      contacted=lead.contacted.union(recipients),
                                      standing=None))
    actions: list[Action] = [NotifyQuorumFormed(quorum, now - pending.opened_at)]
    actions += announcements(announce, pending.base, recipients, joined)
    if s.me in joined:
        s, more = on_announce(s, announce)
        actions += more
    if s.leadership.round is not None:  # joins that came in while it waited
        s, more = try_form(s, now)
        actions += more
    return s, actions


def announcements(announce: QuorumAnnounced, base: Quorum | None,
                  recipients: tuple[int, ...], joined: Mapping[int, JoinRequested]
                  ) -> list[Action]:
    """The compact form to recipients that hold ``base`` (when the roster is
    unchanged), the full form to the others; each one signed broadcast."""
    delta = compact(announce, base) if base is not None and recipients else None
    if delta is None:
        return [Send(recipients, announce)] if recipients else []
    holding = tuple(m for m in recipients if joined[m].last_quorum_id == base.quorum_id)  # type: ignore[union-attr]
    rest = tuple(m for m in recipients if joined[m].last_quorum_id != base.quorum_id)  # type: ignore[union-attr]
    return [Send(to, message) for to, message in ((holding, delta), (rest, announce)) if to]


def previous_quorum(s: QuorumState) -> Quorum | None:
    """The newest quorum this replica knows: one it formed or one it received."""
    known = [q for q in (s.leadership.last_formed, s.member.last_quorum) if q is not None]
    return max(known, key=lambda q: q.quorum_id, default=None)


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
    latest = max([previous.quorum_id if previous else 0]
                 + [j.last_quorum_id for j in joins])
    unchanged = (previous is not None and previous.quorum_id == latest
                 and previous.same_membership(members)
                 and all(j.last_quorum_id == latest for j in joins)
                 and not any(j.commit_failed for j in joins))
    return latest if unchanged else max(latest + 1, (term - 1) * QUORUM_ID_STRIDE + 1)


# --------------------------------------------------------------------------- member side


def request_quorum(s: QuorumState, request: QuorumRequested, now: float) -> Outcome:
    quorum = standing.answer(s, request.next_step, request.address, request.health)
    if quorum is not None:
        return standing.deliver(s, quorum)
    m = s.member
    last = m.last_quorum.quorum_id if m.last_quorum is not None else 0
    seq = m.join_seq + 1
    join = JoinRequested(s.term, request.next_step, request.address, request.health,
                         last, seq, m.commit_failed)
    return send_request(s, now, first=True, request=join, join_seq=seq, commit_failed=False,
                        sent_to=None, sent_at=NEVER)


def report_commit_failure(s: QuorumState, now: float) -> Outcome:
    m = s.member
    if m.request is None:
        return evolve(s, member=evolve(m, commit_failed=True)), []
    # Already waiting: amend the bid under a new join_seq so that an answer to
    # the unamended bid (maybe already in flight) is not taken for this one.
    seq = m.join_seq + 1
    join = evolve(m.request, commit_failed=True, join_seq=seq)
    return send_request(s, now, first=True, request=join, join_seq=seq, sent_to=None)


def send_request(s: QuorumState, now: float, *, first: bool = False,
                 **changes: object) -> Outcome:
    """Send the bid to the leader; the first send of a bid leaves out an
    address the leader already has (kilobytes when a replica advertises its
    ranks' endpoints, a thousand times a round); resends carry it.
    ``changes``: fields of ``Membership`` to set first, in the same copy (a
    member makes a bid every step)."""
    m = s.member
    request: JoinRequested | None = changes.get("request", m.request)  # type: ignore[assignment]
    leader = s.leader_id
    if request is None or leader is None:
        return (evolve(s, member=evolve(m, **changes)) if changes else s), []
    join = request if request.term == s.term else evolve(request, term=s.term)
    member = evolve(m, **{**changes, "request": join, "sent_to": leader, "sent_at": now})
    if leader == s.me:
        return on_join(evolve(s, member=member), s.me, join, now)
    # The leader marks a joiner heard, which is all a heartbeat's ack does: none is
    # due for ack_interval (while rounds run, a member's joins stand in for its acks,
    # a thousand fewer messages to the leader per ack_interval).
    s = evolve(s, member=member, election=evolve(s.election, acked_at=now))
    if first and leader_has_address(s, join):
        return s, [Send((leader,), evolve(join, address=""))]
    return s, [Send((leader,), join)]


def leader_has_address(s: QuorumState, join: JoinRequested) -> bool:
    """Our last quorum was formed by the current leader in this term with our
    address as it is now: the leader took that address from a join of ours in
    this term and keeps it (``Leadership.addresses``) until the term ends."""
    last = s.member.last_quorum
    if last is None or last.term != s.term or last.leader_id != s.leader_id:
        return False
    index = last.index_of.get(s.me)
    return index is not None and last.members[index].address == join.address


def on_announce(s: QuorumState, announce: QuorumAnnounced) -> Outcome:
    m = s.member
    if m.request is None or announce.answered.get(s.me) != m.request.join_seq:
        return s, []
    return deliver(s, announce.quorum)


def on_delta(s: QuorumState, delta: QuorumDeltaAnnounced, now: float, *,
             from_feed: bool = False) -> Outcome:
    """A compact answer: expand it on the last quorum, or ask again for the
    full one (the leader repeats an answered bid in full) if the roster we
    hold is not the one it refers to. On the feed a delta on another roster
    is for the others: the leader sends us the full form itself."""
    m = s.member
    base = m.last_quorum
    if m.request is None:
        return s, []
    if base is None or base.digest != delta.digest:
        return (s, []) if from_feed else send_request(s, now)
    quorum = expand(delta, base)
    if not answers(delta, quorum, s.me, m.request.join_seq):
        return s, []
    return deliver(s, quorum)


def deliver(s: QuorumState, quorum: Quorum) -> Outcome:
    m = s.member
    s = evolve(s, member=Membership(join_seq=m.join_seq, commit_failed=m.commit_failed,
                                     last_quorum=quorum, round_step=quorum.max_step))
    return s, [DeliverQuorum(quorum)]


# --------------------------------------------------------------------------- timers


def on_timer(s: QuorumState, now: float) -> Outcome:
    """Leader: close an expired window. Member: re-send an unanswered bid (the
    leader answers a duplicate of an answered bid by repeating its answer)."""
    actions: list[Action] = []
    if s.role is Role.LEADER and s.leadership.pending is not None:
        s, actions = witness.on_timer(s, now)
    if s.role is Role.LEADER and s.leadership.round is not None:
        s, more = try_form(s, now)
        actions += more
    if now >= _resend_at(s):
        s, more = send_request(s, now)
        actions += more
    return s, actions


def _resend_at(s: QuorumState) -> float:
    """Two join windows after the last send: after one, a leader waiting for a
    dead member closes its window and answers, and a resend at that same
    instant would only earn every member a second, individual answer."""
    m = s.member
    if m.request is None or s.leader_id is None or s.leader_id == s.me:
        return float("inf")
    return m.sent_at + 2 * s.params.join_timeout


def formation_deadline(s: QuorumState, now: float) -> float:
    """The next instant after ``now`` at which ``on_timer`` has something to do.
    An expired window that could not form waits for joins or the next heartbeat
    tick (which refreshes the live set), not for a timer of its own."""
    deadline = _resend_at(s)
    pending = s.leadership.pending
    if s.role is Role.LEADER and pending is not None:
        deadline = min(deadline, witness.resend_at(s, pending))
    current = s.leadership.round
    if s.role is Role.LEADER and current is not None and current.formable_at is not None:
        closes = current.formable_at + s.params.join_timeout
        if closes > now:
            deadline = min(deadline, closes)
    return deadline
