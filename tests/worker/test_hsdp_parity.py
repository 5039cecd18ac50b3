"""FT-HSDP against native torch HSDP (real processes, gloo).

Native: one torch world, a 2-D mesh (replicate, shard=2), FSDP2's own
reduce-scatter + all-reduce. FT-HSDP: each replica a torch world of 2 ranks
sharded with FSDP2, rank k of every replica averaging its gradient shard through
FTAR in FSDP2's all-reduce hook.

With two replicas every sum has one order, so the gradient shards and the
parameters after each AdamW step must be identical, bit for bit. With three, gloo's
ring sums each third of a buffer as ``(x[i+1] + x[i+2]) + x[i]`` and FTAR's ring in
its own order: float addition is not associative, so the gradients agree to a few
ulp (rtol 1e-5) and the parameters, after Adam divides by the gradients' root mean
square, to 1e-5 absolute (the learning rate is 1e-2).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ft_launch.launcher.worker.local import LocalJob, free_port
from tests.waiting import patience

WORKER = Path(__file__).with_name("hsdp_worker.py")
RANKS, STEPS = 2, 2


def run_native(out: Path, replicas: int, reduce_dtype: str) -> None:
    port = free_port()
    procs = []
    for rank in range(replicas * RANKS):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(replicas * RANKS), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, str(WORKER), "--mode", "native", "--out", str(out),
             "--replicas", str(replicas), "--steps", str(STEPS),
             "--reduce-dtype", reduce_dtype], env=env))
    codes = [p.wait(timeout=patience(180)) for p in procs]
    assert codes == [0] * len(procs)


def run_ft(tmp_path: Path, out: Path, replicas: int, reduce_dtype: str,
           overlap: bool = True) -> LocalJob:
    job = LocalJob(tmp_path / "run", replicas=replicas, ranks=RANKS,
                   command=[sys.executable, str(WORKER), "--mode", "ft", "--out", str(out),
                            "--replicas", str(replicas), "--steps", str(STEPS),
                            "--reduce-dtype", reduce_dtype],
                   config_env={"FTL_QUORUM_JOIN_TIMEOUT": "1",
                               "FTL_RUNTIME_OVERLAP_BACKWARD": str(overlap).lower()})
    job.start_all()
    try:
        assert job.wait_all(timeout=patience(180)) == {r: 0 for r in range(replicas)}, \
            job.log(0)[-3000:]
    finally:
        job.stop_everything()
    return job


@pytest.mark.parametrize(("replicas", "reduce_dtype", "exact", "overlap"),
                         [(2, "fp32", True, True), (2, "bf16", True, True),
                          (3, "fp32", False, True),
                          # runtime.overlap_backward = false: every shard after backward
                          (2, "fp32", True, False)])
def test_ft_hsdp_matches_native_hsdp(tmp_path: Path, replicas: int, reduce_dtype: str,
                                     exact: bool, overlap: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run_native(out, replicas, reduce_dtype)
    run_ft(tmp_path, out, replicas, reduce_dtype, overlap)
    compared = 0
    for replica in range(replicas):
        for rank in range(RANKS):
            for step in range(STEPS):
                for kind in ("grad", "param"):
                    name = f"r{replica}-k{rank}-s{step}-{kind}.npz"
                    native, ft = np.load(out / f"native-{name}"), np.load(out / f"ft-{name}")
                    assert sorted(native.files) == sorted(ft.files)
                    for key in native.files:
                        a, b = native[key], ft[key]
                        assert a.shape == b.shape, key
                        if exact:
                            assert np.array_equal(a, b), (name, key)
                        elif kind == "grad":
                            assert np.allclose(a, b, rtol=1e-5, atol=1e-9), (name, key)
                        else:
                            assert np.allclose(a, b, rtol=0, atol=1e-5), (name, key)
                        compared += 1
    # every parameter's shard, on every rank, at every step, gradients and values
    assert compared == replicas * RANKS * STEPS * 2 * len(np.load(out / f"ft-{name}").files)
