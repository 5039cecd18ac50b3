"""The one signed envelope and replay guard (``ft_launch.envelope``) that the quorum
and the health channel share: what it binds, what it refuses, what it remembers."""

from __future__ import annotations

import enum

import pytest

from ft_launch.envelope import (
    BROADCAST,
    MAC_BYTES,
    Envelope,
    Rejected,
    Rejection,
    ReplayGuard,
    Seal,
)
from ft_launch.ids import new_job_secret, sign

pytestmark = pytest.mark.timeout(30)
SECRET = new_job_secret()


class Kind(enum.Enum):
    PING = "ping"


def envelope(sender: object = "a", seq: int = 1, *, to: int = BROADCAST, incarnation: int = 0,
             sent_at: float = 1000.0) -> Envelope:
    return Envelope(Kind.PING, sender, seq, sent_at, b"", to, incarnation)


def reason(call) -> Rejection | None:
    try:
        call()
    except Rejected as exc:
        return exc.reason
    return None


def test_the_mac_is_ftcore_sign_over_domain_context_and_parts():
    plain = Seal(SECRET, b"dom/1", b"job-7", parts=2)
    assert plain.seal(b"a", b"bc") == [b"a", b"bc", sign(SECRET, b"dom/1", b"job-7", b"a", b"bc")]
    tagged = Seal(SECRET, b"dom/1", parts=1, tagged=True)
    assert tagged.seal(b"x") == [b"dom/1", b"x", sign(SECRET, b"dom/1", b"x")]
    assert tagged.open(tagged.seal(b"x")) == [b"x"]


def test_parts_cannot_be_re_split():
    seal = Seal(SECRET, b"dom/1", parts=2)
    *_, mac = seal.seal(b"ab", b"c")
    assert reason(lambda: seal.open([b"a", b"bc", mac])) is Rejection.BAD_SIGNATURE


@pytest.mark.parametrize("other", [
    lambda: Seal(new_job_secret(), b"dom/1", b"job-7"),   # another job's secret
    lambda: Seal(SECRET, b"dom/2", b"job-7"),             # another channel
    lambda: Seal(SECRET, b"dom/1", b"job-8"),             # another job id
], ids=["secret", "domain", "context"])
def test_a_message_of_another_secret_channel_or_job_is_a_bad_signature(other):
    mine = Seal(SECRET, b"dom/1", b"job-7")
    with pytest.raises(Rejected, match="bad signature") as caught:
        mine.open(other().seal(b"hello"))
    assert caught.value.reason is Rejection.BAD_SIGNATURE


def test_wrong_shapes_are_malformed_before_any_hashing():
    seal = Seal(SECRET, b"dom/1", parts=1, tagged=True, max_part_bytes=8)
    good = seal.seal(b"12345678")
    assert seal.open(good) == [b"12345678"]
    shapes = {
        "one frame": [b"junk"],
        "a frame too many": [*good, b""],
        "another channel's tag": [b"dom/2", *good[1:]],
        "a part past the limit": [good[0], b"123456789", good[2]],
        "a short mac": [good[0], good[1], good[2][:16]],
    }
    for name, frames in shapes.items():
        assert reason(lambda f=frames: seal.open(f)) is Rejection.MALFORMED, name
    with pytest.raises(ValueError, match="2 parts"):
        Seal(SECRET, b"dom/1", parts=2).seal(b"only one")
    assert len(good[-1]) == MAC_BYTES


@pytest.mark.parametrize("secret", ["abcd", "not hex at all", ""])
def test_a_short_or_non_hex_secret_is_refused_with_what_to_use(secret):
    with pytest.raises(ValueError, match="at least 16 bytes, hex encoded.*new_job_secret"):
        Seal(secret, b"dom/1")


def test_guard_refuses_repeats_older_messages_and_zombies_per_sender():
    guard = ReplayGuard()
    assert reason(lambda: guard.check(envelope("a", 5))) is None
    assert reason(lambda: guard.check(envelope("a", 5))) is Rejection.REPLAYED
    assert reason(lambda: guard.check(envelope("a", 4))) is Rejection.REPLAYED
    assert reason(lambda: guard.check(envelope("b", 1))) is None       # its own counter
    assert reason(lambda: guard.check(envelope("a", 1, incarnation=1))) is None  # restarted
    assert reason(lambda: guard.check(envelope("a", 9))) is Rejection.REPLAYED  # the zombie
    assert guard.accept(envelope("a", 2, incarnation=1))
    assert not guard.accept(envelope("a", 2, incarnation=1))


def test_guard_with_a_recipient_and_a_window():
    guard = ReplayGuard(me=2, max_age=30.0)
    now = 1000.0
    assert reason(lambda: guard.check(envelope(1, 1, to=3), now)) is Rejection.NOT_FOR_ME
    assert reason(lambda: guard.check(envelope(1, 2, to=2), now)) is None
    assert reason(lambda: guard.check(envelope(1, 3, to=BROADCAST), now)) is None
    old = envelope(1, 4, sent_at=now - 31)
    assert reason(lambda: guard.check(old, now)) is Rejection.EXPIRED
    ahead = envelope(1, 5, sent_at=now + 31)  # a sender clock far ahead is refused too
    assert reason(lambda: guard.check(ahead, now)) is Rejection.EXPIRED
    assert reason(lambda: guard.check(envelope(1, 4), now)) is None  # refusals recorded nothing
    with pytest.raises(ValueError, match="wall_now"):
        guard.check(envelope(1, 6))


def test_guard_memory_is_bounded_and_a_replay_cannot_push_a_live_sender_out():
    guard = ReplayGuard(max_senders=3)
    for name in "abc":
        assert guard.accept(envelope(name, 1))
    assert not guard.accept(envelope("a", 1))  # a replay refreshes nobody
    assert guard.accept(envelope("a", 2))      # a is now the most recently heard
    assert guard.accept(envelope("d", 1))      # b, the least recently heard, is forgotten
    assert not guard.accept(envelope("a", 2)) and not guard.accept(envelope("c", 1))
    assert guard.accept(envelope("b", 1))      # forgotten: only a secret holder gets here


def test_rejected_names_its_reason_and_is_a_value_error():
    error = Rejected(Rejection.INVALID, "field 'x' must be an integer")
    assert isinstance(error, ValueError) and str(error) == "field 'x' must be an integer"
    assert str(Rejected(Rejection.REPLAYED)) == "replayed"
