"""Table tests of the election rules (Raft's, plus pre-vote, lease, check-quorum)."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from ft_launch.launcher.quorum.core import QuorumCore
from ft_launch.launcher.quorum.election import Fail, Send, unit_draw
from ft_launch.launcher.quorum.events import (
    LeaderElected,
    LeadershipLost,
    MajorityLost,
    MajorityRegained,
    MembersLivenessChanged,
)
from ft_launch.launcher.quorum.model import (
    Heartbeat,
    HeartbeatAcked,
    JoinRequested,
    QuorumParams,
    Role,
    VoteAnswered,
    VoteRequested,
)

from .builders import (
    NOW,
    PARAMS,
    TERM,
    MessageReceived,
    QuorumRequested,
    address,
    fact,
    follower,
    leader,
    run,
    sent,
    tick,
)


def got(sender: int, message: object) -> MessageReceived:
    return MessageReceived(sender, message)  # type: ignore[arg-type]


def answers(actions: list) -> list[tuple[int, VoteAnswered]]:
    return [(a.to[0], a.message) for a in sent(actions, VoteAnswered)]


LEASE_OVER = NOW + PARAMS.election_timeout + 0.01


@dataclass(frozen=True)
class VoteCase:
    name: str
    state: Callable[[], QuorumCore]
    request: VoteRequested
    now: float
    granted: bool
    term_after: int


VOTE_CASES = [
    VoteCase("pre-vote refused while the leader's lease holds", follower,
             VoteRequested(TERM + 1, pre_vote=True), NOW + 0.1, False, TERM),
    VoteCase("pre-vote granted once the lease is over, term unchanged", follower,
             VoteRequested(TERM + 1, pre_vote=True), LEASE_OVER, True, TERM),
    VoteCase("pre-vote for a stale term refused", follower,
             VoteRequested(TERM, pre_vote=True), LEASE_OVER, False, TERM),
    VoteCase("vote refused while the lease holds, term unchanged", follower,
             VoteRequested(TERM + 1), NOW + 0.1, False, TERM),
    VoteCase("vote granted after the lease, term adopted", follower,
             VoteRequested(TERM + 1), LEASE_OVER, True, TERM + 1),
    VoteCase("vote for a lower term refused", lambda: follower(leader_id=None),
             VoteRequested(TERM - 1), LEASE_OVER, False, TERM),
    VoteCase("a leader refuses every vote", lambda: leader(live=(0, 1, 2, 3, 4)),
             VoteRequested(TERM + 5), NOW, False, TERM),
]


@pytest.mark.parametrize("case", VOTE_CASES, ids=[c.name for c in VOTE_CASES])
def test_vote_table(case: VoteCase) -> None:
    state, actions = run(case.state(), [got(2, case.request)], now=case.now)
    [(to, answer)] = answers(actions)
    assert to == 2
    assert answer.granted is case.granted
    assert answer.pre_vote is case.request.pre_vote
    assert state.term == case.term_after


def test_one_vote_per_term() -> None:
    state = follower(leader_id=None)
    state, first = run(state, [got(2, VoteRequested(TERM + 1))], now=LEASE_OVER)
    state, second = run(state, [got(3, VoteRequested(TERM + 1))], now=LEASE_OVER)
    state, again = run(state, [got(2, VoteRequested(TERM + 1))], now=LEASE_OVER)
    assert [a.granted for _, a in answers(first) + answers(second) + answers(again)] == \
        [True, False, True]
    assert state.voted_for == 2


@pytest.mark.parametrize("remember", [True, False])
def test_a_restarted_voter_votes_again_in_a_term_only_if_it_forgot(remember: bool) -> None:
    """Two candidates of one term each need a majority; a voter that forgot its
    vote on a restart could give both theirs (two leaders in one term)."""
    state = follower(leader_id=None)
    state, first = run(state, [got(2, VoteRequested(TERM + 1))], now=LEASE_OVER)
    restarted = QuorumCore(state.me, state.voters, PARAMS, LEASE_OVER, seed=2)
    if remember:
        restarted.restore(state.memory())
    restarted, second = run(restarted, [got(3, VoteRequested(TERM + 1))], now=LEASE_OVER)
    assert [a.granted for _, a in answers(first) + answers(second)] == [True, not remember]


def test_timeout_starts_a_pre_vote_without_raising_the_term() -> None:
    state = follower()
    state, actions = tick(state, state.deadline)
    [request] = sent(actions, VoteRequested)
    assert (state.role, state.term, state.leader_id) == (Role.PRE_CANDIDATE, TERM, None)
    assert request.message == VoteRequested(TERM + 1, pre_vote=True)
    assert request.to == (0, 2, 3, 4)


def test_pre_vote_majority_then_vote_majority_makes_a_leader() -> None:
    state, _ = tick(follower(), follower().deadline)
    at = follower().deadline
    state, actions = run(state, [got(2, VoteAnswered(TERM + 1, True, True)),
                                 got(3, VoteAnswered(TERM + 1, True, True))], now=at)
    assert (state.role, state.term) == (Role.CANDIDATE, TERM + 1)
    assert sent(actions, VoteRequested)[0].message == VoteRequested(TERM + 1)
    state, actions = run(state, [got(2, VoteAnswered(TERM + 1, True)),
                                 got(3, VoteAnswered(TERM + 1, True))], now=at)
    assert (state.role, state.leader_id) == (Role.LEADER, 1)
    assert fact(LeaderElected, 1, 1, TERM + 1) in actions
    [heartbeat] = sent(actions, Heartbeat)  # lease taken at once
    assert heartbeat.to == (0, 2, 3, 4)


def test_new_leader_presumes_alive_all_but_the_silent_leader_and_suspects() -> None:
    state = follower()
    state, _ = run(state, [got(0, Heartbeat(TERM, suspects=(4,)))], now=NOW)
    at = state.deadline
    state, _ = tick(state, at)
    state, actions = run(state, [got(2, VoteAnswered(TERM + 1, True, True)),
                                 got(3, VoteAnswered(TERM + 1, True, True)),
                                 got(2, VoteAnswered(TERM + 1, True)),
                                 got(3, VoteAnswered(TERM + 1, True))], now=at)
    assert state.role is Role.LEADER
    assert state.lead is not None and state.lead.live == frozenset({1, 2, 3})
    # The silent leader is lost to this replica too (4 was reported on the heartbeat).
    assert fact(MembersLivenessChanged, 1, [0], []) in actions


def test_a_follower_reports_the_suspects_the_leader_announces_when_they_change() -> None:
    state, actions = run(follower(), [got(0, Heartbeat(TERM, suspects=(3, 4)))], now=NOW)
    assert fact(MembersLivenessChanged, 1, [3, 4], []) in actions
    state, actions = run(state, [got(0, Heartbeat(TERM, suspects=(3, 4)))], now=NOW + 0.1)
    assert not [a for a in actions if isinstance(a, MembersLivenessChanged)]
    state, actions = run(state, [got(0, Heartbeat(TERM, suspects=(4,)))], now=NOW + 0.2)
    assert fact(MembersLivenessChanged, 1, [], [3]) in actions


def test_a_higher_term_deposes_the_leader() -> None:
    state, actions = run(leader(live=(0, 1, 2)), [got(1, HeartbeatAcked(TERM + 2))])
    assert (state.role, state.term, state.leader_id) == (Role.FOLLOWER, TERM + 2, None)
    assert any(isinstance(a, LeadershipLost) for a in actions)


def test_a_stale_leader_is_told_the_current_term() -> None:
    state, actions = run(follower(), [got(3, Heartbeat(TERM - 1))])
    assert state.leader_id == 0
    [ack] = sent(actions, HeartbeatAcked)
    assert (ack.to, ack.message.term) == ((3,), TERM)


def test_heartbeats_are_acknowledged_at_most_every_ack_interval() -> None:
    state = follower(leader_id=None)
    acked_at = []
    for i in range(10):
        now = NOW + i * 0.1
        state, actions = run(state, [got(0, Heartbeat(TERM))], now=now)
        acked_at += [now for _ in sent(actions, HeartbeatAcked)]
    assert acked_at[0] == NOW  # a new leader is answered at once
    gaps = [b - a for a, b in itertools.pairwise(acked_at)]
    assert len(acked_at) >= 3 and all(g >= PARAMS.ack_interval - 1e-9 for g in gaps)


def test_a_join_to_the_leader_stands_in_for_the_next_ack() -> None:
    state, _ = run(follower(), [got(0, Heartbeat(TERM))], now=NOW)
    joined_at = NOW + PARAMS.ack_interval
    state, actions = run(state, [QuorumRequested(5, address(1))], now=joined_at)
    assert [a.to for a in sent(actions, JoinRequested)] == [(0,)]
    late = joined_at + PARAMS.ack_interval
    for now, acks in ((joined_at + 0.01, 0), (late - 0.01, 0), (late + 0.01, 1)):
        state, actions = run(state, [got(0, Heartbeat(TERM))], now=now)
        assert len(sent(actions, HeartbeatAcked)) == acks, now


def test_leader_detects_a_dead_member_within_member_timeout() -> None:
    state = leader(live=(0, 1, 2, 3, 4))
    now = NOW
    while now < NOW + PARAMS.member_timeout + 0.3:
        now = state.next_deadline(now)
        alive = [got(m, HeartbeatAcked(TERM)) for m in (1, 2, 3)]  # 4 went silent
        state, actions = run(state, alive, now=now)
        state, more = tick(state, now)
        lost = [a for a in actions + more if isinstance(a, MembersLivenessChanged)]
        if lost:
            break
    assert lost == [fact(MembersLivenessChanged, 0, [4], [])]
    assert NOW + PARAMS.member_timeout <= now <= NOW + PARAMS.member_timeout + 0.11
    [heartbeat] = sent(more, Heartbeat) or sent(actions, Heartbeat)
    assert heartbeat.message.suspects == (4,)


def test_check_quorum_leader_without_a_majority_steps_down() -> None:
    state = leader(live=(0, 1, 2))
    state, actions = tick(state, NOW + PARAMS.member_timeout - 0.05)
    assert state.role is Role.LEADER
    state, actions = tick(state, NOW + PARAMS.member_timeout + 0.05)
    assert (state.role, state.majority_lost) == (Role.FOLLOWER, True)
    assert fact(MajorityLost, 0, [0], 5) in actions


def test_cut_off_member_reports_majority_lost_and_fails_its_request() -> None:
    state = follower(seen_at=NOW)
    state, _ = run(state, [QuorumRequested(10, address(1))], now=NOW)
    now, reported = NOW, []
    while now < NOW + 5 and not reported:
        now = state.next_deadline(now)
        state, actions = tick(state, now)
        reported = [a for a in actions if isinstance(a, Fail)]
    window = max(PARAMS.member_timeout, PARAMS.election_timeout + PARAMS.election_spread)
    assert now == pytest.approx(NOW + window, abs=PARAMS.heartbeat_interval)
    assert reported[0].reachable == (1,)
    assert state.majority_lost
    # Asking again fails at once; a leader's heartbeat ends it.
    state, actions = run(state, [QuorumRequested(11, address(1))], now=now)
    assert isinstance(actions[0], Fail)
    state, actions = run(state, [got(2, Heartbeat(TERM + 1))], now=now)
    assert fact(MajorityRegained, 1, 2) in actions and not state.majority_lost


def test_majority_not_lost_while_a_majority_answers_pre_votes() -> None:
    state = follower()
    now = NOW
    while now < NOW + 6:
        now = state.next_deadline(now)
        state, actions = tick(state, now)
        for request in sent(actions, VoteRequested):  # 2 and 3 answer, without a winner
            state, _ = run(state, [got(2, VoteAnswered(state.term, False)),
                                   got(3, VoteAnswered(state.term, False))], now=now)
    assert not state.majority_lost


def test_an_unelectable_member_never_campaigns() -> None:
    state = follower()
    state.electable = False
    state, actions = tick(state, NOW + 60)
    assert state.role is Role.FOLLOWER and not sent(actions, VoteRequested)


def test_a_single_replica_leads_at_once() -> None:
    state = QuorumCore(0, [0], PARAMS, NOW)
    state, actions = tick(state, NOW)
    assert state.role is Role.LEADER and fact(LeaderElected, 0, 0, 1) in actions


def test_election_timeouts_are_randomised_reproducibly() -> None:
    draws = [unit_draw(seed=42, me=1, draw=i) for i in range(2000)]
    assert all(0 <= d < 1 for d in draws)
    assert 0.45 < sum(draws) / len(draws) < 0.55
    assert draws == [unit_draw(seed=42, me=1, draw=i) for i in range(2000)]
    assert draws[:5] != [unit_draw(seed=42, me=2, draw=i) for i in range(5)]
    deadlines = [QuorumCore(r, range(5), PARAMS, 0.0, seed=7).deadline
                 for r in range(5)]
    assert all(0.5 <= d < 1.0 for d in deadlines) and len(set(deadlines)) == 5


def test_a_follower_draws_its_timeout_once_per_leader_not_per_contact() -> None:
    """Re-arming on each of a leader's messages reuses the draw made when that
    leader was first heard (a round's announcement reaches every member); a new
    leader, and each member, still get their own random timeout."""
    state, _ = run(follower(leader_id=None), [got(0, Heartbeat(TERM))], now=NOW)
    draws, jitter = state.draws, state.jitter
    assert state.leader_id == 0 and jitter > 0
    assert state.deadline == NOW + PARAMS.election_timeout + jitter
    for i in range(1, 4):
        now = NOW + i * 0.1
        state, _ = run(state, [got(0, Heartbeat(TERM))], now=now)
        assert (state.draws, state.jitter) == (draws, jitter)
        assert state.deadline == now + PARAMS.election_timeout + jitter
    state, _ = run(state, [got(2, Heartbeat(TERM + 1))], now=NOW + 1)
    assert state.leader_id == 2 and state.draws > draws
    jitters = set()
    for me in (1, 3, 4):
        s, _ = run(follower(me=me, leader_id=None), [got(0, Heartbeat(TERM))], now=NOW)
        jitters.add(s.jitter)
    assert len(jitters) == 3


def test_spread_grows_with_the_replica_count_by_the_configured_slot() -> None:
    from ft_launch.config import QuorumConfig
    small = QuorumParams.from_config(QuorumConfig(), 5)
    large = QuorumParams.from_config(QuorumConfig(), 1000)
    assert small.election_spread == QuorumConfig().election_timeout
    assert large.election_spread == pytest.approx(1000 * QuorumConfig().election_slot)
    slower = QuorumParams.from_config(QuorumConfig(election_slot=0.05), 1000)
    assert slower.election_spread == pytest.approx(50.0)


def test_members_sent_an_announcement_get_no_heartbeat_until_suspects_change() -> None:
    from ft_launch.launcher.quorum.model import QuorumAnnounced, QuorumDeltaAnnounced
    state = leader(live=range(5), previous=range(5))
    state, first = tick(state, NOW + PARAMS.heartbeat_interval)
    [beat] = sent(first, Heartbeat)
    assert beat.to == (1, 2, 3, 4)
    joins = [QuorumRequested(11, address(0))] + [
        got(m, JoinRequested(TERM, 11, address(m), 7, 1)) for m in (1, 2, 3)]
    state, actions = run(state, joins, now=NOW + 0.15)
    assert sent(actions, QuorumDeltaAnnounced) + sent(actions, QuorumAnnounced) == []
    state, actions = run(state, [got(4, JoinRequested(TERM, 11, address(4), 7, 1))],
                         now=NOW + 0.16)
    assert sent(actions, QuorumDeltaAnnounced)  # 4 joined last: the round forms
    silent = copy.deepcopy(state)
    silent.heard[4] = NOW - 10  # 4 is now a suspect
    _, quiet = tick(state, NOW + 2 * PARAMS.heartbeat_interval)
    assert sent(quiet, Heartbeat) == []  # every member heard from it 40 ms ago
    _, changed = tick(silent, NOW + 2 * PARAMS.heartbeat_interval)
    [beat] = sent(changed, Heartbeat)
    assert beat.to == (1, 2, 3, 4) and beat.message.suspects == (4,)
    state, _ = tick(state, NOW + 2 * PARAMS.heartbeat_interval)
    _, next_beat = tick(state, NOW + 3 * PARAMS.heartbeat_interval)
    [beat] = sent(next_beat, Heartbeat)  # no round since: everyone again
    assert beat.to == (1, 2, 3, 4)


def test_send_actions_name_only_configured_peers() -> None:
    state = follower(voters=3)
    _, actions = tick(state, state.deadline)
    assert all(set(a.to) <= {0, 2} for a in actions if isinstance(a, Send))
