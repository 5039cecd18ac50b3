"""Hostile peers at a quorum agent: an oversize frame ends the sender's
connection before it is buffered, junk is counted and logged sampled, a peer
record nested too deep is ignored without a traceback, and the message size
limit holds every message a legitimate job sends."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import zmq

from ft_launch.errors import FatalError
from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum import QuorumAgent
from ft_launch.launcher.quorum.directory import FileDirectory, StaticDirectory
from ft_launch.launcher.quorum.model import (
    Heartbeat,
    JoinRequested,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
)
from ft_launch.launcher.quorum.wire import MAX_ADDRESS_BYTES, Codec, max_message_bytes
from ft_launch.launcher.worker.protocol import ReplicaEndpoints
from ft_launch.logs import SAMPLE_EVERY
from tests.waiting import wait_until
from tests.zmtp import RawPeer

from .helpers import FAST_CONFIG

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def trio() -> Iterator[tuple[list[QuorumAgent], StaticDirectory]]:
    directory = StaticDirectory()
    secret = new_job_secret()
    agents = [QuorumAgent(r, range(3), directory, secret, FAST_CONFIG, job_id="t").start()
              for r in range(3)]
    yield agents, directory
    for agent in agents:
        agent.stop()


def one_round(agents: list[QuorumAgent], step: int) -> list[Quorum]:
    futures = [a.request_quorum(step) for a in agents]
    return [f.result(30) for f in futures]


def router_of(directory: StaticDirectory, replica_id: int) -> str:
    record = directory.lookup(replica_id)
    assert record is not None
    return record.address


def test_an_oversize_frame_ends_the_connection_unbuffered_and_the_quorum_still_forms(
        trio: tuple[list[QuorumAgent], StaticDirectory]) -> None:
    agents, directory = trio
    frame = 96 << 20
    assert frame > 2 * max_message_bytes(3)
    me = psutil.Process()  # the agents' loops run in this process
    before = me.memory_info().rss
    attacker = RawPeer(router_of(directory, 0), b"DEALER")
    try:
        completed = attacker.stream_frame(frame)
        grown = me.memory_info().rss - before
    finally:
        attacker.close()
    assert not completed, f"the agent read all of a {frame >> 20} MiB frame"
    assert grown < frame // 2, f"memory grew by {grown >> 20} MiB"
    quorums = one_round(agents, 1)
    assert len(set(quorums)) == 1 and quorums[0].replica_ids == (0, 1, 2)


def test_junk_is_counted_exactly_and_logged_sampled(
        trio: tuple[list[QuorumAgent], StaticDirectory],
        caplog: pytest.LogCaptureFixture) -> None:
    agents, directory = trio
    junk = 1500
    caplog.set_level(logging.WARNING, logger="ft_launch.launcher.quorum.agent")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(router_of(directory, 1))
    try:
        for i in range(junk):  # below SNDHWM: queued, never blocks
            dealer.send_multipart([b"%064d" % i, b"\x00" * 32])
        wait_until(lambda: agents[1].stats()["rejected_bad_signature"] >= junk, 60,
                   "every junk message counted")
    finally:
        dealer.close(0)
    assert agents[1].stats()["rejected_bad_signature"] == junk
    lines = [r for r in caplog.records if r.name == "ft_launch.launcher.quorum.agent"
             and "dropped a quorum message" in r.getMessage()]
    assert len(lines) == 1 + junk // SAMPLE_EVERY


def test_an_address_above_the_limit_fails_the_request_with_a_clear_error(
        trio: tuple[list[QuorumAgent], StaticDirectory]) -> None:
    agents, _ = trio
    future = agents[0].request_quorum(1, address="a" * (MAX_ADDRESS_BYTES + 1))
    with pytest.raises(FatalError, match=f"{MAX_ADDRESS_BYTES + 1} bytes"):
        future.result(10)


def test_a_peer_record_nested_too_deep_is_ignored_without_a_traceback(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    directory = FileDirectory(tmp_path, new_job_secret(), job_id="t")
    directory.file_for(1).write_text("[" * 100_000)
    directory.file_for(2).write_text('{"replica_id": "\u00b2", "address": "x", '
                                     '"incarnation": ' + "9" * 5000 + "}")
    caplog.set_level(logging.WARNING, logger="ft_launch.launcher.quorum.directory")
    assert directory.lookup(1) is None and directory.lookup(2) is None
    assert len(caplog.records) == 2 and not any(r.exc_info for r in caplog.records)


# ------------------------------------------------------------------ the size limit

def _longest_address(size: int = MAX_ADDRESS_BYTES) -> str:
    return "a" * size


@pytest.mark.parametrize("replicas", [1, 3, 40])
def test_the_size_limit_holds_the_largest_messages_of_a_job(replicas: int) -> None:
    codec = Codec(new_job_secret(), "t")
    ids = tuple(range(replicas))
    members = tuple(QuorumMember(r, 2**40, _longest_address()) for r in ids)
    quorum = Quorum.of(2**40, members, term=2**40, leader_id=0)
    delta = QuorumDeltaAnnounced(
        2**40, 2**40, 0, 2**40, quorum.digest, removed=ids,
        added=tuple((r, _longest_address()) for r in ids),
        behind=tuple((r, 2**40) for r in ids), seqs=tuple(2**31 for _ in ids))
    messages = [QuorumAnnounced(2**40, quorum, {r: 2**40 for r in ids}), delta,
                Heartbeat(2**40, ids), JoinRequested(2**40, 2**40, _longest_address())]
    sender_address = "tcp://" + "h" * 65_000 + ":65535"  # the header's longest
    for message in messages:
        data, _ = codec.seal(0, -1, 2**40, 2**40, 0.0, sender_address, message)
        assert len(data) <= max_message_bytes(replicas), type(message).__name__


def test_a_real_1000_member_announcement_is_far_below_the_limit() -> None:
    eight_ranks = ReplicaEndpoints(tuple(("10.10.123.123", 40000 + i) for i in range(8)),
                                   tuple(("10.10.123.123", 41000 + i) for i in range(8)))
    address = eight_ranks.encode()
    members = tuple(QuorumMember(r, 100, address) for r in range(1000))
    announced = QuorumAnnounced(3, Quorum.of(7, members, term=3, leader_id=0),
                                {r: 5 for r in range(1000)})
    data, _ = Codec(new_job_secret(), "t").seal(0, -1, 1, 1, 0.0, "tcp://10.0.0.1:5555",
                                                 announced)
    assert len(data) < max_message_bytes(1000) // 100
    assert json.loads(address)  # the address really is the endpoints' JSON
