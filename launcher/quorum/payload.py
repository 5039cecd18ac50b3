"""Binary bodies of quorum messages (the part after the envelope header).

Fixed-size ``struct`` fields and length-prefixed arrays, big-endian; no JSON:
a join is decoded 1,000 times a round on the leader, and a full announcement
carries 1,000 members. Decoders check every length, so a short or padded body
raises ``ValueError`` / ``struct.error`` (the codec reports it as malformed).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from typing import Any

from .model import (
    EndorseAnswered,
    EndorseRequested,
    Health,
    Heartbeat,
    HeartbeatAcked,
    JoinRequested,
    Message,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
    Standing,
    TimeoutNow,
    VoteAnswered,
    VoteRequested,
)


class Kind(enum.IntEnum):
    VOTE_REQUESTED = 1
    VOTE_ANSWERED = 2
    HEARTBEAT = 3
    HEARTBEAT_ACKED = 4
    JOIN_REQUESTED = 5
    QUORUM_ANNOUNCED = 6
    TIMEOUT_NOW = 7
    QUORUM_DELTA = 8
    ENDORSE_REQUESTED = 9
    ENDORSE_ANSWERED = 10


_HEALTH = tuple(Health)
_CODE = {h: i for i, h in enumerate(_HEALTH)}
_JOIN = struct.Struct("!qqqBB")         # next_step, last_quorum_id, join_seq, health, failed
_FULL = struct.Struct("!qiII")          # quorum_id, leader_id, members, answered
_MEMBER = struct.Struct("!iqBI")        # replica_id, next_step, health, address bytes
_DELTA = struct.Struct("!qiq16sIIIII")  # quorum_id, leader_id, max_step, digest, counts
_ENTRY = struct.Struct("!iBI")          # replica_id, health, address bytes
_ENDORSE = struct.Struct("!qqBI")       # step, quorum_id, required, members
_ENDORSED = struct.Struct("!qB")        # quorum_id, granted
_GRANT = struct.Struct("!qqi")          # standing quorum_id (0: none), through, ended_by
_NO_GRANT = _GRANT.pack(0, 0, -1)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def fields(self, layout: struct.Struct) -> tuple[Any, ...]:
        values = layout.unpack_from(self.data, self.at)
        self.at += layout.size
        return values

    def array(self, code: str, count: int) -> tuple[int, ...]:
        return self.fields(struct.Struct(f"!{count}{code}"))

    def text(self, size: int) -> str:
        end = self.at + size
        if end > len(self.data):
            raise ValueError("text runs past the end of the message")
        value = self.data[self.at:end].decode()
        self.at = end
        return value

    def done(self) -> None:
        if self.at != len(self.data):
            raise ValueError(f"{len(self.data) - self.at} bytes left over")


def _array(code: str, values: tuple[int, ...] | list[int]) -> bytes:
    return struct.pack(f"!{len(values)}{code}", *values)


def encode_payload(message: Message) -> tuple[Kind, bytes]:
    if isinstance(message, JoinRequested):
        return Kind.JOIN_REQUESTED, _JOIN.pack(
            message.next_step, message.last_quorum_id, message.join_seq,
            _CODE[message.health], message.commit_failed) + message.address.encode()
    if isinstance(message, QuorumDeltaAnnounced):
        return Kind.QUORUM_DELTA, _encode_delta(message)
    if isinstance(message, QuorumAnnounced):
        return Kind.QUORUM_ANNOUNCED, _encode_full(message)
    if isinstance(message, VoteRequested):
        return Kind.VOTE_REQUESTED, bytes([message.pre_vote, message.transfer])
    if isinstance(message, VoteAnswered):
        return Kind.VOTE_ANSWERED, bytes([message.granted, message.pre_vote])
    if isinstance(message, Heartbeat):
        grant = message.standing
        return Kind.HEARTBEAT, (
            _GRANT.pack(grant.quorum_id, grant.through,
                        -1 if grant.ended_by is None else grant.ended_by) if grant
            else _NO_GRANT) + _array("i", message.suspects)
    if isinstance(message, EndorseRequested):
        return Kind.ENDORSE_REQUESTED, _ENDORSE.pack(
            message.step, message.quorum_id, message.required,
            len(message.members)) + _array("i", message.members)
    if isinstance(message, EndorseAnswered):
        return Kind.ENDORSE_ANSWERED, _ENDORSED.pack(message.quorum_id, message.granted)
    if isinstance(message, (HeartbeatAcked, TimeoutNow)):
        kind = Kind.HEARTBEAT_ACKED if isinstance(message, HeartbeatAcked) else Kind.TIMEOUT_NOW
        return kind, b""
    raise TypeError(f"not a quorum message: {message!r}")


def decode_payload(kind: Kind, term: int, payload: bytes) -> Message:
    if kind is Kind.JOIN_REQUESTED:
        step, last, seq, health, failed = _JOIN.unpack_from(payload)
        address = payload[_JOIN.size:].decode()
        return JoinRequested(term, step, address, _HEALTH[health], last, seq, bool(failed))
    if kind is Kind.QUORUM_DELTA:
        return _decode_delta(term, _Reader(payload))
    if kind is Kind.QUORUM_ANNOUNCED:
        return _decode_full(term, _Reader(payload))
    if kind is Kind.VOTE_REQUESTED:
        return VoteRequested(term, pre_vote=bool(payload[0]), transfer=bool(payload[1]))
    if kind is Kind.VOTE_ANSWERED:
        return VoteAnswered(term, granted=bool(payload[0]), pre_vote=bool(payload[1]))
    if kind is Kind.HEARTBEAT:
        r = _Reader(payload)
        quorum_id, through, ended_by = r.fields(_GRANT)
        if (len(payload) - _GRANT.size) % 4:
            raise ValueError(f"a heartbeat of {len(payload)} bytes")
        suspects = r.array("i", (len(payload) - _GRANT.size) // 4)
        r.done()
        return Heartbeat(term, suspects, Standing(quorum_id, through,
                                                  None if ended_by < 0 else ended_by)
                         if quorum_id else None)
    if kind is Kind.HEARTBEAT_ACKED:
        return HeartbeatAcked(term)
    if kind is Kind.ENDORSE_REQUESTED:
        r = _Reader(payload)
        step, quorum_id, required, count = r.fields(_ENDORSE)
        members = r.array("i", count)
        r.done()
        return EndorseRequested(term, step, quorum_id, members, bool(required))
    if kind is Kind.ENDORSE_ANSWERED:
        r = _Reader(payload)
        quorum_id, granted = r.fields(_ENDORSED)
        r.done()
        return EndorseAnswered(term, quorum_id, bool(granted))
    return TimeoutNow(term)


def _encode_full(message: QuorumAnnounced) -> bytes:
    q = message.quorum
    parts = [_FULL.pack(q.quorum_id, q.leader_id, len(q.members), len(message.answered))]
    for m in q.members:
        address = m.address.encode()
        parts += (_MEMBER.pack(m.replica_id, m.next_step, _CODE[m.health], len(address)),
                  address)
    parts += (_array("i", list(message.answered)), _array("q", list(message.answered.values())))
    return b"".join(parts)


def _decode_full(term: int, r: _Reader) -> QuorumAnnounced:
    quorum_id, leader_id, count, answered = r.fields(_FULL)
    members = []
    for _ in range(count):
        replica_id, step, health, size = r.fields(_MEMBER)
        members.append(QuorumMember(replica_id, step, r.text(size), _HEALTH[health]))
    ids, seqs = r.array("i", answered), r.array("q", answered)
    r.done()
    quorum = Quorum.of(quorum_id, tuple(members), term=term, leader_id=leader_id)
    return QuorumAnnounced(term, quorum, dict(zip(ids, seqs, strict=True)))


def _encode_delta(d: QuorumDeltaAnnounced) -> bytes:
    parts = [_DELTA.pack(d.quorum_id, d.leader_id, d.max_step, d.digest, len(d.removed),
                         len(d.added), len(d.behind), len(d.seqs), len(d.others)),
             _array("i", d.removed)]
    for replica_id, address, health in d.added:
        text = address.encode()
        parts += (_ENTRY.pack(replica_id, _CODE[health], len(text)), text)
    parts += (_array("i", [r for r, _ in d.behind]), _array("q", [s for _, s in d.behind]),
              _array("I", d.seqs), _array("i", list(d.others)),
              _array("q", list(d.others.values())))
    return b"".join(parts)


def _decode_delta(term: int, r: _Reader) -> QuorumDeltaAnnounced:
    (quorum_id, leader_id, max_step, digest, removed, added, behind, seqs,
     others) = r.fields(_DELTA)
    removed_ids = r.array("i", removed)
    entries = []
    for _ in range(added):
        replica_id, health, size = r.fields(_ENTRY)
        entries.append((replica_id, r.text(size), _HEALTH[health]))
    behind_ids, behind_steps = r.array("i", behind), r.array("q", behind)
    seq_values = r.array("I", seqs)
    other_ids, other_seqs = r.array("i", others), r.array("q", others)
    r.done()
    other_map: Mapping[int, int] = dict(zip(other_ids, other_seqs, strict=True))
    return QuorumDeltaAnnounced(term, quorum_id, leader_id, max_step, digest,
                                removed_ids, tuple(entries),
                                tuple(zip(behind_ids, behind_steps, strict=True)),
                                seq_values, other_map)
