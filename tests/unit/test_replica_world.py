"""Each replica is a torch world of its own: the environment ft-launch gives its
tasks (as torchrun would), and the exchange thread that runs a step's quorum and
reductions in order beside backward."""

from __future__ import annotations

import threading

import pytest

from ft_launch.config import JobConfig
from ft_launch.errors import RecoverableError, UsageError
from ft_launch.launcher.controller.plan import plan_allocation, replica_step_spec
from ft_launch.launcher.worker.exchange import StepWork
from ft_launch.launcher.worker.identity import (
    MASTER_PORT_BASE,
    MASTER_PORT_SPAN,
    master_port,
    replica_world_env,
    task_world_env,
)


def test_task_world_env_takes_rank_and_master_from_the_step() -> None:
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n[4-5]"}
    assert task_world_env(env) == {"RANK": "3", "LOCAL_RANK": "1", "MASTER_ADDR": "n4"}
    assert task_world_env({}) == {}          # outside a Slurm step: nothing to add


def test_replica_world_env_sizes_the_world_and_picks_a_port_per_launch() -> None:
    env = replica_world_env("77", 2, 0, nodes=2, tasks_per_node=4)
    assert env["WORLD_SIZE"] == "8" and env["LOCAL_WORLD_SIZE"] == "4"
    ports = {master_port("77", replica, launch) for replica in range(8) for launch in range(8)}
    assert all(MASTER_PORT_BASE <= p < MASTER_PORT_BASE + MASTER_PORT_SPAN for p in ports)
    assert len(ports) > 60        # a relaunch, or another replica, gets another port
    assert master_port("77", 2, 0) == int(env["MASTER_PORT"])


def test_replica_steps_start_their_tasks_through_the_world_shim() -> None:
    plan = plan_allocation(("n1", "n2", "n3"), JobConfig(replicas=2, standby=0,
                                                         batch_host="replica"),
                           ("python3", "train.py"), job_id="5")
    spec = replica_step_spec(plan, ("n2",), 1)
    assert spec.command[1:4] == ("-m", "ft_launch.launcher.worker.task", "--")
    assert spec.command[4:] == ("python3", "train.py")


def test_exchange_runs_jobs_in_order_and_skips_the_rest_after_a_failure() -> None:
    work = StepWork()
    ran: list[str] = []
    after: list[str] = []
    gate = threading.Event()
    work.begin(lambda: (gate.wait(), ran.append("quorum")))
    work.submit(lambda: ran.append("unit 1"), lambda: after.append("unit 1"))
    gate.set()
    assert work.wait() is None and ran == ["quorum", "unit 1"] and after == ["unit 1"]

    error = RecoverableError("ring broke")
    work.begin(lambda: ran.append("quorum 2"))
    work.submit(lambda: (_ for _ in ()).throw(error))
    work.submit(lambda: ran.append("unit after the failure"), lambda: after.append("done"))
    assert work.wait() is error
    assert "unit after the failure" not in ran and after[-1] == "done"   # skipped, completed

    work.begin(lambda: ran.append("quorum 3"))   # a new step forgets the old failure
    assert work.wait() is None and ran[-1] == "quorum 3"
    work.close()


def test_exchange_raises_other_errors_in_the_waiting_thread() -> None:
    work = StepWork()
    work.begin(lambda: (_ for _ in ()).throw(UsageError("no gradient reached the hooks")))
    with pytest.raises(UsageError, match="no gradient"):
        work.wait()
    work.close()


def test_an_allocation_short_of_cpus_for_the_ranks_is_refused_with_the_fix() -> None:
    from ft_launch.launcher.controller.plan import check_cpus

    check_cpus((2, 2), ("n1", "n2"), 2, "9")
    check_cpus((), ("n1", "n2"), 2, "9")            # counts unknown (--jobid): Slurm decides
    with pytest.raises(UsageError, match=r"holds 1 CPU\(s\) on n2") as refused:
        check_cpus((2, 1, 1), ("n1", "n2", "n3"), 2, "9")
    assert "--exclusive" in (refused.value.hint or "")
