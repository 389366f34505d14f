"""Splitting the rate among streams (ratecontrol.share): weighted water-filling, worked by hand and by
Hypothesis. Issue 12, item 9: an equal split gave an idle second stream half of the rate."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ratecontrol import MAX_RATE, Demand, Share, StreamPolicy, split_rate
from ratecontrol.share import IDLE_FLOOR, MAX_WEIGHT, MIN_WEIGHT

INF = math.inf


def rates(shares: dict[str, Share]) -> dict[str, float]:
    return {name: share.rate for name, share in shares.items()}


def test_an_idle_stream_keeps_a_floor_and_the_busy_one_gets_the_rest() -> None:
    shares = split_rate(20_000, {"a": Demand(busy=True, taken=10_000), "b": Demand(busy=False)})
    # b keeps 5% of its half to ramp from; a gets the rest, not half
    assert rates(shares) == pytest.approx({"a": 19_500, "b": 500})
    assert shares["a"].reason == "busy, weight 1"
    assert shares["b"].reason == "idle: keeps a floor to ramp from"


def test_busy_streams_split_by_weight_and_a_light_one_gets_what_it_uses_with_room() -> None:
    both = split_rate(20_000, {"a": Demand(True), "b": Demand(True)}, {"a": StreamPolicy(weight=3)})
    assert rates(both) == pytest.approx({"a": 15_000, "b": 5_000})
    light = split_rate(20_000, {"a": Demand(False, taken=3_000), "b": Demand(True)})
    assert rates(light) == pytest.approx({"a": 4_500, "b": 15_500})  # 1.5 x what a took
    assert light["a"].reason == "light: takes 3,000 records/s, room to grow"


def test_bounds_hold_and_what_nobody_wants_is_spread_by_weight() -> None:
    capped = split_rate(20_000, {"a": Demand(True), "b": Demand(False)}, {"a": StreamPolicy(max_rate=5_000)})
    assert rates(capped) == pytest.approx({"a": 5_000, "b": 15_000})
    assert capped["a"].reason == "busy, at its max rate"
    assert capped["b"].reason == "idle: takes nothing; spare rate no busy stream wants"
    # nobody busy: by weight, as an equal split did
    assert rates(split_rate(4_000, {"a": Demand(False), "b": Demand(False)})) == {"a": 2_000, "b": 2_000}
    # min rates that ask for more than there is: the busy stream still keeps its floor to ramp from
    short = split_rate(100, {"a": Demand(True), "b": Demand(False)}, {"b": StreamPolicy(min_rate=5_000)})
    assert rates(short) == pytest.approx({"a": 2.5, "b": 97.5})
    assert short["b"].reason == "idle: held at its min rate"
    # unlimited: every stream unlimited but for its max
    free = split_rate(INF, {"a": Demand(True), "b": Demand(False)}, {"b": StreamPolicy(max_rate=7)})
    assert rates(free) == {"a": INF, "b": 7}


@pytest.mark.parametrize(
    "fields", [{"weight": 0.0}, {"weight": INF}, {"weight": math.nan}, {"min_rate": -1.0}, {"max_rate": 0.0},
               {"min_rate": 10.0, "max_rate": 5.0}, {"min_rate": INF}, {"max_rate": math.nan},
               {"weight": 1e308}, {"weight": 1e-320}, {"min_rate": 1e308}, {"max_rate": 1e308}]
)  # fmt: skip
def test_policies_reject_impossible_values(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="a stream's"):
        StreamPolicy(**fields)


def test_the_extreme_weights_still_split_the_whole_rate() -> None:
    # two weights of 1e308 once summed to inf, and both streams got a rate of 0
    busy = {"a": Demand(True), "b": Demand(True)}
    top = StreamPolicy(weight=MAX_WEIGHT)
    assert rates(split_rate(1000.0, busy, {"a": top, "b": top})) == {"a": 500.0, "b": 500.0}
    apart = rates(split_rate(1000.0, busy, {"a": StreamPolicy(weight=MIN_WEIGHT), "b": top}))
    assert 0 < apart["a"] < 1e-6 and apart["b"] == pytest.approx(1000.0)


def test_impossible_demands_and_gains_are_refused() -> None:
    for taken in (-1.0, INF, math.nan):
        with pytest.raises(ValueError, match="taken"):
            Demand(False, taken)
    with pytest.raises(ValueError, match="idle_floor"):
        split_rate(10.0, {"a": Demand(True)}, idle_floor=0.0)
    with pytest.raises(ValueError, match="headroom"):
        split_rate(10.0, {"a": Demand(True)}, headroom=0.5)
    assert split_rate(10.0, {}) == {}


policies = st.builds(
    # a stream's max rate is at most MAX_RATE (or inf), as every rate
    lambda weight, low, span: StreamPolicy(weight, low, min(low * span, MAX_RATE) if low else span),
    st.floats(min_value=1e-3, max_value=1e3),
    st.just(0.0) | st.floats(min_value=1e-3, max_value=1e6),
    st.floats(min_value=1.0, max_value=1e7) | st.just(INF),
)
demands = st.builds(Demand, st.booleans(), st.floats(min_value=0, max_value=1e7))
streams = st.dictionaries(st.sampled_from("abcdefgh"), st.tuples(demands, policies), min_size=1, max_size=8)
totals = st.floats(min_value=1e-3, max_value=1e8)


Spec = dict[str, tuple[Demand, StreamPolicy]]


def split(total: float, spec: Spec) -> dict[str, Share]:
    return split_rate(total, {n: d for n, (d, _) in spec.items()}, {n: p for n, (_, p) in spec.items()})


def floors(total: float, spec: Spec, *, mins: bool = True) -> dict[str, float]:
    """Each stream's floor: its min rate (unless mins is False) or IDLE_FLOOR x its weighted share."""
    weights = sum(p.weight for _, p in spec.values())
    return {
        n: min(max(p.min_rate if mins else 0.0, IDLE_FLOOR * total * p.weight / weights), p.max_rate)
        for n, (_, p) in spec.items()
    }


@settings(max_examples=500)
@given(total=totals, spec=streams)
def test_shares_are_positive_bounded_and_sum_to_the_rate(
    total: float, spec: dict[str, tuple[Demand, StreamPolicy]]
) -> None:
    shares = split(total, spec)
    assert set(shares) == set(spec)
    got = rates(shares)
    for name, rate in got.items():
        policy = spec[name][1]
        assert 0 < rate <= policy.max_rate * (1 + 1e-9)
        assert not math.isnan(rate)
    room = sum(p.max_rate for _, p in spec.values())
    if room >= total:  # someone can take it: all of it goes out
        assert sum(got.values()) == pytest.approx(total, rel=1e-9)
    else:  # everybody at their max
        assert got == pytest.approx({n: p.max_rate for n, (_, p) in spec.items()})
    held = floors(total, spec)
    if sum(held.values()) > total:  # the min rates ask for more than there is
        held = floors(total, spec, mins=False)  # still, every stream keeps its floor to ramp from
    for name, floor in held.items():
        assert got[name] >= floor * (1 - 1e-9)


@settings(max_examples=500)
@given(total=totals, spec=streams)
def test_busy_streams_share_by_weight_and_nobody_idle_takes_from_them(
    total: float, spec: dict[str, tuple[Demand, StreamPolicy]]
) -> None:
    """Water-filling's fairness: a busy stream under its max gets at least as much per unit of weight as
    any stream above its floor; so two busy streams above their floors and under their maxes get
    exactly their weights' ratio, and a stream that is not busy gets more than 1.5 x what it took only
    when no busy stream could use it (every busy one is at its max)."""
    shares = rates(split(total, spec))
    held = floors(total, spec)
    if sum(held.values()) > total:
        return  # the min rates ask for more than there is: no level to compare at
    tol = 1e-7

    busy = [n for n, (d, p) in spec.items() if d.busy and shares[n] < p.max_rate * (1 - tol)]
    for b in busy:
        level = shares[b] / spec[b][1].weight
        for other, (_, policy) in spec.items():
            if shares[other] > held[other] * (1 + tol):
                assert shares[other] / policy.weight <= level * (1 + tol)
    if busy:
        for name, (demand, policy) in spec.items():
            if not demand.busy:
                assert shares[name] <= max(held[name], min(policy.max_rate, demand.taken * 1.5)) * (1 + tol)


@settings(max_examples=300)
@given(total=totals, spec=streams, name=st.sampled_from("abcdefgh"))
def test_a_stream_that_gets_busy_never_gets_less(
    total: float, spec: dict[str, tuple[Demand, StreamPolicy]], name: str
) -> None:
    if name not in spec:
        return
    demand, policy = spec[name]
    idle = split(total, {**spec, name: (Demand(False, demand.taken), policy)})[name].rate
    busy = split(total, {**spec, name: (Demand(True, demand.taken), policy)})[name].rate
    assert busy >= idle * (1 - 1e-9)
