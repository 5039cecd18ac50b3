"""Dual-buffer snapshots: round trip, alternation, never a half-written snapshot."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ckpt.dual import TRANSITIONS, DualBuffer, SlotState
from ckpt.errors import NoCheckpointError
from ckpt.manifest import corrupt_tensors
from ckpt.snapshot import ArrayState, DualBufferSnapshotter

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


def test_copy_in_progress_never_exposes_the_new_buffer():
    snapshotter = snapshot_of(1)
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
    snapshotter = snapshot_of(1)
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
    snapshotter = DualBufferSnapshotter()
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


def test_waiting_lease_returns_when_the_step_completes():
    snapshotter = snapshot_of(1)
    source = GatedSource(make_arrays(2), gate_at=0)
    snapshotter.start(2, source)
    assert source.reached.wait(10)
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
    started = time.monotonic()
    with pytest.raises(NoCheckpointError, match="step 1"), snapshotter.lease(1, timeout=30):
        pass
    assert time.monotonic() - started < 10  # it did not wait out the timeout


def test_transition_table_rejects_illegal_moves():
    assert SlotState.COMPLETE not in TRANSITIONS[SlotState.EMPTY]
    dual = DualBuffer()
    slot = dual.begin(10)
    assert slot is not None and slot.state is SlotState.COPYING
    with pytest.raises(AssertionError, match="not an allowed transition"):
        slot.move(SlotState.COPYING)
