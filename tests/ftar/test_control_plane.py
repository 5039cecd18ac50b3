"""Handshake, refusals, reconfigure timeouts and usage errors, on loopback sockets.

These check one member's control plane, so its peers are raw handshake clients or
groups driven from threads of this process; the ring itself runs in real member
processes in the other test files.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from ft_launch.config import FtarConfig
from ft_launch.ftar import (
    AuthenticationError,
    FtarGroup,
    FtarUsageError,
    GroupState,
    PeerFailedError,
    ReduceOp,
    StaleQuorumError,
)
from ft_launch.ftar.errors import FailureKind
from ft_launch.ftar.transport import Hello, connect
from ft_launch.ids import new_job_secret
from tests.waiting import wait_until

CONFIG = FtarConfig(chunk_bytes=4096, timeout=5.0, connect_timeout=1.0)
SECRET = new_job_secret()


@pytest.fixture
def groups() -> Iterator[list[FtarGroup]]:
    made = [FtarGroup(CONFIG, SECRET) for _ in range(2)]
    yield made
    for group in made:
        group.close()


def _hello(quorum_id: int, config: FtarConfig = CONFIG, from_index: int = 1) -> Hello:
    return Hello(quorum_id, from_index, 0, 0, config.sockets_per_peer, config.chunk_bytes,
                 config.chunks_in_flight)


def _in_threads(*calls: Callable[[], Any]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def _form(groups: list[FtarGroup], quorum_id: int) -> None:
    addresses = [g.address for g in groups]
    results = _in_threads(*[lambda g=g, i=i: g.reconfigure(quorum_id, addresses, i)
                            for i, g in enumerate(groups)])
    assert results == [None] * len(groups), results


@pytest.mark.timeout(30)
def test_stale_quorum_and_missing_secret_are_refused_and_the_ring_still_works(
        groups: list[FtarGroup]) -> None:
    _form(groups, quorum_id=5)
    target = groups[0].address
    with pytest.raises(StaleQuorumError, match="refused quorum 4: it is in quorum 5"):
        connect(target, SECRET, _hello(4), 2.0)
    with pytest.raises(AuthenticationError, match="job secret"):
        connect(target, new_job_secret(), _hello(5), 2.0)
    mismatched = FtarConfig(chunk_bytes=8192)
    with pytest.raises(FtarUsageError, match="another ring configuration"):
        connect(target, SECRET, _hello(5, mismatched), 2.0)
    assert groups[0].stats().refused_connections == 3
    arrays = [np.full(10, i + 1.0, np.float32) for i in range(2)]
    _in_threads(*[lambda g=g, a=a: g.allreduce(a, ReduceOp.SUM)
                  for g, a in zip(groups, arrays)])
    assert all(np.array_equal(a, np.full(10, 3.0, np.float32)) for a in arrays)


@pytest.mark.timeout(30)
def test_member_with_another_secret_cannot_join() -> None:
    with FtarGroup(CONFIG, SECRET) as good, FtarGroup(CONFIG, new_job_secret()) as bad:
        addresses = [good.address, bad.address]
        good_result, bad_result = _in_threads(lambda: good.reconfigure(1, addresses, 0),
                                              lambda: bad.reconfigure(1, addresses, 1))
        assert isinstance(bad_result, AuthenticationError), bad_result
        assert isinstance(good_result, (AuthenticationError, PeerFailedError)), good_result


@pytest.mark.timeout(30)
def test_a_member_in_an_older_quorum_gets_a_recoverable_stale_error(
        groups: list[FtarGroup]) -> None:
    groups[1].reconfigure(7, [groups[1].address], 0)   # already in quorum 7
    with pytest.raises(StaleQuorumError) as caught:
        groups[0].reconfigure(6, [groups[0].address, groups[1].address], 0)
    assert caught.value.peer_quorum_id == 7
    assert groups[0].state is GroupState.UNCONFIGURED or groups[0].state is GroupState.BROKEN


@pytest.mark.timeout(30)
def test_a_neighbour_that_never_connects_is_a_recoverable_error_within_the_timeout(
        groups: list[FtarGroup]) -> None:
    started = time.monotonic()
    with pytest.raises(PeerFailedError, match="member 1 .* did not connect") as caught:
        groups[0].reconfigure(1, [groups[0].address, groups[1].address], 0)
    # connect_timeout bounds it, not the operation's timeout (five times longer here)
    assert time.monotonic() - started < CONFIG.timeout
    assert caught.value.context.quorum_id == 1
    with pytest.raises(FtarUsageError, match="failed reconfigure"):
        groups[0].allreduce(np.zeros(3, np.float32))


def test_usage_errors_are_fatal(groups: list[FtarGroup]) -> None:
    group = groups[0]
    with pytest.raises(FtarUsageError, match="reconfigure.*first"):
        group.allreduce(np.zeros(3, np.float32))
    with pytest.raises(FtarUsageError, match="not this member's address"):
        group.reconfigure(1, [groups[1].address], 0)
    group.reconfigure(3, [group.address], 0)
    with pytest.raises(FtarUsageError, match="older than the current quorum"):
        group.reconfigure(2, [group.address], 0)
    with pytest.raises(FtarUsageError, match="C-contiguous"):
        group.allreduce(np.zeros((4, 4), np.float32)[:, 1])
    with pytest.raises(FtarUsageError, match="unsupported dtype int64"):
        group.allreduce(np.zeros(3, np.int64))
    error = pytest.raises(FtarUsageError, group.allreduce, [1.0, 2.0]).value
    assert error.exit_code.name == "FATAL_NO_REQUEUE" and "fatal" in str(error)


def test_single_member_quorum_averages_over_contributors(groups: list[FtarGroup]) -> None:
    group = groups[0]
    group.reconfigure(1, [group.address], 0)
    data = np.arange(5, dtype=np.float64)
    assert np.array_equal(group.allreduce(data.copy()), data)
    assert not group.allreduce(data.copy(), contributes=False).any()
    assert group.stats().last_contributors == 0


@pytest.mark.timeout(30)
def test_several_sockets_per_peer_split_the_chunks() -> None:
    config = FtarConfig(chunk_bytes=4096, chunks_in_flight=4, sockets_per_peer=2, timeout=5.0)
    groups = [FtarGroup(config, SECRET) for _ in range(3)]
    try:
        _form(groups, quorum_id=1)
        rng = np.random.default_rng(3)
        inputs = [rng.standard_normal(20_001) for _ in groups]
        arrays = [a.copy() for a in inputs]
        results = _in_threads(*[lambda g=g, a=a: g.allreduce(a, ReduceOp.AVG)
                                for g, a in zip(groups, arrays)])
        assert all(isinstance(r, np.ndarray) for r in results), results
        for array in arrays:
            assert np.allclose(array, np.mean(inputs, axis=0), rtol=1e-12, atol=1e-12)
        stats = groups[0].stats()
        assert stats.inflight_limit_bytes == 2 * 4096          # 4 in flight over 2 sockets
        assert 0 < stats.max_inflight_bytes <= stats.inflight_limit_bytes
    finally:
        for group in groups:
            group.close()


@pytest.mark.timeout(60)
def test_a_member_the_quorum_reports_lost_fails_the_operation_at_once() -> None:
    config = FtarConfig(chunk_bytes=4096, timeout=30.0, connect_timeout=2.0)
    groups = [FtarGroup(config, SECRET) for _ in range(3)]
    try:
        _form(groups, quorum_id=4)
        # Member 2 never calls allreduce, as silent as a hung process: without the
        # quorum's report the others would wait the whole 30 s timeout.
        failed: dict[int, tuple[PeerFailedError, float]] = {}

        def reduce(i: int) -> None:
            try:
                groups[i].allreduce(np.ones(50_000, np.float32), step=9)
            except PeerFailedError as exc:
                failed[i] = (exc, time.monotonic())
        threads = [threading.Thread(target=reduce, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        assert not groups[0].member_lost(3, 2, "an older quorum's ring")
        reported = time.monotonic()
        assert groups[0].member_lost(4, 2, "replica 2 silent for 3 s")
        for thread in threads:
            thread.join(config.timeout)  # past it, the report made no difference
        assert set(failed) == {0, 1}
        for exc, at in failed.values():
            # member 1 learns it from member 0's abort notice, naming the same member
            assert (exc.kind, exc.peer_index) == (FailureKind.LOST, 2), exc
            assert at - reported < config.timeout, f"took {at - reported:.1f} s"
        assert "reported lost by the quorum" in str(failed[0][0])
        assert groups[0].state is GroupState.BROKEN
    finally:
        for group in groups:
            group.close()


@pytest.mark.timeout(60)
def test_members_that_leave_their_ring_fail_their_operation_at_once() -> None:
    """Members give up the ring themselves (their leader changed while they stood,
    and member 2 asked the new leader for a round): each one's operation fails at
    once, naming itself, rather than after ``timeout`` waiting for member 2."""
    config = FtarConfig(chunk_bytes=4096, timeout=30.0, connect_timeout=2.0)
    groups = [FtarGroup(config, SECRET) for _ in range(3)]
    try:
        _form(groups, quorum_id=4)
        failed: dict[int, PeerFailedError] = {}

        def reduce(i: int) -> None:
            try:
                groups[i].allreduce(np.ones(50_000, np.float32), step=9)
            except PeerFailedError as exc:
                failed[i] = exc
        threads = [threading.Thread(target=reduce, args=(i,)) for i in (0, 1)]
        for thread in threads:
            thread.start()
        left = time.monotonic()
        assert groups[1].member_lost(4, 1, "its leader changed")
        assert groups[0].member_lost(4, 0, "its leader changed")
        for thread in threads:
            thread.join(config.timeout)
        assert time.monotonic() - left < config.timeout
        assert set(failed) == {0, 1}
        assert all(e.kind is FailureKind.LOST for e in failed.values())
        assert failed[1].peer_index == 1
    finally:
        for group in groups:
            group.close()


@pytest.mark.timeout(60)
def test_rank_0_relays_a_lost_member_to_the_ring_of_another_rank(
        groups: list[FtarGroup]) -> None:
    """Only rank 0 hears the quorum: it relays the loss to the other ranks of its
    replica over their FTAR listeners (authenticated, about their current ring only)."""
    _form(groups, quorum_id=6)
    rank0 = FtarGroup(CONFIG, SECRET)
    try:
        target = groups[0].address
        with pytest.raises(StaleQuorumError):
            rank0.relay_member_lost(target, quorum_id=5, index=1)
        assert groups[0].state is GroupState.READY
        with FtarGroup(CONFIG, new_job_secret()) as stranger, \
                pytest.raises(AuthenticationError):
            stranger.relay_member_lost(target, quorum_id=6, index=1)
        assert groups[0].state is GroupState.READY
        rank0.relay_member_lost(target, quorum_id=6, index=1)
        # The verdict returns before the listener has acted on the notice.
        wait_until(lambda: groups[0].state is GroupState.BROKEN, 10, "the ring to break")
        with pytest.raises(PeerFailedError, match="reported lost by the quorum.*relayed"):
            groups[0].allreduce(np.ones(10, np.float32))
    finally:
        rank0.close()
