"""A rank serving its state in its own process (started with the spawn context)."""

from __future__ import annotations

import multiprocessing.connection
import threading

import numpy as np

from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import ArrayState, DualBufferSnapshotter


def serve_state(conn: multiprocessing.connection.Connection, secret: str, step: int,
                nbytes: int) -> None:
    """Snapshot ``nbytes`` of state as ``step``, serve it, send the port, wait to be killed."""
    arrays = {"big": np.arange(nbytes // 4, dtype=np.float32)}
    snapshotter = DualBufferSnapshotter()
    snapshotter.start(step, ArrayState(arrays))
    snapshotter.wait_complete()
    server = StateServer(secret=secret, host="127.0.0.1", snapshots=snapshotter.buffers).start()
    conn.send(server.address[1])
    threading.Event().wait(120)  # until the test kills this process
