"""The recovery controller's decisions (pure): ``decide(state, event) -> (state, actions)``.

The table (design.md, "Automated fault tolerance"), restricted to what the
controller can observe:

| event                                   | first action                          | again / no other way          |
| --------------------------------------- | ------------------------------------- | ----------------------------- |
| node fault (alarm, node lost, gate fail)| evict node, promote a standby         | no standby: retry on survivors|
| replica crashed, no clear cause         | retry in place (same nodes)           | evict + promote               |
| majority lost, standbys enough (*)      | promote each; they rejoin and restore |                               |
| majority lost, too few standbys         | full in-allocation restart (from ckpt)| too few nodes: give up        |
| replica finished                        | let the others finish, then stop      |                               |
| restart requested (code update)         | relaunch in place, not a failure      |                               |

(*) Better than restarting everyone: the promoted replicas catch up from any survivor
(no step lost), and with no survivor each restores the newest persistent checkpoint and
they form the quorum there: the full in-allocation restart, without cancelling anyone.

The thin shell (``supervisor``) turns actions into srun / scancel / scontrol.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class ReplicaState(enum.Enum):
    RUNNING = "running"
    RECOVERING = "recovering"   # relaunched or promoted, not yet back in training
    FINISHED = "finished"
    FAILED = "failed"           # given up on (no nodes left)


@dataclass(frozen=True)
class Replica:
    replica_id: int
    nodes: tuple[str, ...]
    state: ReplicaState = ReplicaState.RUNNING
    failures: int = 0           # failures since it last made progress
    progressed: bool = False    # has it ever committed a step


@dataclass(frozen=True)
class RunState:
    replicas: tuple[Replica, ...]
    standby: tuple[str, ...]            # warm standby nodes, in promotion order
    evicted: tuple[str, ...] = ()
    restarts: int = 0                   # full in-allocation restarts so far
    nodes_per_replica: int = 1
    last_standby: str | None = None     # the batch host: promoted only when no other is left

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


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ReplicaCrashed:
    """A replica's step ended with an error, and no node is known to be bad."""

    replica_id: int
    exit_code: int


@dataclass(frozen=True)
class NodeFaulted:
    """A node is known bad: health alarm, gate failure, or lost (step alive, no progress,
    or srun reports the node down)."""

    replica_id: int | None
    node: str
    reason: str


@dataclass(frozen=True)
class ReplicaProgressed:
    replica_id: int


@dataclass(frozen=True)
class ReplicaFinished:
    replica_id: int


@dataclass(frozen=True)
class RestartRequested:
    """Restart a healthy replica in place on purpose (a code update): not a failure."""

    replica_id: int


@dataclass(frozen=True)
class StandbyAdded:
    """A new warm standby node joined the pool (reservation mode replenishes it)."""

    node: str


Event = (ReplicaCrashed | NodeFaulted | ReplicaProgressed | ReplicaFinished | RestartRequested
         | StandbyAdded)


# --------------------------------------------------------------------------- actions


@dataclass(frozen=True)
class EvictNode:
    node: str
    reason: str


@dataclass(frozen=True)
class CancelReplica:
    replica_id: int


@dataclass(frozen=True)
class PromoteStandby:
    replica_id: int
    node: str


@dataclass(frozen=True)
class RelaunchReplica:
    replica_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class FullRestart:
    """Relaunch every replica; they restore from the newest persistent checkpoint."""

    placements: tuple[tuple[int, tuple[str, ...]], ...]


@dataclass(frozen=True)
class GiveUp:
    reason: str
    fatal: bool = False         # retrying (a requeue) cannot help: do not requeue


Action = EvictNode | CancelReplica | PromoteStandby | RelaunchReplica | FullRestart | GiveUp


@dataclass(frozen=True)
class Policy:
    retries_in_place: int = 1   # crashes without a cause retried on the same nodes


# --------------------------------------------------------------------------- decide


def decide(state: RunState, event: Event, policy: Policy | None = None
           ) -> tuple[RunState, list[Action]]:
    policy = policy or Policy()
    if isinstance(event, ReplicaProgressed):
        replica = state.replica(event.replica_id)
        if replica.state is ReplicaState.RECOVERING or replica.failures or not replica.progressed:
            state = state.with_replica(replace(replica, state=ReplicaState.RUNNING, failures=0,
                                               progressed=True))
        return state, []
    if isinstance(event, ReplicaFinished):
        replica = state.replica(event.replica_id)
        return state.with_replica(replace(replica, state=ReplicaState.FINISHED)), []
    if isinstance(event, NodeFaulted):
        return _node_faulted(state, event)
    if isinstance(event, StandbyAdded):
        if event.node in state.standby or event.node in state.evicted:
            return state, []
        return state.with_standby(state.standby + (event.node,)), []
    if isinstance(event, RestartRequested):
        replica = state.replica(event.replica_id)
        if replica.state in (ReplicaState.FINISHED, ReplicaState.FAILED):
            return state, []
        state = state.with_replica(replace(replica, state=ReplicaState.RECOVERING))
        return state, [CancelReplica(replica.replica_id),
                       RelaunchReplica(replica.replica_id, replica.nodes)]
    return _crashed(state, event, policy)


def _node_faulted(state: RunState, event: NodeFaulted) -> tuple[RunState, list[Action]]:
    actions: list[Action] = []
    if event.node not in state.evicted:
        actions.append(EvictNode(event.node, event.reason))
        state = replace(state, evicted=state.evicted + (event.node,),
                        standby=tuple(n for n in state.standby if n != event.node))
    owner = event.replica_id
    if owner is None:
        owner = next((r.replica_id for r in state.replicas if event.node in r.nodes), None)
    if owner is None or state.replica(owner).state is ReplicaState.FINISHED:
        return state, actions  # a standby or an idle node: evicting it is all
    replica = state.replica(owner)
    actions.append(CancelReplica(owner))
    lost = _lost_replicas(state, owner)
    if lost * 2 > len(state.replicas):
        return _full_restart(state, actions)
    return _replace_node(state, replica, event.node, actions)


def _replace_node(state: RunState, replica: Replica, bad: str, actions: list[Action]
                  ) -> tuple[RunState, list[Action]]:
    healthy = tuple(n for n in replica.nodes if n != bad)
    if len(replica.nodes) == 1 and state.standby:
        node, rest = state.standby[0], state.standby[1:]
        state = replace(state, standby=rest)
        updated = replace(replica, nodes=(node,), state=ReplicaState.RECOVERING,
                          failures=replica.failures + 1)
        return state.with_replica(updated), actions + [PromoteStandby(replica.replica_id, node)]
    if len(state.standby) >= 1:
        node, rest = state.standby[0], state.standby[1:]
        nodes = tuple(node if n == bad else n for n in replica.nodes)
        state = replace(state, standby=rest)
        updated = replace(replica, nodes=nodes, state=ReplicaState.RECOVERING,
                          failures=replica.failures + 1)
        return state.with_replica(updated), actions + [RelaunchReplica(replica.replica_id,
                                                                       nodes)]
    # No standby left: the replica is lost; the others train on (FT-HSDP's point).
    state = state.with_replica(replace(replica, nodes=healthy, state=ReplicaState.FAILED))
    if all(r.state in (ReplicaState.FAILED, ReplicaState.FINISHED) for r in state.replicas):
        actions.append(GiveUp("every replica has lost a node and no standby is left"))
    return state, actions


def _crashed(state: RunState, event: ReplicaCrashed, policy: Policy
             ) -> tuple[RunState, list[Action]]:
    replica = state.replica(event.replica_id)
    if replica.state in (ReplicaState.FINISHED, ReplicaState.FAILED):
        return state, []
    if replica.failures < policy.retries_in_place:
        updated = replace(replica, state=ReplicaState.RECOVERING, failures=replica.failures + 1)
        return state.with_replica(updated), [RelaunchReplica(replica.replica_id, replica.nodes)]
    if not replica.progressed:
        # Crashing again before its first step: the command or its input is broken far
        # more often than a node. Draining nodes would not help; neither would a requeue.
        return state, [GiveUp(f"replica {replica.replica_id} failed {replica.failures + 1} "
                              f"times before its first step (exit code {event.exit_code}): "
                              "check the training command and its logs", fatal=True)]
    # It failed again where it was: suspect its (first) node.
    return _node_faulted(state, NodeFaulted(
        replica.replica_id, replica.nodes[0],
        f"replica {replica.replica_id} failed {replica.failures + 1} times in a row "
        f"(last exit code {event.exit_code})"))


def _lost_replicas(state: RunState, newly_lost: int) -> int:
    """Replicas that cannot come back: the one just lost and those given up on for lack
    of nodes. A replica being relaunched or promoted is not lost: it restores the newest
    state (a survivor's, else the persistent checkpoint) and rejoins."""
    return sum(1 for r in state.replicas
               if r.replica_id == newly_lost or r.state is ReplicaState.FAILED)


def _full_restart(state: RunState, actions: list[Action]) -> tuple[RunState, list[Action]]:
    usable = [n for r in state.replicas for n in r.nodes if n not in state.evicted]
    usable += list(state.standby)         # the batch host, if still a standby, comes last
    size = state.nodes_per_replica
    count = min(len(usable) // size, len(state.replicas))
    if count * 2 <= len(state.replicas):
        return state, actions + [GiveUp(f"only {len(usable)} healthy node(s) left for "
                                        f"{len(state.replicas)} replicas: requeue the job")]
    placements = []
    replicas = []
    for r in state.replicas:
        if r.replica_id < count:
            nodes = tuple(usable[r.replica_id * size:(r.replica_id + 1) * size])
            placements.append((r.replica_id, nodes))
            replicas.append(Replica(r.replica_id, nodes, ReplicaState.RECOVERING))
        else:
            replicas.append(replace(r, state=ReplicaState.FAILED, nodes=()))
    standby = tuple(usable[count * size:])
    new_state = replace(state, replicas=tuple(replicas), standby=standby,
                        restarts=state.restarts + 1)
    cancels = [CancelReplica(r.replica_id) for r in state.replicas
               if CancelReplica(r.replica_id) not in actions]
    return new_state, actions + cancels + [FullRestart(tuple(placements))]
