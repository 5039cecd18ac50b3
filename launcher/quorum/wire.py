"""Wire format and authentication of quorum messages.

A message travels as two ZeroMQ frames, ``[data, mac]``:

* ``data`` = a fixed binary header (version, kind, sender, recipient,
  incarnation, nonce, wall-clock send time, term, flags, sender address, the
  sender's feed address) followed by the message's binary body (``payload``);
* ``mac`` = HMAC-SHA256 with the per-job secret over a domain tag, the job id
  and ``data`` (``ft_launch.envelope.Seal``), so a message is bound to this job and
  to every header field.

A leader also publishes its broadcasts once on its *feed* (a PUB socket; the
``AgentLoop`` of each process holds one SUB and hands a message to every agent
it hosts that follows that leader): frames ``[topic, data, mac]``, ``topic``
the feed's address, sealed under another domain tag (``FEED_DOMAIN``) so that a
message taken from one channel never opens on the other. Each channel has its
own replay guard at the receiver (the two TCP streams do not keep one order
between them); the sender's nonces rise across both.

Receivers drop what fails the MAC, what is addressed to someone else, what is
older than ``max_age`` (``QuorumConfig.max_message_age``: a replay to a
receiver that never saw the original), and anything not newer than the highest
``(incarnation, nonce)`` already seen from that sender (a replay, or a zombie of
a replaced replica): ``ft_launch.envelope.ReplayGuard``, shared with the health
channel. What is quorum-specific is the header and the payload.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from dataclasses import dataclass

from ft_launch.envelope import BROADCAST, Rejected, Rejection, ReplayGuard, Seal
from ft_launch.envelope import Envelope as SignedEnvelope

from .model import Message
from .payload import Kind, decode_payload, encode_payload

__all__ = ["BROADCAST", "DOMAIN", "FEED_DOMAIN", "MAX_ADDRESS_BYTES", "ON_FEED", "Codec", "Envelope", "Rejected",
           "Rejection", "ReplayGuard", "max_message_bytes"]

VERSION = 4
DOMAIN = b"ftl-quorum/1"
FEED_DOMAIN = b"ftl-quorum-feed/1"
# version, kind, sender, to, incarnation, nonce, sent_at, term, address bytes,
# flags, feed address bytes
_HEADER = struct.Struct("!BBiiQQdQHBH")
#: Flag: the sender receives the recipient's feed (``QuorumNode`` routes by it).
ON_FEED = 1
#: ``Kind(code)`` without the enum call (a leader decodes 1,000 joins a round).
_KINDS = {kind.value: kind for kind in Kind}
#: Verified broadcasts kept for the other agents of the same loop: one verify
#: and one decode of a 1,000-member announcement per process, not per agent.
_CACHE_SIZE = 32
#: The longest address a member may announce. A replica advertises its ranks'
#: endpoints there (``ft_launch.launcher.worker.protocol``, ~48 bytes a rank with IPv4
#: addresses), so this allows ~1,300 ranks per replica; ``QuorumNode.request``
#: refuses a longer one with a clear error.
MAX_ADDRESS_BYTES = 64 * 1024
#: The most one member adds to a message: a delta announcement may carry a
#: removed id (4 bytes), an added entry (9 + address), a behind id and step
#: (12), a join sequence (4) and another id and sequence (12); a full
#: announcement carries less (17 + address + 12), a heartbeat's suspects 4.
_PER_MEMBER_BYTES = 41 + MAX_ADDRESS_BYTES
#: The header, the sender's own and feed addresses (``H`` fields, endpoints of
#: tens of bytes in practice) and spare.
_FIXED_BYTES = 128 * 1024


def max_message_bytes(replicas: int) -> int:
    """The largest frame a job of ``replicas`` replicas legitimately sends. The
    ZeroMQ sockets end a connection that sends a larger one (``zmq.MAXMSGSIZE``)
    before buffering it, so a peer cannot make a receiver hold a frame of any
    size (3 replicas: 320 KiB; 1,000: 66 MB, where a real 1,000-member
    announcement of 8-rank replicas is ~0.4 MB)."""
    return _FIXED_BYTES + max(replicas, 1) * _PER_MEMBER_BYTES


@dataclass(frozen=True)
class Envelope(SignedEnvelope[int, Message]):
    """A quorum message: the shared envelope (``seq`` is the sender's nonce, ``body``
    its ``Message``), the address the sender listens on, its feed's address
    (empty unless it publishes one) and whether it receives the recipient's feed."""

    address: str = ""
    feed: str = ""
    on_feed: bool = False

    @property
    def message(self) -> Message:
        return self.body

    @property
    def nonce(self) -> int:
        return self.seq


class Codec:
    """Seals and opens frames of one job, on either channel (``feed=True``: the
    leader's feed). Stateless apart from a cache of verified broadcasts, so
    agents hosted by one loop may share it."""

    def __init__(self, secret: str, job_id: str = "") -> None:
        self._seal = Seal(secret, DOMAIN, job_id.encode())
        self._feed_seal = Seal(secret, FEED_DOMAIN, job_id.encode())
        self._verified: OrderedDict[tuple[bool, bytes], tuple[bytes, Envelope]] = OrderedDict()

    def seal(self, sender: int, to: int, incarnation: int, nonce: int, sent_at: float,
             address: str, message: Message, *, feed_address: str = "",
             on_feed: bool = False, feed: bool = False) -> list[bytes]:
        kind, payload = encode_payload(message)
        addr, feed_addr = address.encode(), feed_address.encode()
        header = _HEADER.pack(VERSION, kind, sender, to, incarnation, nonce, sent_at,
                              message.term, len(addr), ON_FEED if on_feed else 0,
                              len(feed_addr))
        return (self._feed_seal if feed else self._seal).seal(header + addr + feed_addr + payload)

    def _sign(self, data: bytes) -> bytes:
        return self._seal.sign(data)

    def open(self, frames: list[bytes], *, feed: bool = False) -> Envelope:
        """Verify and decode; raises ``Rejected`` (malformed or bad signature)."""
        seal = self._feed_seal if feed else self._seal
        (data,) = seal.check_shape(frames)
        if len(data) < _HEADER.size:
            raise Rejected(Rejection.MALFORMED, f"a message of {len(data)} bytes, shorter "
                           f"than the {_HEADER.size}-byte header")
        key = (feed, frames[1])
        cached = self._verified.get(key)
        if cached is not None and cached[0] == data:
            return cached[1]
        seal.verify((data,), frames[1])
        envelope = _decode(data)
        if envelope.to == BROADCAST:
            self._verified[key] = (data, envelope)
            if len(self._verified) > _CACHE_SIZE:
                self._verified.popitem(last=False)
        return envelope


def _decode(data: bytes) -> Envelope:
    try:
        (version, code, sender, to, incarnation, nonce, sent_at, term, addr_len, flags,
         feed_len) = _HEADER.unpack_from(data)
    except struct.error as exc:
        raise Rejected(Rejection.MALFORMED, f"undecodable header: {exc}") from None
    if version != VERSION:
        raise Rejected(Rejection.MALFORMED, f"version {version}, expected {VERSION}")
    start = _HEADER.size
    body = start + addr_len + feed_len
    try:
        address = data[start:start + addr_len].decode()
        feed = data[start + addr_len:body].decode()
        kind = _KINDS[code]
        message = decode_payload(kind, term, data[body:])
    except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
        raise Rejected(Rejection.MALFORMED, f"undecodable: {exc}") from None
    return Envelope(kind, sender, nonce, sent_at, message, to, incarnation, address, feed,
                    bool(flags & ON_FEED))
