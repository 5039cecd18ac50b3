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
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Self

from ft_launch.ckpt.fetch import Peer
from ft_launch.ckpt.placement import route_backups
from ft_launch.config import Config, IdenticalStart
from ft_launch.errors import FatalError, FtError, RecoverableError, UsageError
from ft_launch.events import EventLog
from ft_launch.ftar import FtarGroup, ReduceOp

from .audit import AuditLog
from .checkpoints import Restorer, loader_state, rank_checkpointer
from .controller_loss import ControllerLoss
from .events import StepCommitted, StepDiscarded, WorkerStarted, WorkerStopped
from .exchange import Job, StepWork
from .exits import (
    DifferentStart,
    ended_by_error,
    ending,
    mark_finished,
    nothing_to_join,
    run_finished,
    track,
    untrack,
)
from .identity import WorkerIdentity
from .ledger import DataLedger
from .lr import lr_factor
from .observer import StepObserver, load_observer
from .pids import write_rank_pid
from .protocol import (
    FailureBudget,
    NonFiniteGradientsError,
    QuorumView,
    StepKind,
    StepPlan,
    decode_endpoints,
)
from .replay_files import publish_state_servers
from .replica_group import ReplicaGroup, SoloGroup
from .ring_relay import LostMemberRelay
from .rollbacks import Rollbacks
from .step import GradientNorm, Reduction, StepContext, TrainState
from .step_quorum import StepQuorum, gather_endpoints

# what the front ends import from here (``step`` defines them)
__all__ = ["GradientNorm", "Manager", "Reduction", "TrainState"]

log = logging.getLogger(__name__)


class Manager:
    """One rank's side of fault-tolerant training (module doc): a training script's
    loop calls ``start_step``, ``allreduce_gradients`` and ``commit`` (the torch front
    end, ``torch_api``, calls them from the model's hooks and ``FtOptimizer.step``);
    ``next_step`` and ``data_position`` say where training is.

    Threads: the training script's own, where every public method runs; the exchange
    thread (``exchange.StepWork``), which runs each step's quorum, ring, catch-up fetch,
    contribution all-reduce and gradient reductions in order; on rank 0, the quorum
    agent's loop (its events reach ``ring_relay``) and the controller's heartbeat watch
    (``controller_loss``); the checkpointer's state server and snapshot threads.

    Collaborators, each in its own module: ``StepQuorum`` (the step's quorum and plan),
    ``FtarGroup`` (the cross-replica ring), ``RankCheckpointer`` and ``Restorer``
    (snapshots, catch-up, backups, the restore at start: ``checkpoints``),
    ``ControllerLoss``, ``LostMemberRelay``, the ``DataLedger`` (exactly-once
    samples), the ``FailureBudget``, the ``ReplicaGroup`` (collectives among the
    replica's ranks), the ``TrainState`` (model and optimizer) and the
    ``StepObserver`` (no-op in production; fault drills). Each step's own state is a
    ``StepContext``, made when the step starts.

    The step's errors, by what the caller does about them: a recoverable failure (a
    lost peer, a broken ring, a failed catch-up fetch) raises nothing, the step is
    dropped at its commit and trained again; the worker's ends (``exits``) are
    ``SystemExit``s that training code's ``except Exception`` cannot swallow.

    Args:
        config: the run's configuration.
        identity: this rank's place in the run.
        state: the model and optimizer (``TrainState``; for torch, made by
            ``torch_api.ft_manager``).
        batch_size: samples one step of this replica consumes (all its ranks and
            micro-batches together).
        group: the collectives among the replica's ranks; None: a replica of one rank.
        observer: the step observer; None: the one the configuration names (no-op in
            production).

    Raises:
        NothingToJoin: the run finished before this replica started (``SystemExit``,
            exit 77).
        LayoutMismatchError: the state restored at start is laid out for another
            model or mesh (a ``FatalError``).
    """

    def __init__(self, config: Config, identity: WorkerIdentity, state: TrainState,
                 batch_size: int, *, group: ReplicaGroup | None = None,
                 observer: StepObserver | None = None) -> None:
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
        self._events = EventLog(run_dir / "events" /
                                f"replica-{identity.replica_id}-rank-{identity.rank}.jsonl")
        self._audit = (AuditLog(run_dir / "audit" / f"replica-{identity.replica_id}.jsonl")
                       if identity.rank == 0 else None)
        self._observer = load_observer(config, identity) if observer is None else observer
        write_rank_pid(identity)    # where a hang diagnosis finds this rank (worker.pids)
        self._ftar = FtarGroup(config.ftar, identity.secret, identity.host,
                               progress_hook=self._on_ring_progress)
        self._ckpt = rank_checkpointer(config, identity)
        state.bind_snapshots(self._ckpt.snapshots)
        self._endpoints = gather_endpoints(self._group, self._ftar, (
            self._ckpt.address.host, self._ckpt.address.port), self._rollbacks.history)
        if identity.rank == 0:   # where a replay captures this replica's state (replay_files)
            publish_state_servers(run_dir, identity.replica_id, identity.job_id,
                                  self._endpoints.state)
        # before the quorum agent starts: its events read the step in flight
        self._quorum_id: int | None = None    # the quorum this rank's ring is built for
        self._work = StepWork()
        self._step: StepContext | None = None
        self._unsnapshotted: int | None = None   # committed, its snapshot not started yet
        self._controller = ControllerLoss(config, identity, self._group, self._events,
                                          self._ckpt)
        self._quorum = StepQuorum(config, identity, self._group, self._events, self._budget,
                                  self._controller, on_new_quorum=self._route_backups)
        if config.runtime.drop_lost_members:
            self._quorum.subscribe(LostMemberRelay(
                self._ftar, identity.rank, identity.replica_id, self._endpoints.ftar,
                config.quorum.member_timeout, plan=self._plan_in_flight,
                next_step=lambda: self._next_step).on_quorum_event)
        self._controller.start()
        resumed = Restorer(identity, self._group, self._ckpt, state, self._rollbacks,
                           self._events).restore()
        if resumed is not None:
            self._ledger, self._next_step = resumed.ledger, resumed.step + 1
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
        return self._step is not None and self._step.open

    @property
    def gradients_exchanged(self) -> bool:
        """This step's gradients went to the cross-replica average (``allreduce_gradients``
        ran): a later backward's would reach no other replica unless hooks hand them
        over (DDP, FSDP2)."""
        return self._step is not None and self._step.exchanged

    @property
    def plan(self) -> StepPlan:
        """This step's plan (the last step's after its commit); waits for the quorum.

        Raises:
            RuntimeError: no step was started, or the quorum gave no plan.
            NoQuorum, NothingToJoin, TerminalAbort, FatalError: what stopped the
                quorum (see ``allreduce_gradients``).
        """
        step = self._step
        if step is None or (not step.open and step.plan is None):
            raise RuntimeError("start_step() first")
        step.planned.wait()
        if step.plan is None:
            self._work.wait()          # raises what stopped the quorum
            raise RuntimeError("the quorum gave no plan for this step")
        return step.plan

    @property
    def closing(self) -> bool:
        """``close()`` has begun (it runs once)."""
        return self._closing

    def _plan_in_flight(self) -> StepPlan | None:
        return None if self._step is None else self._step.plan

    # ------------------------------------------------------------------ the step

    def start_step(self) -> None:
        """Start the next step: the quorum is asked on the exchange thread, so this
        returns at once and forward runs beside it. ``plan`` waits for the answer.
        Nothing to do if the step is started already (the model's forward starts it).

        The step committed last is snapshotted first: what the loop did after its
        ``optimizer.step()`` (``scheduler.step()``, the script's counters) belongs to
        it, so a replica that catches up from it continues from there exactly.

        Raises:
            DifferentStart: at the run's first step, replicas start from different
                models and ``runtime.identical_start = refuse`` (``SystemExit``, exit
                78); every rank of every replica in the quorum raises it.
            FatalError: at the run's first step, the model copied from the lowest
                replica differs from that replica's (``runtime.identical_start = copy``).
        """
        if self.step_started:
            return
        self._state.begin_step()
        self._snapshot_committed()
        first = self._next_step == 0    # of the run: nothing was committed or restored
        if first and not self._endpoints.start:
            self._advertise_start()
        step = self._step = StepContext()
        self._work.begin(lambda: self._settle_step(step))
        if first:
            self._start_identical(step)

    def _advertise_start(self) -> None:
        """Advertise every rank's model digest with the replica's endpoints (collective)."""
        digests = self._group.all_gather(self._state.model_digest())
        self._endpoints = dataclasses.replace(self._endpoints, start=tuple(digests))

    def _start_identical(self, step: StepContext) -> None:
        """The run's first step, before its forward: replicas seeded apart (``seed +
        RANK``, whose RANK restarts at 0 in every replica, or a per-replica seed) would
        average the gradients of different models and never agree. DDP broadcasts rank
        0's model at construction; here the lowest member's parameters and buffers go to
        every member over the ring, or the run refuses (``runtime.identical_start``).
        Waits for the quorum: this step's forward must see the model it trains."""
        step.planned.wait()
        plan, me = step.plan, self._identity
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
                step, loader_state(self._ledger, self._rollbacks.history)))

    def _settle_step(self, step: StepContext) -> None:
        """On the exchange thread: the quorum, the ring, the catch-up fetch, and the
        exactly-once counts (small: they go before the first gradient reduction)."""
        try:
            plan, step.stopping = self._quorum.join(self._next_step, self._quorum_id,
                                                    self._endpoints)
            step.plan, self._controller.last_members = plan, plan.members
        finally:
            step.planned.set()
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
            step.catch_up = self._ckpt.catch_up(peers, plan.step - 1)
        self._observer.step_started(plan.step)
        training = plan.kind is StepKind.TRAIN
        counts = self._ledger.contribution_vector(self._identity.replica_id,
                                                  self._batch_size if training else 0,
                                                  stopping=step.stopping is not None)
        self._ftar.allreduce(counts, op=ReduceOp.SUM, step=plan.step)
        contribution = self._ledger.decode(plan.step, counts)
        if contribution.stopping:
            # every member stops here, with the same newest committed step and the same
            # last quorum, whose lowest member saves (controller_loss)
            self._controller.end(
                step.stopping.reason if step.stopping is not None else
                f"no controller heartbeat for {self._config.runtime.controller_timeout:g} s "
                "at another replica of the step", self._next_step)
        step.contribution = contribution

    def _route_backups(self, view: QuorumView) -> None:
        """A new quorum: this rank's backup goes to the rank the placement picks over
        the members (their payloads say where every rank's state server is)."""
        members = tuple((replica, decode_endpoints(text).state) for replica, text in view.members)
        self._ckpt.route_backups(route_backups(members, self._identity.replica_id,
                                               self._identity.rank))

    def reduce_gradients(self, reduce: Callable[[Reduction], None],
                         after: Callable[[], None] | None = None) -> Job:
        """Queue a reduction of (some of) this step's gradients on the exchange thread,
        after the quorum: hooks call this during backward. ``after`` runs once it ran
        or was skipped (the step failed earlier). The job, to wait on.

        Args:
            reduce: reduces gradients with the step's ``Reduction`` (the ring, the step,
                whether this replica trains).
            after: called once the job ran or was skipped.

        Returns:
            The queued job (``Job.wait``).
        """
        step = self._step
        return self._work.submit(lambda: self._run_reduction(step, reduce), after)

    def _run_reduction(self, step: StepContext | None,
                       reduce: Callable[[Reduction], None]) -> None:
        assert step is not None and step.plan is not None  # the quorum ran first here
        plan = step.plan
        step.reducing = True
        try:
            alter = self._observer.gradients(plan.step)
            reduce(Reduction(self._ftar, plan.step, plan.kind is StepKind.TRAIN,
                             norm=step.norm, alter=alter))
        finally:
            step.reducing = False

    def _on_ring_progress(self, transfer: Any) -> None:
        """FTAR progress (a completed ring transfer): the observer's point between the
        reduce-scatter and the all-gather of a gradient all-reduce."""
        step = self._step
        plan = None if step is None else step.plan
        if (step is not None and plan is not None and step.reducing
                and transfer.ring_step == len(plan.ring) - 2):
            self._observer.mid_allreduce(plan.step)

    def allreduce_gradients(self) -> None:
        """Finish the cross-replica average of this step's gradients (this rank's
        ring): what hooks did not hand over is reduced now (once a step), then
        everything queued is awaited. The gradients are final afterwards.

        The torch front end calls it at the end of every backward that synchronises
        gradients (``torch_api``), so a script need not: clipping right after
        ``loss.backward()`` sees the average. Called again it only waits for what
        hooks queued since (a DDP or FSDP2 backward that synchronised once more).

        A recoverable failure of the step's cross-replica work (a lost peer, a broken
        ring) raises nothing here: it is recorded and the step is dropped at its
        commit. What else stopped that work is raised here, in the training thread.

        Raises:
            RuntimeError: no step was started (``start_step``).
            NoQuorum: no quorum within ``runtime.max_consecutive_failures`` attempts:
                the others are gone (``SystemExit``, exit 75).
            NothingToJoin: the run finished while this replica waited for a quorum
                (``SystemExit``, exit 77).
            TerminalAbort: the controller is lost; the newest step was saved and the
                allocation ended (``controller_loss``).
            FatalError: retrying cannot help (this replica is ahead of the quorum's
                step, say, or has another number of ranks than the others).
            UsageError: no gradient reached the all-reduce hooks this step (a rank
                skipped backward, or its last backward did not synchronise).
        """
        step = self._step
        if step is None or not step.open:
            if step is not None and step.exchanged:   # committed or dropped: nothing left
                return
            raise RuntimeError("start_step() first")
        if not step.exchanged:
            step.exchanged = True
            self.reduce_gradients(self._state.reduce_gradients)
        with step.waiting():
            error = self._work.wait()
        if error is not None:
            step.error = error.with_ids(replica_id=self._identity.replica_id,
                                        rank=self._identity.rank)
            return
        self._state.finish_gradients()

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
        ``model.set_requires_gradient_sync(False)``).

        Raises:
            UsageError: the model is DDP or FSDP2 (torch front end).
        """
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
        Register before the first ``optimizer.step()``.

        Args:
            name: the object's key in every snapshot, one per object.
            obj: anything with ``state_dict()`` and ``load_state_dict()``.

        Raises:
            UsageError: (torch front end) after the first ``optimizer.step()``; ``obj``
                lacks ``state_dict()`` or ``load_state_dict()``; ``name`` is registered
                already; ``obj.state_dict()`` holds what a snapshot cannot (the error
                says where); or, where a restored state waits for ``name``, what
                ``obj.load_state_dict`` raises (``FtDataLoader``: another stream).
        """
        self._state.register_state(name, obj)

    @contextmanager
    def training_step(self) -> Iterator[None]:
        """``with manager.training_step(): loss.backward()``: starts the step; on
        leaving, the gradients are averaged across replicas (then clip, then commit
        with ``manager.commit()`` or ``FtOptimizer.step()``).

        Raises:
            DifferentStart, NoQuorum, NothingToJoin, TerminalAbort, FatalError,
                UsageError: as ``start_step`` and ``allreduce_gradients``.
        """
        self.start_step()
        yield
        self.allreduce_gradients()

    def commit(self, loss: float | None = None) -> bool:
        """Two-phase commit inside the replica: every rank's all-reduce (and fetch) must
        have succeeded; then the optimizer step, the ledger, the audit, the snapshot.
        ``loss`` (this rank's, optional) goes into the commit event, for the timeline.

        Args:
            loss: this rank's loss of the step, for the commit event.

        Returns:
            True: the step committed (the optimizer stepped, ``next_step`` advanced).
            False: a rank of the replica failed the step (its all-reduce or catch-up);
            it is dropped on every rank, its gradients zeroed, and trained again.

        Raises:
            RuntimeError: no step was started (``start_step``).
            FatalError: ``runtime.max_consecutive_failures`` steps failed in a row; the
                state fetched to catch up is laid out for another model
                (``LayoutMismatchError``); or as ``allreduce_gradients``.
            UsageError: commit() again for a step already committed; a registered
                object refused the state fetched to catch up (``FtDataLoader``: another
                stream); or as ``allreduce_gradients``.
            NoQuorum, NothingToJoin, TerminalAbort: as ``allreduce_gradients``.
        """
        if self._step is not None and not self._step.open:
            # a second commit would step the optimizer again and count the step's
            # samples twice: the next batch silently skipped
            raise UsageError(f"commit() called twice for step {self._step.plan.step}: "
                             "start_step() begins the next step (FtOptimizer.step and a "
                             "forward of the model start it by themselves)")
        self.allreduce_gradients()
        plan = self.plan
        step = self._step
        assert step is not None
        step.open = False
        self._observer.before_commit(plan.step)
        fetched = self._await_catch_up(step)
        with step.waiting():
            healthy = self._group.all_true(step.error is None)
        if not healthy:
            return self._discard(step, plan)
        contribution = step.contribution
        assert contribution is not None
        if fetched is not None:
            fetched_state = self._state.load(fetched.manifest, fetched.buffer)
            self._ledger = DataLedger.from_state(dict(fetched_state), self._identity.num_replicas)
        self._ckpt.before_optimizer_step()
        factor = lr_factor(self._config.runtime.lr_scaling, contribution.contributors,
                           self._identity.num_replicas)
        self._state.apply(factor)
        positions_before = list(self._ledger.positions)
        self._ledger.commit(contribution)
        if self._audit is not None:
            self._audit.step(plan.step, plan.quorum_id, positions_before,
                             list(contribution.counts), self._rollbacks.history)
        self._next_step = plan.step + 1
        if self._endpoints.start:   # compared at the first step only (start_step)
            self._endpoints = dataclasses.replace(self._endpoints, start=())
        # snapshotted when the next step starts, with the ledger (whoever restores it
        # resumes every stream) and what the loop does after this (start_step)
        self._unsnapshotted = plan.step
        self._budget.succeeded()
        self._events.emit(StepCommitted(
            replica_id=self._identity.replica_id, rank=self._identity.rank, step=plan.step,
            quorum_id=plan.quorum_id, contributors=contribution.contributors,
            caught_up=fetched is not None, lr_factor=factor,
            loss=None if loss is None else self._observer.loss(plan.step, loss),
            grad_norm=step.norm.value, step_s=time.monotonic() - step.started,
            wait_s=step.waited, history=self._rollbacks.history))
        self._observer.after_commit(plan.step)
        return True

    def _await_catch_up(self, step: StepContext) -> Any:
        """The state fetched for a replica that catches up (None: none, or failed)."""
        if step.catch_up is None or step.error is not None:
            return None
        try:
            return step.catch_up.result()
        except FtError as error:
            step.error = error
            return None

    def _discard(self, step: StepContext, plan: StepPlan) -> bool:
        error = step.error or RecoverableError("another rank of this replica failed the step")
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
        self._quorum.report_commit_failure()
        self._events.emit(StepDiscarded(replica_id=self._identity.replica_id,
                                        rank=self._identity.rank, step=plan.step,
                                        quorum_id=plan.quorum_id, reason=str(error),
                                        nonfinite_nodes=nonfinite,
                                        nonfinite_values=sum(v for _, _, v in gathered)))
        if not bystander:
            self._budget.failed(error, plan.step)
        return False

    # ------------------------------------------------------------------ closing

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
        self._controller.stop()
        self._quorum.stop()
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
