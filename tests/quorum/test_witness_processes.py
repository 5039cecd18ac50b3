"""Witness voters as real processes on loopback: replicas and witnesses each a
spawned ``QuorumAgent``. A quorum below a majority of the replicas forms with the
witnesses' endorsement; a side without a majority of the votes never forms one."""

from __future__ import annotations

import pytest

from ft_launch.launcher.quorum.model import Quorum, witness_ids
from tests.waiting import wait_until

from .cluster import MakeCluster

pytestmark = pytest.mark.timeout(120)

def test_three_replicas_lose_two_and_the_last_trains_on(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(3, witnesses=witness_ids(1))
    cluster.first_round([0, 1, 2])
    last = (cluster.leader() + 1) % 3
    for victim in (r for r in range(3) if r != last):
        cluster.kill(victim)
    quorum = cluster.settled_round([last], 2, expect=[last])
    again = cluster.round([last], quorum.max_step + 1)
    assert again.replica_ids == (last,) and again.quorum_id == quorum.quorum_id


def test_a_partition_forms_quorums_on_the_witness_side_only_and_heals(
        make_cluster: MakeCluster) -> None:
    [witness] = witness_ids(1)
    cluster = make_cluster(3, witnesses=(witness,))
    first = cluster.first_round([0, 1, 2])
    cluster.partition([0])
    cluster.ask([0], 2)
    shrunk = cluster.settled_round([1, 2], 2, expect=[1, 2])
    assert shrunk.quorum_id > first.quorum_id
    # However long the cut-off replica waits, it is never answered with a quorum:
    # what it gets, if anything, is that the majority is lost.
    for step in range(shrunk.max_step + 1, shrunk.max_step + 4):
        assert cluster.round([1, 2], step).replica_ids == (1, 2)
    cluster.members[0].pump()
    answer = cluster.members[0].answers.get(2)
    assert not isinstance(answer, Quorum), answer
    cluster.heal()
    grown = cluster.settled_round([0, 1, 2], 20, expect=[0, 1, 2])
    assert grown.quorum_id > shrunk.quorum_id


def test_losing_a_witness_then_a_replica_forms_on(make_cluster: MakeCluster) -> None:
    first_witness, second_witness = witness_ids(2)
    cluster = make_cluster(3, witnesses=(first_witness, second_witness))
    cluster.first_round([0, 1, 2])
    cluster.kill(first_witness)
    cluster.settled_round([0, 1, 2], 2, expect=[0, 1, 2])
    victim = (cluster.leader() + 1) % 3
    cluster.kill(victim)
    left = [r for r in range(3) if r != victim]
    assert cluster.settled_round(left, 10, expect=left).replica_ids == tuple(left)


def test_the_survivor_of_two_replicas_with_a_witness_forms_and_the_newcomer_rejoins(
        make_cluster: MakeCluster) -> None:
    cluster = make_cluster(2, witnesses=witness_ids(1))
    cluster.first_round([0, 1])
    victim = cluster.leader()          # the harder case: the survivor must be elected
    survivor = 1 - victim
    cluster.kill(victim)
    cluster.settled_round([survivor], 2, expect=[survivor])
    wait_until(lambda: cluster.status(survivor).leader_id == survivor,
               cluster.round_timeout, "the survivor to lead")
    cluster.start(victim)
    both = sorted([victim, survivor])
    assert cluster.settled_round(both, 10, expect=both).replica_ids == tuple(both)
