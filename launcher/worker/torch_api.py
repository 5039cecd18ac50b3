"""PyTorch front end of the worker runtime (imports torch: training side only).

An FSDP2 script adopts it in a few lines; the loop stays the script's own::

    from ft_launch import FtOptimizer, ft_manager

    dist.init_process_group()                  # this replica's world: ft-launch sets
    for block in model.blocks:                 # RANK, WORLD_SIZE, MASTER_ADDR, ...
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    manager = ft_manager(model, optimizer, batch_size=16)    # + the worker env
    optimizer = FtOptimizer(manager)           # a torch.optim.Optimizer
    scheduler = LambdaLR(optimizer, schedule)  # any torch LR scheduler, or none
    manager.register_state("scheduler", scheduler)   # rides in every snapshot
    while manager.next_step < steps:
        optimizer.zero_grad()                  # here or at the end of the loop body
        for micro in range(accumulation):      # batch_size: all micro-batches together
            model.set_requires_gradient_sync(micro == accumulation - 1)
            loss = model(*batch(manager.data_position, micro)) / accumulation
            loss.backward()                    # the first forward starts the step (the
                                               # quorum runs beside it); FTAR per FSDP unit
        clip_grad_norm_(model.parameters(), 1.0)   # final: the replicas' average
        optimizer.step()                       # commits, or drops the step on every rank
        scheduler.step()

A step starts at the model's first forward with autograd on (``start_step``; an
eval forward under ``torch.no_grad()`` starts none), and ends at
``optimizer.step()``. The learning rate of a step is whatever the param groups
hold when it commits (set by the scheduler, or by the script: a manual schedule
sets ``group["lr"] = lr_at(manager.next_step)`` before the step's forward:
``next_step`` is the step being committed; a replica that catches up steps with
the rate the others set, which rides in the snapshot it loads); the replica LR
factor (``runtime.lr_scaling``) multiplies it for the optimizer's step only, and
the script's value is put back right after.

**Gradients are final when backward returns**, for every kind of model: a
backward that synchronises gradients ends with this step's exchange across
replicas done (``torch_hooks.BackwardEnd``), so ``clip_grad_norm_`` right after
it clips by the global norm (FSDP2's DTensor gradients: the norm over the shards,
of the replicas' average, as native HSDP's) and ``scaler.unscale_`` sees the
average. DDP models reduce in a comm hook, FSDP2 models in the all-reduce hook of
each unit, both during backward; a plain module's gradients are reduced at the end
of backward (averaged over the replica's ranks first). One exchange a step:
accumulate over micro-batches with the model's own no-sync, DDP's ``no_sync()``
(or ``require_backward_grad_sync``), FSDP2's ``set_requires_gradient_sync(False)``,
and for a plain module ``with manager.no_sync(): loss.backward()``, for every
micro-batch but the last (a plain module's backward after the step's exchange is
refused: its gradients would stay this replica's own). ``batch_size`` is the
replica's samples of the whole step, all micro-batches together.

``manager.allreduce_gradients()`` has nothing left to do after such a backward;
loops that call it work as before: ``with manager.training_step(): ...`` (start
the step, backward, ``allreduce_gradients``) and the explicit ``start_step /
allreduce_gradients / commit`` loop of ``Manager``.
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ft_launch.ckpt.manifest import Bytes, Manifest
from ft_launch.ckpt.resident import Residency, ResidentAdam
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import (
    TorchStateSource,
    decode_state,
    encode_state,
    is_sharded,
    load_train_state,
    local_tensor,
)
from ft_launch.config import Config, load_config
from ft_launch.errors import UsageError
from ft_launch.ftar import FtarGroup

from .identity import ENV_CONFIG, ENV_INCARNATION, WorkerIdentity
from .manager import Manager
from .observer import load_observer
from .replay import replay_manager, replay_requested
from .step import Reduction
from .torch_hooks import (
    BackwardEnd,
    DdpExchange,
    FsdpExchange,
    reduce_gradient,
    scaler_found_inf,
)
from .torch_start import copy_model, model_digest

__all__ = ["FtOptimizer", "Manager", "TorchReplicaGroup", "TorchTrainState", "ft_manager"]

log = logging.getLogger(__name__)


class RegisteredState:
    """The objects a script keeps in its snapshots (``Manager.register_state``), by
    name: one ``stateful`` for ``ft_launch.ckpt.torch_state``.

    A state loaded before its object is registered (restored when the manager
    started, before the script built its scheduler) waits in ``pending``: it rides
    in snapshots as it was, and is loaded when the object is registered."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.pending: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {**self.pending, **{name: obj.state_dict() for name, obj in self.objects.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            if name in self.objects:
                self.objects[name].load_state_dict(value)
            else:
                self.pending[name] = value
        for name in sorted(self.objects.keys() - state.keys()):
            log.warning("the state loaded holds nothing registered as %r: it keeps its own "
                        "(saved by a script that did not register it)", name)

    def copy(self) -> Any:
        """The state now, detached from the objects (tensors cloned), as a load gets it."""
        encoded, tensors = encode_state(self.state_dict())
        return decode_state(encoded, [t.clone() for t in tensors])


class TorchTrainState:
    """A model + optimizer for the step protocol: gradient reduction (hooks, or all
    of them after backward), the optimizer step with the replica's LR factor on the
    script's learning rate, snapshots and loading through
    ``ft_launch.ckpt.torch_state`` (with the script's registered objects). Sharded
    (FSDP2) parameters are handled as this rank's local shards, in their own dtypes.

    With a ``ft_launch.ckpt.resident.ResidentAdam`` optimizer the parameters and moments
    live in the snapshot buffers (no copy per step, see ``ckpt/resident.py``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: TorchReplicaGroup | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.registered = RegisteredState()
        #: this step commits without an optimizer update (FtOptimizer.step)
        self.skip_update = False
        self.residency: Residency | None = None
        self.hooks: FsdpExchange | DdpExchange | None = None
        self.backward_end: BackwardEnd | None = None
        #: Manager.no_sync: backward passes keep their gradients to the replica
        self.gradient_sync = True
        self._manager: Manager | None = None
        self._accumulated = False   # a parameter took a gradient in this backward
        self._watched: set[int] = set()   # parameters with the post-accumulate hook
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._last_source: TorchStateSource | None = None
        self._stepped = False   # the optimizer stepped once: the registrations are closed
        self._began = False
        #: the registered objects and hyper-parameters when a step was dropped, put
        #: back when the next one begins
        self._dropped_at: tuple[Any, list[dict[str, Any]]] | None = None
        #: the hyper-parameters last loaded with the optimizer (restored, fetched)
        self._loaded_hyperparameters: list[dict[str, Any]] | None = None

    @property
    def sharded(self) -> bool:
        return any(is_sharded(p) for p in self.params)

    def install_hooks(self, manager: Manager) -> None:
        """Reduce during backward (FSDP2's all-reduce hook, DDP's comm hook), unless
        ``runtime.overlap_backward`` is off or the model is plain; then everything at
        the end of backward. Either way a backward that synchronises gradients
        returns with them final (``end_of_backward``)."""
        self._manager = manager
        self.backward_end = BackwardEnd(self.model, self.end_of_backward)
        if manager.config.runtime.overlap_backward:
            if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
                self.hooks = DdpExchange(self.model, manager.reduce_gradients,
                                         scaled=lambda: self.scaled)
            elif self.sharded:
                self.hooks = FsdpExchange(self.model, manager.reduce_gradients,
                                          scaled=lambda: self.scaled,
                                          on_gradients=self.backward_end.gradients_reached)
        if self.hooks is None:
            self._watch(self.params)

    def _watch(self, params: list[torch.nn.Parameter]) -> None:
        """Note when a backward gives these parameters gradients (FSDP2 calls the hook
        of a sharded parameter when it reduced the gradient: at a synchronising
        backward only)."""
        def accumulated(param: torch.Tensor) -> None:
            self._accumulated = True
            assert self.backward_end is not None
            self.backward_end.gradients_reached()
        for param in params:
            if id(param) not in self._watched:
                self._watched.add(id(param))
                param.register_post_accumulate_grad_hook(accumulated)

    def end_of_backward(self) -> None:
        """The last thing of every backward through the model (``BackwardEnd``): one
        that synchronised the gradients (DDP's or FSDP2's hooks ran, or a parameter
        of a plain module took a gradient outside ``manager.no_sync()``) finishes the
        step's exchange, so its gradients are the replicas' average when backward
        returns. One exchange a step: a plain module's backward after it is refused,
        as its gradients would stay this replica's own (DDP and FSDP2 hand theirs over
        in their hooks, as natively every synchronising backward reduces)."""
        manager = self._manager
        accumulated, self._accumulated = self._accumulated, False
        if manager is None or not manager.step_started:
            return
        if self.hooks is not None:
            if self.hooks.calls:
                manager.allreduce_gradients()
            return
        if not accumulated or not self._synchronising():
            return
        if manager.gradients_exchanged:
            raise UsageError(
                f"a backward in step {manager.next_step} gave the parameters gradients "
                "after the step's were averaged across replicas: they would stay this "
                "replica's own", hint=self._accumulation_hint())
        manager.allreduce_gradients()

    def _synchronising(self) -> bool:
        """Whether a backward through a model without exchange hooks synchronises."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return bool(self.model.require_backward_grad_sync)
        return self.gradient_sync   # FSDP2 (overlap off): its hook ran, it synchronised

    def _accumulation_hint(self) -> str:
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            return ("accumulate gradients under DDP's own: forward and backward of every "
                    "micro-batch but the last inside `with model.no_sync():`")
        if self.sharded:
            return ("accumulate gradients with FSDP2's own: "
                    "model.set_requires_gradient_sync(False) for every micro-batch but the "
                    "last, True for the last")
        return ("accumulate gradients with `with manager.no_sync(): loss.backward()` for "
                "every micro-batch but the last: the last backward averages their sum, once")

    def set_gradient_sync(self, sync: bool) -> bool:
        """``Manager.no_sync``: a plain module's; DDP and FSDP2 models have their own."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel) or self.sharded:
            raise UsageError("manager.no_sync() is for plain modules",
                             hint=self._accumulation_hint())
        previous, self.gradient_sync = self.gradient_sync, sync
        return previous

    @property
    def scaled(self) -> bool:
        """A GradScaler is registered: the gradients are its scaled ones, and Inf/NaN
        in their average is for it to skip (``torch_hooks.reduce_gradient``)."""
        return any(isinstance(obj, torch.amp.GradScaler) and obj.is_enabled()
                   for obj in self.registered.objects.values())

    def bind_snapshots(self, snapshots: DualBufferSnapshotter) -> None:
        if isinstance(self.optimizer, ResidentAdam):
            try:
                self.residency = Residency(self.model, self.optimizer, snapshots,
                                           stateful=self.registered)
            except TypeError as why:   # it stays an ordinary in-place Adam
                log.warning("optimizer state not resident, snapshots copy it: %s", why)

    # ------------------------------------------------------------------ gradients

    def reduce_gradients(self, reduction: Reduction) -> None:
        """After backward, on the exchange thread (the training thread waits)."""
        if self.hooks is not None:
            if self.hooks.calls == 0:
                raise UsageError("no gradient reached the all-reduce hooks this step",
                                 hint="every rank must run forward and backward every step "
                                      "(a catching-up replica contributes zeros), the last "
                                      "micro-batch's backward synchronising (outside DDP's "
                                      "no_sync(); FSDP2: set_requires_gradient_sync(True))")
            return
        replicated_by_hand = (self.group is not None and self.group.ranks > 1
                              and not self.sharded and not isinstance(
                                  self.model, torch.nn.parallel.DistributedDataParallel))
        with torch.no_grad():
            for flat in self._gather().values():
                if replicated_by_hand:  # the replica's ranks trained on different samples
                    assert self.group is not None
                    self.group.average_tensor(flat)
                reduce_gradient(reduction, flat, self.scaled)
            self._scatter()

    def _gather(self) -> dict[torch.dtype, torch.Tensor]:
        """This rank's gradients, one flat buffer per dtype (zeros where none)."""
        if not self._flat:
            sizes: dict[torch.dtype, int] = {}
            for p in self.params:
                sizes[p.dtype] = sizes.get(p.dtype, 0) + local_tensor(p).numel()
            self._flat = {d: torch.zeros(n, dtype=d, device=self.params[0].device)
                          for d, n in sizes.items()}
        offsets = dict.fromkeys(self._flat, 0)
        for p in self.params:
            n, start = local_tensor(p).numel(), offsets[p.dtype]
            view = self._flat[p.dtype][start:start + n]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(local_tensor(p.grad).reshape(-1))
            offsets[p.dtype] = start + n
        return self._flat

    def _scatter(self) -> None:
        from torch.distributed.tensor import DTensor

        offsets = dict.fromkeys(self._flat, 0)
        for p in self.params:
            local = local_tensor(p)
            n, start = local.numel(), offsets[p.dtype]
            reduced = self._flat[p.dtype][start:start + n].view_as(local)
            if p.grad is None:
                grad = reduced.clone()
                p.grad = (DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False)
                          if is_sharded(p) else grad)
            else:
                local_tensor(p.grad).copy_(reduced)
            offsets[p.dtype] = start + n

    def finish_gradients(self) -> None:
        if self.hooks is not None:
            self.hooks.finish()

    def zero_gradients(self) -> None:
        """The step is dropped (the manager retries it): its gradients go, and what
        the loop changes after ``optimizer.step()`` returned False (a scheduler's
        step, a counter) is undone when the next step begins (``begin_step``): as of
        now, before the loop goes on, the registered objects and the optimizer's
        hyper-parameters are as the dropped step found them."""
        if self.hooks is not None:
            self.hooks.reset()
        self.optimizer.zero_grad(set_to_none=True)
        self._dropped_at = self.registered.copy(), self._hyperparameters()

    def begin_step(self) -> None:
        if self.backward_end is not None:
            self.backward_end.reset()
        if self._dropped_at is not None:
            objects, hyperparameters = self._dropped_at
            self._dropped_at = None
            self.registered.load_state_dict(objects)
            self._set_hyperparameters(hyperparameters)
        if not self._began:
            self._began = True
            for name in sorted(self.registered.pending):
                log.warning("the state restored holds %r, which the script did not register "
                            "before its first step: it is kept in the snapshots, unused "
                            "(manager.register_state(%r, obj) loads it)", name, name)

    def model_digest(self) -> str:
        return model_digest(self.model)

    def copy_model(self, ftar: FtarGroup, step: int, source: bool) -> None:
        copy_model(self.model, ftar, step, source)

    # ------------------------------------------------------------------ the step, state

    def apply(self, lr_factor: float) -> None:
        """The optimizer step at the learning rate the script (or its scheduler) set
        for this step, times ``lr_factor``; the script's value is put back after."""
        self._stepped = True
        if self.skip_update:    # the GradScaler found Inf/NaN: no update, as natively
            self.optimizer.zero_grad(set_to_none=True)
            return
        groups = self.optimizer.param_groups
        scripts = [group["lr"] for group in groups]
        if lr_factor != 1.0:
            for group, lr in zip(groups, scripts):
                group["lr"] = lr * lr_factor
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(groups, scripts):
                group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)

    def register_state(self, name: str, obj: Any) -> None:
        """``Manager.register_state``: checked now (what a snapshot cannot hold fails
        here, naming where it is), then loaded at once if a restored state holds it."""
        if self._stepped:
            raise UsageError(f"register_state({name!r}) after the first optimizer step",
                             hint="register every object before the training loop: each "
                                  "snapshot, restore and catch-up holds the same objects")
        if not all(callable(getattr(obj, m, None)) for m in ("state_dict", "load_state_dict")):
            raise UsageError(f"register_state({name!r}): a {type(obj).__name__} has no "
                             "state_dict() and load_state_dict()",
                             hint="register an object with both (torch's schedulers, "
                                  "StatefulDataLoader, or a small class of the script's)")
        if name in self.registered.objects:
            raise UsageError(f"register_state({name!r}): that name is registered already",
                             hint="give each object a name of its own")
        try:
            encode_state({name: obj.state_dict()})
        except UsageError as error:
            raise UsageError(f"register_state({name!r}), a {type(obj).__name__}: "
                             f"{error.message}", hint=error.hint) from None
        self.registered.objects[name] = obj
        if name in self.registered.pending:
            obj.load_state_dict(self.registered.pending.pop(name))
            # An LR scheduler built since the restore has set the learning rate it
            # starts with; the restored one is the step's.
            if self._loaded_hyperparameters is not None:
                self._set_hyperparameters(self._loaded_hyperparameters)

    def add_param_group(self, group: dict[str, Any]) -> None:
        """``FtOptimizer.add_param_group``: parameters of the model only (a snapshot
        holds the model's), reduced from the next step on."""
        if isinstance(self.optimizer, ResidentAdam):
            raise UsageError("add_param_group on a ResidentAdam: its state lives in snapshot "
                             "buffers laid out when it was built",
                             hint="build it with every parameter group, or use "
                                  "torch.optim.AdamW")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        mine = {id(p) for p in self.model.parameters()}
        for param in params:
            tensor = param[1] if isinstance(param, tuple) else param
            if id(tensor) not in mine:
                raise UsageError(f"add_param_group: a parameter of shape {tuple(tensor.shape)} "
                                 "is not a parameter of the model given to ft_manager",
                                 hint="a replica that catches up gets the model's parameters "
                                      "only; make it a parameter of the model")
        self.optimizer.add_param_group(group)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self._flat = {}
        if self._watched:
            self._watch(self.params)

    def load_optimizer_state(self, state_dict: Mapping[str, Any]) -> None:
        """``FtOptimizer.load_state_dict``: the script's own checkpoint."""
        if self.residency is not None:
            self.residency.release()  # loading must not write into a snapshot
        self.optimizer.load_state_dict(state_dict)  # type: ignore[arg-type]

    def _hyperparameters(self) -> list[dict[str, Any]]:
        return [copy.deepcopy({k: v for k, v in group.items() if k != "params"})
                for group in self.optimizer.param_groups]

    def _set_hyperparameters(self, saved: list[dict[str, Any]]) -> None:
        for group, values in zip(self.optimizer.param_groups, saved):
            group.update(copy.deepcopy(values))

    def snapshot_source(self, step: int, loader_state: Mapping[str, Any]) -> TorchStateSource:
        if self.residency is not None:
            return self.residency.source(step, loader_state)
        # the step before's source: what is the same object as then is not described anew
        self._last_source = TorchStateSource(self.model, self.optimizer, self.registered,
                                             step=step, loader_state=loader_state,
                                             previous=self._last_source)
        return self._last_source

    def load(self, manifest: Manifest, buffer: Bytes) -> Mapping[str, Any]:
        if self.residency is not None:
            self.residency.release()  # loading must not write into a snapshot
        loaded = load_train_state(manifest, buffer, self.model, self.optimizer, self.registered)
        self._loaded_hyperparameters = self._hyperparameters()
        return loaded.loader_state


class FtOptimizer(torch.optim.Optimizer):
    """The optimizer of a ``ft_manager``, a ``torch.optim.Optimizer``: torch's LR
    schedulers take it, and what they set is what the wrapped optimizer
    (``.optimizer``) steps with: ``param_groups``, ``state`` and ``defaults`` are
    the wrapped optimizer's own objects.

    ``step()`` commits the step: the wrapped optimizer steps only if every rank of
    the replica finished the step's all-reduce; it returns whether it did (False:
    the step is dropped on every rank, and is trained again). ``step(loss=...)``
    puts this rank's loss into the commit event. Step hooks
    (``register_step_pre_hook`` / ``register_step_post_hook``) run around the
    commit. ``zero_grad`` may come at the start or at the end of the loop body: the
    model's forward starts a step. ``state_dict``, ``load_state_dict`` (a script
    resuming from its own checkpoint) and ``add_param_group`` are the wrapped
    optimizer's; its state-dict hooks are shared with this one. A
    ``torch.amp.GradScaler`` steps it as natively (``scaler.step(optimizer)``) once
    registered (``manager.register_state("scaler", scaler)``): every replica's scaler
    sees the same averaged gradients, a step where it finds Inf/NaN commits without
    an update, and its scale rides in every snapshot.

    Args:
        manager: the manager ``ft_manager`` returned (its optimizer is the one wrapped).

    Raises:
        UsageError: ``manager`` was not made by ``ft_manager`` for a torch model.
    """

    #: GradScaler.step calls step() even where it finds Inf/NaN (``scaler_found_inf``).
    _step_supports_amp_scaling = True

    def __init__(self, manager: Manager) -> None:
        train_state = manager.state
        if not isinstance(train_state, TorchTrainState):
            raise UsageError("FtOptimizer(manager) takes the manager ft_manager() returned",
                             hint="manager = ft_manager(model, optimizer, batch_size=...); "
                                  "optimizer = FtOptimizer(manager)")
        self.manager = manager
        self.optimizer = train_state.optimizer
        self._train_state = train_state
        self._checked_schedulers = False
        # Torch's bookkeeping of an optimizer without Optimizer.__init__, which would
        # add the parameters again: step hooks of its own (run by the step wrapper
        # torch puts on the class), state-dict hooks those of the wrapped optimizer,
        # which state_dict and load_state_dict go to.
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        for kind in ("state_dict_pre", "state_dict_post", "load_state_dict_pre",
                     "load_state_dict_post"):
            name = f"_optimizer_{kind}_hooks"
            setattr(self, name, getattr(self.optimizer, name))
        self._patch_step_function()

    # The wrapped optimizer's own objects, whatever replaces them (its load_state_dict
    # puts in new param groups): a scheduler sets the learning rate the step uses.
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def __repr__(self) -> str:
        return f"FtOptimizer({self.optimizer!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``.

        Args:
            set_to_none: set the gradients to None instead of zeroing them.
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None, *, loss: float | None = None) -> bool:  # type: ignore[override]
        """Commit the step (``Manager.commit``; the class doc): the wrapped optimizer
        steps only if every rank of the replica finished the step's all-reduce. Starts
        the step first if no forward of the model did.

        Args:
            closure: not supported; must be None.
            loss: this rank's loss of the step, for the commit event.

        Returns:
            True if the step committed; False if it was dropped on every rank of the
            replica and is to be trained again.

        Raises:
            UsageError: a ``closure`` was given; at the first step, an LR scheduler
                drives this optimizer but is not registered (``register_state``); or
                as ``Manager.commit``.
            DifferentStart, NoQuorum, NothingToJoin, TerminalAbort, FatalError: as
                ``Manager.start_step`` and ``Manager.commit``.
        """
        if closure is not None:
            raise UsageError("FtOptimizer.step takes no closure: the step commits once "
                             "its all-reduce is done")
        if not self._checked_schedulers:
            self._check_schedulers()
        if not self.manager.step_started:   # no forward of the model started it
            self.manager.start_step()
        # Called by GradScaler.step even where it found Inf/NaN: the step still commits
        # (its batches consumed, as natively), without an update (torch_hooks).
        self._train_state.skip_update = scaler_found_inf(
            self, self._train_state.registered.objects.values(),
            self.manager.allreduce_gradients)
        try:
            return self.manager.commit(loss=loss)
        finally:
            self._train_state.skip_update = False

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``, for the script's own checkpoints."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Load the script's own checkpoint into the wrapped optimizer (a resident
        optimizer's state is moved out of the snapshot buffers first).

        Args:
            state_dict: what ``state_dict()`` returned.

        Raises:
            ValueError: torch's, where ``state_dict`` does not fit the parameter groups.
        """
        self._train_state.load_optimizer_state(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer; its gradients are averaged
        across replicas from the next step on.

        Args:
            param_group: as ``torch.optim.Optimizer.add_param_group`` takes it.

        Raises:
            UsageError: the wrapped optimizer is a ``ResidentAdam``; a parameter is not
                one of the model's given to ``ft_manager``.
        """
        self._train_state.add_param_group(param_group)

    def _check_schedulers(self) -> None:
        """A scheduler that steps this optimizer must ride in the snapshots, or a
        replica that catches up or restarts would start its schedule over, silently.
        (Torch's schedulers mark the ``step`` of the optimizer they drive.)"""
        self._checked_schedulers = True
        driven = any(hasattr(o.step, "_wrapped_by_lr_sched") for o in (self, self.optimizer))
        registered = any(isinstance(o, torch.optim.lr_scheduler.LRScheduler)
                         for o in self._train_state.registered.objects.values())
        if driven and not registered:
            raise UsageError("an LR scheduler drives this optimizer, but none is registered",
                             hint="manager.register_state('scheduler', scheduler) before the "
                                  "loop: a replica that catches up or restarts then continues "
                                  "the schedule at its step")


class TorchReplicaGroup:
    """The ranks of one replica: the script's torch world (its default process
    group, initialised here from the environment if the script did not), plus a
    gloo group of its own for the protocol (quorum answer, commit vote), so these
    never interleave with the training's collectives.

    Without ``MASTER_ADDR`` the rendezvous goes through a file store in the run
    directory, named by the replica's incarnation (its Slurm step, or
    ``FTL_WORKER_INCARNATION``), so a relaunched replica never meets a dead one's."""

    def __init__(self, identity: WorkerIdentity, timeout_s: float = 300.0) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        if not dist.is_initialized():
            backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
            if os.environ.get("MASTER_ADDR"):
                dist.init_process_group(backend, rank=identity.rank,
                                        world_size=identity.ranks, timeout=timeout)
            else:
                incarnation = (os.environ.get(ENV_INCARNATION)
                               or f"{os.environ.get('SLURM_JOB_ID', '')}."
                                  f"{os.environ.get('SLURM_STEP_ID', '')}")
                path = (identity.run_dir / "rendezvous"
                        / f"replica-{identity.replica_id}-{incarnation}")
                path.parent.mkdir(parents=True, exist_ok=True)
                dist.init_process_group(backend, store=dist.FileStore(str(path), identity.ranks),
                                        rank=identity.rank, world_size=identity.ranks,
                                        timeout=timeout)
        elif (dist.get_world_size(), dist.get_rank()) != (identity.ranks, identity.rank):
            raise UsageError(
                f"the script's process group is rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but this worker is rank {identity.rank} of the "
                f"{identity.ranks} ranks of replica {identity.replica_id}",
                hint="each replica is a torch world of its own: call init_process_group() "
                     "without rank or world size (ft-launch sets RANK, WORLD_SIZE, "
                     "MASTER_ADDR and MASTER_PORT for the replica)")
        self.ranks = identity.ranks
        self.control = dist.new_group(backend="gloo", timeout=timeout)

    def broadcast(self, value: Any) -> Any:
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.ranks
        dist.all_gather_object(gathered, value, group=self.control)
        return gathered

    def all_true(self, flag: bool) -> bool:
        vote = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.control)
        return bool(vote.item())

    def average_tensor(self, tensor: torch.Tensor) -> None:
        """Average a CPU ``tensor`` in place across the replica's ranks."""
        dist.all_reduce(tensor, group=self.control)
        tensor.div_(self.ranks)


def ft_manager(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               batch_size: int | None = None, config: Config | None = None,
               identity: WorkerIdentity | None = None, *,
               global_batch_size: int | None = None) -> Manager:
    """A ``Manager`` for this worker, from the environment ``ft-launch run`` sets.

    ``model``: after ``fully_shard`` (FSDP2), a ``DistributedDataParallel``, or a
    plain module. The samples of one optimizer step: ``batch_size``, the replica's
    (all its ranks and micro-batches together), or ``global_batch_size``, the native
    script's (every replica's: the replica's is its share, so the script needs not
    know how many replicas there are). One of the two.
    A replica of several ranks uses the script's process group, or starts one.
    Started for a replay (``FTL_WORKER_REPLAY``), it returns a ``ReplayManager``: the
    same loop then replays one recorded step and ends the process (``replay``).

    Args:
        model: the model the script trains (FSDP2, DDP or a plain module).
        optimizer: the script's own ``torch.optim.Optimizer`` over the model's
            parameters (not an ``FtOptimizer``).
        batch_size: the replica's samples of one optimizer step.
        config: the run's configuration; None: loaded from the environment
            ``ft-launch run`` sets (``FTL_CONFIG``).
        identity: this rank's place in the run; None: from the worker environment.
        global_batch_size: the native script's samples of one optimizer step, every
            replica's together.

    Returns:
        This rank's ``Manager``; wrap its optimizer with ``FtOptimizer(manager)``.

    Raises:
        UsageError: ``optimizer`` is an ``FtOptimizer``; not exactly one of
            ``batch_size`` and ``global_batch_size``; a ``global_batch_size`` that is
            not a positive multiple of the replicas; the worker environment is missing
            or invalid; the script's process group is not this replica's (rank or
            world size).
        ConfigError: the configuration does not load.
        NothingToJoin: the run finished before this replica started (``SystemExit``,
            exit 77).
        LayoutMismatchError: the state restored at start is laid out for another
            model or mesh (a ``FatalError``).
    """
    if isinstance(optimizer, FtOptimizer):
        raise UsageError("ft_manager takes the script's own optimizer, not an FtOptimizer",
                         hint="manager = ft_manager(model, optimizer, ...); then "
                              "optimizer = FtOptimizer(manager)")
    if config is None:
        config = load_config(os.environ.get(ENV_CONFIG) or None)
    identity = identity or WorkerIdentity.from_env()
    batch_size = replica_batch(batch_size, global_batch_size, identity.num_replicas)
    group = (TorchReplicaGroup(identity) if identity.ranks > 1 or dist.is_initialized()
             else None)
    state = TorchTrainState(model, optimizer, group)
    observer = load_observer(config, identity)    # the no-op one unless a drill names one
    observer.attach(model)
    replay = replay_requested()
    manager = (Manager(config, identity, state, batch_size, group=group, observer=observer)
               if replay is None
               else replay_manager(config, identity, state, batch_size, replay, group))
    state.install_hooks(manager)
    model.register_forward_pre_hook(_step_starter(manager), prepend=True)
    return manager


def replica_batch(batch_size: int | None, global_batch_size: int | None,
                  replicas: int) -> int:
    """The replica's samples per step, from exactly one of the two ways to say it."""
    if (batch_size is None) == (global_batch_size is None):
        raise UsageError("ft_manager needs batch_size (the replica's) or global_batch_size "
                         "(all replicas'), exactly one of them")
    if global_batch_size is None:
        assert batch_size is not None
        return batch_size
    if global_batch_size <= 0 or global_batch_size % replicas:
        raise UsageError(f"global_batch_size {global_batch_size} does not divide among "
                         f"{replicas} replicas",
                         hint="use a multiple of the replica count (job.replicas)")
    return global_batch_size // replicas


def _step_starter(manager: Manager) -> Callable[[torch.nn.Module, Any], None]:
    """A forward pre-hook: the model's first forward with autograd on starts the step
    (the quorum is asked beside it), wherever ``zero_grad`` is in the loop. First
    among the model's hooks: an FSDP2 root gathers its parameters in its own, and the
    step's start snapshots the one committed before (``Manager.start_step``)."""
    @torch.compiler.disable   # a compiled model's forward runs it as Python, as it is
    def start(module: torch.nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and not manager.step_started:
            manager.start_step()
    return start
