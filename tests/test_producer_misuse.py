"""The SDK's Producer given arguments it cannot use, or used in ways it does not support: each is refused
at the call, naming what is wrong, before anything changes, and never leaves a producer that hangs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import reactivex
from support import running_server, wait_until

from sluice_client import Producer, SyncProducer, publish, rx
from sluice_client.errors import ProducerClosedError, ProtocolError, RecordTypeError, UnackedRecordsError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.publishers import IterablePublisher


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        ({"batch_size": 1e4}, TypeError, r"^batch_size must be an int, not float \(10000\.0\)$"),
        ({"batch_size": 1.5}, TypeError, r"^batch_size must be an int, not float \(1\.5\)$"),
        ({"batch_size": True}, TypeError, r"^batch_size must be an int, not bool \(True\)$"),
        ({"batch_size": "10"}, TypeError, r"^batch_size must be an int, not str \('10'\)$"),
        ({"batch_size": 0}, ValueError, r"^batch_size must be >= 1, got 0$"),
        ({"batch_bytes": 1e6}, TypeError, r"^batch_bytes must be an int, not float"),
        ({"batch_bytes": math.inf}, TypeError, r"^batch_bytes must be an int, not float \(inf\)$"),
        ({"max_buffered": 1e6}, TypeError, r"^max_buffered must be an int, not float"),
        ({"max_buffered": 10, "batch_size": 20}, ValueError, r"^max_buffered must be >= batch_size"),
        ({"max_buffered_bytes": 1e8}, TypeError, r"^max_buffered_bytes must be an int, not float"),
        ({"max_buffered_bytes": 0}, ValueError, r"^max_buffered_bytes must be >= 1 or None, got 0$"),
        ({"first_seq": 1.5}, TypeError, r"^first_seq must be an int, not float \(1\.5\)$"),
        ({"first_seq": -1}, ValueError, r"^first_seq must be in 0\.\.18446744073709551614, got -1$"),
        ({"first_seq": 2**64 - 1}, ValueError, r"^first_seq must be in 0\.\.18446744073709551614"),
        ({"producer_id": 123}, TypeError, r"^producer_id must be a str .*, not int \(123\)$"),
        (
            {"producer_id": "p" * 257},
            ValueError,
            r"^producer_id must be at most 256 bytes of UTF-8, got 257 ",
        ),
        (
            {"producer_id": "é" * 129},
            ValueError,
            r"^producer_id must be at most 256 bytes of UTF-8, got 258 ",
        ),
        ({"producer_id": "a\0b"}, ValueError, r"^producer_id must not contain NUL, got 'a\\x00b'$"),
        ({"producer_id": "\ud800"}, ValueError, r"^producer_id must be valid UTF-8 text"),
        ({"stream": "\udcff"}, ValueError, r"^stream must be valid UTF-8 text, got '\\udcff'$"),
        ({"resume": "yes"}, TypeError, r"^resume must be a bool, not str \('yes'\)$"),
        ({"linger": "0.1"}, TypeError, r"^linger must be a number of seconds, not str \('0\.1'\)$"),
        ({"linger": math.nan}, ValueError, r"^linger must be >= 0 seconds, got nan$"),
        ({"start_timeout": -1}, ValueError, r"^start_timeout must be >= 0 seconds, got -1$"),
        # an int too large for a float raised OverflowError, naming nothing
        ({"linger": 10**400}, ValueError, r"^linger is out of range: .* 1\.8e\+308 \(inf: no limit\)$"),
        ({"reconnect_backoff": 10**400}, ValueError, r"^reconnect_backoff is out of range: .* 1\.8e\+308$"),
        ({"reconnect_timeout": None}, TypeError, r"^reconnect_timeout must be a number of seconds"),
        ({"max_reconnect_backoff": math.inf}, ValueError, r"^max_reconnect_backoff must be finite"),
        ({"reconnect_backoff": math.inf}, ValueError, r"^reconnect_backoff must be finite"),
        ({"reconnect_backoff": 0}, ValueError, r"^need 0 < reconnect_backoff <= max_reconnect_backoff"),
        ({"reconnect_backoff": 2.0, "max_reconnect_backoff": 1.0}, ValueError, r"^need 0 < reconnect"),
    ],
)
def test_constructor_arguments_of_the_wrong_type_or_range_are_refused(
    setting: dict[str, Any], error: type[Exception], message: str
) -> None:
    """`Producer(batch_size=1e4)` was taken: the sender died on it once a batch was due (a TypeError in
    numpy) and flush() waited for good; `max_reconnect_backoff=inf` failed start() (OverflowError);
    `producer_id=123` said "bad argument type for built-in operation"; `first_seq=1.5` made `acked` 1.5."""
    with pytest.raises(error, match=message):
        Producer("a:1", **{"stream": "s", **setting})


SETTINGS = {
    "targets": ("127.0.0.1:2",),
    "stream": "other",
    "producer_id": "other",
    "resume": True,
    "batch_size": 0,
    "batch_bytes": 1.5,
    "linger": -1.0,
    "max_buffered": 1,
    "max_buffered_bytes": 0,
    "reconnect_backoff": math.inf,
    "max_reconnect_backoff": 0.0,
    "reconnect_timeout": math.nan,
    "start_timeout": -1.0,
    "credentials": None,
}


def test_settings_are_read_only_after_construction() -> None:
    """The settings were plain attributes: `producer.batch_size = 0` (or a float, or max_buffered below
    batch_size) was taken unchecked and failed the producer later, in the middle of sending. Only the
    constructor sets them, checked."""
    producer = Producer("127.0.0.1:1", "s", producer_id="p", batch_size=10, max_buffered=100, linger=0.5)
    before = {name: getattr(producer, name) for name in SETTINGS}
    for name, value in SETTINGS.items():
        with pytest.raises(AttributeError, match="has no setter"):
            setattr(producer, name, value)
    assert {name: getattr(producer, name) for name in SETTINGS} == before
    assert (producer.batch_size, producer.max_buffered, producer.linger) == (10, 100, 0.5)
    assert (producer.targets, producer.stream, producer.producer_id) == (("127.0.0.1:1",), "s", "p")


def test_a_sync_producer_refuses_them_too() -> None:
    with pytest.raises(TypeError, match=r"^batch_size must be an int, not float"):
        SyncProducer("127.0.0.1:1", "s", batch_size=1e4)
    with pytest.raises(ValueError, match=r"^producer_id must be at most 256 bytes of UTF-8, got 300 "):
        SyncProducer("127.0.0.1:1", "s", producer_id="p" * 300)


async def test_a_producer_id_at_the_limit_is_taken(tmp_path: Path) -> None:
    """A producer_id over 256 bytes of UTF-8 was refused only when the session opened (INVALID_ARGUMENT
    from the server); the constructor refuses it now, and one of exactly 256 bytes still works."""
    at_limit = "é" * 128  # 2 bytes each
    async with running_server(tmp_path) as server:
        async with Producer(f"127.0.0.1:{server.port}", "s", producer_id=at_limit, linger=0) as producer:
            await producer.send(b"x")
            await producer.flush(10)
        assert producer.acked == 1


async def test_integers_of_any_kind_and_unbounded_timeouts_are_taken(tmp_path: Path) -> None:
    async with running_server(tmp_path) as server:
        producer = Producer(
            f"127.0.0.1:{server.port}",
            "s",
            batch_size=np.int64(100),
            max_buffered=np.int32(1000),
            first_seq=np.uint64(5),
            linger=0,
            start_timeout=math.inf,
            reconnect_timeout=math.inf,
            max_reconnect_backoff=1e300,  # finite: gRPC's channel option (a C int) takes ~24 days
        )
        assert (producer.batch_size, producer.max_buffered, producer.acked) == (100, 1000, 5)
        assert type(producer.batch_size) is int and type(producer.acked) is int
        async with producer:
            await producer.send_many([b"x"] * 250)
            await producer.flush(10)
        assert producer.acked == 255


async def test_an_error_in_the_send_loop_fails_the_producer_at_once(tmp_path: Path) -> None:
    """A defect in the sender (here a float batch_size forced in behind the read-only setting: numpy
    refused it in the middle of taking a batch) killed the send task alone: the read loop went on,
    flush() waited for good, flush(20) said "no credit came", close() blocked and abort() raised the
    hidden TypeError. It fails the producer now: every call that waits raises at once, the error as the
    cause."""
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s", linger=0)
        await producer.start()
        producer._batch_size = 1.5  # type: ignore[assignment] # the defect, planted
        await producer.send_many([b"x%d" % i for i in range(1000)])
        with pytest.raises(
            ProducerClosedError, match=r"^producer failed: its send loop raised TypeError"
        ) as failed:
            await asyncio.wait_for(producer.flush(), 10)
        assert isinstance(failed.value.__cause__, TypeError)
        with pytest.raises(ProducerClosedError, match="send loop"):
            await producer.send(b"y")
        with pytest.raises(UnackedRecordsError) as unacked:
            await asyncio.wait_for(producer.close(), 10)
        assert unacked.value.__cause__ is failed.value
        assert unacked.value.unacked == 1000
        assert len(await producer.abort()) == 1000  # raises nothing: the error was raised already


async def test_an_error_in_the_read_loop_fails_the_producer_with_it_as_the_cause(tmp_path: Path) -> None:
    """An on_room callback that raises ends the read loop: the producer fails with a ProducerClosedError
    whose cause is that error (it was a SluiceError holding only its repr), and abort(), which `async
    with` runs when its body raised, no longer raises it in place of the body's error."""
    async with running_server(tmp_path) as server:

        def listener() -> None:
            raise RuntimeError("boom")

        with pytest.raises(KeyError, match="the body's"):
            async with Producer(f"127.0.0.1:{server.port}", "s", linger=0) as producer:
                producer.on_room(listener)
                await producer.send(b"x")
                await producer.flush(10)  # its ack called the listener: the read loop ends
                with pytest.raises(ProducerClosedError, match=r"its session raised RuntimeError") as failed:
                    await producer.send(b"y")
                    await asyncio.wait_for(producer.flush(), 10)
                assert isinstance(failed.value.__cause__, RuntimeError)
                raise KeyError("the body's")


@pytest.mark.parametrize("timeout", [-1, math.nan, "1", pytest.param(10**400, id="10**400")])
async def test_a_bad_close_timeout_is_refused_and_leaves_the_producer_as_it_was(
    tmp_path: Path, timeout: Any
) -> None:
    """close(-1) or close(nan) tore the producer down, then raised ValueError: its unacked records were
    dropped without a word, and a second close() returned None. close(10**400) raised OverflowError
    from asyncio's clock once it had begun closing, and the producer could not be closed again."""
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s")
        await producer.start()
        await producer.send_many([b"r%d" % i for i in range(1000)])
        with pytest.raises(
            TypeError if isinstance(timeout, str) else ValueError, match=r"^timeout (must be|is out of range)"
        ):
            await producer.close(timeout)
        await producer.send(b"more")  # still open
        await producer.close(10)
        assert producer.acked == 1001
        assert producer.unacked_records() == []


async def test_a_bad_close_timeout_leaves_a_sync_producer_usable(tmp_path: Path) -> None:
    """SyncProducer.close(-1) stopped its loop all the same: the producer was gone."""
    async with running_server(tmp_path) as server:

        def use() -> int:
            producer = SyncProducer(f"127.0.0.1:{server.port}", "s")
            producer.send_many([b"x"] * 1000)
            with pytest.raises(ValueError, match=r"^timeout must be >= 0 seconds"):
                producer.close(-1)
            producer.send(b"more")
            producer.close(10)
            return producer.acked

        assert await asyncio.to_thread(use) == 1001


async def test_sends_racing_a_close_are_refused_and_what_was_taken_is_acked(tmp_path: Path) -> None:
    """Records sent while close() flushed were taken, counted by no flush and sent after Complete: close()
    raised UnackedRecordsError "server ended the session with 80 records unacked", blaming the server.
    Once close() has begun a send raises ProducerClosedError; close() flushes everything taken before."""
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s")
        await producer.start()
        taken = [0] * 8
        refused: list[BaseException] = []

        async def sender(i: int) -> None:
            try:
                while True:
                    await producer.send_many([b"t%d" % i] * 10)
                    taken[i] += 10
                    await asyncio.sleep(0)
            except ProducerClosedError as exc:
                refused.append(exc)

        senders = [asyncio.create_task(sender(i)) for i in range(8)]
        await asyncio.sleep(0.2)
        # raised UnackedRecordsError; a second close() meanwhile returns once the first is done
        await asyncio.wait_for(asyncio.gather(producer.close(), producer.close()), 10)
        await asyncio.wait_for(asyncio.gather(*senders), 10)
        assert sum(taken) > 0
        assert producer.acked == sum(taken)
        assert producer.unacked_records() == []
        assert len(refused) == 8
        assert {str(exc) for exc in refused} <= {"producer is closing", "producer is closed"}


def close_racing(producer: SyncProducer, senders: list[Any], pause: float) -> int:
    """Run each of `senders` in a thread of its own, close `producer` after `pause` s while they run;
    how many threads are still alive 10 s after the close (hung)."""
    threads = [threading.Thread(target=sender, daemon=True) for sender in senders]
    for thread in threads:
        thread.start()
    time.sleep(pause)
    producer.close(10)
    for thread in threads:
        thread.join(10)
    return sum(thread.is_alive() for thread in threads)


async def test_sync_producer_sends_from_other_threads_racing_a_close_are_refused(tmp_path: Path) -> None:
    async with running_server(tmp_path) as server:

        def run() -> tuple[int, int, list[str]]:
            producer = SyncProducer(f"127.0.0.1:{server.port}", "s")
            taken = [0] * 8
            errors: list[str] = []

            def sender(i: int) -> None:
                try:
                    while True:
                        producer.send_many([b"t%d" % i] * 10)
                        taken[i] += 10
                except ProducerClosedError as exc:
                    errors.append(str(exc))

            assert close_racing(producer, [lambda i=i: sender(i) for i in range(8)], 0.2) == 0
            return sum(taken), producer.acked, errors

        taken, acked, errors = await asyncio.to_thread(run)
        assert taken > 0
        assert acked == taken
        assert len(errors) == 8
        assert set(errors) <= {"producer is closing", "producer is closed"}


async def test_sync_producer_calls_from_other_threads_as_its_loop_stops_end(tmp_path: Path) -> None:
    """A call handed to the SyncProducer's loop just as close() stopped it (after the close itself had
    ended) never ran: its thread waited for good. Each such call raises ProducerClosedError now."""
    async with running_server(tmp_path) as server:

        def run() -> tuple[int, list[str]]:
            producer = SyncProducer(f"127.0.0.1:{server.port}", "s", linger=0)
            errors: list[str] = []

            def sender() -> None:
                refused = 0
                while refused < 500:  # goes on calling after close(), as a careless thread may
                    try:
                        producer.send(b"x")
                    except ProducerClosedError as exc:
                        refused += 1
                        errors.append(type(exc).__name__)

            return close_racing(producer, [sender] * 6, 0.05), errors

        hung, errors = await asyncio.to_thread(run)
        assert hung == 0
        assert set(errors) == {"ProducerClosedError"}
        assert len(errors) == 6 * 500


@pytest.mark.parametrize(
    ("values", "keys", "message"),
    [
        ({b"a": b"1"}, None, r"as values, not dict; give list\(d\.values\(\)\)"),
        ({b"a", b"b"}, None, r"as values, not set; give a list"),
        (b"abc", None, r"as values, not one bytes: give \[record\], or use send\(\)"),
        ("abc", None, r"as values, not one str"),
        ([b"a"], {b"k": 1}, r"as keys, not dict"),
        ([b"a"], b"k", r"as keys, not one bytes"),
    ],
)
async def test_send_many_refuses_what_is_not_a_sequence_of_records(
    tmp_path: Path, values: Any, keys: Any, message: str
) -> None:
    """send_many({...}) said "unhashable type: 'slice'"; send_many(b"abc") or keys=b"k" were taken as
    records of ints and failed the producer when their batch was encoded."""
    async with running_server(tmp_path) as server, Producer(f"127.0.0.1:{server.port}", "s") as producer:
        with pytest.raises(
            TypeError, match=rf"^send_many takes a sequence of records \(a list or tuple\) {message}"
        ):
            await producer.send_many(values, keys)
        assert producer.unacked == 0
        await producer.send_many([b"a"], [b"k"])  # the producer goes on
        await producer.flush(10)
        assert producer.acked == 1


@pytest.mark.parametrize(
    ("count", "error", "message"),
    [
        (math.nan, TypeError, r"must be an int, not float \(nan\)$"),
        (1.5, TypeError, r"must be an int, not float \(1\.5\)$"),
        (math.inf, TypeError, r"must be an int, not float \(inf\)$"),
        (True, TypeError, r"must be an int, not bool \(True\)$"),
        (0, ValueError, r"must be >= 1, got 0$"),
    ],
)
def test_reactive_buffer_sizes_are_whole_counts(count: Any, error: type[Exception], message: str) -> None:
    """from_observable(capacity=nan) was taken, and its buffer then failed the stream with "nan items
    were already waiting"; to_observable(request=nan) passed its `< 1` check too."""
    source = reactivex.from_iterable([b"x"])
    with pytest.raises(error, match=rf"^capacity {message}"):
        rx.from_observable(source, capacity=count)
    with pytest.raises(error, match=rf"^capacity {message}"):
        publish.from_observable(source, capacity=count)
    with pytest.raises(error, match=rf"^request {message}"):
        rx.to_observable(IterablePublisher([b"x"]), request=count)
    assert rx.from_observable(source, capacity=np.int64(3)) is not None


@pytest.mark.parametrize("overflow", ["DROP_OLDEST", None, 3])
def test_an_overflow_strategy_that_is_not_one_is_refused(overflow: Any) -> None:
    """overflow="DROP_OLDEST" (or None) was taken by rx.from_observable and acted as ERROR: the stream
    failed at the first overflow it was meant to survive; publish.from_observable said "'str' object
    has no attribute 'name'"."""
    source = reactivex.from_iterable([b"x"])
    message = rf"^overflow must be an OverflowStrategy, not {type(overflow).__name__} "
    with pytest.raises(TypeError, match=message):
        rx.from_observable(source, capacity=2, overflow=overflow)
    with pytest.raises(TypeError, match=message):
        publish.from_observable(source, capacity=2, overflow=overflow)


async def test_publish_refuses_a_bad_flush_timeout_before_it_takes_anything(tmp_path: Path) -> None:
    """publish(..., flush_timeout=nan) pulled the whole source into the producer and only then raised
    ValueError at its flush: a one-shot source was spent, its records queued by a call that failed."""
    pulled: list[bytes] = []

    def source() -> Any:
        for value in (b"a", b"b", b"c"):
            pulled.append(value)
            yield value

    async with running_server(tmp_path) as server:
        async with Producer(f"127.0.0.1:{server.port}", "s", linger=0) as producer:
            for timeout, error in ((math.nan, ValueError), (-1, ValueError), ("5", TypeError)):
                with pytest.raises(error, match=r"^timeout must be"):
                    await publish.publish(producer, IterablePublisher(source()), flush_timeout=timeout)
            assert pulled == [] and producer.unacked == 0
            assert await publish.publish(producer, IterablePublisher(source()), flush_timeout=10) == 3
        assert producer.acked == 3


async def test_publish_on_a_producer_that_cannot_take_records_says_why(tmp_path: Path) -> None:
    """publish() on a closed producer said "producer not started"."""
    with pytest.raises(ProducerClosedError, match=r"^producer not started$"):
        await publish.publish(Producer("127.0.0.1:1", "s"), IterablePublisher([b"a"]))
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s")
        await producer.start()
        await producer.close()
        with pytest.raises(ProducerClosedError, match=r"^producer is closed$"):
            await publish.publish(producer, IterablePublisher([b"a"]))
        with pytest.raises(ProducerClosedError, match=r"^producer not started$"):
            await Producer("127.0.0.1:1", "s").send(b"a")  # it said "producer is new"


async def test_a_second_close_meanwhile_raises_what_the_first_raised(tmp_path: Path) -> None:
    """A close() that waited for another one under way returned None when that one failed: its caller
    took the records as delivered."""
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s")
        await producer.start()
        await producer.send_many([b"x" * 100] * 50_000)
        first, second = await asyncio.gather(
            producer.close(timeout=0), producer.close(), return_exceptions=True
        )
        assert isinstance(first, UnackedRecordsError), first
        assert isinstance(second, UnackedRecordsError), second
        assert second.unacked == first.unacked > 0 and second.records == first.records


async def test_a_send_many_cut_short_by_close_says_how_many_it_took(tmp_path: Path) -> None:
    """send_many waiting for room in the buffer was refused by a close() part way: some of its records
    were queued (and delivered), the error did not say how many, so a caller that sent them elsewhere
    sent those twice."""
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s", max_buffered=100, batch_size=100)
        await producer.start()
        sending = asyncio.create_task(producer.send_many([b"r%d" % i for i in range(1_000_000)]))
        await asyncio.sleep(0.3)
        await producer.close()
        with pytest.raises(ProducerClosedError, match="were taken before it") as cut:
            await sending
        assert 0 < cut.value.taken < 1_000_000
        assert f"the first {cut.value.taken} of this call's 1000000 records" in str(cut.value)
        assert producer.acked == cut.value.taken  # what it took, close() delivered


async def test_a_sync_producer_called_on_its_own_thread_refuses_at_once(tmp_path: Path) -> None:
    """Code the SyncProducer's loop runs, here a logging handler that ships the producer's own log lines
    through it, called send(): the call waited for the loop thread, which was the caller: the producer
    hung for good (close() or abort() there would have joined their own thread). Each such call raises
    RuntimeError at once now, and the producer goes on."""
    seen: list[str] = []
    done = threading.Event()

    async with running_server(tmp_path) as server:
        producer = await asyncio.to_thread(
            SyncProducer, f"127.0.0.1:{server.port}", "s", linger=0, reconnect_timeout=30
        )

    class Shipper(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if done.is_set():
                return
            for call in (
                lambda: producer.send(record.getMessage().encode()),
                lambda: producer.send_many([b"a"]),
                lambda: producer.flush(1),
                lambda: producer.close(1),
                producer.abort,
            ):
                try:
                    call()
                except RuntimeError as exc:
                    seen.append(str(exc))
            seen.append(f"unacked {len(producer.unacked_records())}")  # answers on that thread
            done.set()

    shipper = Shipper(logging.WARNING)
    logging.getLogger("sluice_client.producer").addHandler(shipper)
    try:
        # the server is gone: the record sent makes the producer reconnect, and log on its thread (a
        # daemon thread sends it: in a deadlock the send never returns)
        sender = threading.Thread(target=producer.send, args=(b"x",), daemon=True)
        sender.start()
        await wait_until(done.is_set, 10)  # else the handler never returned: a deadlock
        await asyncio.to_thread(sender.join, 10)
        assert not sender.is_alive()
        assert seen[-1] == "unacked 1"
        assert [message.split("(")[0] for message in seen[:-1]] == [
            f"SyncProducer.{name}" for name in ("send", "send_many", "flush", "close", "abort")
        ]
        assert all("called from the producer's own event-loop thread" in m for m in seen[:-1])
    finally:
        logging.getLogger("sluice_client.producer").removeHandler(shipper)
    assert await asyncio.to_thread(producer.abort) == [(b"x", None)]  # from another thread: works


async def test_a_producer_used_on_another_event_loop_says_so(tmp_path: Path) -> None:
    """A Producer started on one loop and flushed or closed on another (a second asyncio.run(), a
    thread's own loop) raised "<asyncio.locks.Event object ...> is bound to a different event loop";
    it names the mistake now, and the producer still goes on on its own loop. A send that would not
    wait (there is room) says so too, rather than queue from a foreign thread, unseen by the sender."""
    async with running_server(tmp_path) as server:
        producer = Producer(f"127.0.0.1:{server.port}", "s", linger=0, max_buffered=1, batch_size=1)
        await producer.start()
        await producer.send(b"a")
        await producer.flush(10)
        failures: list[str] = []

        def elsewhere() -> None:
            calls = (
                producer.flush,
                producer.close,
                lambda: producer.send(b"b"),  # there is room: it would not wait
                lambda: producer.send_many([b"b", b"c"]),
                lambda: producer.send_packed(b"bc", [0, 1, 2]),
            )
            for call in calls:
                try:
                    asyncio.run(asyncio.wait_for(call(), 10))
                except RuntimeError as exc:
                    failures.append(str(exc))

        await asyncio.to_thread(elsewhere)
        assert len(failures) == 5, failures
        assert all(f.startswith("this Producer was started on another event loop") for f in failures)
        await producer.close(10)
        assert producer.acked == 1  # nothing sent from the other loop was queued


async def test_an_error_leaving_a_with_block_says_what_it_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An error in an `async with Producer` (or `with SyncProducer`) body aborts it, as it should not
    wait on delivery then; the records it had queued and never got acked went without a word."""
    async with running_server(tmp_path) as server:
        target = f"127.0.0.1:{server.port}"
        with caplog.at_level(logging.WARNING, logger="sluice_client.producer"):
            with pytest.raises(KeyError):
                async with Producer(target, "s", linger=math.inf) as producer:
                    await producer.send_many([b"a", b"b", b"c"])  # held for a full batch
                    raise KeyError("the app's own")

            def in_a_thread() -> SyncProducer:  # off the loop the server runs on
                with pytest.raises(KeyError), SyncProducer(target, "s", linger=math.inf) as sync:
                    sync.send(b"d")
                    raise KeyError("the app's own")
                return sync

            sync = await asyncio.to_thread(in_a_thread)
            with pytest.raises(KeyError):
                async with Producer(target, "s", linger=0) as clean:  # nothing dropped: nothing said
                    await clean.send(b"e")
                    await clean.flush(10)
                    raise KeyError("after a flush")
        dropped = [r.getMessage() for r in caplog.records if "never acked were dropped" in r.getMessage()]
        assert dropped == [
            "producer left with KeyError: 3 record(s) never acked were dropped (abort()); close() or "
            "flush() before leaving delivers them",
            "producer left with KeyError: 1 record(s) never acked were dropped (abort()); close() or "
            "flush() before leaving delivers them",
        ]
        assert (producer.acked, sync.acked) == (0, 0)


@contextlib.asynccontextmanager
async def broken_publish_server(mode: str) -> AsyncIterator[str]:
    """A gRPC server on loopback whose Publish breaks the protocol (`mode`): "ends" ends each call OK
    at once; "acks-then-ends" grants credit, acks the first batch and then ends the call OK; "garbage"
    answers bytes that are no PublishResponse. Its target."""

    async def publish(requests: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        if mode == "garbage":
            yield b"\xff\xff\xff"
            await asyncio.sleep(60)
        elif mode == "acks-then-ends":
            yield pb.PublishResponse(request=pb.Request(n=100)).SerializeToString()
            async for message in requests:
                request = pb.PublishRequest.FromString(message)
                if request.WhichOneof("kind") == "batch":
                    end = request.batch.first_seq + request.batch.count
                    yield pb.PublishResponse(ack=pb.Ack(durable_up_to=end)).SerializeToString()
                    return

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(publish)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("ingest.v1.Ingest", {"Publish": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@pytest.mark.parametrize("mode", ["ends", "garbage"])
async def test_a_server_breaking_the_protocol_at_the_start_fails_it(mode: str) -> None:
    """A session the server ended OK before the producer completed it left a producer that never sent
    and a flush() that waited for good; an answer that is no PublishResponse failed it with an
    AttributeError ('NoneType' object has no attribute 'WhichOneof'). Both are ProtocolError now."""
    says = {
        "ends": r"ended the session \(status OK\) before the producer",
        "garbage": "not a PublishResponse",
    }
    async with broken_publish_server(mode) as target:
        producer = Producer(target, "s", start_timeout=5)
        with pytest.raises(ProtocolError, match=says[mode]):
            await asyncio.wait_for(producer.start(), 10)
        await producer.abort()


async def test_a_session_the_server_ends_ok_while_the_producer_is_open_fails_it() -> None:
    async with broken_publish_server("acks-then-ends") as target:
        producer = Producer(target, "s", linger=0, start_timeout=5)
        await asyncio.wait_for(producer.start(), 10)
        await producer.send(b"acked")
        await asyncio.wait_for(producer.flush(), 10)
        await wait_until(lambda: producer.room < 0)  # it takes no more records: it failed
        with pytest.raises(ProtocolError, match="ended the session"):
            await producer.send(b"never sent")
        with pytest.raises(ProtocolError, match="ended the session"):
            await asyncio.wait_for(producer.close(), 10)
        assert await producer.abort() == []


async def test_a_bytearray_value_resized_before_it_is_sent_is_named(tmp_path: Path) -> None:
    """A bytearray is measured when given and laid out when sent: one resized in between failed the
    producer with "a record of the batch at 0 is not bytes", though it was a bytearray, naming none.
    The error names the record and what changed now."""
    async with running_server(tmp_path) as server:
        producer = Producer(server.target, "s", linger=1)
        await producer.start()
        await producer.send(b"first")
        value = bytearray(b"abc")
        await producer.send(value)
        value.extend(b"defg")  # before the linger ends: the record is not sent yet
        with pytest.raises(
            RecordTypeError,
            match=r"^record 1: its value changed size after it was given \(3 bytes then, 7 now",
        ):
            await asyncio.wait_for(producer.flush(), 10)
        assert [v for v, _ in await producer.abort()] == [b"first", b"abcdefg"]


SENDS_AND_ENDS = {
    "async": """
import asyncio, sys
from sluice_client import Producer
async def main():
    producer = Producer(sys.argv[1], "s", linger=60)
    await producer.start()
    await producer.send(b"x")
    if sys.argv[2] == "close":
        await producer.close()
asyncio.run(main())
""",
    "sync": """
import sys
from sluice_client import SyncProducer
producer = SyncProducer(sys.argv[1], "s", linger=60)
producer.send(b"x")
if sys.argv[2] == "close":
    producer.close()
""",
}


@pytest.mark.parametrize("kind", ["async", "sync"])
async def test_a_producer_never_closed_says_what_it_dropped_at_the_end(tmp_path: Path, kind: str) -> None:
    """A script that sent and ended without close() (asyncio.run returning with the Producer open, a
    SyncProducer left at exit) dropped the records not acked without a word, exit 0. It says so now, as
    leaving a `with` block by an error does; a closed one says nothing."""
    async with running_server(tmp_path) as server:
        for end in ("close", "leave"):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", SENDS_AND_ENDS[kind], server.target, end, stderr=asyncio.subprocess.PIPE
            )
            _, err = await asyncio.wait_for(proc.communicate(), 60)
            stderr = err.decode()
            assert proc.returncode == 0 and "Traceback" not in stderr, stderr
            said = "never closed: 1 record(s) never acked were dropped; close() delivers them" in stderr
            assert said is (end == "leave"), stderr


async def test_a_close_after_one_cut_short_raises_what_it_dropped(tmp_path: Path) -> None:
    """close() cut short (asyncio.wait_for's timeout: the teardown dropped what was not acked, and the
    TimeoutError says nothing of them): a second close() returned None, as if everything was delivered.
    It raises UnackedRecordsError with those records now, unless abort() handed them back meanwhile."""
    async with running_server(tmp_path) as server:
        server.rate.update(20, pin=True)  # slow acks: the close cannot finish in time
        for hand_back in (False, True):
            producer = Producer(server.target, "s", linger=0, max_buffered=1_000, batch_size=100)
            await producer.start()
            await producer.send_many([b"x"] * 500)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(producer.close(), 0.2)
            unacked = producer.unacked
            assert unacked > 0
            if hand_back:
                assert len(await producer.abort()) == unacked
                await producer.close()  # the caller has them: nothing more to say
                continue
            for _ in range(2):
                with pytest.raises(UnackedRecordsError, match=r"cut short \(cancelled\)") as again:
                    await producer.close()
                assert again.value.unacked == unacked and len(again.value.records) == unacked
        server.rate.update(math.inf, pin=True)
        closed = Producer(server.target, "s", linger=0)
        await closed.start()
        await closed.send(b"delivered")
        await closed.close()
        await closed.close()  # everything acked: nothing to say


INTERRUPTED = """
import json, signal, sys, threading, time
from sluice_client import SyncProducer
from sluice_client.errors import UnackedRecordsError

producer = SyncProducer(sys.argv[1], "s", linger=0, max_buffered=1_000, batch_size=100)
call = sys.argv[2]


def interrupt_me(after):  # Ctrl-C: SIGINT to the main thread while it waits in the call
    threading.Timer(after, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT)).start()


if call == "flush":
    producer.send_many([b"x"] * 900)
interrupt_me(1.0)
began = time.monotonic()
try:
    if call == "close":
        producer.send_many([b"x"] * 900)
        producer.close()
    elif call == "flush":
        producer.flush()
    else:
        producer.send_many([b"x"] * 100_000)
    print(json.dumps({"interrupted": False}))
    sys.exit(1)
except KeyboardInterrupt:
    after = time.monotonic() - began
    inner = producer._producer
    taken = producer.acked + producer.unacked
    time.sleep(1.0)  # what a call left running on the loop would do meanwhile
    state = {
        "interrupted": True,
        "after": after,
        "taken": taken,
        "taken_later": producer.acked + producer.unacked,
        "unacked": producer.unacked,
        "flushing": inner._flushing,
        "state": inner._state.name,
    }
print(json.dumps(state), flush=True)
sys.stdin.readline()  # the test looks at the server's sessions meanwhile
if call != "close":  # the producer goes on as it was left: what it took is delivered, once
    producer.close(timeout=60)
    print(json.dumps({"acked": producer.acked}), flush=True)
else:  # the close cut short: the next one says what it dropped
    try:
        producer.close()
        print(json.dumps({"dropped": 0}), flush=True)
    except UnackedRecordsError as exc:
        print(json.dumps({"dropped": exc.unacked}), flush=True)
"""


@pytest.mark.parametrize("call", ["send_many", "flush", "close"])
async def test_a_sync_producer_call_interrupted_by_ctrl_c_is_cancelled_on_its_loop(
    tmp_path: Path, call: str
) -> None:
    """A SyncProducer call waits in its caller's thread for the loop thread to run it: Ctrl-C there (a
    KeyboardInterrupt in the waiting thread) left the call running on the loop. A send_many went on
    taking records after the caller saw it interrupted, a flush went on waiting (a flush in progress
    for good), a close went on past the interrupt and was cut off half-way by the loop's stop (its
    session never ended). The interrupted call is now cancelled on the loop, as a task's cancel ends an
    async Producer's call, and the interrupt raised once it has ended."""
    async with running_server(tmp_path) as server:
        server.rate.update(200, pin=True)  # slow credit and acks: each call is still waiting at the Ctrl-C
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            INTERRUPTED,
            server.target,
            call,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 60)
            assert line, (await proc.stderr.read()).decode() if proc.stderr else ""
            state = json.loads(line)
            assert state["interrupted"] is True, state
            assert state["after"] < 1.0 + 4.0, (
                state
            )  # interrupted at 1 s: the cancel ended it within its grace
            assert state["taken_later"] == state["taken"], state  # nothing more was taken after the interrupt
            assert state["flushing"] == 0, state
            sessions = server.receivers["s"].active_sessions
            if call == "close":  # torn down: the channel closed, the session over
                assert state["state"] == "CLOSED", state
                await wait_until(lambda: server.receivers["s"].active_sessions == 0, 10)
            else:
                assert state["state"] == "OPEN" and sessions == 1, (state, sessions)
            server.rate.update(math.inf, pin=True)
            proc.stdin.write(b"\n")
            await proc.stdin.drain()
            end = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            if call == "close":  # what it had not delivered is said by the next close, as after any cut short
                assert end == {"dropped": state["unacked"]} and state["unacked"] > 0, (end, state)
            else:
                assert end == {"acked": state["taken"]}, (end, state)
        finally:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
