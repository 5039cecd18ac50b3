"""HTTP server of a rank's committed state (catch-up) and of the backups it holds.

Thin shell over ``wire`` (routes, auth) and the dual buffers. A GET streams
the leased snapshot buffer straight from memory with large ``sendall`` calls;
no serialisation, no copy. While a request reads a snapshot it holds a lease,
so the snapshotter skips (never tears) that buffer.

Anything can connect, so nothing a client does may hold the server: the request
line and headers must arrive within ``header_timeout`` in all (not per read: a
byte every second would otherwise hold a thread forever), a body must keep an
average of ``MIN_BODY_RATE``, at most ``max_connections`` are served at once
(the rest get 503 at once), and the listen backlog absorbs bursts of connects.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import logging
import math
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

from ft_launch.config import CkptConfig

from .backup import BackupStore
from .dual import LeaseProvider, Snapshot
from .errors import CheckpointCorruptError, NoCheckpointError
from .manifest import Manifest
from .wire import (
    AUTH_HEADER,
    AUTH_WINDOW,
    BODY_DIGEST_HEADER,
    MANIFEST_BYTES_HEADER,
    MAX_MANIFEST_BYTES,
    AuthVerdict,
    BodyClaim,
    NonceCache,
    Route,
    RouteError,
    RouteKind,
    check_token,
    parse_body_claim,
    parse_range,
    parse_target,
)

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()

#: Bytes per ``sendall``: large enough to run at socket speed, small enough that
#: the io timeout measures progress rather than the whole transfer.
SEND_CHUNK = 32 << 20
#: Bytes per ``readinto`` of a pushed backup, each hashed as it arrives.
RECEIVE_CHUNK = 8 << 20
#: Request line and headers are < 1 KiB and leave in one packet; this is generous.
HEADER_TIMEOUT = 10.0
#: A body slower than this on average is cut (any real link is 100x faster).
MIN_BODY_RATE = 1 << 20
MAX_CONNECTIONS = 128
#: The kernel caps it at net.core.somaxconn (4096 on current kernels); a small backlog
#: drops a burst's SYNs and its clients wait out TCP's retries (measurements:
#: benchmarks/results/measurements.md#state-server-backlog).
LISTEN_BACKLOG = 1024
#: A refusal is logged the first time and every this many times after, not each time.
LOG_EVERY = 1000
_BUSY = b"busy: too many connections; try again"
_BUSY_REPLY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
               b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY), _BUSY))


class _DeadlineReader(io.RawIOBase):
    """Socket reads that all end by one deadline, each also within ``io_timeout``."""

    def __init__(self, sock: socket.socket, io_timeout: float) -> None:
        super().__init__()
        self._sock = sock
        self._io_timeout = io_timeout
        self.deadline = math.inf  # time.monotonic() by which the current phase must end

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("request deadline passed")
        self._sock.settimeout(min(self._io_timeout, left))
        try:
            return self._sock.recv_into(buffer)
        finally:
            self._sock.settimeout(self._io_timeout)  # writes keep the io timeout


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    app: StateServer

    def __init__(self, address: tuple[str, int], max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.app.refuse("connection cap reached", client_address[0])
            request.setblocking(False)  # the accept loop must never wait on a client
            with contextlib.suppress(OSError):
                request.send(_BUSY_REPLY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver would print a traceback to stderr; one line in the log instead.
        log.warning("state server: request from %s failed: %r", client_address[0],
                    sys.exc_info()[1])
        log.debug("state server failure", exc_info=True)


class StateServer:
    """Serves ``snapshots`` (and ``backups`` if given) to holders of ``secret``."""

    def __init__(self, *, secret: str, host: str, snapshots: LeaseProvider,
                 backups: BackupStore | None = None, port: int = _DEFAULTS.serve_port,
                 max_wait: float = _DEFAULTS.fetch_timeout,
                 io_timeout: float = _DEFAULTS.fetch_timeout,
                 header_timeout: float | None = None,
                 max_connections: int = MAX_CONNECTIONS,
                 auth_window: float = AUTH_WINDOW,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.snapshots = snapshots
        self.backups = backups
        self.max_wait = max_wait
        self.io_timeout = io_timeout
        self.header_timeout = (min(io_timeout, HEADER_TIMEOUT) if header_timeout is None
                               else header_timeout)
        self.auth_window = auth_window
        self.nonces = NonceCache()
        self.clock = clock
        #: Refused requests by reason (counters for the status view and tests).
        self.refusals: collections.Counter[str] = collections.Counter()
        self._refusals_lock = threading.Lock()
        self._http = _HttpServer((host, port), max_connections)
        self._http.app = self
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._http.server_address[:2]
        return str(host), int(port)

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._http.serve_forever, kwargs={
            "poll_interval": 0.2}, name=f"ckpt-serve-{self.address[1]}", daemon=True)
        self._thread.start()
        log.info("serving state on %s:%d", *self.address)
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._http.shutdown()
            self._thread.join(timeout=5.0)
        self._http.server_close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def source_for(self, route: Route) -> LeaseProvider:
        if route.kind in (RouteKind.STATE_MANIFEST, RouteKind.STATE_DATA):
            return self.snapshots
        if self.backups is None or route.rank is None:
            raise NoCheckpointError("this rank holds no backups")
        return self.backups.buffers(route.rank)

    def refuse(self, reason: str, client: str) -> None:
        """Count a refused request; log it the first time and every ``LOG_EVERY``."""
        with self._refusals_lock:
            self.refusals[reason] += 1
            count = self.refusals[reason]
        if count == 1 or count % LOG_EVERY == 0:
            log.warning("state server %s:%d refused a request from %s (%s; %d so far)",
                        *self.address, client, reason, count)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        app = self.server.app
        self.connection.settimeout(app.io_timeout)
        self.rfile.close()  # reads go through the deadline instead
        self._reader = _DeadlineReader(self.connection, app.io_timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        self._reader.deadline = time.monotonic() + self.server.app.header_timeout
        super().handle_one_request()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        self._reader.deadline = math.inf  # headers are in; a body sets its own deadline
        app = self.server.app
        verdict, claim = self._authenticate(app, method)
        if verdict is not AuthVerdict.OK:
            app.refuse(verdict.value, self.client_address[0])
            self._reply_text(503 if verdict is AuthVerdict.FLOODED else 403,
                             f"refused: {verdict.value}")
            return
        try:
            route = parse_target(method, self.path)
        except RouteError as exc:
            self._reply_text(exc.status, str(exc))
            return
        try:
            self._serve(app, route, claim)
        except NoCheckpointError as exc:
            self._reply_text(404 if route.step is None else 410, str(exc))
        except CheckpointCorruptError as exc:
            app.refuse("bad backup", self.client_address[0])
            self._reply_text(400, str(exc))
        except (ConnectionError, TimeoutError) as exc:
            log.warning("%s to %s aborted: %r", route.kind.value, self.client_address[0], exc)
            self.close_connection = True

    def _authenticate(self, app: StateServer, method: str) -> tuple[AuthVerdict, BodyClaim]:
        headers = {name: value for name in ("Content-Length", MANIFEST_BYTES_HEADER,
                                            BODY_DIGEST_HEADER)
                   if (value := self.headers.get(name)) is not None}
        try:
            claim = parse_body_claim(method, headers)
        except ValueError:
            return AuthVerdict.MALFORMED, BodyClaim()
        return check_token(app.secret, method, self.path, self.headers.get(AUTH_HEADER),
                           app.clock(), body=claim, window=app.auth_window,
                           seen=app.nonces), claim

    def _serve(self, app: StateServer, route: Route, claim: BodyClaim) -> None:
        if route.kind is RouteKind.BACKUP_PUT:
            self._receive_backup(app, route, claim)
            return
        source = app.source_for(route)
        wait = min(route.wait, app.max_wait)
        # A manifest always leaves with its checksums (computed now if this is the
        # snapshot's first use); the data that follows it needs none.
        manifest_route = route.kind in (RouteKind.STATE_MANIFEST, RouteKind.BACKUP_MANIFEST)
        with source.lease(route.step, wait, checksums=manifest_route) as snap:
            if manifest_route:
                self._reply_bytes(200, snap.manifest.to_json().encode(), "application/json")
            else:
                self._send_data(snap)

    def _send_data(self, snap: Snapshot) -> None:
        total = snap.manifest.total_bytes
        try:
            start, end = parse_range(self.headers.get("Range"), total)
        except ValueError as exc:
            self._reply_text(416, str(exc))
            return
        self.send_response(200 if (start, end) == (0, total) else 206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("X-Ftl-Step", str(snap.step))
        if (start, end) != (0, total):
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{total}")
        self.end_headers()
        for piece in _pieces(snap.buffer.data[start:end]):
            self.wfile.write(piece)

    def _receive_backup(self, app: StateServer, route: Route, claim: BodyClaim) -> None:
        """Everything the signed claim and the manifest say is checked before allocating."""
        if app.backups is None or route.rank is None:
            raise NoCheckpointError("this rank does not hold backups")
        app.backups.check(route.rank)
        if not 0 < claim.manifest_bytes <= min(MAX_MANIFEST_BYTES, claim.length):
            raise CheckpointCorruptError(
                f"{MANIFEST_BYTES_HEADER} {claim.manifest_bytes} must be from 1 to "
                f"min({MAX_MANIFEST_BYTES}, Content-Length {claim.length})")
        self._reader.deadline = time.monotonic() + app.io_timeout + claim.length / MIN_BODY_RATE
        raw = self.rfile.read(claim.manifest_bytes)
        if hashlib.sha256(raw).hexdigest() != claim.manifest_sha256:
            raise CheckpointCorruptError(f"backup manifest of rank {route.rank} "
                                         f"({len(raw)} bytes) does not match its signed digest")
        manifest = Manifest.from_json(raw)
        if manifest.step != route.step:
            raise CheckpointCorruptError(f"backup put of ?step={route.step} carries a manifest "
                                         f"of step {manifest.step}")
        if claim.length - claim.manifest_bytes != manifest.total_bytes:
            raise CheckpointCorruptError(
                f"backup body holds {claim.length - claim.manifest_bytes} bytes, manifest "
                f"says {manifest.total_bytes}")
        app.backups.receive(route.rank, manifest,
                            lambda view: self._read_verified(view, claim.data_sha256))
        self._reply_text(200, f"stored backup of rank {route.rank} step {manifest.step}")

    def _read_verified(self, view: memoryview, sha256: str) -> None:
        """Fill ``view`` from the body, hashing each piece as it arrives."""
        digest = hashlib.sha256()
        got = 0
        while got < len(view):
            n = self.rfile.readinto(view[got:got + RECEIVE_CHUNK])
            if not n:
                raise CheckpointCorruptError(f"backup body ended after {got} of {len(view)} "
                                             f"bytes")
            digest.update(view[got:got + n])
            got += n
        if digest.hexdigest() != sha256:
            raise CheckpointCorruptError("backup body does not match the digest its token signed")

    def _reply_text(self, status: int, text: str) -> None:
        self._reply_bytes(status, text.encode(), "text/plain; charset=utf-8")

    def _reply_bytes(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if status >= 400:  # an unread request body may follow: do not reuse the connection
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)


def _pieces(view: memoryview) -> Iterator[memoryview]:
    for start in range(0, len(view), SEND_CHUNK):
        yield view[start:start + SEND_CHUNK]
