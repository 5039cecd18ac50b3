"""The per-step protocol's decisions (pure): what a rank does with a quorum.

A replica leader advertises its ranks' endpoints (FTAR listener and state
server of each rank) as the quorum member ``address``; every rank of every
member can then derive the same ring and the same catch-up source.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass

from ft_launch.ckpt.placement import choose_fetch_source
from ft_launch.errors import FatalError, RecoverableError

Address = tuple[str, int]


class NonFiniteGradientsError(RecoverableError):
    """The replicas' averaged gradients hold NaN or Inf: every replica discards the step.
    ``own``: this rank's own contribution was already non-finite (its node computed it);
    ``values``: how many of its values were (counted only then)."""

    def __init__(self, message: str, *, own: bool, values: int = 0, **ids: object) -> None:
        super().__init__(message, **ids)  # type: ignore[arg-type]
        self.own = own
        self.values = values


class OtherHistoryError(RecoverableError):
    """The quorum holds replicas of another history (``worker.rollbacks``): processes
    from before a rollback not yet ended, or this one is. Not a failure of this
    replica: the step waits for the quorum to hold one history only."""


@dataclass(frozen=True)
class ReplicaEndpoints:
    """Where each rank of a replica listens: FTAR data plane and state server; the
    history of the state it trains (``worker.rollbacks``); and, until the run's first
    step commits, a digest of each rank's model (``start``: which replicas started
    from another model, see ``StepPlan.diverged``)."""

    ftar: tuple[Address, ...]
    state: tuple[Address, ...]
    history: int = 0
    start: tuple[str, ...] = ()

    def encode(self) -> str:
        fields: dict[str, object] = {"ftar": [list(a) for a in self.ftar],
                                     "state": [list(a) for a in self.state],
                                     "history": self.history}
        if self.start:
            fields["start"] = list(self.start)
        return json.dumps(fields, separators=(",", ":"))

    @staticmethod
    def decode(text: str) -> ReplicaEndpoints:
        raw = json.loads(text)
        return ReplicaEndpoints(tuple((h, int(p)) for h, p in raw["ftar"]),
                                tuple((h, int(p)) for h, p in raw["state"]),
                                int(raw.get("history", 0)),
                                tuple(str(d) for d in raw.get("start", ())))


@functools.lru_cache(maxsize=8192)
def decode_endpoints(text: str) -> ReplicaEndpoints:
    """Cached: the same members advertise the same text step after step, and decoding
    it every step is costly at many replicas (measurements:
    benchmarks/results/measurements.md#endpoint-decode-cache)."""
    return ReplicaEndpoints.decode(text)


class StepKind(enum.Enum):
    """What a replica does in a step, as the quorum decides (``StepPlan.kind``; a
    script reads it as ``manager.plan.kind``)."""

    TRAIN = "train"          # compute gradients on this replica's next batch
    CATCH_UP = "catch_up"    # behind: fetch state, contribute zero gradients


@dataclass(frozen=True)
class QuorumView:
    """The parts of a quorum the protocol needs (decoupled from the agent's types)."""

    quorum_id: int
    max_step: int
    members: tuple[tuple[int, str], ...]   # (replica_id, advertised endpoints), by replica id
    behind: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    step: int
    quorum_id: int
    kind: StepKind
    reconfigure: bool
    ring: tuple[Address, ...]        # FTAR members of this rank, in ring order
    my_index: int
    fetch_from: tuple[Address, ...]  # state servers to fetch ``step - 1`` from, in order
    members: tuple[int, ...]
    #: the run's first step only: the members whose models differ from the lowest
    #: member's (its ``start`` digests, ``reference``), who must take its model
    diverged: tuple[int, ...] = ()
    reference: tuple[str, ...] = ()


def plan_step(view: QuorumView, replica_id: int, rank: int, last_quorum_id: int | None,
              next_step: int) -> StepPlan:
    """Decide this rank's step from the quorum (identical inputs on every rank)."""
    replicas = [r for r, _ in view.members]
    if replica_id not in replicas:
        raise RecoverableError("this replica is not in the quorum", hint="rejoin next step",
                               replica_id=replica_id, quorum_id=view.quorum_id)
    endpoints = {r: decode_endpoints(text) for r, text in view.members}
    mine = endpoints[replica_id].history
    others = sorted(r for r, ends in endpoints.items() if ends.history != mine)
    if others:
        raise OtherHistoryError(
            f"replica(s) {others} of the quorum train another history than this one's "
            f"({mine} rollback(s)): waiting for the processes from before a rollback to end",
            replica_id=replica_id, quorum_id=view.quorum_id)
    if next_step > view.max_step:
        raise FatalError(f"local next step {next_step} is ahead of the quorum's max step "
                         f"{view.max_step}", hint="replica state diverged; restart it",
                         replica_id=replica_id, quorum_id=view.quorum_id)
    for r, ends in endpoints.items():
        if rank >= len(ends.ftar):
            raise FatalError(f"replica {r} advertises {len(ends.ftar)} ranks, this is rank "
                             f"{rank}", hint="all replicas must have the same ranks",
                             replica_id=replica_id, quorum_id=view.quorum_id)
    ring = tuple(endpoints[r].ftar[rank] for r in replicas)
    behind = next_step < view.max_step
    fetch_from: tuple[Address, ...] = ()
    if behind:
        healthy = [r for r in replicas if r not in view.behind]
        if not healthy:
            raise RecoverableError("behind, but no replica in the quorum is at the max step",
                                   replica_id=replica_id, quorum_id=view.quorum_id)
        fetch_from = tuple(endpoints[r].state[rank]
                           for r in fetch_order(rank, replica_id, view.behind, healthy))
    first = view.max_step == 0     # nothing committed yet: every member starts now
    reference = endpoints[replicas[0]].start if first else ()
    return StepPlan(step=view.max_step, quorum_id=view.quorum_id,
                    kind=StepKind.CATCH_UP if behind else StepKind.TRAIN,
                    reconfigure=view.quorum_id != last_quorum_id, ring=ring,
                    my_index=replicas.index(replica_id), fetch_from=fetch_from,
                    members=tuple(replicas),
                    diverged=tuple(r for r in replicas
                                   if first and endpoints[r].start != reference),
                    reference=reference)


def fetch_order(rank: int, replica_id: int, behind: Sequence[int],
                healthy: Sequence[int]) -> list[int]:
    """Healthy replicas to fetch from: the load-spreading first choice, then the rest
    as fallbacks should it die mid-fetch."""
    first = choose_fetch_source(rank, replica_id, behind, healthy)
    return [first] + [r for r in sorted(healthy) if r != first]


class FailureBudget:
    """Consecutive failed steps allowed before giving up (then the error is fatal)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.consecutive = 0

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, error: BaseException, step: int) -> None:
        self.consecutive += 1
        if self.consecutive >= self.limit:
            raise FatalError(f"{self.consecutive} consecutive steps failed; last error: {error}",
                             hint="check the replicas' logs; runtime.max_consecutive_failures "
                                  f"= {self.limit}", step=step) from error
