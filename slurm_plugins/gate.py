"""The step-level gate: the first thing a promoted replica's step runs.

``python -m ft_launch.slurm_plugins.gate [--profile gate] [--report FILE] [--drain] -- CMD...``

A Prolog that fails requeues the whole job; this gate fails only its own step.
It runs the ``gate`` profile on the node it lands on and then

* passes: replaces itself with ``CMD`` (``exec``, no shell), or exits 0 without one;
* fails: prints ``ft-gate: <node> unhealthy: <reason>`` on stderr, writes the
  report to ``--report`` if given, drains the node when ``--drain`` is set (needs
  Slurm operator rights, which a user's step usually lacks: the launcher drains
  instead, from the exit code and the report), and exits 76 (NODE_UNHEALTHY).

The check itself is ``ft_launch.health.gate`` (the standby agent runs it too, at
promotion); this wrapper adds the command line, the report file, the drain and the exec.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from ft_launch.errors import ConfigError, ExitCode, SlurmCommandError
from ft_launch.files import atomic_write_text
from ft_launch.health.drain import drain_node
from ft_launch.health.gate import GATE_PROFILE, check_node
from ft_launch.health.profile import ProfileReport
from ft_launch.health.settings import ENV_CONFIG, load_settings
from ft_launch.logs import configure_logging

from .hook import slurm_client

log = logging.getLogger(__name__)

GATE_FAILED_PREFIX = "ft-gate:"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ft_launch.slurm_plugins.gate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=GATE_PROFILE)
    parser.add_argument("--config", help=f"admin health config (default: ${ENV_CONFIG})")
    parser.add_argument("--report", help="write the JSON report here")
    parser.add_argument("--drain", action="store_true", help="drain the node on failure")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- CMD ARGS...: run after the gate passes")
    return parser.parse_args(argv)


def gate(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[int, ProfileReport]:
    """The check once, as the command line asks: the exit code and the report."""
    settings = load_settings(args.config, env=env)
    report = check_node(settings, env, args.profile)
    if args.report:
        atomic_write_text(args.report, json.dumps(report.to_dict(), indent=1), durable=False)
    failure = report.failure
    if failure is None:
        return ExitCode.OK, report
    sys.stderr.write(f"{GATE_FAILED_PREFIX} {report.node} unhealthy: {failure.reason}\n")
    if args.drain:
        try:
            drain_node(slurm_client(settings, env), report.node, failure.reason)
        except SlurmCommandError as exc:
            log.warning("gate could not drain %s: %s", report.node, exc)
    return ExitCode.NODE_UNHEALTHY, report


def main(argv: Sequence[str] | None = None) -> int:
    configure_logging("WARNING")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        code, _ = gate(args, os.environ)
    except ConfigError as exc:
        # Unlike the Prolog, a broken config or a node name the gate cannot use (the
        # step's environment is the job's own) is the job owner's to fix: say so.
        sys.stderr.write(f"{GATE_FAILED_PREFIX} config error: {exc}\n")
        return ExitCode.USAGE
    if code != ExitCode.OK or not command:
        return code
    os.execvp(command[0], command)
    return ExitCode.FATAL_NO_REQUEUE  # not reached: exec replaces the process


if __name__ == "__main__":
    sys.exit(main())
