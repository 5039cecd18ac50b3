"""Checkpoint benchmark (not a test): snapshot overhead, fetch, persistent write, restore.

    python benchmarks/ckpt_bench.py [--json FILE] [--batch 256] [--pairs 10] [--steps 3]
        [--variants resident,lazy,lazy-nohelp,eager-crc,eager-sum64] [--backup-pairs 4]
        [--backup-every 0,10,25,50] [--backup-every-pairs 3]
        [--backup-optimizers adam,resident] [--backup-only] [--overhead-only]

A CPU training loop (~100M-parameter MLP + Adam) runs with and without a
snapshot every step in interleaved runs, each snapshot run between two plain
ones (plain: torch's Adam; ``resident``: ft's ResidentAdam, which writes each
step's state into the snapshot buffer instead of having it copied; ``lazy``:
torch's Adam and a copy in a background thread, the path for any optimizer);
samples taken while other processes used the shared CPUs are set aside
(see ``snapshot_overhead``); the same again with each snapshot pushed to a
backup peer (``backup_cost``), and pushed only every k steps (``backup_every_cost``:
what chooses ``ckpt.backup_every``). Then the same state is fetched over HTTP (against
a raw-socket transfer of the same bytes), written to HDF5 (against
torch.save), and restored from each tier. Figures on a shared 2-core machine
are noisy: compare ratios taken in one run, not absolute times.
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
from typing import Any, Self

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from record import write_json

from ft_launch.ckpt.backup import BackupSender, BackupStore
from ft_launch.ckpt.fetch import Peer, fetch_state, push_backup
from ft_launch.ckpt.manifest import add_checksums
from ft_launch.ckpt.persist import Completeness, PersistentStore, fsync_file
from ft_launch.ckpt.resident import Residency, ResidentAdam
from ft_launch.ckpt.restore import DiskTier, MemoryTier, PeerTier, RestoreChain, Tier, TierKind
from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.torch_state import TorchStateSource
from ft_launch.config import CkptConfig
from ft_launch.ids import new_job_secret

SECRET = new_job_secret()
RESIDENT = "resident"
GB = 1e9
DEFAULTS = CkptConfig()


def median(values: list[float]) -> float:
    return statistics.median(values)


# ---------------------------------------------------------------------- training loop


class Trainer:
    """An MLP of ``layers`` square layers (width ``width``) and Adam, on the CPU;
    ``resident``: ft's ResidentAdam, whose state lives in the snapshot buffers."""

    def __init__(self, width: int, layers: int, batch: int, resident: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(*[module for _ in range(layers) for module in
                                           (torch.nn.Linear(width, width), torch.nn.GELU())])
        self.optimizer: torch.optim.Optimizer = (
            ResidentAdam(self.model.parameters(), lr=1e-5) if resident
            else torch.optim.Adam(self.model.parameters(), lr=1e-5))
        self.x = torch.randn(batch, width)
        self.y = torch.randn(batch, width)
        self.step_index = 0
        self.params = sum(p.numel() for p in self.model.parameters())
        self.last_drain_s = 0.0  # the last run's wait for its backup push (untimed there)

    def run(self, steps: int, snapshotter: DualBufferSnapshotter | None) -> list[float]:
        """Step times; baseline and snapshot runs differ only in the two snapshot calls."""
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
            snapshotter.wait_complete()  # untimed: the next run starts with nothing running
        self.last_drain_s = 0.0
        if isinstance(snapshotter, BackedUpSnapshotter):
            drained = time.perf_counter()
            snapshotter.drain()
            self.last_drain_s = time.perf_counter() - drained
        return times

    def source(self) -> TorchStateSource:
        return TorchStateSource(self.model, self.optimizer, step=self.step_index,
                                loader_state={"position": self.step_index})


class ForeignLoad:
    """Share of the machine's CPU time that other processes used during a run.

    This machine is shared: ``/proc/stat`` busy time minus our own process's CPU
    time is what everybody else (and the hypervisor, as steal) took meanwhile.
    """

    HZ = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Self:
        self._busy, self._own, self._wall = _busy_seconds(), _own_seconds(), time.perf_counter()
        self.share = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._wall
        #: CPU seconds this process (every thread of it) used meanwhile
        self.own = _own_seconds() - self._own
        foreign = (_busy_seconds() - self._busy) - self.own
        self.share = max(foreign, 0.0) / (wall * (os.cpu_count() or 1))


def _busy_seconds() -> float:
    with open("/proc/stat", encoding="ascii") as handle:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(
            int, handle.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / ForeignLoad.HZ


def _own_seconds() -> float:
    # CLOCK_PROCESS_CPUTIME_ID: every thread, nanosecond resolution; os.times()
    # counts clock ticks, and a short run can read as zero CPU time
    return time.process_time()


def _pct_above(value: float, base: float) -> float:
    """How many percent ``value`` is above ``base`` (0 where base read as nothing)."""
    return 100 * (value / base - 1) if base > 0 else 0.0


@dataclasses.dataclass
class Run:
    step_s: float      # median step time of the run (its first step dropped)
    foreign: float     # share of the CPUs other processes took meanwhile


def timed_run(trainer: Trainer, snapshotter: DualBufferSnapshotter | None, steps: int) -> Run:
    with ForeignLoad() as load:
        # The first step pays nothing for the snapshot of the step before: drop it.
        times = trainer.run(steps + 1, snapshotter)[1:]
    return Run(median(times), load.share)


def spread(values: list[float]) -> dict[str, Any]:
    """Median, quartiles and range of percentages, rounded for the report."""
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    quartiles = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else ordered * 3
    return {"n": len(ordered), "median": round(statistics.median(ordered), 2),
            "q1": round(quartiles[0], 2), "q3": round(quartiles[2], 2),
            "min": round(ordered[0], 2), "max": round(ordered[-1], 2)}


def snapshot_overhead(trainer: Trainer, variants: dict[str, DualBufferSnapshotter],
                      pairs: int, steps: int, max_foreign: float,
                      max_rounds: int, trainers: dict[str, Trainer] | None = None
                      ) -> dict[str, Any]:
    """Step time with a snapshot every step against without, per variant.

    A run without snapshot always trains ``trainer`` (torch's Adam); a variant
    in ``trainers`` runs its snapshots on its own trainer (the same model with
    ResidentAdam), so the baseline is what a user would run without ft.

    Runs alternate ``A B1 A B2 A B2 A B1 ...`` (A: no snapshot). Each B is compared
    with the mean of the A runs either side of it, which cancels a slow drift
    of the machine; consecutive A runs give an A/A control, the noise floor. A
    sample counts as *clean* when other processes took less than
    ``max_foreign`` of the CPUs during all three runs; rounds go on until every
    variant has ``pairs`` clean samples or ``max_rounds`` is reached. The
    figure is the median over clean samples (over all, flagged, if none).
    """
    clean: dict[str, list[float]] = {name: [] for name in variants}
    every: dict[str, list[float]] = {name: [] for name in variants}
    control: list[float] = []
    plain_s: list[float] = []
    snap_s: dict[str, list[float]] = {name: [] for name in variants}
    before = timed_run(trainer, None, steps)
    names = list(variants)
    for round_index in range(max_rounds):
        # Each round starts with another variant, so that none always follows the same one.
        for name in names[round_index % len(names):] + names[:round_index % len(names)]:
            snapshotter = variants[name]
            with_snapshot = timed_run((trainers or {}).get(name, trainer), snapshotter, steps)
            after = timed_run(trainer, None, steps)
            pct = _pct_above(with_snapshot.step_s, (before.step_s + after.step_s) / 2)
            quiet = max(before.foreign, with_snapshot.foreign, after.foreign) < max_foreign
            every[name].append(pct)
            if quiet:
                clean[name].append(pct)
                control.append(_pct_above(after.step_s, before.step_s))
                plain_s += [before.step_s, after.step_s]
                snap_s[name].append(with_snapshot.step_s)
            print(f"  round {round_index} {name:<12} plain {before.step_s:.3f}/{after.step_s:.3f} s"
                  f"  snapshot {with_snapshot.step_s:.3f} s  {pct:+6.1f}%  other load "
                  f"{100 * max(before.foreign, with_snapshot.foreign, after.foreign):3.0f}%"
                  f"{'' if quiet else '  (not counted)'}", flush=True)
            before = after
        if all(len(values) >= pairs for values in clean.values()):
            break
    return {"variants": {name: {"clean": spread(clean[name]), "all": spread(every[name]),
                                "clean_pct": [round(v, 2) for v in clean[name]],
                                "step_s": round(median(snap_s[name]), 3) if snap_s[name]
                                else None, **wait_figures(snapshotter)}
                         for name, snapshotter in variants.items()},
            "control": spread(control),
            "step_s_plain": round(median(plain_s), 3) if plain_s else None}


def wait_figures(snapshotter: DualBufferSnapshotter) -> dict[str, float]:
    """Per snapshot: seconds the training thread waited for the copy, tensors it copied."""
    stats = snapshotter.stats
    taken = max(stats.taken, 1)
    return {"wait_s_per_snapshot": round(stats.wait_seconds / taken, 4),
            "tensors_copied_while_waiting": round(stats.copied_while_waiting / taken, 1)}


class SumChecksumSource:
    """A state source that also sums each copied tensor as 64-bit words (row and
    column sums of a 32 KiB-wide matrix): the fast checksum, taken at snapshot time."""

    WIDTH = 4096

    def __init__(self, inner: TorchStateSource) -> None:
        self._inner = inner
        self.describe, self.meta = inner.describe, inner.meta

    def copy_into(self, index: int, dest: np.ndarray) -> None:
        self._inner.copy_into(index, dest)
        sum64(dest)


def sum64(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    words = raw[:raw.nbytes // 8 * 8].view(np.uint64)
    rows = words.size // SumChecksumSource.WIDTH
    matrix = words[:rows * SumChecksumSource.WIDTH].reshape(rows, SumChecksumSource.WIDTH)
    tail = int(words[rows * SumChecksumSource.WIDTH:].sum()) + int(raw[words.nbytes:].sum())
    return matrix.sum(axis=1), matrix.sum(axis=0), tail


class EagerSumSnapshotter(DualBufferSnapshotter):
    def start(self, step: int, source: Any) -> bool:
        return super().start(step, SumChecksumSource(source))


VARIANTS: dict[str, Callable[[int], DualBufferSnapshotter]] = {
    # The product default: copy only, CRCs when the snapshot is first used.
    "lazy": lambda nice: DualBufferSnapshotter(worker_nice=nice),
    "lazy-nohelp": lambda nice: DualBufferSnapshotter(worker_nice=nice, help_in_wait=False),
    # The previous behaviour: CRC-32 of every tensor in the snapshot thread, every step.
    "eager-crc": lambda nice: DualBufferSnapshotter(worker_nice=nice, eager_checksums=True,
                                                    help_in_wait=False),
    # A fast checksum (64-bit row and column sums) at snapshot time instead.
    "eager-sum64": lambda nice: EagerSumSnapshotter(worker_nice=nice),
    # No copy: ResidentAdam writes each step's state into the snapshot buffer
    # (its own trainer, bound with ``Residency`` in ``main``).
    RESIDENT: lambda nice: DualBufferSnapshotter(worker_nice=nice),
}


def snapshot_rates(trainer: Trainer, snapshotter: DualBufferSnapshotter, reps: int = 3
                   ) -> dict[str, float]:
    """Seconds for one snapshot on its own: the copy (what a step pays), CRC, sum64."""
    copies, crcs, sums = [], [], []
    for _ in range(reps):
        snapshotter.start(trainer.step_index, trainer.source())
        snapshotter.wait_complete()
        copies.append(snapshotter.stats.last_copy_seconds)
        with snapshotter.lease(checksums=False) as snap:
            started = time.perf_counter()
            add_checksums(snap.manifest, snap.buffer)
            crcs.append(time.perf_counter() - started)
            started = time.perf_counter()
            for spec in snap.manifest.tensors:
                sum64(spec.raw(snap.buffer))
            sums.append(time.perf_counter() - started)
    return {"bytes": snapshotter.stats.last_bytes, "copy_s": median(copies),
            "crc32_s": median(crcs), "sum64_s": median(sums)}


def copy_floor(nbytes: int, reps: int = 5) -> dict[str, float]:
    """Seconds to copy ``nbytes`` between preallocated buffers with one and two threads
    (the best of ``reps``: memory bandwidth here varies with the other tenants' load)."""
    source = np.ones(nbytes, dtype=np.uint8)
    dest = np.empty_like(source)
    dest[::4096] = 0

    def copy(first: int, last: int, piece: int = 16 << 20) -> None:
        for start in range(first, last, piece):
            np.copyto(dest[start:min(start + piece, last)], source[start:min(start + piece, last)])

    def timed_copy(threads: int) -> float:
        cut = [nbytes * i // threads for i in range(threads + 1)]
        workers = [threading.Thread(target=copy, args=(cut[i], cut[i + 1]))
                   for i in range(threads)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        return time.perf_counter() - started

    return {f"copy_{threads}_thread_s": min(timed_copy(threads) for _ in range(reps))
            for threads in (1, 2)}


# ---------------------------------------------------------------------- peer backup


class BackedUpSnapshotter(DualBufferSnapshotter):
    """Snapshots every step, each ``every``-th pushed to a backup peer as it completes.

    The peer is a state server in this process: on a cluster every rank both
    sends its backup and receives another rank's, so one process doing both is
    what each node pays per step.
    """

    def __init__(self, peer: Peer, nice: int, every: int = 1) -> None:
        super().__init__(worker_nice=nice)
        self.every = every
        self.sender = BackupSender(self.buffers, peer, SECRET, rank=0, every=every,
                                   poll_interval=0.05).start()

    def drain(self) -> None:
        """Wait until the newest snapshot due for a push was pushed (between runs)."""
        latest = self.latest_step()
        if latest is None:
            return
        due = latest - latest % self.every
        if not self.sender.wait_sent(due, DEFAULTS.fetch_timeout):
            print(f"  backup of step {due} not sent within {DEFAULTS.fetch_timeout} s",
                  flush=True)


def backup_cost(trainer: Trainer, pairs: int, steps: int, max_foreign: float,
                max_rounds: int, nice: int) -> dict[str, Any]:
    """Step time with a snapshot pushed to the backup peer every step, against none.

    Also: one push of a fresh snapshot on its own (CRC-32s on first use, then
    the transfer), and how many of the snapshots the sender kept up with.
    """
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore()) as server:
        snapshotter = BackedUpSnapshotter(Peer(*server.address), nice)
        try:
            trainer.run(2, snapshotter)  # buffers on both sides allocated and touched
            sent, skipped, taken = (snapshotter.sender.sent, snapshotter.stats.skipped,
                                    snapshotter.stats.taken)
            overhead = snapshot_overhead(trainer, {"backup": snapshotter}, pairs, steps,
                                         max_foreign, max_rounds)
            attempts = snapshotter.stats.taken + snapshotter.stats.skipped - taken - skipped
            push = push_seconds(trainer, snapshotter, Peer(*server.address))
        finally:
            snapshotter.sender.close()
    figures = overhead["variants"]["backup"]
    return {"overhead": overhead, "push": push,
            "pct": float(figures["clean" if figures["clean"]["n"] else "all"]["median"]),
            "sent_per_snapshot": round((snapshotter.sender.sent - sent) / max(attempts, 1), 3),
            "skipped_per_snapshot": round((snapshotter.stats.skipped - skipped)
                                          / max(attempts, 1), 3),
            "failed": snapshotter.sender.failed}


def push_seconds(trainer: Trainer, snapshotter: BackedUpSnapshotter, peer: Peer
                 ) -> dict[str, float]:
    """One push of a fresh snapshot, split into its first-use CRC-32s and the transfer."""
    snapshotter.sender.close()  # pushing by hand now
    snapshotter.start(trainer.step_index, trainer.source())
    snapshotter.wait_complete()
    started = time.perf_counter()
    with snapshotter.lease() as snap:
        checksummed = time.perf_counter()
        push_backup(peer, SECRET, snap, source_rank=0)
    done = time.perf_counter()
    return {"crc32_s": checksummed - started, "transfer_s": done - checksummed,
            "total_s": done - started}


#: Intervals for which ``push_cpu_cost`` gives the share of training CPU the pushes take.
PUSH_SHARE_EVERY = (1, 5, 10, 25, 50, 100)


def push_cpu_cost(trainer: Trainer, reps: int = 3) -> dict[str, Any]:
    """CPU seconds of one push (this process: the sender's CRC-32s on first use and
    SHA-256, the socket, the peer's SHA-256 and verification) against the CPU
    seconds of one training step, each the median of ``reps``.

    On a CPU trainer, whose steps keep every core busy, a push's CPU is taken from
    training: ``push_cpu / (k * step_cpu)`` is what pushing every k steps costs it.
    CPU time is what other tenants' load inflates least (wall time doubles when
    they take a core), so this is the figure ``ckpt.backup_every`` is chosen by;
    ``backup_every_cost`` times it in training, where the machine is quiet enough.
    """
    steps, pushes = [], []
    for _ in range(reps):
        before = _own_seconds()
        trainer.run(1, None)
        steps.append(_own_seconds() - before)
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore()) as server:
        snapshotter = DualBufferSnapshotter(worker_nice=0)
        for _ in range(reps):
            snapshotter.start(trainer.step_index, trainer.source())
            snapshotter.wait_complete()
            trainer.step_index += 1
            before = _own_seconds()
            with snapshotter.lease() as snap:      # CRC-32s computed here, on first use
                push_backup(Peer(*server.address), SECRET, snap, source_rank=0)
            pushes.append(_own_seconds() - before)
        snapshotter.close()
    push_cpu, step_cpu = median(pushes), median(steps)
    return {"push_cpu_s": round(push_cpu, 3), "step_cpu_s": round(step_cpu, 3),
            "pct_of_training_by_every": {str(k): round(100 * push_cpu / (k * step_cpu), 2)
                                         for k in PUSH_SHARE_EVERY}}


def backup_every_cost(trainer: Trainer, everies: list[int], pairs: int, steps: int,
                      max_foreign: float, max_rounds: int, nice: int,
                      backed: Trainer | None = None) -> dict[str, Any]:
    """Step time with a snapshot every step and a push every k steps, against none.

    ``backed``: the trainer of the backed-up runs (the same model with ResidentAdam,
    the product's CPU optimizer), bound here to the backed-up snapshots; the runs
    without snapshot train ``trainer`` (torch's Adam) as in ``snapshot_overhead``.

    A push every k steps costs a few steps once every k steps, so the median step
    hides it: a run here is ``max(steps, 3 k)`` steps and its figure the mean step
    time, with the wait for the run's last push (``drain``) counted in. Runs
    alternate A B A B ... (A: no snapshot) as in ``snapshot_overhead``; a sample is
    clean when other processes took less than ``max_foreign`` of the CPUs in all
    three runs. Per k: the median over clean samples (over all, if none).

    Also the CPU seconds per step of this process (all its threads: training,
    snapshot, sender, the peer's handler) against the plain runs' (``cpu_pct``):
    the work a push adds, which other tenants' load does not inflate the way it
    inflates wall time. Training keeps both cores of this machine busy, so on a
    quiet machine the two agree closely.
    """
    results: dict[str, Any] = {}
    backed = backed or trainer
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=DualBufferSnapshotter().buffers,
                     backups=BackupStore()) as server:
        snapshotter = BackedUpSnapshotter(Peer(*server.address), nice)
        if isinstance(backed.optimizer, ResidentAdam):
            Residency(backed.model, backed.optimizer, snapshotter)
        try:
            for every in everies:
                # 0: snapshots only, no push (the sender's interval set out of reach), in
                # runs as long as the longest interval's: what the pushes add is the rest
                length = max(steps, 3 * (every or max(everies)))
                snapshotter.every = snapshotter.sender.every = every or 10**9
                backed.run(min(snapshotter.every, length) + 1, snapshotter)  # buffers touched
                failed, sent = snapshotter.sender.failed, snapshotter.sender.sent
                waited = snapshotter.stats.claim_wait_seconds
                results[str(every)] = figures = _paired_means(
                    trainer, backed, snapshotter, length, pairs, max_foreign, max_rounds,
                    f"every {every}" if every else "no push")
                figures["failed"] = snapshotter.sender.failed - failed
                # ResidentAdam's step waits for a push still reading the buffer it must
                # write (up to resident.READER_WAIT, then it copies the state aside)
                pushes = snapshotter.sender.sent - sent
                figures["resident_wait_s_per_push"] = (
                    round((snapshotter.stats.claim_wait_seconds - waited) / pushes, 3)
                    if pushes else 0.0)
        finally:
            snapshotter.sender.close()
    return results


def _paired_means(trainer: Trainer, backed: Trainer, snapshotter: BackedUpSnapshotter,
                  steps: int, pairs: int, max_foreign: float, max_rounds: int, label: str
                  ) -> dict[str, Any]:
    def mean_run(with_snapshots: bool) -> tuple[Run, float]:
        who = backed if with_snapshots else trainer
        with ForeignLoad() as load:
            times = who.run(steps + 1, snapshotter if with_snapshots else None)[1:]
            total = sum(times) + who.last_drain_s
        return Run(total / len(times), load.share), load.own / (len(times) + 1)

    clean: list[float] = []
    every: list[float] = []
    cpu: list[float] = []
    before, before_cpu = mean_run(False)
    for round_index in range(max_rounds):
        (with_backup, backed_cpu), (after, after_cpu) = mean_run(True), mean_run(False)
        pct = _pct_above(with_backup.step_s, (before.step_s + after.step_s) / 2)
        cpu.append(_pct_above(backed_cpu, (before_cpu + after_cpu) / 2))
        quiet = max(before.foreign, with_backup.foreign, after.foreign) < max_foreign
        every.append(pct)
        if quiet:
            clean.append(pct)
        print(f"  round {round_index} {label:<9} plain {before.step_s:.3f}/{after.step_s:.3f} s"
              f"  backed up {with_backup.step_s:.3f} s  {pct:+6.1f}%  (cpu {cpu[-1]:+6.1f}%)"
              f"  other load {100 * max(before.foreign, with_backup.foreign, after.foreign):3.0f}%"
              f"{'' if quiet else '  (not counted)'}", flush=True)
        before, before_cpu = after, after_cpu
        if len(clean) >= pairs:
            break
    figures = spread(clean if clean else every)
    return {"pct": figures["median"], "clean": spread(clean), "all": spread(every),
            "cpu_pct": spread(cpu)["median"], "cpu": spread(cpu), "steps_per_run": steps}


def backup_every_summary(by_every: dict[str, Any] | None, resident: bool = False
                         ) -> dict[str, Any]:
    if not by_every:
        return {}
    # Snapshot every step + a push every k steps, against no snapshot at all; with
    # ResidentAdam (the product's CPU optimizer) or torch's Adam (copied snapshots).
    key = "backup_resident_overhead_pct_by_every" if resident else "backup_overhead_pct_by_every"
    return {key: {k: v["pct"] for k, v in by_every.items()},
            f"{key.replace('_pct_', '_cpu_pct_')}": {k: v["cpu_pct"]
                                                     for k, v in by_every.items()},
            # The product's default interval, chosen from these figures (CkptConfig).
            "backup_every_default": DEFAULTS.backup_every}


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
            for streams, rates in ((DEFAULTS.fetch_streams, default), (1, one)):
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
        tiers: list[Tier] = [MemoryTier(snapshotter.buffers), PeerTier.of(peer, SECRET, rank=0),
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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=10,
                        help="clean paired samples wanted per variant")
    parser.add_argument("--max-rounds", type=int, default=0,
                        help="give up after this many rounds (default: 3 x --pairs)")
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run")
    parser.add_argument("--max-foreign", type=float, default=0.10,
                        help="a sample counts if other processes took less than this share "
                             "of the CPUs during its runs")
    parser.add_argument("--variants", default=f"{RESIDENT},lazy",
                        help=f"comma-separated, first one is the headline: {', '.join(VARIANTS)}")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of each transfer")
    parser.add_argument("--worker-nice", type=int, default=DEFAULTS.snapshot_nice,
                        help="niceness of the snapshot thread (0: same as training)")
    parser.add_argument("--backup-pairs", type=int, default=4,
                        help="clean paired samples of snapshot + peer backup every step "
                             "(0: do not measure the backup)")
    parser.add_argument("--backup-every", default="0,10,25,50",
                        help="push intervals (steps) whose cost to measure, comma-separated; "
                             "0: snapshots without pushes, the reference (empty: none)")
    parser.add_argument("--backup-every-pairs", type=int, default=3,
                        help="clean paired samples per push interval")
    parser.add_argument("--backup-optimizers", default="adam",
                        help="optimizers the push intervals are measured with, comma-separated: "
                             "adam (torch's, copied snapshots), resident (ResidentAdam, the "
                             "product's CPU optimizer)")
    parser.add_argument("--backup-only", action="store_true",
                        help="measure the peer backup (every step and every k) and stop")
    parser.add_argument("--overhead-only", action="store_true",
                        help="measure the snapshot overhead and stop")
    parser.add_argument("--no-checksums", action="store_true",
                        help="kept for old scripts: snapshots are copy-only per step anyway "
                             "(checksums are computed when a snapshot is first used)")
    args = parser.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    unknown = [v for v in args.backup_optimizers.split(",") if v not in ("adam", "resident")]
    if unknown:
        parser.error(f"unknown --backup-optimizers {unknown}; valid: adam, resident")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    trainer = Trainer(args.width, args.layers, args.batch)
    trainer.run(2, None)  # Adam's state exists from here on
    if args.backup_only:
        return backup_main(args, trainer)
    variants = {name: VARIANTS[name](args.worker_nice) for name in args.variants.split(",")}
    trainers = {}
    if RESIDENT in variants:
        resident = trainers[RESIDENT] = Trainer(args.width, args.layers, args.batch, resident=True)
        assert isinstance(resident.optimizer, ResidentAdam)
        Residency(resident.model, resident.optimizer, variants[RESIDENT])
    for name, snapshotter in variants.items():
        trainers.get(name, trainer).run(2, snapshotter)  # buffers allocated and touched
    # Rates, transfers and restores are of copied snapshots of the torch trainer.
    snapshotter = next((s for name, s in variants.items() if name not in trainers),
                       None) or VARIANTS["lazy"](args.worker_nice)
    print(f"model {trainer.params / 1e6:.1f} M params + Adam, batch {args.batch}, "
          f"torch threads {torch.get_num_threads()}, cpus {os.cpu_count()}", flush=True)
    overhead = timed("snapshot overhead (paired runs)", lambda: snapshot_overhead(
        trainer, variants, args.pairs, args.steps, args.max_foreign,
        args.max_rounds or 3 * args.pairs, trainers))
    rates = timed("snapshot rates", lambda: snapshot_rates(trainer, snapshotter))
    rates.update(copy_floor(rates["bytes"]))
    if args.overhead_only:
        print_overhead(overhead, rates)
        return 0
    backup = (timed("peer backup every step (paired runs)", lambda: backup_cost(
        trainer, args.backup_pairs, args.steps, args.max_foreign,
        args.max_rounds or 3 * args.backup_pairs, args.worker_nice))
        if args.backup_pairs else None)
    by_every, by_every_resident = measure_backup_every(args, trainer)
    fetch = timed("fetch vs raw socket", lambda: fetch_rates(snapshotter, args.reps))
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        write = timed("persistent write", lambda: write_rates(trainer, snapshotter, Path(tmp),
                                                              args.reps))
        restore = timed("restore per tier", lambda: restore_times(snapshotter, Path(tmp)))
    nbytes = rates["bytes"]
    # Each variant's median over clean samples (over all, if none was clean).
    variant_pct = {name: float(f["clean" if f["clean"]["n"] else "all"]["median"])
                   for name, f in overhead["variants"].items()}
    summary = {
        # The first variant's median over clean samples (over all, if none was clean).
        "snapshot_overhead_pct": next(iter(variant_pct.values())),
        "snapshot_overhead_pct_by_variant": variant_pct,
        "snapshot_GBps": round(nbytes / rates["copy_s"] / GB, 2),
        "fetch_GBps": round(fetch["fetch"], 2),
        "raw_socket_GBps": round(fetch["raw"], 2),
        "fetch_ratio_vs_raw": round(fetch["ratio"], 3),
        "hdf5_write_GBps": round(write["hdf5"], 3),
        "torch_save_GBps": round(write["torch_save"], 3),
        "hdf5_vs_torch_save": round(write["ratio"], 3),
        **backup_summary(backup),
        **backup_every_summary(by_every),
        **backup_every_summary(by_every_resident, resident=True),
        # Seconds to restore the whole state from each tier alone, nearest first.
        **{f"restore_{tier.replace(' ', '_')}_s": round(seconds, 3)
           for tier, seconds in restore.items()},
    }
    details = {
        "state_bytes": nbytes, "params": trainer.params, "batch": args.batch,
        "worker_nice": args.worker_nice, "max_foreign": args.max_foreign,
        "overhead": overhead, **snapshot_details(rates, overhead),
        "fetch_streams": DEFAULTS.fetch_streams,
        "fetch_1_stream_GBps": round(fetch["fetch_1_stream"], 2),
        "fetch_1_stream_ratio_vs_raw": round(fetch["ratio_1_stream"], 3),
        "safetensors_GBps": None,  # safetensors is not installed here
        "restore_seconds": {k: round(v, 3) for k, v in restore.items()},
        "backup": backup,
        "backup_every": by_every,
        "backup_every_resident": by_every_resident,
    }
    print_overhead(overhead, rates)
    print_table(summary, details)
    if args.json:
        write_json(args.json, {"summary": summary, "details": details})
    return 0


def measure_backup_every(args: argparse.Namespace, trainer: Trainer
                         ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``backup_every_cost`` for each ``--backup-every`` interval, with each of
    ``--backup-optimizers``: torch's Adam, ResidentAdam."""
    everies = [int(k) for k in args.backup_every.split(",") if k.strip()]
    optimizers = set(args.backup_optimizers.split(","))
    if not everies:
        return None, None

    def measure(backed: Trainer | None) -> dict[str, Any]:
        return backup_every_cost(trainer, everies, args.backup_every_pairs, args.steps,
                                 args.max_foreign, args.max_rounds or 3 * args.backup_every_pairs,
                                 args.worker_nice, backed)

    lazy = (timed("peer backup every k steps, torch Adam (paired runs)", lambda: measure(None))
            if "adam" in optimizers else None)
    resident = (timed("peer backup every k steps, ResidentAdam (paired runs)", lambda: measure(
        Trainer(args.width, args.layers, args.batch, resident=True)))
        if "resident" in optimizers else None)
    return lazy, resident


def backup_main(args: argparse.Namespace, trainer: Trainer) -> int:
    """``--backup-only``: the peer-backup figures alone (what ``ckpt.backup_every``
    is chosen from), without the snapshot variants, transfers and tiers."""
    backup = (timed("peer backup every step (paired runs)", lambda: backup_cost(
        trainer, args.backup_pairs, args.steps, args.max_foreign,
        args.max_rounds or 3 * args.backup_pairs, args.worker_nice))
        if args.backup_pairs else None)
    by_every, by_every_resident = measure_backup_every(args, trainer)
    push = timed("one push's CPU against a step's", lambda: push_cpu_cost(trainer, args.reps))
    summary = {**backup_summary(backup), **backup_every_summary(by_every),
               **backup_every_summary(by_every_resident, resident=True),
               **push_cpu_summary(push)}
    details = {"params": trainer.params, "batch": args.batch, "worker_nice": args.worker_nice,
               "max_foreign": args.max_foreign, "backup": backup, "backup_every": by_every,
               "backup_every_resident": by_every_resident, "push_cpu": push}
    print(json.dumps(summary, indent=2))
    if args.json:
        write_json(args.json, {"summary": summary, "details": details})
    return 0


def push_cpu_summary(push: dict[str, Any]) -> dict[str, Any]:
    return {
        # CPU seconds of one push (both ends) and of one training step.
        "backup_push_cpu_s": push["push_cpu_s"], "train_step_cpu_s": push["step_cpu_s"],
        # A push every k steps, as a share of the training CPU it takes (see push_cpu_cost).
        "backup_push_cpu_pct_by_every": push["pct_of_training_by_every"],
    }


def backup_summary(backup: dict[str, Any] | None) -> dict[str, Any]:
    if backup is None:
        return {}
    return {
        # Snapshot + push to the backup peer every step, against no snapshot at all.
        "backup_overhead_pct": backup["pct"],
        # Share of the snapshots taken during those runs that reached the peer.
        "backup_sent_per_snapshot": backup["sent_per_snapshot"],
        "backup_skipped_snapshots_per_step": backup["skipped_per_snapshot"],
        "backup_push_s": round(backup["push"]["total_s"], 3),
        "backup_push_crc32_s": round(backup["push"]["crc32_s"], 3),
    }


def snapshot_details(rates: dict[str, float], overhead: dict[str, Any]) -> dict[str, Any]:
    nbytes, plain = rates["bytes"], overhead["step_s_plain"]
    figures: dict[str, Any] = {
        f"{name}_GBps": round(nbytes / rates[f"{name}_s"] / GB, 2)
        for name in ("copy", "crc32", "sum64", "copy_1_thread", "copy_2_thread")}
    if plain:
        # What a copy costs when it cannot overlap anything: both cores busy training.
        floor = min(rates["copy_1_thread_s"], rates["copy_2_thread_s"])
        figures["copy_floor_pct_of_step"] = round(100 * floor / plain, 2)
        figures["crc32_pct_of_step"] = round(100 * rates["crc32_s"] / plain, 2)
    return figures


def print_overhead(overhead: dict[str, Any], rates: dict[str, float]) -> None:
    print(f"\nstep without snapshot {overhead['step_s_plain']} s (clean samples); "
          f"overhead per variant, % of step time:")
    rows = [(name, figures["clean"], figures["all"])
            for name, figures in overhead["variants"].items()]
    rows.append(("A/A control", overhead["control"], {"n": "-"}))
    for name, clean, every in rows:
        if clean["n"]:
            text = (f"median {clean['median']:+6.2f}  IQR [{clean['q1']:+.2f}, {clean['q3']:+.2f}]"
                    f"  range [{clean['min']:+.2f}, {clean['max']:+.2f}]")
        else:
            text = "no clean sample"
        counts = f"clean n={clean['n']}" + (f" of {every['n']} (median of all "
                                             f"{every['median']:+.2f})" if "median" in every
                                             else "")
        waits = overhead["variants"].get(name, {})
        wait = (f"; waited {waits['wait_s_per_snapshot']:.3f} s/step" if waits else "")
        print(f"  {name:<12} {text}  {counts}{wait}")
    details = snapshot_details(rates, overhead)
    print(f"  one snapshot of {rates['bytes'] / GB:.2f} GB: copy {rates['copy_s']:.3f} s, "
          f"CRC-32 {rates['crc32_s']:.3f} s, sum64 {rates['sum64_s']:.3f} s; bare copy "
          f"with 1 / 2 threads {rates['copy_1_thread_s']:.3f} / {rates['copy_2_thread_s']:.3f}"
          f" s, the better = {details.get('copy_floor_pct_of_step', float('nan'))}% of a step")


def print_table(summary: dict[str, Any], details: dict[str, Any]) -> None:
    overhead = details["overhead"]
    rows = [
        ("state (params + Adam)", f"{details['state_bytes'] / GB:.2f} GB"),
        ("step time without snapshot (clean samples)", f"{overhead['step_s_plain']} s"),
        ("snapshot-every-step overhead (median, clean pairs)",
         f"{summary['snapshot_overhead_pct']:+.2f}%"),
        ("A/A control (noise floor), median [IQR]",
         (f"{overhead['control'].get('median')}% [{overhead['control'].get('q1')}, "
          f"{overhead['control'].get('q3')}]")),
        ("snapshot copy (per step) / CRC-32 / sum64",
         f"{summary['snapshot_GBps']} / {details['crc32_GBps']} / {details['sum64_GBps']} GB/s"),
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
    ] + ([
        ("snapshot + peer backup every step (median, clean pairs)",
         f"{summary['backup_overhead_pct']:+.2f}%"),
        ("snapshots that reached the backup peer / skipped per step",
         f"{summary['backup_sent_per_snapshot']} / "
         f"{summary['backup_skipped_snapshots_per_step']}"),
        ("one push of a fresh snapshot (CRC-32 on first use)",
         f"{summary['backup_push_s']:.2f} s ({summary['backup_push_crc32_s']:.2f} s CRC)"),
    ] if "backup_overhead_pct" in summary else []) + [
        (f"snapshot every step + peer backup every {k} steps (mean, clean pairs)",
         f"{pct:+.2f}%") for k, pct in summary.get("backup_overhead_pct_by_every", {}).items()
    ] + [(f"restore from {tier}", f"{seconds:.2f} s")
         for tier, seconds in details["restore_seconds"].items()]
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    sys.exit(main())
