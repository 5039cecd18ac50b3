"""Hang diagnosis (``ft_launch.launcher.controller.diagnosis``): the report built from each
node's stacks (pure), the ranks' pid files, and the injected deadlock as py-spy sees it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ft_launch.health.stacks import Frame, ProcessStack, ThreadStack, capture, process_state
from ft_launch.launcher.controller.diagnosis import (
    HangRequest,
    build_report,
    parse_node_stacks,
    report_text,
)
from ft_launch.launcher.worker.identity import WorkerIdentity
from ft_launch.launcher.worker.pids import (
    RankProcess,
    clear_rank_pids,
    read_rank_pids,
    write_rank_pid,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
TORCH_C10D = "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"
FAULTS = str(REPO / "tests" / "faults" / "injector.py")
MANAGER = str(REPO / "launcher" / "worker" / "manager.py")


def main_stack(pid: int, *frames: Frame, state: str = "S") -> ProcessStack:
    """``frames`` innermost first, as py-spy lists them."""
    return ProcessStack(pid, state, (ThreadStack("MainThread", frames, main=True),))


def waiting_in_the_vote(pid: int) -> ProcessStack:
    return main_stack(pid, Frame("all_reduce", TORCH_C10D, 3252),
                      Frame("commit", MANAGER, 380), Frame("main", "/w/train.py", 9))


def deadlocked(pid: int) -> ProcessStack:
    return main_stack(pid, Frame("injected_deadlock", FAULTS, 121),
                      Frame("check", FAULTS, 110), Frame("commit", MANAGER, 366),
                      Frame("main", "/w/train.py", 9))


def request(tmp_path: Path, nodes=("n1a", "n1b"), tasks_per_node=1) -> HangRequest:
    return HangRequest(1, nodes, tasks_per_node, "replica 1 made no progress for 5 s",
                       tmp_path)


def test_the_deadlocked_rank_of_a_pair_and_its_node_are_named(tmp_path):
    processes = [RankProcess(1, 0, "n1a", 10), RankProcess(1, 1, "n1b", 11)]
    stacks = {"n1a": {10: waiting_in_the_vote(10)}, "n1b": {11: deadlocked(11)}}
    report = build_report(request(tmp_path), processes, stacks, {}, 1.5)
    assert report.suspects == ("n1b",) and report.found.outliers == (1,)
    assert report.summary() == "rank 1 on n1b, pid 11 in injected_deadlock (injector.py:121)"
    text = report_text(report)
    assert "* rank 1 on n1b" in text and "   rank 0 on n1a, pid 10 in commit" in text
    assert f"all_reduce ({TORCH_C10D}:3252)" in text     # the whole stack, library too
    as_json = report.to_json()
    assert as_json["waiting"] == [0] and as_json["evict"]["nodes"] == ["n1b"]
    assert json.loads(json.dumps(as_json)) == as_json


def test_ranks_without_a_stack_are_suspects_and_say_why(tmp_path):
    """Rank 0's node did not answer; rank 1 wrote no pid file (stuck before its
    manager started): both are suspect, so both nodes go."""
    processes = [RankProcess(1, 0, "n1a", 10)]
    report = build_report(request(tmp_path), processes, {},
                          {"n1a": "no stacks from n1a within 30 s"}, 30.0)
    assert report.suspects == ("n1a", "n1b") and report.found.outliers == (0, 1)
    assert "rank 0 on n1a, pid 10 no stack (no stacks from n1a within 30 s)" in report.summary()
    assert "rank 1 on n1b no stack (no pid file" in report.summary()


def test_pid_files_of_nodes_the_replica_no_longer_has_are_ignored(tmp_path):
    """After a relaunch on a standby, a rank's old file may still name the old node."""
    processes = [RankProcess(1, 0, "n1a", 10), RankProcess(1, 1, "old", 99)]
    stacks = {"n1a": {10: waiting_in_the_vote(10)}, "old": {99: deadlocked(99)}}
    report = build_report(request(tmp_path, nodes=("n1a", "s1")), processes, stacks, {}, 1.0)
    row = report.ranks[1]
    assert (row.node, row.pid) == ("s1", None) and "no pid file" in row.stack.error


def test_ranks_all_waiting_alike_name_no_rank_and_every_node(tmp_path):
    processes = [RankProcess(1, r, n, 10 + r) for r, n in enumerate(("n1a", "n1a", "n1b",
                                                                      "n1b"))]
    stacks = {"n1a": {10: waiting_in_the_vote(10), 11: waiting_in_the_vote(11)},
              "n1b": {12: waiting_in_the_vote(12), 13: waiting_in_the_vote(13)}}
    report = build_report(request(tmp_path, tasks_per_node=2), processes, stacks, {}, 1.0)
    assert not report.singled_out and report.suspects == ("n1a", "n1b")
    assert report.summary().startswith("no rank stands out (4 ranks, 1 stacks)")


def test_node_stacks_that_are_not_ours_are_refused():
    for text in ("{}", "[{\"pid\": \"x\"}]", "[{\"threads\": []}]", "[1]", "not json"):
        with pytest.raises(ValueError):
            parse_node_stacks(text)
    stack = deadlocked(11)
    assert parse_node_stacks(json.dumps([{"rank": -1, **stack.to_dict()}])) == {11: stack}


def test_pid_files_are_written_read_and_cleared_per_replica(tmp_path):
    for replica, rank, node in ((1, 0, "n1a"), (1, 1, "n1b"), (10, 0, "n9")):
        write_rank_pid(WorkerIdentity("7", replica, 11, rank, 2, "h", tmp_path, "s",
                                      node=node), pid=100 + rank)
    (tmp_path / "pids" / "replica-1-rank-2.json").write_text("{not json")
    found, problems = read_rank_pids(tmp_path, 1)
    assert found == [RankProcess(1, 0, "n1a", 100), RankProcess(1, 1, "n1b", 101)]
    assert len(problems) == 1 and "replica-1-rank-2.json" in problems[0]
    clear_rank_pids(tmp_path, 1)
    assert read_rank_pids(tmp_path, 1) == ([], [])
    assert read_rank_pids(tmp_path, 10)[0] == [RankProcess(10, 0, "n9", 100)]


DEADLOCKING_RANK = """
import sys
from tests.faults.injector import FaultInjector, FaultPoint, parse_faults
injector = FaultInjector(parse_faults("hang@before_commit:4/1"))
injector.check(FaultPoint.BEFORE_COMMIT, 3)
print("step 4", flush=True)
injector.check(FaultPoint.BEFORE_COMMIT, 4)
print("not reached", flush=True)
"""


@pytest.mark.skipif(shutil.which("py-spy") is None, reason="py-spy not installed")
def test_the_injected_hang_blocks_the_thread_where_its_stack_shows_it():
    proc = subprocess.Popen([sys.executable, "-c", DEADLOCKING_RANK], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "step 4"
        def main_frames() -> list[str]:
            stack = capture(proc.pid, timeout=20)
            assert not stack.error, stack.error
            return [f.function for t in stack.threads if t.main for f in t.frames]

        # the deadlock is entered just after the line is printed
        frames = wait_until(lambda: (f := main_frames())[:1] == ["injected_deadlock"] and f,
                            20, "the rank to enter the deadlock")
        assert frames[1].endswith("check")          # FaultInjector.check (qualified)
        assert proc.poll() is None and process_state(proc.pid) != "T"   # alive, not stopped
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_task_announces_the_pid_its_training_command_runs_as(tmp_path):
    """``ft_launch.launcher.worker.task`` writes the file before it execs the command: a rank
    hung before its manager starts (imports, rendezvous) can be found too."""
    env = {**os.environ, "FTL_WORKER_REPLICA_ID": "1", "FTL_WORKER_NUM_REPLICAS": "2",
           "FTL_WORKER_RUN_DIR": str(tmp_path), "FTL_WORKER_SECRET": "s",
           "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURMD_NODENAME": "n7"}
    done = subprocess.run([sys.executable, "-m", "ft_launch.launcher.worker.task", "--",
                           sys.executable, "-c", "import os; print(os.getpid())"],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    (process,), problems = read_rank_pids(tmp_path, 1)
    assert problems == []
    assert process == RankProcess(1, 1, "n7", int(done.stdout.strip()))
