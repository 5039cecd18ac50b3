"""The pure ring schedule: partitions, chunks, and a simulated ring of member programs."""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest

from ft_launch.ftar.schedule import (
    Phase,
    RingPlan,
    Span,
    member_program,
    phase_of,
    plan_ring,
    recv_segment,
    send_segment,
    split_even,
)

CASES = [(total, members, chunk, flight)
         for total in (0, 1, 5, 97, 1000, 4099)
         for members in (1, 2, 3, 4, 7)
         for chunk, flight in ((16, 1), (16, 2), (40, 3), (1 << 20, 2))]


def test_split_even_covers_the_span_with_sizes_one_apart() -> None:
    parts = split_even(Span(10, 27), 5)
    assert parts[0].start == 10 and parts[-1].stop == 27
    assert all(a.stop == b.start for a, b in itertools.pairwise(parts))
    assert sorted({p.size for p in parts}) == [3, 4]


@pytest.mark.parametrize("total, members, chunk, flight", CASES)
def test_plan_partitions_are_bounded_and_cover_everything(total: int, members: int,
                                                          chunk: int, flight: int) -> None:
    itemsize = 4
    plan = plan_ring(total, itemsize, members, chunk * itemsize, flight)
    assert plan.partitions[0].span.start == 0 and plan.partitions[-1].span.stop == total
    for part, after in zip(plan.partitions, plan.partitions[1:]):
        assert part.span.stop == after.span.start
    for part in plan.partitions:
        assert part.span.size <= chunk * flight * members           # S x C x N
        assert len(part.chunks) == members
        assert 1 <= part.chunks_per_segment <= flight
        for segment in part.chunks:
            assert all(c.size <= chunk for c in segment)
        flat = [c for segment in part.chunks for c in segment]
        assert flat[0].start == part.span.start and flat[-1].stop == part.span.stop
        assert all(a.stop == b.start for a, b in itertools.pairwise(flat))


@pytest.mark.parametrize("members", [2, 3, 4, 7])
def test_each_member_sends_what_its_right_neighbour_receives(members: int) -> None:
    for step in range(2 * members - 2):
        for index in range(members):
            assert send_segment(index, members, step) == recv_segment(
                (index + 1) % members, members, step)
    # after the reduce-scatter member i owns segment i+1, which it sends first
    for index in range(members):
        assert recv_segment(index, members, members - 2) == (index + 1) % members
        assert send_segment(index, members, members - 1) == (index + 1) % members
    assert phase_of(members - 2, members) == (Phase.REDUCE_SCATTER, members - 2)
    assert phase_of(members - 1, members) == (Phase.ALL_GATHER, 0)


def simulate(plan: RingPlan, arrays: list[np.ndarray], average: bool,
             contributes: list[bool]) -> list[int]:
    """Run every member's program over in-memory links; check zero-copy send safety.

    Sends read the array when the sender thread gets to them, so a span may not be
    overwritten while a frame of it is still unconsumed downstream: checked here.
    """
    n = plan.members
    programs = [member_program(plan, i) for i in range(n)]
    links: list[deque] = [deque() for _ in range(n)]   # link i: member i -> i+1
    own = [int(c) for c in contributes]
    for i, program in enumerate(programs):
        for transfer in program.first_sends:
            links[i].append((transfer, arrays[i][transfer.span.start:transfer.span.stop].copy(),
                             own[i]))
    position = [0] * n
    counts = list(own)
    while any(position[i] < len(programs[i].receives) for i in range(n)):
        progressed = False
        for i in range(n):
            left = links[(i - 1) % n]
            if position[i] == len(programs[i].receives) or not left:
                continue
            receive = programs[i].receives[position[i]]
            transfer, payload, count = left.popleft()
            assert transfer == receive.transfer          # same frame order at both ends
            span = transfer.span
            for queued, _, _ in links[i]:               # zero-copy hazard check
                assert queued.span.stop <= span.start or span.stop <= queued.span.start
            target = arrays[i][span.start:span.stop]
            if receive.reduce:
                target += payload
                count += own[i]
                if receive.owns and average and count:
                    target /= count
            else:
                target[:] = payload
            counts[i] = count
            for out in ([receive.forward] if receive.forward else []) + list(receive.start_next):
                sent_count = count if out is receive.forward else own[i]
                links[i].append((out, arrays[i][out.span.start:out.span.stop].copy(),
                                 sent_count))
            position[i] += 1
            progressed = True
        assert progressed, "the ring deadlocked"
    assert not any(links)
    return counts


@pytest.mark.parametrize("total, members, chunk, flight", CASES)
@pytest.mark.parametrize("average", [False, True])
def test_simulated_ring_reduces_every_element(total: int, members: int, chunk: int,
                                              flight: int, average: bool) -> None:
    rng = np.random.default_rng(total * 31 + members)
    inputs = [rng.integers(-8, 8, total).astype(np.float64) for _ in range(members)]
    contributes = [i != 1 for i in range(members)] if members > 2 else [True] * members
    for i, ok in enumerate(contributes):
        if not ok:
            inputs[i][:] = 0
    arrays = [a.copy() for a in inputs]
    plan = plan_ring(total, 8, members, chunk * 8, flight)
    counts = simulate(plan, arrays, average, contributes)
    expected = np.sum(inputs, axis=0)
    if average and members > 1:
        expected /= sum(contributes)
    for array in arrays if members > 1 else []:
        assert np.allclose(array, expected)
    assert members == 1 or counts == [sum(contributes)] * members


def test_frames_per_link_counts_every_chunk_of_every_step() -> None:
    plan = plan_ring(1000, 4, 3, 64, 2)     # 16 elements per chunk, 96 per partition
    assert plan.frames_per_link == sum(4 * p.chunks_per_segment for p in plan.partitions)
    assert len(member_program(plan, 0).receives) == plan.frames_per_link


@pytest.mark.parametrize("members", [2, 3])
def test_small_segments_are_still_pipelined_in_chunks_of_a_minimum_size(members: int) -> None:
    plan = plan_ring(3000, 4, members, 1 << 20, 4, min_chunk_bytes=1000)
    (partition,) = plan.partitions
    assert partition.chunks_per_segment == min(4, (3000 // members) * 4 // 1000)
    assert all(c.size * 4 >= 1000 for segment in partition.chunks for c in segment)
    arrays = [np.full(3000, i + 1.0) for i in range(members)]
    simulate(plan, arrays, average=False, contributes=[True] * members)
    assert all(np.all(a == members * (members + 1) / 2) for a in arrays)
    assert plan_ring(3000, 4, members, 1 << 20, 4).partitions[0].chunks_per_segment == 1
