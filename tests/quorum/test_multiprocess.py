"""Multi-process tests: every member a real process, real sockets on loopback.

Invariant checked throughout: the members of a round all end with the very
same quorum.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq

from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum.model import HeartbeatAcked, VoteRequested
from ft_launch.launcher.quorum.wire import Codec
from tests.waiting import wait_until

from .cluster import CALL_TIMEOUT, JOB, MakeCluster
from .helpers import FAST_CONFIG

pytestmark = pytest.mark.timeout(90)

FIVE = list(range(5))
def test_leader_killed_mid_round(make_cluster: MakeCluster) -> None:
    # What failover costs: the survivors notice the silence (election timeout),
    # elect (timeout + spread, the spread at least one election timeout) and the
    # new leader stops counting the dead one (member timeout).
    failover = 2 * FAST_CONFIG.election_timeout + FAST_CONFIG.member_timeout
    # A join window five failovers long: the leader holds the round open for its
    # own join, so the kill lands while the others' joins sit unanswered at the
    # leader, and a failover that waited the window out is told from one that did not.
    config = dataclasses.replace(FAST_CONFIG, join_timeout=5 * failover)
    cluster = make_cluster(5, config=config)
    first = cluster.first_round(FIVE)
    leader = cluster.leader()
    survivors = [r for r in FIVE if r != leader]
    cluster.ask(survivors, 2)
    # Later than the window the round forms without the leader: no kill mid-round.
    wait_until(lambda: cluster.status(leader).round_joined == tuple(survivors),
               config.join_timeout, "the survivors' joins at the leader")
    killed_at = time.monotonic()
    cluster.kill(leader)
    answers = cluster.answers(survivors, 2)
    took = time.monotonic() - killed_at
    quorums = set(answers.values())
    assert len(quorums) == 1, answers
    [quorum] = quorums
    assert quorum.replica_ids == tuple(survivors)
    assert quorum.leader_id != leader and quorum.quorum_id > first.quorum_id
    # Detected by heartbeats, not by the join window.
    assert took < config.join_timeout, \
        f"failover took {took:.1f} s, the join window {config.join_timeout:.1f} s"


def test_partition_one_member_then_heal(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(5)
    cluster.first_round(FIVE)
    victim = (cluster.leader() + 1) % 5
    rest = [r for r in FIVE if r != victim]
    cluster.partition([victim])
    cluster.ask([victim], 2)
    shrunk = cluster.settled_round(rest, 2, expect=rest)
    [error] = cluster.answers([victim], 2).values()
    assert error[0] == "MajorityLostError" and tuple(error[2]) == (victim,)
    cluster.heal()
    grown = cluster.settled_round(FIVE, 10, expect=FIVE)
    assert grown.quorum_id > shrunk.quorum_id


def test_partition_two_of_five(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(5)
    cluster.first_round(FIVE)
    leader = cluster.leader()
    minority = sorted([(leader + 1) % 5, (leader + 2) % 5])
    majority = [r for r in FIVE if r not in minority]
    cluster.partition(minority)
    cluster.ask(minority, 2)
    quorum = cluster.settled_round(majority, 2, expect=majority)
    assert quorum.leader_id == leader
    for error in cluster.answers(minority, 2).values():
        assert error[0] == "MajorityLostError" and sorted(error[2]) == minority


def test_restarted_member_rejoins_at_a_new_address(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(5)
    first = cluster.first_round(FIVE)
    victim = (cluster.leader() + 2) % 5
    old_address = cluster.members[victim].address
    cluster.kill(victim)
    new_address = cluster.start(victim).address
    assert new_address != old_address
    quorum = cluster.settled_round(FIVE, 2, expect=FIVE)
    assert [m.address for m in quorum.members if m.replica_id == victim] == [new_address]
    assert quorum.quorum_id > first.quorum_id


def test_forged_and_replayed_messages_are_dropped(make_cluster: MakeCluster) -> None:
    # Three of four configured replicas run: still a strict majority.
    cluster = make_cluster(3, replicas=4)
    first = cluster.first_round([0, 1, 2])
    target = cluster.members[1]
    term = cluster.status(1).term
    now = time.time()
    fake = "tcp://127.0.0.1:9"
    forged = [
        # A vote that would depose everyone, signed with a guessed secret.
        Codec(new_job_secret(), JOB).seal(0, 1, 1, 1, now, fake, VoteRequested(99)),
        # The right secret bound to another job.
        Codec(cluster.secret, "another-job").seal(0, 1, 1, 1, now, fake, VoteRequested(99)),
    ]
    genuine = Codec(cluster.secret, JOB).seal(3, 1, 5, 1, now, fake, HeartbeatAcked(0))
    stale = Codec(cluster.secret, JOB).seal(3, 1, 5, 2, now - 3600, fake, HeartbeatAcked(0))
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(target.address)
        for frames in [*forged, genuine, genuine, stale]:
            sock.send_multipart(frames)
        expected = {"rejected_bad_signature": 2, "rejected_replayed": 1, "rejected_expired": 1}
        counts = wait_until(lambda: (c := target.call("stats")) and all(
            c[k] == v for k, v in expected.items()) and c, CALL_TIMEOUT,
            "the drops to be counted")
    assert counts["received"] > 0
    assert cluster.status(1).term == term  # the forged vote changed nothing
    second = cluster.round([0, 1, 2], 2)
    assert second.replica_ids == (0, 1, 2) and second.quorum_id == first.quorum_id


def test_steady_steps_go_on_without_rounds_and_a_newcomer_is_admitted(
        make_cluster: MakeCluster) -> None:
    """``quorum.standing``: while the members step quickly, each is answered from the
    leader's grant, not by a round (which costs every follower a join a step); the
    answers stay identical. A member that arrives is taken in when the grants run out."""
    cluster = make_cluster(3, replicas=4, config=dataclasses.replace(FAST_CONFIG, standing=True))
    first = cluster.first_round([0, 1, 2])
    for step in range(2, 31):   # the leader learns the pace and grants ahead
        cluster.round([0, 1, 2], step)
    follower = next(r for r in (0, 1, 2) if r != cluster.leader())
    sent_before = cluster.members[follower].call("stats")["sent"]
    started = time.monotonic()
    steps = 60
    for step in range(31, 31 + steps):
        quorum = cluster.round([0, 1, 2], step)
        assert (quorum.quorum_id, quorum.replica_ids, quorum.max_step) == \
            (first.quorum_id, (0, 1, 2), step)
    elapsed = time.monotonic() - started
    sent = cluster.members[follower].call("stats")["sent"] - sent_before
    # In rounds a follower sends at least a join a step. Standing, it sends its
    # heartbeat acknowledgements (one per ack_interval at most) and a join where
    # it ran out of grant before the next heartbeat extended it.
    ack_interval = max(FAST_CONFIG.heartbeat_interval, FAST_CONFIG.member_timeout / 4)
    assert sent < steps / 2 + elapsed / ack_interval + 2, (sent, elapsed)
    cluster.start(3)
    joined = cluster.settled_round([0, 1, 2, 3], 31 + steps, expect=[0, 1, 2, 3])
    assert joined.quorum_id > first.quorum_id
