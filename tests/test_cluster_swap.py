"""Swapping a cluster's pipeline under load, on real parts: two receiver nodes replicating to each other
(grpc.aio servers on loopback), a ClusterDriver running a real Spark query over them, a producer on each
node that keeps pushing. The sinks are compared with what was acked: every record exactly once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_service import Load
from test_cluster_source import nodes

from ingest.cluster_driver import ClusterDriver, DriverConfig
from ingest.config import RateConfig
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster

pytestmark = pytest.mark.spark


def values_in(spark: Any, *sinks: Path) -> dict[bytes, list[str]]:
    """value -> the pipeline tags that wrote it, over the sinks' committed files."""
    from pyspark.errors import AnalysisException

    seen: dict[bytes, list[str]] = {}
    for sink in sinks:
        try:
            rows = spark.read.parquet(str(sink)).select("value", "pipeline").collect()
        except AnalysisException:  # nothing committed there
            continue
        for row in rows:
            seen.setdefault(bytes(row["value"]), []).append(row["pipeline"])
    return seen


async def test_a_cluster_driver_swaps_its_pipeline_under_load_and_rolls_a_failed_one_back(
    spark: Any, tmp_path: Path
) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters, "events") as servers:
        config = DriverConfig(
            nodes={n.id: n.target for n in clusters[0].nodes},
            streams=("events",),
            data_dir=tmp_path / "driver",
            trigger_interval=0.5,
            pipeline="swap_pipelines:tag_a",
            rate=RateConfig(estimator="fixed", initial_rate=100_000.0),
        )
        driver = ClusterDriver(config)
        await driver.start(spark)
        try:
            sent: list[bytes] = []

            def on_node(node: int) -> Any:
                def make(first: int, n: int) -> tuple[list[bytes], None]:
                    values = [b"n%d-%d" % (node, first + i) for i in range(n)]
                    sent.extend(values)
                    return values, None

                return make

            loads = [Load(servers[i].target, "events", per_tick=100, make=on_node(i)) for i in (0, 1)]
            pushing = [asyncio.create_task(load.run()) for load in loads]
            await asyncio.sleep(3)
            stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(driver.rate_target or ""))
            before = await stub.GetPipeline(pb.GetPipelineRequest())
            assert (before.pipeline, before.generation, before.state) == (
                "swap_pipelines:tag_a",
                0,
                "running",
            )
            # a pipeline that fails its first batch: rolled back, the old query goes on
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.SwapPipeline(
                    pb.SwapPipelineRequest(
                        pipeline="swap_pipelines:fails_first_batch", first_batch_timeout_seconds=60
                    )
                )
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "refuses batch" in (failed.value.details() or ""), failed.value.details()
            assert driver.error() is None  # a swap's stopped queries are no failure of the driver
            await asyncio.sleep(1)
            asked = time.monotonic()
            view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
            swapped = time.monotonic()
            assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_b", 1, "running")
            assert view.last_swap.outcome == "done", view.last_swap
            # the new query started at the old one's committed end of each node's partition
            assert set(view.last_swap.start_offsets) == {"events/0", "events/1"}, view.last_swap
            assert all(n > 0 for n in view.last_swap.start_offsets.values()), view.last_swap
            await asyncio.sleep(2)
            for load in loads:
                load.stop()
            await asyncio.gather(*pushing)
            for load in loads:
                assert load.longest_ack_pause(asked, swapped) < 1.5  # the nodes never waited for Spark
            sinks = (config.data_dir / "sink", Path(view.sink_dir))  # sink-g1-try2: after the failed try
            deadline = time.monotonic() + 120
            seen = await asyncio.to_thread(values_in, spark, *sinks)
            while len(seen) < len(sent) and time.monotonic() < deadline:
                assert driver.error() is None, driver.error()
                await asyncio.sleep(0.5)
                seen = await asyncio.to_thread(values_in, spark, *sinks)
            assert sorted(seen) == sorted(sent)  # every acked record, on both nodes
            assert all(len(tags) == 1 for tags in seen.values())  # each once, across both sinks
            old = values_in(spark, sinks[0])
            new = values_in(spark, sinks[1])
            assert old and new and {t for tags in old.values() for t in tags} == {"a"}
            assert {t for tags in new.values() for t in tags} == {"b"}
            # the driver's Admin serves the pipeline only; settings are the nodes'
            with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                await stub.GetConfig(pb.GetConfigRequest())
            assert elsewhere.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "each receiver node" in (elsewhere.value.details() or "")
        finally:
            await driver.stop()
