"""An HSDP script keeps its mesh: ``ft_init_device_mesh`` in place of torch's
``init_device_mesh`` (``launcher/worker/mesh.py``).

The same native HSDP script (``mesh_worker.py``: a ``("replicate", "shard")`` mesh,
FSDP2 on it, its own data split by the mesh) runs natively as one torch world of
2 x 2 ranks on a real ``(2, 2)`` mesh, and under ft-launch as 2 replicas of 2
ranks, each its own world, with the mesh call swapped: with two replicas every
sum has one order, so every rank's shards of the parameters and of AdamW's state
are identical after every step, bit for bit. A replica killed mid-run and started
again catches up on the 2-D mesh and ends identical to the other.

The mesh itself (in this process, a torch world of one rank): it reports the
run's replicas and this replica's index where a native mesh reports them, keeps
the replica's own process groups, and refuses what it cannot be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ft_launch.errors import UsageError
from ft_launch.files import atomic_write_text
from ft_launch.launcher.worker.identity import WorkerIdentity
from ft_launch.launcher.worker.local import LocalJob, free_port
from tests.waiting import patience, wait_until

from .harness import TEST_CONFIG
from .test_fault_tolerance import kill_and_restart

pytestmark = [pytest.mark.timeout(300)]

WORKER = Path(__file__).with_name("mesh_worker.py")
REPLICAS, SHARDS, STEPS = 2, 2, 3


def worker(mode: str, out: Path, *options: str, replicas: int = REPLICAS) -> list[str]:
    return [sys.executable, str(WORKER), "--mode", mode, "--out", str(out),
            "--replicas", str(replicas), "--shards", str(SHARDS), *options]


def run_native(out: Path, *options: str) -> None:
    port, world = free_port(), REPLICAS * SHARDS
    procs = [subprocess.Popen(worker("native", out, *options),
                              env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                   "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for rank in range(world)]
    try:
        assert [p.wait(timeout=patience(180)) for p in procs] == [0] * world
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def ft_job(run_dir: Path, out: Path, *options: str, config: dict[str, str],
           replicas: int = REPLICAS) -> LocalJob:
    return LocalJob(run_dir, replicas=replicas, ranks=SHARDS,
                    command=worker("ft", out, *options, replicas=replicas), config_env=config)


def results(out: Path, mode: str, replica: int, shard: int) -> tuple[dict, dict]:
    name = f"{mode}-r{replica}-k{shard}"
    with np.load(out / f"{name}.npz") as arrays:
        return json.loads((out / f"{name}.json").read_text()), dict(arrays)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_native_hsdp_script_with_its_mesh_swapped_trains_bit_identical(tmp_path, dtype):
    out = tmp_path / "out"
    out.mkdir()
    options = ("--steps", str(STEPS), "--dtype", dtype)
    run_native(out, *options)
    job = ft_job(tmp_path / "run", out, *options, config={"FTL_QUORUM_JOIN_TIMEOUT": "1"})
    job.start_all()
    try:
        codes = job.wait_all(timeout=patience(180))
        assert codes == {r: 0 for r in range(REPLICAS)}, job.log(0)[-3000:]
    finally:
        job.stop_everything()
    for replica in range(REPLICAS):
        for shard in range(SHARDS):
            (native, native_state), (ft, ft_state) = (results(out, mode, replica, shard)
                                                      for mode in ("native", "ft"))
            assert sorted(native_state) == sorted(ft_state)
            assert any(key.startswith("optim/") for key in native_state)
            for key, value in native_state.items():
                assert np.array_equal(value, ft_state[key]), (replica, shard, key)
            assert ft["steps"] == native["steps"], (replica, shard)
            assert len(ft["steps"]) == STEPS
    # the final model saved from one replica, as natively (a full state dict)
    with np.load(out / "native-full.npz") as native, np.load(out / "ft-full.npz") as ft:
        assert sorted(native.files) == sorted(ft.files)
        assert all(np.array_equal(native[key], ft[key]) for key in native.files)


#: Steps trained by every replica after the killed one is back (``end-step``).
TOGETHER = 10
#: Three replicas: two keep a majority of the quorum's votes while the third is down.
KILL_REPLICAS = 3


def test_a_killed_replica_catches_up_on_the_2d_mesh_and_ends_identical(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    job = ft_job(run_dir, out, "--steps", "100000", config=TEST_CONFIG,
                 replicas=KILL_REPLICAS)
    job.start_all({1: "kill@after_commit:3"})
    try:
        kill_and_restart(job, 1, "after_commit", restart_after_step=5)
        # it trains until end-step is written: having ended, it failed
        wait_until(lambda: job.current(1).poll() is not None
                   or any(e.caught_up for e in job.committed(1)), 120, "replica 1 to catch up")
        assert job.current(1).poll() is None, job.log(1)[-3000:]
        # the run ends TOGETHER steps ahead of every replica (each reads end-step first)
        end = max(job.last_committed_step(r) for r in range(KILL_REPLICAS)) + TOGETHER
        atomic_write_text(run_dir / "end-step", str(end))
        codes = job.wait_all(timeout=patience(120))
        assert codes == {r: 0 for r in range(KILL_REPLICAS)}, job.log(1)[-3000:]
    finally:
        job.stop_everything()
    for shard in range(SHARDS):
        (first, first_state), *others = (results(out, "ft", r, shard)
                                         for r in range(KILL_REPLICAS))
        for replica, (other, other_state) in enumerate(others, start=1):
            assert other["final"] == first["final"], (replica, shard)
            assert all(np.array_equal(v, other_state[k]) for k, v in first_state.items())
            # every step both committed (the restarted one from its catch-up on) ended alike
            both = set(first["steps"]) & set(other["steps"])
            assert len(both) >= TOGETHER
            assert all(first["steps"][s] == other["steps"][s] for s in both), (replica, shard)
    rejoined = [e for e in job.committed(1) if e.caught_up]
    after = [e for e in job.committed(1) if e.step > rejoined[-1].step]
    assert after and all(e.contributors == KILL_REPLICAS and not e.caught_up for e in after)


# ---------------------------------------------------------------------- the mesh itself


@pytest.fixture
def one_rank_world(tmp_path: Path) -> Iterator[None]:
    """This process as a torch world of one rank (a replica of one rank)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def identity(tmp_path: Path, replica_id: int, replicas: int, ranks: int = 1) -> WorkerIdentity:
    return WorkerIdentity(job_id="local", replica_id=replica_id, num_replicas=replicas, rank=0,
                          ranks=ranks, host="127.0.0.1", run_dir=tmp_path, secret="s")


def test_the_mesh_reports_the_run_and_keeps_the_replica_s_groups(tmp_path, one_rank_world):
    from torch.distributed.device_mesh import DeviceMesh

    from ft_launch import ft_init_device_mesh

    mesh = ft_init_device_mesh("cpu", (3, 1), mesh_dim_names=("replicate", "shard"),
                               identity=identity(tmp_path, replica_id=2, replicas=3))
    assert isinstance(mesh, DeviceMesh)
    assert (mesh.shape, mesh.size(), mesh.size(0), mesh.size(-2), mesh.size(1)) == (
        (3, 1), 3, 3, 3, 1)
    assert (mesh.get_local_rank("replicate"), mesh.get_local_rank(0),
            mesh.get_local_rank("shard")) == (2, 2, 0)
    replicate = mesh["replicate"]
    assert (replicate.size(), replicate.get_local_rank(), replicate.shape) == (3, 2, (3,))
    assert mesh["replicate", "shard"] is mesh
    assert (mesh["shard"].size(), mesh["shard"].get_local_rank()) == (1, 0)
    # torch's groups and coordinate are the replica's own: FSDP2 divides by group sizes
    assert mesh.get_group("replicate").size() == 1 and replicate.get_group().size() == 1
    assert mesh.get_coordinate() == (0, 0)
    assert "replica 2 of 3" in repr(mesh)
    with pytest.raises(UsageError, match="fault-tolerant replicate dimension 'replicate'"):
        mesh._flatten("dp")


@pytest.mark.parametrize(("shape", "message"), [
    ((3, 1), "replicate dimension has 3 replica.s., but ft-launch runs 2"),
    ((1, 1), "replicate dimension has 1 replica.s., but ft-launch runs 2"),
    ((2, 4), r"other dimensions \[4\] hold 4 rank.s., but each replica has 1"),
    ((2,), "an HSDP mesh has a replicate dimension and at least one more"),
])
def test_a_mesh_that_does_not_fit_the_run_is_refused(tmp_path, shape, message):
    from ft_launch import ft_init_device_mesh

    with pytest.raises(UsageError, match=message):
        ft_init_device_mesh("cpu", shape, identity=identity(tmp_path, replica_id=0, replicas=2))
