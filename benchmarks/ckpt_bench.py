"""Checkpoint benchmark (not a test): snapshot overhead, fetch, persistent write, restore.

    python benchmarks/ckpt_bench.py [--json FILE] [--batch 256] [--pairs 3] [--steps 4]

A CPU training loop (~100M-parameter MLP + Adam) runs with and without a
snapshot every step in paired, interleaved runs; then the same state is
fetched over HTTP (against a raw-socket transfer of the same bytes), written
to HDF5 (against torch.save), and restored from each tier. Figures on a shared
2-core machine are noisy: compare ratios taken in one run, not absolute times.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt.backup import BackupStore
from ckpt.fetch import FETCH_STREAMS, Peer, fetch_state, push_backup
from ckpt.persist import Completeness, PersistentStore, fsync_file
from ckpt.restore import DiskTier, MemoryTier, PeerTier, RestoreChain, Tier, TierKind
from ckpt.serve import StateServer
from ckpt.snapshot import WORKER_NICE, DualBufferSnapshotter
from ckpt.torch_state import TorchStateSource
from ftcore.ids import new_job_secret

SECRET = new_job_secret()
GB = 1e9


def median(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------------- training loop


class Trainer:
    """An MLP of ``layers`` square layers (width ``width``) and Adam, on the CPU."""

    def __init__(self, width: int, layers: int, batch: int) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[module for _ in range(layers) for module in
                                           (torch.nn.Linear(width, width), torch.nn.GELU())])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)
        self.step_index = 0
        self.params = sum(p.numel() for p in self.model.parameters())

    def run(self, steps: int, snapshotter: DualBufferSnapshotter | None) -> list[float]:
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            loss = ((self.model(self.x) - self.y) ** 2).mean()
            self.optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if snapshotter is not None:
                snapshotter.wait_ready()
            self.optimizer.step()
            self.step_index += 1
            if snapshotter is not None:
                snapshotter.start(self.step_index, self.source())
            times.append(time.perf_counter() - started)
        if snapshotter is not None:
            snapshotter.wait_complete()
        return times

    def source(self) -> TorchStateSource:
        return TorchStateSource(self.model, self.optimizer, step=self.step_index,
                                loader_state={"position": self.step_index})


def snapshot_overhead(trainer: Trainer, snapshotter: DualBufferSnapshotter, pairs: int,
                      steps: int) -> dict[str, Any]:
    """Median step time without / with a snapshot every step, runs alternating."""
    ratios, plain, snap = [], [], []
    for pair in range(pairs):
        order = [None, snapshotter] if pair % 2 == 0 else [snapshotter, None]
        medians = {}
        for mode in order:
            # The first step of a run pays nothing for its own snapshot: drop it.
            medians[mode is None] = median(trainer.run(steps + 1, mode)[1:])
        plain.append(medians[True])
        snap.append(medians[False])
        ratios.append(medians[False] / medians[True] - 1.0)
        print(f"  pair {pair}: plain {medians[True]:.3f} s  snapshot {medians[False]:.3f} s  "
              f"{100 * ratios[-1]:+.1f}%", flush=True)
    return {"overhead_pct": 100 * median(ratios), "pair_pct": [100 * r for r in ratios],
            "step_s_plain": median(plain), "step_s_snapshot": median(snap),
            "pooled_pct": 100 * (median(snap) / median(plain) - 1.0)}


def snapshot_rate(trainer: Trainer, snapshotter: DualBufferSnapshotter, reps: int = 3
                  ) -> tuple[float, float, int]:
    """(copy + checksum GB/s, copy-only GB/s, bytes) of a snapshot taken on its own."""
    totals, copies = [], []
    for _ in range(reps):
        started = time.perf_counter()
        snapshotter.start(trainer.step_index, trainer.source())
        snapshotter.wait_complete()
        totals.append(time.perf_counter() - started)
        copies.append(snapshotter.stats.last_copy_seconds)
    nbytes = snapshotter.stats.last_bytes
    return nbytes / median(totals) / GB, nbytes / median(copies) / GB, nbytes


# ---------------------------------------------------------------------- transfers


def raw_socket_rate(data: np.ndarray, into: np.ndarray) -> float:
    """GB/s of one TCP stream on loopback: sendall of the bytes, recv_into a buffer."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(memoryview(data))

    sender = threading.Thread(target=send)
    sender.start()
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        view, got = memoryview(into)[:data.nbytes], 0
        while got < data.nbytes:
            n = sock.recv_into(view[got:])
            if not n:
                raise RuntimeError("raw socket transfer ended early")
            got += n
    seconds = time.perf_counter() - started
    sender.join(60)
    listener.close()
    return data.nbytes / seconds / GB


def fetch_rates(snapshotter: DualBufferSnapshotter, reps: int) -> dict[str, float]:
    with snapshotter.lease() as snap:
        data, step = snap.buffer, snap.step
    into = np.empty(data.nbytes, dtype=np.uint8)
    into[::4096] = 0
    raw, default, one = [], [], []
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=snapshotter.buffers) as server:
        peer = Peer(*server.address)
        for _ in range(reps):
            raw.append(raw_socket_rate(data, into))
            for streams, rates in ((FETCH_STREAMS, default), (1, one)):
                fetched = fetch_state(peer, SECRET, step=step, buffer=into, streams=streams)
                rates.append(data.nbytes / fetched.seconds / GB)
    # Ratios within each repetition: other jobs' load shifts both sides alike.
    return {"raw": median(raw), "fetch": median(default), "fetch_1_stream": median(one),
            "ratio": median([f / r for f, r in zip(default, raw, strict=True)]),
            "ratio_1_stream": median([f / r for f, r in zip(one, raw, strict=True)])}


# ---------------------------------------------------------------------- persistent tier


def write_rates(trainer: Trainer, snapshotter: DualBufferSnapshotter, root: Path,
                reps: int) -> dict[str, float]:
    """HDF5 shard (the store's atomic, fsynced write) against torch.save + fsync.

    One untimed write of each first: the first write into page cache that this
    VM never touched runs at a fraction of the speed of later ones. Then the
    order alternates each repetition.
    """
    store = PersistentStore(root / "h5", rank=0, world_size=1, keep=1, create=True)
    with snapshotter.lease() as snap:
        manifest, buffer = snap.manifest, snap.buffer.copy()
    state = {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict()}
    steps = iter(range(manifest.step + 1, manifest.step + 2 * reps + 10))

    def hdf5() -> float:
        step_manifest = dataclasses.replace(manifest, step=next(steps))
        started = time.perf_counter()
        store.save(step_manifest, buffer)
        seconds = time.perf_counter() - started
        store.prune()  # deleting the previous GB-sized file is not part of the write
        return seconds

    def torch_save() -> float:
        target = root / "state.pt"
        started = time.perf_counter()
        torch.save(state, target)
        fsync_file(target)
        seconds = time.perf_counter() - started
        target.unlink()
        return seconds

    hdf5(), torch_save()
    h5, pt = [], []
    for rep in range(reps):
        for write, rates in ((hdf5, h5), (torch_save, pt))[::1 if rep % 2 == 0 else -1]:
            rates.append(manifest.total_bytes / write() / GB)
    store.close()
    return {"hdf5": median(h5), "torch_save": median(pt),
            "ratio": median([a / b for a, b in zip(h5, pt, strict=True)])}


# ---------------------------------------------------------------------- restore


def restore_times(snapshotter: DualBufferSnapshotter, root: Path) -> dict[str, float]:
    with snapshotter.lease() as snap:
        manifest, buffer = snap.manifest, snap.buffer.copy()
    local = PersistentStore(root / "local", rank=0, world_size=1, create=True,
                            completeness=Completeness.OWN_SHARD)
    persistent = PersistentStore(root / "persistent", rank=0, world_size=1, create=True)
    for store in (local, persistent):
        store.save(manifest, buffer)
    del buffer
    gc.collect()
    times: dict[str, float] = {}
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore()) as server:
        peer = Peer(*server.address)
        with snapshotter.lease() as snap:
            push_backup(peer, SECRET, snap, source_rank=0)
        tiers: list[Tier] = [MemoryTier(snapshotter.buffers), PeerTier(peer, SECRET, rank=0),
                             DiskTier(local, TierKind.LOCAL_DISK),
                             DiskTier(persistent, TierKind.PERSISTENT)]
        into = np.empty(manifest.total_bytes, dtype=np.uint8)
        into[::4096] = 0  # restore into touched memory, as a live process would
        for tier in tiers:
            started = time.perf_counter()
            restored = RestoreChain([tier], rank=0).restore(buffer=into)
            times[tier.kind.value] = time.perf_counter() - started
            assert restored.step == manifest.step
            del restored
            gc.collect()
    return times


# ---------------------------------------------------------------------- main


def timed(label: str, call: Callable[[], Any]) -> Any:
    print(f"{label} ...", flush=True)
    started = time.perf_counter()
    result = call()
    print(f"  done in {time.perf_counter() - started:.1f} s", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=8, help="paired runs, interleaved")
    parser.add_argument("--steps", type=int, default=2, help="measured steps per run")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each transfer")
    parser.add_argument("--worker-nice", type=int, default=WORKER_NICE,
                        help="niceness of the snapshot thread (0: same as training)")
    parser.add_argument("--overhead-only", action="store_true",
                        help="measure the snapshot overhead and stop")
    parser.add_argument("--no-checksums", action="store_true",
                        help="snapshots without CRCs (with --overhead-only: the copy's share)")
    args = parser.parse_args(argv)

    trainer = Trainer(args.width, args.layers, args.batch)
    trainer.run(2, None)  # Adam's state exists from here on
    snapshotter = DualBufferSnapshotter(worker_nice=args.worker_nice,
                                        checksums=not args.no_checksums)
    trainer.run(2, snapshotter)  # buffers allocated and touched
    print(f"model {trainer.params / 1e6:.1f} M params + Adam, batch {args.batch}, "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}", flush=True)
    overhead = timed("snapshot overhead (paired runs)",
                     lambda: snapshot_overhead(trainer, snapshotter, args.pairs, args.steps))
    if args.overhead_only:
        print(f"snapshot overhead {overhead['overhead_pct']:+.2f}% (median of pairs), "
              f"{overhead['pooled_pct']:+.2f}% (pooled medians)")
        return 0
    snap_rate, copy_rate, nbytes = timed("snapshot rate",
                                         lambda: snapshot_rate(trainer, snapshotter))
    fetch = timed("fetch vs raw socket", lambda: fetch_rates(snapshotter, args.reps))
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        write = timed("persistent write", lambda: write_rates(trainer, snapshotter, Path(tmp),
                                                              args.reps))
        restore = timed("restore per tier", lambda: restore_times(snapshotter, Path(tmp)))

    summary = {
        "snapshot_overhead_pct": round(overhead["overhead_pct"], 2),
        "snapshot_GBps": round(snap_rate, 2),
        "fetch_GBps": round(fetch["fetch"], 2),
        "raw_socket_GBps": round(fetch["raw"], 2),
        "fetch_ratio_vs_raw": round(fetch["ratio"], 3),
        "hdf5_write_GBps": round(write["hdf5"], 3),
        "torch_save_GBps": round(write["torch_save"], 3),
        "hdf5_vs_torch_save": round(write["ratio"], 3),
    }
    details = {
        "state_bytes": nbytes, "params": trainer.params, "batch": args.batch,
        "worker_nice": args.worker_nice,
        "step_s_plain": round(overhead["step_s_plain"], 3),
        "step_s_snapshot": round(overhead["step_s_snapshot"], 3),
        "overhead_pct_per_pair": [round(p, 2) for p in overhead["pair_pct"]],
        "overhead_pct_pooled_medians": round(overhead["pooled_pct"], 2),
        "snapshot_copy_only_GBps": round(copy_rate, 2),
        "fetch_streams": FETCH_STREAMS,
        "fetch_1_stream_GBps": round(fetch["fetch_1_stream"], 2),
        "fetch_1_stream_ratio_vs_raw": round(fetch["ratio_1_stream"], 3),
        "safetensors_GBps": None,  # safetensors is not installed here
        "restore_seconds": {k: round(v, 3) for k, v in restore.items()},
    }
    print_table(summary, details)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "details": details}, indent=2))
    return 0


def print_table(summary: dict[str, Any], details: dict[str, Any]) -> None:
    rows = [
        ("state (params + Adam)", f"{details['state_bytes'] / GB:.2f} GB"),
        ("step time plain / with snapshot",
         f"{details['step_s_plain']:.3f} s / {details['step_s_snapshot']:.3f} s"),
        ("snapshot-every-step overhead (median of pairs)",
         f"{summary['snapshot_overhead_pct']:+.2f}%  (pairs: {details['overhead_pct_per_pair']})"),
        ("snapshot copy + CRC / copy only",
         f"{summary['snapshot_GBps']} / {details['snapshot_copy_only_GBps']} GB/s"),
        (f"fetch (HTTP, CRC-verified), {details['fetch_streams']} streams (default)",
         f"{summary['fetch_GBps']} GB/s"),
        ("fetch, 1 stream", (f"{details['fetch_1_stream_GBps']} GB/s "
                            f"({details['fetch_1_stream_ratio_vs_raw']}x raw)")),
        ("raw socket (1 stream), same bytes", f"{summary['raw_socket_GBps']} GB/s"),
        ("fetch (default) / raw socket, median of paired reps",
         f"{summary['fetch_ratio_vs_raw']}x"),
        ("HDF5 shard write (atomic, fsync)", f"{summary['hdf5_write_GBps']} GB/s"),
        ("torch.save + fsync", f"{summary['torch_save_GBps']} GB/s"),
        ("HDF5 / torch.save, median of paired reps", f"{summary['hdf5_vs_torch_save']}x"),
        ("safetensors", "not installed"),
    ] + [(f"restore from {tier}", f"{seconds:.2f} s")
         for tier, seconds in details["restore_seconds"].items()]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
