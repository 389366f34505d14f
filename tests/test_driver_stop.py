"""A cluster driver's stop when its Spark query cannot be stopped cleanly."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import grpc
import pytest

from ingest.cluster_driver import ClusterDriver
from ingest.config import RateConfig
from ingest.driver_config import DriverConfig
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import free_ports


class _StoppedUnder:
    """What a query's stop raises when a stop signal ended Spark's session during the query's start:
    Py4J's error (it cannot be made here without stopping the test session's Spark)."""

    def stop(self) -> None:
        raise RuntimeError("An error occurred while calling o123.stop.\n: java.lang.IllegalStateException")


async def test_a_driver_whose_query_fails_to_stop_still_closes_its_rate_port(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """driver.stop() raised at the query's stop and skipped the rest: the rate port, the node calls and
    the nodes' lease stayed (a replacement driver waited the lease out)."""
    driver = ClusterDriver(
        DriverConfig(
            nodes={0: f"127.0.0.1:{free_ports(1)[0]}"},
            streams=("s",),
            data_dir=tmp_path / "driver",
            rate=RateConfig(estimator="fixed", initial_rate=3_000.0),
        )
    )
    await driver.serve_rate()
    target = driver.rate_target or ""
    async with grpc.aio.insecure_channel(target) as channel:
        await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest(), timeout=10)
    spark_driver: Any = _StoppedUnder()
    driver.spark_driver = spark_driver
    with caplog.at_level(logging.WARNING, logger="ingest.cluster_driver"):
        await driver.stop()
    assert "stopping the Spark query failed: An error occurred while calling o123.stop." in caplog.text
    async with grpc.aio.insecure_channel(target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as closed:
            await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest(), timeout=3)
    assert closed.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
