"""Scripted fault injection for the tests, the demo and the benchmarks (lab tooling:
no product module imports it). A worker loads it as its step observer
(``ft_launch.launcher.worker.observer``) when ``FTL_WORKER_OBSERVER`` names this file
(``tests.faults.INJECTOR``; the tests set it for every worker they start, the demo
and the benchmarks where they inject), and then fires what ``FTL_WORKER_INJECT``
asks for at the step protocol's points (``FaultObserver``):

``FTL_WORKER_INJECT="kill@mid_allreduce:7,stop@after_commit:12"`` makes this worker
SIGKILL itself in the middle of step 7's gradient all-reduce (after the
reduce-scatter, before the all-gather) and SIGSTOP itself after committing step
12. ``kill@mid_allreduce:7/1`` fires on rank 1 of the replica only (default: every
rank). ``hang@before_commit:40/1`` deadlocks rank 1 before step 40's commit vote: its
training thread blocks for good on a lock it already holds (alive, stack readable,
nothing but SIGKILL ends it), while rank 0 waits for it in the vote.
``nan@gradients:9`` puts a NaN into this rank's first gradient contribution of step 9
(silent data corruption). ``spike@loss:85`` makes step 85's loss a spike: the loss
this rank reports is ``SPIKE_SCALE`` times what it computed, and so are its gradients
of that step (the weights of every replica are really hurt, through the all-reduce).

Each fault fires once per run: when it fires, a marker file in the run directory
(``faults/replica-R-rank-K/``) says so, and no later incarnation of that rank fires
it again, even where the step comes again (a rollback, a restart from a
checkpoint). ``STEP+`` fires at that step and every one after (a broken GPU), and a
last ``@NODE`` limits it to the workers on that node: ``nan@gradients:30+@n3``
corrupts whatever trains on n3 from step 30 on, and stops once n3 is replaced.

A node's own silent data corruption comes from the simulated GPU backend instead
(``ft_launch.health.simulation``: ``{"sdc": true}`` in the node's fault file, switched on and
off while the run goes on): ``node_sdc_probe`` says whether it is on, and
``corrupt_gradients_while`` flips a bit of the gradient backward starts from on that
node, in training and in a replay alike (the node is bad, not the step).

This file imports only ``ft_launch`` (and torch where a model is hooked): a worker
loads it by its path, without the checkout on its import path.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_launch.config import Config, HealthConfig
from ft_launch.env import ENV_INJECT
from ft_launch.errors import ConfigError, UsageError
from ft_launch.launcher.worker.identity import WorkerIdentity
from ft_launch.launcher.worker.observer import AlterGradients, StepObserver

log = logging.getLogger(__name__)
#: what ``spike@loss`` multiplies a step's loss and gradients by: far above any
#: sensible ``recovery.spike_factor``
SPIKE_SCALE = 20.0


class FaultPoint(enum.Enum):
    START_STEP = "start_step"          # after the quorum answered
    MID_ALLREDUCE = "mid_allreduce"    # between reduce-scatter and all-gather
    BEFORE_COMMIT = "before_commit"    # all-reduce done, commit vote not yet cast
    AFTER_COMMIT = "after_commit"      # optimizer step and snapshot started
    GRADIENTS = "gradients"            # this rank's gradients, before they are reduced
    LOSS = "loss"                      # the step's loss and gradients (as they are computed)


class FaultAction(enum.Enum):
    KILL = "kill"              # SIGKILL: the process vanishes
    STOP = "stop"              # SIGSTOP: a hang (resumed by the test with SIGCONT)
    HANG = "hang"              # a deliberate deadlock of the thread that reaches the point
    RAISE = "raise"            # an exception in the training process
    NAN = "nan"                # a NaN in the gradients (at the gradients point only)
    SPIKE = "spike"            # the loss and the gradients scaled up (at the loss point only)


@dataclass(frozen=True)
class InjectedFault:
    action: FaultAction
    point: FaultPoint
    step: int
    rank: int | None = None     # None: every rank of the replica
    onwards: bool = False       # every step from ``step`` on, not just that one
    node: str | None = None     # None: on every node

    @property
    def marker(self) -> str:
        """The name of the file that says it fired (one-shot faults)."""
        return f"{self.action.value}-{self.point.value}-{self.step}"


def parse_faults(text: str) -> tuple[InjectedFault, ...]:
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            action, rest, *node = item.split("@")
            point, when = rest.split(":")
            step, _, rank = when.partition("/")
            if len(node) > 1 or node == [""]:
                raise ValueError(item)
            fault = InjectedFault(FaultAction(action), FaultPoint(point),
                                  int(step.removesuffix("+")), int(rank) if rank else None,
                                  step.endswith("+"), node[0] if node else None)
            if (fault.action is FaultAction.SPIKE) != (fault.point is FaultPoint.LOSS):
                raise ValueError(item)
            faults.append(fault)
        except ValueError:
            raise UsageError(f"bad {ENV_INJECT} item {item!r}",
                             hint="write ACTION@POINT:STEP[+][/RANK][@NODE], ACTION in "
                                  f"{[a.value for a in FaultAction]}, POINT in "
                                  f"{[p.value for p in FaultPoint]} (spike at loss "
                                  "only)") from None
    return tuple(faults)


class FaultInjector:
    """``fired``: the directory of this rank's markers (None: faults fire once per
    process)."""

    def __init__(self, faults: tuple[InjectedFault, ...] = (), fired: Path | None = None
                 ) -> None:
        self.fired = fired
        self.pending = [f for f in faults
                        if f.onwards or fired is None or not (fired / f.marker).exists()]

    @staticmethod
    def from_env(rank: int = 0, node: str = "", fired: Path | None = None) -> FaultInjector:
        """The faults of ``FTL_WORKER_INJECT`` that fire on ``rank`` on ``node`` and
        have not fired in this run yet (markers in ``fired``)."""
        return FaultInjector(tuple(f for f in parse_faults(os.environ.get(ENV_INJECT, ""))
                                   if f.rank in (None, rank) and f.node in (None, node)), fired)

    def _due(self, point: FaultPoint, step: int) -> list[InjectedFault]:
        return [f for f in self.pending if f.point is point
                and (f.step == step or (f.onwards and step >= f.step))]

    def armed(self, point: FaultPoint, step: int) -> bool:
        return bool(self._due(point, step))

    def check(self, point: FaultPoint, step: int) -> bool:
        """Fire the faults due here; True if one corrupts data (``nan``, ``spike``)
        rather than the process, which the caller then does."""
        corrupt = False
        for fault in self._due(point, step):
            if not fault.onwards:
                self.pending.remove(fault)
                self._mark(fault)       # first: a kill leaves no time after
            log.warning("injecting fault: %s at %s of step %d", fault.action.value,
                        point.value, step)
            if fault.action in (FaultAction.NAN, FaultAction.SPIKE):
                corrupt = True
            elif fault.action is FaultAction.KILL:
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action is FaultAction.STOP:
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.action is FaultAction.HANG:
                injected_deadlock()
            else:
                raise RuntimeError(f"injected fault at {point.value} of step {step}")
        return corrupt

    def _mark(self, fault: InjectedFault) -> None:
        if self.fired is None:
            return
        try:
            self.fired.mkdir(parents=True, exist_ok=True)
            (self.fired / fault.marker).touch()
        except OSError as error:     # a drill tool: the fault fires all the same
            log.warning("fault %s not marked as fired in %s: %s", fault.marker, self.fired,
                        error)


def injected_deadlock() -> None:
    """Block the calling thread forever as a real deadlock does: on a lock it already
    holds. Its stack shows this frame (what a hang diagnosis should find)."""
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def node_sdc_probe(health: HealthConfig, node: str) -> Callable[[], bool] | None:
    """On the simulated GPU backend with a fault directory (tests, the lab cluster):
    a check of whether ``node``'s fault file says it corrupts data now (one read of a
    small file, or of none, per step). None elsewhere: real GPUs are not simulated."""
    if health.backend != "simulated" or not health.sim_fault_dir:
        return None
    from ft_launch.health.simulation import SimulatedNvml, fault_file

    backend = SimulatedNvml(0, fault_file(health.sim_fault_dir, node))
    complained: list[str] = []

    def corrupting() -> bool:
        try:
            return backend.faults().sdc
        except ConfigError as error:     # a fault file being edited, or a typo in it
            if str(error) not in complained:
                complained.append(str(error))
                log.warning("fault file of %s ignored: %s", node, error)
            return False
    return corrupting


def corrupt_gradients_while(model: Any, corrupting: Callable[[], bool]) -> None:
    """Silent data corruption on this node (``node_sdc_probe``): while
    ``corrupting()``, one bit of the gradient of the model's output (a torch module's)
    flips before backward goes on from it, so this rank's every local gradient is off
    before FSDP's reduce-scatter (or DDP's all-reduce) mixes it into every rank's shard."""
    import torch  # here: the injector's other users (unit tests, the demo) need no torch

    # The integer view and the top exponent bit of each float format: flipped in 1.0
    # (the gradient of a loss, where backward starts) it gives +Inf in every one of them.
    top_exponent_bit = {torch.float32: (torch.int32, 1 << 30),
                        torch.bfloat16: (torch.int16, 1 << 14),
                        torch.float16: (torch.int16, 1 << 14)}

    def flip(grad: torch.Tensor) -> torch.Tensor:
        flipped = grad.clone()
        kind, bit = top_exponent_bit[grad.dtype]
        flipped.view(-1)[:1].view(kind).bitwise_xor_(bit)
        return flipped

    def on_output(module: torch.nn.Module, inputs: Any, output: Any) -> None:
        if (isinstance(output, torch.Tensor) and output.requires_grad
                and output.dtype in top_exponent_bit and corrupting()):
            output.register_hook(flip)
    model.register_forward_hook(on_output)


class FaultObserver(StepObserver):
    """The drills' step observer: ``injector``'s faults at the step protocol's points,
    and the node's simulated silent data corruption (``corrupting``, if simulated)."""

    def __init__(self, injector: FaultInjector,
                 corrupting: Callable[[], bool] | None = None) -> None:
        self.injector = injector
        self.corrupting = corrupting
        self._spiked: int | None = None    # the step whose loss and gradients spike

    def attach(self, model: Any) -> None:
        if self.corrupting is not None:
            corrupt_gradients_while(model, self.corrupting)

    def step_started(self, step: int) -> None:
        self.injector.check(FaultPoint.START_STEP, step)
        self._spiked = step if self.injector.check(FaultPoint.LOSS, step) else None

    def gradients(self, step: int) -> AlterGradients | None:
        nan = self.injector.check(FaultPoint.GRADIENTS, step)
        scale = SPIKE_SCALE if self._spiked == step else 1.0
        if not nan and scale == 1.0:
            return None

        def alter(tensor: Any) -> None:
            if nan:                     # into this rank's contribution, before averaging
                tensor.view(-1)[0] = float("nan")
            if scale != 1.0:            # the spike's gradients, as its loss
                tensor.mul_(scale)
        return alter

    def mid_allreduce(self, step: int) -> None:
        self.injector.check(FaultPoint.MID_ALLREDUCE, step)

    def before_commit(self, step: int) -> None:
        self.injector.check(FaultPoint.BEFORE_COMMIT, step)

    def after_commit(self, step: int) -> None:
        self.injector.check(FaultPoint.AFTER_COMMIT, step)

    def loss(self, step: int, loss: float) -> float:
        return loss * SPIKE_SCALE if self._spiked == step else loss


def step_observer(config: Config, identity: WorkerIdentity) -> FaultObserver:
    """What ``FTL_WORKER_OBSERVER=<this file>`` makes of a worker: the faults of
    ``FTL_WORKER_INJECT`` for its rank and node, each fired once per run (markers under
    the run directory), and its node's simulated corruption."""
    tag = f"replica-{identity.replica_id}-rank-{identity.rank}"
    return FaultObserver(FaultInjector.from_env(identity.rank, identity.node,
                                                fired=identity.run_dir / "faults" / tag),
                         node_sdc_probe(config.health, identity.node))
