"""What a benchmark writes with ``--json``: its figures and how they were made.

Every benchmark's result file carries ``recorded``: the command line that made it,
the day (UTC), the machine and the commit. A figure quoted elsewhere is read from
such a file (the README's table: ``benchmarks/readme_table.py``), so it names how
to make it again and cannot drift from what the benchmark measured.
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def _git(*argv: str) -> str:
    return subprocess.run(["git", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=30, check=False).stdout.strip()


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return "unknown CPU"


def commit() -> str:
    """The checkout's short commit, ``(dirty)`` when it has changes."""
    return _git("rev-parse", "--short", "HEAD") + (" (dirty)" if _git("status", "--porcelain")
                                                    else "")


def recorded(argv: list[str] | None = None) -> dict[str, str]:
    """How this process's figures were made: command, date, machine, commit."""
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(REPO) if script.is_relative_to(REPO) else script
    args = sys.argv[1:] if argv is None else argv
    return {"command": shlex.join(["python3", str(shown), *args]),
            "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
            "machine": f"{os.cpu_count()} CPUs ({_cpu_model()})", "commit": commit()}


def write_json(path: Path | str, payload: dict[str, Any]) -> None:
    """``payload`` and ``recorded`` to ``path`` (indented JSON)."""
    text = json.dumps({**payload, "recorded": recorded()}, indent=2, default=str)
    Path(path).write_text(text + "\n", encoding="utf-8")
