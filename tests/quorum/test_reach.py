"""The controller's witness address (``reach``) and what the replicas believe of it.

The address is the source of this host's route to the nodes, never loopback while
the nodes are elsewhere. Without one the controller does not vote, the witness
file says so, and a replica counts no witness 0: a survivor of two replicas then
waits for a majority instead of training alone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from ft_launch.config import QuorumConfig
from ft_launch.errors import UsageError
from ft_launch.ids import new_job_secret
from ft_launch.launcher.controller.events import ControllerWitnessChosen
from ft_launch.launcher.quorum import FileDirectory, QuorumAgent
from ft_launch.launcher.quorum.errors import MajorityLostError, QuorumTimeoutError
from ft_launch.launcher.quorum.model import WITNESS_BASE
from ft_launch.launcher.quorum.reach import (
    Route,
    choose_address,
    is_loopback,
    probe,
    route_to,
    spread,
)
from ft_launch.launcher.quorum.witness_service import (
    WitnessJob,
    controller_witness,
    run_witnesses,
    serve,
)
from ft_launch.launcher.reporting.status import StandbyPool, run_status, status_text
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

FAST = QuorumConfig(heartbeat_interval=0.05, election_timeout=0.3, member_timeout=0.6,
                    join_timeout=0.3)
#: A name that never resolves (RFC 6761): a node this host cannot reach.
UNRESOLVABLE = "no-such-node.invalid"


# --------------------------------------------------------------------------- pure


def test_the_source_of_the_route_to_the_nodes_is_chosen() -> None:
    routes = [Route(f"n{i}", f"10.1.0.{i}", "10.1.0.250") for i in range(1, 4)]
    reach = choose_address(routes)
    assert reach.address == "10.1.0.250"
    assert "n1" in reach.reason and "10.1.0.1" in reach.reason


def test_only_loopback_while_the_nodes_are_elsewhere_is_no_address() -> None:
    reach = choose_address([Route("n1", "10.1.0.1", "10.1.0.250"),
                            Route("n2", "10.1.0.2", "127.0.0.1")])
    assert reach.address is None
    assert "only loopback (127.0.0.1)" in reach.reason and "node n2" in reach.reason


def test_a_node_without_a_route_or_an_address_is_no_address() -> None:
    unrouted = choose_address([Route("n1", "10.1.0.1", "10.1.0.250"),
                               Route("n2", "10.2.0.2", None), Route("n3", "10.2.0.3", None)])
    assert unrouted.address is None
    assert unrouted.reason == "no route from this host to node n2 (10.2.0.2) (and 1 more)"
    unresolved = choose_address([Route("n1", None, None), Route("n2", "10.1.0.2", "10.1.0.9")])
    assert unresolved.address is None and "node n1's address does not resolve" in \
        unresolved.reason
    assert choose_address([]).address is None


def test_a_node_at_a_loopback_address_is_this_host_and_says_nothing_of_the_others() -> None:
    # e.g. the batch host, whose own name resolves to 127.0.1.1 on it
    mixed = choose_address([Route("n1", "127.0.1.1", "127.0.0.1"),
                            Route("n2", "10.1.0.2", "10.1.0.1")])
    assert mixed.address == "10.1.0.1" and "node n2" in mixed.reason
    alone = choose_address([Route("n1", "127.0.0.1", "127.0.0.1"),
                            Route("n2", "::1", "::1")])
    assert alone.address == "127.0.0.1" and alone.reason == "every node is this host"


def test_nodes_reached_from_two_addresses_get_the_commoner_one_and_a_note() -> None:
    reach = choose_address([Route("n1", "10.1.0.1", "10.1.0.250"),
                            Route("n2", "10.2.0.2", "10.2.0.250"),
                            Route("n3", "10.1.0.3", "10.1.0.250")])
    assert reach.address == "10.1.0.250" and "2 of 3 probed nodes" in reach.reason


def test_loopback_addresses() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1"]))
    assert not any(map(is_loopback, ["10.0.0.1", "::ffff:10.0.0.1", "fe80::1%eth0", "n1", ""]))


def test_the_probed_nodes_are_spread_over_the_allocation() -> None:
    nodes = [(f"n{i}", f"10.0.{i // 250}.{i % 250}") for i in range(1000)]
    probed = spread(nodes, 32)
    assert len(probed) == len(set(probed)) == 32
    assert probed[0] == nodes[0] and probed[-1] == nodes[-1]
    assert spread(nodes[:5], 32) == nodes[:5]


# --------------------------------------------------------------------------- shell


def test_a_real_route_to_loopback_and_to_a_name_that_does_not_resolve() -> None:
    assert route_to("here", "127.0.0.1") == Route("here", "127.0.0.1", "127.0.0.1")
    assert route_to("gone", UNRESOLVABLE) == Route("gone", None, None)


@pytest.fixture
def job() -> WitnessJob:
    return WitnessJob("job-1", new_job_secret(), replicas=2)


@pytest.fixture
def replicas() -> Iterator[list[QuorumAgent]]:
    """A function's worth of replica agents, each counting the witnesses the run
    directory names (``run_witnesses``, as the worker's manager does)."""
    started: list[QuorumAgent] = []
    yield started
    for agent in started:
        agent.stop()


def start_replicas(run_dir: Path, job: WitnessJob, started: list[QuorumAgent]) -> None:
    witnesses = run_witnesses(run_dir, FAST, controlled=True)
    for r in range(job.replicas):
        started.append(QuorumAgent(r, range(job.replicas),
                                   FileDirectory(run_dir / "peers", job.secret, job.job_id),
                                   job.secret, FAST, job_id=job.job_id,
                                   witnesses=witnesses).start())


def test_a_controller_that_reaches_the_nodes_votes_and_a_lone_survivor_trains_on(
        tmp_path: Path, job: WitnessJob, replicas: list[QuorumAgent]) -> None:
    witness, reach = controller_witness(tmp_path, job, FAST, probe([("n1", "127.0.0.1"),
                                                                    ("n2", "localhost")]))
    assert witness is not None
    try:
        assert reach.address == "127.0.0.1" and witness.address.startswith("tcp://127.0.0.1:")
        assert WitnessJob.read(tmp_path).controller is True
        assert run_witnesses(tmp_path, FAST, controlled=True) == (WITNESS_BASE,)
        assert run_witnesses(tmp_path, FAST, controlled=False) == ()
        start_replicas(tmp_path, job, replicas)
        both = [a.request_quorum(0) for a in replicas]
        assert {f.result(30).replica_ids for f in both} == {(0, 1)}
        replicas.pop().stop()
        survivor = replicas[0]
        # one replica and the witness are a majority of the votes
        alone = [survivor.get_quorum(step, timeout=30).replica_ids for step in (1, 2)]
        assert alone[-1] == (0,), alone
    finally:
        witness.stop()


def test_a_controller_that_reaches_no_node_does_not_vote_and_no_replica_counts_it(
        tmp_path: Path, job: WitnessJob, replicas: list[QuorumAgent]) -> None:
    witness, reach = controller_witness(tmp_path, job, FAST, probe([("n1", "127.0.0.1"),
                                                                    ("n2", UNRESOLVABLE)]))
    assert witness is None and reach.address is None
    assert reach.reason == "node n2's address does not resolve on this host"
    assert WitnessJob.read(tmp_path).controller is False
    assert run_witnesses(tmp_path, FAST, controlled=True) == ()
    more = QuorumConfig(witnesses=1)
    assert run_witnesses(tmp_path, more, controlled=True) == (WITNESS_BASE + 1,)
    start_replicas(tmp_path, job, replicas)
    both = [a.request_quorum(0) for a in replicas]
    assert {f.result(30).replica_ids for f in both} == {(0, 1)}
    replicas.pop().stop()
    # one replica of two, with no witness: never a quorum
    with pytest.raises((MajorityLostError, QuorumTimeoutError)):
        for step in range(1, 4):
            replicas[0].get_quorum(step, timeout=FAST.member_timeout * 6)


def test_switched_off_the_controller_does_not_vote_and_status_says_why(
        tmp_path: Path, job: WitnessJob) -> None:
    witness, reach = controller_witness(tmp_path, job, QuorumConfig(controller_witness=False),
                                        probe([("n1", "127.0.0.1")]))
    assert witness is None and reach.reason == "quorum.controller_witness = false"
    assert WitnessJob.read(tmp_path).controller is False
    chosen = ControllerWitnessChosen(voting=False, address="", reason=reach.reason)
    text = status_text(run_status(tmp_path, [chosen], {}, StandbyPool((), ()), chosen.time))
    assert "controller witness: NOT voting (quorum.controller_witness = false)" in text
    voting = ControllerWitnessChosen(voting=True, address="10.1.0.1", reason="route")
    text = status_text(run_status(tmp_path, [chosen, voting], {}, StandbyPool((), ()),
                                  voting.time))
    assert "  controller witness: votes at 10.1.0.1" in text


def test_a_replica_of_a_controlled_run_without_the_witness_file_is_told_which() -> None:
    with pytest.raises(UsageError, match="quorum-witness.json does not exist"):
        run_witnesses(Path("/nonexistent-run-dir"), FAST, controlled=True)


def test_the_witness_file_names_the_probed_nodes_and_reads_them_back(tmp_path: Path) -> None:
    nodes = tuple((f"n{i}", f"10.2.{i // 256}.{i % 256}") for i in range(100))
    WitnessJob("job-1", "s", 3, controller=True, nodes=nodes).write(tmp_path)
    read = WitnessJob.read(tmp_path)
    assert read.controller and read.replicas == 3
    assert read.nodes == tuple(spread(nodes)) and read.nodes[0] == nodes[0] \
        and read.nodes[-1] == nodes[-1]


def test_an_extra_witness_votes_at_its_routes_source_address(
        tmp_path: Path, job: WitnessJob) -> None:
    """``ft-launch witness``'s service: the address it advertises (in the peer
    directory every replica reads) is the source of its route to the job's nodes."""
    replace(job, nodes=(("n1", "127.0.0.1"),)).write(tmp_path)
    stop = threading.Event()
    config = QuorumConfig(witnesses=1)
    server = threading.Thread(target=serve, args=(tmp_path, 1, config, stop), daemon=True)
    server.start()
    try:
        directory = FileDirectory(tmp_path / "peers", job.secret, job.job_id)
        record = wait_until(lambda: directory.lookup(WITNESS_BASE + 1)
                            or not server.is_alive() and "stopped", 30,
                            "witness 1 to publish its address")
        assert record != "stopped", "the witness service ended before it published"
        assert record.address.startswith("tcp://127.0.0.1:"), record
    finally:
        stop.set()
        server.join(30)
    assert not server.is_alive()


def test_an_extra_witness_that_reaches_no_node_refuses_to_vote_and_says_why(
        tmp_path: Path, job: WitnessJob) -> None:
    replace(job, nodes=(("n1", "127.0.0.1"), ("n2", UNRESOLVABLE))).write(tmp_path)
    with pytest.raises(UsageError, match="witness 1 cannot vote from this host: node n2's "
                                         "address does not resolve on this host"):
        serve(tmp_path, 1, QuorumConfig(witnesses=1), threading.Event())
    job.write(tmp_path)   # written by a controller that probed nothing
    with pytest.raises(UsageError, match="names no nodes to reach"):
        serve(tmp_path, 1, QuorumConfig(witnesses=1), threading.Event())
