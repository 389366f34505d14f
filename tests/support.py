"""Helpers shared by the tests: a real server on a loopback port, and waiting for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from ingest.config import RateConfig, SecurityConfig, ServeConfig
from ingest.server import SluiceServer
from receivers.receiver import ReceiverConfig
from receivers.wal import FsyncPolicy


@contextlib.asynccontextmanager
async def running_server(
    data_dir: Path,
    *streams: str,
    metrics: bool = False,
    segment_bytes: int | None = None,
    fsync: FsyncPolicy | None = None,
    security: SecurityConfig | None = None,
    host: str = "127.0.0.1",
    **receiver: Any,
) -> AsyncIterator[SluiceServer]:
    """A SluiceServer without Spark on a free port of `host` (loopback); `receiver` overrides
    ReceiverConfig, `security` (TLS, auth file, limits) is none unless given."""
    config = ServeConfig(
        host=host,
        port=0,
        metrics_port=0 if metrics else None,
        data_dir=data_dir,
        streams=streams or ("s",),
        receiver=ReceiverConfig(**{"block_interval": 0.02, **receiver}),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),  # unthrottled unless a test says so
        spark=False,
        segment_bytes=segment_bytes,
        security=security or SecurityConfig(),
        **({} if fsync is None else {"fsync": fsync}),
    )
    server = SluiceServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=1)


async def wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    """Poll `condition` (state that another task, thread or process changes) until true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)
