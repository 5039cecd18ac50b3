"""Stack-trace aggregation: the pure grouping and group choice on scripted stacks,
and the whole tracer on real processes captured with py-spy (one blocked in a
different function, one SIGSTOPped)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from health.aggregation import (
    FailSlowVote,
    GroupKey,
    RankPlace,
    aggregate,
    choose_eviction,
    signature,
)
from health.stacks import Frame, ProcessStack, ThreadStack, parse_pyspy_json
from health.tracer import fail_slow_eviction, hang_eviction

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
    from health.aggregation import Aggregation, StackGroup
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


@pytest.fixture
def workers():
    """Start stand-in training processes; stop and reap them all afterwards."""
    started = []

    def start(function):
        proc = subprocess.Popen([sys.executable, str(WORKER), function], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        started.append(proc)
        assert proc.stdout.readline().strip() == f"ready {function}"  # blocks until it is there
        return proc
    yield start
    for proc in started:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")
@pytest.mark.timeout(60)
def test_tracer_on_real_processes_finds_the_hung_pipeline(workers):
    procs = [workers("stuck_in_dataloader" if rank == 4 else "wait_collective")
             for rank in range(6)]
    os.kill(procs[5].pid, signal.SIGSTOP)
    found, decision = hang_eviction({rank: p.pid for rank, p in enumerate(procs)}, topology())
    assert found.outliers == (4, 5)
    assert "wait_collective" in found.groups[0].signature
    assert decision.group == GroupKey("pp", "2") and decision.nodes == ("n4", "n5")
    rounds = []

    def counting_capture(pids):
        from health.stacks import capture_all
        rounds.append(1)
        return capture_all(pids)
    winner = fail_slow_eviction({rank: p.pid for rank, p in enumerate(procs)}, topology(),
                                rounds=2, interval=0.01, capture=counting_capture)
    assert winner.group == GroupKey("pp", "2") and len(rounds) == 2   # 4 of 6 agree
