"""Hostile clients at an FTAR listener: a handshake trickled a byte at a time is
cut at its deadline, idle connections beyond the cap are turned away at once,
junk costs a log line per thousand and no traceback, and a legitimate peer
connects throughout (or as soon as a slot frees)."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from ft_launch.config import FtarConfig
from ft_launch.ftar.connections import Connector
from ft_launch.ftar.transport import MAGIC, VERSION, Hello, Listener, Verdict, connect
from ft_launch.ids import new_job_secret
from ft_launch.logs import SAMPLE_EVERY
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

CONNECT_TIMEOUT = 2.0
CONFIG = FtarConfig(chunk_bytes=4096, timeout=5.0, connect_timeout=CONNECT_TIMEOUT)
SECRET = new_job_secret()
HELLO = Hello(7, 1, 0, 0, CONFIG.sockets_per_peer, CONFIG.chunk_bytes, CONFIG.chunks_in_flight)


@pytest.fixture
def connector() -> Iterator[Connector]:
    made = Connector(CONFIG, SECRET, "127.0.0.1")
    yield made
    made.close()


def _closed_by_peer(sock: socket.socket, wait: float) -> bool:
    """True if the peer closed (EOF or reset) within ``wait`` seconds."""
    sock.settimeout(wait)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_trickled_handshake_is_cut_at_its_deadline_while_a_real_peer_connects(
        connector: Connector) -> None:
    interval = CONNECT_TIMEOUT / 2   # each byte well within a per-read timeout
    give_up = 5 * CONNECT_TIMEOUT    # the deadline, with room for a busy machine
    hello = HELLO.pack(b"\x00" * 16)  # 56 bytes: 56 s at this pace
    sent = []
    outcome: list[float | None] = []

    def trickle() -> None:
        sock = socket.create_connection(connector.address)
        start = time.monotonic()
        try:
            for byte in hello:
                sock.sendall(bytes([byte]))
                sent.append(byte)
                # Paced by the listener's own answer: the wait returns at once
                # when it closes the connection.
                if _closed_by_peer(sock, interval):
                    outcome.append(time.monotonic() - start)
                    return
                if time.monotonic() - start > give_up:
                    break
            outcome.append(None)
        except (BrokenPipeError, ConnectionResetError):
            outcome.append(time.monotonic() - start)
        finally:
            sock.close()

    slow = threading.Thread(target=trickle, daemon=True)
    slow.start()
    wait_until(lambda: len(sent) >= 1, 10, "the trickle to start")
    connect(connector.address, SECRET, HELLO, 10 * CONNECT_TIMEOUT).close()
    assert slow.is_alive(), "the real peer should connect while the trickle is held"
    slow.join(give_up + 10)
    assert outcome and outcome[0] is not None, (
        f"a trickled handshake held its connection for {give_up:g} s "
        f"(connect_timeout {CONNECT_TIMEOUT:g} s)")
    assert outcome[0] <= give_up
    assert len(sent) < len(hello)
    wait_until(lambda: connector._listener.rejections.get("failed") == 1, 10,
               "the trickle counted as a failed handshake")


def test_connections_beyond_the_cap_are_turned_away_and_a_real_peer_gets_in_later() -> None:
    cap, timeout = 4, 2 * CONNECT_TIMEOUT  # turned away at once is well inside timeout / 2
    delivered: list[socket.socket] = []
    listener = Listener("127.0.0.1", SECRET, lambda hello: (Verdict.ACCEPTED, 0),
                        lambda hello, sock: delivered.append(sock), timeout, max_pending=cap)
    idle = [socket.create_connection(listener.address) for _ in range(cap)]
    try:
        wait_until(lambda: listener.pending == cap, 10, "every idle connection pending")
        extra = socket.create_connection(listener.address)
        try:
            assert _closed_by_peer(extra, timeout / 2), "a connection over the cap was kept"
        finally:
            extra.close()
        assert listener.pending == cap and listener.rejections == {"busy": 1}
        # The client retries a listener that turns it away, within its own deadline.
        connect(listener.address, SECRET, HELLO, 5 * timeout).close()
        wait_until(lambda: len(delivered) == 1, 10, "the real peer's connection handed over")
        wait_until(lambda: listener.rejections.get("failed") == cap, 10,
                   "the idle connections cut at their deadline")
    finally:
        for sock in idle + delivered:
            sock.close()
        listener.close()


def _junk_hellos() -> list[bytes]:
    fields = (7, 1, 0, 0, 1, 4096, 2, b"\x00" * 16)
    size = len(HELLO.pack(b"\x00" * 16))
    return [
        b"GET / HTTP/1.0\r\n".ljust(size, b"x"),                            # not FTAR
        struct.pack("<4sHHQIIHHQI16s", MAGIC, VERSION, 200, *fields),     # purpose 200
        struct.pack("<4sHHQIIHHQI16s", MAGIC, 9999, 0, *fields),          # version 9999
    ]


def test_junk_handshakes_are_counted_and_logged_sampled_without_tracebacks(
        connector: Connector, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="ft_launch.ftar.transport")
    rounds = 10
    for _ in range(rounds):
        for junk in _junk_hellos():
            with socket.create_connection(connector.address) as sock:
                sock.sendall(junk)
                assert _closed_by_peer(sock, 10 * CONNECT_TIMEOUT)
    attempts = rounds * len(_junk_hellos())
    wait_until(lambda: connector._listener.rejections.get("failed") == attempts, 10,
               "every junk handshake counted")
    assert connector.refused == attempts
    assert len(caplog.records) == 1 + attempts // SAMPLE_EVERY
    assert not any(r.exc_info for r in caplog.records)
    connect(connector.address, SECRET, HELLO, 10 * CONNECT_TIMEOUT).close()
