"""Fault injection on real member processes: a member killed or stopped mid-operation,
then reconfigure and retry, then a member rejoining."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest

from ft_launch.ids import new_job_secret
from tests.ftar.members import Fault, Reduce, Ring, reference
from tests.waiting import patience

TIMEOUT = 2.0
CONFIG = {"chunk_bytes": 4096, "chunks_in_flight": 2, "timeout": TIMEOUT,
          "connect_timeout": 5.0}
SIZE = 50_000          # float32: several partitions, so a fault lands mid-operation


@pytest.fixture
def ring() -> Iterator[Ring]:
    pool = Ring(CONFIG, new_job_secret())
    pool.spawn(4)
    yield pool
    pool.close()


def _reduce_ok(ring: Ring, members: list, seed: int, contributes: list[bool]) -> None:
    specs = [Reduce(seed=seed, size=SIZE, step=seed, data_index=m.address[1],
                    contributes=c) for m, c in zip(members, contributes)]
    replies = ring.call(members, "reduce", specs)
    assert all(r[0] == "ok" for r in replies), replies
    expected, count = reference(specs)
    for _, (data, contributors), _ in replies:
        assert np.allclose(data, expected, rtol=1e-5, atol=1e-6)
        assert contributors == count


def _fail_one(ring: Ring, victim: int, action: str) -> list[tuple]:
    """Arm ``victim`` to die/stop after the reduce-scatter, run an op, collect survivors."""
    members = ring.members[:4]
    ring.form(members)
    ring.call([members[victim]], "arm", [Fault(action, ring_step=2)])  # N-2: end of RS
    for i, member in enumerate(members):
        member.conn.send(("reduce", Reduce(seed=1, size=SIZE, step=7, data_index=i)))
    survivors = [m for i, m in enumerate(members) if i != victim]
    replies = []
    for member in survivors:
        # its bound (below) and a reconnect, stretched by the machine's load
        assert member.conn.poll(patience(2 * TIMEOUT + CONFIG["connect_timeout"])), \
            "a survivor hung"
        replies.append(member.conn.recv())
    return replies


def _assert_recoverable(replies: list[tuple], quorum_id: int) -> None:
    for status, error, elapsed in replies:
        assert status == "error", error
        kind, message, step, quorum, peer = error
        assert kind == "PeerFailedError", message
        assert "recoverable" in message
        assert (step, quorum) == (7, quorum_id), message
        assert peer is not None and f"member {peer}" in message
        # a stopped member costs its neighbours one timeout; the abort notice carries
        # it round the ring, so no survivor waits a second one
        assert elapsed < 2 * TIMEOUT, f"took {elapsed:.2f} s: {message}"


@pytest.mark.timeout(60)
def test_killed_member_then_reconfigure_to_three_then_rejoin(ring: Ring) -> None:
    replies = _fail_one(ring, victim=2, action="kill")
    _assert_recoverable(replies, ring.quorum_id)
    # abort notices carry the root cause round the ring: every survivor names member 2
    assert [r[1][4] for r in replies] == [2, 2, 2], replies
    dead = ring.members[2]
    dead.process.join(timeout=5)
    assert dead.process.exitcode == -signal.SIGKILL

    survivors = [m for m in ring.members[:4] if m is not dead]
    ring.form(survivors)
    _reduce_ok(ring, survivors, seed=2, contributes=[True] * 3)

    # a replacement process rejoins: it catches up, so it contributes zeros
    (newcomer,) = ring.spawn(1)
    everyone = survivors[:2] + [newcomer] + survivors[2:]
    ring.form(everyone)
    _reduce_ok(ring, everyone, seed=3, contributes=[True, True, False, True])
    _reduce_ok(ring, everyone, seed=4, contributes=[True] * 4)


@pytest.mark.timeout(60)
def test_silent_member_times_out_then_ring_recovers(ring: Ring) -> None:
    replies = _fail_one(ring, victim=1, action="stop")
    _assert_recoverable(replies, ring.quorum_id)
    assert any("timed out" in r[1][1] for r in replies), replies
    stopped = ring.members[1]
    os.kill(stopped.process.pid, signal.SIGKILL)
    stopped.process.join(timeout=5)
    survivors = [m for m in ring.members[:4] if m is not stopped]
    ring.form(survivors)
    _reduce_ok(ring, survivors, seed=5, contributes=[True] * 3)


@pytest.mark.timeout(60)
def test_broken_ring_keeps_failing_until_reconfigured(ring: Ring) -> None:
    _fail_one(ring, victim=3, action="kill")
    again = ring.call(ring.members[:3], "reduce",
                      [Reduce(seed=1, size=10, data_index=i) for i in range(3)])
    assert all(r[0] == "error" and r[1][0] == "PeerFailedError" for r in again), again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_bytes, size", [(4096, 4000), (1 << 20, 1 << 20)])
def test_a_neighbour_closing_right_after_an_operation_does_not_fail_a_slower_one(
        chunk_bytes: int, size: int) -> None:
    pair = Ring(dict(CONFIG, chunk_bytes=chunk_bytes), new_job_secret())
    try:
        pair.spawn(2)
        pair.form(pair.members)
        # Member 1 stalls before reading member 0's last frames; member 0 finishes and
        # closes at once. What member 0 queued must still reach member 1 (small frames:
        # already there; large ones: still in member 0's kernel queue), and member 1's
        # credits to the closed member 0 must not fail its operation.
        pair.call(pair.members[1:], "arm", [Fault("stall", ring_step=0, stall_seconds=0.5)])
        specs = [Reduce(seed=8, size=size, data_index=0, then_close=True),
                 Reduce(seed=8, size=size, data_index=1)]
        replies = pair.call(pair.members, "reduce", specs)
        assert [r[0] for r in replies] == ["ok", "ok"], replies
        expected, _ = reference(specs)
        assert all(np.allclose(r[1][0], expected, rtol=1e-6) for r in replies)
    finally:
        pair.close()
