"""Slurm ``HealthCheckProgram=``: the periodic node check.

slurmd only logs this program's exit code, so it drains the node itself. It sees
only ``SLURMD_NODENAME``. A node already drained keeps its reason.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .hook import run_hook

PROFILE = "healthcheck"


def main(argv: Sequence[str] | None = None) -> int:
    return run_hook("healthcheck", lambda env, settings, slurm: PROFILE, job_ended=False,
                    argv=argv)


if __name__ == "__main__":
    sys.exit(main())
