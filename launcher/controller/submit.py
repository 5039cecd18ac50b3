"""``ft-launch submit``: the allocation without a batch host, in one command.

On a login node: ``salloc --no-shell --no-kill`` for the replicas and standby
nodes, then the controller (``ft-launch run --jobid JOB --release-allocation``)
runs on this host, detached from the terminal, and cancels the allocation when
the run ends. No node of the allocation runs anything but training or standby,
so losing any one of them is an ordinary replica or standby fault. (Under
``sbatch`` the batch host runs the controller and every ``srun`` client; when it
dies the workers save the newest state and requeue the job instead: see
``ft_launch.launcher.worker.controller_loss``.)
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ft_launch.config import Config, StandbyMode
from ft_launch.errors import SlurmCommandError, UsageError
from ft_launch.slurm.client import SlurmCli

from .plan import JOB_FLAGS, plan_allocation

log = logging.getLogger(__name__)


def nodes_needed(config: Config) -> int:
    job = config.job
    standby = job.standby if job.standby_mode is StandbyMode.IN_ALLOCATION else 0
    return job.replicas * job.nodes_per_replica + standby


def salloc_extra(args: argparse.Namespace) -> tuple[str, ...]:
    """The salloc options ``submit`` passes on (time, partition, account, any other)."""
    extra = [f"--{name}={value}" for name, value in (("time", args.time),
                                                     ("partition", args.partition),
                                                     ("account", args.account)) if value]
    return (*extra, *args.salloc_arg)


def controller_argv(args: argparse.Namespace, job_id: str, command: Sequence[str]) -> list[str]:
    """The detached controller's command line: this invocation's config sources and job
    flags, as ``run --jobid JOB --release-allocation``."""
    argv = [sys.executable, "-m", "ft_launch.launcher.cli", "--log-level", args.log_level]
    if args.config:
        argv += ["--config", str(Path(args.config).resolve())]
    for override in args.overrides:
        argv += ["--set", override]
    argv += ["run", "--jobid", job_id, "--release-allocation"]
    for name in JOB_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return [*argv, "--", *command]


def submit(args: argparse.Namespace, config: Config, command: tuple[str, ...],
           slurm: SlurmCli) -> tuple[str, Path, int | None]:
    """Allocate, then start the controller. Returns the job id, the run directory and
    the controller's pid (None with ``--foreground``: the caller runs it)."""
    count = nodes_needed(config)
    # Every mistake the plan can find is found before anything is allocated.
    plan_allocation(tuple(f"node{i}" for i in range(count)), config.job, command)
    sys.stderr.write(f"ft-launch submit: waiting for {count} node(s) "
                     f"(salloc --no-shell --no-kill, job name {args.job_name})\n")
    job_id = slurm.allocate(count, name=args.job_name, extra=salloc_extra(args),
                            wait_forever=True)
    run_dir = (Path(config.run.log_dir) / job_id).resolve()
    sys.stderr.write(f"ft-launch submit: job {job_id} granted; run directory {run_dir}\n")
    if args.foreground:
        return job_id, run_dir, None
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with (run_dir / "controller.out").open("ab") as out:
            controller = subprocess.Popen(controller_argv(args, job_id, command),
                                          stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True,
                                          cwd=os.getcwd())
    except OSError as error:
        release_allocation(slurm, job_id)
        raise UsageError(f"cannot start the controller for job {job_id}: {error}",
                         hint="the allocation was cancelled") from None
    return job_id, run_dir, controller.pid


def release_allocation(slurm: SlurmCli, job_id: str) -> None:
    """Cancel an allocation made for this run; if that fails, say how to do it by hand
    (never replace the run's own outcome with this error)."""
    try:
        slurm.cancel_job(job_id)
        log.info("allocation %s released", job_id)
    except SlurmCommandError as error:
        sys.stderr.write(f"ft-launch: cancel job {job_id} yourself (scancel "
                         f"{job_id}): {error}\n")
