"""End to end into Spark: records/s a live publisher gets through Sluice into a Spark query.

Run: python bench/end_to_end.py [--records 3000000] [--record-bytes 100] [--sink both|noop|parquet]
     [--quick]

One Spark session (local[*]) in this process; per sink one Sluice server (fsync on) and its query, the
publisher in a subprocess. After a warm-up (Spark's first micro-batch pays for its Python workers, and
the JVM compiles the write path in the first few hundred thousand records: --warm records through the
same query), the publisher pushes --records as fast as credit allows. Prints the acked ingest rate and
the end-to-end rate (records processed by the query / time from first send to the batch that completes
the last record) for each sink; with both sinks, the Parquet rate against the noop sink's (Spark's
read path without a write, the same run's baseline).

Then (unless --no-fixed-cost) Spark's fixed cost per micro-batch, without Sluice's server: blocks
written to a block store beforehand, read by the default Parquet pipeline with trigger 0 and
maxRecordsPerBatch at several sizes; each batch's triggerExecution time (from the query's progress)
fitted as fixed + per_record * records. A batch capped at rate x trigger interval (`sluice serve`'s
rate control) spends `fixed` of each interval on that cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver
from ingest.server import SluiceServer
from ingest.spark.pipeline import parquet_pipeline, start_query
from ingest.spark.session import build_session
from receivers.block import PLAIN_SCHEMA
from receivers.config import FsyncPolicy
from receivers.wal import WalBlockStore
from sluice_client import Producer

GOAL = 500_000
"""Issue 17, item 3: end to end into Parquet at 500k records/s or more."""


def publish(target: str, records: int, record_bytes: int, results: Any) -> None:
    async def main() -> None:
        values = [b"v" * record_bytes] * 4096
        async with Producer(target, "bench", batch_size=4096) as producer:
            started = time.time()
            sent = 0
            while sent < records:
                chunk = values[: records - sent]
                await producer.send_many(chunk)
                sent += len(chunk)
            await producer.flush(timeout=600)
            results.put((started, time.time()))

    asyncio.run(main())


async def end_to_end(spark: Any, args: argparse.Namespace, sink: str) -> tuple[float, float]:
    """(acked ingest rate, end-to-end rate) of one run into `sink`."""
    with tempfile.TemporaryDirectory() as tmp:
        config = ServeConfig(
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),  # throughput: unthrottled
            port=0,
            metrics_port=None,
            data_dir=Path(tmp),
            streams=("bench",),
            trigger_interval=args.trigger,
        )
        server = SluiceServer(config)
        await server.start()
        pipeline = (
            parquet_pipeline(config.sink_dir)
            if sink == "parquet"
            else lambda df: df.writeStream.format("noop")
        )
        driver = SparkDriver(spark, config, pipeline, query_name=f"bench_{sink}")
        await asyncio.to_thread(driver.start)
        try:
            async with Producer(server.target, "bench") as warm:
                await warm.send_many([b"w" * args.record_bytes] * 1000)  # the first batch: workers start
                while driver.records_processed < 1000:
                    await asyncio.sleep(0.1)
                await warm.send_many([b"w" * args.record_bytes] * args.warm)  # the JIT compiles
            while driver.records_processed < 1000 + args.warm:
                await asyncio.sleep(0.1)
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            proc = ctx.Process(target=publish, args=(server.target, args.records, args.record_bytes, results))
            proc.start()
            total = 1000 + args.warm + args.records
            while driver.records_processed < total:
                if driver.error():
                    raise RuntimeError(driver.error())
                await asyncio.sleep(0.05)
            done = time.time()
            started, acked = await asyncio.to_thread(results.get, True, 600)
            proc.join(30)
        finally:
            await server.stop(grace=1)
            await asyncio.to_thread(driver.stop)
    return args.records / (acked - started), args.records / (done - started)


def write_blocks(root: Path, records: int, record_bytes: int, block_records: int = 100_000) -> None:
    """`records` records of `record_bytes` in blocks of `block_records`, in 4096-record batches as a
    producer's would be, into a block store at `root` (stream "bench")."""
    store = WalBlockStore(root, fsync=FsyncPolicy.off())
    seq, offset = store.recover("bench")
    values = pa.array([b"v" * record_bytes] * block_records, pa.binary())
    keys = pa.nulls(block_records, pa.binary())
    stamps = pa.array(np.full(block_records, time.time_ns() // 1000, dtype=np.int64)).cast(
        pa.timestamp("us", tz="UTC")
    )
    block = pa.RecordBatch.from_arrays([keys, values, stamps], schema=PLAIN_SCHEMA)
    while records > 0:
        n = min(block_records, records)
        batches = [block.slice(i, min(4096, n - i)) for i in range(0, n, 4096)]
        store.write("bench", seq, offset, 0, batches)
        seq, offset, records = seq + 1, offset + n, records - n
    store.close()


def fixed_cost(spark: Any, sizes: list[int], batches: int, record_bytes: int) -> tuple[float, float, list]:
    """Fit triggerExecution = fixed + per_record * records over batches of `sizes` records (each size:
    `batches` batches, the first of each query left out) read from pre-written blocks into Parquet;
    returns (fixed seconds, per-record seconds, [(records, seconds)])."""
    points: list[tuple[int, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, size in enumerate(sizes):
            root = Path(tmp) / f"blocks{i}"
            write_blocks(root, size * (batches + 1), record_bytes)
            query = start_query(
                spark,
                store_root=root,
                streams=["bench"],
                pipeline=parquet_pipeline(Path(tmp) / f"sink{i}"),
                checkpoint_dir=Path(tmp) / f"checkpoint{i}",
                trigger_seconds=0,
                query_name=f"bench_fixed_{i}",
                max_records_per_batch=size,
            )
            try:
                deadline = time.monotonic() + 600
                while sum(p.numInputRows for p in query.recentProgress) < size * (batches + 1):
                    if not query.isActive or time.monotonic() > deadline:
                        raise RuntimeError(f"fixed-cost query stopped or stuck: {query.exception()}")
                    time.sleep(0.05)
                progress = [p for p in query.recentProgress if p.numInputRows]
            finally:
                query.stop()
            points += [(p.numInputRows, p.durationMs["triggerExecution"] / 1000) for p in progress[1:]]
    x = np.array([n for n, _ in points], dtype=float)
    y = np.array([s for _, s in points], dtype=float)
    (fixed, per_record), *_ = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)
    return float(fixed), float(per_record), points


def figure(what: str, value: float, unit: str, baseline: str, baseline_value: float | None, goal: str,
           met: bool | None) -> dict[str, Any]:  # fmt: skip
    ratio = value / baseline_value if baseline_value else None
    return {
        "what": what,
        "value": round(value, 3),
        "unit": unit,
        "baseline": baseline,
        "baseline_value": None if baseline_value is None else round(baseline_value, 3),
        "ratio": None if ratio is None else round(ratio, 3),
        "goal": goal,
        "met": met,
    }


async def run(args: argparse.Namespace) -> None:
    spark = build_session("local[*]", app_name="sluice-bench")
    sinks = ["noop", "parquet"] if args.sink == "both" else [args.sink]
    rates: dict[str, tuple[float, float]] = {}
    for sink in sinks:
        rates[sink] = await end_to_end(spark, args, sink)
    fit: tuple[float, float, list] | None = None
    if not args.no_fixed_cost:
        fit = await asyncio.to_thread(
            fixed_cost, spark, args.fixed_sizes, args.fixed_batches, args.record_bytes
        )
    spark.stop()

    print(
        f"{args.records:,} records of {args.record_bytes} B after {args.warm:,} warm-up ones, "
        f"trigger {args.trigger:g} s, local[*] on {mp.cpu_count()} cores"
    )
    for sink, (ingest, e2e) in rates.items():
        print(f"  sink {sink:8s} ingest (acked) {ingest:>12,.0f} rec/s   end to end {e2e:>12,.0f} rec/s")
    figures = []
    if "parquet" in rates:
        e2e = rates["parquet"][1]
        base = rates["noop"][1] if "noop" in rates else None
        if base:
            print(f"  Parquet end to end: {e2e / base:.2f}x the noop sink's (Spark's read path alone)")
        figures.append(
            figure(
                f"end to end into Parquet, {args.record_bytes} B records",
                e2e, "records/s", "the noop sink end to end, same run", base, f">= {GOAL:,} records/s",
                e2e >= GOAL,
            )
        )  # fmt: skip
    elif "noop" in rates:
        e2e = rates["noop"][1]
        figures.append(figure("end to end into the noop sink", e2e, "records/s", "acked ingest, same run",
                              rates["noop"][0], "", None))  # fmt: skip
    if fit is not None:
        fixed, per_record, points = fit
        print(
            f"  Parquet batch cost (pre-written blocks, trigger 0, {len(points)} batches of "
            f"{', '.join(f'{s:,}' for s in args.fixed_sizes)} records): "
            f"{fixed * 1000:.0f} ms fixed + {per_record * 1e9:.0f} ns/record"
        )
        for size in args.fixed_sizes:
            took = [s for n, s in points if n == size]
            if took:
                mean = sum(took) / len(took)
                print(
                    f"    {size:>9,} records: {mean * 1000:6.0f} ms a batch, "
                    f"{min(1.0, fixed / mean):5.0%} of it fixed, {size / mean:>10,.0f} rec/s"
                )
        capped = 1 / (per_record * args.trigger) * max(0.0, args.trigger - fixed)
        print(
            f"    a batch capped at rate x {args.trigger:g} s: at most {capped:,.0f} rec/s "
            f"({max(0.0, 1 - fixed / args.trigger):.0%} of the interval left for records)"
        )
        figures.append(
            figure("fixed cost per Parquet micro-batch", fixed * 1000, "ms", "", None, "", None)
        )  # fmt: skip
    print("RESULT " + json.dumps({"bench": "end_to_end", "figures": figures}))


def sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3_000_000)
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--warm", type=int, default=300_000, help="records through the query before timing")
    parser.add_argument("--trigger", type=float, default=1.0, help="trigger interval, seconds")
    parser.add_argument("--sink", choices=["both", "noop", "parquet"], default="both")
    parser.add_argument("--fixed-sizes", type=sizes, default=[25_000, 100_000, 400_000],
                        help="batch sizes of the fixed-cost fit, comma-separated")  # fmt: skip
    parser.add_argument("--fixed-batches", type=int, default=6, help="batches per size in the fit")
    parser.add_argument("--no-fixed-cost", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a short run (1M records, a smaller fit)")
    args = parser.parse_args(argv)
    if args.quick:
        args.records, args.warm, args.fixed_batches = 1_000_000, 100_000, 3
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
