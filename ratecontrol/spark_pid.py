"""Spark Streaming's PID rate estimator, re-implemented exactly, to compare Sluice's estimators against.

Source: org.apache.spark.streaming.scheduler.rate.PIDRateEstimator as in Spark 4.x. Its faults under a
saturating sender (starvation at minRate after a backlog, a capacity estimate biased low by the fixed
cost per batch) are described in DESIGN.md, section "Control loop"; they are kept.

Units. Spark feeds compute() whole milliseconds taken from its clock (System.currentTimeMillis):
time = processingEndTime, processingDelay = processingEndTime - processingStartTime,
schedulingDelay = processingStartTime - submissionTime, where submissionTime is the batch time, the end
of the interval that collected the batch. We rebuild those three clock readings from a BatchMetrics
(end = completed_at, start = end - processing_delay, submission = start - lateness, lateness being the
oldest record's wait beyond one interval), truncate each to a millisecond as the clock would, and take
the same differences: a 0.4 ms batch has a processingDelay of 0 or 1 ms depending on where it fell, as
in Spark. The truncation forgives binary rounding of a few ulps (4.35 s is 4350 ms, not 4349). The
batch interval is a Spark Duration, a whole number of milliseconds: round(batch_interval * 1000), read
from each batch so that a runtime change of the trigger interval is followed (Spark fixes it per
StreamingContext).

Overflow. Gains are any finite numbers >= 0, as in Spark; a step whose arithmetic overflows (gains of
1e308) is not taken: the state stays as it was and no rate is proposed, where Spark's latestRate would
turn inf, then NaN, for good.

Bounds. Spark's estimator applies only minRate (our bounds.min_rate) inside its formula; the maximum
(spark.streaming.receiver.maxRate) is applied later by the receiver's RateLimiter, outside the
estimator's state. Here the output is clamped to bounds.max_rate too, and, as in Spark, the clamp does
not feed back into latestRate. Spark's initialRate likewise only seeds the RateLimiter: the estimator
ignores `initial_rate` (it only says what rate is in force until the first output).
"""

from __future__ import annotations

import math

from ratecontrol.batch import BatchMetrics
from ratecontrol.estimator import RateBounds, RateEstimator, StateValue, register
from ratecontrol.rate import UNLIMITED

SPARK_BOUNDS = RateBounds(min_rate=100.0, max_rate=UNLIMITED)
"""Spark's defaults: minRate 100, no maxRate."""


def clock_millis(seconds: float) -> int:
    """A clock reading in seconds as Spark's millisecond clock would show it (truncated)."""
    millis = seconds * 1000.0
    # forgive the binary rounding of a decimal input (4.35 * 1000 == 4349.999999999999)
    return math.floor(millis + max(1e-6, 4 * math.ulp(millis)))


@register
class SparkPIDEstimator(RateEstimator):
    """Spark's PIDRateEstimator: error = latest rate - processing rate, integral from scheduling delay."""

    name = "spark-pid"

    def __init__(
        self,
        *,
        bounds: RateBounds = SPARK_BOUNDS,
        initial_rate: float = UNLIMITED,
        proportional: float = 1.0,
        integral: float = 0.2,
        derivative: float = 0.0,
    ) -> None:
        super().__init__(bounds=bounds, initial_rate=initial_rate)
        for gain, value in (
            ("proportional", proportional),
            ("integral", integral),
            ("derivative", derivative),
        ):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{gain} gain must be a finite number >= 0, got {value}")
        self.proportional = proportional
        self.integral = integral
        self.derivative = derivative
        # Spark's initial state, including latestError = -1 (only ever read in the discarded first run)
        self._first_run = True
        self._latest_time = -1
        self._latest_rate = -1.0
        self._latest_error = -1.0

    def _estimate(self, batch: BatchMetrics) -> float | None:
        time = clock_millis(batch.completed_at)
        started = clock_millis(batch.completed_at - batch.processing_delay)
        submitted = clock_millis(batch.completed_at - batch.processing_delay - batch.lateness)
        interval = round(batch.batch_interval * 1000)
        return self._compute_millis(time, batch.records, time - started, started - submitted, interval)

    def _compute_millis(
        self,
        time: int,
        num_elements: int,
        processing_delay: int,
        scheduling_delay: int,
        batch_interval_millis: int,
    ) -> float | None:
        """Spark's compute(time, numElements, processingDelay, schedulingDelay), all in milliseconds.

        Returns Spark's newRate unclamped by max_rate (compute() clamps it); None where Spark's
        returns None: the first run, a time not after the latest, no elements, no processing delay.
        """
        if batch_interval_millis <= 0:
            return None  # Spark refuses to build an estimator for an interval under 1 ms
        if not (time > self._latest_time and num_elements > 0 and processing_delay > 0):
            return None
        delay_since_update = (time - self._latest_time) / 1000
        processing_rate = num_elements / processing_delay * 1000
        error = self._latest_rate - processing_rate
        historical_error = scheduling_delay * processing_rate / batch_interval_millis
        d_error = (error - self._latest_error) / delay_since_update
        new_rate = max(
            self._latest_rate
            - self.proportional * error
            - self.integral * historical_error
            - self.derivative * d_error,
            self._bounds.min_rate,
        )
        if not math.isfinite(new_rate):
            # gains so large (1e308) that the step overflows: Spark's doubles would carry the inf into
            # latestRate and the next error (inf - inf: NaN for good); the step is not taken instead
            return None
        self._latest_time = time
        if self._first_run:
            self._latest_rate = processing_rate
            self._latest_error = 0.0
            self._first_run = False
            return None
        self._latest_rate = new_rate
        self._latest_error = error
        return new_rate

    def _adopted(self, rate: float) -> None:
        # Spark's latestRate is the rate its next error is measured against; before the first run it is
        # set from the first batch's processing rate, and an unlimited rate is no base to step from
        if not self._first_run and math.isfinite(rate):
            self._latest_rate = rate

    def _state(self) -> dict[str, StateValue]:
        return {
            "proportional": self.proportional,
            "integral": self.integral,
            "derivative": self.derivative,
            "first_run": int(self._first_run),
            "latest_time_ms": self._latest_time,
            "latest_rate": self._latest_rate,
            "latest_error": self._latest_error,
        }
