"""One rank's checkpointing, wired together for the per-step protocol.

The training loop calls three things::

    ckpt.before_optimizer_step()                    # waits only if the last copy runs late
    optimizer.step()
    ckpt.after_optimizer_step(step, source)

and, when behind, ``ckpt.catch_up(peers, step)`` then ``.result()`` at the
commit point; after a restart, ``ckpt.restore_chain(...).restore(step)``; at each
new quorum, ``ckpt.route_backups(placement.route_backups(...))``.

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

from ft_launch.config import CkptConfig
from ft_launch.events import EventLog

from .backup import BackupSender, BackupStore
from .dual import Allocator, numpy_allocator
from .fetch import CatchUp, Peer
from .held import HeldCopy, HeldFiles
from .persist import Completeness, PersistBusyError, PersistentStore, ShardRecord
from .placement import BackupRoute
from .restore import DiskTier, MemoryTier, PeerCopy, PeerTier, RestoreChain, Tier, TierKind
from .serve import StateServer
from .snapshot import DualBufferSnapshotter, StateSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where a rank sits: global rank (``placement.global_rank``: its backups are
    known by it), index and count of its shard in the replica."""

    rank: int
    world_size: int
    shard: int
    shards: int


class RankCheckpointer:
    """Snapshots every step, serves them, backs them up, persists every P steps.

    Everything tunable comes from ``config`` (``[ckpt]``); the keyword arguments
    are what the config cannot know: where this rank's backup goes and whose
    backups it holds (topology: given here, or by ``route_backups`` at each
    quorum), where on this node held backups live as files (``held``: see
    ``HeldFiles.open``), how buffers are allocated (pinned for CUDA).
    """

    def __init__(self, config: CkptConfig, place: RankPlace, *, secret: str, host: str,
                 persist: bool = True, backup_peer: Peer | None = None,
                 accept_backups_from: Collection[int] = (), held: HeldFiles | None = None,
                 allocator: Allocator = numpy_allocator, create_dirs: bool = True) -> None:
        self.config = config
        self.place = place
        self._secret = secret
        self.snapshots = DualBufferSnapshotter(rank=place.shard, world_size=place.shards,
                                               allocator=allocator,
                                               worker_nice=config.snapshot_nice)
        self.backups = BackupStore(accept_from=accept_backups_from, allocator=allocator,
                                   files=held)
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
        self._no_route = ""   # why the last quorum gave no backup rank (logged once)
        # Started without a peer when the placement comes later (route_backups).
        self.sender = (BackupSender(self.snapshots.buffers, backup_peer, secret, rank=place.rank,
                                    every=config.backup_every,
                                    timeout=config.fetch_timeout).start()
                       if config.peer_backup else None)

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

    def snapshot_restored(self, step: int, source: StateSource) -> None:
        """Snapshot a state just restored, before any step: this rank can serve it at
        once (after every replica was lost, it may be the newest state anywhere)."""
        self.snapshots.start(step, source)

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

    def route_backups(self, route: BackupRoute) -> None:
        """A new quorum's placement: push to its holder, take its sources' backups."""
        if not self.config.peer_backup:
            return
        if route.send_to is None and route.why_none != self._no_route:
            log.warning("rank %d has no backup rank under this quorum: %s", self.place.rank,
                        route.why_none)
        self._no_route = route.why_none
        if self.sender is not None:
            self.sender.retarget(Peer(*route.send_to) if route.send_to else None)
        self.backups.accept(route.accept_from)

    def held_copies(self) -> list[HeldCopy]:
        """The backups held on this node (for a restart: ``restore.peer_copies``)."""
        return self.backups.held_copies()

    def discard_held(self) -> None:
        """The run is over: free the backups held here (files included)."""
        self.backups.discard()

    def restore_chain(self, backup_peer: Peer | None = None,
                      events: EventLog | None = None,
                      held: Sequence[PeerCopy] = ()) -> RestoreChain:
        """``backup_peer``: this rank's backup rank, if alive; ``held``: copies of this
        rank's shard that its replica's ranks found on their nodes."""
        tiers: list[Tier] = [MemoryTier(self.snapshots.buffers)]
        copies = list(held)
        if backup_peer is not None:
            copies.insert(0, PeerCopy(backup_peer, self.place.rank))
        if copies:
            tiers.append(PeerTier(copies, self._secret, timeout=self.config.fetch_timeout))
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
