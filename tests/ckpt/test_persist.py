"""HDF5 persistent tier: round trip, atomicity under crashes, corrupt shards, errors."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

from ft_launch.ckpt import persist
from ft_launch.ckpt.errors import (
    CheckpointCorruptError,
    StorageError,
    StorageSetupError,
    storage_error,
)
from ft_launch.ckpt.persist import Completeness, PersistBusyError, PersistentStore, step_dir_name
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from tests.waiting import wait_until

from .helpers import GatedSource, assert_state_equal, make_arrays, snapshot_of

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def _store(root: Path, rank: int = 0, world: int = 1, **kwargs) -> PersistentStore:
    return PersistentStore(root, rank=rank, world_size=world, **kwargs)


def _save(store: PersistentStore, step: int, size: int = 1000) -> None:
    snapshotter = snapshot_of(step, DualBufferSnapshotter(rank=store.rank,
                                                          world_size=store.world_size), size)
    with snapshotter.lease() as snap:
        store.save(snap.manifest, snap.buffer)


def _child(mode: str, root: Path, step: int, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-m", "tests.ckpt.persist_proc", mode,
                             str(root), str(step)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_round_trip(tmp_path):
    store = _store(tmp_path)
    _save(store, 100)
    assert store.complete_steps() == [100]
    assert_state_equal(store.load(100), 100)
    assert store.verify_step(100) == []


def test_async_save_from_snapshots_while_they_go_on(tmp_path):
    store = _store(tmp_path)
    snapshotter = snapshot_of(100)
    future = store.save_async(snapshotter.buffers, 100)
    with pytest.raises(PersistBusyError):
        while not future.done():
            store.save_async(snapshotter.buffers, 100)
    record = store.wait(timeout=30)
    assert record is not None and record.manifest.step == 100
    snapshot_of(101, snapshotter)
    snapshot_of(102, snapshotter)  # reuses step 100's buffer: the persist no longer holds it
    assert_state_equal(store.load(100), 100)


def test_the_staging_copy_lives_only_as_long_as_its_write(tmp_path, monkeypatch):
    """Between persists the rank holds its two snapshot buffers, not a third copy; from
    the second persist on, the staging memory is faulted in before the lease is taken."""
    staged: list[tuple[str, weakref.ref]] = []
    prefault = persist.numpy_allocator

    class Numpy:  # numpy as ft_launch.ckpt.persist sees it, its staging allocations noted
        def __getattr__(self, name: str):
            return getattr(np, name)

        @staticmethod
        def empty(*args, **kwargs):
            buffer = np.empty(*args, **kwargs)
            staged.append(("under the lease", weakref.ref(buffer)))
            return buffer

    def prefaulted(nbytes: int):
        buffer = prefault(nbytes)
        staged.append(("before the lease", weakref.ref(buffer)))
        return buffer

    monkeypatch.setattr(persist, "np", Numpy())
    monkeypatch.setattr(persist, "numpy_allocator", prefaulted)
    store = _store(tmp_path)
    snapshotter = snapshot_of(100)
    for step in (100, 101, 102):
        snapshot_of(step, snapshotter)
        store.save_async(snapshotter.buffers, step)
        assert store.wait(timeout=30).manifest.step == step
    gc.collect()
    assert [kind for kind, _ in staged] == ["under the lease"] + 2 * ["before the lease"]
    assert all(ref() is None for _, ref in staged), "a staging buffer outlived its write"
    assert_state_equal(store.load(102), 102)


def test_async_save_waits_for_the_snapshot_being_copied(tmp_path):
    store = _store(tmp_path)
    # Copied on the snapshot's thread (the gate holds it there), not inline in start.
    snapshotter = snapshot_of(99, DualBufferSnapshotter(inline_bytes=0))
    source = GatedSource(make_arrays(100), gate_at=2)
    snapshotter.start(100, source)
    future = store.save_async(snapshotter.buffers, 100, wait=30)
    assert source.reached.wait(10)
    source.release.set()
    assert future.result(timeout=30).manifest.step == 100
    assert_state_equal(store.load(100), 100)


def test_every_shard_must_be_present(tmp_path):
    rank0, rank1 = _store(tmp_path, 0, 2), _store(tmp_path, 1, 2)
    _save(rank0, 10)
    assert rank0.complete_steps() == []
    assert "rank 1" in rank0.missing_shards(10)[0]
    with pytest.raises(CheckpointCorruptError, match="incomplete"):
        rank0.load(10)
    _save(rank1, 10)
    assert rank0.complete_steps() == [10]
    assert_state_equal(rank0.load(10), 10)
    assert rank0.verify_step(10) == []


def test_own_shard_suffices_on_local_disk(tmp_path):
    local = _store(tmp_path, 3, 8, completeness=Completeness.OWN_SHARD)
    _save(local, 10)
    assert local.complete_steps() == [10]


def test_keep_prunes_older_checkpoints(tmp_path):
    store = _store(tmp_path, keep=2)
    for step in (100, 200, 300):
        _save(store, step)
        store.prune()
    assert store.complete_steps() == [200, 300]
    assert not (tmp_path / step_dir_name(100)).exists()


def test_prune_never_removes_the_last_complete_checkpoint(tmp_path):
    rank0, rank1 = _store(tmp_path, 0, 2, keep=1), _store(tmp_path, 1, 2, keep=1)
    for store in (rank0, rank1):
        _save(store, 100)
    _save(rank0, 200)  # rank 1 has not written 200 yet (or died doing it)
    rank0.prune()
    assert rank0.complete_steps() == [100]
    assert_state_equal(rank0.load(100), 100)


def test_truncated_shard_is_skipped_and_reported(tmp_path):
    store = _store(tmp_path)
    _save(store, 100)
    _save(store, 200)
    shard = store.root / step_dir_name(200) / store.record(200).file
    with shard.open("r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    assert store.complete_steps() == [100]
    assert "bytes, record says" in store.missing_shards(200)[0]


def test_flipped_byte_inside_a_shard_fails_verification(tmp_path):
    store = _store(tmp_path)
    _save(store, 100, size=50_000)
    shard = store.root / step_dir_name(100) / store.record(100).file
    data = bytearray(shard.read_bytes())
    # Flip a byte in the middle of the largest tensor's data (size is unchanged).
    middle = data.find(make_arrays(100, 50_000)["model/w"].tobytes()[:64])
    assert middle > 0
    data[middle + 1000] ^= 0x40
    shard.write_bytes(bytes(data))
    assert store.complete_steps() == [100]  # present: the size is right ...
    with pytest.raises(CheckpointCorruptError, match="failed verification: model/w"):
        store.load(100)  # ... but it is never loaded
    assert "model/w" in store.verify_step(100)[0]


def test_garbage_record_counts_as_missing(tmp_path):
    store = _store(tmp_path)
    _save(store, 100)
    (tmp_path / step_dir_name(100) / "rank-00000.json").write_text("{not json")
    assert store.complete_steps() == []


@pytest.mark.parametrize("mode", ["hang-before-rename", "hang-before-record"])
def test_crash_mid_write_leaves_previous_checkpoint(tmp_path, mode):
    assert _child("save", tmp_path, 100).wait(60) == 0
    child = _child(mode, tmp_path, 200)
    try:
        wait_until(lambda: (tmp_path / "blocked").exists(), 60, "the writer to stop mid-write")
    finally:
        child.kill()
        child.wait(30)
    store = _store(tmp_path)
    assert store.complete_steps() == [100]
    assert_state_equal(store.load(100), 100, size=2_000_000)
    _save(store, 200)  # the next attempt succeeds over the debris
    assert store.complete_steps() == [100, 200]


def test_disk_full_is_a_clear_error_and_keeps_previous(tmp_path):
    assert _child("save", tmp_path, 100).wait(60) == 0
    child = _child("fsize-limit", tmp_path, 200)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 3, err
    kind, message = out.strip().split("|", 1)
    assert kind == "StorageError"
    assert "EFBIG" in message and "previous checkpoint is untouched" in message
    assert os.listdir(tmp_path / step_dir_name(200)) == []  # no debris
    assert_state_equal(_store(tmp_path).load(100), 100, size=2_000_000)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="drops root's permission override with setpriv")
def test_permission_denied_is_a_setup_error_and_keeps_previous(tmp_path):
    assert _child("save", tmp_path, 100).wait(60) == 0
    (tmp_path / step_dir_name(200)).mkdir()
    for directory in (tmp_path, tmp_path / step_dir_name(200)):
        directory.chmod(0o555)
    drop = ("setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--")
    try:
        child = _child("save", tmp_path, 200, prefix=drop)
        out, err = child.communicate(timeout=60)
    finally:
        tmp_path.chmod(0o755)
        (tmp_path / step_dir_name(200)).chmod(0o755)
    assert child.returncode == 3, err
    assert out.startswith("StorageSetupError|") and "EACCES" in out
    assert _store(tmp_path).complete_steps() == [100]


def test_missing_directory_or_a_file_is_a_setup_error(tmp_path):
    with pytest.raises(StorageSetupError, match="ENOENT") as caught:
        _store(tmp_path / "nope")
    assert "create the directory" in str(caught.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageSetupError, match="ENOTDIR"):
        _store(tmp_path / "file")
    assert _store(tmp_path / "made", create=True).root.is_dir()


def test_directory_removed_under_a_running_store(tmp_path):
    root = tmp_path / "ckpt"
    store = _store(root, create=True)
    shutil.rmtree(root)
    with pytest.raises(StorageSetupError, match="ENOENT"):
        _save(store, 100)


@pytest.mark.parametrize("code, kind", [(errno.ENOSPC, StorageError),
                                        (errno.EDQUOT, StorageError),
                                        (errno.EIO, StorageError),
                                        (errno.EACCES, StorageSetupError),
                                        (errno.EROFS, StorageSetupError)])
def test_errno_classification(code, kind):
    error = storage_error("write shard", "/x", OSError(code, os.strerror(code)), step=5)
    assert type(error) is kind
    assert errno.errorcode[code] in str(error) and "step=5" in str(error)


def test_tensor_names_become_hdf5_paths(tmp_path):
    import h5py

    store = _store(tmp_path)
    _save(store, 7)
    shard = store.root / step_dir_name(7) / store.record(7).file
    with h5py.File(shard, "r") as handle:
        dataset = handle["tensors/optim/state/0/exp_avg"]
        assert dataset.attrs["dtype"] == "float32"
        np.testing.assert_array_equal(dataset[...], make_arrays(7)["optim/state/0/exp_avg"])


def test_a_shard_always_carries_checksums(tmp_path):
    store = _store(tmp_path)
    snapshotter = snapshot_of(8)
    with snapshotter.lease(checksums=False) as snap:
        assert not snap.manifest.checksummed
        store.save(snap.manifest, snap.buffer)
    record = store.record(8)
    assert record.manifest.checksummed
    assert_state_equal(store.load(8), 8)



def test_two_writers_of_one_shard_never_remove_each_others_file(tmp_path, monkeypatch):
    """Replicas that lost their controller may save the same step into one directory at
    once: the record written last must name a file that is still there."""
    first, second = _store(tmp_path), _store(tmp_path)
    write_record = persist.atomic_write_text
    interleaved = []

    def second_writes_while_first_has_not_yet_recorded(*args, **kwargs):
        if not interleaved:   # the first writer's shard file is in place, its record not
            interleaved.append(True)
            _save(second, 100)
        write_record(*args, **kwargs)

    monkeypatch.setattr(persist, "atomic_write_text",
                        second_writes_while_first_has_not_yet_recorded)
    _save(first, 100)
    assert interleaved and first.missing_shards(100) == []
    assert_state_equal(first.load(100), 100)


def test_a_rewritten_shard_replaces_its_file_and_pruning_removes_leftovers(tmp_path):
    store, other = _store(tmp_path, keep=1), _store(tmp_path, keep=1)
    _save(store, 100)
    _save(store, 100)
    _save(other, 100)             # leaves store's file behind, unreferenced
    assert len(list((tmp_path / step_dir_name(100)).glob("rank-00000-*.h5"))) == 2
    _save(store, 200)
    store.prune()
    assert store.complete_steps() == [200]
    assert not (tmp_path / step_dir_name(100)).exists()
