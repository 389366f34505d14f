"""Flow publishers in process, through a Producer, over the wire to a real server: backpressure end to end."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import reactivex
from prometheus_client import REGISTRY
from support import running_server

from ingest.server import SluiceServer
from sluice_client import Producer
from sluice_client.errors import ProducerClosedError, ReconnectTimeoutError
from sluice_client.publish import from_observable as counted_from_observable
from sluice_client.publish import publish
from sluice_client.publishers import BufferOverflowError, IterablePublisher, OverflowStrategy
from sluice_client.rx import from_observable


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    async with running_server(tmp_path, buffer_records=5_000, prefetch=1_000) as srv:
        yield srv


def stored(server: SluiceServer) -> list[tuple[bytes | None, bytes]]:
    store = server.store
    return [
        (row["key"], row["value"])
        for block in store.blocks("s")
        for batch in store.read(block)
        for row in batch.select(["key", "value"]).to_pylist()
    ]


async def test_an_iterable_publisher_is_sent_in_order_and_acked(server: SluiceServer) -> None:
    records = [f"r{i}".encode() for i in range(20_000)]
    async with Producer(server.target, "s", linger=0, max_buffered=2_000, batch_size=500) as producer:
        count = await publish(producer, IterablePublisher(records), flush_timeout=30)
        assert count == 20_000 and producer.acked == 20_000
    assert stored(server) == [(None, r) for r in records]


async def test_keyed_records_from_an_async_iterable(server: SluiceServer) -> None:
    async def source() -> AsyncIterator[tuple[bytes | None, bytes]]:
        for i in range(100):
            yield (b"k" if i % 2 else None, str(i).encode())

    async with Producer(server.target, "s", linger=0) as producer:
        assert await publish(producer, IterablePublisher(source()), flush_timeout=10) == 100
    assert stored(server) == [(b"k" if i % 2 else None, str(i).encode()) for i in range(100)]


async def test_the_upstream_is_pulled_only_as_fast_as_the_server_grants(server: SluiceServer) -> None:
    # through the controller, which owns every receiver's rate (it re-splits it every 0.1 s)
    server.rate.update(2_000, pin=True)
    pulled = 0

    def endless() -> Iterator[bytes]:
        nonlocal pulled
        for i in itertools.count():
            pulled += 1
            yield str(i).encode()

    async with Producer(server.target, "s", linger=0, max_buffered=1_000, batch_size=100) as producer:
        sending = asyncio.create_task(publish(producer, IterablePublisher(endless())))
        await asyncio.sleep(1.5)
        # pulled = sent + what waits in the producer's bounded buffer; sent is bounded by the rate
        assert pulled <= producer.sent + producer.max_buffered + 1
        assert producer.sent <= 2_000 * 1.5 + 1_000  # rate x time + one burst of credit
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        await producer.abort()


async def test_a_failing_publisher_fails_publish_after_sending_what_came_before(server: SluiceServer) -> None:
    def broken() -> Iterator[bytes]:
        yield b"a"
        yield b"b"
        raise ValueError("source broke")

    async with Producer(server.target, "s", linger=0) as producer:
        with pytest.raises(ValueError, match="source broke"):
            await publish(producer, IterablePublisher(broken()))
        await producer.flush(timeout=10)
    assert stored(server) == [(None, b"a"), (None, b"b")]


class _AllAtOnce:
    """A Publisher that emits all its items at the first request and then completes, a cancel
    meanwhile noted only (items in flight may still come after a cancel: Reactive Streams rule 2.8)."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def subscribe(self, subscriber: Any) -> None:
        items = self.items

        class Subscription:
            def request(self, n: int) -> None:
                for item in items:
                    subscriber.on_next(item)
                subscriber.on_complete()

            def cancel(self) -> None:
                pass

        subscriber.on_subscribe(Subscription())


@pytest.mark.parametrize(
    ("bad", "error", "says"),
    [
        ("text", TypeError, "record value must be bytes, not str"),
        ((b"k",), TypeError, r"a record is a value \(bytes\) or a \(key, value\) pair, not a tuple of 1"),
        ((b"k", b"v", b"w"), TypeError, r"or a \(key, value\) pair, not a tuple of 3"),
    ],
)
async def test_items_after_one_that_failed_publish_are_not_sent(
    server: SluiceServer, bad: Any, error: type[Exception], says: str
) -> None:
    """publish() raised for an item that is no record and cancelled the upstream, but the items the
    upstream still emitted after it (as it may, rule 2.8) were queued, sent and acked all the same:
    the caller, told publish failed at that item, would send them again. They are dropped now."""
    async with Producer(server.target, "s", linger=0) as producer:
        with pytest.raises(error, match=says):
            await publish(producer, _AllAtOnce([b"a", bad, b"c", b"d"]))
        await producer.flush(timeout=10)
        assert producer.acked == 1
    assert stored(server) == [(None, b"a")]


async def test_an_observable_through_a_bounded_buffer_counts_its_drops(server: SluiceServer) -> None:
    dropped: list[int] = []
    # a burst of 1,000 items against a demand of 100 (the producer's buffer) and a buffer of 10
    source = from_observable(
        reactivex.from_iterable([str(i).encode() for i in range(1_000)]),
        capacity=10,
        overflow=OverflowStrategy.DROP_OLDEST,
        on_drop=dropped.append,
    )
    async with Producer(server.target, "s", linger=0, max_buffered=100, batch_size=50) as producer:
        count = await publish(producer, source, flush_timeout=10)
    assert count + sum(dropped) == 1_000
    assert sum(dropped) > 0
    values = [v for _, v in stored(server)]
    assert values == sorted(values, key=int) and values[-1] == b"999"


async def test_drops_are_counted_in_the_client_metrics(server: SluiceServer) -> None:
    def counted() -> float:
        return (
            REGISTRY.get_sample_value("sluice_client_records_dropped_total", {"overflow": "DROP_LATEST"})
            or 0.0
        )

    before = counted()
    source = counted_from_observable(
        reactivex.from_iterable([b"d"] * 500), capacity=5, overflow=OverflowStrategy.DROP_LATEST
    )
    async with Producer(server.target, "s", linger=0, max_buffered=50, batch_size=50) as producer:
        count = await publish(producer, source, flush_timeout=10)
    assert counted() - before == 500 - count > 0


async def test_an_observable_overflowing_with_error_fails_publish(server: SluiceServer) -> None:
    source = from_observable(reactivex.from_iterable([b"x"] * 1_000), capacity=10)
    async with Producer(server.target, "s", linger=0, max_buffered=100, batch_size=50) as producer:
        with pytest.raises(BufferOverflowError):
            await publish(producer, source)
        await producer.flush(timeout=10)


@pytest.mark.parametrize("end", ["abort", "failure"])
async def test_publish_ends_when_its_producer_is_aborted_or_fails(server: SluiceServer, end: str) -> None:
    """The bridge asks for more only as acks make room: a producer aborted (or failed) while its buffer
    was full made none, and publish() waited for ever. It raises the producer's error now."""
    server.rate.update(100, pin=True)  # the buffer fills and stays full

    def endless() -> Iterator[bytes]:
        for i in itertools.count():
            yield str(i).encode()

    producer = Producer(server.target, "s", linger=0, max_buffered=200, batch_size=10, reconnect_timeout=0.5)
    await producer.start()
    sending = asyncio.create_task(publish(producer, IterablePublisher(endless())))
    deadline = time.monotonic() + 30  # full in a fraction of a second, more on a loaded machine
    while producer.room and not sending.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not sending.done() and producer.room == 0
    if end == "abort":
        await producer.abort()
        with pytest.raises(ProducerClosedError):
            await asyncio.wait_for(sending, 10)
    else:
        await server.stop()  # UNAVAILABLE, then no server within reconnect_timeout
        with pytest.raises(ReconnectTimeoutError):
            await asyncio.wait_for(sending, 30)
        await producer.abort()
