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
from ckpt.torch_state import TorchStateSource, load_train_state
from ftcore.config import Config, load_config

from .identity import ENV_CONFIG, WorkerIdentity
from .manager import Manager


class TorchTrainState:
    """Gradients of a model as one flat float32 buffer; the optimizer step with a
    scaled learning rate; snapshots and loading through ``ckpt.torch_state``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if any(p.dtype != torch.float32 for p in self.params):
            raise TypeError("TorchTrainState handles float32 parameters; cast the model")
        self.flat = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32)
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]

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
        return TorchStateSource(self.model, self.optimizer, step=step, loader_state=loader_state)

    def load(self, manifest: Manifest, buffer: Bytes) -> Mapping[str, Any]:
        return load_train_state(manifest, buffer, self.model, self.optimizer).loader_state


def ft_manager(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch_size: int,
               config: Config | None = None, identity: WorkerIdentity | None = None
               ) -> Manager:
    """A ``Manager`` for this worker, from the environment ``ft-launch run`` sets."""
    if config is None:
        config = load_config(os.environ.get(ENV_CONFIG) or None)
    return Manager(config, identity or WorkerIdentity.from_env(), TorchTrainState(model,
                                                                                   optimizer),
                   batch_size)
