"""Wire format and authentication of quorum messages.

A message travels as two ZeroMQ frames, ``[data, mac]``:

* ``data`` = a fixed binary header (version, kind, sender, recipient,
  incarnation, nonce, wall-clock send time, term, sender address) followed by a
  small JSON or binary payload;
* ``mac`` = HMAC-SHA256 with the per-job secret over a domain tag, the job id
  and ``data`` (``ftcore.ids.sign``), so a message is bound to this job and to
  every header field.

Receivers drop what fails the MAC, what is addressed to someone else, what is
older than ``max_age`` (a replay to a receiver that never saw the original),
and anything not newer than the highest ``(incarnation, nonce)`` already seen
from that sender (a replay, or a zombie of a replaced replica).
"""

from __future__ import annotations

import enum
import hmac
import json
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ftcore.ids import sign

from .model import (
    Health,
    Heartbeat,
    HeartbeatAcked,
    JoinRequested,
    Message,
    Quorum,
    QuorumAnnounced,
    QuorumMember,
    TimeoutNow,
    VoteAnswered,
    VoteRequested,
)

VERSION = 1
BROADCAST = -1
DOMAIN = b"ftl-quorum/1"
_HEADER = struct.Struct("!BBiiQQdQH")
_MAC_BYTES = 32
#: Verified broadcasts kept for the other agents of the same loop: one verify
#: and one decode of a 1,000-member announcement per process, not per agent.
_CACHE_SIZE = 32


class Kind(enum.IntEnum):
    VOTE_REQUESTED = 1
    VOTE_ANSWERED = 2
    HEARTBEAT = 3
    HEARTBEAT_ACKED = 4
    JOIN_REQUESTED = 5
    QUORUM_ANNOUNCED = 6
    TIMEOUT_NOW = 7


class Rejection(enum.Enum):
    MALFORMED = "malformed"
    BAD_SIGNATURE = "bad_signature"
    NOT_FOR_ME = "not_for_me"
    EXPIRED = "expired"
    REPLAYED = "replayed"
    UNKNOWN_SENDER = "unknown_sender"


class Rejected(Exception):
    def __init__(self, reason: Rejection, detail: str = "") -> None:
        self.reason = reason
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)


@dataclass(frozen=True)
class Envelope:
    sender: int
    to: int
    incarnation: int
    nonce: int
    sent_at: float
    address: str
    message: Message


class Codec:
    """Seals and opens frames of one job. Stateless apart from a cache of
    verified broadcasts, so agents hosted by one loop may share it."""

    def __init__(self, secret: str, job_id: str = "") -> None:
        try:
            if len(bytes.fromhex(secret)) < 16:
                raise ValueError
        except ValueError:
            raise ValueError("the quorum secret must be at least 16 bytes, hex encoded "
                             "(ftcore.ids.new_job_secret())") from None
        self._secret = secret
        self._job = job_id.encode()
        self._verified: OrderedDict[bytes, tuple[bytes, Envelope]] = OrderedDict()

    def seal(self, sender: int, to: int, incarnation: int, nonce: int, sent_at: float,
             address: str, message: Message) -> list[bytes]:
        kind, payload = encode_payload(message)
        addr = address.encode()
        header = _HEADER.pack(VERSION, kind, sender, to, incarnation, nonce, sent_at,
                              message.term, len(addr))
        data = header + addr + payload
        return [data, sign(self._secret, DOMAIN, self._job, data)]

    def open(self, frames: list[bytes]) -> Envelope:
        """Verify and decode; raises ``Rejected`` (malformed or bad signature)."""
        if len(frames) != 2 or len(frames[1]) != _MAC_BYTES or len(frames[0]) < _HEADER.size:
            raise Rejected(Rejection.MALFORMED, f"{len(frames)} frames")
        data, mac = frames
        cached = self._verified.get(mac)
        if cached is not None and cached[0] == data:
            return cached[1]
        if not hmac.compare_digest(sign(self._secret, DOMAIN, self._job, data), mac):
            raise Rejected(Rejection.BAD_SIGNATURE)
        envelope = _decode(data)
        if envelope.to == BROADCAST:
            self._verified[mac] = (data, envelope)
            if len(self._verified) > _CACHE_SIZE:
                self._verified.popitem(last=False)
        return envelope


def _decode(data: bytes) -> Envelope:
    try:
        (version, kind, sender, to, incarnation, nonce, sent_at, term,
         addr_len) = _HEADER.unpack_from(data)
        if version != VERSION:
            raise Rejected(Rejection.MALFORMED, f"version {version}")
        start = _HEADER.size
        address = data[start:start + addr_len].decode()
        message = decode_payload(Kind(kind), term, data[start + addr_len:])
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise Rejected(Rejection.MALFORMED, str(exc)) from None
    return Envelope(sender, to, incarnation, nonce, sent_at, address, message)


class ReplayGuard:
    """Per-receiver check of freshness and ordering of authenticated envelopes."""

    def __init__(self, me: int, max_age: float = 30.0) -> None:
        self.me = me
        self.max_age = max_age
        self._highest: dict[int, tuple[int, int]] = {}

    def check(self, envelope: Envelope, wall_now: float) -> None:
        """Raise ``Rejected`` unless the envelope is for us, fresh and new."""
        if envelope.to not in (BROADCAST, self.me):
            raise Rejected(Rejection.NOT_FOR_ME, f"to {envelope.to}")
        if abs(wall_now - envelope.sent_at) > self.max_age:
            raise Rejected(Rejection.EXPIRED, f"sent {wall_now - envelope.sent_at:.1f}s ago")
        key = (envelope.incarnation, envelope.nonce)
        if key <= self._highest.get(envelope.sender, (-1, -1)):
            raise Rejected(Rejection.REPLAYED, f"from {envelope.sender} at {key}")
        self._highest[envelope.sender] = key


# --------------------------------------------------------------------------- payloads


def encode_payload(message: Message) -> tuple[Kind, bytes]:
    if isinstance(message, VoteRequested):
        return Kind.VOTE_REQUESTED, bytes([message.pre_vote, message.transfer])
    if isinstance(message, VoteAnswered):
        return Kind.VOTE_ANSWERED, bytes([message.granted, message.pre_vote])
    if isinstance(message, Heartbeat):
        return Kind.HEARTBEAT, struct.pack(f"!{len(message.suspects)}i", *message.suspects)
    if isinstance(message, (HeartbeatAcked, TimeoutNow)):
        kind = Kind.HEARTBEAT_ACKED if isinstance(message, HeartbeatAcked) else Kind.TIMEOUT_NOW
        return kind, b""
    if isinstance(message, JoinRequested):
        return Kind.JOIN_REQUESTED, _json({
            "s": message.next_step, "a": message.address, "h": message.health.value,
            "q": message.last_quorum_id, "j": message.join_seq, "c": message.commit_failed})
    if isinstance(message, QuorumAnnounced):
        q = message.quorum
        return Kind.QUORUM_ANNOUNCED, _json({
            "q": q.quorum_id, "l": q.leader_id,
            "m": [[m.replica_id, m.next_step, m.address, m.health.value] for m in q.members],
            "j": [[r, seq] for r, seq in message.answered.items()]})
    raise TypeError(f"not a quorum message: {message!r}")


def decode_payload(kind: Kind, term: int, payload: bytes) -> Message:
    if kind is Kind.VOTE_REQUESTED:
        return VoteRequested(term, pre_vote=bool(payload[0]), transfer=bool(payload[1]))
    if kind is Kind.VOTE_ANSWERED:
        return VoteAnswered(term, granted=bool(payload[0]), pre_vote=bool(payload[1]))
    if kind is Kind.HEARTBEAT:
        return Heartbeat(term, struct.unpack(f"!{len(payload) // 4}i", payload))
    if kind is Kind.HEARTBEAT_ACKED:
        return HeartbeatAcked(term)
    if kind is Kind.TIMEOUT_NOW:
        return TimeoutNow(term)
    body: dict[str, Any] = json.loads(payload)
    if kind is Kind.JOIN_REQUESTED:
        return JoinRequested(term, int(body["s"]), str(body["a"]), Health(body["h"]),
                             int(body["q"]), int(body["j"]), bool(body["c"]))
    members = tuple(QuorumMember(int(r), int(step), str(addr), Health(h))
                    for r, step, addr, h in body["m"])
    quorum = Quorum.of(int(body["q"]), members, term=term, leader_id=int(body["l"]))
    return QuorumAnnounced(term, quorum, {int(r): int(seq) for r, seq in body["j"]})


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
