"""Import the benchmark scripts (``benchmarks/`` is not a package) as modules."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    # On sys.path (not loaded from a file spec) so that spawned processes can
    # import the module that defines their target by name.
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)
