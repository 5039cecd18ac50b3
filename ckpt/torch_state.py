"""Torch front end: a training state as a ``StateSource``, and loading it back.

Training-side only: this module imports torch (3.3 s); the controller never
imports it. The flat layout of a rank's state:

* ``model/<key>``: ``model.state_dict()``; buffers (BatchNorm statistics and
  the like change during forward) are *eager*, copied when the snapshot starts;
* ``optim/state/<param id>/<key>``: the optimizer's per-parameter tensors;
* ``rng/torch``, ``rng/cuda/<i>``, ``rng/numpy``: generator states (eager);
* ``state/<i>``: the tensors of ``stateful`` (any object with ``state_dict()`` /
  ``load_state_dict()``: an LR scheduler, or the script's registered objects),
  copied when the snapshot starts (eager);
* JSON ``meta``: optimizer param groups and scalar state, the rest of
  ``stateful``'s state (``state``, see ``encode_state``), Python and numpy RNG
  scalars, ``step``, ``loader_state``, and ``layout``.

Sharded models (FSDP2, any DTensor): a rank snapshots, serves and loads only
its local shards. Each DTensor is recorded as its local tensor (the manifest's
shapes are local shapes) and ``meta["layout"]`` records its mesh, placements
and global shape (``ft_launch.ckpt.manifest.build_layout``). ``load_train_state`` refuses
a state whose layout differs from the live objects' (``LayoutMismatchError``)
before it changes anything, and rebuilds DTensors with the live mesh.

On CUDA the device-to-host copy runs on a dedicated stream into pinned
buffers, after an event recorded when the snapshot started (so it sees the
optimizer step's result); the background thread waits per tensor.
"""

from __future__ import annotations

import functools
import random
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ft_launch.errors import UsageError

from .errors import LayoutMismatchError
from .manifest import (
    Bytes,
    Layout,
    Manifest,
    ShardInfo,
    TensorDesc,
    build_layout,
    layout_difference,
    layout_shards,
)

MODEL = "model/"
OPTIM = "optim/state/"
STATE = "state/"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a DTensor. Its module is looked up, not imported: no tensor can
    be one before it is, and importing it costs a plain job time for nothing
    (measurements: benchmarks/results/measurements.md#dtensor-import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes this rank holds of ``tensor``: its local shard if sharded (the
    same memory, not a copy), else the tensor itself; detached either way."""
    if is_sharded(tensor):
        if not torch.is_grad_enabled():   # the context manager costs more than the rest
            return tensor.to_local().detach()  # type: ignore[attr-defined, no-any-return]
        with torch.no_grad():  # no autograd node: the very local tensor, viewed
            return tensor.to_local().detach()  # type: ignore[attr-defined, no-any-return]
    return tensor.detach()


def shard_info(tensor: torch.Tensor) -> ShardInfo:
    """How a DTensor is sharded, in the manifest's terms."""
    return _shard_info(tensor.device_mesh, tuple(tensor.placements),  # type: ignore[attr-defined]
                       tuple(tensor.shape), tuple(local_tensor(tensor).shape))


@functools.lru_cache(maxsize=4096)
def _shard_info(mesh: Any, placements: tuple[Any, ...], global_shape: tuple[int, ...],
                local_shape: tuple[int, ...]) -> ShardInfo:
    # Cached: every snapshot describes every shard, and a mesh's shape is computed
    # anew on each read (in Python); a model has a handful of distinct shardings.
    names = mesh.mesh_dim_names
    return ShardInfo(mesh_shape=tuple(mesh.shape), coordinate=tuple(mesh.get_coordinate() or ()),
                     mesh_dim_names=None if names is None else tuple(names),
                     placements=tuple(repr(p) for p in placements),
                     global_shape=global_shape, local_shape=local_shape)


def layout_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Layout:
    """The ``layout`` a snapshot of these objects records now (optimizer tensors
    only where the optimizer has state). ``layout_of(model)`` is what ranks of
    replicas compare (``ft_launch.ckpt.manifest.layout_digest``) before one catches up."""
    return build_layout({name: shard_info(t) for name, t in _named_tensors(model, optimizer)
                         if is_sharded(t)})


def _named_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
                   ) -> list[tuple[str, torch.Tensor]]:
    named = [(MODEL + k, t) for k, t in model.state_dict(keep_vars=True).items()]
    if optimizer is not None:
        for param_id, values in optimizer.state_dict()["state"].items():
            named += [(f"{OPTIM}{param_id}/{k}", v) for k, v in values.items()
                      if isinstance(v, torch.Tensor)]
    return named


def pinned_allocator(nbytes: int) -> Bytes:
    """Page-locked host memory (CUDA only): device copies into it run asynchronously."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def as_tensor(spec_view: Bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A torch tensor over raw bytes (no copy when the bytes are writable)."""
    raw = spec_view if spec_view.flags.writeable else spec_view.copy()
    return torch.from_numpy(raw).view(getattr(torch, dtype)).view(tuple(shape))


class TorchStateSource:
    """One step's state of a model / optimizer / ``stateful`` object (an LR
    scheduler, or several objects under names), ready to be snapshotted.

    Build it after ``optimizer.step()``; it holds references to the live
    tensors, which ``copy_into`` reads from the snapshot thread (``stateful``'s
    tensors are copied at once, when the snapshot starts).

    ``previous``: the source of the step before, of the same objects. A tensor that
    is the very object it was then, in the same place, with the same local shape
    and dtype, keeps its description and sharding (reading a DTensor's mesh and
    placements costs more Python than the rest of a small model's snapshot).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 stateful: Any = None, *, step: int,
                 loader_state: Mapping[str, Any] | None = None, rng: bool = True,
                 stream: Any = None, previous: TorchStateSource | None = None) -> None:
        self._previous = previous
        self._objects: list[torch.Tensor] = []     # as given: DTensors stay DTensors
        self._tensors: list[torch.Tensor] = []
        self._descs: list[TensorDesc] = []
        self._meta: dict[str, Any] = {"step": step, "loader_state": dict(loader_state or {})}
        self._shards: dict[str, ShardInfo] = {}
        self._stream = stream
        self._ready: Any = None
        self._add_model(model)
        if optimizer is not None:
            self._add_optimizer(optimizer)
        if stateful is not None:
            self._meta["state"], tensors = encode_state(stateful.state_dict())
            for index, tensor in enumerate(tensors):
                self._add(f"{STATE}{index}", tensor, eager=True)
        if rng:
            self._add_rng()
        if self._shards:
            self._meta["layout"] = self._same_layout() or build_layout(self._shards)
        self._previous = None   # what it describes is copied; no chain of sources
        if any(t.is_cuda for t in self._tensors):
            # On the tensors' device, whatever device this thread has current: the
            # copies must be ordered after the step that produced them there.
            device = next(t.device for t in self._tensors if t.is_cuda)
            self._stream = self._stream or torch.cuda.Stream(device=device)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))

    def _add(self, name: str, tensor: torch.Tensor, eager: bool) -> None:
        local = local_tensor(tensor)
        index = len(self._descs)
        prev = self._previous
        if (prev is not None and index < len(prev._descs) and prev._objects[index] is tensor
                and prev._descs[index].name == name and prev._descs[index].eager == eager
                and prev._tensors[index].shape == local.shape
                and prev._tensors[index].dtype == local.dtype):
            desc, info = prev._descs[index], prev._shards.get(name)
        else:
            desc = TensorDesc(name, dtype_name(local.dtype), tuple(local.shape), eager)
            info = shard_info(tensor) if is_sharded(tensor) else None
        if info is not None:
            self._shards[name] = info
        self._objects.append(tensor)
        self._tensors.append(local)
        self._descs.append(desc)

    def _same_layout(self) -> Layout | None:
        """The previous source's layout, if every shard is described as it was."""
        prev = self._previous
        if (prev is None or "layout" not in prev._meta or len(prev._shards) != len(self._shards)
                or any(prev._shards.get(name) is not info for name, info in self._shards.items())):
            return None
        return prev._meta["layout"]  # type: ignore[no-any-return]

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

    def moves(self, index: int, dest: Bytes) -> bool:
        """False when tensor ``index`` already lives at ``dest`` (resident.py)."""
        tensor = self._tensors[index]
        return (tensor.is_cuda or not tensor.is_contiguous()
                or tensor.data_ptr() != dest.ctypes.data)

    def copy_into(self, index: int, dest: Bytes) -> None:
        tensor = self._tensors[index]
        if not tensor.is_cuda:
            if not self.moves(index, dest):
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
                     optimizer: torch.optim.Optimizer | None = None, stateful: Any = None,
                     *, restore_rng: bool = True) -> LoadedState:
    """Apply a verified state (restored or fetched) to live objects, at the commit point.
    ``stateful`` (as given to ``TorchStateSource``) loads its part, if the state has one.

    Sharded live objects get this rank's shards, as DTensors on their own mesh;
    a state sharded otherwise than they are (or not at all) raises
    ``LayoutMismatchError`` before anything is changed.
    """
    live = _live_counterparts(manifest, model, optimizer)
    _check_layout(manifest, live)
    tensors = {spec.name: sharded_like(live.get(spec.name),
                                       as_tensor(spec.raw(buffer), spec.dtype, spec.shape))
               for spec in manifest.tensors}
    model.load_state_dict({k[len(MODEL):]: v for k, v in tensors.items()
                           if k.startswith(MODEL)})
    meta = manifest.meta
    if optimizer is not None:
        optimizer.load_state_dict(_optimizer_state(tensors, meta))
    if stateful is not None and "state" in meta:
        count = sum(1 for name in tensors if name.startswith(STATE))
        # clones: the buffer behind these views is reused by the next snapshot or fetch
        stateful.load_state_dict(decode_state(
            meta["state"], [tensors[f"{STATE}{index}"].clone() for index in range(count)]))
    if restore_rng:
        _restore_rng(tensors, meta)
    return LoadedState(int(meta.get("step", manifest.step)), dict(meta.get("loader_state", {})))


def check_layout(manifest: Manifest, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Raise ``LayoutMismatchError`` unless every tensor of ``manifest`` is sharded
    as its live counterpart is: what ``load_train_state`` checks first, callable
    as soon as a peer's manifest is known (before its bytes are fetched)."""
    _check_layout(manifest, _live_counterparts(manifest, model, optimizer))


def _check_layout(manifest: Manifest, live: Mapping[str, torch.Tensor]) -> None:
    stored = manifest.meta.get("layout") or {}
    names = {spec.name for spec in manifest.tensors} | set(layout_shards(stored))
    current = build_layout({name: shard_info(t) for name, t in live.items()
                            if name in names and is_sharded(t)})
    difference = layout_difference(
        stored, current, stored_shapes={spec.name: spec.shape for spec in manifest.tensors},
        live_shapes={name: tuple(t.shape) for name, t in live.items()})
    if difference is not None:
        raise LayoutMismatchError(difference, stored=stored, live=current, rank=manifest.rank)


def _live_counterparts(manifest: Manifest, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """For each stored model and optimizer tensor, the live tensor it must fit.

    An optimizer without state yet (built, never stepped) has no moments to
    compare: a moment's counterpart is then its parameter, if the stored tensor
    has the parameter's global shape (Adam's do), else nothing (a plain scalar).
    """
    live = {MODEL + k: t for k, t in model.state_dict(keep_vars=True).items()}
    if optimizer is None:
        return live
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stored = layout_shards(manifest.meta.get("layout"))
    for spec in manifest.tensors:
        if not spec.name.startswith(OPTIM):
            continue
        param_id, key = spec.name[len(OPTIM):].split("/", 1)
        if not 0 <= int(param_id) < len(params):
            continue
        param = params[int(param_id)]
        value = optimizer.state.get(param, {}).get(key)
        shape = stored[spec.name].global_shape if spec.name in stored else spec.shape
        if isinstance(value, torch.Tensor):
            live[spec.name] = value
        elif tuple(param.shape) == shape:
            live[spec.name] = param
    return live


def sharded_like(live: torch.Tensor | None, local: torch.Tensor) -> torch.Tensor:
    """``local`` as this rank's shard of a DTensor laid out as ``live`` is (on its
    mesh, with its placements and global shape); ``local`` itself if ``live`` is
    plain or None. The shapes must agree: ``check_layout`` says whether they do."""
    if live is None or not is_sharded(live):
        return local
    from torch.distributed.tensor import DTensor  # imported already: ``live`` is one
    with torch.no_grad():
        return DTensor.from_local(local, live.device_mesh,  # type: ignore[attr-defined]
                                  live.placements, run_check=False,  # type: ignore[attr-defined]
                                  shape=live.shape, stride=live.stride())


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


# Markers of what JSON has no value for; a dict of the state that holds one of these
# keys itself is stored as a list of items, so no marker is ever the state's own key.
_TENSOR, _TUPLE, _ITEMS = "__tensor__", "__tuple__", "__items__"
_MARKERS = frozenset((_TENSOR, _TUPLE, _ITEMS))


def encode_state(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """A state dict as JSON, and its tensors, for the flat layout: each tensor is
    replaced by its index in the list (and its device). Tuples, and dicts whose keys
    are not all strings, keep their types through ``decode_state``: the state loads
    back exactly as it was. Anything else raises ``UsageError`` naming where it is
    (the first key is the registered object's name)."""
    tensors: list[torch.Tensor] = []

    def encode(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return {_TENSOR: len(tensors) - 1, "device": str(value.device)}
        if value is None or isinstance(value, bool | int | float | str):
            return value
        if isinstance(value, np.generic) and isinstance(value.item(), bool | int | float):
            return value.item()
        if isinstance(value, tuple):
            return {_TUPLE: [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [encode(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, Mapping):
            if all(isinstance(k, str) for k in value) and not _MARKERS & value.keys():
                return {k: encode(v, f"{path}/{k}" if path else k) for k, v in value.items()}
            return {_ITEMS: [[encode(k, f"{path} key {k!r}"), encode(v, f"{path}/{k!r}")]
                             for k, v in value.items()]}
        raise UsageError(
            f"the state at {path!r} is a {type(value).__name__} ({value!r:.60}): a snapshot "
            "holds tensors and plain values (numbers, strings, None, lists, tuples, dicts) only",
            hint="make state_dict() return those (a numpy array: torch.from_numpy(array); an "
                 "object: its own state_dict()), and load_state_dict() take them back")

    return encode(state, ""), tensors


def decode_state(encoded: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """What ``encode_state`` took apart, with ``tensors`` in their places (moved back
    to the device each was on)."""
    if isinstance(encoded, list):
        return [decode_state(v, tensors) for v in encoded]
    if not isinstance(encoded, dict):
        return encoded
    if _TENSOR in encoded:
        tensor = tensors[encoded[_TENSOR]]
        return tensor if encoded["device"] == str(tensor.device) else tensor.to(encoded["device"])
    if _TUPLE in encoded:
        return tuple(decode_state(v, tensors) for v in encoded[_TUPLE])
    if _ITEMS in encoded:
        return {decode_state(k, tensors): decode_state(v, tensors) for k, v in encoded[_ITEMS]}
    return {k: decode_state(v, tensors) for k, v in encoded.items()}
