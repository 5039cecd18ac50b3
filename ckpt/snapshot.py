"""In-memory dual-buffer snapshots (ByteRobust's every-step checkpoint).

Two preallocated CPU buffers alternate: the snapshot of step n goes into the
buffer that does not hold the newest complete snapshot, so that one stays
readable (by restore, the state server, the backup sender) while the copy runs.

Protocol per step, in the training thread::

    optimizer.step()
    snapshotter.start(step, source)      # returns at once; the copy runs in a thread
    ... forward / backward of the next step ...
    snapshotter.wait_ready()              # normally already done: costs nothing
    optimizer.step()

The copy reads live tensors that only ``optimizer.step()`` modifies, hence the
wait before it. Tensors that change elsewhere (``eager``: model buffers, RNG
states) are copied in ``start`` itself.

A buffer is usable only in state COMPLETE, reached after every tensor was
copied and check-summed; a copy that fails leaves it FAILED and the other buffer
(the previous snapshot) remains the newest complete one. Readers take a lease;
the writer never waits for a reader: if the buffer it would overwrite is leased,
that step's snapshot is skipped and counted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from .dual import Allocator, DualBuffer, Slot, SlotState, Snapshot, numpy_allocator
from .errors import SnapshotFailedError
from .manifest import Bytes, Manifest, TensorDesc, plan_layout
from .manifest import checksum as crc32_of

log = logging.getLogger(__name__)


class StateSource(Protocol):
    """A rank's training state seen as named tensors (numpy or torch behind it)."""

    def describe(self) -> Sequence[TensorDesc]:
        """Name, dtype and shape of each tensor, in a fixed order."""
        ...

    def meta(self) -> Mapping[str, Any]:
        """The non-tensor parts as JSON values, read when the snapshot starts."""
        ...

    def copy_into(self, index: int, dest: Bytes) -> None:
        """Copy tensor ``index``'s bytes into ``dest``; complete when it returns."""
        ...


class ArrayState:
    """A ``StateSource`` over numpy arrays (used by tests, benchmarks, the controller)."""

    def __init__(self, arrays: Mapping[str, npt.NDArray[Any]],
                 meta: Mapping[str, Any] | None = None, eager: Collection[str] = ()) -> None:
        self._arrays = [np.ascontiguousarray(a) for a in arrays.values()]
        self._descs = [TensorDesc(name, np.dtype(a.dtype).name, tuple(a.shape), name in eager)
                       for name, a in zip(arrays, self._arrays)]
        self._meta = dict(meta or {})

    def describe(self) -> Sequence[TensorDesc]:
        return self._descs

    def meta(self) -> Mapping[str, Any]:
        return self._meta

    def copy_into(self, index: int, dest: Bytes) -> None:
        array = self._arrays[index]
        np.copyto(dest.view(array.dtype).reshape(array.shape), array, casting="no")


@dataclass
class SnapshotStats:
    """Counters and the last copy's duration, for metrics and the benchmark."""

    taken: int = 0
    skipped: int = 0
    failed: int = 0
    last_copy_seconds: float = 0.0
    last_bytes: int = 0
    wait_seconds: float = 0.0


#: Niceness of the snapshot thread. On CPU training the copy and the CRC compete
#: with the compute threads for the same cores, and an OpenMP thread that loses
#: its core stalls its whole team at the next barrier. At the lowest priority the
#: snapshot runs when a core is idle (Python and autograd gaps); if it has not
#: finished by the next optimizer step, ``wait_ready`` blocks and it runs alone,
#: so it never costs more than its own duration. (An A/B of 0 against 19 on the
#: shared 2-core build machine was inconclusive: other jobs' noise was larger.)
#: On GPU the thread mostly waits for the DMA copy and this hardly matters.
WORKER_NICE = 19


def _lower_priority(nice: int) -> None:
    """Lower this thread's scheduling priority (Linux: niceness is per thread)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.debug("could not lower the snapshot thread's priority: %s", exc)


@dataclass
class _Job:
    """One background snapshot: ``copied`` is set once the live tensors are no longer read."""

    copied: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None


class DualBufferSnapshotter:
    """Snapshots of one rank: one background copy at a time, newest complete wins.

    A snapshot runs in two phases in its thread: the copy (reads the live
    tensors; ``wait_ready`` waits for it before the next optimizer step), then
    the checksums (read only our buffer, so they overlap the next step freely;
    ``start`` of the next snapshot waits for them).
    """

    def __init__(self, *, rank: int = 0, world_size: int = 1,
                 allocator: Allocator = numpy_allocator, checksums: bool = True,
                 worker_nice: int = WORKER_NICE) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stats = SnapshotStats()
        self.buffers = DualBuffer(allocator, name=f"snapshots of rank {rank}")
        self._checksums = checksums
        self._worker_nice = worker_nice
        self._job: _Job | None = None

    def start(self, step: int, source: StateSource) -> bool:
        """Begin the snapshot of ``step``; False if skipped (its buffer is being read)."""
        self.wait_complete()
        descs = list(source.describe())
        specs, total = plan_layout(descs)
        slot = self.buffers.begin(total)
        if slot is None:
            self.stats.skipped += 1
            log.debug("snapshot of step %d skipped: the buffer to reuse is being read", step)
            return False
        assert slot.buffer is not None
        eager = {i for i, desc in enumerate(descs) if desc.eager}
        try:
            meta = dict(source.meta())
            for index in sorted(eager):
                source.copy_into(index, specs[index].raw(slot.buffer))
        except BaseException:
            self._end(slot, None)
            raise
        header = Manifest(step, specs, total, self.rank, self.world_size, meta)
        job = self._job = _Job()
        job.thread = threading.Thread(target=self._run, args=(job, slot, header, source, eager),
                                      name=f"ckpt-snapshot-{step}", daemon=True)
        job.thread.start()
        return True

    def wait_ready(self, timeout: float | None = None) -> SlotState:
        """Block until the running snapshot no longer reads the live tensors.

        Call before ``optimizer.step()``. Returns FAILED if that copy failed
        (logged, not raised: training goes on and the previous snapshot stays
        the newest), else COMPLETE (checksums may still be running).
        """
        job = self._job
        if job is None:
            return SlotState.COMPLETE if self.latest_step() is not None else SlotState.EMPTY
        started = time.perf_counter()
        if not job.copied.wait(timeout):
            raise SnapshotFailedError(f"snapshot copy still running after {timeout} s",
                                      rank=self.rank)
        self.stats.wait_seconds += time.perf_counter() - started
        return SlotState.FAILED if job.error is not None else SlotState.COMPLETE

    def wait_complete(self, timeout: float | None = None) -> SlotState:
        """Block until the running snapshot is complete or failed (checksums included)."""
        job = self._job
        if job is None:
            return SlotState.COMPLETE if self.latest_step() is not None else SlotState.EMPTY
        state = self.wait_ready(timeout)
        assert job.thread is not None
        job.thread.join(timeout)
        if job.thread.is_alive():
            raise SnapshotFailedError(f"snapshot checksums still running after {timeout} s",
                                      rank=self.rank)
        self._job = None
        if job.error is not None:
            log.warning("snapshot failed, the newest complete one stays step %s: %r",
                        self.latest_step(), job.error)
            return SlotState.FAILED
        return state

    def close(self) -> None:
        self.wait_complete()

    def latest_step(self) -> int | None:
        return self.buffers.latest_step()

    def lease(self, step: int | None = None,
              timeout: float = 0.0) -> contextlib.AbstractContextManager[Snapshot]:
        """See ``DualBuffer.lease``."""
        return self.buffers.lease(step, timeout)

    def _run(self, job: _Job, slot: Slot, header: Manifest, source: StateSource,
             done: set[int]) -> None:
        assert slot.buffer is not None
        _lower_priority(self._worker_nice)
        started = time.perf_counter()
        try:
            try:
                for index, spec in enumerate(header.tensors):
                    if index not in done:
                        source.copy_into(index, spec.raw(slot.buffer))
            finally:
                job.copied.set()  # after a failure too: the training thread must go on
            self.stats.last_copy_seconds = time.perf_counter() - started
            specs = tuple(replace(s, crc32=crc32_of(s.raw(slot.buffer))) if self._checksums
                          else s for s in header.tensors)
        except Exception as exc:  # noqa: BLE001 - the thread reports any failure, never dies silently
            job.error = exc
            self._end(slot, None)
            return
        self.stats.last_bytes = header.total_bytes
        self._end(slot, replace(header, tensors=specs))

    def _end(self, slot: Slot, manifest: Manifest | None) -> None:
        if manifest is None:
            self.stats.failed += 1
            self.buffers.fail(slot)
        else:
            self.stats.taken += 1
            self.buffers.commit(slot, manifest)
