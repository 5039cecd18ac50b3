"""Fail-slow among replicas that step in lockstep: their own times are compared."""

from __future__ import annotations

import itertools
import random

import pytest

from ft_launch.health.anomaly import PeerSlowdownDetector


def feed(detector: PeerSlowdownDetector, own: dict[int, float], steps: int,
         jitter: float = 0.0, seed: int = 0) -> list:
    rng = random.Random(seed)
    found = []
    for _, (peer, base) in itertools.product(range(steps), own.items()):
        slow = detector.observe(peer, base * (1 + rng.uniform(-jitter, jitter)))
        if slow is not None:
            found.append(slow)
    return found


def test_the_peer_whose_own_time_stays_above_the_factor_is_named_once_per_window():
    detector = PeerSlowdownDetector(factor=2.0, window=10)
    found = feed(detector, {0: 0.1, 1: 0.35, 2: 0.1}, steps=25, jitter=0.2)
    assert [s.peer for s in found] == [1, 1]       # after 10 and again after 20 steps
    assert found[0].own_s == pytest.approx(0.35, rel=0.25)
    assert found[0].peers_s == pytest.approx(0.1, rel=0.25)
    assert "as long as its peers" in found[0].describe()


def test_equal_peers_with_noise_and_single_outliers_are_never_named():
    detector = PeerSlowdownDetector(factor=2.0, window=10)
    assert feed(detector, {0: 0.1, 1: 0.1, 2: 0.1}, steps=200, jitter=0.6, seed=3) == []
    for _ in range(4):                        # a few slow steps in a window do not count
        assert detector.observe(1, 5.0) is None
    assert all(detector.observe(p, 0.1) is None for p in (0, 1, 2) for _ in range(3))


def test_just_below_the_factor_is_not_slow():
    detector = PeerSlowdownDetector(factor=2.0, window=5)
    assert feed(detector, {0: 0.1, 1: 0.199}, steps=20) == []


def test_nothing_is_named_without_full_windows_of_peers_or_after_forget():
    detector = PeerSlowdownDetector(factor=2.0, window=5)
    assert feed(detector, {1: 1.0}, steps=20) == []              # no peers at all
    assert feed(detector, {0: 0.1}, steps=4) == []               # peer 0: 4 < 5 steps
    detector.forget(1)                                           # relaunched: a new window
    assert detector.observe(1, 1.0) is None
    assert detector.observe(0, 0.1) is None                      # now 5 steps of peer 0
    assert detector.observe(1, float("nan")) is None             # ignored


def test_a_recovered_peer_is_not_named_again():
    detector = PeerSlowdownDetector(factor=2.0, window=5)
    assert [s.peer for s in feed(detector, {0: 0.1, 1: 0.5}, steps=5)] == [1]
    assert feed(detector, {0: 0.1, 1: 0.11}, steps=30) == []
