"""Dual-phase replay in the controller's decision (pure): when one runs, and what
its verdict evicts. ``lifecycle.decide`` dispatches to it; ``sdc_replay`` runs it.

Why: a replica sharded over several nodes (FSDP2, or DDP) mixes every rank's
gradients inside the replica before FTAR sees them, so a NaN/Inf computed on one
node shows in every rank's shard. The replica then names all its nodes (or the
rank that owns the shard, anywhere) as having computed it
(``StepDiscarded.nonfinite_nodes``): evicting what it names drains healthy nodes.
A replica of one node names it precisely, and keeps the per-node rule
(``lifecycle._nonfinite``).

* ``on_nonfinite``: each step such a replica discarded with NaN/Inf of its own
  counts against it; at ``recovery.nonfinite_limit`` the replica is cancelled (the
  others train on) and replayed (``RunReplay``) on its N nodes and N x (N - 1)
  healthy reference nodes: standbys first, then nodes of training replicas (shared
  with ``srun --overlap``). With no training replica to capture the state from, or
  too few reference nodes, every node of it is evicted at once (over-eviction).
* ``on_located``: the verdict. One node found: it alone is evicted, with the
  replay's rows and columns in its drain reason; the recovery table relaunches the
  replica with a standby in its place. Not reproduced, ambiguous or failed: every
  node of the replica the verdict does not clear is evicted (the fallback; the
  per-node rule would have evicted them all too).
* ``on_tick``: a replay the shell has not answered within twice
  ``recovery.replay_timeout`` counts as failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from .events import SdcReplayOrdered
from .run_state import RunState

#: ``ReplayLocated.status`` of a replay that gave no verdict (besides ``ReplayStatus``'s).
FAILED = "failed"
FOUND = "found"


@dataclass(frozen=True)
class RunReplay:
    """Replay a step of replica ``replica_id`` on its nodes (``suspects``) and healthy
    ``references``, from the state of the first of ``sources`` (training replicas)
    that serves it; the answer comes back as ``ReplayLocated``."""

    replica_id: int
    suspects: tuple[str, ...]
    references: tuple[str, ...]
    sources: tuple[int, ...]
    command: tuple[str, ...]
    reason: str = field(default="", compare=False)


@dataclass(frozen=True)
class ReplayLocated:
    """What a replay found (``sdc_replay``): ``status`` is a
    ``ft_launch.health.replay.ReplayStatus`` value, or ``FAILED`` (then ``summary`` says
    why)."""

    replica_id: int
    status: str
    suspects: tuple[str, ...] = ()
    failed_rows: tuple[int, ...] = ()
    failed_columns: tuple[int, ...] = ()
    summary: str = ""


@dataclass(frozen=True)
class Replaying:
    replica_id: int
    since: float                # when it was ordered (``Now.elapsed``)
    nodes: tuple[str, ...]      # the replica's, then
    steps: int                  # the NaN/Inf steps that led to it


@dataclass(frozen=True)
class ReplayBook:
    """The rule's part of the controller state."""

    nonfinite: tuple[tuple[int, int], ...] = ()     # replica -> NaN/Inf steps counted
    running: tuple[Replaying, ...] = ()

    def replaying(self, replica_id: int) -> Replaying | None:
        return next((r for r in self.running if r.replica_id == replica_id), None)

    def without(self, replica_id: int) -> ReplayBook:
        return replace(self, running=tuple(r for r in self.running
                                           if r.replica_id != replica_id))


@dataclass(frozen=True)
class ReplayDecision:
    """``replay``: cancel the replica and run it; ``evict``: these nodes of it are bad
    (one failure of the replica); ``record``: for the controller's log."""

    book: ReplayBook
    replica_id: int
    reason: str
    replay: RunReplay | None = None
    evict: tuple[str, ...] = ()
    record: SdcReplayOrdered | None = None


def applies(enabled: bool, run: RunState, replica_id: int) -> bool:
    """Replay tells the nodes of a multi-node replica apart; one node is named exactly."""
    return enabled and len(run.replica(replica_id).nodes) > 1


def on_nonfinite(book: ReplayBook, run: RunState, replica_id: int, watched: bool,
                 training: Sequence[int], limit: int, now: float, on_standby: bool = True
                 ) -> ReplayDecision:
    """One more step replica ``replica_id`` discarded with NaN/Inf of its own;
    ``watched``: its current process wrote it. ``training``: the replicas that train
    (a replay's sources); ``on_standby``: standbys may host replay steps."""
    rid = replica_id
    if book.replaying(rid) is not None or not watched:
        return ReplayDecision(book, rid, f"replica {rid}'s cancelled process wrote it: not "
                                         "news")
    counts = dict(book.nonfinite)
    steps = counts[rid] = counts.get(rid, 0) + 1
    if not limit or steps < limit:
        return ReplayDecision(replace(book, nonfinite=tuple(sorted(counts.items()))), rid,
                              f"replica {rid}: NaN/Inf gradients in {steps} step(s) (a "
                              f"replay at {limit})")
    del counts[rid]
    book = replace(book, nonfinite=tuple(sorted(counts.items())))
    replica = run.replica(rid)
    size = len(replica.nodes)
    needed = size * (size - 1)
    sources = tuple(r for r in training if r != rid)
    pool = [*(run.standby if on_standby else ()),
            *(n for r in sources for n in run.replica(r).nodes)]
    references = tuple(dict.fromkeys(n for n in pool if n not in run.evicted
                                     and n not in replica.nodes))[:needed]
    # no quotes: a drain reason keeps to what scontrol takes (ft_launch.health.drain)
    why = (f"sdc: replica {rid} computed NaN/Inf gradients in {steps} steps, its {size} "
           "nodes mixed: each is named")
    if not sources or len(references) < needed:
        missing = ("no training replica to replay from" if not sources else
                   f"{len(references)} healthy nodes of the {needed} it needs")
        return ReplayDecision(book, rid, f"{why}; no dual-phase replay ({missing}): all "
                                         "its nodes", evict=replica.nodes)
    command = run.version(replica.version or run.current).command
    reason = f"{why}: dual-phase replay on them and {', '.join(references)}"
    order = RunReplay(rid, replica.nodes, references, sources, command, reason)
    record = SdcReplayOrdered(replica_id=rid, suspects=list(replica.nodes),
                              references=list(references), steps=steps, reason=reason)
    book = replace(book, running=(*book.running, Replaying(rid, now, replica.nodes, steps)))
    return ReplayDecision(book, rid, reason, replay=order, record=record)


def on_located(book: ReplayBook, event: ReplayLocated) -> ReplayDecision:
    rid = event.replica_id
    replaying = book.replaying(rid)
    book = book.without(rid)
    if replaying is None:
        return ReplayDecision(book, rid, f"replica {rid}'s replay answered after it was "
                                         "given up on: nothing to evict")
    nodes = replaying.nodes
    # the drain reason is cut at 100 characters (ft_launch.health.drain): the verdict comes first
    if event.status == FOUND and len(event.suspects) == 1:
        (node,) = event.suspects
        rows = ", ".join(map(str, event.failed_rows))
        columns = ", ".join(map(str, event.failed_columns))
        return ReplayDecision(book, rid, f"sdc: {node} computes NaN/Inf gradients "
                                         f"(dual-phase replay: row {rows} and column "
                                         f"{columns} failed)", evict=(node,))
    named = tuple(n for n in event.suspects if n in nodes)
    evict = named if event.status != FAILED and named else nodes
    reason = (f"sdc: replica {rid} computes NaN/Inf gradients, dual-phase replay "
              f"{event.status}: {'the nodes it names' if evict != nodes else 'all its nodes'}"
              + (f" ({event.summary})" if event.summary else ""))
    return ReplayDecision(book, rid, reason, evict=evict)


def on_tick(book: ReplayBook, now: float, timeout: float) -> ReplayDecision | None:
    """The first replay overdue (twice the shell's own bound), as failed; None if none."""
    overdue = next((r for r in book.running if now - r.since > 2 * timeout), None)
    if overdue is None:
        return None
    return on_located(book, ReplayLocated(overdue.replica_id, FAILED,
                                          summary=f"no answer within {2 * timeout:g} s"))
