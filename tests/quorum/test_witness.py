"""Witness voters in the pure core, on the simulated network: a quorum smaller than
a majority of the replicas trains when the witnesses endorse it, and never two."""

from __future__ import annotations

from ft_launch.launcher.quorum.election import Send
from ft_launch.launcher.quorum.events import QuorumFormed
from ft_launch.launcher.quorum.model import EndorseRequested, Quorum, voter_weights, witness_ids

from .sim import Sim

W0, W1 = witness_ids(2)


def settle(sim: Sim) -> int:
    assert sim.run_until(sim.stable, 5.0), "no stable leader"
    return sim.leader()


def rounds(sim: Sim, members: list[int], step: int, limit: float = 5.0) -> Quorum:
    """Everyone in ``members`` asks for ``step`` until they all get the same quorum."""
    before = {r: len(sim.delivered[r]) for r in members}
    for r in members:
        sim.request(r, step)
    assert sim.run_until(lambda: all(len(sim.delivered[r]) > before[r] for r in members),
                         limit), f"round {step} incomplete for {members}"
    got = {sim.delivered[r][-1] for r in members}
    assert len(got) == 1, got
    return got.pop()


def settled(sim: Sim, members: list[int], step: int, tries: int = 6) -> Quorum:
    """Rounds from ``step`` on until one has exactly ``members``: a newcomer may miss
    a round (the leader formed it before it heard of the newcomer) and then waits
    for the next one, as a replica that asks every step does."""
    for attempt in range(tries):
        before = {r: len(sim.delivered[r]) for r in members}
        for r in members:
            sim.request(r, step + attempt)
        sim.run_until(lambda b=before: all(len(sim.delivered[r]) > b[r] for r in members), 3.0)
        got = {sim.delivered[r][-1] for r in members if len(sim.delivered[r]) > before[r]}
        if len(got) == 1 and all(len(sim.delivered[r]) > before[r] for r in members):
            quorum = got.pop()
            if quorum.replica_ids == tuple(members):
                return quorum
    raise AssertionError(f"no round of exactly {members} in {tries} tries")


def test_weights_make_all_replicas_or_one_replica_with_the_witnesses_a_majority() -> None:
    for replicas in (2, 3, 5, 12):
        for count in (1, 2, 3):
            weights = voter_weights(range(replicas), witness_ids(count))
            total = sum(weights.values())
            majority = total // 2 + 1
            assert replicas >= majority                     # no witness needed
            assert 1 + (replicas - 1) >= majority          # one replica + every witness
            assert replicas - 1 < majority                 # a replica short, no witness: not


def test_two_replicas_and_a_witness_the_survivor_trains_on_and_the_newcomer_rejoins() -> None:
    sim = Sim(range(2), witnesses=(W0,))
    assert settle(sim) in (0, 1)
    first = rounds(sim, [0, 1], 1)
    assert first.replica_ids == (0, 1)
    sim.kill(1)
    quorum = None
    for step in range(2, 6):
        quorum = rounds(sim, [0], step)
    assert quorum is not None and quorum.replica_ids == (0,)
    sim.start(1, seq_base=100)
    settled(sim, [0, 1], 10)


def test_three_replicas_lose_two_and_the_last_trains_on() -> None:
    sim = Sim(range(3), witnesses=(W0,))
    settle(sim)
    rounds(sim, [0, 1, 2], 1)
    sim.kill(1)
    sim.kill(2)
    assert rounds(sim, [0], 2, limit=10.0).replica_ids == (0,)
    assert rounds(sim, [0], 3).replica_ids == (0,)


def test_a_partition_trains_on_one_side_only_and_heals() -> None:
    sim = Sim(range(3), witnesses=(W0,))
    settle(sim)
    rounds(sim, [0, 1, 2], 1)
    sim.partition([0], [1, 2, W0])
    cut_at = len(sim.delivered[0])
    for r in (0, 1, 2):
        sim.request(r, 2)
    assert sim.run_until(lambda: len(sim.delivered[1]) > 1 and len(sim.delivered[2]) > 1, 10.0)
    sim.run(3.0)
    assert len(sim.delivered[0]) == cut_at, "the cut-off replica was answered"
    assert sim.delivered[1][-1].replica_ids == (1, 2)
    sim.heal()
    settled(sim, [0, 1, 2], 5)


def test_the_side_without_the_witness_cannot_train_even_with_the_old_leader() -> None:
    sim = Sim(range(2), witnesses=(W0,))
    leader = settle(sim)
    other = 1 - leader
    rounds(sim, [0, 1], 1)
    sim.partition([leader], [other, W0])
    for r in (0, 1):
        sim.request(r, 2)
    assert sim.run_until(lambda: len(sim.delivered[other]) > 1, 10.0)
    sim.run(3.0)
    assert len(sim.delivered[leader]) == 1


def test_losing_a_witness_then_a_replica_trains_on() -> None:
    sim = Sim(range(3), witnesses=(W0, W1))
    settle(sim)
    rounds(sim, [0, 1, 2], 1)
    sim.kill(W0)
    assert rounds(sim, [0, 1, 2], 2, limit=10.0).replica_ids == (0, 1, 2)
    victim = next(r for r in range(3) if r != sim.leader())
    sim.kill(victim)
    left = [r for r in range(3) if r != victim]
    assert rounds(sim, left, 3, limit=10.0).replica_ids == tuple(left)


def test_without_witnesses_a_lone_survivor_of_two_cannot_train() -> None:
    sim = Sim(range(2))
    settle(sim)
    rounds(sim, [0, 1], 1)
    sim.kill(1)
    sim.request(0, 2)
    sim.run(5.0)
    assert len(sim.delivered[0]) == 1 and sim.failed[0]


def test_a_witness_refuses_a_quorum_disjoint_from_the_last_it_endorsed() -> None:
    sim = Sim(range(2), witnesses=(W0,))
    settle(sim)
    rounds(sim, [0, 1], 1)
    sim.kill(1)
    rounds(sim, [0], 2)
    # Replica 0 dies too; a fresh replica 1 (no history of 0's steps) must not
    # train from its own old state: the witness last endorsed {0}.
    sim.kill(0)
    sim.start(1, seq_base=100)
    answers, actions = len(sim.delivered[1]), len(sim.actions)
    sim.request(1, 1)
    sim.run(8.0)
    assert len(sim.delivered[1]) == answers
    later = sim.actions[actions:]
    formed = [a for r, a in later if r == 1 and isinstance(a, QuorumFormed)]
    asked = [a for r, a in later if r == 1 and isinstance(a, Send)
             and isinstance(a.message, EndorseRequested)]
    assert asked and not formed
