"""Resident state: Adam writes the next step's state straight into the snapshot buffer.

A copying snapshot (``snapshot.py``) moves the whole state (1.2 GB for a 100M
model with Adam) through memory once more every step. On a GPU that copy is a
DMA beside the compute; on a CPU trainer it competes with the compute for the
same cores and memory bandwidth, and costs ~4-5% of a step however it is
scheduled (measured, see ``snapshot.py``). Here there is no copy: the
parameters and Adam moments *live* in the dual buffer, and the optimizer step
is computed out of place, reading step n from the buffer that holds it and
writing step n+1 into the other one, which is the memory traffic an in-place
step has anyway. Afterwards the parameters point at the new buffer; the old one
still holds step n, complete, for restore, serving and backup. The small rest
(model buffers, RNG, step counters, JSON meta) is copied by ``start`` as usual.

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

The numbers are those of ``torch.optim.Adam`` / ``AdamW`` (``foreach=False``):
the same kernels in the same order, bit for bit (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .errors import SnapshotFailedError
from .snapshot import DualBufferSnapshotter
from .torch_state import MODEL, OPTIM, TorchStateSource, as_tensor

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
        return loss

    @staticmethod
    def _update(group: Mapping[str, Any], p: torch.Tensor, state: dict[str, Any],
                home: Home | None) -> None:
        """torch's single-tensor Adam, with every result written to ``home``."""
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        weight_decay = group["weight_decay"]
        param, grad = p.detach(), p.grad
        assert grad is not None  # step() skips parameters without one
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
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
    """``torch.optim.AdamW``'s defaults and decoupled weight decay."""
    return ResidentAdam(params, lr, betas, eps, weight_decay, decoupled_weight_decay=True)


def _move_home(p: torch.Tensor, state: dict[str, Any], home: Home, *, copy: bool) -> None:
    """Point the parameter and its moments at ``home`` (copying them there first)."""
    new_param, new_avg, new_sq = home
    if copy:
        for old, new in ((p.detach(), new_param), (state["exp_avg"], new_avg),
                         (state["exp_avg_sq"], new_sq)):
            if old.data_ptr() != new.data_ptr():
                new.copy_(old)
    p.data = new_param
    state["exp_avg"], state["exp_avg_sq"] = new_avg, new_sq


class Residency:
    """Keeps a model's parameters and its ``ResidentAdam`` moments in the
    snapshot buffers of ``snapshots``; builds the snapshot sources that match.

    ``scheduler`` and ``rng`` must be what every snapshot of this state is
    built with (``source`` does that): the optimizer writes into the layout
    they give, and ``start`` refuses a snapshot laid out otherwise.
    """

    def __init__(self, model: torch.nn.Module, optimizer: ResidentAdam,
                 snapshots: DualBufferSnapshotter, *, scheduler: Any = None, rng: bool = True,
                 wait: float = READER_WAIT) -> None:
        self.model = model
        self.optimizer = optimizer
        self.snapshots = snapshots
        self.scheduler = scheduler
        self.rng = rng
        self.wait = wait
        self._names = self._home_names()
        optimizer.homes = self._claim_homes

    def source(self, step: int, loader_state: Mapping[str, Any] | None = None
               ) -> TorchStateSource:
        return TorchStateSource(self.model, self.optimizer, self.scheduler, step=step,
                                loader_state=loader_state, rng=self.rng)

    def release(self) -> None:
        """Give the parameters and moments private memory again, before anything
        other than the optimizer writes them (loading a restored or fetched
        state); the next step moves them back into the buffers."""
        for p in self.optimizer.params_in_order():
            state = self.optimizer.state[p]
            p.data = p.detach().clone()
            state["exp_avg"] = state["exp_avg"].clone()
            state["exp_avg_sq"] = state["exp_avg_sq"].clone()

    def _where_they_are(self) -> list[Home]:
        """Homes that are the tensors themselves: the step updates them in place."""
        return [(p.detach(), self.optimizer.state[p]["exp_avg"],
                 self.optimizer.state[p]["exp_avg_sq"])
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
        descs = self.source(0).describe()
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
