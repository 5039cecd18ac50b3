"""One rank's checkpointing, wired together for the per-step protocol.

The training loop calls three things::

    ckpt.before_optimizer_step()                    # waits only if the last copy runs late
    optimizer.step()
    ckpt.after_optimizer_step(step, source)

and, when behind, ``ckpt.catch_up(peers, step)`` then ``.result()`` at the
commit point; after a restart, ``ckpt.restore_chain(...).restore(step)``.

With FT-HSDP every replica holds the same state, so only one replica needs to
write the persistent tier every ``persist_every`` steps: ``shard`` / ``shards`` are
the rank's index and count inside its replica, and ``persist`` says whether this
replica writes on that schedule. Any rank can persist on demand (``persist_now``).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ftcore.config import CkptConfig
from ftcore.events import EventLog

from .backup import BackupSender, BackupStore
from .dual import Allocator, numpy_allocator
from .fetch import CatchUp, Peer
from .persist import Completeness, PersistBusyError, PersistentStore, ShardRecord
from .restore import DiskTier, MemoryTier, PeerTier, RestoreChain, Tier, TierKind
from .serve import StateServer
from .snapshot import DualBufferSnapshotter, StateSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits: global rank, index and count of its shard in the replica."""

    rank: int
    world_size: int
    shard: int
    shards: int


class RankCheckpointer:
    """Snapshots every step, serves them, backs them up, persists every P steps.

    Everything tunable comes from ``config`` (``[ckpt]``); the keyword arguments
    are what the config cannot know: where this rank's backup goes and whose
    backups it holds (topology), how buffers are allocated (pinned for CUDA).
    """

    def __init__(self, config: CkptConfig, place: RankPlace, *, secret: str, host: str,
                 persist: bool = True, backup_peer: Peer | None = None,
                 accept_backups_from: Collection[int] = (),
                 allocator: Allocator = numpy_allocator, create_dirs: bool = True) -> None:
        self.config = config
        self.place = place
        self._secret = secret
        self.snapshots = DualBufferSnapshotter(rank=place.shard, world_size=place.shards,
                                               allocator=allocator,
                                               worker_nice=config.snapshot_nice)
        self.backups = BackupStore(accept_from=accept_backups_from, allocator=allocator)
        self.server = StateServer(secret=secret, host=host, port=config.serve_port,
                                  snapshots=self.snapshots.buffers, backups=self.backups,
                                  max_wait=config.fetch_timeout,
                                  io_timeout=config.fetch_timeout).start()
        # Every rank can persist on demand (``persist_now``); ``persist``: also every
        # ``persist_every`` steps (one replica's ranks write the shared store).
        self.persistent = self._store(config.dir, Completeness.ALL_SHARDS, create_dirs)
        self.persist_on_schedule = persist
        self.local = (self._store(config.local_dir, Completeness.OWN_SHARD, create_dirs)
                      if config.local_dir else None)
        self.sender = (BackupSender(self.snapshots.buffers, backup_peer, secret, rank=place.rank,
                                    every=config.backup_every,
                                    timeout=config.fetch_timeout).start()
                       if config.peer_backup and backup_peer is not None else None)

    def _store(self, root: str, completeness: Completeness, create: bool) -> PersistentStore:
        return PersistentStore(root, rank=self.place.shard, world_size=self.place.shards,
                               keep=self.config.keep, every=self.config.persist_every,
                               durable=self.config.durable, create=create,
                               completeness=completeness)

    @property
    def address(self) -> Peer:
        return Peer(*self.server.address)

    def before_optimizer_step(self) -> None:
        self.snapshots.wait_ready()

    def after_optimizer_step(self, step: int, source: StateSource) -> None:
        """Start the snapshot of the committed ``step`` (its loader state rides in
        ``source``'s meta, so every copy resumes the data where it left off); persist
        it if due."""
        self.snapshots.start(step, source)
        scheduled = (self.persistent if self.persist_on_schedule else None, self.local)
        for store in scheduled:
            if store is not None and store.should_persist(step):
                self._persist(store, step)

    def persist_now(self, step: int | None = None
                    ) -> concurrent.futures.Future[ShardRecord] | None:
        """Persist on demand (the newest snapshot if ``step`` is None)."""
        return self._persist(self.persistent, step)

    def _persist(self, store: PersistentStore, step: int | None
                 ) -> concurrent.futures.Future[ShardRecord] | None:
        try:
            future = store.save_async(self.snapshots.buffers, step, self.config.fetch_timeout)
        except PersistBusyError as exc:
            log.warning("%s", exc)
            return None
        future.add_done_callback(_log_failure)
        return future

    def wait_persisted(self, timeout: float | None = None) -> None:
        """Wait for running persists (before exit, or to make tests deterministic)."""
        for store in (self.persistent, self.local):
            if store is not None:
                store.wait(timeout)

    def catch_up(self, peers: Sequence[Peer], step: int) -> CatchUp:
        """Start fetching ``step`` (the end of ``max_step - 1``) from ``peers`` in order."""
        return CatchUp(peers, self._secret, step=step, timeout=self.config.fetch_timeout,
                       streams=self.config.fetch_streams).start()

    def restore_chain(self, backup_peer: Peer | None = None,
                      events: EventLog | None = None) -> RestoreChain:
        tiers: list[Tier] = [MemoryTier(self.snapshots.buffers)]
        if backup_peer is not None:
            tiers.append(PeerTier(backup_peer, self._secret, rank=self.place.rank,
                                  timeout=self.config.fetch_timeout))
        if self.local is not None:
            tiers.append(DiskTier(self.local, TierKind.LOCAL_DISK))
        tiers.append(DiskTier(self.persistent, TierKind.PERSISTENT))
        return RestoreChain(tiers, rank=self.place.shard, check_finite=self.config.check_finite,
                            events=events)

    def close(self) -> None:
        self.snapshots.close()
        if self.sender is not None:
            self.sender.close()
        for store in (self.persistent, self.local):
            if store is not None:
                store.close()
        self.server.close()


def _log_failure(future: concurrent.futures.Future[ShardRecord]) -> None:
    error = future.exception()
    if error is not None:
        log.error("persisting a checkpoint failed: %s", error)
