"""The Slurm backend interface and its tested implementation over the Slurm CLI.

A pyslurm backend can implement ``SlurmBackend`` later; none ships, since no
pyslurm release matches the Slurm versions we can test against.
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from ..errors import SlurmCommandError
from ..ids import StepRef
from . import commands, parse
from .commands import StepSpec
from .parse import JobInfo, NodeInfo, ReservationInfo, StepInfo

log = logging.getLogger(__name__)


class SlurmBackend(Protocol):
    def job(self, job_id: str) -> JobInfo | None: ...
    def nodes(self, names: tuple[str, ...] = ()) -> list[NodeInfo]: ...
    def steps(self, job_id: str) -> list[StepInfo]: ...
    def reservation(self, name: str) -> ReservationInfo | None: ...
    def cancel_step(self, step: StepRef, signal: str | None = None) -> None: ...
    def set_node_state(self, node: str, state: str, reason: str | None = None) -> None: ...
    def launch_step(self, spec: StepSpec, env: Mapping[str, str] | None = None,
                    stdout: int | None = None) -> subprocess.Popen[bytes]: ...
    def create_reservation(self, name: str, nodes: tuple[str, ...], duration_minutes: int,
                           users: tuple[str, ...], flags: tuple[str, ...] = ()) -> None: ...
    def update_reservation(self, name: str, nodes: tuple[str, ...]) -> None: ...
    def delete_reservation(self, name: str) -> None: ...
    def resize_job(self, job_id: str, num_nodes: int) -> None: ...
    def allocate(self, nodes: int, *, name: str, reservation: str | None = None,
                 nodelist: tuple[str, ...] = (), expand: str | None = None,
                 immediate_s: int | None = None, extra: tuple[str, ...] = (),
                 wait_forever: bool = False) -> str: ...
    def shrink_job(self, job_id: str, keep: tuple[str, ...]) -> None: ...
    def cancel_job(self, job_id: str) -> None: ...
    def requeue_job(self, job_id: str) -> None: ...
    def set_comment(self, job_id: str, comment: str) -> None: ...
    def config(self) -> dict[str, str]: ...


class SlurmCli:
    """Runs the Slurm commands; every call has a timeout; failures raise
    ``SlurmCommandError`` (recoverable: the controller may just be busy)."""

    def __init__(self, command_timeout: float = 30.0, env: Mapping[str, str] | None = None,
                 prefix: Sequence[str] = ()) -> None:
        self.command_timeout = command_timeout
        self.env = dict(os.environ if env is None else env)
        # e.g. ("nsenter", "--net=...") to reach a controller only a login node can see
        self.prefix = tuple(prefix)

    def run(self, argv: Sequence[str]) -> str:
        return self._run(argv).stdout

    def _run(self, argv: Sequence[str], cwd: str | None = None, wait_forever: bool = False,
             longer_s: float = 0.0, on_timeout: Callable[[str], None] | None = None
             ) -> subprocess.CompletedProcess[str]:
        """Bounded by ``command_timeout`` (plus ``longer_s``, the time the command itself
        may take by design), unless ``wait_forever`` (salloc in the queue: as long as it
        takes, as sbatch's job would wait); ``on_timeout`` gets what the killed command
        had written to stderr."""
        limit = None if wait_forever else self.command_timeout + longer_s
        try:
            result = subprocess.run([*self.prefix, *argv], capture_output=True, text=True,
                                    check=False, timeout=limit, env=self.env, cwd=cwd)
        except subprocess.TimeoutExpired as expired:
            if on_timeout is not None:     # bytes, even in text mode
                on_timeout((expired.stderr or b"").decode(errors="replace"))
            raise SlurmCommandError(f"'{' '.join(argv)}' did not answer within {limit:g} s",
                                    hint="slurmctld may be overloaded; retry") from None
        except FileNotFoundError:
            raise SlurmCommandError(f"'{argv[0]}' not found on PATH",
                                    hint="install the Slurm client commands") from None
        if result.returncode != 0:
            raise SlurmCommandError(f"'{' '.join(argv)}' failed (exit {result.returncode}): "
                                    f"{result.stderr.strip() or result.stdout.strip()}")
        return result

    def _cancel_pending(self, salloc_stderr: str) -> None:
        """A salloc killed while its request waits in the queue leaves the job pending:
        it would take its nodes later, for nobody. Cancel it (salloc names it first)."""
        job_id = parse.parse_pending_job(salloc_stderr)
        if job_id is None:
            return
        try:
            self.cancel_job(job_id)
        except SlurmCommandError as error:
            log.warning("job %s, which a salloc that timed out left pending, not cancelled: "
                        "%s", job_id, error)

    def job(self, job_id: str) -> JobInfo | None:
        jobs = parse.parse_jobs(self.run(commands.show_job_argv(job_id)))
        return jobs[0] if jobs else None

    def nodes(self, names: tuple[str, ...] = ()) -> list[NodeInfo]:
        return parse.parse_nodes(self.run(commands.show_nodes_argv(names)))

    def steps(self, job_id: str) -> list[StepInfo]:
        return parse.parse_steps(self.run(commands.list_steps_argv(job_id)))

    def reservation(self, name: str) -> ReservationInfo | None:
        try:
            found = parse.parse_reservations(self.run(commands.show_reservation_argv(name)))
        except SlurmCommandError:
            return None
        return found[0] if found else None

    def cancel_step(self, step: StepRef, signal: str | None = None) -> None:
        self.run(commands.scancel_step_argv(step, signal))

    def set_node_state(self, node: str, state: str, reason: str | None = None) -> None:
        log.info("scontrol: node %s -> %s (%s)", node, state, reason or "")
        self.run(commands.update_node_argv(node, state, reason))

    def launch_step(self, spec: StepSpec, env: Mapping[str, str] | None = None,
                    stdout: int | None = None) -> subprocess.Popen[bytes]:
        """Start ``srun`` for one step (not waited for: the caller supervises it)."""
        argv = commands.srun_argv(spec)
        log.info("launch: %s", " ".join(argv))
        return subprocess.Popen([*self.prefix, *argv], env={**self.env, **(env or {})}, stdout=stdout,
                                stderr=subprocess.STDOUT if stdout is not None else None,
                                stdin=subprocess.DEVNULL)

    def create_reservation(self, name: str, nodes: tuple[str, ...], duration_minutes: int,
                           users: tuple[str, ...], flags: tuple[str, ...] = ()) -> None:
        self.run(commands.create_reservation_argv(name, nodes, duration_minutes, users, flags))

    def update_reservation(self, name: str, nodes: tuple[str, ...]) -> None:
        self.run(commands.update_reservation_argv(name, nodes))

    def delete_reservation(self, name: str) -> None:
        self.run(commands.delete_reservation_argv(name))

    def resize_job(self, job_id: str, num_nodes: int) -> None:
        # scontrol writes slurm_job_<id>_resize.{sh,csh} into its working directory:
        # keep them out of the user's.
        with tempfile.TemporaryDirectory(prefix="ftl-resize-") as scratch:
            self._run(commands.resize_job_argv(job_id, num_nodes), cwd=scratch)

    def allocate(self, nodes: int, *, name: str, reservation: str | None = None,
                 nodelist: tuple[str, ...] = (), expand: str | None = None,
                 immediate_s: int | None = None, extra: tuple[str, ...] = (),
                 wait_forever: bool = False) -> str:
        """``salloc --no-shell``; returns the new job's id."""
        # --immediate: salloc gives up by itself (and withdraws its request) first
        result = self._run(commands.allocate_argv(nodes, name=name, reservation=reservation,
                                                  nodelist=nodelist, expand=expand,
                                                  immediate_s=immediate_s, extra=extra),
                           wait_forever=wait_forever, longer_s=immediate_s or 0,
                           on_timeout=self._cancel_pending)
        job_id = parse.parse_granted_job(result.stderr + result.stdout)
        if job_id is None:
            raise SlurmCommandError(f"salloc granted no allocation: {result.stderr.strip()}")
        return job_id

    def shrink_job(self, job_id: str, keep: tuple[str, ...]) -> None:
        self.run(commands.shrink_job_argv(job_id, keep))

    def cancel_job(self, job_id: str) -> None:
        self.run(commands.cancel_job_argv(job_id))

    def requeue_job(self, job_id: str) -> None:
        log.info("scontrol: requeue job %s", job_id)
        self.run(commands.requeue_argv(job_id))

    def config(self) -> dict[str, str]:
        return parse.parse_config(self.run(commands.show_config_argv()))

    def set_comment(self, job_id: str, comment: str) -> None:
        self.run(commands.set_comment_argv(job_id, comment))


def launch_logged(slurm: SlurmBackend, spec: StepSpec, log_base: Path,
                  env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Launch ``spec``; each task writes ``<log_base>.<task>.log`` itself. A per-task
    name (``%t``) is what makes slurmstepd open the file on the task's node; with one
    name for all tasks srun writes it, and a task's output (then the task) waits on
    srun, stalled with a hung batch host. srun's own messages: ``<log_base>.srun.log``."""
    spec = replace(spec, output=f"{commands.literal_pattern(str(log_base))}.%t.log")
    with Path(f"{log_base}.srun.log").open("ab") as out:
        return slurm.launch_step(spec, env=env, stdout=out.fileno())


def cancel_named_step(slurm: SlurmBackend, job_id: str, name: str,
                      proc: subprocess.Popen[bytes]) -> None:
    """scancel the step called ``name`` (its id is Slurm's), then make sure the local
    ``srun`` of it is gone."""
    try:
        for step in slurm.steps(job_id):
            if step.name == name:
                slurm.cancel_step(step.step)
    except SlurmCommandError as error:
        log.warning("scancel of %s: %s", name, error)
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
