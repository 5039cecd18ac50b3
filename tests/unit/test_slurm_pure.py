"""Slurm client: hostlists, allocation env, argv builders and parsers on recorded output."""

from pathlib import Path

import pytest

from ftcore.errors import UsageError
from ftcore.ids import StepRef
from ftcore.slurm import commands, parse
from ftcore.slurm.allocation import Allocation, expand_counts
from ftcore.slurm.hostlist import compress, expand
from ftcore.slurm.states import JobState, NodeState

FIXTURES = Path(__file__).parent / "fixtures"
V22 = FIXTURES / "slurm-22.05"
V24 = FIXTURES / "slurm-24.11"


@pytest.mark.parametrize("expression, names", [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,5],login", ["n1", "n2", "n5", "login"]),
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("node-a[1-2]-ib", ["node-a1-ib", "node-a2-ib"]),
])
def test_hostlist_expand(expression, names):
    assert expand(expression) == names


@pytest.mark.parametrize("bad", ["n[1-", "n[3-1]", "n[a-b]", "n]1[", "n 1"])
def test_hostlist_rejects_malformed(bad):
    with pytest.raises(UsageError, match="bad hostlist"):
        expand(bad)


@pytest.mark.parametrize("names", [
    ["n1", "n2", "n3", "n7"], ["gpu008", "gpu009", "gpu010"], ["login", "n4"], ["a1"]])
def test_hostlist_compress_round_trips(names):
    assert expand(compress(names)) == names


def test_allocation_from_env():
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "n[1-4]",
           "SLURM_JOB_CPUS_PER_NODE": "2(x3),1", "SLURMD_NODENAME": "n1",
           "SLURM_JOB_NAME": "train"}
    alloc = Allocation.from_env(env)
    assert alloc.job_id == "42" and alloc.nodes == ("n1", "n2", "n3", "n4")
    assert alloc.cpus_per_node == (2, 2, 2, 1) and alloc.batch_host == "n1"
    with pytest.raises(UsageError, match="not inside a Slurm allocation"):
        Allocation.from_env({})
    assert expand_counts("4") == [4]


def test_srun_argv_is_exact_and_unquoted():
    spec = commands.StepSpec(nodes=("n3", "n4"), command=("python", "train.py", "a b"),
                             tasks_per_node=2, name="replica-1", job_id="9")
    argv = commands.srun_argv(spec)
    assert argv[:2] == ["srun", "--exact"]
    assert "--nodelist=n[3-4]" in argv and "--ntasks=4" in argv and "--jobid=9" in argv
    assert argv[argv.index("--") + 1:] == ["python", "train.py", "a b"]


def test_control_argv():
    assert commands.scancel_step_argv(StepRef("9", "2")) == ["scancel", "9.2"]
    assert commands.update_node_argv("n3", "drain", "ft-launch: gpu3 xid 79") == [
        "scontrol", "update", "nodename=n3", "state=drain", "reason=ft-launch: gpu3 xid 79"]
    grow = commands.allocate_argv(1, name="ftl-grow-9", reservation="pool", nodelist=("n7",),
                                  expand="9", immediate_s=30)
    assert grow[:2] == ["salloc", "--no-shell"] and "--dependency=expand:9" in grow
    assert "--nodelist=n7" in grow and "--reservation=pool" in grow
    assert commands.shrink_job_argv("5", ("n2", "n3")) == [
        "scontrol", "update", "jobid=5", "nodelist=n[2-3]"]


def test_allocation_ids_and_settings_are_parsed():
    assert parse.parse_granted_job("salloc: Granted job allocation 17\n") == "17"
    assert parse.parse_granted_job("salloc: error: nope") is None
    text = "Configuration data as of x\nSchedulerParameters     = bf_interval=5,permit_job_expansion\n"
    assert parse.parse_config(text)["SchedulerParameters"] == "bf_interval=5,permit_job_expansion"


def test_parse_jobs_22_05():
    jobs = {j.job_id: j for j in parse.parse_jobs((V22 / "scontrol_show_job.txt").read_text())}
    running = jobs["3"]
    assert running.state is JobState.RUNNING and running.name == "ftl-fixture"
    assert running.nodes == ("n1", "n2", "n3") and running.batch_host == "n1"
    assert jobs["1"].state is JobState.COMPLETED and jobs["1"].exit_code == 0


def test_parse_nodes_22_05_with_spaces_in_values():
    nodes = parse.parse_nodes((V22 / "scontrol_show_node_drain.txt").read_text())
    (n5,) = nodes
    assert n5.name == "n5" and n5.state is NodeState.IDLE and n5.drained
    assert n5.reason.startswith("ft-launch: test drain")
    all_nodes = parse.parse_nodes((V22 / "scontrol_show_node.txt").read_text())
    assert [n.name for n in all_nodes] == [f"n{i}" for i in range(1, 7)]
    assert all(n.address.startswith("10.77.0.") for n in all_nodes)


def test_parse_dead_node_22_05():
    (n6,) = parse.parse_nodes((V22 / "scontrol_show_node_down.txt").read_text())
    assert n6.state is NodeState.DOWN and "NOT_RESPONDING" in n6.flags
    assert n6.reason.startswith("Not responding")
    nodes = {n.name: n for n in parse.parse_sinfo_json((V22 / "sinfo_down.json").read_text())}
    assert nodes["n6"].state is NodeState.DOWN and nodes["n1"].state is not NodeState.DOWN


def test_parse_steps_and_reservation_22_05():
    steps = parse.parse_steps((V22 / "squeue_steps.txt").read_text())
    by_id = {s.step.step_id: s for s in steps}
    assert by_id["0"].nodes == ("n2",) and by_id["1"].nodes == ("n1",)
    assert by_id["0"].name == "sleep" and by_id["batch"].step.job_id == "4"
    (res,) = parse.parse_reservations((V22 / "scontrol_show_reservation.txt").read_text())
    assert res.name == "standby" and res.nodes == ("n6",) and "IGNORE_JOBS" in res.flags


@pytest.mark.parametrize("version", [V22, V24])
def test_parse_json_both_versions(version):
    jobs = parse.parse_squeue_json((version / "squeue.json").read_text())
    running = [j for j in jobs if j.state is JobState.RUNNING]
    assert running and running[0].nodes and running[0].batch_host
    nodes = {n.name: n for n in parse.parse_sinfo_json((version / "sinfo_drain.json").read_text())}
    assert nodes["n5"].drained and nodes["n5"].state is NodeState.IDLE
    assert not nodes["n1"].drained
