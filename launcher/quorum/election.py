"""Leader election: Raft's rules (terms, one vote per term, randomised timeouts,
heartbeats), without a log, plus three refinements from the Raft thesis / etcd:

* **pre-vote**: a member first asks whether it *could* win before raising its
  term, so a member cut off for a while does not come back with a huge term and
  depose a healthy leader;
* **leader lease**: a follower that heard from its leader within
  ``election_timeout`` refuses (pre-)votes, and a leader refuses them always;
* **check-quorum**: a leader that has not heard from voters with a majority of
  the votes within ``member_timeout`` steps down and says the majority is lost.

``Election`` is the base of ``core.QuorumCore``: the state every voter keeps and
the transitions between roles. It does no I/O: what it decides to send or report
goes to ``self.out`` (``Send``, events), and time comes in as ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from . import events as ev
from .model import (
    Heartbeat,
    HeartbeatAcked,
    Message,
    Quorum,
    QuorumParams,
    Role,
    VoteAnswered,
    VoteRequested,
    voter_weights,
)

NEVER = -math.inf
#: Events the core makes carry no clock of their own: the shell stamps them.
UNSTAMPED = 0.0
_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class Send:
    """Send one message (signed once) to each voter in ``to``."""

    to: tuple[int, ...]
    message: Message


@dataclass(frozen=True)
class Deliver:
    """Answer the local quorum request with ``quorum``."""

    quorum: Quorum


@dataclass(frozen=True)
class Fail:
    """Fail the local quorum request: the majority is lost (``reachable`` are the
    voters heard from within the majority window, this one included)."""

    reachable: tuple[int, ...]


Action = Send | Deliver | Fail | ev.Event


def unit_draw(seed: int, me: int, draw: int) -> float:
    """A reproducible number in [0, 1) (splitmix64): the core stays deterministic
    and tests can replay the exact election timeouts."""
    z = (seed * 0x9E3779B97F4A7C15 + me * 0xD1B54A32D192ED03 + draw + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    z ^= z >> 31
    return (z >> 11) / float(1 << 53)


class Election:
    """One voter's election state and role transitions (see the module docstring).
    ``witnesses``: the voters that never train (a witness never campaigns);
    ``electable=False``: votes and joins but never campaigns."""

    def __init__(self, me: int, voters: Iterable[int], params: QuorumParams, now: float, *,
                 seed: int = 0, electable: bool = True, witnesses: Iterable[int] = ()) -> None:
        self.me, self.params, self.seed = me, params, seed
        self.voters = frozenset(voters) | {me}
        self.witnesses = frozenset(witnesses) & self.voters
        self.weights = voter_weights(self.voters - self.witnesses, self.witnesses)
        self.majority = sum(self.weights.values()) // 2 + 1
        self.others = tuple(sorted(self.voters - {me}))
        self.electable = electable and me not in self.witnesses
        self.role = Role.FOLLOWER
        self.term = 0
        self.voted_for: int | None = None
        self.leader_id: int | None = None
        #: The leader whose silence started the current election: a new leader
        #: presumes every voter alive except this one and the known suspects.
        self.previous_leader: int | None = None
        #: Last contact with a leader (a leader: when it took office).
        self.leader_seen_at = NEVER
        self.had_leader = False
        self.deadline = now  # alone: nobody to wait for, take office at the first tick
        self.draws = 0
        #: The random part of the timeout last drawn: kept while one leader stays in contact.
        self.jitter = 0.0
        self.votes: set[int] = set()
        self.heartbeat_due = 0.0
        self.acked_at = NEVER
        #: Voters the leader's heartbeats say it has not heard from.
        self.suspects: frozenset[int] = frozenset()
        self.majority_lost = False
        #: Last authenticated message from each voter (any kind counts as alive).
        self.heard: dict[int, float] = {}
        self.out: list[Action] = []
        if len(self.voters) > 1:
            self._reset_timer(now)

    # ------------------------------------------------------------------ helpers
    def weight_of(self, voters: Iterable[int]) -> int:
        """The votes ``voters`` carry together."""
        return sum(self.weights.get(v, 0) for v in voters)

    def fresh(self, now: float, within: float | None = None) -> frozenset[int]:
        """Voters heard from within ``within`` (``member_timeout``), this one included."""
        horizon = now - (self.params.member_timeout if within is None else within)
        return frozenset(p for p, t in self.heard.items() if t > horizon) | {self.me}

    def majority_window(self) -> float:
        """How long without a leader, and how far back to look for signs of life,
        before saying the majority is lost: every reachable voter runs at least one
        (pre-)vote round within ``election_timeout + election_spread``."""
        p = self.params
        return max(p.member_timeout, p.election_timeout + p.election_spread)

    def in_lease(self, now: float) -> bool:
        return self.role is Role.LEADER or (
            self.leader_id is not None
            and now - self.leader_seen_at < self.params.election_timeout)

    def _send(self, to: int | tuple[int, ...], message: Message) -> None:
        self.out.append(Send(to if isinstance(to, tuple) else (to,), message))

    def _reset_timer(self, now: float, *, redraw: bool = True) -> None:
        """Arm the election timer at ``now + timeout + spread * U[0, 1)``; without
        ``redraw`` with the last draw (one leader's contacts re-arm it: the voters'
        draws still differ, so they time out apart once it falls silent)."""
        if redraw:
            self.jitter = self.params.election_spread * unit_draw(self.seed, self.me, self.draws)
            self.draws += 1
        self.deadline = now + self.params.election_timeout + self.jitter

    # ------------------------------------------------------------------ transitions
    def _become_follower(self, term: int, leader: int | None, now: float) -> None:
        """Follow ``leader`` (None: unknown) in ``term``: a higher term seen, or a
        leader's contact."""
        was_leader, new_term = self.role is Role.LEADER, term > self.term
        if was_leader:
            reason = f"saw the higher term {term}" if new_term else "another leader"
            self.out.append(ev.LeadershipLost(self.me, self.term, reason, time=UNSTAMPED))
            self._leadership_ended()
        if new_term:
            self.term, self.voted_for = term, None
        if leader is None:
            if was_leader:
                self._reset_timer(now)  # a leader kept no election timer
        else:
            same = not new_term and self.leader_id == leader and self.role is Role.FOLLOWER
            if new_term or self.leader_id != leader:
                self.out.append(ev.LeaderElected(self.me, leader, term, time=UNSTAMPED))
            if self.majority_lost:
                self.out.append(ev.MajorityRegained(self.me, leader, time=UNSTAMPED))
            self._reset_timer(now, redraw=not same)
            self.leader_seen_at, self.had_leader, self.majority_lost = now, True, False
        if self.leader_id is not None and self.leader_id != leader:
            self.previous_leader = self.leader_id
        self.role, self.leader_id, self.votes = Role.FOLLOWER, leader, set()

    def _campaign(self, now: float, *, pre_vote: bool) -> None:
        """Start a pre-vote (the term stays) or a candidacy (the term rises)."""
        if self.leader_id is not None:
            self.previous_leader = self.leader_id
        self.leader_id, self.votes = None, {self.me}
        if pre_vote:
            self.role = Role.PRE_CANDIDATE
        else:
            self.role, self.term, self.voted_for = Role.CANDIDATE, self.term + 1, self.me
        self._reset_timer(now)
        if self.weight_of(self.votes) >= self.majority:
            self._won(now)
        else:
            self._send(self.others, VoteRequested(self.term + pre_vote, pre_vote))

    def _won(self, now: float) -> None:
        if self.role is Role.PRE_CANDIDATE:
            self._campaign(now, pre_vote=False)
        else:
            self._become_leader(now)

    def _become_leader(self, now: float) -> None:
        self.out.append(ev.LeaderElected(self.me, self.me, self.term, time=UNSTAMPED))
        if self.majority_lost:
            self.out.append(ev.MajorityRegained(self.me, self.me, time=UNSTAMPED))
        # Presume alive every voter not already suspected and not the leader whose
        # silence caused this election, so a full round forms at once instead of
        # waiting out the join window for members merely not heard from lately.
        silent = self.previous_leader
        for voter in self.voters - self.suspects - {self.me, silent}:
            self.heard[voter] = now
        self.heard.pop(silent, None)  # type: ignore[arg-type]
        self.role, self.leader_id, self.votes = Role.LEADER, self.me, set()
        self.leader_seen_at, self.had_leader, self.majority_lost = now, True, False
        self.heartbeat_due = now
        self._leadership_began(now)
        if silent is not None and silent != self.me:
            # Its followers learn it from this leader's suspects; its own replica here.
            self.out.append(ev.MembersLivenessChanged(self.me, [silent], [], time=UNSTAMPED))

    def _step_down(self, fresh: frozenset[int], now: float) -> None:
        """Check-quorum: a leader without a majority for ``member_timeout``."""
        reason = (f"heard from voters with {self.weight_of(fresh)} of "
                  f"{sum(self.weights.values())} votes within member_timeout, "
                  f"a majority needs {self.majority}")
        self.out.append(ev.LeadershipLost(self.me, self.term, reason, time=UNSTAMPED))
        self.out.append(ev.MajorityLost(self.me, sorted(fresh), len(self.voters),
                                        time=UNSTAMPED))
        self._leadership_ended()
        self.role, self.leader_id, self.previous_leader = Role.FOLLOWER, None, None
        self.majority_lost = True
        self._reset_timer(now)

    def _leadership_began(self, now: float) -> None:
        """Set up what only a leader keeps (the core's rounds)."""

    def _leadership_ended(self) -> None:
        """Drop what only a leader keeps."""

    # ------------------------------------------------------------------ messages
    def _on_vote_requested(self, sender: int, msg: VoteRequested, now: float) -> None:
        """After ``step``'s term rules: a vote in a higher term has made this voter
        a follower of no leader in it, unless the lease holds or it is a pre-vote."""
        granted = False
        if self.in_lease(now):
            pass
        elif msg.pre_vote:
            granted = msg.term > self.term
            if granted:
                # A member that just saw someone campaign holds back rather than
                # start a competing round.
                self._reset_timer(now)
        elif msg.term == self.term and self.voted_for in (None, sender):
            self.voted_for, granted = sender, True
            self._reset_timer(now)
        term = msg.term if granted and msg.pre_vote else self.term
        self._send(sender, VoteAnswered(term, granted, msg.pre_vote))

    def _on_vote_answered(self, sender: int, msg: VoteAnswered, now: float) -> None:
        expected = (Role.PRE_CANDIDATE, self.term + 1) if msg.pre_vote else \
            (Role.CANDIDATE, self.term)
        if msg.granted and (self.role, msg.term) == expected:
            self.votes.add(sender)
            if self.weight_of(self.votes) >= self.majority:
                self._won(now)

    def _on_heartbeat(self, sender: int, msg: Heartbeat, now: float, new_leader: bool) -> None:
        suspects = frozenset(msg.suspects)
        if suspects != self.suspects:
            # Followers learn of a lost voter from the leader's heartbeats: a replica
            # in an all-reduce with it stops waiting for it (worker ``Manager``).
            self.out.append(ev.MembersLivenessChanged(
                self.me, sorted(suspects - self.suspects), sorted(self.suspects - suspects),
                time=UNSTAMPED))
            self.suspects = suspects
        if new_leader or now - self.acked_at >= self.params.ack_interval:
            self.acked_at = now
            self._send(sender, HeartbeatAcked(self.term))

    # ------------------------------------------------------------------ timers
    def _tick_election(self, now: float) -> None:
        """A non-leader's timer: campaign once the election timeout passed, and say
        the majority is lost after ``majority_window`` without a leader while the
        voters heard from hold less than a majority."""
        if now >= self.deadline and self.electable:
            self._campaign(now, pre_vote=True)
        if self.majority_lost or not self.had_leader or self.leader_id is not None \
                or now - self.leader_seen_at < self.majority_window():
            return
        reachable = self.fresh(now, self.majority_window())
        if self.weight_of(reachable) < self.majority:
            self.majority_lost = True
            self.out.append(ev.MajorityLost(self.me, sorted(reachable), len(self.voters),
                                            time=UNSTAMPED))

    def _election_deadline(self, now: float) -> float:
        deadline = self.deadline if self.electable else math.inf
        if self.had_leader and self.leader_id is None and not self.majority_lost:
            check_at = self.leader_seen_at + self.majority_window()
            # Past the window the answer depends on who is heard from: look again
            # every heartbeat interval rather than only when our own timer fires.
            deadline = min(deadline, check_at if check_at > now
                           else now + self.params.heartbeat_interval)
        return deadline
