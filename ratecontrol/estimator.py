"""Rate estimators: completed batches in, a new ingest rate (records/s) out.

Every estimator is one class registered by its `name`, built with `make_estimator` from configuration.
An estimator is stateful (one per streaming query, fed every completed batch in order) and not
thread-safe: feed it from one thread or event loop.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

from ratecontrol.batch import BatchMetrics
from ratecontrol.rate import MAX_RATE, UNLIMITED, check_rate

StateValue = float | int | str | None


MIN_RATE = 1e-6
"""Records/s: the lowest bound there may be (a record every 11.6 days). Below it the rate's arithmetic
underflowed: bounds of 5e-324 were refused with "rate must be > 0, got 0.0"."""


@dataclass(frozen=True)
class RateBounds:
    """The range every estimator's output is clamped into (records/s)."""

    min_rate: float = 100.0
    """Lowest rate ever proposed (>= MIN_RATE, finite); Spark's spark.streaming.backpressure.pid.minRate."""
    max_rate: float = UNLIMITED
    """Highest rate ever proposed (>= min_rate; inf for none); Spark's spark.streaming.receiver.maxRate."""

    def __post_init__(self) -> None:
        for name, value in (("min_rate", self.min_rate), ("max_rate", self.max_rate)):
            if math.isnan(value):  # named: the message is mapped to the flag or key that set it
                raise ValueError(f"{name} must be a number, got NaN")
        if not (MIN_RATE <= self.min_rate < math.inf):
            raise ValueError(f"min_rate must be >= {MIN_RATE:g} and finite, got {self.min_rate:g}")
        for name, value in (("min_rate", self.min_rate), ("max_rate", self.max_rate)):
            if MAX_RATE < value < math.inf:  # inf: no maximum
                none = " (inf: none)" if name == "max_rate" else ""
                raise ValueError(f"{name} must be at most {MAX_RATE:g} records/s{none}, got {value:g}")
        if self.max_rate < self.min_rate:
            raise ValueError(f"max_rate ({self.max_rate}) must be >= min_rate ({self.min_rate})")

    def clamp(self, rate: float) -> float:
        return min(max(rate, self.min_rate), self.max_rate)


DEFAULT_BOUNDS = RateBounds()


class RateEstimator(ABC):
    """Turns each completed batch into a new rate, or None to keep the current one.

    Subclasses implement `_estimate` and `_state`; `compute` clamps every rate into the bounds and
    drops NaN (what Spark's RateLimiter does too: it ignores any rate that is not > 0).
    """

    name: ClassVar[str]

    def __init__(self, *, bounds: RateBounds, initial_rate: float) -> None:
        self._bounds = bounds
        self._rate = bounds.clamp(check_rate(initial_rate))

    @property
    def bounds(self) -> RateBounds:
        return self._bounds

    @property
    def rate(self) -> float:
        """The rate this estimator believes is in force: its latest output, else the initial rate."""
        return self._rate

    @property
    def capacity(self) -> float | None:
        """Records/s the pipeline is estimated to process with one batch per interval; None if unknown.

        Where a batch's size is capped (the source's latestOffset), allow max(rate, capacity) x interval:
        a cap of rate x interval lets no more out per batch than comes in, so a backlog never drains.
        """
        return None

    def batch_cap(self, interval: float) -> float:
        """Most records the next batch may hold, where a source caps its batches (Sluice's asks before
        each batch): max(rate, capacity) x interval by default (inf while the rate is unlimited and the
        capacity unknown). An estimator may allow more for a while (the model, to drain what piled up
        behind a batch that overran)."""
        return max(self._rate, self.capacity or 0.0) * interval

    @property
    def intake_held(self) -> bool:
        """Whether intake should take nothing for now, whatever the rate (a receiver then grants no
        credit): a pause the estimator is in (the model's, while the next batch is full anyway or a
        drain batch runs). Its rate meanwhile is min_rate. False by default."""
        return False

    def set_bounds(self, bounds: RateBounds) -> None:
        """New bounds apply from the next output on (the rate in force is clamped at once)."""
        self._bounds = bounds
        self._rate = bounds.clamp(self._rate)

    def adopt(self, rate: float) -> None:
        """An operator set the rate in force (`sluice rate set`): the estimator goes on from it, as Spark's
        estimators go on from their latest output, rather than from a rate no longer in force."""
        self._rate = self._bounds.clamp(check_rate(rate))
        self._adopted(self._rate)

    def _adopted(self, rate: float) -> None:
        """Hook for adopt(): bring any state that holds the rate in force up to `rate` (clamped)."""
        return None  # nothing beyond the rate itself by default

    def compute(self, batch: BatchMetrics) -> float | None:
        """A new rate in records/s after `batch` completed, or None for no new rate."""
        rate = self._estimate(batch)
        if rate is None or math.isnan(rate):
            return None
        self._rate = self._bounds.clamp(rate)
        return self._rate

    def overrun(
        self, records: int, elapsed: float, interval: float, waiting: int | None = None
    ) -> float | None:
        """A lower rate now, or None: a batch of `records` has run `elapsed` seconds and not completed;
        `waiting` records (when known) are there for the batches after it.

        Called while a batch overruns its interval (a watchdog), so an estimator can act on a slower
        pipeline before the batch's completion says so. Never raises the rate.
        """
        if records <= 0 or not elapsed > interval > 0:
            return None
        rate = self._overrun(records, elapsed, interval, waiting)
        if rate is None or math.isnan(rate) or rate >= self._rate:
            return None
        self._rate = self._bounds.clamp(rate)
        return self._rate

    def _overrun(self, records: int, elapsed: float, interval: float, waiting: int | None) -> float | None:
        return None

    def resume(self, elapsed: float) -> float | None:
        """The rate to resume intake at, or None: the running batch has run `elapsed` seconds.

        Called with the watchdog's looks (from the batch's start, not only past its interval). An
        estimator that paused intake when a batch completed, until a point in the next one, ends the
        pause here; the only way a look at a running batch raises the rate. None by default.
        """
        if not (math.isfinite(elapsed) and elapsed >= 0):
            return None
        rate = self._resume(elapsed)
        if rate is None or math.isnan(rate):
            return None
        self._rate = self._bounds.clamp(rate)
        return self._rate

    def _resume(self, elapsed: float) -> float | None:
        return None

    def state(self) -> dict[str, StateValue]:
        """The estimator's internal state, for an operator (GetRate, the status page)."""
        return {
            "estimator": self.name,
            "rate": self._rate,
            "min_rate": self._bounds.min_rate,
            "max_rate": self._bounds.max_rate,
            **self._state(),
        }

    @abstractmethod
    def _estimate(self, batch: BatchMetrics) -> float | None: ...

    @abstractmethod
    def _state(self) -> dict[str, StateValue]: ...


ESTIMATORS: dict[str, Callable[..., RateEstimator]] = {}
"""Estimator classes by name; every module of the package registers its own on import."""

DEFAULT_ESTIMATOR = "model"

_E = TypeVar("_E", bound=type[RateEstimator])


def register(cls: _E) -> _E:
    """Class decorator: make `cls` available to make_estimator under `cls.name`."""
    if cls.name in ESTIMATORS:
        raise ValueError(f"two estimators named {cls.name!r}")
    ESTIMATORS[cls.name] = cls
    return cls


class UnknownEstimatorError(ValueError):
    """No estimator has this name."""


def check_estimator(name: str) -> str:
    """`name`, if it names an estimator; else UnknownEstimatorError."""
    if name not in ESTIMATORS:
        raise UnknownEstimatorError(f"unknown estimator {name!r}; known: {', '.join(sorted(ESTIMATORS))}")
    return name


def make_estimator(name: str, *, bounds: RateBounds, initial_rate: float, **gains: float) -> RateEstimator:
    """Build the estimator called `name`; `gains` are its own keyword parameters (e.g. integral=0.2).

    Raises UnknownEstimatorError for an unknown name and ValueError for a parameter the estimator does
    not have or a value it rejects, so a configuration error never surfaces as a TypeError.
    """
    factory = ESTIMATORS[check_estimator(name)]
    accepted = set(inspect.signature(factory).parameters) - {"bounds", "initial_rate"}
    unknown = sorted(set(gains) - accepted)
    if unknown:
        named = ", ".join(repr(u) if len(u) <= 100 else f"{u[:100]!r}..." for u in unknown[:5])
        more = f" ({len(unknown)} in all)" if len(unknown) > 5 else ""  # a message, not a megabyte
        takes = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"estimator {name!r} has no parameter {named}{more}; it takes: {takes}")
    return factory(bounds=bounds, initial_rate=initial_rate, **gains)


@register
class FixedEstimator(RateEstimator):
    """Never proposes a rate: the rate stays what an operator set."""

    name = "fixed"

    def __init__(self, *, bounds: RateBounds = DEFAULT_BOUNDS, initial_rate: float = UNLIMITED) -> None:
        super().__init__(bounds=bounds, initial_rate=initial_rate)

    def _estimate(self, batch: BatchMetrics) -> float | None:
        return None

    def _state(self) -> dict[str, StateValue]:
        return {}
