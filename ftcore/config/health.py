"""The node health sections: ``[health]`` (the node, its GPU backend, what the
Slurm hooks do, the inspection during a run), and the named tables
``[checks.NAME]`` and ``[profiles.NAME]``.

The Slurm hooks (Prolog, Epilog, HealthCheckProgram) run as root outside any
job: they read these sections from the admin's file (``ft_launch.health.settings``), the
inspection agent and ``ft-launch`` from theirs. The check catalog lives in
``health``, above this kernel, so the named tables are kept here as plain
values (``Tables``) and typed there.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .fields import _count, _seconds, _Section, string_problem

BACKENDS = ("auto", "nvml", "simulated", "none")
#: Named tables per section and keys per table: an admin file has a few dozen.
MAX_TABLES = 256
_MAX_DEPTH = 4


@dataclass(frozen=True)
class HealthConfig(_Section):
    """Node checks, what the hooks do about a failure, and runtime inspection."""

    gpus_per_node: int = _count(0, 0, 128)    # 0: the GPU count is not judged
    backend: str = "auto"             # auto: NVML when /dev/nvidiactl exists, else none
    inspection: bool = True          # an inspection step per node during ft-launch run
    inspection_interval: float = _seconds(5.0)
    #: The disk check's free-space floor unless ``[checks.disk] min_free_bytes`` sets one.
    min_free_disk_bytes: int = _count(1 << 30, 0, 1 << 62)
    sim_fault_dir: str = ""           # simulated backend: faults in <dir>/<node>.json
    xid_window: float = _seconds(3600.0, zero_ok=True)  # kernel log that counts (0: since boot)
    drain: bool = True                # hooks drain a failing node themselves
    report_dir: str = ""              # each hook run writes <dir>/<node>/<hook>-<job>.json
    log_file: str = ""                # hooks log here as well as to stderr
    slurm_command_timeout: float = _seconds(10.0)

    def rules(self) -> Iterable[tuple[str, str]]:
        if self.backend not in BACKENDS:
            yield "backend", f"must be one of {', '.join(repr(b) for b in BACKENDS)}"
        elif self.backend == "none" and self.gpus_per_node:
            yield "backend", "'none' contradicts gpus_per_node > 0"


@dataclass(frozen=True)
class Tables:
    """Named tables of plain config values (strings, finite numbers, booleans,
    lists and tables of them), each with the source it came from."""

    tables: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: Where each table's values came from (a file, ``--set``): for error messages.
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    def __iter__(self) -> Iterator[str]:
        return iter(self.tables)

    def __len__(self) -> int:
        return len(self.tables)

    def get(self, name: str) -> Mapping[str, Any]:
        return self.tables.get(name, {})

    def source(self, name: str) -> str:
        return self.sources.get(name, "defaults")

    def updated(self, name: str, values: Mapping[str, Any], source: str) -> Tables:
        """These tables with ``values`` over table ``name``, key by key."""
        tables = {**self.tables, name: {**self.get(name), **values}}
        return Tables(tables, {**self.sources, name: source})

    def problems(self) -> Iterable[tuple[str, str]]:
        if len(self.tables) > MAX_TABLES:
            yield "", f"must hold at most {MAX_TABLES} tables"
        for name, table in self.tables.items():
            problem = string_problem(name) or (None if len(table) <= MAX_TABLES else
                                               f"must hold at most {MAX_TABLES} keys")
            if problem:
                yield name, problem
            for key, value in table.items():
                problem = string_problem(key) or _value_problem(value, _MAX_DEPTH)
                if problem:
                    yield f"{name}.{key}", problem


def _value_problem(value: Any, depth: int) -> str | None:
    """Why ``value`` is not a plain config value (TOML dates, NaN, control characters)."""
    if isinstance(value, str):
        return string_problem(value)
    if isinstance(value, bool) or isinstance(value, int) and abs(value) < 2**63:
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else "must be a finite number (not NaN or infinity)"
    if isinstance(value, (list, tuple, dict)):
        if depth == 0 or len(value) > MAX_TABLES:
            return f"must nest at most {_MAX_DEPTH} deep, {MAX_TABLES} items each"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return next((f"item {k!r} {p}" for k, v in items
                     if (p := (string_problem(k) if isinstance(k, str) else None)
                         or _value_problem(v, depth - 1))), None)
    return "must be a string, a number, true or false, a list or a table"

