"""``ft-launch``: the command line. Subcommands: ``plan`` (dry run).

Exit codes follow ``ftcore.errors.ExitCode`` (2: bad input; 78: fatal, do not
requeue; 75: transient, a requeue may help).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict

from ftcore.config import Config, load_config
from ftcore.errors import ExitCode, FtError, TerminalAbort
from ftcore.logs import configure_logging
from ftcore.slurm.allocation import Allocation
from ftcore.slurm.hostlist import compress, expand

from .plan import LaunchPlan, plan_allocation

log = logging.getLogger(__name__)

#: Shortcut flags of ``plan``/``run`` and the config keys they set.
JOB_FLAGS = {"replicas": "job.replicas", "nodes_per_replica": "job.nodes_per_replica",
             "tasks_per_node": "job.tasks_per_node", "standby": "job.standby"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ft-launch",
        description="Fault-tolerant launcher for data-parallel training on Slurm: one job "
                    "step per replica, warm standby nodes, recovery without requeueing.",
        epilog="Configuration: defaults < --config FILE < FTL_<SECTION>_<KEY> environment < "
               "--set section.key=value. Exit codes: 0 ok, 2 bad input, 75 transient "
               "(requeue may help), 76 node unhealthy, 78 fatal (do not requeue).")
    parser.add_argument("--config", metavar="FILE", help="TOML config file (see etc/)")
    parser.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                        dest="overrides", help="override one config value (repeatable)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    plan = sub.add_parser(
        "plan", help="print the node assignment and the exact srun commands; runs nothing",
        description="Dry run: split the allocation (or --nodelist) into replicas and standby "
                    "nodes and print the srun command of every replica step.")
    plan.add_argument("--nodelist", metavar="HOSTLIST",
                      help="nodes to plan for, e.g. n[1-8] (default: this allocation)")
    _add_job_flags(plan)
    output = plan.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the plan as JSON")
    output.add_argument("--shell", action="store_true",
                        help="print a bash script that starts every step and waits for all")
    plan.add_argument("train_command", nargs=argparse.REMAINDER,
                      help="-- then the training command each rank runs")
    return parser


def _add_job_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, help="data-parallel replicas (job.replicas)")
    parser.add_argument("--nodes-per-replica", type=int, help="job.nodes_per_replica")
    parser.add_argument("--tasks-per-node", type=int, help="job.tasks_per_node")
    parser.add_argument("--standby", type=int, help="warm standby nodes (job.standby)")


def resolve_config(args: argparse.Namespace) -> Config:
    overrides = list(args.overrides)
    for flag, key in JOB_FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append(f"{key}={value}")
    return load_config(args.config, overrides=overrides)


def command_plan(args: argparse.Namespace, config: Config) -> int:
    command = tuple(args.train_command[1:] if args.train_command[:1] == ["--"]
                    else args.train_command)
    if args.nodelist:
        nodes, job_id, batch_host = tuple(expand(args.nodelist)), None, None
    else:
        allocation = Allocation.from_env(os.environ)
        nodes, job_id, batch_host = allocation.nodes, allocation.job_id, allocation.batch_host
    plan = plan_allocation(nodes, config.job, command, job_id=job_id, batch_host=batch_host)
    extra = config.slurm.srun_extra_args
    if args.json:
        sys.stdout.write(json.dumps({**asdict(plan), "srun": plan.srun_commands(extra)},
                                    indent=2) + "\n")
    elif args.shell:
        sys.stdout.write(render_shell(plan, extra))
    else:
        sys.stdout.write(render_plan(plan, extra))
    return ExitCode.OK


def render_plan(plan: LaunchPlan, extra_args: tuple[str, ...] = ()) -> str:
    nodes = [n for r in plan.replicas for n in r.nodes] + list(plan.standby)
    lines = [(f"ft-launch plan: job {plan.job_id or '(none: --nodelist)'}, "
              f"{len(plan.replicas)} replica(s) on {compress(nodes)}")]
    for replica in plan.replicas:
        lines.append(f"  replica {replica.replica_id:<3d} {compress(replica.nodes)}")
    lines.append(f"  standby     {compress(plan.standby) or '-'}")
    if plan.excluded:
        lines.append(f"  excluded    {compress(plan.excluded)} (batch host)")
    lines.append("srun commands:")
    lines += [f"  {shlex.join(argv)}" for argv in plan.srun_commands(extra_args)]
    return "\n".join(lines) + "\n"


def render_shell(plan: LaunchPlan, extra_args: tuple[str, ...] = ()) -> str:
    """A script that runs the steps side by side and exits with the worst status."""
    lines = ["#!/bin/bash", "# generated by: ft-launch plan --shell", "pids=()"]
    for argv in plan.srun_commands(extra_args):
        lines += [f"{shlex.join(argv)} &", "pids+=($!)"]
    lines += ["rc=0", 'for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done', "exit $rc"]
    return "\n".join(lines) + "\n"


COMMANDS = {"plan": command_plan}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = resolve_config(args)
        return COMMANDS[args.command](args, config)
    except FtError as error:
        sys.stderr.write(f"ft-launch: error: {error}\n")
        return error.exit_code
    except TerminalAbort as abort:
        sys.stderr.write(f"ft-launch: aborted: {abort.reason}\n")
        return abort.exit_code


if __name__ == "__main__":
    sys.exit(main())
