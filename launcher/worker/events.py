"""Events of the worker runtime (JSON lines, one file per rank)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ft_launch.events import Event
from ft_launch.launcher.quorum import events as quorum_events  # noqa: F401  same log: register them too


@dataclass(frozen=True)
class WorkerStarted(Event):
    replica_id: int
    rank: int
    next_step: int


@dataclass(frozen=True)
class StepCommitted(Event):
    replica_id: int
    rank: int
    step: int
    quorum_id: int
    contributors: int
    caught_up: bool
    lr_factor: float
    loss: float | None = None    # when the training script hands it to commit()
    grad_norm: float | None = None   # of this rank's reduced gradients (its shard)
    #: from start_step to the commit, and the part of it this rank waited for the
    #: others (the ring's last transfers, the replica's vote): step_s - wait_s is its
    #: own pace, which the controller compares across replicas (fail-slow)
    step_s: float | None = None
    wait_s: float | None = None
    #: the rollbacks the state it trains has been through (``worker.rollbacks``)
    history: int = 0


@dataclass(frozen=True)
class StepDiscarded(Event):
    replica_id: int
    rank: int
    step: int
    quorum_id: int
    reason: str
    #: the nodes whose ranks' own gradients held NaN/Inf before the reduction (rank 0
    #: tells the controller: silent data corruption is suspected there)
    nonfinite_nodes: list[str] = field(default_factory=list)
    nonfinite_values: int = 0    # how many gradient values this replica's ranks computed so


@dataclass(frozen=True)
class ControllerLost(Event):
    """This rank stopped training: the controller's heartbeat stopped."""

    replica_id: int
    rank: int
    next_step: int
    reason: str


@dataclass(frozen=True)
class AllocationEnding(Event):
    """After the controller was lost: the newest state saved (``saved_step``, None if
    this replica saved nothing), written just before the job is requeued (or cancelled
    if it cannot be). Not after: the requeue ends this process with the rest of the job."""

    replica_id: int
    saved_step: int | None


@dataclass(frozen=True)
class WorkerStopped(Event):
    """This rank closed its runtime; what its FTAR ring carried over the whole run."""

    replica_id: int
    rank: int
    next_step: int
    ftar_ops: int
    ftar_ops_failed: int
    ftar_bytes_sent: int
    ftar_bytes_received: int
    #: its script ended normally (the run is over), not by an error, SIGTERM or an exit
    finished: bool = False


@dataclass(frozen=True)
class StateRestored(Event):
    """At start: every rank of the replica restored ``step`` (the newest they all hold
    soundly) from ``tier`` (ft_launch.ckpt.restore.TierKind: a backup peer's copy, a disk tier);
    ``skipped``: copies passed over, and why."""

    replica_id: int
    rank: int
    step: int
    tier: str
    skipped: list[str] = field(default_factory=list)
