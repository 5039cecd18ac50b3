"""The README's "What works today" table, from the benchmarks' own result files.

Each row's figure is read from one file in ``benchmarks/results/`` (what the
benchmark wrote with ``--json``: ``benchmarks/record.py``) with the command, day and
machine that made it; ``tests/unit/test_readme_table.py`` keeps the README equal to
what this renders, so a figure changes only with a new run of its benchmark.

``python3 benchmarks/readme_table.py``          print the table
``python3 benchmarks/readme_table.py --write``  put it into README.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
BEGIN = "<!-- the table below: python3 benchmarks/readme_table.py --write -->"
END = "<!-- end of the table -->"

Summary = Mapping[str, Any]


@dataclass(frozen=True)
class Row:
    part: str
    state: str
    result: str | None = None                          # a file in benchmarks/results/
    figure: Callable[[Summary], str] | None = None     # its summary -> one figure


def _quorum(s: Summary) -> str:
    standing = s["standing_round"]
    return (f"{standing['members']} members: p50 {standing['p50_ms']:.1f} ms a round "
            f"(standing quorum); leader failover {s['failover_s']:.2f} s")


ROWS = (
    Row("config, errors, events, Slurm client (`ftcore/`)", "done"),
    Row("`ft-launch plan`, `run` (in-allocation or reservation standby, `--jobid` from a "
        "login node), `submit`, `local` (no Slurm), `status`, `update`, `timeline`, "
        "`standby-size`", "done", "recovery.json",
        lambda s: f"a node crashed: no progress for {s['ftlaunch_no_progress_s']:.1f} s, "
                  f"{s['ratio']:.1f}x shorter than a whole-job requeue"),
    Row("FTAR (`ftar/`): fault-tolerant ring all-reduce, overlapped with backward",
        "done; the CUDA path passed `tests/gpu/run.sh` on an H200 (2026-12-04)",
        "ftar.json", lambda s: f"{s['geomean_ratio_vs_gloo']:.2f}x gloo's throughput "
                               "(geometric mean over the sizes)"),
    Row("quorum (`launcher/quorum/`): leader-elected, HMAC-authenticated, witness voters, "
        "standing quorums", "done", "quorum.json", _quorum),
    # no result file yet (benchmarks/ckpt_bench.py): no figure until a run writes one
    Row("checkpoints (`ckpt/`): dual buffer, peer backup, HTTP catch-up, HDF5, restore chain",
        "done (`benchmarks/ckpt_bench.py`)"),
    Row("FT-HSDP worker runtime (`launcher/worker/`): per-step protocol, exactly-once data, "
        "FSDP2 / DDP / plain replicas", "done; FSDP2 on CUDA passed `tests/gpu/run.sh` on an "
        "H200 (2026-12-04)", "hsdp.json",
        lambda s: f"a step takes {s['step_time_ratio_vs_native_hsdp']:.2f}x native HSDP's "
                  "(median over the run's pairs)"),
    Row("a replica hung mid all-reduce", "done", "hang.json",
        lambda s: f"the others stall {s['max_healthy_stall_s']:.1f} s, not the ring timeout "
                  f"({s['ring_timeout_only_stall_s']:.0f} s)"),
    Row("health checks, Slurm prolog/epilog/healthcheck/gate (`health/`, `slurm_plugins/`)",
        "done (the NVML backend not yet run on a GPU)"),
    Row("the real Slurm test cluster (`tests/cluster/slurm-cluster`)", "done"),
)


def _cell(row: Row, results: Path) -> str:
    if row.result is None or row.figure is None:
        return "-"
    data = json.loads((results / row.result).read_text(encoding="utf-8"))
    made = data["recorded"]
    return (f"{row.figure(data['summary'])} (`{made['command']}`, {made['date']}, "
            f"{made['machine']})")


def render(results: Path = RESULTS) -> str:
    """The table, with each row's figure as its result file has it."""
    lines = ["| part | state | figure (command, day, machine) |", "| --- | --- | --- |"]
    lines += [f"| {row.part} | {row.state} | {_cell(row, results)} |" for row in ROWS]
    return "\n".join(lines)


def _between(readme: str) -> tuple[int, int]:
    return readme.index(BEGIN) + len(BEGIN), readme.index(END)


def table_in(readme: str) -> str:
    """The table between the markers of ``readme``."""
    start, end = _between(readme)
    return readme[start:end].strip("\n")


def with_table(readme: str, table: str) -> str:
    """``readme`` with ``table`` between its markers (whatever was there before)."""
    start, end = _between(readme)
    return f"{readme[:start]}\n{table}\n{readme[end:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="put the table into README.md")
    args = parser.parse_args(argv)
    table = render()
    if not args.write:
        print(table)
        return 0
    README.write_text(with_table(README.read_text(encoding="utf-8"), table), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
