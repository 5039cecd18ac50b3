"""The state server against hostile or broken peers: replays, lies, slow and many clients.

Black-box where the attack is: raw sockets on loopback against a real server.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import http.client
import json
import logging
import select
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from ft_launch.ckpt.backup import BackupStore
from ft_launch.ckpt.dual import Snapshot
from ft_launch.ckpt.errors import NoCheckpointError
from ft_launch.ckpt.fetch import Peer, fetch_state, push_backup
from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.wire import (
    AUTH_HEADER,
    AuthVerdict,
    BodyClaim,
    NonceCache,
    Route,
    RouteError,
    RouteKind,
    auth_token,
    check_token,
    parse_target,
    target_for,
)
from ft_launch.ids import new_job_secret
from tests.waiting import wait_until

from .helpers import assert_state_equal, snapshot_of

pytestmark = pytest.mark.timeout(120)
SECRET = new_job_secret()
SMALL = 1 << 20  # allocations up to this are real; larger ones are refused by the allocator


class TrackingAllocator:
    """Records what the store asks for; never really allocates more than ``SMALL``."""

    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.buffers: list[weakref.ref[np.ndarray]] = []

    def __call__(self, nbytes: int) -> np.ndarray:
        self.sizes.append(nbytes)
        if nbytes > SMALL:
            raise MemoryError(f"test allocator refuses {nbytes} bytes")
        buffer = np.zeros(nbytes, dtype=np.uint8)
        self.buffers.append(weakref.ref(buffer))
        return buffer

    def held(self) -> int:
        gc.collect()
        return sum(ref().nbytes for ref in self.buffers if ref() is not None)


@contextlib.contextmanager
def serving(store: BackupStore | None = None, snapshotter: DualBufferSnapshotter | None = None,
            **options: Any) -> Iterator[tuple[StateServer, Peer]]:
    snapshotter = snapshotter or snapshot_of(1)
    options.setdefault("io_timeout", 10)
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=snapshotter.buffers,
                     backups=store, **options) as server:
        yield server, Peer(*server.address)


def own_snapshot(step: int = 6) -> DualBufferSnapshotter:
    return snapshot_of(step, DualBufferSnapshotter(rank=0, world_size=2))


def put_request(target: str, manifest: bytes, data: bytes, *, claim: BodyClaim | None = None
                ) -> bytes:
    """A signed backup PUT, as ``push_backup`` sends it; ``claim`` to sign a different one."""
    claim = claim or BodyClaim.of_backup(manifest, memoryview(data))
    token = auth_token(SECRET, "PUT", target, time.time(), body=claim)
    head = f"PUT {target} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {token}\r\n" + "".join(
        f"{name}: {value}\r\n" for name, value in claim.headers().items()) + "\r\n"
    return head.encode() + manifest + data


def get_request(target: str, token: str | None = None) -> bytes:
    token = token if token is not None else auth_token(SECRET, "GET", target, time.time())
    return f"GET {target} HTTP/1.1\r\nHost: x\r\n{AUTH_HEADER}: {token}\r\n\r\n".encode()


def exchange(peer: Peer, payload: bytes, timeout: float = 10.0) -> tuple[int, str]:
    """Send raw bytes, return the status and body of the reply (the peer may cut us short)."""
    with socket.create_connection((peer.host, peer.port), timeout=timeout) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(payload)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read().decode(errors="replace")


def held_steps(store: BackupStore, rank: int = 0) -> list[int]:
    return store.buffers(rank).complete_steps()


# -- 1. replayed tokens ---------------------------------------------------------------


class Recorder:
    """A fake backup rank that records one request and answers 200: a sniffed copy."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.peer = Peer("127.0.0.1", self._sock.getsockname()[1])
        self.head = b""
        self.body = b""
        self._thread = threading.Thread(target=self._record, daemon=True)
        self._thread.start()

    def _record(self) -> None:
        conn, _ = self._sock.accept()
        with conn, conn.makefile("rb") as reader:
            lines = []
            while (line := reader.readline()) not in (b"\r\n", b""):
                lines.append(line)
            self.head = b"".join(lines) + b"\r\n"
            length = next(int(line.split(b":")[1]) for line in lines
                          if line.lower().startswith(b"content-length:"))
            self.body = reader.read(length)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")

    def capture(self, snap: Snapshot) -> tuple[bytes, bytes]:
        push_backup(self.peer, SECRET, snap, source_rank=0, timeout=10)
        self._thread.join(10)
        self._sock.close()
        return self.head, self.body


def forged_body(captured: bytes, manifest_bytes: int, step: int) -> bytes:
    """The captured body with its manifest rewritten to ``step``, padded to the same length."""
    record = json.loads(captured[:manifest_bytes])
    record["step"], record["meta"] = step, {}
    forged = json.dumps(record, separators=(",", ":")).encode()
    assert len(forged) <= manifest_bytes
    return forged.ljust(manifest_bytes) + captured[manifest_bytes:]


def _manifest_bytes(head: bytes) -> int:
    line = next(line for line in head.split(b"\r\n") if line.lower().startswith(b"x-ftl-manifest"))
    return int(line.split(b":")[1])


@pytest.mark.parametrize("original_delivered", [True, False])
def test_a_captured_backup_put_replayed_with_another_body_is_refused(original_delivered):
    own = own_snapshot(6)
    with own.lease() as snap:
        head, body = Recorder().capture(snap)
    store = BackupStore(accept_from={0})
    with serving(store) as (server, peer):
        if original_delivered:
            assert exchange(peer, head + body)[0] == 200
        status, reason = exchange(peer, head + forged_body(body, _manifest_bytes(head), 666))
        assert status in (400, 403), reason
        if original_delivered:
            assert held_steps(store) == [6]
            assert exchange(peer, head + body)[0] == 403  # even the same body, once only
            assert server.refusals[AuthVerdict.REPLAYED.value] == 2
            fetched = fetch_state(peer, SECRET, backup_of=0, timeout=10)
            assert_state_equal((fetched.manifest, fetched.buffer), 6)
        else:
            assert "does not match its signed digest" in reason
            with pytest.raises(NoCheckpointError):
                held_steps(store)


def test_a_put_whose_step_is_not_the_manifests_is_refused():
    store = BackupStore(accept_from={0})
    with own_snapshot(6).lease() as snap, serving(store) as (_server, peer):
        target = target_for(Route(RouteKind.BACKUP_PUT, 0, 666))
        manifest = snap.manifest.to_json().encode()
        status, reason = exchange(peer, put_request(target, manifest, bytes(snap.buffer)))
        assert status == 400 and "manifest of step 6" in reason
        with pytest.raises(NoCheckpointError, match="no backup of rank 0"):
            held_steps(store)
        unstepped = target_for(Route(RouteKind.BACKUP_PUT, 0))
        assert exchange(peer, put_request(unstepped, manifest, bytes(snap.buffer)))[0] == 400


def test_tokens_bind_the_body_and_work_once():
    target = "/v1/backup/data?rank=0&step=3"
    claim = BodyClaim(100, 40, "a" * 64, "b" * 64)
    token = auth_token(SECRET, "PUT", target, 1000.0, body=claim)
    assert check_token(SECRET, "PUT", target, token, 1001.0, body=claim) is AuthVerdict.OK
    for other in (BodyClaim(101, 40, "a" * 64, "b" * 64), BodyClaim(100, 40, "a" * 64, "c" * 64),
                  BodyClaim()):
        assert check_token(SECRET, "PUT", target, token, 1001.0, body=other) \
            is AuthVerdict.BAD_SIGNATURE
    seen = NonceCache()
    assert check_token(SECRET, "PUT", target, token, 1001.0, body=claim, seen=seen) \
        is AuthVerdict.OK
    assert check_token(SECRET, "PUT", target, token, 1002.0, body=claim, seen=seen) \
        is AuthVerdict.REPLAYED
    forged = token[:-1] + ("0" if token[-1] != "0" else "1")
    assert check_token(SECRET, "PUT", target, forged, 1002.0, body=claim, seen=seen) \
        is AuthVerdict.BAD_SIGNATURE
    assert len(seen) == 1  # a bad signature takes no memory


def test_the_nonce_cache_is_bounded_by_the_window_and_its_capacity():
    seen = NonceCache(capacity=3)
    for index in range(3):
        assert seen.admit(f"n{index}", expires=100.0 + index, now=90.0) is AuthVerdict.OK
    assert seen.admit("n3", expires=110.0, now=90.0) is AuthVerdict.FLOODED
    assert seen.admit("n0", expires=110.0, now=90.0) is AuthVerdict.REPLAYED
    assert seen.admit("n3", expires=110.0, now=101.5) is AuthVerdict.OK  # n0, n1 expired
    assert len(seen) == 2
    assert seen.admit("n0", expires=120.0, now=101.5) is AuthVerdict.OK


# -- 2. sizes that do not match ---------------------------------------------------------


def _big_manifest(step: int, nbytes: int) -> bytes:
    return json.dumps({"format": "ftl-ckpt/1", "step": step, "rank": 0, "world_size": 2,
                       "total_bytes": nbytes, "meta": {}, "tensors": [
                           {"name": "w", "dtype": "uint8", "shape": [nbytes], "offset": 0,
                            "nbytes": nbytes, "crc32": 0}]}).encode()


def test_sizes_that_do_not_match_the_manifest_are_refused_before_allocating():
    allocator = TrackingAllocator()
    store = BackupStore(accept_from={0}, allocator=allocator, max_bytes=SMALL)
    big = 768 << 20
    manifest = _big_manifest(7, big)
    target = target_for(Route(RouteKind.BACKUP_PUT, 0, 7))
    digest = hashlib.sha256(manifest).hexdigest()
    lying = BodyClaim(len(manifest) + 10, len(manifest), digest, "0" * 64)
    honest_but_huge = BodyClaim(len(manifest) + big, len(manifest), digest, "0" * 64)
    with serving(store) as (_server, peer):
        status, reason = exchange(peer, put_request(target, manifest, b"x" * 10, claim=lying))
        assert status == 400 and f"manifest says {big}" in reason
        status, reason = exchange(peer, put_request(target, manifest, b"", claim=honest_but_huge))
        assert status == 400 and "more than the" in reason
    assert allocator.sizes == []


def test_a_replayed_put_claiming_more_is_refused_before_allocating():
    own = own_snapshot(6)
    with own.lease() as snap:
        head, _body = Recorder().capture(snap)
    allocator = TrackingAllocator()
    store = BackupStore(accept_from={0}, allocator=allocator)
    big = 768 << 20
    manifest = _big_manifest(6, big)
    lines = [line for line in head.split(b"\r\n") if line]
    swapped = [b"Content-Length: %d" % (len(manifest) + big) if line.lower().startswith(
        b"content-length:") else b"X-Ftl-Manifest-Bytes: %d" % len(manifest)
        if line.lower().startswith(b"x-ftl-manifest") else line for line in lines]
    with serving(store) as (_server, peer):
        status, _reason = exchange(peer, b"\r\n".join(swapped) + b"\r\n\r\n" + manifest)
    assert status in (400, 403)
    assert all(size <= SMALL for size in allocator.sizes)


def test_a_body_that_fails_its_digest_leaves_no_memory_behind():
    allocator = TrackingAllocator()
    store = BackupStore(accept_from={0}, allocator=allocator)
    with own_snapshot(6).lease() as snap, serving(store) as (_server, peer):
        manifest = snap.manifest.to_json().encode()
        data = bytes(snap.buffer)
        claim = BodyClaim.of_backup(manifest, memoryview(data))
        tampered = bytearray(data)
        tampered[snap.manifest.spec("model/w").offset] ^= 1
        target = target_for(Route(RouteKind.BACKUP_PUT, 0, 6))
        status, reason = exchange(peer, put_request(target, manifest, bytes(tampered),
                                                    claim=claim))
        assert status == 400 and "does not match the digest" in reason
        assert allocator.sizes and allocator.held() == 0
        status, _reason = exchange(peer, put_request(target, manifest, data))
        assert status == 200 and held_steps(store) == [6]


# -- 3. slow and many clients -----------------------------------------------------------


def trickle(peer: Peer, interval: float, give_up: float, connected: threading.Event
            ) -> float | None:
    """Send a request a byte every ``interval``; seconds until the server closed, or None."""
    started = time.monotonic()
    endless = b"GET /v1/state/manifest HTTP/1.1\r\nX-Pad: " + b"a" * 100_000
    with socket.create_connection((peer.host, peer.port), timeout=give_up) as sock:
        connected.set()
        for byte in endless:
            if time.monotonic() - started > give_up:
                return None
            # select's timeout is the trickle's pace, not a wait for an event we expect
            readable, _, _ = select.select([sock], [], [], interval)
            try:
                if readable and not sock.recv(4096):
                    return time.monotonic() - started
                sock.send(bytes([byte]))
            except ConnectionError:
                return time.monotonic() - started
    return None


def test_a_client_sending_a_byte_at_a_time_is_cut_at_the_header_deadline():
    header_timeout = 1.0
    bound = 10 * header_timeout
    results: list[float | None] = []
    with serving(io_timeout=header_timeout, header_timeout=header_timeout) as (_server, peer):
        connected = [threading.Event() for _ in range(3)]
        slow = [threading.Thread(target=lambda event=event: results.append(
            trickle(peer, header_timeout * 0.3, bound, event))) for event in connected]
        for thread in slow:
            thread.start()
        assert all(event.wait(10) for event in connected)
        assert fetch_state(peer, SECRET, timeout=10).step == 1  # served meanwhile
        for thread in slow:
            thread.join(bound + 10)
    assert len(results) == 3
    assert all(took is not None and took < bound for took in results), results


def test_connections_beyond_the_cap_are_refused_at_once():
    header_timeout = 2.0
    with serving(io_timeout=header_timeout, header_timeout=header_timeout,
                 max_connections=2) as (server, peer):
        holders = [socket.create_connection((peer.host, peer.port), timeout=10)
                   for _ in range(2)]
        try:
            for holder in holders:
                holder.sendall(b"GET /v1/st")  # an unfinished request holds a slot
            wait_until(lambda: _refused_over_cap(peer), 10 * header_timeout,
                       "a connection beyond the cap to be refused")
            assert server.refusals["connection cap reached"] >= 1
        finally:
            for holder in holders:
                holder.close()
        wait_until(lambda: _fetch_ok(peer), 10 * header_timeout, "the slots to come free")


def _refused_over_cap(peer: Peer) -> bool:
    try:
        status, _ = exchange(peer, get_request(target_for(Route(RouteKind.STATE_MANIFEST))))
    except ConnectionError:
        return False  # refused, but the 503 was lost to the reset: try again
    return status == 503


def _fetch_ok(peer: Peer) -> bool:
    with contextlib.suppress(Exception):
        return fetch_state(peer, SECRET, timeout=5).step == 1
    return False


def test_a_burst_of_connections_is_answered_within_the_timeouts():
    io_timeout = 2.0
    clients = 200
    bound = 3 * io_timeout  # TCP retries a dropped SYN after 1, 3, 7 s: a short backlog shows
    answers: list[tuple[int | str, float]] = []
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    target = target_for(Route(RouteKind.STATE_MANIFEST))

    def client() -> None:
        payload = get_request(target)
        start.wait(30)
        began = time.monotonic()
        try:
            answer: int | str = exchange(peer, payload, timeout=4 * bound)[0]
        except OSError as exc:
            answer = repr(exc)
        with lock:
            answers.append((answer, time.monotonic() - began))

    with serving(io_timeout=io_timeout, max_connections=clients + 10) as (_server, peer):
        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        start.wait(30)
        for thread in threads:
            thread.join(8 * bound)
    assert len(answers) == clients
    slow = [(answer, round(took, 2)) for answer, took in answers if answer != 200 or took > bound]
    assert not slow, f"{len(slow)} of {clients} not answered within {bound} s: {slow[:10]}"


# -- 4, 5. malformed stamps and parameters ----------------------------------------------


@pytest.mark.parametrize("rest", [f"{'0' * 32}:{'0' * 64}", "0" * 64])
@pytest.mark.parametrize("stamp", ["²", "1" * 5000, "-5", "1_000", "1.5", "0x10", "١٢٣"])
def test_malformed_auth_stamps_are_refused_without_a_traceback(stamp, rest, caplog):
    target = target_for(Route(RouteKind.STATE_MANIFEST))
    token = f"{stamp}:{rest}"
    assert check_token(SECRET, "GET", target, token, time.time()) is AuthVerdict.MALFORMED
    with caplog.at_level(logging.DEBUG), serving() as (_server, peer):
        status, reason = exchange(peer, get_request(target, token=token))
    assert status == 403 and "malformed" in reason
    assert not [record for record in caplog.records if record.exc_info], "a traceback was logged"


@pytest.mark.parametrize("query", ["step=99&wait=nan", "step=99&wait=inf", "wait=-1",
                                   "wait=1e308", "step=%C2%B2", "step=-1", "step=1e3",
                                   "rank=" + "9" * 5000, "step=1&step=2", "wait=NaN"])
def test_bad_query_values_are_refused_at_once(query, caplog):
    target = f"/v1/state/manifest?{query}"
    with pytest.raises(RouteError):
        parse_target("GET", target)
    max_wait = 6.0
    with caplog.at_level(logging.DEBUG), serving(max_wait=max_wait) as (_server, peer):
        # Refused before any wait: a reply after max_wait / 2 means the value was used
        # (``nan`` made the handler spin forever, ``inf`` wait max_wait).
        status, reason = exchange(peer, get_request(target), timeout=max_wait / 2)
    assert status == 400, reason
    assert not [record for record in caplog.records if record.exc_info], "a traceback was logged"


def test_a_valid_wait_still_round_trips():
    route = Route(RouteKind.STATE_MANIFEST, step=4, wait=9.999995000000001)
    parsed = parse_target("GET", target_for(route))
    assert parsed.step == 4 and parsed.wait == pytest.approx(route.wait, abs=1e-3)
    assert parse_target("GET", target_for(Route(RouteKind.STATE_MANIFEST, wait=1e9))).wait \
        == 86_400.0
