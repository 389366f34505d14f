"""Per-principal limits over real gRPC on loopback (issue 13, item 5): each limit's status and message,
nothing taken by the refused call, earlier records still acked, other clients unaffected.

    max_sessions, max_streams   RESOURCE_EXHAUSTED at Open (sessions on every stream count)
    max_message_bytes           RESOURCE_EXHAUSTED, checked on the raw message before it is parsed
    max_record_bytes            INVALID_ARGUMENT naming the record; earlier batches acked
    idle_timeout                Cancel + UNAVAILABLE "idle for N s"; a session waiting for credit is not
                                idle; the SDK reconnects only once it has something to send
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from support import running_server, wait_until

from ingest.config import SecurityConfig
from ingest.server import SluiceServer
from receivers.auth import new_token, token_hash
from receivers.limits import limit_key, peer_host
from receivers.principal import ANONYMOUS, Limits, Principal
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.errors import RecordTooLargeError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.wire import encode_batch

TOKENS = {name: new_token() for name in ("app", "other")}


def auth_file(path: Path, **limits: Any) -> Path:
    """`app` has `limits`; `other` has the defaults."""
    keys = "\n".join(f"{k} = {v!r}" if isinstance(v, str) else f"{k} = {v}" for k, v in limits.items())
    path.write_text(
        f"""
[principals.app]
roles = ["producer"]
streams = ["*"]
token_sha256 = ["{token_hash(TOKENS["app"])}"]
{keys}

[principals.other]
roles = ["producer"]
streams = ["*"]
token_sha256 = ["{token_hash(TOKENS["other"])}"]
"""
    )
    return path


@contextlib.asynccontextmanager
async def server_with(
    tmp_path: Path, *, security: SecurityConfig, host: str = "127.0.0.1", **receiver: Any
) -> AsyncIterator[SluiceServer]:
    receiver = {"buffer_records": 10_000, "prefetch": 1_000, **receiver}
    async with running_server(
        tmp_path / "data", "a", "b", "c", security=security, host=host, **receiver
    ) as server:
        yield server


@contextlib.asynccontextmanager
async def limited(
    tmp_path: Path, receiver: dict[str, Any] | None = None, **limits: Any
) -> AsyncIterator[SluiceServer]:
    """A server whose principal `app` has `limits` (auth-file keys); `receiver`: ReceiverConfig fields."""
    security = SecurityConfig(auth_file=auth_file(tmp_path / "auth.toml", **limits))
    async with server_with(tmp_path, security=security, **(receiver or {})) as srv:
        yield srv


class Raw:
    """A Publish call driven by hand: Open, then what the test sends; responses read in the background."""

    def __init__(
        self, target: str, stream: str, principal: str | None = "app", producer_id: str = ""
    ) -> None:
        self.channel = grpc.aio.insecure_channel(target)
        metadata = () if principal is None else (("authorization", f"Bearer {TOKENS[principal]}"),)
        self.call = pb_grpc.IngestStub(self.channel).Publish(metadata=metadata)  # type: ignore[call-arg]
        self.stream = stream
        self.producer_id = producer_id
        self.credit = 0
        self.acked = 0
        self.cancel: pb.Cancel | None = None
        self.status: grpc.StatusCode | None = None
        self.details = ""
        self._reader: asyncio.Task[None] | None = None

    async def open(self) -> Raw:
        opening = pb.Open(stream=self.stream, producer_id=self.producer_id)
        await self.call.write(pb.PublishRequest(open=opening))
        self._reader = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            async for response in self.call:
                kind = response.WhichOneof("kind")
                if kind == "request":
                    self.credit += response.request.n
                elif kind == "ack":
                    self.acked = response.ack.durable_up_to
                elif kind == "cancel":
                    self.cancel = response.cancel
            self.status = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            self.status, self.details = exc.code(), exc.details() or ""

    async def send(self, first_seq: int, values: list[bytes], keys: list[bytes | None] | None = None) -> None:
        await self.call.write(pb.PublishRequest(batch=encode_batch(first_seq, values, keys)))

    async def ended(self, timeout: float = 10) -> tuple[grpc.StatusCode, str]:
        await wait_until(lambda: self.status is not None, timeout)
        assert self.status is not None
        return self.status, self.details

    async def close(self) -> None:
        self.call.cancel()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self.channel.close(None)


@contextlib.asynccontextmanager
async def raw_sessions(*sessions: Raw) -> AsyncIterator[list[Raw]]:
    try:
        yield [await s.open() for s in sessions]
    finally:
        for s in sessions:
            await s.close()


def opened(server: SluiceServer) -> int:
    return sum(r.stats.sessions_opened for r in server.receivers.values())


def granted(server: SluiceServer) -> int:
    return sum(r.stats.credit_granted for r in server.receivers.values())


async def test_max_sessions_counts_every_stream_and_refuses_at_open(tmp_path: Path) -> None:
    async with limited(tmp_path, max_sessions=2) as server:
        one, two = Raw(server.target, "a"), Raw(server.target, "b")
        async with raw_sessions(one, two):
            await wait_until(lambda: one.credit > 0 and two.credit > 0)
            before = (opened(server), granted(server))
            third = Raw(server.target, "c")
            async with raw_sessions(third):
                assert await third.ended() == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "principal 'app' has 2 Publish sessions open (every stream): max_sessions is 2; close "
                    "one first",
                )
                assert third.credit == 0
            assert (opened(server), granted(server)) == before  # nothing granted, no session
            # another principal is not counted with it
            async with Producer(server.target, "c", credentials=Credentials(token=TOKENS["other"])) as other:
                await other.send_many([b"o"] * 10)
                await other.flush(10)
            # the two sessions still work
            await one.send(0, [b"x"] * 5)
            await wait_until(lambda: one.acked == 5)
        # closed: room for new sessions again
        await wait_until(lambda: all(r.active_sessions == 0 for r in server.receivers.values()))
        async with Producer(server.target, "a", credentials=Credentials(token=TOKENS["app"])) as again:
            await again.send_many([b"y"] * 10)


async def test_a_reconnect_that_fences_its_old_session_is_not_refused(tmp_path: Path) -> None:
    async with limited(tmp_path, max_sessions=1) as server:
        old = Raw(server.target, "a", producer_id="p")
        async with raw_sessions(old):
            await wait_until(lambda: old.credit > 0)
            new = Raw(server.target, "a", producer_id="p")
            async with raw_sessions(new):
                await wait_until(lambda: new.credit > 0)
                assert (await old.ended())[0] == grpc.StatusCode.ABORTED


async def test_max_streams_refuses_one_more_stream_not_one_more_session(tmp_path: Path) -> None:
    async with limited(tmp_path, max_streams=2) as server:
        sessions = [Raw(server.target, s) for s in ("a", "b", "a")]
        async with raw_sessions(*sessions):
            await wait_until(lambda: all(s.credit > 0 for s in sessions))
            before = (opened(server), granted(server))
            extra = Raw(server.target, "c")
            async with raw_sessions(extra):
                assert await extra.ended() == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "principal 'app' publishes to 2 streams at once (a, b): max_streams is 2; stream 'c' "
                    "would be one more",
                )
            assert (opened(server), granted(server)) == before
            async with Producer(server.target, "c", credentials=Credentials(token=TOKENS["other"])) as other:
                await other.send_many([b"o"] * 10)


async def test_a_message_over_max_message_bytes_is_refused_before_parsing(tmp_path: Path) -> None:
    async with limited(tmp_path, max_message_bytes="64KiB") as server:
        receiver = server.receivers["a"]
        session = Raw(server.target, "a", producer_id="p")
        async with raw_sessions(session):
            await wait_until(lambda: session.credit > 0)
            await session.send(0, [b"s" * 1_000] * 10)  # 10 kB: fine
            await wait_until(lambda: session.acked == 10)
            await session.send(10, [b"b" * 1_000] * 70)  # 70 kB
            status, details = await session.ended()
            assert status == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert details.startswith("a Publish message of 70")
            assert details.endswith(
                "bytes: over max_message_bytes 65536 of principal 'app'; send smaller batches"
            )
        assert session.acked == 10
        assert receiver.stats.records_received == 10  # nothing of the big message taken
        # garbage over the limit is refused for its size, not parsed
        garbage = Raw(server.target, "a")
        async with raw_sessions(garbage):
            await wait_until(lambda: garbage.credit > 0)
            await garbage.call.write(pb.PublishRequest(open=pb.Open(stream="x" * 70_000)))
            assert (await garbage.ended())[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("where", ["server", "principal"])
async def test_the_sdk_cuts_its_batches_under_the_message_limit_the_server_tells(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """`--max-message-bytes 1MiB` (or a principal's max_message_bytes): the SDK cut its batches at
    batch_bytes (1 MiB) and past it, so every push of ordinary records failed RESOURCE_EXHAUSTED (after
    a reconnect on "INTERNAL: Internal error from Core"). The server tells the limit on its Requests."""
    limits = {"max_message_bytes": "1MiB"} if where == "principal" else {}
    security = SecurityConfig(auth_file=auth_file(tmp_path / "auth.toml", **limits))
    async with running_server(
        tmp_path / "data",
        "a",
        security=security,
        max_message_bytes=1 << 20 if where == "server" else None,
        buffer_records=100_000,
        prefetch=50_000,
    ) as server:
        credentials = Credentials(token=TOKENS["app"])
        async with Producer(server.target, "a", credentials=credentials, producer_id="p") as producer:
            await producer.send_many([b"%08d" % i + b"z" * 250 for i in range(20_000)])  # 4,096: 1.06 MB
            await producer.flush(timeout=60)
            assert (producer.acked, producer.reconnects) == (20_000, 0)
            # told the limit: a record no message can carry is refused by the call that gives it
            said = r"record 1 of the call has 1048513 bytes .* over the 1048512-byte limit of a record"
            with pytest.raises(RecordTooLargeError, match=said + r" \(a message is at most 1048576 bytes"):
                await producer.send_many([b"ok", b"x" * 1_048_513])
            await producer.send(b"y" * 1_048_512)  # the largest record there is: alone in its message
            await producer.flush(timeout=60)
            assert producer.acked == 20_001
        # given before a session told the limit: refused when it comes to be sent, naming it
        fresh = Producer(server.target, "a", credentials=credentials, producer_id="q")
        await fresh.start()
        try:
            said = r"1048576(-byte message limit of the server| bytes \(the server's max_message_bytes)"
            with pytest.raises(RecordTooLargeError, match=said):  # (whether the Request came first)
                await fresh.send(b"x" * 2_000_000)
                await fresh.flush(timeout=30)
        finally:
            await fresh.abort()
    assert "session with the server" not in caplog.text  # no session lost on the way


async def test_a_record_over_max_record_bytes_is_invalid_earlier_batches_acked(tmp_path: Path) -> None:
    async with limited(tmp_path, max_record_bytes=1_000) as server:
        receiver = server.receivers["a"]
        session = Raw(server.target, "a", producer_id="p")
        async with raw_sessions(session):
            await wait_until(lambda: session.credit > 0)
            await session.send(0, [b"v" * 900, b"w" * 1_000], [b"k" * 100, None])  # exactly at the limit
            await session.send(2, [b"x", b"y" * 600, b"z" * 10], [None, b"k" * 401, None])  # 1,001 bytes
            assert await session.ended() == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "record 1 of the batch (sequence number 3) has 1001 bytes of key and value: over "
                "max_record_bytes 1000 of principal 'app'; nothing of the batch was taken",
            )
        assert session.acked == 2
        assert receiver.stats.records_received == 2


async def test_an_idle_session_ends_unavailable_one_waiting_for_credit_is_not(tmp_path: Path) -> None:
    # the buffer is one session's prefetch, so a session that spent it waits for blocks to be sealed
    async with limited(tmp_path, {"buffer_records": 1_000}, idle_timeout_seconds=0.5) as server:
        receiver = server.receivers["a"]
        idle = Raw(server.target, "a")
        async with raw_sessions(idle):
            await wait_until(lambda: idle.credit > 0)
            await idle.send(0, [b"i"])
            status, details = await idle.ended(timeout=5)
            assert status == grpc.StatusCode.UNAVAILABLE
            assert details.startswith("idle for 0.5 s: no batch while holding 999 credits")
            assert idle.cancel is not None and idle.cancel.code == grpc.StatusCode.UNAVAILABLE.value[0]
            assert idle.cancel.accepted_up_to == 1 and idle.acked == 1
        assert receiver.stats.sessions_idle == 1
        assert server.registry.get_sample_value("sluice_sessions_idle_total", {"stream": "a"}) == 1
        # a session that spent its credit waits for more (blocks cannot be written): not idle
        gate = threading.Event()
        write = receiver.store.write
        receiver.store.write = lambda *args: (gate.wait(30), write(*args))[1]  # type: ignore[method-assign]
        waiting = Raw(server.target, "a")
        try:
            async with raw_sessions(waiting):
                await wait_until(lambda: waiting.credit == 1_000)
                await waiting.send(0, [b"w"] * 1_000)
                await asyncio.sleep(1.5)  # three idle timeouts without credit
                assert waiting.status is None and waiting.cancel is None
                gate.set()
                await wait_until(lambda: waiting.acked == 1_000)
                # credit again, and nothing sent: now it is idle
                status, details = await waiting.ended(timeout=5)
                assert (status, details[:16]) == (grpc.StatusCode.UNAVAILABLE, "idle for 0.5 s: ")
        finally:
            gate.set()


async def test_the_sdk_reconnects_after_an_idle_close_only_with_something_to_send(tmp_path: Path) -> None:
    async with limited(tmp_path, idle_timeout_seconds=0.3) as server:
        receiver = server.receivers["a"]
        credentials = Credentials(token=TOKENS["app"])
        async with Producer(server.target, "a", credentials=credentials, producer_id="p") as producer:
            await producer.send_many([b"1"] * 10)
            await producer.flush(10)
            await wait_until(lambda: receiver.stats.sessions_idle == 1)
            await asyncio.sleep(1.0)  # three timeouts: no session churn while it has nothing to send
            assert receiver.stats.sessions_opened == 1 and receiver.active_sessions == 0
            assert producer.reconnects == 0
            await producer.send(b"2")
            await producer.flush(10)
            assert producer.acked == 11 and producer.reconnects == 1
        assert receiver.stats.sessions_opened == 2


async def test_anonymous_sessions_count_per_peer_host(tmp_path: Path) -> None:
    """Without authentication every client is the anonymous principal: its limits count per peer host,
    so one client at its max_sessions does not lock out another host."""
    security = SecurityConfig(limits=Limits(max_sessions=1), insecure=True)
    async with server_with(tmp_path, security=security, host="::") as server:
        first = Raw(f"127.0.0.1:{server.port}", "a", principal=None)
        async with raw_sessions(first):
            await wait_until(lambda: first.credit > 0)
            second = Raw(f"127.0.0.1:{server.port}", "a", principal=None)
            async with raw_sessions(second):
                assert await second.ended() == (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "principal 'anonymous' (peer 127.0.0.1) has 1 Publish sessions open (every stream): "
                    "max_sessions is 1; close one first",
                )
            elsewhere = Raw(f"[::1]:{server.port}", "a", principal=None)  # another host: IPv6 loopback
            async with raw_sessions(elsewhere):
                await wait_until(lambda: elsewhere.credit > 0)


def test_peer_hosts_and_limit_keys() -> None:
    assert peer_host("ipv4:127.0.0.1:50051") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:50051") == "::1"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"
    assert peer_host("") == "unknown peer"
    assert limit_key(ANONYMOUS, "ipv4:10.0.0.7:4000") == "anonymous@10.0.0.7"
    assert limit_key(Principal("app"), "ipv4:10.0.0.7:4000") == "app"
