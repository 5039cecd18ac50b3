"""The pure core of FTAR: partitioning, chunking and the ring step schedule.

A reduction of ``total`` elements among ``members`` ring members is cut into
*partitions* of at most ``chunk_bytes x chunks_in_flight x members`` bytes. Each
partition is one ring round: it is split into one *segment* per member (sizes
differ by at most one element), and each segment into at most
``chunks_in_flight`` *chunks* of at most ``chunk_bytes``. A round has ``2N-2``
ring steps: ``N-1`` reduce-scatter steps, after which member ``i`` owns the fully
reduced segment ``i+1``, then ``N-1`` all-gather steps that pass the owned
segments around.

Member ``i`` sends only to member ``i+1`` and receives only from member ``i-1``.
Frames travel on that link in one fixed order, ``(partition, ring step, chunk)``
lexicographic, and both ends derive the same order from the same plan, so no
frame needs to say where its bytes go (headers still carry the sequence number,
to catch disagreement). ``member_program`` turns the plan into what one member
does: which frames it may send at once, and for every frame it receives, what to
do with it and which frames that unblocks.

Nothing here touches sockets or arrays; tests drive it with a pure simulator.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass


class Phase(enum.Enum):
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"


@dataclass(frozen=True)
class Span:
    """A half-open range of element offsets in the flat array."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Partition:
    """One ring round: ``chunks[segment][chunk]`` are the spans of each chunk."""

    index: int
    span: Span
    chunks: tuple[tuple[Span, ...], ...]

    @property
    def chunks_per_segment(self) -> int:
        return len(self.chunks[0])


@dataclass(frozen=True)
class RingPlan:
    """How ``total`` elements of ``itemsize`` bytes travel round a ring of ``members``."""

    members: int
    total: int
    itemsize: int
    partitions: tuple[Partition, ...]

    @property
    def ring_steps(self) -> int:
        return 2 * self.members - 2

    @property
    def frames_per_link(self) -> int:
        return sum(self.ring_steps * p.chunks_per_segment for p in self.partitions)


@dataclass(frozen=True)
class Transfer:
    """One frame on a link: chunk ``chunk`` of ring step ``ring_step`` of a partition."""

    seq: int
    partition: int
    ring_step: int
    chunk: int
    span: Span

    def describe(self, members: int) -> str:
        phase, number = phase_of(self.ring_step, members)
        return (f"{phase.value} step {number + 1}/{members - 1} (ring step "
                f"{self.ring_step + 1}/{2 * members - 2}, partition {self.partition}, "
                f"chunk {self.chunk})")


@dataclass(frozen=True)
class Receive:
    """A frame to receive, and what it unblocks once it is handled.

    ``reduce``: add the payload into the span (reduce-scatter); otherwise the payload
    lands in the span as it is (all-gather). ``owns``: this was the last
    reduce-scatter step, the span is now fully reduced by this member (divide it
    here for an average). ``ends_step``: the last chunk of its ring step.
    ``forward``: the frame to send next with this span.
    ``start_next``: the first frames of the next partition, sendable right away.
    """

    transfer: Transfer
    reduce: bool
    owns: bool
    ends_step: bool
    forward: Transfer | None
    start_next: tuple[Transfer, ...]


@dataclass(frozen=True)
class MemberProgram:
    """Everything member ``index`` does in one all-reduce, in order."""

    index: int
    members: int
    first_sends: tuple[Transfer, ...]
    receives: tuple[Receive, ...]


def phase_of(ring_step: int, members: int) -> tuple[Phase, int]:
    """The phase of a ring step and the step's number inside that phase."""
    if ring_step < members - 1:
        return Phase.REDUCE_SCATTER, ring_step
    return Phase.ALL_GATHER, ring_step - (members - 1)


def send_segment(index: int, members: int, ring_step: int) -> int:
    """The segment member ``index`` sends to its right neighbour at ``ring_step``."""
    phase, number = phase_of(ring_step, members)
    if phase is Phase.REDUCE_SCATTER:
        return (index - number) % members
    return (index + 1 - number) % members


def recv_segment(index: int, members: int, ring_step: int) -> int:
    """The segment member ``index`` receives from its left neighbour at ``ring_step``."""
    phase, number = phase_of(ring_step, members)
    if phase is Phase.REDUCE_SCATTER:
        return (index - number - 1) % members
    return (index - number) % members


def split_even(span: Span, parts: int) -> tuple[Span, ...]:
    """``parts`` consecutive spans covering ``span``; sizes differ by at most one."""
    base, extra = divmod(span.size, parts)
    spans: list[Span] = []
    start = span.start
    for part in range(parts):
        stop = start + base + (1 if part < extra else 0)
        spans.append(Span(start, stop))
        start = stop
    return tuple(spans)


@functools.lru_cache(maxsize=64)
def plan_ring(total: int, itemsize: int, members: int, chunk_bytes: int,
              chunks_in_flight: int, min_chunk_bytes: int = 0) -> RingPlan:
    """Partition and chunk ``total`` elements for a ring of ``members``.

    A segment of a full partition holds ``chunks_in_flight`` chunks of
    ``chunk_bytes // itemsize`` elements. A smaller segment is still cut into up to
    ``chunks_in_flight`` chunks of at least ``min_chunk_bytes`` (when 0 < that), so
    that forwarding a chunk overlaps receiving the next one. An empty array still
    gets one partition of empty frames, so members still check they agree on size.
    """
    if members < 1 or itemsize < 1 or total < 0:
        raise ValueError(f"bad ring plan input: total={total} itemsize={itemsize} "
                         f"members={members}")
    chunk_elems = max(1, chunk_bytes // itemsize)
    partition_elems = chunk_elems * chunks_in_flight * members
    partitions: list[Partition] = []
    start = 0
    while start < total or not partitions:
        stop = min(total, start + partition_elems)
        span = Span(start, stop)
        segments = split_even(span, members)
        largest = max(s.size for s in segments)
        per_segment = max(1, -(-largest // chunk_elems))
        if min_chunk_bytes > 0:
            pipelined = min(chunks_in_flight, largest * itemsize // min_chunk_bytes)
            per_segment = max(per_segment, pipelined)
        chunks = tuple(split_even(s, per_segment) for s in segments)
        partitions.append(Partition(len(partitions), span, chunks))
        start = stop
    return RingPlan(members, total, itemsize, tuple(partitions))


def _transfer(plan: RingPlan, partition: Partition, seq_base: int, ring_step: int,
              chunk: int, segment: int) -> Transfer:
    k = partition.chunks_per_segment
    return Transfer(seq=seq_base + ring_step * k + chunk, partition=partition.index,
                    ring_step=ring_step, chunk=chunk, span=partition.chunks[segment][chunk])


@functools.lru_cache(maxsize=64)
def member_program(plan: RingPlan, index: int) -> MemberProgram:
    """The ordered sends and receives of member ``index`` under ``plan``."""
    n = plan.members
    if not 0 <= index < n:
        raise ValueError(f"member index {index} outside a ring of {n}")
    if n == 1:
        return MemberProgram(index, n, (), ())
    steps = plan.ring_steps
    bases: list[int] = []
    seq = 0
    for partition in plan.partitions:
        bases.append(seq)
        seq += steps * partition.chunks_per_segment

    def first_sends(p: int) -> tuple[Transfer, ...]:
        part = plan.partitions[p]
        return tuple(_transfer(plan, part, bases[p], 0, c, send_segment(index, n, 0))
                     for c in range(part.chunks_per_segment))

    receives: list[Receive] = []
    for p, part in enumerate(plan.partitions):
        k = part.chunks_per_segment
        for t in range(steps):
            for c in range(k):
                incoming = _transfer(plan, part, bases[p], t, c, recv_segment(index, n, t))
                forward = None
                if t + 1 < steps:
                    forward = _transfer(plan, part, bases[p], t + 1, c,
                                        send_segment(index, n, t + 1))
                last_forward = t + 2 == steps and c == k - 1
                start_next = first_sends(p + 1) if last_forward and p + 1 < len(
                    plan.partitions) else ()
                receives.append(Receive(incoming, reduce=t < n - 1, owns=t == n - 2,
                                        ends_step=c == k - 1, forward=forward,
                                        start_next=start_next))
    return MemberProgram(index, n, first_sends(0), tuple(receives))
