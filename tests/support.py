"""Helpers shared by the tests: a real server on a loopback port, and waiting for a condition."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import json
import math
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow.parquet as pq

from ingest.config import RateConfig, SecurityConfig, ServeConfig
from ingest.server import SluiceServer
from receivers.cluster import Cluster, Node
from receivers.config import FsyncPolicy, ReceiverConfig
from sluice_client import Producer
from sluice_client.errors import RPCError


@contextlib.asynccontextmanager
async def running_server(
    data_dir: Path,
    *streams: str,
    metrics: bool = False,
    segment_bytes: int | None = None,
    fsync: FsyncPolicy | None = None,
    security: SecurityConfig | None = None,
    host: str = "127.0.0.1",
    cluster: Cluster | None = None,
    port: int = 0,
    peer_token_file: Path | None = None,
    max_message_bytes: int | None = None,
    rate: RateConfig | None = None,
    health_port: int | None = None,
    accept_wal_damage: tuple[str, ...] = (),
    **receiver: Any,
) -> AsyncIterator[SluiceServer]:
    """A SluiceServer without Spark on a free port of `host` (loopback); `receiver` overrides
    ReceiverConfig, `security` (TLS, auth file, limits) is none unless given, `rate` is the start's
    (as the command line gives it; fixed and unthrottled unless given)."""
    config = ServeConfig(
        host=host,
        port=port,
        cluster=cluster,
        metrics_port=0 if metrics else None,
        data_dir=data_dir,
        streams=streams or ("s",),
        receiver=ReceiverConfig(**{"block_interval": 0.02, **receiver}),
        # unthrottled unless a test says so
        rate=rate or RateConfig(estimator="fixed", initial_rate=math.inf),
        spark=False,
        segment_bytes=segment_bytes,
        security=security or SecurityConfig(),
        peer_token_file=peer_token_file,
        health_port=health_port,
        accept_wal_damage=accept_wal_damage,
        **({} if fsync is None else {"fsync": fsync}),
        **({} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}),
    )
    server = SluiceServer(config)
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace=1)


@dataclasses.dataclass
class _Flow:
    """One connection through a Proxy: the client's side and the upstream's."""

    writers: tuple[asyncio.StreamWriter, asyncio.StreamWriter]
    dropped: bool = False
    """Nothing more is forwarded either way (read and dropped): the flow a NAT or firewall forgot."""
    down: int = 0
    """Bytes forwarded from the upstream to the client."""


class Proxy:
    """A TCP proxy to `upstream` on a free loopback port, to cut a connection without a FIN or RST (a
    host powered off, a network cut, a NAT or firewall that dropped the flow): what comes in on such a
    connection, either way, is read and dropped, and the connection stays open.

    `frozen = True`: every connection, new ones too (the upstream's host is gone); cut(): the
    connections open now, while new ones are forwarded (a NAT that forgot its flows); `stall_after`:
    each connection once it has forwarded that many bytes to its client (a cut in the middle of a
    long answer)."""

    def __init__(self, upstream: str, *, stall_after: int | None = None) -> None:
        self.upstream = upstream
        self.frozen = False
        self.stall_after = stall_after
        self.server: asyncio.Server | None = None
        self.flows: list[_Flow] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:  # the node is not up yet: the caller retries
            writer.close()
            return
        flow = _Flow((writer, up_writer))
        self.flows.append(flow)
        for task in (
            self._pump(flow, reader, up_writer, down=False),
            self._pump(flow, up_reader, writer, down=True),
        ):
            pump = asyncio.create_task(task)
            self._tasks.add(pump)
            pump.add_done_callback(self._tasks.discard)

    async def _pump(
        self, flow: _Flow, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, down: bool
    ) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if self.frozen or flow.dropped:
                    continue  # dropped: the far side neither answers nor closes
                if down and self.stall_after is not None:
                    data = data[: max(0, self.stall_after - flow.down)]
                    flow.down += len(data)
                    flow.dropped = flow.down >= self.stall_after
                writer.write(data)
                await writer.drain()

    def cut(self) -> None:
        """The connections open now forward nothing more, either way, and stay open; new ones are
        forwarded."""
        for flow in self.flows:
            flow.dropped = True

    def thaw(self) -> None:
        """The network is back: the connections frozen or cut meanwhile are reset (their peers
        reconnect)."""
        self.frozen = False
        for flow in self.flows:
            for writer in flow.writers:
                writer.close()
        self.flows.clear()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for flow in self.flows:
            for writer in flow.writers:
                writer.close()
        if self.server is not None:
            self.server.close()


def free_ports(n: int) -> list[int]:
    """n ports free on loopback now (a cluster's node list needs them before its servers start)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def loopback_cluster(n: int, replication: int = 1, min_insync: int = 1) -> list[Cluster]:
    """The Cluster of each of n nodes on free loopback ports (node ids 0..n-1)."""
    nodes = tuple(Node(i, f"127.0.0.1:{port}") for i, port in enumerate(free_ports(n)))
    return [Cluster(nodes, i, replication, min_insync) for i in range(n)]


async def wait_until(condition: Callable[[], bool], timeout: float = 10) -> None:
    """Poll `condition` (state that another task, thread or process changes) until true."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def committed_files(sink: Path) -> list[str]:
    """Files Spark's file sink committed, from its _spark_metadata log (others may be half written)."""
    files: set[str] = set()
    log = sink / "_spark_metadata"
    if not log.is_dir():
        return []
    for entry in sorted(
        log.iterdir(), key=lambda p: int(p.name.split(".")[0]) if p.name[0].isdigit() else -1
    ):
        if not entry.name[0].isdigit():
            continue
        for line in entry.read_text().splitlines()[1:]:  # first line is the log version
            record = json.loads(line)
            if record["action"] == "add":
                files.add(record["path"])
            else:
                files.discard(record["path"])
    return sorted(files)


def sink_values(sink: Path) -> list[bytes]:
    files = [urllib.parse.urlparse(f).path for f in committed_files(sink)]
    return [v for f in files for v in pq.read_table(f, columns=["value"]).column("value").to_pylist()]


# grpc.aio's client reports a write that raced the server's end of the call as this, in place of the
# server's status (grpc/grpc#36066): a status under test is asked again when it comes back as this
CORE_RACE = "Internal error from Core"


async def status_past_core_race(call: Callable[[], Any], attempts: int = 5) -> tuple[grpc.StatusCode, str]:
    """The status of `call()` (a coroutine that raises AioRpcError or returns), asked again while the
    client shows the write race instead of the server's status."""
    code, details = grpc.StatusCode.OK, ""
    for _ in range(attempts):
        try:
            await call()
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
        else:
            return grpc.StatusCode.OK, ""
        if not (code is grpc.StatusCode.INTERNAL and details == CORE_RACE):
            break
    return code, details


def stop(proc: subprocess.Popen[bytes], timeout: float, sig: signal.Signals = signal.SIGTERM) -> int:
    """Send `sig` to `proc` (nothing if it has ended) and wait up to `timeout` s for its exit code; one
    that outlives it (TimeoutExpired) or whose wait is interrupted is killed and reaped."""
    try:
        proc.send_signal(sig)
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def refused(producer: Producer) -> RPCError:
    """The error a producer fails with: at start (a server it cannot reach, or a session the server
    refused: start waits for its answer) or at the first flush (a refusal after start's wait)."""
    try:
        await asyncio.wait_for(producer.start(), 20)
        await producer.send_many([b"r"])
        await producer.flush(10)
    except RPCError as exc:
        return exc
    finally:
        await producer.abort()
    raise AssertionError("the producer was not refused")


@contextlib.contextmanager
def serving_page(body: bytes, *, content_length: bool = True, drip: float = 0.0) -> Iterator[str]:
    """An HTTP server on a loopback port answering every GET with `body` (200); yields its base URL.
    Without `content_length` the body ends where the connection does; `drip`: seconds between bytes
    (a page sent a byte at a time, until the client goes or the server stops)."""
    stopping = threading.Event()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            if content_length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # a client that stopped reading went away
                if not drip:
                    self.wfile.write(body)
                    return
                for i in range(len(body)):
                    if stopping.wait(drip):
                        return
                    self.wfile.write(body[i : i + 1])
                    self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stopping.set()
        server.shutdown()
        server.server_close()


def positions(offset: dict[str, Any]) -> dict[str, Any]:
    """A source offset's positions, without the incarnations of the logs they are in."""
    return {stream: at for stream, at in offset.items() if stream != "_incarnations"}
