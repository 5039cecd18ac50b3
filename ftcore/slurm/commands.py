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
    #: share CPUs with other steps instead of ``--exact``: needed on a node a job got by
    #: expansion, where Slurm 22.05 leaves ``--exact`` steps pending (job core bitmap)
    overlap: bool = False
    #: the tasks' stdout and stderr: a file name pattern of srun's (``%t``: the task)
    output: str | None = None
    extra_args: tuple[str, ...] = ()


def srun_argv(spec: StepSpec) -> list[str]:
    """srun for one step: ``--exact`` so steps of one job run side by side (or
    ``--overlap``, see ``StepSpec.overlap``)."""
    argv = ["srun", "--overlap" if spec.overlap else "--exact", f"--nodes={len(spec.nodes)}",
            f"--nodelist={compress(spec.nodes)}",
            f"--ntasks={len(spec.nodes) * spec.tasks_per_node}",
            f"--ntasks-per-node={spec.tasks_per_node}"]
    if spec.job_id:
        argv.append(f"--jobid={spec.job_id}")
    if spec.name:
        argv.append(f"--job-name={spec.name}")
    if spec.kill_on_bad_exit:
        argv.append("--kill-on-bad-exit=1")
    if spec.output:
        argv += [f"--output={spec.output}", "--open-mode=append"]
    return [*argv, *spec.extra_args, "--", *spec.command]


def literal_pattern(path: str) -> str:
    """``path`` inside an srun file name pattern (``%%``: a literal %)."""
    return path.replace("%", "%%")


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


def allocate_argv(nodes: int, *, name: str, reservation: str | None = None,
                  nodelist: tuple[str, ...] = (), expand: str | None = None,
                  immediate_s: int | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """``salloc --no-shell``: an allocation without a shell (driven by ``srun --jobid``),
    kept when one of its nodes fails; ``expand``: as an expansion of that job (needs
    ``SchedulerParameters=permit_job_expansion``)."""
    # --exclusive: a standby node is held whole (another job must not share it).
    argv = ["salloc", "--no-shell", "--no-kill", "--exclusive", f"--nodes={nodes}",
            f"--job-name={name}"]
    if reservation:
        argv.append(f"--reservation={reservation}")
    if nodelist:
        argv.append(f"--nodelist={compress(nodelist)}")
    if expand:
        argv.append(f"--dependency=expand:{expand}")
    if immediate_s is not None:
        argv.append(f"--immediate={immediate_s}")
    return [*argv, *extra]


def shrink_job_argv(job_id: str, keep: tuple[str, ...]) -> list[str]:
    """Release every node of a running job but ``keep``."""
    return ["scontrol", "update", f"jobid={job_id}", f"nodelist={compress(keep)}"]


def set_comment_argv(job_id: str, comment: str) -> list[str]:
    return ["scontrol", "update", f"jobid={job_id}", f"comment={comment}"]


def cancel_job_argv(job_id: str) -> list[str]:
    return ["scancel", job_id]


def show_config_argv() -> list[str]:
    return ["scontrol", "show", "config"]


def requeue_argv(job_id: str) -> list[str]:
    return ["scontrol", "requeue", job_id]
