"""Effective training time ratio (ETTR): a discrete-event model of a training job
under failures, and warm-standby sizing.

Pure and cheap: used by ``ft-launch standby-size`` and ``benchmarks/ettr_sim.py``.

The model: each failure makes the **whole job** stop for a *stall* (detection,
then whatever the strategy must do before any replica computes again), then,
for strategies that recover one replica while the others train, leaves that
replica out for a *degraded* period (capacity ``(R - k) / R`` with ``k``
replicas out). Synchronous strategies have no degraded period: they stall until
the job runs at full strength. A failure while the pool of warm standby nodes
is empty costs the strategy's *fallback* (a reschedule) instead. ETTR is the
integral of capacity over wall time.

What a failure costs comes from its parts (``RecoveryParts``: detection,
eviction, standby promotion, restart, checkpoint restore or catch-up fetch,
rejoin, the first step) through ``recovery_cost(strategy, parts)`` for the four
strategies (requeue, reschedule, warm standby with a synchronous restart,
asynchronous per-replica recovery); failure times come from a trace, a
periodic back-of-envelope process, or per-node Poisson processes
(``node_failures``).
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class Strategy(enum.Enum):
    REQUEUE = "requeue"                      # scontrol requeue, restart from persistent ckpt
    RESCHEDULE = "reschedule"                # new allocation for the failed part, sync restart
    WARM_STANDBY_SYNC = "warm_standby_sync"  # promote a standby, restart everyone
    ASYNC_REPLICA = "async_replica"          # ours: others keep training, one replica rejoins


@dataclass(frozen=True)
class RecoveryCost:
    """Seconds one failure costs under one strategy."""

    stall: float            # whole job makes no progress (detection included)
    degraded: float = 0.0   # after the stall: one replica out, the others train
    fallback_stall: float | None = None     # when no standby is free (default: stall)
    fallback_degraded: float | None = None  # when no standby is free (default: degraded)


@dataclass(frozen=True)
class JobModel:
    replicas: int
    horizon: float                   # seconds of wall time simulated
    standby: int | None = None       # warm standby nodes; None = never runs out
    replenish: float = 0.0           # seconds until a used standby is replaced


@dataclass(frozen=True)
class EttrResult:
    ettr: float
    failures: int
    stalled_s: float
    degraded_replica_s: float
    fallbacks: int


def periodic_failures(interval: float, horizon: float, first: float | None = None) -> list[float]:
    """A failure every ``interval`` seconds (the papers' back-of-envelope trace)."""
    start = interval if first is None else first
    return [start + k * interval for k in range(int((horizon - start) // interval) + 1)
            if start + k * interval < horizon]


def poisson_failures(rate_per_s: float, horizon: float, seed: int) -> list[float]:
    """Failure times of a Poisson process (``rate_per_s`` = machines x per-machine rate)."""
    rng = random.Random(seed)
    times: list[float] = []
    now = 0.0
    while True:
        now += rng.expovariate(rate_per_s)
        if now >= horizon:
            return times
        times.append(now)


def simulate(failures: Sequence[float], cost: RecoveryCost, job: JobModel) -> EttrResult:
    """Integrate capacity over ``[0, horizon]`` given failure times."""
    stalls: list[tuple[float, float]] = []
    degraded: list[tuple[float, float]] = []
    pool_back: list[float] = []  # times at which used standby nodes are replaced
    fallbacks = 0
    for t in sorted(failures):
        use_fallback = False
        if job.standby is not None:
            in_use = sum(1 for back in pool_back if back > t)
            use_fallback = in_use >= job.standby
            if not use_fallback:
                pool_back.append(t + job.replenish)
        fallbacks += use_fallback
        stall = cost.fallback_stall if use_fallback and cost.fallback_stall is not None \
            else cost.stall
        out = cost.fallback_degraded if use_fallback and cost.fallback_degraded is not None \
            else cost.degraded
        stalls.append((t, t + stall))
        if out > 0:
            degraded.append((t + stall, t + stall + out))
    stalled = _union_length(stalls, job.horizon)
    useful = _capacity_integral(stalls, degraded, job.replicas, job.horizon)
    return EttrResult(ettr=useful / job.horizon, failures=len(failures), stalled_s=stalled,
                      degraded_replica_s=sum(min(b, job.horizon) - min(a, job.horizon)
                                             for a, b in degraded),
                      fallbacks=fallbacks)


def _union_length(intervals: Iterable[tuple[float, float]], horizon: float) -> float:
    total, end = 0.0, 0.0
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, horizon)
        if b > a:
            total += b - a
            end = b
    return total


def _capacity_integral(stalls: list[tuple[float, float]], degraded: list[tuple[float, float]],
                       replicas: int, horizon: float) -> float:
    """Sweep line: capacity is 0 inside any stall, else (R - replicas out) / R."""
    events: list[tuple[float, int, int]] = []  # (time, stall delta, degraded delta)
    for a, b in stalls:
        events += [(a, 1, 0), (b, -1, 0)]
    for a, b in degraded:
        events += [(a, 0, 1), (b, 0, -1)]
    events.sort()
    useful, now, stalling, out = 0.0, 0.0, 0, 0
    for time, d_stall, d_out in events + [(horizon, 0, 0)]:
        time = min(time, horizon)
        if time > now and stalling == 0:
            useful += (time - now) * max(replicas - out, 0) / replicas
        now = max(now, time)
        stalling += d_stall
        out += d_out
    return useful


# --------------------------------------------------------------------------- standby sizing


def window_failure_probability(daily_rate: float, window_hours: float) -> float:
    """Probability one machine fails within the replenish window."""
    return float(1.0 - (1.0 - daily_rate) ** (window_hours / 24.0))


def binomial_quantile(n: int, p: float, quantile: float) -> int:
    """Smallest k with P[Binomial(n, p) <= k] >= quantile (log-space: n may be 1e5)."""
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")
    if p <= 0.0:
        return 0
    if p >= 1.0:
        return n
    log_p, log_q = math.log(p), math.log1p(-p)
    cdf = 0.0
    for k in range(n + 1):
        cdf += math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
                        + k * log_p + (n - k) * log_q)
        if cdf >= quantile:
            return k
    return n


def standby_size(machines: int, daily_rate: float, window_hours: float,
                 quantile: float = 0.99) -> int:
    """ByteRobust's warm-standby count: the quantile of concurrent failures."""
    return binomial_quantile(machines, window_failure_probability(daily_rate, window_hours),
                             quantile)


# --------------------------------------------------------------------------- recovery parts


@dataclass(frozen=True)
class RecoveryParts:
    """Seconds each part of recovering from one failure takes; ``recovery_cost``
    turns them into what the job loses under each strategy. A part a strategy
    does not use is ignored by it (e.g. ``fetch`` by the synchronous ones)."""

    detection: float                 # failure -> the system acts (timeouts, alarms)
    eviction: float = 0.0            # drain the bad node
    promotion: float = 0.0           # a warm standby node takes its place
    restart: float = 0.0             # processes of the restarted part start and initialise
    restore: float = 0.0             # synchronous: every replica loads a checkpoint
    lost_work: float = 0.0           # synchronous: work redone since that checkpoint
    fetch: float = 0.0               # asynchronous: catch-up fetch from a healthy replica
    rejoin: float = 0.0              # quorum, ring rebuild, until it trains again
    first_step: float = 0.0          # extra cost of the first step after a restart
    healthy_stall: float = 0.0       # asynchronous: the healthy replicas' stall
    queue_wait: float = 0.0          # requeue: back through the Slurm queue
    reschedule_wait: float = 0.0     # reschedule: waiting for replacement nodes

    def synchronous_tail(self) -> float:
        """Everyone restarts together once the nodes are there."""
        return self.restart + self.restore + self.lost_work + self.rejoin + self.first_step

    def replica_out(self, wait: float) -> float:
        """How long the failed replica is out under asynchronous recovery, given
        how long it waits for its node (promotion, or a reschedule)."""
        return (self.detection + self.eviction + wait + self.restart + self.fetch
                + self.rejoin + self.first_step)


def recovery_cost(strategy: Strategy, parts: RecoveryParts) -> RecoveryCost:
    """What one failure costs the job under ``strategy`` (see ``RecoveryCost``).

    * requeue: the whole job goes back through the queue and restarts;
    * reschedule: replacement nodes are found, then everyone restarts;
    * warm standby, synchronous: a standby is promoted, then everyone restarts
      (falls back to reschedule when the pool is empty);
    * asynchronous per replica (ours): the healthy replicas stall only until
      the quorum re-forms without the failed one, then train on while it is
      replaced, fetches the state and rejoins (``degraded``).
    """
    p = parts
    reschedule = p.detection + p.eviction + p.reschedule_wait + p.synchronous_tail()
    if strategy is Strategy.REQUEUE:
        return RecoveryCost(stall=p.detection + p.queue_wait + p.synchronous_tail())
    if strategy is Strategy.RESCHEDULE:
        return RecoveryCost(stall=reschedule)
    if strategy is Strategy.WARM_STANDBY_SYNC:
        return RecoveryCost(stall=p.detection + p.eviction + p.promotion + p.synchronous_tail(),
                            fallback_stall=reschedule)
    stall = p.healthy_stall
    return RecoveryCost(stall=stall,
                        degraded=max(p.replica_out(p.promotion) - stall, 0.0),
                        fallback_degraded=max(p.replica_out(p.reschedule_wait) - stall, 0.0))


def node_failures(rates_per_day: Sequence[float], horizon: float, seed: int) -> list[float]:
    """Failure times of independent nodes, each a Poisson process with its own
    rate (failures per day), merged and sorted; a failed node is replaced, so
    its process goes on."""
    rng = random.Random(seed)
    times: list[float] = []
    for rate in rates_per_day:
        if rate <= 0:
            continue
        now = rng.expovariate(rate / 86_400.0)
        while now < horizon:
            times.append(now)
            now += rng.expovariate(rate / 86_400.0)
    return sorted(times)


def failure_interval(gpus: int, reference_gpus: int, reference_interval: float) -> float:
    """Mean time between job failures at ``gpus``, scaling a reference figure
    (e.g. FT-HSDP: one failure every 18 minutes at 98,304 GPUs) by size: the
    per-GPU failure rate is taken as constant."""
    return reference_interval * reference_gpus / gpus


def job_ettr(strategy: Strategy, parts: RecoveryParts, failures: Sequence[float],
             job: JobModel) -> EttrResult:
    """ETTR of ``job`` under ``failures`` when every failure is recovered by ``strategy``."""
    cost = recovery_cost(strategy, parts)
    if strategy in (Strategy.REQUEUE, Strategy.RESCHEDULE):
        job = JobModel(job.replicas, job.horizon)  # no standby pool involved
    return simulate(failures, cost, job)
