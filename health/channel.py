"""ZeroMQ endpoints for the signed health messages: ``Sender`` (PUSH, thread safe)
on nodes and ranks, ``Collector`` (PULL) on the controller. Every wait has a
timeout; a sender never blocks training: when the controller is away, messages
are dropped (and counted) rather than queued without bound."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

import zmq

from .wire import Envelope, MessageKind, ReplayGuard, Sequencer, WireError, decode, encode

log = logging.getLogger(__name__)

SEND_HWM = 1000


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
    """Receives, verifies and de-duplicates health messages."""

    def __init__(self, secret: str, bind: str = "tcp://127.0.0.1:0") -> None:
        self.secret = secret
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind)
        self.endpoint: str = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._guard = ReplayGuard()
        self.rejected = 0

    def poll(self, timeout: float) -> list[Envelope]:
        """Messages that arrive within ``timeout`` seconds (all already queued, at least)."""
        received: list[Envelope] = []
        if not self._socket.poll(int(timeout * 1000)):
            return received
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return received
            try:
                envelope = decode(self.secret, frames)
            except WireError as exc:
                self.rejected += 1
                log.warning("rejected health message: %s", exc)
                continue
            if not self._guard.accept(envelope):
                self.rejected += 1
                log.warning("rejected replayed message from %s", envelope.sender)
                continue
            received.append(envelope)

    def close(self) -> None:
        self._socket.close(0)
