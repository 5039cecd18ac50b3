"""Child process for persistence faults: ``python -m tests.ckpt.persist_proc MODE ROOT STEP``.

Modes:
* ``save``: write the shard of STEP and exit 0.
* ``hang-before-rename`` / ``hang-before-record``: start writing STEP, stop at
  that point of the atomic sequence, create ``ROOT/blocked`` and wait to be killed.
* ``fsize-limit``: write STEP with the file size limit below the shard size (a
  full disk, as far as the writer can tell); print the error class and message.
* ``save-report``: like ``save`` but print the error class and message on failure.
"""

from __future__ import annotations

import resource
import signal
import sys
import threading
from pathlib import Path

from ft_launch.ckpt import persist
from ft_launch.ckpt.errors import StorageError, StorageSetupError
from ft_launch.ckpt.persist import PersistentStore
from ft_launch.ckpt.snapshot import DualBufferSnapshotter

from .helpers import snapshot_of

SIZE = 2_000_000


def _hang(root: Path) -> None:
    (root / "blocked").write_text("x")
    threading.Event().wait(120)


def main(mode: str, root_text: str, step: int) -> int:
    root = Path(root_text)
    snapshotter = snapshot_of(step, DualBufferSnapshotter(), size=SIZE)
    if mode == "hang-before-rename":
        persist.fsync_file = lambda path: _hang(root)  # type: ignore[assignment]
    elif mode == "hang-before-record":
        persist.atomic_write_text = lambda *a, **k: _hang(root)  # type: ignore[assignment]
    elif mode == "fsize-limit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (SIZE, SIZE))
    try:
        store = PersistentStore(root, rank=0, world_size=1, keep=5)
        with snapshotter.lease() as snap:
            store.save(snap.manifest, snap.buffer)
    except (StorageError, StorageSetupError) as exc:
        print(f"{type(exc).__name__}|{exc}")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
