"""The control loop's one place: batch metrics in, the ingest rate out to every receiver.

The estimator (ratecontrol) proposes a rate after each completed micro-batch; an operator may set or pin
one through RateControl. Both go through `update`'s validation and the same clamping into the bounds, and
end in Receiver.set_rate, which meters credit: so the rate throttles the clients, not a buffer.

The rate covers all streams the query reads; each stream's receiver gets an equal share (dividing it by
backlog comes with several receivers per stream).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Mapping

from ingest.config import RateConfig
from ratecontrol import BatchMetrics, RateBounds, RateEstimator, check_rate, make_estimator
from receivers.receiver import Receiver

log = logging.getLogger(__name__)


STARTUP_BATCHES = 2
"""Batches of a fresh query the model estimator does not fit."""

WATCHDOG_TICK = 0.1
"""Seconds between looks at a running batch (check_overrun), as the server calls it."""

MAX_BATCH_WAIT = 10.0
"""Longest wait for a running batch's metrics that a caller of wait_for_batch may ask for."""


class RateController:
    """Owns the ingest rate of a node's receivers."""

    def __init__(
        self,
        receivers: Mapping[str, Receiver],
        config: RateConfig | None = None,
        *,
        batch_interval: float = 1.0,
    ) -> None:
        config = config or RateConfig()
        self._receivers = receivers
        self._batch_interval = batch_interval
        # the batch the source started: records, when, backlog beyond it then, records taken by then
        self._running: tuple[int, float, int, int] | None = None
        self._completed = asyncio.Event()  # set while no reported batch awaits its completion
        self._completed.set()
        # whether completions arrive at all (a listener is wired and keeps up): waits are skipped
        # from a wait that timed out until the next completion
        self._completions_arrive = False
        self._bounds = RateBounds(config.min_rate, config.max_rate)
        self._rate = self._clamp(check_rate(config.initial_rate))
        # a fresh query's first batch pays ~10 s of worker start-up and the second is still slow (seen
        # here: 1,000 records in 2 s, read as 2 ms a record); fitting either collapses the rate
        gains = {"warmup_batches": STARTUP_BATCHES} if config.estimator == "model" else {}
        self.estimator: RateEstimator = make_estimator(
            config.estimator, bounds=self._bounds, initial_rate=self._rate, **gains
        )
        self.pinned = False
        self.last_batch: BatchMetrics | None = None
        self._apply(self._rate)

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def bounds(self) -> RateBounds:
        return self._bounds

    def stream_rates(self) -> dict[str, float]:
        return {stream: receiver.rate for stream, receiver in self._receivers.items()}

    def credit_paused(self) -> dict[str, list[str]]:
        """Stream -> why its credit is paused now (sorted reasons: see receivers.receiver.PAUSE_REASONS)."""
        return {stream: sorted(receiver.paused) for stream, receiver in self._receivers.items()}

    def on_batch(self, batch: BatchMetrics) -> None:
        """A micro-batch completed: let the estimator propose a rate (ignored while pinned)."""
        # an empty batch (Spark reports some while idle) is none the source started: it ends no watch
        if batch.records > 0:
            if self._running is not None and batch.waiting is None:
                # what waits now for later batches, counted: left behind at the start plus taken since
                _, _, backlog, taken = self._running
                batch = dataclasses.replace(batch, waiting=max(0, backlog + self._taken() - taken))
            self._running = None
            self._completions_arrive = True
            self._completed.set()
        self.last_batch = batch
        proposal = self.estimator.compute(batch)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "batch %s -> %s proposes %s; state %s",
                batch,
                self.estimator.name,
                proposal,
                self.estimator.state(),
            )
        if proposal is not None and not self.pinned:
            self._apply(self._clamp(check_rate(proposal)))

    def batch_started(self, records: int, backlog: int = 0, now: float | None = None) -> None:
        """The source planned a batch of `records` (ValueError unless > 0), with `backlog` records
        (ValueError if < 0) there beyond it, and runs it from `now`."""
        if records <= 0:
            raise ValueError(f"a started batch has records > 0, got {records}")
        if backlog < 0:
            raise ValueError(f"backlog must be >= 0 records, got {backlog}")
        now = time.monotonic() if now is None else now
        self._running = (records, now, backlog, self._taken())
        self._completed.clear()

    async def wait_for_batch(self, timeout: float) -> None:
        """Until the batch reported by batch_started has completed (its metrics went through
        on_batch), at most `timeout` seconds (ValueError unless finite, >= 0 and <= MAX_BATCH_WAIT).

        Spark plans the next batch right after the last one ended, often before the listener's event
        has arrived here: a cap read then would follow the batch before last. Does not wait while
        completions do not arrive (no listener wired, or the last wait timed out) until one does.
        """
        if not (math.isfinite(timeout) and 0 <= timeout <= MAX_BATCH_WAIT):
            raise ValueError(f"a wait for a batch must be in [0, {MAX_BATCH_WAIT:g}] seconds, got {timeout}")
        if self._completed.is_set() or timeout == 0 or not self._completions_arrive:
            return
        try:
            await asyncio.wait_for(self._completed.wait(), timeout)
        except TimeoutError:
            log.warning(
                "no metrics for the running batch within %.2f s: not waiting again until some arrive", timeout
            )
            self._completions_arrive = False

    def _taken(self) -> int:
        return sum(r.stats.records_received for r in self._receivers.values())

    def check_overrun(self, now: float | None = None) -> None:
        """The watchdog: while the running batch overruns its interval, let the estimator lower the
        rate at once rather than when the batch completes (records keep arriving at the old rate
        meanwhile, and each of them waits for a slower pipeline). Ignored while pinned."""
        if self._running is None or self.pinned:
            return
        records, started, backlog, taken = self._running
        elapsed = (time.monotonic() if now is None else now) - started
        waiting = backlog + self._taken() - taken
        proposal = self.estimator.overrun(records, elapsed, self._batch_interval, waiting)
        if proposal is not None:
            log.info(
                "batch of %d records still running after %.2f s, %d waiting: rate %s -> %s records/s",
                records,
                elapsed,
                waiting,
                self._rate,
                proposal,
            )
            self._apply(self._clamp(check_rate(proposal)))

    def update(self, rate: float, *, pin: bool = False) -> None:
        """An operator sets the rate (InvalidRateError if it is not one; nothing changes then)."""
        rate = self._clamp(check_rate(rate))
        self.pinned = pin
        self._apply(rate)

    def set_bounds(self, min_rate: float, max_rate: float) -> None:
        """New bounds (ValueError if invalid; nothing changes then); the rate is clamped into them."""
        bounds = RateBounds(min_rate, max_rate)
        self._bounds = bounds
        self.estimator.set_bounds(bounds)
        self._apply(self._clamp(self._rate))

    def set_estimator(self, name: str) -> None:
        """Switch estimator (UnknownEstimatorError if unknown); it starts from the current rate; unpins."""
        # mid-run, the next batch is a normal one: only a query's first batch carries start-up cost
        gains = {"warmup_batches": 0} if name == "model" and self.last_batch is not None else {}
        self.estimator = make_estimator(name, bounds=self._bounds, initial_rate=self._rate, **gains)
        self.pinned = False

    def _clamp(self, rate: float) -> float:
        return min(self._bounds.max_rate, max(self._bounds.min_rate, rate))

    def _apply(self, rate: float) -> None:
        if rate != self._rate:
            log.debug("rate %s -> %s records/s", self._rate, rate)
        self._rate = rate
        share = rate / len(self._receivers)
        for receiver in self._receivers.values():
            receiver.set_rate(share)
