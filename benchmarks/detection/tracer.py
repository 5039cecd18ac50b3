"""The on-demand tracer: capture stacks of a job's ranks and decide what to evict,
once for a hang, every ``interval`` seconds over ``rounds`` rounds for fail-slow."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence

from ft_launch.health.aggregation import (
    Aggregation,
    EvictionDecision,
    FailSlowVote,
    RankPlace,
    diagnose,
)
from ft_launch.health.stacks import ProcessStack, capture_all

log = logging.getLogger(__name__)

Capture = Callable[[Iterable[int]], Mapping[int, ProcessStack]]


def rank_stacks(pids: Mapping[int, int], capture: Capture) -> dict[int, ProcessStack]:
    """{rank: stack} from {rank: pid}."""
    by_pid = capture(pids.values())
    return {rank: by_pid[pid] for rank, pid in pids.items()}


def hang_eviction(pids: Mapping[int, int], topology: Sequence[RankPlace],
                  capture: Capture = capture_all,
                  attempts: int = 3) -> tuple[Aggregation, EvictionDecision | None]:
    """Aggregate once; sample again (up to ``attempts``) while the result is ambiguous."""
    for _ in range(attempts):
        found, decision = diagnose(rank_stacks(pids, capture), topology)
        if not found.ambiguous:
            break
    log.info("hang: %d stack groups, outliers %s -> %s", len(found.groups), list(found.outliers),
             decision.describe() if decision else "nothing to evict")
    return found, decision


def fail_slow_eviction(pids: Mapping[int, int], topology: Sequence[RankPlace], *,
                       rounds: int = 5, interval: float = 10.0, capture: Capture = capture_all,
                       stop: threading.Event | None = None,
                       max_samples: int | None = None) -> EvictionDecision | None:
    """Sample every ``interval`` seconds until ``rounds`` samples had a healthy
    majority (at most ``max_samples``, default 3 x rounds), then vote."""
    vote = FailSlowVote()
    stop = stop or threading.Event()
    for sample in range(max_samples or 3 * rounds):
        if sample and stop.wait(interval):  # the sampling period; stop() ends it early
            break
        found, decision = diagnose(rank_stacks(pids, capture), topology)
        vote.add(found, decision)
        if len(vote.usable()) >= rounds:
            break
    winner = vote.winner()
    log.info("fail-slow over %d samples (%d usable) -> %s", len(vote.rounds),
             len(vote.usable()), winner.describe() if winner else "nothing to evict")
    return winner
