"""The token bucket and rate validation: pure logic, property-tested."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ratecontrol import MAX_RATE, UNLIMITED, InvalidRateError, TokenBucket, capped, check_rate

rates = st.floats(min_value=0.5, max_value=1e9, allow_nan=False, allow_infinity=False)
steps = st.lists(
    st.tuples(
        st.floats(min_value=0, max_value=5, allow_nan=False), st.integers(min_value=0, max_value=10**7)
    ),
    max_size=50,
)


@pytest.mark.parametrize("bad", [math.nan, 0.0, -1.0, -math.inf])
def test_check_rate_rejects_non_rates(bad: float) -> None:
    with pytest.raises(InvalidRateError, match="rate"):
        check_rate(bad)


@pytest.mark.parametrize("huge", [1e308, MAX_RATE * (1 + 1e-15)])
def test_a_finite_rate_past_the_most_is_not_a_rate_but_inf_is(huge: float) -> None:
    """1e308 records/s was a rate: twice it (a batch's cap at a 2 s trigger) overflowed to inf."""
    with pytest.raises(InvalidRateError, match=r"at most 1e\+12 records/s \(or inf for unlimited\)"):
        check_rate(huge)
    assert check_rate(MAX_RATE) == MAX_RATE and check_rate(UNLIMITED) == UNLIMITED
    # what the arithmetic makes (an estimator's proposal, a share) is brought down, not refused
    assert capped(huge) == MAX_RATE and capped(UNLIMITED) == UNLIMITED and capped(5.0) == 5.0
    bucket = TokenBucket(huge)
    assert bucket.rate == MAX_RATE and bucket.take(10**12, now=0.0) == int(MAX_RATE * 0.2)


def test_unlimited_grants_everything() -> None:
    bucket = TokenBucket(UNLIMITED)
    assert bucket.take(10**12, now=0.0) == 10**12
    assert bucket.seconds_until(10**9, now=0.0) == 0.0


@given(rate=rates, script=steps)
def test_taken_never_exceeds_rate_times_time_plus_burst(rate: float, script: list[tuple[float, int]]) -> None:
    bucket = TokenBucket(rate, burst_seconds=0.2, now=0.0)
    now = 0.0
    taken = 0
    for dt, wanted in script:
        now += dt
        got = bucket.take(wanted, now)
        assert 0 <= got <= wanted
        assert bucket.available(now) >= 0
        taken += got
    assert taken <= rate * now + bucket.burst + 1e-6 * max(1.0, rate * now)


@given(rate=rates)
def test_an_idle_bucket_refills_to_its_burst(rate: float) -> None:
    bucket = TokenBucket(rate, burst_seconds=0.2, now=0.0)
    bucket.take(10**12, 0.0)
    assert bucket.take(10**12, 1_000.0) == int(bucket.burst)


def test_rate_change_takes_effect_and_caps_saved_tokens() -> None:
    bucket = TokenBucket(1_000.0, burst_seconds=0.2, now=0.0)
    assert bucket.take(10_000, 0.0) == 200
    bucket.set_rate(10.0, 0.0)
    assert bucket.take(10_000, 1.0) == 2  # burst of a 10/s bucket
    bucket.set_rate(UNLIMITED, 1.0)
    assert bucket.take(5, 1.0) == 5
    bucket.set_rate(100.0, 1.0)
    assert bucket.available(1.0) == pytest.approx(20.0)  # capped to the new burst
    assert bucket.seconds_until(30, 1.0) == 0.0  # wanting more than a burst waits for a burst


@given(rate=rates, script=steps, at_least=st.integers(min_value=1, max_value=10**6))
def test_take_at_least_grants_nothing_or_a_whole_quantum(
    rate: float, script: list[tuple[float, int]], at_least: int
) -> None:
    bucket = TokenBucket(rate, burst_seconds=0.2, now=0.0)
    now = 0.0
    for dt, wanted in script:
        now += dt
        got = bucket.take(wanted, now, at_least=at_least)
        assert got == 0 or got >= min(wanted, at_least, math.floor(bucket.burst))
        assert 0 <= got <= wanted


def test_take_at_least_waits_for_the_quantum() -> None:
    bucket = TokenBucket(1_000.0, burst_seconds=0.2, now=0.0)
    assert bucket.take(10_000, 0.0) == 200
    assert bucket.take(10_000, 0.01, at_least=50) == 0  # 10 tokens: not yet
    assert bucket.take(10_000, 0.05, at_least=50) == 50
    assert bucket.take(3, 0.06, at_least=50) == 3  # wanting less than the quantum takes what it wants
