"""Standing quorums (``quorum.standing``): members go on with the last quorum
while the leader grants it, and fall back to a round whenever anything changes."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from ft_launch.launcher.quorum.core import Membership, QuorumCore, Round
from ft_launch.launcher.quorum.delta import advance
from ft_launch.launcher.quorum.election import Send
from ft_launch.launcher.quorum.events import StandingEnded
from ft_launch.launcher.quorum.model import (
    Heartbeat,
    JoinRequested,
    Quorum,
    QuorumMember,
    Standing,
    VoteRequested,
)

from .builders import (
    NOW,
    PARAMS,
    TERM,
    CommitFailureReported,
    MessageReceived,
    QuorumRequested,
    address,
    delivered,
    fact,
    follower,
    join,
    leader,
    run,
    sent,
    tick,
)
from .sim import FAST, Sim

STANDING = dataclasses.replace(PARAMS, standing=True)
QUORUM_ID = 7
GRANT = Standing(QUORUM_ID, 15)


def last_quorum(members: tuple[int, ...] = (0, 1, 2), step: int = 10) -> Quorum:
    return Quorum.of(QUORUM_ID, tuple(QuorumMember(m, step, address(m)) for m in members),
                     term=TERM, leader_id=0)


def changed(s: QuorumCore, **fields: Any) -> QuorumCore:
    for name, value in fields.items():
        setattr(s, name, value)
    return s


def granted(me: int = 1, grant: Standing | None = GRANT) -> QuorumCore:
    """A follower of leader 0 whose last quorum (id 7, members 0-2) ended at step 10."""
    return changed(follower(me, voters=3, params=STANDING),
                   member=Membership(last_quorum=last_quorum(), standing=grant))


def ask(s: QuorumCore, step: int = 11, *, me: int = 1,
        generation: int = 0) -> tuple[QuorumCore, list]:
    return run(s, [QuorumRequested(step, address(me, generation))])


# --------------------------------------------------------------------------- member side


def test_a_member_within_the_grant_is_answered_on_the_spot() -> None:
    s, actions = ask(granted())
    (quorum,) = delivered(actions)
    assert not sent(actions, JoinRequested)
    assert quorum.quorum_id == QUORUM_ID and quorum.replica_ids == (0, 1, 2)
    assert quorum.max_step == 11 and {m.next_step for m in quorum.members} == {11}
    assert quorum.behind == () and (quorum.term, quorum.leader_id) == (TERM, 0)
    assert s.member.last_quorum == quorum and s.member.standing == GRANT
    assert s.member.request is None
    # and the next step too, up to the grant's last
    for step in range(12, GRANT.through + 1):
        s, actions = ask(s, step)
        assert [q.max_step for q in delivered(actions)] == [step]
    s, actions = ask(s, GRANT.through + 1)
    assert not delivered(actions) and sent(actions, JoinRequested)


@pytest.mark.parametrize("why, state, step, kwargs", [
    ("no grant", lambda: granted(grant=None), 11, {}),
    ("a grant for another quorum", lambda: granted(grant=Standing(QUORUM_ID + 1, 15)), 11, {}),
    ("beyond the grant", lambda: granted(grant=Standing(QUORUM_ID, 10)), 11, {}),
    ("not the step after its last", granted, 12, {}),
    ("a step again (rolled back)", granted, 10, {}),
    ("a new address (restarted)", granted, 11, {"generation": 1}),
    ("another leader", lambda: changed(granted(), leader_id=2), 11, {}),
    ("a later term", lambda: changed(granted(), term=TERM + 1), 11, {}),
    ("no leader", lambda: changed(granted(), leader_id=None), 11, {}),
    ("not a member", lambda: changed(granted(), member=Membership(
        last_quorum=last_quorum((0, 2)), standing=GRANT)), 11, {}),
])
def test_anything_else_asks_for_a_round(why: str, state: Any, step: int,
                                        kwargs: dict) -> None:
    _, actions = ask(state(), step, **kwargs)
    assert not delivered(actions), why


def test_a_failed_commit_asks_for_a_round_with_its_flag() -> None:
    s, _ = run(granted(), [CommitFailureReported()])
    _, actions = ask(s)
    assert not delivered(actions)
    (join,) = sent(actions, JoinRequested)
    assert join.message.commit_failed


def test_the_next_heartbeats_grant_answers_a_join_sent_on_a_stale_one() -> None:
    s, actions = ask(granted(grant=Standing(QUORUM_ID, 10)))
    assert sent(actions, JoinRequested) and not delivered(actions)
    s, actions = run(s, [MessageReceived(0, Heartbeat(TERM, (), Standing(QUORUM_ID, 13)))])
    (quorum,) = delivered(actions)
    assert quorum.max_step == 11 and s.member.request is None
    # a grant for another quorum changes nothing
    s, actions = ask(granted(grant=None))
    s, actions = run(s, [MessageReceived(0, Heartbeat(TERM, (), Standing(QUORUM_ID + 1, 13)))])
    assert not delivered(actions) and s.member.standing is None


@pytest.mark.parametrize("why, message", [
    ("a new leader", Heartbeat(TERM + 1, (), None)),
    ("a candidate's vote request", VoteRequested(TERM + 1)),
])
def test_a_leader_change_voids_the_grant_and_the_member_leaves_its_standing_ring(
        why: str, message: object) -> None:
    """The others may learn of the change first and ask a round for a step this
    member stands at: it gives up its ring of any step after the last a round
    answered, and asks the round itself from then on."""
    s = granted()
    s.member.round_step = 8
    after_lease = NOW + PARAMS.election_timeout  # a vote is refused while the lease holds
    s, actions = run(s, [MessageReceived(2, message)], now=after_lease)  # type: ignore[arg-type]
    assert s.member.standing is None, why
    assert fact(StandingEnded, 1, QUORUM_ID, 8, 1) in actions, why
    s, actions = ask(s)
    assert not delivered(actions)


def test_the_same_leader_keeps_the_grant() -> None:
    s, actions = run(granted(), [MessageReceived(0, Heartbeat(TERM, (), GRANT))])
    assert s.member.standing == GRANT
    assert not [a for a in actions if isinstance(a, StandingEnded)]


def test_off_a_grant_is_ignored() -> None:
    s = changed(granted(grant=None), params=PARAMS)
    s, actions = run(s, [MessageReceived(0, Heartbeat(TERM, (), GRANT))])
    assert s.member.standing is None
    _, actions = ask(s)
    assert not delivered(actions) and sent(actions, JoinRequested)


def test_every_member_computes_the_same_quorum() -> None:
    answers = {delivered(ask(granted(me), me=me)[1])[0] for me in (1, 2)}
    assert len(answers) == 1


# --------------------------------------------------------------------------- leader side


def steady_leader(step: int = 10) -> QuorumCore:
    """Leader 0 of 3 that formed quorum 7 (members 0-2) this term, all live."""
    s = leader(3, live=(1, 2), params=STANDING)
    s.last_formed = s.member.last_quorum = last_quorum(step=step)
    return s


def at_step(s: QuorumCore, step: int) -> QuorumCore:
    s.member.last_quorum = advance(s.member.last_quorum, step)  # type: ignore[arg-type]
    return s


def paced(s: QuorumCore, steps_per_second: float, ticks: int = 3,
          now: float = 100.0) -> tuple[QuorumCore, float]:
    """Tick at each heartbeat interval, the leader's step rising at this pace."""
    interval = s.params.heartbeat_interval
    for _ in range(ticks):
        now += interval
        s = at_step(s, s.member.last_quorum.max_step + round(steps_per_second * interval))
        s.heard = {1: now, 2: now}
        s, _ = tick(s, now)
    return s, now


def test_the_leader_grants_what_it_steps_in_the_horizon() -> None:
    s, _ = paced(steady_leader(), 50.0)
    grant = s.lead.standing
    ahead = int(50.0 * s._horizon())
    assert grant == Standing(QUORUM_ID, s.member.last_quorum.max_step + ahead)
    assert s.member.standing == grant   # it answers itself by it too
    s.heard = {1: 101.0, 2: 101.0}
    s, actions = tick(s, 100.0 + 10 * PARAMS.heartbeat_interval)
    assert [h.message.standing for h in sent(actions, Heartbeat)] in ([grant], [])


def test_heartbeats_carry_a_new_grant_to_every_member() -> None:
    s, now = paced(steady_leader(), 50.0, ticks=2)
    before = s.lead.standing
    s = at_step(s, s.member.last_quorum.max_step + 5)
    s.heard, s.lead.contacted = {1: now, 2: now}, {1, 2}
    s, actions = tick(s, now + PARAMS.heartbeat_interval)
    assert s.lead.standing != before
    (beat,) = sent(actions, Heartbeat)
    assert set(beat.to) == {1, 2} and beat.message.standing == s.lead.standing


def test_slow_steps_get_no_grant() -> None:
    s, _ = paced(steady_leader(), 1.0, ticks=5)
    assert s.lead.standing is None


@pytest.mark.parametrize("why", ["a join is open", "another term", "not its own quorum"])
def test_the_grant_stops_growing_when_a_round_is_asked_for(why: str) -> None:
    s, now = paced(steady_leader(), 50.0)
    grant = s.lead.standing
    assert grant is not None
    heard = {1: now, 2: now}
    if why == "a join is open":
        s.lead.round = Round(now, {2: JoinRequested(TERM, 0, address(2, 1), 0, 1)})
    elif why == "another term":
        s.term = TERM + 1
    else:
        s.last_formed = None
    for _ in range(3):
        now += PARAMS.heartbeat_interval
        s = at_step(s, s.member.last_quorum.max_step + 5)
        s.heard = dict(heard)
        s, _ = tick(s, now)
    assert s.lead.standing == grant, why


# --------------------------------------------------------------------------- whole clusters

QUICK = dataclasses.replace(FAST, standing=True)
STEP = 0.02   # seconds between steps: a grant spans several


def train(sim: Sim, members: list[int], first: int, last: int) -> dict[int, list[Quorum]]:
    """Each of ``members`` asks for step after step as soon as it has the last;
    what each got, by step."""
    got: dict[int, list[Quorum]] = {r: [] for r in members}
    for step in range(first, last + 1):
        before = {r: len(sim.delivered[r]) for r in members}
        for r in members:
            sim.request(r, step)
        assert sim.run_until(lambda b=before: all(len(sim.delivered[r]) > b[r] for r in members),
                             5.0), f"step {step} incomplete"
        for r in members:
            got[r].append(sim.delivered[r][-1])
        sim.run(STEP)
    return got


def joins_sent(sim: Sim, since: int) -> int:
    return sum(len(a.to) for _, a in sim.actions[since:]
               if isinstance(a, Send) and isinstance(a.message, JoinRequested))


def test_steady_steps_need_no_joins_and_all_members_agree() -> None:
    sim = Sim(range(3), params=QUICK)
    assert sim.run_until(sim.stable, 5.0)
    got = train(sim, [0, 1, 2], 1, 40)
    for step, quorums in enumerate(zip(*got.values()), start=1):
        assert len(set(quorums)) == 1, f"members took different quorums for step {step}"
        assert quorums[0].max_step == step and quorums[0].replica_ids == (0, 1, 2)
    mark = len(sim.actions)
    train(sim, [0, 1, 2], 41, 80)
    # every step a round would cost a join per follower (80); standing, almost none
    assert joins_sent(sim, mark) < 40 * 2 / 4
    off = Sim(range(3), params=FAST)
    assert off.run_until(off.stable, 5.0)
    train(off, [0, 1, 2], 1, 40)
    mark = len(off.actions)
    train(off, [0, 1, 2], 41, 80)
    assert joins_sent(off, mark) >= 40 * 2


def test_a_newcomer_joins_when_the_grant_runs_out() -> None:
    sim = Sim(range(4), params=QUICK)
    assert sim.run_until(sim.stable, 5.0)
    train(sim, [0, 1, 2], 1, 30)
    assert sim.delivered[0][-1].replica_ids == (0, 1, 2)
    # replica 3 arrives at step 31: the others reach the end of their grant and join
    # the round that takes it in
    for step in range(31, 60):
        got = train(sim, [0, 1, 2, 3], step, step)
        if all(q[-1].replica_ids == (0, 1, 2, 3) for q in got.values()):
            break
    else:
        pytest.fail("replica 3 was never admitted")
    assert len({q[-1] for q in got.values()}) == 1
    assert step - 31 <= 1 + int(sim.states[0]._horizon() / STEP) + 2


def test_a_member_cut_off_commits_nothing() -> None:
    """It may go on with its standing quorum until the grant or its leader contact
    runs out; the others form a new quorum without it. For every step, at most one
    quorum reaches all of its members: only that one's ring can commit it."""
    sim = Sim(range(5), params=QUICK)
    assert sim.run_until(sim.stable, 5.0)
    leader = sim.leader()
    train(sim, list(range(5)), 1, 20)
    victim = (leader + 1) % 5
    sim.partition([victim], [r for r in range(5) if r != victim])
    rest = [r for r in range(5) if r != victim]
    by_step: dict[int, dict[Quorum, set[int]]] = {}
    for step in range(21, 61):
        for r in range(5):
            sim.request(r, step)
        sim.run_until(lambda s=step: all(sim.delivered[r][-1].max_step == s for r in rest), 5.0)
        sim.run(STEP)
    for r, quorums in sim.delivered.items():
        for q in quorums:
            by_step.setdefault(q.max_step, {}).setdefault(q, set()).add(r)
    for step, takers in by_step.items():
        complete = [q for q, who in takers.items() if set(q.replica_ids) <= who]
        assert len(complete) <= 1, f"step {step}: two quorums could commit: {complete}"
    assert all(sim.delivered[r][-1].replica_ids == tuple(rest) for r in rest)
    cut_off = [q for q in sim.delivered[victim] if q.max_step > 20]
    assert len(cut_off) <= 1 + int(sim.states[leader]._horizon() / STEP) + 2


@pytest.mark.parametrize("seed", range(6))
def test_random_faults_never_let_two_quorums_commit_a_step(seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim(range(5), params=QUICK, seed=seed, latency=0.001, jitter=0.004)
    next_step = dict.fromkeys(range(5), 1)
    for _ in range(300):
        fault = rng.random()
        alive = [r for r in range(5) if r not in sim.dead]
        if fault < 0.01 and len(alive) > 3:
            sim.kill(rng.choice(alive))
        elif fault < 0.02 and sim.dead:
            r = rng.choice(sorted(sim.dead))
            sim.start(r, seq_base=10**6 * (1 + len(sim.delivered[r])))
        elif fault < 0.03:
            cut = rng.sample(range(5), rng.randint(1, 2))
            sim.partition(cut, [r for r in range(5) if r not in cut])
        elif fault < 0.05:
            sim.heal()
        for r in range(5):
            if r not in sim.dead and sim.states[r].member.request is None:
                last = sim.delivered[r][-1].max_step if sim.delivered[r] else 0
                next_step[r] = last + 1
                sim.request(r, next_step[r])
        sim.run(STEP)
    by_step: dict[int, dict[Quorum, set[int]]] = {}
    membership: dict[int, frozenset[int]] = {}
    for r, quorums in sim.delivered.items():
        for q in quorums:
            by_step.setdefault(q.max_step, {}).setdefault(q, set()).add(r)
            assert q.includes(r)
            assert membership.setdefault(q.quorum_id, frozenset(q.replica_ids)) == \
                frozenset(q.replica_ids), f"quorum {q.quorum_id} named two memberships"
    for step, takers in by_step.items():
        complete = [q for q, who in takers.items() if set(q.replica_ids) <= who]
        assert len(complete) <= 1, f"step {step}: two quorums could commit: {complete}"
    assert max(by_step) > 50   # training went on


def test_a_silent_member_revokes_the_grant_at_once() -> None:
    """Nobody may step with a member the leader lost: the leader drops its grant, its
    next heartbeat says so to every member (with the suspect), and a member that
    hears of the suspect first asks for a round even on a grant it still holds."""
    s, now = paced(steady_leader(), 50.0)
    assert s.lead.standing is not None
    now += PARAMS.member_timeout + PARAMS.heartbeat_interval
    s.heard = {1: now}
    s, actions = tick(s, now)
    assert s.lead.standing is None and s.member.standing is None
    (beat,) = sent(actions, Heartbeat)
    assert set(beat.to) == {1, 2} and beat.message == Heartbeat(TERM, (2,), None)
    follower_state, _ = run(granted(), [MessageReceived(0, beat.message)])
    assert follower_state.member.standing is None
    _, actions = ask(follower_state)
    assert not delivered(actions) and sent(actions, JoinRequested)
    # the suspect alone is enough
    suspecting = changed(granted(), suspects=frozenset({2}))
    _, actions = ask(suspecting)
    assert not delivered(actions) and sent(actions, JoinRequested)


def test_a_member_asking_for_a_round_within_the_grant_ends_it_there() -> None:
    """The others may be in that step's all-reduce waiting for it: the leader ends
    the grant before the step and tells everyone at once, and each member's
    manager gives up such a ring (``StandingEnded``); the step is retried."""
    s, now = paced(steady_leader(), 50.0)
    grant = s.lead.standing
    step = s.member.last_quorum.max_step + 1
    assert grant is not None and grant.through > step
    asking = join(2, step, last=QUORUM_ID, seq=5, commit_failed=True)
    s, actions = run(s, [asking], now)
    ended = Standing(QUORUM_ID, step - 1, ended_by=2)
    assert s.lead.standing == ended and s.member.standing == ended
    (beat,) = sent(actions, Heartbeat)
    assert set(beat.to) == {1, 2} and beat.message.standing == ended
    assert fact(StandingEnded, 0, QUORUM_ID, step - 1, 2) in actions
    # a follower hears of it: it tells its manager, and asks for a round from there
    f, actions = run(granted(), [MessageReceived(0, beat.message)])
    assert fact(StandingEnded, 1, QUORUM_ID, step - 1, 2) in actions
    f, _ = run(f, [MessageReceived(0, beat.message)])   # said once
    f.member.last_quorum = last_quorum(step=step - 1)
    _, actions = ask(f, step)
    assert not delivered(actions) and sent(actions, JoinRequested)


@pytest.mark.parametrize("why", ["beyond the grant", "answered before", "not a member"])
def test_other_joins_leave_the_grant_alone(why: str) -> None:
    s, now = paced(steady_leader(), 50.0)
    grant = s.lead.standing
    assert grant is not None
    if why == "beyond the grant":
        event = join(2, grant.through + 1, last=QUORUM_ID, seq=5)
    elif why == "answered before":
        s.lead.answered_seq = {2: 5}
        event = join(2, grant.through, last=QUORUM_ID, seq=5)
    else:
        s.member.last_quorum = s.last_formed = last_quorum((0, 1), step=10)
        s.lead.standing = grant = Standing(QUORUM_ID, 20)
        event = join(2, 11, last=QUORUM_ID, seq=5)
    s, actions = run(s, [event], now)
    assert s.lead.standing == grant, why
    assert not [a for a in actions if isinstance(a, StandingEnded)]


def test_a_member_left_behind_does_not_hold_the_others_up() -> None:
    """Whatever sends one member to a round while the others stand (a grant it
    missed, a commit only it failed), the round forms with everyone within a join
    window, not after ftar.timeout."""
    sim = Sim(range(3), params=QUICK)
    assert sim.run_until(sim.stable, 5.0)
    train(sim, [0, 1, 2], 1, 30)
    leader = sim.leader()
    odd = (leader + 1) % 3
    # it failed the commit of step 30 alone: it asks for step 30 again, the others
    # stand at step 31
    sim.feed(odd, CommitFailureReported())
    sim.request(odd, 30)
    others = [r for r in range(3) if r != odd]
    for r in others:
        sim.request(r, 31)
    assert sim.run_until(lambda: any(isinstance(a, StandingEnded)
                                     for _, a in sim.actions), QUICK.join_timeout)
    ended = {r for r, a in sim.actions if isinstance(a, StandingEnded)}
    assert set(others) <= ended
    # the others' rings give up (the manager's part); they ask again for step 31
    for r in others:
        sim.request(r, 31)
    assert sim.run_until(lambda: all(sim.delivered[r][-1].max_step == 31 and
                                     set(sim.delivered[r][-1].replica_ids) == {0, 1, 2}
                                     for r in others), 5.0)


def test_a_join_that_only_missed_the_grant_gets_it_again() -> None:
    """A member whose heartbeat with the newest grant came late joins: it is sent
    the grant at once (it answers itself by it, see the follower tests above). The
    same join once more means it still cannot use it: the grant ends there."""
    s, now = paced(steady_leader(), 50.0)
    grant = s.lead.standing
    step = s.member.last_quorum.max_step + 1
    late = join(2, step, last=QUORUM_ID, seq=5)
    s, actions = run(s, [late], now)
    assert s.lead.standing == grant
    (beat,) = sent(actions, Heartbeat)
    assert beat.to == (2,) and beat.message.standing == grant
    assert not [a for a in actions if isinstance(a, StandingEnded)]
    assert s.lead.round is None, "the grant answers the join: no round waits for it"
    s, actions = run(s, [late], now + 0.5)
    assert s.lead.standing == Standing(QUORUM_ID, step - 1, ended_by=2)
    assert fact(StandingEnded, 0, QUORUM_ID, step - 1, 2) in actions
    assert s.lead.round.joins[2].join_seq == 5, "ended: the round answers it"


def test_a_join_the_grant_answered_leaves_the_grant_growing() -> None:
    """Left in the round, a late join would stop the grant at once (a round is asked
    for), and the round at its end would count the member at that old step while
    it waits for the answer to a later join: the others would step with it, and
    it would wait alone."""
    s, now = paced(steady_leader(), 50.0)
    grant = s.lead.standing
    late = join(2, s.member.last_quorum.max_step + 1, last=QUORUM_ID, seq=5)
    s, _ = run(s, [late], now)
    s, _ = paced(s, 50.0, now=now)
    assert s.lead.standing.through > grant.through


def test_a_member_that_cannot_use_a_covering_grant_joins_again() -> None:
    """Its join looked late to the leader, which sent the grant back; it still
    cannot use it (here: it suspects a member): it sends the same join again, which
    ends the grant at the leader."""
    s = changed(granted(grant=Standing(QUORUM_ID, 10)), suspects=frozenset({2}))
    s, actions = ask(s)
    (first,) = sent(actions, JoinRequested)
    s, actions = run(s, [MessageReceived(0, Heartbeat(TERM, (2,), GRANT))])
    (again,) = sent(actions, JoinRequested)
    assert again.to == (0,) and again.message.join_seq == first.message.join_seq
    assert not delivered(actions)
