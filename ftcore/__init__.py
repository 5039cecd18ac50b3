"""ft-launch: data-parallel training that survives node, GPU, network and software
faults on Slurm. A training script imports from here, and only from here::

    from ft_launch import FtOptimizer, ft_manager

Every other module is internal.

The one import package is built from the repository's source folders (pyproject's
``package-dir``): this folder, ``ftcore/``, is ``ft_launch`` itself, the shared
kernel (config, errors, events, logs, ids, files, the Slurm client) that every layer
imports and that imports none of them; ``launcher/``, ``ftar/``, ``ckpt/``,
``health/`` and ``slurm_plugins/`` are ``ft_launch.launcher`` and so on.

The names below load on first use: the training API imports torch, and the Slurm
plugins and the controller, which import this package too, must never load it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_PUBLIC = {
    "FtBatchSampler": "ft_launch.launcher.worker.data",
    "FtDataLoader": "ft_launch.launcher.worker.data",
    "FtOptimizer": "ft_launch.launcher.worker.torch_api",
    "Manager": "ft_launch.launcher.worker.manager",
    "ResidentAdamW": "ft_launch.ckpt.resident",
    "StepKind": "ft_launch.launcher.worker.protocol",
    "configure_logging": "ft_launch.logs",
    "ft_init_device_mesh": "ft_launch.launcher.worker.mesh",
    "ft_manager": "ft_launch.launcher.worker.torch_api",
}

__all__ = ["FtBatchSampler", "FtDataLoader", "FtOptimizer", "Manager", "ResidentAdamW",
           "StepKind", "configure_logging", "ft_init_device_mesh", "ft_manager"]

if TYPE_CHECKING:
    from .ckpt.resident import ResidentAdamW
    from .launcher.worker.data import FtBatchSampler, FtDataLoader
    from .launcher.worker.manager import Manager
    from .launcher.worker.mesh import ft_init_device_mesh
    from .launcher.worker.protocol import StepKind
    from .launcher.worker.torch_api import FtOptimizer, ft_manager
    from .logs import configure_logging


def __getattr__(name: str) -> Any:
    try:
        module = _PUBLIC[name]
    except KeyError:
        raise AttributeError(f"module 'ft_launch' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
