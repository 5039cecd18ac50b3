"""FTAR against gloo ``all_reduce`` and MPI ``Allreduce``, side by side.

    python benchmarks/ftar_bench.py [--members 2 3 4] [--sizes 1 16 64 256]
                                    [--rounds N] [--json FILE]

For each member count the driver starts that many worker processes on this
machine (under ``mpiexec`` when ``mpi4py`` imports, so MPI joins the comparison;
plain processes otherwise). Every worker holds an FTAR group and a gloo process
group (and MPI's COMM_WORLD), and runs paired, interleaved rounds: in each round
every implementation reduces the same float32 data once, in an order that
rotates from round to round. Each result is checked exactly (the data are small
integers, so every summation order gives the same float32 sum). A round's time is
the slowest member's; the table shows medians as algorithm bandwidth
(size / time) in GB/s, and FTAR's ratio to each peer.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from record import write_json

MiB = 1 << 20


# ---------------------------------------------------------------- worker side


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from ft_launch.config import FtarConfig
    from ft_launch.ftar import FtarGroup, ReduceOp

    comm = None
    if args.mpi:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
    else:
        rank, world = args.rank, args.world
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.FileStore(args.store, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    config = FtarConfig(chunk_bytes=args.chunk_bytes, chunks_in_flight=args.chunks_in_flight,
                        sockets_per_peer=args.sockets_per_peer, timeout=60.0,
                        reduce_bytes=args.reduce_bytes,
                        socket_buffer_bytes=args.socket_buffer_bytes)
    group = FtarGroup(config, args.secret)
    addresses: list[Any] = [None] * world
    dist.all_gather_object(addresses, group.address)
    group.reconfigure(1, addresses, rank)

    cases = []
    for size_mib in args.sizes:
        n = int(size_mib * MiB) // 4
        source = (np.arange(n, dtype=np.int64) % 1024).astype(np.float32) + rank
        expected = (np.arange(n, dtype=np.int64) % 1024).astype(np.float32) * world + (
            world * (world - 1) // 2)
        buffer = np.empty(n, np.float32)
        tensor = torch.from_numpy(buffer)
        impls: dict[str, Callable[[], object]] = {
            "ftar": functools.partial(group.allreduce, buffer, ReduceOp.SUM),
            "gloo": functools.partial(dist.all_reduce, tensor, op=dist.ReduceOp.SUM),
        }
        if comm is not None:
            from mpi4py import MPI
            impls["mpi"] = functools.partial(comm.Allreduce, MPI.IN_PLACE, buffer, op=MPI.SUM)
        times: dict[str, list[float]] = {name: [] for name in impls}
        names = list(impls)
        # Small reductions run in back-to-back batches so that a barrier's uneven exit
        # (about a millisecond) does not swamp them; re-filling the buffer and the
        # check are outside the timed calls.
        batch = max(1, round(args.batch_bytes / (n * 4)))
        for round_index in range(args.rounds + 1):   # round 0 warms up
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                dist.barrier()
                elapsed = 0.0
                for _ in range(batch):
                    np.copyto(buffer, source)
                    start = time.perf_counter()
                    impls[name]()
                    elapsed += time.perf_counter() - start
                    if not np.array_equal(buffer, expected):
                        raise SystemExit(f"{name} gave a wrong result at {size_mib} MiB, "
                                         f"{world} members (rank {rank})")
                if round_index:
                    times[name].append(elapsed / batch)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, times)
        if rank == 0:
            cases.append(_case(world, n * 4, gathered))
    if rank == 0:
        Path(args.out).write_text(json.dumps(cases))
    group.close()
    dist.destroy_process_group()


def _case(world: int, size_bytes: int, gathered: list[dict[str, list[float]]]) -> dict:
    def gbps(name: str) -> float | None:
        if name not in gathered[0]:
            return None
        rounds = zip(*(per_rank[name] for per_rank in gathered))
        slowest = [max(r) for r in rounds]
        return size_bytes / statistics.median(slowest) / 1e9

    ftar, gloo, mpi = gbps("ftar"), gbps("gloo"), gbps("mpi")
    assert ftar is not None and gloo is not None
    return {"members": world, "size_bytes": size_bytes, "ftar_GBps": ftar,
            "gloo_GBps": gloo, "mpi_GBps": mpi, "ratio_vs_gloo": ftar / gloo,
            "ratio_vs_mpi": ftar / mpi if mpi else None}


# ---------------------------------------------------------------- driver side


def _mpi_available() -> bool:
    if shutil.which("mpiexec") is None:
        return False
    probe = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"],
                           capture_output=True, timeout=60, check=False)
    return probe.returncode == 0


def _worker_argv(args: argparse.Namespace, store: str, out: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--store", store,
            "--out", out, "--secret", args.secret, "--rounds", str(args.rounds),
            "--batch-bytes", str(args.batch_bytes),
            "--chunk-bytes", str(args.chunk_bytes),
            "--chunks-in-flight", str(args.chunks_in_flight),
            "--sockets-per-peer", str(args.sockets_per_peer),
            "--reduce-bytes", str(args.reduce_bytes),
            "--socket-buffer-bytes", str(args.socket_buffer_bytes),
            "--sizes", *map(str, args.sizes)]
    return argv


def _run_members(args: argparse.Namespace, world: int, use_mpi: bool) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ftar-bench-") as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        argv = _worker_argv(args, store, out)
        if use_mpi:
            procs = [subprocess.Popen(["mpiexec", "-n", str(world), *argv, "--mpi"])]
        else:
            procs = [subprocess.Popen([*argv, "--rank", str(r), "--world", str(world)])
                     for r in range(world)]
        codes = [p.wait(timeout=args.case_timeout) for p in procs]
        if any(codes):
            raise SystemExit(f"a worker failed ({codes}) with {world} members")
        return json.loads(Path(out).read_text())


def _summary(cases: list[dict]) -> dict:
    ratios = [c["ratio_vs_gloo"] for c in cases]
    mpi = [c["ratio_vs_mpi"] for c in cases if c["ratio_vs_mpi"]]
    return {"geomean_ratio_vs_gloo": _geomean(ratios),
            "min_ratio_vs_gloo": min(ratios) if ratios else None,
            "geomean_ratio_vs_mpi": _geomean(mpi) if mpi else None}


def _geomean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _table(cases: list[dict], summary: dict) -> str:
    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [(f"{'members':>7} {'size':>8} {'ftar GB/s':>10} {'gloo GB/s':>10} "
             f"{'mpi GB/s':>9} {'ftar/gloo':>10} {'ftar/mpi':>9}")]
    for c in cases:
        lines.append(f"{c['members']:>7} {c['size_bytes'] / MiB:>6g}Mi "
                     f"{c['ftar_GBps']:>10.3f} {c['gloo_GBps']:>10.3f} "
                     f"{fmt(c['mpi_GBps'], '.3f'):>9} {c['ratio_vs_gloo']:>10.2f} "
                     f"{fmt(c['ratio_vs_mpi'], '.2f'):>9}")
    lines.append(f"geomean ftar/gloo {fmt(summary['geomean_ratio_vs_gloo'], '.3f')}, "
                 f"min {fmt(summary['min_ratio_vs_gloo'], '.3f')}, geomean ftar/mpi "
                 f"{fmt(summary['geomean_ratio_vs_mpi'], '.3f')}")
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 16, 64, 256],
                        help="MiB of float32 per reduction")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds per case")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--batch-bytes", type=float, default=32 * MiB,
                        help="reductions smaller than this run in batches of about this "
                             "many bytes per timed round")
    parser.add_argument("--no-mpi", action="store_true", help="leave MPI out")
    parser.add_argument("--chunk-bytes", type=int, default=16 * MiB)
    parser.add_argument("--chunks-in-flight", type=int, default=2)
    parser.add_argument("--sockets-per-peer", type=int, default=1)
    parser.add_argument("--reduce-bytes", type=int, default=2 * MiB)
    parser.add_argument("--socket-buffer-bytes", type=int, default=0)
    parser.add_argument("--case-timeout", type=float, default=900.0)
    # worker-only arguments
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mpi", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--secret", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.worker:
        _worker(args)
        return 0
    from ft_launch.ids import new_job_secret
    args.secret = new_job_secret()
    use_mpi = not args.no_mpi and _mpi_available()
    if not use_mpi:
        print("MPI: mpi4py not importable (or --no-mpi): the MPI column is null",
              file=sys.stderr)
    cases: list[dict] = []
    for world in args.members:
        cases.extend(_run_members(args, world, use_mpi))
    summary = _summary(cases)
    print(_table(cases, summary))
    if args.json:
        write_json(args.json, {"cases": cases, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
