"""Whole-cluster scenarios of the pure core on a simulated network (no sockets)."""

from __future__ import annotations

import random

import pytest

from ft_launch.launcher.quorum.election import Send
from ft_launch.launcher.quorum.events import QuorumFormed
from ft_launch.launcher.quorum.model import Quorum, Role, VoteRequested

from .builders import QuorumRequested
from .sim import FAST, Sim

FIVE = range(5)


def settle(sim: Sim) -> int:
    assert sim.run_until(sim.stable, 5.0), "no stable leader"
    return sim.leader()


def round_of(sim: Sim, members: list[int], step: int, limit: float = 5.0) -> list[Quorum]:
    """Everyone in ``members`` asks for ``step``; returns what each got."""
    before = {r: len(sim.delivered[r]) for r in members}
    for r in members:
        sim.request(r, step)
    assert sim.run_until(lambda: all(len(sim.delivered[r]) > before[r] for r in members),
                         limit), f"round {step} incomplete"
    return [sim.delivered[r][-1] for r in members]


def random_fault(sim: Sim, rng: random.Random, step: int,
                 odds: tuple[float, float, float, float]) -> None:
    """At most one fault among 5 members: kill one (while more than 3 live), restart
    a dead one, cut 1 or 2 off, or heal; ``odds`` are the cumulative chances."""
    kill, restart, cut_off, heal = odds
    fault = rng.random()
    alive = [r for r in range(5) if r not in sim.dead]
    if fault < kill and len(alive) > 3:
        sim.kill(rng.choice(alive))
    elif fault < restart and sim.dead:
        sim.start(rng.choice(sorted(sim.dead)), seq_base=step * 1000)
    elif fault < cut_off:
        cut = rng.sample(range(5), rng.randint(1, 2))
        sim.partition(cut, [r for r in range(5) if r not in cut])
    elif fault < heal:
        sim.heal()


def test_everyone_gets_the_same_quorum() -> None:
    sim = Sim(FIVE)
    settle(sim)
    quorums = round_of(sim, list(FIVE), 1)
    assert len(set(quorums)) == 1 and quorums[0].replica_ids == (0, 1, 2, 3, 4)


def test_leader_killed_mid_round_survivors_reform() -> None:
    sim = Sim(FIVE)
    old = settle(sim)
    first = round_of(sim, list(FIVE), 1)[0]
    survivors = [r for r in FIVE if r != old]
    for r in survivors:  # joins reach the leader, which dies before answering
        sim.request(r, 2)
    sim.run(0.002)
    assert sim.states[old].lead.round is not None  # type: ignore[union-attr]
    sim.kill(old)
    assert sim.run_until(lambda: all(len(sim.delivered[r]) == 2 for r in survivors), 3.0)
    quorums = {sim.delivered[r][-1] for r in survivors}
    assert len(quorums) == 1
    [quorum] = quorums
    assert quorum.replica_ids == tuple(survivors)
    assert quorum.quorum_id > first.quorum_id and quorum.leader_id != old
    # Failover took one election timeout or two, not the join window on top.
    assert sim.now < 1.0 + 2 * (FAST.election_timeout + FAST.election_spread)


def test_partition_one_member_then_heal() -> None:
    sim = Sim(FIVE)
    leader = settle(sim)
    victim = (leader + 1) % 5
    rest = [r for r in FIVE if r != victim]
    sim.partition([victim], rest)
    sim.request(victim, 1)
    quorums = round_of(sim, rest, 1)
    assert quorums[0].replica_ids == tuple(rest)
    assert sim.run_until(lambda: bool(sim.failed[victim]), 3.0)
    assert sim.failed[victim][0].reachable == (victim,)
    term = sim.states[leader].term
    sim.heal()
    # A cut-off member fails fast until it hears a leader again.
    assert sim.run_until(lambda: not sim.states[victim].majority_lost, 1.0)
    quorums = round_of(sim, list(FIVE), 2)
    assert len(set(quorums)) == 1 and quorums[0].replica_ids == (0, 1, 2, 3, 4)
    assert quorums[0].quorum_id == sim.delivered[rest[0]][0].quorum_id + 1
    # Pre-vote: the returning member did not depose the healthy leader.
    assert (sim.leader(), sim.states[leader].term) == (leader, term)


def test_partition_two_of_five() -> None:
    sim = Sim(FIVE)
    leader = settle(sim)
    minority = [(leader + 1) % 5, (leader + 2) % 5]
    majority = [r for r in FIVE if r not in minority]
    sim.partition(minority, majority)
    for r in minority:
        sim.request(r, 1)
    quorums = round_of(sim, majority, 1)
    assert len(set(quorums)) == 1 and quorums[0].replica_ids == tuple(majority)
    assert sim.run_until(lambda: all(sim.failed[r] for r in minority), 3.0)
    assert {sim.failed[r][0].reachable for r in minority} == {tuple(sorted(minority))}
    assert all(not sim.delivered[r] for r in minority)


def test_leader_in_the_minority_steps_down_and_the_majority_elects() -> None:
    sim = Sim(FIVE)
    old = settle(sim)
    minority = [old, (old + 1) % 5]
    majority = [r for r in FIVE if r not in minority]
    sim.partition(minority, majority)
    quorums = round_of(sim, majority, 1)
    assert quorums[0].replica_ids == tuple(majority) and quorums[0].leader_id != old
    assert sim.run_until(lambda: sim.states[old].role is not Role.LEADER, 3.0)


def test_restarted_member_rejoins_at_a_new_address() -> None:
    sim = Sim(FIVE)
    leader = settle(sim)
    first = round_of(sim, list(FIVE), 1)[0]
    victim = (leader + 3) % 5
    sim.kill(victim)
    sim.start(victim, seq_base=10_000)
    # The simulation's addresses carry no port; the request says where it is now.
    before = {r: len(sim.delivered[r]) for r in FIVE}
    for r in FIVE:
        moved = "-new" if r == victim else ""
        sim.feed(r, QuorumRequested(2, f"tcp://r{r}{moved}"))
    assert sim.run_until(lambda: all(len(sim.delivered[r]) > before[r] for r in FIVE), 5.0)
    quorum = sim.delivered[(leader + 1) % 5][-1]
    assert quorum.replica_ids == (0, 1, 2, 3, 4)
    assert [m.address for m in quorum.members if m.replica_id == victim] == \
        [f"tcp://r{victim}-new"]
    assert quorum.quorum_id == first.quorum_id + 1


# 80: a replica that forgot its vote on a restart made two leaders in one term
@pytest.mark.parametrize("seed", [*range(12), 80])
def test_random_faults_keep_the_invariants(seed: int) -> None:
    """At most one leader per term; a quorum_id always names one membership;
    quorum ids never go back; a delivered quorum includes its receiver and is
    exactly one a leader formed (compact answers expand to the same value)."""
    rng = random.Random(seed)
    sim = Sim(range(5), seed=seed, latency=0.002, jitter=0.01)
    leaders_by_term: dict[int, set[int]] = {}
    membership: dict[int, frozenset[int]] = {}
    for step in range(1, 41):
        random_fault(sim, rng, step, (0.1, 0.2, 0.3, 0.45))
        for r in range(5):
            if r not in sim.dead and rng.random() < 0.8:
                sim.request(r, step)
        for _ in range(10):
            sim.run(0.03)
            for r, s in sim.states.items():
                if r not in sim.dead and s.role is Role.LEADER:
                    leaders_by_term.setdefault(s.term, set()).add(r)
    for term, leaders in leaders_by_term.items():
        assert len(leaders) == 1, f"term {term} had leaders {leaders}"
    formed = set(sim.formed)
    assert len(formed) == sum(isinstance(a, QuorumFormed) for _, a in sim.actions)
    delivered = {q for quorums in sim.delivered.values() for q in quorums}
    assert delivered <= formed, "a member took a quorum no leader formed (bad expansion?)"
    for r, quorums in sim.delivered.items():
        ids = [q.quorum_id for q in quorums]
        assert ids == sorted(ids), f"replica {r} saw quorum ids go back: {ids}"
        for q in quorums:
            assert q.includes(r)
            assert membership.setdefault(q.quorum_id, frozenset(q.replica_ids)) == \
                frozenset(q.replica_ids), f"quorum {q.quorum_id} named two memberships"
    assert sum(len(q) for q in sim.delivered.values()) > 20  # quorums did form


def test_pre_votes_do_not_raise_terms_in_a_minority() -> None:
    sim = Sim(FIVE)
    leader = settle(sim)
    victim = (leader + 2) % 5
    sim.partition([victim], [r for r in FIVE if r != victim])
    sim.run(3.0)
    requests = [a.message for r, a in sim.actions
                if r == victim and isinstance(a, Send) and isinstance(a.message, VoteRequested)]
    assert requests and all(m.pre_vote for m in requests)
    assert sim.states[victim].term == sim.states[leader].term
