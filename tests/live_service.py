"""A live service in the test process, as `sluice serve` runs it (server, Spark driver, pipeline manager),
and a producer that keeps pushing: for the tests that change the running system under load."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc

from ingest.config import RateConfig, ServeConfig
from ingest.server import SluiceServer
from ingest.spark_side import attach_spark
from receivers.config import ReceiverConfig
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc


@contextlib.asynccontextmanager
async def service(
    spark: Any,
    data_dir: Path,
    *streams: str,
    pipeline: str = "",
    rate: RateConfig | None = None,
    reset_pipeline: bool = False,
) -> AsyncIterator[SluiceServer]:
    """What `sluice serve` runs, in this process: the server, the driver and the pipeline manager
    (`rate`: the operator's fixed unlimited rate unless given). What the query's start raises is raised
    here, the server stopped."""
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=data_dir,
        streams=streams or ("events",),
        receiver=ReceiverConfig(block_interval=0.05),
        rate=rate or RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
        pipeline=pipeline,
        reset_pipeline=reset_pipeline,
    )
    server = SluiceServer(config)
    await server.start()
    try:
        driver, _ = await attach_spark(spark, server, query_name=f"swap{abs(hash(data_dir)) % 10_000}")
    except BaseException:
        await server.stop(grace=1)
        raise
    try:
        yield server
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


Make = Callable[[int, int], tuple[list[bytes], list[bytes | None] | None]]
"""(first record number, count) -> the records' values and keys."""


def numbered(stream: str) -> Make:
    return lambda first, n: ([f"{stream}-{first + i}".encode() for i in range(n)], None)


SWAP_ACK_PAUSE = 3.0
"""The longest an ack may wait while a pipeline is swapped (acks never wait for Spark): a few block
intervals and fsyncs on a loaded 2-core machine, where the swap itself takes 5-15 s. 1.5 s failed once
at 1.75 s with other test runs on the cores."""


class Load:
    """A producer that keeps pushing records (`per_tick` every 20 ms); records when acks arrive."""

    def __init__(self, target: str, stream: str, per_tick: int = 200, make: Make | None = None) -> None:
        self.target, self.stream, self.per_tick = target, stream, per_tick
        self.make = make or numbered(stream)
        self.sent = 0
        self.ack_times: list[tuple[float, int]] = []
        self._stop = asyncio.Event()
        self.error: BaseException | None = None

    async def run(self) -> None:
        try:
            # a bounded backlog (half a second of the offered load): intake stays saturated, and what
            # is left to flush at the stop is not the Producer's default 500,000 records, which a slow
            # pipeline on a loaded machine did not drain within the flush's timeout
            backlog = max(25 * self.per_tick, 10_000)
            async with Producer(self.target, self.stream, batch_size=500, max_buffered=backlog) as producer:
                while not self._stop.is_set():
                    values, keys = self.make(self.sent, self.per_tick)
                    await producer.send_many(values, keys)
                    self.sent += len(values)
                    await asyncio.sleep(0.02)
                    self.ack_times.append((time.monotonic(), producer.acked))
                await producer.flush(timeout=120)
                self.ack_times.append((time.monotonic(), producer.acked))
        except BaseException as exc:
            self.error = exc
            raise

    def stop(self) -> None:
        self._stop.set()

    def longest_ack_pause(self, since: float, until: float) -> float:
        """The longest time acks did not advance between `since` and `until` (monotonic)."""
        longest, last_change, last = 0.0, since, -1
        for when, acked in self.ack_times:
            if when < since or when > until:
                continue
            if acked != last:
                longest = max(longest, when - last_change)
                last_change, last = when, acked
        return longest


def offsets_in(spark: Any, *sinks: Path) -> list[int]:
    from pyspark.errors import AnalysisException

    offsets: list[int] = []
    for sink in sinks:
        try:
            offsets += [r["offset"] for r in spark.read.parquet(str(sink)).select("offset").collect()]
        except AnalysisException:  # no batch committed there
            continue
    return offsets


async def wait_for_offsets(spark: Any, n: int, *sinks: Path, timeout: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        got = await asyncio.to_thread(offsets_in, spark, *sinks)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.5)


def admin(server: SluiceServer) -> Any:
    return pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
