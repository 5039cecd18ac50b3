"""Dual-buffer snapshots: round trip, alternation, never a half-written snapshot."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from ft_launch.ckpt.dual import TRANSITIONS, DualBuffer, SlotState
from ft_launch.ckpt.errors import NoCheckpointError
from ft_launch.ckpt.manifest import corrupt_tensors
from ft_launch.ckpt.snapshot import ArrayState, DualBufferSnapshotter
from tests.waiting import wait_until

from .helpers import GatedSource, assert_state_equal, make_arrays, snapshot_of

pytestmark = pytest.mark.timeout(60)


def _held(snapshotter: DualBufferSnapshotter, step: int | None = None):
    with snapshotter.lease(step) as snap:
        assert corrupt_tensors(snap.manifest, snap.buffer) == []
        return snap.manifest, snap.buffer.copy()


def test_round_trip_with_checksums_and_meta():
    snapshotter = snapshot_of(5)
    manifest, buffer = _held(snapshotter)
    assert_state_equal((manifest, buffer), 5)
    assert manifest.meta == {"step": 5}
    assert all(spec.crc32 is not None for spec in manifest.tensors)


def test_buffers_alternate_and_newest_complete_wins():
    snapshotter = DualBufferSnapshotter()
    for step in range(1, 5):
        snapshot_of(step, snapshotter)
        assert snapshotter.latest_step() == step
    assert snapshotter.buffers.complete_steps() == [3, 4]
    assert_state_equal(_held(snapshotter, 3), 3)
    assert_state_equal(_held(snapshotter), 4)


def _threaded(**kwargs) -> DualBufferSnapshotter:
    """A snapshotter whose every copy runs in its thread (these tests stop it there)."""
    return DualBufferSnapshotter(inline_bytes=0, **kwargs)


def test_copy_in_progress_never_exposes_the_new_buffer():
    snapshotter = snapshot_of(1, _threaded())
    source = GatedSource(make_arrays(2), gate_at=3)
    assert snapshotter.start(2, source)
    assert source.reached.wait(10)
    # The writer is stopped halfway through step 2: readers still see step 1, intact.
    assert set(snapshotter.buffers.states()) == {SlotState.COPYING, SlotState.COMPLETE}
    assert_state_equal(_held(snapshotter), 1)
    with pytest.raises(NoCheckpointError):
        _held(snapshotter, 2)
    source.release.set()
    assert snapshotter.wait_complete(timeout=10) is SlotState.COMPLETE
    assert_state_equal(_held(snapshotter), 2)


def test_writer_killed_mid_copy_leaves_previous_snapshot():
    snapshotter = snapshot_of(1, _threaded())
    source = GatedSource(make_arrays(2), gate_at=2, fail=True)
    snapshotter.start(2, source)
    assert snapshotter.wait_complete(timeout=10) is SlotState.FAILED
    assert snapshotter.stats.failed == 1
    assert snapshotter.latest_step() == 1
    assert_state_equal(_held(snapshotter), 1)
    snapshot_of(3, snapshotter)  # the failed buffer is reused by the next snapshot
    assert snapshotter.buffers.complete_steps() == [1, 3]


def test_leased_buffer_is_skipped_not_overwritten():
    snapshotter = snapshot_of(1)
    snapshot_of(2, snapshotter)
    with snapshotter.lease(1) as held:
        before = held.buffer.copy()
        assert not snapshotter.start(3, ArrayState(make_arrays(3)))
        assert snapshotter.stats.skipped == 1
        np.testing.assert_array_equal(held.buffer, before)
        assert not held.buffer.flags.writeable
    assert snapshotter.start(3, ArrayState(make_arrays(3)))
    snapshotter.wait_complete(timeout=10)
    assert snapshotter.latest_step() == 3


def test_eager_tensors_are_copied_before_start_returns():
    arrays = make_arrays(1)
    source = GatedSource(arrays, gate_at=0)
    source._inner = ArrayState(arrays, eager={"rng/torch"})
    snapshotter = _threaded()
    snapshotter.start(1, source)
    assert source.reached.wait(10)
    original = arrays["rng/torch"].copy()
    arrays["rng/torch"][:] = 0  # the next forward pass advances the RNG
    source.release.set()
    snapshotter.wait_complete(timeout=10)
    manifest, buffer = _held(snapshotter)
    np.testing.assert_array_equal(manifest.spec("rng/torch").view(buffer), original)


def test_growing_state_reallocates_the_buffer():
    snapshotter = snapshot_of(1, size=100)
    snapshot_of(2, snapshotter, size=100)
    snapshot_of(3, snapshotter, size=5000)  # e.g. optimizer state appears after step 1
    assert_state_equal(_held(snapshotter), 3, size=5000)
    assert_state_equal(_held(snapshotter, 2), 2, size=100)


def _stuck_in_tensor_0(kind: type[GatedSource] = GatedSource
                       ) -> tuple[DualBufferSnapshotter, GatedSource]:
    """Step 1 complete; the snapshot thread of step 2 held inside its first tensor."""
    snapshotter = snapshot_of(1, _threaded())
    source = kind(make_arrays(2), gate_at=0)
    snapshotter.start(2, source)
    assert source.reached.wait(10)
    return snapshotter, source


def _wait_ready_in_thread(snapshotter: DualBufferSnapshotter
                          ) -> tuple[threading.Thread, list[SlotState]]:
    waited: list[SlotState] = []
    waiter = threading.Thread(target=lambda: waited.append(snapshotter.wait_ready(timeout=20)))
    waiter.start()
    return waiter, waited


def test_waiting_lease_returns_when_the_step_completes():
    snapshotter, source = _stuck_in_tensor_0()
    result: list[int] = []

    def reader() -> None:
        with snapshotter.lease(2, timeout=20) as snap:
            result.append(snap.step)

    thread = threading.Thread(target=reader)
    thread.start()
    source.release.set()
    thread.join(20)
    assert result == [2]


def test_lease_of_a_replaced_step_fails_at_once():
    snapshotter = DualBufferSnapshotter()
    for step in (1, 2, 3):
        snapshot_of(step, snapshotter)
    timeout = 30.0
    started = time.monotonic()
    with pytest.raises(NoCheckpointError, match="step 1"), snapshotter.lease(1, timeout=timeout):
        pass
    assert time.monotonic() - started < timeout  # it did not wait the timeout out


def test_transition_table_rejects_illegal_moves():
    assert SlotState.COMPLETE not in TRANSITIONS[SlotState.EMPTY]
    dual = DualBuffer()
    slot = dual.begin(10)
    assert slot is not None and slot.state is SlotState.COPYING
    with pytest.raises(AssertionError, match="not an allowed transition"):
        slot.move(SlotState.COPYING)


# ---------------------------------------------------------------------- lazy checksums


def test_a_step_pays_for_the_copy_only_checksums_come_with_first_use():
    snapshotter = snapshot_of(3)
    with snapshotter.lease(checksums=False) as snap:
        assert not snap.manifest.checksummed  # nothing computed during the step
    with snapshotter.lease() as snap:
        assert snap.manifest.checksummed
        assert corrupt_tensors(snap.manifest, snap.buffer) == []
    with snapshotter.lease(checksums=False) as snap:
        assert snap.manifest.checksummed  # kept for every later reader


def test_concurrent_first_uses_compute_the_checksums_once(monkeypatch):
    from ft_launch.ckpt import dual

    calls: list[int] = []
    original = dual.add_checksums

    def counting(manifest, buffer):
        calls.append(manifest.step)
        return original(manifest, buffer)

    monkeypatch.setattr(dual, "add_checksums", counting)
    snapshotter = snapshot_of(4, size=200_000)
    seen: list[int | None] = []

    def reader() -> None:
        with snapshotter.lease() as snap:
            seen.append(snap.manifest.spec("model/w").crc32)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert calls == [4]
    assert len(seen) == 4 and len(set(seen)) == 1 and seen[0] is not None


def test_eager_checksums_are_there_when_the_snapshot_completes():
    snapshotter = snapshot_of(2, DualBufferSnapshotter(eager_checksums=True))
    with snapshotter.lease(checksums=False) as snap:
        assert snap.manifest.checksummed
        assert corrupt_tensors(snap.manifest, snap.buffer) == []


# ---------------------------------------------------------------------- copying while waiting


def test_wait_ready_copies_what_the_snapshot_thread_has_not_reached():
    snapshotter, source = _stuck_in_tensor_0()
    # Step 1's wait may have helped too (its nice-19 thread started late): count from here.
    before = snapshotter.stats.copied_while_waiting
    waiter, waited = _wait_ready_in_thread(snapshotter)
    tensors = len(make_arrays(2))
    try:
        wait_until(lambda: snapshotter.stats.copied_while_waiting - before == tensors - 1, 10,
                   "the waiting thread to copy every other tensor")
        assert waited == [] and snapshotter.latest_step() == 1  # still not complete
    finally:
        source.release.set()
    waiter.join(20)
    assert waited == [SlotState.COMPLETE]
    assert snapshotter.wait_complete(timeout=10) is SlotState.COMPLETE
    assert_state_equal(_held(snapshotter), 2)


class _FailsWhileHelped(GatedSource):
    """Holds the snapshot thread in tensor 0; tensor 2 fails for whoever copies it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed = threading.Event()

    def copy_into(self, index, dest):
        if index == 2:
            self.failed.set()
            raise RuntimeError("copy failed in the waiting thread (injected)")
        super().copy_into(index, dest)


def test_a_copy_failing_in_the_waiting_thread_fails_the_snapshot_not_training():
    snapshotter, source = _stuck_in_tensor_0(_FailsWhileHelped)
    waiter, waited = _wait_ready_in_thread(snapshotter)
    assert isinstance(source, _FailsWhileHelped) and source.failed.wait(10)
    waiter.join(0.2)
    assert waiter.is_alive()  # tensor 0 is still being read: training must not go on yet
    source.release.set()
    waiter.join(20)
    assert waited == [SlotState.FAILED]
    assert snapshotter.wait_complete(timeout=10) is SlotState.FAILED
    assert snapshotter.latest_step() == 1
    assert_state_equal(_held(snapshotter), 1)


def test_without_help_the_waiting_thread_copies_nothing():
    snapshotter = DualBufferSnapshotter(help_in_wait=False)
    snapshotter.start(1, ArrayState(make_arrays(1)))
    assert snapshotter.wait_ready(timeout=10) is SlotState.COMPLETE
    assert snapshotter.stats.copied_while_waiting == 0
    snapshotter.wait_complete(timeout=10)
    assert_state_equal(_held(snapshotter), 1)


class _RecordsPriority(GatedSource):
    """Notes the niceness of whichever thread copies each tensor."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nice: dict[int, int] = {}

    def copy_into(self, index, dest):
        self.nice[index] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        super().copy_into(index, dest)


def test_snapshot_thread_runs_at_low_priority_helpers_at_the_callers():
    snapshotter = _threaded(worker_nice=17)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    source = _RecordsPriority(make_arrays(1), gate_at=0)
    snapshotter.start(1, source)
    assert source.reached.wait(10)  # tensor 0: the snapshot thread
    waiter, _ = _wait_ready_in_thread(snapshotter)
    wait_until(lambda: len(source.nice) == len(make_arrays(1)), 10, "every tensor to start")
    source.release.set()
    waiter.join(20)
    assert source.nice[0] == max(own, 17)
    assert set(list(source.nice.values())[1:]) == {own}  # the waiting thread and its helper


class _InPlace(ArrayState):
    """Tensors ``resident`` already live in the buffer (as ``resident.py`` leaves them)."""

    def __init__(self, arrays, resident=()) -> None:
        super().__init__(arrays)
        self.resident = {i for i, name in enumerate(arrays) if name in resident}
        self.copied: list[int] = []
        self.threads: set[str] = set()

    def moves(self, index, dest):
        return index not in self.resident

    def copy_into(self, index, dest):
        self.copied.append(index)
        self.threads.add(threading.current_thread().name)
        if index in self.resident:
            return
        super().copy_into(index, dest)


def test_a_small_copy_is_made_by_start_itself_and_complete_when_it_returns():
    snapshotter = DualBufferSnapshotter(inline_bytes=1 << 20)
    source = _InPlace(make_arrays(1))
    assert snapshotter.start(1, source)
    assert snapshotter.latest_step() == 1     # no thread to wait for
    assert source.threads == {threading.current_thread().name}
    assert_state_equal(_held(snapshotter), 1)


def test_what_is_resident_does_not_count_against_the_inline_copy():
    big = make_arrays(1, size=200_000)              # 0.8 MB each of weights and moments
    snapshotter = DualBufferSnapshotter(inline_bytes=64 << 10)
    in_place = {"model/w", "optim/state/0/exp_avg"}
    resident = _InPlace(big, resident=in_place)
    assert snapshotter.start(1, resident)
    assert snapshotter.latest_step() == 1           # the rest was copied inline
    assert resident.threads == {threading.current_thread().name}
    assert not resident.copied or all(list(big)[i] not in in_place for i in resident.copied)
    copied = _InPlace(make_arrays(2, size=200_000))
    assert snapshotter.start(2, copied)             # all of it moves: the thread copies it
    assert copied.threads <= {"ckpt-snapshot-2"}    # start copied none of it
    assert snapshotter.wait_complete(timeout=10) is SlotState.COMPLETE
    assert_state_equal(_held(snapshotter), 2, size=200_000)
