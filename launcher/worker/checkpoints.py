"""This rank's checkpoints as the step protocol uses them: the checkpointer
(``rank_checkpointer``), what rides in every snapshot beside the model
(``loader_state``), and the restore when a replica starts (``Restorer``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ft_launch.ckpt.errors import LayoutMismatchError, NoCheckpointError
from ft_launch.ckpt.fetch import Peer
from ft_launch.ckpt.held import HeldFiles
from ft_launch.ckpt.placement import global_rank
from ft_launch.ckpt.rank import RankCheckpointer, RankPlace
from ft_launch.ckpt.restore import Restored, TierKind, peer_copies
from ft_launch.config import Config
from ft_launch.events import EventLog

from .events import StateRestored
from .identity import WorkerIdentity
from .ledger import DataLedger
from .replica_group import ReplicaGroup
from .rollbacks import HISTORY_KEY, Rollbacks, history_of
from .step import TrainState

log = logging.getLogger(__name__)


def rank_checkpointer(config: Config, identity: WorkerIdentity) -> RankCheckpointer:
    """This rank's checkpointer: ``ckpt.dir`` under the run directory unless absolute;
    only replica 0 writes the persistent tier. Backups are known by global rank; the
    ones this rank holds for others live in this node's files (``ckpt.backup_dir``),
    where the job's next incarnation finds them."""
    ckpt_dir = Path(config.ckpt.dir)
    ckpt_config = dataclasses.replace(config.ckpt, dir=str(
        ckpt_dir if ckpt_dir.is_absolute() else identity.run_dir / ckpt_dir))
    held = (HeldFiles.open(config.ckpt.backup_dir, identity.job_id, identity.node,
                           str(identity.run_dir)) if config.ckpt.peer_backup else None)
    place = RankPlace(rank=global_rank(identity.replica_id, identity.rank, identity.ranks),
                      world_size=identity.num_replicas * identity.ranks,
                      shard=identity.rank, shards=identity.ranks)
    return RankCheckpointer(ckpt_config, place, secret=identity.secret, host=identity.host,
                            persist=identity.replica_id == 0, held=held)


def loader_state(ledger: DataLedger, history: int) -> dict[str, Any]:
    """What rides in every snapshot beside the model: the ledger (whoever restores it
    resumes every replica's stream), and the history (``rollbacks``)."""
    return {**ledger.to_state(), HISTORY_KEY: history}


@dataclass(frozen=True)
class Resumed:
    """The state a replica resumes from: its step, and the data ledger it holds."""

    step: int
    ledger: DataLedger


class Restorer:
    """When a replica starts: resume from the newest step that every rank of it
    restores soundly from ckpt's tiers (a replica that comes back older than the
    others catches up from them at its first quorum). The tiers include the peer
    backups that this replica's ranks find on their nodes: after every replica was
    lost at once, those are newer than the persistent tier. After a rollback only the
    states it left are restored (``rollbacks``): the newest from before the spike,
    first. Collective: every rank of the replica restores alike."""

    def __init__(self, identity: WorkerIdentity, group: ReplicaGroup, ckpt: RankCheckpointer,
                 state: TrainState, rollbacks: Rollbacks, events: EventLog) -> None:
        self._identity = identity
        self._group = group
        self._ckpt = ckpt
        self._state = state
        self._rollbacks = rollbacks
        self._events = events

    def restore(self) -> Resumed | None:
        """Load the newest sound step into the model, snapshot it (a replica that
        comes back older fetches it from this one at the first quorum: it must be in
        the snapshot buffers, not only in the model) and say so (``StateRestored``).
        None: nothing to restore, a fresh start."""
        me = self._identity
        found = self._group.all_gather((me.node, (self._ckpt.address.host,
                                                  self._ckpt.address.port),
                                        self._ckpt.held_copies()))
        chain = self._ckpt.restore_chain(held=peer_copies(
            [(node, Peer(*server), copies) for node, server, copies in found], me.rank))
        listed, _ = chain.available()
        held = self._group.all_gather(sorted({candidate.step for candidate in listed}))
        for step in sorted(set.intersection(*map(set, held)), reverse=True):
            try:
                restored: Restored | None = chain.restore(step)
            except NoCheckpointError as error:  # every copy of it failed verification
                log.warning("step %d cannot be restored: %s", step, error)
                restored = None
            if restored is not None and not self._rollbacks.restorable(
                    step, history_of(restored.manifest.meta)):
                log.info("step %d (%s, history %d) was rolled back: passed over", step,
                         restored.tier.value, history_of(restored.manifest.meta))
                restored = None
            if self._group.all_true(restored is not None):
                assert restored is not None
                loaded = self._load(restored)
                if not self._group.all_true(loaded is not None):
                    continue
                assert loaded is not None
                ledger = DataLedger.from_state(dict(loaded), me.num_replicas)
                log.info("restored step %d from %s", restored.step, restored.tier.value)
                self._ckpt.snapshot_restored(restored.step, self._state.snapshot_source(
                    restored.step, loader_state(ledger, self._rollbacks.history)))
                self._events.emit(StateRestored(
                    replica_id=me.replica_id, rank=me.rank, step=restored.step,
                    tier=restored.tier.value, skipped=list(restored.skipped)))
                return Resumed(restored.step, ledger)
        return None

    def _load(self, restored: Restored) -> Mapping[str, Any] | None:
        """Load a restored copy into the model; None for a peer's copy laid out for
        another model (not this job's: a reused job id), which is passed over."""
        try:
            return self._state.load(restored.manifest, restored.buffer)
        except LayoutMismatchError as error:
            if restored.tier is not TierKind.PEER:
                raise
            log.warning("the backup peer's copy of step %d does not fit this model, passed "
                        "over: %s", restored.step, error)
            return None
