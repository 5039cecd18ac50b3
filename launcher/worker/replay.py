"""Replay mode of the worker runtime: one recorded step of a replica, replayed by the
user's own training script, unchanged, on the nodes the controller picks.

``ft-launch run`` starts the script with ``FTL_WORKER_REPLAY=<spec>`` (see
``replay_files``) when a replica keeps computing NaN/Inf and it must find which of
its nodes does (``ft_launch.launcher.controller.sdc_replay``). ``ft_manager`` then returns a
``ReplayManager`` instead of a ``Manager``: the script's loop runs as ever, but

* at start, no quorum is joined and no state server started: rank K loads rank K's
  shard of the captured step S from the replay's state files (a healthy
  replica's, CRC-checked) and with it the data ledger, so ``data_position`` is
  where that replica's stream stood;
* forward and backward of step S + 1 run as in training, FSDP's reduce-scatter
  (or DDP's all-reduce) inside the replay group included;
* each reduction that FTAR would average across replicas is digested instead
  (``DigestRing``: a ring of this rank alone, whose average is its input), and a
  NaN/Inf in it counted, not raised;
* ``commit`` writes ``results/<group>/rank-K.json`` (atomically), waits for the
  group's other ranks and ends the process at once with exit status 0: nothing
  is committed, snapshotted or written to the replica's event file, so the
  controller cannot mistake a replay for training, and nothing of the script
  after its commit runs. (At once: a torch process that leaves by the
  interpreter's exit tears its process groups down while its peers do too, and
  may abort there, failing the step for nothing.)

Same state, same batch, same world layout: healthy CPU nodes compute the same
bits (gloo's reductions are deterministic), so a group whose digests differ from
the healthy reference group's, or that counts NaN/Inf, holds the bad node. (On
GPUs the same holds only for deterministic kernels and collectives: without them a
replay tells NaN/Inf apart, not a wrong bit.)
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from ft_launch.config import Config, FtarConfig
from ft_launch.env import ENV_REPLAY, ENV_REPLAY_GROUP
from ft_launch.errors import UsageError

from .exchange import Job
from .identity import WorkerIdentity
from .ledger import DataLedger
from .manager import Manager
from .protocol import NonFiniteGradientsError, StepPlan
from .replay_files import (
    RankDigest,
    ReplayFileError,
    ReplaySpec,
    check_name,
    load_captured,
    read_spec,
    write_result,
)
from .replica_group import ReplicaGroup, SoloGroup
from .step import GradientNorm, Reduction, StepContext, TrainState

log = logging.getLogger(__name__)


class DigestRing:
    """FTAR's stand-in in a replay: a ring of this rank alone (the average is the
    input, left as it is) that hashes each reduction handed to it, in order. A
    device tensor arrives staged in host memory, as FTAR gets it (``config`` sizes
    the staging); its combiner has nothing to add back."""

    def __init__(self, config: FtarConfig | None = None) -> None:
        self.config = config or FtarConfig()
        self._hash = hashlib.sha256()
        self.reductions = 0

    def reduce_flat(self, flat: np.ndarray, etype: Any, *, op: Any, contributes: bool,
                    step: int | None, combiner: Any = None) -> int:
        self._hash.update(np.ascontiguousarray(flat).view(np.uint8).data)
        self.reductions += 1
        if combiner is not None:
            combiner.finish()
        return 1

    @property
    def digest(self) -> str:
        return self._hash.hexdigest()


def replay_requested() -> Path | None:
    """The replay spec this process was started with, if any."""
    path = os.environ.get(ENV_REPLAY)
    return Path(path) if path else None


class ReplayManager(Manager):
    """A ``Manager`` for a replay (module doc): what a training script reads of one
    (``next_step``, ``data_position``, ``identity``, ...) as ever, none of its
    machinery (quorum, FTAR, state server, event file), and a step that ends the
    process at its commit. Replica ``identity.replica_id`` is the one replayed."""

    def __init__(self, config: Config, identity: WorkerIdentity, state: TrainState,
                 batch_size: int, spec: ReplaySpec, group_label: str, *,
                 group: ReplicaGroup | None = None) -> None:
        # not Manager.__init__: that one joins the job
        if (spec.ranks, spec.replica_id) != (identity.ranks, identity.replica_id):
            raise ReplayFileError(f"replay {spec.replay_id} replays {spec.ranks} ranks of "
                                  f"replica {spec.replica_id}, but this group runs "
                                  f"{identity.ranks} of replica {identity.replica_id}")
        self._config = config
        self._identity = identity
        self._state = state
        self._batch_size = batch_size
        self._spec = spec
        self._label = check_name(group_label, ENV_REPLAY_GROUP)
        self._group = group or SoloGroup()
        manifest, buffer = load_captured(Path(spec.state_dir), identity.rank)
        if manifest.step != spec.step:
            raise ReplayFileError(f"{spec.state_dir}: rank {identity.rank}'s state is of "
                                  f"step {manifest.step}, the spec says {spec.step}")
        loader_state = state.load(manifest, buffer)
        self._ledger = DataLedger.from_state(dict(loader_state), identity.num_replicas)
        self._next_step = spec.step + 1
        self._ring = DigestRing(config.ftar)
        self._nonfinite = 0
        self._step: StepContext | None = None
        log.info("replaying step %d of replica %d as rank %d of group %s on %s",
                 self._next_step, spec.replica_id, identity.rank, self._label, identity.node)

    @property
    def plan(self) -> StepPlan:
        raise UsageError("a replay joins no quorum: it has no step plan",
                         hint="the replay ends at commit(); nothing after it runs")

    # ------------------------------------------------------------------ the step

    def start_step(self) -> None:
        self._step = StepContext()

    def reduce_gradients(self, reduce: Callable[[Reduction], None],
                         after: Callable[[], None] | None = None) -> Job:
        """Digest a reduction now, on the caller's thread (there is no ring to wait
        for); NaN/Inf in it is counted, not raised."""
        job = Job(lambda: None, 0, after)
        try:
            reduce(Reduction(self._ring, self._next_step, True,  # type: ignore[arg-type]
                             norm=GradientNorm()))
        except NonFiniteGradientsError as error:
            self._nonfinite += max(error.values, 1)
        finally:
            if after is not None:
                after()
            job.done.set()
        return job

    def allreduce_gradients(self) -> None:
        step = self._step
        if step is None:
            raise RuntimeError("start_step() first")
        if step.exchanged:
            return
        self.reduce_gradients(self._state.reduce_gradients)
        step.exchanged = True
        self._state.finish_gradients()

    def commit(self, loss: float | None = None) -> bool:
        """Write this rank's digest, wait for the group, end the process (no commit)."""
        self.allreduce_gradients()
        me = self._identity
        write_result(self._spec, RankDigest(
            group=self._label, rank=me.rank, node=me.node, step=self._next_step,
            digest=self._ring.digest, nonfinite=self._nonfinite,
            reductions=self._ring.reductions))
        log.info("replayed step %d: %d reductions, digest %s, %d NaN/Inf values (loss %s)",
                 self._next_step, self._ring.reductions, self._ring.digest[:12],
                 self._nonfinite, loss)
        # none leaves while another still reads from it
        self._group.all_true(True)
        end_process()

    def close(self) -> None:
        return None     # nothing was started


def replay_manager(config: Config, identity: WorkerIdentity, state: TrainState,
                   batch_size: int, spec_path: Path,
                   group: ReplicaGroup | None = None) -> ReplayManager:
    """The replay of the spec at ``spec_path``, as group ``FTL_WORKER_REPLAY_GROUP``."""
    label = os.environ.get(ENV_REPLAY_GROUP, "")
    if not label:
        raise UsageError(f"{ENV_REPLAY} is set but {ENV_REPLAY_GROUP} is not",
                         hint="replays are started by ft-launch run, which sets both")
    return ReplayManager(config, identity, state, batch_size, read_spec(spec_path), label,
                         group=group)


def end_process() -> NoReturn:
    """Exit status 0 now, the logs flushed, no interpreter teardown (module doc)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
