"""Loss spike -> rollback (pure): the controller's rule when the job's loss spikes,
one part of the one decision (``lifecycle.decide`` dispatches ``LossSpikeFound``
here).

The shell feeds every replica's rank-0 commit loss to ``ft_launch.health.anomaly.
StepLossSpikes`` (per step the mean over the replicas that trained it, against the
median of the ``recovery.spike_window`` steps before). A spike is recorded
(``LossSpiked``); under ``recovery.spike_policy = "rollback"`` every replica is rolled
back to its newest state from before the spiking step K, and trains on from there
with the data positions of that state: the batches after it are trained again.

How, with the parts that exist: every replica is restarted in place, as an update
restart is (``recovery.RestartRequested``: not a failure; no eviction, drain,
requeue or failure count), all cancelled before any is launched again, and every
launch from then on carries the run's rollbacks (``FTL_WORKER_ROLLBACKS``, the K of
each; ``worker.rollbacks``). The processes are gone, so their in-memory snapshots
are too; what is left is what the restore chain of a restarted replica reads: the
peer backups that its nodes' tmpfs kept (memory that outlives the process:
``ckpt.backup_every``, the two newest per source), else the persistent tier, else
nothing (step 0). Each state records its history (how many rollbacks it had been
through), and a state of a rolled-back step is never restored, now or later. A
process from before the rollback that Slurm has not ended yet is no peer: replicas
of different histories never share a quorum's ring, so none catches up from the
spike. An in-process rollback agreed through the quorum would keep the processes,
but every replica would have to switch at one step while the quorum orders them by
step for catch-up, and no process holds a snapshot older than two steps.

Bounds: at most ``recovery.max_rollbacks`` a run, then reported only; a spike at a
step within ``spike_window`` of the last one rolled back is the same one coming
back (its data, most likely): reported only, not rolled back forever. A spike of a
history already rolled back (lines read late) is passed over.
"""

from __future__ import annotations

from dataclasses import dataclass

from ft_launch.config import Config, SpikePolicy

from . import recovery
from .events import LossSpiked
from .run_state import ReplicaState, RunState


@dataclass(frozen=True)
class LossSpikeFound:
    """The job's mean loss spiked at ``step`` (``ft_launch.health.anomaly.LossSpike``), in commits
    of history ``history`` (the rollbacks their state had been through)."""

    step: int
    loss: float
    baseline: float
    replicas: int
    history: int = 0


@dataclass(frozen=True)
class SpikeRules:
    policy: SpikePolicy = SpikePolicy.ROLLBACK
    max_rollbacks: int = 3
    window: int = 20        # recovery.spike_window: a spike this close to the last is it

    @classmethod
    def from_config(cls, config: Config) -> SpikeRules:
        recovery = config.recovery
        return cls(recovery.spike_policy, recovery.max_rollbacks, recovery.spike_window)


@dataclass(frozen=True)
class Outcome:
    run: RunState
    #: the spiking step of every rollback so far, in order (``worker.rollbacks``)
    rolled_back: tuple[int, ...]
    actions: list[recovery.RecoveryAction | LossSpiked]
    reason: str


def decide(run: RunState, rolled_back: tuple[int, ...], event: LossSpikeFound,
           rules: SpikeRules, wall: float) -> Outcome:
    if event.history != len(rolled_back) or rules.policy is SpikePolicy.OFF:
        return Outcome(run, rolled_back, [], f"loss spike at step {event.step} of history "
                                             f"{event.history} passed over (the run is in "
                                             f"history {len(rolled_back)})")
    spike = (f"loss spike at step {event.step}: mean loss {event.loss:.4g} over "
             f"{event.replicas} replica(s), {event.loss / event.baseline:.1f}x the median "
             f"{event.baseline:.4g} of the steps before")
    live = [r.replica_id for r in run.replicas if not r.retired]
    why_not = _why_not(run, rolled_back, event, rules, live)
    action = "report" if why_not else "rollback"
    reason = f"{spike}: {why_not}" if why_not else \
        f"{spike}: every replica restarts from its newest state before step {event.step}"
    record = LossSpiked(step=event.step, loss=event.loss, baseline=event.baseline,
                        replicas=event.replicas, action=action, reason=reason, time=wall)
    if why_not:
        return Outcome(run, rolled_back, [record], reason)
    cancels: list[recovery.RecoveryAction] = []
    launches: list[recovery.RecoveryAction] = []
    for replica_id in live:
        run, restart = recovery.decide(run, recovery.RestartRequested(replica_id, reason))
        cancels += [a for a in restart if isinstance(a, recovery.CancelReplica)]
        launches += [a for a in restart if not isinstance(a, recovery.CancelReplica)]
    # every old process is stopped before a new one starts (and the histories keep
    # apart the ones Slurm ends late)
    return Outcome(run, (*rolled_back, event.step), [record, *cancels, *launches], reason)


def _why_not(run: RunState, rolled_back: tuple[int, ...], event: LossSpikeFound,
             rules: SpikeRules, live: list[int]) -> str:
    """Why the spike is reported only ("" to roll back)."""
    if rules.policy is SpikePolicy.REPORT:
        return "reported (recovery.spike_policy = report)"
    if len(rolled_back) >= rules.max_rollbacks:
        return (f"reported: {len(rolled_back)} rollback(s) already, the most a run gets "
                "(recovery.max_rollbacks)")
    if rolled_back and event.step <= rolled_back[-1] + rules.window:
        return (f"reported: it came back within {rules.window} steps of the spike at step "
                f"{rolled_back[-1]} rolled back (its data, not a fault)")
    if any(r.state is ReplicaState.FINISHED for r in run.replicas):
        return "reported: training finished"
    if not live:
        return "reported: no replica left to roll back"
    return ""
