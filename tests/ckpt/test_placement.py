"""Backup placement and catch-up source choice (pure)."""

from __future__ import annotations

from collections import Counter

import pytest

from ft_launch.ckpt.errors import PlacementError
from ft_launch.ckpt.placement import (
    GroupKind,
    PlacementRule,
    Topology,
    choose_fetch_source,
    eviction_domains,
    place_backups,
    shares_a_group,
)


def _assert_cross_group_plan(topology: Topology) -> None:
    plan = place_backups(topology)
    assert plan.rule is PlacementRule.CROSS_GROUP
    for rank, backup in enumerate(plan.backup_of):
        assert not shares_a_group(topology, rank, backup), (rank, backup)
        for kind in GroupKind:
            assert backup not in topology.group(kind, rank)
        node = topology.nodes[backup]
        assert node != topology.nodes[rank]
        assert all(node not in domain for domain in eviction_domains(topology, rank))


def test_coords_round_trip_and_replica_major_numbering():
    topology = Topology.uniform(dp=3, tp=2, pp=4, ranks_per_node=2)
    assert [topology.rank_of(topology.coords(r)) for r in range(24)] == list(range(24))
    assert topology.coords(8) == (1, 0, 0)  # the first rank of replica 1
    assert topology.group(GroupKind.TP, 0) == {0, 1}
    assert topology.group(GroupKind.PP, 0) == {0, 2, 4, 6}
    assert topology.group(GroupKind.DP, 0) == {0, 8, 16}


@pytest.mark.parametrize("dp, tp, pp, per_node", [
    (4, 2, 2, 2),   # TP inside a node, PP and DP across nodes
    (2, 2, 2, 2),   # ByteRobust fig. 9 scale
    (3, 4, 3, 4),
    (4, 1, 4, 1),   # one rank per node, DP x PP
    (2, 8, 1, 8),   # FT-HSDP: replicas of one node each, TP inside
    (4, 2, 2, 4),   # a node holds a TP pair of two PP stages
])
def test_three_d_layouts_place_outside_groups_and_eviction_domains(dp, tp, pp, per_node):
    topology = Topology.uniform(dp, tp, pp, per_node)
    _assert_cross_group_plan(topology)


def test_uniform_layout_spreads_backups_one_per_rank():
    topology = Topology.uniform(4, 2, 2, 2)
    plan = place_backups(topology)
    assert sorted(plan.backup_of) == list(range(16))
    assert all(len(plan.backups_held_by(r)) == 1 for r in range(16))


def test_fig9_example_backs_up_into_another_pp_and_dp_group():
    # dp=2, pp=2, tp=2, one (dp, pp) block of 2 ranks per node: nodes n0..n3.
    topology = Topology.uniform(2, 2, 2, 2)
    plan = place_backups(topology)
    for rank, backup in enumerate(plan.backup_of):
        (d, _, p), (bd, _, bp) = topology.coords(rank), topology.coords(backup)
        assert bd != d and bp != p


def test_group_spanning_every_node_is_not_an_eviction_domain():
    topology = Topology.uniform(2, 8, 1, 8)  # the DP group of each rank spans both nodes
    domains = eviction_domains(topology, 0)
    assert frozenset(topology.nodes) not in domains
    assert frozenset({"n0"}) in domains


def test_pp_group_on_its_own_nodes_is_avoided():
    # A PP group (the over-eviction unit in ByteRobust) spans n0 and n1 for replica 0.
    topology = Topology.uniform(2, 1, 2, 1)
    plan = place_backups(topology)
    for rank, backup in enumerate(plan.backup_of):
        pp_nodes = topology.group_nodes(GroupKind.PP, rank)
        assert topology.nodes[backup] not in pp_nodes


def test_irregular_node_assignment_falls_back_to_search():
    # Ranks scattered so that no uniform shift satisfies every rank.
    nodes = ("a", "b", "c", "d", "b", "a", "d", "c", "c", "d", "a", "b", "d", "c", "b", "a")
    topology = Topology(4, 2, 2, nodes)
    _assert_cross_group_plan(topology)


@pytest.mark.parametrize("dp, tp, pp, per_node", [(4, 1, 1, 1), (8, 1, 1, 2), (1, 4, 1, 2),
                                                  (1, 1, 3, 1)])
def test_single_parallel_group_uses_the_neighbouring_node(dp, tp, pp, per_node):
    topology = Topology.uniform(dp, tp, pp, per_node)
    plan = place_backups(topology)
    assert plan.rule is PlacementRule.NEIGHBOUR_NODE
    order = list(dict.fromkeys(topology.nodes))
    for rank, backup in enumerate(plan.backup_of):
        node = topology.nodes[rank]
        assert topology.nodes[backup] == order[(order.index(node) + 1) % len(order)]
    assert sorted(plan.backup_of) == list(range(topology.world_size))


def test_one_node_cannot_hold_a_backup():
    with pytest.raises(PlacementError, match="at least two nodes"):
        place_backups(Topology.uniform(2, 2, 1, 4))


def test_impossible_layout_says_why():
    # dp=2 x pp=2: rank 0's only rank outside its groups is rank 3, on rank 0's own node.
    topology = Topology(2, 1, 2, ("n0", "n1", "n2", "n0"))
    with pytest.raises(PlacementError, match="no rank outside .* of rank 0") as caught:
        place_backups(topology)
    assert "peer_backup" in str(caught.value)


def test_bad_topology_is_rejected():
    with pytest.raises(ValueError, match="node names"):
        Topology(2, 2, 1, ("n0",))


def test_fetch_sources_spread_over_healthy_replicas():
    healthy = [0, 2, 3]
    chosen = Counter(choose_fetch_source(rank, 1, [1], healthy) for rank in range(6))
    assert chosen == {0: 2, 2: 2, 3: 2}
    per_rank = [(choose_fetch_source(0, b, [1, 4, 5], healthy)) for b in (1, 4, 5)]
    assert sorted(per_rank) == healthy  # three behind replicas, three different sources


def test_fetch_source_needs_a_healthy_replica():
    with pytest.raises(ValueError, match="no healthy replica"):
        choose_fetch_source(0, 1, [1], [])
    with pytest.raises(ValueError, match="not among the behind"):
        choose_fetch_source(0, 1, [2], [0])
