"""Where each rank backs up its snapshot, and where a behind rank fetches from.

Pure functions over a (dp, tp, pp, node) topology.

Backup rule (ByteRobust, fig. 9): the backup of rank r shares none of r's DP,
TP or PP groups, and lives on a node that no single over-eviction of a group r
belongs to would also take (over-eviction removes every node of the parallel
group the suspects share). A group that spans every node is not counted as an
eviction domain: evicting it loses the whole job, so no placement could survive
it and honouring it would forbid every placement. With only one parallel group
(pure DP / ZeRO, or a single dimension larger than one) no rank can avoid
sharing it; the backup is then the rank in the same slot on the neighbouring
node.

Rank numbering is replica-major, ``rank = (dp_index * pp + pp_index) * tp +
tp_index``, because a replica (one DP index) is one Slurm job step.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .errors import PlacementError

#: How many uniform shifts to try before the per-rank search.
MAX_SHIFTS = 64


class GroupKind(enum.Enum):
    DP = "dp"
    TP = "tp"
    PP = "pp"


class PlacementRule(enum.Enum):
    CROSS_GROUP = "cross_group"       # outside every parallel group and eviction domain
    NEIGHBOUR_NODE = "neighbour_node"  # a single parallel group: next node, same slot


Coords = tuple[int, int, int]  # (dp, tp, pp)


@dataclass(frozen=True)
class Topology:
    """Sizes of the three parallel dimensions and the node of every rank."""

    dp: int
    tp: int
    pp: int
    nodes: tuple[str, ...]
    _node_sets: dict[tuple[GroupKind, Coords], frozenset[str]] = field(
        default_factory=dict, init=False, repr=False, compare=False)
    #: ``frozenset(nodes)``, once: every rank's eviction domains compare with it.
    every_node: frozenset[str] = field(default=frozenset(), init=False, repr=False,
                                       compare=False)

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp) < 1:
            raise ValueError(f"dp, tp, pp must be >= 1, got {self.dp}, {self.tp}, {self.pp}")
        if len(self.nodes) != self.world_size:
            raise ValueError(f"{len(self.nodes)} node names for {self.world_size} ranks "
                             f"(dp={self.dp} tp={self.tp} pp={self.pp})")
        object.__setattr__(self, "every_node", frozenset(self.nodes))

    @staticmethod
    def uniform(dp: int, tp: int, pp: int, ranks_per_node: int) -> Topology:
        """Ranks filled onto nodes ``n0, n1, ...`` in rank order."""
        world = dp * tp * pp
        return Topology(dp, tp, pp, tuple(f"n{r // ranks_per_node}" for r in range(world)))

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def sizes(self) -> Coords:
        return (self.dp, self.tp, self.pp)

    def coords(self, rank: int) -> Coords:
        tp_index = rank % self.tp
        pp_index = (rank // self.tp) % self.pp
        return (rank // (self.tp * self.pp), tp_index, pp_index)

    def rank_of(self, coords: Coords) -> int:
        dp_index, tp_index, pp_index = coords
        return (dp_index * self.pp + pp_index) * self.tp + tp_index

    def group(self, kind: GroupKind, rank: int) -> frozenset[int]:
        """The ranks of ``rank``'s group of ``kind`` (those differing only along it)."""
        axis = _AXIS[kind]
        base = list(self.coords(rank))
        members = []
        for index in range(self.sizes[axis]):
            base[axis] = index
            members.append(self.rank_of((base[0], base[1], base[2])))
        return frozenset(members)

    def group_nodes(self, kind: GroupKind, rank: int) -> frozenset[str]:
        key = (kind, _group_key(kind, self.coords(rank)))
        if key not in self._node_sets:
            nodes = frozenset(self.nodes[r] for r in self.group(kind, rank))
            # one set object for every group spanning all nodes: compared by identity
            self._node_sets[key] = self.every_node if nodes == self.every_node else nodes
        return self._node_sets[key]


_AXIS = {GroupKind.DP: 0, GroupKind.TP: 1, GroupKind.PP: 2}


def _group_key(kind: GroupKind, coords: Coords) -> Coords:
    """``coords`` with the group's own axis blanked: equal for every member."""
    key = [-1 if axis == _AXIS[kind] else value for axis, value in enumerate(coords)]
    return (key[0], key[1], key[2])


@dataclass(frozen=True)
class BackupPlan:
    """``backup_of[r]`` is the rank that holds rank r's backup."""

    rule: PlacementRule
    backup_of: tuple[int, ...]

    def backups_held_by(self, rank: int) -> tuple[int, ...]:
        """The ranks whose backups ``rank`` receives."""
        return tuple(r for r, b in enumerate(self.backup_of) if b == rank)


def shares_a_group(topology: Topology, rank: int, other: int) -> bool:
    """True when the two ranks agree on two of the three coordinates."""
    a, b = topology.coords(rank), topology.coords(other)
    return sum(x == y for x, y in zip(a, b)) >= 2


def eviction_domains(topology: Topology, rank: int) -> list[frozenset[str]]:
    """Node sets one over-eviction involving ``rank`` could remove.

    Its own node always; each of its groups' nodes unless a group spans every
    node (see module docstring).
    """
    domains = [frozenset({topology.nodes[rank]})]
    for kind in GroupKind:
        nodes = topology.group_nodes(kind, rank)
        if nodes is not topology.every_node:
            domains.append(nodes)
    return domains


def is_valid_backup(topology: Topology, rank: int, backup: int) -> bool:
    """The cross-group rule for one pair."""
    if backup == rank or shares_a_group(topology, rank, backup):
        return False
    node = topology.nodes[backup]
    return not any(node in domain for domain in eviction_domains(topology, rank))


def place_backups(topology: Topology) -> BackupPlan:
    """Choose every rank's backup; raises ``PlacementError`` when none can exist."""
    if len(set(topology.nodes)) < 2:
        raise PlacementError(
            f"peer backup needs at least two nodes; all {topology.world_size} ranks are on "
            f"{topology.nodes[0]!r}", hint="set ckpt.peer_backup = false for one-node jobs")
    if sum(size > 1 for size in topology.sizes) <= 1:
        return BackupPlan(PlacementRule.NEIGHBOUR_NODE, _neighbour_node(topology))
    for shift in itertools.islice(_shifts(topology.sizes), MAX_SHIFTS):
        plan = _shifted(topology, shift)
        if all(is_valid_backup(topology, r, b) for r, b in enumerate(plan)):
            return BackupPlan(PlacementRule.CROSS_GROUP, plan)
    return BackupPlan(PlacementRule.CROSS_GROUP, _searched(topology))


def _shifts(sizes: Coords) -> Iterator[Coords]:
    """Uniform coordinate shifts moving at least two axes, smallest first.

    A uniform shift is a permutation of ranks, so every rank holds exactly one
    backup; moving two axes guarantees no group is shared.
    """
    candidates = [(a, b, c) for a, b, c in itertools.product(*(range(n) for n in sizes))
                  if (a != 0) + (b != 0) + (c != 0) >= 2]
    # Prefer moving DP (another replica) and PP, then fewer and smaller moves.
    candidates.sort(key=lambda s: (s[0] == 0, s[2] == 0, sum(v != 0 for v in s), sum(s)))
    yield from candidates


def _shifted(topology: Topology, shift: Coords) -> tuple[int, ...]:
    sizes = topology.sizes
    plan = []
    for rank in range(topology.world_size):
        c = topology.coords(rank)
        moved = tuple((c[i] + shift[i]) % sizes[i] for i in range(3))
        plan.append(topology.rank_of((moved[0], moved[1], moved[2])))
    return tuple(plan)


def _searched(topology: Topology) -> tuple[int, ...]:
    """Per rank, the valid backup holding the fewest backups so far (ties: nearest)."""
    world = topology.world_size
    load = [0] * world
    plan = []
    for rank in range(world):
        valid = [b for b in range(world) if is_valid_backup(topology, rank, b)]
        if not valid:
            raise PlacementError(
                f"no rank outside the DP/TP/PP groups and eviction domains of rank {rank} "
                f"(coords dp,tp,pp={topology.coords(rank)}, node {topology.nodes[rank]!r}); "
                f"dp={topology.dp} tp={topology.tp} pp={topology.pp} on "
                f"{len(set(topology.nodes))} nodes",
                hint="spread the groups over more nodes or set ckpt.peer_backup = false")
        best = min(valid, key=lambda b: (load[b], (b - rank) % world))
        load[best] += 1
        plan.append(best)
    return tuple(plan)


def _neighbour_node(topology: Topology) -> tuple[int, ...]:
    """Same slot on the next node (nodes ordered by their first rank)."""
    order = list(dict.fromkeys(topology.nodes))
    ranks_on: dict[str, list[int]] = {node: [] for node in order}
    for rank, node in enumerate(topology.nodes):
        ranks_on[node].append(rank)
    plan = []
    for rank, node in enumerate(topology.nodes):
        slot = ranks_on[node].index(rank)
        neighbour = ranks_on[order[(order.index(node) + 1) % len(order)]]
        plan.append(neighbour[slot % len(neighbour)])
    return tuple(plan)


Address = tuple[str, int]


@dataclass(frozen=True)
class BackupRoute:
    """One rank's part of the backup placement under one quorum: where its backup
    goes, and whose backups it takes. Ranks are global: ``global_rank``."""

    send_to: Address | None             # the holder's state server (None: no placement)
    holder: int | None
    accept_from: frozenset[int]
    rule: PlacementRule | None
    why_none: str = ""


def global_rank(replica_id: int, rank: int, ranks_per_replica: int) -> int:
    """A rank's number across replicas; stable across incarnations (replica ids are)."""
    return replica_id * ranks_per_replica + rank


@functools.lru_cache(maxsize=64)
def route_backups(members: tuple[tuple[int, tuple[Address, ...]], ...], replica_id: int,
                  rank: int) -> BackupRoute:
    """The placement over a quorum's members, for rank ``rank`` of ``replica_id``.

    ``members``: (replica_id, the state server address of each of its ranks), by
    replica id, as the quorum's member payloads advertise them. A replica is one
    DP index and its ranks (its shards) the second axis; an address's host is its
    node. Every rank of every member computes the same plan from the same quorum.
    Cached: the same members come back step after step, and the plan of a large
    job is too slow to make at every step (measurements:
    benchmarks/results/measurements.md#backup-placement-cache).
    """
    shards = len(members[0][1]) if members else 0
    if not shards or any(len(addresses) != shards for _, addresses in members):
        return BackupRoute(None, None, frozenset(), None,
                           "the members advertise different numbers of ranks")
    replicas = [replica for replica, _ in members]
    index = {r: i for i, r in enumerate(replicas)}
    if replica_id not in index:
        return BackupRoute(None, None, frozenset(), None, f"replica {replica_id} is not a member")
    topology = Topology(len(members), shards, 1,
                        tuple(host for _, addresses in members for host, _ in addresses))
    try:
        plan = place_backups(topology)
    except PlacementError as exc:
        return BackupRoute(None, None, frozenset(), None, str(exc))
    me = index[replica_id] * shards + rank
    holder = plan.backup_of[me]
    to_global = [global_rank(replica, shard, shards) for replica in replicas
                 for shard in range(shards)]
    return BackupRoute(members[holder // shards][1][holder % shards], to_global[holder],
                       frozenset(to_global[r] for r in plan.backups_held_by(me)), plan.rule)


def choose_fetch_source(rank: int, replica_id: int, behind: Sequence[int],
                        healthy: Sequence[int]) -> int:
    """The healthy replica whose rank ``rank`` serves ``replica_id``'s rank ``rank``.

    Behind replicas and ranks are spread round-robin over the healthy replicas, so
    with B behind and H healthy replicas each healthy rank serves at most
    ceil(B / H) fetches and one behind replica pulls from all healthy ones.
    """
    if not healthy:
        raise ValueError("no healthy replica to fetch state from")
    if replica_id not in behind:
        raise ValueError(f"replica {replica_id} is not among the behind replicas {list(behind)}")
    ordered = sorted(healthy)
    position = sorted(behind).index(replica_id)
    return ordered[(position + rank) % len(ordered)]
