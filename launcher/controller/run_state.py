"""The one record of every replica's lifecycle, shared by the controller's rule tables
(pure; ``recovery`` for faults, ``versions`` for code updates, ``lifecycle`` for the
decision that composes them).

Lifecycle of one replica (the only enum that tracks it)::

    NOT_LAUNCHED --launch--> STARTING --commit--> RUNNING --finished--> FINISHED
                                 |                  |
                                 +----failure-------+--> DOWN --relaunch/promote-->
                                                         RECOVERING --commit--> RUNNING
    any live state --no node left / lost in a full restart--> FAILED

``DOWN`` lasts only inside one decision: the recovery table relaunches, promotes or
gives up on a failed replica in the same step. FINISHED and FAILED are final
("retired": nobody waits for them).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace


class ReplicaState(enum.Enum):
    NOT_LAUNCHED = "not launched"
    STARTING = "starting"       # launched with the run, no step committed yet
    RUNNING = "running"         # committing steps
    DOWN = "down"               # failed; recovery relaunches it (or gives up)
    RECOVERING = "recovering"   # relaunched or promoted, not yet back in training
    FINISHED = "finished"
    FAILED = "failed"           # given up on (no nodes left)


RETIRED = frozenset({ReplicaState.FINISHED, ReplicaState.FAILED})


@dataclass(frozen=True)
class CodeVersion:
    number: int                 # 1 = the command the run started with
    command: tuple[str, ...]
    digest: str                 # versions.digest_command() of it when it was recorded
    note: str
    created: float


@dataclass(frozen=True)
class Replica:
    replica_id: int
    nodes: tuple[str, ...]
    state: ReplicaState = ReplicaState.NOT_LAUNCHED
    failures: int = 0           # failures since it last made progress (recovery's count)
    progressed: bool = False    # has it ever committed a step
    version: int = 0            # code version of its last launch (0: never launched)
    #: failures on ``version`` since it last committed a step (the rollback's count: a
    #: new version starts it again, the recovery count goes on)
    failures_on_version: int = 0

    @property
    def retired(self) -> bool:
        return self.state in RETIRED


@dataclass(frozen=True)
class RunState:
    replicas: tuple[Replica, ...]
    standby: tuple[str, ...] = ()       # warm standby nodes, in promotion order
    evicted: tuple[str, ...] = ()
    restarts: int = 0                   # full in-allocation restarts so far
    nodes_per_replica: int = 1
    last_standby: str | None = None     # the batch host: promoted only when no other is left
    # code versions (hot update and rollback)
    versions: tuple[CodeVersion, ...] = ()  # versions[n - 1] is version n
    current: int = 0                        # the version new launches run
    #: (version, at): after ``at``, replicas on an older version are restarted onto current
    deadlines: tuple[tuple[int, float], ...] = ()
    bad: tuple[int, ...] = ()               # rolled back; never run again
    restarting: int | None = None           # replica restarted for an update, not yet back

    @classmethod
    def initial(cls, command: Sequence[str], digest: str,
                placements: Mapping[int, tuple[str, ...]] | Iterable[int], now: float, *,
                standby: tuple[str, ...] = (), nodes_per_replica: int = 1,
                last_standby: str | None = None, note: str = "initial command") -> RunState:
        """Nothing launched yet; version 1 is ``command``. ``placements``: replica id ->
        nodes (bare ids give each replica no nodes, enough for the code-version table)."""
        nodes = placements if isinstance(placements, Mapping) else {r: () for r in placements}
        first = CodeVersion(1, tuple(command), digest, note, now)
        state = cls(replicas=tuple(Replica(r, tuple(n)) for r, n in sorted(nodes.items())),
                    nodes_per_replica=nodes_per_replica, last_standby=last_standby,
                    versions=(first,), current=1)
        return state.with_standby(standby)

    def with_standby(self, nodes: tuple[str, ...]) -> RunState:
        """``nodes`` as the standby pool, ``last_standby`` (if among them) moved last."""
        last = tuple(n for n in nodes if n == self.last_standby)
        return replace(self, standby=tuple(n for n in nodes if n != self.last_standby) + last)

    def replica(self, replica_id: int) -> Replica:
        return self.replicas[replica_id]

    def with_replica(self, updated: Replica) -> RunState:
        replicas = list(self.replicas)
        replicas[updated.replica_id] = updated
        return replace(self, replicas=tuple(replicas))

    def owner_of(self, node: str) -> int | None:
        return next((r.replica_id for r in self.replicas if node in r.nodes), None)

    def version(self, number: int) -> CodeVersion:
        if not 1 <= number <= len(self.versions):
            raise ValueError(f"no code version {number}: versions are 1 to {len(self.versions)}")
        return self.versions[number - 1]

    def required(self, now: float) -> int:
        """Replicas on an older version than this are due for a restart."""
        return max((v for v, at in self.deadlines if at <= now), default=0)


@dataclass(frozen=True)
class ReplicaProgressed:
    """The replica committed a step (both tables hear of it; one rule applies it)."""

    replica_id: int


def record_progress(state: RunState, replica_id: int) -> RunState:
    """A commit: a starting or recovering replica is back, its failure counts reset. A
    late commit (read after the replica failed or retired) brings nothing back."""
    replica = state.replica(replica_id)
    if replica.retired:
        return state
    if replica.state is ReplicaState.DOWN:
        updated = replace(replica, failures_on_version=0)
    else:
        updated = replace(replica, state=ReplicaState.RUNNING, failures=0, progressed=True,
                          failures_on_version=0)
    state = state.with_replica(updated)
    if state.restarting == replica_id:
        state = replace(state, restarting=None)
    return state
