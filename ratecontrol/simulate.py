"""A tiny deterministic pipeline to try estimators on: a saturating publisher, a Spark receiver, batches.

`simulate` is modelled like a Spark Streaming receiver; `simulate_structured` like Sluice under
Structured Streaming (records wait in the store, each batch takes what is there up to the source's cap).
In `simulate`: The publisher always offers `offered_rate` records/s; the
receiver admits min(offered, rate in force). The records admitted during [(k-1) I, k I) form batch k,
due at k I (I = interval). Batches run one at a time, in order: batch k starts at max(k I, end of batch
k-1), so a batch that overruns its interval makes the next late, and takes
`fixed_cost + per_record_cost * records` seconds (plus `startup` for the first batch), at the cost in
force when it starts. When a batch completes the estimator sees its BatchMetrics, and a new rate applies
to admission from that moment on.

The oldest record of batch k was admitted at (k-1) I, so its scheduling_delay is start - (k-1) I, and
its lateness (start - k I) is Spark's schedulingDelay: the delay the measures below and DESIGN.md's
numbers speak of. Capacity at time t is what one batch per interval can process:
(I - fixed_cost) / (per_record_cost(t) I) records/s.

Measures (`Simulation`): utilisation = records processed by batches 2..N / capacity integrated from the
end of batch 1 to the end of batch N (batch 1 carries start-up, which no controller can help); time to
settle = start of the first batch of the first 5 in a row that start less than one interval late; a
starved batch holds under half of capacity x interval (capacity when its records began to be
admitted: what its rate could know), counted from settling on and after the first 3 batches. Two
refinements, which matter only where the cost changes or batches leave the trigger grid: the interval
is the time since the previous batch started where that is shorter (a batch right after one that
overran holds what arrived since, no more), and under `simulate_structured` (and the bench's judge) a
fall of the cost counts from when a controller could see it, the end of the first batch that started
after it (`known_capacity`): records taken before that came at the rate the slower pipeline allowed.
`starved_after(t)` counts them among the batches that started at or after t instead (e.g. a cost
change), and `jumps` builds a schedule of cost jumps that land at different phases of a batch.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
from dataclasses import dataclass

from ratecontrol.batch import BatchMetrics
from ratecontrol.estimator import RateEstimator

SETTLE_RUN = 5
"""Batches in a row starting less than one interval late that count as settled."""
STARVED_SHARE = 0.5
"""A batch holding under this share of capacity x interval is starved."""
UNJUDGED = 3
"""First batches not counted as starved: formed at the initial rate, before any estimate applied."""


JUMP_SPACING = 6.0
"""Intervals between two cost changes of `jumps`: enough for a controller to settle in between."""
GOLDEN = (math.sqrt(5) - 1) / 2
"""Each change lands this much of an interval later in its batch than the one before (mod 1): the
phases spread evenly over a batch, none aligned with another."""


def jumps(
    duration: float, factor: float, interval: float = 1.0, *, spacing: float = JUMP_SPACING
) -> tuple[tuple[float, float], ...]:
    """Pipeline.cost_changes for a per-record cost that jumps by `factor` and back, again and again.

    The first change comes after a quarter of the run (rounded down to an interval: the start, with
    its own transient, is over by then), then one every
    `spacing` intervals while one interval-spacing is left: up, back to 1, up, ... Each lands at
    phase (0.1 + k x 0.618) mod 1 of an interval past a multiple of it (the trigger grid), so while
    batches run on the grid the changes land early, late and in between in a batch.
    """
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a finite number > 0, got {factor}")
    changes: list[tuple[float, float]] = []
    t = math.floor(duration / 4 / interval) * interval
    k = 0
    while t + spacing * interval <= duration:
        phase = (0.1 + k * GOLDEN) % 1.0
        changes.append((t + phase * interval, factor if k % 2 == 0 else 1.0))
        k += 1
        t += spacing * interval
    return tuple(changes)


@dataclass(frozen=True)
class Pipeline:
    """What a micro-batch costs; defaults: 45k records/s at 1 s batches (DESIGN.md's measured pipeline)."""

    fixed_cost: float = 0.4
    """Seconds every batch costs regardless of size."""
    per_record_cost: float = 1 / 75_000
    """Seconds per record: with 0.4 s fixed cost a 1 s batch holds (1 - 0.4) * 75k = 45k records."""
    cost_changes: tuple[tuple[float, float], ...] = ()
    """(from second, factor): per_record_cost x factor from that time on, e.g. ((30, 2.0), (60, 1.0))."""
    startup: float = 0.0
    """Extra seconds of the first batch (worker start-up; ~10 s for a fresh PySpark query)."""
    jitter: float = 0.0
    """Each batch's time is off by up to this many seconds either way (a loaded machine: seen here
    0.8-1.6 s for batches alike), pseudo-random but the same for the same batch, so runs stay
    deterministic; never below zero."""
    seed: int = 0
    """Picks the jitter's sequence."""

    def per_record_cost_at(self, t: float) -> float:
        factor = 1.0
        for since, change in self.cost_changes:
            if t >= since:
                factor = change
        return self.per_record_cost * factor

    def processing_time(self, start: float, records: int) -> float:
        """Seconds a batch of `records` started at `start` takes: the fixed cost, then each record at the
        per-record cost in force when it runs (a cost change may land mid-batch, as on a real pipeline)."""
        t = start + self.fixed_cost
        left = float(records)
        for since in sorted(since for since, _ in self.cost_changes if since > t):
            fits = (since - t) / self.per_record_cost_at(t)
            if fits >= left:
                break
            left -= fits
            t = since
        took = t + left * self.per_record_cost_at(t) - start
        if self.jitter:
            # seeded by the batch itself: the same batch gets the same noise in every run
            draw = random.Random(f"{self.seed}:{start!r}:{records}")  # noqa: S311 - noise, not secrets
            noise = draw.uniform(-self.jitter, self.jitter)
            took = max(0.0, took + noise)
        return took

    def capacity_at(self, t: float, interval: float) -> float:
        """Records/s one batch per interval can process at time t (inf if records cost nothing)."""
        room, cost = max(0.0, interval - self.fixed_cost), self.per_record_cost_at(t)
        return room / cost / interval if cost > 0 else math.inf if room > 0 else 0.0

    def capacity_between(self, t0: float, t1: float, interval: float) -> float:
        """Records the pipeline could process from t0 to t1 (capacity integrated over time)."""
        edges = sorted({t0, t1, *(since for since, _ in self.cost_changes if t0 < since < t1)})
        return sum(self.capacity_at(a, interval) * (b - a) for a, b in itertools.pairwise(edges))


def known_capacity(
    pipeline: Pipeline, t: float, interval: float, batches: tuple[BatchMetrics, ...] | list[BatchMetrics]
) -> float:
    """The pipeline's capacity at `t` as a controller could know it: a fall of the per-record cost
    (more capacity) counts only from the end of the first of `batches` that started at or after it;
    before that, the capacity before the fall (a rise counts at once)."""
    capacity = pipeline.capacity_at(t, interval)
    for since, _ in pipeline.cost_changes:
        if since > t:
            continue
        seen = min(
            (b.completed_at for b in batches if b.completed_at - b.processing_delay >= since),
            default=math.inf,
        )
        if t < seen:
            capacity = min(capacity, pipeline.capacity_at(math.nextafter(since, -math.inf), interval))
    return capacity


@dataclass(frozen=True)
class Simulation:
    """One run: every batch as the estimator saw it, the pipeline's capacity, and the measures."""

    interval: float
    batches: tuple[BatchMetrics, ...]
    capacities: tuple[float, ...]
    """Capacity (records/s) when each batch's records began to be admitted: what its rate could know."""
    rates: tuple[float, ...]
    """Rate in force after each batch completed."""
    utilisation: float

    def peak_delay(self, after_batch: int = 0) -> float:
        """Largest lateness (Spark's scheduling delay) of the batches after the first `after_batch` ones."""
        return max((b.lateness for b in self.batches[after_batch:]), default=0.0)

    @property
    def settled_from(self) -> int | None:
        """Index of the first batch of the first SETTLE_RUN in a row that started on time."""
        on_time = [b.lateness < self.interval for b in self.batches]
        for i in range(len(on_time) - SETTLE_RUN + 1):
            if all(on_time[i : i + SETTLE_RUN]):
                return i
        return None

    @property
    def settle_time(self) -> float | None:
        """Seconds from the start of the run until batches start on time (None if they never do)."""
        i = self.settled_from
        if i is None:
            return None
        batch = self.batches[i]
        return batch.completed_at - batch.processing_delay

    def _starved(self) -> list[bool]:
        starts = [b.completed_at - b.processing_delay for b in self.batches]
        # what a batch can hold is what arrived since the previous one took its records
        spans = [self.interval] + [min(self.interval, max(0.0, t - s)) for s, t in itertools.pairwise(starts)]
        return [
            b.records < STARVED_SHARE * capacity * span
            for b, capacity, span in zip(self.batches, self.capacities, spans, strict=True)
        ]

    def peak_delay_since(self, since: float) -> float:
        """Largest lateness of the batches that started at or after `since` (seconds from the start)."""
        return max(
            (b.lateness for b in self.batches if b.completed_at - b.processing_delay >= since), default=0.0
        )

    def starved_after(self, since: float) -> int:
        """Starved batches among those that started at or after `since` (seconds from the run's start)."""
        return sum(
            starved
            for b, starved in zip(self.batches, self._starved(), strict=True)
            if b.completed_at - b.processing_delay >= since
        )

    @property
    def starved(self) -> int:
        """Starved batches from settling on, after the first UNJUDGED batches (all of those if never settled).

        The first batches are formed before any estimate can apply (an estimator first speaks when
        batch 1 or 2 completes), so their size is the initial rate's doing, not the estimator's.
        """
        settled = self.settled_from
        return sum(self._starved()[max(UNJUDGED, settled or 0) :])

    @property
    def longest_starvation(self) -> int:
        """Most batches in a row starved, anywhere after the first batch."""
        longest = run = 0
        for starved in self._starved()[1:]:
            run = run + 1 if starved else 0
            longest = max(longest, run)
        return longest

    def summary(self) -> dict[str, float | int | None]:
        return {
            "utilisation": round(self.utilisation, 3),
            "peak_delay_s": round(self.peak_delay(), 2),
            "peak_delay_after_3_s": round(self.peak_delay(UNJUDGED), 2),
            "settle_time_s": None if self.settle_time is None else round(self.settle_time, 2),
            "starved": self.starved,
            "longest_starvation": self.longest_starvation,
        }


def simulate(
    estimator: RateEstimator,
    pipeline: Pipeline,
    *,
    interval: float = 1.0,
    duration: float = 90.0,
    offered_rate: float = 100_000.0,
    pass_backlog: bool = False,
) -> Simulation:
    """Run `duration / interval` batches; the estimator's `rate` is the rate in force at the start.

    pass_backlog: tell the estimator, per batch, the records of the later batches already due when it
    started (BatchMetrics.backlog); otherwise backlog is None and the estimator infers it.
    """
    # admission rate changes: (from time, rate), in time order because batches complete in order
    changes: list[tuple[float, float]] = [(0.0, estimator.rate)]

    def admitted(t: float) -> int:
        """Whole records admitted from time 0 to t."""
        total = 0.0
        for (since, rate), (until, _) in zip(changes, [*changes[1:], (math.inf, 0.0)], strict=True):
            if since >= t:
                break
            total += min(offered_rate, rate) * (min(t, until) - since)
        return math.floor(total)

    batches: list[BatchMetrics] = []
    capacities: list[float] = []
    rates: list[float] = []
    end = 0.0
    for k in range(1, round(duration / interval) + 1):
        due = k * interval
        start = max(due, end)
        records = admitted(due) - admitted(due - interval)
        took = pipeline.processing_time(start, records)
        if k == 1:
            took += pipeline.startup
        end = start + took
        backlog = None
        if pass_backlog:
            due_by_start = math.floor(start / interval + 1e-9) * interval
            backlog = max(0, admitted(due_by_start) - admitted(due))
        batch = BatchMetrics(
            batch_id=k - 1,
            completed_at=end,
            records=records,
            processing_delay=took,
            scheduling_delay=start - (due - interval),
            batch_interval=interval,
            backlog=backlog,
        )
        rate = estimator.compute(batch)
        if rate is not None:
            changes.append((end, rate))
        batches.append(batch)
        capacities.append(pipeline.capacity_at(due - interval, interval))
        rates.append(changes[-1][1])

    processed = sum(b.records for b in batches[1:])
    possible = pipeline.capacity_between(batches[0].completed_at, end, interval)
    return Simulation(
        interval=interval,
        batches=tuple(batches),
        capacities=tuple(capacities),
        rates=tuple(rates),
        utilisation=processed / possible if possible > 0 else 0.0,
    )


def simulate_structured(  # noqa: PLR0915 - one simulated pipeline; its helpers share its state
    estimator: RateEstimator,
    pipeline: Pipeline,
    *,
    interval: float = 1.0,
    duration: float = 90.0,
    offered_rate: float = 100_000.0,
    watchdog: float | None = 0.1,
    backlog: int = 0,
    catch_up_min_share: float = 0.0,
) -> Simulation:
    """Like `simulate`, but modelled on Sluice under Structured Streaming rather than a DStream receiver.

    Admitted records (min(offered, rate in force)) wait in the block store. A trigger fires every
    interval, or as soon as the previous batch ends when it overran; the batch takes the records that
    are there, oldest first, up to the source's cap of max(rate, estimated capacity) x interval (asked
    when the batch is planned), and reports what it left (`backlog`). Scheduling delay is batch start -
    arrival of its oldest record; a starved batch is judged against the capacity at that arrival.

    backlog: records already in the store at time 0 (e.g. what a server killed under load left behind
    for the restarted query), arrived at 0, before anything the rate admits.
    catch_up_min_share: as the Sluice source does (0.5 there; 0 here by default: every trigger runs), a
    trigger off the grid within 0.75 interval of the last batch's start whose batch would hold under
    this share of the cap waits for the next grid point instead.
    """
    if backlog < 0:
        raise ValueError(f"backlog must be >= 0 records, got {backlog}")
    changes: list[tuple[float, float]] = [(0.0, estimator.rate)]

    def admit(t: float) -> None:
        """Admission from `t` on: the estimator's rate, or nothing while it holds intake."""
        rate = 0.0 if estimator.intake_held else estimator.rate
        if rate != changes[-1][1]:
            changes.append((t, rate))

    def segments() -> list[tuple[float, float, float]]:
        ends = [since for since, _ in changes[1:]] + [math.inf]
        return [
            (since, until, min(offered_rate, rate))
            for (since, rate), until in zip(changes, ends, strict=True)
        ]

    def admitted(t: float) -> float:
        return backlog + sum(rate * (min(t, until) - since) for since, until, rate in segments() if since < t)

    def arrival(record: float) -> float:
        """When the `record`-th admitted record (1-based) arrived."""
        if record <= backlog:
            return 0.0
        total = float(backlog)
        for since, until, rate in segments():
            span = rate * (until - since)
            if rate > 0 and total + span >= record:
                return since + (record - total) / rate
            total += span
        return math.inf

    def plan(start: float) -> tuple[int, int]:
        """Records there at `start` and what the source's cap lets the batch take of them."""
        available = math.floor(admitted(start)) - consumed
        cap = estimator.batch_cap(interval)  # max(rate, capacity) x interval, or more while draining
        return available, max(0, math.floor(min(available, cap)))

    def watch(start: float, end: float, records: int, consumed: int, tick: float) -> None:
        """The server polls a running batch: a hold the estimator planned may end (resume), and past
        its interval the estimator may cut the rate."""
        k = 1
        while (t := start + k * tick) < end:
            k += 1
            if records:
                estimator.resume(t - start)
                admit(t)
            if t - start > interval:
                estimator.overrun(records, t - start, interval, math.floor(admitted(t)) - consumed)
                admit(t)

    batches: list[BatchMetrics] = []
    arrivals: list[float] = []  # when each batch's oldest record arrived
    rates: list[float] = []
    consumed = 0
    end = start = 0.0
    k = 0
    while True:
        k += 1
        # Spark's ProcessingTime trigger: the next multiple of the interval after the last trigger,
        # or at once when the batch ended later (no catching up on missed triggers)
        last, start = start, max((math.floor(start / interval + 1e-9) + 1) * interval, end)
        if start >= duration:
            break
        available, records = plan(start)
        off_grid = start > math.floor(start / interval + 1e-9) * interval + 1e-9
        small = records < catch_up_min_share * estimator.batch_cap(interval)
        if off_grid and k > 1 and start - last < 0.75 * interval and small:
            # the source defers a small catch-up batch to the grid (ingest.spark.source)
            start = (math.floor(start / interval) + 1) * interval
            if start >= duration:
                break
            available, records = plan(start)
        oldest = arrival(consumed + 1) if records else start
        took = pipeline.processing_time(start, records) + (pipeline.startup if k == 1 else 0.0)
        consumed += records
        end = start + took
        if watchdog is not None:
            watch(start, end, records, consumed, watchdog)
        batch = BatchMetrics(
            batch_id=k - 1,
            completed_at=end,
            records=records,
            processing_delay=took,
            scheduling_delay=max(0.0, start - oldest),
            batch_interval=interval,
            backlog=available - records,
            waiting=max(0, math.floor(admitted(end)) - consumed),
        )
        estimator.compute(batch)
        admit(end)
        batches.append(batch)
        arrivals.append(min(oldest, start))
        rates.append(changes[-1][1])

    processed = sum(b.records for b in batches[1:])
    possible = pipeline.capacity_between(batches[0].completed_at, end, interval)
    return Simulation(
        interval=interval,
        batches=tuple(batches),
        capacities=tuple(known_capacity(pipeline, t, interval, batches) for t in arrivals),
        rates=tuple(rates),
        utilisation=processed / possible if possible > 0 else 0.0,
    )


SOURCE_CATCH_UP_MIN_SHARE = 0.5
"""The Sluice source's share below which a small catch-up batch off the grid waits for it."""


def simulate_jumps(
    estimator: RateEstimator, pipeline: Pipeline, factor: float, *, duration: float = 60.0
) -> tuple[Simulation, tuple[tuple[float, float], ...]]:
    """`duration` s of Sluice's loop (`simulate_structured`, the source deferring small catch-up
    batches as it does) while the per-record cost jumps by `factor` and back (`jumps`). Returns the
    run and the changes, whose first time is where issue 17's item 6 starts judging."""
    changes = jumps(duration, factor)
    sim = simulate_structured(
        estimator,
        dataclasses.replace(pipeline, cost_changes=changes),
        duration=duration,
        catch_up_min_share=SOURCE_CATCH_UP_MIN_SHARE,
    )
    return sim, changes
