"""The cluster's services under an auth file: each role gets what it needs and nothing else.

Two receiver nodes (replication 2) on loopback with an auth file: the nodes call each other as the peer
principal (its token in --peer-token-file); producers, readers and operators get PERMISSION_DENIED on the
cluster methods their roles do not cover, unknown callers UNAUTHENTICATED, and a refused call stores,
releases or reveals nothing."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from ingest.config import SecurityConfig
from ingest.server import SluiceServer
from receivers import blocks_service
from receivers.auth import new_token, token_hash
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, refused, running_server, status_past_core_race, wait_until

ROLES = {"app": "producer", "watcher": "reader", "executor": "consumer", "ops": "operator", "node": "peer"}
TOKENS = {name: new_token() for name in ROLES}


def write_auth_file(path: Path) -> Path:
    sections = []
    for name, role in ROLES.items():
        streams = '\nstreams = ["s"]' if role == "producer" else ""
        digest = token_hash(TOKENS[name])
        sections.append(f'[principals.{name}]\nroles = ["{role}"]{streams}\ntoken_sha256 = ["{digest}"]\n')
    path.write_text("\n".join(sections))
    return path


def bearer(name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[name]}"),)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[dict[int, SluiceServer]]:
    async with secured_cluster(tmp_path, write_auth_file(tmp_path / "auth.toml")) as servers:
        yield servers


@contextlib.asynccontextmanager
async def secured_cluster(tmp_path: Path, auth: Path) -> AsyncIterator[dict[int, SluiceServer]]:
    """Two receiver nodes, replication 2 and min-insync 2 (an ack needs both), replicating as "node"."""
    security = SecurityConfig(auth_file=auth)
    peer_token = tmp_path / "peer.token"
    peer_token.write_text(TOKENS["node"])
    peer_token.chmod(0o600)
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for node in loopback_cluster(2, replication=2, min_insync=2):
            port = int(node.me.target.rsplit(":", 1)[1])
            servers[node.me.id] = await stack.enter_async_context(
                running_server(
                    tmp_path / f"node{node.me.id}",
                    "s",
                    cluster=node,
                    port=port,
                    security=security,
                    peer_token_file=peer_token,
                )
            )
        yield servers


Call = Callable[[grpc.aio.Channel, tuple[tuple[str, str], ...]], Awaitable[object]]


async def _read(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> object:
    request = pb.ReadBlocksRequest(stream="s", owner=0, from_offset=0, to_offset=10)
    return [chunk async for chunk in pb_grpc.BlocksStub(channel).ReadBlocks(request, metadata=metadata)]


async def _replicate(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...]) -> object:
    call = pb_grpc.ReplicationStub(channel).Replicate(metadata=metadata)  # type: ignore[call-arg]
    hello = pb.ReplicaHello(owner=1, nodes=2, replication=2)
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.write(pb.ReplicateRequest(hello=hello))
        await call.done_writing()
    return [response async for response in call]


CALLS: dict[str, Call] = {
    "ListPartitions": lambda ch, md: pb_grpc.BlocksStub(ch).ListPartitions(
        pb.ListPartitionsRequest(), metadata=md
    ),
    "ReadBlocks": _read,
    "ReleaseBlocks": lambda ch, md: pb_grpc.BlocksStub(ch).ReleaseBlocks(
        pb.ReleaseBlocksRequest(stream="s", owner=0, before_offset=5), metadata=md
    ),
    "Replicate": _replicate,
    "ProducerMarks": lambda ch, md: pb_grpc.ReplicationStub(ch).ProducerMarks(
        pb.ProducerMarksRequest(stream="s", producers=["app/p"]), metadata=md
    ),
}
ALLOWED = {
    "app": set(),
    "watcher": {"ListPartitions"},  # status, never a record
    "executor": {"ListPartitions", "ReadBlocks"},
    "ops": {"ListPartitions", "ReleaseBlocks"},
    "node": {"Replicate", "ProducerMarks", "ListPartitions"},  # a restarted node asks where copies end
}


async def status(target: str, method: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    async def once() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            await asyncio.wait_for(CALLS[method](channel, metadata), 10)

    return (await status_past_core_race(once))[0]


def log_state(server: SluiceServer) -> tuple[object, ...]:
    node = server.node
    assert node is not None
    return (
        node.local.released_offset("s"),
        node.local.durable_seq("s"),
        node.replicas.owners(),
        [node.replicas.next_seq(o, "s") for o in node.replicas.owners()],
    )


async def test_nodes_replicate_as_the_peer_principal_and_each_role_gets_only_its_methods(
    cluster: dict[int, SluiceServer],
) -> None:
    target = cluster[0].target
    async with Producer(target, "s", credentials=Credentials(token=TOKENS["app"]), linger=0) as app:
        await app.send_many([b"r"] * 10)
        await app.flush(20)  # acked: so the peer token got the block onto node 1
    assert cluster[1].node is not None
    await wait_until(lambda: cluster[1].node is not None and cluster[1].node.replicas.owners() == [0])
    before = [log_state(s) for s in cluster.values()]

    for name, allowed in ALLOWED.items():
        for method in CALLS:
            code = await status(target, method, bearer(name))
            if method in allowed:
                assert code not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), (
                    name,
                    method,
                    code,
                )
            else:
                assert code is grpc.StatusCode.PERMISSION_DENIED, (name, method, code)
        if name == "ops":  # its ReleaseBlocks went through: the only call that changes the log
            before = [log_state(s) for s in cluster.values()]
    for method in CALLS:
        assert await status(target, method, ()) is grpc.StatusCode.UNAUTHENTICATED, method
        forged = (("authorization", f"Bearer {new_token()}"),)
        assert await status(target, method, forged) is grpc.StatusCode.UNAUTHENTICATED, method
    assert [log_state(s) for s in cluster.values()] == before


async def test_a_principal_set_up_as_a_driver_before_the_consumer_role_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auth = tmp_path / "auth.toml"
    auth.write_text(
        f'[principals.driver]\nroles = ["reader", "operator"]\ntoken_sha256 = ["{token_hash(new_token())}"]\n'
    )
    (node,) = loopback_cluster(1)
    port = int(node.me.target.rsplit(":", 1)[1])
    async with running_server(
        tmp_path / "n", "s", cluster=node, port=port, security=SecurityConfig(auth_file=auth)
    ):
        assert "principal 'driver' has the reader and operator roles but not consumer" in caplog.text


async def test_a_receiver_node_holds_a_principal_to_its_session_limit(tmp_path: Path) -> None:
    """On a cluster node the ledger counted a producer's sessions under its producer key instead of the
    call's, so max_sessions never refused one (a single node did)."""
    auth = write_auth_file(tmp_path / "auth.toml")
    auth.write_text(auth.read_text().replace("[principals.app]\n", "[principals.app]\nmax_sessions = 1\n"))
    peer_token = tmp_path / "peer.token"
    peer_token.write_text(TOKENS["node"])
    peer_token.chmod(0o600)
    (node,) = loopback_cluster(1, replication=1, min_insync=1)
    port = int(node.me.target.rsplit(":", 1)[1])
    security = SecurityConfig(auth_file=auth)
    async with running_server(
        tmp_path / "node", "s", cluster=node, port=port, security=security, peer_token_file=peer_token
    ) as server:
        credentials = Credentials(token=TOKENS["app"])
        async with Producer(server.target, "s", producer_id="p1", credentials=credentials) as first:
            await first.send(b"1")
            await first.flush(timeout=10)
            said = await refused(Producer(server.target, "s", producer_id="p2", credentials=credentials))
        assert said.status is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_sessions" in said.message


async def test_a_peer_token_removed_on_reload_ends_the_replicate_streams_opened_with_it(
    tmp_path: Path,
) -> None:
    """A Replicate stream opened with one of the peer principal's tokens ends UNAUTHENTICATED, saying the
    token was revoked, once a reload drops that token; the nodes' own replication, on the peer's other
    token, goes on (with min-insync 2 a producer's acks show it). Before, a live Replicate stream was
    never looked at again on reload: the removed token kept its stream open."""
    auth = write_auth_file(tmp_path / "auth.toml")
    text = auth.read_text()
    spare = new_token()
    node_hash = f'"{token_hash(TOKENS["node"])}"'
    auth.write_text(text.replace(node_hash, f'{node_hash}, "{token_hash(spare)}"'))
    async with (
        secured_cluster(tmp_path, auth) as servers,
        grpc.aio.insecure_channel(servers[0].target) as channel,
    ):
        stray = pb_grpc.ReplicationStub(channel).Replicate(  # type: ignore[call-arg]
            metadata=(("authorization", f"Bearer {spare}"),)
        )
        await stray.write(pb.ReplicateRequest(hello=pb.ReplicaHello(owner=1, nodes=2, replication=2)))
        first = await asyncio.wait_for(stray.read(), 10)
        assert first.WhichOneof("kind") == "state"
        credentials = Credentials(token=TOKENS["app"])
        async with Producer(servers[1].target, "s", credentials=credentials, linger=0) as app:
            await app.send_many([b"r"] * 10)
            await app.flush(20)
            auth.write_text(text)  # the spare token removed
            assert servers[0].reload_security() == ["auth file: 5 principals, 5 tokens; 1 live calls revoked"]
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(stray.read(), 5)
            assert time.monotonic() - started < 2.5  # at the reload, not at the 5 s wait's end
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, info.value
            assert "revoked" in (info.value.details() or ""), info.value.details()
            for _ in range(3):  # node 1 -> node 0 replication, on the kept token, is undisturbed
                await app.send_many([b"r"] * 10)
                await app.flush(20)
            assert app.acked == 40 and app.reconnects == 0


async def test_a_consumer_token_removed_on_reload_ends_its_read_before_the_next_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ReadBlocks stream of a removed token ends UNAUTHENTICATED ("revoked") instead of streaming the
    rest of its range; a read on the principal's other token is served whole."""
    monkeypatch.setattr(blocks_service, "CHUNK_BYTES", 16 * 1024)  # many chunks: the read stays open
    auth = write_auth_file(tmp_path / "auth.toml")
    text = auth.read_text()
    spare = new_token()
    executor_hash = f'"{token_hash(TOKENS["executor"])}"'
    auth.write_text(text.replace(executor_hash, f'{executor_hash}, "{token_hash(spare)}"'))
    (node,) = loopback_cluster(1)
    port = int(node.me.target.rsplit(":", 1)[1])
    security = SecurityConfig(auth_file=auth)
    async with running_server(tmp_path / "node", "s", cluster=node, port=port, security=security) as server:
        async with Producer(server.target, "s", credentials=Credentials(token=TOKENS["app"])) as app:
            await app.send_many([bytes(1000)] * 2000)  # 2 MB: about 120 chunks
            await app.flush(20)
        # a small flow-control window: the server waits to write while the reader does not read
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 32 * 1024)]
        async with grpc.aio.insecure_channel(server.target, options=options) as channel:
            stub = pb_grpc.BlocksStub(channel)
            listed = await stub.ListPartitions(
                pb.ListPartitionsRequest(seal_blocks=True), metadata=bearer("executor")
            )
            (partition,) = listed.partitions
            assert partition.end_offset == 2000
            request = pb.ReadBlocksRequest(stream="s", owner=0, from_offset=0, to_offset=2000)
            read = stub.ReadBlocks(request, metadata=(("authorization", f"Bearer {spare}"),))
            first = await asyncio.wait_for(read.read(), 10)
            assert isinstance(first, pb.BlockChunk) and first.count < 2000
            auth.write_text(text)  # the spare token removed
            assert server.reload_security() == ["auth file: 5 principals, 5 tokens; 1 live calls revoked"]
            got = first.count
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while (chunk := await asyncio.wait_for(read.read(), 5)) is not grpc.aio.EOF:
                    got += chunk.count
            assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED, info.value
            assert "revoked" in (info.value.details() or "")
            assert got < 2000
            kept = stub.ReadBlocks(request, metadata=bearer("executor"))
            assert sum([chunk.count async for chunk in kept]) == 2000


async def test_a_driver_whose_credentials_the_nodes_refuse_stops_at_start_with_one_line(
    tmp_path: Path, cluster: dict[int, SluiceServer], capsys: pytest.CaptureFixture[str]
) -> None:
    """The driver claims the nodes (one driver per cluster) before anything starts: a token of the
    wrong role was refused there, and the ClusterRefusedError escaped as a traceback."""
    import types

    from ingest.cluster_driver import ClusterDriver, _run
    from ingest.driver_config import DriverConfig

    token = tmp_path / "app.token"
    token.write_text(TOKENS["app"])  # a producer's token: not consumer and operator
    token.chmod(0o600)
    nodes = {node_id: f"127.0.0.1:{server.port}" for node_id, server in cluster.items()}
    config = DriverConfig(nodes=nodes, streams=("s",), data_dir=tmp_path / "driver", token_file=token)
    driver = ClusterDriver(config)
    no_spark = types.SimpleNamespace(stop=lambda: None)  # refused before the query would need Spark
    assert await _run(driver, asyncio.Event(), lambda: no_spark) == 1
    said = capsys.readouterr().err
    assert "cannot start the driver: the receiver nodes refused its credentials" in said, said
    assert "PERMISSION_DENIED" in said and "Traceback" not in said, said


async def test_a_revoked_replicate_stream_ends_once_its_copy_being_stored_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A reload that revokes the token an owner's Replicate stream was opened with, while the follower
    stores a copy in its thread: the stream ends UNAUTHENTICATED once that store has finished, not
    before. Before, the handler was cancelled at once: the call ended (and the service counted no
    stream, so a stop could close the copies under it) while the thread still wrote the block. With the
    token back the owner reconnects and the copy and the owner's view agree: every record once."""
    from receivers import replication_service

    entered, release = threading.Event(), threading.Event()
    check = replication_service._check_payload

    def slow_check(block: Any) -> None:  # the first copy's store waits here, in its thread
        if not entered.is_set():
            entered.set()
            release.wait(30)
        check(block)

    auth = write_auth_file(tmp_path / "auth.toml")
    text = auth.read_text()
    node_hash = token_hash(TOKENS["node"])
    async with secured_cluster(tmp_path, auth) as servers, _released(release):
        owner, follower = servers[1].node, servers[0].node
        assert owner is not None and follower is not None
        (link,) = owner.replicator.links
        await wait_until(lambda: link.in_sync, timeout=20)
        monkeypatch.setattr(replication_service, "_check_payload", slow_check)
        credentials = Credentials(token=TOKENS["app"])
        async with Producer(servers[1].target, "s", credentials=credentials, linger=0) as app:
            sent = [f"r{i}".encode() for i in range(100)]
            await app.send_many(sent)
            assert await asyncio.to_thread(entered.wait, 20), "no copy was stored"
            auth.write_text(text.replace(node_hash, token_hash(new_token())))  # the nodes' token revoked
            assert servers[0].reload_security() == ["auth file: 5 principals, 5 tokens; 1 live calls revoked"]
            await asyncio.sleep(1)  # generous: a stream ended at once is seen by the owner in milliseconds
            assert link.connected and link.error is None, link.error  # the store is still under way
            release.set()
            await wait_until(lambda: not link.connected, timeout=10)
            assert link.error is not None and link.error.startswith("UNAUTHENTICATED"), link.error
            assert "'node' was opened with was revoked" in caplog.text
            auth.write_text(text)  # the token back: the owner reconnects
            servers[0].reload_security()
            await app.flush(30)
            assert app.acked == len(sent)
        await wait_until(lambda: link.connected and link.in_sync, timeout=10)
        end = owner.local.durable_seq("s")
        assert link.acked["s"] == follower.replicas.next_seq(1, "s") == end  # one view of the copy
        blocks = follower.replicas.blocks(1, "s")
        assert [b.seq for b in blocks] == list(range(end))  # whole: each block once, in order
        async with grpc.aio.insecure_channel(servers[0].target) as channel:
            request = pb.ReadBlocksRequest(stream="s", owner=1, from_offset=0, to_offset=len(sent))
            read = pb_grpc.BlocksStub(channel).ReadBlocks(request, metadata=bearer("executor"))
            got = []
            async for chunk in read:
                got += pa.ipc.open_stream(chunk.arrow_ipc).read_all().column("value").to_pylist()
        assert got == sent


@contextlib.asynccontextmanager
async def _released(event: threading.Event) -> AsyncIterator[None]:
    """`event` set on the way out, whatever happened: a thread waiting for it does not hold the stop."""
    try:
        yield
    finally:
        event.set()


async def test_a_driver_reachable_without_authentication_warns_and_names_certified_callers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver serving TLS on a non-loopback address without an auth file or a client CA said
    nothing, where a node warns that every caller may operate it; and under mutual TLS the driver
    ignored the names in a verified client certificate, so an operator the auth file knows by
    certificate (no token) was UNAUTHENTICATED there while the nodes took it. Both as a node now; the
    driver's real rate server, called by `sluice rate get`."""
    import subprocess
    import sys

    from pki import CertificateAuthority

    from ingest.cluster_driver import ClusterDriver
    from ingest.config import TlsConfig
    from ingest.driver_config import DriverConfig

    ca = CertificateAuthority(tmp_path / "pki")
    issued = ca.issue("driver", server=True)
    ops = ca.issue("ops-cert")
    auth = tmp_path / "auth.toml"
    auth.write_text('[principals."ops-cert"]\nroles = ["operator"]\n')
    # without a client CA a file of no token is refused (no caller could authenticate): one with a token
    tokened = tmp_path / "tokened.toml"
    tokened.write_text(auth.read_text() + f'token_sha256 = "{"a" * 64}"\n')
    sluice = str(Path(sys.executable).parent / "sluice")

    async def serving(host: str, *, client_ca: bool, auth_file: Path | None) -> tuple[ClusterDriver, int]:
        tls = TlsConfig(issued.cert_file, issued.key_file, ca.cert_file if client_ca else None)
        config = DriverConfig(
            nodes={0: "127.0.0.1:1"},
            streams=("s",),
            data_dir=tmp_path / f"driver-{len(caplog.records)}-{client_ca}-{auth_file is not None}",
            rate_host=host,
            tls=tls,
            auth_file=auth_file,
        )
        driver = ClusterDriver(config)
        await driver.serve_rate()
        assert driver.rate_target is not None
        return driver, int(driver.rate_target.rpartition(":")[2])

    async def stopped(driver: ClusterDriver) -> None:
        driver.blocks.fenced = "not claimed"  # nothing to give back: this driver never claimed nodes
        await driver.stop()

    caplog.set_level(logging.WARNING, logger="ingest.cluster_driver")
    warning = "without --auth-file or --client-ca: every client that reaches it may operate the driver"
    for host, client_ca, auth_file, warned in (
        ("0.0.0.0", False, None, True),  # TLS alone on the network: anyone may operate it
        ("127.0.0.1", False, None, False),  # loopback, as a node: no warning
        ("0.0.0.0", True, None, False),  # mutual TLS: the client CA vouches for every caller
        ("0.0.0.0", False, tokened, False),
    ):
        caplog.clear()
        driver, _ = await serving(host, client_ca=client_ca, auth_file=auth_file)
        await stopped(driver)
        assert (warning in caplog.text) is warned, (host, client_ca, auth_file, caplog.text)

    driver, port = await serving("127.0.0.1", client_ca=True, auth_file=auth)
    try:
        command = [sluice, "rate", "get", "--target", f"localhost:{port}", "--ca-file", str(ca.cert_file)]
        with_cert = [*command, "--cert-file", str(ops.cert_file), "--key-file", str(ops.key_file)]
        done = await asyncio.to_thread(
            subprocess.run, with_cert, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        assert "records/s" in done.stdout
        stranger = ca.issue("stranger")
        other = [*command, "--cert-file", str(stranger.cert_file), "--key-file", str(stranger.key_file)]
        done = await asyncio.to_thread(
            subprocess.run, other, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 3 and "PERMISSION_DENIED" in done.stderr, done.stderr
    finally:
        await stopped(driver)


async def test_only_an_operator_may_name_a_driver_to_a_node(cluster: dict[int, SluiceServer]) -> None:
    """A call that names a driver (metadata sluice-driver-id) takes the node's driver lease
    (ListPartitions) or tells it where the driver serves RateControl (GetRate), where the node sends
    operators in its refusals. Both methods are open to a reader (a dashboard's token), which took the
    lease, renewed it each second and locked the cluster's driver out ("another driver holds the
    receiver nodes"), or sent operators, their operator token with them, to an address of its
    choosing. Naming a driver now needs operator, as the driver has: PERMISSION_DENIED, nothing taken;
    the same calls without the name go on as before."""
    target = cluster[0].target
    evil = (("sluice-driver-id", "not-the-driver"), ("sluice-driver-rate", "203.0.113.9:51109"))
    async with grpc.aio.insecure_channel(target) as channel:
        blocks, rate = pb_grpc.BlocksStub(channel), pb_grpc.RateControlStub(channel)
        calls = [(name, "ListPartitions") for name in ("watcher", "executor", "node")]
        calls.append(("watcher", "GetRate"))  # the only one of them that may call GetRate
        for name, method in calls:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                if method == "GetRate":
                    await rate.GetRate(pb.GetRateRequest(), metadata=(*bearer(name), *evil))
                else:
                    await blocks.ListPartitions(pb.ListPartitionsRequest(), metadata=(*bearer(name), *evil))
            details = str(refused.value.details())
            assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED, (name, method, details)
            assert f"principal {name!r} may call /ingest.v1." in details, details
            assert "not naming a driver (sluice-driver-id): it needs operator" in details, details
        await blocks.ListPartitions(
            pb.ListPartitionsRequest(), metadata=bearer("watcher")
        )  # unnamed: as before
        # the lease is free: a driver (operator) takes it
        driver = (*bearer("ops"), ("sluice-driver-id", "the-driver"))
        await blocks.ListPartitions(pb.ListPartitionsRequest(), metadata=driver)
        # and no operator is sent to the forged address
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rate.UpdateRate(
                pb.UpdateRateRequest(records_per_second=5000, pin=True), metadata=bearer("ops")
            )
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "203.0.113.9" not in str(refused.value.details()), refused.value.details()


async def test_a_follower_says_when_it_refuses_a_replicate_call_once_a_minute(
    cluster: dict[int, SluiceServer], caplog: pytest.LogCaptureFixture
) -> None:
    """A node whose peer token this follower does not accept had its copies refused at every try, and
    only the owner said so: an operator looking at the follower saw nothing. The follower says it too,
    at most once a minute (any caller can make refusals)."""
    target = cluster[1].target
    wrong = (("authorization", f"Bearer {new_token()}"),)
    caplog.set_level(logging.DEBUG, logger="receivers.replication_service")
    for metadata in (wrong, bearer("watcher"), wrong):
        code = await status(target, "Replicate", metadata)
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED), code
    said = [r for r in caplog.records if "refused replication from" in r.getMessage()]
    warned = [r for r in said if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "unknown bearer token" in warned[0].getMessage(), warned
    assert "peer role" in warned[0].getMessage()
    assert len(said) >= 3  # the others at DEBUG
