"""Allocation planning (pure): which nodes run which replica, which wait as standby,
and the exact srun command of each replica step."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ft_launch.config import BatchHostRole, JobConfig, StandbyMode
from ft_launch.env import ENV_NUM_REPLICAS, ENV_REPLICA_ID
from ft_launch.errors import UsageError
from ft_launch.slurm.commands import StepSpec, srun_argv

#: Shortcut flags of ``plan``/``run``/``submit`` and the config keys they set.
JOB_FLAGS = {"replicas": "job.replicas", "nodes_per_replica": "job.nodes_per_replica",
             "tasks_per_node": "job.tasks_per_node", "standby": "job.standby"}


@dataclass(frozen=True)
class ReplicaPlacement:
    replica_id: int
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class LaunchPlan:
    job_id: str | None
    replicas: tuple[ReplicaPlacement, ...]
    standby: tuple[str, ...]
    excluded: tuple[str, ...]          # e.g. the batch host, kept out of replicas
    tasks_per_node: int
    command: tuple[str, ...]
    batch_host: str | None = None      # runs the controller; a standby promoted last

    def step_spec(self, replica_id: int, extra_args: tuple[str, ...] = ()) -> StepSpec:
        placement = self.replicas[replica_id]
        return replica_step_spec(self, placement.nodes, replica_id, extra_args)

    def srun_commands(self, extra_args: tuple[str, ...] = ()) -> list[list[str]]:
        return [srun_argv(self.step_spec(r.replica_id, extra_args)) for r in self.replicas]


def replica_step_spec(plan: LaunchPlan, nodes: tuple[str, ...], replica_id: int,
                      extra_args: tuple[str, ...] = (),
                      command: tuple[str, ...] | None = None,
                      overlap: bool = False) -> StepSpec:
    """The step of ``replica_id`` on ``nodes`` (its first nodes, or a promoted standby),
    running ``command`` (default: the plan's; a hot update replaces it)."""
    export = (f"--export=ALL,{ENV_REPLICA_ID}={replica_id},"
              f"{ENV_NUM_REPLICAS}={len(plan.replicas)}")
    # Each task gets its replica's torch world (RANK, MASTER_ADDR, ...) as torchrun would.
    task = (sys.executable, "-m", "ft_launch.launcher.worker.task", "--")
    return StepSpec(nodes=nodes, command=(*task, *(command or plan.command)),
                    tasks_per_node=plan.tasks_per_node,
                    name=f"replica-{replica_id}", job_id=plan.job_id,
                    overlap=overlap, extra_args=(export, *extra_args))


def plan_allocation(nodes: tuple[str, ...], job: JobConfig, command: tuple[str, ...],
                    *, job_id: str | None = None, batch_host: str | None = None) -> LaunchPlan:
    """Split ``nodes`` into ``job.replicas`` replicas of ``job.nodes_per_replica``
    consecutive nodes, then standby nodes. Surplus nodes join the standby pool.

    The batch host runs the controller and every srun client: by default
    (``job.batch_host = "standby"``) it trains nothing and is the standby promoted
    last, so that losing any training node never takes the controller with it."""
    if not command:
        raise UsageError("no training command given", hint="put it after '--', e.g. "
                         "ft-launch plan -- python train.py")
    if len(set(nodes)) != len(nodes):
        raise UsageError(f"node list has duplicates: {', '.join(nodes)}")
    role = job.batch_host if batch_host in nodes else BatchHostRole.REPLICA
    excluded = (batch_host,) if role is BatchHostRole.EXCLUDED else ()
    usable = [n for n in nodes if n not in excluded]
    if role is BatchHostRole.STANDBY:
        usable.remove(batch_host)
        usable.append(batch_host)   # after every other node: the last standby
    # In reservation mode the standby nodes come from the reservation, not the allocation.
    in_allocation = job.standby if job.standby_mode is StandbyMode.IN_ALLOCATION else 0
    trainers = job.replicas * job.nodes_per_replica
    needed = trainers + in_allocation
    spare_for_batch_host = 1 if role is BatchHostRole.STANDBY and in_allocation == 0 else 0
    if len(usable) < needed + spare_for_batch_host:
        raise UsageError(
            f"the allocation has {len(usable)} usable node(s) but {job.replicas} replica(s) x "
            f"{job.nodes_per_replica} node(s) + {in_allocation} standby need {needed}"
            + (f" ({excluded[0]} is excluded as the batch host)" if excluded else "")
            + (f", and the batch host {batch_host} trains nothing (job.batch_host = "
               "'standby'): one more node" if spare_for_batch_host else ""),
            hint=f"request at least {needed + len(excluded) + spare_for_batch_host} nodes "
                 "(sbatch -N), lower job.replicas / job.nodes_per_replica, or drive the "
                 "allocation from a login node (ft-launch submit)")
    size = job.nodes_per_replica
    replicas = tuple(ReplicaPlacement(r, tuple(usable[r * size:(r + 1) * size]))
                     for r in range(job.replicas))
    standby = tuple(usable[trainers:])
    return LaunchPlan(job_id=job_id, replicas=replicas, standby=standby, excluded=excluded,
                      tasks_per_node=job.tasks_per_node, command=tuple(command),
                      batch_host=batch_host if batch_host in nodes else None)


def check_cpus(cpus_per_node: tuple[int, ...], nodes: tuple[str, ...], tasks_per_node: int,
               job_id: str) -> None:
    """Every replica step runs ``tasks_per_node`` tasks on each node: an allocation that
    holds fewer CPUs somewhere (sbatch's default is one task, one CPU, per node)
    would have its steps refused later; say so now. Unknown counts pass."""
    short = [(node, cpus) for node, cpus in zip(nodes, cpus_per_node) if cpus < tasks_per_node]
    if short:
        node, cpus = short[0]
        raise UsageError(
            f"job {job_id} holds {cpus} CPU(s) on {node} ({len(short)} node(s) short), but "
            f"job.tasks_per_node = {tasks_per_node} needs {tasks_per_node} on every node",
            hint="allocate whole nodes (#SBATCH --exclusive, as ft-launch submit does) or "
                 f"--ntasks-per-node={tasks_per_node}")
