"""Signed messages from nodes and ranks to the controller (ZeroMQ frames).

Frames: ``[PROTOCOL, kind, body, mac]``; ``body`` is JSON with the sender, a
per-sender sequence number and the send time; ``mac`` is HMAC-SHA256 over the
protocol, kind and body with the job secret (``ftcore.ids.sign``). The
receiver drops anything unsigned, malformed or replayed (sequence not above the
last one seen from that sender); a restarted sender picks a new sender id.
"""

from __future__ import annotations

import enum
import json
import math
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ftcore.ids import sign, verify

PROTOCOL = b"ftl-health/1"


class MessageKind(enum.Enum):
    REPORT = "report"          # an inspection agent's profile report
    METRICS = "metrics"        # one training step of one rank
    HEARTBEAT = "heartbeat"    # a rank or agent is alive


def write_number(value: float | None) -> float | str | None:
    """JSON has no NaN/Inf: they travel as the strings 'nan', 'inf', '-inf'."""
    if value is None or math.isfinite(value):
        return value
    return repr(value)


def read_number(value: object) -> float | None:
    """The inverse of ``write_number`` (``float('nan')`` reads the strings back)."""
    if value is None:
        return None
    if not isinstance(value, (int, float, str)):
        raise WireError(f"not a number: {value!r}")
    return float(value)


class WireError(ValueError):
    """A message that must be dropped (bad signature, malformed, replayed)."""


@dataclass(frozen=True)
class Envelope:
    kind: MessageKind
    sender: str
    seq: int
    sent: float
    body: Mapping[str, Any] = field(default_factory=dict)


def new_sender_id(name: str) -> str:
    """``name/pid/nonce``: unique per process start, so sequences never collide."""
    return f"{name}/{os.getpid()}/{secrets.token_hex(4)}"


def encode(secret: str, envelope: Envelope) -> list[bytes]:
    kind = envelope.kind.value.encode()
    body = json.dumps({"sender": envelope.sender, "seq": envelope.seq, "sent": envelope.sent,
                       "body": envelope.body}, separators=(",", ":")).encode()
    return [PROTOCOL, kind, body, sign(secret, PROTOCOL, kind, body)]


def decode(secret: str, frames: Sequence[bytes]) -> Envelope:
    if len(frames) != 4 or frames[0] != PROTOCOL:
        raise WireError("not an ft-launch health message")
    _, kind, body, mac = frames
    if not verify(secret, mac, PROTOCOL, kind, body):
        raise WireError("bad signature")
    try:
        raw = json.loads(body)
        return Envelope(MessageKind(kind.decode()), str(raw["sender"]), int(raw["seq"]),
                        float(raw["sent"]), dict(raw["body"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise WireError(f"malformed body: {exc}") from None


class ReplayGuard:
    """Accepts each sender's messages only in increasing sequence order."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def accept(self, envelope: Envelope) -> bool:
        if envelope.seq <= self._last.get(envelope.sender, -1):
            return False
        self._last[envelope.sender] = envelope.seq
        return True


class Sequencer:
    """Builds envelopes for one sender with increasing sequence numbers."""

    def __init__(self, sender: str) -> None:
        self.sender = sender
        self._seq = 0

    def next(self, kind: MessageKind, body: Mapping[str, Any]) -> Envelope:
        self._seq += 1
        return Envelope(kind, self.sender, self._seq, time.time(), body)
