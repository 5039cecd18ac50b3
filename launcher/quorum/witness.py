"""Witness endorsements: how a quorum smaller than a majority of the votes may train.

A witness is a voter that never trains: it votes in elections, answers
heartbeats, and endorses rounds. When the members of a formed quorum hold
fewer than a majority of all votes, the leader asks the witnesses
(``EndorseRequested(required=True)``) and announces the quorum only once the
members' votes and the granting witnesses' make a majority. When the members
alone are a majority, the witnesses are only told of the round
(``required=False``), so that each knows the last round that trained.

A witness grants an endorsement only to the leader it follows, in that
leader's term, and only for a quorum that shares a replica with the last
round it endorsed or was told of (continuity: a history passes from one round
to the next through a replica that was in both). The package docstring has
the safety argument.

What a voter must not forget across a restart (``Memory``: its term, its
vote in that term and, at a witness, the last round it endorsed or was told
of) is kept by the shell (``QuorumNode`` with ``witness_service.MemoryFile``):
written before any answer that depends on it leaves, read back at start.
Without it a restarted witness would endorse whichever side asked first, and
any restarted voter, replica or witness, could vote twice in one term: two
leaders in a term.

All functions are pure: ``(state, ..., now) -> (state, actions)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from . import election, formation
from .model import EndorseAnswered, EndorseRequested, Quorum, Role, evolve
from .state import Action, Pending, QuorumState, Send

Outcome = tuple[QuorumState, list[Action]]


@dataclass(frozen=True)
class Memory:
    """A voter's state that must survive its restart (a replica's ``endorsed``
    stays None)."""

    term: int = 0
    voted_for: int | None = None
    #: Members of the last round endorsed or told of; None: none yet (a new
    #: job), an empty set: unknown (endorse nothing until told of a round
    #: whose members alone are a majority).
    endorsed: frozenset[int] | None = None


class MemoryStore(Protocol):
    def load(self) -> Memory: ...

    def save(self, memory: Memory) -> None: ...


def memory_of(s: QuorumState) -> Memory:
    e = s.election
    return Memory(e.term, e.voted_for, s.endorsed)


def restore(s: QuorumState, memory: Memory) -> QuorumState:
    """A starting voter's state with what it remembered."""
    return evolve(s, election=evolve(s.election, term=memory.term,
                                     voted_for=memory.voted_for),
                  endorsed=memory.endorsed)


def tell_witnesses(s: QuorumState, quorum: Quorum, *, required: bool) -> list[Action]:
    if not s.witnesses:
        return []
    return [Send(tuple(sorted(s.witnesses)),
                 EndorseRequested(s.term, quorum.max_step, quorum.quorum_id,
                                  quorum.replica_ids, required))]


# --------------------------------------------------------------------------- witness side


def on_endorse_requested(s: QuorumState, sender: int, msg: EndorseRequested,
                         now: float) -> Outcome:
    s, actions = election.on_leader_contact(s, sender, msg.term, now)
    if s.me not in s.witnesses:
        return s, actions  # a replica hears it on its leader's feed: not for it
    if s.leader_id != sender or s.term != msg.term:
        return s, actions  # a deposed leader: told our term, endorses nothing
    members = frozenset(msg.members)
    continuous = s.endorsed is None or not s.endorsed.isdisjoint(members)
    if msg.required and not continuous:
        return s, actions + [Send((sender,), EndorseAnswered(s.term, msg.quorum_id, False))]
    s = evolve(s, endorsed=members)
    if msg.required:
        actions.append(Send((sender,), EndorseAnswered(s.term, msg.quorum_id, True)))
    return s, actions


# --------------------------------------------------------------------------- leader side


def on_endorse_answered(s: QuorumState, sender: int, msg: EndorseAnswered,
                        now: float) -> Outcome:
    s, actions = election.adopt_term(s, msg.term, now)
    pending = s.leadership.pending
    if sender not in s.witnesses or s.role is not Role.LEADER or pending is None \
            or msg.term != s.term \
            or msg.quorum_id != pending.announce.quorum.quorum_id:
        return s, actions
    if msg.granted:
        pending = evolve(pending, granted=pending.granted | {sender})
    else:
        pending = evolve(pending, refused=pending.refused | {sender})
    s, more = _settle(s, pending, now)
    return s, actions + more


def on_timer(s: QuorumState, now: float) -> Outcome:
    """Ask again the witnesses that have not answered (a lost message, or a
    witness that was away)."""
    pending = s.leadership.pending
    if pending is None or now < resend_at(s, pending):
        return s, []
    waiting = tuple(sorted(s.witnesses - pending.granted - pending.refused))
    quorum = pending.announce.quorum
    pending = evolve(pending, asked_at=now)
    s = evolve(s, leadership=evolve(s.leadership, pending=pending))
    if not waiting:
        return s, []
    return s, [Send(waiting, EndorseRequested(s.term, quorum.max_step, quorum.quorum_id,
                                              quorum.replica_ids, True))]


def resend_at(s: QuorumState, pending: Pending) -> float:
    return pending.asked_at + s.params.join_timeout


def _settle(s: QuorumState, pending: Pending, now: float) -> Outcome:
    """Announce once a majority stands behind the quorum; give it up once
    refusals make that impossible (its members ask again and a new round forms)."""
    members = frozenset(pending.announce.quorum.replica_ids)
    votes = s.weight_of(members) + s.weight_of(pending.granted)
    if votes >= s.majority:
        return formation.publish(s, pending, now)
    possible = votes + s.weight_of(s.witnesses - pending.granted - pending.refused)
    if possible < s.majority:
        return evolve(s, leadership=evolve(s.leadership, pending=None)), []
    return evolve(s, leadership=evolve(s.leadership, pending=pending)), []
