import json
import subprocess
import sys

import pytest

from ft_launch.config import BatchHostRole, JobConfig
from ft_launch.errors import UsageError
from ft_launch.launcher.controller.plan import plan_allocation

NODES = tuple(f"n{i}" for i in range(1, 9))


def test_plan_splits_replicas_then_standby():
    job = JobConfig(replicas=3, nodes_per_replica=2, standby=1)
    plan = plan_allocation(NODES[:7], job, ("python", "train.py"), job_id="5")
    assert [r.nodes for r in plan.replicas] == [("n1", "n2"), ("n3", "n4"), ("n5", "n6")]
    assert plan.standby == ("n7",)
    commands = plan.srun_commands()
    assert len(commands) == 3
    assert "--nodelist=n[3-4]" in commands[1] and "--jobid=5" in commands[1]
    assert any("FTL_WORKER_REPLICA_ID=1" in arg for arg in commands[1])
    assert commands[2][-2:] == ["python", "train.py"]


def test_surplus_nodes_join_standby_and_batch_host_excluded():
    job = JobConfig(replicas=2, nodes_per_replica=2, standby=1,
                    batch_host=BatchHostRole.EXCLUDED)
    plan = plan_allocation(NODES, job, ("x",), batch_host="n1")
    assert plan.excluded == ("n1",)
    assert [r.nodes for r in plan.replicas] == [("n2", "n3"), ("n4", "n5")]
    assert plan.standby == ("n6", "n7", "n8")


def test_by_default_the_batch_host_trains_nothing_and_is_the_last_standby():
    job = JobConfig(replicas=3, standby=1)
    plan = plan_allocation(NODES[:4], job, ("x",), batch_host="n1")
    assert [r.nodes for r in plan.replicas] == [("n2",), ("n3",), ("n4",)]
    assert plan.standby == ("n1",) and plan.batch_host == "n1" and plan.excluded == ()
    surplus = plan_allocation(NODES[:6], job, ("x",), batch_host="n3")
    assert [r.nodes for r in surplus.replicas] == [("n1",), ("n2",), ("n4",)]
    assert surplus.standby == ("n5", "n6", "n3")


def test_the_batch_host_needs_a_node_of_its_own_unless_it_may_train():
    with pytest.raises(UsageError, match="batch host n1 trains nothing") as refused:
        plan_allocation(NODES[:3], JobConfig(replicas=3), ("x",), batch_host="n1")
    assert "at least 4 nodes" in refused.value.hint and "ft-launch submit" in refused.value.hint
    trains = plan_allocation(NODES[:3], JobConfig(replicas=3, batch_host=BatchHostRole.REPLICA),
                             ("x",), batch_host="n1")
    assert [r.nodes for r in trains.replicas] == [("n1",), ("n2",), ("n3",)]
    # no batch host (plan --nodelist, ft-launch run --jobid): every node may train
    assert len(plan_allocation(NODES[:3], JobConfig(replicas=3), ("x",)).replicas) == 3


@pytest.mark.parametrize("nodes, job, command, message", [
    (NODES[:5], JobConfig(replicas=3, nodes_per_replica=2), ("x",), "need 6"),
    (NODES, JobConfig(), (), "no training command"),
    (("n1", "n1"), JobConfig(replicas=1), ("x",), "duplicates"),
])
def test_plan_rejects_bad_input(nodes, job, command, message):
    with pytest.raises(UsageError, match=message):
        plan_allocation(nodes, job, command)


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ft_launch.launcher.cli", *args],
                          capture_output=True, text=True, timeout=60, env=env, check=False)


def test_cli_plan_prints_exact_commands():
    result = run_cli("plan", "--nodelist", "n[1-7]", "--replicas", "3", "--nodes-per-replica",
                     "2", "--standby", "1", "--json", "--", "python", "train.py")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["standby"] == ["n7"]
    assert plan["srun"][0][:2] == ["srun", "--exact"]


@pytest.mark.parametrize("args, code, message", [
    (["--nodelist", "n[1-5]", "--replicas", "3", "--nodes-per-replica", "2"], 2, "need 6"),
    (["--nodelist", "n[1-"], 2, "bad hostlist"),
    (["--nodelist", "n[1-4]", "--nodes-per-replica", "0"], 2, "at least 1"),
    ([], 2, "not inside a Slurm allocation"),
])
def test_cli_plan_bad_input(args, code, message):
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("SLURM_")}
    result = run_cli("plan", *args, "--", "python", "train.py", env=env)
    assert result.returncode == code
    assert message in result.stderr and "Traceback" not in result.stderr


def test_cli_help():
    result = run_cli("--help")
    assert result.returncode == 0 and "plan" in result.stdout and "Exit codes" in result.stdout


def test_cli_standby_size():
    result = run_cli("standby-size", "--machines", "1000", "--daily-failure-rate", "0.002",
                     "--window", "24")
    assert result.returncode == 0, result.stderr
    from ft_launch.launcher.reporting.ettr import standby_size
    expected = standby_size(1000, 0.002, 24)
    assert f"hold {expected} warm standby" in result.stdout
    assert "ETTR gained per standby node" in result.stdout
    bad = run_cli("standby-size", "--machines", "0", "--daily-failure-rate", "0.1", "--window", "1")
    assert bad.returncode == 2 and "--machines" in bad.stderr


def test_cli_update_records_a_request_and_rejects_a_run_dir_that_is_not_one(tmp_path):
    (tmp_path / "controller.jsonl").write_text("")
    done = run_cli("update", "--run-dir", str(tmp_path), "--urgent", "--note", "fix",
                   "--", "python3", "train.py", "--lr", "1e-3")
    assert done.returncode == 0, done.stderr
    assert "update request 1 recorded" in done.stdout and "now" in done.stdout
    record = json.loads((tmp_path / "updates" / "0001.json").read_text())
    assert record["command"] == ["python3", "train.py", "--lr", "1e-3"] and record["urgent"]
    missing = run_cli("update", "--run-dir", str(tmp_path / "nope"), "--", "python3", "x.py")
    assert missing.returncode == 2 and "not an ft-launch run directory" in missing.stderr
