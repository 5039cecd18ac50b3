"""Signed messages from nodes and ranks to the controller (ZeroMQ frames).

Frames: ``[PROTOCOL, kind, body, mac]``, the shared signed envelope of
``ft_launch.envelope`` (tagged with ``PROTOCOL``); ``body`` is JSON with the
sender, a per-sender sequence number and the send time; ``mac`` is HMAC-SHA256
over the protocol, kind and body with the job secret. The receiver drops
anything unsigned, malformed or replayed (sequence not above the last one seen
from that sender: ``ft_launch.envelope.ReplayGuard``); a restarted sender picks a
new sender id.

A signed message is still only data: ``decode`` checks every field the
controller reads (types, finite numbers, ranges, lengths) against the schema of
its kind, so a buggy or hostile secret holder gets its message dropped
(``WireError``, the shared ``Rejected``), never an exception in the controller.
"""

from __future__ import annotations

import enum
import json
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ft_launch.envelope import Envelope, Rejected, Rejection, ReplayGuard, Seal

from .result import CheckStatus

__all__ = ["MAX_FRAME_BYTES", "PROTOCOL", "REASONS", "Envelope", "HealthEnvelope", "MessageKind",
           "Rejected", "Rejection", "ReplayGuard", "Sequencer", "WireError", "decode", "encode",
           "new_sender_id", "read_number", "write_number"]

PROTOCOL = b"ftl-health/1"
#: The largest frame accepted (and sent). An inspection report is ~1.2 KiB with
#: 10 checks on 8 GPUs; 256 KiB leaves room for verbose evidence while bounding
#: what one message may make the collector buffer (``zmq.MAXMSGSIZE``).
MAX_FRAME_BYTES = 256 * 1024
MAX_NAME_CHARS = 256          # a sender id, node, profile or check name
MAX_TEXT_CHARS = 4096         # a check's reason (it becomes a drain reason)
MAX_RESULTS = 1024            # checks in one report
MAX_SEQ = 2**63 - 1
MAX_RANK = 2**31 - 1
_NON_FINITE = ("nan", "inf", "-inf")


class MessageKind(enum.Enum):
    REPORT = "report"          # an inspection agent's profile report
    METRICS = "metrics"        # one training step of one rank
    HEARTBEAT = "heartbeat"    # a rank or agent is alive


#: What the collector counts drops by (``ft_launch.envelope.Rejection``: a health
#: message has no recipient and no age limit).
REASONS = (Rejection.MALFORMED, Rejection.BAD_SIGNATURE, Rejection.INVALID, Rejection.REPLAYED)
#: A message that must be dropped (bad signature, malformed, invalid, replayed).
WireError = Rejected
#: A health message as the collector hands it on: sender name, JSON body.
HealthEnvelope = Envelope[str, Mapping[str, Any]]


def _invalid(detail: str) -> Rejected:
    """A signed message whose field is missing, mistyped or out of range."""
    return Rejected(Rejection.INVALID, detail)


def write_number(value: float | None) -> float | str | None:
    """JSON has no NaN/Inf: they travel as the strings 'nan', 'inf', '-inf'."""
    if value is None or math.isfinite(value):
        return value
    return repr(value)


def read_number(value: object) -> float | None:
    """The inverse of ``write_number``: a number, one of its three strings, or None."""
    if value is None:
        return None
    if isinstance(value, str) and value in _NON_FINITE:
        return float(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _invalid(f"not a number: {_shown(value)} (expected a number, 'nan', 'inf' "
                    f"or '-inf')")


def new_sender_id(name: str) -> str:
    """``name/pid/nonce``: unique per process start, so sequences never collide."""
    return f"{name}/{os.getpid()}/{secrets.token_hex(4)}"


def _seal(secret: str) -> Seal:
    return Seal(secret, PROTOCOL, parts=2, tagged=True, max_part_bytes=MAX_FRAME_BYTES)


def encode(secret: str, envelope: HealthEnvelope) -> list[bytes]:
    kind = envelope.kind.value.encode()
    body = json.dumps({"sender": envelope.sender, "seq": envelope.seq, "sent": envelope.sent_at,
                       "body": envelope.body}, separators=(",", ":")).encode()
    return _seal(secret).seal(kind, body)


def decode(secret: str, frames: Sequence[bytes]) -> HealthEnvelope:
    """The verified, schema-checked envelope; ``WireError`` for anything else."""
    kind, body = _seal(secret).open(frames)
    try:
        message_kind = MessageKind(kind.decode("ascii"))
        raw = json.loads(body)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _invalid(f"malformed body: {str(exc)[:80]}") from None
    fields = _mapping(raw, "message")
    envelope: HealthEnvelope = Envelope(
        message_kind, _name(fields.get("sender"), "sender"),
        _integer(fields.get("seq"), "seq", 0, MAX_SEQ), _finite(fields.get("sent"), "sent"),
        _mapping(fields.get("body"), "body"))
    _BODY_SCHEMA[message_kind](envelope.body)
    return envelope


# ---------------------------------------------------------------------- schemas

def _heartbeat(body: Mapping[str, Any]) -> None:
    _integer(body.get("rank"), "body.rank", 0, MAX_RANK)


def _metrics(body: Mapping[str, Any]) -> None:
    _integer(body.get("rank"), "body.rank", 0, MAX_RANK)
    _integer(body.get("step"), "body.step", 0, MAX_SEQ)
    if "loss" not in body:
        raise _invalid("field 'body.loss' is missing (expected a number, 'nan', 'inf' or "
                        "'-inf')")
    for name in ("loss", "grad_norm", "step_time"):
        try:
            read_number(body.get(name))
        except WireError as exc:
            raise _invalid(f"field 'body.{name}': {exc}") from None
    if body.get("tokens") is not None:
        _integer(body.get("tokens"), "body.tokens", 0, MAX_SEQ)


def _report(body: Mapping[str, Any]) -> None:
    """What ``ProfileReport.from_dict`` reads (and ``benchmarks/detection``'s monitor)."""
    _name(body.get("profile"), "body.profile")
    _name(body.get("node"), "body.node")
    _status(body.get("status"), "body.status")
    for name in ("started", "duration"):
        if name in body:
            _finite(body[name], f"body.{name}")
    results = body.get("results")
    if not isinstance(results, list) or len(results) > MAX_RESULTS:
        raise _invalid(f"field 'body.results' must be a list of at most {MAX_RESULTS} "
                        f"check results, got {_shown(results)}")
    for index, result in enumerate(results):
        where = f"body.results[{index}]"
        checked = _mapping(result, where)
        _name(checked.get("name"), f"{where}.name")
        _status(checked.get("status"), f"{where}.status")
        _text(checked.get("reason"), f"{where}.reason", MAX_TEXT_CHARS)
        _mapping(checked.get("evidence", {}), f"{where}.evidence")


_BODY_SCHEMA: dict[MessageKind, Callable[[Mapping[str, Any]], None]] = {
    MessageKind.HEARTBEAT: _heartbeat, MessageKind.METRICS: _metrics,
    MessageKind.REPORT: _report}
_STATUSES = frozenset(s.value for s in CheckStatus)


def _shown(value: object) -> str:
    """A peer's value for an error message: short, whatever it is."""
    try:
        text = repr(value)
    except ValueError:  # an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _invalid(f"field '{where}' must be a JSON object, got {_shown(value)}")
    return value


def _integer(value: object, where: str, low: int, high: int) -> int:
    # bool is an int in Python, and 1.0 or "1" is not what a sender writes.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _invalid(f"field '{where}' must be an integer {low}..{high}, "
                        f"got {_shown(value)}")
    return value


def _finite(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise _invalid(f"field '{where}' must be a finite number, got {_shown(value)}")
    return float(value)


def _text(value: object, where: str, limit: int) -> str:
    if not isinstance(value, str) or len(value) > limit:
        raise _invalid(f"field '{where}' must be a string of at most {limit} characters, "
                        f"got {_shown(value)}")
    return value


def _name(value: object, where: str) -> str:
    text = _text(value, where, MAX_NAME_CHARS)
    if not text or not text.isprintable():
        raise _invalid(f"field '{where}' must be a non-empty printable name, "
                        f"got {_shown(value)}")
    return text


def _status(value: object, where: str) -> None:
    if not isinstance(value, str) or value not in _STATUSES:
        raise _invalid(f"field '{where}' must be one of {sorted(_STATUSES)}, "
                        f"got {_shown(value)}")


class Sequencer:
    """Builds envelopes for one sender with increasing sequence numbers."""

    def __init__(self, sender: str) -> None:
        self.sender = sender
        self._seq = 0

    def next(self, kind: MessageKind, body: Mapping[str, Any]) -> HealthEnvelope:
        self._seq += 1
        return Envelope(kind, self.sender, self._seq, time.time(), body)
