"""PyTorch front end of the worker runtime (imports torch: training side only).

An FSDP2 script adopts it in a few lines; the loop stays the script's own::

    from ft_launch import FtOptimizer, ft_manager

    dist.init_process_group()                  # this replica's world: ft-launch sets
    for block in model.blocks:                 # RANK, WORLD_SIZE, MASTER_ADDR, ...
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    manager = ft_manager(model, optimizer, batch_size=16)    # + the worker env
    optimizer = FtOptimizer(manager)
    while manager.next_step < steps:
        optimizer.zero_grad()                  # starts the step; the quorum runs beside
        loss = model.loss(*batch(manager.data_position))
        loss.backward()                        # FTAR per FSDP unit, beside backward
        manager.allreduce_gradients()          # (only to clip: gradients are final here)
        optimizer.step()                       # commits, or drops the step on every rank

``with manager.training_step(): ...`` is the same as ``zero_grad`` + backward +
``allreduce_gradients``; the explicit ``start_step / allreduce_gradients / commit``
loop of ``Manager`` works too. DDP models reduce in a comm hook; any other model's
gradients are reduced after backward (averaged over the replica's ranks first).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ft_launch.ckpt.manifest import Bytes, Manifest
from ft_launch.ckpt.resident import Residency, ResidentAdam
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import TorchStateSource, is_sharded, load_train_state, local_tensor
from ft_launch.config import Config, load_config
from ft_launch.errors import UsageError

from .faults import node_sdc_probe
from .identity import ENV_CONFIG, ENV_INCARNATION, WorkerIdentity
from .manager import Manager, Reduction
from .replay import replay_manager, replay_requested
from .torch_hooks import DdpExchange, FsdpExchange, corrupt_gradients_while, reduce_gradient

__all__ = ["FtOptimizer", "Manager", "TorchReplicaGroup", "TorchTrainState", "ft_manager"]

log = logging.getLogger(__name__)


class TorchTrainState:
    """A model + optimizer for the step protocol: gradient reduction (hooks, or all
    of them after backward), the optimizer step with a scaled learning rate,
    snapshots and loading through ``ft_launch.ckpt.torch_state``. Sharded (FSDP2) parameters
    are handled as this rank's local shards, in their own dtypes.

    With a ``ft_launch.ckpt.resident.ResidentAdam`` optimizer the parameters and moments
    live in the snapshot buffers (no copy per step, see ``ckpt/resident.py``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 group: TorchReplicaGroup | None = None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.residency: Residency | None = None
        self.hooks: FsdpExchange | DdpExchange | None = None
        self._flat: dict[torch.dtype, torch.Tensor] = {}
        self._last_source: TorchStateSource | None = None

    @property
    def sharded(self) -> bool:
        return any(is_sharded(p) for p in self.params)

    def install_hooks(self, manager: Manager) -> None:
        """Reduce during backward (FSDP2's all-reduce hook, DDP's comm hook), unless
        ``runtime.overlap_backward`` is off; then everything after backward."""
        if not manager.config.runtime.overlap_backward:
            return
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self.hooks = DdpExchange(self.model, manager.reduce_gradients)
        elif self.sharded:
            self.hooks = FsdpExchange(self.model, manager.reduce_gradients)

    def bind_snapshots(self, snapshots: DualBufferSnapshotter) -> None:
        if isinstance(self.optimizer, ResidentAdam):
            try:
                self.residency = Residency(self.model, self.optimizer, snapshots)
            except TypeError as why:   # it stays an ordinary in-place Adam
                log.warning("optimizer state not resident, snapshots copy it: %s", why)

    # ------------------------------------------------------------------ gradients

    def reduce_gradients(self, reduction: Reduction) -> None:
        """After backward, on the exchange thread (the training thread waits)."""
        if self.hooks is not None:
            if self.hooks.calls == 0:
                raise UsageError("no gradient reached the all-reduce hooks this step",
                                 hint="every rank must run forward and backward every step "
                                      "(a catching-up replica contributes zeros)")
            return
        replicated_by_hand = (self.group is not None and self.group.ranks > 1
                              and not self.sharded and not isinstance(
                                  self.model, torch.nn.parallel.DistributedDataParallel))
        with torch.no_grad():
            for flat in self._gather().values():
                if replicated_by_hand:  # the replica's ranks trained on different samples
                    assert self.group is not None
                    self.group.average_tensor(flat)
                reduce_gradient(reduction, flat)
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
        if self.hooks is not None:
            self.hooks.reset()
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ the step, state

    def apply(self, lr_factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * lr_factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot_source(self, step: int, loader_state: Mapping[str, Any]) -> TorchStateSource:
        if self.residency is not None:
            return self.residency.source(step, loader_state)
        # the step before's source: what is the same object as then is not described anew
        self._last_source = TorchStateSource(self.model, self.optimizer, step=step,
                                             loader_state=loader_state,
                                             previous=self._last_source)
        return self._last_source

    def load(self, manifest: Manifest, buffer: Bytes) -> Mapping[str, Any]:
        if self.residency is not None:
            self.residency.release()  # loading must not write into a snapshot
        return load_train_state(manifest, buffer, self.model, self.optimizer).loader_state


class FtOptimizer:
    """The optimizer of a ``ft_manager``: ``zero_grad`` starts a step (unless one is
    started), ``step`` commits it: the wrapped optimizer steps only if every rank
    of the replica finished the step's all-reduce. ``step`` returns whether it did."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        state = manager.state
        assert isinstance(state, TorchTrainState)
        self.optimizer = state.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if not self.manager.step_started:
            self.manager.start_step()

    def step(self, closure: Any = None, *, loss: float | None = None) -> bool:
        if closure is not None:
            raise UsageError("FtOptimizer.step takes no closure: the step commits once "
                             "its all-reduce is done")
        return self.manager.commit(loss=loss)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()


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


def ft_manager(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_size: int,
               config: Config | None = None, identity: WorkerIdentity | None = None
               ) -> Manager:
    """A ``Manager`` for this worker, from the environment ``ft-launch run`` sets.

    ``model``: after ``fully_shard`` (FSDP2), a ``DistributedDataParallel``, or a
    plain module; ``batch_size`` is the replica's batch (all its ranks together).
    A replica of several ranks uses the script's process group, or starts one.
    Started for a replay (``FTL_WORKER_REPLAY``), it returns a ``ReplayManager``: the
    same loop then replays one recorded step and ends the process (``replay``)."""
    if config is None:
        config = load_config(os.environ.get(ENV_CONFIG) or None)
    identity = identity or WorkerIdentity.from_env()
    group = (TorchReplicaGroup(identity) if identity.ranks > 1 or dist.is_initialized()
             else None)
    state = TorchTrainState(model, optimizer, group)
    corrupting = node_sdc_probe(config.health, identity.node)
    if corrupting is not None:
        corrupt_gradients_while(model, corrupting)
    replay = replay_requested()
    manager = (Manager(config, identity, state, batch_size, group=group) if replay is None
               else replay_manager(config, identity, state, batch_size, replay, group))
    state.install_hooks(manager)
    return manager
