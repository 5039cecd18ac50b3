"""A deterministic in-memory network for the pure core: no sockets, no clock.

Messages are delivered in order after a fixed latency; a partition drops
traffic between groups. Used by the scenario tests of ``decide``.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ft_launch.launcher.quorum.core import QuorumCore
from ft_launch.launcher.quorum.election import Action, Deliver, Fail, Send
from ft_launch.launcher.quorum.events import QuorumFormed
from ft_launch.launcher.quorum.model import Quorum, QuorumParams, Role

from .builders import Input, MessageReceived, QuorumRequested, TimerFired, feed

FAST = QuorumParams(min_replicas=1, join_timeout=0.5, heartbeat_interval=0.05,
                    election_timeout=0.3, election_spread=0.3, member_timeout=0.6,
                    ack_interval=0.15, standing=False)


@dataclass
class Sim:
    replicas: Iterable[int]
    params: QuorumParams = FAST
    latency: float = 0.001
    jitter: float = 0.0
    seed: int = 1
    now: float = 0.0
    states: dict[int, QuorumCore] = field(default_factory=dict)
    delivered: dict[int, list[Any]] = field(default_factory=dict)
    failed: dict[int, list[Fail]] = field(default_factory=dict)
    #: Every quorum a leader formed, as it formed it.
    formed: list[Quorum] = field(default_factory=list)
    actions: list[tuple[int, Action]] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    cut: set[frozenset[int]] = field(default_factory=set)
    sent: int = 0
    _queue: list[tuple[float, int, int, Input]] = field(default_factory=list)
    _order: Any = field(default_factory=itertools.count)
    _rng: random.Random = field(default_factory=random.Random)
    #: Voters that never train (their ids among every member's voters).
    witnesses: Iterable[int] = ()

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)
        self.witnesses = tuple(self.witnesses)
        ids = list(self.replicas) + list(self.witnesses)
        for r in ids:
            self.start(r, ids)

    def start(self, r: int, ids: Iterable[int] | None = None, seq_base: int = 0,
              remember: bool = True) -> None:
        """(Re)start voter ``r``. A restart keeps what the product's voters keep in
        their memory files (``model.Memory``: term, vote, a witness's last round)
        unless ``remember`` is False."""
        previous = self.states.get(r)
        voters = list(ids) if ids is not None else sorted(self.states[r].voters)
        self.states[r] = QuorumCore(r, voters, self.params, self.now, seed=self.seed,
                                    join_seq_base=seq_base, witnesses=self.witnesses)
        if remember and previous is not None:
            self.states[r].restore(previous.memory())
        self.dead.discard(r)
        self.delivered.setdefault(r, [])
        self.failed.setdefault(r, [])

    # ------------------------------------------------------------------ faults
    def kill(self, r: int) -> None:
        self.dead.add(r)

    def partition(self, *groups: Iterable[int]) -> None:
        sets = [frozenset(g) for g in groups]
        self.cut = {frozenset((a, b)) for g in sets for h in sets if g != h
                    for a in g for b in h}

    def heal(self) -> None:
        self.cut = set()

    # ------------------------------------------------------------------ driving
    def feed(self, r: int, event: Input) -> None:
        if r in self.dead:
            return
        for action in feed(self.states[r], event, self.now):
            self.actions.append((r, action))
            self._perform(r, action)

    def _perform(self, r: int, action: Action) -> None:
        if isinstance(action, Send):
            for to in action.to:
                self.sent += 1
                if frozenset((r, to)) in self.cut:
                    continue
                delay = self.latency + self.jitter * self._rng.random()
                heapq.heappush(self._queue, (self.now + delay, next(self._order), to,
                                             MessageReceived(r, action.message)))
        elif isinstance(action, Deliver):
            self.delivered[r].append(action.quorum)
        elif isinstance(action, QuorumFormed):
            self.formed.append(self.states[r].last_formed)  # type: ignore[arg-type]
        elif isinstance(action, Fail):
            self.failed[r].append(action)

    def request(self, r: int, step: int) -> None:
        self.feed(r, QuorumRequested(step, f"tcp://r{r}"))

    def run(self, seconds: float) -> None:
        """Advance time, delivering messages and firing timers in order."""
        end = self.now + seconds
        while True:
            timers = [(s.next_deadline(self.now), r) for r, s in self.states.items()
                      if r not in self.dead]
            when_timer, who = min(timers)
            when_msg = self._queue[0][0] if self._queue else float("inf")
            when = min(when_timer, when_msg)
            if when > end:
                self.now = end
                return
            self.now = max(self.now, when)
            if when_msg <= when_timer:
                _, _, to, event = heapq.heappop(self._queue)
                self.feed(to, event)
            else:
                self.feed(who, TimerFired())

    def run_until(self, predicate: Any, limit: float = 10.0, step: float = 0.01) -> bool:
        deadline = self.now + limit
        while self.now < deadline:
            if predicate():
                return True
            self.run(step)
        return bool(predicate())

    # ------------------------------------------------------------------ views
    def leaders(self) -> list[int]:
        return [r for r, s in self.states.items()
                if r not in self.dead and s.role is Role.LEADER]

    def leader(self) -> int:
        found = self.leaders()
        assert len(found) == 1, f"expected one leader, found {found}"
        return found[0]

    def stable(self) -> bool:
        found = self.leaders()
        if len(found) != 1:
            return False
        return all(s.leader_id == found[0] for r, s in self.states.items()
                   if r not in self.dead)
