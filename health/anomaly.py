"""Training-metric anomalies (pure): NaN / Inf, a loss or grad-norm spike of
``factor`` x over a moving baseline, and fail-slow (step time up, or throughput
down, against a longer baseline).

Baselines are medians over a window: one outlier neither triggers nor hides the
next. A spiking value is not added to the baseline, so a run of spikes keeps
being reported against the healthy level.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from dataclasses import dataclass


class AnomalyKind(enum.Enum):
    NAN_LOSS = "nan_loss"
    INF_LOSS = "inf_loss"
    NAN_GRAD = "nan_grad"
    LOSS_SPIKE = "loss_spike"
    GRAD_SPIKE = "grad_spike"
    FAIL_SLOW = "fail_slow"              # step time up
    THROUGHPUT_DROP = "throughput_drop"  # tokens (or samples) per second down


@dataclass(frozen=True)
class Anomaly:
    kind: AnomalyKind
    step: int
    value: float
    baseline: float | None = None

    def describe(self) -> str:
        base = "" if self.baseline is None else f" (baseline {self.baseline:.4g})"
        return f"{self.kind.value} at step {self.step}: {self.value:.4g}{base}"


class SpikeDetector:
    """``value > factor * median(last window)`` after ``warmup`` values."""

    def __init__(self, factor: float = 5.0, window: int = 20, warmup: int = 5) -> None:
        self.factor = factor
        self.warmup = warmup
        self._history: deque[float] = deque(maxlen=window)

    def observe(self, value: float) -> float | None:
        """The baseline when ``value`` spikes, else None (and ``value`` joins the baseline)."""
        if len(self._history) >= self.warmup:
            baseline = statistics.median(self._history)
            if baseline > 0 and value > self.factor * baseline:
                return baseline
        self._history.append(value)
        return None


class SlowdownDetector:
    """Fail-slow: the median of the last ``recent`` values exceeds ``factor`` times the
    median of the ``window`` before them. Reports once per episode."""

    def __init__(self, factor: float = 1.5, window: int = 20, recent: int = 5) -> None:
        self.factor = factor
        self.recent = recent
        self._baseline: deque[float] = deque(maxlen=window)
        self._recent: deque[float] = deque(maxlen=recent)
        self._slow = False

    def observe(self, value: float) -> tuple[float, float] | None:
        """(recent median, baseline median) when a slowdown starts, else None."""
        if len(self._recent) == self.recent:
            self._baseline.append(self._recent[0])
        self._recent.append(value)
        if len(self._baseline) < self.recent or len(self._recent) < self.recent:
            return None
        now, before = statistics.median(self._recent), statistics.median(self._baseline)
        slow = now > self.factor * before
        started, self._slow = slow and not self._slow, slow
        if slow:
            self._baseline.pop()  # keep the slow values out of the healthy baseline
        return (now, before) if started else None


@dataclass(frozen=True)
class AnomalySettings:
    spike_factor: float = 5.0
    window: int = 20
    warmup: int = 5
    slow_factor: float = 1.5
    slow_recent: int = 5


class MetricAnomalyDetector:
    """All metric detectors of one rank (or of the job, fed with job-level values)."""

    def __init__(self, settings: AnomalySettings = AnomalySettings()) -> None:
        s = settings
        self.loss = SpikeDetector(s.spike_factor, s.window, s.warmup)
        self.grad = SpikeDetector(s.spike_factor, s.window, s.warmup)
        self.step_time = SlowdownDetector(s.slow_factor, s.window, s.slow_recent)
        self.seconds_per_token = SlowdownDetector(s.slow_factor, s.window, s.slow_recent)

    def observe(self, step: int, loss: float | None, grad_norm: float | None = None,
                step_time: float | None = None,
                throughput: float | None = None) -> list[Anomaly]:
        found: list[Anomaly] = []
        if loss is not None:
            found += self._value(step, loss, self.loss, AnomalyKind.LOSS_SPIKE, loss_kind=True)
        if grad_norm is not None:
            found += self._value(step, grad_norm, self.grad, AnomalyKind.GRAD_SPIKE,
                                 loss_kind=False)
        if step_time is not None and math.isfinite(step_time):
            slow = self.step_time.observe(step_time)
            if slow is not None:
                found.append(Anomaly(AnomalyKind.FAIL_SLOW, step, slow[0], slow[1]))
        if throughput is not None and throughput > 0 and math.isfinite(throughput):
            # A drop in throughput is a rise in its inverse: one detector serves both.
            drop = self.seconds_per_token.observe(1.0 / throughput)
            if drop is not None:
                found.append(Anomaly(AnomalyKind.THROUGHPUT_DROP, step, 1.0 / drop[0],
                                     1.0 / drop[1]))
        return found

    @staticmethod
    def _value(step: int, value: float, spikes: SpikeDetector, spike_kind: AnomalyKind,
               *, loss_kind: bool) -> list[Anomaly]:
        if math.isnan(value):
            return [Anomaly(AnomalyKind.NAN_LOSS if loss_kind else AnomalyKind.NAN_GRAD, step,
                            value)]
        if math.isinf(value):
            return [Anomaly(AnomalyKind.INF_LOSS if loss_kind else AnomalyKind.NAN_GRAD, step,
                            value)]
        baseline = spikes.observe(abs(value))
        return [] if baseline is None else [Anomaly(spike_kind, step, value, baseline)]


@dataclass(frozen=True)
class SlowPeer:
    """A peer whose own step time stays an outlier: medians over the window."""

    peer: int
    own_s: float
    peers_s: float
    steps: int

    def describe(self) -> str:
        return (f"took {self.own_s / self.peers_s:.1f}x as long as its peers for its own "
                f"part of a step ({self.own_s:.3g} s against {self.peers_s:.3g} s, medians "
                f"of {self.steps} steps)")


class PeerSlowdownDetector:
    """Fail-slow among peers that step in lockstep (FT-HSDP replicas). Every peer's
    step takes as long as the slowest's, so step times alone name nobody; each peer's
    *own* time (its step minus what it waited for the others) does. A peer whose
    median own time over ``window`` steps exceeds ``factor`` x the median of the
    other peers' medians is reported, once; its history starts again after that
    (and after ``forget``, when it is relaunched)."""

    def __init__(self, factor: float = 2.0, window: int = 30) -> None:
        self.factor = factor
        self.window = window
        self._own: dict[int, deque[float]] = {}

    def observe(self, peer: int, own_s: float) -> SlowPeer | None:
        if not math.isfinite(own_s) or own_s < 0:
            return None
        history = self._own.setdefault(peer, deque(maxlen=self.window))
        history.append(own_s)
        if len(history) < self.window:
            return None
        others = [statistics.median(h) for p, h in self._own.items()
                  if p != peer and len(h) == self.window]
        if not others:
            return None
        mine, baseline = statistics.median(history), statistics.median(others)
        if baseline <= 0 or mine <= self.factor * baseline:
            return None
        self.forget(peer)
        return SlowPeer(peer, mine, baseline, self.window)

    def forget(self, peer: int) -> None:
        self._own.pop(peer, None)


@dataclass(frozen=True)
class LossSpike:
    """A step whose mean loss over the replicas that trained it spiked."""

    step: int
    loss: float         # the mean over ``replicas`` replicas
    baseline: float     # median of the means of the steps before it
    replicas: int

    def describe(self) -> str:
        return (f"step {self.step}: mean loss {self.loss:.4g} over {self.replicas} "
                f"replica(s), {self.loss / self.baseline:.1f}x the median {self.baseline:.4g} "
                "of the steps before it")


class StepLossSpikes:
    """Loss spikes of a data-parallel job, fed with every replica's loss of every step.

    A step's value is the mean over the replicas that trained it (one replica's batch
    may be hard; a spike of all of them is the model's), taken once all of them
    reported it, or once the job is ``LAG`` steps further (a replica died in the
    step). Steps are judged in order by a ``SpikeDetector`` whose baseline is the
    median of the ``window`` steps before, and only once ``window`` steps were seen
    (warm-up: the first losses fall fast and say nothing of the next ones).

    ``history`` tells apart the histories of a run that was rolled back: a value of
    an older history than the newest seen is passed over, a newer one starts the
    steps again (the baseline is kept: it holds healthy losses only)."""

    LAG = 2

    def __init__(self, factor: float, window: int) -> None:
        self._detector = SpikeDetector(factor, window, warmup=window)
        self._pending: dict[int, tuple[int, list[float]]] = {}  # step -> (expected, losses)
        self._judged = -1       # the newest step judged (or passed over) so far
        self._newest = -1
        self._history = 0

    def observe(self, step: int, loss: float, replicas: int, history: int = 0
                ) -> LossSpike | None:
        """One replica's loss of ``step``, which ``replicas`` replicas trained; the first
        spike among the steps this completes, if any."""
        if history < self._history or not math.isfinite(loss):
            return None
        if history > self._history:
            self._history, self._pending, self._judged, self._newest = history, {}, -1, -1
        if step <= self._judged:
            return None     # late: that step was judged without it
        _, losses = self._pending.setdefault(step, (max(replicas, 1), []))
        losses.append(loss)
        self._newest = max(self._newest, step)
        return self._judge()

    def _judge(self) -> LossSpike | None:
        found = None
        for step in sorted(self._pending):
            expected, losses = self._pending[step]
            if len(losses) < expected and step > self._newest - self.LAG:
                break       # its other replicas may still report it
            del self._pending[step]
            self._judged = step
            mean = statistics.fmean(losses)
            baseline = self._detector.observe(mean)
            if baseline is not None and found is None:
                found = LossSpike(step, mean, baseline, len(losses))
        return found
