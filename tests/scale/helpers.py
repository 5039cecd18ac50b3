"""Import scripts that are in no package (``benchmarks/``, ``etc/``) as modules."""

from __future__ import annotations

import importlib
import importlib.util
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


def load_script(path: Path) -> ModuleType:
    """``path`` as a fresh module of its own, with its directory on ``sys.path``
    while it loads (as when run: the example's ``train.py`` imports its neighbours)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))
