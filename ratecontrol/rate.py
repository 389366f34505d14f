"""Rates: records per second, validated in one place for operators and estimators alike."""

from __future__ import annotations

import math

UNLIMITED = math.inf
"""The rate of a stream nobody throttles."""

MAX_RATE = 1e12
"""Records/s: the highest finite rate or bound there may be (inf is the one above it: unlimited). Far
past any pipeline, and a rate times any interval (a day at most) stays a count a batch's int64 fields
and a float hold exactly enough. 1e308 was taken: shown as a 309-digit number by `sluice rate get`,
and twice it, a batch's cap at a 2 s trigger, overflowed to inf (int() of it raised)."""


class InvalidRateError(ValueError):
    """A value that is not a rate: NaN, zero, negative, or finite past MAX_RATE."""


def check_rate(value: float) -> float:
    """Return `value` if it is a usable rate (> 0 and at most MAX_RATE, or +inf for unlimited), else raise
    InvalidRateError."""
    if math.isnan(value):
        raise InvalidRateError("rate is NaN; give records per second > 0, or inf for unlimited")
    if value <= 0:
        raise InvalidRateError(f"rate must be > 0 records/s (or inf for unlimited), got {value}")
    if MAX_RATE < value < math.inf:
        raise InvalidRateError(
            f"rate must be at most {MAX_RATE:g} records/s (or inf for unlimited), got {value:g}"
        )
    return value


def capped(value: float) -> float:
    """`value` with a finite rate past MAX_RATE brought down to it (NaN, inf and the rest as they are):
    for rates the arithmetic makes (an estimator's proposal, a share of a rate, where a rounding may
    cross it), which are not an operator's to refuse."""
    return MAX_RATE if MAX_RATE < value < math.inf else value
