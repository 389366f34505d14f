"""What Spark has committed leaves the block store without waiting for another batch: on a real Spark
query (the shared session) against a real server, and on a real checkpoint after a restart."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from ingest.client import Producer
from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver, drive_rate
from ingest.server import SluiceServer
from receivers.receiver import ReceiverConfig

pytestmark = pytest.mark.spark

N = 20_000


def sink_values(spark: Any, sink: Path) -> list[bytes]:
    from pyspark.errors import AnalysisException

    try:
        return [bytes(r["value"]) for r in spark.read.parquet(str(sink)).select("value").collect()]
    except AnalysisException:  # no batch committed yet
        return []


async def test_a_disk_budget_below_one_batch_still_moves_data(spark: Any, tmp_path: Path) -> None:
    # as `sluice serve --disk-budget 1KB` runs it: a metered rate (credit a tick's worth at a time, so
    # the first sealed block pauses intake), the live cap on each batch, the listener wired to the server
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        receiver=ReceiverConfig(disk_budget_bytes=1000),
        rate=RateConfig(estimator="fixed", initial_rate=10_000),
        trigger_interval=0.5,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="disk-budget", rate_target=server.target)
    server.batches_completed = lambda: driver.batches_completed
    drive_rate(driver, server, asyncio.get_running_loop())
    await asyncio.to_thread(driver.start)
    try:
        values = [f"record {i}".encode() for i in range(N)]
        started = time.monotonic()
        async with Producer(server.target, "s", producer_id="budget") as producer:
            await producer.send_many(values)
            await producer.flush(timeout=120)  # stalled for good before: the last batch was never released
            assert producer.acked == N
        print(f"{N} records acked under a 1 KB disk budget in {time.monotonic() - started:.1f} s")
        receiver = server.receivers["s"]
        assert receiver.stats.credit_pauses["disk_budget"] > 0  # the budget really was below a batch
        deadline = time.monotonic() + 120
        while len(got := sink_values(spark, config.sink_dir)) < N and time.monotonic() < deadline:
            assert driver.error() is None, driver.error()
            await asyncio.sleep(0.5)
        assert Counter(got) == Counter(values)  # every record exactly once
        # and the idle stream's last batch leaves the store too (it used to wait for a next batch)
        await asyncio.sleep(0)
        deadline = time.monotonic() + 30
        while server.store.blocks("s") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert server.store.blocks("s") == []
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)
