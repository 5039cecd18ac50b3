"""FT-HSDP against native torch HSDP, bit for bit, on a 2x2 mesh (real processes, gloo).

Native: one torch world of 4 ranks, a 2-D mesh (replicate=2, shard=2), FSDP2's
own reduce-scatter + all-reduce. FT-HSDP: two replicas, each a torch world of 2
ranks sharded with FSDP2, rank k of both averaging its gradient shard through
FTAR in FSDP2's all-reduce hook. With two members every sum has one order, so
the gradient shards and the parameters after each AdamW step must be identical.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from launcher.worker.local import LocalJob, free_port
from tests.waiting import patience

WORKER = Path(__file__).with_name("hsdp_worker.py")
REPLICAS, RANKS, STEPS = 2, 2, 2


def run_native(out: Path, reduce_dtype: str) -> None:
    port = free_port()
    procs = []
    for rank in range(REPLICAS * RANKS):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(REPLICAS * RANKS), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), "--mode", "native", "--out", str(out),
             "--steps", str(STEPS), "--reduce-dtype", reduce_dtype], env=env))
    codes = [p.wait(timeout=patience(180)) for p in procs]
    assert codes == [0] * len(procs)


def run_ft(tmp_path: Path, out: Path, reduce_dtype: str) -> LocalJob:
    job = LocalJob(tmp_path / "run", replicas=REPLICAS, ranks=RANKS,
                   command=[sys.executable, str(WORKER), "--mode", "ft", "--out", str(out),
                            "--steps", str(STEPS), "--reduce-dtype", reduce_dtype],
                   config_env={"FTL_QUORUM_JOIN_TIMEOUT": "1"})
    job.start_all()
    try:
        assert job.wait_all(timeout=patience(180)) == {r: 0 for r in range(REPLICAS)}, \
            job.log(0)[-3000:]
    finally:
        job.stop_everything()
    return job


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_ft_hsdp_is_bit_identical_to_native_hsdp(tmp_path: Path, reduce_dtype: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_native(out, reduce_dtype)
    run_ft(tmp_path, out, reduce_dtype)
    compared = 0
    for replica in range(REPLICAS):
        for rank in range(RANKS):
            for step in range(STEPS):
                for kind in ("grad", "param"):
                    name = f"r{replica}-k{rank}-s{step}-{kind}.npz"
                    native, ft = np.load(out / f"native-{name}"), np.load(out / f"ft-{name}")
                    assert sorted(native.files) == sorted(ft.files)
                    for key in native.files:
                        assert native[key].shape == ft[key].shape, key
                        assert np.array_equal(native[key], ft[key]), (name, key)
                        compared += 1
    # every parameter's shard, on every rank, at every step, gradients and values
    assert compared == REPLICAS * RANKS * STEPS * 2 * len(np.load(out / f"ft-{name}").files)
