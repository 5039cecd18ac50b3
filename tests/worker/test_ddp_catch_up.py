"""DDP replicas through a failure: a replica killed and started again catches up and
ends bit-identical to the others, with one and two ranks per replica; replicas
that lay their gradients out differently stop with an error naming what differs;
gradient accumulation under ``no_sync()`` still trains bit for bit as native DDP.

DDP re-buckets its gradients once, from the order they were ready in a process's
first backward. A restarted replica's first backward is its catch-up step, where
the survivors had re-bucketed long before: without ft-launch fixing the layout
before the first exchange (``torch_hooks.DdpExchange``), FTAR averaged the
survivors' buckets into the wrong parameters of the newcomer, for good."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ft_launch.launcher.worker.local import LocalJob

from .harness import logs_of_a_failed_run, loopback_job, restart_and_end_once_caught_up
from .test_amp import REPLICAS, run_ft, run_native
from .test_fault_tolerance import LONG_RUN, assert_ranks_agree, finish_and_check

pytestmark = [pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("replicated_worker.py")


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_killed_ddp_replica_catches_up_and_every_replica_ends_identical(tmp_path, ranks):
    # Never ends by itself: once the restarted replica is back, the run is ended
    # (end-step) far enough ahead of every replica, however slow its start was.
    job = loopback_job(tmp_path, replicas=3, steps=100_000, ranks=ranks, parallel="ddp")
    job.start_all({1: "kill@after_commit:10"})
    try:
        end = restart_and_end_once_caught_up(job, 1, ahead=LONG_RUN // 4)
        finish_and_check(job, end)
    finally:
        job.stop_everything()
    assert_ranks_agree(tmp_path, replicas=3, ranks=ranks)
    assert any(e.caught_up for e in job.committed(1))


def test_replicas_with_different_ddp_buckets_stop_naming_what_differs(tmp_path):
    """Replica 1 builds DDP with a smaller ``bucket_cap_mb``: its buckets hold other
    parameters than replica 0's. Both stop at their first step, before any gradient is
    averaged, with an error that names the parameters laid out differently."""
    job = LocalJob(tmp_path / "run", replicas=2,
                   command=[sys.executable, str(WORKER), "--mode", "ft", "--parallel", "ddp",
                            "--out", str(tmp_path / "out"), "--steps", "3",
                            "--bucket-cap-mb", "25,0.02"],
                   config_env={"FTL_QUORUM_JOIN_TIMEOUT": "1"})
    for replica, log in enumerate(logs_of_a_failed_run(job)):
        assert "lay their DDP gradient buckets out differently" in log, log[-3000:]
        assert "10 of 17 parameters sit elsewhere: tok.weight (bucket" in log, log[-3000:]
        assert not (tmp_path / "out" / f"ft-r{replica}.json").exists()
    # nothing was committed, so nothing was averaged into the wrong parameters
    assert not any(type(e).__name__ == "StepCommitted" for r in range(2) for e in job.events(r))


def test_ddp_gradient_accumulation_under_no_sync_trains_as_natively(tmp_path):
    """Two micro-batches a step, the first under DDP's ``no_sync()``: the buckets fixed
    at the start carry the accumulated gradients, one exchange per step, and two
    replicas train bit for bit as one native DDP world of two processes."""
    out = tmp_path / "out"
    options = ["--accumulate", "2"]
    run_native(out, options)
    run_ft(tmp_path / "run", out, "ddp", options)
    for replica in range(REPLICAS):
        native, ft = (json.loads((out / f"{mode}-r{replica}.json").read_text())
                      for mode in ("native", "ft"))
        assert ft["state_sha256"] == native["state_sha256"], replica
        assert ft["positions"] == native["positions"]
