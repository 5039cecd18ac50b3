"""Wire format and authentication of quorum messages.

A message travels as two ZeroMQ frames, ``[data, mac]``: ``data`` is a fixed
binary header (version, kind, sender, recipient, incarnation, nonce, wall-clock
send time, term, sender address) and the message's binary body; ``mac`` is
HMAC-SHA256 with the per-job secret over a domain tag, the job id and ``data``
(``ft_launch.envelope.Seal``), so a message is bound to this job and to every
header field. Bodies are ``struct`` fields and length-prefixed arrays, no JSON:
a leader decodes 1,000 joins a round. Decoders check every length, so a short
or padded body is refused as malformed, never misread.

Receivers drop what fails the MAC, what is addressed to someone else, what is
older than ``max_age`` (``QuorumConfig.max_message_age``), and anything not newer
than the highest ``(incarnation, nonce)`` seen from that sender (a replay, or a
zombie of a replaced replica): ``ft_launch.envelope.ReplayGuard``.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

from ft_launch.envelope import BROADCAST, Rejected, Rejection, ReplayGuard, Seal
from ft_launch.envelope import Envelope as SignedEnvelope

from .model import (
    EndorseAnswered,
    EndorseRequested,
    Heartbeat,
    HeartbeatAcked,
    JoinRequested,
    Message,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
    Standing,
    VoteAnswered,
    VoteRequested,
)

__all__ = ["BROADCAST", "DOMAIN", "MAX_ADDRESS_BYTES", "Codec", "Envelope", "Rejected",
           "Rejection", "ReplayGuard", "max_message_bytes"]

VERSION = 5
DOMAIN = b"ftl-quorum/1"
# version, kind, sender, to, incarnation, nonce, sent_at, term, address bytes
_HEADER = struct.Struct("!BBiiQQdQH")
#: The longest address a member may announce. A replica advertises its ranks'
#: endpoints there (``ft_launch.launcher.worker.protocol``, ~48 bytes a rank with IPv4),
#: so this allows ~1,300 ranks per replica; ``QuorumAgent`` refuses a longer one.
MAX_ADDRESS_BYTES = 64 * 1024
#: The most one member adds to a message: a delta may carry a removed id (4), an
#: added entry (8 + address), a behind id and step (12) and a sequence (4).
_PER_MEMBER_BYTES = 28 + MAX_ADDRESS_BYTES
#: The header, the sender's address and spare.
_FIXED_BYTES = 128 * 1024


def max_message_bytes(replicas: int) -> int:
    """The largest frame a job of ``replicas`` replicas legitimately sends. The
    sockets end a connection that sends a larger one (``zmq.MAXMSGSIZE``) before
    buffering it, so a peer cannot make a receiver hold a frame of any size."""
    return _FIXED_BYTES + max(replicas, 1) * _PER_MEMBER_BYTES


class Kind(enum.IntEnum):
    VOTE_REQUESTED = 1
    VOTE_ANSWERED = 2
    HEARTBEAT = 3
    HEARTBEAT_ACKED = 4
    JOIN_REQUESTED = 5
    QUORUM_ANNOUNCED = 6
    QUORUM_DELTA = 8
    ENDORSE_REQUESTED = 9
    ENDORSE_ANSWERED = 10


_KIND_OF = {VoteRequested: Kind.VOTE_REQUESTED, VoteAnswered: Kind.VOTE_ANSWERED,
            Heartbeat: Kind.HEARTBEAT, HeartbeatAcked: Kind.HEARTBEAT_ACKED,
            JoinRequested: Kind.JOIN_REQUESTED, QuorumAnnounced: Kind.QUORUM_ANNOUNCED,
            QuorumDeltaAnnounced: Kind.QUORUM_DELTA, EndorseRequested: Kind.ENDORSE_REQUESTED,
            EndorseAnswered: Kind.ENDORSE_ANSWERED}
_JOIN = struct.Struct("!qqqB")          # next_step, last_quorum_id, join_seq, commit failed
_FULL = struct.Struct("!qiI")           # quorum_id, leader_id, members
_MEMBER = struct.Struct("!iqqI")        # replica_id, next_step, join_seq, address bytes
_DELTA = struct.Struct("!qiq16sIIII")   # quorum_id, leader_id, max_step, digest, counts
_ENTRY = struct.Struct("!iI")           # replica_id, address bytes
_ENDORSE = struct.Struct("!qqBI")       # step, quorum_id, required, members
_ENDORSED = struct.Struct("!qB")        # quorum_id, granted
_GRANT = struct.Struct("!qqi")          # standing quorum_id (0: none), through, ended_by
_FLAGS = struct.Struct("!BB")


class _Reader:
    """Reads a body front to back; every read checks the length left."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def fields(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def array(self, code: str, count: int) -> tuple[int, ...]:
        return self.fields(struct.Struct(f"!{count}{code}"))

    def text(self, size: int) -> str:
        if self.at + size > len(self.data):
            raise ValueError("text runs past the end of the message")
        self.at += size
        return self.data[self.at - size:self.at].decode()

    def done(self) -> None:
        if self.at != len(self.data):
            raise ValueError(f"{len(self.data) - self.at} bytes left over")


def _array(code: str, values: tuple[int, ...] | list[int]) -> bytes:
    return struct.pack(f"!{len(values)}{code}", *values)


def encode_body(m: Message) -> bytes:
    if isinstance(m, JoinRequested):
        return _JOIN.pack(m.next_step, m.last_quorum_id, m.join_seq, m.commit_failed) + \
            m.address.encode()
    if isinstance(m, QuorumAnnounced):
        q = m.quorum
        parts = [_FULL.pack(q.quorum_id, q.leader_id, len(q.members))]
        for member in q.members:
            address = member.address.encode()
            parts += (_MEMBER.pack(member.replica_id, member.next_step,
                                   m.answered.get(member.replica_id, 0), len(address)), address)
        return b"".join(parts)
    if isinstance(m, QuorumDeltaAnnounced):
        parts = [_DELTA.pack(m.quorum_id, m.leader_id, m.max_step, m.digest, len(m.removed),
                             len(m.added), len(m.behind), len(m.seqs)), _array("i", m.removed)]
        for replica_id, address in m.added:
            text = address.encode()
            parts += (_ENTRY.pack(replica_id, len(text)), text)
        parts += (_array("i", [r for r, _ in m.behind]), _array("q", [s for _, s in m.behind]),
                  _array("I", m.seqs))
        return b"".join(parts)
    if isinstance(m, (VoteRequested, VoteAnswered)):
        return _FLAGS.pack(m.pre_vote, getattr(m, "granted", False))
    if isinstance(m, Heartbeat):
        g = m.standing or Standing(0, 0)
        return _GRANT.pack(g.quorum_id, g.through, -1 if g.ended_by is None else g.ended_by) \
            + _array("i", m.suspects)
    if isinstance(m, EndorseRequested):
        return _ENDORSE.pack(m.step, m.quorum_id, m.required, len(m.members)) + \
            _array("i", m.members)
    if isinstance(m, EndorseAnswered):
        return _ENDORSED.pack(m.quorum_id, m.granted)
    return b""  # HeartbeatAcked: the term is in the header


def decode_body(kind: Kind, term: int, body: bytes) -> Message:
    r = _Reader(body)
    message: Message
    if kind is Kind.JOIN_REQUESTED:
        step, last, seq, failed = r.fields(_JOIN)
        message = JoinRequested(term, step, r.text(len(body) - r.at), last, seq, bool(failed))
    elif kind is Kind.QUORUM_ANNOUNCED:
        quorum_id, leader_id, count = r.fields(_FULL)
        members, answered = [], {}
        for _ in range(count):
            replica_id, step, seq, size = r.fields(_MEMBER)
            members.append(QuorumMember(replica_id, step, r.text(size)))
            answered[replica_id] = seq
        quorum = Quorum.of(quorum_id, members, term=term, leader_id=leader_id)
        message = QuorumAnnounced(term, quorum, answered)
    elif kind is Kind.QUORUM_DELTA:
        quorum_id, leader_id, max_step, digest, removed, added, behind, seqs = r.fields(_DELTA)
        removed_ids = r.array("i", removed)
        entries = []
        for _ in range(added):
            replica_id, size = r.fields(_ENTRY)
            entries.append((replica_id, r.text(size)))
        behind_ids, behind_steps = r.array("i", behind), r.array("q", behind)
        message = QuorumDeltaAnnounced(term, quorum_id, leader_id, max_step, digest,
                                       removed_ids, tuple(entries),
                                       tuple(zip(behind_ids, behind_steps, strict=True)),
                                       r.array("I", seqs))
    elif kind in (Kind.VOTE_REQUESTED, Kind.VOTE_ANSWERED):
        pre_vote, granted = r.fields(_FLAGS)
        message = VoteRequested(term, bool(pre_vote)) if kind is Kind.VOTE_REQUESTED \
            else VoteAnswered(term, bool(granted), bool(pre_vote))
    elif kind is Kind.HEARTBEAT:
        quorum_id, through, ended_by = r.fields(_GRANT)
        if (len(body) - _GRANT.size) % 4:
            raise ValueError(f"a heartbeat of {len(body)} bytes")
        suspects = r.array("i", (len(body) - _GRANT.size) // 4)
        grant = Standing(quorum_id, through, None if ended_by < 0 else ended_by)
        message = Heartbeat(term, suspects, grant if quorum_id else None)
    elif kind is Kind.ENDORSE_REQUESTED:
        step, quorum_id, required, count = r.fields(_ENDORSE)
        message = EndorseRequested(term, step, quorum_id, r.array("i", count), bool(required))
    elif kind is Kind.ENDORSE_ANSWERED:
        quorum_id, granted = r.fields(_ENDORSED)
        message = EndorseAnswered(term, quorum_id, bool(granted))
    else:
        message = HeartbeatAcked(term)
    r.done()
    return message


@dataclass(frozen=True)
class Envelope(SignedEnvelope[int, Message]):
    """A quorum message: the shared envelope (``seq`` the sender's nonce, ``body``
    its ``Message``) and the address the sender listens on."""

    address: str = ""


class Codec:
    """Seals and opens the frames of one job's quorum messages."""

    def __init__(self, secret: str, job_id: str = "") -> None:
        self._seal = Seal(secret, DOMAIN, job_id.encode())

    def seal(self, sender: int, to: int, incarnation: int, nonce: int, sent_at: float,
             address: str, message: Message) -> list[bytes]:
        addr = address.encode()
        header = _HEADER.pack(VERSION, _KIND_OF[type(message)], sender, to, incarnation, nonce,
                              sent_at, message.term, len(addr))
        return self._seal.seal(header + addr + encode_body(message))

    def open(self, frames: list[bytes]) -> Envelope:
        """Verify and decode; raises ``Rejected`` (malformed or bad signature)."""
        (data,) = self._seal.open(frames)
        try:
            (version, code, sender, to, incarnation, nonce, sent_at, term,
             addr_len) = _HEADER.unpack_from(data)
            if version != VERSION:
                raise ValueError(f"version {version}, expected {VERSION}")
            start = _HEADER.size
            address = data[start:start + addr_len].decode()
            kind = Kind(code)
            message = decode_body(kind, term, data[start + addr_len:])
        except (ValueError, struct.error) as exc:
            raise Rejected(Rejection.MALFORMED, f"undecodable: {exc}") from None
        return Envelope(kind, sender, nonce, sent_at, message, to, incarnation, address)
