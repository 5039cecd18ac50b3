"""``ft-launch``: the command line (``ft-launch --help`` lists the subcommands).

Exit codes follow ``ft_launch.errors.ExitCode`` (2: bad input; 78: fatal, do not
requeue; 75: transient, a requeue may help).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ft_launch.config import Config, load_config, save_config
from ft_launch.errors import (
    ConfigError,
    ExitCode,
    FtError,
    SlurmCommandError,
    TerminalAbort,
    UsageError,
)
from ft_launch.events import EventLog, RunStarted
from ft_launch.files import atomic_write_text
from ft_launch.ids import new_job_secret
from ft_launch.logs import configure_logging
from ft_launch.slurm.allocation import Allocation, allocation_of_job
from ft_launch.slurm.client import SlurmCli
from ft_launch.slurm.hostlist import compress, expand

from .controller.events import ControllerWitnessChosen
from .controller.plan import JOB_FLAGS, LaunchPlan, check_cpus, plan_allocation
from .controller.submit import release_allocation, submit
from .controller.supervisor import Supervisor
from .controller.versions import write_update_request
from .heartbeat import heartbeat_path
from .quorum.agent import QuorumAgent
from .quorum.reach import Reach, probe
from .quorum.witness_service import WitnessJob, controller_witness, serve
from .reporting.ettr import JobModel, RecoveryCost, poisson_failures, simulate, standby_size
from .reporting.live import show, watch
from .reporting.plots import render_timeline
from .reporting.summary import summarize
from .worker.identity import (
    ENV_CONFIG,
    ENV_HEARTBEAT,
    ENV_JOB_ID,
    ENV_NUM_REPLICAS,
    ENV_RUN_DIR,
    ENV_SECRET,
)
from .worker.local import LocalJob, LocalRun

log = logging.getLogger(__name__)



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
    run = sub.add_parser(
        "run", help="run training: one job step per replica, warm standby, recovery",
        description="Inside an allocation (sbatch --no-kill): plan replicas and standby "
                    "nodes, launch one srun step per replica and a warm standby agent per "
                    "standby node, and recover from faults without requeueing. Writes "
                    "<run.log_dir>/<job id>/: config.toml, controller.jsonl, events/, logs/, "
                    "summary.json.")
    _add_job_flags(run)
    run.add_argument("--jobid", metavar="JOB",
                     help="drive this allocation from outside it, e.g. from a login node: "
                          "salloc --no-shell --no-kill -N NODES, then ft-launch run --jobid "
                          "JOB ... (no batch host: the run survives the loss of any compute "
                          "node)")
    run.add_argument("--release-allocation", action="store_true",
                     help="cancel the --jobid allocation when the run ends (ft-launch submit "
                          "sets it: the allocation was made for this run)")
    run.add_argument("train_command", nargs=argparse.REMAINDER,
                     help="-- then the training command each rank runs")

    local = sub.add_parser(
        "local", help="run the training script's replicas on this machine, without Slurm",
        description="Try a training loop before submitting it: the script runs as REPLICAS "
                    "replicas of TASKS_PER_NODE ranks each, as local processes on loopback, "
                    "with the same quorum, FTAR and state servers as under 'ft-launch run'. "
                    "A replica that dies is started again and catches up from the others "
                    "(--max-restarts); --kill shows that happen. Writes the run directory "
                    "'ft-launch status' and 'ft-launch timeline' read.",
        epilog="Example: ft-launch local --replicas 2 --kill 1@20 -- python train.py")
    local.add_argument("--replicas", type=int, help="data-parallel replicas (job.replicas)")
    local.add_argument("--tasks-per-node", type=int, metavar="RANKS",
                       help="ranks per replica, each a process on this machine "
                            "(job.tasks_per_node)")
    local.add_argument("--max-restarts", type=int, default=3, metavar="N",
                       help="how many times each replica is started again after it "
                            "failed (default 3)")
    local.add_argument("--kill", action="append", default=[], metavar="REPLICA@STEP",
                       help="SIGKILL replica REPLICA right after it commits step STEP, to "
                            "watch it recover (repeatable)")
    local.add_argument("--run-dir", type=Path,
                       help="where the run writes (default: <run.log_dir>/local-<time>)")
    local.add_argument("train_command", nargs=argparse.REMAINDER,
                       help="-- then the training command each rank runs")

    witness = sub.add_parser(
        "witness", help="vote in a running job's quorum without training (a witness)",
        description="Run witness K of a job (K = 1..quorum.witnesses; witness 0 is the "
                    "controller) on a login or service node that shares the run directory. "
                    "Witnesses let the replicas train on down to quorum.min_replicas while "
                    "two sides of a partition can never both train. Runs until SIGTERM or "
                    "Ctrl-C.")
    witness.add_argument("--run-dir", type=Path, required=True, help="the job's run directory")
    witness.add_argument("--index", type=int, required=True, metavar="K",
                         help="which witness this is (1..quorum.witnesses)")

    sub_parser = sub.add_parser(
        "submit", help="from a login node: allocate, and run the controller here",
        description="One command on a login node: salloc --no-shell --no-kill for the "
                    "replicas and standby nodes, then the controller (ft-launch run --jobid) "
                    "runs on this host, detached, and cancels the allocation when the run "
                    "ends. No node of the allocation is special: losing any one is a replica "
                    "or standby fault. Under sbatch instead, the batch host carries the "
                    "controller; if it dies the workers save the newest state and requeue "
                    "the job.",
        epilog="Follow it with: ft-launch status RUN_DIR, or tail -f RUN_DIR/controller.log.")
    _add_job_flags(sub_parser)
    sub_parser.add_argument("--job-name", default="ft-launch", help="salloc --job-name")
    sub_parser.add_argument("--time", help="salloc --time (e.g. 2-00:00:00)")
    sub_parser.add_argument("--partition", help="salloc --partition")
    sub_parser.add_argument("--account", help="salloc --account")
    sub_parser.add_argument("--salloc-arg", action="append", default=[], metavar="ARG",
                            help="another salloc option, e.g. --salloc-arg=--qos=high "
                                 "(repeatable)")
    sub_parser.add_argument("--foreground", action="store_true",
                            help="run the controller in this terminal instead of detached")
    sub_parser.add_argument("train_command", nargs=argparse.REMAINDER,
                            help="-- then the training command each rank runs")

    status = sub.add_parser("status", help="replicas, nodes, steps, standby pool, events",
                            description="Read a run directory and show where it stands.")
    status.add_argument("run_dir", type=Path, nargs="?",
                        help="run directory (default: <run.log_dir>/$SLURM_JOB_ID)")
    status.add_argument("--summary", action="store_true", help="print the run summary (JSON)")
    status.add_argument("--watch", action="store_true",
                        help="keep the view on screen, updated in place, until the run ends "
                             "(when stdout is not a terminal: new events, one line each)")
    status.add_argument("--total-steps", type=int, metavar="N",
                        help="the steps the run trains for: progress bars fill to N "
                             "(default: to the leading replica's step)")

    update = sub.add_parser(
        "update", help="hot-update the training command of a running job",
        description="Record a new code version for a running job. It is applied at each "
                    "replica's next recovery; --urgent restarts the replicas now, one at a "
                    "time (the others keep training); otherwise they are restarted after the "
                    "window (default 24 h). A version on which a replica fails repeatedly "
                    "without a step is rolled back. Every change is in controller.jsonl.")
    update.add_argument("--run-dir", type=Path,
                        help="run directory (default: <run.log_dir>/$SLURM_JOB_ID)")
    update.add_argument("--urgent", action="store_true", help="apply now (rolling restart)")
    update.add_argument("--window", type=float, metavar="S",
                        help="force the update after S seconds (default 24 h)")
    update.add_argument("--note", default="", help="why (recorded with the version)")
    update.add_argument("train_command", nargs=argparse.REMAINDER,
                        help="-- then the new training command (run from the current "
                             "directory's point of view: its files are digested now)")

    timeline = sub.add_parser("timeline", help="draw a run's timeline (PNG)",
                              description="Replica states (starting, training, down, "
                                          "finished), failures, promotions and the loss "
                                          "(else the committed step) over time. Needs "
                                          "matplotlib: pip install 'ft-launch[plot]'.")
    timeline.add_argument("run_dir", type=Path, nargs="?",
                          help="run directory (default: <run.log_dir>/$SLURM_JOB_ID)")
    timeline.add_argument("--out", type=Path, help="PNG path (default: RUN_DIR/timeline.png)")

    size = sub.add_parser(
        "standby-size", help="how many warm standby nodes to hold (binomial percentile)",
        description="Warm standby count = the chosen percentile of concurrent machine failures "
                    "within the replenish window (Binomial(machines, p_window)), and the ETTR "
                    "each standby node buys, from a simulated month of Poisson failures with "
                    "asynchronous per-replica recovery.")
    size.add_argument("--machines", type=int, required=True, help="machines in the job")
    size.add_argument("--daily-failure-rate", type=float, required=True,
                      help="probability that one machine fails in a day, e.g. 0.002")
    size.add_argument("--window", type=float, required=True, metavar="HOURS",
                      help="hours until a used standby node is replaced")
    size.add_argument("--percentile", type=float, default=0.99)
    size.add_argument("--replicas", type=int, default=12,
                      help="data-parallel replicas (default 12, FT-HSDP's at 100K GPUs)")
    size.add_argument("--stall", type=float, default=10.0, metavar="S",
                      help="seconds every replica stalls per failure (detection + reconfigure)")
    size.add_argument("--rejoin", type=float, default=120.0, metavar="S",
                      help="seconds a replica is out when a standby is promoted")
    size.add_argument("--reschedule", type=float, default=900.0, metavar="S",
                      help="seconds a replica is out when no standby is free")
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
    command = _train_command(args)
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


def command_run(args: argparse.Namespace, config: Config) -> int:
    slurm = SlurmCli(config.slurm.command_timeout)
    if not args.release_allocation:
        return _run(args, config, slurm)
    if not args.jobid:
        raise UsageError("--release-allocation needs --jobid")
    try:
        return _run(args, config, slurm)
    finally:
        release_allocation(slurm, args.jobid)


def command_submit(args: argparse.Namespace, config: Config) -> int:
    slurm = SlurmCli(config.slurm.command_timeout)
    job_id, run_dir, pid = submit(args, config, _train_command(args), slurm)
    if pid is None:
        args.jobid, args.release_allocation = job_id, True
        return command_run(args, config)
    sys.stdout.write(f"job {job_id}: controller running here (pid {pid}), detached; it "
                     f"releases the allocation when the run ends\n"
                     f"  run directory  {run_dir}\n"
                     f"  follow         ft-launch status {run_dir}\n"
                     f"  stop           scancel {job_id}\n")
    return ExitCode.OK


def _run(args: argparse.Namespace, config: Config, slurm: SlurmCli) -> int:
    command = _train_command(args)
    if args.jobid:
        info = slurm.job(args.jobid)
        if info is None:
            raise UsageError(f"no job {args.jobid}", hint="check squeue")
        allocation = allocation_of_job(info)
    else:
        allocation = Allocation.from_env(os.environ)
    check_cpus(allocation.cpus_per_node, allocation.nodes, config.job.tasks_per_node,
               allocation.job_id)
    plan = plan_allocation(allocation.nodes, config.job, command, job_id=allocation.job_id,
                           batch_host=allocation.batch_host)
    run_dir = (Path(config.run.log_dir) / allocation.job_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config_path = save_config(config, run_dir)
    worker_env = {ENV_JOB_ID: allocation.job_id, ENV_NUM_REPLICAS: str(config.job.replicas),
                  ENV_RUN_DIR: str(run_dir), ENV_SECRET: new_job_secret(),
                  ENV_CONFIG: str(config_path), ENV_HEARTBEAT: str(heartbeat_path(run_dir))}
    configure_logging(args.log_level, run_dir / "controller.log")
    log.info("run %s: %s", run_dir, render_plan(plan, config.slurm.srun_extra_args))
    with EventLog(run_dir / "controller.jsonl") as events:
        events.emit(RunStarted(job_id=allocation.job_id, replicas=config.job.replicas,
                               nodes=list(allocation.nodes)))
        targets = node_targets(slurm, allocation.nodes)
        reach = probe(targets)
        witness = start_witness(run_dir, WitnessJob(allocation.job_id, worker_env[ENV_SECRET],
                                                    config.job.replicas, nodes=targets),
                                config, reach, events)
        try:
            code = Supervisor(config, plan, slurm, run_dir, worker_env, events,
                              listen_host=reach.address).run()
        finally:
            if witness is not None:
                witness.stop()
    write_run_report(run_dir)
    return code


def command_local(args: argparse.Namespace, config: Config) -> int:
    command = _train_command(args)
    if not command:
        raise UsageError("no training command", hint="ft-launch local -- python train.py ...")
    if args.max_restarts < 0:
        raise UsageError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    kills = parse_kills(args.kill, config.job.replicas)
    job_id = f"local-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    run_dir = (args.run_dir or Path(config.run.log_dir) / job_id).resolve()
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config_path = save_config(config, run_dir)
    configure_logging(args.log_level, run_dir / "controller.log")
    ranks = config.job.nodes_per_replica * config.job.tasks_per_node
    job = LocalJob(run_dir, config.job.replicas, command, {ENV_CONFIG: str(config_path)},
                   ranks=ranks, job_id=job_id)
    run = LocalRun(job, max_restarts=args.max_restarts, kills=kills)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: run.stop.set())
    sys.stdout.write(f"local run: {config.job.replicas} replica(s) x {ranks} rank(s) of "
                     f"{shlex.join(command)}\n  run directory  {run_dir}\n  follow         "
                     f"ft-launch status --watch {run_dir}\n")
    sys.stdout.flush()
    code = run.run()
    write_run_report(run_dir)
    return code


def parse_kills(items: Sequence[str], replicas: int) -> dict[int, int]:
    """``--kill REPLICA@STEP`` items: replica -> step."""
    kills = {}
    for item in items:
        replica, _, step = item.partition("@")
        try:
            replica_id, at = int(replica), int(step)
        except ValueError:
            raise UsageError(f"--kill {item!r}: expected REPLICA@STEP, e.g. 1@20") from None
        if not 0 <= replica_id < replicas or at < 0:
            raise UsageError(f"--kill {item!r}: replica must be 0..{replicas - 1} and the "
                             "step 0 or more")
        kills[replica_id] = at
    return kills


def node_targets(slurm: SlurmCli, nodes: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``(name, address)`` of the allocation's nodes, the addresses from Slurm (its
    NodeAddr), or the names themselves where Slurm does not answer."""
    try:
        addresses = {n.name: n.address for n in slurm.nodes(nodes)}
    except SlurmCommandError as error:     # the node names are tried instead
        log.warning("no node addresses from Slurm (%s); resolving the node names", error)
        addresses = {}
    return tuple((n, addresses.get(n) or n) for n in nodes)


def start_witness(run_dir: Path, job: WitnessJob, config: Config, reach: Reach,
                  events: EventLog) -> QuorumAgent | None:
    """The controller votes as witness 0 (quorum.controller_witness): with it one live
    replica trains on; losing it alone costs the replicas nothing. It listens at the
    address its route to the nodes leaves from (``reach``); without one it does not
    vote (and no replica counts it), which is logged, recorded and shown by
    ft-launch status."""
    agent, reach = controller_witness(run_dir, job, config.quorum, reach)
    if agent is not None:
        log.info("the controller votes as witness 0 at %s: %s", agent.address, reach.reason)
    elif config.quorum.controller_witness:
        log.warning("the controller does NOT vote as witness 0: %s. The replicas train on "
                    "only while a majority of them is live; make the nodes reachable from "
                    "this host, or run 'ft-launch witness' elsewhere", reach.reason)
    events.emit(ControllerWitnessChosen(voting=agent is not None, address=reach.address or "",
                                        reason=reach.reason))
    return agent


def command_witness(args: argparse.Namespace, config: Config) -> int:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    log.info("witness %d of %s", args.index, args.run_dir)
    serve(args.run_dir.resolve(), args.index, config.quorum, stop)
    return ExitCode.OK


def write_run_report(run_dir: Path) -> None:
    """The run's summary.json and timeline picture, printed. The run is over: a failure
    here (a full disk, an unreadable log) is logged and never replaces its exit code."""
    try:
        summary = summarize(run_dir)
        atomic_write_text(run_dir / "summary.json", summary.to_json() + "\n")
        sys.stdout.write(f"summary ({run_dir / 'summary.json'}):\n{summary.to_json()}\n")
        sys.stdout.write(f"timeline: {render_timeline(run_dir, run_dir / 'timeline.png')}\n")
    except (ValueError, OSError, FtError) as error:
        log.warning("no run report: %s", error)


def _run_dir(args: argparse.Namespace, config: Config) -> Path:
    run_dir = args.run_dir
    if run_dir is None:
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            raise UsageError("which run?", hint="give the run directory, or run inside the job")
        run_dir = Path(config.run.log_dir) / job_id
    if not (run_dir / "controller.jsonl").exists():
        raise UsageError(f"{run_dir} is not an ft-launch run directory (no controller.jsonl)")
    return run_dir


def command_update(args: argparse.Namespace, config: Config) -> int:
    run_dir = _run_dir(args, config)
    request = write_update_request(run_dir, _train_command(args), urgent=args.urgent,
                                   window_s=args.window, note=args.note)
    when = "now, one replica at a time" if args.urgent else (
        f"at each replica's next recovery, at the latest after "
        f"{'24 h' if args.window is None else f'{args.window:g} s'}")
    sys.stdout.write(f"update request {request.number} recorded (digest "
                     f"{request.digest[:12]}): applied {when}\n")
    return ExitCode.OK


def command_timeline(args: argparse.Namespace, config: Config) -> int:
    run_dir = _run_dir(args, config)
    out = render_timeline(run_dir, args.out or run_dir / "timeline.png")
    sys.stdout.write(f"{out}\n")
    return ExitCode.OK


def command_status(args: argparse.Namespace, config: Config) -> int:
    run_dir = _run_dir(args, config)
    if args.summary:
        sys.stdout.write(summarize(run_dir).to_json() + "\n")
    elif args.watch:
        watch(run_dir, total_steps=args.total_steps)
    else:
        show(run_dir, total_steps=args.total_steps)
    return ExitCode.OK


def _train_command(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(args.train_command[1:] if args.train_command[:1] == ["--"]
                 else args.train_command)


def command_standby_size(args: argparse.Namespace, config: Config) -> int:
    if args.machines < 1 or not 0 <= args.daily_failure_rate < 1 or args.window <= 0:
        raise UsageError("need --machines >= 1, 0 <= --daily-failure-rate < 1, --window > 0")
    recommended = standby_size(args.machines, args.daily_failure_rate, args.window,
                               args.percentile)
    replicas = args.replicas
    horizon = 30 * 86400.0
    failures = poisson_failures(args.machines * args.daily_failure_rate / 86400.0, horizon,
                                seed=0)
    cost = RecoveryCost(stall=args.stall, degraded=args.rejoin,
                        fallback_degraded=args.reschedule)
    lines = [(f"P{args.percentile * 100:g} of concurrent failures in a {args.window:g} h "
              f"window on {args.machines} machines: {recommended} -> hold {recommended} warm "
              "standby node(s)"),
             (f"ETTR over 30 simulated days ({len(failures)} failures, {replicas} replicas, "
              f"stall {args.stall:g} s, rejoin {args.rejoin:g} s, reschedule "
              f"{args.reschedule:g} s):"),
             "  standby    ETTR     fallbacks (no standby free)"]
    ettr = {}
    for count in sorted({0, recommended // 4, recommended // 2, 3 * recommended // 4,
                         recommended, recommended + 1}):
        job = JobModel(replicas, horizon, standby=count, replenish=args.window * 3600)
        result = simulate(failures, cost, job)
        ettr[count] = result.ettr
        lines.append(f"  {count:7d}   {result.ettr:.5f}   {result.fallbacks}")
    if recommended:
        per_node = (ettr[recommended] - ettr[0]) / recommended * 100
        lines.append(f"ETTR gained per standby node (0 -> {recommended}): {per_node:+.4f} pp")
    sys.stdout.write("\n".join(lines) + "\n")
    return ExitCode.OK


COMMANDS = {"plan": command_plan, "run": command_run, "submit": command_submit,
            "local": command_local,
            "status": command_status,
            "update": command_update, "timeline": command_timeline,
            "standby-size": command_standby_size, "witness": command_witness}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        config = resolve_config(args)
    except ConfigError as error:  # this invocation's input (--config, FTL_*, --set, flags)
        sys.stderr.write(f"ft-launch: error: {error}\n")
        return ExitCode.USAGE
    try:
        return COMMANDS[args.command](args, config)
    except FtError as error:
        sys.stderr.write(f"ft-launch: error: {error}\n")
        return error.exit_code
    except TerminalAbort as abort:
        sys.stderr.write(f"ft-launch: aborted: {abort.reason}\n")
        return abort.exit_code


if __name__ == "__main__":
    sys.exit(main())
