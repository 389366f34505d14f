"""End to end into Spark: records/s a live publisher gets through Sluice into a Spark query.

Run: python bench/end_to_end.py [--records 3000000] [--record-bytes 100] [--sink noop|parquet]

One Sluice server (fsync on) and one Spark session (local[*]) in this process, the publisher in a
subprocess. After a warm-up batch (Spark's first micro-batch pays ~10 s of worker start-up), the
publisher pushes --records as fast as credit allows. Prints the acked ingest rate and the end-to-end rate
(records processed by the query / time from first send to the batch that completes the last record),
and their ratio: both measured in the same run, so the ratio holds on a noisy machine.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver
from ingest.server import SluiceServer
from ingest.spark.pipeline import parquet_pipeline
from ingest.spark.session import build_session
from sluice_client import Producer


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


async def run(args: argparse.Namespace) -> None:
    spark = build_session("local[*]", app_name="sluice-bench")
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
            if args.sink == "parquet"
            else lambda df: df.writeStream.format("noop")
        )
        driver = SparkDriver(spark, config, pipeline, query_name="bench")
        await asyncio.to_thread(driver.start)
        try:
            async with Producer(server.target, "bench") as warm:
                await warm.send_many([b"w" * args.record_bytes] * 1000)
            while driver.records_processed < 1000:
                await asyncio.sleep(0.2)
            ctx = mp.get_context("spawn")
            results = ctx.Queue()
            proc = ctx.Process(target=publish, args=(server.target, args.records, args.record_bytes, results))
            proc.start()
            total = 1000 + args.records
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
    spark.stop()
    ingest = args.records / (acked - started)
    e2e = args.records / (done - started)
    print(
        f"{args.records:,} records of {args.record_bytes} B, sink {args.sink}, trigger {args.trigger:g} s, "
        f"local[*] on {mp.cpu_count()} cores"
    )
    print(f"  ingest (acked)     {ingest:>12,.0f} rec/s")
    print(f"  end to end         {e2e:>12,.0f} rec/s   {e2e / ingest:6.1%} of ingest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=3_000_000)
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--trigger", type=float, default=1.0, help="trigger interval, seconds")
    parser.add_argument("--sink", choices=["noop", "parquet"], default="noop")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
