"""Compact announcements: the difference against the previous quorum, both ends."""

from __future__ import annotations

import dataclasses
import time

import pytest

from ft_launch.ids import new_job_secret, sign
from ft_launch.launcher.quorum.core import Membership, QuorumCore
from ft_launch.launcher.quorum.delta import answers, compact, expand
from ft_launch.launcher.quorum.election import Deliver
from ft_launch.launcher.quorum.model import (
    JoinRequested,
    Quorum,
    QuorumAnnounced,
    QuorumDeltaAnnounced,
    QuorumMember,
)
from ft_launch.launcher.quorum.wire import BROADCAST, DOMAIN, Codec, Rejected

from .builders import (
    NOW,
    PREVIOUS_ID,
    TERM,
    MessageReceived,
    QuorumRequested,
    TimerFired,
    address,
    follower,
    leader,
    run,
    sent,
)
from .sim import Sim

FIVE = (0, 1, 2, 3, 4)
SECRET = new_job_secret()


def base_quorum(members: tuple[int, ...] = FIVE) -> Quorum:
    return Quorum.of(PREVIOUS_ID, tuple(QuorumMember(m, 10, address(m)) for m in members),
                     term=TERM, leader_id=0)


def announce_of(members: tuple[QuorumMember, ...], quorum_id: int = PREVIOUS_ID + 1,
                seq: int = 1) -> QuorumAnnounced:
    quorum = Quorum.of(quorum_id, members, term=TERM, leader_id=0)
    return QuorumAnnounced(TERM, quorum, {m.replica_id: seq for m in members})


def test_an_unchanged_roster_is_sent_as_steps_only_and_expands_to_the_same_quorum() -> None:
    base = base_quorum()
    members = tuple(QuorumMember(m, 11 if m != 3 else 9, address(m)) for m in FIVE)
    full = announce_of(members, PREVIOUS_ID)
    delta = compact(full, base)
    assert delta is not None and (delta.removed, delta.added) == ((), ())
    assert delta.behind == ((3, 9),) and delta.digest == base.digest
    assert expand(delta, base) == full.quorum
    assert all(answers(delta, full.quorum, m, 1) for m in FIVE)
    assert not answers(delta, full.quorum, 2, 2)  # a newer bid is not answered by this


def test_a_failure_and_a_replacement_travel_as_a_difference() -> None:
    base = base_quorum()
    members = (QuorumMember(0, 11, address(0)), QuorumMember(1, 11, address(1)),
               QuorumMember(2, 11, address(2, generation=1)),            # replaced
               QuorumMember(4, 11, address(4)))
    full = announce_of(members)                                           # 3 failed
    delta = compact(full, base)
    assert delta is not None
    assert delta.removed == (3,)
    assert delta.added == ((2, address(2, generation=1)),)
    quorum = expand(delta, base)
    assert quorum == full.quorum and quorum.digest == full.quorum.digest != base.digest


def test_a_mostly_new_roster_is_sent_in_full() -> None:
    base = base_quorum()
    moved = tuple(QuorumMember(m, 11, address(m, generation=1)) for m in FIVE)
    assert compact(announce_of(moved), base) is None


def test_wire_round_trip_and_size_at_1000_members() -> None:
    codec = Codec(SECRET, "job")
    wide = "x" * 4000  # a replica advertising its ranks' endpoints
    base = Quorum.of(5, tuple(QuorumMember(m, 10, f"{wide}{m}") for m in range(1000)))
    members = tuple(QuorumMember(m, 11, f"{wide}{m}") for m in range(1000) if m != 7)
    full = announce_of(members, 6, seq=1_700_000_000_000_000_123)
    delta = compact(full, base)
    assert delta is not None
    frames = codec.seal(0, BROADCAST, 1, 1, time.time(), "tcp://a:1", delta)
    assert codec.open(frames).body == delta
    full_frames = codec.seal(0, BROADCAST, 1, 2, time.time(), "tcp://a:1", full)
    assert codec.open(full_frames).body == full
    assert len(frames[0]) < len(full_frames[0]) / 500  # 4 KB of seqs against 4 MB
    short = frames[0][:-3]
    with pytest.raises(Rejected):  # a body cut short is refused, not misread
        codec.open([short, sign(SECRET, DOMAIN, b"job", short)])


def member_waiting(seq: int = 5) -> QuorumCore:
    """Replica 1 following leader 0, holding ``base_quorum()``, waiting on bid ``seq``."""
    state = follower()
    join = JoinRequested(TERM, 11, address(1), PREVIOUS_ID, seq)
    state.member = Membership(request=join, sent_at=NOW, sent_to=0, join_seq=seq,
                              last_quorum=base_quorum())
    return state


def test_a_member_delivers_the_expanded_quorum() -> None:
    full = announce_of(tuple(QuorumMember(m, 11, address(m)) for m in FIVE[:4]), seq=5)
    delta = compact(full, base_quorum())
    state, actions = run(member_waiting(), [MessageReceived(0, delta)])  # type: ignore[arg-type]
    assert [a.quorum for a in actions if isinstance(a, Deliver)] == [full.quorum]
    assert state.member.last_quorum == full.quorum and state.member.request is None


def test_a_member_holding_another_roster_asks_again_with_the_same_bid() -> None:
    full = announce_of(tuple(QuorumMember(m, 11, address(m)) for m in FIVE), seq=5)
    other = Quorum.of(PREVIOUS_ID, tuple(QuorumMember(m, 10, address(m, 9)) for m in FIVE))
    delta = dataclasses.replace(compact(full, base_quorum()), digest=other.digest)  # type: ignore[type-var]
    _, actions = run(member_waiting(), [MessageReceived(0, delta)])  # type: ignore[arg-type]
    assert not any(isinstance(a, Deliver) for a in actions)
    [again] = sent(actions, JoinRequested)
    assert again.to == (0,) and again.message.join_seq == 5
    # The leader answers an answered bid with the full form.
    lead = leader(live=FIVE, previous=FIVE)
    lead, first = run(lead, [QuorumRequested(11, address(0))]
                      + [MessageReceived(m, JoinRequested(TERM, 11, address(m), PREVIOUS_ID, 5)) for m in FIVE[1:]])
    assert sent(first, QuorumDeltaAnnounced)
    _, repeat = run(lead, [MessageReceived(1, again.message)])
    [full_again] = sent(repeat, QuorumAnnounced)
    assert full_again.to == (1,)


def test_a_stale_compact_answer_is_ignored() -> None:
    full = announce_of(tuple(QuorumMember(m, 11, address(m)) for m in FIVE), seq=4)
    delta = compact(full, base_quorum())
    _, actions = run(member_waiting(seq=5), [MessageReceived(0, delta)])  # type: ignore[arg-type]
    assert actions == []


def test_a_member_that_missed_the_last_quorum_gets_the_full_form() -> None:
    lead = leader(live=FIVE, previous=FIVE)
    joins = [MessageReceived(m, JoinRequested(TERM, 11, address(m),
                                              PREVIOUS_ID - 1 if m == 3 else PREVIOUS_ID, 1))
             for m in FIVE[1:]]
    _, actions = run(lead, [QuorumRequested(11, address(0))] + joins)
    [full] = sent(actions, QuorumAnnounced)
    [delta] = sent(actions, QuorumDeltaAnnounced)
    assert full.to == (3,) and delta.to == (1, 2, 4)


def test_after_a_failure_survivors_get_a_difference_and_agree_with_the_leader() -> None:
    sim = Sim(range(7))
    assert sim.run_until(sim.stable, 5.0)
    leader_id = sim.leader()
    for step in (1, 2):
        for r in range(7):
            sim.request(r, step)
        assert sim.run_until(lambda s=step: all(len(sim.delivered[r]) == s for r in range(7)))
    victim = (leader_id + 2) % 7
    sim.kill(victim)
    before = len(sim.actions)
    survivors = [r for r in range(7) if r != victim]
    for r in survivors:
        sim.request(r, 3)
    assert sim.run_until(lambda: all(len(sim.delivered[r]) == 3 for r in survivors), 5.0)
    quorums = {sim.delivered[r][-1] for r in survivors}
    assert len(quorums) == 1 and victim not in quorums.pop().replica_ids
    after = [a.message for r, a in sim.actions[before:] if r == leader_id
             and isinstance(getattr(a, "message", None), (QuorumAnnounced,
                                                          QuorumDeltaAnnounced))]
    assert [(type(m), getattr(m, "removed", None)) for m in after] == \
        [(QuorumDeltaAnnounced, (victim,))]


def test_a_join_leaves_out_the_address_the_leader_has_and_a_resend_carries_it() -> None:
    mine = Quorum.of(PREVIOUS_ID, tuple(QuorumMember(m, 10, address(m)) for m in FIVE),
                     term=TERM, leader_id=0)
    state = follower()
    state.member, state.deadline = Membership(join_seq=4, last_quorum=mine), NOW + 100
    state, actions = run(state, [QuorumRequested(11, address(1))])
    [first] = sent(actions, JoinRequested)
    assert first.message.address == "" and state.member.request.address == address(1)
    _, actions = run(state, [TimerFired()], NOW + 2 * 1.0 + 0.01)  # two join windows later
    [again] = sent(actions, JoinRequested)
    assert again.message.address == address(1) and again.message.join_seq == 5
    _, actions = run(state, [QuorumRequested(12, address(1, generation=2))])
    [full] = sent(actions, JoinRequested)
    assert full.message.address == address(1, generation=2)  # a new address goes in full
    other_term = dataclasses.replace(mine, term=TERM - 1)
    state = follower()
    state.member = Membership(join_seq=4, last_quorum=other_term)
    _, actions = run(state, [QuorumRequested(11, address(1))])
    assert sent(actions, JoinRequested)[0].message.address == address(1)


def test_the_leader_fills_in_addresses_it_has_and_ignores_those_it_has_not() -> None:
    lead = leader(live=FIVE, previous=FIVE)
    def join_of(m: int, text: str, seq: int) -> MessageReceived:
        return MessageReceived(m, JoinRequested(TERM, 11, text, PREVIOUS_ID, seq))
    lead, actions = run(lead, [QuorumRequested(11, address(0))]
                        + [join_of(m, address(m), 1) for m in FIVE[1:]])
    assert sent(actions, QuorumDeltaAnnounced)
    lead, actions = run(lead, [QuorumRequested(12, address(0))]
                        + [join_of(m, "", 2) for m in FIVE[1:]], now=NOW + 0.1)
    formed = [a.quorum for a in actions if isinstance(a, Deliver)]
    assert [m.address for m in formed[0].members] == [address(m) for m in FIVE]
    fresh = leader(live=FIVE, previous=FIVE)  # no join of this term on file
    fresh, actions = run(fresh, [join_of(1, "", 3)])
    assert actions == [] and fresh.lead.round is None
