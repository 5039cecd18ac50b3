"""Leader election: Raft's rules (terms, one vote per term, randomised timeouts,
heartbeats), without a log, plus three refinements from the Raft thesis / etcd:

* **pre-vote**: a member first asks whether it *could* win before raising its
  term, so a member cut off for a while does not come back with a huge term and
  depose a healthy leader;
* **leader lease**: a follower that heard from its leader within
  ``election_timeout`` refuses (pre-)votes, and a leader refuses them always;
* **check-quorum**: a leader that has not heard from a majority within
  ``member_timeout`` steps down and says the majority is lost.

All functions are pure: ``(state, ..., now) -> (state, actions)``.
"""

from __future__ import annotations

import math

from . import standing
from .model import Heartbeat, HeartbeatAcked, Role, TimeoutNow, VoteAnswered, VoteRequested, evolve
from .state import (
    Action,
    Election,
    Leadership,
    NotifyLeaderElected,
    NotifyLeadershipLost,
    NotifyLivenessChanged,
    NotifyMajorityLost,
    NotifyMajorityRegained,
    QuorumState,
    Send,
)

Outcome = tuple[QuorumState, list[Action]]

_MASK = (1 << 64) - 1
_NO_VOTES: frozenset[int] = frozenset()


def unit_draw(seed: int, me: int, draw: int) -> float:
    """A reproducible number in [0, 1) (splitmix64), so that ``decide`` stays a
    pure function and tests can replay the exact election timeouts."""
    z = (seed * 0x9E3779B97F4A7C15 + me * 0xD1B54A32D192ED03 + draw + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def reset_timer(s: QuorumState, now: float) -> QuorumState:
    """Arm the election timer at ``now + timeout + spread * U[0, 1)``."""
    return evolve(s, election=evolve(s.election, **_timer(s, s.election, now)))


def _timer(s: QuorumState, e: Election, now: float) -> dict[str, float | int]:
    """The fields of ``e`` that ``reset_timer`` sets, for callers that change
    others in the same copy (every follower does on every announcement)."""
    jitter = s.params.election_spread * unit_draw(s.seed, s.me, e.draws)
    return {"deadline": now + s.params.election_timeout + jitter, "draws": e.draws + 1,
            "jitter": jitter}


def majority_window(s: QuorumState) -> float:
    """How long without a leader, and how far back to look for signs of life,
    before saying the majority is lost: every reachable member runs at least
    one (pre-)vote round within ``election_timeout + election_spread``."""
    p = s.params
    return max(p.member_timeout, p.election_timeout + p.election_spread)


def in_lease(s: QuorumState, now: float) -> bool:
    e = s.election
    if e.role is Role.LEADER:
        return True
    return e.leader_id is not None and now - e.leader_seen_at < s.params.election_timeout


def adopt_term(s: QuorumState, term: int, now: float) -> Outcome:
    """A higher term was seen: become a follower of an unknown leader in it."""
    e = s.election
    if term <= e.term:
        return s, []
    actions: list[Action] = []
    leadership = s.leadership
    if e.role is Role.LEADER:
        actions.append(NotifyLeadershipLost(e.term, f"saw the higher term {term}"))
        leadership = Leadership(last_formed=leadership.last_formed)
    previous = e.leader_id if e.leader_id is not None else e.previous_leader
    election = evolve(e, role=Role.FOLLOWER, term=term, voted_for=None, votes=frozenset(),
                       leader_id=None, previous_leader=previous)
    s = evolve(s, election=election, leadership=leadership)
    if e.role is Role.LEADER:
        s = reset_timer(s, now)  # a leader kept no election timer
    return s, actions


# --------------------------------------------------------------------------- votes


def on_vote_requested(s: QuorumState, sender: int, msg: VoteRequested, now: float) -> Outcome:
    e = s.election
    if in_lease(s, now) and not msg.transfer:
        return s, [Send((sender,), VoteAnswered(e.term, False, msg.pre_vote))]
    if msg.pre_vote:
        # Nothing changes on a pre-vote except our own timer: a member that just
        # saw someone campaign holds back rather than start a competing round.
        if msg.term > e.term:
            return reset_timer(s, now), [Send((sender,), VoteAnswered(msg.term, True, True))]
        return s, [Send((sender,), VoteAnswered(e.term, False, True))]
    s, actions = adopt_term(s, msg.term, now)
    e = s.election
    if msg.term == e.term and e.voted_for in (None, sender):
        s = reset_timer(evolve(s, election=evolve(e, voted_for=sender)), now)
        return s, actions + [Send((sender,), VoteAnswered(e.term, True, False))]
    return s, actions + [Send((sender,), VoteAnswered(e.term, False, False))]


def on_vote_answered(s: QuorumState, sender: int, msg: VoteAnswered, now: float) -> Outcome:
    actions: list[Action] = []
    if not (msg.granted and msg.pre_vote):
        # A granted pre-vote echoes the term we would run in; anything else in a
        # higher term means we are behind.
        s, actions = adopt_term(s, msg.term, now)
    e = s.election
    if not msg.granted:
        return s, actions
    if msg.pre_vote and e.role is Role.PRE_CANDIDATE and msg.term == e.term + 1:
        s = evolve(s, election=evolve(e, votes=e.votes | {sender}))
        if s.weight_of(s.election.votes) >= s.majority:
            s, more = start_candidacy(s, now)
            actions += more
    elif not msg.pre_vote and e.role is Role.CANDIDATE and msg.term == e.term:
        s = evolve(s, election=evolve(e, votes=e.votes | {sender}))
        if s.weight_of(s.election.votes) >= s.majority:
            s, more = become_leader(s, now)
            actions += more
    return s, actions


def start_pre_vote(s: QuorumState, now: float) -> Outcome:
    e = s.election
    previous = e.leader_id if e.leader_id is not None else e.previous_leader
    s = reset_timer(evolve(s, election=evolve(
        e, role=Role.PRE_CANDIDATE, votes=frozenset({s.me}), leader_id=None,
        previous_leader=previous)), now)
    if s.weight_of(s.election.votes) >= s.majority:
        return start_candidacy(s, now)
    return s, [Send(s.others, VoteRequested(e.term + 1, pre_vote=True))]


def start_candidacy(s: QuorumState, now: float, *, transfer: bool = False) -> Outcome:
    e = s.election
    term = e.term + 1
    previous = e.leader_id if e.leader_id is not None else e.previous_leader
    s = reset_timer(evolve(s, election=evolve(
        e, role=Role.CANDIDATE, term=term, voted_for=s.me, votes=frozenset({s.me}),
        leader_id=None, previous_leader=previous)), now)
    if s.weight_of(s.election.votes) >= s.majority:
        return become_leader(s, now)
    return s, [Send(s.others, VoteRequested(term, pre_vote=False, transfer=transfer))]


def transfer_leadership(s: QuorumState, target: int) -> Outcome:
    """Raft's leadership transfer: the target campaigns at once, and voters set
    their leases aside for it, so the hand-over costs one vote round."""
    if s.role is not Role.LEADER or target == s.me or target not in s.voters:
        return s, []
    return s, [Send((target,), TimeoutNow(s.term))]


def on_timeout_now(s: QuorumState, sender: int, msg: TimeoutNow, now: float) -> Outcome:
    e = s.election
    if msg.term != e.term or e.leader_id != sender or e.role is Role.LEADER \
            or not s.electable:
        return s, []
    # The outgoing leader stays alive and is presumed so by the new one.
    s = evolve(s, election=evolve(e, leader_id=None, previous_leader=None))
    return start_candidacy(s, now, transfer=True)


def become_leader(s: QuorumState, now: float) -> Outcome:
    e = s.election
    actions: list[Action] = [NotifyLeaderElected(e.term, s.me)]
    if e.majority_lost:
        actions.append(NotifyMajorityRegained(s.me))
    # Presume alive every member not already suspected and not the leader whose
    # silence caused this election, so a full round forms at once instead of
    # waiting out the join window for members we merely have not heard lately.
    presumed = s.voters - e.suspects - {s.me}
    heard = dict(s.heard)
    if e.previous_leader is not None:
        # Its heartbeats are recent but it fell silent: alive only if heard again.
        presumed -= {e.previous_leader}
        heard.pop(e.previous_leader, None)
    for member in presumed:
        heard[member] = now
    election = evolve(e, role=Role.LEADER, leader_id=s.me, leader_seen_at=now,
                       had_leader=True, votes=frozenset(), heartbeat_due=now,
                       majority_lost=False)
    s = evolve(s, election=election, heard=heard)
    leadership = Leadership(live=s.fresh(now), last_formed=s.leadership.last_formed)
    if e.previous_leader is not None and e.previous_leader not in leadership.live:
        # Its followers learn it from this leader's suspects; its own replica here.
        actions.append(NotifyLivenessChanged((e.previous_leader,), ()))
    return evolve(s, leadership=leadership), actions


# --------------------------------------------------------------------------- leader contact


def on_leader_contact(s: QuorumState, sender: int, term: int, now: float) -> Outcome:
    """A heartbeat or announcement from ``sender``; stale leaders are told our term."""
    if term < s.election.term:
        return s, [Send((sender,), HeartbeatAcked(s.election.term))]
    s, actions = adopt_term(s, term, now)
    e = s.election
    if e.leader_id != sender:
        actions.append(NotifyLeaderElected(term, sender))
    if e.majority_lost:
        actions.append(NotifyMajorityRegained(sender))
    # The same leader again (every announcement): re-arm with the timeout drawn when
    # it was first heard. The members' draws still differ, so they still time out
    # apart once it falls silent (etcd draws on becoming a follower, not per
    # heartbeat, too).
    timer = ({"deadline": now + s.params.election_timeout + e.jitter}
             if e.leader_id == sender and e.role is Role.FOLLOWER else _timer(s, e, now))
    election = evolve(e, role=Role.FOLLOWER, leader_id=sender, leader_seen_at=now,
                      had_leader=True, votes=_NO_VOTES, majority_lost=False, **timer)
    return evolve(s, election=election), actions


def on_heartbeat(s: QuorumState, sender: int, msg: Heartbeat, now: float) -> Outcome:
    new_leader = s.election.leader_id != sender
    s, actions = on_leader_contact(s, sender, msg.term, now)
    e = s.election
    if e.leader_id != sender:
        return s, actions  # stale heartbeat, already answered with our term
    suspects = frozenset(msg.suspects)
    if suspects != e.suspects:
        # Followers learn of a lost member from the leader's heartbeats: a replica
        # in an all-reduce with it stops waiting for it (worker ``Manager``).
        actions.append(NotifyLivenessChanged(tuple(sorted(suspects - e.suspects)),
                                             tuple(sorted(e.suspects - suspects))))
    election = evolve(e, suspects=suspects)
    if new_leader or now - e.acked_at >= s.params.ack_interval:
        election = evolve(election, acked_at=now)
        actions.append(Send((sender,), HeartbeatAcked(e.term)))
    s = evolve(s, election=election)
    s, more = standing.on_grant(s, msg.standing)
    return s, actions + more


# --------------------------------------------------------------------------- timers


def on_timer(s: QuorumState, now: float) -> Outcome:
    e = s.election
    if e.role is Role.LEADER:
        if now >= e.heartbeat_due:
            return leader_tick(s, now)
        return s, []
    actions: list[Action] = []
    if now >= e.deadline and s.electable:
        s, actions = start_pre_vote(s, now)
    s, more = check_majority(s, now)
    return s, actions + more


def leader_tick(s: QuorumState, now: float) -> Outcome:
    """Heartbeat everyone, refresh the live set, step down without a majority."""
    e = s.election
    fresh = s.fresh(now)
    if now - e.leader_seen_at >= s.params.member_timeout and s.weight_of(fresh) < s.majority:
        return step_down_without_majority(s, fresh, now)
    actions: list[Action] = []
    lost = tuple(sorted(s.leadership.live - fresh))
    recovered = tuple(sorted(fresh - s.leadership.live))
    if lost or recovered:
        actions.append(NotifyLivenessChanged(lost, recovered))
    suspects = tuple(sorted(s.voters - fresh))
    s = standing.extend(s, fresh, now)
    lead = s.leadership
    grant = lead.standing
    to = s.others
    if suspects == lead.suspects_sent and grant == lead.standing_sent:
        to = tuple(p for p in to if p not in lead.contacted)
    if to:
        actions.append(Send(to, Heartbeat(e.term, suspects, grant)))
    election = evolve(e, heartbeat_due=now + s.params.heartbeat_interval)
    leadership = evolve(lead, live=fresh, contacted=frozenset(), suspects_sent=suspects,
                        standing_sent=grant)
    return evolve(s, election=election, leadership=leadership), actions


def step_down_without_majority(s: QuorumState, fresh: frozenset[int], now: float) -> Outcome:
    e = s.election
    reachable = tuple(sorted(fresh))
    election = evolve(e, role=Role.FOLLOWER, leader_id=None, majority_lost=True,
                       previous_leader=None)
    s = evolve(s, election=election, leadership=Leadership(
        last_formed=s.leadership.last_formed))
    reason = (f"heard from voters with {s.weight_of(fresh)} of {s.total_weight} votes "
              f"within member_timeout, a majority needs {s.majority}")
    return reset_timer(s, now), [NotifyLeadershipLost(e.term, reason),
                                 NotifyMajorityLost(reachable)]


def check_majority(s: QuorumState, now: float) -> Outcome:
    """A member without a leader for ``majority_window`` that has heard from fewer
    than a majority in that window is cut off (or the majority is dead)."""
    e = s.election
    window = majority_window(s)
    if e.majority_lost or not e.had_leader or e.leader_id is not None:
        return s, []
    if now - e.leader_seen_at < window:
        return s, []
    horizon = now - window
    reachable = frozenset(p for p, t in s.heard.items() if t > horizon and p in s.voters)
    reachable |= {s.me}
    if s.weight_of(reachable) >= s.majority:
        return s, []
    s = evolve(s, election=evolve(e, majority_lost=True))
    return s, [NotifyMajorityLost(tuple(sorted(reachable)))]


def election_deadline(s: QuorumState, now: float) -> float:
    """The next instant after ``now`` at which ``on_timer`` has something to do."""
    e = s.election
    if e.role is Role.LEADER:
        return e.heartbeat_due
    deadline = e.deadline if s.electable else math.inf
    if e.had_leader and e.leader_id is None and not e.majority_lost:
        check_at = e.leader_seen_at + majority_window(s)
        # Past the window the answer depends on who we hear from: look again
        # every heartbeat interval rather than only when our own timer fires.
        deadline = min(deadline, check_at if check_at > now
                       else now + s.params.heartbeat_interval)
    return deadline
