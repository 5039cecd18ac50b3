"""Builders for pure-core states and events, so table tests read as tables."""

from __future__ import annotations

from collections.abc import Iterable

from ft_launch.launcher.quorum.core import decide, initial_state
from ft_launch.launcher.quorum.model import (
    Health,
    JoinRequested,
    Quorum,
    QuorumMember,
    QuorumParams,
    Role,
    evolve,
)
from ft_launch.launcher.quorum.state import (
    Action,
    Input,
    Leadership,
    Membership,
    MessageReceived,
    NotifyQuorumFormed,
    QuorumState,
    Send,
    TimerFired,
)

PARAMS = QuorumParams(min_replicas=1, join_timeout=1.0, heartbeat_interval=0.1,
                      election_timeout=0.5, election_spread=0.5, member_timeout=2.0,
                      ack_interval=0.3)
NOW = 100.0
TERM = 1
PREVIOUS_ID = 7


def address(replica: int, generation: int = 0) -> str:
    return f"tcp://10.0.0.{replica}:{5000 + generation}"


def quorum(quorum_id: int, members: Iterable[int], step: int = 10) -> Quorum:
    return Quorum.of(quorum_id, tuple(QuorumMember(m, step, address(m)) for m in members),
                     term=TERM, leader_id=0)


def leader(voters: int = 5, *, live: Iterable[int] = (), previous: Iterable[int] | None = None,
           params: QuorumParams = PARAMS, now: float = NOW) -> QuorumState:
    """Replica 0 leading term 3, having heard from ``live`` just now."""
    s = initial_state(0, range(voters), params, 0.0, seed=1)
    last = quorum(PREVIOUS_ID, previous) if previous is not None else None
    election = evolve(s.election, role=Role.LEADER, term=TERM, leader_id=0, had_leader=True,
                      leader_seen_at=now - 10, heartbeat_due=now + params.heartbeat_interval)
    heard = {m: now for m in live if m != 0}
    return evolve(s, election=election, heard=heard,
                  leadership=Leadership(live=frozenset(heard) | {0}, last_formed=last),
                  member=Membership(join_seq=0, last_quorum=last))


def follower(me: int = 1, voters: int = 5, *, leader_id: int | None = 0, term: int = TERM,
             seen_at: float = NOW, params: QuorumParams = PARAMS) -> QuorumState:
    s = initial_state(me, range(voters), params, 0.0, seed=1)
    election = evolve(s.election, term=term, leader_id=leader_id, leader_seen_at=seen_at,
                      had_leader=leader_id is not None,
                      deadline=seen_at + params.election_timeout)
    return evolve(s, election=election)


def join(replica: int, step: int = 10, *, commit_failed: bool = False,
         health: Health = Health.OK, generation: int = 0, last: int = PREVIOUS_ID,
         seq: int = 1, term: int = TERM) -> MessageReceived:
    return MessageReceived(replica, JoinRequested(term, step, address(replica, generation),
                                                  health, last, seq, commit_failed))


def run(state: QuorumState, events: Iterable[Input], now: float = NOW
        ) -> tuple[QuorumState, list[Action]]:
    actions: list[Action] = []
    for event in events:
        state, more = decide(state, event, now)
        actions += more
    return state, actions


def tick(state: QuorumState, now: float) -> tuple[QuorumState, list[Action]]:
    return decide(state, TimerFired(), now)


def formed(actions: Iterable[Action]) -> Quorum | None:
    found = [a.quorum for a in actions if isinstance(a, NotifyQuorumFormed)]
    assert len(found) <= 1, found
    return found[0] if found else None


def sent(actions: Iterable[Action], kind: type) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.message, kind)]
