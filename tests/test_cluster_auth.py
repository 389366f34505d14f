"""The cluster's services under an auth file: each role gets what it needs and nothing else.

Two receiver nodes (replication 2) on loopback with an auth file: the nodes call each other as the peer
principal (its token in --peer-token-file); producers, readers and operators get PERMISSION_DENIED on the
cluster methods their roles do not cover, unknown callers UNAUTHENTICATED, and a refused call stores,
releases or reveals nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from ingest.config import SecurityConfig
from ingest.server import SluiceServer
from receivers.auth import new_token, token_hash
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, refused, running_server, wait_until

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
    security = SecurityConfig(auth_file=write_auth_file(tmp_path / "auth.toml"))
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
    async with grpc.aio.insecure_channel(target) as channel:
        try:
            await asyncio.wait_for(CALLS[method](channel, metadata), 10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK


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
