"""PyTorch front end of the worker runtime (imports torch: training side only).

Adopting it in a training script::

    from launcher.worker.torch_api import ft_manager
    manager = ft_manager(model, optimizer, batch_size=16)     # reads the worker env
    while manager.next_step < steps:
        plan = manager.start_step()
        if plan.kind is StepKind.TRAIN:
            ids = my_sample_ids(manager.data_position)
            model.loss(*batch(ids)).backward()
        manager.allreduce_gradients()
        manager.commit()
    manager.close()
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckpt.manifest import Bytes, Manifest
from ckpt.resident import Residency, ResidentAdam
from ckpt.snapshot import DualBufferSnapshotter
from ckpt.torch_state import TorchStateSource, load_train_state
from ftcore.config import Config, load_config

from .identity import ENV_CONFIG, ENV_INCARNATION, WorkerIdentity
from .manager import Manager


class TorchTrainState:
    """Gradients of a model as one flat float32 buffer; the optimizer step with a
    scaled learning rate; snapshots and loading through ``ckpt.torch_state``.

    With a ``ckpt.resident.ResidentAdam`` optimizer the parameters and moments
    live in the snapshot buffers (no copy per step, see ``ckpt/resident.py``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in self.params):
            raise TypeError("TorchTrainState handles float32 parameters; cast the model")
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32)
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.residency: Residency | None = None

    def bind_snapshots(self, snapshots: DualBufferSnapshotter) -> None:
        if isinstance(self.optimizer, ResidentAdam):
            self.residency = Residency(self.model, self.optimizer, snapshots)

    def gradients(self) -> np.ndarray:
        offset = 0
        for p in self.params:
            n = p.numel()
            view = self.flat[offset:offset + n]
            if p.grad is None:
                view.zero_()
            else:
                view.copy_(p.grad.reshape(-1))
            offset += n
        return self.flat.numpy()

    def set_gradients(self, flat: np.ndarray) -> None:
        source = torch.from_numpy(flat)
        offset = 0
        for p in self.params:
            n = p.numel()
            grad = source[offset:offset + n].view_as(p)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
            offset += n

    def zero_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def apply(self, lr_factor: float) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * lr_factor
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def snapshot_source(self, step: int, loader_state: Mapping[str, Any]) -> TorchStateSource:
        if self.residency is not None:
            return self.residency.source(step, loader_state)
        return TorchStateSource(self.model, self.optimizer, step=step, loader_state=loader_state)

    def load(self, manifest: Manifest, buffer: Bytes) -> Mapping[str, Any]:
        if self.residency is not None:
            self.residency.release()  # loading must not write into a snapshot
        return load_train_state(manifest, buffer, self.model, self.optimizer).loader_state


class TorchReplicaGroup:
    """The ranks of one replica as a gloo process group (``ReplicaGroup``).

    Rendezvous through a file store in the run directory, named by the replica's
    incarnation (its Slurm step, or ``FTLAUNCH_INCARNATION``), so a relaunched
    replica never meets the store of a dead one. A rank that dies takes the group
    with it: the replica step ends and the launcher relaunches it.
    """

    def __init__(self, identity: WorkerIdentity, timeout_s: float = 300.0) -> None:
        import datetime

        import torch.distributed as dist

        self.dist = dist
        incarnation = (os.environ.get(ENV_INCARNATION)
                       or f"{os.environ.get('SLURM_JOB_ID', '')}.{os.environ.get('SLURM_STEP_ID', '')}")
        path = identity.run_dir / "rendezvous" / f"replica-{identity.replica_id}-{incarnation}"
        path.parent.mkdir(parents=True, exist_ok=True)
        store = dist.FileStore(str(path), identity.ranks)
        dist.init_process_group("gloo", store=store, rank=identity.rank,
                                world_size=identity.ranks,
                                timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_gather(self, value: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(gathered, value)
        return gathered

    def all_true(self, flag: bool) -> bool:
        vote = torch.tensor([1 if flag else 0], dtype=torch.int32)
        self.dist.all_reduce(vote, op=self.dist.ReduceOp.MIN)
        return bool(vote.item())

    def average(self, array: np.ndarray) -> None:
        """Average ``array`` in place across the replica's ranks."""
        tensor = torch.from_numpy(array)
        self.dist.all_reduce(tensor)
        tensor.div_(self.dist.get_world_size())


def ft_manager(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_size: int,
               config: Config | None = None, identity: WorkerIdentity | None = None
               ) -> Manager:
    """A ``Manager`` for this worker, from the environment ``ft-launch run`` sets.

    ``batch_size`` is the replica's batch (all its ranks together). With several
    ranks per replica, ranks form a gloo group for the commit vote and the quorum
    broadcast; the training script averages gradients inside the replica (DDP or
    ``manager.group.average``) before ``allreduce_gradients``."""
    if config is None:
        config = load_config(os.environ.get(ENV_CONFIG) or None)
    identity = identity or WorkerIdentity.from_env()
    group = TorchReplicaGroup(identity) if identity.ranks > 1 else None
    return Manager(config, identity, TorchTrainState(model, optimizer), batch_size, group=group)
