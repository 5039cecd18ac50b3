"""The controller's heartbeat, and the workers' watch on it.

The controller (``ft-launch run``) runs on the batch host, or on a login node, and
with it every ``srun`` client. If that host dies, the replicas may train on, but
nobody would recover them, and Slurm keeps a batch job whose batch host is dead
RUNNING until its time limit (measurements:
benchmarks/results/measurements.md#batch-host-loss). So the controller rewrites
a small file in the shared run directory every ``interval``; a worker that sees
it unchanged for ``runtime.controller_timeout`` (by its own clock: no clock is
compared across nodes) knows the controller is lost and ends the allocation
cleanly (see ``ft_launch.launcher.worker.manager``).

The run directory is shared by every node already (events, audit, checkpoints);
a file there needs no listening socket on the controller and works the same
from a batch host and from a login node.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ft_launch.files import atomic_write_text

log = logging.getLogger(__name__)

HEARTBEAT_FILE = "controller.heartbeat"
#: A heartbeat is one short line; more than this is not one of ours.
MAX_BEAT_BYTES = 256


def heartbeat_path(run_dir: Path) -> Path:
    return run_dir / HEARTBEAT_FILE


def beat_interval(controller_timeout: float) -> float:
    """How often the controller beats: several beats per timeout, at most one a second
    (a shared file system should not be written more often)."""
    return min(1.0, controller_timeout / 5)


# --------------------------------------------------------------------------- pure


@dataclass(frozen=True)
class ControllerSilence:
    """The controller's heartbeat stopped changing."""

    silent_s: float
    last_beat: str

    def describe(self, path: Path) -> str:
        return (f"no controller heartbeat for {self.silent_s:.1f} s ({path} unchanged; last "
                f"{self.last_beat or 'none'}): its host is gone")


class ControllerWatch:
    """Decides, from successive reads of the heartbeat file, when the controller is
    lost: its content has not changed for ``timeout`` seconds of the reader's clock."""

    def __init__(self, timeout: float, now: float) -> None:
        self.timeout = timeout
        self._beat: str | None = None
        self._changed_at = now

    def observe(self, beat: str | None, now: float) -> ControllerSilence | None:
        """``beat``: the file's content, or None when it cannot be read."""
        if beat is not None and beat != self._beat:
            self._beat, self._changed_at = beat, now
            return None
        silent = now - self._changed_at
        return ControllerSilence(silent, (self._beat or "").strip()) \
            if silent > self.timeout else None


# --------------------------------------------------------------------------- shells


class HeartbeatWriter:
    """The controller's side: a thread rewriting the heartbeat file every interval."""

    def __init__(self, run_dir: Path, controller_timeout: float) -> None:
        self.path = heartbeat_path(run_dir)
        self.interval = beat_interval(controller_timeout)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="controller-heartbeat",
                                        daemon=True)
        self._seq = 0
        self._who = f"{socket.gethostname()} pid {os.getpid()}"

    def start(self) -> HeartbeatWriter:
        self.beat()   # before any worker starts watching it
        self._thread.start()
        return self

    def beat(self) -> None:
        self._seq += 1
        try:
            # Not durable: a beat lost in a crash is what a crash means anyway.
            atomic_write_text(self.path, f"{self._seq} {self._who}\n", durable=False)
        except OSError as error:
            log.warning("controller heartbeat not written (%s): workers may think the "
                        "controller lost", error)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def read_beat(path: Path) -> str | None:
    try:
        with path.open("rb") as handle:
            return handle.read(MAX_BEAT_BYTES).decode("utf-8", "replace")
    except OSError:
        return None


class ControllerWatchThread:
    """A worker's side: reads the heartbeat every beat interval; ``lost`` is set (with
    the reason) once the controller has been silent for ``timeout``; ``on_lost`` is
    called once, on this thread."""

    def __init__(self, path: Path, timeout: float,
                 on_lost: Callable[[str], None] = lambda reason: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.timeout = timeout
        self._clock = clock
        self._on_lost = on_lost
        self._watch = ControllerWatch(timeout, clock())
        self._stop = threading.Event()
        self.lost = threading.Event()
        self.reason = ""
        self._thread = threading.Thread(target=self._run, name="controller-watch", daemon=True)

    def start(self) -> ControllerWatchThread:
        self._thread.start()
        log.info("watching the controller's heartbeat %s (lost after %g s of silence)",
                 self.path, self.timeout)
        return self

    def _run(self) -> None:
        interval = beat_interval(self.timeout)
        # Reads at the same wall-clock instants on every node (clocks agree to far less
        # than a beat), so the replicas all notice in the same round and stop at the
        # same step boundary.
        while not self._stop.wait(interval - time.time() % interval):
            silence = self._watch.observe(read_beat(self.path), self._clock())
            if silence is not None:
                self.reason = silence.describe(self.path)
                self.lost.set()
                log.error("controller lost: %s", self.reason)
                self._on_lost(self.reason)
                return

    def stop(self) -> None:
        self._stop.set()
