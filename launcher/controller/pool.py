"""Warm standby nodes held in a site reservation (``job.standby_mode = "reservation"``).

A standby job (``salloc --no-shell --reservation=R``) holds ``job.standby`` nodes of
the reservation, and the controller runs one standby agent step per node in it
(``srun --jobid=<standby job>``). A promotion takes one of two paths
(``job.promote_by``; ``auto`` picks the first the site allows):

* ``expansion``: the node moves into the main job (shrink the standby job, allocate
  the node as an expansion of the main job, hand it over, cancel the helper job;
  needs ``SchedulerParameters=permit_job_expansion``) and the replica starts there.
  The node's agent ends with the move, so the replica starts cold, but the main job
  owns every node it trains on (accounting, limits, one job to requeue or cancel);
* ``standby_job``: the warm agent becomes the replica as a step of the standby job.

After a promotion the standby job grows by a node of the reservation when one is
free (``Flags=REPLACE`` refills the reservation as nodes leave it). A pool short of
``job.standby`` nodes keeps trying, backing off from ``GROW_RETRY_FIRST_S`` to
``GROW_RETRY_MAX_S`` between tries: a reservation's nodes free up as other jobs end,
and a busy slurmctld may refuse an ``--immediate`` request it would grant a moment
later. The standby job is cancelled when the run ends. See ``etc/reservation.md`` for the admin's side.
"""

from __future__ import annotations

import logging

from ft_launch.config import JobConfig, PromotionPath
from ft_launch.errors import ConfigError, SlurmCommandError
from ft_launch.slurm.client import SlurmBackend

log = logging.getLogger(__name__)
GROW_WAIT_S = 5       # salloc --immediate: a free reservation node is granted at once
GROW_RETRY_FIRST_S = 10.0   # a short pool tries again after this, doubling each time ...
GROW_RETRY_MAX_S = 300.0    # ... up to this: each try holds the controller's loop up to
#                             GROW_WAIT_S, so a reservation with no free node costs
#                             the loop at most GROW_WAIT_S / GROW_RETRY_MAX_S of its time


class ReservationPool:
    """The standby jobs in the reservation and which node each holds."""

    def __init__(self, slurm: SlurmBackend, job: JobConfig, main_job_id: str) -> None:
        self.slurm = slurm
        self.reservation = job.reservation
        self.size = job.standby
        self.main_job_id = main_job_id
        self.name = f"ftl-standby-{main_job_id}"
        self.holder: dict[str, str] = {}     # standby node -> the standby job holding it
        self._trained_in: set[str] = set()   # standby jobs a replica was promoted inside
        self._retry_after = GROW_RETRY_FIRST_S
        self._next_try: float | None = None  # when a short pool tries to grow again
        self.path = self._resolve_path(job.promote_by)

    def _resolve_path(self, wanted: PromotionPath) -> PromotionPath:
        if wanted is not PromotionPath.AUTO:
            return wanted
        try:
            scheduler = self.slurm.config().get("SchedulerParameters", "")
        except SlurmCommandError as error:
            log.warning("cannot read the Slurm config (%s): promoting inside the standby job",
                        error)
            return PromotionPath.STANDBY_JOB
        path = PromotionPath.EXPANSION if "permit_job_expansion" in scheduler \
            else PromotionPath.STANDBY_JOB
        log.info("standby promotion path: %s (SchedulerParameters=%s)", path.value, scheduler)
        return path

    def acquire(self) -> tuple[str, ...]:
        """Allocate the standby job in the reservation; its nodes, in promotion order."""
        if self.size == 0:
            return ()
        try:
            nodes = self._allocate(self.size, immediate_s=60)
        except SlurmCommandError as error:
            raise ConfigError(f"cannot hold {self.size} standby node(s) in reservation "
                              f"{self.reservation!r}: {error}", key="job.reservation",
                              hint="check the reservation exists, has free nodes and lets "
                                   "this user in (scontrol show reservation)") from None
        log.info("standby job %s holds %s in reservation %s", self.holder[nodes[0]],
                 ",".join(nodes), self.reservation)
        return nodes

    def _allocate(self, count: int, immediate_s: int) -> tuple[str, ...]:
        job_id = self.slurm.allocate(count, name=self.name, reservation=self.reservation,
                                     immediate_s=immediate_s)
        info = self.slurm.job(job_id)
        nodes = info.nodes if info is not None else ()
        self.holder.update({n: job_id for n in nodes})
        return nodes

    def job_of(self, node: str) -> str | None:
        """The standby job holding ``node``; None for a node of the main job (the batch
        host is a standby there too)."""
        return self.holder.get(node)

    def move_to_main(self, node: str) -> None:
        """Expansion path: take ``node`` out of its standby job into the main job."""
        job_id = self.holder.pop(node)
        rest = tuple(n for n, j in self.holder.items() if j == job_id)
        if rest:
            self.slurm.shrink_job(job_id, rest)
        else:
            self.slurm.cancel_job(job_id)
        grow = self.slurm.allocate(1, name=f"ftl-grow-{self.main_job_id}",
                                   reservation=self.reservation, nodelist=(node,),
                                   expand=self.main_job_id, immediate_s=30)
        try:
            self.slurm.resize_job(grow, 0)  # its node goes to the main job ...
        finally:                            # ... and the helper job goes away (with the
            try:                            # node, if the hand-over failed)
                self.slurm.cancel_job(grow)
            except SlurmCommandError as error:
                log.warning("helper job %s not cancelled: %s", grow, error)
        log.info("node %s moved from standby job %s into job %s", node, job_id,
                 self.main_job_id)

    def promoted_in_place(self, node: str) -> None:
        """Standby-job path: the node trains inside its standby job from now on."""
        job_id = self.holder.pop(node, None)
        if job_id is not None:
            self._trained_in.add(job_id)

    @property
    def short(self) -> int:
        """How many standby nodes the pool lacks (promotions took them)."""
        return max(0, self.size - len(self.holder))

    def grow_due(self, now: float) -> bool:
        """Whether a short pool's next try at growing is due (``now``: monotonic s)."""
        return self.short > 0 and (self._next_try is None or now >= self._next_try)

    def grow(self, now: float) -> str | None:
        """Replenish by one node of the reservation (a one-node standby job), if one is
        free now; if none is, the next try is due after a backoff (``grow_due``)."""
        try:
            nodes = self._allocate(1, immediate_s=GROW_WAIT_S)
            why = "Slurm listed no node in the job it granted"
        except SlurmCommandError as error:
            nodes, why = (), str(error)
        if nodes:
            self._next_try, self._retry_after = None, GROW_RETRY_FIRST_S
            return nodes[0]
        log.warning("standby pool %d node(s) short, trying again in %.0f s (no free node in "
                    "reservation %s?): %s", self.short, self._retry_after, self.reservation,
                    why)
        self._next_try = now + self._retry_after
        self._retry_after = min(2 * self._retry_after, GROW_RETRY_MAX_S)
        return None

    def release(self) -> None:
        """Cancel every standby job (and with it the replicas run inside one)."""
        for job_id in sorted(set(self.holder.values()) | self._trained_in):
            try:
                self.slurm.cancel_job(job_id)
            except SlurmCommandError as error:
                log.warning("standby job %s not cancelled: %s", job_id, error)
        self.holder.clear()
        self._trained_in.clear()
