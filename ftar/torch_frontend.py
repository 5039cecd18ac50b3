"""FTAR for torch: tensors, CUDA tensors through pinned host staging, a DDP hook.

This module imports torch; only training-side code imports it (the controller,
the CLI and the Slurm plugins never do).

* ``allreduce_tensor(group, tensor, ...)``: CPU tensors are reduced in place
  through a zero-copy numpy view of their storage. CUDA tensors (or any tensor
  with ``stage=True``) are copied once into a pinned host buffer that the ring
  sends from; every reduction happens on the tensor's device (received chunks
  are copied up, added there, and the sum copied back down for the next hop);
  gathered chunks are copied up as they arrive.
* ``ddp_comm_hook(state, bucket)``: register with
  ``model.register_comm_hook(FtarHookState(group), ddp_comm_hook)``; DDP then
  averages each gradient bucket across replicas with FTAR (after the replica's
  own all-reduce when ``intra_group`` is given). Buckets run on one background
  thread, overlapping the rest of backward. A recoverable failure does not raise
  into backward: it is kept in ``state.error``, later buckets are skipped, and the
  training loop must skip the optimizer step (``state.take_error()``); a fatal
  error fails the bucket's future.
"""

# No ``from __future__ import annotations`` here: DDP checks the hook's annotations
# against the real ``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]``.
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ftcore.errors import FtError, RecoverableError

from .dtypes import ElementType
from .errors import FtarUsageError
from .ring import FtarGroup, ReduceOp
from .schedule import Span

_ETYPES = {torch.float32: ElementType.FLOAT32, torch.float64: ElementType.FLOAT64,
           torch.float16: ElementType.FLOAT16, torch.bfloat16: ElementType.BFLOAT16}
# torch dtypes whose numpy view holds the same bytes (bfloat16 travels as raw int16 bits)
_STORAGE = {torch.float32: torch.float32, torch.float64: torch.float64,
            torch.float16: torch.float16, torch.bfloat16: torch.int16}


def allreduce_tensor(group: FtarGroup, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVG,
                     contributes: bool = True, step: int | None = None, *,
                     stage: bool | None = None) -> int:
    """Reduce ``tensor`` in place across the quorum; the number of contributors.

    ``stage``: go through pinned host staging with the reduction on the device
    (default: only for non-CPU tensors).
    """
    etype = _ETYPES.get(tensor.dtype)
    if etype is None:
        raise FtarUsageError(f"unsupported tensor dtype {tensor.dtype}; FTAR reduces "
                             f"{', '.join(str(d) for d in _ETYPES)}", step=step)
    with torch.no_grad():
        work = tensor if tensor.is_contiguous() else tensor.contiguous()
        if stage or (stage is None and work.device.type != "cpu"):
            count = _reduce_staged(group, work, etype, op, contributes, step)
        else:
            count = group.reduce_flat(_numpy_view(work), etype, op=op,
                                      contributes=contributes, step=step)
        if work is not tensor:
            tensor.copy_(work)
    return count


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's storage as a flat numpy array (shares memory, no copy)."""
    flat = tensor.detach().reshape(-1).view(_STORAGE[tensor.dtype]).numpy()
    return flat.view(np.uint16) if tensor.dtype is torch.bfloat16 else flat


class StagingCombiner:
    """Keeps the device tensor authoritative; the pinned host copy is what travels."""

    def __init__(self, device_flat: torch.Tensor, host_flat: torch.Tensor,
                 scratch: torch.Tensor) -> None:
        self._device = device_flat
        self._host = host_flat
        self._scratch = scratch
        self._cuda = device_flat.device.type == "cuda"

    def add(self, span: Span, incoming: np.ndarray) -> None:
        received = torch.from_numpy(incoming).view(self._device.dtype)
        scratch = self._scratch[:span.size]
        scratch.copy_(received)
        target = self._device[span.start:span.stop]
        target.add_(scratch)       # on the device; half types accumulate in float32 there
        self._down(span)

    def scale(self, span: Span, divisor: int) -> None:
        self._device[span.start:span.stop].div_(divisor)
        self._down(span)

    def landed(self, span: Span) -> None:
        self._device[span.start:span.stop].copy_(self._host[span.start:span.stop],
                                                 non_blocking=self._cuda)

    def finish(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self._device.device)

    def _down(self, span: Span) -> None:
        # Synchronous: the ring sends these host bytes as soon as this returns.
        self._host[span.start:span.stop].copy_(self._device[span.start:span.stop])


@dataclass
class _StagingBuffers:
    host: torch.Tensor
    scratch: torch.Tensor


_staging: dict[tuple[int, torch.dtype, str], _StagingBuffers] = {}
_staging_lock = threading.Lock()


def _buffers(group: FtarGroup, tensor: torch.Tensor) -> _StagingBuffers:
    """Pinned host buffer and device scratch, grown on demand and reused."""
    key = (id(group), tensor.dtype, str(tensor.device))
    piece = max(group.config.chunk_bytes, 1) // tensor.element_size() + 1
    with _staging_lock:
        found = _staging.get(key)
        if found is None or found.host.numel() < tensor.numel():
            pin = tensor.device.type == "cuda"
            found = _StagingBuffers(
                host=torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=pin),
                scratch=torch.empty(piece, dtype=tensor.dtype, device=tensor.device))
            _staging[key] = found
        return found


def _reduce_staged(group: FtarGroup, tensor: torch.Tensor, etype: ElementType, op: ReduceOp,
                   contributes: bool, step: int | None) -> int:
    device_flat = tensor.reshape(-1)
    if not contributes:
        device_flat.zero_()
    buffers = _buffers(group, tensor)
    host = buffers.host[:device_flat.numel()]
    host.copy_(device_flat)                       # device -> pinned host, synchronous
    combiner = StagingCombiner(device_flat, host, buffers.scratch)
    return group.reduce_flat(_numpy_view(host), etype, op=op, contributes=contributes,
                             step=step, combiner=combiner)


# ---------------------------------------------------------------------- DDP hook


@dataclass
class FtarHookState:
    """State of ``ddp_comm_hook``; set ``contributes`` and ``step`` before each step."""

    group: FtarGroup
    contributes: bool = True
    step: int | None = None
    intra_group: Any = None            # the replica's own process group (HSDP), or None
    error: FtError | None = None
    contributors: int = 0
    _queue: queue.SimpleQueue[Callable[[], None] | None] = field(
        default_factory=queue.SimpleQueue, repr=False)
    _worker: threading.Thread | None = field(default=None, repr=False)

    def take_error(self) -> FtError | None:
        """The recoverable error of this step (then cleared); skip the step if not None."""
        error, self.error = self.error, None
        return error

    def submit(self, job: Callable[[], None]) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._run, daemon=True, name="ftar-ddp")
            self._worker.start()
        self._queue.put(job)

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            job()

    def close(self) -> None:
        self._queue.put(None)


def ddp_comm_hook(state: FtarHookState,
                  bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average each gradient bucket across replicas."""
    tensor = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()

    def reduce_bucket() -> None:
        if state.error is not None:           # the ring broke earlier this step: skip
            future.set_result(tensor)
            return
        try:
            if state.intra_group is not None and dist.get_world_size(state.intra_group) > 1:
                tensor.div_(dist.get_world_size(state.intra_group))
                dist.all_reduce(tensor, group=state.intra_group)
            state.contributors = allreduce_tensor(state.group, tensor, ReduceOp.AVG,
                                                  state.contributes, state.step)
        except RecoverableError as exc:
            state.error = exc
        except BaseException as exc:  # noqa: BLE001 - fatal: handed to DDP, raised in backward
            future.set_exception(exc)  # type: ignore[arg-type]
            return
        future.set_result(tensor)

    state.submit(reduce_bucket)
    return future
