"""The ETTR model reproduces the papers' own arithmetic before projecting ours."""

import pytest

from ft_launch.launcher.reporting.ettr import (
    JobModel,
    RecoveryCost,
    binomial_quantile,
    periodic_failures,
    poisson_failures,
    simulate,
    standby_size,
)

MIN = 60.0
HORIZON = 100 * 18 * MIN


def fthsdp_failures():
    return periodic_failures(18 * MIN, HORIZON, first=0.0)  # one failure every 18 min


def test_reproduces_fthsdp_synchronous_recovery_44_percent():
    result = simulate(fthsdp_failures(), RecoveryCost(stall=10 * MIN), JobModel(12, HORIZON))
    assert result.ettr == pytest.approx(8 / 18, abs=1e-9)
    assert result.failures == 100


def test_reproduces_fthsdp_async_recovery_80_percent():
    cost = RecoveryCost(stall=3 * MIN, degraded=7 * MIN)
    result = simulate(fthsdp_failures(), cost, JobModel(12, HORIZON))
    assert result.ettr == pytest.approx((8 + 7 * 11 / 12) / 18, abs=1e-9)
    assert result.ettr == pytest.approx(0.80, abs=0.01)


def test_overlapping_failures_do_not_double_count():
    # Two failures 1 min apart, 10-min stalls: the job is down 11 min, not 20.
    result = simulate([0.0, MIN], RecoveryCost(stall=10 * MIN), JobModel(4, 60 * MIN))
    assert result.stalled_s == pytest.approx(11 * MIN)
    assert result.ettr == pytest.approx(49 / 60)


def test_two_replicas_out_at_once_halve_capacity_of_four():
    cost = RecoveryCost(stall=0.0, degraded=10 * MIN)
    result = simulate([0.0, 0.0], cost, JobModel(4, 10 * MIN))
    assert result.ettr == pytest.approx(0.5)


def test_empty_standby_pool_falls_back_to_reschedule():
    cost = RecoveryCost(stall=MIN, degraded=2 * MIN, fallback_stall=10 * MIN)
    job = JobModel(8, 120 * MIN, standby=1, replenish=60 * MIN)
    result = simulate([0.0, 30 * MIN, 90 * MIN], cost, job)
    assert result.fallbacks == 1          # the second failure found the pool empty
    assert result.stalled_s == pytest.approx(MIN + 10 * MIN + MIN)
    more = simulate([0.0, 30 * MIN, 90 * MIN], cost, JobModel(8, 120 * MIN, 2, 60 * MIN))
    assert more.fallbacks == 0 and more.ettr > result.ettr


def test_poisson_failures_have_the_requested_rate():
    times = poisson_failures(rate_per_s=1 / 60, horizon=600_000, seed=3)
    assert len(times) == pytest.approx(10_000, rel=0.05)
    assert times == sorted(times) and times[-1] < 600_000


def test_binomial_quantile_matches_direct_sum():
    # n=10, p=0.5: P[X<=6] = 0.828, P[X<=7] = 0.945, P[X<=8] = 0.989, P[X<=9] = 0.999
    assert binomial_quantile(10, 0.5, 0.9) == 7
    assert binomial_quantile(10, 0.5, 0.99) == 9
    assert binomial_quantile(100_000, 1e-4, 0.99) >= 10  # mean 10, large n in log space
    assert binomial_quantile(50, 0.0, 0.99) == 0


def test_standby_size_grows_with_machines_and_window():
    small = standby_size(1_000, daily_rate=0.002, window_hours=24)
    assert standby_size(10_000, 0.002, 24) > small
    assert standby_size(1_000, 0.002, 72) > small
    assert small >= 2  # mean 2 failures a day: P99 is above the mean
