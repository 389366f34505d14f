"""The SDK's failover between receiver nodes, against real servers on loopback.

A producer given several targets moves to the next one when its node goes away (gracefully or with its
connections cut) and resends what was not acked there; a target that is not listening is skipped; all
targets down ends in the start or reconnect timeout; a refusal (PERMISSION_DENIED) is not failed over.

These servers are single nodes: each keeps its own producer marks, so a record sent to A and not acked
before A went away is stored on A and again on B. Here the test asserts no LOSS only; making the resend
exactly once across nodes is the cluster's job (nodes replicate blocks and producer marks).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import logging
import math
import re
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from support import running_server, wait_until

from ingest import cli
from ingest.config import SecurityConfig
from ingest.server import SluiceServer
from receivers.auth import new_token, token_hash
from receivers.wal import WalBlockStore
from sluice_client import Credentials, Producer, SyncProducer
from sluice_client.errors import ReconnectTimeoutError, RPCError, StartTimeoutError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

FAST = {"linger": 0.001, "reconnect_backoff": 0.02, "max_reconnect_backoff": 0.2}


def dead_target() -> str:
    """A loopback port with nothing listening: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def stored_values(*blocks_dirs: Path) -> collections.Counter[bytes]:
    """Every record value in the block logs of stream "s" under these (stopped) servers' blocks dirs."""
    counts: collections.Counter[bytes] = collections.Counter()
    for root in blocks_dirs:
        store = WalBlockStore(root)
        for block in store.blocks("s"):
            for batch in store.read(block):
                counts.update(batch.column("value").to_pylist())
        store.close()
    return counts


async def kill(server: SluiceServer, how: str) -> None:
    if how == "graceful":
        # seal and ack what was taken, end the sessions with UNAVAILABLE
        await server.stop(grace=0.5)
    else:
        # connections cut first: acks of what was taken never reach the producer, which resends it
        assert server._grpc is not None
        await server._grpc.stop(None)
        await server.stop(grace=0)


@pytest.mark.parametrize("how", ["graceful", "hard"])
async def test_a_producer_fails_over_to_the_next_node_and_loses_nothing(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sluice_client.producer")
    sent = [b"r%05d" % i for i in range(3000)]
    async with running_server(tmp_path / "a") as a, running_server(tmp_path / "b") as b:
        producer = Producer([a.target, b.target], "s", reconnect_timeout=20, start_timeout=10, **FAST)
        await producer.start()
        assert producer.target == a.target
        assert producer.targets == (a.target, b.target)

        async def send_all() -> None:
            for i in range(0, len(sent), 100):
                await producer.send_many(sent[i : i + 100])
                await asyncio.sleep(0.005)

        sending = asyncio.create_task(send_all())
        await wait_until(lambda: producer.acked >= 500)
        await kill(a, how)
        await sending
        await producer.flush(timeout=30)
        assert producer.acked == len(sent)
        assert producer.target == b.target
        assert producer.reconnects >= 1
        await producer.close(timeout=10)
        dirs = (a.config.blocks_dir, b.config.blocks_dir)
    moved = [r for r in caplog.records if "failed over from" in r.getMessage()]
    assert len(moved) == 1 and moved[0].levelname == "INFO"
    assert f"from {a.target} to {b.target}" in moved[0].getMessage()
    counts = stored_values(*dirs)
    assert set(counts) == set(sent), "a record acked by the producer is in neither block log"
    assert sum(counts.values()) >= len(sent)
    assert max(counts.values()) <= 2  # at most once per node
    assert counts[sent[-1]] == 1  # sent only after the failover: on B alone


async def test_a_dead_node_in_the_list_is_skipped_without_backing_off(tmp_path: Path) -> None:
    dead = dead_target()
    async with running_server(tmp_path / "a") as a, running_server(tmp_path / "b") as b:
        # a backoff would take 5-10 s: the first round after a loss starts at once, and skips the
        # dead node at once
        slow = {"reconnect_backoff": 10.0, "max_reconnect_backoff": 10.0}
        producer = Producer([a.target, dead, b.target], "s", linger=0.001, reconnect_timeout=60, **slow)
        await producer.start()
        await producer.send_many([b"x"] * 10)
        await producer.flush(timeout=10)
        await kill(a, "graceful")
        started = asyncio.get_running_loop().time()
        await producer.send_many([b"y"] * 10)
        await producer.flush(timeout=30)
        assert asyncio.get_running_loop().time() - started < 4
        assert producer.target == b.target
        assert producer.acked == 20
        await producer.close(timeout=10)


async def test_the_first_session_starts_on_the_next_target_when_the_first_is_down(tmp_path: Path) -> None:
    dead = dead_target()
    async with running_server(tmp_path / "b") as b:
        producer = Producer(f"{dead},{b.target}", "s", start_timeout=10, **FAST)
        started = asyncio.get_running_loop().time()
        async with producer:
            assert producer.target == b.target
            await producer.send_many([b"a", b"b", b"c"])
            await producer.flush(timeout=10)
            assert producer.acked == 3
        assert asyncio.get_running_loop().time() - started < 5
        assert b.receivers["s"].stats.records_received == 3

        # the blocking facade takes the same list and says where it is
        sync = await asyncio.to_thread(SyncProducer, [dead, b.target], "s", start_timeout=10, **FAST)
        try:
            assert sync.target == b.target
            assert sync.targets == (dead, b.target)
            await asyncio.to_thread(sync.send_many, [b"d"])
            await asyncio.to_thread(sync.flush, 10)
        finally:
            await asyncio.to_thread(sync.close, 10)


class Unready(pb_grpc.IngestServicer):
    """A node that takes the call and then ends it UNAVAILABLE after the Open (stopping, not ready, or
    a cluster node that cannot tell the producer's mark yet)."""

    def __init__(self) -> None:
        self.opens: list[pb.Open] = []

    async def Publish(self, request_iterator, context):  # type: ignore[no-untyped-def]
        first = await anext(aiter(request_iterator))
        self.opens.append(first.open)
        await context.abort(grpc.StatusCode.UNAVAILABLE, "node not ready; retry")


@contextlib.asynccontextmanager
async def unready_node() -> AsyncIterator[tuple[str, Unready]]:
    servicer = Unready()
    server = grpc.aio.server()
    pb_grpc.add_IngestServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(None)


async def test_a_first_session_ended_unavailable_after_open_fails_over_at_once(tmp_path: Path) -> None:
    """start() waited FIRST_ANSWER_SECONDS (2 s) on a first session that the node ended UNAVAILABLE
    after Open, with no retry and no failover until a send: the first session's UNAVAILABLE now goes
    into the failover at once, and start() returns when the next target gives credit."""
    async with unready_node() as (unready, node), running_server(tmp_path / "b") as b:
        producer = Producer([unready, b.target], "s", producer_id="p", start_timeout=30)
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(producer.start(), 20)
        assert asyncio.get_running_loop().time() - started < 1.0
        assert producer.target == b.target
        await producer.send(b"a")
        await producer.close(timeout=10)
        assert [opening.fresh for opening in node.opens] == [True]  # a new run, on either node
        assert b.receivers["s"].stats.records_received == 1


async def test_a_node_that_keeps_ending_the_first_session_unavailable_is_a_start_timeout() -> None:
    """Retried within start_timeout, then start() raises StartTimeoutError (it returned after 2 s, the
    producer never started and nothing said why until a send)."""
    async with unready_node() as (unready, node):
        producer = Producer(unready, "s", start_timeout=1.0, **FAST)
        started = asyncio.get_running_loop().time()
        with pytest.raises(StartTimeoutError) as info:
            await asyncio.wait_for(producer.start(), 20)
        assert 0.9 < asyncio.get_running_loop().time() - started < 1.9
        assert info.value.status is grpc.StatusCode.UNAVAILABLE
        assert "node not ready" in str(info.value)
        assert len(node.opens) >= 3  # retried with the backoff
        assert await producer.abort() == []


async def test_with_every_target_down_start_fails_naming_them(tmp_path: Path) -> None:
    first, second = dead_target(), dead_target()
    producer = Producer([first, second], "s", start_timeout=0.5, **FAST)
    started = asyncio.get_running_loop().time()
    with pytest.raises(StartTimeoutError) as info:
        await producer.start()
    assert 0.4 < asyncio.get_running_loop().time() - started < 5
    assert info.value.status is grpc.StatusCode.UNAVAILABLE
    assert f"no server at {first}, {second} within" in str(info.value)
    assert info.value.attempts >= 4  # both targets, more than one round


async def test_with_every_target_down_reconnecting_gives_up_naming_them(tmp_path: Path) -> None:
    dead = dead_target()
    async with running_server(tmp_path / "a") as a:
        producer = Producer([a.target, dead], "s", reconnect_timeout=0.5, **FAST)
        await producer.start()
        await producer.send(b"a")
        await producer.flush(timeout=10)
        await kill(a, "hard")
        started = asyncio.get_running_loop().time()
        await producer.send(b"b")
        with pytest.raises(ReconnectTimeoutError) as info:
            await producer.flush(timeout=10)
        assert 0.4 < asyncio.get_running_loop().time() - started < 5
        assert info.value.status is grpc.StatusCode.UNAVAILABLE
        assert f"to {a.target}, {dead} in" in str(info.value)
        assert info.value.attempts >= 2
        assert (await producer.abort()) == [(b"b", None)]


async def test_a_refusal_is_not_failed_over(tmp_path: Path) -> None:
    token = new_token()

    def auth_file(name: str, stream: str) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'[principals.app]\nroles = ["producer"]\nstreams = ["{stream}"]\n'
            f'token_sha256 = ["{token_hash(token)}"]\n'
        )
        return path

    # A does not grant the stream to this principal; B does, so a failover would "succeed" there
    on_a = SecurityConfig(auth_file=auth_file("a", "other"))
    on_b = SecurityConfig(auth_file=auth_file("b", "s"))
    async with (
        running_server(tmp_path / "a", "s", "other", security=on_a) as a,
        running_server(tmp_path / "b", "s", security=on_b) as b,
    ):
        producer = Producer([a.target, b.target], "s", credentials=Credentials(token=token), **FAST)
        with pytest.raises(RPCError) as info:
            await producer.start()  # it waits for the server's answer to its first session
        assert info.value.status is grpc.StatusCode.PERMISSION_DENIED
        assert producer.target == a.target
        assert producer.reconnects == 0
        assert b.receivers["s"].stats.sessions_opened == 0
        await producer.abort()


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("", "an empty entry"),
        ([], "no target"),
        ("a:1,,b:2", "an empty entry"),
        ("a:1,", "an empty entry"),
        (["a:1", " "], "an empty entry"),
        ("a:1,a:1", "'a:1' is named twice"),
        (["a:1", "b:2,a:1"], "'a:1' is named twice"),
        ("127.0.0.1:99999", "port 99999 of '127.0.0.1:99999' is not 1-65535"),
        ("a:1,b:0", "port 0 of 'b:0' is not 1-65535"),
        # an outside tester's: retried DNS for the whole timeout, where 127.0.0.1:99999 is refused at once
        ("a b:5", "'a b:5': it holds whitespace"),
        ("a:1,b\t:2", "it holds whitespace"),
        ("http://127.0.0.1:5", "a http:// URL is no gRPC target; use 'host:port', here '127.0.0.1:5'"),
        ("https://127.0.0.1:5", "TLS comes from a CA file"),
        ("grpc://127.0.0.1:5", "a grpc:// URL is no gRPC target"),
        (["a:1", "HTTP://b:2"], "a HTTP:// URL is no gRPC target"),
        # gRPC could not parse these either and retried them for the whole start_timeout
        ("127.0.0.1:5/", "port '5/' is not a number"),
        ("127.0.0.1:", "port '' is not a number"),
        ("127.0.0.1:\u0663", "port '\u0663' is not a number"),  # an Arabic-Indic 3: isdigit(), not a port
        (":5", "no host before the port"),
        ("[::1", "the IPv6 host's .* has no"),
        ("[::1]5", "use '.ipv6.:port'"),
        # UnicodeEncodeError at start(); a NUL: gRPC read up to it, another target than the one given
        ("\udcff:5", "it is not valid UTF-8 text"),
        ("127.0.0.1:5\0", "it holds a NUL"),
    ],
)
def test_bad_target_lists_are_refused(target: str | list[str], message: str) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(message) if "://" in message else message):
        Producer(target, "s")
    assert time.monotonic() - started < 1  # at construction, not after a timeout


@pytest.mark.parametrize(
    "target", ["dns:///127.0.0.1:5", "unix:///tmp/sluice.sock", "ipv4:127.0.0.1:5", "[::1]:5"]
)
def test_grpc_target_uris_are_taken(target: str) -> None:
    assert Producer(target, "s") is not None


@pytest.mark.parametrize("target", ["localhost", "[::1]", "::1", "fe80::1%eth0", "a:05", "vsock:3:5"])
def test_targets_without_a_port_or_with_gruff_ones_are_taken_as_grpc_does(target: str) -> None:
    """A host alone (gRPC's default port, 443) and a bare IPv6 address are gRPC's to read."""
    assert Producer(target, "s").targets == (target,)


def test_a_target_given_as_bytes_says_so() -> None:
    """b"host:port" was iterated and refused as "a target is a str ..., not int"."""
    with pytest.raises(TypeError, match=r"^a target is a str such as 'host:port', not bytes$"):
        Producer(b"127.0.0.1:5", "s")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ({"batch_bytes": math.nan}, TypeError),
        ({"batch_size": math.nan}, TypeError),
        ({"max_buffered": math.nan}, TypeError),
        ({"max_buffered_bytes": math.nan}, TypeError),
        ({"batch_bytes": 0}, ValueError),
    ],
)
def test_sizes_that_are_not_numbers_are_refused(setting: dict[str, float], error: type[Exception]) -> None:
    """A NaN size passed every `< 1` check: batch_bytes NaN never cut a batch by bytes. A size is an
    int: a float one, NaN too, is a TypeError naming it."""
    with pytest.raises(error, match=rf"^{next(iter(setting))} must be"):
        Producer("a:1", "s", **setting)  # type: ignore[arg-type]


async def test_target_lists_and_a_channel_of_ones_own() -> None:
    assert Producer("a:1, b:2", "s").targets == ("a:1", "b:2")
    # gRPC's other target forms pass as they are
    assert Producer("unix:/tmp/sluice.sock,[::1]:50051,dns:///a:1", "s").targets == (
        "unix:/tmp/sluice.sock",
        "[::1]:50051",
        "dns:///a:1",
    )
    assert Producer(["a:1", "b:2,c:3"], "s").targets == ("a:1", "b:2", "c:3")
    assert Producer("a:1", "s").target == "a:1"
    async with grpc.aio.insecure_channel("a:1") as channel:
        with pytest.raises(ValueError, match="channel= serves one target"):
            Producer("a:1,b:2", "s", channel=channel)


async def test_sluice_push_takes_several_targets(tmp_path: Path) -> None:
    dead = dead_target()
    source = tmp_path / "in.txt"
    source.write_bytes(b"".join(b"line %d\n" % i for i in range(1000)))
    async with running_server(tmp_path / "b") as b:
        args = ["push", str(source), "--stream", "s", "--target", f"{dead},{b.target}", "--no-progress"]
        assert await asyncio.to_thread(cli.main, args) == 0
        assert b.receivers["s"].stats.records_received == 1000
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        cli.main(["push", str(source), "--target", f"{dead},{dead}"])
    assert exit_info.value.code == 2
    assert "is named twice" in err.getvalue()
