"""Rates: records per second, validated in one place for operators and estimators alike."""

from __future__ import annotations

import math

UNLIMITED = math.inf
"""The rate of a stream nobody throttles."""


class InvalidRateError(ValueError):
    """A value that is not a rate: NaN, zero, negative."""


def check_rate(value: float) -> float:
    """Return `value` if it is a usable rate (> 0, or +inf for unlimited), else raise InvalidRateError."""
    if math.isnan(value):
        raise InvalidRateError("rate is NaN; give records per second > 0, or inf for unlimited")
    if value <= 0:
        raise InvalidRateError(f"rate must be > 0 records/s (or inf for unlimited), got {value}")
    return value
