"""Optional multi-node bandwidth probe (mpi4py): every rank sends to the next
and receives from the previous one on a ring, several times; rank 0 prints one
JSON line with each link's bandwidth. ``judge_bandwidth`` (pure) names the
slowest link below the threshold.

Run it under the site's MPI launcher, one rank per node, e.g.
``srun --mpi=pmi2 -N 8 python -m ft_launch.health.bw_probe --bytes 268435456`` or
``mpiexec -n 2 python -m ft_launch.health.bw_probe``.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .result import CheckResult, failed, passed


@dataclass(frozen=True)
class LinkBandwidth:
    src: str
    dst: str
    gbytes_per_s: float


def judge_bandwidth(name: str, links: Sequence[LinkBandwidth],
                    min_gbytes_per_s: float) -> CheckResult:
    if not links:
        return failed(name, "bandwidth probe returned no links")
    slowest = min(links, key=lambda link: link.gbytes_per_s)
    evidence: dict[str, Any] = {f"{lk.src}->{lk.dst}": round(lk.gbytes_per_s, 3) for lk in links}
    if slowest.gbytes_per_s < min_gbytes_per_s:
        return failed(name, f"link {slowest.src}->{slowest.dst} {slowest.gbytes_per_s:.2f}GB/s"
                            f"<{min_gbytes_per_s:g}GB/s", **evidence)
    return passed(name, f"slowest {slowest.gbytes_per_s:.2f}GB/s", **evidence)


def links_from_json(raw: Mapping[str, Any]) -> list[LinkBandwidth]:
    return [LinkBandwidth(str(x["src"]), str(x["dst"]), float(x["gbytes_per_s"]))
            for x in raw["links"]]


def probe(size: int, iterations: int) -> dict[str, Any] | None:
    """Ring exchange; returns the result on rank 0, None elsewhere."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    send, recv = np.ones(size, dtype=np.uint8), np.empty(size, dtype=np.uint8)
    dst, src = (rank + 1) % world, (rank - 1) % world
    comm.Sendrecv(send, dest=dst, recvbuf=recv, source=src)  # warm-up: connections, pages
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        comm.Sendrecv(send, dest=dst, recvbuf=recv, source=src)
    seconds = time.perf_counter() - start
    hosts = comm.gather(socket.gethostname(), root=0)
    rates = comm.gather(size * iterations / seconds / 1e9, root=0)
    if rank != 0:
        return None
    assert hosts is not None and rates is not None
    return {"links": [{"src": hosts[r], "dst": hosts[(r + 1) % world], "rank": r,
                       "gbytes_per_s": rates[r]} for r in range(world)]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ft_launch.health.bw_probe",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--iterations", type=int, default=5)
    args = parser.parse_args(argv)
    result = probe(args.bytes, args.iterations)
    if result is not None:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
