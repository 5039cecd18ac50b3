"""ZeroMQ endpoints for the signed health messages: ``Sender`` (PUSH, thread safe)
on nodes and ranks, ``Collector`` (PULL) on the controller. Every wait has a
timeout; a sender never blocks training: when the controller is away, messages
are dropped (and counted) rather than queued without bound. The collector bounds
what any peer can make it hold: frames above ``MAX_FRAME_BYTES`` end the
connection (``zmq.MAXMSGSIZE``) and at most ``RECV_HWM`` messages queue per
connection; whatever it rejects is counted and logged sampled, never raised."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import zmq

from ft_launch.logs import log_sampled

from .wire import (
    MAX_FRAME_BYTES,
    REASONS,
    HealthEnvelope,
    MessageKind,
    Rejected,
    ReplayGuard,
    Sequencer,
    decode,
    encode,
)

log = logging.getLogger(__name__)

SEND_HWM = 1000
#: Messages queued per connected sender before ZeroMQ stops reading from it. A
#: rank sends a heartbeat each 0.5 s and a message per step, so this covers a
#: controller busy for several seconds; one connection can make the collector
#: hold at most RECV_HWM x MAX_FRAME_BYTES (32 MiB).
RECV_HWM = 128
#: Messages one ``poll`` takes at most, so a flood cannot keep the controller's
#: loop inside it (1,000 nodes' ranks send ~16,000 heartbeats a second).
MAX_PER_POLL = 20_000


class Sender:
    def __init__(self, endpoint: str, secret: str, sender_id: str,
                 send_timeout: float = 1.0) -> None:
        self.secret = secret
        self._sequencer = Sequencer(sender_id)
        self._lock = threading.Lock()  # zmq sockets are not thread safe
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
        self._socket.connect(endpoint)
        self.dropped = 0

    @property
    def sender_id(self) -> str:
        return self._sequencer.sender

    def send(self, kind: MessageKind, body: Mapping[str, Any]) -> bool:
        with self._lock:
            frames = encode(self.secret, self._sequencer.next(kind, body))
            if len(frames[2]) > MAX_FRAME_BYTES:
                # The collector would drop the connection; never raise into training.
                self.dropped += 1
                log_sampled(log, self.dropped, "health %s message of %d bytes dropped: the "
                            "collector accepts at most %d", kind.value, len(frames[2]),
                            MAX_FRAME_BYTES, level=logging.ERROR)
                return False
            try:
                self._socket.send_multipart(frames)
                return True
            except zmq.Again:
                self.dropped += 1
                log.warning("health message dropped (controller not receiving): %s", kind.value)
                return False

    def close(self) -> None:
        with self._lock:
            self._socket.close(0)


class Collector:
    """Receives, verifies, checks and de-duplicates health messages."""

    def __init__(self, secret: str, bind: str = "tcp://127.0.0.1:0") -> None:
        self.secret = secret
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._socket.setsockopt(zmq.RCVHWM, RECV_HWM)
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._guard = ReplayGuard()
        #: Messages dropped since start, by ``Rejection`` value (for the status view).
        self.rejections: dict[str, int] = dict.fromkeys((r.value for r in REASONS), 0)

    @property
    def rejected(self) -> int:
        """All messages dropped so far."""
        return sum(self.rejections.values())

    def poll(self, timeout: float) -> list[HealthEnvelope]:
        """Messages that arrive within ``timeout`` seconds (those already queued, up
        to ``MAX_PER_POLL`` received or rejected)."""
        received: list[HealthEnvelope] = []
        if not self._socket.poll(int(timeout * 1000)):
            return received
        for _ in range(MAX_PER_POLL):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return received
            try:
                envelope = decode(self.secret, [frame.bytes for frame in frames])
                self._guard.check(envelope)
            except Rejected as exc:
                self._reject(exc, frames[0])
                continue
            received.append(envelope)
        return received

    def _reject(self, exc: Rejected, first: zmq.Frame) -> None:
        name = exc.reason.value
        self.rejections[name] += 1
        log_sampled(log, self.rejections[name], "rejected health message from %s (%s): %s",
                    _peer_of(first), name, exc)

    def close(self) -> None:
        self._socket.close(0)


def _peer_of(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:  # not a TCP connection (inproc, ipc)
        return "an unknown peer"
