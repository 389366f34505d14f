"""Rate estimators: Spark's PID worked by hand, properties of every estimator, and simulated pipelines.

Simulated pipeline (ratecontrol.simulate.Pipeline defaults, DESIGN.md's measured machine): 1 s batches,
0.4 s fixed cost per batch, 1/75,000 s per record, so a batch per interval holds (1 - 0.4) x 75,000 =
45,000 records: capacity 45k records/s. The publisher always offers 100k records/s; runs last 90 s.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ratecontrol
from ratecontrol import (
    ESTIMATORS,
    BatchMetrics,
    FixedEstimator,
    ModelEstimator,
    RateBounds,
    RateEstimator,
    SparkPIDEstimator,
    UnknownEstimatorError,
    make_estimator,
)
from ratecontrol.simulate import (
    UNJUDGED,
    Pipeline,
    Simulation,
    jumps,
    known_capacity,
    simulate,
    simulate_jumps,
    simulate_structured,
)

INF = math.inf

TARGET = inspect.signature(ModelEstimator).parameters["target_utilisation"].default
"""The model's default share of capacity in steady state."""


def batch(
    completed_at: float,
    records: int,
    processing_delay: float,
    late: float = 0.0,
    batch_interval: float = 1.0,
    backlog: int | None = None,
) -> BatchMetrics:
    """A batch that started `late` seconds after it was due (Spark's schedulingDelay): its oldest record
    waited the interval it was collected in plus that."""
    return BatchMetrics(
        batch_id=0,
        completed_at=completed_at,
        records=records,
        processing_delay=processing_delay,
        scheduling_delay=batch_interval + late,
        batch_interval=batch_interval,
        backlog=backlog,
    )


# --- the public surface ---------------------------------------------------------------------------------


def test_public_names_are_pinned() -> None:
    assert sorted(ratecontrol.__all__) == sorted(
        [
            "DEFAULT_ESTIMATOR",
            "ESTIMATORS",
            "MAX_RATE",
            "UNLIMITED",
            "BatchMetrics",
            "Demand",
            "FixedEstimator",
            "InvalidRateError",
            "ModelEstimator",
            "RateBounds",
            "RateEstimator",
            "Share",
            "SparkPIDEstimator",
            "StreamPolicy",
            "TokenBucket",
            "UnknownEstimatorError",
            "capped",
            "check_estimator",
            "check_rate",
            "make_estimator",
            "split_rate",
        ]
    )
    for name in ratecontrol.__all__:
        assert hasattr(ratecontrol, name)


def test_registry_knows_every_estimator_and_the_default() -> None:
    assert set(ESTIMATORS) == {"fixed", "spark-pid", "model"}
    assert ratecontrol.DEFAULT_ESTIMATOR == "model"
    for name in ESTIMATORS:
        estimator = make_estimator(name, bounds=RateBounds(10.0, 1e6), initial_rate=500.0)
        assert isinstance(estimator, RateEstimator)
        assert estimator.name == name
        assert estimator.rate == 500.0
        assert estimator.state()["estimator"] == name


def test_unknown_estimator_lists_the_known_ones() -> None:
    with pytest.raises(UnknownEstimatorError, match=r"'pid'.*fixed, model, spark-pid"):
        make_estimator("pid", bounds=RateBounds(), initial_rate=100.0)
    assert issubclass(UnknownEstimatorError, ValueError)


def test_make_estimator_passes_gains_and_rejects_unknown_or_bad_ones() -> None:
    pid = make_estimator("spark-pid", bounds=RateBounds(), initial_rate=INF, integral=0.5)
    assert isinstance(pid, SparkPIDEstimator)
    assert pid.integral == 0.5
    with pytest.raises(ValueError, match=r"no parameter 'gain'.*derivative, integral, proportional"):
        make_estimator("spark-pid", bounds=RateBounds(), initial_rate=INF, gain=1.0)
    with pytest.raises(ValueError, match=r"no parameter 'integral'.*it takes: none"):
        make_estimator("fixed", bounds=RateBounds(), initial_rate=INF, integral=1.0)
    with pytest.raises(ValueError, match="integral gain"):
        make_estimator("spark-pid", bounds=RateBounds(), initial_rate=INF, integral=-0.1)
    with pytest.raises(ValueError, match="horizon"):
        make_estimator("model", bounds=RateBounds(), initial_rate=1e4, horizon=0.5)
    with pytest.raises(ValueError, match="warmup_batches"):
        make_estimator("model", bounds=RateBounds(), initial_rate=1e4, warmup_batches=1.5)
    for bad in ({"jump_tolerance": 0.5}, {"jump_tolerance": math.nan}, {"jump_lateness": 0.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            make_estimator("model", bounds=RateBounds(), initial_rate=1e4, **bad)


@pytest.mark.parametrize(
    "fields",
    [
        {"batch_id": -1},
        {"records": -1},
        {"completed_at": -0.1},
        {"completed_at": math.nan},
        {"completed_at": math.inf},
        {"processing_delay": -1.0},
        {"processing_delay": math.nan},
        {"scheduling_delay": -0.001},
        {"scheduling_delay": math.nan},
        {"batch_interval": 0.0},
        {"batch_interval": math.nan},
        {"backlog": -5},
        {"waiting": -1},
    ],
)
def test_batch_metrics_reject_impossible_values(fields: dict[str, float]) -> None:
    good: dict[str, float | int | None] = {
        "batch_id": 1,
        "completed_at": 1.0,
        "records": 10,
        "processing_delay": 0.5,
        "scheduling_delay": 0.0,
        "batch_interval": 1.0,
    }
    name = next(iter(fields))
    with pytest.raises(ValueError, match=name):
        BatchMetrics(**{**good, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("low", "high"), [(0.0, 10.0), (-1.0, 10.0), (math.nan, 10.0), (10.0, math.nan), (10.0, 5.0), (INF, INF)]
)
def test_rate_bounds_reject_impossible_ranges(low: float, high: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        RateBounds(low, high)


def test_rate_bounds_clamp_and_may_be_unbounded_above() -> None:
    bounds = RateBounds(100.0, INF)
    assert bounds.clamp(5.0) == 100.0
    assert bounds.clamp(1e12) == 1e12
    assert RateBounds(5.0, 5.0).clamp(7.0) == 5.0


def test_fixed_never_proposes_a_rate() -> None:
    fixed = FixedEstimator(initial_rate=1000.0)
    assert fixed.compute(batch(1.0, 1000, 0.5)) is None
    assert fixed.compute(batch(2.0, 10**6, 50.0, late=30.0)) is None
    assert fixed.rate == 1000.0


def test_fixed_takes_an_operators_rate_as_its_own() -> None:
    fixed = FixedEstimator(initial_rate=1_000_000.0)
    fixed.adopt(300_000.0)
    assert fixed.rate == 300_000.0 and fixed.state()["rate"] == 300_000.0
    assert fixed.compute(batch(1.0, 1000, 0.5)) is None and fixed.rate == 300_000.0


# --- Spark's PID, worked by hand from PIDRateEstimator.compute ------------------------------------------


def test_spark_pid_first_batch_is_silent_then_follows_the_processing_rate() -> None:
    pid = SparkPIDEstimator()  # Kp=1, Ki=0.2, Kd=0, minRate=100
    # time=2000 ms, 45000 records in 1000 ms: processingRate = 45000 / 1000 * 1000 = 45000 rec/s.
    # First run: latestRate := 45000, latestError := 0, and no rate.
    assert pid.compute(batch(2.0, 45_000, 1.0)) is None
    assert pid.state()["latest_rate"] == 45_000.0
    assert pid.state()["latest_error"] == 0.0
    # time=3000: error = 45000 - 45000 = 0; historicalError = 0 * 45000 / 1000 = 0; dError = 0 / 1 = 0
    # newRate = 45000 - 1*0 - 0.2*0 - 0*0 = 45000
    assert pid.compute(batch(3.0, 45_000, 1.0)) == 45_000.0


def test_spark_pid_clamps_to_min_rate_after_a_21_second_delay() -> None:
    """DESIGN.md's failure mode: delay 21 s, interval 1 s; processingRate x (1 - 0.2 x 21) < 0."""
    pid = SparkPIDEstimator()
    pid.compute(batch(2.0, 45_000, 1.0))
    assert pid.compute(batch(3.0, 45_000, 1.0)) == 45_000.0
    # time=4000, the oldest record waited 22 s: 1 s of collection, then 21 s late, so Spark's
    # schedulingDelay = 21000 ms. processingRate = 45000; error = 45000 - 45000 = 0
    # historicalError = 21000 * 45000 / 1000 = 945000
    # newRate = max(45000 - 0 - 0.2 * 945000, 100) = max(-144000, 100) = 100
    assert pid.compute(batch(4.0, 45_000, 1.0, late=21.0)) == 100.0
    # time=5000: 100 records in 400 ms (all fixed cost), still 20 s late: processingRate = 100/400*1000 = 250
    # error = 100 - 250 = -150; historicalError = 20000 * 250 / 1000 = 5000
    # newRate = max(100 + 150 - 0.2 * 5000, 100) = max(-750, 100) = 100: starved at minRate
    assert pid.compute(batch(5.0, 100, 0.4, late=20.0)) == 100.0
    # time=6000, backlog gone: error = -150, historicalError = 0: newRate = 100 + 150 = 250, though the
    # pipeline can take 45000/s; the fixed cost makes the small batch look slow, so the climb is slow
    assert pid.compute(batch(6.0, 100, 0.4)) == 250.0


def test_spark_pid_all_three_terms_and_time_between_updates() -> None:
    pid = SparkPIDEstimator(proportional=0.5, integral=0.1, derivative=0.05)
    # 2 s interval = 2000 ms. time=10000, 3000 records in 1500 ms: processingRate = 2000; first run
    assert pid.compute(batch(10.0, 3000, 1.5, batch_interval=2.0)) is None
    # time=12500: delaySinceUpdate = (12500 - 10000) / 1000 = 2.5 s
    # processingRate = 5000 / 2000 * 1000 = 2500; error = 2000 - 2500 = -500
    # historicalError = 500 * 2500 / 2000 = 625; dError = (-500 - 0) / 2.5 = -200
    # newRate = 2000 - 0.5*(-500) - 0.1*625 - 0.05*(-200) = 2000 + 250 - 62.5 + 10 = 2197.5
    assert pid.compute(batch(12.5, 5000, 2.0, late=0.5, batch_interval=2.0)) == pytest.approx(
        2197.5, rel=1e-12
    )
    # time=14500: delaySinceUpdate = 2.0; processingRate = 4000 / 2500 * 1000 = 1600
    # error = 2197.5 - 1600 = 597.5; historicalError = 1000 * 1600 / 2000 = 800
    # dError = (597.5 - (-500)) / 2.0 = 548.75
    # newRate = 2197.5 - 0.5*597.5 - 0.1*800 - 0.05*548.75 = 2197.5 - 298.75 - 80 - 27.4375 = 1791.3125
    assert pid.compute(batch(14.5, 4000, 2.5, late=1.0, batch_interval=2.0)) == pytest.approx(
        1791.3125, rel=1e-12
    )


def test_spark_pid_goes_on_from_an_operators_rate() -> None:
    """An operator's rate (adopt) becomes Spark's latestRate: the next error is measured against the rate
    that was in force, not the PID's own last output."""
    pid = SparkPIDEstimator(proportional=0.5, integral=0.0)
    pid.adopt(7_000)  # before the first run: nothing to step from yet, the first run primes as ever
    assert pid.rate == 7_000 and pid.state()["first_run"] == 1
    assert pid.compute(batch(2.0, 45_000, 1.0)) is None  # latestRate := 45000
    pid.adopt(20_000)
    assert pid.state()["latest_rate"] == 20_000 and pid.rate == 20_000
    # time=3000, 20000 records in 1000 ms (what the operator's rate let in): processingRate = 20000
    # error = 20000 - 20000 = 0: newRate = 20000 (from the PID's own 45000 it would be
    # 45000 - 0.5 * 25000 = 32500)
    assert pid.compute(batch(3.0, 20_000, 1.0)) == 20_000.0
    pid.adopt(math.inf)  # no base to step from: latestRate stays
    assert pid.state()["latest_rate"] == 20_000 and math.isinf(pid.rate)
    assert pid.compute(batch(4.0, 20_000, 1.0)) == 20_000.0


def test_spark_pid_no_new_rate_cases_leave_its_state_alone() -> None:
    pid = SparkPIDEstimator()
    assert pid.compute(batch(1.0, 0, 0.5)) is None  # no elements: not even the first run
    assert pid.state()["first_run"] == 1
    assert pid.compute(batch(1.0, 1000, 0.0)) is None  # no processing delay
    # 0.4 ms of processing inside one clock millisecond: end 3000 ms, start 3000 ms: processingDelay 0
    assert pid.compute(batch(3.0005, 1000, 0.0004)) is None
    assert pid.state()["first_run"] == 1
    assert pid.compute(batch(2.0, 1000, 0.5)) is None  # the first run: rate 1000 / 500 * 1000 = 2000
    before = pid.state()
    assert pid.compute(batch(2.0, 1000, 0.5)) is None  # time not after the latest
    assert pid.compute(batch(1.5, 1000, 0.5)) is None  # time going back
    assert pid.compute(batch(2.5, 0, 0.5)) is None  # no elements
    assert pid.state() == before
    # time=3000 (1 s after the first run, the skipped ones did not move latestTime): rate = 2000
    assert pid.compute(batch(3.0, 1000, 0.5)) == 2000.0


def test_spark_pid_sees_milliseconds_as_spark_would() -> None:
    pid = SparkPIDEstimator(proportional=1.0, integral=1.0)
    pid.compute(batch(1.0, 350, 0.35))
    # end 4.35 s -> 4350 ms (not 4349 from 4.35 * 1000 == 4349.999...), start 4.0 s -> 4000 ms:
    # processingDelay = 350 ms; submitted 3.9995 s -> 3999 ms: schedulingDelay = 4000 - 3999 = 1 ms
    # processingRate = 350 / 350 * 1000 = 1000; error = 1000 - 1000 = 0
    # historicalError = 1 * 1000 / 1000 = 1; newRate = 1000 - 0 - 1.0 * 1 = 999
    assert pid.compute(batch(4.35, 350, 0.35, late=0.0005)) == 999.0
    state = pid.state()
    assert state["latest_time_ms"] == 4350


def test_spark_pid_clamps_to_max_outside_its_state() -> None:
    pid = SparkPIDEstimator(bounds=RateBounds(100.0, 30_000.0))
    pid.compute(batch(2.0, 45_000, 1.0))
    # Spark's newRate is 45000; the receiver's RateLimiter would cap it at maxRate, the estimator keeps 45000
    assert pid.compute(batch(3.0, 45_000, 1.0)) == 30_000.0
    assert pid.state()["latest_rate"] == 45_000.0
    assert pid.rate == 30_000.0


def test_spark_pid_with_huge_gains_stays_finite() -> None:
    """Gains of 1e308 were taken, and a step that overflowed left latest_rate inf, then NaN for good
    (rate inf): such a step is not taken, the state stays finite."""
    pid = SparkPIDEstimator(initial_rate=10_000.0, proportional=1e308, integral=1e308, derivative=1e308)
    for second, records in enumerate([1000, 5000, 200, 9000, 3000], 1):
        out = pid.compute(batch(second, records, 1.0, late=0.5))
        assert out is None or math.isfinite(out), out
        state = pid.state()
        values = [state["rate"], state["latest_rate"], state["latest_error"]]
        assert all(isinstance(v, float) and math.isfinite(v) for v in values), state


# --- the model estimator, batch by batch ----------------------------------------------------------------


def cost(records: int) -> float:
    """The simulated pipeline's processing time: 0.4 s + records / 75,000."""
    return 0.4 + records / 75_000


def test_model_does_not_read_the_start_up_batch_as_capacity() -> None:
    model = ModelEstimator(initial_rate=10_000.0)
    # 10 s of worker start-up in the first batch: 10k records / 10.53 s would say ~950 records/s
    assert model.compute(batch(11.53, 10_000, 10.0 + cost(10_000))) is None
    assert model.rate == 10_000.0
    # second batch: one point, fixed cost from the prior 0.25 s: b = (0.533 - 0.25) / 10k, capacity ~26.5k
    rate = model.compute(batch(12.1, 10_000, cost(10_000)))
    assert rate is not None
    assert rate > 20_000.0
    state = model.state()
    assert state["fit"] == "anchored"
    assert state["fixed_cost_s"] == pytest.approx(0.25)


def test_model_fits_fixed_and_per_record_cost_from_batches_of_different_sizes() -> None:
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0)
    now = 0.0
    for records in (10_000, 20_000, 30_000, 40_000):
        now += 1.0
        model.compute(batch(now, records, cost(records)))
    state = model.state()
    assert state["fit"] == "fitted"
    assert state["fixed_cost_s"] == pytest.approx(0.4, abs=0.01)
    assert state["per_record_cost_s"] == pytest.approx(1 / 75_000, rel=0.02)
    assert model.capacity == pytest.approx(45_000, rel=0.02)
    assert model.rate == pytest.approx(TARGET * 45_000, rel=0.02)  # target utilisation, no backlog


def test_model_stays_sane_when_all_batches_are_alike() -> None:
    model = ModelEstimator(initial_rate=40_000.0, warmup_batches=0)
    for i in range(30):
        rate = model.compute(batch(float(i + 1), 40_000, cost(40_000)))
        assert rate is not None
        assert 0 < rate < INF
    state = model.state()
    # sizes never varied: the fixed cost stays at the prior, the per-record cost explains the rest, and
    # the fit still predicts a batch of this size exactly
    assert state["fit"] == "anchored"
    a, b = state["fixed_cost_s"], state["per_record_cost_s"]
    assert isinstance(a, float) and isinstance(b, float)
    assert a + b * 40_000 == pytest.approx(cost(40_000))


def test_model_drains_backlog_over_its_horizon_but_never_under_its_floor() -> None:
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0)
    for i, records in enumerate((20_000, 40_000, 30_000, 40_000)):
        model.compute(batch(float(i + 1), records, cost(records)))
    capacity = model.capacity
    assert capacity is not None
    # a little backlog lowers the rate under the target, a huge one only down to half the capacity
    in_force = model.rate
    small = model.compute(batch(5.0, 40_000, cost(40_000), backlog=20_000))
    assert small is not None
    assert 0.5 * capacity < small < TARGET * capacity
    # the batch finished early: the next starts on time, the backlog shrank by the idle time's worth
    state = model.state()
    backlog = 20_000 - in_force * (1.0 - cost(40_000))
    assert state["backlog_records"] == pytest.approx(backlog)
    # its cost: per record, plus the fixed cost of the batches (of in_force x 1 s) it sits in, paid off
    # over 4 intervals out of the per-record budget: rate = target x capacity - cost / (4 b 1 s)
    a, b, refitted = state["fixed_cost_s"], state["per_record_cost_s"], state["capacity_rps"]
    assert isinstance(a, float) and isinstance(b, float) and isinstance(refitted, float)
    assert small == pytest.approx(TARGET * refitted - backlog * (b + a / in_force) / (4 * b))
    huge = model.compute(batch(6.0, 40_000, cost(40_000), backlog=10**7))
    assert huge == pytest.approx(0.5 * capacity, rel=0.02)


# --- properties of every estimator ----------------------------------------------------------------------

Factory = Callable[[], RateEstimator]

times = st.floats(min_value=0, max_value=1e7)
delays = st.floats(min_value=0, max_value=1e5)
batches = st.builds(
    BatchMetrics,
    batch_id=st.integers(min_value=0, max_value=10**6),
    completed_at=times,
    records=st.integers(min_value=0, max_value=10**9),
    processing_delay=delays,
    scheduling_delay=delays,
    batch_interval=st.floats(min_value=1e-3, max_value=1e3),
    backlog=st.none() | st.integers(min_value=0, max_value=10**10),
    waiting=st.none() | st.integers(min_value=0, max_value=10**10),
)


@st.composite
def runs(draw: st.DrawFn) -> list[BatchMetrics]:
    """A plausible run: completion times increase; sizes, costs and delays anything valid."""
    now = draw(st.floats(min_value=0, max_value=100))
    run: list[BatchMetrics] = []
    for metrics in draw(st.lists(batches, max_size=25)):
        now += draw(st.floats(min_value=0, max_value=30))
        run.append(dataclasses.replace(metrics, batch_id=len(run), completed_at=now))
    return run


bounds = st.builds(
    lambda low, span: RateBounds(low, low * span),
    st.floats(min_value=1e-3, max_value=1e6),
    st.floats(min_value=1.0, max_value=1e6) | st.just(INF),
)


@st.composite
def factories(draw: st.DrawFn) -> Factory:
    """A way to build one estimator, any registered one, with any valid bounds, initial rate and gains."""
    name = draw(st.sampled_from(sorted(ESTIMATORS)))
    gains: dict[str, float] = {}
    if name == "spark-pid":
        gains = {
            "proportional": draw(st.floats(min_value=0, max_value=2)),
            "integral": draw(st.floats(min_value=0, max_value=1)),
            "derivative": draw(st.floats(min_value=0, max_value=1)),
        }
    elif name == "model":
        gains = {
            "target_utilisation": draw(st.floats(min_value=0.5, max_value=1.0)),
            "horizon": draw(st.floats(min_value=1.0, max_value=20.0)),
            "forgetting": draw(st.floats(min_value=0.1, max_value=0.99)),
            "floor_fraction": draw(st.floats(min_value=0.0, max_value=1.0)),
            "warmup_batches": draw(st.integers(min_value=0, max_value=2)),
            "jump_tolerance": draw(st.floats(min_value=1.0, max_value=100.0)),
            "jump_lateness": draw(st.floats(min_value=1e-3, max_value=10.0)),
        }
    initial_rate = draw(st.floats(min_value=1e-3, max_value=1e9) | st.just(INF))
    return functools.partial(make_estimator, name, bounds=draw(bounds), initial_rate=initial_rate, **gains)


def check_in_bounds(estimator: RateEstimator, rate: float | None) -> None:
    """`rate` (an output) and the rate in force are numbers within the bounds; no NaN in the state an
    operator reads."""
    if rate is not None:
        assert not math.isnan(rate)
        assert 0 < estimator.bounds.min_rate <= rate <= estimator.bounds.max_rate
    assert estimator.bounds.min_rate <= estimator.rate <= estimator.bounds.max_rate
    for value in estimator.state().values():
        assert not (isinstance(value, float) and math.isnan(value))


def changed_midway(estimator: RateEstimator, run: list[BatchMetrics], change: Callable[[], None]) -> None:
    """Feed the first half of `run`, make `change`, feed the rest: every later rate in bounds."""
    half = len(run) // 2
    for metrics in run[:half]:
        estimator.compute(metrics)
    change()
    for metrics in run[half:]:
        check_in_bounds(estimator, estimator.compute(metrics))


@settings(max_examples=200)
@given(factory=factories(), run=runs() | st.lists(batches, max_size=25))
def test_every_rate_is_a_number_within_the_bounds(factory: Factory, run: list[BatchMetrics]) -> None:
    """Any valid batches, in order or not: no exception, never NaN, every rate within [min_rate, max_rate]
    (so never negative or zero), and no NaN in the state an operator reads."""
    estimator = factory()
    for metrics in run:
        check_in_bounds(estimator, estimator.compute(metrics))


@settings(max_examples=50)
@given(factory=factories(), run=runs(), new_bounds=bounds)
def test_new_bounds_hold_at_once_and_for_every_later_rate(
    factory: Factory, run: list[BatchMetrics], new_bounds: RateBounds
) -> None:
    estimator = factory()
    changed_midway(estimator, run, lambda: estimator.set_bounds(new_bounds))
    check_in_bounds(estimator, None)


@settings(max_examples=50)
@given(factory=factories(), run=runs(), rate=st.floats(min_value=1e-3, max_value=1e12) | st.just(INF))
def test_an_operators_rate_is_taken_clamped_and_later_rates_stay_in_bounds(
    factory: Factory, run: list[BatchMetrics], rate: float
) -> None:
    estimator = factory()

    def adopt() -> None:
        estimator.adopt(rate)
        assert estimator.rate == estimator.bounds.clamp(rate) and not estimator.intake_held

    changed_midway(estimator, run, adopt)


def after(factory: Factory, history: list[BatchMetrics], last: BatchMetrics) -> float | None:
    estimator = factory()
    for metrics in history:
        estimator.compute(metrics)
    return estimator.compute(last)


@settings(max_examples=200)
@given(factory=factories(), run=runs().filter(bool), extra=delays)
def test_a_larger_scheduling_delay_never_yields_a_higher_rate(
    factory: Factory, run: list[BatchMetrics], extra: float
) -> None:
    """Two identical fresh estimators see the same batches; only the last differs, in its scheduling delay:
    d in one, d + extra in the other. Then either both propose a rate or neither does, and the rate after
    the longer delay is <= the rate after the shorter: a larger delay never yields a higher rate, a smaller
    one never a lower rate. (Only the last batch differs: histories that differ are not ordered.)"""
    *history, last = run
    shorter = after(factory, history, last)
    longer = after(
        factory, history, dataclasses.replace(last, scheduling_delay=last.scheduling_delay + extra)
    )
    assert (shorter is None) == (longer is None)
    if shorter is not None and longer is not None:
        assert longer <= shorter


@settings(max_examples=100)
@given(factory=factories(), run=runs().filter(bool), extra=st.integers(min_value=0, max_value=10**9))
def test_a_larger_backlog_never_yields_a_higher_rate(
    factory: Factory, run: list[BatchMetrics], extra: int
) -> None:
    """As above, with the last batch's backlog (records left behind) b and b + extra; None counts as 0."""
    *history, last = run
    fewer = after(factory, history, last)
    more = after(factory, history, dataclasses.replace(last, backlog=(last.backlog or 0) + extra))
    if last.backlog is None:
        fewer = after(factory, history, dataclasses.replace(last, backlog=0))
    assert (fewer is None) == (more is None)
    if fewer is not None and more is not None:
        assert more <= fewer


@settings(max_examples=100)
@given(factory=factories(), run=runs().filter(bool), extra=st.integers(min_value=1, max_value=10**9))
def test_more_records_waiting_never_yield_a_higher_rate(
    factory: Factory, run: list[BatchMetrics], extra: int
) -> None:
    """As above, with the records counted waiting at the last batch's completion: w and w + extra."""
    *history, last = run
    waiting = last.waiting or 0
    fewer = after(factory, history, dataclasses.replace(last, waiting=waiting))
    more = after(factory, history, dataclasses.replace(last, waiting=waiting + extra))
    assert (fewer is None) == (more is None)
    if fewer is not None and more is not None:
        assert more <= fewer


# --- simulated pipelines --------------------------------------------------------------------------------

STEADY = Pipeline()
DOUBLING = Pipeline(cost_changes=((30.0, 2.0), (60.0, 1.0)))
"""Per-record cost doubles from 30 s to 60 s: capacity 45k -> 22.5k -> 45k records/s."""
SLUICE_START = 10_000.0
"""A conservative initial rate (22% of capacity): Sluice bounds admission from the first record."""


def simulated(
    name: str, pipeline: Pipeline, *, initial_rate: float, pass_backlog: bool = False
) -> Simulation:
    estimator = make_estimator(name, bounds=RateBounds(100.0, INF), initial_rate=initial_rate)
    return simulate(estimator, pipeline, interval=1.0, duration=90.0, pass_backlog=pass_backlog)


def test_spark_pid_reproduces_the_anchor_failure() -> None:
    """Spark's own conditions: no initial rate (the first batches are unthrottled, the sender offers 100k/s)
    and 10 s of worker start-up in the first batch. DESIGN.md measured 49% utilisation, 21.5 s peak delay,
    37 batches starved at minRate, ~75 s to settle."""
    sim = simulated("spark-pid", Pipeline(startup=10.0), initial_rate=INF)
    assert sim.peak_delay() > 15.0
    assert min(sim.rates[1:30]) == 100.0  # clamped to minRate while the backlog drains
    assert sim.longest_starvation >= 30
    settle = sim.settle_time
    assert settle is not None and settle > 40.0
    assert sim.utilisation < 0.85


@pytest.mark.parametrize("pass_backlog", [False, True], ids=["backlog-inferred", "backlog-passed"])
@pytest.mark.parametrize("pipeline", [STEADY, DOUBLING], ids=["steady", "cost-doubles"])
def test_model_meets_the_control_goals(pipeline: Pipeline, pass_backlog: bool) -> None:
    """DESIGN.md's goals: >= 90% utilisation, peak delay <= 2 intervals (after the third batch), settled
    within 10 s, no starved batch; from a conservative initial rate, with no start-up in the first batch."""
    sim = simulated("model", pipeline, initial_rate=SLUICE_START, pass_backlog=pass_backlog)
    summary = sim.summary()
    # converged within a few batches: at 95% of capacity from the sixth batch until the cost changes
    assert sim.rates[5:29] == pytest.approx([TARGET * 45_000] * 24, rel=0.01), summary
    assert sim.utilisation >= 0.90, summary
    assert sim.peak_delay(after_batch=3) <= 2.0, summary
    settle = sim.settle_time
    assert settle is not None and settle <= 10.0, summary
    assert sim.starved == 0, summary
    assert sim.longest_starvation <= 2, summary  # only batches formed at the initial rate


def test_model_follows_the_cost_doubling_and_its_return_within_two_batches() -> None:
    sim = simulated("model", DOUBLING, initial_rate=SLUICE_START)
    # batch k is due at k s; its rate was set when batch k-1 or k-2 completed
    doubled = sim.rates[33:58]
    assert all(0.5 * 22_500 <= rate <= 22_500 for rate in doubled)
    assert sim.rates[40:58] == pytest.approx([TARGET * 22_500] * 18, rel=0.01)
    assert sim.rates[61:] == pytest.approx([TARGET * 45_000] * len(sim.rates[61:]), rel=0.01)


def test_model_with_a_start_up_batch_never_starves_and_beats_spark_pid() -> None:
    """A fresh query: 10 s of start-up in the first batch. Batches formed during it at the initial rate
    queue up behind it (no controller can help those), so the delay is ~9 s for a while; the model must
    not take the slow batch for capacity, must not starve while the queue drains, and must end at target."""
    start_up = Pipeline(startup=10.0)
    model = simulated("model", start_up, initial_rate=SLUICE_START)
    pid = simulated("spark-pid", start_up, initial_rate=SLUICE_START)
    assert model.starved == 0, model.summary()
    # the slow first batch did not drag the rate down: it never fell under the initial rate, where
    # Spark's PID read the same batches as a backlog to clear at once and dropped to minRate
    assert min(model.rates) >= SLUICE_START, model.summary()
    assert min(pid.rates) == 100.0
    settle = model.settle_time
    assert settle is not None and settle <= 25.0, model.summary()
    assert model.rates[-1] == pytest.approx(TARGET * 45_000, rel=0.01)
    assert model.utilisation > pid.utilisation + 0.05, (model.summary(), pid.summary())
    assert pid.starved > 5


def test_simulation_is_deterministic_and_counts_what_it_admits() -> None:
    first = simulated("model", DOUBLING, initial_rate=SLUICE_START)
    again = simulated("model", DOUBLING, initial_rate=SLUICE_START)
    assert first == again
    fixed = simulated("fixed", STEADY, initial_rate=20_000.0)
    assert [b.records for b in fixed.batches] == [20_000] * 90
    # the oldest record of each batch waited the one interval it was collected in, and no more
    assert all(b.scheduling_delay == 1.0 and b.lateness == 0 for b in fixed.batches)
    assert fixed.batches[0].processing_delay == pytest.approx(0.4 + 20_000 / 75_000)
    # 20k of 45k per interval, processed over 89 intervals
    assert fixed.utilisation == pytest.approx(20_000 / 45_000, rel=1e-3)
    assert fixed.starved == 87 and fixed.longest_starvation == 89


@pytest.mark.parametrize("pipeline", [STEADY, DOUBLING], ids=["steady", "cost-doubles"])
def test_model_meets_the_control_goals_under_structured_streaming(pipeline: Pipeline) -> None:
    """The same goals with Sluice's own admission: records wait in the store, each batch takes what is
    there up to the source's cap of max(rate, capacity) x interval, and reports the backlog it left."""
    estimator = make_estimator("model", bounds=RateBounds(100.0, INF), initial_rate=SLUICE_START)
    sim = simulate_structured(estimator, pipeline, interval=1.0, duration=90.0)
    summary = sim.summary()
    assert sim.utilisation >= 0.90, summary
    assert sim.peak_delay(after_batch=3) <= 2.0, summary
    settle = sim.settle_time
    assert settle is not None and settle <= 10.0, summary
    assert sim.starved == 0, summary


def test_spark_pid_under_structured_streaming_starves_after_a_cost_doubling() -> None:
    estimator = make_estimator("spark-pid", bounds=RateBounds(100.0, INF), initial_rate=SLUICE_START)
    sim = simulate_structured(estimator, DOUBLING, interval=1.0, duration=90.0)
    assert sim.peak_delay() > 20.0, sim.summary()
    assert sim.starved > 30, sim.summary()


def test_model_watchdog_cuts_the_rate_on_the_evidence_of_a_running_batch() -> None:
    """overrun(): a batch still running gives a lower bound on the per-record cost, so the rate may drop
    before the batch completes; never up, nothing before a fit, nothing within the noise."""
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0)
    assert model.overrun(40_000, 3.0, 1.0) is None  # no fit yet: no basis
    for i, records in enumerate((20_000, 40_000, 30_000, 40_000)):
        model.compute(batch(float(i + 1), records, cost(records)))
    rate, capacity = model.rate, model.capacity
    assert capacity is not None
    assert model.overrun(40_000, 0.9, 1.0) is None  # not over its interval
    assert model.overrun(40_000, cost(40_000) * 1.05, 1.0) is None  # within the noise
    # the per-record cost doubled: at 1.8 s the batch has shown b >= (1.8 - 0.4) / 40k = 1 / 28.6k
    cut = model.overrun(40_000, 1.8, 1.0)
    assert cut is not None and cut < rate
    at_least = (1.8 - 0.4) / 40_000
    assert model.capacity == pytest.approx((1.0 - 0.4) / at_least, rel=0.01)
    assert cut == pytest.approx(TARGET * model.capacity, rel=0.01)
    # later looks at the same batch only lower it further; an earlier elapsed time changes nothing
    deeper = model.overrun(40_000, 2.5, 1.0)
    assert deeper is not None and deeper < cut
    assert model.overrun(40_000, 1.9, 1.0) is None
    assert model.state()["overrun_cuts"] == 2


@settings(max_examples=100)
@given(
    factory=factories(),
    run=runs(),
    looks=st.lists(
        st.tuples(st.integers(min_value=-5, max_value=10**6), st.floats(min_value=0, max_value=100)),
        max_size=10,
    ),
)
def test_overrun_never_raises_the_rate_and_stays_in_bounds(
    factory: Factory, run: list[BatchMetrics], looks: list[tuple[int, float]]
) -> None:
    estimator = factory()
    for metrics in run:
        estimator.compute(metrics)
    for records, elapsed in looks:
        before = estimator.rate
        cut = estimator.overrun(records, elapsed, 1.0)
        check_in_bounds(estimator, cut)
        assert estimator.rate <= before


def test_the_watchdog_lowers_the_peak_delay_of_a_cost_doubling_under_structured_streaming() -> None:
    pipeline = Pipeline(fixed_cost=0.24, per_record_cost=10.8e-6, cost_changes=((20.0, 2.0), (40.0, 1.0)))

    def peak(watchdog: float | None) -> float:
        model = make_estimator("model", bounds=RateBounds(100, INF), initial_rate=10_000.0)
        return simulate_structured(model, pipeline, duration=60.0, watchdog=watchdog).peak_delay(3)

    assert peak(0.1) < peak(None) - 0.2


def test_model_watchdog_pauses_intake_while_the_next_batch_waits_in_full() -> None:
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0, bounds=RateBounds(100, INF))
    for i, records in enumerate((20_000, 40_000, 30_000, 40_000)):
        model.compute(batch(float(i + 1), records, cost(records)))
    capacity = model.capacity
    assert capacity is not None
    # overrunning, but what waits does not fill the next batch yet: only the cost's lower bound
    cut = model.overrun(40_000, 1.2, 1.0, waiting=int(0.5 * capacity))
    assert cut is not None and cut > 100
    # the next batch is there in full: more records would only queue
    assert model.overrun(40_000, 1.3, 1.0, waiting=int(capacity) + 1) == 100
    # the batch completes: the estimate starts from the batches' size before the pause, not from 100/s
    # (the slower batch about halves the capacity, and the floor is half of that, up to the fit's rounding)
    rate = model.compute(batch(6.5, 40_000, 1.5, backlog=int(capacity)))
    assert rate is not None and rate >= 0.49 * 0.5 * capacity


def fitted_model() -> ModelEstimator:
    """A model fitted on four batches of the default pipeline (capacity 45k records/s)."""
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0, bounds=RateBounds(100, INF))
    for i, records in enumerate((20_000, 40_000, 30_000, 40_000)):
        model.compute(batch(float(i + 1), records, cost(records)))
    assert model.capacity == pytest.approx(45_000, rel=0.02)
    return model


def test_model_warm_up_batches_may_raise_the_rate_but_never_lower_it() -> None:
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=2)
    # a cold start: 10 s of worker start-up for 10k records is no reason to go under the initial rate
    assert model.compute(batch(10.5, 10_000, 10.5)) is None
    assert model.rate == 10_000.0
    # warm: 10k records in 0.25 s; a batch at 1.5 x that throughput takes <= 1.5 s whatever the costs
    assert model.compute(batch(11.5, 10_000, 0.25)) == pytest.approx(1.5 * 40_000)
    assert model.state()["fit"] == "none"  # neither batch was fitted
    assert model.compute(batch(12.5, 30_000, cost(30_000))) is not None
    assert model.state()["fit"] == "anchored"


def test_model_counts_what_waits_at_completion_when_it_is_known() -> None:
    """In Sluice a batch takes what waits in the store: what the next batch, at capacity, cannot take is
    backlog, counted rather than estimated; batches after the next one are full of it, so intake may go
    under the starvation floor while it lasts."""
    model = fitted_model()
    capacity = model.capacity
    assert capacity is not None
    # what waits fits the next batch: no backlog, the target rate
    rate = model.compute(dataclasses.replace(batch(5.0, 40_000, cost(40_000)), waiting=int(0.9 * capacity)))
    assert rate == pytest.approx(TARGET * capacity, rel=0.02)
    # three batches' worth waits: two of them are backlog, and intake drops under half the capacity
    rate = model.compute(dataclasses.replace(batch(6.0, 40_000, cost(40_000)), waiting=int(3 * capacity)))
    assert rate is not None and 100 <= rate < 0.5 * capacity
    assert model.state()["backlog_records"] == pytest.approx(2 * capacity, rel=0.02)
    # unknown (a DStream-like admission): the floor holds, the batches are what arrives
    estimated = fitted_model().compute(batch(5.0, 40_000, cost(40_000), backlog=int(3 * capacity)))
    assert estimated is not None and estimated >= 0.5 * capacity * 0.99


def test_model_believes_a_faster_batch_at_once_within_its_stretch() -> None:
    model = fitted_model()
    # the per-record cost halved: 40k records in 0.4 + 40k / 150k s, capacity 90k
    rate = model.compute(batch(5.0, 40_000, 0.4 + 40_000 / 150_000))
    assert model.capacity == pytest.approx(90_000, rel=0.05)
    assert rate == pytest.approx(TARGET * 90_000, rel=0.05)


def test_model_believes_a_slower_batch_the_watchdog_saw_overrun() -> None:
    """A slower batch alone may be a pause (halfway to what it says); one the watchdog saw overrunning
    is believed, and a cost change that landed mid-batch shows only part of the new cost anyway."""
    doubled = batch(5.5, 40_000, 0.4 + 40_000 / 37_500)  # per-record cost doubled: capacity 22.5k
    unseen, seen = fitted_model(), fitted_model()
    unseen.compute(doubled)
    assert unseen.state()["capacity_rps"] == pytest.approx(45_000 / math.sqrt(2), rel=0.05)
    # the batch after a surprise holds at most what a jump of jump_tolerance would keep within
    # jump_lateness (with a 0.4 s fixed cost, a 4x jump: 2.4 / (4 x 0.6) = all of it)
    assert unseen.capacity is not None and unseen.capacity <= unseen.state()["capacity_rps"]
    assert seen.overrun(40_000, 1.2, 1.0) is not None
    seen.compute(doubled)
    assert seen.capacity == pytest.approx(22_500, rel=0.05)


def test_a_pipeline_cost_change_lands_mid_batch() -> None:
    pipeline = Pipeline(fixed_cost=0.4, per_record_cost=1 / 75_000, cost_changes=((10.0, 2.0),))
    # from 9 s: the fixed cost to 9.4 s, 45k records by 10 s, the other 30k at the doubled cost
    assert pipeline.processing_time(9.0, 75_000) == pytest.approx(0.4 + 0.6 + 30_000 * 2 / 75_000)
    assert pipeline.processing_time(11.0, 75_000) == pytest.approx(0.4 + 2.0)
    assert pipeline.processing_time(5.0, 75_000) == pytest.approx(1.4)


def test_structured_triggers_keep_to_the_interval_grid_after_an_overrun() -> None:
    """Spark's ProcessingTime trigger: a batch that overran is followed at once, the one after waits for
    the next multiple of the interval (missed triggers are not caught up)."""
    fixed = FixedEstimator(initial_rate=10_000.0)
    pipeline = Pipeline(fixed_cost=0.1, per_record_cost=1e-6, startup=2.5)
    sim = simulate_structured(fixed, pipeline, duration=8.0, watchdog=None)
    starts = [round(b.completed_at - b.processing_delay, 2) for b in sim.batches]
    assert starts == [1.0, 3.61, 4.0, 5.0, 6.0, 7.0]


# a real trace: `python bench/control_loop.py --only sluice-model --cost-us 50`, cost x2 from 20 s to
# 40 s; (records, processing seconds) per batch. Capacity was ~33k records/s, ~16.5k while doubled.
TRACE_50US = [
    (6029, 0.36), (13374, 0.48), (32496, 0.96), (34375, 1.02), (33810, 1.04), (33048, 1.01),
    (32872, 1.02), (32504, 1.03), (32232, 1.0), (30946, 0.96), (28751, 0.9), (28057, 0.88),
    (29314, 0.9), (31760, 0.96), (31254, 0.93), (31617, 0.92), (29809, 0.93), (33580, 0.98),
    (32140, 0.98), (33102, 1.34), (24250, 1.4), (16805, 1.05), (15892, 0.99), (21505, 1.27),
    (16689, 1.02), (19879, 1.2), (17232, 1.09), (16406, 1.01), (17799, 1.1), (11159, 0.79),
    (7358, 0.59), (8438, 0.62), (17412, 1.05), (16877, 1.05), (16384, 1.06), (15916, 0.99),
    (15885, 1.02), (15500, 0.97), (15251, 0.98), (14769, 0.58), (14301, 0.53), (30199, 0.91),
    (29827, 0.95), (32756, 1.0), (32817, 1.04),
]  # fmt: skip


def test_model_follows_a_real_noisy_trace_without_absurd_fits() -> None:
    """Batches of one size (an anchored fit) still tell a cost change near that size; and a noisy mix
    of sizes and costs is not read as a fixed cost of 0.9 s (which once made the rate 5k, then 51k)."""
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=2, bounds=RateBounds(100, INF))
    capacities = []
    for i, (records, seconds) in enumerate(TRACE_50US):
        model.compute(batch(float(i + 1), records, seconds))
        capacities.append(model.capacity)
    assert model.state()["cost_changes"] == 2  # doubled, restored
    doubled = capacities[21:39]
    assert all(c is not None and 12_000 <= c <= 22_000 for c in doubled), doubled
    assert all(c is not None and 28_000 <= c <= 40_000 for c in capacities[41:]), capacities[41:]


def test_model_capacity_is_never_under_what_the_batch_just_done_showed() -> None:
    """A batch done within its interval processed records / seconds: with a fixed cost per batch a
    batch of that many per interval fits in it, whatever a fit (or a watchdog's bound under another
    fit's fixed cost) says; seen here, a fit through a batch that straddled a cost change read half."""
    model = fitted_model()
    # faster than the fit by 20%: not an outlier, absorbed by the fit only in part
    model.compute(batch(5.0, 40_000, 0.75))
    assert model.capacity is not None and model.capacity >= 40_000 / 0.75
    # slower than its interval: it holds up no floor, the capacity falls (halfway: it may be a pause)
    model = fitted_model()
    model.compute(batch(5.0, 40_000, 1.2))
    assert model.capacity is not None and model.capacity < 0.85 * 45_000


def test_model_forgets_the_batch_a_cost_change_landed_in() -> None:
    """Under load a cost change lands mid-batch: the first surprising batch paid partly the old cost.
    Once a second one confirms the change, the fit restarts from that one alone, anchored on the fixed
    cost known so far; kept, the straddling batch tilted the line (seen on real Spark: a fixed cost of
    0.61 s against 0.22 s, and a 25% overshoot when the cost came back)."""
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0)
    before = 10e-6  # 0.2 s + 10 us a record: 80k records/s at 1 s batches
    for i, records in enumerate((60_000, 80_000, 70_000, 90_000, 75_000, 65_000)):
        model.compute(batch(float(i + 1), records, 0.2 + records * before))
    assert model.capacity == pytest.approx(80_000, rel=0.02)
    # the per-record cost doubles halfway through an 80k batch, then a 50k batch runs at the new cost
    model.compute(batch(7.0, 80_000, 0.2 + 40_000 * before + 40_000 * 2 * before))
    model.compute(batch(8.0, 50_000, 0.2 + 50_000 * 2 * before))
    assert model.state()["capacity_rps"] == pytest.approx(40_000, rel=0.05)
    state = model.state()
    assert state["cost_changes"] == 1 and state["fixed_cost_s"] == pytest.approx(0.2, abs=0.05)


# --- tiny batches carry no news of the per-record cost (issue 12, item 8) --------------------------------


def test_single_record_batches_on_a_loaded_machine_leave_the_rate_alone() -> None:
    """Issue 12, item 8: a fresh server (initial rate 10k, two start-up batches) saw three single-record
    batches of ~0.9 s: all fixed cost and its noise, read as 0.6 s a record (1.2 records/s), and the rate
    fell to the minimum. A batch far below the operating point only bounds capacity from below."""
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=2, bounds=RateBounds(100, INF))
    assert model.compute(batch(10.0, 1, 9.5)) is None  # worker start-up
    assert model.compute(batch(11.0, 1, 0.7)) is None  # still warming up
    for i, seconds in enumerate((0.875, 0.9, 0.8)):
        assert model.compute(batch(12.0 + i, 1, seconds)) is None
    assert model.rate == 10_000.0
    assert model.state()["small_batches"] == 3 and model.state()["fit"] == "none"
    # the push that follows is fitted from its first full batch on
    rate = model.compute(batch(16.0, 10_000, cost(10_000)))
    assert rate is not None and rate > 20_000.0
    # a fitted model too: a dozen slow single-record batches change neither capacity nor rate
    model = fitted_model()
    capacity, rate = model.capacity, model.rate
    for i in range(12):
        assert model.compute(batch(10.0 + i, 1, 0.9)) is None
    assert (model.capacity, model.rate) == (capacity, rate)
    # nor does the watchdog read a per-record cost from one that overruns: 3 s for a record is a stall
    assert model.overrun(1, 3.0, 1.0) is None
    assert (model.capacity, model.rate) == (capacity, rate)
    # ... and a fit that follows them is no different from one without them (none was a point in it)
    model.compute(batch(30.0, 40_000, cost(40_000)))
    twin = fitted_model()
    twin.compute(batch(30.0, 40_000, cost(40_000)))
    assert (model.capacity, model.rate) == (twin.capacity, twin.rate)


@settings(max_examples=200)
@given(
    factory=factories(),
    run=runs(),
    small=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=1, exclude_max=True),  # share of the largest small size
            delays,
            st.none() | st.integers(min_value=0, max_value=10**10),
        ),
        min_size=1,
        max_size=20,
    ),
)
def test_batches_far_below_the_operating_point_never_lower_rate_or_capacity(
    factory: Factory, run: list[BatchMetrics], small: list[tuple[float, float, int | None]]
) -> None:
    """Whatever came before, any sequence of batches under 1 / max_growth of the operating point (the
    rate in force or the capacity, per interval), however slow and whatever waits behind them, leaves
    the model's rate where it was and its capacity no lower."""
    estimator = factory()
    if not isinstance(estimator, ModelEstimator):
        return
    now = 0.0
    for metrics in run:
        estimator.compute(metrics)
        now = metrics.completed_at
    for share, seconds, waiting in small:
        rate, capacity = estimator.rate, estimator.capacity
        scale = max((r for r in (rate, capacity) if r is not None and math.isfinite(r)), default=0.0)
        if scale == 0:
            return  # no operating point yet (unlimited, unfitted): nothing is small
        records = math.floor(share * scale / estimator.max_growth)  # under the bound
        # watched while it runs (no waiting counted: a full next batch pauses intake, which is no fit)
        if records > 0:
            assert estimator.overrun(records, seconds, 1.0) is None
            assert (estimator.rate, estimator.capacity) == (rate, capacity)
        now += 1.0
        last = dataclasses.replace(batch(now, records, seconds), waiting=waiting)
        # warm-up batches may raise the rate, never lower it
        proposed = estimator.compute(last)
        assert proposed is None or proposed >= rate
        assert estimator.rate >= rate
        if capacity is not None:
            assert estimator.capacity is not None and estimator.capacity >= capacity


# --- a fixed cost over the interval: the loop must not settle at the floor (the crash test's restart) ------

LOADED = Pipeline(fixed_cost=1.2, per_record_cost=20e-6, startup=10.0, jitter=0.3)
"""The crash test's restarted server on a loaded 2-core machine: batches of 50 to 5,000 records all took
0.8-1.6 s against a 0.5 s trigger (a fixed cost ~2.4x the interval), 50k records/s per record."""


def restarted(pipeline: Pipeline, initial_rate: float, duration: float = 90.0) -> Simulation:
    """A server restarted after kill -9 (`sluice serve --trigger-interval 0.5`): a fresh estimator as the
    RateController builds it, 300k acked records in the store, a producer offering 20k records/s."""
    estimator = make_estimator(
        "model", bounds=RateBounds(100.0, INF), initial_rate=initial_rate, warmup_batches=2
    )
    return simulate_structured(
        estimator, pipeline, interval=0.5, duration=duration, offered_rate=20_000.0, backlog=300_000
    )


@pytest.mark.parametrize(
    ("pipeline", "initial_rate"),
    [
        (dataclasses.replace(LOADED, jitter=0.0), 10_000.0),
        (LOADED, 10_000.0),  # the default initial rate
        (LOADED, 100.0),  # at the floor, as after the watchdog paused intake to the minimum rate
        (dataclasses.replace(LOADED, fixed_cost=0.6, jitter=0.15, seed=3), 100.0),  # just over the interval
    ],
    ids=["exact", "noisy", "noisy-from-the-floor", "fixed-cost-0.6s"],
)
def test_a_fixed_cost_over_the_interval_does_not_hold_batches_at_the_floor(
    pipeline: Pipeline, initial_rate: float
) -> None:
    """Seen in test_crash: batches of 5,000, 1,900, 800, 350, then 50 records (100 records/s x 0.5 s) for
    four minutes, the 300k-record backlog never drained. The fit read a fixed cost over the interval as
    no room for records in one (capacity 0), or, with batches alike, anchored on the prior, put the time
    on the records. Batches now plan on the fixed cost (twice it when it exceeds half the interval),
    and alike batches at the floor are let grow until their times tell the costs apart."""
    sim = restarted(pipeline, initial_rate)
    sizes = [b.records for b in sim.batches]
    # the backlog went through (before: ~10k records in 90 s, in batches of 50)
    drained = next((b for b in sim.batches if b.waiting is not None and b.waiting <= b.records), None)
    assert drained is not None and drained.completed_at <= 75.0, sizes
    assert sum(sizes) >= 300_000, sizes
    # and from then on it takes what the producer offers, 20k records/s (the pipeline could take 25k)
    tail = [b for b in sim.batches if b.completed_at > drained.completed_at]
    assert sum(b.records for b in tail) / (tail[-1].completed_at - drained.completed_at) > 0.5 * 20_000


class _Recorded(ModelEstimator):
    """The model, noting after each batch whether its fit told the two costs apart."""

    def __init__(self, **kwargs: float) -> None:
        super().__init__(bounds=RateBounds(100.0, INF), initial_rate=100.0, **kwargs)
        self.fits: list[str] = []

    def compute(self, batch: BatchMetrics) -> float | None:
        rate = super().compute(batch)
        self.fits.append(str(self.state()["fit"]))
        return rate


@settings(max_examples=25, deadline=None)
@given(
    fixed=st.floats(min_value=1.0, max_value=5.0),  # the fixed cost, in intervals
    per_record_cost=st.floats(min_value=0.0, max_value=50e-6),
    interval=st.sampled_from([0.5, 1.0]),
)
def test_from_the_floor_batches_never_shrink_until_the_fit_sees_per_record_cost(
    fixed: float, per_record_cost: float, interval: float
) -> None:
    """Any pipeline whose fixed cost is at least the interval, started at the floor (the minimum rate)
    with a backlog: until a fit tells per-record cost from fixed cost, no batch the source's cap holds
    back is smaller than the one before; and the batches leave the floor within a few of them."""
    pipeline = Pipeline(fixed_cost=fixed * interval, per_record_cost=per_record_cost)
    estimator = _Recorded(warmup_batches=0)  # at the floor, not a fresh query's start-up
    sim = simulate_structured(
        estimator, pipeline, interval=interval, duration=30 * pipeline.fixed_cost, backlog=10**8
    )
    sizes = [b.records for b in sim.batches]
    trace = list(zip(sizes, estimator.fits, strict=True))
    for k in range(1, len(sizes) - 1):
        capped = (sim.batches[k + 1].backlog or 0) > 0  # not the last of the backlog
        if capped and estimator.fits[k] != "fitted":
            assert sizes[k + 1] >= sizes[k], trace
    assert max(sizes[:12]) > 10 * 100.0 * interval, trace


# --- a per-record cost that jumps by 3-4x and back (issue 17, item 6) -------------------------------------

BENCH_LIKE = Pipeline(fixed_cost=0.24, per_record_cost=10.8e-6)
"""bench/control_loop.py's Sluice pipeline as measured here: ~0.25 s a batch and ~11 us a record, ~70k
records/s at 1 s batches."""


def jumped(
    name: str, pipeline: Pipeline, factor: float
) -> tuple[Simulation, tuple[tuple[float, float], ...]]:
    """60 s of Sluice's loop while the per-record cost jumps by `factor` and back every 6 s, at other
    phases of the trigger interval each time; the source defers small catch-up batches as it does."""
    estimator = make_estimator(name, bounds=RateBounds(100.0, INF), initial_rate=SLUICE_START)
    return simulate_jumps(estimator, pipeline, factor)


def test_jumps_land_at_phases_spread_over_the_interval() -> None:
    changes = jumps(60.0, 3.5)
    assert [factor for _, factor in changes] == [3.5, 1.0, 3.5, 1.0, 3.5, 1.0, 3.5]
    assert changes[0][0] == pytest.approx(15.1)
    assert all(5.0 < b - a < 7.0 for (a, _), (b, _) in itertools.pairwise(changes))
    phases = sorted(since % 1.0 for since, _ in changes)
    assert phases[0] < 0.15 and phases[-1] > 0.8  # early and late in a batch ...
    assert min(b - a for a, b in itertools.pairwise(phases)) > 0.05  # ... and no two alike
    assert jumps(24.0, 3.5)[0][0] == pytest.approx(6.1) and len(jumps(24.0, 3.5)) == 3
    with pytest.raises(ValueError, match="factor"):
        jumps(60.0, 0.0)


SMALL_FIXED = Pipeline(fixed_cost=0.1, per_record_cost=0.9 / 70_000)
"""A batch mostly records (a long trigger, a heavy per-record pipeline): a jump hits most of it."""
NOISY_BENCH = dataclasses.replace(BENCH_LIKE, jitter=0.05)
NOISY_SMALL_FIXED = dataclasses.replace(SMALL_FIXED, jitter=0.05)
LARGE_FIXED = Pipeline(fixed_cost=0.6, per_record_cost=0.4 / 70_000)
"""A batch mostly fixed cost: the batch a fall back lands in, fitted, tilted the fit, and the next batches
(back at the old cost) were judged against it and starved while it recovered."""


@pytest.mark.parametrize(
    ("pipeline", "factor"),
    [
        (STEADY, 3.0),
        (STEADY, 3.5),
        (STEADY, 4.0),
        (BENCH_LIKE, 3.0),
        (BENCH_LIKE, 3.5),
        (BENCH_LIKE, 4.0),
        (NOISY_BENCH, 3.5),
        (SMALL_FIXED, 3.0),
        (SMALL_FIXED, 3.5),
        (SMALL_FIXED, 4.0),
        (NOISY_SMALL_FIXED, 4.0),
        (LARGE_FIXED, 3.0),
        (LARGE_FIXED, 4.0),
    ],
    ids=[
        "fixed-0.4s-x3",
        "fixed-0.4s-x3.5",
        "fixed-0.4s-x4",
        "bench-like-x3",
        "bench-like-x3.5",
        "bench-like-x4",
        "noisy-bench-like-x3.5",
        "fixed-0.1s-x3",
        "fixed-0.1s-x3.5",
        "fixed-0.1s-x4",
        "noisy-fixed-0.1s-x4",
        "fixed-0.6s-x3",
        "fixed-0.6s-x4",
    ],
)
def test_model_keeps_cost_jumps_within_two_intervals_and_starves_no_batch(
    pipeline: Pipeline, factor: float
) -> None:
    """Issue 17, item 6: a cost that jumps by 3-4x and back, at any point in a batch, keeps the peak
    scheduling delay within 2 intervals and starves no batch that started after the change. (With a
    fixed cost of 0.24 s, a 4x jump at the very start of a full batch alone makes it take 3.2 s: no
    controller that admitted a full batch before it can keep the next within 2 intervals, so the
    model admits what a 4x jump keeps within 1.8: `jump_tolerance`, `jump_lateness`.)"""
    sim, changes = jumped("model", pipeline, factor)
    summary = sim.summary()
    assert sim.peak_delay(UNJUDGED) <= 2.0, summary
    assert sim.peak_delay_since(changes[0][0]) == sim.peak_delay(UNJUDGED)
    assert sim.starved_after(changes[0][0]) == 0, summary
    assert sim.utilisation >= 0.7, summary


@pytest.mark.parametrize(
    ("fixed", "share"),
    [(0.0, 0.7), (0.1, (2.8 - 0.1) / (4 * 0.9)), (0.24, (2.8 - 0.24) / (4 * 0.76)), (0.4, TARGET)],
)
def test_model_leaves_headroom_for_a_4x_jump_where_the_fixed_cost_is_small(
    fixed: float, share: float
) -> None:
    """Issue 17, item 6: a batch admitted at share u that a jump J hits at its start takes a + J (u - a)
    intervals; the model admits at most what a 4x jump keeps within 1.8 intervals late (with no fixed
    cost 70% of capacity, with 0.4 s of a 1 s interval the usual 97%), and never under the floor."""
    per_record = (1.0 - fixed) / 70_000  # 70k records/s at 1 s batches whatever the fixed cost
    model = ModelEstimator(initial_rate=10_000.0, warmup_batches=0, bounds=RateBounds(100, INF))
    for i, records in enumerate((30_000, 60_000, 45_000, 55_000, 40_000, 65_000)):
        model.compute(batch(float(i + 1), records, fixed + per_record * records))
    assert model.state()["fit"] == "fitted"
    assert model.rate == pytest.approx(share * 70_000, rel=0.02)
    jumped = fixed + 4 * per_record * model.rate  # the next batch if the cost jumps 4x as it starts
    assert jumped <= 2.8 * 1.001
    off = ModelEstimator(initial_rate=10_000.0, warmup_batches=0, jump_tolerance=1.0)
    for i, records in enumerate((30_000, 60_000, 45_000, 55_000, 40_000, 65_000)):
        off.compute(batch(float(i + 1), records, fixed + per_record * records))
    assert off.rate == pytest.approx(TARGET * 70_000, rel=0.02)


def test_model_restores_the_fit_from_before_a_rise_when_the_cost_falls_back() -> None:
    """After a rise the watchdog saw, the batches are small and mostly fixed cost; the first one back at
    the old cost brings the old fit back at once (read alone it recovered the rate over 4 batches, and
    the batches meanwhile were starved)."""
    model = fitted_model()
    rate = model.rate
    assert model.overrun(40_000, 1.5, 1.0) is not None  # the watchdog sees the cost rise 3x
    model.compute(batch(5.5, 40_000, 0.4 + 3 * 40_000 / 75_000))
    model.compute(batch(6.5, 14_000, 0.4 + 3 * 14_000 / 75_000))
    assert model.rate < 0.5 * rate
    model.compute(batch(7.5, 14_000, cost(14_000)))  # the cost is back: 0.59 s, 0.96 s predicted
    assert model.rate == pytest.approx(rate, rel=0.02)
    assert model.state()["capacity_rps"] == pytest.approx(45_000, rel=0.02)


def test_spark_pid_starves_under_cost_jumps() -> None:
    """The baseline: Spark's PID under the same jumps falls behind at the first and never recovers."""
    sim, changes = jumped("spark-pid", BENCH_LIKE, 3.5)
    assert sim.peak_delay(UNJUDGED) > 20.0, sim.summary()
    assert sim.starved_after(changes[0][0]) > 20, sim.summary()


def test_after_a_jump_one_batch_drains_the_pile_and_intake_waits_for_it() -> None:
    """What piles up while a batch overruns by a cost jump (the watchdog holds intake only once it
    sees the overrun) goes in one batch (several would each pay the fixed cost and make the later
    ones later), and intake is held into that batch so the batch after it starts about one interval
    late: seen on a 3.5x jump at the very start of a batch."""
    sim, _ = jumped("model", BENCH_LIKE, 3.5)
    starts = [b.completed_at - b.processing_delay for b in sim.batches]
    jumped_at = next(i for i, start in enumerate(starts) if start >= 15.0)
    overran, drain, after = sim.batches[jumped_at : jumped_at + 3]
    assert overran.processing_delay > 2.2  # the jump landed in its fixed cost
    assert drain.records > overran.records  # the whole pile, more than a batch's cap
    assert drain.lateness == pytest.approx(overran.processing_delay - 1.0, abs=0.05)
    assert drain.processing_delay > 2.5
    assert after.lateness <= 1.1  # held into the drain batch, not taken right at its start
    assert sim.rates[jumped_at] == 0.0  # intake held, not at min_rate: no record trickles in


def test_model_drain_cap_pause_and_resume() -> None:
    """The estimator's side: a watchdog-seen overrun lets the next batch take the pile (batch_cap above
    max(rate, capacity) x interval), the completion plans a hold (intake_held, min_rate) that resume()
    ends at the planned point of the next batch, at a paced rate; a batch that finds no pile ends it."""
    model = fitted_model()
    assert model.batch_cap(1.0) == pytest.approx(max(model.rate, model.capacity or 0.0))
    assert not model.intake_held and model.resume(5.0) is None
    # a 40k-record batch runs long: the cost rose ~3.5x; 60k records wait behind it
    assert model.overrun(40_000, 1.2, 1.0, waiting=60_000) == 100.0
    assert model.intake_held
    usual = max(model.rate, model.capacity or 0.0)
    assert model.batch_cap(1.0) > 60_000 > usual
    slow = 0.4 + 3.5 * 40_000 / 75_000  # 2.27 s
    rate = model.compute(dataclasses.replace(batch(7.0, 40_000, slow), waiting=60_000))
    assert rate == 100.0 and model.intake_held  # the pile takes ~3.4 s: intake waits into it
    assert model.batch_cap(1.0) >= 60_000
    assert model.resume(0.1) is None and model.intake_held
    resumed = model.resume(1.5)
    assert resumed is not None and 100.0 < resumed < TARGET * 12_857 and not model.intake_held
    assert model.resume(1.6) is None  # once
    # the drain batch completes with no more waiting than a batch holds: back to the usual cap
    done = model.compute(
        dataclasses.replace(batch(10.5, 60_000, 0.4 + 3.5 * 60_000 / 75_000), waiting=10_000)
    )
    assert done is not None and not model.intake_held
    assert model.batch_cap(1.0) == pytest.approx(max(model.rate, model.capacity or 0.0))
    assert model.state()["drain_pauses"] == 1


def test_an_unlimited_start_takes_a_rate_from_the_first_batch_that_overruns() -> None:
    """`sluice serve` starts the model unlimited: while start-up batches keep up it stays so; the first
    that overruns its interval (intake outpacing the pipeline) sets the rate from its throughput, as a
    warm-up raise would (a saturating publisher otherwise kept filling the store for 30 s)."""
    model = ModelEstimator(initial_rate=INF, warmup_batches=2)
    assert model.compute(batch(1.0, 50_000, 0.8)) is None and model.rate == INF
    assert model.compute(batch(8.0, 500_000, 6.7)) == pytest.approx(1.5 * 500_000 / 6.7)
    assert model.state()["fit"] == "none"


def test_no_starved_batch_for_a_short_collection_or_an_unseen_speed_up() -> None:
    """Simulation's starved measure: a batch holds what arrived since the previous one started (no
    more than the interval's worth of capacity is asked of a batch that follows an overrun at once),
    and a fall of the cost counts from when a batch that started after it ended."""
    pipeline = Pipeline(fixed_cost=0.4, per_record_cost=1 / 75_000, cost_changes=((10.0, 3.0), (12.5, 1.0)))
    ran = [  # (start, seconds, records)
        (9.0, 1.0, 40_000),
        (10.0, 2.0, 20_000),  # the cost rose at its start
        (12.0, 0.8, 14_000),  # the cost fell in it, at 12.5
        (12.8, 0.3, 6_500),  # started after the fall: it shows it when it ends at 13.1
        (13.2, 0.6, 15_000),  # 0.4 s after the last start: its records came over 0.4 s
    ]
    batches = [
        BatchMetrics(i, start + seconds, records, seconds, 1.0, 1.0)
        for i, (start, seconds, records) in enumerate(ran)
    ]
    capacities = [known_capacity(pipeline, start, 1.0, batches) for start, _, _ in ran]
    assert capacities[3] == pytest.approx(15_000)  # at 12.8 the fall is not known yet
    assert capacities[4] == pytest.approx(45_000)  # at 13.2 it is
    sim = Simulation(
        interval=1.0, batches=tuple(batches), capacities=tuple(capacities), rates=(), utilisation=0.0
    )
    # 15k over 0.4 s against 45k/s: over half of 18k; by the whole interval (22.5k) it would be starved
    assert sim.starved_after(10.0) == 0
    assert sim.starved_after(0.0) == 0


def test_a_batch_far_faster_after_a_rise_reads_no_more_than_the_cost_before_it() -> None:
    """A batch far faster than the fit, within the window after a rise the watchdog saw, sets capacity
    at its own per-record time: (seconds - a) / records. Where that is mostly noise over a fixed cost
    (a fast batch right after a slow one, nothing changed), it read a 45k pipeline as 120k records/s,
    the rate followed, and a backlog built that the next real jump made wait 4.5 intervals (seen in
    bench/control_loop.py). A fall back is to about the cost before the rise, not past it."""
    model = fitted_model()
    assert model.overrun(40_000, 1.3, 1.0) is not None  # the watchdog sees a batch overrun: a rise?
    model.compute(batch(6.3, 40_000, 1.3))  # ... a noisy one: nothing changed
    model.compute(batch(7.0, 30_000, 0.55))  # and a fast one (cost(30_000) is 0.8 s)
    assert model.capacity is not None and model.capacity <= 1.25 * 45_000 * 1.02, model.state()
    assert model.rate <= model.capacity


def test_a_drain_batch_may_take_more_than_the_pile_it_counted() -> None:
    """After a batch the watchdog saw overrun, the next one drains what piled up behind it (10). The pile
    is counted from the overrunning batch's StartBatch, so records taken between the source's planning
    of that batch and its StartBatch are in no count: capped at the count, the drain batch left the
    newest of the pile behind, and they waited out the whole drain batch (3.2 intervals late in
    bench/control_loop.py). The cap leaves a batch at capacity to spare, within max_drain intervals."""
    model = fitted_model()  # 0.4 s + records / 75,000: 45k records/s
    assert model.overrun(40_000, 1.5, 1.0, 0) is not None  # the watchdog sees it overrun
    overran = BatchMetrics(
        batch_id=5,
        completed_at=7.5,
        records=40_000,
        processing_delay=2.5,
        scheduling_delay=1.0,
        batch_interval=1.0,
        backlog=0,
        waiting=60_000,
    )
    model.compute(overran)
    cap = model.batch_cap(1.0)
    assert cap > 60_000, model.state()
    per_record = (2.5 - 0.4) / 40_000  # what the overrun showed
    assert 0.4 + cap * per_record <= model.max_drain * 1.0 * 1.01, model.state()
