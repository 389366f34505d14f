"""Nexmark end to end: events/s each query gets through a real Sluice server into Spark (local[2]).

Run: python bench/nexmark.py [--events 1000000] [--queries q0,q1,q2,q5,q7,q8] [--trigger 1]

Per query: a fresh Sluice server (fsync on, unthrottled) with the query as its pipeline, run by a
SparkDriver on one shared Spark session, as in bench/end_to_end.py. A publisher subprocess makes the
events first (ingest.nexmark.generator; making them is not measured), pushes a warm-up of 2,000 (Spark's
first micro-batch pays for starting its workers), then, once the query has processed those, pushes
--events as fast as the server's credit allows. Throughput is events / time from the first send to the
end of the micro-batch that completes the last event, counted as the query's input rows (progress
events), not as sink rows (Q2, Q5, Q7, Q8 write few). The ratio to Q0 (pass-through) measured in the same
run is the figure to compare: the machine is shared and noisy.
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
from ingest.nexmark.generator import GeneratorConfig, NexmarkGenerator
from ingest.nexmark.queries import QUERIES
from ingest.server import SluiceServer
from ingest.spark.session import build_session
from sluice_client import Producer

STREAM = "nexmark"
WARM_UP = 2_000


def publish(target: str, events: int, config: GeneratorConfig, go: Any, results: Any) -> None:
    """In a subprocess: make WARM_UP + events events, push the warm-up, wait for `go`, push the rest."""

    async def main() -> None:
        generator = NexmarkGenerator(config)
        made = generator.take(WARM_UP + events)
        values = [e.encode() for e in made]
        keys = [e.key for e in made]
        del made
        async with Producer(target, STREAM, batch_size=4096) as producer:
            await producer.send_many(values[:WARM_UP], keys=keys[:WARM_UP])
            await producer.flush(timeout=120)
            results.put(("warm", time.time()))
            await asyncio.to_thread(go.wait)
            started = time.time()
            for i in range(WARM_UP, WARM_UP + events, 4096):
                await producer.send_many(values[i : i + 4096], keys=keys[i : i + 4096])
            await producer.flush(timeout=600)
            results.put(("done", started, time.time(), producer.acked))

    asyncio.run(main())


async def run_query(spark: Any, name: str, args: argparse.Namespace) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        config = ServeConfig(
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),  # throughput: unthrottled
            port=0,
            metrics_port=None,
            data_dir=Path(tmp),
            streams=(STREAM,),
            trigger_interval=args.trigger,
        )
        server = SluiceServer(config)
        await server.start()
        driver = SparkDriver(spark, config, QUERIES[name], query_name=f"nexmark-{name}")
        await asyncio.to_thread(driver.start)
        ctx = mp.get_context("spawn")
        go, results = ctx.Event(), ctx.Queue()
        generator = GeneratorConfig(seed=args.seed, base_time_ms=round(time.time() * 1000))
        proc = ctx.Process(target=publish, args=(server.target, args.events, generator, go, results))
        proc.start()
        try:
            await asyncio.to_thread(results.get, True, 300)  # warm-up acked
            await wait_processed(driver, WARM_UP)
            go.set()
            await wait_processed(driver, WARM_UP + args.events)
            done = time.time()
            _, started, acked_at, acked = await asyncio.to_thread(results.get, True, 600)
            proc.join(30)
        finally:
            if proc.is_alive():
                proc.kill()
            await server.stop(grace=1)
            await asyncio.to_thread(driver.stop)
    assert acked == WARM_UP + args.events, f"{acked} acked of {WARM_UP + args.events}"
    return {"seconds": done - started, "ingest": args.events / (acked_at - started)}


async def wait_processed(driver: SparkDriver, events: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while driver.records_processed < events:
        if driver.error():
            raise RuntimeError(driver.error())
        if time.monotonic() > deadline:
            raise TimeoutError(f"the query processed {driver.records_processed} of {events} events")
        await asyncio.sleep(0.05)


async def run(args: argparse.Namespace) -> None:
    names = [q.strip() for q in args.queries.split(",") if q.strip()]
    unknown = [q for q in names if q not in QUERIES]
    if unknown:
        raise SystemExit(f"unknown queries {unknown}; there are {', '.join(QUERIES)}")
    spark = build_session("local[2]", app_name="sluice-nexmark-bench")
    # a query stopped mid-batch logs errors; a query that fails shows through driver.error()
    spark.sparkContext.setLogLevel("FATAL")
    measured: dict[str, dict[str, float]] = {}
    try:
        for name in names:
            measured[name] = await run_query(spark, name, args)
            m = measured[name]
            print(f"  {name}: {args.events / m['seconds']:,.0f} events/s", flush=True)
    finally:
        spark.stop()
    print(
        f"\n{args.events:,} events a query (after {WARM_UP:,} warm-up), trigger {args.trigger:g} s, "
        f"local[2] on {mp.cpu_count()} cores"
    )
    print(f"{'query':<6} {'events':>10} {'seconds':>8} {'events/s':>10} {'vs q0':>6} {'ingest/s':>10}")
    base = measured.get("q0")
    for name, m in measured.items():
        rate = args.events / m["seconds"]
        ratio = f"{rate / (args.events / base['seconds']):.2f}" if base else "-"
        seconds, ingest = m["seconds"], m["ingest"]
        print(f"{name:<6} {args.events:>10,} {seconds:>8.1f} {rate:>10,.0f} {ratio:>6} {ingest:>10,.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000, help="events pushed per query")
    parser.add_argument("--queries", default=",".join(QUERIES), help="comma-separated, e.g. q0,q1")
    parser.add_argument("--trigger", type=float, default=1.0, help="trigger interval, seconds")
    parser.add_argument("--seed", type=int, default=42)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
