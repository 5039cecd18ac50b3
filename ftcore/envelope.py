"""The signed envelope every message channel uses, and its replay guard.

A message travels as ZeroMQ frames ``[*parts, mac]``, or ``[domain, *parts,
mac]`` for a *tagged* channel (its first frame names it, so a stray message of
another protocol is told from a forgery). ``mac`` is HMAC-SHA256 with the
per-job secret over the channel's domain tag, its context (e.g. the job id)
and every part, each length-prefixed: exactly ``ft_launch.ids.sign(secret,
domain, *context, *parts)``. A message is thereby bound to its channel, to its
job and to every byte of every part; what the parts hold (a binary header, a
JSON body) is the channel's own business.

``Seal`` signs and opens such frames; it refuses what has the wrong shape or is
larger than the channel allows *before* hashing it. ``Envelope`` is what an
opened message says about itself (its channel decodes it): who sent it, to
whom, in which order, when, and the channel's message. ``ReplayGuard`` then
accepts each sender's envelopes only in rising ``(incarnation, seq)`` order,
optionally only those addressed to the receiver and sent within ``max_age``
seconds, remembering a bounded number of senders.

Everything a receiver drops is a ``Rejected`` naming one ``Rejection`` reason,
so channels count drops by reason and never raise a peer's mistake further.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

#: ``Envelope.to`` of a message for every receiver (and of a channel without recipients).
BROADCAST = -1
MAC_BYTES = 32
#: The shortest job secret accepted (``ft_launch.ids.new_job_secret`` makes 32 bytes).
MIN_SECRET_BYTES = 16
#: Senders whose last ``(incarnation, seq)`` a guard remembers; beyond it the least
#: recently heard is forgotten. Only a secret holder can add senders, so memory is
#: bounded while a replayed recording, which adds none, cannot push a live sender out.
MAX_SENDERS = 65536


class Rejection(enum.Enum):
    """Why a message was dropped (channels count each)."""

    MALFORMED = "malformed"            # not this channel's frames, or too large to check
    BAD_SIGNATURE = "bad_signature"
    INVALID = "invalid"                # signed, but a field is missing, mistyped or out of range
    NOT_FOR_ME = "not_for_me"
    EXPIRED = "expired"
    REPLAYED = "replayed"
    UNKNOWN_SENDER = "unknown_sender"


class Rejected(ValueError):
    """A message that must be dropped, and why. The text says what was wrong."""

    def __init__(self, reason: Rejection, detail: str = "") -> None:
        self.reason = reason
        super().__init__(detail or reason.value)


SenderT = TypeVar("SenderT", bound=Hashable)
BodyT = TypeVar("BodyT")


@dataclass(frozen=True)
class Envelope(Generic[SenderT, BodyT]):
    """One authenticated message, as its channel decoded it."""

    kind: enum.Enum            # the channel's message kind
    sender: SenderT            # a replica id, a sender name
    seq: int                   # rises with every message of one sender incarnation
    sent_at: float             # the sender's wall clock (seconds since the epoch)
    body: BodyT                # the channel's message
    to: int = BROADCAST        # the recipient
    incarnation: int = 0       # rises when a sender restarts under the same id


class Seal:
    """Signs and opens the frames of one channel of one job.

    ``parts``: how many frames a message carries between the tag and the MAC;
    ``max_part_bytes``: the largest part accepted (checked before hashing)."""

    def __init__(self, secret: str, domain: bytes, *context: bytes, parts: int = 1,
                 tagged: bool = False, max_part_bytes: int | None = None) -> None:
        try:
            key = bytes.fromhex(secret)
        except (ValueError, TypeError):
            key = b""
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"the job secret of {domain.decode(errors='replace')} messages "
                             f"must be at least {MIN_SECRET_BYTES} bytes, hex encoded "
                             f"(ft_launch.ids.new_job_secret())")
        self.domain = domain
        self.parts = parts
        self.tagged = tagged
        self.max_part_bytes = max_part_bytes
        # ``ft_launch.ids.sign`` with the key schedule and the constant parts hashed once:
        # a quorum leader checks 1,000 joins a round.
        self._prefix = hmac.new(key, digestmod=hashlib.sha256)
        for part in (domain, *context):
            self._absorb(self._prefix, part)

    @staticmethod
    def _absorb(mac: hmac.HMAC, part: bytes) -> None:
        mac.update(len(part).to_bytes(8, "big"))
        mac.update(part)

    def sign(self, *parts: bytes) -> bytes:
        mac = self._prefix.copy()
        for part in parts:
            self._absorb(mac, part)
        return mac.digest()

    def seal(self, *parts: bytes) -> list[bytes]:
        if len(parts) != self.parts:
            raise ValueError(f"a {self.domain.decode()} message has {self.parts} parts, "
                             f"got {len(parts)}")
        return [*((self.domain,) if self.tagged else ()), *parts, self.sign(*parts)]

    def check_shape(self, frames: Sequence[bytes]) -> list[bytes]:
        """The parts of ``frames``, unverified; ``Rejected`` (malformed) for the wrong
        number of frames, another channel's tag, a part too large or a short MAC."""
        expected = self.parts + 1 + self.tagged
        if len(frames) != expected or (self.tagged and frames[0] != self.domain):
            raise Rejected(Rejection.MALFORMED, f"not a {self.domain.decode()} message "
                           f"({len(frames)} frames, expected {expected})")
        parts = list(frames[self.tagged:-1])
        if self.max_part_bytes is not None and \
                max(len(part) for part in parts) > self.max_part_bytes:
            raise Rejected(Rejection.MALFORMED, f"a frame exceeds {self.max_part_bytes} bytes")
        if len(frames[-1]) != MAC_BYTES:
            raise Rejected(Rejection.MALFORMED, f"a MAC of {len(frames[-1])} bytes, "
                           f"expected {MAC_BYTES}")
        return parts

    def verify(self, parts: Sequence[bytes], mac: bytes) -> None:
        if not hmac.compare_digest(self.sign(*parts), mac):
            raise Rejected(Rejection.BAD_SIGNATURE,
                           f"bad signature: not a {self.domain.decode()} message of this job "
                           f"(another secret or job, or altered on the way)")

    def open(self, frames: Sequence[bytes]) -> list[bytes]:
        """The verified parts; ``Rejected`` (malformed, bad signature) for anything else."""
        parts = self.check_shape(frames)
        self.verify(parts, frames[-1])
        return parts


class ReplayGuard:
    """Per-receiver freshness and ordering of authenticated envelopes.

    Accepts an envelope only if it is addressed to ``me`` or to everyone (when
    ``me`` is given), was sent within ``max_age`` seconds of the receiver's
    wall clock (when given: a replay to a receiver that never saw the original),
    and is newer than anything seen from its sender: ``(incarnation, seq)``
    above the highest so far (a repeat, an older message, or a zombie of a
    replaced sender is not)."""

    def __init__(self, me: int | None = None, max_age: float | None = None,
                 max_senders: int = MAX_SENDERS) -> None:
        self.me = me
        self.max_age = max_age
        self.max_senders = max_senders
        self._highest: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()

    def check(self, envelope: Envelope[SenderT, BodyT], wall_now: float | None = None) -> None:
        """Record the envelope, or raise ``Rejected`` (not for me, expired, replayed)."""
        if self.me is not None and envelope.to not in (BROADCAST, self.me):
            raise Rejected(Rejection.NOT_FOR_ME,
                           f"addressed to {envelope.to}, not to {self.me}")
        if self.max_age is not None:
            if wall_now is None:
                raise ValueError("a ReplayGuard with max_age needs the receiver's wall_now")
            age = wall_now - envelope.sent_at
            if abs(age) > self.max_age:
                raise Rejected(Rejection.EXPIRED, f"sent {age:.1f}s ago, outside the "
                               f"{self.max_age:g}s window (replayed, or clocks apart)")
        key = (envelope.incarnation, envelope.seq)
        highest = self._highest.get(envelope.sender)
        if highest is not None and key <= highest:
            raise Rejected(Rejection.REPLAYED, f"replayed: (incarnation, seq) {key} from "
                           f"{envelope.sender!r}, already at {highest}")
        self._highest[envelope.sender] = key
        self._highest.move_to_end(envelope.sender)
        if len(self._highest) > self.max_senders:
            self._highest.popitem(last=False)

    def accept(self, envelope: Envelope[SenderT, BodyT], wall_now: float | None = None) -> bool:
        """``check`` as a yes or no."""
        try:
            self.check(envelope, wall_now)
        except Rejected:
            return False
        return True
