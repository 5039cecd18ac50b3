"""Two replicas' ranks wired through ``RankCheckpointer``: catch-up, backup, restart."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from ft_launch.ckpt.persist import Completeness
from ft_launch.ckpt.rank import RankCheckpointer, RankPlace
from ft_launch.ckpt.restore import TierKind
from ft_launch.ckpt.snapshot import ArrayState
from ft_launch.config import CkptConfig
from ft_launch.ids import new_job_secret

pytestmark = pytest.mark.timeout(60)
SECRET = new_job_secret()


def _train_step(state: dict[str, np.ndarray], step: int) -> None:
    """A deterministic 'optimizer step': every replica computes the same update."""
    grad = np.random.default_rng(step).standard_normal(state["w"].shape).astype(np.float32)
    state["m"] = 0.9 * state["m"] + 0.1 * grad
    state["w"] -= 0.01 * state["m"]


def _fresh() -> dict[str, np.ndarray]:
    return {"w": np.ones(50_000, np.float32), "m": np.zeros(50_000, np.float32)}


def _ranks(tmp_path, replicas: int = 2) -> list[RankCheckpointer]:
    config = CkptConfig(dir=str(tmp_path / "shared"), persist_every=2, keep=2)
    return [RankCheckpointer(replace(config, local_dir=str(tmp_path / f"local{r}")),
                             RankPlace(rank=r, world_size=replicas, shard=0, shards=1),
                             secret=SECRET, host="127.0.0.1", persist=(r == 0),
                             accept_backups_from={(r + 1) % replicas})
            for r in range(replicas)]


def _run(ckpt: RankCheckpointer, state: dict[str, np.ndarray], steps: range) -> None:
    for step in steps:
        ckpt.before_optimizer_step()
        _train_step(state, step)
        ckpt.after_optimizer_step(step, ArrayState(state, meta={"step": step}))
        ckpt.wait_persisted(timeout=30)  # steps here take microseconds, not seconds
    ckpt.before_optimizer_step()


def test_behind_replica_catches_up_and_ends_identical(tmp_path):
    healthy, behind = _ranks(tmp_path)
    try:
        state = _fresh()
        _run(healthy, state, range(5))
        catch_up = behind.catch_up([healthy.address], step=4)
        fetched = catch_up.result(timeout=30)
        caught = {name: fetched.manifest.spec(name).view(fetched.buffer).copy()
                  for name in ("w", "m")}
        _run(healthy, state, range(5, 8))
        _run(behind, caught, range(5, 8))
        for name in state:
            np.testing.assert_array_equal(caught[name], state[name])
        assert healthy.persistent is not None
        assert healthy.persistent.complete_steps() == [4, 6]
    finally:
        healthy.close()
        behind.close()


def test_restarted_rank_restores_from_its_backup_peer(tmp_path):
    first, second = _ranks(tmp_path)
    first.close()
    config = CkptConfig(dir=str(tmp_path / "shared"), persist_every=100, backup_every=1)
    first = RankCheckpointer(config, RankPlace(0, 2, 0, 1), secret=SECRET, host="127.0.0.1",
                             backup_peer=second.address, accept_backups_from={1})
    try:
        state = _fresh()
        _run(first, state, range(3))
        assert first.sender is not None and first.sender.wait_sent(2, timeout=20)
        expected = {k: v.copy() for k, v in state.items()}
        first.close()  # the process dies: its memory and server are gone
        restarted = RankCheckpointer(config, RankPlace(0, 2, 0, 1), secret=SECRET,
                                     host="127.0.0.1", persist=False)
        try:
            restored = restarted.restore_chain(backup_peer=second.address).restore()
        finally:
            restarted.close()
        assert (restored.tier, restored.step) == (TierKind.PEER, 2)
        np.testing.assert_array_equal(restored.manifest.spec("w").view(restored.buffer),
                                      expected["w"])
    finally:
        second.close()


def test_every_tunable_comes_from_the_config(tmp_path):
    config = CkptConfig(dir=str(tmp_path / "shared"), persist_every=3, keep=4,
                        local_dir=str(tmp_path / "local"), backup_every=5, fetch_streams=3,
                        durable=False, snapshot_nice=7, check_finite=False, fetch_timeout=9.0)
    helper = RankCheckpointer(CkptConfig(dir=str(tmp_path / "helper")), RankPlace(1, 2, 0, 1),
                              secret=SECRET, host="127.0.0.1")
    ckpt = RankCheckpointer(config, RankPlace(0, 2, 0, 1), secret=SECRET, host="127.0.0.1",
                            backup_peer=helper.address)
    try:
        assert ckpt.snapshots._worker_nice == 7
        for store, completeness in ((ckpt.persistent, Completeness.ALL_SHARDS),
                                    (ckpt.local, Completeness.OWN_SHARD)):
            assert store is not None and store.completeness is completeness
            assert (store.keep, store.every, store.durable) == (4, 3, False)
        assert ckpt.local is not None and ckpt.local.root == tmp_path / "local"
        assert ckpt.sender is not None and ckpt.sender.every == 5
        assert ckpt.server.io_timeout == 9.0
        assert ckpt.restore_chain().check_finite is False
        _run(helper, _fresh(), range(1))
        catch_up = ckpt.catch_up([helper.address], step=0)
        assert catch_up._streams == 3
        assert catch_up.result(timeout=20).step == 0
    finally:
        ckpt.close()
        helper.close()
