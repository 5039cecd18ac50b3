"""Client side of the state server: fetch a peer's state, push a backup.

Bytes are read with ``readinto`` straight into a (preferably preallocated)
buffer, optionally over several connections with byte ranges, then checked
against the manifest's CRC-32s; nothing unverified leaves this module. Every
socket operation has a timeout and the whole fetch a deadline.
"""

from __future__ import annotations

import http.client
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ft_launch.config import CkptConfig

from .dual import Snapshot
from .errors import FetchError
from .manifest import Bytes, Manifest, ManifestError, checksum
from .wire import (
    AUTH_HEADER,
    BodyClaim,
    Route,
    RouteKind,
    auth_token,
    method_for,
    range_header,
    split_ranges,
    target_for,
)

log = logging.getLogger(__name__)

#: Bytes per ``readinto``: also the step at which verification follows the transfer.
READ_CHUNK = 8 << 20
SEND_CHUNK = 32 << 20
#: Defaults of the tunables below come from ``[ckpt]``. ``fetch_streams``: connections
#: per fetch, each reading one byte range; two came closer to a raw socket than one
#: (measurements: benchmarks/results/measurements.md#fetch-streams).
_DEFAULTS = CkptConfig()


@dataclass(frozen=True)
class Peer:
    """Where a rank's state server listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class FetchedState:
    """A verified copy of a peer's state, staged until the commit point applies it."""

    manifest: Manifest
    buffer: Bytes
    peer: Peer
    seconds: float

    @property
    def step(self) -> int:
        return self.manifest.step


class _Deadline:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.end = time.monotonic() + timeout

    def left(self, what: str, peer: Peer) -> float:
        remaining = self.end - time.monotonic()
        if remaining <= 0:
            raise FetchError(f"{what} from {peer} did not finish within {self.timeout} s")
        return remaining


def _open(peer: Peer, secret: str, route: Route, deadline: _Deadline,
          headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    target = target_for(route)
    what = f"{route.kind.value} (step {route.step})"
    try:
        conn = http.client.HTTPConnection(peer.host, peer.port,
                                          timeout=deadline.left(what, peer))
        conn.request(method_for(route), target, headers={
            AUTH_HEADER: auth_token(secret, method_for(route), target, time.time()),
            **(headers or {})})
        response = conn.getresponse()
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"{what} from {peer} failed: {exc!r}") from exc
    if response.status not in (200, 206):
        reason = response.read(4096).decode(errors="replace")
        conn.close()
        raise FetchError(f"{what} refused by {peer}: HTTP {response.status} {reason}",
                         status=response.status)
    return response


def fetch_manifest(peer: Peer, secret: str, route: Route, timeout: float) -> Manifest:
    response = _open(peer, secret, route, _Deadline(timeout))
    try:
        return Manifest.from_json(response.read())
    except ManifestError as exc:
        raise FetchError(f"manifest from {peer} is invalid: {exc}") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"reading the manifest from {peer} failed: {exc!r}") from exc
    finally:
        response.close()


def fetch_state(peer: Peer, secret: str, *, step: int | None = None,
                backup_of: int | None = None, timeout: float = _DEFAULTS.fetch_timeout,
                wait: float = 0.0, buffer: Bytes | None = None,
                streams: int = _DEFAULTS.fetch_streams) -> FetchedState:
    """Fetch, verify and return the state of ``step`` (newest if None).

    ``backup_of=r`` fetches the backup of rank r that ``peer`` holds instead of
    the peer's own state. ``wait`` lets the peer wait that long for the step's
    snapshot to complete. Raises ``FetchError`` on refusal, timeout, truncation
    or a checksum mismatch.
    """
    started = time.perf_counter()
    deadline = _Deadline(timeout)
    backup = backup_of is not None
    kind = RouteKind.BACKUP_MANIFEST if backup else RouteKind.STATE_MANIFEST
    manifest = fetch_manifest(peer, secret, Route(kind, backup_of, step, wait), timeout)
    if buffer is None or buffer.nbytes < manifest.total_bytes:
        buffer = np.empty(manifest.total_bytes, dtype=np.uint8)
    data = Route(RouteKind.BACKUP_DATA if backup else RouteKind.STATE_DATA, backup_of,
                 manifest.step)
    ranges = split_ranges(manifest.total_bytes, streams)
    progress = _Progress(ranges)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_receive_range, daemon=True, args=(
        peer, secret, data, buffer, index, progress, deadline, errors))
        for index in range(len(ranges))]
    for thread in threads:
        thread.start()
    bad = _verify_as_received(manifest, buffer, progress, deadline)
    for thread in threads:
        thread.join(deadline.left("state transfer", peer))
    if errors:
        raise errors[0]
    if bad:
        raise FetchError(f"state of step {manifest.step} from {peer} failed verification: "
                         f"{', '.join(bad[:5])}" + (f" and {len(bad) - 5} more" if len(bad) > 5
                                                    else ""), step=manifest.step)
    return FetchedState(manifest, buffer, peer, time.perf_counter() - started)


class _Progress:
    """Bytes each stream has received, so that verification trails the transfer.

    A tensor is check-summed as soon as all its bytes are in, while later bytes
    still arrive: on separate machines the CRC then costs no time at all.
    """

    def __init__(self, ranges: Sequence[tuple[int, int]]) -> None:
        self.ranges = list(ranges)
        self.got = [0] * len(ranges)
        self.ended = 0
        self.cond = threading.Condition()

    def advance(self, index: int, nbytes: int) -> None:
        with self.cond:
            self.got[index] += nbytes
            self.cond.notify_all()

    def end(self) -> None:
        with self.cond:
            self.ended += 1
            self.cond.notify_all()

    def covered(self, start: int, end: int) -> bool:
        for (first, last), got in zip(self.ranges, self.got, strict=True):
            if max(first, start) < min(last, end) and min(last, end) > first + got:
                return False
        return True

    def wait_covered(self, start: int, end: int, timeout: float) -> bool:
        with self.cond:
            self.cond.wait_for(lambda: self.covered(start, end)
                               or self.ended == len(self.ranges), timeout)
            return self.covered(start, end)


def _verify_as_received(manifest: Manifest, buffer: Bytes, progress: _Progress,
                        deadline: _Deadline) -> list[str]:
    """Names of tensors whose CRC does not match; stops when a stream fails."""
    bad: list[str] = []
    for spec in sorted(manifest.tensors, key=lambda t: t.offset):
        remaining = max(deadline.end - time.monotonic(), 0.0)
        if not progress.wait_covered(spec.offset, spec.offset + spec.nbytes, remaining):
            return bad  # a stream failed or timed out: its error is raised instead
        if spec.crc32 is None or checksum(spec.raw(buffer)) != spec.crc32:
            bad.append(spec.name)
    return bad


def _receive_range(peer: Peer, secret: str, route: Route, buffer: Bytes, index: int,
                   progress: _Progress, deadline: _Deadline, errors: list[BaseException]
                   ) -> None:
    start, end = progress.ranges[index]
    try:
        response = _open(peer, secret, route, deadline, {"Range": range_header(start, end)})
        try:
            _read_exact(response, buffer.data[start:end], peer, deadline,
                        lambda n: progress.advance(index, n))
        finally:
            response.close()
    except BaseException as exc:  # noqa: BLE001 - re-raised in the fetching thread
        errors.append(exc)
    finally:
        progress.end()


def _read_exact(response: http.client.HTTPResponse, view: memoryview, peer: Peer,
                deadline: _Deadline, on_read: Callable[[int], None] | None = None) -> None:
    got = 0
    try:
        while got < len(view):
            deadline.left("state transfer", peer)
            n = response.readinto(view[got:got + READ_CHUNK])
            if not n:
                raise FetchError(f"state transfer from {peer} truncated after {got} of "
                                 f"{len(view)} bytes")
            got += n
            if on_read is not None:
                on_read(n)
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"state transfer from {peer} failed after {got} bytes: "
                         f"{exc!r}") from exc


def push_backup(peer: Peer, secret: str, snapshot: Snapshot, *, source_rank: int,
                timeout: float = _DEFAULTS.fetch_timeout) -> None:
    """Send ``snapshot`` (rank ``source_rank``'s) to the rank that backs it up."""
    route = Route(RouteKind.BACKUP_PUT, source_rank, snapshot.step)
    target = target_for(route)
    manifest = snapshot.manifest.to_json().encode()
    view = snapshot.buffer.data[:snapshot.manifest.total_bytes]
    # The token signs both digests, so no other body can be sent with it (the cost:
    # benchmarks/results/measurements.md#push-digest).
    claim = BodyClaim.of_backup(manifest, view)
    conn = http.client.HTTPConnection(peer.host, peer.port, timeout=timeout)
    try:
        conn.putrequest("PUT", target, skip_accept_encoding=True)
        conn.putheader(AUTH_HEADER, auth_token(secret, "PUT", target, time.time(), body=claim))
        for name, value in claim.headers().items():
            conn.putheader(name, value)
        conn.endheaders(manifest)
        try:
            for start in range(0, len(view), SEND_CHUNK):
                conn.send(view[start:start + SEND_CHUNK])
        except ConnectionError:
            pass  # the peer refused before reading the body; its reply says why
        response = conn.getresponse()
        reply = response.read(4096).decode(errors="replace")
    except (OSError, http.client.HTTPException) as exc:
        raise FetchError(f"backup of rank {source_rank} step {snapshot.step} to {peer} "
                         f"failed: {exc!r}", rank=source_rank) from exc
    finally:
        conn.close()
    if response.status != 200:
        raise FetchError(f"backup of rank {source_rank} step {snapshot.step} refused by "
                         f"{peer}: HTTP {response.status} {reply}", status=response.status,
                         rank=source_rank)


class CatchUp:
    """Fetch one step's state in the background, trying peers in order.

    The training thread starts it when the quorum says the replica is behind,
    goes on with its zero-gradient step, and takes ``result()`` at the commit
    point, where the state is applied.
    """

    def __init__(self, peers: Sequence[Peer], secret: str, *, step: int,
                 timeout: float = _DEFAULTS.fetch_timeout, buffer: Bytes | None = None,
                 streams: int = _DEFAULTS.fetch_streams) -> None:
        if not peers:
            raise ValueError("catch-up needs at least one peer to fetch from")
        self.peers = tuple(peers)
        self.step = step
        self._secret = secret
        self._timeout = timeout
        self._buffer = buffer
        self._streams = streams
        self._result: FetchedState | None = None
        self._failures: list[str] = []
        self._thread = threading.Thread(target=self._run, name=f"ckpt-catchup-{step}",
                                        daemon=True)

    def start(self) -> CatchUp:
        self._thread.start()
        return self

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float | None = None) -> FetchedState:
        self._thread.join(self._timeout if timeout is None else timeout)
        if self._thread.is_alive():
            raise FetchError(f"catch-up fetch of step {self.step} still running", step=self.step)
        if self._result is None:
            raise FetchError(f"catch-up fetch of step {self.step} failed from every peer: "
                             + "; ".join(self._failures), step=self.step)
        return self._result

    def _run(self) -> None:
        deadline = time.monotonic() + self._timeout
        for peer in self.peers:
            left = deadline - time.monotonic()
            if left <= 0:
                self._failures.append(f"{peer}: no time left")
                continue
            try:
                self._result = fetch_state(peer, self._secret, step=self.step, timeout=left,
                                           wait=left / 2, buffer=self._buffer,
                                           streams=self._streams)
                log.info("fetched step %d from %s in %.2f s", self.step, peer,
                         self._result.seconds)
                return
            except FetchError as exc:
                log.warning("catch-up fetch from %s failed: %s", peer, exc)
                self._failures.append(f"{peer}: {exc}")
