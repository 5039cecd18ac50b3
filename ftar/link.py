"""FTAR's data plane on one TCP connection: framed sends, credits, exact receives.

Data flows one way on a connection (left neighbour -> this member); the other
direction carries *credits*: the cumulative number of frames the receiver has
consumed, as 8-byte counters. A sender keeps at most ``window`` frames (each at
most ``chunk_bytes`` of payload) unconsumed by its peer, so the bytes in flight
per connection are bounded by ``window x chunk_bytes`` whatever the kernel
buffers do.

Each ``OutLink`` has one sender thread, so sending overlaps receiving and
reducing in the caller's thread. Sends come straight from the caller's array
(no copy); receives land in preallocated buffers or straight in the array, one
``recv_into(MSG_WAITALL)`` call per piece.

Socket failures surface as ``LinkBroken`` with a ``FailureKind``; the ring turns
them into ``PeerFailedError`` naming the peer, quorum and step.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import queue
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import FailureKind
from .schedule import Transfer

log = logging.getLogger(__name__)

HEADER = struct.Struct("<BBBBIQQIIQ")
FRAME_DATA = 1
FRAME_ABORT = 2   # "member <contributors field> failed (<flags field> = FailureKind code)"
_CREDIT = struct.Struct("<Q")
_PEER_ERRNOS = {errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED, errno.ETIMEDOUT,
                errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ECONNREFUSED,
                errno.ENOTCONN, errno.ESHUTDOWN, errno.EAGAIN}


class LinkBroken(Exception):
    """A connection failed in a way that blames the peer (or a deliberate abort)."""

    def __init__(self, kind: FailureKind, detail: str) -> None:
        self.kind = kind
        self.detail = detail
        super().__init__(f"{kind.value}: {detail}")


class RemoteAbort(LinkBroken):
    """The left neighbour sent an abort notice: ``member`` failed (as it saw it)."""

    def __init__(self, kind: FailureKind, member: int, reporter: int) -> None:
        super().__init__(kind, f"reported by member {reporter}")
        self.member = member


def abort_notice(kind: FailureKind, member: int, op_seq: int) -> bytes:
    """For the data stream (to the right): a header at a frame boundary."""
    return HEADER.pack(FRAME_ABORT, 0, 0, kind.code, member, op_seq, 0, 0, 0, 0)


def credit_abort_notice(kind: FailureKind, member: int) -> bytes:
    """For the credit stream (to the left): a counter with the top bit set."""
    return _CREDIT.pack(_NOTICE_BIT | kind.code << 32 | member)


_NOTICE_BIT = 1 << 63


def classify(exc: OSError) -> LinkBroken | None:
    """The peer failure a socket error means, or None for a local error (EBADF, ENOMEM)."""
    if isinstance(exc, (BlockingIOError, TimeoutError)) or exc.errno == errno.EAGAIN:
        return LinkBroken(FailureKind.TIMEOUT, "no progress within the timeout")
    if isinstance(exc, ConnectionResetError):
        return LinkBroken(FailureKind.RESET, str(exc))
    if isinstance(exc, (BrokenPipeError, ConnectionError)) or exc.errno in _PEER_ERRNOS:
        return LinkBroken(FailureKind.CLOSED, str(exc))
    return None


def peer_error(exc: OSError) -> LinkBroken:
    """``classify`` for callers that re-raise: a local error propagates unchanged."""
    broken = classify(exc)
    if broken is None:
        raise exc
    return broken


@dataclass
class SendItem:
    header: bytes
    payload: memoryview
    transfer: Transfer


@dataclass
class LinkStats:
    frames: int = 0
    payload_bytes: int = 0
    max_inflight_bytes: int = 0


class OutLink:
    """Sends frames to the right neighbour from a dedicated thread, under credits."""

    def __init__(self, sock: socket.socket, window: int, wait_timeout: float, peer_index: int,
                 on_failure: Callable[[Exception, Transfer | None], None], name: str) -> None:
        self.sock = sock
        self.wait_timeout = wait_timeout
        self.peer_index = peer_index
        self.window = window
        self.stats = LinkStats()
        self.progress = 0                       # bumped on every completed frame / credit
        self._on_failure = on_failure
        self._queue: queue.SimpleQueue[SendItem | threading.Event | None] = queue.SimpleQueue()
        self._unacked: collections.deque[int] = collections.deque()
        self._sent = 0                          # frames sent on this connection
        self._acked = 0                         # frames the peer has consumed
        self._credit_buf = bytearray(4096)
        self._credit_carry = b""
        self._failed = False
        self._stopping = False
        self._frame_lock = threading.Lock()     # held while a frame is on its way
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)
        self._thread.start()

    def submit(self, item: SendItem) -> None:
        self._queue.put(item)

    def fence(self) -> threading.Event:
        """An event set once every frame submitted before it is sent (or dropped)."""
        event = threading.Event()
        self._queue.put(event)
        return event

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if self._failed:
                continue  # the ring is broken: queued work is skipped
            try:
                self._await_credit()
                with self._frame_lock:
                    if not self._failed:
                        self._send(item)
            except OSError as exc:
                self._fail(self._notice() or classify(exc) or exc, item.transfer)
            except LinkBroken as exc:
                self._fail(self._notice() or exc, item.transfer)
            except Exception as exc:  # noqa: BLE001 - reported to the ring as local/fatal
                self._fail(exc, item.transfer)

    def _fail(self, exc: Exception, transfer: Transfer | None) -> None:
        self._failed = True
        if not self._stopping:
            self._on_failure(exc, transfer)

    def _send(self, item: SendItem) -> None:
        header, payload = item.header, item.payload
        total = len(header) + len(payload)
        started = time.monotonic()
        sent = self.sock.sendmsg([header, payload])
        while sent < total:  # a partial send: the kernel timed out or was interrupted
            if time.monotonic() - started >= self.wait_timeout:
                raise LinkBroken(FailureKind.TIMEOUT, f"only {sent} of {total} bytes taken")
            started = time.monotonic()
            if sent < len(header):
                sent += self.sock.sendmsg([header[sent:], payload])
            else:
                sent += self.sock.send(payload[sent - len(header):])
        self._sent += 1
        self._unacked.append(len(payload))
        self.stats.frames += 1
        self.stats.payload_bytes += len(payload)
        self.stats.max_inflight_bytes = max(self.stats.max_inflight_bytes, sum(self._unacked))
        self.progress += 1

    def _await_credit(self) -> None:
        while self._sent - self._acked >= self.window:
            n = self.sock.recv_into(self._credit_buf)
            if n == 0:
                raise LinkBroken(FailureKind.CLOSED, "end of stream while waiting for credit")
            self._take_credits(n)
            self.progress += 1

    def _take_credits(self, n: int) -> None:
        data = self._credit_carry + bytes(self._credit_buf[:n])
        whole = len(data) - len(data) % _CREDIT.size
        self._credit_carry = data[whole:]
        for (value,) in _CREDIT.iter_unpack(data[:whole]):
            if value & _NOTICE_BIT:
                raise RemoteAbort(FailureKind.from_code(value >> 32 & 0xFF),
                                  value & 0xFFFFFFFF, self.peer_index)
            while self._acked < value and self._unacked:
                self._unacked.popleft()
                self._acked += 1
            self._acked = max(self._acked, value)

    def _notice(self) -> RemoteAbort | None:
        """After a failure: an abort notice the peer left in the credit stream, if any."""
        try:
            while True:
                n = self.sock.recv_into(self._credit_buf, 0, socket.MSG_DONTWAIT)
                if n == 0:
                    return None
                self._take_credits(n)
        except RemoteAbort as notice:
            return notice
        except OSError:
            return None

    def notify_abort(self, header: bytes, wait: float) -> bool:
        """Put an abort notice in the stream at a frame boundary, if one comes within
        ``wait`` seconds; later frames are dropped. Best effort: False if not sent."""
        if not self._frame_lock.acquire(timeout=wait):
            return False
        try:
            self._failed = True
            return self.sock.send(header, socket.MSG_DONTWAIT) == len(header)
        except OSError:
            return False
        finally:
            self._frame_lock.release()

    def stop(self, linger: float) -> None:
        """Stop the thread and close the socket.

        ``linger`` > 0 (a healthy ring): first let the kernel deliver what is still
        queued, so a slower neighbour can finish the last operation; closing with
        data queued either way would reset the connection and lose it.
        """
        self._stopping = True
        if linger <= 0 or self._failed:
            shutdown_quietly(self.sock)
        self._queue.put(None)
        self._thread.join(timeout=10)
        if linger > 0 and not self._failed:
            _flush(self.sock, linger)
        self.sock.close()


class InLink:
    """Receives frames from the left neighbour and returns credits for them.

    ``wait_timeout``: the kernel's bound on one receive call (SO_RCVTIMEO); a call
    that lasts that long and leaves its frame incomplete means a silent peer.
    """

    def __init__(self, sock: socket.socket, wait_timeout: float, peer_index: int) -> None:
        self.sock = sock
        self.wait_timeout = wait_timeout
        self.peer_index = peer_index
        self.stats = LinkStats()
        self._consumed = 0
        self._credits_refused = False
        self._header = bytearray(HEADER.size)
        self._header_view = memoryview(self._header)

    def recv_header(self) -> tuple[int, ...]:
        self._fill(self._header_view)
        return HEADER.unpack(self._header)

    def recv_exact(self, view: memoryview) -> None:
        """Fill ``view`` with payload; each kernel call waits at most the socket timeout."""
        self._fill(view)
        self.stats.payload_bytes += len(view)

    def _fill(self, view: memoryview) -> None:
        size = len(view)
        got = 0
        while got < size:
            started = time.monotonic()
            try:
                n = self.sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            except OSError as exc:
                raise peer_error(exc) from exc
            if n == 0:
                raise LinkBroken(FailureKind.CLOSED, f"end of stream after {got} of {size} "
                                 "bytes")
            got += n
            if got < size and time.monotonic() - started >= self.wait_timeout:
                # the kernel wait ran out with the frame incomplete (not a signal): silent
                raise LinkBroken(FailureKind.TIMEOUT, f"only {got} of {size} bytes arrived")

    def credit(self) -> None:
        """Tell the sender one more frame is consumed (its buffer may be reused)."""
        self._consumed += 1
        self.stats.frames += 1
        if self._credits_refused:
            return
        try:
            self.sock.sendall(_CREDIT.pack(self._consumed))
        except OSError as exc:
            # A neighbour that finished the operation first may already have closed the
            # connection: the frames it sent are still readable here, so this alone is
            # no failure. A dead neighbour shows on the next receive (or its notice does).
            if classify(exc) is None:
                raise
            self._credits_refused = True
            notice = self._notice()
            if notice is not None:
                raise notice from exc

    def _notice(self) -> RemoteAbort | None:
        """An abort notice waiting at the head of the stream (peeked, not consumed)."""
        try:
            n = self.sock.recv_into(self._header_view, HEADER.size,
                                    socket.MSG_DONTWAIT | socket.MSG_PEEK)
        except OSError:
            return None
        if n < HEADER.size:
            return None
        kind, _op, _dtype, code, member, *_rest = HEADER.unpack(self._header)
        if kind != FRAME_ABORT:
            return None
        return RemoteAbort(FailureKind.from_code(code), member, self.peer_index)

    def notify_abort(self, notice: bytes) -> None:
        """Best effort: tell the left neighbour's sender who failed. Safe beside
        ``credit`` on another thread: both write 8 bytes, which the kernel keeps whole."""
        try:
            self.sock.send(notice, socket.MSG_DONTWAIT)
        except OSError:
            pass

    def close(self) -> None:
        shutdown_quietly(self.sock)
        self.sock.close()


def _flush(sock: socket.socket, linger: float) -> None:
    """Wait (at most ``linger`` s) until the peer has every queued byte, reading and
    dropping what it sends meanwhile (unread input would make close() reset)."""
    deadline = time.monotonic() + linger
    try:
        sock.shutdown(socket.SHUT_WR)
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], 0.005)
            if readable and not sock.recv(65536, socket.MSG_DONTWAIT):
                return    # the peer closed too: nothing more can be delivered
            queued = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ,
                                                     b"\0\0\0\0"))[0]
            if queued == 0:
                return
    except OSError:
        return


def shutdown_quietly(sock: socket.socket) -> None:
    """Wake every thread blocked on ``sock``; the peer sees end of stream."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
