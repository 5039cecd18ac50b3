"""The checkpoint benchmark's peer-backup measurement, on a tiny model (seconds)."""

from __future__ import annotations

import threading

import numpy as np

from ft_launch.ckpt.backup import BackupStore
from ft_launch.ckpt.fetch import Peer
from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from tests.scale.helpers import load_benchmark

bench = load_benchmark("ckpt_bench")


def tiny_trainer() -> object:
    return bench.Trainer(width=16, layers=2, batch=4)


class SlowPeerStore(BackupStore):
    """A backup peer that takes 0.3 s longer per push (injected slowness, not a wait)."""

    def receive(self, *args, **kwargs) -> None:
        threading.Event().wait(0.3)
        super().receive(*args, **kwargs)


def test_a_backed_up_run_ends_with_its_newest_snapshot_on_the_peer() -> None:
    trainer = tiny_trainer()
    store = SlowPeerStore()
    with StateServer(secret=bench.SECRET, host="127.0.0.1",
                     snapshots=DualBufferSnapshotter().buffers, backups=store) as server:
        snapshotter = bench.BackedUpSnapshotter(Peer(*server.address), nice=0)
        try:
            trainer.run(3, snapshotter)  # returns after the drain: nothing left in flight
            assert store.buffers(0).latest_step() == snapshotter.latest_step()
            # (A snapshot whose buffer the sender still read was skipped: the newest
            # complete one may be older than the last step, never missing on the peer.)
            with snapshotter.lease() as mine, store.buffers(0).lease() as held:
                assert mine.step == held.step
                assert np.array_equal(mine.buffer, held.buffer)
        finally:
            snapshotter.sender.close()


def test_backup_cost_reports_the_summary_keys() -> None:
    trainer = tiny_trainer()
    trainer.run(2, None)
    backup = bench.backup_cost(trainer, pairs=1, steps=1, max_foreign=1.0, max_rounds=1, nice=0)
    summary = bench.backup_summary(backup)
    assert set(summary) == {"backup_overhead_pct", "backup_sent_per_snapshot",
                            "backup_skipped_snapshots_per_step", "backup_push_s",
                            "backup_push_crc32_s"}
    assert 0 < summary["backup_sent_per_snapshot"] <= 1
    assert backup["failed"] == 0
    assert bench.backup_summary(None) == {}


def test_the_resident_variant_trains_its_own_trainer_against_the_torch_baseline() -> None:
    baseline = tiny_trainer()
    resident = bench.Trainer(width=16, layers=2, batch=4, resident=True)
    snapshotter = DualBufferSnapshotter(worker_nice=0)
    bench.Residency(resident.model, resident.optimizer, snapshotter)
    before = baseline.step_index
    overhead = bench.snapshot_overhead(baseline, {bench.RESIDENT: snapshotter}, pairs=1,
                                       steps=1, max_foreign=1.0, max_rounds=1,
                                       trainers={bench.RESIDENT: resident})
    # Plain runs train the torch baseline, the snapshot run the resident trainer.
    assert baseline.step_index == before + 2 * 2
    assert snapshotter.latest_step() == resident.step_index == 2
    assert overhead["variants"][bench.RESIDENT]["all"]["n"] == 1
    first = next(resident.model.parameters())
    with snapshotter.lease() as snap:
        start = snap.buffer.ctypes.data
        assert start <= first.data_ptr() < start + snap.buffer.nbytes  # resident, not copied


def test_backup_every_cost_reports_each_interval_and_the_default():
    """Pushes every k steps: each k measured with runs of at least 3 k steps, with
    torch's Adam and with ResidentAdam (the product's CPU optimizer)."""
    trainer = tiny_trainer()
    trainer.run(2, None)
    lazy = bench.backup_every_cost(trainer, [2, 3], pairs=1, steps=1, max_foreign=1.0,
                                   max_rounds=1, nice=0)
    resident = bench.backup_every_cost(trainer, [2], pairs=1, steps=1, max_foreign=1.0,
                                       max_rounds=1, nice=0,
                                       backed=bench.Trainer(width=16, layers=2, batch=4,
                                                            resident=True))
    assert set(lazy) == {"2", "3"} and set(resident) == {"2"}
    assert lazy["3"]["steps_per_run"] == 9 and all(v["failed"] == 0 for v in lazy.values())
    summary = {**bench.backup_every_summary(lazy),
               **bench.backup_every_summary(resident, resident=True)}
    assert set(summary) == {"backup_overhead_pct_by_every", "backup_overhead_cpu_pct_by_every",
                            "backup_resident_overhead_pct_by_every",
                            "backup_resident_overhead_cpu_pct_by_every", "backup_every_default"}
    assert set(summary["backup_overhead_pct_by_every"]) == {"2", "3"}
    assert summary["backup_every_default"] == bench.DEFAULTS.backup_every
    assert bench.backup_every_summary(None) == {}
