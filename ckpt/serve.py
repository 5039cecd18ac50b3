"""HTTP server of a rank's committed state (catch-up) and of the backups it holds.

Thin shell over ``wire`` (routes, auth) and the dual buffers. A GET streams
the leased snapshot buffer straight from memory with large ``sendall`` calls;
no serialisation, no copy. While a request reads a snapshot it holds a lease,
so the snapshotter skips (never tears) that buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

from ftcore.config import CkptConfig

from .backup import BackupStore
from .dual import LeaseProvider, Snapshot
from .errors import CheckpointCorruptError, NoCheckpointError
from .manifest import Manifest
from .wire import (
    AUTH_HEADER,
    MANIFEST_BYTES_HEADER,
    MAX_MANIFEST_BYTES,
    AuthVerdict,
    Route,
    RouteKind,
    check_token,
    parse_range,
    parse_target,
)

log = logging.getLogger(__name__)
_DEFAULTS = CkptConfig()

#: Bytes per ``sendall``: large enough to run at socket speed, small enough that
#: the io timeout measures progress rather than the whole transfer.
SEND_CHUNK = 32 << 20


class _HttpServer(ThreadingHTTPServer):
    daemon_threads = True
    app: StateServer


class StateServer:
    """Serves ``snapshots`` (and ``backups`` if given) to holders of ``secret``."""

    def __init__(self, *, secret: str, host: str, snapshots: LeaseProvider,
                 backups: BackupStore | None = None, port: int = _DEFAULTS.serve_port,
                 max_wait: float = _DEFAULTS.fetch_timeout,
                 io_timeout: float = _DEFAULTS.fetch_timeout,
                 clock: Callable[[], float] = time.time) -> None:
        self.secret = secret
        self.snapshots = snapshots
        self.backups = backups
        self.max_wait = max_wait
        self.io_timeout = io_timeout
        self.clock = clock
        self._http = _HttpServer((host, port), _Handler)
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.app.io_timeout)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        app = self.server.app
        verdict = check_token(app.secret, method, self.path, self.headers.get(AUTH_HEADER),
                              app.clock())
        if verdict is not AuthVerdict.OK:
            log.warning("refused %s %s from %s: %s", method, self.path,
                        self.client_address[0], verdict.value)
            self._reply_text(403, f"refused: {verdict.value}")
            return
        try:
            route = parse_target(method, self.path)
        except ValueError as exc:
            self._reply_text(404, str(exc))
            return
        try:
            self._serve(app, route)
        except NoCheckpointError as exc:
            self._reply_text(404 if route.step is None else 410, str(exc))
        except CheckpointCorruptError as exc:
            self._reply_text(400, str(exc))
        except (ConnectionError, TimeoutError) as exc:
            log.warning("%s to %s aborted: %r", route.kind.value, self.client_address[0], exc)
            self.close_connection = True

    def _serve(self, app: StateServer, route: Route) -> None:
        if route.kind is RouteKind.BACKUP_PUT:
            self._receive_backup(app, route)
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

    def _receive_backup(self, app: StateServer, route: Route) -> None:
        if app.backups is None or route.rank is None:
            raise NoCheckpointError("this rank does not hold backups")
        manifest_bytes = int(self.headers.get(MANIFEST_BYTES_HEADER, "-1"))
        length = int(self.headers.get("Content-Length", "-1"))
        if not 0 < manifest_bytes <= min(MAX_MANIFEST_BYTES, length):
            self._reply_text(400, f"bad {MANIFEST_BYTES_HEADER} {manifest_bytes}")
            return
        manifest = Manifest.from_json(self.rfile.read(manifest_bytes))
        if length - manifest_bytes != manifest.total_bytes:
            raise CheckpointCorruptError(
                f"backup body holds {length - manifest_bytes} bytes, manifest says "
                f"{manifest.total_bytes}")
        app.backups.receive(route.rank, manifest, self._read_into)
        self._reply_text(200, f"stored backup of rank {route.rank} step {manifest.step}")

    def _read_into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            n = self.rfile.readinto(view[got:])
            if not n:
                raise CheckpointCorruptError(f"backup body ended after {got} of {len(view)} "
                                             f"bytes")
            got += n

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
