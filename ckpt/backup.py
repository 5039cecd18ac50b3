"""Peer backup: keep the snapshots other ranks send here, send ours to our backup.

Each rank pushes its newest complete snapshot, every ``ckpt.backup_every`` steps,
to the rank ``placement`` chose (outside its parallel groups and eviction
domains) under the current quorum (``placement.route_backups``: the quorum's
member payloads say where every rank's state server is). The receiving rank
keeps, per source rank, a dual buffer like its own snapshots: a push that dies
halfway or fails verification leaves the previous backup as the newest complete
one. With ``ckpt.backup_dir`` those buffers are files on the node (``held``), so
the backups outlive the holder's process and a restarted job finds them.

Sources are global ranks, ``replica_id * ranks_per_replica + rank``: the same
rank of the same replica keeps its number across incarnations.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection

from ft_launch.config import CkptConfig

from .dual import Allocator, DualBuffer, numpy_allocator
from .errors import CheckpointCorruptError, FetchError, NoCheckpointError
from .fetch import Peer, push_backup
from .held import FileDualBuffer, HeldCopy, HeldFiles
from .manifest import Manifest, corrupt_tensors

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()
#: Snapshots a push to a new backup rank is tried on before waiting for the next
#: ``every`` step: the new holder may take the quorum's new placement a step later.
RETARGET_TRIES = 3


class BackupStore:
    """The backups this rank holds for others, by global source rank.

    (A manifest's own ``rank`` is the shard index inside the replica, which is
    what a restore checks; the store is keyed by the global rank that sent it.)
    """

    def __init__(self, *, accept_from: Collection[int] | None = None,
                 allocator: Allocator = numpy_allocator, max_bytes: int | None = None,
                 files: HeldFiles | None = None) -> None:
        self._accept = None if accept_from is None else frozenset(accept_from)
        self._allocator = allocator
        #: Where held backups live as files (None: process memory only).
        self.files = files
        #: The largest backup taken; a push claiming more is refused before allocating.
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self._lock = threading.Lock()
        self._by_rank: dict[int, DualBuffer] = {}
        #: Held sources no longer assigned here, dropped once an assigned one arrives.
        self._retiring: set[int] = set()

    def buffers(self, source_rank: int) -> DualBuffer:
        """The backups of ``source_rank`` held here: received by this process, or left
        in this node's files by an earlier one (adopted on first use)."""
        with self._lock:
            found = self._by_rank.get(source_rank)
            if found is None and self.files is not None and any(
                    c.source == source_rank for c in self.files.copies()):
                found = self._by_rank[source_rank] = FileDualBuffer(
                    self.files, source_rank, self._allocator)
        if found is None:
            raise NoCheckpointError(f"no backup of rank {source_rank} held here")
        return found

    def accept(self, sources: Collection[int]) -> None:
        """From now on take pushes from ``sources`` only (a new quorum's placement).
        Backups of the others are kept until one of ``sources`` has arrived: until
        then they may be the newest copy anywhere."""
        with self._lock:
            self._accept = frozenset(sources)
            self._retiring = {s for s in self._by_rank if s not in self._accept}

    def held_copies(self) -> list[HeldCopy]:
        """Every complete backup held on this node: in its files (whichever process
        wrote them), else in this process's memory."""
        if self.files is not None:
            return self.files.copies()
        with self._lock:
            duals = list(self._by_rank.items())
        copies = []
        for source, dual in duals:
            for step in dual.complete_steps():
                with dual.lease(step, checksums=False) as snap:
                    copies.append(HeldCopy(source, -1, step, snap.manifest.rank,
                                           snap.manifest.total_bytes))
        return copies

    def discard(self) -> None:
        """Drop every backup held here, files included (the run is over)."""
        with self._lock:
            self._by_rank.clear()
            self._retiring.clear()
        if self.files is not None:
            self.files.discard()

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
        self._retire()

    def _dual(self, source_rank: int) -> DualBuffer:
        with self._lock:
            found = self._by_rank.get(source_rank)
        if found is not None:
            return found
        try:
            return self.buffers(source_rank)   # left in this node's files earlier
        except NoCheckpointError:
            pass
        with self._lock:
            if source_rank not in self._by_rank:
                self._by_rank[source_rank] = (
                    FileDualBuffer(self.files, source_rank, self._allocator)
                    if self.files is not None
                    else DualBuffer(self._allocator, name=f"backup of rank {source_rank}"))
            return self._by_rank[source_rank]

    def _retire(self) -> None:
        with self._lock:
            retiring, self._retiring = self._retiring, set()
            for source in retiring:
                self._by_rank.pop(source, None)
        for source in retiring:
            log.info("dropped the backup of rank %d: no longer held here", source)
            if self.files is not None:
                self.files.drop(source)


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
    never blocked by it. The backup rank may change with the quorum
    (``retarget``); the first snapshot after a change is pushed whatever its
    step, so that the new holder has a copy without waiting ``every`` steps.
    """

    def __init__(self, snapshots: DualBuffer, peer: Peer | None, secret: str, *, rank: int,
                 every: int = _DEFAULTS.backup_every, timeout: float = _DEFAULTS.fetch_timeout,
                 poll_interval: float = 0.5) -> None:
        self.snapshots = snapshots
        self.rank = rank
        self.every = every
        self.sent = 0
        self.failed = 0
        self.last_sent_step: int | None = None
        self._last_tried: int | None = None   # step of the last push, sent or not
        self._peer = peer
        self._retarget_tries = RETARGET_TRIES if peer is not None else 0
        self._secret = secret
        self._timeout = timeout
        self._poll_interval = poll_interval
        self._stop = threading.Event()
        self._sent_cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"ckpt-backup-{rank}",
                                        daemon=True)

    @property
    def peer(self) -> Peer | None:
        with self._sent_cond:
            return self._peer

    def retarget(self, peer: Peer | None) -> None:
        """Push to ``peer`` from now on (None: nowhere, e.g. no placement exists)."""
        with self._sent_cond:
            if peer != self._peer:
                log.info("backup of rank %d goes to %s from now on", self.rank, peer)
                self._peer = peer
                self._retarget_tries = RETARGET_TRIES if peer is not None else 0

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
            with self._sent_cond:
                peer = self._peer
                retarget = self._retarget_tries > 0
                if peer is not None and retarget:
                    self._retarget_tries -= 1
            if peer is not None and (retarget or self._due(step)):
                self._send(peer, step)

    def _due(self, step: int) -> bool:
        """A multiple of ``every`` was passed since the last push. Not ``step % every
        == 0``: while a push runs the sender sees no snapshot, and a multiple missed
        then must not wait for the next one. A push that failed counts too: a dead
        holder is not tried (and every snapshot hashed for it) at every step."""
        last = self._last_tried
        return last is None or step // self.every > last // self.every

    def _send(self, peer: Peer, step: int) -> None:
        self._last_tried = step
        try:
            # the newest: ``step`` may have been replaced since it was seen
            with self.snapshots.lease() as snap:
                step = snap.step
                push_backup(peer, self._secret, snap, source_rank=self.rank,
                            timeout=self._timeout)
        except (FetchError, NoCheckpointError) as exc:
            self.failed += 1
            log.warning("backup of step %d to %s failed: %s", step, peer, exc)
            return
        with self._sent_cond:
            self._last_tried = step
            self.sent += 1
            self.last_sent_step = step
            if peer == self._peer:
                self._retarget_tries = 0   # the new holder has a copy
            self._sent_cond.notify_all()
