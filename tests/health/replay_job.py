"""A stand-in reduced job for dual-phase replay, for the replay runner's tests (host and
Slurm tiers), run by path: ``python tests/health/replay_job.py --expect DIGEST``.

Every task computes a fixed workload in pure Python - only IEEE-754 additions,
multiplications and divisions, so every correct machine gets the same bits -
and compares its digest with ``--expect`` (the runner computes it with
``reference_digest()``). A mismatch exits 1, failing the step. On the simulated
GPU backend, a node whose fault file holds ``sdc`` computes a wrong result.

The real replay reruns the training job itself, reduced (same TP/PP, smaller
DP, fewer layers); any command that exits non-zero on a wrong result will do.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import sys
from collections.abc import Sequence

SIZE = 24
ROUNDS = 3


def _matrix(salt: int) -> list[list[float]]:
    return [[((i * 31 + j * 17 + salt) % 97) / 97.0 for j in range(SIZE)] for i in range(SIZE)]


def _dot(row: list[float], b: list[list[float]], column: int) -> float:
    # A plain loop, not sum(): Python 3.12 made sum() of floats compensated.
    total = 0.0
    for t in range(SIZE):
        total += row[t] * b[t][column]
    return total


def workload_digest(corrupt: bool = False) -> str:
    a, b = _matrix(1), _matrix(2)
    if corrupt:  # silent data corruption: one low-order bit of one operand flips
        a[3][5] += 2.0 ** -40
    for _ in range(ROUNDS):
        a = [[_dot(a[i], b, j) / SIZE for j in range(SIZE)] for i in range(SIZE)]
    return hashlib.sha256(b"".join(struct.pack("<d", v) for row in a for v in row)).hexdigest()


def reference_digest() -> str:
    return workload_digest(corrupt=False)


def node_corrupts(node: str) -> bool:
    """Whether this node has simulated silent data corruption injected."""
    from ft_launch.health.settings import load_settings
    from ft_launch.health.simulation import SimulatedNvml

    backend = load_settings().gpu_backend(node)
    return isinstance(backend, SimulatedNvml) and backend.faults().sdc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="replay_job.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect", required=True, help="the reference digest")
    args = parser.parse_args(argv)
    node = os.environ.get("SLURMD_NODENAME", "")
    digest = workload_digest(corrupt=bool(node) and node_corrupts(node))
    ok = digest == args.expect
    json.dump({"node": node, "rank": os.environ.get("SLURM_PROCID"), "digest": digest, "ok": ok},
              sys.stdout)
    sys.stdout.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
