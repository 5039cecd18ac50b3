"""Fault injection for the tests, the demo and the benchmarks: lab tooling, no product
module imports it. A worker injects faults through its step observer seam
(``ft_launch.launcher.worker.observer``) when ``FTL_WORKER_OBSERVER`` names
``INJECTOR``, the file of ``injector``; ``lab_env`` is that setting."""

from __future__ import annotations

from pathlib import Path

from ft_launch.env import ENV_OBSERVER

#: What ``FTL_WORKER_OBSERVER`` names for a worker to inject faults: a file, as the
#: workers run the installed package without the checkout on their path.
INJECTOR = Path(__file__).resolve().with_name("injector.py")


def lab_env() -> dict[str, str]:
    """The environment that makes a worker inject ``FTL_WORKER_INJECT``'s faults and
    its node's simulated silent data corruption."""
    return {ENV_OBSERVER: str(INJECTOR)}
