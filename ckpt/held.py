"""Backups held for peers, kept as files in a node-local directory (tmpfs by default).

Why files. In FT-HSDP every replica holds the same state, so while any replica's
process lives it is a better source than a backup (catch-up). A backup is needed
only when no process holds the state any more: every replica lost at once, say a
lost majority whose survivors then exit or are cancelled, or a requeue. The
holder's own process is gone then too, and a backup in its process memory with
it. Kept in a file on its node's tmpfs (``ckpt.backup_dir``, ``/dev/shm``) it is
still memory, received straight into the mapped file (no extra copy), but it
outlives the process: the next incarnation's ranks on that node list it to their
replica and serve it (``restore.PeerTier``). A node that dies takes its files
with it, which is why ``placement`` puts a rank's backup on another node.

Layout, one directory per job and node (mode 0700, owned by this user)::

    <backup_dir>/ftl-backup-<job_id>-<node>-<run>/
        src-<source>.<slot>.bin     the bytes of one copy (slot 0 or 1: a dual buffer)
        src-<source>.<slot>.json    its manifest with checksums, written after the bytes

``<run>`` is a digest of the job's run directory: a requeued job (same id, same run
directory) finds its files, and a job that merely reuses an id (a Slurm whose state
was reset, or two test clusters on one machine) does not take another's for its own.

A slot's ``.json`` exists only while its ``.bin`` holds that complete, verified
copy: it is removed before the slot is rewritten and written (temp + rename)
after. Whatever a file holds is checked again when it is read (its CRC-32s, and
by the restore chain for NaN/Inf), so a torn or stale file is skipped, not used.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .dual import Allocator, DualBuffer, Slot, SlotState, numpy_allocator
from .manifest import Bytes, Manifest, ManifestError
from .wire import MAX_MANIFEST_BYTES

log = logging.getLogger(__name__)

_NAME = re.compile(r"^src-(\d{1,9})\.([01])\.json$")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class HeldCopy:
    """One complete backup in a node's directory: rank ``source``'s shard ``shard``."""

    source: int
    slot: int
    step: int
    shard: int
    nbytes: int


class HeldFiles:
    """The directory of one job's held backups on this node."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @staticmethod
    def open(backup_dir: str, job_id: str, node: str, run: str = "") -> HeldFiles | None:
        """This node's directory under ``backup_dir`` for the job whose run directory is
        ``run``; None (process memory only) when ``backup_dir`` is empty or the
        directory is not safely ours."""
        if not backup_dir:
            return None
        root = Path(backup_dir) / HeldFiles.dir_name(job_id, node, run)
        try:
            root.mkdir(mode=0o700, exist_ok=True)
            info = os.lstat(root)
        except OSError as exc:
            log.error("backups held here stay in process memory: cannot use %s (%s)",
                      root, exc)
            return None
        # Anything else could be another user's: files they wrote would be loaded as state.
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or info.st_mode & 0o077):
            log.error("backups held here stay in process memory: %s is not a directory of "
                      "this user's with mode 0700 (mode %o, uid %d)", root,
                      stat.S_IMODE(info.st_mode), info.st_uid)
            return None
        return HeldFiles(root)

    @staticmethod
    def dir_name(job_id: str, node: str, run: str = "") -> str:
        """``ftl-backup-<job_id>-<node>[-<digest of run>]``, one path component."""
        name = f"ftl-backup-{_UNSAFE.sub('_', job_id)}-{_UNSAFE.sub('_', node)}"
        return name + ("-" + hashlib.sha256(run.encode()).hexdigest()[:12] if run else "")

    def bin_path(self, source: int, slot: int) -> Path:
        return self.root / f"src-{source}.{slot}.bin"

    def json_path(self, source: int, slot: int) -> Path:
        return self.root / f"src-{source}.{slot}.json"

    def allocate(self, source: int, slot: int, nbytes: int) -> Bytes:
        """A writable buffer of ``nbytes`` backed by the slot's file. The space is
        reserved first, so a full tmpfs is an ``OSError`` here, not a SIGBUS later."""
        self.forget(source, slot)
        # A new file, not the old one truncated: a process that still maps the old one
        # (a sibling serving it to a restore) would get SIGBUS past the new end.
        path = self.bin_path(source, slot)
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return np.frombuffer(mapped, dtype=np.uint8)

    def record(self, source: int, slot: int, manifest: Manifest) -> None:
        """The slot's file holds this complete, verified copy (no fsync: tmpfs, and a
        process crash keeps the page cache)."""
        path = self.json_path(source, slot)
        temp = path.with_suffix(".json.tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(manifest.to_json())
            os.replace(temp, path)
        except OSError as exc:
            log.warning("backup of rank %d step %d is held in memory only: %s", source,
                        manifest.step, exc)

    def forget(self, source: int, slot: int) -> None:
        """The slot is about to be rewritten: it no longer holds a complete copy."""
        self.json_path(source, slot).unlink(missing_ok=True)

    def drop(self, source: int) -> None:
        for slot in (0, 1):
            self.forget(source, slot)
            self.bin_path(source, slot).unlink(missing_ok=True)

    def copies(self) -> list[HeldCopy]:
        """Every complete copy listed in the directory (manifests only are read)."""
        found = []
        try:
            names = sorted(os.listdir(self.root))
        except OSError as exc:
            log.warning("cannot list held backups in %s: %s", self.root, exc)
            return []
        for name in names:
            match = _NAME.match(name)
            if match is None:
                continue
            source, slot = int(match[1]), int(match[2])
            manifest = self._manifest(source, slot)
            if manifest is not None:
                found.append(HeldCopy(source, slot, manifest.step, manifest.rank,
                                      manifest.total_bytes))
        return found

    def load(self, source: int) -> list[tuple[int, Manifest, Bytes]]:
        """The complete copies of ``source`` held here: (slot, manifest, mapped bytes)."""
        loaded = []
        for slot in (0, 1):
            manifest = self._manifest(source, slot)
            if manifest is None:
                continue
            try:
                fd = os.open(self.bin_path(source, slot),
                             os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    mapped = mmap.mmap(fd, max(manifest.total_bytes, 1), flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
            except (OSError, ValueError) as exc:
                log.warning("held backup of rank %d slot %d unreadable: %s", source, slot, exc)
                continue
            loaded.append((slot, manifest, np.frombuffer(mapped, dtype=np.uint8)))
        return loaded

    def discard(self) -> None:
        """The run is over: nobody will restore from these."""
        shutil.rmtree(self.root, ignore_errors=True)

    def _manifest(self, source: int, slot: int) -> Manifest | None:
        path = self.json_path(source, slot)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                raw = handle.read(MAX_MANIFEST_BYTES + 1)
            data_bytes = os.stat(self.bin_path(source, slot)).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("held backup manifest %s unreadable: %s", path, exc)
            return None
        try:
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"larger than {MAX_MANIFEST_BYTES} bytes")
            manifest = Manifest.from_json(raw)
        except ManifestError as exc:
            log.warning("held backup manifest %s skipped: %s", path, exc)
            return None
        if data_bytes < manifest.total_bytes or not manifest.checksummed:
            log.warning("held backup %s skipped: %d data bytes for %d in its manifest%s",
                        path, data_bytes, manifest.total_bytes,
                        "" if manifest.checksummed else ", no checksums")
            return None
        return manifest


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map the reserved pages now


class FileDualBuffer(DualBuffer):
    """A source's two backup slots as files in ``HeldFiles``; adopts the complete
    copies a previous process left there. Falls back to process memory for a slot
    whose file cannot be made (tmpfs full)."""

    def __init__(self, files: HeldFiles, source: int,
                 fallback: Allocator = numpy_allocator) -> None:
        super().__init__(self._allocate, name=f"backup of rank {source}")
        self.files = files
        self.source = source
        self._fallback = fallback
        self._on_file = [False, False]
        self._adopt()

    def _adopt(self) -> None:
        # Set directly, before anyone else sees this buffer: the copies were completed
        # (received and verified) by the process that wrote them.
        for index, manifest, buffer in self.files.load(self.source):
            slot = self._slots[index]
            slot.buffer, slot.manifest, slot.state = buffer, manifest, SlotState.COMPLETE
            self._on_file[index] = True
            if self._latest is None or manifest.step > (self._latest.manifest.step
                                                        if self._latest.manifest else -1):
                self._latest = slot
        if self._latest is not None:
            log.info("adopted held backup of rank %d, steps %s", self.source,
                     self.complete_steps())

    def _allocate(self, nbytes: int) -> Bytes:
        # Called by ``begin`` for the slot it just claimed (COPYING), which stays the
        # older one until ``commit``: so this is that slot's index.
        index = self._older().index
        try:
            buffer = self.files.allocate(self.source, index, nbytes)
        except OSError as exc:
            log.warning("backup of rank %d held in process memory, not in %s: %s",
                        self.source, self.files.root, exc)
            self._on_file[index] = False
            return self._fallback(nbytes)
        self._on_file[index] = True
        return buffer

    def begin(self, total_bytes: int, wait: float = 0.0) -> Slot | None:
        slot = super().begin(total_bytes, wait)
        if slot is not None:
            self.files.forget(self.source, slot.index)
        return slot

    def commit(self, slot: Slot, manifest: Manifest) -> None:
        super().commit(slot, manifest)
        if self._on_file[slot.index] and slot.buffer is not None:
            self.files.record(self.source, slot.index, manifest)
