"""FTAR's control plane on raw TCP: listener, authenticated handshake, socket tuning.

Every data connection opens with a handshake that proves both ends know the job
secret and names the quorum it belongs to::

    client -> HELLO    (quorum id, from/to member index, socket index, plan
                        parameters, client nonce)
    server -> CHALLENGE(server nonce)
    client -> PROOF    HMAC(secret, "ftar-client", HELLO, server nonce)
    server -> VERDICT  (code, server quorum id,
                        HMAC(secret, "ftar-server", HELLO, server nonce, code, quorum))

Both nonces make a recorded handshake useless for a replay. The server judges the
HELLO only after the proof checks out, so a peer without the secret learns nothing
but a refusal; a peer from an older quorum is refused as stale. Every handshake
must finish within ``connect_timeout`` in all (a deadline, not a per-read
timeout, so a peer trickling a byte at a time cannot hold a thread), and at
most ``MAX_PENDING_HANDSHAKES`` run at once (more are closed at once, and the
client retries within its own deadline). After the
handshake the socket carries data frames only; ZeroMQ is kept for the quorum's
control messages because it is slower on large frames (measurements:
benchmarks/results/measurements.md#ftar-raw-sockets).
"""

from __future__ import annotations

import enum
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ft_launch.ids import sign, verify
from ft_launch.logs import log_sampled

from .errors import AuthenticationError, FtarUsageError, StaleQuorumError

log = logging.getLogger(__name__)

MAGIC = b"FTAR"
VERSION = 1
NONCE_BYTES = 16
_HELLO = struct.Struct("<4sHHQIIHHQI16s")
_CHALLENGE = struct.Struct("<4sH16s")
_PROOF = struct.Struct("<32s")
_VERDICT = struct.Struct("<4sBQ32s")
_TIMEVAL = struct.Struct("@ll")
#: Handshakes one listener runs at once (a thread each). A member legitimately
#: gets ``sockets_per_peer`` connections from its left neighbour plus the odd
#: member-lost notice; the cap bounds the threads a flood of idle connections
#: can hold, each for at most ``connect_timeout``.
MAX_PENDING_HANDSHAKES = 64

Address = tuple[str, int]


class Purpose(enum.IntEnum):
    """Why a client connects (wire codes: do not renumber)."""

    RING = 0          # a data connection to its right neighbour
    MEMBER_LOST = 1   # a notice: member ``to_index`` of the ring of ``quorum_id`` is lost


class Verdict(enum.IntEnum):
    """The server's answer to a HELLO (wire codes: do not renumber)."""

    ACCEPTED = 0
    BAD_SECRET = 1
    STALE_QUORUM = 2
    UNEXPECTED = 3        # not this member's left neighbour in that quorum
    CONFIG_MISMATCH = 4   # chunk size / chunks in flight / sockets per peer differ
    CLOSING = 5


@dataclass(frozen=True)
class Hello:
    """Who is connecting, for which quorum and ring position, with which plan
    (``purpose`` MEMBER_LOST: a notice naming the lost member in ``to_index``)."""

    quorum_id: int
    from_index: int
    to_index: int
    socket_index: int
    sockets: int
    chunk_bytes: int
    chunks_in_flight: int
    purpose: Purpose = Purpose.RING

    def pack(self, nonce: bytes) -> bytes:
        return _HELLO.pack(MAGIC, VERSION, self.purpose, self.quorum_id, self.from_index,
                           self.to_index, self.socket_index, self.sockets,
                           self.chunk_bytes, self.chunks_in_flight, nonce)

    @staticmethod
    def unpack(data: bytes) -> Hello:
        (magic, version, purpose, quorum_id, from_index, to_index, socket_index, sockets,
         chunk_bytes, chunks_in_flight, _nonce) = _HELLO.unpack(data)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not an FTAR v{VERSION} hello (magic {magic!r}, "
                             f"version {version})")
        return Hello(quorum_id, from_index, to_index, socket_index, sockets, chunk_bytes,
                     chunks_in_flight, Purpose(purpose))


Judge = Callable[[Hello], tuple[Verdict, int]]
Deliver = Callable[[Hello, socket.socket], None]


class PeerClosedEarly(ConnectionError):
    """The listener closed before its challenge: at its handshake cap (or not FTAR)."""


def recv_exact(sock: socket.socket, size: int, deadline: float) -> bytes:
    """Read exactly ``size`` bytes by ``deadline`` (``time.monotonic``), however
    the peer splits them; EOF is an error."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        _wait_at_most_until(sock, deadline)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {size} bytes")
        got += n
    return bytes(buffer)


def _wait_at_most_until(sock: socket.socket, deadline: float) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the handshake did not finish within its deadline")
    sock.settimeout(remaining)


def _send_by(sock: socket.socket, data: bytes, deadline: float) -> None:
    _wait_at_most_until(sock, deadline)
    sock.sendall(data)


def tune_data_socket(sock: socket.socket, timeout: float, buffer_bytes: int) -> None:
    """Blocking socket whose waits the kernel bounds (SO_RCVTIMEO / SO_SNDTIMEO).

    Kernel timeouts let ``recv_into(..., MSG_WAITALL)`` fill a whole chunk in one
    call, where Python-level timeouts would poll before every partial read.
    ``buffer_bytes`` 0 keeps the kernel's autotuned buffers.
    """
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    seconds = int(timeout)
    timeval = _TIMEVAL.pack(seconds, int((timeout - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    if buffer_bytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


def _server_proof(secret: str, hello_bytes: bytes, nonce: bytes, code: int,
                  quorum_id: int) -> bytes:
    return sign(secret, b"ftar-server", hello_bytes, nonce, bytes([code]),
                quorum_id.to_bytes(8, "little"))


def client_handshake(sock: socket.socket, secret: str, hello: Hello, peer: str,
                     deadline: float) -> None:
    """Run the client side on a connected socket by ``deadline``; raise if the
    server refuses (``PeerClosedEarly`` if it closed before its challenge)."""
    hello_bytes = hello.pack(secrets.token_bytes(NONCE_BYTES))
    try:
        _send_by(sock, hello_bytes, deadline)
        challenge = recv_exact(sock, _CHALLENGE.size, deadline)
    except ConnectionError as exc:  # EOF, or a reset if our hello was still unread
        raise PeerClosedEarly(f"the listener closed before its challenge ({exc}): busy, "
                              f"or not an FTAR v{VERSION} listener") from exc
    magic, _version, nonce = _CHALLENGE.unpack(challenge)
    if magic != MAGIC:
        raise AuthenticationError("the peer is not an FTAR endpoint", peer_address=peer,
                                  quorum_id=hello.quorum_id)
    _send_by(sock, _PROOF.pack(sign(secret, b"ftar-client", hello_bytes, nonce)), deadline)
    magic, code, server_quorum, proof = _VERDICT.unpack(
        recv_exact(sock, _VERDICT.size, deadline))
    if magic != MAGIC or not verify(secret, proof, b"ftar-server", hello_bytes, nonce,
                                    bytes([code]), server_quorum.to_bytes(8, "little")):
        raise AuthenticationError("the peer did not prove the job secret, or refused ours",
                                  peer_address=peer, quorum_id=hello.quorum_id)
    _raise_for_verdict(Verdict(code), hello, server_quorum, peer)


def _raise_for_verdict(verdict: Verdict, hello: Hello, server_quorum: int,
                       peer: str) -> None:
    if verdict is Verdict.ACCEPTED:
        return
    if verdict is Verdict.STALE_QUORUM:
        raise StaleQuorumError(quorum_id=hello.quorum_id, peer_quorum_id=server_quorum,
                               peer_address=peer)
    if verdict is Verdict.CONFIG_MISMATCH:
        raise FtarUsageError(
            f"FTAR peer {peer} runs another ring configuration than this member "
            f"(chunk_bytes={hello.chunk_bytes}, chunks_in_flight={hello.chunks_in_flight}, "
            f"sockets_per_peer={hello.sockets}); every member needs the same [ftar] config",
            quorum_id=hello.quorum_id)
    # UNEXPECTED / CLOSING: the peer does not (or no longer) expect us; a new quorum helps.
    raise StaleQuorumError(quorum_id=hello.quorum_id, peer_quorum_id=server_quorum,
                           peer_address=f"{peer} ({verdict.name.lower()})")


Refusal = Callable[[Verdict, Hello, int], None]


def server_handshake(sock: socket.socket, secret: str, judge: Judge, deadline: float,
                     on_refusal: Refusal = lambda verdict, hello, current: None
                     ) -> Hello | None:
    """Run the server side by ``deadline``; the authenticated, accepted Hello, or
    None if refused (``on_refusal(verdict, hello, current quorum)`` runs before
    the refusal is sent)."""
    hello_bytes = recv_exact(sock, _HELLO.size, deadline)
    hello = Hello.unpack(hello_bytes)
    nonce = secrets.token_bytes(NONCE_BYTES)
    _send_by(sock, _CHALLENGE.pack(MAGIC, VERSION, nonce), deadline)
    (proof,) = _PROOF.unpack(recv_exact(sock, _PROOF.size, deadline))
    if verify(secret, proof, b"ftar-client", hello_bytes, nonce):
        verdict, current = judge(hello)
    else:
        verdict, current = Verdict.BAD_SECRET, 0
    if verdict is not Verdict.ACCEPTED:
        on_refusal(verdict, hello, current)
    _send_by(sock, _VERDICT.pack(MAGIC, verdict, current,
                                _server_proof(secret, hello_bytes, nonce, verdict, current)),
            deadline)
    return hello if verdict is Verdict.ACCEPTED else None


def connect(address: Address, secret: str, hello: Hello, connect_timeout: float) -> socket.socket:
    """Connect and handshake within ``connect_timeout``, retrying refused connects
    and listeners that close at once (at their handshake cap)."""
    deadline = time.monotonic() + connect_timeout
    peer = f"{address[0]}:{address[1]}"
    delay = 0.01
    while True:
        remaining = deadline - time.monotonic()
        try:
            sock = socket.create_connection(address, timeout=max(remaining, 0.001))
        except (ConnectionRefusedError, TimeoutError, OSError) as exc:
            if time.monotonic() + delay >= deadline:
                raise ConnectionError(f"cannot connect to {peer} within "
                                      f"{connect_timeout:g} s: {exc}") from exc
            time.sleep(delay)  # back-off between connect attempts, not synchronisation
            delay = min(delay * 2, 0.5)
            continue
        try:
            client_handshake(sock, secret, hello, peer, deadline)
            return sock
        except PeerClosedEarly as exc:
            sock.close()
            if time.monotonic() + delay >= deadline:
                raise ConnectionError(f"cannot connect to {peer} within "
                                      f"{connect_timeout:g} s: {exc}") from exc
            time.sleep(delay)  # back-off before trying a busy listener again
            delay = min(delay * 2, 0.5)
        except BaseException:
            sock.close()
            raise


class Listener:
    """Accepts connections on ``host``:0 from construction; hands accepted ones over.

    Each handshake runs on its own short-lived thread so a slow or hostile client
    cannot hold up others; ``connect_timeout`` bounds each in all, and at most
    ``max_pending`` run at once: a connection beyond them is closed at once.
    Failures and refusals are counted in ``rejections`` and logged sampled.
    """

    def __init__(self, host: str, secret: str, judge: Judge, deliver: Deliver,
                 connect_timeout: float, max_pending: int = MAX_PENDING_HANDSHAKES) -> None:
        self._secret = secret
        self._judge = judge
        self._deliver = deliver
        self._connect_timeout = connect_timeout
        self._max_pending = max_pending
        self._pending = 0
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address: Address = (host, self._sock.getsockname()[1])
        #: Connections not handed over, by why: "failed" (broken or too slow a
        #: handshake), "busy" (over the cap), or the refusing ``Verdict``'s name.
        self.rejections: dict[str, int] = {}
        self._count_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"ftar-listen-{self.address[1]}")
        self._thread.start()

    @property
    def refused(self) -> int:
        """Connections not handed over (failed, refused or turned away)."""
        with self._count_lock:
            return sum(self.rejections.values())

    @property
    def pending(self) -> int:
        """Handshakes running now."""
        with self._count_lock:
            return self._pending

    def _start_pending(self) -> bool:
        with self._count_lock:
            if self._pending >= self._max_pending:
                return False
            self._pending += 1
            return True

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, peer = self._sock.accept()
            except OSError:
                return  # closed
            name = f"{peer[0]}:{peer[1]}"
            if not self._start_pending():
                self._count("busy", "FTAR turned away a connection from %s: %d handshakes "
                            "already pending", name, self._max_pending)
                sock.close()
                continue
            deadline = time.monotonic() + self._connect_timeout
            threading.Thread(target=self._handshake, args=(sock, name, deadline),
                             daemon=True, name="ftar-handshake").start()

    def _handshake(self, sock: socket.socket, peer: str, deadline: float) -> None:
        try:
            hello = server_handshake(
                sock, self._secret, self._judge, deadline,
                lambda verdict, claimed, current: self._refused(peer, verdict, claimed, current))
        except (OSError, ValueError, struct.error) as exc:
            self._count("failed", "FTAR handshake from %s failed: %s", peer, exc)
            hello = None
        finally:
            with self._count_lock:
                self._pending -= 1
        if hello is None:
            sock.close()
            return
        self._deliver(hello, sock)

    def _refused(self, peer: str, verdict: Verdict, hello: Hello, current: int) -> None:
        if verdict is Verdict.BAD_SECRET:
            self._count(verdict.name, "FTAR refused a connection from %s: it failed the "
                        "job-secret check", peer)
        else:
            self._count(verdict.name, "FTAR refused a connection from %s: %s (it claims "
                        "quorum %d member %d; this member is in quorum %d)", peer,
                        verdict.name, hello.quorum_id, hello.from_index, current)

    def _count(self, reason: str, msg: str, *args: object) -> None:
        with self._count_lock:
            count = self.rejections[reason] = self.rejections.get(reason, 0) + 1
        log_sampled(log, count, msg, *args)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)
