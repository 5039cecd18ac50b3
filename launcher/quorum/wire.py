"""Wire format and authentication of quorum messages.

A message travels as two ZeroMQ frames, ``[data, mac]``:

* ``data`` = a fixed binary header (version, kind, sender, recipient,
  incarnation, nonce, wall-clock send time, term, sender address) followed by
  the message's binary body (``payload``);
* ``mac`` = HMAC-SHA256 with the per-job secret over a domain tag, the job id
  and ``data`` (``ftcore.ids.sign``), so a message is bound to this job and to
  every header field.

Receivers drop what fails the MAC, what is addressed to someone else, what is
older than ``max_age`` (``QuorumConfig.max_message_age``: a replay to a
receiver that never saw the original), and anything not newer than the highest
``(incarnation, nonce)`` already seen from that sender (a replay, or a zombie of
a replaced replica).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections import OrderedDict
from dataclasses import dataclass

from .model import Message
from .payload import Kind, decode_payload, encode_payload

VERSION = 2
BROADCAST = -1
DOMAIN = b"ftl-quorum/1"
_HEADER = struct.Struct("!BBiiQQdQH")
_MAC_BYTES = 32
#: ``Kind(code)`` without the enum call (a leader decodes 1,000 joins a round).
_KINDS = {kind.value: kind for kind in Kind}
#: Verified broadcasts kept for the other agents of the same loop: one verify
#: and one decode of a 1,000-member announcement per process, not per agent.
_CACHE_SIZE = 32
#: The longest address a member may announce. A replica advertises its ranks'
#: endpoints there (``launcher.worker.protocol``, ~48 bytes a rank with IPv4
#: addresses), so this allows ~1,300 ranks per replica; ``QuorumNode.request``
#: refuses a longer one with a clear error.
MAX_ADDRESS_BYTES = 64 * 1024
#: The most one member adds to a message: a delta announcement may carry a
#: removed id (4 bytes), an added entry (9 + address), a behind id and step
#: (12), a join sequence (4) and another id and sequence (12); a full
#: announcement carries less (17 + address + 12), a heartbeat's suspects 4.
_PER_MEMBER_BYTES = 41 + MAX_ADDRESS_BYTES
#: The header, the sender's own address (at most 64 KiB, a ``H`` field) and spare.
_FIXED_BYTES = 128 * 1024


def max_message_bytes(replicas: int) -> int:
    """The largest frame a job of ``replicas`` replicas legitimately sends. The
    ZeroMQ sockets end a connection that sends a larger one (``zmq.MAXMSGSIZE``)
    before buffering it, so a peer cannot make a receiver hold a frame of any
    size (3 replicas: 320 KiB; 1,000: 66 MB, where a real 1,000-member
    announcement of 8-rank replicas is ~0.4 MB)."""
    return _FIXED_BYTES + max(replicas, 1) * _PER_MEMBER_BYTES


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
        # ``ftcore.ids.sign(secret, DOMAIN, job, data)``, with the key schedule
        # and the constant parts hashed once: a leader checks 1,000 joins a round.
        self._prefix = hmac.new(bytes.fromhex(secret), digestmod=hashlib.sha256)
        for part in (DOMAIN, job_id.encode()):
            self._prefix.update(len(part).to_bytes(8, "big"))
            self._prefix.update(part)
        self._verified: OrderedDict[bytes, tuple[bytes, Envelope]] = OrderedDict()

    def seal(self, sender: int, to: int, incarnation: int, nonce: int, sent_at: float,
             address: str, message: Message) -> list[bytes]:
        kind, payload = encode_payload(message)
        addr = address.encode()
        header = _HEADER.pack(VERSION, kind, sender, to, incarnation, nonce, sent_at,
                              message.term, len(addr))
        data = header + addr + payload
        return [data, self._sign(data)]

    def _sign(self, data: bytes) -> bytes:
        mac = self._prefix.copy()
        mac.update(len(data).to_bytes(8, "big"))
        mac.update(data)
        return mac.digest()

    def open(self, frames: list[bytes]) -> Envelope:
        """Verify and decode; raises ``Rejected`` (malformed or bad signature)."""
        if len(frames) != 2 or len(frames[1]) != _MAC_BYTES or len(frames[0]) < _HEADER.size:
            raise Rejected(Rejection.MALFORMED, f"{len(frames)} frames")
        data, mac = frames
        cached = self._verified.get(mac)
        if cached is not None and cached[0] == data:
            return cached[1]
        if not hmac.compare_digest(self._sign(data), mac):
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
        message = decode_payload(_KINDS[kind], term, data[start + addr_len:])
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise Rejected(Rejection.MALFORMED, str(exc)) from None
    return Envelope(sender, to, incarnation, nonce, sent_at, address, message)


class ReplayGuard:
    """Per-receiver check of freshness and ordering of authenticated envelopes."""

    def __init__(self, me: int, max_age: float) -> None:
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
