"""Peer backup: keep the snapshots other ranks send here, send ours to our backup.

Each rank pushes its newest complete snapshot to the rank ``placement`` chose
(outside its parallel groups and eviction domains). The receiving rank keeps,
per source rank, a dual buffer like its own snapshots: a push that dies halfway
or fails verification leaves the previous backup as the newest complete one.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection

from ftcore.config import CkptConfig

from .dual import Allocator, DualBuffer, numpy_allocator
from .errors import CheckpointCorruptError, FetchError, NoCheckpointError
from .fetch import Peer, push_backup
from .manifest import Manifest, corrupt_tensors

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()


class BackupStore:
    """The backups this rank holds for others, by global source rank.

    (A manifest's own ``rank`` is the shard index inside the replica, which is
    what a restore checks; the store is keyed by the global rank that sent it.)
    """

    def __init__(self, *, accept_from: Collection[int] | None = None,
                 allocator: Allocator = numpy_allocator, max_bytes: int | None = None) -> None:
        self._accept = None if accept_from is None else frozenset(accept_from)
        self._allocator = allocator
        #: The largest backup taken; a push claiming more is refused before allocating.
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._by_rank: dict[int, DualBuffer] = {}

    def buffers(self, source_rank: int) -> DualBuffer:
        with self._lock:
            found = self._by_rank.get(source_rank)
        if found is None:
            raise NoCheckpointError(f"no backup of rank {source_rank} held here")
        return found

    def check(self, source_rank: int, manifest: Manifest | None = None) -> None:
        """Refuse, before anything is read or allocated, a push this store must not take."""
        if self._accept is not None and source_rank not in self._accept:
            raise CheckpointCorruptError(
                f"not the backup rank of rank {source_rank} (holding {sorted(self._accept)})")
        if manifest is None:
            return
        if manifest.total_bytes > self.max_bytes:
            raise CheckpointCorruptError(
                f"backup of rank {source_rank} step {manifest.step} claims "
                f"{manifest.total_bytes} bytes, more than the {self.max_bytes} this store "
                f"takes (BackupStore max_bytes)")
        if not manifest.checksummed:
            raise CheckpointCorruptError(f"backup of rank {source_rank} step {manifest.step} "
                                         f"has tensors without checksums")

    def receive(self, source_rank: int, manifest: Manifest,
                read_into: Callable[[memoryview], None]) -> None:
        """Read a pushed snapshot into the older buffer, verify it, make it the newest."""
        self.check(source_rank, manifest)
        dual = self._dual(source_rank)
        slot = dual.begin(manifest.total_bytes)
        if slot is None:
            raise CheckpointCorruptError(f"backup of rank {source_rank} is being read; "
                                         f"push again later")
        assert slot.buffer is not None
        try:
            read_into(slot.buffer.data[:manifest.total_bytes])
            bad = corrupt_tensors(manifest, slot.buffer)
            if bad:
                raise CheckpointCorruptError(
                    f"backup of rank {source_rank} step {manifest.step} failed verification: "
                    f"{', '.join(bad[:5])}")
        except BaseException:
            # Keep no memory for a body that failed (cut short, not the signed one,
            # corrupt): its sender must not leave a buffer behind. The next push
            # allocates anew; the other slot still holds the newest good backup.
            slot.buffer = None
            dual.fail(slot)
            raise
        dual.commit(slot, manifest)
        log.debug("holding backup of rank %d step %d", source_rank, manifest.step)

    def _dual(self, source_rank: int) -> DualBuffer:
        with self._lock:
            if source_rank not in self._by_rank:
                self._by_rank[source_rank] = DualBuffer(
                    self._allocator, name=f"backup of rank {source_rank}")
            return self._by_rank[source_rank]


def default_max_bytes() -> int:
    """A quarter of physical memory: the store keeps two buffers per source rank."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    except (ValueError, OSError):
        return 1 << 40  # no sysconf: no cap beyond the signed, checked claim


class BackupSender:
    """A thread that pushes each new snapshot (every ``every`` steps) to the backup rank.

    It never queues: it always sends the newest complete snapshot, and a push
    that fails is logged and counted (the next one may succeed); training is
    never blocked by it.
    """

    def __init__(self, snapshots: DualBuffer, peer: Peer, secret: str, *, rank: int,
                 every: int = _DEFAULTS.backup_every, timeout: float = _DEFAULTS.fetch_timeout,
                 poll_interval: float = 0.5) -> None:
        self.snapshots = snapshots
        self.peer = peer
        self.rank = rank
        self.every = every
        self.sent = 0
        self.failed = 0
        self.last_sent_step: int | None = None
        self._secret = secret
        self._timeout = timeout
        self._poll_interval = poll_interval
        self._stop = threading.Event()
        self._sent_cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"ckpt-backup-{rank}",
                                        daemon=True)

    def start(self) -> BackupSender:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._timeout)

    def wait_sent(self, step: int, timeout: float) -> bool:
        """Wait until a push of ``step`` or later succeeded (used by tests and drain)."""
        with self._sent_cond:
            return self._sent_cond.wait_for(
                lambda: self.last_sent_step is not None and self.last_sent_step >= step,
                timeout)

    def _loop(self) -> None:
        # Normal priority on purpose: a push holds a lease on the snapshot (for its
        # checksums, on first use, and the transfer), and while it does the
        # snapshotter skips every step. A starved low-priority pusher would stall
        # the snapshots for as long as it is starved.
        seen: int | None = None
        while not self._stop.is_set():
            step = self.snapshots.wait_newer(seen, self._poll_interval)
            if step is None or step == seen:
                continue
            seen = step
            if step % self.every == 0:
                self._send(step)

    def _send(self, step: int) -> None:
        try:
            with self.snapshots.lease(step) as snap:
                push_backup(self.peer, self._secret, snap, source_rank=self.rank,
                            timeout=self._timeout)
        except (FetchError, NoCheckpointError) as exc:
            self.failed += 1
            log.warning("backup of step %d to %s failed: %s", step, self.peer, exc)
            return
        with self._sent_cond:
            self.sent += 1
            self.last_sent_step = step
            self._sent_cond.notify_all()
