"""The ring-failure relay (``runtime.drop_lost_members``): a replica the quorum has
lost fails this step's rings at once, on every rank of this replica.

A hung or unplugged replica sends no FIN, and the ring alone would wait
``ftar.timeout`` for it. Only rank 0 hears the quorum (its agent's events), so it
fails its own ring and tells the replica's other ranks to fail theirs (each rank's
ring has the same member order).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ft_launch.errors import FtError
from ft_launch.ftar import FtarGroup
from ft_launch.launcher.quorum import MembersLivenessChanged, StandingEnded
from ft_launch.launcher.quorum.events import Event as QuorumEvent

from .protocol import Address, StepPlan

log = logging.getLogger(__name__)


class LostMemberRelay:
    """Rank 0's subscriber to its quorum agent's events. ``plan``: the plan of the
    step in flight (the last step's after its commit; None before the quorum
    answers); ``next_step``: the step training is at; ``addresses``: the FTAR
    addresses of the replica's ranks, by rank."""

    def __init__(self, ftar: FtarGroup, rank: int, replica_id: int,
                 addresses: Sequence[Address], member_timeout: float,
                 plan: Callable[[], StepPlan | None], next_step: Callable[[], int]) -> None:
        self._ftar = ftar
        self._rank = rank
        self._replica_id = replica_id
        self._addresses = tuple(addresses)
        self._member_timeout = member_timeout
        self._plan = plan
        self._next_step = next_step

    def on_quorum_event(self, event: QuorumEvent) -> None:
        """On the quorum's loop thread. A replica the quorum lost (its heartbeats
        stopped) that is in this step's ring fails the all-reduce now. So does a step
        of a standing quorum that its leader ended before it: a member asked for a
        round instead and will not come (or, ended by this replica, its leader
        changed: it leaves the ring, see ``quorum.events.StandingEnded``)."""
        plan = self._plan()
        if plan is None:
            return
        if isinstance(event, MembersLivenessChanged):
            detail = f"silent for {self._member_timeout:g} s"
            gone = [r for r in event.lost if r != self._replica_id]
        elif isinstance(event, StandingEnded) and event.quorum_id == plan.quorum_id \
                and plan.step > event.through and self._next_step() <= plan.step:
            mine = event.ended_by == self._replica_id
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
        """Fail this rank's ring, then relay to the other ranks of the replica."""
        self._ftar.member_lost(quorum_id, index, f"replica {replica} {detail}")
        for rank, address in enumerate(self._addresses):
            if rank == self._rank:
                continue
            try:
                self._ftar.relay_member_lost(address, quorum_id, index)
            except (FtError, OSError) as exc:  # it has moved on, or it is gone itself
                log.info("rank %d did not take the notice that replica %d is lost: %s",
                         rank, replica, exc)
