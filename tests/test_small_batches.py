"""Tiny batches do not talk the rate down (issue 12, item 8): on a real Spark query (the shared session)
against a real server, with the model estimator steering the live cap as `sluice serve` wires it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from support import wait_until

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver, drive_rate
from ingest.server import SluiceServer
from receivers.config import ReceiverConfig
from sluice_client import Producer

pytestmark = pytest.mark.spark

INITIAL = 10_000.0
PUSH = 20_000


async def test_single_record_batches_leave_the_rate_warm(spark: Any, tmp_path: Path) -> None:
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        receiver=ReceiverConfig(block_interval=0.05),
        rate=RateConfig(estimator="model", initial_rate=INITIAL),
        trigger_interval=0.5,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="small-batches", rate_target=server.target)
    server.batches_completed = lambda: driver.batches_completed
    drive_rate(driver, server, asyncio.get_running_loop())
    await asyncio.to_thread(driver.start)
    try:
        controller = server.rate
        async with Producer(server.target, "s", linger=0) as producer:
            # two start-up batches the model skips, then three it sees: each one record, in its own batch
            for i in range(1, 6):
                await producer.send(f"one {i}".encode())
                await producer.flush(timeout=30)
                await wait_until(lambda n=i: driver.records_processed >= n, timeout=120)  # type: ignore[misc]
                await wait_until(
                    lambda: (
                        controller.last_batch is not None
                        and driver.last_batch is not None
                        and controller.last_batch.batch_id == driver.last_batch.batch_id
                    )
                )
                assert driver.error() is None, driver.error()
        state = controller.estimator.state()
        print(f"after 5 single-record batches: rate {controller.rate:,.0f} records/s, state {state}")
        # before: the third single-record batch fitted ~0.3 s a record and the rate fell to 100/s
        assert controller.rate >= INITIAL
        assert controller.estimator.capacity is None or controller.estimator.capacity >= INITIAL
        assert server.receivers["s"].rate >= INITIAL
        # the push that follows runs at the warm rate: 20k records in a few seconds, not 200 s at 100/s
        started = time.monotonic()
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"x" * 20] * PUSH)
            await producer.flush(timeout=120)
        elapsed = time.monotonic() - started
        print(f"then {PUSH:,} records acked in {elapsed:.1f} s")
        assert elapsed < 30, elapsed
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)
