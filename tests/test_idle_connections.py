"""Connections that handshake and open no call: a real server drops them after
--connection-idle-timeout (gRPC's max_connection_idle: GOAWAY, then the close), refuses those over
--max-connections as it accepts them, and meanwhile serves honest clients: a Producer holding its
Publish stream open through a quiet spell longer than the idle timeout (a connection with a call is not
idle), and a client between calls (its channel reconnects at the next one)."""

from __future__ import annotations

import asyncio
import select
import socket
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import running_server

from ingest import config
from ingest.config import SecurityConfig, default_max_connections, grpc_connection_options
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + empty SETTINGS
GOAWAY = 7


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """`count` connections that complete HTTP/2's handshake (the preface and SETTINGS) and open no call:
    the outside tester's script."""
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        sock.sendall(PREFACE)
        socks.append(sock)
    return socks


def closed_within(socks: list[socket.socket], bound: float) -> dict[int, float]:
    """Seconds until each socket was closed by the server (recv returned b"", or a reset), by index;
    those still open after `bound` seconds are missing. A GOAWAY frame read is noted on the way."""
    started = time.monotonic()
    closed: dict[int, float] = {}
    while len(closed) < len(socks) and time.monotonic() - started < bound:
        open_socks = [s for i, s in enumerate(socks) if i not in closed]
        readable, _, _ = select.select(open_socks, [], [], 0.1)
        for sock in readable:
            try:
                data = sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                closed[socks.index(sock)] = time.monotonic() - started
    return closed


def test_options_bound_every_connection() -> None:
    """The options every gRPC server of the service is built with."""
    options = dict(grpc_connection_options(10.0, 30.0, 500))
    assert options == {
        "grpc.server_handshake_timeout_ms": 10_000,
        "grpc.max_connection_idle_ms": 30_000,
        "grpc.max_allowed_incoming_connections": 500,
    }
    auto = dict(SecurityConfig().grpc_options())
    assert auto["grpc.max_connection_idle_ms"] == 30_000  # not the 5 minutes it was
    assert auto.get("grpc.max_allowed_incoming_connections") == default_max_connections()


async def test_handshaken_connections_without_calls_are_dropped(tmp_path: Path) -> None:
    """30 raw connections that handshake and open no call are closed within the idle timeout (1 s here;
    they were kept 5 minutes), while a Producer holds its stream open through 3 s of silence and a
    client between calls keeps working."""
    security = SecurityConfig(connection_idle_timeout=1.0)
    async with running_server(tmp_path / "data", "s", security=security) as server:
        async with Producer(server.target, "s", linger=0.001, start_timeout=10) as producer:
            await producer.send(b"before")
            await producer.flush(timeout=10)
            socks = await asyncio.to_thread(idle_connections, server.port, 30)
            try:
                async with grpc.aio.insecure_channel(server.target) as channel:
                    stub = pb_grpc.RateControlStub(channel)
                    await stub.GetRate(pb.GetRateRequest(), timeout=10)
                    closed = await asyncio.to_thread(closed_within, socks, 10.0)
                    assert len(closed) == len(socks), (
                        f"{len(socks) - len(closed)} idle connections still open"
                    )
                    assert max(closed.values()) < 8, closed
                    await asyncio.sleep(2.0)  # the channel between calls has been dropped too: it reconnects
                    await stub.GetRate(pb.GetRateRequest(), timeout=10)
            finally:
                for sock in socks:
                    sock.close()
            # the Producer's stream stayed open through 3+ s of silence: not idle, not reconnected
            await producer.send(b"after")
            await producer.flush(timeout=10)
            assert producer.reconnects == 0
        assert server.receivers["s"].stats.sessions_opened == 1


async def test_connections_over_the_cap_are_refused(tmp_path: Path) -> None:
    """Past --max-connections a new connection is closed as it is accepted; those idle under it are
    dropped after the idle timeout, and then an honest Producer gets in."""
    security = SecurityConfig(connection_idle_timeout=1.0, max_connections=5)
    async with running_server(tmp_path / "data", "s", security=security) as server:
        socks = await asyncio.to_thread(idle_connections, server.port, 12)
        try:
            closed = await asyncio.to_thread(closed_within, socks, 0.5)
            assert len(closed) == 7, closed  # the 7 over the cap, at once
            closed = await asyncio.to_thread(closed_within, socks, 10.0)
            assert len(closed) == 12, closed  # and the 5 under it, once idle
        finally:
            for sock in socks:
                sock.close()
        await asyncio.sleep(0.2)  # the server's side of the closes
        async with Producer(server.target, "s", linger=0.001, start_timeout=10) as producer:
            await producer.send(b"x")
            await producer.flush(timeout=10)


async def test_the_health_port_holds_few_connections(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An outside tester: the plaintext health port (every interface, no credentials) had a
    --max-connections cap of its own beside the service port's, 3/4 of the open-file limit each, so
    that connections to it took the files the block log needed, and a producer whose port was far
    under its cap waited 23 s to connect ("File descriptor limit reached"). It holds at most
    HEALTH_MAX_CONNECTIONS (or --max-connections if lower); probes get in beside them."""
    monkeypatch.setattr(config, "HEALTH_MAX_CONNECTIONS", 4)
    async with running_server(tmp_path / "data", "s", health_port=0) as server:
        assert server.health_port is not None
        socks = await asyncio.to_thread(idle_connections, server.health_port, 10)
        try:
            closed = await asyncio.to_thread(closed_within, socks, 1.0)
            assert len(closed) == 6, closed  # the 6 over the cap, at once
        finally:
            for sock in socks:
                sock.close()
        await asyncio.sleep(0.2)  # the server's side of the closes
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=10
            )
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    # a lower --max-connections is the health port's cap too
    low = dict(SecurityConfig(max_connections=2).health_grpc_options())
    assert low["grpc.max_allowed_incoming_connections"] == 2


async def test_calls_without_credentials_cannot_hold_connections_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside tester, without a token on a server with an auth file: a connection with one health
    Watch call open was never idle, so it stayed past --connection-idle-timeout (8 s of 2 s, and on),
    and enough of them would hold every --max-connections slot with no reconnecting. Health's Watch
    and reflection's stream are at most MAX_OPEN_STREAMS open each (RESOURCE_EXHAUSTED past it)."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from ingest import reflection

    monkeypatch.setattr(reflection, "MAX_OPEN_STREAMS", 2)
    auth = tmp_path / "auth.toml"
    auth.write_text('[principals.ops]\nroles = ["operator"]\ntoken_sha256 = "' + "a" * 64 + '"\n')
    security = SecurityConfig(auth_file=auth, connection_idle_timeout=1.0)
    async with running_server(tmp_path / "data", "s", security=security) as server:
        channels = [grpc.aio.insecure_channel(server.target) for _ in range(6)]
        try:
            watches = [
                health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))
                for ch in channels[:3]
            ]
            infos = [
                reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo() for ch in channels[3:]
            ]
            codes = []
            for call in watches:
                try:
                    await asyncio.wait_for(call.read(), 10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            assert sorted(c.name for c in codes) == ["OK", "OK", "RESOURCE_EXHAUSTED"], codes
            codes = []
            await asyncio.sleep(0.5)  # a refused stream ends at its start: a write to it raced that end
            for call in infos:
                if call.done():
                    codes.append(await call.code())
                    continue
                try:
                    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                    await asyncio.wait_for(call.read(), 10)
                    codes.append(grpc.StatusCode.OK)
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError):  # refused before the write
                    codes.append(await call.code())
            assert sorted(c.name for c in codes) == ["OK", "OK", "RESOURCE_EXHAUSTED"], codes
            for call in (*watches, *infos):
                call.cancel()
            await asyncio.sleep(0.3)
            # the ended calls made room again
            again = health_pb2_grpc.HealthStub(channels[0]).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await asyncio.wait_for(again.read(), 10)).status == health_pb2.HealthCheckResponse.SERVING
            again.cancel()
        finally:
            for ch in channels:
                await ch.close(None)
