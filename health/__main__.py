"""``python -m ft_launch.health run --profile NAME [--json]``: run a health profile on this
node and print the report (stop-time diagnosis runs it with ``srun`` on a
replica's nodes). Exit 0 when nothing failed, 76 (NODE_UNHEALTHY) otherwise.
``python -m ft_launch.health profiles`` lists the profiles and their checks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from ft_launch.errors import ConfigError, ExitCode
from ft_launch.logs import configure_logging

from .profile import run_profile
from .settings import ENV_CONFIG, load_settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_launch.health",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", help=f"admin health config (default: ${ENV_CONFIG})")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one profile on this node")
    run.add_argument("--profile", default="diagnosis")
    run.add_argument("--node", default=os.environ.get("SLURMD_NODENAME", ""))
    run.add_argument("--json", action="store_true")
    sub.add_parser("profiles", help="list profiles")
    args = parser.parse_args(argv)
    configure_logging("WARNING")
    try:
        settings = load_settings(args.config)
        if args.command == "profiles":
            for name, spec in sorted(settings.profiles.items()):
                sys.stdout.write(f"{name} ({spec.budget:g}s): {', '.join(spec.checks)}\n")
            return ExitCode.OK
        node = args.node or os.uname().nodename.split(".")[0]
        report = run_profile(settings.profile(args.profile), settings.context(node))
    except ConfigError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return ExitCode.USAGE
    if args.json:
        sys.stdout.write(json.dumps(report.to_dict()) + "\n")
    else:
        for result in report.results:
            sys.stdout.write(f"{result.status.value:4s} {result.name:20s} {result.reason}\n")
    return ExitCode.OK if report.failure is None else ExitCode.NODE_UNHEALTHY


if __name__ == "__main__":
    sys.exit(main())
