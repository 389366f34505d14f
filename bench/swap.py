"""What a pipeline swap costs while Nexmark events flow: the ingestion pause, the processing gap, and the
extra delay the records waiting through the swap see.

Run: python bench/swap.py [--rate 5000] [--swaps 3] [--trigger 1] [--queries q1,q2]

One Sluice service in this process (server, Spark local[2], the pipeline manager, as `sluice serve` runs
them), a producer pushing Nexmark events at --rate through the SDK, and swaps (--queries: Q1 -> Q2 ->
Q1 ...) at intervals. Measured in the same run, against a baseline from the minutes before the first swap:

- ingestion pause: the longest time acks did not advance during a swap, against the longest in a window
  of the same length before it (goal: none, i.e. ratio ~1: acks never wait for Spark);
- processing gap: from the end of the old query's last batch to the end of the new one's first
  (PipelineSwap.processing_gap_seconds), and the new query's start-up within it;
- extra delay: the latency of a batch's oldest record (batch end - when the receiver took it), the
  largest among the new query's first batches, minus the median before the swap. The goal: under one
  trigger interval plus the new query's start-up (the seed's Flink add-on: one 3,500 ms spike on Q8).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from ingest.config import RateConfig, ServeConfig
from ingest.nexmark.generator import GeneratorConfig, NexmarkGenerator
from ingest.server import SluiceServer
from ingest.spark.listener import BatchCompleted
from ingest.spark.session import build_session
from ingest.spark_side import attach_spark
from receivers.config import ReceiverConfig
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

STREAM = "nexmark"


async def produce(target: str, rate: float, stop: asyncio.Event, acks: list[tuple[float, int]]) -> int:
    generator = NexmarkGenerator(GeneratorConfig(events_per_second=rate))
    tick = 0.02
    per_tick = max(1, round(rate * tick))
    sent = 0
    async with Producer(target, STREAM, batch_size=1000) as producer:
        started = time.monotonic()
        while not stop.is_set():
            made = generator.take(per_tick)
            await producer.send_many([e.encode() for e in made], [e.key for e in made])
            sent += per_tick
            ahead = started + sent / rate - time.monotonic()
            await asyncio.sleep(max(0.0, ahead))
            acks.append((time.monotonic(), producer.acked))
        await producer.flush(timeout=120)
        acks.append((time.monotonic(), producer.acked))
    return sent


def longest_pause(acks: list[tuple[float, int]], since: float, until: float) -> float:
    longest, last_change, last = 0.0, since, -1
    for when, acked in acks:
        if since <= when <= until and acked != last:
            longest = max(longest, when - last_change)
            last_change, last = when, acked
    return max(longest, until - last_change) if last_change >= since else longest


async def run(args: argparse.Namespace) -> None:
    queries = [f"ingest.nexmark.queries:{q.strip()}" for q in args.queries.split(",")]
    spark = build_session("local[2]", app_name="sluice-bench-swap")
    with tempfile.TemporaryDirectory(prefix="sluice-swap-") as tmp:
        config = ServeConfig(
            port=0,
            metrics_port=None,
            data_dir=Path(tmp),
            streams=(STREAM,),
            receiver=ReceiverConfig(block_interval=0.1),
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),
            trigger_interval=args.trigger,
            pipeline=queries[0],
        )
        server = SluiceServer(config)
        await server.start()
        driver, _ = await attach_spark(spark, server)
        loop = asyncio.get_running_loop()
        latencies: list[tuple[str, float, float]] = []  # (run id, batch end, oldest record's latency)

        def measure(batch: BatchCompleted) -> None:
            end = batch.started_at + batch.processing_seconds
            taken = [t for s, o in (batch.start_offset or {}).items() if (t := server.received_at(s, o))]
            if taken and batch.num_input_rows > 0:
                latencies.append((batch.run_id, end, end - min(taken)))

        driver.on_batch(lambda batch: loop.call_soon_threadsafe(measure, batch))
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        acks: list[tuple[float, int]] = []
        stop = asyncio.Event()
        producing = asyncio.create_task(produce(server.target, args.rate, stop, acks))
        rows: list[dict[str, Any]] = []
        try:
            await asyncio.sleep(args.warm_up)
            for k in range(args.swaps):
                before = [lat for _, end, lat in latencies if end > time.time() - args.settle]
                old_runs = {r for r, _, _ in latencies}
                calm_from = time.monotonic() - args.settle
                calm_pause = longest_pause(acks, calm_from, time.monotonic())
                asked = time.monotonic()
                request = pb.SwapPipelineRequest(pipeline=queries[(k + 1) % len(queries)])
                view = await stub.SwapPipeline(request)
                done = time.monotonic()
                swap = view.last_swap
                await asyncio.sleep(args.settle)
                new_run = next((r for r, _, _ in latencies if r not in old_runs), None)
                after = [lat for r, _, lat in latencies if r == new_run][:3]
                base = statistics.median(before) if before else float("nan")
                rows.append(
                    {
                        "swap": f"{_short(swap.from_pipeline)}->{_short(swap.to_pipeline)}",
                        "took": done - asked,
                        "ack_pause": longest_pause(acks, asked, done),
                        "calm_pause": calm_pause,
                        "gap": swap.processing_gap_seconds,
                        "startup": swap.startup_seconds,
                        "base_latency": base,
                        "spike": max(after) if after else float("nan"),
                    }
                )
        finally:
            stop.set()
            sent = await producing
            await server.stop()
            await asyncio.to_thread(driver.stop)
            spark.stop()
    print(f"Nexmark at {args.rate:,.0f} events/s, trigger {args.trigger:g} s, {sent:,} events pushed")
    print(
        f"{'swap':<8} {'took s':>7} {'ack pause s':>12} {'(calm) s':>9} {'x calm':>7} {'gap s':>6} "
        f"{'start-up s':>10} {'latency s':>9} {'spike s':>8} {'extra s':>8} {'goal s':>7}"
    )
    for r in rows:
        extra = r["spike"] - r["base_latency"]
        goal = args.trigger + r["startup"]
        print(
            f"{r['swap']:<8} {r['took']:>7.2f} {r['ack_pause']:>12.2f} {r['calm_pause']:>9.2f} "
            f"{r['ack_pause'] / max(r['calm_pause'], 1e-3):>7.2f} {r['gap']:>6.2f} {r['startup']:>10.2f} "
            f"{r['base_latency']:>9.2f} {r['spike']:>8.2f} {extra:>8.2f} {goal:>7.2f}"
        )


def _short(spec: str) -> str:
    return spec.rsplit(":", 1)[-1] or "builtin"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=5000.0, help="events per second pushed")
    parser.add_argument("--swaps", type=int, default=3)
    parser.add_argument("--queries", default="q1,q2", help="the pipelines swapped in turn (Nexmark names)")
    parser.add_argument("--trigger", type=float, default=1.0, help="trigger interval, seconds")
    parser.add_argument("--warm-up", type=float, default=20.0, help="seconds before the first swap")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds between swaps")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
