"""FTAR members as real processes on loopback (port 0): results, bounds, mismatches."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ft_launch.ids import new_job_secret
from tests.ftar.members import DTYPES, Fault, Reduce, Ring, as_float64, reference, tolerance

# Small chunks so that modest arrays still span several partitions and chunks.
CONFIG = {"chunk_bytes": 4096, "chunks_in_flight": 2, "timeout": 10.0,
          "connect_timeout": 10.0}
SIZES = (0, 1, 7, 1001, 12_289)     # empty, fewer than N, not divisible, several partitions


@pytest.fixture(scope="module")
def ring() -> Iterator[Ring]:
    pool = Ring(CONFIG, new_job_secret())
    pool.spawn(4)
    yield pool
    pool.close()


def _check(ring: Ring, specs: list[Reduce]) -> list[np.ndarray]:
    members = ring.members[:len(specs)]
    replies = ring.call(members, "reduce", specs)
    assert all(r[0] == "ok" for r in replies), replies
    expected, count = reference(specs)
    bound = tolerance(specs)
    results = []
    for index, (_, (data, contributors), _) in enumerate(replies):
        got = as_float64(data, specs[0].dtype)
        assert got.shape == expected.shape
        assert np.all(np.abs(got - expected) <= bound), (
            f"member {index}: max error {np.max(np.abs(got - expected), initial=0)}")
        assert contributors == count
        results.append(data)
    for data in results[1:]:   # every member ends with the same bits
        assert np.array_equal(data.view(np.uint8), results[0].view(np.uint8))
    return results


@pytest.mark.timeout(90)
@pytest.mark.parametrize("members", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_results_match_float64_reference(ring: Ring, members: int, dtype: str) -> None:
    ring.form(ring.members[:members])
    for size in SIZES:
        for op in ("AVG", "SUM"):
            _check(ring, [Reduce(seed=size, size=size, dtype=dtype, op=op, data_index=i)
                          for i in range(members)])


@pytest.mark.timeout(60)
def test_average_counts_only_contributing_members(ring: Ring) -> None:
    ring.form(ring.members[:3])
    specs = [Reduce(seed=5, size=5000, data_index=i, contributes=i != 1) for i in range(3)]
    results = _check(ring, specs)          # the reference divides by 2 contributors
    by_two = reference([specs[0], specs[2]])[0]
    assert np.allclose(as_float64(results[1], "float32"), by_two, atol=1e-6)
    assert not np.allclose(by_two * 2 / 3, by_two, atol=1e-6)


@pytest.mark.timeout(60)
def test_bytes_in_flight_stay_within_chunks_in_flight(ring: Ring) -> None:
    ring.form(ring.members[:3])
    ring.call(ring.members[2:3], "arm", [_stall(ring_step=0)])   # a slow receiver
    _check(ring, [Reduce(seed=9, size=60_000, data_index=i) for i in range(3)])
    for status, stats, _ in ring.call(ring.members[:3], "stats", [None] * 3):
        assert status == "ok"
        assert stats.inflight_limit_bytes == CONFIG["chunk_bytes"] * CONFIG["chunks_in_flight"]
        # the window was used in full, and never exceeded
        assert stats.max_inflight_bytes == stats.inflight_limit_bytes


def _stall(ring_step: int) -> Fault:
    return Fault("stall", ring_step, stall_seconds=0.3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mismatch", ["size", "dtype"])
def test_members_that_disagree_get_a_fatal_error(ring: Ring, mismatch: str) -> None:
    ring.form(ring.members[:3])
    specs = [Reduce(seed=1, size=3000, data_index=i) for i in range(3)]
    specs[1] = (Reduce(seed=1, size=3001, data_index=1) if mismatch == "size"
                else Reduce(seed=1, size=3000, dtype="float64", data_index=1))
    replies = ring.call(ring.members[:3], "reduce", specs)
    kinds = [r[1][0] for r in replies]
    assert all(r[0] == "error" for r in replies), replies
    assert "FtarUsageError" in kinds, kinds
    assert set(kinds) <= {"FtarUsageError", "PeerFailedError"}, kinds
    usage = next(r[1][1] for r in replies if r[1][0] == "FtarUsageError")
    assert "members disagree" in usage and "fatal" in usage
