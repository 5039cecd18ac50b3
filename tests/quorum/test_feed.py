"""The leader's feed and the loop's batched sends: followers hosted by one loop take
a round's answer from one published copy, and each channel's messages open only
on that channel."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum import AgentLoop, QuorumAgent, StaticDirectory
from ft_launch.launcher.quorum.loop import split_batch
from ft_launch.launcher.quorum.model import Heartbeat
from ft_launch.launcher.quorum.wire import Codec, Rejected, Rejection
from tests.waiting import wait_until

from .helpers import FAST_CONFIG, round_timeout
from .test_agent import leader_of, one_round

pytestmark = pytest.mark.timeout(60)

MEMBERS = 6


@pytest.fixture
def shared() -> Iterator[list[QuorumAgent]]:
    """Replica 0 on a loop of its own, the others sharing one (as in the benchmark)."""
    directory, secret = StaticDirectory(), new_job_secret()
    own, followers = AgentLoop("lead").start(), AgentLoop("followers").start()
    agents = [QuorumAgent(r, range(MEMBERS), directory, secret, FAST_CONFIG, job_id="t",
                          loop=own if r == 0 else followers, electable=r == 0).start()
              for r in range(MEMBERS)]
    yield agents
    for agent in agents:
        agent.stop()
    followers.stop()
    own.stop()


def test_followers_take_the_rounds_from_the_leaders_feed(shared: list[QuorumAgent]) -> None:
    assert leader_of(shared) == 0
    step = 1

    def on_feed() -> bool:
        nonlocal step
        quorums = one_round(shared, step)
        step += 1
        assert len({q.quorum_id for q in quorums}) == 1
        assert quorums[0].replica_ids == tuple(range(MEMBERS))
        return all(a.stats()["received_on_feed"] > 0 for a in shared[1:])
    wait_until(on_feed, round_timeout(FAST_CONFIG), "every follower on the leader's feed")
    published = shared[0].stats()["published"]
    before = [a.stats()["received_on_feed"] for a in shared[1:]]
    one_round(shared, step)
    assert shared[0].stats()["published"] > published
    assert all(a.stats()["received_on_feed"] > b for a, b in zip(shared[1:], before))
    for agent in shared:
        assert agent.stats().unauthenticated == 0 and agent.stats().replayed == 0


def test_a_message_opens_only_on_the_channel_it_was_sealed_for() -> None:
    codec = Codec(new_job_secret(), "t")
    unicast = codec.seal(0, 1, 5, 1, time.time(), "tcp://a:1", Heartbeat(3))
    published = codec.seal(0, -1, 5, 2, time.time(), "tcp://a:1", Heartbeat(3),
                           feed_address="tcp://a:2", feed=True)
    assert codec.open(unicast).message == Heartbeat(3)
    opened = codec.open(published, feed=True)
    assert opened.message == Heartbeat(3) and opened.feed == "tcp://a:2"
    for frames, feed in ((unicast, True), (published, False)):
        with pytest.raises(Rejected) as caught:
            codec.open(frames, feed=feed)
        assert caught.value.reason is Rejection.BAD_SIGNATURE


def test_a_batch_frame_splits_into_its_messages_or_is_refused_whole() -> None:
    codec = Codec(new_job_secret(), "t")
    messages = [codec.seal(r, 0, 5, 1, time.time(), f"tcp://r{r}:1", Heartbeat(r))
                for r in range(1, 4)]
    frame = b"".join(len(d).to_bytes(4, "big") + d + m for d, m in messages)
    assert split_batch(frame, 32) == [list(m) for m in messages]
    for broken in (frame[:-1], frame + b"\x00\x00", b"\xff\xff\xff\xff" + frame):
        with pytest.raises(ValueError):
            split_batch(broken, 32)
