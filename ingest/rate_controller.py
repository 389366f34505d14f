"""The control loop's one place: batch metrics in, the ingest rate out to every receiver.

The estimator (ratecontrol) proposes a rate after each completed micro-batch; an operator may set or pin
one through RateControl. Both go through `update`'s validation and the same clamping into the bounds, and
end in Receiver.set_rate, which meters credit: so the rate throttles the clients, not a buffer.

The rate covers all streams the query reads. It is split among the streams' receivers by what each can
use (ratecontrol.share: weighted water-filling): a stream whose publishers run out of credit the rate
withholds is busy and shares by its weight, one that takes less gets what it took with room to grow, an
idle one keeps a floor to ramp from. The server re-splits every WATCHDOG_TICK (`resplit`), so a stream
that gets busy has its share back within a tick or two; operators set weights and per-stream bounds.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping

from ingest.config import RateConfig
from ratecontrol import (
    MAX_RATE,
    BatchMetrics,
    Demand,
    RateBounds,
    RateEstimator,
    Share,
    StreamPolicy,
    capped,
    check_rate,
    make_estimator,
    split_rate,
)
from receivers.config import MAX_RECORDS
from receivers.receiver import Receiver

log = logging.getLogger(__name__)


STARTUP_BATCHES = 2
"""Batches of a fresh query the model estimator does not fit."""

RECALLED_INTERVALS = 2.0
"""An unmeasured batch takes at most this many trigger intervals of a capacity remembered from an
earlier run of the same pipeline (ingest.rate_memory): room for a pipeline that got faster."""
LOADED_SHARE = 0.5
"""The capacity is handed on to be remembered only after a batch that kept the pipeline busy for at
least this share of its interval: under a light load it is an extrapolation from small batches (the
built-in sink read 8k records/s that way, a hundredth of the truth), and a restart bounded by it would
catch up on a backlog slowly."""

WATCHDOG_TICK = 0.1
"""Seconds between looks at a running batch (check_overrun), as the server calls it."""

MAX_BATCH_WAIT = 10.0
"""Longest wait for a running batch's metrics that a caller of wait_for_batch may ask for."""

PAST_GRID = 0.05
"""Seconds past the trigger grid point after a batch's start from which the next trigger is known to
have come at the batch's end (Spark triggers at once after a batch that ran past its grid point)."""

BUSY_WITHIN = 0.3
"""Seconds since a stream's publishers last ran out of credit the rate withheld, within which it counts
as busy: a saturating publisher runs out every credit tick (0.05 s), so a few ticks of slack."""

INTAKE_SECONDS = 0.5
"""Time constant of the records/s a stream took, as the split sees it (an exponential average)."""

RECENT_BATCHES = 300
"""Completed batches kept for the status page (recent_batches)."""

WATCHES = 4
"""Most started batches kept while their metrics are on the way (none arrive without a listener)."""


@dataclasses.dataclass
class _Watch:
    """A batch the source started, until its metrics arrive."""

    records: int
    started: float  # time.monotonic()
    started_wall: float  # time.time(), against Spark's trigger grid
    backlog: int  # records there beyond it when it started
    taken: int  # records the receivers had taken by then
    taken_at_end: int | None = None  # ... by the time the source planned the next batch


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
        # batches the source started whose metrics have not arrived, oldest first; the last one runs
        # unless the source has planned the next batch since (taken_at_end set)
        self._watches: list[_Watch] = []
        self._completed = asyncio.Event()  # set while no reported batch awaits its completion
        self._completed.set()
        # whether completions arrive at all (a listener is wired and keeps up): waits are skipped
        # from a wait that timed out until the next completion
        self._completions_arrive = False
        self._bounds = RateBounds(config.min_rate, config.max_rate)
        self._rate = self._clamp(check_rate(config.initial_rate))
        # a fresh query's first batch pays ~10 s of worker start-up and the second is still slow (seen
        # here: 1,000 records in 2 s, read as 2 ms a record); fitting either collapses the rate
        gains: dict[str, float] = {"warmup_batches": STARTUP_BATCHES} if config.estimator == "model" else {}
        gains.update(config.estimator_params)
        self.estimator: RateEstimator = make_estimator(
            config.estimator, bounds=self._bounds, initial_rate=self._rate, **gains
        )
        self.pinned = False
        self._recalled: float | None = None
        self.on_capacity: Callable[[float], None] | None = None
        """Called with the estimator's capacity after each batch it measured (ingest.rate_memory)."""
        self.last_batch: BatchMetrics | None = None
        self.recent_batches: collections.deque[tuple[float, BatchMetrics]] = collections.deque(
            maxlen=RECENT_BATCHES
        )
        """The last completed batches, with when their metrics arrived (epoch s): the status page's."""
        self._all_policies = dict(config.stream_policies)
        self._policies = {s: p for s, p in config.stream_policies.items() if s in receivers}
        self._warmup = 0  # batches of a restarted query not fed to the estimator (query_started)
        self._demands = {stream: Demand(busy=False) for stream in receivers}
        self._shares: dict[str, Share] = {}
        self._intake: dict[str, tuple[float, int]] = {}  # stream -> (when, records taken by then)
        self._full_unmeasured = False  # unlimited and unmeasured, what waits fills the next batch
        # records taken (_taken()) when a query attached that has planned no batch yet: all taken since
        # waits for its first batch (attach_query); None once it planned one
        self._unplanned_from: int | None = None
        self._held = False  # whether the receivers grant no credit for now (_sync_hold)
        self._apply(self._rate)

    @property
    def rate(self) -> float:
        return self._rate

    @property
    def bounds(self) -> RateBounds:
        return self._bounds

    def stream_rates(self) -> dict[str, float]:
        return {stream: receiver.rate for stream, receiver in self._receivers.items()}

    def stream_shares(self) -> dict[str, tuple[Share, Demand, StreamPolicy]]:
        """Stream -> its share of the rate and why, the demand it was split by, the operator's policy."""
        return {
            stream: (share, self._demands[stream], self._policies.get(stream, StreamPolicy()))
            for stream, share in self._shares.items()
        }

    def resplit(self, now: float | None = None) -> None:
        """Split the rate again by each stream's demand now: whether its publishers ran out of credit the
        rate withheld lately, and the records/s it took (`now`: time.monotonic()). On a short timer."""
        now = time.monotonic() if now is None else now
        for stream, receiver in self._receivers.items():
            taken = receiver.stats.records_received
            when, before = self._intake.get(stream, (now, taken))
            self._intake[stream] = (now, taken)
            rate = self._demands[stream].taken
            if now > when:
                weight = 1 - math.exp(-(now - when) / INTAKE_SECONDS)
                rate += weight * ((taken - before) / (now - when) - rate)
            self._demands[stream] = Demand(receiver.credit_starved(BUSY_WITHIN), max(0.0, rate))
        self._split()

    def _split(self) -> None:
        self._shares = split_rate(self._rate, self._demands, self._policies)
        for stream, share in self._shares.items():
            receiver = self._receivers[stream]
            if receiver.rate != share.rate:
                receiver.set_rate(share.rate)

    def set_batch_interval(self, seconds: float) -> None:
        """The query's trigger interval changed (ValueError unless finite and > 0)."""
        if not 0 < seconds < math.inf:
            raise ValueError(f"batch interval must be > 0 and finite, got {seconds}")
        self._batch_interval = seconds

    def streams_changed(self) -> None:
        """The receivers' streams changed (Admin.AddStream/RemoveStream): split the rate over the new set."""
        self._policies = {s: p for s, p in self._all_policies.items() if s in self._receivers}
        self._demands = {s: self._demands.get(s, Demand(busy=False)) for s in self._receivers}
        self._intake = {s: v for s, v in self._intake.items() if s in self._receivers}
        self._split()

    def attach_query(self) -> None:
        """A Spark query plans batches from these receivers (ingest.driver.drive_rate). Until it plans
        its first (its start: the first trigger, its Python workers), everything taken waits for that
        batch, which takes at most the unmeasured bound: intake is held once that much waits, as while
        an unmeasured batch runs. A saturating publisher otherwise filled the log before the first
        batch: 7.3M records, 80 s of a 90k records/s pipeline, each batch ever later."""
        self._unplanned_from = self._taken()

    def query_started(self, warmup_batches: int = STARTUP_BATCHES) -> None:
        """A new query took over (a pipeline swap, a new trigger interval): its first batches pay the
        start-up of a fresh query (workers, plans) and are not the pipeline's capacity, so they are not
        fed to the estimator; the rate holds meanwhile."""
        self._warmup = warmup_batches
        self._watches.clear()  # the old query's batches will never report
        self._completed.set()
        self._full_unmeasured = False
        self._sync_hold()

    def credit_paused(self) -> dict[str, list[str]]:
        """Stream -> why its credit is paused now (sorted reasons: see receivers.receiver.PAUSE_REASONS)."""
        return {stream: sorted(receiver.paused) for stream, receiver in self._receivers.items()}

    def on_batch(self, batch: BatchMetrics) -> None:
        """A micro-batch completed: let the estimator propose a rate (ignored while pinned)."""
        # an empty batch (Spark reports some while idle) is none the source started: it ends no watch
        if batch.records > 0:
            watch = self._reported(batch.records)
            if watch is not None and batch.waiting is None:
                batch = dataclasses.replace(batch, waiting=max(0, self._waiting(watch)))
            self._completions_arrive = True
            if not self._watches:
                self._completed.set()
        self.last_batch = batch
        self.recent_batches.append((time.time(), batch))
        if self._warmup > 0 and batch.records > 0:
            self._warmup -= 1
            log.debug("batch %s of a restarted query: start-up, not fed to the estimator", batch)
            return
        self._full_unmeasured = False  # a batch completed: the next one can take what waits
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
            self._apply(self._clamp(check_rate(capped(proposal))))
        self._sync_hold()
        capacity = self.estimator.capacity
        loaded = batch.processing_delay >= LOADED_SHARE * batch.batch_interval
        if self.on_capacity is not None and loaded and capacity is not None:
            self.on_capacity(capacity)  # RateMemory.remember keeps only a positive, finite one

    def recall(self, capacity: float | None) -> None:
        """A capacity (records/s) the pipeline showed in an earlier run: until this run measures one,
        it bounds unmeasured batches (unmeasured_batch_records); None forgets it."""
        self._recalled = capacity if capacity is not None and 0 < capacity <= MAX_RATE else None

    def unmeasured_batch_records(self) -> int:
        """While the rate is unlimited and the estimator has measured nothing (no capacity; `fixed`
        excepted: an operator's unlimited rate is unbounded on purpose), the most records a batch may
        take: what the receivers may hold in memory, or less when a capacity was recalled (RECALLED_
        INTERVALS x it x the trigger interval) (RateStatus.unmeasured_batch_records); else 0."""
        estimator = self.estimator
        if math.isinf(self._rate) and not estimator.capacity and estimator.name != "fixed":
            memory = sum(r.config.buffer_records for r in self._receivers.values())
            if self._recalled is None:
                return memory
            return max(1, min(memory, math.ceil(RECALLED_INTERVALS * self._recalled * self._batch_interval)))
        return 0

    def _sync_hold(self) -> None:
        """Receivers grant no credit while the estimator holds intake (RateEstimator.intake_held) or,
        unmeasured, what waits already fills the next batch (more would only wait); never pinned."""
        held = not self.pinned and (self.estimator.intake_held or self._full_unmeasured)
        if held == self._held:
            return
        self._held = held
        log.debug("intake %s", "held" if held else "no longer held")
        for receiver in self._receivers.values():
            receiver.hold_credit(held)

    def _reported(self, records: int) -> _Watch | None:
        """The watch of the batch whose metrics arrived: the oldest with its record count (those before
        it were never reported: a query restarted mid-batch), or None if no watch matches."""
        for i, watch in enumerate(self._watches):
            if watch.records == records:
                del self._watches[: i + 1]
                return watch
        return None

    def batch_started(self, records: int, backlog: int = 0, now: float | None = None) -> None:
        """The source planned a batch of `records` (ValueError unless 1..MAX_RECORDS), with `backlog`
        records (ValueError unless 0..MAX_RECORDS) there beyond it, and runs it from `now`
        (time.monotonic()). The bound: StartBatch(records=2**63-1, backlog=2**63-1) was taken, and once
        a batch of its count completed, the records waiting (backlog + taken since) passed int64, and
        every GetRate (the source's too) failed UNKNOWN "Value out of range" while it was the last."""
        if not 0 < records <= MAX_RECORDS:
            raise ValueError(f"a started batch has records > 0 and at most {MAX_RECORDS:,}, got {records:,}")
        if not 0 <= backlog <= MAX_RECORDS:
            raise ValueError(f"backlog must be >= 0 and at most {MAX_RECORDS:,} records, got {backlog:,}")
        now = time.monotonic() if now is None else now
        taken = self._taken()
        for watch in self._watches:
            if watch.taken_at_end is None:
                watch.taken_at_end = taken  # a next batch was planned: this one has ended
        self._watches.append(_Watch(records, now, time.time() - (time.monotonic() - now), backlog, taken))
        del self._watches[:-WATCHES]
        self._unplanned_from = None
        self._completed.clear()

    async def wait_for_batch(self, timeout: float) -> None:
        """Until the batches reported by batch_started have completed (their metrics went through
        on_batch), at most `timeout` seconds (ValueError unless finite, >= 0 and <= MAX_BATCH_WAIT).

        The source asks this as it plans the next batch, so the running batch has ended: its metrics
        are on their way through Spark's listener (50-90 ms under load here), and a cap read before they
        arrive would follow the batch before last. Not waited for, though, when the batch ran past the
        trigger grid point after its start (by PAST_GRID) for at least half an interval: Spark then plans
        the next batch at once, so the time since the batch started is its time, to the milliseconds,
        and the watchdog takes a last look with it (a slower batch lowers the cap now); the metrics
        follow into the fit. Does not wait while completions do not arrive (no listener wired, or the
        last wait timed out) until one does.
        """
        if not (math.isfinite(timeout) and 0 <= timeout <= MAX_BATCH_WAIT):
            raise ValueError(f"a wait for a batch must be in [0, {MAX_BATCH_WAIT:g}] seconds, got {timeout}")
        # a batch before the one that just ended had a whole batch's time to be reported: lost
        del self._watches[:-1]
        if self._watches and self._watches[-1].taken_at_end is None:
            watch = self._watches[-1]
            now, wall = time.monotonic(), time.time()
            watch.taken_at_end = self._taken()
            interval = self._batch_interval
            grid = watch.started_wall - watch.started_wall % interval + interval if interval > 0 else math.inf
            if wall > grid + PAST_GRID and now - watch.started >= 0.5 * interval:
                self._look(watch, now - watch.started)
                return
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

    def _waiting(self, watch: _Watch) -> int:
        """Records waiting for batches after `watch`'s, counted: left behind at its start plus taken
        since, up to when the source planned the next batch if it has (that batch takes from there)."""
        taken = self._taken() if watch.taken_at_end is None else watch.taken_at_end
        return watch.backlog + taken - watch.taken

    def check_overrun(self, now: float | None = None) -> None:
        """The watchdog: while the running batch overruns its interval, let the estimator lower the
        rate at once rather than when the batch completes (records keep arriving at the old rate
        meanwhile, and each of them waits for a slower pipeline); and end a pause the estimator
        planned for a point in the running batch (RateEstimator.resume). Ignored while pinned."""
        if not self._watches:
            if self._unplanned_from is not None:  # the query is yet to plan its first batch
                self._full_unmeasured = self._fills_unmeasured(self._taken() - self._unplanned_from)
                self._sync_hold()
            return
        if self._watches[-1].taken_at_end is not None:
            return  # it has ended and its metrics are on their way
        watch = self._watches[-1]
        elapsed = (time.monotonic() if now is None else now) - watch.started
        self._full_unmeasured = self._fills_unmeasured(self._waiting(watch))
        if not self.pinned:
            resumed = self.estimator.resume(elapsed)
            if resumed is not None:
                log.debug(
                    "batch of %d records at %.2f s: intake resumes at %s records/s",
                    watch.records,
                    elapsed,
                    resumed,
                )
                self._apply(self._clamp(check_rate(capped(resumed))))
        self._look(watch, elapsed)
        self._sync_hold()

    def _fills_unmeasured(self, waiting: int) -> bool:
        """Whether `waiting` records fill the next unmeasured batch: unlimited from the first record,
        but no more than that batch will take (more would only wait); a saturating publisher otherwise
        fills the store for as long as start-up batches last."""
        bound = self.unmeasured_batch_records()
        return bool(bound) and waiting >= bound

    def drain_batch_records(self) -> int:
        """Records the next batch may take while the estimator drains a pile-up, when that is more
        than max(rate, capacity) x interval (RateEstimator.batch_cap); 0 otherwise."""
        interval = self._batch_interval
        cap = self.estimator.batch_cap(interval)
        usual = max(self._rate, self.estimator.capacity or 0.0) * interval
        if self._watches:
            # what waits behind the latest batch: a pile-up while it ran, unless it took from a
            # backlog left before it (a start's burst, a restart), which drains as usual
            watch = self._watches[-1]
            # (not capped at the count of what waits: records taken between the source's planning and
            # its StartBatch are in neither count, and the newest of the pile went to the batch after)
            cap = usual if watch.backlog > usual else cap
        if not (math.isfinite(cap) and cap > usual):
            return 0
        return int(cap)

    def _look(self, watch: _Watch, elapsed: float) -> None:
        if self.pinned:
            return
        waiting = self._waiting(watch)
        proposal = self.estimator.overrun(watch.records, elapsed, self._batch_interval, waiting)
        if proposal is not None:
            # DEBUG, as the estimator's per-batch changes: under a lasting overload this is every batch
            log.debug(
                "batch of %d records still running after %.2f s, %d waiting: rate %s -> %s records/s",
                watch.records,
                elapsed,
                waiting,
                self._rate,
                proposal,
            )
            self._apply(self._clamp(check_rate(capped(proposal))))

    def clamped(self, rate: float) -> float:
        """The rate `update(rate)` would set (InvalidRateError if it is not one), nothing changed."""
        return self._clamp(check_rate(rate))

    def update(self, rate: float, *, pin: bool = False) -> None:
        """An operator sets the rate (InvalidRateError if it is not one; nothing changes then)."""
        rate = self._clamp(check_rate(rate))
        self.pinned = pin
        self.estimator.adopt(rate)
        self._apply(rate)
        self._sync_hold()

    def set_bounds(self, min_rate: float, max_rate: float) -> None:
        """New bounds (ValueError if invalid; nothing changes then); the rate is clamped into them."""
        bounds = RateBounds(min_rate, max_rate)
        self._bounds = bounds
        self.estimator.set_bounds(bounds)
        self._apply(self._clamp(self._rate))

    def set_estimator(self, name: str, params: Mapping[str, float] | None = None) -> None:
        """Switch estimator, with its own parameters (UnknownEstimatorError if unknown, ValueError for a
        bad parameter: nothing changes then); it starts from the current rate; unpins."""
        # mid-run, the next batch is a normal one: only a query's first batch carries start-up cost
        restarted = name == "model" and self.last_batch is not None
        gains: dict[str, float] = {"warmup_batches": 0} if restarted else {}
        gains.update(params or {})
        self.estimator = make_estimator(name, bounds=self._bounds, initial_rate=self._rate, **gains)
        self.pinned = False
        self._sync_hold()

    def _clamp(self, rate: float) -> float:
        return min(self._bounds.max_rate, max(self._bounds.min_rate, rate))

    def _apply(self, rate: float) -> None:
        if rate != self._rate:
            log.debug("rate %s -> %s records/s", self._rate, rate)
        self._rate = rate
        self._split()
