"""The recovery table (pure): ``decide(state, event) -> (state, actions)``, the fault
rules of the one controller decision (``lifecycle.decide``).

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

Every action says why it was taken (``reason``). ``lifecycle.decide`` composes this
table with the code-version one over the one ``RunState``; the thin shell
(``supervisor``) turns actions into srun / scancel / scontrol.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .run_state import Replica, ReplicaProgressed, ReplicaState, RunState, record_progress

#: The lifecycle types are re-exported: the table's callers need nothing else.
__all__ = ["CancelReplica", "EvictNode", "FullRestart", "GiveUp", "NodeFaulted",
           "PromoteStandby", "RecoveryAction", "RecoveryEvent", "RecoveryPolicy",
           "RelaunchReplica", "Replica", "ReplicaCrashed", "ReplicaFinished",
           "ReplicaProgressed", "ReplicaState", "RestartRequested", "RunState", "StandbyAdded",
           "decide"]


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
class ReplicaFinished:
    replica_id: int


@dataclass(frozen=True)
class RestartRequested:
    """Restart a healthy replica in place on purpose (a code update): not a failure."""

    replica_id: int
    reason: str = "restart requested"


@dataclass(frozen=True)
class StandbyAdded:
    """A new warm standby node joined the pool (reservation mode replenishes it)."""

    node: str


RecoveryEvent = (ReplicaCrashed | NodeFaulted | ReplicaProgressed | ReplicaFinished
                 | RestartRequested | StandbyAdded)


# --------------------------------------------------------------------------- actions
# Each carries why it was taken; where the reason is not part of what the action does
# (everything but a drain's and a give-up's), it takes no part in comparisons.


@dataclass(frozen=True)
class EvictNode:
    node: str
    reason: str                 # the drain reason (sanitised by ft_launch.health.drain)


@dataclass(frozen=True)
class CancelReplica:
    replica_id: int
    reason: str = field(default="", compare=False)


@dataclass(frozen=True)
class PromoteStandby:
    replica_id: int
    node: str
    reason: str = field(default="", compare=False)
    command: tuple[str, ...] = field(default=(), compare=False)  # set by lifecycle.decide


@dataclass(frozen=True)
class RelaunchReplica:
    replica_id: int
    nodes: tuple[str, ...]
    reason: str = field(default="", compare=False)
    command: tuple[str, ...] = field(default=(), compare=False)  # set by lifecycle.decide


@dataclass(frozen=True)
class FullRestart:
    """Relaunch every replica; they restore from the newest persistent checkpoint."""

    placements: tuple[tuple[int, tuple[str, ...]], ...]
    reason: str = field(default="", compare=False)
    #: each placement's command, in order (set by lifecycle.decide)
    commands: tuple[tuple[str, ...], ...] = field(default=(), compare=False)


@dataclass(frozen=True)
class GiveUp:
    reason: str
    fatal: bool = False         # retrying (a requeue) cannot help: do not requeue


RecoveryAction = (EvictNode | CancelReplica | PromoteStandby | RelaunchReplica | FullRestart
                  | GiveUp)


@dataclass(frozen=True)
class RecoveryPolicy:
    retries_in_place: int = 1   # crashes without a cause retried on the same nodes


# --------------------------------------------------------------------------- decide


def decide(state: RunState, event: RecoveryEvent, policy: RecoveryPolicy | None = None
           ) -> tuple[RunState, list[RecoveryAction]]:
    policy = policy or RecoveryPolicy()
    if isinstance(event, ReplicaProgressed):
        return record_progress(state, event.replica_id), []
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
        if replica.retired:
            return state, []
        state = state.with_replica(replace(replica, state=ReplicaState.RECOVERING))
        return state, [CancelReplica(replica.replica_id, event.reason),
                       RelaunchReplica(replica.replica_id, replica.nodes, event.reason)]
    return _crashed(state, event, policy)


def _node_faulted(state: RunState, event: NodeFaulted) -> tuple[RunState, list[RecoveryAction]]:
    actions: list[RecoveryAction] = []
    if event.node not in state.evicted:
        actions.append(EvictNode(event.node, event.reason))
        state = replace(state, evicted=state.evicted + (event.node,),
                        standby=tuple(n for n in state.standby if n != event.node))
    owner = event.replica_id if event.replica_id is not None else state.owner_of(event.node)
    if owner is None or state.replica(owner).state is ReplicaState.FINISHED:
        return state, actions  # a standby or an idle node: evicting it is all
    replica = state.replica(owner)
    why = f"node {event.node} of replica {owner} at fault: {event.reason}"
    actions.append(CancelReplica(owner, why))
    lost = _lost_replicas(state, owner)
    if lost * 2 > len(state.replicas):
        return _full_restart(state, actions, f"{why}; {lost} of {len(state.replicas)} "
                                             "replicas lost, a majority")
    return _replace_node(state, replica, event.node, actions, why)


def _replace_node(state: RunState, replica: Replica, bad: str, actions: list[RecoveryAction],
                  why: str) -> tuple[RunState, list[RecoveryAction]]:
    healthy = tuple(n for n in replica.nodes if n != bad)
    if state.standby:
        node, rest = state.standby[0], state.standby[1:]
        state = replace(state, standby=rest)
        # A one-node replica becomes the warm standby's agent; a bigger one is relaunched
        # with the standby in place of the bad node.
        nodes = (node,) if len(replica.nodes) == 1 else tuple(
            node if n == bad else n for n in replica.nodes)
        updated = replace(replica, nodes=nodes, state=ReplicaState.RECOVERING,
                          failures=replica.failures + 1)
        why = f"{why}; standby {node} takes its place"
        action: RecoveryAction = PromoteStandby(replica.replica_id, node, why) \
            if len(replica.nodes) == 1 else RelaunchReplica(replica.replica_id, nodes, why)
        return state.with_replica(updated), actions + [action]
    # No standby left: the replica is lost; the others train on (FT-HSDP's point).
    state = state.with_replica(replace(replica, nodes=healthy, state=ReplicaState.FAILED))
    if all(r.retired for r in state.replicas):
        actions.append(GiveUp("every replica has lost a node and no standby is left"))
    return state, actions


def _crashed(state: RunState, event: ReplicaCrashed, policy: RecoveryPolicy
             ) -> tuple[RunState, list[RecoveryAction]]:
    replica = state.replica(event.replica_id)
    if replica.retired:
        return state, []
    if replica.failures < policy.retries_in_place:
        updated = replace(replica, state=ReplicaState.RECOVERING, failures=replica.failures + 1)
        why = (f"replica {replica.replica_id} exited with {event.exit_code}, no node at "
               f"fault: retry {replica.failures + 1} of {policy.retries_in_place} in place")
        return state.with_replica(updated), [RelaunchReplica(replica.replica_id, replica.nodes,
                                                             why)]
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


def _full_restart(state: RunState, actions: list[RecoveryAction], why: str
                  ) -> tuple[RunState, list[RecoveryAction]]:
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
            replicas.append(replace(r, nodes=nodes, state=ReplicaState.RECOVERING, failures=0,
                                    progressed=False))
        else:
            replicas.append(replace(r, state=ReplicaState.FAILED, nodes=()))
    standby = tuple(usable[count * size:])
    new_state = replace(state, replicas=tuple(replicas), standby=standby,
                        restarts=state.restarts + 1)
    why = f"{why}: every replica restarts from the newest checkpoint"
    cancels = [CancelReplica(r.replica_id, why) for r in state.replicas
               if CancelReplica(r.replica_id) not in actions]
    return new_state, actions + cancels + [FullRestart(tuple(placements), why)]
