"""Torch front end: a training state as a ``StateSource``, and loading it back.

Training-side only: this module imports torch (3.3 s); the controller never
imports it. The flat layout of a rank's state:

* ``model/<key>``: ``model.state_dict()``; buffers (BatchNorm statistics and
  the like change during forward) are *eager*, copied when the snapshot starts;
* ``optim/state/<param id>/<key>``: the optimizer's per-parameter tensors;
* ``rng/torch``, ``rng/cuda/<i>``, ``rng/numpy``: generator states (eager);
* JSON ``meta``: optimizer param groups and scalar state, scheduler state,
  Python and numpy RNG scalars, ``step``, ``loader_state``.

On CUDA the device-to-host copy runs on a dedicated stream into pinned
buffers, after an event recorded when the snapshot started (so it sees the
optimizer step's result); the background thread waits per tensor.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .manifest import Bytes, Manifest, TensorDesc

MODEL = "model/"
OPTIM = "optim/state/"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def pinned_allocator(nbytes: int) -> Bytes:
    """Page-locked host memory (CUDA only): device copies into it run asynchronously."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def as_tensor(spec_view: Bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A torch tensor over raw bytes (no copy when the bytes are writable)."""
    raw = spec_view if spec_view.flags.writeable else spec_view.copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).view(tuple(shape))


class TorchStateSource:
    """One step's state of a model / optimizer / scheduler, ready to be snapshotted.

    Build it right after ``optimizer.step()``; it holds references to the live
    tensors, which ``copy_into`` reads from the snapshot thread.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, *, step: int,
                 loader_state: Mapping[str, Any] | None = None, rng: bool = True,
                 stream: Any = None) -> None:
        self._tensors: list[torch.Tensor] = []
        self._descs: list[TensorDesc] = []
        self._meta: dict[str, Any] = {"step": step, "loader_state": dict(loader_state or {})}
        self._stream = stream
        self._ready: Any = None
        self._add_model(model)
        if optimizer is not None:
            self._add_optimizer(optimizer)
        if scheduler is not None:
            self._meta["scheduler"] = _jsonable(scheduler.state_dict(), "scheduler state")
        if rng:
            self._add_rng()
        if any(t.is_cuda for t in self._tensors):
            self._stream = self._stream or torch.cuda.Stream()
            self._ready = torch.cuda.Event()
            self._ready.record()

    def _add(self, name: str, tensor: torch.Tensor, eager: bool) -> None:
        self._tensors.append(tensor.detach())
        self._descs.append(TensorDesc(name, dtype_name(tensor.dtype), tuple(tensor.shape), eager))

    def _add_model(self, model: torch.nn.Module) -> None:
        params = {id(p) for p in model.parameters()}
        for key, tensor in model.state_dict(keep_vars=True).items():
            self._add(MODEL + key, tensor, eager=id(tensor) not in params)

    def _add_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        state = optimizer.state_dict()
        scalars: dict[str, dict[str, Any]] = {}
        for param_id, values in state["state"].items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor):
                    self._add(f"{OPTIM}{param_id}/{key}", value, eager=False)
                else:
                    scalars.setdefault(str(param_id), {})[key] = value
        self._meta["optim_scalars"] = _jsonable(scalars, "optimizer state")
        self._meta["optim_param_groups"] = _jsonable(state["param_groups"],
                                                     "optimizer param groups")

    def _add_rng(self) -> None:
        self._add("rng/torch", torch.get_rng_state(), eager=True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
                self._add(f"rng/cuda/{index}", cuda_state, eager=True)
        kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
        self._add("rng/numpy", torch.from_numpy(np.array(keys, dtype=np.uint32).view(np.int32)),
                  eager=True)
        self._meta["rng_numpy"] = [kind, int(pos), int(has_gauss), float(gauss)]
        version, internal, gauss_next = random.getstate()
        self._meta["rng_python"] = [version, list(internal), gauss_next]

    def describe(self) -> Sequence[TensorDesc]:
        return self._descs

    def meta(self) -> Mapping[str, Any]:
        return self._meta

    def copy_into(self, index: int, dest: Bytes) -> None:
        tensor = self._tensors[index]
        if not tensor.is_cuda:
            if tensor.is_contiguous() and tensor.data_ptr() == dest.ctypes.data:
                return  # resident: the optimizer step already wrote it here (resident.py)
            # numpy: one thread, GIL released. torch's copy_ would start a second
            # OpenMP team in this thread and fight the training thread's for the cores.
            source = _as_numpy_words(tensor)
            np.copyto(dest.view(source.dtype).reshape(source.shape), source, casting="no")
            return
        target = torch.from_numpy(dest).view(tensor.dtype).view(tensor.shape)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(self._ready)
            target.copy_(tensor, non_blocking=True)
        self._stream.synchronize()


_NUMPY_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_numpy_words(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as numpy, without a copy: flat bytes when contiguous,
    else a strided view as same-size words (also for dtypes numpy lacks)."""
    size = tensor.element_size()
    if not tensor.is_contiguous() and size in _TORCH_WORDS:
        return tensor.view(_TORCH_WORDS[size]).numpy().view(_NUMPY_WORDS[size])
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy()


@dataclass(frozen=True)
class LoadedState:
    step: int
    loader_state: Mapping[str, Any] = field(default_factory=dict)


def load_train_state(manifest: Manifest, buffer: Bytes, model: torch.nn.Module,
                     optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                     *, restore_rng: bool = True) -> LoadedState:
    """Apply a verified state (restored or fetched) to live objects, at the commit point."""
    tensors = {spec.name: as_tensor(spec.raw(buffer), spec.dtype, spec.shape)
               for spec in manifest.tensors}
    model.load_state_dict({k[len(MODEL):]: v for k, v in tensors.items()
                           if k.startswith(MODEL)})
    meta = manifest.meta
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(tensors, meta))
    if scheduler is not None and "scheduler" in meta:
        scheduler.load_state_dict(dict(meta["scheduler"]))
    if restore_rng:
        _restore_rng(tensors, meta)
    return LoadedState(int(meta.get("step", manifest.step)), dict(meta.get("loader_state", {})))


def _optimizer_state(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]
                     ) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        if name.startswith(OPTIM):
            param_id, key = name[len(OPTIM):].split("/", 1)
            # A clone: optimizers keep same-device tensors as given, and the
            # buffer behind these views is reused by the next snapshot or fetch.
            state.setdefault(int(param_id), {})[key] = tensor.clone()
    for param_id, values in dict(meta.get("optim_scalars", {})).items():
        state.setdefault(int(param_id), {}).update(values)
    return {"state": state, "param_groups": [dict(g) for g in meta["optim_param_groups"]]}


def _restore_rng(tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
    if "rng/torch" in tensors:
        torch.set_rng_state(tensors["rng/torch"].clone())
    cuda = sorted((k for k in tensors if k.startswith("rng/cuda/")),
                  key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k].clone() for k in cuda])
    if "rng/numpy" in tensors and "rng_numpy" in meta:
        kind, pos, has_gauss, gauss = meta["rng_numpy"]
        keys = tensors["rng/numpy"].numpy().view(np.uint32).copy()
        np.random.set_state((kind, keys, int(pos), int(has_gauss), float(gauss)))
    if "rng_python" in meta:
        version, internal, gauss_next = meta["rng_python"]
        random.setstate((version, tuple(internal), gauss_next))


def _jsonable(value: Any, what: str) -> Any:
    """``value`` with tuples as lists and 0-d tensors as numbers; errors name the part."""
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, what) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{what} holds {type(value).__name__} {value!r:.80}, which a checkpoint "
                    f"cannot store as JSON")
