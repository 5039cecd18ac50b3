"""FTAR for torch: tensors (a sharded one's local part), CUDA tensors through
pinned host staging. The hooks that call it during backward (FSDP2, DDP) are the
worker's (``launcher/worker/torch_hooks.py``).

This module imports torch; only training-side code imports it (the controller,
the CLI and the Slurm plugins never do).

* ``allreduce_tensor(group, tensor, ...)``: CPU tensors are reduced in place
  through a zero-copy numpy view of their storage. CUDA tensors (or any tensor
  with ``stage=True``) are copied once into a pinned host buffer that the ring
  sends from; every reduction happens on the tensor's device (received chunks
  are copied up, added there, and the sum copied back down for the next hop);
  gathered chunks are copied up as they arrive. That device work runs on a
  staging stream of the device's own, after what the caller's current stream had
  queued; on return the caller's stream is ordered after it.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import torch

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
    local = getattr(tensor, "_local_tensor", None)   # a DTensor: this rank's shard
    if local is not None:
        tensor = local
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
    """Keeps the device tensor authoritative; the pinned host copy is what travels.

    On CUDA every device operation is queued on the device's staging stream
    (``streams.staging``), never on the caller's: that stream goes on with its own
    work meanwhile, and ``finish`` hands the result back to it.
    """

    def __init__(self, device_flat: torch.Tensor, host_flat: torch.Tensor,
                 scratch: torch.Tensor, streams: _Streams | None = None) -> None:
        self._device = device_flat
        self._host = host_flat
        self._scratch = scratch
        self._cuda = device_flat.device.type == "cuda"
        self._streams = streams
        self._divisors: dict[int, torch.Tensor] = {}

    def add(self, span: Span, incoming: np.ndarray) -> None:
        received = torch.from_numpy(incoming).view(self._device.dtype)
        with _queued_on(self._streams):
            scratch = self._scratch[:span.size]
            scratch.copy_(received)    # synchronous: the ring reuses incoming's slot next
            target = self._device[span.start:span.stop]
            target.add_(scratch)       # on the device; half types accumulate in float32 there
            self._down(span)

    def scale(self, span: Span, divisor: int) -> None:
        with _queued_on(self._streams):
            target = self._device[span.start:span.stop]
            target.div_(self._divisor(divisor) if self._cuda else divisor)
            self._down(span)

    def landed(self, span: Span) -> None:
        with _queued_on(self._streams):
            self._device[span.start:span.stop].copy_(self._host[span.start:span.stop],
                                                     non_blocking=self._cuda)

    def finish(self) -> None:
        if self._streams is not None:
            # Nothing of this operation is still queued (on the device tensor or the
            # pinned buffer) once this returns, and the caller's later work comes after
            # it. Synchronized first, so the caller's stream (often the default one,
            # shared with training) is not held up on the device by the wait.
            self._streams.staging.synchronize()
            self._streams.caller.wait_stream(self._streams.staging)

    def _down(self, span: Span) -> None:
        # Synchronous: the ring sends these host bytes as soon as this returns.
        self._host[span.start:span.stop].copy_(self._device[span.start:span.stop])

    def _divisor(self, divisor: int) -> torch.Tensor:
        """``divisor`` as a one-element float32 tensor on the device (queued on the
        staging stream). Dividing by a tensor is a true division in float32, as the
        host kernels do; CUDA would multiply by the reciprocal of a Python number,
        which can differ in the last bit when ``divisor`` is not a power of two."""
        found = self._divisors.get(divisor)
        if found is None:
            found = torch.full((1,), float(divisor), dtype=torch.float32,
                               device=self._device.device)
            self._divisors[divisor] = found
        return found


@dataclass(frozen=True)
class _Streams:
    """The CUDA streams of one staged operation: ``staging`` runs its device work,
    after what ``caller`` (the caller's current stream at entry) had queued, and
    ``caller`` waits for it at the end."""

    staging: torch.cuda.Stream
    caller: torch.cuda.Stream

    @classmethod
    def enter(cls, device: torch.device) -> _Streams:
        streams = cls(_staging_stream(device), torch.cuda.current_stream(device))
        streams.staging.wait_stream(streams.caller)   # the producer's writes come first
        return streams


def _queued_on(streams: _Streams | None) -> contextlib.AbstractContextManager[object]:
    """Device work inside goes to the staging stream (nothing changes without CUDA)."""
    if streams is None:
        return contextlib.nullcontext()
    return torch.cuda.stream(streams.staging)


@dataclass
class _StagingBuffers:
    host: torch.Tensor
    scratch: torch.Tensor


_staging: dict[tuple[int, torch.dtype, str], _StagingBuffers] = {}
_staging_streams: dict[int, torch.cuda.Stream] = {}
_staging_lock = threading.Lock()


def _staging_stream(device: torch.device) -> torch.cuda.Stream:
    """The staging stream of a CUDA device, created on first use and kept. One per
    device: staged reductions on one device follow one another (a group runs one at
    a time). torch hands out streams round-robin from a pool of 32 per device and
    priority, so other code's streams can share it: ordering stays correct, that
    code's queued work may just delay ``finish``."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _staging_lock:
        found = _staging_streams.get(index)
        if found is None:
            found = _staging_streams[index] = torch.cuda.Stream(device=index)
        return found


def _buffers(group: FtarGroup, tensor: torch.Tensor,
             streams: _Streams | None = None) -> _StagingBuffers:
    """Pinned host buffer and device scratch, grown on demand and reused. On CUDA
    the scratch is allocated on the staging stream, the only one that uses it."""
    key = (id(group), tensor.dtype, str(tensor.device))
    piece = max(group.config.chunk_bytes, 1) // tensor.element_size() + 1
    with _staging_lock:
        found = _staging.get(key)
        if found is None or found.host.numel() < tensor.numel():
            pin = tensor.device.type == "cuda"
            with _queued_on(streams):
                found = _StagingBuffers(
                    host=torch.empty(tensor.numel(), dtype=tensor.dtype, pin_memory=pin),
                    scratch=torch.empty(piece, dtype=tensor.dtype, device=tensor.device))
            _staging[key] = found
        return found


def _reduce_staged(group: FtarGroup, tensor: torch.Tensor, etype: ElementType, op: ReduceOp,
                   contributes: bool, step: int | None) -> int:
    device_flat = tensor.reshape(-1)
    streams = _Streams.enter(tensor.device) if tensor.device.type == "cuda" else None
    buffers = _buffers(group, tensor, streams)
    host = buffers.host[:device_flat.numel()]
    combiner = StagingCombiner(device_flat, host, buffers.scratch, streams)
    with _queued_on(streams):
        if not contributes:
            device_flat.zero_()
        host.copy_(device_flat)                   # device -> pinned host, synchronous
    try:
        return group.reduce_flat(_numpy_view(host), etype, op=op, contributes=contributes,
                                 step=step, combiner=combiner)
    except BaseException:
        combiner.finish()   # leave nothing queued on a tensor the caller may now free
        raise
