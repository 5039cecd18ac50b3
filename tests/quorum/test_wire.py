"""Wire format and authentication: round trips, forgeries, replays."""

from __future__ import annotations

import struct
import time

import pytest

from ft_launch.ids import new_job_secret
from ft_launch.launcher.quorum.model import (
    Heartbeat,
    HeartbeatAcked,
    JoinRequested,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
    Standing,
    VoteAnswered,
    VoteRequested,
)
from ft_launch.launcher.quorum.wire import (
    BROADCAST,
    Codec,
    Kind,
    Rejected,
    Rejection,
    ReplayGuard,
    decode_body,
)

SECRET = new_job_secret()
JOB = "job-42"
ADDRESS = "tcp://127.0.0.1:5555"

MESSAGES = [
    VoteRequested(3, pre_vote=True),
    VoteRequested(4),
    VoteAnswered(4, granted=True, pre_vote=False),
    Heartbeat(5, suspects=(2, 7)),
    Heartbeat(5),
    Heartbeat(5, suspects=(3,), standing=Standing(9, 1_234_567)),
    Heartbeat(5, standing=Standing(9, 1_234_567, ended_by=4)),
    HeartbeatAcked(6),
    JoinRequested(6, 120, "tcp://h:1", 9, 1_700_000_000_000_000_001, True),
    QuorumAnnounced(7, Quorum.of(9, (QuorumMember(0, 12, "tcp://a:1"),
                                     QuorumMember(3, 11, "tcp://b:2")),
                                 term=7, leader_id=0), {0: 5, 3: 1_700_000_000_000_000_002}),
    JoinRequested(6, 121, "", 9, 2, False),  # address left out: leader has it
    QuorumDeltaAnnounced(7, 10, 0, 12, bytes(range(16)), removed=(2, 5),
                         added=((3, "tcp://c:3"),), behind=((3, 11),),
                         seqs=(5, 4_294_967_295, 8)),
]


def seal(message: object, *, codec: Codec | None = None, sender: int = 1, to: int = 2,
         incarnation: int = 100, nonce: int = 1, sent_at: float | None = None) -> list[bytes]:
    codec = codec or Codec(SECRET, JOB)
    return codec.seal(sender, to, incarnation, nonce,
                      time.time() if sent_at is None else sent_at, ADDRESS, message)  # type: ignore[arg-type]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: object) -> None:
    envelope = Codec(SECRET, JOB).open(seal(message, incarnation=77, nonce=9))
    assert envelope.body == message
    assert (envelope.sender, envelope.to, envelope.incarnation, envelope.seq,
            envelope.address) == (1, 2, 77, 9, ADDRESS)


FORGERIES = {
    "another secret": lambda f: Codec(new_job_secret(), JOB).seal(
        1, 2, 100, 1, time.time(), ADDRESS, VoteRequested(99)),
    "another job": lambda f: Codec(SECRET, "job-43").seal(
        1, 2, 100, 1, time.time(), ADDRESS, VoteRequested(99)),
    "a flipped header bit": lambda f: [bytes([f[0][0], f[0][1] ^ 1]) + f[0][2:], f[1]],
    "a changed term": lambda f: [f[0][:41] + bytes([f[0][41] ^ 0x40]) + f[0][42:], f[1]],
    "a truncated mac": lambda f: [f[0], f[1][:16]],
    "one frame": lambda f: [f[0]],
    "garbage": lambda f: [b"\x00" * 10, b"\x00" * 32],
}


@pytest.mark.parametrize("name", FORGERIES)
def test_forgeries_are_rejected(name: str) -> None:
    frames = FORGERIES[name](seal(VoteRequested(3)))
    with pytest.raises(Rejected) as caught:
        Codec(SECRET, JOB).open(frames)
    assert caught.value.reason in (Rejection.BAD_SIGNATURE, Rejection.MALFORMED)


def test_secret_must_be_long_enough() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        Codec("abcd", JOB)


def test_replay_guard() -> None:
    codec = Codec(SECRET, JOB)
    guard = ReplayGuard(me=2, max_age=30.0)
    now = time.time()

    def check(**kw: object) -> Rejection | None:
        try:
            guard.check(codec.open(seal(HeartbeatAcked(1), codec=codec, **kw)), now)  # type: ignore[arg-type]
        except Rejected as exc:
            return exc.reason
        return None

    assert check(nonce=5) is None
    assert check(nonce=5) is Rejection.REPLAYED  # the same message again
    assert check(nonce=4) is Rejection.REPLAYED  # an older one
    assert check(nonce=6) is None
    assert check(incarnation=99, nonce=50) is Rejection.REPLAYED  # a replaced replica's zombie
    assert check(incarnation=101, nonce=1) is None  # its replacement starts over
    assert check(nonce=2, incarnation=101, to=3) is Rejection.NOT_FOR_ME
    assert check(nonce=3, incarnation=101, to=BROADCAST) is None
    assert check(nonce=4, incarnation=101, sent_at=now - 31) is Rejection.EXPIRED
    assert check(nonce=5, incarnation=101, sender=3) is None  # per-sender counters


def test_the_mac_is_ftcore_sign_over_the_domain_the_job_and_the_data() -> None:
    from ft_launch.ids import sign
    from ft_launch.launcher.quorum.wire import DOMAIN
    data, mac = seal(VoteRequested(3))
    assert mac == sign(SECRET, DOMAIN, JOB.encode(), data)


@pytest.mark.parametrize("body", [b"", b"\x00" * 19, b"\x00" * 23, b"\x00" * 20 + b"\x01"])
def test_a_heartbeat_body_of_the_wrong_length_is_malformed(body: bytes) -> None:
    with pytest.raises((ValueError, struct.error)):
        decode_body(Kind.HEARTBEAT, 1, body)
