"""Demand policy on real gRPC: bounded buffers, a blocked producer stays blocked, fair sharing."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support import running_server, wait_until

from ingest.server import SluiceServer
from sluice_client import Producer


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    async with running_server(tmp_path, buffer_records=2_000, prefetch=500, low_tide=100) as srv:
        yield srv


async def test_prefetch_is_the_first_grant_and_refills_at_low_tide(server: SluiceServer) -> None:
    receiver = server.receivers["s"]
    async with Producer(server.target, "s", linger=0, batch_size=1_000) as producer:
        await wait_until(lambda: producer.credit > 0)
        assert producer.credit == 500
        await producer.send_many([b"x"] * 350)
        await wait_until(lambda: producer.acked == 350)
        await asyncio.sleep(0.1)
        assert producer.credit == 150  # 150 > low tide 100: no refill, though the buffer has room
        await producer.send_many([b"x"] * 60)
        await wait_until(lambda: producer.credit == 500)  # topped up to prefetch once it fell to 90
        await producer.flush(timeout=10)
    assert receiver.stats.credit_granted >= 500 + 410


async def test_a_blocked_producer_stays_blocked(server: SluiceServer) -> None:
    """Blocks cannot be written (a slow disk, later a slow pipeline): credit stops, the client waits."""
    receiver = server.receivers["s"]
    gate = threading.Event()
    write = receiver.store.write

    def slow_write(*args: Any) -> Any:
        gate.wait(30)
        return write(*args)

    receiver.store.write = slow_write  # type: ignore[method-assign]
    producer = Producer(server.target, "s", linger=0, batch_size=100, max_buffered=1_000)
    await producer.start()
    try:
        sending = asyncio.create_task(producer.send_many([b"y" * 10] * 20_000))
        await asyncio.sleep(1.0)
        # bounded on every side: the receiver's buffer, the credit, the producer's own buffer
        assert not sending.done()
        assert receiver.buffered_records + receiver.credit_outstanding <= 2_000
        assert producer.sent <= 2_000
        assert producer.unacked <= 2_000 + 1_000
        sent_while_blocked = producer.sent
        await asyncio.sleep(0.5)
        assert producer.sent == sent_while_blocked  # still blocked, not trickling
        assert not sending.done()
        gate.set()
        await asyncio.wait_for(sending, 30)
        await producer.flush(timeout=30)
        assert producer.acked == 20_000
    finally:
        gate.set()
        await producer.abort()


async def test_fast_and_slow_publishers_both_progress(server: SluiceServer) -> None:
    server.rate.update(5_000, pin=True)  # the controller owns the rate (it re-splits it every 0.1 s)
    async with (
        Producer(server.target, "s", linger=0, producer_id="fast") as fast,
        Producer(server.target, "s", linger=0, producer_id="slow") as slow,
    ):
        flood = asyncio.create_task(fast.send_many([b"f"] * 100_000))
        started = time.monotonic()
        for _ in range(40):  # one record every 25 ms for a second
            await slow.send(b"s")
            await asyncio.sleep(0.025)
        await slow.flush(timeout=10)
        slow_done = time.monotonic() - started
        assert slow.acked == 40
        assert slow_done < 5, slow_done  # not starved behind the flood
        assert fast.acked > 1_000  # and the flood progressed too
        flood.cancel()
        await fast.abort()


async def test_the_tap_sees_every_accepted_batch(server: SluiceServer) -> None:
    receiver = server.receivers["s"]
    seen: list[pa.RecordBatch] = []
    subscription = receiver.tap.subscribe(seen.append)
    try:
        async with Producer(server.target, "s", linger=0, batch_size=100) as producer:
            await producer.send_many([str(i).encode() for i in range(1_000)])
    finally:
        subscription.dispose()
    values = [v for batch in seen for v in batch.column("value").to_pylist()]
    assert values == [str(i).encode() for i in range(1_000)]


async def test_failed_block_writes_are_retried_and_nothing_is_lost(server: SluiceServer) -> None:
    receiver = server.receivers["s"]
    write = receiver.store.write
    failures = 3

    def flaky_write(*args: Any) -> Any:
        nonlocal failures
        if failures:
            failures -= 1
            raise OSError(28, "No space left on device")
        return write(*args)

    receiver.store.write = flaky_write  # type: ignore[method-assign]
    async with Producer(server.target, "s", linger=0) as producer:
        await producer.send_many([str(i).encode() for i in range(3_000)])
        await producer.flush(timeout=30)
    assert receiver.stats.block_write_errors == 3
    values = [
        v
        for b in receiver.store.blocks("s")
        for rb in receiver.store.read(b)
        for v in rb.column("value").to_pylist()
    ]
    assert values == [str(i).encode() for i in range(3_000)]


async def test_the_next_block_is_prepared_during_a_write_and_a_failed_write_loses_nothing(
    server: SluiceServer,
) -> None:
    """While a slow write runs, a block's worth piles up: it is taken and prepared as the next block
    (the log encodes it meanwhile) and written right after. When the write before it fails, both go
    back to the front of what is pending, in order, and are written once the disk recovers."""
    receiver = server.receivers["s"]
    write, prepare = receiver.store.write, receiver.store.prepare
    prepared: list[tuple[int, int]] = []
    written: list[tuple[int, int]] = []
    calls = 0

    def slow_write(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        time.sleep(0.05)
        if calls == 4:
            raise OSError(28, "No space left on device")
        written.append((args[1], args[2]))
        return write(*args)

    def spy_prepare(*args: Any) -> None:
        prepared.append((args[1], args[2]))
        prepare(*args)

    receiver.store.write = slow_write  # type: ignore[method-assign]
    receiver.store.prepare = spy_prepare  # type: ignore[method-assign]
    sent = [str(i).encode() for i in range(20_000)]
    async with Producer(server.target, "s", linger=0, batch_size=100) as producer:
        await producer.send_many(sent)
        await producer.flush(timeout=60)
    assert receiver.stats.block_write_errors == 1
    assert len(set(prepared) & set(written)) >= 3  # written as prepared, with a chain of several
    values = [
        v
        for b in receiver.store.blocks("s")
        for rb in receiver.store.read(b)
        for v in rb.column("value").to_pylist()
    ]
    assert values == sent
