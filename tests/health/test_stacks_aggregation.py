"""Stack-trace aggregation: the pure grouping and group choice on scripted stacks,
and the whole tracer on real processes captured with py-spy (one blocked in a
different function, one SIGSTOPped)."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from benchmarks.detection.tracer import fail_slow_eviction, hang_eviction
from ft_launch.health.aggregation import (
    FailSlowVote,
    GroupKey,
    RankPlace,
    aggregate,
    choose_eviction,
    hang_suspects,
    signature,
)
from ft_launch.health.stacks import Frame, ProcessStack, ThreadStack, parse_pyspy_json

WORKER = Path(__file__).with_name("stack_worker.py")
SITE = "/usr/lib/python3.11/site-packages/zmq/sugar/socket.py"


def stack(pid, *functions, state="S", library_leaf=None, error=""):
    frames = [Frame(f, "/work/train.py") for f in reversed(functions)]
    if library_leaf:
        frames.insert(0, Frame(library_leaf, SITE))
    return ProcessStack(pid, state, (ThreadStack("MainThread", tuple(frames), main=True),), error)


def topology(replicas=3, stages=2):
    """One rank per node; a replica is one pipeline of ``stages`` stages."""
    return [RankPlace(rank=r, node=f"n{r}", replica_id=r // stages, dp_group=r % stages,
                      tp_group=r, pp_group=r // stages) for r in range(replicas * stages)]


def test_signature_ignores_library_leaves_and_lines():
    a = stack(1, "main", "train_step", "wait_allreduce", library_leaf="poll")
    b = stack(2, "main", "train_step", "wait_allreduce", library_leaf="recv_multipart")
    assert signature(a) == signature(b) == \
        "main@train.py > train_step@train.py > wait_allreduce@train.py"
    assert signature(stack(3, error="py-spy timed out")).startswith("<unreadable")


def test_outliers_and_the_shared_pipeline_group_are_evicted():
    stacks = {r: stack(r, "main", "wait_allreduce") for r in range(6)}
    stacks[4] = stack(4, "main", "forward", "attention")          # hung in compute
    stacks[5] = stack(5, "main", "recv_activation")                # its pipeline peer waits
    found = aggregate(stacks)
    assert found.groups[0].ranks == (0, 1, 2, 3) and found.outliers == (4, 5)
    decision = choose_eviction(found.outliers, topology())
    assert decision.group == GroupKey("pp", "2") and decision.nodes == ("n4", "n5")
    assert decision.covers_all


def test_a_single_outlier_evicts_its_node_and_stopped_processes_count():
    stacks = {r: stack(r, "main", "wait_allreduce", state="T" if r == 3 else "S")
              for r in range(6)}
    found = aggregate(stacks)
    assert found.outliers == (3,)                 # same stack, but stopped
    decision = choose_eviction(found.outliers, topology())
    assert decision.group == GroupKey("node", "n3") and decision.nodes == ("n3",)
    assert choose_eviction([], topology()) is None


def test_a_tie_for_largest_group_is_ambiguous_and_marks_no_group():
    stacks = {r: stack(r, "main", "compute_forward" if r % 2 == 0 else "recv_activation")
              for r in range(6)}
    found = aggregate(stacks)
    assert found.ambiguous and found.outliers == ()
    stacks[2] = stack(2, "main", "compute_forward", state="T")
    assert aggregate(stacks).outliers == (2,)       # a stopped process still counts
    assert not aggregate(stacks).majority


def test_scattered_outliers_pick_the_group_with_most():
    decision = choose_eviction([0, 1, 4], topology())
    assert decision.group == GroupKey("pp", "0") and not decision.covers_all


def sample(top, outliers):
    """An aggregation whose healthy group has ``top`` ranks of 6, plus its decision."""
    from ft_launch.health.aggregation import Aggregation, StackGroup
    rest = 6 - top
    found = Aggregation((StackGroup("wait", tuple(range(top))), StackGroup("x", (9,) * rest)),
                        tuple(outliers))
    return found, choose_eviction(outliers, topology())


def test_fail_slow_vote_counts_majority_rounds_only():
    vote = FailSlowVote()
    # Rank 2 is slow and rank 3 (its pipeline peer) waits on it; a sample early in a
    # step (healthy group of 3 of 6) names healthy ranks and must not vote.
    for top, outliers in ((5, [2]), (3, [0, 4, 5]), (3, [0, 4]), (4, [2, 3]), (5, [2])):
        vote.add(*sample(top, outliers))
    assert len(vote.usable()) == 3
    assert vote.winner().group == GroupKey("node", "n2")
    assert FailSlowVote().winner() is None


def test_parse_pyspy_json_marks_the_main_thread():
    text = json.dumps([{"pid": 9, "thread_id": 1, "thread_name": "heartbeat", "os_thread_id": 10,
                        "frames": [{"name": "wait", "filename": "/x/threading.py"}]},
                       {"pid": 9, "thread_id": 2, "thread_name": "MainThread", "os_thread_id": 9,
                        "frames": [{"name": "step", "filename": "/w/train.py", "line": 3}]}])
    parsed = parse_pyspy_json(9, text, "S")
    assert [t.main for t in parsed.threads] == [False, True]
    assert ProcessStack.from_dict(parsed.to_dict()) == parsed


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")
@pytest.mark.timeout(60)
def test_tracer_on_real_processes_finds_the_hung_pipeline(stack_workers):
    procs = [stack_workers("stuck_in_dataloader" if rank == 4 else "wait_collective")
             for rank in range(6)]
    os.kill(procs[5].pid, signal.SIGSTOP)
    found, decision = hang_eviction({rank: p.pid for rank, p in enumerate(procs)}, topology())
    assert found.outliers == (4, 5)
    assert "wait_collective" in found.groups[0].signature
    assert decision.group == GroupKey("pp", "2") and decision.nodes == ("n4", "n5")
    rounds = []

    def counting_capture(pids):
        from ft_launch.health.stacks import capture_all
        rounds.append(1)
        return capture_all(pids)
    winner = fail_slow_eviction({rank: p.pid for rank, p in enumerate(procs)}, topology(),
                                rounds=2, interval=0.01, capture=counting_capture)
    assert winner.group == GroupKey("pp", "2") and len(rounds) == 2   # 4 of 6 agree


TORCH_C10D = "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def in_collective(pid, *functions):
    """A rank blocked in a torch collective called from ``functions`` (outermost first)."""
    found = stack(pid, *functions)
    thread = found.threads[0]
    frames = (Frame("all_reduce", TORCH_C10D), *thread.frames)
    return ProcessStack(pid, "S", (ThreadStack("MainThread", frames, main=True),))


def replica_of_nodes(*nodes):
    """One rank per node, all in replica 0, no tensor or pipeline groups."""
    return [RankPlace(rank=r, node=n, replica_id=0) for r, n in enumerate(nodes)]


def test_in_a_tied_pair_the_rank_not_waiting_for_its_peer_is_the_outlier():
    """Two ranks: rank 0 waits in the commit vote's collective, rank 1 is deadlocked in
    its own code. Two stacks of one rank each tie; the wait breaks the tie."""
    stacks = {0: in_collective(10, "main", "commit", "all_true"),
              1: stack(11, "main", "commit", "injected_deadlock")}
    found, decision = hang_suspects(stacks, replica_of_nodes("n1a", "n1b"))
    assert found.outliers == (1,) and found.waiting == (0,) and not found.ambiguous
    assert decision.group == GroupKey("node", "n1b") and decision.nodes == ("n1b",)
    # both waiting, or neither: no way to tell, every rank suspect, the whole replica
    both = {0: stacks[0], 1: in_collective(11, "main", "forward", "all_gather")}
    found, decision = hang_suspects(both, replica_of_nodes("n1a", "n1b"))
    assert found.ambiguous and found.outliers == ()
    assert decision.group == GroupKey("replica", "0") and decision.nodes == ("n1a", "n1b")


def test_ranks_all_alike_make_every_rank_of_the_replica_suspect():
    stacks = {r: in_collective(r, "main", "commit", "all_true") for r in range(4)}
    found, decision = hang_suspects(stacks, replica_of_nodes("a", "b", "c", "d"))
    assert found.outliers == () and not found.ambiguous
    assert decision.nodes == ("a", "b", "c", "d") and decision.covers_all


def test_a_layout_without_tensor_or_pipeline_groups_has_only_node_and_replica_groups():
    from ft_launch.health.aggregation import parallel_groups
    kinds = {key.kind for key in parallel_groups(replica_of_nodes("a", "b"))}
    assert kinds == {"node", "replica"}


def test_ft_launch_frames_count_as_ours_even_when_installed_in_site_packages(monkeypatch):
    from ft_launch.health import aggregation
    site = "/usr/lib/python3.11/site-packages/"
    monkeypatch.setattr(aggregation, "OWN_PREFIXES", (site + "launcher/",))
    assert not aggregation.is_library(site + "launcher/worker/faults.py")
    assert aggregation.is_library(SITE) and aggregation.is_library(TORCH_C10D)
