"""The default estimator ("model"): fit what a batch costs, then admit what the pipeline can process.

Spark's PID reads capacity as n / processing_delay and backlog only as delay (DESIGN.md, "Control
loop"). Both mislead it: a batch carries a fixed cost, so small batches look slow and the loop climbs
back from minRate by small steps; and its integral term asks for the whole backlog to go in one
interval, which from a 5 s delay on (with Ki = 0.2) is a negative rate, so it starves at minRate. This
estimator instead:

1. Models the cost of a batch as `processing_delay = a + b * records` (fixed cost a per batch, cost b
   per record), fitted online by weighted least squares over recent batches; a batch's weight decays by
   `forgetting` per later batch, so the fit follows a pipeline whose cost changes. When all recent
   batches had about the same size (or their spread explains less of the times than the noise does) the
   two costs cannot be told apart; a weak prior on the fixed cost (the last fixed cost that was
   identifiable, at first `prior_fixed_cost` x interval) then keeps `a` and puts the rest of the time
   on `b`, which still predicts batches of that size exactly. Where sizes varied but the times did not
   follow beyond their noise (fixed-cost dominated batches on a loaded machine), `b` is at most what
   that spread could hide in the noise and `a` the rest ("bounded"), whatever the prior guessed.
2. Capacity is what a batch per period can hold: `capacity = (period - a) / (b * period)` records/s,
   and never less than records / seconds of the batch just done if it took at most about a period (it
   proved that much, whatever the fit says); steady state runs at `target_utilisation` x capacity, not
   biased by batch size. The period is the interval, unless the fixed cost takes more than
   `max_fixed_share` of it: then a batch is planned to take a / (1 - max_fixed_share) (Spark starts
   the next at once), so a fixed cost over the interval (1 s against a 0.5 s trigger on a loaded
   machine) still leaves room for records, where one interval had none (capacity 0: batches at the
   floor). The `capacity` an estimator reports for the source's cap is per interval: x period / interval.
3. Backlog is counted in records. Where records wait in a queue that batches take from (Sluice's
   store), the controller counts what waits when a batch completes (`BatchMetrics.waiting`), whatever
   the rate did meanwhile: what the next batch, at capacity, cannot take is backlog. Otherwise it is
   estimated: what the batch left behind (`BatchMetrics.backlog`, or, when unknown, its lateness x the
   rate in force), grown by what arrived while the batch overran its interval.
   Its cost in seconds (per record, plus the fixed cost of the batches it sits in) is paid off over
   `horizon` intervals: rate = target - backlog_cost / (horizon * b * interval).
4. The rate never goes under `floor_fraction` x capacity (unless the bounds force it): while a backlog
   drains the pipeline stays busy, and no batch is starved to minRate. Where the backlog is counted in
   the queue, the batches after the next one hold it before anything that comes in now, so the floor
   is lower by backlog / interval: intake may pause while they are full anyway.
5. The first `warmup_batches` batches carry worker start-up (~10 s for a fresh query) and are not
   fitted; their throughput is a lower bound, so they may raise the rate (within the caps of 6), never
   lower it. Later, a batch whose processing time is off the fit by more than `change_threshold` is an
   outlier and weighs little in the fit (judged by a fit anchored on the prior only near the batch
   sizes it was fitted on: further away the prior is a guess, and such a batch is what corrects it).
   The next rate believes it when it was faster (the caps of 6 bound the risk) or when the watchdog saw
   it overrun (a cost change that lands mid-batch shows only part of the new cost anyway); a slower one
   alone may be a pause (GC), and the rate goes halfway to it, geometrically. A second one in a row,
   off in the same direction, means the cost changed: the fit restarts from that batch (the first
   one likely straddled the change), anchored on the last fixed cost until sizes vary.
6. A linear fit is only trusted near its data. Whatever the fit, no batch may take more than
   `max_stretch` intervals even if a recent batch's whole time were per-record cost (no fixed cost, the
   worst case for extrapolating up): the rate never exceeds max_stretch x max(records / seconds) over
   recent batches, nor `max_growth` x the largest of them per interval. So an under-determined fit
   cannot overshoot far, while a pipeline found much faster than the first guess is reached in a batch
   or two (a 10k-record batch done in 0.35 s allows ~43k records/s next). These caps win over the floor:
   when clients send little, the rate follows their load up by at most that much per batch. A bounded
   fit (1) extrapolates a per-record cost that may be far under the truth: its capacity is capped so.
7. A watchdog (`overrun`): while a batch runs past its interval and past its predicted time by more
   than `overrun_threshold`, it has already shown a per-record cost of at least (elapsed - a) / records.
   That lower bound caps capacity and the rate at once, before the batch completes: after a cost
   change the records that would keep arriving at the old rate meanwhile each wait for the slower
   pipeline (in simulation this takes 0.1-0.4 s off the peak delay of a doubled cost). And once the
   records waiting beyond the running batch fill the next one (`waiting` >= capacity x interval, the
   capacity that bound allows), intake pauses (min rate) until the batch completes: more would only
   queue, while the next batch is full anyway.

8. A batch far below the operating point (records x `max_growth` under the larger of the rate in
   force and the capacity, per interval: a batch that could not have lifted the rate to where it is)
   is mostly fixed cost and its noise; a per-record cost read from it is that noise divided by a handful
   of records (three single-record batches on a loaded machine once read 1.2 records/s of capacity).
   Such a batch is not fitted, not judged an outlier and proposes no rate: it only bounds capacity
   from below (records / seconds, if done within about an interval). Nor does the watchdog read a
   per-record cost from one that overruns (7).

9. Batches alike carry no news of how their time splits, and held alike they never will: at the floor
   (min rate x interval, e.g. after a restart with a backlog) an anchored fit on a low prior reads
   their time as per-record cost and keeps them there. So while records wait beyond the next batch and
   the fit is anchored, the next may try `max_stretch` x the records (at most that many times as long
   if all were per-record cost), and is not cut on the prior's guess until a fit tells the costs apart:
   a tried batch that took about as long is tried larger again, one that took longer is held, a second
   in a row that took longer ends it (`_probe`). Not after a batch far slower than the others.

10. (See `_drain_plan`: what piles up behind an overrun goes in the next batch at once, with a batch
   at capacity to spare: the pile's count misses what was taken before the overrunning batch's
   StartBatch.) Within the window of such a rise, a batch far faster than the fit lifts capacity to
   at most 1.25x what it was before the rise (`_within_before_rise`), unless it processed more itself.

11. A cost that jumps by J at the very start of a batch admitted at a share u of capacity makes it
   take a + J (u period - a): the next starts J u - 1 intervals late where the fixed cost a is small,
   whatever a controller does after. So the rate admits at most the share of capacity that a jump of
   `jump_tolerance` (4) keeps within `jump_lateness` (1.8) intervals late, under the fixed cost fitted
   (with a 0.24 s fixed cost at 1 s batches 84%, with none 70%, with 0.4 s all: the price in
   throughput is paid where a jump would hurt most; a fixed cost only guessed, never measured, counts
   as none once the start's ramp is past), and so does the source's cap for the batch after
   one that ran slower than the fit by `overrun_threshold` (a jump late in it shows only in part).
   When the cost falls back (a batch far faster than the fit, or far closer to the fit before the
   rise than to it, and within change_threshold of what that fit predicts), it applies again at
   once: the batches right after a rise are small, mostly fixed cost, and read alone they recovered
   the rate over 4 batches, starving them.

Until a first batch has been fitted it proposes no rate but a warm-up batch's raise (5): the initial
rate stays in force.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ratecontrol.batch import BatchMetrics
from ratecontrol.estimator import DEFAULT_BOUNDS, RateBounds, RateEstimator, StateValue, register

_RIDGE = 0.05
"""Weight of the fixed-cost prior, in batches: pins a degenerate fit, too light to bias a real one."""
_DATA_RIDGE = 2.0
_FEW_POINTS = 4
"""The prior's weight while a fit has fewer than _FEW_POINTS batches and the prior is a fixed cost
fitted from data: two batches of a fresh fit (after a cost change) cannot outvote it. Seen here: two
batches 0.56 s apart in time and 24k in size, with ~0.1 s of noise each, fitted a fixed cost of 0.77 s
against the 0.23 s of the 20 before, which read capacity as a third of the truth."""
_NEAR_SIZE = 0.25
"""A batch within this share of the fitted batches' mean size is predicted well by any fit of them."""
_SIGNAL_TO_NOISE = 2.0
"""A fit tells the two costs apart only where the time the sizes' spread explains is this many times
the fit's residual noise."""
_SHOWN_WITHIN = 1.05
"""A batch done within this many intervals shows a capacity of at least its records / seconds: exact
up to the interval (the fixed cost makes smaller batches slower per record), <= 5% over it beyond."""
_SURPRISE_NOISE = 3.0
"""A batch is off the fit only if it is off by this many times the fit's noise as well."""
_PER_RECORD_SHOWN = 0.5
"""A tried larger batch shows per-record cost when it took at least this share of the time it would
have added were all of the smaller batch's time per record."""
_OUTLIER_WEIGHT = 0.1
_CLOSER = 0.25
"""A batch this many times as far from one fit as from another is judged by the other."""
_GUESS_BATCHES = 4
"""Batches after the warm-up during which a fixed cost that is a guess still sizes the jump share (11)."""
_IDENTIFIABLE_CV = 0.1
"""Batch sizes must vary by this coefficient of variation before the fit's fixed cost is believed."""
_MIN_PER_RECORD_COST = 1e-12
_WATCHED_HOLD = 0.5
"""Intervals into a drain batch that follows a batch the watchdog saw overrun during which intake is
held anyway (10): a batch that overran by a cost rise late in it tells little of the new cost."""


@dataclass
class _Point:
    records: int
    seconds: float
    weight: float
    outlier: bool = False


@register
class ModelEstimator(RateEstimator):
    """Fixed + per-record cost model, capacity at a target utilisation, backlog drained over a horizon."""

    name = "model"

    def __init__(
        self,
        *,
        bounds: RateBounds = DEFAULT_BOUNDS,
        initial_rate: float,
        target_utilisation: float = 0.97,
        horizon: float = 4.0,
        forgetting: float = 0.8,
        floor_fraction: float = 0.5,
        warmup_batches: int = 1,
        max_growth: float = 8.0,
        max_stretch: float = 1.5,
        overrun_threshold: float = 0.1,
        change_threshold: float = 0.25,
        prior_fixed_cost: float = 0.25,
        max_fixed_share: float = 0.5,
        window: int = 16,
        max_drain: float = 4.0,
        drain_lateness: float = 1.0,
        jump_tolerance: float = 4.0,
        jump_lateness: float = 1.8,
    ) -> None:
        """
        Args:
            target_utilisation: share of capacity admitted in steady state (0 < u <= 1); the rest is slack
                for noise. 0.97 keeps >= 90% utilisation through transients (0.95 left too little on
                this machine's bench, where noise is ~5% of a batch).
            horizon: intervals over which a backlog is drained (>= 1). Longer is gentler and keeps the
                rate higher while draining; 4 clears a few seconds of delay in about as many batches.
            forgetting: per-batch decay of an old batch's weight in the fit (0 < f < 1); 0.8 remembers
                about 5 batches.
            floor_fraction: the rate never goes under this share of estimated capacity (0 <= f <= 1), so
                no batch is starved. The price: while batches formed earlier queue up (a Spark receiver),
                a lower floor would clear them sooner at the same long-run throughput.
            warmup_batches: first batches not fitted (start-up); 0 when switching estimators mid-run.
            max_growth: the rate never exceeds this multiple of the largest recent batch per interval.
            max_stretch: the rate never exceeds this multiple of the fastest throughput (records per
                second of processing) a recent batch showed: the intervals the next batch may take if the
                whole cost were per record (> 1).
            change_threshold: relative error of the fit beyond which a batch is an outlier.
            prior_fixed_cost: fixed cost per batch assumed before it can be fitted, as a share of the
                interval (0 <= p < 1); a low prior errs on the safe side (capacity underestimated).
            max_fixed_share: the largest share of a batch's time planned for its fixed cost (0 < s < 1).
                Where the fixed cost is more than that share of the interval, batches are planned to
                take fixed cost / (1 - s) (Spark starts the next at once) rather than one interval, in
                which ever fewer records fit: 0.5 spends at least half of each batch on records.
            window: most batches kept for the fit (>= 2).
            max_drain: after a batch the watchdog saw overrun (a cost rise), the next batches may take
                all that waits, up to what they process in this many intervals (>= 1), until a batch
                finds no more waiting than a normal one holds (10).
            drain_lateness: while draining, intake is paced (paused first if need be) so that the
                batch after the next one starts at most this many intervals late (>= 0) (10).
            jump_tolerance: a batch holds at most what keeps the next one within `jump_lateness`
                intervals late even if the per-record cost jumps by this factor (>= 1; 1 = no such
                bound) as the batch starts (11).
            jump_lateness: see jump_tolerance (> 0); under 2 by a margin for the noise of batch times.
        """
        super().__init__(bounds=bounds, initial_rate=initial_rate)
        _check_range("target_utilisation", target_utilisation, 0, 1, low_open=True)
        _check_range("horizon", horizon, 1, math.inf, high_open=True)
        _check_range("forgetting", forgetting, 0, 1, low_open=True, high_open=True)
        _check_range("floor_fraction", floor_fraction, 0, 1)
        _check_range("max_growth", max_growth, 1, math.inf, high_open=True)
        _check_range("overrun_threshold", overrun_threshold, 0, math.inf, high_open=True)
        _check_range("max_stretch", max_stretch, 1, math.inf, low_open=True, high_open=True)
        _check_range("change_threshold", change_threshold, 0, math.inf, low_open=True, high_open=True)
        _check_range("prior_fixed_cost", prior_fixed_cost, 0, 1, high_open=True)
        _check_range("max_fixed_share", max_fixed_share, 0, 1, low_open=True, high_open=True)
        _check_range("warmup_batches", warmup_batches, 0, math.inf, high_open=True, whole=True)
        _check_range("window", window, 2, math.inf, high_open=True, whole=True)
        _check_range("max_drain", max_drain, 1, math.inf, high_open=True)
        _check_range("drain_lateness", drain_lateness, 0, math.inf, high_open=True)
        _check_range("jump_tolerance", jump_tolerance, 1, math.inf, high_open=True)
        _check_range("jump_lateness", jump_lateness, 0, math.inf, low_open=True, high_open=True)
        self.target_utilisation = target_utilisation
        self.horizon = horizon
        self.forgetting = forgetting
        self.floor_fraction = floor_fraction
        self.warmup_batches = int(warmup_batches)
        self.max_growth = max_growth
        self.max_stretch = max_stretch
        self.overrun_threshold = overrun_threshold
        self.change_threshold = change_threshold
        self.prior_fixed_cost = prior_fixed_cost
        self.max_fixed_share = max_fixed_share
        self.window = int(window)
        self.max_drain = max_drain
        self.drain_lateness = drain_lateness
        self.jump_tolerance = jump_tolerance
        self.jump_lateness = jump_lateness

        self._init_state()

    def _init_state(self) -> None:
        self._points: list[_Point] = []
        self._suspect_sign = 0  # sign of the previous batch's outlying error, 0 if it fitted
        self._prior_a = 0.0  # seconds, set from prior_fixed_cost once the first batch gives the interval
        self._prior_from_data = False  # whether _prior_a is a fitted fixed cost rather than the guess
        self._batches = 0
        self._latest_time = -math.inf
        self._last_fitted: tuple[int, float] | None = None  # (records, seconds) of the latest fitted batch
        self._changes = 0
        self._overruns = 0
        self._small_batches = 0  # batches far below the operating point: not fitted (8)
        self._probes = 0  # batches let grow to tell the costs apart (9)
        self._probed: tuple[int, float] | None = None  # (records, seconds) of the batch a probe grew
        self._probing = False
        self._shown = 0  # probes in a row that took longer, as per-record cost would
        self._proposed: float | None = None  # the latest rate _estimate proposed
        self._watched: float | None = None  # how long the running batch was seen running, when the
        # watchdog found it slower than the fit: a lower bound on its time
        # the latest fit and what was derived from it, for state()
        self._a: float | None = None
        self._b: float | None = None
        self._fit = "none"  # "anchored": fixed cost from the prior; "fitted": both costs from data;
        # "bounded": the per-record cost at most what the sizes' spread can hide in the noise
        self._capacity: float | None = None  # records/s, with a batch every _period seconds
        self._interval = 1.0  # the trigger interval of the latest batch
        self._period = 1.0  # seconds a batch is planned to take: the interval, or more (2)
        self._backlog: float | None = None
        self._drain_seconds: float | None = None
        self._draining = False  # the next batch may take all that waits, up to max_drain (10)
        self._drain_take: float | None = None  # ... namely this many records, once a completion said
        self._paused_until: tuple[float, float] | None = None  # (elapsed into the next batch, rate)
        self._pauses = 0
        self._held = False  # intake takes nothing until the next completion or a planned resume
        self._risen = 0  # batches left within which a fall of the cost is believed at once
        self._slower = False  # the latest batch, not the one before, took over (1 + overrun_threshold)
        # x the fit's prediction
        self._was_slower = False  # the latest batch did
        self._before_rise: tuple[float, float, list[_Point]] | None = None  # the fit before it: a, b
        # and its batches

    @property
    def capacity(self) -> float | None:
        """Records per trigger interval a batch may hold (the source caps a batch at this x interval):
        the records/s the pipeline processes, scaled by period / interval where its fixed cost makes a
        batch take longer than the interval (2)."""
        if self._capacity is None:
            return None
        return self._capacity * self._cap_share() * self._period / self._interval

    def _cap_share(self) -> float:
        """The share of capacity the source lets the next batch hold: all of it, unless the batch
        just done was slower than the fit, which a cost jump that landed late in it shows only in
        part: then no more than a jump allows (11), whatever piled up meanwhile. Slower by more than
        overrun_threshold, as the watchdog judges: a jump late in a batch may add less than
        change_threshold to it. Not after a second slower batch in a row: that one ran at the new
        cost throughout, and capped, the pile behind the first aged in batches at the cap."""
        return self._jump_share() if self._slower else 1.0

    def _estimate(self, batch: BatchMetrics) -> float | None:
        if batch.completed_at <= self._latest_time:
            return None  # a stale or repeated event
        self._latest_time = batch.completed_at
        self._batches += 1
        self._paused_until, self._held = None, False  # a hold planned for the batch just done ends
        self._risen = max(0, self._risen - 1)
        watched, self._watched = self._watched, None
        interval = batch.batch_interval
        if self._batches == 1:
            self._prior_a = self.prior_fixed_cost * interval
            self._period = self._interval = interval
        if batch.records == 0 or batch.processing_delay == 0:
            return None  # nothing measured
        if self._batches <= self.warmup_batches:
            return self._warm_up(batch)
        if batch.records * self.max_growth < self._operating_point(interval):
            self._small_batches += 1
            if self._capacity is not None and batch.processing_delay <= _SHOWN_WITHIN * self._period:
                self._capacity = max(self._capacity, batch.records / batch.processing_delay)
            return None
        before = self._predicted(batch.records)
        # (a first one: a second in a row ran all at the new cost, which its time shows in full)
        slower = before is not None and batch.processing_delay > (1 + self.overrun_threshold) * before
        self._slower, self._was_slower = slower and not self._was_slower, slower
        if self._fell_back(before, batch):
            self._restore_before_rise()
        a, b = self._refit(batch, watched=watched is not None)
        b = self._hedged(batch, a, b, watched)
        capacity, period = self._set_capacity(batch, a, b)
        if self._fell(before, batch.processing_delay, a, period):
            capacity = self._sped_up(batch, a, capacity, period)
        capacity = self._within_before_rise(batch, capacity, period)
        largest = max(p.records for p in self._points)
        fastest = max(p.records / p.seconds for p in self._points)

        # the rate in force when the backlog piled up; an unthrottled start is read from the batch
        in_force = self.rate if math.isfinite(self.rate) else batch.records / interval
        pace, pause = 1.0, 0.0
        if batch.waiting is not None:
            # counted, not estimated: what the next batch, at capacity, cannot take, unless it drains
            # a pile-up (10)
            take, pace, pause = self._drain_plan(batch, a, capacity, period, watched=watched)
            backlog = max(0.0, batch.waiting - take)
            # batches after the next one hold that much before anything new comes in
            floor = self.floor_fraction * capacity - backlog / period
        else:
            left = batch.backlog if batch.backlog is not None else in_force * batch.lateness
            overrun = batch.processing_delay - interval
            backlog = max(0.0, left + in_force * overrun)
            floor = self.floor_fraction * capacity
        # the size of the batches a backlog drains in: what the last estimate admitted, not a watchdog cut
        proposed = in_force if self._proposed is None else self._proposed  # finite: capped by the fit
        batch_size = max(1.0, proposed * period)
        drain_seconds = backlog * (b + a / batch_size)
        self._backlog, self._drain_seconds = backlog, drain_seconds

        rate = self.target_utilisation * capacity - drain_seconds / (self.horizon * b * period)
        rate = pace * max(rate, floor)
        jump_safe = self._jump_share() * capacity  # (11)
        self._proposed = min(rate, self.max_growth * largest / period, self.max_stretch * fastest, jump_safe)
        if batch.waiting is not None:
            self._probe(batch, batch.waiting, self._proposed, capacity, period)
        return self._hold_into_next_batch(pause, self._proposed)

    def _refit(self, batch: BatchMetrics, *, watched: bool) -> tuple[float, float]:
        """Fit the batch just done: (a, b), also kept as the fit outliers are judged against."""
        # judged against the fit whatever its size: the watchdog saw this batch overrun, or the cost
        # rose lately and may fall back; a fit blending both costs otherwise hides the next change
        self._observe(batch.records, batch.processing_delay, judge=watched or self._risen > 0)
        a, b, self._fit = self._solve(self._prior_a)
        if self._fit != "anchored":
            self._prior_a = a  # the fixed cost to assume when batch sizes stop varying
            # a fixed cost to judge batches by: fitted where the noise could be measured, not from
            # two batches (any line fits them) nor a bound
            measured = self._fit == "fitted" and math.isfinite(self._noise(a, b)[1])
            self._prior_from_data = self._prior_from_data or measured
        self._a, self._b = a, b  # outliers are judged against the fit itself, not the caller's hedge
        return a, b

    def _hold_into_next_batch(self, pause: float, rate: float) -> float:
        """`rate`, or, for a pause > 0, min_rate and intake held until `pause` seconds into the next
        batch (resume), then `rate`."""
        if pause <= 0:
            return rate
        self._paused_until, self._held = (pause, rate), True
        self._pauses += 1
        return self.bounds.min_rate

    def _hedged(self, batch: BatchMetrics, a: float, b: float, watched: float | None) -> float:
        """The per-record cost to plan by after `batch`: the fit's, unless the batch was a surprise or
        the watchdog saw it run (see 5 and 7)."""
        if self._suspect_sign:
            # one surprising batch: a cost change, or a GC pause? Faster than the fit: believe it (the
            # stretch cap below bounds the risk). Slower, and the watchdog saw it overrun: believe it
            # too (a cost change mid-batch even shows only part of the new cost). Slower otherwise: go
            # halfway, geometrically. At most 4x either way; a second surprise confirms the change.
            alone = min(max((batch.processing_delay - a) / batch.records, b / 4), 4 * b)
            b = alone if self._suspect_sign < 0 or watched is not None else math.sqrt(b * alone)
        if watched is not None:
            # what the watchdog saw this batch do, under this fit's fixed cost: no bounce back up
            b = max(b, (watched - a) / batch.records)
        return b

    def _predicted(self, records: int) -> float | None:
        """Seconds the latest fit predicts for a batch of `records` (None before a fit)."""
        if self._a is None or self._b is None:
            return None
        return self._a + self._b * records

    def _fell(self, before: float | None, seconds: float, a: float, period: float) -> bool:
        """Whether a batch of `seconds` shows the per-record cost fell: far faster than the fit before
        it predicted, with a fit that tells the costs apart well enough (not a bound or a probe from
        the floor, and the batch mostly records: on a loaded machine a fixed cost over the interval
        and its noise make any batch look fast or slow)."""
        return (
            before is not None
            and self._risen > 0  # back down after a rise the watchdog saw, within a window of it
            and seconds < (1 - self.change_threshold) * before
            and self._fit != "bounded"
            and not self._probing
            and period <= self._interval  # not a fixed cost over the interval (2)
            and seconds - a >= (1 - self.max_fixed_share) * (period - a)
        )

    def _fell_back(self, before: float | None, batch: BatchMetrics) -> bool:
        """Whether a batch shows the cost fell back to where it was before a rise the watchdog saw:
        far faster than the fit predicted, and within change_threshold of what the fit before the
        rise predicts for it. Then that fit applies again, batches and all. Unlike `_fell` this
        holds for a batch that is mostly fixed cost (those after a rise are small): the fit before
        the rise knows how its time splits, the batch's own time does not (a fixed cost misread from
        the slow batches made the records of the first fast batch look twice as slow as they were,
        and the rate took 4 batches to come back: batches starved meanwhile)."""
        if before is None or self._risen <= 0 or self._before_rise is None or self._probing:
            return False
        a0, b0, _ = self._before_rise
        expected = a0 + b0 * batch.records
        seconds = batch.processing_delay
        if abs(seconds - expected) > self.change_threshold * expected:
            return False
        if seconds < (1 - self.change_threshold) * before:
            return True  # far faster than the fit predicts
        # or, where the batch the fall landed in (partly at each cost) was fitted and tilted the fit
        # partway down, faster than it and far closer to the fit before the rise
        return seconds < before and abs(seconds - expected) < _CLOSER * (before - seconds)

    def _restore_before_rise(self) -> None:
        """The fit before the rise holds again (11): judged by it, the batch just done joins it."""
        if self._before_rise is None:
            return
        self._a, self._b, self._points = self._before_rise
        self._before_rise, self._suspect_sign, self._risen = None, 0, 0
        self._changes += 1

    def _within_before_rise(self, batch: BatchMetrics, capacity: float, period: float) -> float:
        """Within the window of a rise the watchdog saw, a batch far faster than the fit is read as the
        cost falling back: to about the cost before the rise (1 + change_threshold of its capacity), not
        past it, unless the batch itself proved more. Its (seconds - a) / records, under a fixed cost
        fitted high, is mostly noise: a fast batch right after a noisy slow one read a 60k pipeline as
        141k records/s, the rate followed, and the backlog it built waited 4.5 intervals when a real
        jump came (bench/control_loop.py)."""
        if self._before_rise is None or self._risen <= 0 or period > self._interval:
            return capacity  # (not where a fixed cost over the interval sets the period: see 2)
        a0, b0, _ = self._before_rise
        if b0 <= 0 or period <= a0:
            return capacity
        bound = max(
            (1 + self.change_threshold) * (period - a0) / (b0 * period),
            batch.records / batch.processing_delay,
        )
        if capacity <= bound:
            return capacity
        self._capacity = bound
        return bound

    def _sped_up(self, batch: BatchMetrics, a: float, capacity: float, period: float) -> float:
        """A batch far faster than the fit before it predicted: the cost fell back after a jump.
        Its records took (seconds - a) / records each, which a fit still weighing the slower batches
        (an anchored fit does not judge a batch of another size an outlier) reads as a fraction of
        the fall: capacity at that per-record cost, within max_stretch x what the batch showed, so
        the rate is back in a batch or two rather than six (seen: 15k, 21k, 27k, 32k, 36k, 38k of
        45k records/s, and batches starved meanwhile)."""
        seconds, records = batch.processing_delay, batch.records
        if seconds <= a:
            return capacity
        at_cost = (period - a) / ((seconds - a) / records * period)
        self._capacity = max(capacity, min(at_cost, self.max_stretch * records / seconds))
        self._risen = 0
        return self._capacity

    def _drain_plan(
        self, batch: BatchMetrics, a: float, capacity: float, period: float, *, watched: float | None
    ) -> tuple[float, float, float]:
        """(records the next batch takes, share of the rate to admit, seconds into the next batch that
        intake is held): a batch at capacity, the full rate, no hold; or, while draining what piled up
        behind an overrun (10), all of it (up to max_drain), intake paced so the batch after it holds
        about one period, and held first as long as what comes in would wait too long. Not after a
        batch that itself took from a backlog left before it (a start's burst, a restart): that drains
        as usual; taken whole, a start's burst once made batches of 4-6 s."""
        waiting = batch.waiting or 0
        take = capacity * self._cap_share() * period  # what the source lets the next batch hold
        # (not when the batch itself took from a backlog that was there before it)
        if not (self._draining and waiting > take and (batch.backlog or 0) <= take):
            self._draining, self._drain_take = False, None
            return take, 1.0, 0.0
        interval = self._interval
        per_record = (period - a) / (capacity * period)
        normal, drain = take, (self.max_drain * interval - a) / per_record
        take = max(normal, min(waiting, drain))
        # the source's cap, with a batch at capacity to spare: records taken between the source's
        # planning of the batch that overran and its StartBatch are in no count, and the newest of the
        # pile, left behind, waited out the whole drain batch (3.2 intervals late in a real run)
        self._drain_take = max(take, min(waiting + normal, drain))
        upcoming = a + take * per_record  # seconds the next batch is planned to take
        # records taken before this far into it would wait too long for the batch after it
        pause = max(0.0, upcoming - (1 + self.drain_lateness) * interval)
        if watched is not None and upcoming > (1 + _WATCHED_HOLD / 2) * interval:
            # the cost rose within the batch just done, perhaps late in it: it shows only part of
            # the new cost, and the pile may take far longer than predicted (seen in simulation:
            # 3.1 s for a pile predicted at 1.3 s). Hold a while regardless, unless the pile is about
            # one batch (after a noisy overrun of a steady pipeline the hold left the next batches
            # at a third of capacity).
            pause = max(pause, _WATCHED_HOLD * interval)
        window = max(upcoming - pause, 0.0)  # what is taken from the resume on waits for it
        return take, period / max(window, period), pause

    def batch_cap(self, interval: float) -> float:
        """max(rate, capacity) x interval; while draining (10), at least what the next batch processes
        in max_drain intervals at the estimated cost."""
        cap = super().batch_cap(interval)
        a, capacity, period = self._a, self._capacity, self._period
        if self._draining and a is not None and capacity is not None and 0 < capacity < math.inf:
            per_record = (period - a) / (capacity * period)
            if per_record > 0:
                drain = (self.max_drain * interval - a) / per_record
                cap = max(cap, drain if self._drain_take is None else min(drain, self._drain_take))
        return cap

    def _adopted(self, rate: float) -> None:
        self._paused_until, self._held = None, False  # the operator's rate holds from now, not a plan

    def _resume(self, elapsed: float) -> float | None:
        if self._paused_until is None or elapsed < self._paused_until[0]:
            return None
        rate, self._paused_until = self._paused_until[1], None
        self._held = False
        return rate

    @property
    def intake_held(self) -> bool:
        return self._held

    def _set_capacity(self, batch: BatchMetrics, a: float, b: float) -> tuple[float, float]:
        """Capacity (records/s) from the fit a + b x records, and the seconds a batch is planned to
        take for it (the period: the interval, or more where the fixed cost leaves too little room)."""
        interval = batch.batch_interval
        # a fixed cost near or over the interval leaves little or no room for records in one: then
        # batches take longer (Spark starts the next at once), at least half of it on records, rather
        # than ever fewer records (a capacity of 0 from a fixed cost of 1 s held batches at the floor)
        period = max(interval, a / (1 - self.max_fixed_share))
        capacity = (period - a) / (b * period)
        if batch.processing_delay <= _SHOWN_WITHIN * period:
            # whatever the fit says, the batch just done processed this much within its period (a
            # fit through a batch that straddled a cost change once read half of that)
            capacity = max(capacity, batch.records / batch.processing_delay)
        if self._fit == "bounded":
            # a per-record cost hidden in the noise may be far under the truth: the batches it allows
            # grow by the caps of 6, at most max_stretch periods even if all their time were per record
            largest = max(p.records for p in self._points)
            fastest = max(p.records / p.seconds for p in self._points)
            capacity = min(capacity, self.max_stretch * fastest, self.max_growth * largest / period)
        self._capacity, self._period, self._interval = capacity, period, interval
        return capacity, period

    def _jump_share(self) -> float:
        """The share of capacity a batch may hold (11) so that, were each record to cost
        jump_tolerance times as much from the batch's start, it ends within 1 + jump_lateness
        intervals of its due time: the next batch starts at most jump_lateness late. (A batch of
        fixed cost a, admitted at utilisation u, that a cost jump J hits at its start takes
        a + J (u period - a): no controller that planned it fuller keeps the next one within that,
        whatever it does afterwards.) Never under floor_fraction: no batch is starved for it."""
        a, period = self._a, self._period
        if a is None or period > self._interval:
            return 1.0  # batches planned past their interval (2) are late anyway: nothing to keep
        if not self._prior_from_data and self._batches > self.warmup_batches + _GUESS_BATCHES:
            # past the start's ramp, a fixed cost still a guess (the configured prior, or a line
            # through two batches of the ramp: 0.21 s against 0.1 s in simulation, and a 4x jump
            # made the next batch 2.1 intervals late) may be far over the truth, and a jump scales
            # all of the time that is not fixed: plan for none
            a = 0.0
        share = ((1 + self.jump_lateness) * self._interval - a) / (self.jump_tolerance * (period - a))
        return min(1.0, max(share, self.floor_fraction))

    def _probe(
        self, batch: BatchMetrics, waiting: int, proposed: float, capacity: float, period: float
    ) -> None:
        """Batches alike tell nothing of how their time splits, and kept alike (at the floor after a
        restart on a loaded machine) they never would. So while records wait beyond the next batch
        and the fit cannot tell the costs apart, the next may try max_stretch x the records: at most
        that many times as long if all were per record; if most of it is fixed cost, about as long,
        holding more. Either way its size differs and the fit learns. While probing, batches never
        shrink on the prior's guess: a tried batch that took about as long as the one before is
        tried larger again, one that took longer is held at its size, and a second in a row that
        took longer (per-record cost, twice) or a fit that tells the costs apart ends the probing."""
        probed, self._probed = self._probed, None
        records, seconds = batch.records, batch.processing_delay
        # what the source lets the next batch take: max(rate, capacity) x interval
        size = max(self.bounds.clamp(proposed) * batch.batch_interval, capacity * period)
        # not after a batch far slower than others: its records cost more than the fit says (or it
        # stalled), and a larger one would be slower still
        slow = seconds > self.max_stretch * min(p.seconds for p in self._points)
        if self._fit == "fitted" or waiting <= size or slow:
            self._probing, self._shown = False, 0
            return
        if self._fit == "anchored" and size > (1 - _IDENTIFIABLE_CV) * records:
            self._probing = True  # the next batch would be alike: nothing new to learn
        if not self._probing:
            return
        grow = True
        if probed is not None:
            before, took = probed
            added = (records / before - 1) * took  # what it added if all of it were per record
            shown = seconds - took >= _PER_RECORD_SHOWN * added
            self._shown = self._shown + 1 if shown else 0
            if self._shown >= 2:
                self._probing, self._shown = False, 0
                return
            grow = not shown
        self._capacity = max(capacity, records / period)  # not smaller on the prior's guess
        probe = max(self.max_stretch * records, records + 1.0)
        if grow and probe > size:
            self._probes += 1
            self._probed = (records, seconds)
            self._capacity = probe / period

    def _operating_point(self, interval: float) -> float:
        """Records a batch holds at the scale the rate works at: the larger of what the rate in force
        admits and what the capacity allows per interval (0 while neither is known: unlimited, unfitted;
        an infinite capacity, from a batch timed at ~0 s, is no scale either)."""
        scales = [r for r in (self.rate, self.capacity) if r is not None and math.isfinite(r)]
        return max(scales, default=0.0) * interval

    def _warm_up(self, batch: BatchMetrics) -> float | None:
        """A start-up batch is not fitted (its time carries worker start-up), but its throughput is a
        lower bound on the pipeline's: it may raise the rate by the same growth caps as a fitted batch,
        never lower it. A warm pipeline is reached in a batch or two, a cold one changes nothing.

        The exception is an unlimited start (`sluice serve`'s): while its batches keep up it stays
        unlimited, but the first that overruns its interval shows intake outpacing the pipeline: its
        throughput (with the same caps) becomes the rate, less what drains what waits beyond a batch
        over the horizon, and the capacity (a lower bound) the source caps batches by. Unlimited, a
        saturating publisher kept filling the store while three 500k-record start-up batches ran,
        6-11 s each: the next minute of batches started 26-56 s late."""
        grown = min(
            self.max_stretch * batch.records / batch.processing_delay,
            self.max_growth * batch.records / batch.batch_interval,
        )
        unlimited = math.isinf(self.rate) and batch.processing_delay > batch.batch_interval
        if unlimited:
            # its throughput is a capacity measured (a lower bound: the source caps batches by it)
            self._capacity = max(self._capacity or 0.0, batch.records / batch.processing_delay)
        if self._capacity is not None and batch.waiting is not None:
            # after an unlimited start, what waits beyond a batch at that capacity drains over the
            # horizon before intake grows again
            interval = batch.batch_interval
            excess = max(0.0, batch.waiting - self._capacity * interval)
            drained = self.target_utilisation * self._capacity - excess / (self.horizon * interval)
            grown = max(self.bounds.min_rate, min(grown, drained))
        if not (grown > self.rate or unlimited):
            return None
        self._proposed = grown
        return grown

    def _overrun(self, records: int, elapsed: float, interval: float, waiting: int | None) -> float | None:
        a, b, capacity = self._a, self._b, self._capacity
        if a is None or b is None or capacity is None:
            return None
        predicted = a + b * records
        if self._last_fitted is not None:
            # nor longer than the latest batch's time per record says: a fit still weighing batches
            # of an earlier, higher cost (seen: 1.2 s for a batch like one just done in 0.94 s) would
            # keep the watchdog blind for a quarter of an interval while records pile up
            last_records, last_seconds = self._last_fitted
            predicted = min(predicted, a + max(0.0, last_seconds - a) * records / last_records)
        if elapsed <= predicted * (1 + self.overrun_threshold):
            return None  # slower than usual, but within the noise a completed batch may show
        # the batch is still running, so its per-record cost is at least this: a lower bound, not a guess
        at_least = (elapsed - a) / records
        period = self._period
        lower = max(0.0, (period - a) / (at_least * period))
        # ... unless it is far below the operating point: then a slower fixed cost or a stall keeps it
        # running, and a handful of records would turn that into a per-record cost (8)
        small = records * self.max_growth < self._operating_point(interval)
        lowered = not small and at_least > b and lower < capacity
        if lowered:
            self._capacity = capacity = lower
            self._watched = elapsed
            self._draining = True  # what piles up meanwhile goes in the next batch at once (10)
            self._drain_take = None  # (how much, the completion tells)
            if self._risen == 0:  # what the cost may fall back to
                self._before_rise = (a, b, [dataclasses.replace(p) for p in self._points])
            self._risen = self.window  # batches within which a fall back is believed at once
        if waiting is not None and waiting >= capacity * self._cap_share() * period:
            # the next batch is already there in full: what else comes in now only waits longer
            self._overruns += 1
            self._held = True
            return self.bounds.min_rate
        if not lowered:
            return None  # nothing the fit or an earlier look at this batch did not already know
        self._overruns += 1
        return min(self.target_utilisation, self._jump_share()) * lower

    def _observe(self, records: int, seconds: float, *, judge: bool = False) -> None:
        self._last_fitted = (records, seconds)
        for point in self._points:
            point.weight *= self.forgetting
        sign = 0
        # a fit anchored on the configured prior (not on a fixed cost from data) is a guess away from
        # the batch sizes it was fitted on: a batch of another size is what corrects it, no outlier.
        # Near those sizes it predicts exactly, whatever the split between the two costs.
        judged = judge or self._prior_from_data or self._near_fitted_sizes(records)
        if judged and len(self._points) >= 2 and self._a is not None and self._b is not None:
            predicted = self._a + self._b * records
            # off by more than the batches' own noise too: on a loaded machine batches alike took
            # 0.8-1.6 s, and every other one read as a cost change reset the fit
            noise = self._noise(self._a, self._b)[1]
            off = self.change_threshold * predicted
            # (not where the watchdog's evidence or a recent rise says to judge: the noise of a fit
            # blending two costs, 3x of it, hid a 3.5x jump and its fall back)
            if math.isfinite(noise) and not judge:
                off = max(off, _SURPRISE_NOISE * noise)
            if abs(seconds - predicted) > off:
                sign = 1 if seconds > predicted else -1
        if sign == 0:
            self._points.append(_Point(records, seconds, 1.0))
        elif sign == self._suspect_sign:
            # the same surprise twice: the pipeline's cost changed, forget what it was. The first
            # surprise is forgotten too: under load a cost change lands mid-batch, so that batch paid
            # partly the old cost, and kept in the new fit it tilted it (seen: a fixed cost of 0.61 s,
            # then 0.48 s for 20 batches, against 0.22 s, and a 25% overshoot when the cost came back)
            self._changes += 1
            self._points = [_Point(records, seconds, 1.0)]
            sign = 0
        else:
            self._points.append(_Point(records, seconds, _OUTLIER_WEIGHT, outlier=True))
        self._suspect_sign = sign
        del self._points[: -self.window]

    def _near_fitted_sizes(self, records: int) -> bool:
        weight = sum(p.weight for p in self._points)
        if weight <= 0:
            return False
        mean = sum(p.weight * p.records for p in self._points) / weight
        return abs(records - mean) <= _NEAR_SIZE * mean

    def _solve(self, prior_a: float) -> tuple[float, float, str]:
        """Weighted least squares for seconds = a + b * records with a weak prior a ~ prior_a.

        Returns (a, b, fit). "fitted": both costs from the data. "anchored": batch sizes were too alike
        (or noise made the fit absurd) to tell the costs apart; a stays at the prior and b explains the
        mean, which still predicts batches of the usual size exactly. "bounded": sizes varied but their
        times did not follow beyond the noise; then b is at most what that spread could hide in the
        noise, and a the rest of the mean (fixed-cost dominated batches, e.g. on a loaded machine).
        """
        # records scaled to [0, 1] keeps the 2x2 system well conditioned for any batch size
        scale = max(p.records for p in self._points)
        weight = s1 = s2 = t0 = t1 = 0.0
        for p in self._points:
            x = p.records / scale
            weight += p.weight
            s1 += p.weight * x
            s2 += p.weight * x * x
            t0 += p.weight * p.seconds
            t1 += p.weight * x * p.seconds
        few = len(self._points) < _FEW_POINTS  # e.g. just after a cost change reset the fit
        ridge = _DATA_RIDGE if self._prior_from_data and few else _RIDGE
        s0 = weight + ridge
        det = s0 * s2 - s1 * s1  # > 0: the prior term alone makes the system regular
        a = (s2 * (t0 + ridge * prior_a) - s1 * t1) / det
        b = (s0 * t1 - s1 * (t0 + ridge * prior_a)) / det / scale
        mean_x = s1 / weight
        sd_x = math.sqrt(max(0.0, s2 / weight - mean_x * mean_x))
        shortest = min(p.seconds for p in self._points)
        varied = sd_x / mean_x >= _IDENTIFIABLE_CV
        # the sizes' spread must explain more of the times than the noise does: otherwise a few
        # noisy batches (or old ones at another cost) tilt the line, e.g. to a fixed cost of 0.9 s
        # and a capacity a third of the truth, seen here at 50 us a record
        residual, noise = self._noise(a, b) if varied else (math.inf, math.inf)
        if varied and 0 <= a < shortest and b > 0 and b * scale * sd_x >= _SIGNAL_TO_NOISE * residual:
            return a, b, "fitted"
        mean_t = t0 / weight
        anchored_a = min(prior_a, 0.9 * shortest)
        anchored_b = max((mean_t - anchored_a) / (mean_x * scale), _MIN_PER_RECORD_COST)
        # a per-record cost above this would have made the sizes' spread explain more than the noise
        # (it would have been fitted; noise measured over more batches than the fit has costs): a
        # batch of 5,000 records and one of 50 that both took ~1 s say the cost is fixed, whatever
        # the prior guessed (which read it as per-record cost and shrank every batch to the minimum
        # rate after a restart on a loaded machine)
        bound = max(b, 0.0) + _SIGNAL_TO_NOISE * noise / (scale * sd_x) if varied else math.inf
        if bound < anchored_b:
            bounded_a = min(mean_t - bound * mean_x * scale, 0.9 * shortest)
            return bounded_a, max((mean_t - bounded_a) / (mean_x * scale), _MIN_PER_RECORD_COST), "bounded"
        return anchored_a, anchored_b, "anchored"

    def _noise(self, a: float, b: float) -> tuple[float, float]:
        """The residual of batch times around a + b x records (the inliers' weighted standard
        deviation), and the noise it measures: corrected for the two costs fitted from the same
        batches, inf from too few of them (two batches fit any line exactly)."""
        inliers = [p for p in self._points if not p.outlier]  # an outlier is no measure of noise
        weight = sum(p.weight for p in inliers)
        if weight <= 0:
            return math.inf, math.inf
        squares = sum(p.weight * p.weight for p in inliers)
        effective = weight * weight / squares  # batches, counted by their weights
        residual = math.sqrt(sum(p.weight * (p.seconds - a - b * p.records) ** 2 for p in inliers) / weight)
        noise = residual * math.sqrt(effective / (effective - 2)) if effective > 2.5 else math.inf
        return residual, noise

    def _state(self) -> dict[str, StateValue]:
        return {
            "fit": self._fit,
            "fixed_cost_s": self._a,
            "per_record_cost_s": self._b,
            "capacity_rps": self._capacity,
            "batch_period_s": self._period,
            "backlog_records": self._backlog,
            "backlog_cost_s": self._drain_seconds,
            "batches": self._batches,
            "fit_points": len(self._points),
            "cost_changes": self._changes,
            "overrun_cuts": self._overruns,
            "small_batches": self._small_batches,
            "size_probes": self._probes,
            "draining": self._draining,
            "drain_pauses": self._pauses,
            "intake_held": self._held,
            "target_utilisation": self.target_utilisation,
            "horizon": self.horizon,
            "forgetting": self.forgetting,
            "floor_fraction": self.floor_fraction,
            "jump_tolerance": self.jump_tolerance,
            "jump_lateness": self.jump_lateness,
        }


def _check_range(
    name: str,
    value: float,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    whole: bool = False,
) -> None:
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if math.isnan(value) or not (above and below) or (whole and value != math.floor(value)):
        lo, hi = "(" if low_open else "[", ")" if high_open else "]"
        kind = "a whole number" if whole else "a number"
        raise ValueError(f"{name} must be {kind} in {lo}{low}, {high}{hi}, got {value}")
