"""Stack-trace aggregation and over-eviction (pure), after ByteRobust.

1. Normalise each training process's main-thread stack: our frames only
   (library frames such as ``zmq`` polls or ``threading`` waits are dropped, so
   a wait that is sampled in ``poll`` or in ``recv`` reads the same; ft-launch's
   own packages count as ours wherever they are installed), no line numbers.
2. Group identical stacks; the largest group is taken as healthy; every other
   process is an outlier, and so is any stopped or unreadable process. When two
   groups tie for largest there is no healthy majority to compare against (a
   sample taken mid-step, or a replica of two ranks): a process blocked in a
   collective (``PEER_WAIT_MARKERS``, library frames included) waits for the
   others, so where some do and some do not, the ones that do not are the
   outliers (a rank of a hung pair deadlocked in its own code, while its peer
   waits for it in the commit vote). Otherwise only stopped or unreadable
   processes count, and the aggregation says it is ambiguous (the caller samples
   again, or, for a hang, suspects every rank: ``hang_suspects``).
3. Map the outliers onto the parallel groups of the topology (node, TP, PP, DP,
   replica; a group the layout does not have is left out) and pick the group
   holding the most outliers, the smallest such group on a tie: its nodes are
   evicted together (over-eviction: healthy machines of that group go too, which
   is cheaper than finding the root cause).

Fail-slow: run the aggregation once per round; the group chosen in most
rounds is the one to evict (``FailSlowVote``).
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .stacks import Frame, ProcessStack, ThreadStack

GROUP_KINDS = ("node", "tp", "pp", "replica", "dp")   # preference on a tie, smallest first
LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3", "<frozen ")
#: ft-launch's packages: ours even when installed into site-packages.
OWN_PACKAGES = ("ft_launch", "ft_launch.launcher", "ft_launch.ftar", "ft_launch.ckpt",
                "ft_launch.health", "ft_launch.slurm_plugins")


def _folders_of(packages: Iterable[str]) -> tuple[str, ...]:
    """The folders the packages load from (``find_spec`` does not import them): one
    ``ft_launch`` folder when installed, each source folder in a checkout."""
    return tuple(f"{Path(folder).resolve()}/" for name in packages
                 for folder in importlib.util.find_spec(name).submodule_search_locations)


OWN_PREFIXES = _folders_of(OWN_PACKAGES)
#: A frame in one of these files is a wait for other processes (a collective, the
#: cross-replica ring, the quorum).
PEER_WAIT_MARKERS = ("/torch/distributed/", "/ftar/", "/launcher/quorum/", "/mpi4py/")


@dataclass(frozen=True)
class RankPlace:
    """Where one training process sits in the parallel layout."""

    rank: int
    node: str
    replica_id: int
    dp_group: int | None = None      # None: the layout has no such group
    tp_group: int | None = None
    pp_group: int | None = None


@dataclass(frozen=True, order=True)
class GroupKey:
    kind: str
    id: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.id}"


@dataclass(frozen=True)
class StackGroup:
    signature: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Aggregation:
    groups: tuple[StackGroup, ...]      # largest first; groups[0] is the healthy one
    outliers: tuple[int, ...]
    ambiguous: bool = False             # the largest groups tie: no healthy reference
    waiting: tuple[int, ...] = ()       # ranks blocked waiting for other processes

    @property
    def majority(self) -> bool:
        """Whether the healthy group holds more than half of the ranks."""
        total = sum(len(g.ranks) for g in self.groups)
        return bool(self.groups) and not self.ambiguous and 2 * len(self.groups[0].ranks) > total


@dataclass(frozen=True)
class EvictionDecision:
    group: GroupKey
    nodes: tuple[str, ...]
    ranks: tuple[int, ...]              # every rank of the evicted group
    outliers: tuple[int, ...]
    covers_all: bool                    # False: some outliers lie outside the group

    def describe(self) -> str:
        return (f"evict {self.group} (nodes {','.join(self.nodes)}): outlier ranks "
                f"{list(self.outliers)}{'' if self.covers_all else ' (partly)'}")


def is_library(file: str) -> bool:
    return any(marker in file for marker in LIBRARY_MARKERS) and not file.startswith(
        OWN_PREFIXES)


def waits_on_peers(stack: ProcessStack) -> bool:
    """Whether the main thread is blocked in a collective or another wait for peers."""
    thread = main_thread(stack)
    return not stack.error and thread is not None and any(
        marker in f.file for f in thread.frames for marker in PEER_WAIT_MARKERS)


def innermost_own_frame(stack: ProcessStack) -> Frame | None:
    """Where the main thread is in our (or the training script's) code."""
    thread = main_thread(stack)
    if thread is None:
        return None
    return next((f for f in thread.frames if not is_library(f.file)),
                thread.frames[0] if thread.frames else None)


def main_thread(stack: ProcessStack) -> ThreadStack | None:
    return next((t for t in stack.threads if t.main), stack.threads[0] if stack.threads else None)


def signature(stack: ProcessStack) -> str:
    """The normalised main-thread stack, outermost call first."""
    if stack.error:
        return f"<unreadable: {stack.error}>"
    thread = main_thread(stack)
    if thread is None:
        return "<no threads>"
    frames = [f for f in thread.frames if not is_library(f.file)] or list(thread.frames[:1])
    return " > ".join(f"{f.function}@{f.file.rsplit('/', 1)[-1]}" for f in reversed(frames))


def aggregate(stacks: Mapping[int, ProcessStack]) -> Aggregation:
    """Group ranks by stack; outliers are every rank outside the largest group,
    plus stopped or unreadable processes wherever they fall. On a tie for largest,
    the ranks that wait for peers are the healthy ones, if some do and some not."""
    by_signature: dict[str, list[int]] = {}
    for rank in sorted(stacks):
        by_signature.setdefault(signature(stacks[rank]), []).append(rank)
    groups = sorted((StackGroup(sig, tuple(ranks)) for sig, ranks in by_signature.items()),
                    key=lambda g: (-len(g.ranks), g.signature))
    waiting = {rank for rank, stack in stacks.items() if waits_on_peers(stack)}
    ambiguous = len(groups) > 1 and len(groups[0].ranks) == len(groups[1].ranks)
    if ambiguous and waiting and waiting != set(stacks):
        healthy, ambiguous = waiting, False
    else:
        healthy = set(groups[0].ranks) if groups and not ambiguous else set(stacks)
    outliers = {rank for rank in stacks if rank not in healthy
                or stacks[rank].stopped or stacks[rank].error}
    return Aggregation(tuple(groups), tuple(sorted(outliers)), ambiguous,
                       tuple(sorted(waiting)))


def parallel_groups(topology: Iterable[RankPlace]) -> dict[GroupKey, list[RankPlace]]:
    groups: dict[GroupKey, list[RankPlace]] = {}
    for place in topology:
        keys = [GroupKey("node", place.node), GroupKey("replica", str(place.replica_id))]
        keys += [GroupKey(kind, str(group)) for kind, group in (
            ("tp", place.tp_group), ("pp", place.pp_group), ("dp", place.dp_group))
            if group is not None]
        for key in keys:
            groups.setdefault(key, []).append(place)
    return groups


def choose_eviction(outliers: Iterable[int],
                    topology: Sequence[RankPlace]) -> EvictionDecision | None:
    """The parallel group with the most outliers (the smallest one on a tie)."""
    wanted = set(outliers)
    if not wanted:
        return None
    best: tuple[tuple[int, int, int], GroupKey, list[RankPlace]] | None = None
    for key, members in parallel_groups(topology).items():
        count = sum(1 for p in members if p.rank in wanted)
        if not count:
            continue
        nodes = len({p.node for p in members})
        score = (count, -nodes, -GROUP_KINDS.index(key.kind))
        if best is None or score > best[0]:
            best = (score, key, members)
    if best is None:
        return None
    _, key, members = best
    ranks = tuple(sorted(p.rank for p in members))
    return EvictionDecision(key, tuple(sorted({p.node for p in members})), ranks,
                            tuple(sorted(wanted)), covers_all=wanted <= set(ranks))


def diagnose(stacks: Mapping[int, ProcessStack],
             topology: Sequence[RankPlace]) -> tuple[Aggregation, EvictionDecision | None]:
    found = aggregate(stacks)
    return found, choose_eviction(found.outliers, topology)


def hang_suspects(stacks: Mapping[int, ProcessStack], topology: Sequence[RankPlace]
                  ) -> tuple[Aggregation, EvictionDecision | None]:
    """For a group of ranks known to be hung: the outliers' group, or, when the stacks
    single none out (all alike, or no way to tell), every rank: the smallest group
    holding them all is evicted (over-eviction rather than a guess)."""
    found = aggregate(stacks)
    return found, choose_eviction(found.outliers or tuple(stacks), topology)


class FailSlowVote:
    """ByteRobust's fail-slow rule: each round marks the group with the most
    outliers; after the rounds, the group marked most (the latest on a tie) is the
    degraded one.

    Only rounds in which a majority of ranks share the healthy stack mark a group:
    a sample taken early in a step finds healthy ranks busy as well, and its
    "outliers" are mostly healthy (measured in benchmarks/detection_bench.py).
    """

    def __init__(self) -> None:
        self.rounds: list[tuple[Aggregation, EvictionDecision | None]] = []

    def add(self, found: Aggregation, decision: EvictionDecision | None) -> None:
        self.rounds.append((found, decision))

    def usable(self) -> list[EvictionDecision | None]:
        return [decision for found, decision in self.rounds if found.majority]

    def winner(self) -> EvictionDecision | None:
        marked = [d for d in self.usable() if d is not None]
        if not marked:
            return None
        counts = Counter(d.group for d in marked)
        top = max(counts.values())
        return next(d for d in reversed(marked) if counts[d.group] == top)
