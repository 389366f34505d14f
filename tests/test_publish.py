"""Publish over real gRPC on loopback: credit, acks, protocol violations, other sessions unaffected."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support import running_server, wait_until

from ingest.config import RateConfig, ServeConfig
from ingest.server import SluiceServer
from receivers.config import FsyncPolicy, ReceiverConfig
from sluice_client import Producer
from sluice_client.errors import ReconnectTimeoutError, RecordTooLargeError, RecordTypeError, RPCError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.producer import DEFAULT_MAX_MESSAGE_BYTES, MAX_RECORD_BYTES
from sluice_client.wire import encode_batch


def make_config(tmp_path: Path, **receiver: float) -> ServeConfig:
    return ServeConfig(
        port=0,
        metrics_port=0,
        data_dir=tmp_path,
        streams=("events", "other"),
        receiver=ReceiverConfig(block_interval=0.05, **receiver),  # type: ignore[arg-type]
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        spark=False,
    )


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    srv = SluiceServer(make_config(tmp_path, buffer_records=10_000, prefetch=1_000))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=1)


class RawPeer:
    """A scripted publisher that sends frames directly, misbehaving on purpose."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        self.call = pb_grpc.IngestStub(self.channel).Publish()

    async def open(self, stream: str = "events", seq: int = 0) -> None:
        await self.call.write(
            pb.PublishRequest(open=pb.Open(stream=stream, producer_id="raw", resume_from_seq=seq))
        )

    async def batch(self, first_seq: int, n: int) -> None:
        await self.call.write(pb.PublishRequest(batch=encode_batch(first_seq, [b"x"] * n)))

    async def read(self) -> pb.PublishResponse:
        response = await asyncio.wait_for(self.call.read(), 10)
        assert response is not grpc.aio.EOF
        return response  # type: ignore[return-value]

    async def status(self) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while True:
                response = await asyncio.wait_for(self.call.read(), 10)
                if response is grpc.aio.EOF:
                    return await self.call.code(), await self.call.details() or ""
        return info.value.code(), info.value.details() or ""

    async def close(self) -> None:
        await self.channel.close()


async def test_producer_records_are_acked_and_stored(server: SluiceServer) -> None:
    async with Producer(server.target, "events", linger=0.001, batch_size=100) as producer:
        for i in range(2_500):
            await producer.send(f"record-{i}".encode(), key=b"k" if i % 2 else None)
        await producer.flush(timeout=10)
        assert producer.acked == 2_500
    blocks = server.store.blocks("events")
    assert sum(b.count for b in blocks) == 2_500
    rows = [row for b in blocks for batch in server.store.read(b) for row in batch.to_pylist()]
    assert [r["value"] for r in rows] == [f"record-{i}".encode() for i in range(2_500)]
    assert [r["key"] for r in rows[:4]] == [None, b"k", None, b"k"]
    assert [b.first_offset for b in blocks] == [sum(x.count for x in blocks[:i]) for i in range(len(blocks))]


@pytest.mark.parametrize(
    ("bad", "named"),
    [("text", "its value is str"), (memoryview(b"abcd").cast("I"), "its value is a memoryview of 4-byte")],
)
async def test_a_record_that_is_not_bytes_fails_the_producer_clearly(
    server: SluiceServer, bad: object, named: str
) -> None:
    """send_many takes records unchecked (a check per record would cost as much as the rest of the
    path): one that is not bytes fails the producer with its sequence number when its batch is encoded,
    nothing of that batch is sent, and abort() gives every unsent record back; the server goes on."""
    producer = Producer(server.target, "events", linger=0)
    await producer.start()
    await producer.send_many([b"a", b"b"])
    await producer.flush(timeout=10)
    await producer.send_many([b"c", bad, b"d"])  # type: ignore[list-item]
    with pytest.raises(RecordTypeError, match=f"record 3: {named}"):
        await producer.flush(timeout=10)
    with pytest.raises(RecordTypeError):
        await producer.send(b"e")
    assert [value for value, _ in await producer.abort()] == [b"c", bad, b"d"]
    with pytest.raises(RecordTypeError, match="must be bytes, not int"):  # found at once: no len()
        async with Producer(server.target, "events") as other:
            await other.send_many([b"x", 7])  # type: ignore[list-item]
    async with Producer(server.target, "events") as fine:
        await fine.send_many([b"f"])
    assert sum(b.count for b in server.store.blocks("events")) == 3


async def test_an_iterator_and_a_bad_flush_timeout_are_refused_at_the_call(server: SluiceServer) -> None:
    """A generator failed inside send_many with Python's "has no len()"; a NaN flush timeout ran out at
    once ("not acked within nan s"). Both are refused by the call, and the producer goes on."""
    async with Producer(server.target, "events", linger=0) as producer:
        with pytest.raises(TypeError, match=r"send_many takes a sequence of records .* not generator"):
            await producer.send_many(v for v in [b"a"])  # type: ignore[arg-type]
        for timeout in (-1.0, math.nan):
            with pytest.raises(ValueError, match="timeout must be >= 0 seconds"):
                await producer.flush(timeout)
        await producer.send_many([b"b"])
        await producer.flush(timeout=10)
        assert producer.acked == 1


async def test_a_key_without_a_length_is_refused_at_the_call(server: SluiceServer) -> None:
    """Keys are measured as they are queued (they count in max_buffered_bytes): one that is not bytes
    and has no length is refused by the call that gave it, nothing of that call is queued, and the
    producer goes on."""
    async with Producer(server.target, "events", linger=0) as producer:
        with pytest.raises(TypeError, match="record key must be bytes, not int"):
            await producer.send(b"a", 5)  # type: ignore[arg-type]
        with pytest.raises(RecordTypeError, match="record keys must be bytes, not float"):
            await producer.send_many([b"b", b"c"], [b"k", 1.5])  # type: ignore[list-item]
        await producer.send_many([b"d"], [b"k"])
        await producer.flush(timeout=10)
    blocks = server.store.blocks("events")
    rows = [row for b in blocks for batch in server.store.read(b) for row in batch.to_pylist()]
    assert [(r["key"], r["value"]) for r in rows] == [(b"k", b"d")]


async def test_a_record_over_the_message_limit_is_refused_when_given(server: SluiceServer) -> None:
    """A record no message can carry used to end and reopen sessions until the reconnect timeout (a
    session up again reset it: forever); then it failed the producer when its batch was encoded, with
    the records sent just before it in flight and never acked. Now the call that gives it raises
    RecordTooLargeError (as Kafka's send does) and the producer goes on. A batch_bytes above the
    message limit is sent in pieces that fit."""
    async with Producer(server.target, "events", batch_bytes=64 * 1024 * 1024, batch_size=100) as producer:
        await producer.send_many([bytes([i]) * (1024 * 1024) for i in range(40)])
        await producer.flush(timeout=30)
    assert sum(b.count for b in server.store.blocks("events")) == 40
    async with Producer(server.target, "events", linger=0) as producer:
        await producer.send(b"ok")  # in flight while the large ones are refused
        with pytest.raises(RecordTooLargeError, match=r"record 1 of the call has 33554433 bytes"):
            await producer.send_many([b"small", b"x" * (DEFAULT_MAX_MESSAGE_BYTES + 1), b"after"])
        over = MAX_RECORD_BYTES + 1
        with pytest.raises(RecordTooLargeError, match=f"record 0 of the call has {over} bytes"):
            await producer.send(b"v" * (MAX_RECORD_BYTES - 9), b"k" * 10)
        with pytest.raises(RecordTooLargeError, match=r"record 0 of the call .* nothing of it was queued"):
            await producer.send_many([b"x"], [b"k" * (MAX_RECORD_BYTES + 1)])
        await producer.send(b"v" * (MAX_RECORD_BYTES - 10), b"k" * 10)  # the largest record there is
        await producer.send(b"last")
        await producer.flush(timeout=60)
        assert producer.acked == 3
    assert sum(b.count for b in server.store.blocks("events")) == 43


async def test_credit_violation_ends_only_that_session(server: SluiceServer) -> None:
    good = Producer(server.target, "events", linger=0.001, batch_size=200)
    await good.start()
    raw = RawPeer(server.target)
    try:
        await raw.open()
        granted = (await raw.read()).request.n
        assert 0 < granted <= 1_000
        await raw.batch(0, granted + 1)
        code, message = await raw.status()
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "exceeds" in message and "credit" in message and "rule 1.1" in message
        # the well-behaved producer goes on, before and after
        await good.send_many([b"ok"] * 5_000)
        await good.flush(timeout=10)
        assert good.acked == 5_000
    finally:
        await raw.close()
        await good.close()


async def test_producer_never_exceeds_credit(server: SluiceServer) -> None:
    # buffer_records=10_000, window 1_000: the producer must wait for grants, in any case within them
    async with Producer(server.target, "other", linger=0, batch_size=700, max_buffered=5_000) as producer:
        await producer.send_many([b"y" * 10] * 20_000)
        await producer.flush(timeout=20)
    receiver = server.receivers["other"]
    assert receiver.stats.records_received == 20_000
    assert receiver.stats.sessions_failed == 0
    assert receiver.credit_outstanding == 0


@pytest.mark.parametrize(
    ("script", "code", "words"),
    [
        ("batch_first", grpc.StatusCode.FAILED_PRECONDITION, "first message must be Open"),
        ("open_twice", grpc.StatusCode.FAILED_PRECONDITION, "Open sent twice"),
        ("unknown_stream", grpc.StatusCode.NOT_FOUND, "no stream named 'nope'"),
        ("gap", grpc.StatusCode.INVALID_ARGUMENT, "first_seq"),
        ("bad_offsets", grpc.StatusCode.INVALID_ARGUMENT, "value_offsets"),
        ("after_complete", grpc.StatusCode.FAILED_PRECONDITION, "after the publisher's Complete"),
    ],
)
async def test_protocol_violations_get_precise_status(
    server: SluiceServer, script: str, code: grpc.StatusCode, words: str
) -> None:
    raw = RawPeer(server.target)
    try:
        if script == "batch_first":
            await raw.batch(0, 1)
        elif script == "unknown_stream":
            await raw.open("nope")
        else:
            await raw.open()
            await raw.read()
            if script == "open_twice":
                await raw.open()
            elif script == "gap":
                await raw.batch(5, 1)
            elif script == "bad_offsets":
                batch = encode_batch(0, [b"abc"])
                batch.value_offsets = (0).to_bytes(4, "little") + (99).to_bytes(4, "little")
                await raw.call.write(pb.PublishRequest(batch=batch))
            elif script == "after_complete":
                await raw.batch(0, 1)
                await raw.call.write(pb.PublishRequest(complete=pb.Complete()))
                await raw.batch(1, 1)
        got, message = await raw.status()
        assert got == code, message
        assert words in message
    finally:
        await raw.close()


async def test_oversized_message_is_resource_exhausted(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    config = ServeConfig(**{**config.__dict__, "max_message_bytes": 64 * 1024})
    srv = SluiceServer(config)
    await srv.start()
    raw = RawPeer(srv.target)
    try:
        await raw.open()
        await raw.read()
        await raw.call.write(pb.PublishRequest(batch=encode_batch(0, [b"z" * 100_000])))
        code, _ = await raw.status()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await raw.close()
        await srv.stop(grace=1)


async def test_unknown_stream_raises_rpc_error_in_sdk(server: SluiceServer) -> None:
    producer = Producer(server.target, "missing")
    with pytest.raises(RPCError) as info:
        await producer.start()  # it waits for the server's answer to its first session
    assert info.value.status == grpc.StatusCode.NOT_FOUND
    assert not info.value.retriable
    await producer.abort()


async def test_server_stop_cancels_sessions_after_acking(tmp_path: Path) -> None:
    srv = SluiceServer(make_config(tmp_path))
    await srv.start()
    # reconnect_timeout=0: give up at the first retriable end instead of reconnecting (test_dedup.py
    # covers reconnects)
    producer = Producer(srv.target, "events", linger=0, reconnect_timeout=0)
    await producer.start()
    try:
        await producer.send_many([b"before"] * 100)
        await producer.flush(timeout=10)
        await srv.stop(grace=1)
        assert producer.acked == 100
        with pytest.raises(ReconnectTimeoutError) as info:
            for _ in range(1_000):  # until the producer sees the end of its session
                await producer.send(b"after")
                await asyncio.sleep(0.01)
        assert info.value.status == grpc.StatusCode.UNAVAILABLE
        assert info.value.retriable
        assert producer.cancel_reason == "receiver stopping"
    finally:
        await producer.abort()
        await srv.stop()
    assert sum(b.count for b in srv.store.blocks("events")) == 100


async def test_a_dead_block_generator_fails_its_sessions(server: SluiceServer) -> None:
    receiver = server.receivers["events"]

    def broken_write(*args: object) -> None:
        raise RuntimeError("disk exploded")

    receiver.store.write = broken_write  # type: ignore[method-assign]
    async with Producer(server.target, "other") as healthy:
        # a write failing with no sign that the data is at fault fails the sessions whose records were
        # in the block: UNAVAILABLE, retriable; with reconnect_timeout=0 the producer reports it instead
        # of trying to reconnect
        producer = Producer(server.target, "events", linger=0, reconnect_timeout=0)
        await producer.start()
        await producer.send(b"x")
        with pytest.raises(RPCError) as info:
            await producer.flush(timeout=10)
        assert info.value.status == grpc.StatusCode.UNAVAILABLE
        assert "disk exploded" in info.value.message
        await producer.abort()
        # the healthy stream uses the same store object: give it back its write
        del receiver.store.write
        await healthy.send(b"fine")
        await healthy.flush(timeout=10)


async def test_fsync_interval_is_group_commit_acks_wait_for_the_background_fsync(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s", fsync=FsyncPolicy.interval(1500)) as server:
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"g"] * 10)
            # the block is written (readers see it) but not yet fsynced: no ack yet
            await wait_until(lambda: len(server.store.blocks("s")) >= 1)
            assert server.store.durable_seq("s") == 0
            assert producer.acked == 0
            # the next background fsync covers it, and only then is it acked
            await wait_until(lambda: producer.acked == 10, timeout=10)
            assert server.store.durable_seq("s") >= 1
            await producer.send_many([b"h"] * 5)
        # close() waited for the next fsync to ack the rest
        assert producer.acked == 15


async def test_group_commit_acks_once_the_background_fsync_lands(tmp_path: Path) -> None:
    # the receiver's own looks are 30 s apart (block interval, credit tick): the ack within seconds
    # can only come from the store saying that the fsync landed
    fsync = FsyncPolicy.interval(60_000)
    async with running_server(tmp_path, "s", fsync=fsync, block_interval=30, credit_tick=30) as server:
        receiver = server.receivers["s"]
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"q"] * 10)
            await wait_until(lambda: receiver.stats.records_received == 10)
            await receiver.seal_now()
            assert server.store.durable_seq("s") == 0
            assert producer.acked == 0
            await asyncio.to_thread(server.store.flush)  # what the flusher thread does, an interval on
            await wait_until(lambda: producer.acked == 10, timeout=5)


async def test_stopping_fsyncs_and_acks_what_waits_for_the_group_commit(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s", fsync=FsyncPolicy.interval(60_000)) as server:
        producer = Producer(server.target, "s", linger=0, reconnect_timeout=0)
        await producer.start()
        try:
            await producer.send_many([b"w"] * 7)
            await wait_until(lambda: sum(b.count for b in server.store.blocks("s")) == 7)
            assert producer.acked == 0  # the next background fsync is a minute away
            await server.stop(grace=1)
            await wait_until(lambda: producer.acked == 7)
        finally:
            await producer.abort()


async def test_a_publishers_error_message_is_one_escaped_log_line(
    server: SluiceServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Error.message went into the server's log as it came: a newline in it forged a log line."""
    raw = RawPeer(server.target)
    try:
        await raw.open()
        forged = "boom\n2026-11-25 07:00:00,000 CRITICAL ingest.server: FORGED LINE"
        with caplog.at_level(logging.WARNING, "receivers.publish_service"):
            await raw.call.write(pb.PublishRequest(error=pb.Error(code=2, message=forged)))
            await raw.call.done_writing()
            while await asyncio.wait_for(raw.call.read(), 10) is not grpc.aio.EOF:
                pass  # the server's Request(n), then the end of the call
            assert await raw.call.code() == grpc.StatusCode.OK
        lines = [r.getMessage() for r in caplog.records if "FORGED" in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0] and "boom\\n2026" in lines[0], lines
    finally:
        await raw.close()
