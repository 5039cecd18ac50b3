"""What one step of the protocol is made of (torch-free): the model + optimizer as the
protocol sees them (``TrainState``), a gradient reduction's view of its step
(``Reduction``), and the step's own state from its start to its commit or drop
(``StepContext``, one per step: nothing of a step outlives it by hand-reset fields).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ft_launch.ckpt.manifest import Bytes, Manifest
from ft_launch.ckpt.snapshot import DualBufferSnapshotter, StateSource
from ft_launch.ftar import FtarGroup

from .controller_loss import ControllerLostNotice
from .ledger import StepContribution
from .protocol import StepPlan


@dataclass
class GradientNorm:
    """The L2 norm of this rank's reduced gradients in one step, summed up reduction by
    reduction (on the one exchange thread)."""

    squares: float = 0.0

    def add(self, norm: float) -> None:
        self.squares += norm * norm

    @property
    def value(self) -> float:
        return math.sqrt(self.squares)


@dataclass(frozen=True)
class Reduction:
    """What a gradient reduction needs of its step: this rank's ring, the step, and
    whether this replica's gradients count (False: it catches up and sends zeros)."""

    ftar: FtarGroup
    step: int
    contributes: bool
    norm: GradientNorm = field(default_factory=GradientNorm)   # the step's, accumulated
    #: the step observer's change to each gradient tensor before it is averaged (in
    #: place; a drill's NaN or loss spike, ``observer``); None in production
    alter: Callable[[Any], None] | None = None


class TrainState(Protocol):
    """What the protocol needs of a model + optimizer (see ``torch_api``)."""

    def reduce_gradients(self, reduction: Reduction) -> None: ...   # after backward
    def finish_gradients(self) -> None: ...   # all reductions done: gradients final
    def zero_gradients(self) -> None: ...     # the step is dropped
    def begin_step(self) -> None: ...         # a step starts (a dropped one's effects undone)
    def set_gradient_sync(self, sync: bool) -> bool: ...   # Manager.no_sync; the old setting
    def model_digest(self) -> str: ...        # of this rank's parameters and buffers
    def copy_model(self, ftar: FtarGroup, step: int, source: bool) -> None: ...   # the source's
    def register_state(self, name: str, obj: Any) -> None: ...   # see Manager.register_state
    def apply(self, lr_factor: float) -> None: ...        # the optimizer step
    def snapshot_source(self, step: int, loader_state: Mapping[str, Any]) -> StateSource: ...
    def bind_snapshots(self, snapshots: DualBufferSnapshotter) -> None: ...
    def load(self, manifest: Manifest, buffer: Bytes) -> Mapping[str, Any]: ...


@dataclass(eq=False)
class StepContext:
    """One step of this rank, made by ``Manager.start_step``. The exchange thread fills
    in what the quorum and the contribution all-reduce decide (``plan`` first, then
    ``planned`` is set); the training thread records what the commit needs and reports.
    It stays the manager's last step after its commit or drop (``open`` False) until
    the next step starts."""

    #: set once the quorum answered (with a plan, or an error)
    planned: threading.Event = field(default_factory=threading.Event)
    plan: StepPlan | None = None
    #: rank 0 found the controller lost (``controller_loss``): the step's members stop
    stopping: ControllerLostNotice | None = None
    #: the samples every replica contributes (the contribution all-reduce)
    contribution: StepContribution | None = None
    #: the fetch of the others' state, for a replica that catches up
    catch_up: Any = None
    #: why this rank fails the step (the commit votes it down)
    error: BaseException | None = None
    #: not yet committed or dropped
    open: bool = True
    #: the gradients went to the cross-replica average (``allreduce_gradients``)
    exchanged: bool = False
    #: a gradient reduction runs (on the exchange thread): ring progress is mid-all-reduce
    reducing: bool = False
    #: what the commit reports: when the step started, how long this rank waited for
    #: the others (the ring, the replica's vote), its reduced gradients' norm
    started: float = field(default_factory=time.monotonic)
    waited: float = 0.0
    norm: GradientNorm = field(default_factory=GradientNorm)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time inside as waited for the others."""
        since = time.monotonic()
        try:
            yield
        finally:
            self.waited += time.monotonic() - since
