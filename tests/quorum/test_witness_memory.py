"""A witness's memory survives its restart: the file, the pure restore, and real
processes. Without it a restarted witness would endorse the other side's round."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ft_launch.launcher.quorum.model import Memory, Quorum, witness_ids
from ft_launch.launcher.quorum.witness_service import MemoryFile
from tests.waiting import wait_until

from .cluster import JOB as JOB_OF_CLUSTER
from .cluster import Cluster
from .sim import Sim
from .test_witness import rounds, settle

[W0] = witness_ids(1)
JOB = "job-7"


# --------------------------------------------------------------------------- the file


def test_the_memory_file_round_trips_and_starts_empty(tmp_path: Path) -> None:
    store = MemoryFile(tmp_path / "w.json", JOB)
    assert store.load() == Memory()                      # a witness new to the job
    store.save(Memory(7, 1, frozenset({1, 0})))
    assert store.load() == Memory(7, 1, frozenset({0, 1}))
    store.save(Memory(8, None, None))
    assert store.load() == Memory(8, None, None)


@pytest.mark.parametrize("text", [
    "{not json",
    '{"job_id": "job-7", "term": 3}',
    '{"job_id": "job-7", "term": "x", "voted_for": null, "endorsed": []}',
    '{"job_id": "job-8", "term": 3, "voted_for": null, "endorsed": [1]}',
    "[1, 2]",
])
def test_an_unreadable_memory_endorses_nothing_until_told_of_a_round(
        tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "w.json"
    path.write_text(text)
    assert MemoryFile(path, JOB).load() == Memory(endorsed=frozenset())
    assert str(path) in caplog.text and "endorses nothing" in caplog.text


def test_the_memory_file_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "w.json"
    store = MemoryFile(path, JOB)
    store.save(Memory(1, None, frozenset({0})))
    store.save(Memory(2, 0, frozenset({0, 1})))
    assert json.loads(path.read_text()) == {"job_id": JOB, "term": 2, "voted_for": 0,
                                            "endorsed": [0, 1]}
    assert [p.name for p in tmp_path.iterdir()] == ["w.json"]   # no temporary left


# --------------------------------------------------------------------------- the core


def _restart_witness(sim: Sim, remember: bool) -> None:
    """The witness starts again, with its memory or without."""
    memory = sim.states[W0].memory()
    sim.start(W0, remember=False)
    if remember:
        sim.states[W0].restore(memory)


@pytest.mark.parametrize("remember", [True, False])
def test_a_restarted_witness_endorses_the_other_side_only_if_it_forgot(
        remember: bool) -> None:
    """Replica 0 trains alone with the witness; then 0 is gone, the witness
    restarts, and replica 1 (which missed 0's rounds) asks alone."""
    sim = Sim(range(2), witnesses=(W0,))
    settle(sim)
    rounds(sim, [0, 1], 1)
    sim.kill(1)
    assert rounds(sim, [0], 2, limit=10.0).replica_ids == (0,)
    sim.kill(0)
    _restart_witness(sim, remember)
    sim.start(1, seq_base=100)
    before = len(sim.delivered[1])
    sim.request(1, 3)
    trained = sim.run_until(lambda: len(sim.delivered[1]) > before, 10.0)
    assert trained is not remember
    assert sim.states[1].role.value == "leader"   # elected with the witness's vote either way


def test_a_restarted_witness_keeps_its_term_and_vote() -> None:
    sim = Sim(range(2), witnesses=(W0,))
    settle(sim)
    before = sim.states[W0].memory()
    _restart_witness(sim, remember=True)
    after = sim.states[W0]
    assert (after.term, after.voted_for) == (before.term, before.voted_for)


# --------------------------------------------------------------------------- processes


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(running: int, **kwargs: object) -> Cluster:
        made.append(Cluster(tmp_path / str(len(made)), running, **kwargs))  # type: ignore[arg-type]
        return made[-1]
    yield make
    for c in made:
        c.close()


@pytest.mark.timeout(180)
def test_a_restarted_witness_process_refuses_the_side_that_missed_rounds(
        cluster: Callable[..., Cluster]) -> None:
    c = cluster(2, witnesses=(W0,), witness_memory=True)
    c.first_round([0, 1])
    victim = c.leader()
    survivor = 1 - victim
    c.kill(victim)
    alone = c.settled_round([survivor], 2, expect=[survivor])
    remembered = MemoryFile(Path(c.memory_of(W0)), JOB_OF_CLUSTER).load()
    assert remembered.endorsed == frozenset({survivor})
    c.kill(survivor)
    c.kill(W0)
    c.start(W0)
    c.start(victim)
    c.ask([victim], alone.max_step + 1)
    # The witness votes for the newcomer (it leads) but refuses its round.
    wait_until(lambda: c.status(victim).leader_id == victim, c.round_timeout,
               "the newcomer to lead with the witness's vote")
    wait_until(lambda: c.members[W0].call("stats")["endorsements_refused"] > 0,
               c.round_timeout, "the restarted witness to refuse the newcomer's round")
    c.members[victim].pump()
    assert not isinstance(c.members[victim].answers.get(alone.max_step + 1), Quorum)
    # Both replicas together are a majority of the votes: they form without it.
    c.start(survivor)
    both = sorted([victim, survivor])
    assert c.settled_round(both, alone.max_step + 2, expect=both).replica_ids == tuple(both)
