"""What the workers do when their controller is lost (its host died).

Nobody would recover the replicas any more, and Slurm keeps a batch job whose
batch host is dead RUNNING (with ``--no-kill``) until its time limit. So the
workers end the allocation themselves, within a bound, without losing state:

1. every replica of a step learns it at that step's start: rank 0 watches the
   heartbeat and tells its ranks with the quorum's answer, and every rank adds
   the finding to the step's contribution all-reduce, so all members stop
   together, before the step trains, with the same last quorum (a member that
   stopped alone would hold up a ring its standing quorum still counts it in);
2. one replica, the lowest of the last quorum, writes the newest committed step
   to the persistent tier (every rank its shard), then its rank 0 requeues the
   job (``scontrol requeue``; a job that cannot be requeued is cancelled);
3. the other replicas wait up to ``runtime.controller_timeout`` for that to end
   the job, and otherwise save and requeue it themselves (the saver may have died
   with the controller's host).

The requeued job runs the batch script again; its replicas restore the newest
complete persistent checkpoint (``checkpoints.Restorer``) and go on.

``ControllerLoss`` is one rank's side of this; the functions below it are its pure
and Slurm parts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, Self

from ft_launch.ckpt.rank import RankCheckpointer
from ft_launch.config import Config
from ft_launch.errors import FtError, SlurmCommandError, TerminalAbort
from ft_launch.events import EventLog
from ft_launch.launcher.heartbeat import ControllerWatchThread
from ft_launch.slurm.client import SlurmBackend, SlurmCli
from ft_launch.slurm.states import JobState

from .events import AllocationEnding, ControllerLost
from .identity import WorkerIdentity
from .replica_group import ReplicaGroup

log = logging.getLogger(__name__)

#: Job states in which the job still holds its allocation and trains.
_RUNNING = (JobState.RUNNING, JobState.SUSPENDED)


@dataclass(frozen=True)
class ControllerLostNotice:
    """Rank 0's answer instead of a quorum: stop, the controller is lost."""

    reason: str


class ControllerLoss:
    """One rank's side of the module doc. Rank 0 watches the controller's heartbeat
    (``start``; ``notice`` is its finding); every rank of the replica ends through
    ``end``, together, at a step's start; if training does not reach one in time,
    the watch thread ends the allocation unsaved (``_end_if_stuck``)."""

    def __init__(self, config: Config, identity: WorkerIdentity, group: ReplicaGroup,
                 events: EventLog, ckpt: RankCheckpointer) -> None:
        self._config = config
        self._identity = identity
        self._group = group
        self._events = events
        self._ckpt = ckpt
        #: the members of the last quorum this replica joined: its lowest saves the
        #: state (a step's plan is gone once the next step starts)
        self.last_members: tuple[int, ...] = ()
        self._ending = threading.Event()
        self._watch: ControllerWatchThread | None = None

    def start(self) -> Self:
        """Rank 0 of a worker the controller watches (``identity.heartbeat``) watches
        the controller; the other ranks hear of a loss with the quorum's answer."""
        me = self._identity
        if me.rank == 0 and me.heartbeat is not None:
            self._watch = ControllerWatchThread(me.heartbeat,
                                                self._config.runtime.controller_timeout,
                                                on_lost=self._end_if_stuck).start()
        return self

    def notice(self) -> ControllerLostNotice | None:
        """This rank's finding that the controller is lost, if it found it."""
        if self._watch is not None and self._watch.lost.is_set():
            return ControllerLostNotice(self._watch.reason)
        return None

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()

    def end(self, reason: str, next_step: int) -> NoReturn:
        """Save the newest committed step (``next_step - 1``) and requeue the job, then
        stop (module doc). Collective: every rank of the replica is here."""
        me = self._identity
        self._ending.set()
        self._events.emit(ControllerLost(replica_id=me.replica_id, rank=me.rank,
                                         next_step=next_step, reason=reason))
        slurm = SlurmCli(self._config.slurm.command_timeout)
        members = self.last_members
        if not saver_of(members, me.replica_id):
            waited = self._config.runtime.controller_timeout
            log.error("controller lost (%s): waiting up to %g s for replica %d to save the "
                      "state and requeue job %s", reason, waited, min(members), me.job_id)
            ended = me.rank != 0 or wait_job_ended(slurm, me.job_id, waited)
            if self._group.all_true(ended):
                raise TerminalAbort(f"controller lost: {reason}; the job was ended")
            log.error("job %s still runs: this replica saves the state and requeues it",
                      me.job_id)
        saved = self._persist_newest(next_step - 1)
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

    def _persist_newest(self, step: int) -> int | None:
        """Write ``step``, the newest committed, to the persistent tier (this rank's
        shard); the step, or None if there is none or it could not be written in time."""
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


def saver_of(members: tuple[int, ...], replica_id: int) -> bool:
    """Whether this replica writes the newest state: the lowest member of the last
    quorum (all replicas agree on it), or itself if it never joined one."""
    return replica_id == min(members, default=replica_id)


def end_allocation(slurm: SlurmBackend, job_id: str) -> str:
    """Requeue the job (Slurm starts it again; it resumes from the persistent tier);
    cancel it if it cannot be requeued. What happened, for the log."""
    try:
        slurm.requeue_job(job_id)
        return f"job {job_id} requeued"
    except SlurmCommandError as requeue_error:
        log.error("requeue of job %s failed (%s): cancelling it", job_id, requeue_error)
    try:
        slurm.cancel_job(job_id)
        return f"job {job_id} cancelled (it could not be requeued)"
    except SlurmCommandError as cancel_error:
        log.error("cancelling job %s failed too: %s", job_id, cancel_error)
        return f"job {job_id} neither requeued nor cancelled: {cancel_error}"


def job_still_running(slurm: SlurmBackend, job_id: str) -> bool:
    try:
        info = slurm.job(job_id)
    except SlurmCommandError as error:
        log.warning("cannot read job %s: %s", job_id, error)
        return True
    return info is not None and info.state in _RUNNING


def wait_job_ended(slurm: SlurmBackend, job_id: str, timeout: float,
                   interval: float = 1.0, clock: Callable[[], float] = time.monotonic,
                   pause: Callable[[float], None] = time.sleep) -> bool:
    """Wait up to ``timeout`` for another replica to requeue or cancel the job; True
    if it did. (This process is normally killed by that, and never sees True.)"""
    deadline = clock() + timeout
    while clock() < deadline:
        if not job_still_running(slurm, job_id):
            return True
        pause(min(interval, max(0.0, deadline - clock())))
    return not job_still_running(slurm, job_id)
