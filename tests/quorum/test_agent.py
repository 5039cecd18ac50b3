"""The agent shell in one process (threads, real sockets on loopback)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from ft_launch.config import QuorumConfig
from ft_launch.errors import ConfigError
from ft_launch.events import EventLog, read_events
from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum import QuorumAgent
from ft_launch.launcher.quorum.directory import StaticDirectory
from ft_launch.launcher.quorum.errors import QuorumStoppedError, QuorumTimeoutError
from ft_launch.launcher.quorum.events import LeaderElected, QuorumFormed, QuorumJoined
from ft_launch.logs import SAMPLE_EVERY
from tests.waiting import patience, wait_until

from .helpers import FAST_CONFIG, round_timeout

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def trio() -> Iterator[list[QuorumAgent]]:
    directory = StaticDirectory()
    secret = new_job_secret()
    agents = [QuorumAgent(r, range(3), directory, secret, FAST_CONFIG, job_id="t").start()
              for r in range(3)]
    yield agents
    for agent in agents:
        agent.stop()


def one_round(agents: list[QuorumAgent], step: int) -> list:
    futures = [a.request_quorum(step) for a in agents]
    return [f.result(patience(round_timeout(a.config))) for a, f in zip(agents, futures)]


def leader_of(agents: list[QuorumAgent]) -> int:
    def agreed() -> int | None:
        views = {a.status().leader_id for a in agents}
        return views.pop() if len(views) == 1 and None not in views else None
    found = wait_until(lambda: agreed() is not None, round_timeout(agents[0].config),
                       "a leader everyone follows")
    assert found
    leader = agreed()
    assert leader is not None
    return leader


def test_three_agents_agree(trio: list[QuorumAgent]) -> None:
    quorums = one_round(trio, 5)
    assert len(set(quorums)) == 1
    quorum = quorums[0]
    assert quorum.replica_ids == (0, 1, 2) and quorum.max_step == 5
    assert [m.address for m in quorum.members] == [a.address for a in trio]
    again = one_round(trio, 6)
    assert again[0].quorum_id == quorum.quorum_id  # nobody changed
    assert trio[0].stats()["sent"] > 0


def test_commit_failure_bumps_the_quorum_id(trio: list[QuorumAgent]) -> None:
    first = one_round(trio, 1)[0]
    trio[1].report_commit_failure()
    second = one_round(trio, 1)[0]
    third = one_round(trio, 2)[0]
    assert second.quorum_id == first.quorum_id + 1
    assert third.quorum_id == second.quorum_id


def test_events_reach_subscribers_and_the_event_log(tmp_path: Path) -> None:
    directory = StaticDirectory()
    secret = new_job_secret()
    log = EventLog(tmp_path / "events.jsonl")
    seen: list[object] = []
    agents = [QuorumAgent(r, range(2), directory, secret, FAST_CONFIG,
                          event_log=log if r == 0 else None) for r in range(2)]
    try:
        agents[1].subscribe(seen.append)
        for agent in agents:
            agent.start()
        one_round(agents, 3)
        wait_until(lambda: any(isinstance(e, QuorumJoined) for e in seen), 5, "an event")
    finally:
        for agent in agents:
            agent.stop()
        log.close()
    kinds = {type(e) for e in seen}
    assert {LeaderElected, QuorumJoined} <= kinds
    logged = list(read_events(tmp_path / "events.jsonl"))
    assert any(isinstance(e, QuorumJoined) and e.members == [0, 1] for e in logged)
    formed = [e for e in logged + seen if isinstance(e, QuorumFormed)]
    assert len(formed) == 1 and formed[0].members == [0, 1]


def test_a_subscriber_that_raises_does_not_stop_the_agent(trio: list[QuorumAgent]) -> None:
    def broken(event: object) -> None:
        raise RuntimeError("subscriber bug")
    trio[0].subscribe(broken)
    assert one_round(trio, 1)[0].replica_ids == (0, 1, 2)


def test_no_quorum_in_time_raises_a_recoverable_timeout() -> None:
    agent = QuorumAgent(0, range(3), StaticDirectory(), new_job_secret(), FAST_CONFIG).start()
    try:
        with pytest.raises(QuorumTimeoutError) as caught:
            agent.get_quorum(1, timeout=0.3)
        assert caught.value.context.replica_id == 0 and caught.value.context.step == 1
    finally:
        agent.stop()


def test_stop_fails_the_waiting_caller_and_later_calls() -> None:
    agent = QuorumAgent(0, range(3), StaticDirectory(), new_job_secret(), FAST_CONFIG).start()
    future = agent.request_quorum(1)
    agent.stop()
    with pytest.raises(QuorumStoppedError):
        future.result(5)
    with pytest.raises(QuorumStoppedError):
        agent.get_quorum(2, timeout=1)
    with pytest.raises(QuorumStoppedError):
        agent.start()


def test_newer_request_supersedes_the_unanswered_one() -> None:
    agent = QuorumAgent(0, range(3), StaticDirectory(), new_job_secret(), FAST_CONFIG).start()
    try:
        old = agent.request_quorum(1)
        agent.request_quorum(2)
        wait_until(old.cancelled, 5, "the older request to be cancelled")
    finally:
        agent.stop()


def test_invalid_setups_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not among the configured replicas"):
        QuorumAgent(5, range(3), {}, new_job_secret())
    with pytest.raises(ConfigError, match="quorum.election_timeout"):
        QuorumAgent(0, range(3), {}, new_job_secret(),
                    QuorumConfig(heartbeat_interval=1.0, election_timeout=0.5))


def test_an_input_that_trips_a_bug_is_dropped_logged_sampled_and_the_agent_goes_on(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="ft_launch.launcher.quorum.agent")
    agent = QuorumAgent(0, [0], {}, new_job_secret(), FAST_CONFIG).start()

    def broken() -> None:
        raise RuntimeError("a bug the input trips")

    try:
        for _ in range(1500):
            agent._guarded(broken)
        assert agent.stats()["failed_steps"] == 1500
        assert len(caplog.records) == 1 + 1500 // SAMPLE_EVERY
        assert all(r.exc_info for r in caplog.records)
        assert agent.get_quorum(1, timeout=patience(round_timeout(FAST_CONFIG))).replica_ids \
            == (0,)
    finally:
        agent.stop()


def test_the_replay_window_comes_from_the_config() -> None:
    import time

    from ft_launch.launcher.quorum.model import HeartbeatAcked
    from ft_launch.launcher.quorum.wire import Codec
    secret = new_job_secret()
    config = QuorumConfig(heartbeat_interval=0.05, election_timeout=0.4, member_timeout=1.2,
                          join_timeout=0.6, max_message_age=5.0)
    agent = QuorumAgent(0, range(2), StaticDirectory(), secret, config, job_id="t").start()
    try:
        codec = Codec(secret, "t")
        now = time.time()
        old = codec.seal(1, 0, 5, 1, now - 10, "tcp://127.0.0.1:9", HeartbeatAcked(0))
        recent = codec.seal(1, 0, 5, 2, now - 3, "tcp://127.0.0.1:9", HeartbeatAcked(0))
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 1000)
            sock.connect(agent.address)
            for frames in (old, recent):
                sock.send_multipart(frames)
            wait_until(lambda: agent.stats()["received"] >= 1, 10, "the recent one")
        assert agent.stats()["rejected_expired"] == 1  # 10 s > max_message_age = 5 s
    finally:
        agent.stop()
