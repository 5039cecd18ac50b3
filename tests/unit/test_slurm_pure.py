"""Slurm client: hostlists, allocation env, argv builders and parsers on recorded output."""

import json
from pathlib import Path

import pytest

from ft_launch.errors import UsageError
from ft_launch.health.slurm_env import read_slurm_env
from ft_launch.ids import StepRef
from ft_launch.slurm import commands, parse
from ft_launch.slurm.allocation import Allocation, expand_counts
from ft_launch.slurm.hostlist import compress, expand
from ft_launch.slurm.states import JobState, NodeState

FIXTURES = Path(__file__).parent / "fixtures"
#: recorded from each real release by tests/cluster/record_fixtures.py (same scenario)
RELEASES = ("22.05", "24.11", "26.05")


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


def recorded(release: str, name: str) -> str:
    return (FIXTURES / f"slurm-{release}" / name).read_text()


def hook_env(release: str, hook: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in recorded(release, f"env_{hook}.txt").splitlines()
                if "=" in line)


@pytest.fixture(params=RELEASES)
def release(request) -> str:
    return request.param


def test_fixtures_were_recorded_on_that_release(release):
    assert recorded(release, "VERSION").startswith(release + ".")


def test_parse_jobs(release):
    jobs = {j.name: j for j in parse.parse_jobs(recorded(release, "scontrol_show_job.txt"))}
    running = jobs["ftl-fixture"]
    assert running.state is JobState.RUNNING and running.nodes == ("n1", "n2", "n3")
    assert running.batch_host == "n1" and running.restarts == 0
    done = jobs["ftl-done"]
    assert done.state is JobState.COMPLETED and done.exit_code == 0 and done.nodes == ("n4",)


def test_parse_nodes_with_spaces_in_values(release):
    (n5,) = parse.parse_nodes(recorded(release, "scontrol_show_node_drain.txt"))
    assert n5.name == "n5" and n5.state is NodeState.IDLE and n5.drained
    assert n5.reason.startswith("ft-launch: test drain gpu3 xid 79 [root@")
    all_nodes = parse.parse_nodes(recorded(release, "scontrol_show_node.txt"))
    assert [n.name for n in all_nodes] == [f"n{i}" for i in range(1, 7)]
    assert all(n.address.startswith("10.77.") for n in all_nodes)


def test_parse_dead_node(release):
    (n6,) = parse.parse_nodes(recorded(release, "scontrol_show_node_down.txt"))
    assert n6.state is NodeState.DOWN and {"NOT_RESPONDING", "RESERVED"} <= n6.flags
    assert n6.reason.startswith("Not responding [root@") and n6.reason.endswith("]")
    nodes = {n.name: n for n in parse.parse_sinfo_json(recorded(release, "sinfo_down.json"))}
    assert nodes["n6"].state is NodeState.DOWN and "NOT_RESPONDING" in nodes["n6"].flags
    assert nodes["n6"].reason == "Not responding"
    assert nodes["n1"].state is not NodeState.DOWN


def test_a_reserved_nodes_reason_ends_before_its_reservation_from_24_11(release):
    """24.11 and 26.05 print ``ReservationName=`` after a node's free-text ``Reason=``;
    22.05 does not print it: the reason must not swallow it."""
    text = recorded(release, "scontrol_show_node_down.txt")
    assert ("ReservationName=standby" in text) == (release != "22.05")
    (n6,) = parse.parse_nodes(text)
    assert "ReservationName" not in n6.reason


def test_parse_steps_and_reservation(release):
    steps = parse.parse_steps(recorded(release, "squeue_steps.txt"))
    by_id = {s.step.step_id: s for s in steps}
    assert by_id["0"].nodes == ("n1",) and by_id["1"].nodes == ("n2",)
    assert by_id["0"].name == "sleep" and by_id["batch"].nodes == ("n1",)
    assert len({s.step.job_id for s in steps}) == 1
    (res,) = parse.parse_reservations(recorded(release, "scontrol_show_reservation.txt"))
    assert res.name == "standby" and res.nodes == ("n6",) and res.state == "ACTIVE"
    assert {"IGNORE_JOBS", "SPEC_NODES"} <= res.flags and res.users == ("root",)


def test_parse_json(release):
    jobs = {j.name: j for j in parse.parse_squeue_json(recorded(release, "squeue.json"))}
    running = jobs["ftl-fixture"]
    assert running.state is JobState.RUNNING and running.nodes == ("n1", "n2", "n3")
    assert running.batch_host == "n1" and running.exit_code == 0
    nodes = {n.name: n for n in parse.parse_sinfo_json(recorded(release, "sinfo_drain.json"))}
    assert set(nodes) == {f"n{i}" for i in range(1, 7)}
    assert nodes["n5"].drained and nodes["n5"].state is NodeState.IDLE
    assert not nodes["n1"].drained and nodes["n1"].state is NodeState.MIXED


def test_json_node_reason_is_text_in_22_05_and_an_object_from_24_11(release):
    """sinfo --json: 22.05 gives ``"reason": "text"``, 24.11 ``{"description", "time",
    "user"}``, 26.05 ``{"description", "time"}``; the parser gives the text."""
    raw = json.loads(recorded(release, "sinfo_drain.json"))
    reasons = ([n["reason"] for n in raw["nodes"]] if release == "22.05" else
               [g["reason"] for g in raw["sinfo"]])
    assert all(isinstance(r, str if release == "22.05" else dict) for r in reasons)
    nodes = {n.name: n for n in parse.parse_sinfo_json(recorded(release, "sinfo_drain.json"))}
    assert nodes["n5"].reason == "ft-launch: test drain gpu3 xid 79"
    assert nodes["n1"].reason == ""


def test_json_differences_the_client_does_not_rely_on(release):
    """squeue --json lists finished jobs (within MinJobAge) only in 22.05; sinfo --json
    gives node addresses only in 22.05. The client reads both from scontrol."""
    names = {j.name for j in parse.parse_squeue_json(recorded(release, "squeue.json"))}
    assert ("ftl-done" in names) == (release == "22.05")
    nodes = parse.parse_sinfo_json(recorded(release, "sinfo.json"))
    assert all(bool(n.address) == (release == "22.05") for n in nodes)


def test_job_expansion_adds_the_node_on_every_release(release):
    """``salloc --dependency=expand:MAIN``, ``NumNodes=0``, ``scancel``: the node joins
    MAIN (``SchedulerParameters=permit_job_expansion``) in all three."""
    text = recorded(release, "expansion.txt")
    assert "-> exit 0" in text.splitlines()[0]
    (main,) = parse.parse_jobs(text)
    assert main.name == "ftl-main" and main.nodes == ("n1", "n4")
    assert main.state is JobState.RUNNING


def test_hook_environments(release):
    """What slurmd gives Prolog, Epilog and HealthCheckProgram (recorded). The same in all
    three: SLURM_SCRIPT_CONTEXT marks Prolog and Epilog, no job name, and the health
    check sees only SLURMD_NODENAME. Different: SLURM_JOB_NODELIST only from 24.11 on
    (22.05: SLURM_NODELIST alone); 26.05 adds SLURM_JOB_SLUID."""
    prolog, epilog = hook_env(release, "prolog"), hook_env(release, "epilog")
    check = hook_env(release, "healthcheck")
    assert prolog["SLURM_SCRIPT_CONTEXT"] == "prolog_slurmd"
    assert epilog["SLURM_SCRIPT_CONTEXT"] == "epilog_slurmd"
    assert set(check) - {"PWD"} == {"SLURMD_NODENAME"}
    assert "SLURM_JOB_NAME" not in prolog and "SLURM_JOB_NAME" not in epilog
    assert ("SLURM_JOB_NODELIST" in prolog) == (release != "22.05")
    assert ("SLURM_JOB_SLUID" in prolog) == (release == "26.05")
    assert prolog["SLURM_NODELIST"] == "n2" and epilog["SLURM_JOB_EXIT_CODE"] == "0"
    for env in (prolog, epilog):
        inputs = read_slurm_env(env, "unused")
        assert (inputs.node, inputs.job_uid, inputs.job_user) == ("n2", 0, "root")
        assert inputs.job_id == env["SLURM_JOB_ID"] and not inputs.rejected
        assert Allocation.from_env(env).nodes == ("n2",)
    assert read_slurm_env(check, "unused").job_id is None
