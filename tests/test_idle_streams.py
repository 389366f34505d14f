"""Streams nobody publishes to cost next to nothing: each block generator ticked every credit_tick (50 ms)
through asyncio.wait_for, a task a tick, so 1,000 idle streams took about a core of the event loop and
every admin call waited behind them (AddStream 0.5 s at 1,000 streams). An idle stream's generator now
looks in once a second and a session opening wakes it.

Real gRPC server on loopback, real block log; CPU and time bounds are generous (a loaded CI machine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from support import running_server

from receivers import receiver
from sluice_client import Producer

STREAMS = 300


async def test_idle_streams_leave_the_event_loop_idle(tmp_path: Path) -> None:
    streams = [f"s{i}" for i in range(STREAMS)]
    async with running_server(tmp_path, *streams, block_interval=0.2) as server:
        await asyncio.sleep(1.5)  # past the start's first ticks
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(3)
        cores = (time.process_time() - cpu) / (time.monotonic() - wall)
        # 300 streams ticking every 50 ms took 0.17 of a core here; now 0.03-0.04
        assert cores < 0.1, f"{STREAMS} idle streams kept {cores:.2f} of a core busy"
        async with Producer(server.target, streams[-1]) as producer:  # and they still take records
            await producer.send(b"x")
            await producer.flush(timeout=30)


async def test_a_stream_woken_from_its_idle_sleep_seals_at_its_block_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(receiver, "_IDLE_TICK", 10.0)  # a look-in far later than any bound below
    async with running_server(tmp_path, "a", "b", block_interval=0.2, block_linger=None) as server:
        await asyncio.sleep(1)  # the generators sleep as idle ones do
        for stream in ("a", "b"):
            async with Producer(server.target, stream) as producer:
                started = time.monotonic()
                await producer.send(b"after a lull")
                await producer.flush(timeout=30)
                took = time.monotonic() - started
            # the session's opening woke the generator: sealed within a block interval or so
            assert took < 3, f"a record on a stream idle for a while was acked after {took:.2f} s"
