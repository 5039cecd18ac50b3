"""Resident state: Adam writes the next step's state straight into the snapshot buffer.

A copying snapshot (``snapshot.py``) moves the whole state (1.2 GB for a 100M
model with Adam) through memory once more every step. On a GPU that copy is a
DMA beside the compute; on a CPU trainer it competes with the compute for the
same cores and memory bandwidth, and costs a few percent of a step however it
is scheduled (measurements: benchmarks/results/measurements.md#resident-state).
Here there is no copy: the parameters and Adam moments *live* in the dual
buffer, and the optimizer step is computed out of place, reading step n from the
buffer that holds it and writing step n+1 into the other one, which is the
memory traffic an in-place step has anyway. Afterwards the parameters point at
the new buffer; the old one still holds step n, complete, for restore, serving
and backup. The small rest (model buffers, RNG, step counters, JSON meta) is
copied by ``start`` as usual.

Per step, exactly as with copying snapshots::

    snapshotter.wait_ready()
    optimizer.step()                               # ResidentAdam: claims the buffer
    snapshotter.start(step, residency.source(step, loader_state))   # commits it

What changes for a user:

* parameters must change only in ``optimizer.step()`` (or while the state is
  ``released``): an in-place edit elsewhere would edit a complete snapshot;
* if a reader still holds the buffer the step must write (a slow fetch of the
  previous snapshot), the step waits for it up to ``wait`` seconds; then it
  moves the state to private memory (``release``, one copy), updates it there,
  and that step's snapshot is skipped, as a copying snapshot would skip it;
* CPU parameters only: on CUDA the copy is already off the critical path.

Sharded parameters (FSDP2, DTensor) work the same on their local shards: the
homes are the local tensors, the step reads and writes ``p.to_local()`` and
``p.grad.to_local()``. FSDP2 all-gathers a parameter from a padded buffer of its
own, not from the DTensor, so after each move it is told where the shard now
lives: ``FSDPParam.reset_sharded_param``, the hook torch itself runs after
``load_state_dict``. That is private torch API (checked against torch 2.13);
``Residency`` raises ``TypeError`` if it is missing, and the caller falls back to
a copying snapshot. A shard FSDP2 must pad (dim 0 not divisible by the mesh
size) or pin (CPU offload with pinned memory) is re-copied by that hook into
private memory after each step, so it is snapshotted by copy like any other
tensor outside the buffer: correct, only not resident (logged once).

The numbers are those of ``torch.optim.Adam`` / ``AdamW`` (``foreach=False``):
the same kernels in the same order, bit for bit (tested).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .errors import SnapshotFailedError
from .snapshot import DualBufferSnapshotter
from .torch_state import (
    MODEL,
    OPTIM,
    TorchStateSource,
    as_tensor,
    is_sharded,
    local_tensor,
)

log = logging.getLogger(__name__)

#: Where one parameter's step writes: (parameter, exp_avg, exp_avg_sq).
Home = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: Called by the optimizer at each step: the homes of its parameters, in order.
HomeFinder = Callable[[], Sequence[Home]]

#: Seconds a step waits for a reader of the buffer it must write (then falls back).
READER_WAIT = 1.0


class ResidentAdam(torch.optim.Optimizer):
    """Adam (``decoupled_weight_decay``: AdamW) that computes out of place into
    the homes a ``Residency`` gives it; unbound, it updates in place like torch's.

    The moments exist from construction (torch creates them at the first
    step), so a snapshot has the same layout from the first step on.

    Args:
        params: the parameters or parameter groups, as torch's optimizers take them.
        lr: the learning rate.
        betas: the decay rates of the gradient's running average and of its square's.
        eps: added to the denominator.
        weight_decay: the weight decay (L2 penalty; decoupled with
            ``decoupled_weight_decay``).
        decoupled_weight_decay: AdamW's decoupled weight decay.

    Raises:
        ValueError: a negative ``lr``, ``eps`` or ``weight_decay``; a beta outside
            ``[0, 1)``; a CUDA parameter (use ``torch.optim.Adam`` there); no
            parameters (torch's check).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, decoupled_weight_decay: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"ResidentAdam: invalid lr={lr}, betas={betas}, eps={eps} or "
                             f"weight_decay={weight_decay} (expected lr, eps, weight_decay "
                             f">= 0 and betas in [0, 1))")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps,
                                  "weight_decay": weight_decay,
                                  "decoupled_weight_decay": decoupled_weight_decay})
        for group in self.param_groups:
            for p in group["params"]:
                if p.is_cuda:
                    raise ValueError("ResidentAdam keeps parameters in host snapshot buffers; "
                                     "on CUDA use torch.optim.Adam (the snapshot copy runs "
                                     "on its own stream there)")
                self.state[p] = {"step": torch.tensor(0.0),
                                 "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                 "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        self.homes: HomeFinder | None = None
        #: Called after a step that moved parameters to new homes (``Residency``).
        self.moved: Callable[[], None] | None = None

    def params_in_order(self) -> list[torch.Tensor]:
        """Parameters in ``state_dict`` order (its integer state keys index this list)."""
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        homes = self.homes() if self.homes is not None else None
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                home = homes[index] if homes is not None else None
                index += 1
                state = self.state[p]
                if p.grad is None:
                    if home is not None:  # unchanged, but the new snapshot must hold it too
                        _move_home(p, state, home, copy=True)
                    continue
                self._update(group, p, state, home)
        if homes is not None and self.moved is not None:
            self.moved()
        return loss

    @staticmethod
    def _update(group: Mapping[str, Any], p: torch.Tensor, state: dict[str, Any],
                home: Home | None) -> None:
        """torch's single-tensor Adam, with every result written to ``home``."""
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        weight_decay = group["weight_decay"]
        assert p.grad is not None  # step() skips parameters without one
        # Local shards of sharded tensors: the same element-wise kernels, per rank.
        param, grad = local_tensor(p), local_tensor(p.grad)
        exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        out_param, out_avg, out_sq = home if home is not None else (param, exp_avg, exp_avg_sq)
        state["step"] += 1
        if weight_decay != 0:
            if group["decoupled_weight_decay"]:
                torch.mul(param, 1 - lr * weight_decay, out=out_param)
                param = out_param
            else:
                grad = grad.add(param, alpha=weight_decay)
        torch.lerp(exp_avg, grad, 1 - beta1, out=out_avg)
        torch.mul(exp_avg_sq, beta2, out=out_sq).addcmul_(grad, grad, value=1 - beta2)
        step = state["step"].item()
        bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
        denom = (out_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        torch.addcdiv(param, out_avg, denom, value=-(lr / (1 - beta1 ** step)), out=out_param)
        if home is not None:
            _move_home(p, state, home, copy=False)


def ResidentAdamW(params: Iterable[Any], lr: float = 1e-3,
                  betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                  weight_decay: float = 1e-2) -> ResidentAdam:
    """``torch.optim.AdamW``'s defaults and decoupled weight decay.

    Args:
        params: the parameters or parameter groups, as torch's optimizers take them.
        lr: the learning rate.
        betas: the decay rates of the gradient's running average and of its square's.
        eps: added to the denominator.
        weight_decay: the decoupled weight decay.

    Returns:
        A ``ResidentAdam`` with ``decoupled_weight_decay=True``.

    Raises:
        ValueError: as ``ResidentAdam``.
    """
    return ResidentAdam(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)


def _move_home(p: torch.Tensor, state: dict[str, Any], home: Home, *, copy: bool) -> None:
    """Point the parameter and its moments at ``home`` (copying them there first)."""
    new_param, new_avg, new_sq = home
    if copy:
        for old, new in ((p, new_param), (state["exp_avg"], new_avg),
                         (state["exp_avg_sq"], new_sq)):
            old_local = local_tensor(old)
            if old_local.data_ptr() != new.data_ptr():
                new.copy_(old_local)
    _rebind(p, new_param)
    # The moments stay the same objects (a DTensor each, rebound like the parameter):
    # a new DTensor per moment per step cost more than the step's arithmetic, and the
    # snapshot sources recognise unchanged objects (``TorchStateSource(previous=)``).
    for key, new in (("exp_avg", new_avg), ("exp_avg_sq", new_sq)):
        if is_sharded(state[key]):
            _rebind(state[key], new)
        else:
            state[key] = new


def _rebind(p: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` the memory of ``p``, a parameter or a moment (its local shard
    if sharded)."""
    if not is_sharded(p):
        p.data = local
    elif p._local_tensor is not local:  # type: ignore[attr-defined]
        # A DTensor's bytes are its _local_tensor (``.data`` would not reach
        # them); FSDP2 rebinds it the same way in reset_sharded_param.
        p._local_tensor = local  # type: ignore[attr-defined]


class Residency:
    """Keeps a model's parameters and its ``ResidentAdam`` moments in the
    snapshot buffers of ``snapshots``; builds the snapshot sources that match.

    ``stateful`` and ``rng`` must be what every snapshot of this state is
    built with (``source`` does that): the optimizer writes into the layout
    they give, and ``start`` refuses a snapshot laid out otherwise.

    Raises ``TypeError`` when sharded parameters cannot be kept resident (FSDP2
    internals of another torch version, or parameters FSDP2 does not list);
    the optimizer is then left unbound, an ordinary in-place Adam, to be
    snapshotted by copy (``TorchStateSource``).
    """

    def __init__(self, model: torch.nn.Module, optimizer: ResidentAdam,
                 snapshots: DualBufferSnapshotter, *, stateful: Any = None, rng: bool = True,
                 wait: float = READER_WAIT) -> None:
        self.model = model
        self.optimizer = optimizer
        self.snapshots = snapshots
        self.stateful = stateful
        self.rng = rng
        self.wait = wait
        self._names = self._home_names()
        self._fsdp = _FsdpShards(model, optimizer.params_in_order())
        #: the newest source built: the next one reuses what did not change, and the
        #: next claim its layout (the state's tensors are the same from step to step)
        self._last: TorchStateSource | None = None
        optimizer.homes = self._claim_homes
        optimizer.moved = self._fsdp.sync

    def source(self, step: int, loader_state: Mapping[str, Any] | None = None
               ) -> TorchStateSource:
        self._last = TorchStateSource(self.model, self.optimizer, self.stateful, step=step,
                                      loader_state=loader_state, rng=self.rng,
                                      previous=self._last)
        return self._last

    def release(self) -> None:
        """Give the parameters and moments private memory again, before anything
        other than the optimizer writes them (loading a restored or fetched
        state); the next step moves them back into the buffers."""
        self._last = None    # its tensors are no longer the state's
        with torch.no_grad():
            for p in self.optimizer.params_in_order():
                state = self.optimizer.state[p]
                _rebind(p, local_tensor(p).clone())
                state["exp_avg"] = state["exp_avg"].clone()
                state["exp_avg_sq"] = state["exp_avg_sq"].clone()
        self._fsdp.sync()

    def _where_they_are(self) -> list[Home]:
        """Homes that are the tensors themselves: the step updates them in place."""
        return [(local_tensor(p), local_tensor(self.optimizer.state[p]["exp_avg"]),
                 local_tensor(self.optimizer.state[p]["exp_avg_sq"]))
                for p in self.optimizer.params_in_order()]

    def _home_names(self) -> list[tuple[str, str, str]]:
        """For each parameter in optimizer order: its three names in a snapshot."""
        key_of = {id(t): key for key, t in self.model.state_dict(keep_vars=True).items()}
        names = []
        for index, p in enumerate(self.optimizer.params_in_order()):
            if id(p) not in key_of:
                raise ValueError(f"ResidentAdam parameter {index} ({tuple(p.shape)}) is not a "
                                 f"parameter of the model given to Residency")
            names.append((MODEL + key_of[id(p)], f"{OPTIM}{index}/exp_avg",
                          f"{OPTIM}{index}/exp_avg_sq"))
        return names

    def _claim_homes(self) -> list[Home]:
        # The layout of a snapshot of this state: the step and loader state are
        # JSON meta, so any values describe the same tensors.
        descs = (self._last or self.source(0)).describe()
        try:
            specs, buffer = self.snapshots.claim(descs, self.wait)
        except SnapshotFailedError as exc:
            # The other buffer is still read and this one holds the newest snapshot:
            # this step updates private memory, and its snapshot will be skipped.
            log.warning("resident state: %s; this step runs in private memory", exc)
            self.release()
            return self._where_they_are()
        by_name = {spec.name: spec for spec in specs}

        def view(name: str) -> torch.Tensor:
            spec = by_name[name]
            return as_tensor(spec.raw(buffer), spec.dtype, spec.shape)
        return [(view(p), view(a), view(s)) for p, a, s in self._names]


#: What ``_FsdpShards`` uses of FSDP2's private ``FSDPParam`` (torch 2.13).
_FSDP_PARAM_API = ("sharded_param", "reset_sharded_param", "padded_sharded_param_size",
                   "pin_memory")


class _FsdpShards:
    """The FSDP2 bookkeeping of a model's sharded parameters, told when they move.

    FSDP2 all-gathers from ``FSDPParam._sharded_param_data``, a padded buffer it
    keeps beside the DTensor; ``reset_sharded_param`` points it at the DTensor's
    current local tensor (or re-pads that into a new buffer if it must).
    """

    def __init__(self, model: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
        self._params: list[Any] = []
        if not any(is_sharded(p) for p in params) or "torch.distributed.fsdp" not in sys.modules:
            return  # nothing FSDP2 manages (plain, or DTensors of tensor parallelism only)
        by_id = self._fsdp_params(model)
        unknown = [i for i, p in enumerate(params) if is_sharded(p) and id(p) not in by_id]
        if by_id and unknown:
            # FSDP2 would go on all-gathering their old shards: training would be wrong.
            raise TypeError(f"Residency: sharded parameters {unknown} are not among the "
                            f"sharded parameters FSDP2 manages in this model (was the "
                            f"optimizer built while the model was unsharded?); build it "
                            f"from model.parameters() after fully_shard, or use a copying "
                            f"snapshot")
        self._params = [by_id[id(p)] for p in params if id(p) in by_id]
        private = [fp for fp in self._params
                   if tuple(local_tensor(fp.sharded_param).shape)
                   != tuple(fp.padded_sharded_param_size) or fp.pin_memory]
        if private:
            log.warning("resident state: %d of %d FSDP2 shards are padded or pinned by FSDP2 "
                        "(dim 0 not divisible by the mesh size, or pinned CPU offload); "
                        "those are copied into each snapshot, not resident",
                        len(private), len(self._params))

    @staticmethod
    def _fsdp_params(model: torch.nn.Module) -> dict[int, Any]:
        """``FSDPParam`` objects by id of their sharded parameter (private API)."""
        from torch.distributed.fsdp import FSDPModule  # imported already: checked above

        try:
            found = [fp for module in model.modules() if isinstance(module, FSDPModule)
                     for group in module._get_fsdp_state()._fsdp_param_groups
                     for fp in group.fsdp_params]
            for fp in found:
                for name in _FSDP_PARAM_API:
                    getattr(fp, name)
        except AttributeError as exc:
            raise TypeError(f"Residency cannot keep FSDP2 parameters resident with torch "
                            f"{torch.__version__}: its FSDP2 internals differ from those "
                            f"this was written for (torch 2.13: {exc}); use a copying "
                            f"snapshot (torch.optim.AdamW and TorchStateSource)") from exc
        return {id(fp.sharded_param): fp for fp in found}

    def sync(self) -> None:
        with torch.no_grad():
            for fsdp_param in self._params:
                fsdp_param.reset_sharded_param()
