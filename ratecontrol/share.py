"""Splitting a node's ingest rate among its streams: weighted water-filling over what each can use.

The estimator sets one rate for all the streams a query reads. Split equally, an idle stream's share
is lost: a second, idle stream once halved the first (13.3k records/s against 30.6k alone). Here each
stream gets weight x level, clamped into [floor, cap], at the level where the shares sum to the rate:

- cap: what the stream can use: no limit while its publishers run out of credit the rate withholds
  (busy), else what it took per second lately x `headroom` (room to grow into); never over its max.
- floor: its min rate, and for every stream `idle_floor` x its weighted share of the rate: an idle
  stream's publishers still get credit at once, run out of it as soon as they get busy, and the next
  split (a tick later) gives the stream its weighted share back. No stream starves another.
- What no stream can use (all capped by demand) goes out again by weight to those under their max, as
  headroom: the shares sum to the rate unless every stream is at its max rate.

Floors that together exceed the rate are scaled down to fit it. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ratecontrol.rate import MAX_RATE, UNLIMITED

IDLE_FLOOR = 0.05
"""Share of its weighted share of the rate a stream keeps while idle: credit to ramp from."""
MIN_WEIGHT, MAX_WEIGHT = 1e-6, 1e6
"""A stream's weight lies in between. Weights are relative, so this loses nothing: two of 1e308 summed
to inf and gave every stream a rate of 0, and one of 1e-320 left its stream a rate of 1e-317."""
HEADROOM = 1.5
"""A stream that takes less than its share may use this multiple of what it took before it counts as
busy again; it grows by that factor per split meanwhile."""


@dataclass(frozen=True)
class StreamPolicy:
    """An operator's say in one stream's share (`sluice serve --stream-weight/-min-rate/-max-rate`)."""

    weight: float = 1.0
    """Share among busy streams, relative to the others' (MIN_WEIGHT..MAX_WEIGHT)."""
    min_rate: float = 0.0
    """Records/s the stream keeps however little it takes, as far as the node's rate allows (>= 0)."""
    max_rate: float = UNLIMITED
    """Records/s the stream never exceeds (> 0 and >= min_rate; inf for none)."""

    def __post_init__(self) -> None:
        if not MIN_WEIGHT <= self.weight <= MAX_WEIGHT:
            raise ValueError(
                f"a stream's weight must be a number in {MIN_WEIGHT:g}..{MAX_WEIGHT:g} (weights are "
                f"relative), got {self.weight}"
            )
        if not (math.isfinite(self.min_rate) and self.min_rate >= 0):
            raise ValueError(f"a stream's min rate must be a finite number >= 0, got {self.min_rate}")
        if math.isnan(self.max_rate) or self.max_rate <= 0 or self.max_rate < self.min_rate:
            raise ValueError(
                f"a stream's max rate must be > 0 and >= its min rate ({self.min_rate}), got {self.max_rate}"
            )
        for which, value in (("min", self.min_rate), ("max", self.max_rate)):
            if MAX_RATE < value < math.inf:
                none = " (inf: none)" if which == "max" else ""
                raise ValueError(
                    f"a stream's {which} rate must be at most {MAX_RATE:g} records/s{none}, got {value:g}"
                )


DEFAULT_POLICY = StreamPolicy()


@dataclass(frozen=True)
class Demand:
    """What one stream's receiver saw lately."""

    busy: bool
    """Its publishers ran out of credit the rate withheld: it would take more than its share."""
    taken: float = 0.0
    """Records per second it took lately (>= 0, finite)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.taken) and self.taken >= 0):
            raise ValueError(f"records taken per second must be a finite number >= 0, got {self.taken}")


@dataclass(frozen=True)
class Share:
    """One stream's part of the rate, and why."""

    rate: float
    """Records per second (> 0; inf when unlimited)."""
    reason: str
    """For operators: "busy", "idle: keeps a floor to ramp from", "at its max rate", ..."""


def split_rate(
    total: float,
    demands: Mapping[str, Demand],
    policies: Mapping[str, StreamPolicy] | None = None,
    *,
    idle_floor: float = IDLE_FLOOR,
    headroom: float = HEADROOM,
) -> dict[str, Share]:
    """Each stream's share of `total` records/s (> 0, inf for unlimited) given its demand and policy
    (DEFAULT_POLICY for streams without one). ValueError for an idle floor outside (0, 1] or a headroom
    under 1. See the module docstring for the rule."""
    if not 0 < idle_floor <= 1:
        raise ValueError(f"idle_floor must be in (0, 1], got {idle_floor}")
    if not headroom >= 1:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    policies = policies or {}
    names = list(demands)
    if not names:
        return {}
    pol = [policies.get(name, DEFAULT_POLICY) for name in names]
    dem = [demands[name] for name in names]
    if math.isinf(total):
        return {
            name: Share(p.max_rate, "at its max rate" if math.isfinite(p.max_rate) else "unlimited")
            for name, p in zip(names, pol, strict=True)
        }
    weights = [p.weight for p in pol]
    highs = [p.max_rate for p in pol]
    fair = [total * w / sum(weights) for w in weights]
    ramps = [min(idle_floor * f, p.max_rate) for p, f in zip(pol, fair, strict=True)]
    floors = [min(max(p.min_rate, ramp), p.max_rate) for p, ramp in zip(pol, ramps, strict=True)]
    if sum(floors) >= total:
        # the min rates ask for more than there is: each keeps its floor to ramp from, and the rest
        # goes to the min rates in proportion to what they ask beyond it
        asked = sum(floors) - sum(ramps)
        scale = (total - sum(ramps)) / asked if asked > 0 else 0.0
        rates = [ramp + (floor - ramp) * scale for ramp, floor in zip(ramps, floors, strict=True)]
        return {
            name: Share(rate, _reason(d, p, rate, floor, floor, weighted=False))
            for name, d, p, rate, floor in zip(names, dem, pol, rates, floors, strict=True)
        }
    caps = [
        max(floor, p.max_rate if d.busy else min(p.max_rate, d.taken * headroom))
        for d, p, floor in zip(dem, pol, floors, strict=True)
    ]
    if sum(caps) >= total:
        rates = _fill(total, weights, floors, caps)
    elif sum(highs) > total:
        rates = _fill(total, weights, caps, highs)  # what nobody uses, as headroom by weight
    else:
        rates = highs
    return {
        name: Share(rate, _reason(d, p, rate, floor, cap, weighted=True))
        for name, d, p, rate, floor, cap in zip(names, dem, pol, rates, floors, caps, strict=True)
    }


def _fill(
    total: float, weights: Sequence[float], lows: Sequence[float], highs: Sequence[float]
) -> list[float]:
    """clamp(w_i x level, low_i, high_i) at the level where they sum to `total`; needs
    sum(lows) <= total <= sum(highs) (highs may be inf)."""

    def at(level: float) -> list[float]:
        return [min(max(w * level, lo), hi) for w, lo, hi in zip(weights, lows, highs, strict=True)]

    # the sum is piecewise linear in the level, with a bend where a stream leaves its low or reaches
    # its high: find the segment holding `total`, then solve on it
    bends = sorted({x / w for w, lo, hi in zip(weights, lows, highs, strict=True) for x in (lo, hi)})
    below, above = 0.0, math.inf
    for bend in bends:
        if not math.isfinite(bend) or sum(at(bend)) >= total:
            above = bend
            break
        below = bend
    # who rises on the segment, judged inside it (at a bend, rounding may put a stream on either side)
    inside = (below + above) / 2 if math.isfinite(above) else 2 * below + 1
    slope = sum(w for w, lo, hi in zip(weights, lows, highs, strict=True) if lo < w * inside < hi)
    level = below + (total - sum(at(below))) / slope if slope > 0 else below
    return at(min(level, above))


def _reason(
    demand: Demand, policy: StreamPolicy, rate: float, floor: float, cap: float, *, weighted: bool
) -> str:
    near = 1e-9 * max(rate, 1.0)
    if math.isfinite(policy.max_rate) and rate >= policy.max_rate - near:
        return "busy, at its max rate" if demand.busy else "at its max rate"
    if demand.busy:
        return f"busy, weight {policy.weight:g}" if weighted else "busy"
    kind = "light" if demand.taken else "idle"
    took = f"takes {demand.taken:,.0f} records/s" if demand.taken else "takes nothing"
    if rate <= floor + near:
        if policy.min_rate > 0 and policy.min_rate >= floor - near:
            return f"{kind}: held at its min rate"
        return f"{kind}: keeps a floor to ramp from" if not demand.taken else f"{kind}: {took}, keeps a floor"
    if rate > cap + near:
        return f"{kind}: {took}; spare rate no busy stream wants"
    return f"{kind}: {took}, room to grow"
