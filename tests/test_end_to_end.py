"""End to end on real parts: Producer -> gRPC -> receiver -> blocks -> Spark streaming query -> Parquet."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import Any

import pytest

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver
from ingest.server import SluiceServer
from receivers.config import ReceiverConfig
from sluice_client import Producer

pytestmark = pytest.mark.spark

N = 100_000


def sink_rows(spark: Any, sink: Path) -> int:
    from pyspark.errors import AnalysisException

    try:
        return int(spark.read.parquet(str(sink)).count())
    except AnalysisException:  # no batch committed yet
        return 0


async def test_100k_records_reach_the_parquet_sink_exactly(spark: Any, tmp_path: Path) -> None:
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("events",),
        receiver=ReceiverConfig(block_interval=0.1),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="e2e")
    server.batches_completed = lambda: driver.batches_completed
    await asyncio.to_thread(driver.start)
    try:
        values = [f"{i}:{'x' * (i % 50)}".encode() for i in range(N)]
        keys = [None if i % 3 else f"k{i % 7}".encode() for i in range(N)]
        started = time.monotonic()
        async with Producer(server.target, "events", batch_size=2_000) as producer:
            await producer.send_many(values[: N // 2], keys[: N // 2])
            for i in range(N // 2, N):  # and one by one
                await producer.send(values[i], keys[i])
            await producer.flush(timeout=60)
            assert producer.acked == N
        print(f"pushed and acked {N} records in {time.monotonic() - started:.1f} s")
        deadline = time.monotonic() + 180
        while sink_rows(spark, config.sink_dir) < N and time.monotonic() < deadline:
            assert driver.error() is None, driver.error()
            await asyncio.sleep(1)
        df = spark.read.parquet(str(config.sink_dir))
        assert df.columns == ["key", "value", "topic", "partition", "offset", "timestamp", "timestampType"]
        rows = df.orderBy("offset").select("key", "value", "topic", "offset", "timestampType").collect()
        assert len(rows) == N
        assert [r["offset"] for r in rows] == list(range(N))
        assert [bytes(r["value"]) for r in rows] == values
        assert [None if r["key"] is None else bytes(r["key"]) for r in rows] == keys
        assert {r["topic"] for r in rows} == {"events"}
        assert {r["timestampType"] for r in rows} == {1}  # Kafka's LogAppendTime: the receiver's clock
        deadline = time.monotonic() + 30  # progress events reach the listener asynchronously
        while driver.batches_completed < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert driver.batches_completed >= 1
        # once Spark's commit log has a batch, the blocks it covered leave the store, without a next
        # batch (the driver releases them on the batch's progress event)
        deadline = time.monotonic() + 60
        while server.store.blocks("events") and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert server.store.blocks("events") == []
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


async def test_user_pipeline_from_a_module_spec(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "upper"
    module = tmp_path / "my_pipelines.py"
    module.write_text(
        "def upper(df):\n"
        "    return (df.selectExpr('upper(CAST(value AS STRING)) AS line', 'offset')\n"
        f"            .writeStream.format('parquet').option('path', {str(out)!r}))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path / "data",
        streams=("s",),
        receiver=ReceiverConfig(block_interval=0.05),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
        pipeline="my_pipelines:upper",
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="user-pipeline")
    await asyncio.to_thread(driver.start)
    try:
        async with Producer(server.target, "s") as producer:
            await producer.send_many([b"hello", b"world"])
        deadline = time.monotonic() + 120
        while sink_rows(spark, out) < 2 and time.monotonic() < deadline:
            assert driver.error() is None, driver.error()
            await asyncio.sleep(0.5)
        rows = spark.read.parquet(str(out)).orderBy("offset").collect()
        assert [(r["line"], r["offset"]) for r in rows] == [("HELLO", 0), ("WORLD", 1)]
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)
