"""Table tests of quorum formation (ports of the classic lighthouse cases), pure core."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from ft_launch.launcher.quorum.delta import QUORUM_ID_STRIDE, answers, expand
from ft_launch.launcher.quorum.election import Deliver
from ft_launch.launcher.quorum.model import HeartbeatAcked, QuorumAnnounced, QuorumDeltaAnnounced

from .builders import (
    NOW,
    PARAMS,
    PREVIOUS_ID,
    TERM,
    CommitFailureReported,
    MessageReceived,
    QuorumRequested,
    address,
    follower,
    formed,
    join,
    leader,
    run,
    sent,
    tick,
)
from .builders import (
    quorum as quorum_of,
)

ALL = (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class Case:
    name: str
    live: tuple[int, ...]
    joins: tuple[object, ...]
    expect: tuple[int, ...] | None
    expect_id: int | None = None
    after: float = 0.0
    previous: tuple[int, ...] = ALL
    voters: int = 5
    min_replicas: int = 1


CASES = [
    Case("fast re-quorum when everyone is present", ALL, tuple(join(m) for m in ALL),
         ALL, PREVIOUS_ID),
    Case("join timeout: waits for a live member", ALL, tuple(join(m) for m in ALL[:4]),
         None, after=0.5),
    Case("join timeout: forms without it once the window closes", ALL,
         tuple(join(m) for m in ALL[:4]), ALL[:4], PREVIOUS_ID + 1, after=1.0),
    Case("shrink: a dead member is not waited for", ALL[:4], tuple(join(m) for m in ALL[:4]),
         ALL[:4], PREVIOUS_ID + 1),
    Case("grow on rejoin", ALL, tuple(join(m, last=6 if m == 4 else 7) for m in ALL),
         ALL, PREVIOUS_ID + 1, previous=ALL[:4]),
    Case("split brain refused: a minority never forms", (0, 1), (join(0), join(1)),
         None, after=5.0),
    Case("strict majority of the configured replicas, not of the live ones", (0, 1, 2),
         tuple(join(m) for m in (0, 1, 2)), (0, 1, 2), PREVIOUS_ID + 1),
    Case("half of an even replica set is not a majority", (0, 1), (join(0), join(1)),
         None, after=5.0, voters=4, previous=(0, 1, 2, 3)),
    Case("min_replicas above the majority", (0, 1, 2), tuple(join(m) for m in (0, 1, 2)),
         None, after=5.0, min_replicas=4),
    Case("commit failure bumps quorum_id", ALL,
         tuple(join(m, commit_failed=m == 2) for m in ALL), ALL, PREVIOUS_ID + 1),
    Case("a member that missed the last quorum bumps quorum_id", ALL,
         tuple(join(m, last=6 if m == 3 else 7) for m in ALL), ALL, PREVIOUS_ID + 1),
    Case("a replaced replica (same id, new address) is a membership change", ALL,
         tuple(join(m, generation=1 if m == 2 else 0) for m in ALL), ALL, PREVIOUS_ID + 1),
]


def _own_join(event: object) -> object:
    """Replica 0 is the leader: its own join is a local request, not a message."""
    if getattr(event, "sender", None) == 0:
        message = event.message  # type: ignore[attr-defined]
        return QuorumRequested(message.next_step, message.address)
    return event


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_formation_table(case: Case) -> None:
    params = dataclasses.replace(PARAMS, min_replicas=case.min_replicas)
    state = leader(case.voters, live=case.live, previous=case.previous, params=params)
    state, actions = run(state, [_own_join(e) for e in case.joins])
    if case.after:
        state, more = tick(state, NOW + case.after)
        actions += more
    if case.expect is None:
        assert formed(actions) is None
        return
    quorum = state.last_formed
    assert formed(actions) is not None and quorum is not None
    assert quorum.replica_ids == case.expect
    assert quorum.quorum_id == case.expect_id
    # Every joined member gets the same answer once: compact to those holding
    # the previous roster, in full to the others, each form one signed broadcast.
    joined = {e.sender for e in case.joins} - {0}  # type: ignore[attr-defined]
    sends = sent(actions, QuorumAnnounced) + sent(actions, QuorumDeltaAnnounced)
    assert sorted(m for send in sends for m in send.to) == sorted(joined)
    assert len(sends) == len({type(send.message) for send in sends})
    base = quorum_of(PREVIOUS_ID, case.previous)
    for send in sends:
        message = send.message
        if isinstance(message, QuorumAnnounced):
            assert message.quorum == quorum
            assert set(message.answered) == joined | {0}
        else:
            assert expand(message, base) == quorum
            assert all(answers(message, quorum, m, 1) for m in send.to)


def test_max_step_and_behind() -> None:
    state = leader(live=ALL, previous=ALL)
    steps = {0: 12, 1: 12, 2: 11, 3: 12, 4: 9}
    own = QuorumRequested(steps[0], address(0))
    state, _ = run(state, [own] + [join(m, steps[m]) for m in ALL[1:]])
    quorum = state.last_formed
    assert quorum is not None
    assert (quorum.max_step, quorum.behind) == (12, (2, 4))
    assert [m.next_step for m in quorum.members] == [12, 12, 11, 12, 9]


def test_leader_answers_itself_with_the_same_quorum() -> None:
    state = leader(live=ALL, previous=ALL)
    _, actions = run(state, [QuorumRequested(10, address(0))] + [join(m) for m in ALL[1:]])
    delivered = [a.quorum for a in actions if isinstance(a, Deliver)]
    assert formed(actions) is not None and delivered == [state.last_formed]


def test_window_opens_once_the_joins_could_form_and_later_joins_do_not_extend_it() -> None:
    state = leader(live=ALL, previous=ALL)
    state, _ = run(state, [join(1)], now=NOW)
    state, _ = run(state, [join(2)], now=NOW + 0.5)  # two of five: no quorum yet
    state, actions = run(state, [join(3)], now=NOW + 0.9)  # a majority: the window opens
    assert formed(actions) is None and state.lead.round.formable_at == NOW + 0.9
    state, actions = tick(state, NOW + 1.0)  # a window from the first join would close here
    assert formed(actions) is None
    state, actions = run(state, [join(4)], now=NOW + 1.5)
    assert formed(actions) is None
    _, actions = tick(state, NOW + 0.9 + PARAMS.join_timeout)
    quorum = formed(actions)
    assert quorum is not None and quorum.members == [1, 2, 3, 4]


def test_members_that_waited_long_do_not_close_the_window_on_the_others() -> None:
    """Replicas 1 and 2 joined early (one started late and missed the last round,
    one finished its step sooner); the others join a join window later, a moment
    apart. The quorum waits for all of them instead of forming with the first
    three and leaving the rest to the next step, every step."""
    state = leader(live=ALL, previous=ALL)
    state, _ = run(state, [join(1), join(2)], now=NOW)
    later = NOW + 1.5 * PARAMS.join_timeout
    state, actions = run(state, [join(3)], now=later)
    assert formed(actions) is None
    state, actions = run(state, [join(4), QuorumRequested(10, address(0))], now=later + 0.1)
    quorum = formed(actions)
    assert quorum is not None and quorum.members == list(ALL)


def test_the_window_opens_again_when_a_joined_member_falls_silent() -> None:
    state = leader(live=ALL, previous=ALL)
    state, _ = run(state, [join(1), join(2), join(3)], now=NOW)
    assert state.lead.round.formable_at == NOW
    # Past member_timeout only 1 has not been heard: 2 and 3 alone are no majority.
    silent = NOW + PARAMS.member_timeout + 0.1
    acks = [MessageReceived(m, HeartbeatAcked(TERM)) for m in (2, 3, 4)]
    state, actions = run(state, acks, now=silent)
    state, more = tick(state, silent)  # the heartbeat tick finds 1 silent
    assert formed(actions + more) is None and state.lead.round.formable_at is None
    state, actions = run(state, [join(4)], now=silent)  # a majority again: a new window
    assert formed(actions) is None and state.lead.round.formable_at == silent


def test_resent_join_after_the_answer_gets_the_same_answer_and_no_new_round() -> None:
    state = leader(live=ALL, previous=ALL)
    state, actions = run(state, [QuorumRequested(10, address(0))] + [join(m) for m in ALL[1:]])
    first = state.last_formed
    state, actions = run(state, [join(3)], now=NOW + 0.5)  # same join_seq: a duplicate
    [again] = sent(actions, QuorumAnnounced)
    assert again.to == (3,) and again.message.quorum == first
    assert state.lead.round is None


def test_a_follower_ignores_joins() -> None:
    state, actions = run(follower(), [join(2)])
    assert actions == [] and state.lead is None


def test_a_new_leader_continues_the_quorum_id_it_learns_from_members() -> None:
    # Replica 0 was not in quorum 7 (it knows only 5), the members report 7.
    state = leader(live=ALL, previous=None)
    state, actions = run(state, [QuorumRequested(10, address(0))] + [join(m) for m in ALL[1:]])
    quorum = formed(actions)
    assert quorum is not None and quorum.quorum_id == PREVIOUS_ID + 1


def test_a_later_leader_creates_ids_no_earlier_leader_can_have_used() -> None:
    state = leader(live=ALL[:4], previous=ALL)  # 4 is silent: a membership change
    state.term = 4
    joins = [QuorumRequested(10, address(0))] + [join(m, term=4) for m in ALL[1:4]]
    _, actions = run(state, joins)
    quorum = formed(actions)
    assert quorum is not None and quorum.quorum_id == 3 * QUORUM_ID_STRIDE + 1
    unchanged = [QuorumRequested(10, address(0))] + [join(m, term=4) for m in ALL[1:]]
    state = leader(live=ALL, previous=ALL)
    state.term = 4
    _, actions = run(state, unchanged)
    assert formed(actions).quorum_id == PREVIOUS_ID  # type: ignore[union-attr]


def test_commit_failure_reported_while_waiting_amends_the_bid() -> None:
    state = follower()
    state, actions = run(state, [QuorumRequested(10, address(1))])
    [first] = [a.message for a in actions]
    state, actions = run(state, [CommitFailureReported()])
    [amended] = [a.message for a in actions]
    assert amended.commit_failed and amended.join_seq == first.join_seq + 1
