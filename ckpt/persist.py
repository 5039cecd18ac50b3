"""Persistent tier: one HDF5 shard per rank per step, written atomically and in the background.

Layout under ``root``::

    step-00000100/rank-00003-<token>.h5   tensors as datasets (names as HDF5 paths)
    step-00000100/rank-00003.json         the shard record, written last

A shard is written to a temp file, fsynced, renamed (its name carries a fresh
token, so it never replaces a file a record points to), the directory fsynced,
and only then is its record written (atomically). A crash at any point leaves
either the old record or the new one, each naming a complete file. A writer
removes only the files it wrote itself: two writers of one rank's shard (replicas
saving the same step when their controller is lost) may interleave, and the file
one of them just named in the record must never be the other's garbage. Files
left by a writer that lost the race or crashed go when the step is pruned. A step
counts as a checkpoint only when every rank's record is present and names a
file of the recorded size; the rank that loads a shard verifies every CRC.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import errno
import json
import logging
import os
import re
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from ft_launch.config import CkptConfig
from ft_launch.errors import RecoverableError
from ft_launch.files import atomic_write_text, fsync_directory

from .dual import LeaseProvider, Snapshot, numpy_allocator
from .errors import CheckpointCorruptError, storage_error
from .manifest import Bytes, Manifest, ManifestError, add_checksums, corrupt_tensors

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()

_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_ERRNO_IN_TEXT = re.compile(r"errno = (\d+)")


class Completeness(enum.Enum):
    """What a step needs before it counts as a checkpoint."""

    ALL_SHARDS = "all_shards"  # shared persistent store: every rank's shard
    OWN_SHARD = "own_shard"    # node-local disk: this rank's shard is all there is


class PersistBusyError(RecoverableError):
    """A persist was asked for while the previous one is still being written."""


@dataclass(frozen=True)
class ShardRecord:
    """What a rank wrote for one step: its manifest, file name and file size."""

    manifest: Manifest
    file: str
    file_bytes: int

    def to_json(self) -> str:
        return json.dumps({"file": self.file, "file_bytes": self.file_bytes,
                           "manifest": json.loads(self.manifest.to_json())}, indent=1)

    @staticmethod
    def from_json(text: str) -> ShardRecord:
        try:
            record = json.loads(text)
            return ShardRecord(Manifest.from_json(json.dumps(record["manifest"])),
                               str(record["file"]), int(record["file_bytes"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ManifestError(f"unreadable shard record: {exc!r}") from None


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def record_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


class PersistentStore:
    """This rank's view of a checkpoint directory (shared or node-local)."""

    def __init__(self, root: str | os.PathLike[str], *, rank: int, world_size: int,
                 keep: int = _DEFAULTS.keep, every: int = _DEFAULTS.persist_every,
                 durable: bool = _DEFAULTS.durable, create: bool = False,
                 completeness: Completeness = Completeness.ALL_SHARDS) -> None:
        self.root = Path(root)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.every = every
        self.durable = durable
        self.completeness = completeness
        self._check_root(create)
        self._staged_bytes = 0   # the last persist's size: the next one's staging is faulted in first
        # Normal priority on purpose (unlike the snapshot thread): staging holds a
        # lease on the snapshot, during which the snapshotter skips every step.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"ckpt-persist-{rank}")
        self._pending: concurrent.futures.Future[ShardRecord] | None = None
        self._lock = threading.Lock()
        self._own_files: dict[int, str] = {}   # step -> the newest shard file written here

    def _check_root(self, create: bool) -> None:
        try:
            if create:
                self.root.mkdir(parents=True, exist_ok=True)
            if not self.root.exists():
                raise FileNotFoundError(2, "No such file or directory", str(self.root))
            if not self.root.is_dir():
                raise NotADirectoryError(20, "Not a directory", str(self.root))
        except OSError as exc:
            raise storage_error("use checkpoint directory", self.root, exc,
                                rank=self.rank) from None

    # ------------------------------------------------------------------ writing

    def should_persist(self, step: int) -> bool:
        return step % self.every == 0

    def save(self, manifest: Manifest, buffer: Bytes) -> ShardRecord:
        """Write this rank's shard of ``manifest.step`` now (blocking; no pruning).

        A shard always carries its CRCs: missing ones are computed from ``buffer``.
        """
        manifest = add_checksums(manifest, buffer)
        step_dir = self.root / step_dir_name(manifest.step)
        final = step_dir / f"rank-{self.rank:05d}-{secrets.token_hex(4)}.h5"
        tmp = step_dir / f".{final.name}.tmp"
        try:
            step_dir.mkdir(exist_ok=True)
            _write_shard(tmp, manifest, buffer)
            if self.durable:
                fsync_file(tmp)
            os.replace(tmp, final)
            if self.durable:
                fsync_directory(step_dir)
            record = ShardRecord(manifest, final.name, final.stat().st_size)
            atomic_write_text(step_dir / record_name(self.rank), record.to_json(),
                              durable=self.durable)
        except OSError as exc:
            _remove_quietly(tmp)
            _remove_quietly(final)
            raise _as_storage_error(exc, f"write checkpoint shard of step {manifest.step}",
                                    step_dir, self.rank) from None
        replaced = self._own_files.get(manifest.step)
        self._own_files = {manifest.step: final.name}  # only the newest step is rewritten
        if replaced is not None and replaced != final.name:
            _remove_quietly(step_dir / replaced)
        log.info("persisted step %d shard of rank %d (%d bytes)", manifest.step, self.rank,
                 record.file_bytes)
        return record

    def save_async(self, snapshots: LeaseProvider, step: int | None = None,
                   wait: float = _DEFAULTS.fetch_timeout
                   ) -> concurrent.futures.Future[ShardRecord]:
        """Persist the snapshot of ``step`` (newest if None) in the background.

        The worker copies the snapshot into a staging buffer under a short lease,
        then writes without holding it, so snapshots keep alternating; the staging
        buffer lives only as long as the write.
        Raises ``PersistBusyError`` if the previous persist is still running.
        """
        with self._lock:
            if self._pending is not None and not self._pending.done():
                raise PersistBusyError("previous persist still running; skipping this one",
                                       step=step, rank=self.rank)
            self._pending = self._executor.submit(self._stage_and_save, snapshots, step, wait)
            return self._pending

    def wait(self, timeout: float | None = None) -> ShardRecord | None:
        """Wait for the running persist; its record (None if there was none)."""
        pending = self._pending
        return None if pending is None else pending.result(timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=True)

    def _stage_and_save(self, snapshots: LeaseProvider, step: int | None,
                        wait: float) -> ShardRecord:
        # A staging buffer per persist, dropped once written: kept between persists it
        # would be a third resident copy of the rank's state (beside the two snapshot
        # buffers) for the persist_every steps it idles. Its pages are faulted in before
        # the lease (sized as the last persist), so the lease lasts a copy, no longer.
        staged = numpy_allocator(self._staged_bytes) if self._staged_bytes else None
        with snapshots.lease(step, wait) as snap:
            manifest, staged = self._stage(snap, staged)
        self._staged_bytes = staged.nbytes
        record = self.save(manifest, staged)
        del staged
        self.prune()  # deleting a GB-sized shard takes a while: off the save's clock too
        return record

    @staticmethod
    def _stage(snap: Snapshot, staged: Bytes | None) -> tuple[Manifest, Bytes]:
        total = snap.manifest.total_bytes
        if staged is None or staged.nbytes != total:   # the first persist, or a new layout
            staged = np.empty(total, dtype=np.uint8)
        np.copyto(staged, snap.buffer)
        return snap.manifest, staged

    def prune(self) -> None:
        """Remove this rank's shards older than the ``keep`` newest complete steps."""
        complete = self.complete_steps()
        if len(complete) < self.keep:
            return
        oldest_kept = complete[-self.keep]
        for step in self.steps():
            if step < oldest_kept:
                self._remove_own_shard(step)

    def _remove_own_shard(self, step: int) -> None:
        step_dir = self.root / step_dir_name(step)
        _remove_quietly(step_dir / record_name(self.rank))
        for path in step_dir.glob(f"*rank-{self.rank:05d}-*"):
            _remove_quietly(path)
        try:
            step_dir.rmdir()  # succeeds only once every rank removed its files
        except OSError:
            pass

    # ------------------------------------------------------------------ reading

    def steps(self) -> list[int]:
        """Steps that have a directory, oldest first."""
        if not self.root.is_dir():
            return []
        found = (_STEP_DIR.match(p.name) for p in self.root.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def record(self, step: int, rank: int | None = None) -> ShardRecord:
        """The shard record of ``rank`` (default: this rank) at ``step``."""
        path = self.root / step_dir_name(step) / record_name(self.rank if rank is None else rank)
        try:
            return ShardRecord.from_json(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise CheckpointCorruptError(f"shard record {path} unreadable: {exc}") from None

    def missing_shards(self, step: int) -> list[str]:
        """Why ``step`` does not count as complete (empty when it does)."""
        ranks = (range(self.world_size) if self.completeness is Completeness.ALL_SHARDS
                 else [self.rank])
        problems = []
        for rank in ranks:
            try:
                self._check_shard(step, rank)
            except CheckpointCorruptError as exc:
                problems.append(f"rank {rank}: {exc.message}")
        return problems

    def _check_shard(self, step: int, rank: int) -> ShardRecord:
        record = self.record(step, rank)
        manifest = record.manifest
        if (manifest.step, manifest.rank) != (step, rank):
            raise CheckpointCorruptError(f"record says step {manifest.step} rank "
                                         f"{manifest.rank}")
        if self.completeness is Completeness.ALL_SHARDS and \
                manifest.world_size != self.world_size:
            raise CheckpointCorruptError(f"written by a world of {manifest.world_size} ranks, "
                                         f"not {self.world_size}")
        path = self.root / step_dir_name(step) / record.file
        size = path.stat().st_size if path.exists() else -1
        if size != record.file_bytes:
            raise CheckpointCorruptError(f"{path.name} has {size} bytes, record says "
                                         f"{record.file_bytes}")
        return record

    def complete_steps(self) -> list[int]:
        return [step for step in self.steps() if not self.missing_shards(step)]

    def load(self, step: int, buffer: Bytes | None = None, rank: int | None = None
             ) -> tuple[Manifest, Bytes]:
        """Read and verify one shard; ``CheckpointCorruptError`` says what is wrong."""
        rank = self.rank if rank is None else rank
        missing = self.missing_shards(step)
        if missing:
            raise CheckpointCorruptError(f"step {step} is incomplete: " + "; ".join(missing))
        record = self._check_shard(step, rank)
        manifest = record.manifest
        if buffer is None or buffer.nbytes < manifest.total_bytes:
            buffer = np.zeros(manifest.total_bytes, dtype=np.uint8)
        path = self.root / step_dir_name(step) / record.file
        _read_shard(path, manifest, buffer)
        bad = corrupt_tensors(manifest, buffer)
        if bad:
            raise CheckpointCorruptError(f"{path.name} failed verification: "
                                         f"{', '.join(bad[:5])}")
        return manifest, buffer

    def verify_step(self, step: int) -> list[str]:
        """Read every shard of ``step`` and check every CRC; the problems found."""
        problems = self.missing_shards(step)
        if problems:
            return problems
        ranks = range(self.world_size) if self.completeness is Completeness.ALL_SHARDS \
            else [self.rank]
        for rank in ranks:
            try:
                self.load(step, rank=rank)
            except CheckpointCorruptError as exc:
                problems.append(f"rank {rank}: {exc.message}")
        return problems


# ---------------------------------------------------------------------- HDF5 shards


def _write_shard(path: Path, manifest: Manifest, buffer: Bytes) -> None:
    """Write the HDF5 file; every failure comes out as an ``OSError`` with its errno."""
    try:
        _write_h5(path, manifest, buffer)
    except RuntimeError as exc:  # h5py raises it for some low-level write failures
        raise _as_os_error(exc) from exc


def _write_h5(path: Path, manifest: Manifest, buffer: Bytes) -> None:
    handle = h5py.File(path, "w")
    closing = False
    try:
        handle.create_dataset("ftl_manifest", data=np.frombuffer(
            manifest.to_json().encode(), dtype=np.uint8))
        for spec in manifest.tensors:
            dataset = handle.create_dataset(f"tensors/{spec.name}", data=spec.view(buffer))
            dataset.attrs["dtype"] = spec.dtype
            if spec.crc32 is not None:
                dataset.attrs["crc32"] = np.uint32(spec.crc32)
        closing = True
        handle.close()
    finally:
        if not closing:  # the write error says more than a failed close would
            with contextlib.suppress(OSError, RuntimeError):
                handle.close()


_HDF5_MESSAGE = re.compile(r"error message = '([^']*)'")


def _as_os_error(exc: BaseException) -> OSError:
    """HDF5 puts the system errno and message inside its own text; recover both."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    code = getattr(exc, "errno", None)
    if code is None:
        match = _ERRNO_IN_TEXT.search(text)
        code = int(match.group(1)) if match else errno.EIO
    message = _HDF5_MESSAGE.search(text)
    head = text.split(" (", 1)[0]
    return OSError(code, f"{head}: {message.group(1)}" if message else text)


def _read_shard(path: Path, manifest: Manifest, buffer: Bytes) -> None:
    try:
        with h5py.File(path, "r") as handle:
            for spec in manifest.tensors:
                dataset = handle[f"tensors/{spec.name}"]
                if tuple(dataset.shape) != spec.shape:
                    raise CheckpointCorruptError(f"{path.name}: {spec.name} has shape "
                                                 f"{dataset.shape}, manifest {spec.shape}")
                if spec.nbytes:
                    dataset.read_direct(spec.view(buffer))
    except (OSError, KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise CheckpointCorruptError(f"{path.name} unreadable: {exc}") from None


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def _as_storage_error(exc: OSError, action: str, path: Path, rank: int) -> Exception:
    return storage_error(action, path, _as_os_error(exc) if "errno =" in str(exc) else exc,
                         rank=rank)
