"""A replica's rank checkpointing in its own process (spawn context), for the
peer-backup tests: it trains a deterministic state, backs it up to the rank the
placement picks over the members the test tells it, and waits to be killed; or,
restarted, restores through the restore chain from what its node holds."""

from __future__ import annotations

import multiprocessing.connection
import threading
from pathlib import Path

import numpy as np

from ft_launch.ckpt.held import HeldFiles
from ft_launch.ckpt.placement import global_rank, route_backups
from ft_launch.ckpt.rank import RankCheckpointer, RankPlace
from ft_launch.ckpt.restore import peer_copies
from ft_launch.ckpt.snapshot import ArrayState
from ft_launch.config import CkptConfig

JOB = "job7"


def state_at(step: int) -> dict[str, np.ndarray]:
    """The same state on every replica at ``step`` (FT-HSDP replicas are identical)."""
    rng = np.random.default_rng(step)
    return {"w": rng.standard_normal(20_000).astype(np.float32),
            "m": np.full(500, step, dtype=np.float64)}


def _checkpointer(root: Path, replica: int, replicas: int, host: str, node: str,
                  every: int) -> RankCheckpointer:
    config = CkptConfig(dir=str(root / "shared"), persist_every=10**6, backup_every=every,
                        fetch_timeout=20.0, backup_dir=str(root / "shm"))
    return RankCheckpointer(config, RankPlace(global_rank(replica, 0, 1), replicas, 0, 1),
                            secret=(root / "secret").read_text(),
                            host=host, persist=False,
                            held=HeldFiles.open(config.backup_dir, JOB, node))


def train(conn: multiprocessing.connection.Connection, root: str, replica: int, replicas: int,
          host: str, node: str, steps: int, every: int) -> None:
    """Serve, take the members from the test, train ``steps`` steps backing up every
    ``every``, report the newest step pushed and, when asked, the backups held here;
    then wait to be killed."""
    ckpt = _checkpointer(Path(root), replica, replicas, host, node, every)
    conn.send(ckpt.address)
    members = conn.recv()
    ckpt.route_backups(route_backups(members, replica, 0))
    assert ckpt.sender is not None
    sent = True
    for step in range(steps):
        ckpt.before_optimizer_step()
        ckpt.after_optimizer_step(step, ArrayState(state_at(step), meta={"step": step}))
        if step % every == 0:   # a real step takes longer than a push of this small state
            sent = sent and ckpt.sender.wait_sent(step, timeout=20)
    ckpt.before_optimizer_step()
    conn.send(ckpt.sender.last_sent_step if sent else None)
    conn.recv()   # every rank has sent (and its holder stored) its last push
    conn.send(ckpt.backups.held_copies())
    threading.Event().wait(120)  # until the test kills this process


def restore(conn: multiprocessing.connection.Connection, root: str, replica: int,
            replicas: int, host: str, node: str) -> None:
    """A new incarnation: restore from whatever this node holds; report tier and step."""
    ckpt = _checkpointer(Path(root), replica, replicas, host, node, every=1)
    try:
        copies = peer_copies([(node, ckpt.address, ckpt.held_copies())], shard=0)
        restored = ckpt.restore_chain(held=copies).restore()
        expected = state_at(restored.step)
        same = all(np.array_equal(restored.manifest.spec(k).view(restored.buffer), v)
                   for k, v in expected.items())
        conn.send((restored.tier.value, restored.step, same))
    finally:
        ckpt.close()
