"""The pure core of the replica quorum: ``decide(state, event, now) -> (state, actions)``.

It joins leader election (``election``) and quorum formation (``formation``):
messages are routed to either, timers are checked after every event, and a few
cross-cutting rules react to what changed (a new leader gets the outstanding
join; losing the majority fails it). No sockets, clocks or randomness here: the
shell passes ``now`` and a seed, and performs the returned actions.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import election, formation, standing, witness
from .model import (
    EndorseAnswered,
    EndorseRequested,
    Heartbeat,
    HeartbeatAcked,
    JoinFailure,
    JoinRequested,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumParams,
    Role,
    TimeoutNow,
    VoteAnswered,
    VoteRequested,
    evolve,
    voter_weights,
)
from .pmap import with_item
from .state import (
    NEVER,
    Action,
    CommitFailureReported,
    FailQuorumRequest,
    Input,
    LeadershipTransferRequested,
    Membership,
    MessageReceived,
    MessagesReceived,
    QuorumRequested,
    QuorumState,
)

Outcome = tuple[QuorumState, list[Action]]

_HEARD_RESOLUTION = 0.05


def initial_state(me: int, voters: Iterable[int], params: QuorumParams, now: float, *,
                  seed: int = 0, join_seq_base: int = 0, electable: bool = True,
                  witnesses: Iterable[int] = ()) -> QuorumState:
    """A follower with an armed election timer. ``witnesses``: the voters among
    ``voters`` that never train (a witness never campaigns).

    ``join_seq_base`` should grow across restarts of the same replica (the
    shell uses its incarnation), so that a leader never mistakes a restarted
    member's fresh join for a duplicate of one it already answered.
    """
    voter_set = frozenset(voters) | {me}
    witness_set = frozenset(witnesses) & voter_set
    weights = voter_weights(voter_set - witness_set, witness_set)
    state = QuorumState(me=me, voters=voter_set, params=params, seed=seed, started_at=now,
                        electable=electable and me not in witness_set,
                        member=Membership(join_seq=join_seq_base), witnesses=witness_set,
                        witness_weights={w: weights[w] for w in witness_set})
    if len(voter_set) == 1:
        # Alone: nobody to wait for, take office at the first timer.
        return evolve(state, election=evolve(state.election, deadline=now))
    return election.reset_timer(state, now)


def decide(state: QuorumState, event: Input, now: float) -> Outcome:
    before = state
    if isinstance(event, MessageReceived):
        state, actions = _on_message(state, event.sender, event.message, now,
                                     from_feed=event.from_feed)
    elif isinstance(event, MessagesReceived):
        state, actions = _on_messages(state, event.messages, now)
    elif isinstance(event, QuorumRequested):
        state, actions = _on_request(state, event, now)
    elif isinstance(event, CommitFailureReported):
        state, actions = formation.report_commit_failure(state, now)
    elif isinstance(event, LeadershipTransferRequested):
        state, actions = election.transfer_leadership(state, event.target)
    else:
        actions = []
    if _timers_due(state, now):
        state, more = _on_time(state, now)
        actions += more
    state, more = _follow_transitions(before, state, now)
    return state, actions + more


#: ``next_deadline``'s last answer: ``decide`` asks it of the state it returns
#: (``_timers_due``, most followers' events) and the shell asks again to
#: schedule the timer. A pure function's memo, by identity of its arguments.
_last_deadline: tuple[QuorumState | None, float, float] = (None, 0.0, 0.0)


def next_deadline(state: QuorumState, now: float) -> float:
    """When the shell must call ``decide`` with ``TimerFired`` at the latest."""
    global _last_deadline
    last_state, last_now, deadline = _last_deadline
    if last_state is state and last_now == now:
        return deadline
    deadline = min(election.election_deadline(state, now),
                   formation.formation_deadline(state, now))
    _last_deadline = (state, now, deadline)  # one assignment: safe beside other loops
    return deadline


def _on_request(s: QuorumState, request: QuorumRequested, now: float) -> Outcome:
    if s.election.majority_lost:
        return s, [FailQuorumRequest(JoinFailure.MAJORITY_LOST, _reachable(s, now))]
    return formation.request_quorum(s, request, now)


def _on_messages(s: QuorumState, messages: Iterable[MessageReceived], now: float) -> Outcome:
    """Messages in order, as many ``_on_message`` would take them; a leader
    takes each run of joins of its term as one batch (``formation.on_joins``)."""
    actions: list[Action] = []
    run: list[MessageReceived] = []
    for received in messages:
        message = received.message
        if type(message) is JoinRequested and message.term <= s.election.term \
                and s.election.role is Role.LEADER:
            run.append(received)
            continue
        if run:
            s, more = _on_joins(s, run, now)
            actions += more
            run = []
        s, more = _on_message(s, received.sender, message, now, from_feed=received.from_feed)
        actions += more
    if run:
        s, more = _on_joins(s, run, now)
        actions += more
    return s, actions


def _on_joins(s: QuorumState, run: list[MessageReceived], now: float) -> Outcome:
    """``_on_message`` for each of a run of joins that cannot change the term."""
    joins = [(r.sender, r.message) for r in run if r.sender != s.me and r.sender in s.voters]
    return formation.on_joins(s, joins, now,  # type: ignore[arg-type]
                              heard_before=now - _HEARD_RESOLUTION)


def _on_message(s: QuorumState, sender: int, message: object, now: float, *,
                from_feed: bool = False) -> Outcome:
    if sender == s.me or sender not in s.voters:
        return s, []
    if s.heard.get(sender, NEVER) < now - _HEARD_RESOLUTION:
        # Liveness is judged at the scale of member_timeout: refreshing the
        # timestamp at most every 50 ms spares most updates altogether.
        s = evolve(s, heard=with_item(s.heard, sender, now))
    if isinstance(message, Heartbeat):
        return election.on_heartbeat(s, sender, message, now)
    if isinstance(message, JoinRequested):
        s, actions = election.adopt_term(s, message.term, now)
        s, more = formation.on_join(s, sender, message, now)
        return s, actions + more
    if isinstance(message, HeartbeatAcked):
        return election.adopt_term(s, message.term, now)
    if isinstance(message, (QuorumAnnounced, QuorumDeltaAnnounced)):
        s, actions = election.on_leader_contact(s, sender, message.term, now)
        if s.leader_id != sender:
            return s, actions
        if isinstance(message, QuorumAnnounced):
            s, more = formation.on_announce(s, message)
        else:
            s, more = formation.on_delta(s, message, now, from_feed=from_feed)
        return s, actions + more
    if isinstance(message, VoteRequested):
        return election.on_vote_requested(s, sender, message, now)
    if isinstance(message, VoteAnswered):
        return election.on_vote_answered(s, sender, message, now)
    if isinstance(message, TimeoutNow):
        return election.on_timeout_now(s, sender, message, now)
    if isinstance(message, EndorseRequested):
        return witness.on_endorse_requested(s, sender, message, now)
    if isinstance(message, EndorseAnswered):
        return witness.on_endorse_answered(s, sender, message, now)
    raise TypeError(f"not a quorum message: {message!r}")


def _timers_due(s: QuorumState, now: float) -> bool:
    """Whether ``_on_time`` may act: always for a leader or a member without one
    (their checks look at what each event changed), for a follower of a known
    leader only from its next deadline on (its election timer, a bid's resend),
    which is every follower on almost every message."""
    e = s.election
    if e.role is Role.LEADER or e.leader_id is None:
        return True
    return now >= next_deadline(s, now)


def _on_time(s: QuorumState, now: float) -> Outcome:
    s, actions = election.on_timer(s, now)
    s, more = formation.on_timer(s, now)
    return s, actions + more


def _follow_transitions(before: QuorumState, s: QuorumState, now: float) -> Outcome:
    """Rules that span election and formation, applied to what just changed."""
    s, ended = standing.on_leader_change(before, s)
    m = s.member
    if m.request is None:
        return s, ended
    if s.election.majority_lost and not before.election.majority_lost:
        s = evolve(s, member=evolve(m, request=None, sent_to=None))
        return s, ended + [FailQuorumRequest(JoinFailure.MAJORITY_LOST, _reachable(s, now))]
    if s.leader_id is not None and m.sent_to != s.leader_id:
        s, sent = formation.send_request(s, now)
        return s, ended + sent
    return s, ended


def _reachable(s: QuorumState, now: float) -> tuple[int, ...]:
    horizon = now - election.majority_window(s)
    return tuple(sorted({p for p, t in s.heard.items() if t > horizon} | {s.me}))
