"""The per-step protocol of one rank: quorum, FTAR, catch-up, two-phase commit,
snapshot. Torch-free: the model and optimizer come in through ``TrainState``
(``torch_api.TorchTrainState`` for PyTorch).

A training loop::

    manager.start_step()              # returns at once: the quorum is asked beside forward
    loss = model.loss(batch_for(manager.data_position)); loss.backward()
    manager.allreduce_gradients()     # waits for FTAR across replicas (torch: done already,
                                      # at the end of backward)
    if manager.commit():              # all ranks agree -> optimizer step
        ...                           # committed; else the step is retried

Every rank runs forward and backward every step: whether this replica trains or
catches up is known only when the quorum answers, and a catching-up replica
makes the same reductions, contributing zeros. The quorum and the reductions run
in order on the exchange thread (``exchange.py``), beside backward.

Failures of FTAR, the quorum or the fetch are recoverable: the step is dropped
on every rank of the replica and retried under a new quorum, up to
``runtime.max_consecutive_failures`` in a row.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

from ft_launch.ckpt.errors import LayoutMismatchError, NoCheckpointError
from ft_launch.ckpt.fetch import Peer
from ft_launch.ckpt.held import HeldFiles
from ft_launch.ckpt.manifest import Bytes, Manifest
from ft_launch.ckpt.placement import global_rank, route_backups
from ft_launch.ckpt.rank import RankCheckpointer, RankPlace
from ft_launch.ckpt.restore import Restored, TierKind, peer_copies
from ft_launch.ckpt.snapshot import DualBufferSnapshotter, StateSource
from ft_launch.config import Config, IdenticalStart
from ft_launch.errors import ExitCode, FatalError, FtError, RecoverableError, TerminalAbort
from ft_launch.events import EventLog
from ft_launch.ftar import FtarGroup, ReduceOp
from ft_launch.launcher.heartbeat import ControllerWatchThread
from ft_launch.launcher.quorum import (
    FileDirectory,
    MembersLivenessChanged,
    QuorumAgent,
    StandingEnded,
)
from ft_launch.launcher.quorum.events import Event as QuorumEvent
from ft_launch.launcher.quorum.witness_service import MemoryFile, replica_memory_path, run_witnesses
from ft_launch.slurm.client import SlurmCli

from .audit import AuditLog
from .controller_loss import ControllerLostNotice, end_allocation, saver_of, wait_job_ended
from .events import (
    AllocationEnding,
    ControllerLost,
    StateRestored,
    StepCommitted,
    StepDiscarded,
    WorkerStarted,
    WorkerStopped,
)
from .exchange import Job, StepWork
from .exits import (
    DifferentStart,
    FinishedRun,
    NoQuorum,
    ended_by_error,
    ending,
    mark_finished,
    nothing_to_join,
    run_finished,
    track,
    untrack,
)
from .faults import SPIKE_SCALE, FaultInjector, FaultPoint
from .identity import WorkerIdentity
from .ledger import DataLedger, StepContribution
from .lr import lr_factor
from .pids import write_rank_pid
from .protocol import (
    FailureBudget,
    NonFiniteGradientsError,
    OtherHistoryError,
    QuorumView,
    ReplicaEndpoints,
    StepKind,
    StepPlan,
    decode_endpoints,
    plan_step,
)
from .replay_files import publish_state_servers
from .replica_group import ReplicaGroup, SoloGroup
from .rollbacks import HISTORY_KEY, Rollbacks, history_of

log = logging.getLogger(__name__)


@dataclass
class GradientNorm:
    """The L2 norm of this rank's reduced gradients in one step, summed up reduction by
    reduction (on the one exchange thread)."""

    squares: float = 0.0

    def add(self, norm: float) -> None:
        self.squares += norm * norm

    @property
    def value(self) -> float:
        return math.sqrt(self.squares)


@dataclass(frozen=True)
class Reduction:
    """What a gradient reduction needs of its step: this rank's ring, the step, and
    whether this replica's gradients count (False: it catches up and sends zeros)."""

    ftar: FtarGroup
    step: int
    contributes: bool
    corrupt: bool = False       # fault injection: put a NaN into this contribution
    scale: float = 1.0          # fault injection: a loss spike scales the gradients
    norm: GradientNorm = field(default_factory=GradientNorm)   # the step's, accumulated


class TrainState(Protocol):
    """What the protocol needs of a model + optimizer (see ``torch_api``)."""

    def reduce_gradients(self, reduction: Reduction) -> None: ...   # after backward
    def finish_gradients(self) -> None: ...   # all reductions done: gradients final
    def zero_gradients(self) -> None: ...     # the step is dropped
    def begin_step(self) -> None: ...         # a step starts (a dropped one's effects undone)
    def set_gradient_sync(self, sync: bool) -> bool: ...   # Manager.no_sync; the old setting
    def model_digest(self) -> str: ...        # of this rank's parameters and buffers
    def copy_model(self, ftar: FtarGroup, step: int, source: bool) -> None: ...   # the source's
    def register_state(self, name: str, obj: Any) -> None: ...   # see Manager.register_state
    def apply(self, lr_factor: float) -> None: ...        # the optimizer step
    def snapshot_source(self, step: int, loader_state: Mapping[str, Any]) -> StateSource: ...
    def bind_snapshots(self, snapshots: DualBufferSnapshotter) -> None: ...
    def load(self, manifest: Manifest, buffer: Bytes) -> Mapping[str, Any]: ...


class Manager:
    def __init__(self, config: Config, identity: WorkerIdentity, state: TrainState,
                 batch_size: int, *, group: ReplicaGroup | None = None) -> None:
        self._config = config
        self._identity = identity
        self._state = state
        self._batch_size = batch_size
        self._group = group or SoloGroup()
        # A replica started after the run finished has nothing to join: it ends before
        # it starts anything (rank 0 reads the mark, so every rank ends alike).
        (finished,) = self._group.broadcast((run_finished(identity),) if identity.rank == 0
                                            else None)
        if finished is not None:
            raise nothing_to_join(finished, identity)
        self._ledger = DataLedger(identity.num_replicas)
        self._next_step = 0
        self._budget = FailureBudget(config.runtime.max_consecutive_failures)
        #: the run's rollbacks: which states this process may restore, whom it trains with
        self._rollbacks = Rollbacks.from_env()
        run_dir = identity.run_dir
        tag = f"replica-{identity.replica_id}-rank-{identity.rank}"
        self._events = EventLog(run_dir / "events" / f"{tag}.jsonl")
        self._audit = (AuditLog(run_dir / "audit" / f"replica-{identity.replica_id}.jsonl")
                       if identity.rank == 0 else None)
        self._faults = FaultInjector.from_env(identity.rank, identity.node,
                                              fired=run_dir / "faults" / tag)
        self._loss_scale = 1.0      # this step's (fault injection: a loss spike)
        write_rank_pid(identity)    # where a hang diagnosis finds this rank (worker.pids)
        self._ftar = FtarGroup(config.ftar, identity.secret, identity.host,
                              progress_hook=self._on_ring_progress)
        ckpt_dir = Path(config.ckpt.dir)
        ckpt_config = dataclasses.replace(config.ckpt, dir=str(ckpt_dir if ckpt_dir.is_absolute()
                                                           else run_dir / ckpt_dir))
        # Backups are known by global rank; the ones this rank holds for others live in
        # this node's files (ckpt.backup_dir), where the job's next incarnation finds them.
        self._ckpt = RankCheckpointer(
            ckpt_config, RankPlace(rank=global_rank(identity.replica_id, identity.rank,
                                                    identity.ranks),
                                   world_size=identity.num_replicas * identity.ranks,
                                   shard=identity.rank, shards=identity.ranks),
            secret=identity.secret, host=identity.host, persist=identity.replica_id == 0,
            held=(HeldFiles.open(config.ckpt.backup_dir, identity.job_id, identity.node,
                                 str(run_dir)) if config.ckpt.peer_backup else None))
        state.bind_snapshots(self._ckpt.snapshots)
        mine = (self._ftar.address, (self._ckpt.address.host, self._ckpt.address.port))
        gathered = self._group.all_gather(mine)
        self._endpoints = ReplicaEndpoints(tuple(tuple(g[0]) for g in gathered),   # type: ignore[misc]
                                          tuple(tuple(g[1]) for g in gathered),   # type: ignore[misc]
                                          self._rollbacks.history)
        if identity.rank == 0:   # where a replay captures this replica's state (replay_files)
            publish_state_servers(run_dir, identity.replica_id, identity.job_id,
                                  self._endpoints.state)
        # before the quorum agent starts: its callbacks read the step's plan
        self._quorum_id: int | None = None
        self._work = StepWork()
        self._plan_ready = threading.Event()
        self._started = False
        self._exchanged = False
        self._plan: StepPlan | None = None
        self._unsnapshotted: int | None = None   # committed, its snapshot not started yet
        # the last quorum's members: a step's plan is cleared when it starts, and the
        # lowest of these saves the state when the controller is lost (controller_loss)
        self._last_members: tuple[int, ...] = ()
        #: Set when rank 0 found the controller lost (``_quorum_view``).
        self._stopping: ControllerLostNotice | None = None
        self._catch_up: Any = None
        self._contribution: StepContribution | None = None
        self._error: BaseException | None = None
        self._in_gradient_allreduce = False
        self._agent: QuorumAgent | None = None
        if identity.rank == 0:
            directory = FileDirectory(run_dir / "peers", identity.secret, identity.job_id)
            # Witness 0 counts only if the controller (it writes the heartbeat) says it votes.
            witnesses = run_witnesses(run_dir, config.quorum,
                                      controlled=identity.heartbeat is not None)
            # its term and vote outlive the process: a relaunch votes as it did
            memory = MemoryFile(replica_memory_path(run_dir, identity.replica_id),
                                identity.job_id)
            self._agent = QuorumAgent(identity.replica_id, range(identity.num_replicas),
                                     directory, identity.secret, config.quorum,
                                     job_id=identity.job_id, host=identity.host,
                                     event_log=self._events, witnesses=witnesses,
                                     memory=memory).start()
            if config.runtime.drop_lost_members:
                self._agent.subscribe(self._on_quorum_event)
        # Rank 0 watches the controller; its ranks hear of a loss with the quorum's answer.
        self._ending = threading.Event()
        self._controller = (ControllerWatchThread(identity.heartbeat,
                                                 config.runtime.controller_timeout,
                                                 on_lost=self._end_if_stuck).start()
                           if identity.rank == 0 and identity.heartbeat is not None else None)
        self._restore_persistent()
        if self._audit is not None:
            if self._rollbacks.history:
                self._audit.rollback(self._rollbacks.history, self._rollbacks.before[-1],
                                     self._next_step - 1)
            self._audit.restored(self._next_step - 1, self._rollbacks.history)
        self._events.emit(WorkerStarted(replica_id=identity.replica_id, rank=identity.rank,
                                       next_step=self._next_step))
        self._closing = False
        track(self)     # closed at interpreter exit if the script does not; SIGTERM stops it

    # ------------------------------------------------------------------ state

    @property
    def config(self) -> Config:
        return self._config

    @property
    def identity(self) -> WorkerIdentity:
        return self._identity

    @property
    def state(self) -> TrainState:
        return self._state

    @property
    def next_step(self) -> int:
        """The step training is at: every step before it is committed."""
        return self._next_step

    @property
    def positions(self) -> list[int]:
        """Samples of every replica's stream consumed by committed steps."""
        return list(self._ledger.positions)

    @property
    def batch_size(self) -> int:
        """Samples a training step of this replica consumes (all its ranks together)."""
        return self._batch_size

    @property
    def data_position(self) -> int:
        """Samples of this replica's stream consumed by committed steps."""
        return self._ledger.positions[self._identity.replica_id]

    @property
    def step_started(self) -> bool:
        """A step is started and not yet committed or dropped."""
        return self._started

    @property
    def plan(self) -> StepPlan:
        """This step's plan (the last step's after its commit); waits for the quorum."""
        if not self._started and self._plan is None:
            raise RuntimeError("start_step() first")
        self._plan_ready.wait()
        if self._plan is None:
            self._work.wait()          # raises what stopped the quorum
            raise RuntimeError("the quorum gave no plan for this step")
        return self._plan

    def _restore_persistent(self) -> None:
        """After a full restart: resume from the newest step that every rank of this
        replica restores soundly from ckpt's tiers (a replica that comes back older than
        the others catches up from them at its first quorum). The tiers include the peer
        backups that this replica's ranks find on their nodes: after every replica was
        lost at once, those are newer than the persistent tier. After a rollback only
        the states it left are restored (``worker.rollbacks``): the newest from before
        the spike, first."""
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
                loader_state = self._load_restored(restored)
                if not self._group.all_true(loader_state is not None):
                    continue
                assert loader_state is not None
                self._ledger = DataLedger.from_state(dict(loader_state),
                                                    self._identity.num_replicas)
                self._next_step = restored.step + 1
                log.info("restored step %d from %s", restored.step, restored.tier.value)
                # a replica that comes back older fetches this step from us at the first
                # quorum: it must be in the snapshot buffers, not only in the model
                self._ckpt.snapshot_restored(restored.step, self._state.snapshot_source(
                    restored.step, self._loader_state()))
                self._events.emit(StateRestored(
                    replica_id=me.replica_id, rank=me.rank, step=restored.step,
                    tier=restored.tier.value, skipped=list(restored.skipped)))
                return

    def _loader_state(self) -> dict[str, Any]:
        """What rides in every snapshot beside the model: the ledger, and the history."""
        return {**self._ledger.to_state(), HISTORY_KEY: self._rollbacks.history}

    def _load_restored(self, restored: Restored) -> Mapping[str, Any] | None:
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

    # ------------------------------------------------------------------ the step

    def start_step(self) -> None:
        """Start the next step: the quorum is asked on the exchange thread, so this
        returns at once and forward runs beside it. ``plan`` waits for the answer.
        Nothing to do if the step is started already (the model's forward starts it).

        The step committed last is snapshotted first: what the loop did after its
        ``optimizer.step()`` (``scheduler.step()``, the script's counters) belongs to
        it, so a replica that catches up from it continues from there exactly."""
        if self._started:
            return
        self._state.begin_step()
        self._snapshot_committed()
        first = self._next_step == 0    # of the run: nothing was committed or restored
        if first and not self._endpoints.start:
            self._advertise_start()
        self._error, self._contribution, self._catch_up, self._plan = None, None, None, None
        self._loss_scale = 1.0
        # what the commit reports of the step: its time, the time this rank waited for
        # the others (the ring, the replica's vote), its reduced gradients' norm
        self._step_started, self._waited, self._norm = time.monotonic(), 0.0, GradientNorm()
        self._plan_ready.clear()
        self._started, self._exchanged = True, False
        self._work.begin(self._settle_step)
        if first:
            self._start_identical()

    def _advertise_start(self) -> None:
        """Advertise every rank's model digest with the replica's endpoints (collective)."""
        digests = self._group.all_gather(self._state.model_digest())
        self._endpoints = dataclasses.replace(self._endpoints, start=tuple(digests))

    def _start_identical(self) -> None:
        """The run's first step, before its forward: replicas seeded apart (``seed +
        RANK``, whose RANK restarts at 0 in every replica, or a per-replica seed) would
        average the gradients of different models and never agree. DDP broadcasts rank
        0's model at construction; here the lowest member's parameters and buffers go to
        every member over the ring, or the run refuses (``runtime.identical_start``).
        Waits for the quorum: this step's forward must see the model it trains."""
        self._plan_ready.wait()
        plan, me = self._plan, self._identity
        if plan is None or not plan.diverged:
            return
        lowest, diverged = plan.members[0], ", ".join(map(str, plan.diverged))
        if self._config.runtime.identical_start is IdenticalStart.REFUSE:
            message = (f"replica(s) {diverged} start from another model than replica {lowest} "
                       "(their parameters or buffers differ) and runtime.identical_start = "
                       "refuse: seed the model alike in every replica (a replica's RANK "
                       "restarts at 0), or set it to copy")
            log.error("%s", message)
            raise ending(DifferentStart(message))
        self._work.submit(lambda: self._state.copy_model(
            self._ftar, plan.step, source=me.replica_id == lowest)).wait()
        if self._work.failed:   # the step is dropped at its commit; its retry copies again
            return
        self._advertise_start()
        if self._endpoints.start != plan.reference:
            raise FatalError(f"the model copied from replica {lowest} differs from its own "
                             f"(digests {self._endpoints.start} vs {plan.reference})",
                             replica_id=me.replica_id, rank=me.rank, step=plan.step)
        if me.rank == 0:
            log.warning("replica(s) %s started from another model than replica %d: every "
                        "replica trains replica %d's, copied before step %d "
                        "(runtime.identical_start = copy)", diverged, lowest, lowest, plan.step)

    def _snapshot_committed(self) -> None:
        """Start the snapshot of the step committed last, unless it is started."""
        if self._unsnapshotted is not None:
            step, self._unsnapshotted = self._unsnapshotted, None
            self._ckpt.after_optimizer_step(step, self._state.snapshot_source(
                step, self._loader_state()))

    def _settle_step(self) -> None:
        """On the exchange thread: the quorum, the ring, the catch-up fetch, and the
        exactly-once counts (small: they go before the first gradient reduction)."""
        try:
            plan = self._join_quorum()
            self._plan, self._last_members = plan, plan.members
        finally:
            self._plan_ready.set()
        if plan.reconfigure:
            self._quorum_id = None  # rebuilt below; on failure, rebuilt next step
            try:
                self._ftar.reconfigure(plan.quorum_id, list(plan.ring), plan.my_index)
            except FtError as error:  # a neighbour that fails the handshake: next quorum
                if isinstance(error, RecoverableError):
                    raise
                raise RecoverableError(f"FTAR ring of quorum {plan.quorum_id}: {error}",
                                       step=plan.step) from error
        self._quorum_id = plan.quorum_id
        if plan.kind is StepKind.CATCH_UP:
            peers = [Peer(host, port) for host, port in plan.fetch_from]
            self._catch_up = self._ckpt.catch_up(peers, plan.step - 1)
        self._faults.check(FaultPoint.START_STEP, plan.step)
        self._loss_scale = SPIKE_SCALE if self._faults.check(FaultPoint.LOSS, plan.step) else 1.0
        training = plan.kind is StepKind.TRAIN
        counts = self._ledger.contribution_vector(self._identity.replica_id,
                                                 self._batch_size if training else 0,
                                                 stopping=self._stopping is not None)
        self._ftar.allreduce(counts, op=ReduceOp.SUM, step=plan.step)
        contribution = self._ledger.decode(plan.step, counts)
        if contribution.stopping:
            # every member stops here, with the same newest committed step and the same
            # last quorum, whose lowest member saves (controller_loss)
            self._end_without_controller(
                self._stopping.reason if self._stopping is not None else
                f"no controller heartbeat for {self._config.runtime.controller_timeout:g} s "
                "at another replica of the step")
        self._contribution = contribution

    def _join_quorum(self) -> StepPlan:
        """The quorum for the next step. One that cannot form yet (election,
        stragglers, majority briefly lost) is retried, each failure counted against
        ``runtime.max_consecutive_failures``. Attempts are paced one join window
        apart: a replica that cannot reach a majority is answered at once, and
        unpaced retries would spend the whole budget in milliseconds instead of
        waiting for the others to come back. Once the budget is spent the replica
        ends (``NoQuorum``); once the run has finished, at once (``NothingToJoin``)."""
        waiting = time.monotonic()
        attempts = 0
        while True:
            attempt_started = time.monotonic()
            attempts += 1
            try:
                view = self._quorum_view()
                plan = plan_step(view, self._identity.replica_id, self._identity.rank,
                                 self._quorum_id, self._next_step)
                if plan.reconfigure:
                    self._route_backups(view)
                return plan
            except RecoverableError as error:
                log.warning("no quorum for step %d yet: %s", self._next_step, error)
                if not isinstance(error, OtherHistoryError):   # a rollback: nobody's fault
                    try:
                        self._budget.failed(error, self._next_step)
                    except FatalError:
                        raise self._no_quorum(error, attempts,
                                              time.monotonic() - waiting) from error
                time.sleep(max(0.0, attempt_started + self._config.quorum.join_timeout
                               - time.monotonic()))

    def _no_quorum(self, error: RecoverableError, attempts: int, waited: float) -> NoQuorum:
        """The exit of a replica whose failure budget ran out waiting for a quorum."""
        me, budget = self._identity, self._budget.limit
        message = (f"replica {me.replica_id} rank {me.rank} could not join: no quorum for "
                   f"step {self._next_step} in {waited:.1f} s ({attempts} attempt(s); the "
                   f"last: {error}); the other replicas are gone or unreachable. "
                   f"runtime.max_consecutive_failures = {budget} bounds this wait (each "
                   "attempt waits up to quorum.join_timeout + quorum.member_timeout + 4 x "
                   f"quorum.election_timeout); exit {int(ExitCode.RECOVERABLE)}")
        log.error("%s", message)
        return ending(NoQuorum(message))

    def _route_backups(self, view: QuorumView) -> None:
        """A new quorum: this rank's backup goes to the rank the placement picks over
        the members (their payloads say where every rank's state server is)."""
        members = tuple((replica, decode_endpoints(text).state) for replica, text in view.members)
        self._ckpt.route_backups(route_backups(members, self._identity.replica_id,
                                               self._identity.rank))

    def _quorum_view(self) -> QuorumView:
        """Rank 0 asks the quorum; every rank of the replica gets its answer (or error)."""
        answer: QuorumView | ControllerLostNotice | FinishedRun | str | None = None
        notice = None
        if self._controller is not None and self._controller.lost.is_set():
            notice = ControllerLostNotice(self._controller.reason)
        if self._agent is not None:
            try:
                answer = self._ask_quorum()
            except RecoverableError as error:
                # no quorum now: if because the run finished, none will ever come
                answer = run_finished(self._identity) or str(error)
        if notice is not None and not isinstance(answer, QuorumView):
            answer = notice   # no step to stop at with the others: stop now
        answer, self._stopping = self._group.broadcast((answer, notice))
        if isinstance(answer, FinishedRun):
            raise nothing_to_join(answer, self._identity)
        if isinstance(answer, ControllerLostNotice):
            self._end_without_controller(answer.reason)
        if isinstance(answer, str):
            raise RecoverableError(answer, replica_id=self._identity.replica_id,
                                   rank=self._identity.rank)
        assert answer is not None
        return answer

    def _ask_quorum(self) -> QuorumView:
        assert self._agent is not None
        quorum = self._agent.get_quorum(self._next_step, address=self._endpoints.encode())
        return QuorumView(quorum_id=quorum.quorum_id, max_step=quorum.max_step,
                          members=tuple(sorted((m.replica_id, m.address)
                                               for m in quorum.members)),
                          behind=tuple(quorum.behind))

    def reduce_gradients(self, reduce: Callable[[Reduction], None],
                         after: Callable[[], None] | None = None) -> Job:
        """Queue a reduction of (some of) this step's gradients on the exchange thread,
        after the quorum: hooks call this during backward. ``after`` runs once it ran
        or was skipped (the step failed earlier). The job, to wait on."""
        return self._work.submit(lambda: self._run_reduction(reduce), after)

    def _run_reduction(self, reduce: Callable[[Reduction], None]) -> None:
        plan = self._plan
        assert plan is not None  # the quorum ran first on this thread
        self._in_gradient_allreduce = True
        try:
            corrupt = self._faults.check(FaultPoint.GRADIENTS, plan.step)
            reduce(Reduction(self._ftar, plan.step, plan.kind is StepKind.TRAIN,
                             corrupt=corrupt, scale=self._loss_scale, norm=self._norm))
        finally:
            self._in_gradient_allreduce = False

    def allreduce_gradients(self) -> None:
        """Finish the cross-replica average of this step's gradients (this rank's
        ring): what hooks did not hand over is reduced now (once a step), then
        everything queued is awaited. The gradients are final afterwards.

        The torch front end calls it at the end of every backward that synchronises
        gradients (``torch_api``), so a script need not: clipping right after
        ``loss.backward()`` sees the average. Called again it only waits for what
        hooks queued since (a DDP or FSDP2 backward that synchronised once more)."""
        if not self._started:
            if self._exchanged:    # the step committed or was dropped: nothing left
                return
            raise RuntimeError("start_step() first")
        if not self._exchanged:
            self._exchanged = True
            self.reduce_gradients(self._state.reduce_gradients)
        waiting = time.monotonic()
        error = self._work.wait()
        self._waited += time.monotonic() - waiting
        if error is not None:
            self._error = error.with_ids(replica_id=self._identity.replica_id,
                                         rank=self._identity.rank)
            return
        self._state.finish_gradients()

    @property
    def gradients_exchanged(self) -> bool:
        """This step's gradients went to the cross-replica average (``allreduce_gradients``
        ran): a later backward's would reach no other replica unless hooks hand them
        over (DDP, FSDP2)."""
        return self._exchanged

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation on a plain module, DDP's idiom: ``with
        manager.no_sync(): loss.backward()`` for every micro-batch but the last. A
        backward inside keeps its gradients to this replica (accumulated in
        ``.grad``); the last backward, outside, averages the sum across replicas, so
        a step makes one exchange whatever its micro-batches (and ``batch_size`` is
        the replica's samples of all of them). Without it, a second backward after
        the step's exchange is refused (``UsageError``): its gradients would stay this
        replica's own. DDP and FSDP2 models use their own (``model.no_sync()``,
        ``model.set_requires_gradient_sync(False)``)."""
        previous = self._state.set_gradient_sync(False)
        try:
            yield
        finally:
            self._state.set_gradient_sync(previous)

    def register_state(self, name: str, obj: Any) -> None:
        """Keep ``obj`` in every snapshot under ``name``: anything with ``state_dict()``
        and ``load_state_dict()`` (an LR scheduler, a data loader, an RNG holder, the
        script's own counters), the same on every replica. It rides in catch-up, peer
        backups and the persistent tier, and is loaded where they are: a replica that
        catches up or restarts continues the schedule at the right step. Its state is
        taken when the next step starts (``start_step``); a dropped step's changes to
        it (a ``scheduler.step()`` after a ``step()`` that returned False) are undone.
        Register before the first ``optimizer.step()``."""
        self._state.register_state(name, obj)

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """``with manager.training_step(): loss.backward()``: starts the step; on
        leaving, the gradients are averaged across replicas (then clip, then commit
        with ``manager.commit()`` or ``FtOptimizer.step()``)."""
        self.start_step()
        yield
        self.allreduce_gradients()

    def commit(self, loss: float | None = None) -> bool:
        """Two-phase commit inside the replica: every rank's all-reduce (and fetch) must
        have succeeded; then the optimizer step, the ledger, the audit, the snapshot.
        ``loss`` (this rank's, optional) goes into the commit event, for the timeline."""
        self.allreduce_gradients()
        plan = self.plan
        self._started = False
        self._faults.check(FaultPoint.BEFORE_COMMIT, plan.step)
        fetched = self._await_catch_up()
        waiting = time.monotonic()
        healthy = self._group.all_true(self._error is None)
        self._waited += time.monotonic() - waiting
        if not healthy:
            return self._discard(plan)
        assert self._contribution is not None
        if fetched is not None:
            loader_state = self._state.load(fetched.manifest, fetched.buffer)
            self._ledger = DataLedger.from_state(dict(loader_state), self._identity.num_replicas)
        self._ckpt.before_optimizer_step()
        factor = lr_factor(self._config.runtime.lr_scaling, self._contribution.contributors,
                           self._identity.num_replicas)
        self._state.apply(factor)
        positions_before = list(self._ledger.positions)
        self._ledger.commit(self._contribution)
        self._write_audit(plan, positions_before)
        self._next_step = plan.step + 1
        if self._endpoints.start:   # compared at the first step only (start_step)
            self._endpoints = dataclasses.replace(self._endpoints, start=())
        # snapshotted when the next step starts, with the ledger (whoever restores it
        # resumes every stream) and what the loop does after this (start_step)
        self._unsnapshotted = plan.step
        self._budget.succeeded()
        self._events.emit(StepCommitted(
            replica_id=self._identity.replica_id, rank=self._identity.rank, step=plan.step,
            quorum_id=plan.quorum_id, contributors=self._contribution.contributors,
            caught_up=fetched is not None, lr_factor=factor,
            loss=None if loss is None else loss * self._loss_scale,
            grad_norm=self._norm.value, step_s=time.monotonic() - self._step_started,
            wait_s=self._waited, history=self._rollbacks.history))
        self._faults.check(FaultPoint.AFTER_COMMIT, plan.step)
        return True

    def _on_ring_progress(self, transfer: Any) -> None:
        """FTAR progress (a completed ring transfer): fault injection between the
        reduce-scatter and the all-gather of the gradient all-reduce."""
        plan = self._plan
        if (plan is not None and self._in_gradient_allreduce
                and transfer.ring_step == len(plan.ring) - 2):
            self._faults.check(FaultPoint.MID_ALLREDUCE, plan.step)

    def _on_quorum_event(self, event: QuorumEvent) -> None:
        """On the quorum's loop thread. A replica the quorum lost (its heartbeats
        stopped) that is in this step's ring fails the all-reduce now: a hung or
        unplugged replica sends no FIN, and the ring alone would wait ``ftar.timeout``.
        So does a step of a standing quorum that its leader ended before it: a member
        asked for a round instead and will not come (or, ended by this replica, its
        leader changed: it leaves the ring, see ``quorum.events.StandingEnded``)."""
        plan = self._plan
        if plan is None:
            return
        if isinstance(event, MembersLivenessChanged):
            detail = f"silent for {self._config.quorum.member_timeout:g} s"
            gone = [r for r in event.lost if r != self._identity.replica_id]
        elif isinstance(event, StandingEnded) and event.quorum_id == plan.quorum_id \
                and plan.step > event.through and self._next_step <= plan.step:
            mine = event.ended_by == self._identity.replica_id
            why = "left the ring, its leader changed" if mine else "asked for a round"
            detail = f"{why}: quorum {event.quorum_id} stands through step {event.through} only"
            gone = [event.ended_by]
        else:
            return
        for replica in gone:
            if replica in plan.members:
                # Off the loop thread: telling the neighbours may wait for a frame boundary.
                threading.Thread(target=self._fail_rings, name="ftar-member-lost",
                                 args=(plan.quorum_id, plan.members.index(replica), replica,
                                       detail), daemon=True).start()

    def _fail_rings(self, quorum_id: int, index: int, replica: int, detail: str) -> None:
        """Fail this rank's ring, then relay to the other ranks of the replica (only
        rank 0 hears the quorum); each rank's ring has the same member order."""
        self._ftar.member_lost(quorum_id, index, f"replica {replica} {detail}")
        for rank, address in enumerate(self._endpoints.ftar):
            if rank == self._identity.rank:
                continue
            try:
                self._ftar.relay_member_lost(address, quorum_id, index)
            except (FtError, OSError) as exc:  # it has moved on, or it is gone itself
                log.info("rank %d did not take the notice that replica %d is lost: %s",
                         rank, replica, exc)

    # ------------------------------------------------------------------ controller lost

    def _end_without_controller(self, reason: str) -> None:
        """Save the newest committed step and requeue the job, then stop (see
        ``controller_loss``). Collective: every rank of the replica is here."""
        me = self._identity
        self._ending.set()
        self._events.emit(ControllerLost(replica_id=me.replica_id, rank=me.rank,
                                        next_step=self._next_step, reason=reason))
        slurm = SlurmCli(self._config.slurm.command_timeout)
        members = self._last_members
        if not saver_of(members, me.replica_id):
            waited = self._config.runtime.controller_timeout
            log.error("controller lost (%s): waiting up to %g s for replica %d to save the "
                      "state and requeue job %s", reason, waited, min(members), me.job_id)
            ended = me.rank != 0 or wait_job_ended(slurm, me.job_id, waited)
            if self._group.all_true(ended):
                raise TerminalAbort(f"controller lost: {reason}; the job was ended")
            log.error("job %s still runs: this replica saves the state and requeues it",
                      me.job_id)
        saved = self._persist_newest()
        saved_step = saved if self._group.all_true(saved is not None) else None
        outcome = "nothing to save"
        if me.rank == 0:
            log.error("controller lost (%s): step %s saved to the persistent tier; ending "
                      "the allocation", reason, "none" if saved_step is None else saved_step)
            self._events.emit(AllocationEnding(replica_id=me.replica_id, saved_step=saved_step))
            outcome = end_allocation(slurm, me.job_id)
        raise TerminalAbort(f"controller lost: {reason}; {outcome}")

    def _end_if_stuck(self, reason: str) -> None:
        """On the watch thread: if training does not reach a step boundary within
        ``runtime.controller_timeout`` (hung in a collective, say), end the allocation
        from here, unsaved (the persistent tier has the last scheduled checkpoint)."""
        if not self._ending.wait(self._config.runtime.controller_timeout):
            log.error("controller lost (%s) and training is stuck: ending the allocation "
                      "without saving", reason)
            end_allocation(SlurmCli(self._config.slurm.command_timeout), self._identity.job_id)

    def _persist_newest(self) -> int | None:
        """Write the newest committed step to the persistent tier (this rank's shard);
        the step, or None if there is none or it could not be written in time."""
        step = self._next_step - 1
        if step < 0:
            return None
        timeout = self._config.ckpt.fetch_timeout
        self._ckpt.wait_persisted(timeout)     # a scheduled persist may be running
        if step in self._ckpt.persistent.complete_steps():
            return step
        future = self._ckpt.persist_now(step)
        try:
            if future is None:
                raise TimeoutError("a persist is still running")
            future.result(timeout=timeout)
        except (FtError, OSError, TimeoutError) as error:
            log.error("step %d not saved: %s", step, error)
            return None
        return step

    def _await_catch_up(self) -> Any:
        if self._catch_up is None or self._error is not None:
            return None
        try:
            return self._catch_up.result()
        except FtError as error:
            self._error = error
            return None

    def _discard(self, plan: StepPlan) -> bool:
        error = self._error or RecoverableError("another rank of this replica failed the step")
        log.warning("step %d discarded: %s", plan.step, error)
        # Every rank is here (the vote's outcome is the same on all): which of this
        # replica's nodes computed NaN/Inf, and whether a non-finite average was seen.
        seen = isinstance(error, NonFiniteGradientsError)
        own = isinstance(error, NonFiniteGradientsError) and error.own
        values = error.values if isinstance(error, NonFiniteGradientsError) else 0
        gathered = self._group.all_gather((self._identity.node if own else None, seen, values))
        nonfinite = sorted({node for node, _, _ in gathered if node is not None})
        # Another replica's NaN reached the average: not this replica's failure. Its
        # budget is kept for its own faults, and the controller evicts the node that
        # computes them (recovery.nonfinite_limit).
        bystander = any(s for _, s, _ in gathered) and not nonfinite
        self._state.zero_gradients()
        self._quorum_id = None  # the ring may be broken: rebuild it under the next quorum
        if self._agent is not None:
            self._agent.report_commit_failure()
        self._events.emit(StepDiscarded(replica_id=self._identity.replica_id,
                                       rank=self._identity.rank, step=plan.step,
                                       quorum_id=plan.quorum_id, reason=str(error),
                                       nonfinite_nodes=nonfinite,
                                       nonfinite_values=sum(v for _, _, v in gathered)))
        if not bystander:
            self._budget.failed(error, plan.step)
        return False

    def _write_audit(self, plan: StepPlan, positions_before: list[int]) -> None:
        if self._audit is None:
            return
        assert self._contribution is not None
        self._audit.step(plan.step, plan.quorum_id, positions_before,
                         list(self._contribution.counts), self._rollbacks.history)

    @property
    def closing(self) -> bool:
        """``close()`` has begun (it runs once)."""
        return self._closing

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()      # sees the exception leaving the block, if any (sys.exc_info)

    def close(self) -> None:
        """Stop this rank's runtime: quorum agent, exchange thread, state server, FTAR;
        then ``WorkerStopped``. Idempotent; leaving ``with ft_manager(...) as manager:``
        calls it, and so does the interpreter's exit if the script did not (``exits``).

        Called with no exception on its way (and none that ended the script), the
        run is over: this replica marks it finished and the backups held on this node
        are discarded. After a crash, a SIGTERM or a kill they are kept, as the job's
        next incarnation needs them, unless the run has finished meanwhile."""
        if self._closing:
            return
        self._closing = True
        try:
            self._close(finished=sys.exc_info()[0] is None and not ended_by_error())
        finally:
            untrack(self)

    def _close(self, finished: bool) -> None:
        me = self._identity
        if finished:
            self._snapshot_committed()    # the last step's (see start_step)
            if me.rank == 0:              # first: a replica waiting to join reads it
                mark_finished(me, self._next_step - 1)
        if self._controller is not None:
            self._controller.stop()
        if self._agent is not None:
            self._agent.stop()
        self._work.close()
        self._ckpt.wait_persisted(self._config.ckpt.fetch_timeout)
        if finished or run_finished(me) is not None:
            self._ckpt.discard_held()
        self._ckpt.close()
        self._ftar.close()
        stats = self._ftar.stats()
        self._events.emit(WorkerStopped(
            replica_id=me.replica_id, rank=me.rank, next_step=self._next_step,
            ftar_ops=stats.ops_completed, ftar_ops_failed=stats.ops_failed,
            ftar_bytes_sent=stats.bytes_sent, ftar_bytes_received=stats.bytes_received,
            finished=finished))
        self._events.close()
