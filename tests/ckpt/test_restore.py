"""Restore chain: order of tiers, newest verified copy wins, bad copies skipped."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pytest

from ft_launch.ckpt.backup import BackupStore
from ft_launch.ckpt.errors import NoCheckpointError
from ft_launch.ckpt.fetch import Peer, push_backup
from ft_launch.ckpt.manifest import Bytes, Manifest
from ft_launch.ckpt.persist import Completeness, PersistentStore
from ft_launch.ckpt.restore import (
    Candidate,
    DiskTier,
    MemoryTier,
    PeerTier,
    RestoreChain,
    TierKind,
    newest_common_step,
    order_candidates,
)
from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import ArrayState, DualBufferSnapshotter
from ft_launch.events import EventLog, read_events
from ft_launch.ids import new_job_secret

from .helpers import assert_state_equal, make_arrays, snapshot_of

pytestmark = pytest.mark.timeout(60)
SECRET = new_job_secret()


def test_candidates_newest_first_then_nearest_tier():
    found = [Candidate(TierKind.PERSISTENT, 300), Candidate(TierKind.MEMORY, 200),
             Candidate(TierKind.PEER, 300), Candidate(TierKind.LOCAL_DISK, 300)]
    assert order_candidates(found) == [Candidate(TierKind.PEER, 300),
                                       Candidate(TierKind.LOCAL_DISK, 300),
                                       Candidate(TierKind.PERSISTENT, 300),
                                       Candidate(TierKind.MEMORY, 200)]
    assert order_candidates(found, step=200) == [Candidate(TierKind.MEMORY, 200)]


def test_newest_common_step():
    assert newest_common_step({0: [100, 200, 300], 1: [100, 200], 2: [200, 300]}) == 200
    with pytest.raises(NoCheckpointError, match="rank 1: steps"):
        newest_common_step({0: [300], 1: [200]})


@dataclass
class Tiers:
    memory: DualBufferSnapshotter
    peer: Peer
    local: PersistentStore
    persistent: PersistentStore

    def chain(self, *, memory: bool = True, peer: Peer | None = None,
              events: EventLog | None = None, wrap_memory=None) -> RestoreChain:
        tiers = [PeerTier.of(peer or self.peer, SECRET, rank=0, timeout=5),
                 DiskTier(self.local, TierKind.LOCAL_DISK),
                 DiskTier(self.persistent, TierKind.PERSISTENT)]
        if memory:
            tier = MemoryTier(self.memory.buffers)
            tiers.insert(0, wrap_memory(tier) if wrap_memory else tier)
        return RestoreChain(tiers, rank=0, events=events)


def _save(store: PersistentStore, step: int) -> None:
    with snapshot_of(step).lease() as snap:
        store.save(snap.manifest, snap.buffer)


@pytest.fixture
def tiers(tmp_path) -> Iterator[Tiers]:
    """Memory holds 4 and 5, the backup peer 5, local disk 4, the persistent store 3."""
    memory = snapshot_of(4)
    snapshot_of(5, memory)
    local = PersistentStore(tmp_path / "local", rank=0, world_size=2, create=True,
                            completeness=Completeness.OWN_SHARD)
    persistent = PersistentStore(tmp_path / "shared", rank=0, world_size=1, create=True)
    _save(local, 4)
    _save(persistent, 3)
    store = BackupStore(accept_from={0})
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=store, io_timeout=10) as server:
        peer = Peer(*server.address)
        with memory.lease(5) as snap:
            push_backup(peer, SECRET, snap, source_rank=0, timeout=10)
        yield Tiers(memory, peer, local, persistent)


class _Corrupting:
    """A tier whose copies arrive with one byte flipped, or with a NaN (valid checksum)."""

    def __init__(self, inner: MemoryTier, nan: bool = False) -> None:
        self.inner, self.kind, self.nan = inner, inner.kind, nan

    def steps(self) -> list[int]:
        return self.inner.steps()

    def load(self, step: int, buffer: Bytes | None = None) -> tuple[Manifest, Bytes]:
        manifest, buffer = self.inner.load(step, buffer)
        spec = manifest.spec("model/w")
        if not self.nan:
            buffer[spec.offset + 3] ^= 0x01
            return manifest, buffer
        state = make_arrays(step)
        state["model/w"][0, 0] = np.nan  # a peer that snapshotted after silent corruption
        snapshotter = DualBufferSnapshotter()
        snapshotter.start(step, ArrayState(state, meta={"step": step}))
        snapshotter.wait_complete()
        with snapshotter.lease() as snap:
            return snap.manifest, snap.buffer.copy()


def test_own_memory_wins_when_sound(tiers):
    restored = tiers.chain().restore()
    assert (restored.tier, restored.step, restored.skipped) == (TierKind.MEMORY, 5, ())
    assert_state_equal((restored.manifest, restored.buffer), 5)


@pytest.mark.parametrize("memory", [True, False])
def test_restore_into_a_preallocated_buffer(tiers, memory):
    into = np.empty(1 << 20, dtype=np.uint8)
    restored = tiers.chain(memory=memory).restore(buffer=into)
    assert restored.buffer is into or np.shares_memory(restored.buffer, into)
    assert_state_equal((restored.manifest, restored.buffer), 5)


def test_corrupt_memory_falls_back_to_the_backup_peer(tiers):
    restored = tiers.chain(wrap_memory=_Corrupting).restore()
    assert (restored.tier, restored.step) == (TierKind.PEER, 5)
    assert "memory step 5: checksum mismatch in model/w" in restored.skipped[0]
    assert_state_equal((restored.manifest, restored.buffer), 5)


def test_nan_carrying_copy_is_never_loaded(tiers):
    restored = tiers.chain(wrap_memory=lambda t: _Corrupting(t, nan=True)).restore()
    assert restored.tier is TierKind.PEER
    assert "NaN/Inf in model/w" in restored.skipped[0]


def _dead_peer() -> Peer:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return Peer("127.0.0.1", sock.getsockname()[1])


def test_lost_memory_and_dead_peer_fall_back_to_local_disk(tiers, tmp_path):
    with EventLog(tmp_path / "events.jsonl") as events:
        restored = tiers.chain(memory=False, peer=_dead_peer(), events=events).restore()
    assert (restored.tier, restored.step) == (TierKind.LOCAL_DISK, 4)
    assert restored.skipped[0].startswith("backup peer: ")
    assert_state_equal((restored.manifest, restored.buffer), 4)
    (event,) = list(read_events(tmp_path / "events.jsonl"))
    assert (event.tier, event.step) == ("local disk", 4)


def test_corrupt_local_shard_falls_back_to_the_persistent_store(tiers):
    shard = tiers.local.root / "step-00000004" / tiers.local.record(4).file
    data = bytearray(shard.read_bytes())
    data[data.find(make_arrays(4)["model/w"].tobytes()[:64]) + 8] ^= 0x02
    shard.write_bytes(bytes(data))
    restored = tiers.chain(memory=False, peer=_dead_peer()).restore()
    assert (restored.tier, restored.step) == (TierKind.PERSISTENT, 3)
    assert any("local disk step 4" in s and "model/w" in s for s in restored.skipped)


def test_exact_step_for_a_common_restore(tiers):
    restored = tiers.chain().restore(step=3)
    assert (restored.tier, restored.step) == (TierKind.PERSISTENT, 3)
    chain = tiers.chain()
    candidates, _ = chain.available()
    assert {c.step for c in candidates} == {3, 4, 5}


def test_nothing_sound_anywhere_lists_every_reason(tmp_path):
    empty = PersistentStore(tmp_path, rank=0, world_size=1)
    chain = RestoreChain([MemoryTier(DualBufferSnapshotter().buffers),
                          PeerTier.of(_dead_peer(), SECRET, rank=0, timeout=2),
                          DiskTier(empty, TierKind.PERSISTENT)], rank=0)
    with pytest.raises(NoCheckpointError, match="no sound checkpoint") as caught:
        chain.restore()
    assert any(reason.startswith("backup peer") for reason in caught.value.reasons)


def test_wrong_rank_copy_is_skipped(tiers):
    other = DualBufferSnapshotter(rank=1, world_size=2)
    snapshot_of(9, other)
    chain = RestoreChain([MemoryTier(other.buffers),
                          DiskTier(tiers.persistent, TierKind.PERSISTENT)], rank=0)
    restored = chain.restore()
    assert restored.step == 3 and "of rank 1" in restored.skipped[0]



def _recording_snapshotter(**kwargs) -> tuple[DualBufferSnapshotter, list[np.ndarray]]:
    """A snapshotter whose buffers the test can reach (to corrupt them in place)."""
    buffers: list[np.ndarray] = []

    def allocate(nbytes: int) -> np.ndarray:
        buffers.append(np.zeros(nbytes, dtype=np.uint8))
        return buffers[-1]

    return DualBufferSnapshotter(allocator=allocate, **kwargs), buffers


def _flip_in_place(snapshotter: DualBufferSnapshotter, buffers: list[np.ndarray]) -> None:
    with snapshotter.lease(checksums=False) as snap:
        offset = snap.manifest.spec("model/w").offset + 11
        (held,) = [b for b in buffers if np.shares_memory(b, snap.buffer)]
    held[offset] ^= 0x04  # a bit flip in this process's RAM


def test_memory_copy_corrupted_after_its_first_use_is_skipped(tiers):
    snapshotter, buffers = _recording_snapshotter()
    snapshot_of(5, snapshotter)
    with snapshotter.lease():  # first use (a fetch, a backup push): checksums computed
        pass
    _flip_in_place(snapshotter, buffers)
    chain = RestoreChain([MemoryTier(snapshotter.buffers),
                          DiskTier(tiers.local, TierKind.LOCAL_DISK)], rank=0)
    restored = chain.restore()
    assert (restored.tier, restored.step) == (TierKind.LOCAL_DISK, 4)
    assert "memory step 5: checksum mismatch in model/w" in restored.skipped[0]


def test_eager_checksums_cover_the_memory_copy_from_the_start(tiers):
    snapshotter, buffers = _recording_snapshotter(eager_checksums=True)
    snapshot_of(5, snapshotter)
    _flip_in_place(snapshotter, buffers)  # before any use
    chain = RestoreChain([MemoryTier(snapshotter.buffers),
                          DiskTier(tiers.local, TierKind.LOCAL_DISK)], rank=0)
    assert chain.restore().tier is TierKind.LOCAL_DISK


def test_check_finite_off_accepts_a_nan_copy(tiers):
    chain = tiers.chain(wrap_memory=lambda t: _Corrupting(t, nan=True))
    chain.check_finite = False
    restored = chain.restore()
    assert restored.tier is TierKind.MEMORY
    assert np.isnan(restored.manifest.spec("model/w").view(restored.buffer)[0, 0])
