"""Slurm ``Prolog=``: the quick profile before a job uses the node.

A failing Prolog makes Slurm drain the node and requeue *and hold* the whole
batch job (measurements: benchmarks/results/measurements.md#prolog-failure); the
node is drained first with the precise reason, which Slurm then keeps. For a
node promoted into a running job use the step-level gate
(``ft_launch.slurm_plugins.gate``) instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .hook import run_hook

PROFILE = "prolog"


def main(argv: Sequence[str] | None = None) -> int:
    return run_hook("prolog", lambda env, settings, slurm: PROFILE, job_ended=False, argv=argv)


if __name__ == "__main__":
    sys.exit(main())
