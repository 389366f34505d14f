"""The Spark side of `sluice serve`, attached to a running server: the driver (the query, the rate loop,
releases) and the pipeline manager (swaps, restarts). One wiring for the CLI, the tests and the benches."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ingest.driver import QUERY_NAME, SparkDriver, drive_rate
from ingest.pipeline_manager import PipelineManager
from ingest.rate_memory import RateMemory
from ingest.server import SluiceServer

if TYPE_CHECKING:
    from ingest.spark.pipeline import Pipeline

log = logging.getLogger(__name__)

WARM_TIMEOUT = 60.0
"""Seconds `attach_spark(warm=True)` waits for the query to plan its first batch before it says it is
ready."""


def warm_python_workers(spark: Any) -> None:
    """Start Spark's Python worker daemon and a worker per core now (blocking): a fresh query's first
    batch otherwise pays for them (seconds), with records already waiting. Workers are reused after."""
    cores = max(1, int(spark.sparkContext.defaultParallelism))
    spark.sparkContext.parallelize(range(cores), cores).map(lambda x: x).count()


def wait_first_trigger(driver: SparkDriver, timeout: float = WARM_TIMEOUT) -> None:
    """Wait (blocking) until the query has planned its first batch (it runs it now) or waits for data:
    its planning worker and source are then up. Not until that batch ends: a first batch that takes
    long (a backlog after a restart, a slow sink) held `sluice serve`'s "running" line and the health
    check's SERVING for the whole WARM_TIMEOUT, while nothing was left to warm."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        query = driver.query
        if query is None or not query.isActive or query.lastProgress is not None:
            return
        status = query.status
        message = str(status.get("message", ""))
        if message == "Processing new data" or (
            not status.get("isTriggerActive", True) and "Waiting for data" in message
        ):
            return
        time.sleep(0.1)


async def attach_spark(
    spark: Any,
    server: SluiceServer,
    *,
    query_name: str = QUERY_NAME,
    warm: bool = False,
    preloaded: Mapping[str, Pipeline] | None = None,
) -> tuple[SparkDriver, PipelineManager]:
    """Start the server's query on `spark` (the generation pipeline.json names, else the config's
    pipeline). Raises PipelineStateError (a bad pipeline.json) before anything starts, or what Spark
    raises when the query cannot start. warm: start Spark's Python workers first and return once the
    query has planned its first batch, so the first records do not wait for them (`sluice serve`).
    preloaded: spec -> pipeline function loaded already at this start (PipelineManager): the start
    imports the pipeline's module once, not again."""
    loop = asyncio.get_running_loop()
    # its own source asks the rate with this run's token (a plaintext loopback port under TLS);
    # server.config: the command line with the settings changed at run time
    driver = SparkDriver(
        spark,
        server.config,
        query_name=query_name,
        rate_target=server.rate_target,
        rate_token_file=server.pipeline_token_file,
        streams=server.streams.known,
    )
    server.batches_completed = lambda: driver.batches_completed
    drive_rate(driver, server, loop)
    manager = PipelineManager(driver, server, loop, preloaded=preloaded)
    server.pipeline_control = manager
    # the capacity an earlier run of this pipeline showed bounds the first batches (ingest.rate_memory)
    memory = RateMemory(server.config.data_dir)
    recalled = memory.recall(manager.current.spec)
    server.rate.recall(recalled)
    bound = server.rate.unmeasured_batch_records()  # 0 unless the model runs unlimited
    if recalled is not None and bound:
        log.info(
            "this pipeline showed %.0f records/s before (%s): until it is measured again, a batch takes "
            "at most %d records",
            recalled,
            memory.path,
            bound,
        )
    server.rate.on_capacity = lambda capacity: memory.remember(manager.current.spec, capacity)
    if warm:
        await asyncio.to_thread(warm_python_workers, spark)
    await manager.start()
    if warm:
        await asyncio.to_thread(wait_first_trigger, driver)
    await server.attach_query(manager.failure)  # health's "" is SERVING from now on, until it fails
    return driver, manager
