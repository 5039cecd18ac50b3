"""The replica quorum's core: one voter's state machine, with no I/O.

``QuorumCore`` takes four inputs and returns what to do (``Send``, ``Deliver``,
``Fail``) and what to report (events): ``step`` for each authenticated message,
``tick`` once ``now`` reaches ``next_deadline()`` (the one timer path), and the
local replica's ``request`` and ``report_commit_failure``. As in etcd's raft, a
message passes one term rule, then the step function of the voter's role.

**Rounds.** The leader forms a quorum as soon as every replica it believes alive
has joined, or once the join window (``join_timeout``) closes with at least
``min_replicas``. The window opens when the joins could first make a quorum
(``Round.formable_at``), so a member that joined long before the others does not
close it on them. The quorum is announced once voters with a majority of the
votes stand behind it: its members and, when they are too few, the witnesses
that endorse it (``Pending``; README.md has the safety argument).

**Standing quorums** (``quorum.standing``). In steady state each round repeats
the last one a step further, so the leader grants its last quorum a few steps
ahead on its heartbeats (``Standing``) while nothing asks for a round, and a
member whose request continues it exactly answers itself: the same quorum one
step on, the same for every member. A member that joins for a step the grant
covers and cannot use it would leave the others waiting in that step's ring: the
leader ends the grant before that step and tells everyone (``StandingEnded``). A
grant dies with its leader. A standing answer forms no quorum: it continues one
a majority stood behind, and a step commits only in the ring of all its members.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from . import events as ev
from .delta import advance, answers, compact, expand, next_quorum_id
from .election import NEVER, UNSTAMPED, Action, Deliver, Election, Fail
from .model import (
    EndorseAnswered,
    EndorseRequested,
    Heartbeat,
    HeartbeatAcked,
    JoinRequested,
    Memory,
    Message,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
    QuorumParams,
    Role,
    Standing,
    VoteAnswered,
    VoteRequested,
)

#: Messages only a leader sends: one of a lower term is answered with ours.
_FROM_LEADER = (Heartbeat, QuorumAnnounced, QuorumDeltaAnnounced, EndorseRequested)


@dataclass
class Round:
    """Joins the leader has collected since the first of them (``opened_at``);
    ``formable_at``: when they could first make a quorum (the window opened)."""

    opened_at: float
    joins: dict[int, JoinRequested] = field(default_factory=dict)
    formable_at: float | None = None


@dataclass
class Pending:
    """A formed quorum whose members alone are short of a majority of the votes,
    waiting for the witnesses' endorsements before it is announced."""

    announce: QuorumAnnounced
    base: Quorum | None
    joined: dict[int, JoinRequested]
    opened_at: float
    asked_at: float
    granted: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)


@dataclass
class Leadership:
    """What only the leader keeps, dropped when it steps down."""

    live: frozenset[int]
    round: Round | None = None
    #: Highest join_seq answered per member: a late resend of an answered join
    #: must not linger in the next round as a member that is not waiting.
    answered_seq: dict[int, int] = field(default_factory=dict)
    last_announce: QuorumAnnounced | None = None
    #: Members sent an announcement since the last heartbeat tick: that was leader
    #: contact as recent as the tick's heartbeat, so while rounds run faster than
    #: ``heartbeat_interval`` they get none unless the suspects or the grant change.
    contacted: set[int] = field(default_factory=set)
    suspects_sent: tuple[int, ...] | None = None
    #: Each member's address from its joins of this term: a member whose last
    #: quorum this leader formed leaves it out of its next join.
    addresses: dict[int, str] = field(default_factory=dict)
    pending: Pending | None = None
    #: The grant for the last quorum, the one the last heartbeat carried, and this
    #: replica's own step at the last tick with the time and the pace.
    standing: Standing | None = None
    standing_sent: Standing | None = None
    step_clock: tuple[int, float, float] | None = None
    #: Members sent the grant again for a join that only missed it, by join_seq
    #: (the same join once more ends the grant: the member could not use it).
    granted_late: dict[int, int] = field(default_factory=dict)


@dataclass
class Membership:
    """The local replica's side: its outstanding request and last quorum."""

    request: JoinRequested | None = None
    sent_at: float = NEVER
    sent_to: int | None = None
    join_seq: int = 0
    commit_failed: bool = False
    last_quorum: Quorum | None = None
    #: The leader's grant for ``last_quorum``, heard since it came.
    standing: Standing | None = None
    #: The step of the last quorum a round answered (later ones came from the grant).
    round_step: int = -1


class QuorumCore(Election):
    """One voter of the quorum (see the module docstring). ``join_seq_base`` must
    grow across restarts of one replica (the shell uses its incarnation), so that
    a leader never takes a restarted member's fresh join for one it answered."""

    def __init__(self, me: int, voters: Iterable[int], params: QuorumParams, now: float, *,
                 seed: int = 0, join_seq_base: int = 0, electable: bool = True,
                 witnesses: Iterable[int] = ()) -> None:
        super().__init__(me, voters, params, now, seed=seed, electable=electable,
                         witnesses=witnesses)
        self.member = Membership(join_seq=join_seq_base)
        self.lead: Leadership | None = None
        #: The last quorum this replica formed as leader (it outlives the leadership).
        self.last_formed: Quorum | None = None
        #: At a witness: the members of the last round it endorsed or was told of.
        self.endorsed: frozenset[int] | None = None
        self._step_by_role = {Role.LEADER: self._step_leader,
                              Role.CANDIDATE: self._step_candidate,
                              Role.PRE_CANDIDATE: self._step_candidate,
                              Role.FOLLOWER: self._step_follower}

    # ------------------------------------------------------------------ inputs
    def step(self, sender: int, message: Message, now: float) -> list[Action]:
        """An authenticated message from a voter."""
        before = self._before()
        if sender != self.me and sender in self.voters:
            self.heard[sender] = now
            self._step(sender, message, now)
        return self._after(before, now)

    def tick(self, now: float) -> list[Action]:
        """Time has passed: whatever is due by ``now``."""
        before = self._before()
        if self.lead is not None:
            self._tick_leader(now)
        else:
            self._tick_election(now)
            m = self.member
            if m.request is not None and now >= self._resend_at():
                self._send_request(now)
        return self._after(before, now)

    def next_deadline(self, now: float) -> float:
        """When ``tick`` must run at the latest."""
        lead = self.lead
        if lead is None:
            return min(self._election_deadline(now), self._resend_at())
        deadline = self.heartbeat_due
        if lead.pending is not None:
            deadline = min(deadline, lead.pending.asked_at + self.params.join_timeout)
        if lead.round is not None and lead.round.formable_at is not None:
            closes = lead.round.formable_at + self.params.join_timeout
            if closes > now:
                deadline = min(deadline, closes)
        return deadline

    def request(self, next_step: int, address: str, now: float) -> list[Action]:
        """The local replica asks to join the quorum for ``next_step``."""
        before = self._before()
        m = self.member
        quorum = None if self.majority_lost else self._standing_answer(next_step, address, False)
        if self.majority_lost:
            self.out.append(Fail(self._reachable(now)))
        elif quorum is not None:
            self._deliver_standing(quorum)
        else:
            last = m.last_quorum.quorum_id if m.last_quorum is not None else 0
            m.join_seq += 1
            m.request = JoinRequested(self.term, next_step, address, last, m.join_seq,
                                      m.commit_failed)
            m.commit_failed, m.sent_to = False, None
            self._send_request(now, first=True)
        return self._after(before, now)

    def report_commit_failure(self, now: float) -> list[Action]:
        """The local replica's last commit failed: the next quorum gets a new id."""
        before = self._before()
        m = self.member
        if m.request is None:
            m.commit_failed = True
        else:
            # Already waiting: amend the bid under a new join_seq so that an answer
            # to the unamended bid (maybe already in flight) is not taken for it.
            m.join_seq += 1
            m.request = replace(m.request, commit_failed=True, join_seq=m.join_seq)
            m.sent_to = None
            self._send_request(now, first=True)
        return self._after(before, now)

    def memory(self) -> Memory:
        return Memory(self.term, self.voted_for, self.endorsed)

    def restore(self, memory: Memory) -> None:
        """A starting voter takes back what it remembered."""
        self.term, self.voted_for, self.endorsed = memory.term, memory.voted_for, memory.endorsed

    # ------------------------------------------------------------------ transitions
    def _before(self) -> tuple[int, int | None, bool, Standing | None]:
        return self.term, self.leader_id, self.majority_lost, self.member.standing

    def _after(self, before: tuple[int, int | None, bool, Standing | None],
               now: float) -> list[Action]:
        """Rules on what an input changed, then the actions it produced."""
        term, leader, lost, grant = before
        m = self.member
        if grant is not None and (self.term, self.leader_id) != (term, leader):
            # The grant goes with its leader. Members learn of the change at different
            # moments: one that learned first asks the new leader for a step the grant
            # covered while the others may wait for it in that step's ring. So each,
            # as it learns, leaves its own ring of any step after the last a round
            # answered (ended by itself), and asks the new leader's round for it.
            if m.standing == grant:
                m.standing = None
            if grant.ended_by is None:
                self.out.append(ev.StandingEnded(self.me, grant.quorum_id, m.round_step,
                                                 self.me, time=UNSTAMPED))
        if m.request is not None:
            if self.majority_lost and not lost:
                m.request = m.sent_to = None
                self.out.append(Fail(self._reachable(now)))
            elif self.leader_id is not None and m.sent_to != self.leader_id:
                self._send_request(now)  # a new leader: the bid goes to it
        out, self.out = self.out, []
        return out

    def _leadership_began(self, now: float) -> None:
        self.lead = Leadership(live=self.fresh(now))
        self._tick_leader(now)  # heartbeats at once: the lease starts now

    def _leadership_ended(self) -> None:
        self.lead = None

    def _reachable(self, now: float) -> tuple[int, ...]:
        return tuple(sorted(self.fresh(now, self.majority_window())))

    # ------------------------------------------------------------------ role dispatch
    def _step(self, sender: int, msg: Message, now: float) -> None:
        if msg.term > self.term and not self._keeps_term(msg, now):
            self._become_follower(msg.term, None, now)
        if msg.term < self.term:
            if isinstance(msg, _FROM_LEADER):
                self._send(sender, HeartbeatAcked(self.term))  # a deposed leader learns
            elif isinstance(msg, VoteRequested):
                self._send(sender, VoteAnswered(self.term, False, msg.pre_vote))
        elif isinstance(msg, VoteRequested):
            self._on_vote_requested(sender, msg, now)
        else:
            self._step_by_role[self.role](sender, msg, now)

    def _keeps_term(self, msg: Message, now: float) -> bool:
        """A higher term that does not depose: a pre-vote (or a vote inside the
        lease) asks, and a granted pre-vote echoes the term we would run in."""
        if isinstance(msg, VoteRequested):
            return msg.pre_vote or self.in_lease(now)
        return isinstance(msg, VoteAnswered) and msg.pre_vote and msg.granted

    def _step_leader(self, sender: int, msg: Message, now: float) -> None:
        # Heartbeat acks only refresh ``heard``; no other leader shares this term.
        if isinstance(msg, JoinRequested):
            self._on_join(sender, msg, now)
        elif isinstance(msg, EndorseAnswered):
            self._on_endorse_answered(sender, msg, now)

    def _step_candidate(self, sender: int, msg: Message, now: float) -> None:
        if isinstance(msg, VoteAnswered):
            self._on_vote_answered(sender, msg, now)
        else:
            self._step_follower(sender, msg, now)

    def _step_follower(self, sender: int, msg: Message, now: float) -> None:
        # Joins go to whoever the member learns leads; acks and endorsements to leaders.
        if not isinstance(msg, _FROM_LEADER):
            return
        new_leader = self.leader_id != sender
        self._become_follower(msg.term, sender, now)
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(sender, msg, now, new_leader)
            self._on_grant(msg.standing, now)
        elif isinstance(msg, QuorumAnnounced):
            self._on_announce(msg)
        elif isinstance(msg, QuorumDeltaAnnounced):
            self._on_delta(msg, now)
        else:
            self._on_endorse_requested(sender, msg)

    def _tick_leader(self, now: float) -> None:
        if now >= self.heartbeat_due:
            self._heartbeat(now)
        lead = self.lead
        if lead is None:
            return  # stepped down
        pending = lead.pending
        if pending is not None and now >= pending.asked_at + self.params.join_timeout:
            # Ask again the witnesses that have not answered (a lost message, or a
            # witness that was away).
            pending.asked_at = now
            waiting = self.witnesses - pending.granted - pending.refused
            if waiting:
                self._tell_witnesses(pending.announce.quorum, True, tuple(sorted(waiting)))
        if lead.round is not None:
            self._try_form(now)

    def _heartbeat(self, now: float) -> None:
        """Heartbeat everyone, refresh the live set, step down without a majority."""
        lead = self.lead
        assert lead is not None
        fresh = self.fresh(now)
        if now - self.leader_seen_at >= self.params.member_timeout \
                and self.weight_of(fresh) < self.majority:
            self._step_down(fresh, now)
            return
        lost, recovered = sorted(lead.live - fresh), sorted(fresh - lead.live)
        if lost or recovered:
            self.out.append(ev.MembersLivenessChanged(self.me, lost, recovered,
                                                      time=UNSTAMPED))
        suspects = tuple(sorted(self.voters - fresh))
        self._extend_grant(fresh, now)
        to = self.others
        if (suspects, lead.standing) == (lead.suspects_sent, lead.standing_sent):
            to = tuple(p for p in to if p not in lead.contacted)
        if to:
            self._send(to, Heartbeat(self.term, suspects, lead.standing))
        self.heartbeat_due = now + self.params.heartbeat_interval
        lead.live, lead.contacted = fresh, set()
        lead.suspects_sent, lead.standing_sent = suspects, lead.standing

    # ------------------------------------------------------------------ leader: rounds
    def _on_join(self, sender: int, join: JoinRequested, now: float) -> None:
        lead = self.lead
        assert lead is not None
        if join.join_seq <= lead.answered_seq.get(sender, -1):
            # A re-sent join already answered: the answer was probably lost.
            last = lead.last_announce
            if last is not None and last.answered.get(sender) == join.join_seq \
                    and sender != self.me:
                self._send(sender, last)
            return
        known = lead.addresses.get(sender)
        if not join.address:
            if known is None:
                return  # cannot happen by the member's rule; its resend is in full
            join = replace(join, address=known)
        lead.addresses[sender] = join.address
        if self._standing_join(sender, join):
            return
        current = lead.round = lead.round or Round(now)
        current.joins[sender] = join
        # The cheap tests first; ``_try_form`` runs once the count can match every
        # live replica, the window may open, or it has closed.
        count = len(current.joins)
        if count >= len(lead.live - self.witnesses) or (
                count >= self._joins_needed() if current.formable_at is None
                else now >= current.formable_at + self.params.join_timeout):
            self._try_form(now)

    def _joins_needed(self) -> int:
        """The fewest joins that can make a quorum: ``min_replicas``, and with every
        witness's votes a majority."""
        return max(self.params.min_replicas, self.majority - self.weight_of(self.witnesses))

    def _try_form(self, now: float) -> None:
        lead = self.lead
        assert lead is not None
        current = lead.round
        if current is None or lead.pending is not None:
            return
        live = lead.live - self.witnesses
        everyone = len(current.joins) >= len(live) and live <= current.joins.keys()
        opened = current.formable_at
        if not everyone and opened is not None and now < opened + self.params.join_timeout:
            return  # the window is open: wait for the live members
        horizon = now - self.params.member_timeout
        joined = {m: j for m, j in current.joins.items()
                  if m == self.me or self.heard.get(m, NEVER) > horizon}
        if len(joined) < self._joins_needed():
            # Not (or no longer: a member fell silent) enough: the window opens
            # again when there are.
            current.formable_at = None
        elif not everyone and opened is None and self.params.join_timeout > 0:
            current.formable_at = now  # the window opens
        else:
            self._form(joined, now)

    def _form(self, joined: dict[int, JoinRequested], now: float) -> None:
        lead = self.lead
        assert lead is not None and lead.round is not None
        members = tuple(QuorumMember(m, j.next_step, j.address) for m, j in sorted(joined.items()))
        base = max((q for q in (self.last_formed, self.member.last_quorum) if q is not None),
                   key=lambda q: q.quorum_id, default=None)
        quorum_id = next_quorum_id(base, members, joined.values(), self.term)
        quorum = Quorum.of(quorum_id, members, term=self.term, leader_id=self.me)
        announce = QuorumAnnounced(self.term, quorum, {m: j.join_seq for m, j in joined.items()})
        pending = Pending(announce, base, joined, lead.round.opened_at, now)
        lead.round = None
        if len(members) >= self.majority or not self.witnesses:
            # The members alone are a majority: the witnesses only hear of the round.
            self._publish(pending, now)
            self._tell_witnesses(quorum, False)
        else:
            lead.pending = pending
            self._tell_witnesses(quorum, True)

    def _publish(self, pending: Pending, now: float) -> None:
        """Announce a formed quorum that a majority of the votes stands behind."""
        lead = self.lead
        assert lead is not None
        announce, joined, base = pending.announce, pending.joined, pending.base
        quorum = announce.quorum
        lead.answered_seq.update(announce.answered)
        recipients = tuple(m for m in sorted(joined) if m != self.me)
        lead.pending, lead.last_announce, lead.standing = None, announce, None
        lead.contacted.update(recipients)
        self.last_formed = quorum
        self.out.append(ev.QuorumFormed(self.me, quorum_id=quorum.quorum_id,
                                        members=list(quorum.replica_ids),
                                        max_step=quorum.max_step, behind=list(quorum.behind),
                                        term=quorum.term, window_s=now - pending.opened_at,
                                        time=UNSTAMPED))
        # The compact form to the recipients holding the base, the full one to the others.
        delta = compact(announce, base) if base is not None and recipients else None
        holding = tuple(m for m in recipients
                        if delta is not None and joined[m].last_quorum_id == base.quorum_id)  # type: ignore[union-attr]
        rest = tuple(m for m in recipients if m not in holding)
        if holding:
            self._send(holding, delta)  # type: ignore[arg-type]
        if rest:
            self._send(rest, announce)
        if self.me in joined:
            self._on_announce(announce)
        if lead.round is not None:  # joins that came in while it waited
            self._try_form(now)

    # ------------------------------------------------------------------ witnesses
    def _tell_witnesses(self, quorum: Quorum, required: bool,
                        to: tuple[int, ...] | None = None) -> None:
        if self.witnesses:
            self._send(to or tuple(sorted(self.witnesses)), EndorseRequested(
                self.term, quorum.max_step, quorum.quorum_id, quorum.replica_ids, required))

    def _on_endorse_requested(self, sender: int, msg: EndorseRequested) -> None:
        """At a witness, from the leader of its term: endorse a quorum continuous
        with the last round it knows (sharing a replica with it), and remember it."""
        if self.me not in self.witnesses:
            return
        members = frozenset(msg.members)
        continuous = self.endorsed is None or not self.endorsed.isdisjoint(members)
        if msg.required and not continuous:
            self._send(sender, EndorseAnswered(self.term, msg.quorum_id, False))
            return
        self.endorsed = members
        if msg.required:
            self._send(sender, EndorseAnswered(self.term, msg.quorum_id, True))

    def _on_endorse_answered(self, sender: int, msg: EndorseAnswered, now: float) -> None:
        """Announce once a majority stands behind the quorum; give it up once
        refusals make that impossible (its members ask again, a new round forms)."""
        lead = self.lead
        assert lead is not None
        pending = lead.pending
        if sender not in self.witnesses or pending is None \
                or msg.quorum_id != pending.announce.quorum.quorum_id:
            return
        (pending.granted if msg.granted else pending.refused).add(sender)
        votes = self.weight_of(pending.announce.quorum.replica_ids) + \
            self.weight_of(pending.granted)
        undecided = self.weight_of(self.witnesses - pending.granted - pending.refused)
        if votes >= self.majority:
            self._publish(pending, now)
        elif votes + undecided < self.majority:
            lead.pending = None

    # ------------------------------------------------------------------ member side
    def _send_request(self, now: float, *, first: bool = False) -> None:
        """Send the bid to the leader. Its first send leaves out an address the
        leader already has (kilobytes when a replica advertises its ranks'
        endpoints, a thousand times a round); resends carry it."""
        m, leader = self.member, self.leader_id
        if m.request is None or leader is None:
            return
        if m.request.term != self.term:
            m.request = replace(m.request, term=self.term)
        m.sent_to, m.sent_at = leader, now
        if leader == self.me:
            self._on_join(self.me, m.request, now)
            return
        # The leader marks a joiner heard, all that an ack does: none is due for
        # ack_interval (a thousand fewer messages to the leader while rounds run).
        self.acked_at = now
        join = m.request
        if first and self._leader_has_address(join):
            join = replace(join, address="")
        self._send(leader, join)

    def _leader_has_address(self, join: JoinRequested) -> bool:
        """Our last quorum was formed by the current leader in this term with our
        address as it is now: the leader took that address from a join of ours in
        this term and keeps it (``Leadership.addresses``) until the term ends."""
        last = self.member.last_quorum
        if last is None or (last.term, last.leader_id) != (self.term, self.leader_id):
            return False
        index = last.index_of.get(self.me)
        return index is not None and last.members[index].address == join.address

    def _resend_at(self) -> float:
        """Two join windows after the last send: after one, a leader waiting for a
        dead member closes its window and answers, and a resend at that instant
        would only earn every member a second, individual answer."""
        m = self.member
        if m.request is None or self.leader_id is None or self.leader_id == self.me:
            return math.inf
        return m.sent_at + 2 * self.params.join_timeout

    def _on_announce(self, announce: QuorumAnnounced) -> None:
        request = self.member.request
        if request is not None and announce.answered.get(self.me) == request.join_seq:
            self._deliver(announce.quorum)

    def _on_delta(self, delta: QuorumDeltaAnnounced, now: float) -> None:
        """Expand a compact answer on the last quorum, or ask again for the full
        one if the roster held is not the one it refers to."""
        m = self.member
        if m.request is None:
            return
        if m.last_quorum is None or m.last_quorum.digest != delta.digest:
            self._send_request(now)
            return
        quorum = expand(delta, m.last_quorum)
        if answers(delta, quorum, self.me, m.request.join_seq):
            self._deliver(quorum)

    def _deliver(self, quorum: Quorum) -> None:
        m = self.member
        self.member = Membership(join_seq=m.join_seq, commit_failed=m.commit_failed,
                                 last_quorum=quorum, round_step=quorum.max_step)
        self.out.append(Deliver(quorum))

    # ------------------------------------------------------------------ standing quorums
    def _standing_answer(self, next_step: int, address: str,
                         commit_failed: bool) -> Quorum | None:
        """The standing quorum for this request, or None when it needs a round."""
        m = self.member
        grant, last = m.standing, m.last_quorum
        if grant is None or last is None or commit_failed or m.commit_failed \
                or grant.quorum_id != last.quorum_id or next_step != last.max_step + 1 \
                or next_step > grant.through:
            return None
        if self.leader_id is None or (last.term, last.leader_id) != (self.term, self.leader_id):
            return None  # another leader, or none: its rounds decide
        if self.lead is None and not self.suspects.isdisjoint(last.replica_ids):
            return None  # a member its leader finds silent: the round goes on without it
        index = last.index_of.get(self.me)
        if index is None or last.members[index].address != address:
            return None
        return advance(last, next_step)

    def _deliver_standing(self, quorum: Quorum) -> None:
        """Answer the request with the standing quorum; the grant stays."""
        m = self.member
        m.request, m.sent_to, m.last_quorum = None, None, quorum
        self.out.append(Deliver(quorum))

    def _on_grant(self, grant: Standing | None, now: float) -> None:
        """Our leader's heartbeat: keep its grant if it is for our last quorum (none:
        revoked), and answer a join sent on a stale grant if this one covers it."""
        m = self.member
        if grant is None:
            m.standing = None
            return
        if m.last_quorum is None or grant.quorum_id != m.last_quorum.quorum_id \
                or not self.params.standing:
            return
        if m.standing != grant:
            m.standing = grant
            if grant.ended_by is not None:
                self.out.append(ev.StandingEnded(self.me, grant.quorum_id, grant.through,
                                                 grant.ended_by, time=UNSTAMPED))
        request = m.request
        if request is None:
            return
        quorum = self._standing_answer(request.next_step, request.address, request.commit_failed)
        if quorum is not None:
            self._deliver_standing(quorum)
        elif grant.ended_by is None and request.next_step <= grant.through \
                and self.leader_id not in (None, self.me):
            # The grant covers this join yet does not answer it here (the leader may
            # have sent it for this join): the same join again tells the leader to
            # end the grant, or the others may wait for this member.
            self._send(self.leader_id, request)  # type: ignore[arg-type]

    def _horizon(self) -> float:
        """How far ahead, in time, the leader grants."""
        return min(3 * self.params.heartbeat_interval, self.params.join_timeout / 2)

    def _extend_grant(self, fresh: frozenset[int], now: float) -> None:
        """The leader's grant at a heartbeat tick: grown while nothing asks for a
        round, kept otherwise, revoked once a member falls silent (nobody may step
        with it again). It grants the steps it makes in the horizon at the pace of
        its last ones; none below one step (a round costs nothing beside slow steps)."""
        lead, own = self.lead, self.member.last_quorum
        assert lead is not None
        if not self.params.standing or own is None:
            return
        step, clock = own.max_step, lead.step_clock
        if clock is None or step < clock[0]:
            clock = (step, now, 0.0)
        elif step > clock[0]:
            clock = (step, now, (step - clock[0]) / max(now - clock[1], 1e-9))
        lead.step_clock = clock
        all_live = fresh.issuperset(own.replica_ids)
        grant = lead.standing if all_live else None
        ahead = math.floor(clock[2] * self._horizon())
        formed = self.last_formed
        steady = (formed is not None and formed.quorum_id == own.quorum_id
                  and (formed.term, formed.leader_id) == (self.term, self.me)
                  and own.includes(self.me) and lead.pending is None
                  and (lead.round is None or not lead.round.joins))
        if ahead >= 1 and all_live and steady and (grant is None or step + ahead > grant.through):
            grant = Standing(own.quorum_id, step + ahead)
        lead.standing = self.member.standing = grant  # the leader answers itself by it too

    def _standing_join(self, sender: int, join: JoinRequested) -> bool:
        """A join from a member of the standing quorum for a step the grant covers:
        the others may be in that step's all-reduce waiting for it. If it only
        missed the grant (a heartbeat late) it is sent the grant at once and answers
        itself by it (True: the round leaves it out). Otherwise the grant ends before
        that step and every member is told at once; the step is retried in a round."""
        lead = self.lead
        assert lead is not None
        grant, own = lead.standing, self.member.last_quorum
        if grant is None or grant.ended_by is not None or own is None \
                or not own.includes(sender) or join.next_step > grant.through:
            return False
        mine = own.members[own.index_of[sender]]
        if sender != self.me and lead.granted_late.get(sender) != join.join_seq \
                and join.last_quorum_id == grant.quorum_id and not join.commit_failed \
                and join.address == mine.address:
            lead.granted_late[sender] = join.join_seq
            if lead.round is not None:
                lead.round.joins.pop(sender, None)
            self._send(sender, Heartbeat(self.term, lead.suspects_sent or (), grant))
            return True
        ended = Standing(grant.quorum_id, join.next_step - 1, sender)
        self.member.standing = lead.standing = lead.standing_sent = ended
        lead.granted_late = {}
        self._send(self.others, Heartbeat(self.term, lead.suspects_sent or (), ended))
        self.out.append(ev.StandingEnded(self.me, ended.quorum_id, ended.through, sender,
                                         time=UNSTAMPED))
        return False
