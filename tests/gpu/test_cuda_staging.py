"""FTAR through pinned staging on a CUDA device, in real member processes sharing
one GPU: the staged result has the CPU path's bits exactly, and the staged path
orders its device work against the caller's stream (and only that stream)."""

from __future__ import annotations

import multiprocessing
from typing import Any

import numpy as np
import pytest

from ft_launch.ids import new_job_secret
from tests.gpu.staged_member import DTYPES, SIZES, expected_sum, member_main
from tests.waiting import patience

pytestmark = pytest.mark.gpu


def run_members(members: int, device_name: str) -> list[dict[str, Any]]:
    """Start ``members`` member processes (spawn) on ``device_name``; their results."""
    ctx = multiprocessing.get_context("spawn")
    secret = new_job_secret()
    pipes, processes = [], []
    for index in range(members):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=member_main, daemon=True,
                              args=(child, index, secret, device_name))
        process.start()
        pipes.append(parent)
        processes.append(process)
    try:
        addresses = [_recv(p, processes) for p in pipes]
        for pipe in pipes:
            pipe.send(addresses)
        return [_recv(p, processes) for p in pipes]
    finally:
        for process in processes:
            process.join(timeout=patience(10))
            if process.is_alive():
                process.kill()


def _recv(pipe: Any, processes: list[Any]) -> Any:
    if not pipe.poll(patience(60)):
        codes = [p.exitcode for p in processes]
        raise AssertionError(f"a member did not answer within its deadline (exit codes {codes})")
    return pipe.recv()


def assert_same_bits(results: list[dict[str, Any]], members: int) -> None:
    cases = ["sum", "avg", "avg-left-out"]
    compared = 0
    for dtype in DTYPES:
        for size in SIZES:
            for name in cases:
                key = f"{dtype}-{size}-{name}"
                reference = results[0][f"cpu-{key}"]
                for index, member in enumerate(results):
                    cpu, staged = member[f"cpu-{key}"], member[f"staged-{key}"]
                    differ = np.flatnonzero(cpu != staged)
                    assert differ.size == 0, (
                        f"member {index} of {members}, {key}: staged differs from the CPU "
                        f"path at {differ.size} of {cpu.size} elements, first at "
                        f"{differ[0]}: bits {staged[differ[0]]:#x} vs {cpu[differ[0]]:#x}")
                    assert np.array_equal(cpu, reference), f"members disagree on {key}"
                    compared += 1
    assert compared == len(DTYPES) * len(SIZES) * len(cases) * members


# 2 members: every average divides by 2 (or 1); 3: by 3, where a multiplication by
# the reciprocal would differ from the CPU path's division in float32.
@pytest.mark.timeout(120)
@pytest.mark.parametrize("members", [2, 3])
def test_staged_cuda_allreduce_has_the_cpu_paths_bits(cuda_torch: Any, members: int) -> None:
    results = run_members(members, "cuda:0")
    assert_same_bits(results, members)
    total = expected_sum(members)
    for index, member in enumerate(results):
        # the input was written on the caller's stream while it was still busy, and
        # the result read back through that stream, with no synchronize in between
        assert not member["order-staging-is-caller"]
        assert np.array_equal(member["order-result"],
                              np.full(member["order-result"].shape, 2 * total, np.float32)), \
            f"member {index}: the staged path did not follow the caller's stream"
        assert np.array_equal(member["busy-result"],
                              np.full(member["busy-result"].shape, total, np.float32))
        if member["busy-is-staging"]:   # torch's stream pool handed out the same stream
            continue
        assert member["busy-still-running"], (
            f"member {index}: the reduction waited for an unrelated stream of the device "
            "(a device-wide synchronize)")
