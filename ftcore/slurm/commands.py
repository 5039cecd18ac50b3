"""Pure builders of Slurm command lines (argv lists, never shell strings)."""

from __future__ import annotations

from dataclasses import dataclass

from ..ids import StepRef
from .hostlist import compress

STEP_FORMAT = "%i|%N|%M|%j"  # squeue --steps: id | nodes | elapsed | name (name last: may hold '|')


@dataclass(frozen=True)
class StepSpec:
    """One job step: a command on given nodes of an allocation."""

    nodes: tuple[str, ...]
    command: tuple[str, ...]
    tasks_per_node: int = 1
    name: str = ""
    job_id: str | None = None        # set to drive an allocation from outside it
    kill_on_bad_exit: bool = True    # one task failing ends the whole step
    overlap: bool = False            # share CPUs with another step on the same node
    output: str | None = None
    extra_args: tuple[str, ...] = ()


def srun_argv(spec: StepSpec) -> list[str]:
    """srun for one step: ``--exact`` so steps of one job run side by side."""
    argv = ["srun", "--exact", f"--nodes={len(spec.nodes)}",
            f"--nodelist={compress(spec.nodes)}",
            f"--ntasks={len(spec.nodes) * spec.tasks_per_node}",
            f"--ntasks-per-node={spec.tasks_per_node}"]
    if spec.job_id:
        argv.append(f"--jobid={spec.job_id}")
    if spec.name:
        argv.append(f"--job-name={spec.name}")
    if spec.kill_on_bad_exit:
        argv.append("--kill-on-bad-exit=1")
    if spec.overlap:
        argv.append("--overlap")
    if spec.output:
        argv.append(f"--output={spec.output}")
    return [*argv, *spec.extra_args, "--", *spec.command]


def scancel_step_argv(step: StepRef, signal: str | None = None) -> list[str]:
    return ["scancel", *([f"--signal={signal}"] if signal else []), str(step)]


def update_node_argv(node: str, state: str, reason: str | None = None) -> list[str]:
    """``scontrol update`` of one node; the reason is one argv element (no shell)."""
    argv = ["scontrol", "update", f"nodename={node}", f"state={state}"]
    if reason:
        argv.append(f"reason={reason}")
    return argv


def show_job_argv(job_id: str) -> list[str]:
    return ["scontrol", "show", "job", "-o", job_id]


def show_nodes_argv(nodes: tuple[str, ...] = ()) -> list[str]:
    return ["scontrol", "show", "node", "-o", *([compress(nodes)] if nodes else [])]


def show_reservation_argv(name: str | None = None) -> list[str]:
    return ["scontrol", "show", "reservation", "-o", *([name] if name else [])]


def list_steps_argv(job_id: str) -> list[str]:
    return ["squeue", "--steps", "--noheader", f"--jobs={job_id}", f"--format={STEP_FORMAT}"]


def squeue_json_argv(job_id: str | None = None) -> list[str]:
    return ["squeue", "--json", *([f"--jobs={job_id}"] if job_id else [])]


def sinfo_json_argv() -> list[str]:
    return ["sinfo", "--json"]


def create_reservation_argv(name: str, nodes: tuple[str, ...], duration_minutes: int,
                            users: tuple[str, ...], flags: tuple[str, ...] = ()) -> list[str]:
    argv = ["scontrol", "create", "reservation", f"reservationname={name}",
            f"nodes={compress(nodes)}", "starttime=now", f"duration={duration_minutes}",
            f"users={','.join(users)}"]
    return argv + ([f"flags={','.join(flags)}"] if flags else [])


def update_reservation_argv(name: str, nodes: tuple[str, ...]) -> list[str]:
    return ["scontrol", "update", f"reservationname={name}", f"nodes={compress(nodes)}"]


def delete_reservation_argv(name: str) -> list[str]:
    return ["scontrol", "delete", f"reservationname={name}"]


def resize_job_argv(job_id: str, num_nodes: int) -> list[str]:
    """Shrink a job (or, with 0, hand its nodes to the job it expands)."""
    return ["scontrol", "update", f"jobid={job_id}", f"numnodes={num_nodes}"]


def expand_job_argv(main_job_id: str, node: str) -> list[str]:
    """Allocate ``node`` as an expansion of ``main_job_id`` (needs permit_job_expansion)."""
    return ["salloc", "--no-shell", "--nodes=1", f"--nodelist={node}",
            f"--dependency=expand:{main_job_id}"]


def requeue_argv(job_id: str) -> list[str]:
    return ["scontrol", "requeue", job_id]
