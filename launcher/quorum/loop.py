"""One thread that drives any number of quorum agents: sockets, timers, calls.

A replica runs one agent on its own loop. The benchmark hosts hundreds of
agents per loop so that 1,000 members fit on a small machine; nothing in an
agent depends on how many others share its loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import selectors
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import zmq

from ftcore.logs import log_sampled

from .wire import Codec

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Enough sockets for a leader with a DEALER to each of 1,000+ members.
_MAX_SOCKETS = 16384


class Hosted(Protocol):
    """What the loop needs from an agent's node."""

    socket: zmq.Socket[Any]

    def on_readable(self, now: float, wall: float) -> bool:
        """Take waiting messages; True if it stopped early and more may wait."""
        ...

    def on_timer(self, now: float) -> None: ...

    def deadline(self, now: float) -> float: ...


class AgentLoop:
    def __init__(self, name: str = "quorum-loop") -> None:
        self.name = name
        self.context: zmq.Context[Any] = zmq.Context()
        self.context.set(zmq.MAX_SOCKETS, _MAX_SOCKETS)
        # epoll on each socket's ZMQ_FD rather than zmq_poll: zmq_poll costs
        # O(sockets) per wake-up (0.2 ms with 333 hosted agents), epoll costs
        # O(sockets with news). ZMQ_FD is edge-triggered, so a signalled node
        # stays in ``_ready`` until a read finds its socket empty.
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque[Callable[[], None]] = deque()
        self._hosted: dict[Hosted, int] = {}
        self._ready: dict[Hosted, None] = {}
        self._timers: list[tuple[float, int, Hosted]] = []
        self._scheduled: dict[int, float] = {}
        self._order = itertools.count()
        self._codecs: dict[tuple[str, str], Codec] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failed_steps = 0

    # ------------------------------------------------------------------ any thread
    def start(self) -> AgentLoop:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            self._stopping = True
            self._wake()
            thread.join(timeout)
            if thread.is_alive():
                log.warning("%s did not stop within %.1fs", self.name, timeout)
                return
        self._close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the loop thread (thread safe)."""
        self._calls.append(fn)
        if threading.current_thread() is not self._thread:
            self._wake()  # the loop itself looks at its calls before it waits

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn`` on the loop thread and wait for its result."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future[T] = Future()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, not swallowed
                future.set_exception(exc)

        self.call_soon(run)
        return future.result(timeout)

    def codec(self, secret: str, job_id: str) -> Codec:
        """A codec shared by the agents of one job on this loop."""
        key = (secret, job_id)
        codec = self._codecs.get(key)
        if codec is None:
            codec = self._codecs[key] = Codec(secret, job_id)
        return codec

    # ------------------------------------------------------------------ loop thread
    def add(self, node: Hosted) -> None:
        fd = int(node.socket.getsockopt(zmq.FD))
        self._hosted[node] = fd
        self._selector.register(fd, selectors.EVENT_READ, node)
        self._ready[node] = None  # messages may have queued before it was added
        self.schedule(node, time.monotonic())

    def remove(self, node: Hosted) -> None:
        fd = self._hosted.pop(node, None)
        if fd is not None:
            self._selector.unregister(fd)
        self._ready.pop(node, None)
        self._scheduled.pop(id(node), None)

    def schedule(self, node: Hosted, when: float) -> None:
        """Make sure ``node.on_timer`` runs at ``when`` (the latest request wins)."""
        key = id(node)
        if self._scheduled.get(key) == when or node not in self._hosted:
            return
        self._scheduled[key] = when
        if math.isfinite(when):
            heapq.heappush(self._timers, (when, next(self._order), node))

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._selector.select(self._select_timeout()):
                    if key.data is None:
                        self._drain_wake()
                    else:
                        self._ready[key.data] = None
                self._run_calls()
                now, wall = time.monotonic(), time.time()
                for node in list(self._ready):
                    if not self._guarded(node, node.on_readable, now, wall):
                        self._ready.pop(node, None)
                self._run_timers()
        except Exception:
            log.exception("%s crashed", self.name)
            raise

    def _select_timeout(self) -> float:
        if self._calls or self._ready:
            return 0.0
        if not self._timers:
            return 1.0
        return max(0.0, min(1.0, self._timers[0][0] - time.monotonic()))

    def _run_calls(self) -> None:
        while self._calls:
            fn = self._calls.popleft()
            try:
                fn()
            except Exception:
                log.exception("call on %s failed", self.name)

    def _run_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            when, _, node = heapq.heappop(self._timers)
            if self._scheduled.get(id(node)) != when:
                continue  # superseded by a later schedule
            del self._scheduled[id(node)]
            self._guarded(node, node.on_timer, now)

    def _guarded(self, node: Hosted, step: Callable[..., bool | None], *args: float) -> bool:
        """Run one step of one node. A bug that raises there is logged with its
        traceback and the input dropped (the core is pure, so the node's state
        is as before); the other agents on this loop keep going. Sampled: input
        that trips the bug again and again must not flood the log."""
        try:
            return bool(step(*args))
        except Exception:
            self.failed_steps += 1
            log_sampled(log, self.failed_steps, "%s: quorum node %r failed; input dropped",
                        self.name, node, level=logging.ERROR, exc_info=True)
            return False

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full, so the loop is already going to wake up
        except OSError:
            pass  # closed: the loop has stopped

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _close(self) -> None:
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.context.destroy(linger=0)
