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
complete persistent checkpoint (``Manager._restore_persistent``) and go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ft_launch.errors import SlurmCommandError
from ft_launch.slurm.client import SlurmBackend
from ft_launch.slurm.states import JobState

log = logging.getLogger(__name__)

#: Job states in which the job still holds its allocation and trains.
_RUNNING = (JobState.RUNNING, JobState.SUSPENDED)


@dataclass(frozen=True)
class ControllerLostNotice:
    """Rank 0's answer instead of a quorum: stop, the controller is lost."""

    reason: str


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
