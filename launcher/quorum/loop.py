"""One thread that drives any number of quorum agents: sockets, timers, calls.

A replica runs one agent on its own loop. The benchmark hosts hundreds of
agents per loop so that 1,000 members fit on a small machine; nothing in an
agent depends on how many others share its loop. The loop's one SUB socket
(``feed``) takes each leader broadcast once and hands it to its agents.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import os
import selectors
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

import zmq

from ft_launch.logs import log_sampled

from .feed import FeedReader
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


#: A DEALER only sends; what a peer sends back to it is never read.
_DEALER_MAX_RECEIVE = 4096
#: Messages a DEALER queues while its peer is slow or unreachable (then new
#: ones are dropped): a round's joins of every agent the loop hosts fit.
_DEALER_SNDHWM = 1000


#: Small messages to one address taken in one pass of the loop leave as one
#: frame of at most this size (any receiver accepts far larger: ``wire``).
BATCH_BYTES = 64 * 1024
_ENTRY = struct.Struct("!I")
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.NOBLOCK | zmq.SNDMORE)


class Connections:
    """The loop's DEALER sockets, one per peer address, shared by the agents it
    hosts (loop thread only): 333 agents of one process sending their joins to
    one leader use one TCP connection, as one replica's process does, rather
    than 333 (each a wake-up of ZeroMQ's I/O threads at both ends). Receivers
    never look at the connection a message came on, only at its signed header.

    Small messages (``post``) wait for the end of the loop's pass and leave
    together: one message of two frames ``[data, mac]`` alone, or several as
    one *batch* frame of ``(length, data, mac)`` entries (``split_batch``), each
    still signed and checked on its own. Order per address is kept."""

    def __init__(self, context: zmq.Context[Any]) -> None:
        self._context = context
        self._open: dict[str, tuple[zmq.Socket[Any], int]] = {}
        #: Per address: queued (data, mac, the sender's counters) and their bytes.
        self._queued: dict[str, list[tuple[bytes, bytes, dict[str, int]]]] = {}
        self._queued_bytes: dict[str, int] = {}

    def post(self, address: str, data: bytes, mac: bytes, counts: dict[str, int]) -> None:
        """Queue a small message for ``address`` (an acquired socket's)."""
        size = _ENTRY.size + len(data) + len(mac)
        if self._queued_bytes.get(address, 0) + size > BATCH_BYTES:
            self._flush(address)
        self._queued.setdefault(address, []).append((data, mac, counts))
        self._queued_bytes[address] = self._queued_bytes.get(address, 0) + size

    def send_now(self, address: str, frames: tuple[Any, bytes], copy: bool,
                 counts: dict[str, int]) -> None:
        """Send at once (a large message), after what is queued for ``address``."""
        self._flush(address)
        sock = self._open[address][0]
        try:
            sock.send(frames[0], _MORE, copy=copy)
            sock.send(frames[1], _NOBLOCK)
            counts["sent"] += 1
        except zmq.Again:
            counts["dropped_full"] += 1

    def flush(self) -> None:
        for address in list(self._queued):
            self._flush(address)

    def _flush(self, address: str) -> None:
        queued = self._queued.pop(address, None)
        self._queued_bytes.pop(address, None)
        if not queued:
            return
        sock = self._open[address][0]
        try:
            if len(queued) == 1:
                sock.send(queued[0][0], _MORE)
                sock.send(queued[0][1], _NOBLOCK)
            else:
                sock.send(b"".join(part for data, mac, _ in queued
                                   for part in (_ENTRY.pack(len(data)), data, mac)), _NOBLOCK)
            outcome = "sent"
        except zmq.Again:
            outcome = "dropped_full"
        for _, _, counts in queued:
            counts[outcome] += 1

    def acquire(self, address: str) -> zmq.Socket[Any]:
        """The socket to ``address`` (raises ``zmq.ZMQError`` when out of sockets)."""
        found = self._open.get(address)
        if found is not None:
            self._open[address] = (found[0], found[1] + 1)
            return found[0]
        sock = self._context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, _DEALER_SNDHWM)
            sock.setsockopt(zmq.MAXMSGSIZE, _DEALER_MAX_RECEIVE)
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.connect(address)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._open[address] = (sock, 1)
        return sock

    def release(self, address: str) -> None:
        found = self._open.get(address)
        if found is None:
            return
        if found[1] > 1:
            self._open[address] = (found[0], found[1] - 1)
            return
        self._flush(address)
        del self._open[address]
        found[0].close(linger=0)

    def __len__(self) -> int:
        return len(self._open)

    def close(self) -> None:
        for sock, _ in self._open.values():
            sock.close(linger=0)
        self._open.clear()
        self._queued.clear()
        self._queued_bytes.clear()


def split_batch(frame: bytes, mac_bytes: int) -> list[list[bytes]]:
    """The ``[data, mac]`` messages of a batch frame; ``ValueError`` if malformed."""
    messages, offset, end = [], 0, len(frame)
    while offset < end:
        if offset + _ENTRY.size > end:
            raise ValueError("a batch entry cut short in its length")
        (size,) = _ENTRY.unpack_from(frame, offset)
        start = offset + _ENTRY.size
        offset = start + size + mac_bytes
        if offset > end:
            raise ValueError(f"a batch entry of {size} bytes runs past the frame")
        messages.append([frame[start:start + size], frame[start + size:offset]])
    return messages


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
        self._feed: FeedReader | None = None
        #: Sending sockets shared by the agents of this loop (loop thread only).
        self.connections = Connections(self.context)
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
    @property
    def feed(self) -> FeedReader:
        """The loop's one SUB socket for the leaders' feeds (``feed``)."""
        if self._feed is None:
            self._feed = FeedReader(self.context, self._guarded)
            self.add(self._feed)
        return self._feed

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
                self.connections.flush()
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

    def _guarded(self, node: Any, step: Callable[..., bool | None], *args: Any) -> bool:
        """Run one step of one node. A bug that raises there is logged with its
        traceback and the input dropped (the core is pure, so the node's state
        is as before); the other agents on this loop keep going. Sampled: input
        that trips the bug again and again must not flood the log."""
        try:
            return bool(step(*args))
        except Exception:  # noqa: BLE001 - one node's bug must not stop the loop's others
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
        self.connections.close()
        if self._feed is not None:
            self.remove(self._feed)
            self._feed.close()
        self._selector.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.context.destroy(linger=0)
