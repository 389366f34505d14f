"""Changing the running query under load, on real parts: a real server, real Spark, a producer that keeps
pushing; the sinks are compared with what was acked (every offset exactly once)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver, drive_rate
from ingest.pipeline_manager import PipelineManager
from ingest.server import SluiceServer
from receivers.receiver import ReceiverConfig
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

pytestmark = pytest.mark.spark


@contextlib.asynccontextmanager
async def service(spark: Any, data_dir: Path, *streams: str, pipeline: str = "") -> AsyncIterator[SluiceServer]:
    """What `sluice serve` runs, in this process: the server, the driver and the pipeline manager."""
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=data_dir,
        streams=streams or ("events",),
        receiver=ReceiverConfig(block_interval=0.05),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
        pipeline=pipeline,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(
        spark,
        server.config,
        query_name=f"swap{abs(hash(data_dir)) % 10_000}",
        rate_target=server.rate_target,
        rate_token_file=server.pipeline_token_file,
        streams=server.streams.known,
    )
    drive_rate(driver, server, asyncio.get_running_loop())
    manager = PipelineManager(driver, server, asyncio.get_running_loop())
    server.pipeline_control = manager
    await manager.start()
    try:
        yield server
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


class Load:
    """A producer that keeps pushing numbered records; records when acks arrive."""

    def __init__(self, target: str, stream: str, per_tick: int = 200) -> None:
        self.target, self.stream, self.per_tick = target, stream, per_tick
        self.sent = 0
        self.ack_times: list[tuple[float, int]] = []
        self._stop = asyncio.Event()
        self.error: BaseException | None = None

    async def run(self) -> None:
        try:
            async with Producer(self.target, self.stream, batch_size=500) as producer:
                while not self._stop.is_set():
                    values = [f"{self.stream}-{self.sent + i}".encode() for i in range(self.per_tick)]
                    await producer.send_many(values)
                    self.sent += len(values)
                    await asyncio.sleep(0.02)
                    self.ack_times.append((time.monotonic(), producer.acked))
                await producer.flush(timeout=60)
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


async def test_swap_under_load_loses_nothing_and_doubles_nothing(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(3)
        stub = admin(server)
        before = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (before.pipeline, before.generation, before.state) == ("swap_pipelines:tag_a", 0, "running")
        asked = time.monotonic()
        view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        swapped = time.monotonic()
        await asyncio.sleep(2)
        load.stop()
        await pushing
        assert view.pipeline == "swap_pipelines:tag_b" and view.generation == 1 and view.state == "running"
        assert view.last_swap.outcome == "done", view.last_swap
        assert view.last_swap.start_offsets["events"] > 0
        # acks kept flowing through the swap: no pause near a trigger interval, let alone the swap's
        pause = load.longest_ack_pause(asked, swapped)
        print(f"swap took {swapped - asked:.1f} s, processing gap {view.last_swap.processing_gap_seconds:.1f} s, "
              f"longest ack pause during it {pause:.2f} s")
        assert pause < 1.5
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink", tmp_path / "sink-g1")
        assert sorted(offsets) == list(range(load.sent))  # each acked record once, across both sinks
        old = offsets_in(spark, tmp_path / "sink")
        new = offsets_in(spark, tmp_path / "sink-g1")
        assert old and new and max(old) < min(new)  # the new query started where the old one ended
        assert min(new) == view.last_swap.start_offsets["events"]


async def test_a_swap_that_fails_is_rolled_back(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        stub = admin(server)
        await asyncio.sleep(2)
        # a spec that does not load: refused before anything stops
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="no_such_module:nothing"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no_such_module" in (refused.value.details() or "")
        # fails as it is built, then fails its first batch: both rolled back, the old query runs on
        for spec, said in (("swap_pipelines:broken_at_start", "cannot be built"),
                           ("swap_pipelines:fails_first_batch", "refuses batch")):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec, first_batch_timeout_seconds=60))
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert said in (failed.value.details() or ""), failed.value.details()
            view = await stub.GetPipeline(pb.GetPipelineRequest())
            assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
            assert view.last_swap.outcome == "rolled back" and said in view.last_swap.error
        await asyncio.sleep(1)
        load.stop()
        await pushing
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink")
        assert sorted(offsets) == list(range(load.sent))
