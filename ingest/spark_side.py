"""The Spark side of `sluice serve`, attached to a running server: the driver (the query, the rate loop,
releases) and the pipeline manager (swaps, restarts). One wiring for the CLI, the tests and the benches."""

from __future__ import annotations

import asyncio
from typing import Any

from ingest.driver import QUERY_NAME, SparkDriver, drive_rate
from ingest.pipeline_manager import PipelineManager
from ingest.server import SluiceServer


async def attach_spark(
    spark: Any, server: SluiceServer, *, query_name: str = QUERY_NAME
) -> tuple[SparkDriver, PipelineManager]:
    """Start the server's query on `spark` (the generation pipeline.json names, else the config's
    pipeline). Raises PipelineStateError (a bad pipeline.json) before anything starts, or what Spark
    raises when the query cannot start."""
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
    manager = PipelineManager(driver, server, loop)
    server.pipeline_control = manager
    await manager.start()
    await server.attach_query(manager.failure)  # health's "" is SERVING from now on, until it fails
    return driver, manager
