"""State server and client on loopback: fetch, auth, backups, peers that die."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import multiprocessing
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from ft_launch.ckpt.backup import BackupSender, BackupStore
from ft_launch.ckpt.dual import SlotState, Snapshot
from ft_launch.ckpt.errors import FetchError
from ft_launch.ckpt.fetch import (
    CatchUp,
    Peer,
    _Deadline,
    _open,
    _read_exact,
    fetch_manifest,
    fetch_state,
    push_backup,
)
from ft_launch.ckpt.serve import StateServer
from ft_launch.ckpt.snapshot import DualBufferSnapshotter
from ft_launch.ckpt.wire import (
    AUTH_HEADER,
    AuthVerdict,
    BodyClaim,
    Route,
    RouteKind,
    auth_token,
    check_token,
    parse_range,
    parse_target,
    split_ranges,
    target_for,
)
from ft_launch.ids import new_job_secret
from tests.waiting import wait_until

from .helpers import GatedSource, assert_state_equal, make_arrays, snapshot_of
from .peer_proc import serve_state

pytestmark = pytest.mark.timeout(60)
SECRET = new_job_secret()


@contextlib.contextmanager
def serving(snapshotter: DualBufferSnapshotter | None = None,
            backups: BackupStore | None = None) -> Iterator[Peer]:
    snapshotter = snapshotter or DualBufferSnapshotter()
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=snapshotter.buffers,
                     backups=backups, io_timeout=10) as server:
        yield Peer(*server.address)


@pytest.mark.parametrize("streams", [1, 3])
def test_fetch_round_trip_into_preallocated_buffer(streams):
    snapshotter = snapshot_of(4, size=300_000)
    buffer = np.empty(4 << 20, dtype=np.uint8)
    with serving(snapshotter) as peer:
        fetched = fetch_state(peer, SECRET, step=4, buffer=buffer, streams=streams, timeout=20)
    assert fetched.buffer is buffer
    assert_state_equal((fetched.manifest, fetched.buffer), 4, size=300_000)
    assert fetched.manifest.meta == {"step": 4}


def test_a_served_manifest_carries_checksums_computed_on_first_use():
    snapshotter = snapshot_of(4)
    with snapshotter.lease(checksums=False) as snap:
        assert not snap.manifest.checksummed
    with serving(snapshotter) as peer:
        manifest = fetch_manifest(peer, SECRET, Route(RouteKind.STATE_MANIFEST), timeout=10)
    assert manifest.checksummed
    with snapshotter.lease(checksums=False) as snap:
        assert snap.manifest == manifest


def test_fetch_refused_without_or_with_a_wrong_secret():
    with serving(snapshot_of(1)) as peer:
        conn = http.client.HTTPConnection(peer.host, peer.port, timeout=10)
        conn.request("GET", target_for(Route(RouteKind.STATE_MANIFEST)))
        response = conn.getresponse()
        assert response.status == 403
        assert b"no auth header" in response.read()
        conn.close()
        with pytest.raises(FetchError, match="HTTP 403") as caught:
            fetch_state(peer, new_job_secret(), timeout=10)
        assert caught.value.status == 403


def test_auth_tokens_bind_method_target_and_time():
    target = "/v1/state/data?step=3"
    token = auth_token(SECRET, "GET", target, now=1000.0)
    assert check_token(SECRET, "GET", target, token, now=1010.0) is AuthVerdict.OK
    assert check_token(SECRET, "GET", "/v1/state/data?step=4", token, 1010.0) \
        is AuthVerdict.BAD_SIGNATURE
    assert check_token(SECRET, "PUT", target, token, 1010.0) is AuthVerdict.BAD_SIGNATURE
    assert check_token(SECRET, "GET", target, token, 2000.0) is AuthVerdict.EXPIRED
    assert check_token(SECRET, "GET", target, "garbage", 1000.0) is AuthVerdict.MALFORMED
    assert check_token(SECRET, "GET", target, None, 1000.0) is AuthVerdict.MISSING


def test_routes_ranges_and_splits():
    assert parse_target("GET", "/v1/backup/data?rank=3&step=9") == \
        Route(RouteKind.BACKUP_DATA, 3, 9)
    for method, target in [("GET", "/v1/nothing"), ("GET", "/v1/backup/data"),
                           ("GET", "/v1/state/data?bogus=1")]:
        with pytest.raises(ValueError):
            parse_target(method, target)
    assert parse_range("bytes=10-19", 100) == (10, 20)
    assert parse_range(None, 100) == (0, 100)
    with pytest.raises(ValueError):
        parse_range("bytes=90-200", 100)
    pieces = split_ranges(5_000_000, 3)
    assert pieces[0][0] == 0 and pieces[-1][1] == 5_000_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))


def test_fetch_waits_for_the_step_being_copied():
    # Copied on the snapshot's thread (the gate holds it there), not inline in start.
    snapshotter = snapshot_of(1, DualBufferSnapshotter(inline_bytes=0))
    source = GatedSource(make_arrays(2), gate_at=1)
    snapshotter.start(2, source)
    assert source.reached.wait(10)
    with serving(snapshotter) as peer:
        catch_up = CatchUp([peer], SECRET, step=2, timeout=20).start()
        assert not catch_up.done()
        source.release.set()
        fetched = catch_up.result(timeout=20)
    assert_state_equal((fetched.manifest, fetched.buffer), 2)


def test_fetch_of_a_replaced_step_is_gone():
    snapshotter = DualBufferSnapshotter()
    for step in (1, 2, 3):
        snapshot_of(step, snapshotter)
    with serving(snapshotter) as peer, pytest.raises(FetchError) as caught:
        fetch_state(peer, SECRET, step=1, timeout=10)
    assert caught.value.status == 410


class _CorruptingProvider:
    """Serves a snapshot whose bytes no longer match its manifest (bit rot in a peer)."""

    def __init__(self, snapshotter: DualBufferSnapshotter) -> None:
        with snapshotter.lease() as snap:
            self.manifest, self.buffer = snap.manifest, snap.buffer.copy()
        self.buffer[self.manifest.spec("model/w").offset + 5] ^= 0x10

    @contextlib.contextmanager
    def lease(self, step=None, timeout=0.0, *, checksums=True):
        yield Snapshot(self.manifest, self.buffer)


def test_corrupt_bytes_from_a_peer_are_rejected():
    provider = _CorruptingProvider(snapshot_of(7))
    with StateServer(secret=SECRET, host="127.0.0.1", snapshots=provider) as server, \
            pytest.raises(FetchError, match="failed verification: model/w"):
        fetch_state(Peer(*server.address), SECRET, timeout=10)


def test_peer_killed_mid_transfer_is_a_clear_error():
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=serve_state, args=(child, SECRET, 3, 256 << 20))
    process.start()
    try:
        assert parent.poll(60), "peer process did not start serving"
        peer = Peer("127.0.0.1", parent.recv())
        deadline = _Deadline(30)
        response = _open(peer, SECRET, Route(RouteKind.STATE_DATA, step=3), deadline)
        head = np.empty(1 << 20, dtype=np.uint8)
        _read_exact(response, memoryview(head), peer, deadline)
        os.kill(process.pid, signal.SIGKILL)
        process.join(30)
        rest = np.empty((256 << 20) - (1 << 20), dtype=np.uint8)
        with pytest.raises(FetchError, match="truncated|failed after"):
            _read_exact(response, memoryview(rest), peer, deadline)
    finally:
        if process.is_alive():
            process.kill()
        process.join(10)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_catch_up_falls_back_to_the_next_peer():
    dead = Peer("127.0.0.1", _closed_port())
    with serving(snapshot_of(5)) as alive:
        fetched = CatchUp([dead, alive], SECRET, step=5, timeout=20).start().result()
    assert fetched.peer == alive and fetched.step == 5
    failing = CatchUp([dead], SECRET, step=5, timeout=5).start()
    with pytest.raises(FetchError, match="failed from every peer"):
        failing.result()


def test_backup_push_then_fetch_back():
    store = BackupStore(accept_from={0})
    own = snapshot_of(6, DualBufferSnapshotter(rank=0, world_size=2))
    with serving(backups=store) as backup_rank:
        with own.lease() as snap:
            push_backup(backup_rank, SECRET, snap, source_rank=0, timeout=10)
        fetched = fetch_state(backup_rank, SECRET, backup_of=0, timeout=10)
        assert_state_equal((fetched.manifest, fetched.buffer), 6)
        with pytest.raises(FetchError, match="not the backup rank"), own.lease() as snap:
            push_backup(backup_rank, SECRET, snap, source_rank=1, timeout=10)


def test_backup_push_cut_short_keeps_the_previous_backup():
    store = BackupStore()
    own = snapshot_of(1)
    with serving(backups=store) as backup_rank:
        with own.lease() as snap:
            push_backup(backup_rank, SECRET, snap, source_rank=0, timeout=10)
        snapshot_of(2, own)
        with own.lease() as snap:
            _push_half(backup_rank, snap)
        wait_until(lambda: SlotState.FAILED in store.buffers(0).states(), 20,
                   "the server to notice the cut push")
        fetched = fetch_state(backup_rank, SECRET, backup_of=0, timeout=10)
    assert_state_equal((fetched.manifest, fetched.buffer), 1)


def _push_half(peer: Peer, snap: Snapshot) -> None:
    """A sender that dies after half the body: headers promise more than arrives."""
    manifest = snap.manifest.to_json().encode()
    target = target_for(Route(RouteKind.BACKUP_PUT, 0, snap.step))
    claim = BodyClaim.of_backup(manifest, snap.buffer.data)
    head = (f"PUT {target} HTTP/1.1\r\nHost: x\r\n"
            f"{AUTH_HEADER}: {auth_token(SECRET, 'PUT', target, time.time(), body=claim)}\r\n"
            + "".join(f"{name}: {value}\r\n" for name, value in claim.headers().items())
            + "\r\n").encode()
    with socket.create_connection((peer.host, peer.port), timeout=10) as sock:
        sock.sendall(head + manifest + bytes(snap.buffer[:snap.manifest.total_bytes // 2]))


def test_backup_sender_pushes_each_new_snapshot():
    store = BackupStore()
    own = DualBufferSnapshotter(rank=0)
    with serving(backups=store) as backup_rank:
        sender = BackupSender(own.buffers, backup_rank, SECRET, rank=0, every=1, timeout=10,
                              poll_interval=0.05).start()
        try:
            for step in (1, 2, 3):
                snapshot_of(step, own)
                assert sender.wait_sent(step, timeout=20)
        finally:
            sender.close()
    assert store.buffers(0).latest_step() == 3
    assert sender.failed == 0


def test_many_concurrent_fetches_are_all_served():
    snapshotter = snapshot_of(2, size=100_000)
    results: list[int] = []
    with serving(snapshotter) as peer:
        threads = [threading.Thread(target=lambda: results.append(
            fetch_state(peer, SECRET, step=2, timeout=20).step)) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert results == [2] * 6


def test_refused_large_push_reports_the_peers_reason():
    store = BackupStore(accept_from={0})
    own = snapshot_of(1, DualBufferSnapshotter(rank=3, world_size=4), size=8_000_000)
    with serving(backups=store) as backup_rank, own.lease() as snap, \
            pytest.raises(FetchError, match="not the backup rank of rank 3"):
        push_backup(backup_rank, SECRET, snap, source_rank=3, timeout=10)
