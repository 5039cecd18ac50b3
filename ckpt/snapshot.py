"""In-memory dual-buffer snapshots (ByteRobust's every-step checkpoint).

Two preallocated CPU buffers alternate: the snapshot of step n goes into the
buffer that does not hold the newest complete snapshot, so that one stays
readable (by restore, the state server, the backup sender) while the copy runs.
With ``resident.py``'s Adam there is no copy of the parameters and moments:
the optimizer step writes them into the claimed buffer (``claim``), and
``start`` copies only the rest.

Protocol per step, in the training thread::

    optimizer.step()
    snapshotter.start(step, source)      # returns at once; the copy runs in a thread
                                         # (a small one, INLINE_COPY_BYTES: done here)
    ... forward / backward of the next step ...
    snapshotter.wait_ready()              # normally already done: costs nothing
    optimizer.step()

The copy reads live tensors that only ``optimizer.step()`` modifies, hence the
wait before it. Tensors that change elsewhere (``eager``: model buffers, RNG
states) are copied in ``start`` itself.

A buffer is usable only in state COMPLETE, reached after every tensor was
copied; a copy that fails leaves it FAILED and the other buffer (the previous
snapshot) remains the newest complete one. Readers take a lease; the writer
never waits for a reader: if the buffer it would overwrite is leased, that
step's snapshot is skipped and counted.

Checksums are lazy. Every step pays for the copy only; the per-tensor CRC-32s
are computed the first time the snapshot is used (served for catch-up, pushed
as a backup, persisted, restored), from the snapshot buffer under the lease,
and kept in its manifest. So every copy that leaves the process carries them
and every receiver verifies them; what the CRC no longer covers is a bit flip
in this process's own RAM between the copy and its first use (ECC's job;
``eager_checksums`` restores that cover at the old price). A CRC in the snapshot
thread at every step cost far more than the copy itself (measurements:
benchmarks/results/measurements.md#snapshot-checksums).

What a snapshot still costs a CPU trainer is the copy's memory traffic, with no
idle core to hide it in. SCHED_IDLE instead of niceness, nice 0, no helpers, and
copying with torch's OpenMP team at the wait all measured within the noise of
this design, so none is used (measurements:
benchmarks/results/measurements.md#snapshot-step-time).

Priorities on a CPU-bound trainer: the snapshot thread runs at niceness
``ckpt.snapshot_nice`` (19). The copy competes with the compute threads for the
same cores, and an OpenMP thread that loses its core stalls its whole team at
the next barrier; at niceness 19 a thread takes a sliver of a busy core and runs
freely on an idle one (measurements:
benchmarks/results/measurements.md#snapshot-priority). It holds no lease, so
starving it delays nothing but its own copy; what is left when ``wait_ready``
comes is copied by the training thread and a helper at normal priority, since
training waits anyway. Copies go through numpy (one thread, GIL released),
never torch's ``copy_``, which would start a second OpenMP team. On GPU the
thread mostly waits for the device-to-host DMA and none of this matters.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ft_launch.config import CkptConfig

from .dual import Allocator, DualBuffer, Slot, SlotState, Snapshot, numpy_allocator
from .errors import SnapshotFailedError
from .manifest import Bytes, Manifest, TensorDesc, TensorSpec, add_checksums, plan_layout

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()


class StateSource(Protocol):
    """A rank's training state seen as named tensors (numpy or torch behind it)."""

    def describe(self) -> Sequence[TensorDesc]:
        """Name, dtype and shape of each tensor, in a fixed order."""
        ...

    def meta(self) -> Mapping[str, Any]:
        """The non-tensor parts as JSON values, read when the snapshot starts."""
        ...

    def copy_into(self, index: int, dest: Bytes) -> None:
        """Copy tensor ``index``'s bytes into ``dest``; complete when it returns.

        Called from the snapshot thread and, in ``wait_ready``, from the training
        thread at the same time (never twice for one tensor).

        Optional: ``moves(index, dest) -> bool``, False when ``copy_into`` would move
        nothing (the tensor already lives at ``dest``: ``resident.py``). Without it
        every tensor counts as moved.
        """
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
    claim_wait_seconds: float = 0.0  # resident state waiting for a reader of its next buffer
    copied_while_waiting: int = 0   # tensors copied by ``wait_ready``'s threads


def _lower_priority(nice: int) -> None:
    """Lower this thread's scheduling priority (Linux: niceness is per thread)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.debug("could not lower the snapshot thread's priority: %s", exc)


#: Bytes to copy at most for ``start`` to copy them itself, with no snapshot thread:
#: what is left of a resident state (step counters, small unsharded tensors). A thread
#: started per step waits to be scheduled, and one that holds the GIL at niceness 19
#: between small copies stalls the training thread on a busy host, both costing more
#: than copying this much (well under a millisecond).
INLINE_COPY_BYTES = 1 << 20

#: Threads that copy alongside the training thread in ``wait_ready``. Two copying
#: threads beat one when the host's memory bandwidth was free (no gain when other
#: tenants used it); more would only compete for memory bandwidth (measurements:
#: benchmarks/results/measurements.md#snapshot-wait-helpers).
WAIT_HELPERS = 1


class _Job:
    """One snapshot's copy: tensors still to copy, taken by any thread that helps.

    ``copied`` is set once no tensor is left being copied (all done, or the copy
    failed), i.e. once the live tensors are no longer read.
    """

    def __init__(self, slot: Slot, header: Manifest, source: StateSource,
                 todo: Sequence[int]) -> None:
        assert slot.buffer is not None
        self.slot = slot
        self.header = header
        self.source = source
        self.buffer: Bytes = slot.buffer
        self.error: BaseException | None = None
        self.copied = threading.Event()
        self.thread: threading.Thread | None = None
        self.taken_by_waiters = 0
        self._todo = collections.deque(todo)
        self._left = len(self._todo)
        self._lock = threading.Lock()
        if not self._left:
            self.copied.set()

    def copy_some(self, waiter: bool = True) -> None:
        """Copy tensors until none is left to take (``waiter``: not the snapshot thread).

        Never raises for a failed copy (it is recorded in ``error``), except for
        what must reach the caller anyway (``KeyboardInterrupt`` and the like).
        """
        while (index := self._take(waiter)) is not None:
            try:
                self.source.copy_into(index, self.header.tensors[index].raw(self.buffer))
            except BaseException as exc:  # recorded; the snapshot thread fails the slot
                self._settle(exc)
                if not isinstance(exc, Exception):
                    raise
                return
            self._settle(None)

    def untaken(self) -> int:
        with self._lock:
            return len(self._todo)

    def _take(self, waiter: bool) -> int | None:
        with self._lock:
            if not self._todo or self.error is not None:
                return None
            self.taken_by_waiters += waiter
            return self._todo.popleft()

    def _settle(self, error: BaseException | None) -> None:
        with self._lock:
            finished = 1
            if error is not None and self.error is None:
                self.error = error
                finished += len(self._todo)  # nobody will copy the rest
                self._todo.clear()
            self._left -= finished
            if self._left == 0:
                self.copied.set()


@dataclass(frozen=True)
class _Claim:
    """A buffer claimed for the next snapshot, with the layout it was claimed for."""

    slot: Slot
    specs: tuple[TensorSpec, ...]


class DualBufferSnapshotter:
    """Snapshots of one rank: one background copy at a time, newest complete wins.

    A snapshot is a copy and nothing else: its checksums are computed when it
    is first used (served, pushed, persisted, restored: ``DualBuffer.lease``),
    so a step pays for the copy only. ``eager_checksums`` computes them in the
    snapshot thread right after the copy instead (the old behaviour: the memory
    tier is then verified from the moment of the copy, at the price of a CRC pass
    per step: benchmarks/results/measurements.md#snapshot-checksums).

    A copy of at most ``inline_bytes`` (what ``start`` must copy beyond the eager
    tensors and what is resident) is made by ``start`` itself, with no thread.

    A larger copy runs in a background thread at niceness ``worker_nice``; if it has
    not finished when ``wait_ready`` is called, the training thread and
    ``WAIT_HELPERS`` helper threads copy the remaining tensors alongside it,
    since the training thread would otherwise sit idle.
    """

    def __init__(self, *, rank: int = 0, world_size: int = 1,
                 allocator: Allocator = numpy_allocator, eager_checksums: bool = False,
                 worker_nice: int = _DEFAULTS.snapshot_nice, help_in_wait: bool = True,
                 inline_bytes: int = INLINE_COPY_BYTES) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stats = SnapshotStats()
        self.buffers = DualBuffer(allocator, name=f"snapshots of rank {rank}")
        self._eager_checksums = eager_checksums
        self._worker_nice = worker_nice
        self._help_in_wait = help_in_wait
        self._inline_bytes = inline_bytes
        self._job: _Job | None = None
        self._claimed: _Claim | None = None

    def claim(self, descs: Sequence[TensorDesc], wait: float) -> tuple[tuple[TensorSpec, ...], Bytes]:
        """The layout and buffer the next ``start`` fills, claimed now so that an
        optimizer can write the new state straight into it (``resident.py``).

        Waits up to ``wait`` seconds for a reader of that buffer. Claimed again
        before ``start`` (a step without a snapshot), it is the same buffer: it
        holds the live state, which is then updated in place.
        """
        if self._claimed is None:
            self.wait_complete()
            specs, total = plan_layout(descs)
            started = time.perf_counter()
            slot = self.buffers.begin(total, wait)
            self.stats.claim_wait_seconds += time.perf_counter() - started
            if slot is None:
                raise SnapshotFailedError(f"the snapshot buffer the optimizer step must write "
                                          f"was still being read after {wait} s", rank=self.rank)
            self._claimed = _Claim(slot, specs)
        claim = self._claimed
        assert claim.slot.buffer is not None  # a claimed slot is COPYING: its buffer exists
        return claim.specs, claim.slot.buffer

    def start(self, step: int, source: StateSource) -> bool:
        """Begin the snapshot of ``step``; False if skipped (its buffer is being read)."""
        self.wait_complete()
        descs = list(source.describe())
        specs, total = plan_layout(descs)
        claim, self._claimed = self._claimed, None
        slot: Slot | None
        if claim is not None:
            slot = claim.slot
            if specs != claim.specs:
                self._end(slot, None)
                raise ValueError(f"snapshot of step {step}: the state is laid out otherwise than "
                                 f"when its buffer was claimed (the optimizer wrote into that "
                                 f"layout); build sources the way the claim did")
        else:
            slot = self.buffers.begin(total)
        if slot is None:
            self.stats.skipped += 1
            log.debug("snapshot of step %d skipped: the buffer to reuse is being read", step)
            return False
        assert slot.buffer is not None
        eager = [i for i, desc in enumerate(descs) if desc.eager]
        try:
            meta = dict(source.meta())
            for index in eager:
                source.copy_into(index, specs[index].raw(slot.buffer))
        except BaseException:
            self._end(slot, None)
            raise
        header = Manifest(step, specs, total, self.rank, self.world_size, meta)
        background = [i for i, desc in enumerate(descs) if not desc.eager]
        moves = getattr(source, "moves", None)
        if moves is not None:
            background = [i for i in background if moves(i, specs[i].raw(slot.buffer))]
        if (not self._eager_checksums
                and sum(specs[i].nbytes for i in background) <= self._inline_bytes):
            self._copy_inline(slot, header, source, background)
            return True
        job = self._job = _Job(slot, header, source, background)
        job.thread = threading.Thread(target=self._run, args=(job,),
                                      name=f"ckpt-snapshot-{step}", daemon=True)
        job.thread.start()
        return True

    def _copy_inline(self, slot: Slot, header: Manifest, source: StateSource,
                     indices: Sequence[int]) -> None:
        """The whole (small) copy now, in the caller's thread; the snapshot is complete
        or failed when this returns. A failed copy is logged, as the thread's is."""
        assert slot.buffer is not None
        started = time.perf_counter()
        try:
            for index in indices:
                source.copy_into(index, header.tensors[index].raw(slot.buffer))
        except Exception as exc:  # noqa: BLE001 - the previous snapshot stays the newest
            self._end(slot, None)
            log.warning("snapshot of step %d failed, the newest complete one stays step %s: "
                        "%r", header.step, self.latest_step(), exc)
            return
        except BaseException:
            self._end(slot, None)
            raise
        self.stats.last_copy_seconds = time.perf_counter() - started
        self.stats.last_bytes = header.total_bytes
        self._end(slot, header)

    def wait_ready(self, timeout: float | None = None) -> SlotState:
        """Block until the running snapshot no longer reads the live tensors.

        Call before ``optimizer.step()``. Copies the tensors the snapshot thread
        has not reached yet. Returns FAILED if that copy failed (logged, not
        raised: training goes on and the previous snapshot stays the newest),
        else COMPLETE.
        """
        job = self._job
        if job is None:
            return SlotState.COMPLETE if self.latest_step() is not None else SlotState.EMPTY
        started = time.perf_counter()
        if self._help_in_wait and not job.copied.is_set():
            self._help(job)
        if not job.copied.wait(timeout):
            raise SnapshotFailedError(f"snapshot copy still running after {timeout} s",
                                      rank=self.rank)
        self.stats.wait_seconds += time.perf_counter() - started
        return SlotState.FAILED if job.error is not None else SlotState.COMPLETE

    def _help(self, job: _Job) -> None:
        """Copy what is left with the training thread and ``WAIT_HELPERS`` more threads.

        The helpers are new threads at the training thread's priority: the
        snapshot thread's low priority is right while training computes, but
        now the training thread waits and its cores are ours.
        """
        before = job.taken_by_waiters
        for _ in range(min(WAIT_HELPERS, job.untaken() - 1)):
            threading.Thread(target=job.copy_some, name="ckpt-snapshot-helper",
                             daemon=True).start()
        job.copy_some()
        self.stats.copied_while_waiting += job.taken_by_waiters - before

    def wait_complete(self, timeout: float | None = None) -> SlotState:
        """Block until the running snapshot is complete or failed."""
        job = self._job
        if job is None:
            return SlotState.COMPLETE if self.latest_step() is not None else SlotState.EMPTY
        state = self.wait_ready(timeout)
        assert job.thread is not None
        job.thread.join(timeout)
        if job.thread.is_alive():
            raise SnapshotFailedError(f"snapshot thread still running after {timeout} s",
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

    def lease(self, step: int | None = None, timeout: float = 0.0, *,
              checksums: bool = True) -> contextlib.AbstractContextManager[Snapshot]:
        """See ``DualBuffer.lease``."""
        return self.buffers.lease(step, timeout, checksums=checksums)

    def _run(self, job: _Job) -> None:
        _lower_priority(self._worker_nice)
        started = time.perf_counter()
        job.copy_some(waiter=False)
        job.copied.wait()  # the training thread may still be copying its last tensor
        self.stats.last_copy_seconds = time.perf_counter() - started
        manifest: Manifest | None = None
        if job.error is None:
            try:
                manifest = (add_checksums(job.header, job.buffer) if self._eager_checksums
                            else job.header)
            except Exception as exc:  # noqa: BLE001 - the thread reports any failure
                job.error = exc
        if manifest is not None:
            self.stats.last_bytes = job.header.total_bytes
        self._end(job.slot, manifest)

    def _end(self, slot: Slot, manifest: Manifest | None) -> None:
        if manifest is None:
            self.stats.failed += 1
            self.buffers.fail(slot)
        else:
            self.stats.taken += 1
            self.buffers.commit(slot, manifest)
