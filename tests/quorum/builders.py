"""Builders for core states and inputs, so table tests read as tables."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ft_launch.launcher.quorum.core import Leadership, Membership, QuorumCore
from ft_launch.launcher.quorum.election import UNSTAMPED, Action, Deliver, Send
from ft_launch.launcher.quorum.events import QuorumFormed
from ft_launch.launcher.quorum.model import (
    JoinRequested,
    Message,
    Quorum,
    QuorumMember,
    QuorumParams,
    Role,
)

PARAMS = QuorumParams(min_replicas=1, join_timeout=1.0, heartbeat_interval=0.1,
                      election_timeout=0.5, election_spread=0.5, member_timeout=2.0,
                      ack_interval=0.3, standing=False)
NOW = 100.0
TERM = 1
PREVIOUS_ID = 7


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class MessageReceived:
    sender: int
    message: Message


@dataclass(frozen=True)
class QuorumRequested:
    next_step: int
    address: str


@dataclass(frozen=True)
class TimerFired:
    pass


@dataclass(frozen=True)
class CommitFailureReported:
    pass


Input = MessageReceived | QuorumRequested | TimerFired | CommitFailureReported


def feed(core: QuorumCore, event: Input, now: float) -> list[Action]:
    """One input, by the core's entry point for it."""
    if isinstance(event, MessageReceived):
        return core.step(event.sender, event.message, now)
    if isinstance(event, QuorumRequested):
        return core.request(event.next_step, event.address, now)
    if isinstance(event, CommitFailureReported):
        return core.report_commit_failure(now)
    return core.tick(now)


def run(state: QuorumCore, events: Iterable[Input], now: float = NOW
        ) -> tuple[QuorumCore, list[Action]]:
    """Feed ``events`` in order (the core changes in place; returned for brevity)."""
    actions: list[Action] = []
    for event in events:
        actions += feed(state, event, now)
    return state, actions


def tick(state: QuorumCore, now: float) -> tuple[QuorumCore, list[Action]]:
    return state, state.tick(now)


# --------------------------------------------------------------------------- states


def address(replica: int, generation: int = 0) -> str:
    return f"tcp://10.0.0.{replica}:{5000 + generation}"


def quorum(quorum_id: int, members: Iterable[int], step: int = 10) -> Quorum:
    return Quorum.of(quorum_id, [QuorumMember(m, step, address(m)) for m in members],
                     term=TERM, leader_id=0)


def leader(voters: int = 5, *, live: Iterable[int] = (), previous: Iterable[int] | None = None,
           params: QuorumParams = PARAMS, now: float = NOW) -> QuorumCore:
    """Replica 0 leading term 1, having heard from ``live`` just now."""
    s = QuorumCore(0, range(voters), params, 0.0, seed=1)
    last = quorum(PREVIOUS_ID, previous) if previous is not None else None
    s.role, s.term, s.leader_id, s.had_leader = Role.LEADER, TERM, 0, True
    s.leader_seen_at, s.heartbeat_due = now - 10, now + params.heartbeat_interval
    s.heard = {m: now for m in live if m != 0}
    s.lead = Leadership(live=frozenset(s.heard) | {0})
    s.last_formed, s.member = last, Membership(join_seq=0, last_quorum=last)
    return s


def follower(me: int = 1, voters: int = 5, *, leader_id: int | None = 0, term: int = TERM,
             seen_at: float = NOW, params: QuorumParams = PARAMS) -> QuorumCore:
    s = QuorumCore(me, range(voters), params, 0.0, seed=1)
    s.term, s.leader_id, s.leader_seen_at = term, leader_id, seen_at
    s.had_leader, s.deadline = leader_id is not None, seen_at + params.election_timeout
    return s


def join(replica: int, step: int = 10, *, commit_failed: bool = False, generation: int = 0,
         last: int = PREVIOUS_ID, seq: int = 1, term: int = TERM) -> MessageReceived:
    return MessageReceived(replica, JoinRequested(term, step, address(replica, generation),
                                                  last, seq, commit_failed))


# --------------------------------------------------------------------------- outputs


def fact(kind: type, *fields: Any) -> Any:
    """An event as the core makes it (the shell stamps the time)."""
    return kind(*fields, time=UNSTAMPED)


def formed(actions: Iterable[Action]) -> QuorumFormed | None:
    """The one quorum the leader formed in ``actions`` (its event), if any."""
    found = [a for a in actions if isinstance(a, QuorumFormed)]
    assert len(found) <= 1, found
    return found[0] if found else None


def delivered(actions: Iterable[Action]) -> list[Quorum]:
    return [a.quorum for a in actions if isinstance(a, Deliver)]


def sent(actions: Iterable[Action], kind: type) -> list[Send]:
    return [a for a in actions if isinstance(a, Send) and isinstance(a.message, kind)]
