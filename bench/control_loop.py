"""Control under saturation: Spark's receiver backpressure against Sluice's estimators, in one run.

Run: python bench/control_loop.py [--duration 60] [--profile jumps|steady|halved|both|all]
                                  [--only sparkpid-dstream|sluice-spark-pid|sluice-model] [--cost-us 20]
                                  [--factor 3.5] [--initial-rate R] [--quick] [--batches]

One Spark session (local[2]) runs, per profile, three systems with the same per-record cost (a Python
busy-wait in the pipeline), the same 1 s batch interval and a sender that always offers more than capacity:

- sparkpid-dstream: Spark Streaming's own receiver backpressure (PIDRateEstimator): socketTextStream from
  a TCP server thread in this process writing 100-byte lines as fast as the socket takes them.
- sluice-spark-pid: Sluice (fsync on) with RateConfig(estimator="spark-pid"), publisher in a subprocess.
- sluice-model: Sluice with the default estimator ("model").

Capacity is measured in the same run, right before each system runs (the machine is shared and its
speed drifts). For the Sluice rows: Sluice itself with the "fixed" estimator pinned at two rates, one
well under and one over a first guess, fitted as fixed + per-record cost per batch. That measures the
pipeline under the same ingest load as the runs (publisher process, server, fsynced log and Spark
share local[2]'s two cores); the first guess comes from the same source, stage, sink and trigger over
pre-written blocks without ingest, which reads ~40% higher. For the DStream row: the cost stage over
spark.range in batch mode on one core, because its receiver pins the other core of local[2] for the
whole run; batch mode has a smaller fixed cost per batch than a streaming trigger, so this is an upper
bound. The "halved" profile doubles the per-record cost from 1/3 to 2/3 of the
duration (a multiplier file the executors' workers read). The "jumps" profile (the default, issue 17
item 6) multiplies it by --factor (3.5) and back, again and again (ratecontrol.simulate.jumps: from a
quarter of the run, a change every 6 s, each at another phase of the 1 s trigger grid, which the run's
start is aligned to); each change's phase in the batch it landed in is printed, and its peak delay is
judged over the batches from the first change on ("after chg s"; the start is the steady profile's).
The "busy" column is the share of wall time Spark spent processing batches: it needs no capacity
estimate.

Measures are ratecontrol.simulate's (utilisation, peak Spark scheduling delay after the 3rd batch, time to
settle, starved batches), on Spark's definition of scheduling delay (batch start - batch due time). A
batch is starved when it holds under half of capacity x interval (simulate's definition: capacity when
its oldest record arrived, a fall of the cost counted from the end of the first batch that started
after it; the interval shortened to the time since the previous batch started); for "jumps" and
"halved" the "after chg" column counts them among the batches that started at or after the first
cost change.

Sluice starts as `sluice serve` does: the model estimator unlimited (the first batches bounded by the
receivers' memory until one is measured), spark-pid at 10,000 records/s (--initial-rate overrides).
The last line is the RESULT line (bench/all.py's convention); --quick is a short smoke run (jumps, 24 s,
Spark's DStream loop and sluice-model only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from line_server import LineServer
from pyspark import StorageLevel
from pyspark.streaming import StreamingContext
from pyspark.streaming.listener import StreamingListener

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver, batch_metrics, drive_rate
from ingest.server import SluiceServer
from ingest.spark.listener import BatchCompleted, BatchListener
from ingest.spark.pipeline import start_query
from ingest.spark.session import build_session
from ratecontrol import BatchMetrics
from ratecontrol.simulate import UNJUDGED, Pipeline, Simulation, jumps, known_capacity
from receivers.block import PLAIN_SCHEMA
from receivers.config import FsyncPolicy
from receivers.wal import WalBlockStore
from sluice_client import Producer

INTERVAL = 1.0
STREAM = "bench"
SYSTEMS = ("sparkpid-dstream", "sluice-spark-pid", "sluice-model")
SESSION_CONF = {
    "spark.streaming.backpressure.enabled": "true",
    "spark.streaming.backpressure.pid.minRate": "100",
    "spark.driver.memory": "8g",
    # a ceiling far above capacity (~40k rec/s on one core at 20 us): the sender still saturates, but the
    # unthrottled first batch (start-up takes seconds) cannot fill the heap with tens of millions of lines
    "spark.streaming.receiver.maxRate": "200000",
    "spark.sql.execution.arrow.maxRecordsPerBatch": "10000",
}


# ---- the cost stage (pickled by value into the executors' Python workers) -------------------------


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _multiplier(path: str) -> float:
    try:
        with open(path) as f:
            return float(f.read().strip() or 1.0)
    except (OSError, ValueError):
        return 1.0


def arrow_cost(cost: float, path: str) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """mapInArrow function: per Arrow batch, spin cost x multiplier x rows, emit the row count."""

    def fn(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            n = batch.num_rows
            _spin(n * cost * _multiplier(path))
            yield pa.RecordBatch.from_pydict({"n": [n]})

    return fn


def partition_cost(cost: float, path: str) -> Callable[[Iterator[str]], Iterator[int]]:
    """DStream mapPartitions function: the same spin per record, emits the partition's count."""

    def fn(lines: Iterator[str]) -> Iterator[int]:
        n = sum(1 for _ in lines)
        _spin(n * cost * _multiplier(path))
        yield n

    return fn


def _collect(rdd: Any) -> None:
    """The DStream's output operation; returns None (a returned value would be taken for an RDD)."""
    rdd.sum()


class CostFile:
    """The per-record cost multiplier the workers read; set_at schedules changes from a start time."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.set(1.0)

    def set(self, factor: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{factor}\n")
        tmp.replace(self.path)

    def schedule(self, t0: float, changes: tuple[tuple[float, float], ...]) -> threading.Event:
        # the workers read the file per Arrow batch (10k records): a change is seen within ~0.1 s
        """Apply (seconds after t0, factor) changes on a thread; set the returned event to cancel."""
        cancel = threading.Event()

        def run() -> None:
            for since, factor in changes:
                if cancel.wait(max(0.0, t0 + since - time.time())):
                    return
                self.set(factor)

        threading.Thread(target=run, daemon=True, name="cost-schedule").start()
        return cancel


# ---- capacity ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Capacity:
    fixed_cost: float
    per_record_cost: float
    """Seconds per record with the measured parallelism (wall time, not CPU time)."""

    def pipeline(self, changes: tuple[tuple[float, float], ...]) -> Pipeline:
        return Pipeline(self.fixed_cost, self.per_record_cost, cost_changes=changes)

    @property
    def records_per_second(self) -> float:
        return self.pipeline(()).capacity_at(0.0, INTERVAL)


def measure_capacity(spark: Any, cost: float, path: str, cores: int, big: int = 200_000) -> Capacity:
    """Fit fixed + per-record cost from the cost stage over spark.range in batch mode at two sizes."""
    small = big // 20

    def timed(n: int) -> float:
        df = spark.range(n, numPartitions=cores).selectExpr("repeat('v', 99) AS value")
        started = time.perf_counter()
        df.mapInArrow(arrow_cost(cost, path), "n long").count()
        return time.perf_counter() - started

    timed(small)  # warm the Python workers
    t_small = min(timed(small) for _ in range(2))
    t_big = min(timed(big) for _ in range(2))
    per_record = max(1e-9, (t_big - t_small) / (big - small))
    fixed = max(0.0, t_small - per_record * small)
    return Capacity(fixed, per_record)


def measure_streaming_capacity(
    spark: Any, cost: float, path: str, sizes: tuple[int, int] = (5_000, 40_000), batches: int = 6
) -> Capacity:
    """Fit fixed + per-record cost of the Sluice pipeline itself, in streaming mode: the same source,
    cost stage, sink and 1 s trigger as the Sluice runs, over a backlog of pre-written blocks, with
    batches capped at two sizes. A streaming trigger with a Python source costs more per batch than
    batch mode (~0.3-0.4 s against ~0.15 s), which is what the controller has to live with."""
    fn = arrow_cost(cost, path)
    value = b"v" * 99
    with tempfile.TemporaryDirectory(prefix="sluice-capacity-") as tmp:
        root = Path(tmp) / "blocks"
        store = WalBlockStore(root, fsync=FsyncPolicy.off())
        block = 10_000
        total = (batches + 2) * sum(sizes)
        now = pa.array([int(time.time() * 1e6)] * block, pa.timestamp("us", tz="UTC"))
        records = pa.RecordBatch.from_arrays(
            [pa.nulls(block, pa.binary()), pa.array([value] * block, pa.binary()), now],
            schema=PLAIN_SCHEMA,
        )
        for seq in range(-(-total // block)):
            store.write(STREAM, seq, seq * block, 0, [records])
        times: list[tuple[int, float]] = []
        for i, size in enumerate(sizes):
            events: list[BatchCompleted] = []
            listener = BatchListener(events.append)
            spark.streams.addListener(listener)
            query = start_query(
                spark,
                store_root=root,
                streams=[STREAM],
                pipeline=lambda df: df.select("value").mapInArrow(fn, "n long").writeStream.format("noop"),
                checkpoint_dir=Path(tmp) / f"checkpoint-{i}",
                trigger_seconds=INTERVAL,
                query_name=f"control_capacity_{i}",
                max_records_per_batch=size,
            )
            try:
                deadline = time.time() + 120
                while len([e for e in events if e.num_input_rows]) < batches + 2 and time.time() < deadline:
                    time.sleep(0.2)
            finally:
                query.stop()
                spark.streams.removeListener(listener)
            # the first two batches of a fresh query carry start-up
            times += [(e.num_input_rows, e.processing_seconds) for e in events if e.num_input_rows][2:]
    return _fit(times)


def measure_in_situ_capacity(
    spark: Any, cost: float, cost_file: CostFile, args: Any, guess: Capacity, seconds: float
) -> Capacity:
    """Fit fixed + per-record cost from Sluice itself at two pinned rates ("fixed" estimator), under
    the same ingest load as the runs: a saturating publisher, the server, the fsynced log and Spark share
    the machine's two cores, which a measurement over pre-written blocks does not see. One rate well
    under `guess`'s capacity, one over it (batches then run back to back at the cap)."""
    points: list[tuple[int, float]] = []
    for share in (0.4, 1.3):
        # a loaded machine once fitted the streaming guess at 0 rec/s (a fixed cost over the interval)
        rate = share * max(guess.records_per_second, 10_000.0)
        batches = asyncio.run(
            run_sluice(
                spark, "fixed", cost, cost_file, (), args, duration=seconds, initial_rate=rate, warmup=0
            )
        )
        points += [(b.records, b.processing_delay) for b in batches[3:] if b.records]
    return _fit(points)


def _fit(points: list[tuple[int, float]]) -> Capacity:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return Capacity(max(0.0, mean_y - b * mean_x), max(1e-9, b))


# ---- results -------------------------------------------------------------------------------------


def judge(batches: list[BatchMetrics], pipeline: Pipeline, duration: float) -> Simulation | None:
    """simulate's measures over batches that started within the run (times relative to its start)."""
    batches = sorted(
        (b for b in batches if b.completed_at - b.processing_delay < duration), key=lambda b: b.batch_id
    )
    if len(batches) < 2:
        return None
    starts = [b.completed_at - b.processing_delay for b in batches]
    capacities = tuple(
        known_capacity(pipeline, max(0.0, start - b.scheduling_delay), INTERVAL, batches)
        for b, start in zip(batches, starts, strict=True)
    )
    processed = sum(b.records for b in batches[1:])
    possible = pipeline.capacity_between(batches[0].completed_at, batches[-1].completed_at, INTERVAL)
    return Simulation(
        interval=INTERVAL,
        batches=tuple(batches),
        capacities=capacities,
        rates=(),
        utilisation=processed / possible if possible > 0 else 0.0,
    )


def phases(batches: list[BatchMetrics], changes: tuple[tuple[float, float], ...]) -> list[float | None]:
    """Where in its batch each cost change landed: (change - batch start) / batch time, None when no
    batch ran then (between batches)."""
    landed: list[float | None] = []
    for since, _ in changes:
        running = [b for b in batches if b.completed_at - b.processing_delay <= since < b.completed_at]
        if running:
            b = running[0]
            landed.append((since - (b.completed_at - b.processing_delay)) / b.processing_delay)
        else:
            landed.append(None)
    return landed


def next_grid_point(now: float) -> float:
    """The next multiple of the trigger interval in epoch time: Spark's ProcessingTime trigger (and a
    DStream's batch clock) start batches on that grid, so cost changes scheduled from it land at
    known phases of the interval."""
    return math.floor(now / INTERVAL + 1) * INTERVAL


# ---- (a) Spark Streaming receiver backpressure -----------------------------------------------------


def run_dstream(
    spark: Any,
    cost: float,
    cost_file: CostFile,
    changes: tuple[tuple[float, float], ...],
    args: Any,
    warmup: float = 0.0,
) -> list[BatchMetrics]:
    raw: list[tuple[int, int, int, int, int]] = []

    class Collector(StreamingListener):
        def onBatchCompleted(self, batchCompleted: Any) -> None:
            info = batchCompleted.batchInfo()
            raw.append(
                (
                    int(info.batchTime().milliseconds()),
                    int(info.numRecords()),
                    int(info.schedulingDelay()),
                    int(info.processingDelay()),
                    int(info.processingEndTime()),
                )
            )

    lines_server = LineServer(args.record_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # DStreams are deprecated; this is the anchor
        ssc = StreamingContext(spark.sparkContext, INTERVAL)
    cancel: threading.Event | None = None
    t0 = time.time()
    try:
        ssc.addStreamingListener(Collector())
        lines = ssc.socketTextStream("127.0.0.1", lines_server.port, StorageLevel.MEMORY_AND_DISK)
        lines.mapPartitions(partition_cost(cost, str(cost_file.path))).foreachRDD(_collect)
        t0 = next_grid_point(time.time() + warmup)
        cancel = cost_file.schedule(t0, changes)
        ssc.start()
        time.sleep(max(0.0, t0 + args.duration - time.time()))
    finally:
        if cancel is not None:
            cancel.set()
        ssc.stop(stopSparkContext=False, stopGraceFully=False)
        lines_server.stop()
        cost_file.set(1.0)
    batches = []
    for batch_ms, records, scheduling_ms, processing_ms, end_ms in raw:
        if scheduling_ms < 0 or processing_ms < 0 or end_ms < 0:
            continue  # unknown (-1): not a completed batch as far as the measures go
        if end_ms / 1000 < t0:
            continue  # done during the warm-up
        batches.append(
            BatchMetrics(
                batch_id=len(batches),
                completed_at=max(0.0, end_ms / 1000 - t0),
                records=records,
                processing_delay=processing_ms / 1000,
                # Sluice's definition: the oldest record waited one interval plus Spark's schedulingDelay
                scheduling_delay=INTERVAL + scheduling_ms / 1000,
                batch_interval=INTERVAL,
            )
        )
        del batch_ms
    return batches


# ---- (b), (c) Sluice ---------------------------------------------------------------------------------


def publish(target: str, record_bytes: int, seconds: float) -> None:
    """Publisher subprocess: 100-byte records as fast as credit allows, for `seconds`."""

    async def main() -> None:
        values = [b"v" * record_bytes] * 4096
        producer = Producer(target, STREAM, batch_size=4096)
        await producer.start()
        deadline = time.time() + seconds
        try:
            while time.time() < deadline:
                await asyncio.wait_for(producer.send_many(values), max(0.1, deadline - time.time()))
        except TimeoutError:
            pass
        finally:
            await producer.abort()

    asyncio.run(main())


def serve_initial_rate(estimator: str, args: Any) -> float:
    """`sluice serve`'s default: the model estimator unlimited, spark-pid 10,000 records/s."""
    if args.initial_rate is not None:
        return float(args.initial_rate)
    return math.inf if estimator == "model" else 10_000.0


async def run_sluice(
    spark: Any,
    estimator: str,
    cost: float,
    cost_file: CostFile,
    changes: tuple[tuple[float, float], ...],
    args: Any,
    *,
    duration: float | None = None,
    initial_rate: float | None = None,
    warmup: float | None = None,
) -> list[BatchMetrics]:
    duration = args.duration if duration is None else duration
    warmup = warmup if warmup is not None else (args.warmup or 0.0)
    loop = asyncio.get_running_loop()
    collected: list[tuple[BatchMetrics, float]] = []
    path = str(cost_file.path)
    fn = arrow_cost(cost, path)

    def pipeline(df: Any) -> Any:
        return df.select("value").mapInArrow(fn, "n long").writeStream.format("noop")

    with tempfile.TemporaryDirectory(prefix="sluice-control-") as tmp:
        config = ServeConfig(
            port=0,
            metrics_port=None,
            data_dir=Path(tmp),
            streams=(STREAM,),
            trigger_interval=INTERVAL,
            rate=RateConfig(estimator=estimator, initial_rate=serve_initial_rate(estimator, args))
            if initial_rate is None
            else RateConfig(estimator=estimator, initial_rate=initial_rate),
        )
        server = SluiceServer(config)
        await server.start()
        driver = SparkDriver(
            spark, config, pipeline=pipeline, rate_target=server.target, query_name=f"control_{estimator}"
        )
        drive_rate(driver, server, loop)

        def on_loop(batch: BatchCompleted) -> None:
            collected.append((batch_metrics(batch, INTERVAL, server.received_at), batch.started_at))

        driver.on_batch(lambda batch: None if loop.is_closed() else loop.call_soon_threadsafe(on_loop, batch))
        proc: Any = None
        cancel: threading.Event | None = None
        t0 = time.time()
        try:
            await asyncio.to_thread(driver.start)
            ctx = mp.get_context("spawn")
            if warmup > 0:  # the sender runs from now; the measured run starts after the warm-up
                t0 = next_grid_point(time.time() + warmup)
                sending = t0 - time.time() + duration
            else:
                t0 = next_grid_point(time.time())
                await asyncio.sleep(max(0.0, t0 - time.time()))
                sending = duration
            cancel = cost_file.schedule(t0, changes)
            proc = ctx.Process(target=publish, args=(server.target, args.record_bytes, sending), daemon=True)
            proc.start()
            while time.time() < t0 + duration:
                if driver.error():
                    raise RuntimeError(f"query died: {driver.error()}")
                await asyncio.sleep(0.2)
        finally:
            if cancel is not None:
                cancel.set()
            if proc is not None:
                await asyncio.to_thread(proc.join, 10)
                if proc.is_alive():
                    proc.terminate()
                    await asyncio.to_thread(proc.join, 5)
            await asyncio.to_thread(driver.stop)
            await server.stop(grace=1)
            cost_file.set(1.0)
    return [
        BatchMetrics(
            batch_id=m.batch_id,
            completed_at=max(0.0, started_at + m.processing_delay - t0),
            records=m.records,
            processing_delay=m.processing_delay,
            scheduling_delay=m.scheduling_delay,
            batch_interval=INTERVAL,
        )
        for m, started_at in collected
        if started_at + m.processing_delay >= t0
    ]


# ---- main ----------------------------------------------------------------------------------------


def print_batches(name: str, batches: list[BatchMetrics]) -> None:
    print(f"  {name}: batch | start s | records | processing s | Spark scheduling delay s")
    for b in batches:
        start = b.completed_at - b.processing_delay
        print(
            f"  {b.batch_id:>5} | {start:>7.1f} | {b.records:>8,} | {b.processing_delay:>12.2f} | "
            f"{b.lateness:>8.2f}"
        )


def busy_share(sim: Simulation) -> float:
    """Share of the wall time from the first batch's end to the last one's that Spark spent processing:
    the utilisation measure that needs no capacity estimate, so it does not drift with the machine."""
    batches = sim.batches
    span = batches[-1].completed_at - batches[0].completed_at
    return sum(b.processing_delay for b in batches[1:]) / span if span > 0 else 0.0


@dataclass
class Outcome:
    """One system's run of one profile, judged."""

    profile: str
    system: str
    capacity: float
    sim: Simulation | None
    batches: int
    first_change: float | None

    @property
    def peak_intervals(self) -> float | None:
        """Peak Spark scheduling delay, in trigger intervals: of the batches that started at or after
        the first cost change where there is one (the start's own transient is the steady profile's
        figure), else after the third batch."""
        if self.sim is None:
            return None
        if self.first_change is not None:
            return self.sim.peak_delay_since(self.first_change) / INTERVAL
        return self.sim.peak_delay(UNJUDGED) / INTERVAL

    @property
    def starved_after_change(self) -> int | None:
        if self.sim is None or self.first_change is None:
            return None
        return self.sim.starved_after(self.first_change)


def row(outcome: Outcome) -> str:
    sim, name = outcome.sim, outcome.system
    if sim is None:
        return f"{name:<18} | {outcome.capacity:>9,.0f} | {'too few batches':^98} | {outcome.batches:>7}"
    settle = "never" if sim.settle_time is None else f"{sim.settle_time:.1f}"
    after = outcome.starved_after_change
    since = "-" if outcome.first_change is None else f"{sim.peak_delay_since(outcome.first_change):.2f}"
    return (
        f"{name:<18} | {outcome.capacity:>9,.0f} | {sim.utilisation:>10.1%} | {busy_share(sim):>7.1%} | "
        f"{sim.peak_delay(UNJUDGED):>14.2f} | {since:>11} | {settle:>10} | {sim.starved:>7} | "
        f"{'-' if after is None else after:>11} | {len(sim.batches):>7}"
    )


def profile_changes(profile: str, duration: float, factor: float) -> tuple[tuple[float, float], ...]:
    if profile == "halved":
        return ((duration / 3, 2.0), (2 * duration / 3, 1.0))
    if profile == "jumps":
        return jumps(duration, factor, INTERVAL)
    return ()


def figure(
    what: str,
    value: float | None,
    unit: str,
    baseline: str,
    baseline_value: float | None,
    goal: str | None,
    met: bool | None,
    *,
    ratio: bool = True,
) -> dict[str, Any]:
    return {
        "what": what,
        "value": None if value is None else round(value, 4),
        "unit": unit,
        "baseline": baseline,
        "baseline_value": None if baseline_value is None else round(baseline_value, 4),
        "ratio": round(value / baseline_value, 4) if ratio and value is not None and baseline_value else None,
        "goal": goal,
        "met": met,
    }


def result_line(outcomes: list[Outcome], factor: float) -> str:
    """The RESULT line: sluice-model's figures per profile, Spark's DStream loop of the same run as the
    baseline (sluice-spark-pid's where the DStream loop did not run)."""
    figures: list[dict[str, Any]] = []
    by = {(o.profile, o.system): o for o in outcomes}
    for profile in dict.fromkeys(o.profile for o in outcomes):
        model = by.get((profile, "sluice-model"))
        if model is None or model.sim is None:
            continue
        base = by.get((profile, "sparkpid-dstream")) or by.get((profile, "sluice-spark-pid"))
        base_sim = None if base is None else base.sim
        base_name = "none" if base is None else f"{base.system}, same run"
        label = f"{profile} x{factor:g}" if profile == "jumps" else profile
        peak = model.peak_intervals
        base_peak = None if base is None else base.peak_intervals
        goal = "<= 2 intervals" if profile == "jumps" else None
        met = (peak is not None and peak <= 2.0) if profile == "jumps" else None
        figures.append(
            figure(
                f"{label}: peak scheduling delay, sluice-model",
                peak,
                "intervals",
                base_name,
                base_peak,
                goal,
                met,
            )
        )
        if model.first_change is not None:
            starved = model.starved_after_change
            base_starved = None if base is None else base.starved_after_change
            figures.append(
                figure(
                    f"{label}: starved batches after a change, sluice-model",
                    starved,
                    "batches",
                    base_name,
                    base_starved,
                    "0" if profile == "jumps" else None,
                    (starved == 0) if profile == "jumps" else None,
                    ratio=False,
                )
            )
        util = model.sim.utilisation
        figures.append(
            figure(
                f"{label}: utilisation, sluice-model",
                util,
                "share of capacity",
                base_name,
                None if base_sim is None else base_sim.utilisation,
                None,
                None,
            )
        )
        if profile != "jumps":
            settle = model.sim.settle_time
            figures.append(
                figure(
                    f"{label}: settled after, sluice-model",
                    settle,
                    "s",
                    base_name,
                    None if base_sim is None else base_sim.settle_time,
                    None,
                    None,
                )
            )
    return "RESULT " + json.dumps({"bench": "control_loop", "figures": figures})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds per system and profile")
    parser.add_argument(
        "--profile",
        choices=["jumps", "steady", "halved", "both", "all"],
        default="jumps",
        help="both: steady and halved; all: the three",
    )
    parser.add_argument("--only", choices=SYSTEMS, default=None, help="run one system only")
    parser.add_argument("--cost-us", type=float, default=20.0, help="busy-wait per record, microseconds")
    parser.add_argument("--factor", type=float, default=3.5, help="jumps: the per-record cost's multiplier")
    parser.add_argument(
        "--initial-rate", type=float, default=None, help="Sluice's initial rate (default: as sluice serve)"
    )
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument(
        "--batches",
        action="store_true",
        help="also print every batch of every run (a run whose peak after a change exceeds 2 intervals, "
        "or that starved a batch after one, prints them anyway)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: jumps, 24 s, DStream and model")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds the sender runs before the measured run (default: 20 for jumps, where the start's "
        "transient is not the figure, 0 otherwise)",
    )
    args = parser.parse_args()
    if args.quick:
        args.profile, args.duration = "jumps", 24.0
        args.warmup = 10.0 if args.warmup is None else args.warmup

    if not (args.factor > 0 and math.isfinite(args.factor)):
        parser.error("--factor must be a finite number > 0")
    cost = args.cost_us / 1e6
    profiles = {"both": ["steady", "halved"], "all": ["steady", "halved", "jumps"]}.get(
        args.profile, [args.profile]
    )
    systems = [args.only] if args.only else list(SYSTEMS)
    if args.quick and not args.only:
        systems = ["sparkpid-dstream", "sluice-model"]
    in_situ_seconds = 8.0 if args.quick else 15.0

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    warnings.filterwarnings("ignore", category=FutureWarning)
    spark = build_session("local[2]", app_name="sluice-control-loop", conf=SESSION_CONF)
    outcomes: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="sluice-cost-") as tmp:
        cost_file = CostFile(Path(tmp) / "multiplier")
        try:
            for profile in profiles:
                d = args.duration
                changes = profile_changes(profile, d, args.factor)
                lines = []
                for system in systems:
                    # capacity right before each run: the machine is shared and drifts
                    if system == "sparkpid-dstream":
                        cap = measure_capacity(spark, cost, str(cost_file.path), 1)
                        how = "batch mode, 1 core: the receiver pins the other"
                    else:
                        guess = measure_streaming_capacity(spark, cost, str(cost_file.path))
                        cap = measure_in_situ_capacity(spark, cost, cost_file, args, guess, in_situ_seconds)
                        how = (
                            f"Sluice at two pinned rates under ingest load, 2 cores; without ingest "
                            f"{guess.records_per_second:,.0f} rec/s"
                        )
                    print(
                        f"[{profile}] {system}: capacity ({how}): fixed {cap.fixed_cost:.3f} s/batch, "
                        f"{cap.per_record_cost * 1e6:.2f} us/record -> {cap.records_per_second:,.0f} rec/s "
                        f"at {INTERVAL:g} s batches; running for {d:g} s...",
                        flush=True,
                    )
                    warmup = args.warmup if args.warmup is not None else (20.0 if profile == "jumps" else 0.0)
                    if system == "sparkpid-dstream":
                        batches = run_dstream(spark, cost, cost_file, changes, args, warmup)
                    else:
                        estimator = "spark-pid" if system == "sluice-spark-pid" else "model"
                        batches = asyncio.run(
                            run_sluice(spark, estimator, cost, cost_file, changes, args, warmup=warmup)
                        )
                    sim = judge(batches, cap.pipeline(changes), d)
                    # a run that missed item 6's goals prints its batches anyway: it is the one to explain
                    since = sim.peak_delay_since(changes[0][0]) if changes and sim is not None else 0.0
                    starved = sim.starved_after(changes[0][0]) if changes and sim is not None else 0
                    if args.batches or since > 2.0 or starved:
                        print_batches(system, batches)
                    if changes:
                        landed = ", ".join(
                            f"x{factor:g} at {since:.2f} s: "
                            + ("between batches" if ph is None else f"{ph:.0%}")
                            for (since, factor), ph in zip(changes, phases(batches, changes), strict=True)
                        )
                        print(f"  {system}: where each change landed in its batch: {landed}", flush=True)
                    outcome = Outcome(
                        profile,
                        system,
                        cap.records_per_second,
                        sim,
                        len(batches),
                        changes[0][0] if changes else None,
                    )
                    outcomes.append(outcome)
                    lines.append(row(outcome))
                print()
                described = {
                    "halved": f", cost x2 from {d / 3:.0f} s to {2 * d / 3:.0f} s",
                    "jumps": f", cost x{args.factor:g} and back at "
                    + ", ".join(f"{since:.2f}" for since, _ in changes)
                    + " s",
                }.get(profile, "")
                warmed = args.warmup if args.warmup is not None else (20.0 if profile == "jumps" else 0.0)
                after = f", after {warmed:g} s of warm-up" if warmed else ""
                print(
                    f"profile {profile}: {d:g} s{after}, 1 s batches, {args.cost_us:g} us/record{described}"
                )
                print(
                    f"{'system':<18} | {'cap rec/s':>9} | {'avg util':>10} | {'busy':>7} | "
                    f"{'peak delay s':>14} | {'after chg s':>11} | {'settle s':>10} | {'starved':>7} | "
                    f"{'after chg':>11} | {'batches':>7}"
                )
                print("-" * 134)
                for line in lines:
                    print(line)
                print(flush=True)
        finally:
            spark.stop()
    print(result_line(outcomes, args.factor), flush=True)


if __name__ == "__main__":
    main()
