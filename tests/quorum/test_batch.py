"""A leader takes the joins it read at once as one batch (``formation.on_joins``):
randomized runs check that the batch gives exactly what one message at a time
gives (same state, same actions in the same order), answered and duplicate
joins, unknown addresses, higher terms and formations in mid-batch included."""

from __future__ import annotations

import random

import pytest

from ft_launch.launcher.quorum import core, election, formation
from ft_launch.launcher.quorum.model import (
    Health,
    HeartbeatAcked,
    JoinRequested,
    QuorumParams,
    Role,
    evolve,
)
from ft_launch.launcher.quorum.state import (
    NEVER,
    Action,
    MessageReceived,
    MessagesReceived,
    NotifyQuorumFormed,
    QuorumRequested,
    QuorumState,
    Round,
    Send,
)

from .builders import NOW, PREVIOUS_ID, TERM, address, leader

VOTERS = 9
#: A short window and heartbeat so that runs cross both.
PARAMS = QuorumParams(min_replicas=1, join_timeout=0.4, heartbeat_interval=0.3,
                      election_timeout=0.5, election_spread=0.5, member_timeout=1.0,
                      ack_interval=0.3)


def reference_on_join(s: QuorumState, sender: int, join: JoinRequested, now: float
                      ) -> tuple[QuorumState, list[Action]]:
    """The rules of one join, written plainly (as ``formation.on_join`` was
    before batching): the model the batch must match."""
    if s.role is not Role.LEADER:
        return s, []
    lead = s.leadership
    if join.join_seq <= lead.answered_seq.get(sender, -1):
        last = lead.last_announce
        if last is not None and last.answered.get(sender) == join.join_seq and sender != s.me:
            return s, [Send((sender,), last)]
        return s, []
    if not join.address:
        known = lead.addresses.get(sender)
        if known is None:
            return s, []
        join = evolve(join, address=known)
    elif lead.addresses.get(sender) != join.address:
        lead = evolve(lead, addresses={**lead.addresses, sender: join.address})
    current = lead.round or Round(opened_at=now, joins={})
    s = evolve(s, leadership=evolve(lead, round=Round(current.opened_at,
                                                      {**current.joins, sender: join},
                                                      current.formable_at)))
    return formation.try_form(s, now)


def one_at_a_time(s: QuorumState, messages: tuple[MessageReceived, ...], now: float
                  ) -> tuple[QuorumState, list[Action]]:
    """What ``decide`` does with a batch, one message at a time by the model."""
    before, actions = s, []
    for received in messages:
        sender, message = received.sender, received.message
        if not isinstance(message, JoinRequested) or sender == s.me or sender not in s.voters:
            s, more = core._on_message(s, sender, message, now)
            actions += more
            continue
        if s.heard.get(sender, NEVER) < now - core._HEARD_RESOLUTION:
            s = evolve(s, heard={**s.heard, sender: now})
        s, more = election.adopt_term(s, message.term, now)
        actions += more
        s, more = reference_on_join(s, sender, message, now)
        actions += more
    s, more = core._on_time(s, now)
    actions += more
    s, more = core._follow_transitions(before, s, now)
    return s, actions + more


def random_message(rng: random.Random, step: int) -> MessageReceived:
    sender = rng.choice([*range(VOTERS), 42])  # itself and a stranger too
    higher = rng.random() < 0.002  # deposes the leader: rare, or little else is tested
    if rng.random() < 0.1:
        return MessageReceived(sender, HeartbeatAcked(TERM + higher))
    term = TERM + higher - (rng.random() < 0.1)
    known = rng.random() < 0.3
    return MessageReceived(sender, JoinRequested(
        term, step + rng.randrange(2), "" if known else address(sender, rng.randrange(2)),
        Health.UNHEALTHY if rng.random() < 0.05 else Health.OK,
        rng.choice([0, PREVIOUS_ID]), rng.randrange(1, 4) + step, rng.random() < 0.05))


def replay(seed: int) -> int:
    """One random run, checked batch by batch; the quorums it formed."""
    rng = random.Random(seed)
    live = [0, *rng.sample(range(1, VOTERS), rng.randrange(4, VOTERS))]
    state = leader(VOTERS, live=live, previous=live, params=PARAMS)
    reference, now, formed = state, NOW, 0
    for step in range(30):
        now += rng.choice([0.0, 0.01, 0.2, 0.5])
        if rng.random() < 0.2:
            own = QuorumRequested(step, address(0))
            state, _ = core.decide(state, own, now)
            reference, _ = core.decide(reference, own, now)
        batch = tuple(random_message(rng, step) for _ in range(rng.randrange(1, 25)))
        state, actions = core.decide(state, MessagesReceived(batch), now)
        reference, expected = one_at_a_time(reference, batch, now)
        assert actions == expected, f"seed {seed} step {step}"
        assert state == reference, f"seed {seed} step {step}"
        formed += sum(isinstance(a, NotifyQuorumFormed) for a in actions)
    return formed


@pytest.mark.parametrize("seed", range(40))
def test_a_batch_of_joins_is_one_message_at_a_time(seed: int) -> None:
    replay(seed)


def test_the_random_runs_form_quorums() -> None:
    """Otherwise the equivalence above would say little about formation."""
    assert sum(replay(seed) for seed in range(40)) >= 20
