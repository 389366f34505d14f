"""Authentication and authorization over real gRPC on loopback, with real tokens and certificates.

Every method of every service: no credentials, an unknown token or a malformed authorization header is
UNAUTHENTICATED; the wrong role, or a stream not granted (one that does not exist too), is
PERMISSION_DENIED; either way nothing is taken (no session, no credit, no record, no rate change) and
other clients keep working. Principals from client certificates (mutual TLS). Producer ids belong to
their principal (no fencing or dedup across principals, marks survive a restart), and a reloaded auth
table revokes the sessions it no longer allows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from pki import CertificateAuthority
from support import positions, refused, running_server, status_past_core_race, wait_until
from test_cli import SLUICE

from ingest.config import RateConfig, SecurityConfig, ServeConfig
from ingest.server import SluiceServer
from ingest.sessions_service import SessionsService
from receivers.auth import (
    METHOD_ROLES,
    Authenticator,
    AuthFileError,
    AuthTable,
    new_token,
    revoke,
    token_hash,
)
from receivers.config import ReceiverConfig
from receivers.errors import PermissionDenied, Unauthenticated
from receivers.parsed_service import add_parsed_servicer
from receivers.publish_service import PublishService
from receivers.receiver import Receiver
from receivers.wal import WalBlockStore
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.errors import RPCError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

STREAMS = ("clicks", "orders", "secret")
TOKENS = {name: new_token() for name in ("clicks-app", "orders-app", "watcher", "ops")}


def write_auth_file(path: Path, *, clicks_app_streams: tuple[str, ...] = ("clicks",)) -> Path:
    granted = ", ".join(f'"{s}"' for s in clicks_app_streams)
    path.write_text(
        f"""
[principals.clicks-app]
roles = ["producer"]
streams = [{granted}]
token_sha256 = ["{token_hash(TOKENS["clicks-app"])}"]

[principals.orders-app]
roles = ["producer"]
streams = ["clicks", "orders"]
token_sha256 = ["{token_hash(TOKENS["orders-app"])}"]

[principals.watcher]
roles = ["reader"]
token_sha256 = ["{token_hash(TOKENS["watcher"])}"]

[principals.ops]
roles = ["operator"]
token_sha256 = ["{token_hash(TOKENS["ops"])}"]

[principals."mtls-client"]
roles = ["producer", "reader"]
streams = ["clicks"]
"""
    )
    return path


def bearer(principal: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {TOKENS[principal]}"),)


def as_principal(principal: str) -> Credentials:
    return Credentials(token=TOKENS[principal])


@contextlib.asynccontextmanager
async def secured_server(data_dir: Path, auth_file: Path) -> AsyncIterator[SluiceServer]:
    security = SecurityConfig(auth_file=auth_file)
    receiver = {"buffer_records": 10_000, "prefetch": 1_000}
    async with running_server(data_dir, *STREAMS, security=security, **receiver) as server:
        yield server


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    async with secured_server(tmp_path / "data", write_auth_file(tmp_path / "auth.toml")) as srv:
        yield srv


# ---- calling every method ------------------------------------------------------------------------

UNARY: Mapping[str, tuple[Callable[[grpc.aio.Channel], Any], Callable[[], Any]]] = {
    "/ingest.v1.RateControl/GetRate": (pb_grpc.RateControlStub, pb.GetRateRequest),
    "/ingest.v1.RateControl/UpdateRate": (
        pb_grpc.RateControlStub,
        lambda: pb.UpdateRateRequest(records_per_second=500, pin=True),
    ),
    "/ingest.v1.RateControl/SetBounds": (
        pb_grpc.RateControlStub,
        lambda: pb.SetBoundsRequest(min_rate=1, max_rate=10),
    ),
    "/ingest.v1.RateControl/SetEstimator": (
        pb_grpc.RateControlStub,
        lambda: pb.SetEstimatorRequest(estimator="spark-pid"),
    ),
    "/ingest.v1.RateControl/StartBatch": (
        pb_grpc.RateControlStub,
        lambda: pb.StartBatchRequest(records=10, backlog=5),
    ),
    "/ingest.v1.Sessions/ListSessions": (pb_grpc.SessionsStub, pb.ListSessionsRequest),
    "/ingest.v1.Sessions/CancelSession": (
        pb_grpc.SessionsStub,
        lambda: pb.CancelSessionRequest(session_id=1, code=7, reason="x"),
    ),
    "/ingest.v1.Admin/GetConfig": (pb_grpc.AdminStub, pb.GetConfigRequest),
    "/ingest.v1.Admin/SetConfig": (
        pb_grpc.AdminStub,
        lambda: pb.SetConfigRequest(set={"block-interval": "0.5"}),
    ),
    "/ingest.v1.Admin/ListStreams": (pb_grpc.AdminStub, pb.ListStreamsRequest),
    "/ingest.v1.Admin/AddStream": (pb_grpc.AdminStub, lambda: pb.AddStreamRequest(stream="new")),
    "/ingest.v1.Admin/RemoveStream": (
        pb_grpc.AdminStub,
        lambda: pb.RemoveStreamRequest(stream="clicks", backlog=pb.RemoveStreamRequest.KEEP),
    ),
    "/ingest.v1.Admin/GetPipeline": (pb_grpc.AdminStub, pb.GetPipelineRequest),
    "/ingest.v1.Admin/SwapPipeline": (pb_grpc.AdminStub, lambda: pb.SwapPipelineRequest(pipeline="x:y")),
}
PUBLISH = "/ingest.v1.Ingest/Publish"
EVERY_METHOD = (*UNARY, PUBLISH)
CLUSTER_ONLY = {
    # served by a cluster's receiver nodes only (ingest.receiver_node)
    "/ingest.v1.Blocks/ListPartitions",
    "/ingest.v1.Blocks/ReadBlocks",
    "/ingest.v1.Blocks/ReleaseBlocks",
    "/ingest.v1.Replication/Replicate",
    "/ingest.v1.Replication/ProducerMarks",
}


def test_every_method_of_every_service_needs_a_role() -> None:
    served = {
        f"/{service.full_name}/{method.name}"
        for service in pb.DESCRIPTOR.services_by_name.values()
        for method in service.methods
    }
    assert served == set(METHOD_ROLES) == set(EVERY_METHOD) | CLUSTER_ONLY


async def call(
    target: str, method: str, metadata: tuple[tuple[str, str], ...], *, stream: str = "clicks"
) -> tuple[grpc.StatusCode, str]:
    """Call `method` as a client with `metadata` would; its status and details. A Publish sends Open
    and checks that no credit comes before the call ends."""

    async def once() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            if method == PUBLISH:
                publish = pb_grpc.IngestStub(channel).Publish(metadata=metadata)  # type: ignore[call-arg]
                opening = pb.Open(stream=stream, producer_id="intruder", resume_from_seq=0)
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await publish.write(pb.PublishRequest(open=opening))
                while (response := await asyncio.wait_for(publish.read(), 10)) is not grpc.aio.EOF:
                    raise AssertionError(f"a refused Publish got {response}")
                code = await publish.code()
                if code is not grpc.StatusCode.OK:
                    raise grpc.aio.AioRpcError(
                        code, grpc.aio.Metadata(), grpc.aio.Metadata(), await publish.details()
                    )
                return
            stub, request = UNARY[method]
            rpc = getattr(stub(channel), method.rpartition("/")[2])
            await asyncio.wait_for(rpc(request(), metadata=metadata), 10)

    return await status_past_core_race(once)


def taken(server: SluiceServer) -> dict[str, Any]:
    """What a refused call must not change."""
    state: dict[str, Any] = {
        "rate": (server.rate.rate, server.rate.bounds, server.rate.estimator.name, server.rate.pinned),
        "sessions": sorted(s.id for r in server.receivers.values() for s in r.sessions if not s.cancelled),
        "settings": (server.runtime.version, server.runtime.overrides),
    }
    for name, receiver in server.receivers.items():
        stats = receiver.stats
        state[name] = (stats.sessions_opened, stats.credit_granted, stats.records_received)
    return state


async def send_and_ack(producer: Producer, n: int) -> None:
    before = producer.acked
    await producer.send_many([b"r"] * n)
    await producer.flush(10)
    assert producer.acked == before + n


MALFORMED: Mapping[str, tuple[tuple[str, str], ...]] = {
    "no credentials": (),
    "unknown token": (("authorization", f"Bearer {new_token()}"),),
    "another scheme": (("authorization", f"Basic {TOKENS['ops']}"),),
    "no token": (("authorization", "Bearer "),),
    "two headers": (("authorization", f"Bearer {TOKENS['ops']}"), ("authorization", "Bearer x")),
    "a hash for a token": (("authorization", f"Bearer {token_hash(TOKENS['ops'])}"),),
    "too long": (("authorization", "Bearer " + "x" * 5000),),
}


async def test_no_or_bad_credentials_are_unauthenticated_on_every_method(server: SluiceServer) -> None:
    # a live session of a legitimate producer that must not notice anything
    async with Producer(server.target, "clicks", credentials=as_principal("clicks-app"), linger=0) as live:
        await send_and_ack(live, 10)
        before = taken(server)
        for case, metadata in MALFORMED.items():
            for method in EVERY_METHOD:
                code, details = await call(server.target, method, metadata)
                assert code is grpc.StatusCode.UNAUTHENTICATED, (case, method, code, details)
                assert details, (case, method)
        assert taken(server) == before
        await send_and_ack(live, 10)  # still served


GET_RATE = "/ingest.v1.RateControl/GetRate"
READS = ("/ingest.v1.Admin/GetConfig", "/ingest.v1.Admin/ListStreams", "/ingest.v1.Admin/GetPipeline")
LIST_SESSIONS = "/ingest.v1.Sessions/ListSessions"
ROLES_REFUSED = {
    # principal -> the methods its roles do not cover
    "clicks-app": [m for m in EVERY_METHOD if m != PUBLISH],
    "watcher": [m for m in EVERY_METHOD if m not in (GET_RATE, LIST_SESSIONS, *READS)],
    "ops": [PUBLISH],
}


async def test_the_wrong_role_is_permission_denied_and_takes_nothing(server: SluiceServer) -> None:
    async with Producer(server.target, "clicks", credentials=as_principal("orders-app"), linger=0) as live:
        await send_and_ack(live, 10)
        before = taken(server)
        for principal, methods in ROLES_REFUSED.items():
            for method in methods:
                code, details = await call(server.target, method, bearer(principal))
                assert code is grpc.StatusCode.PERMISSION_DENIED, (principal, method, code, details)
                assert principal in details and method in details
        assert taken(server) == before
        await send_and_ack(live, 10)
    # and what each role covers goes through
    assert (await call(server.target, GET_RATE, bearer("watcher")))[0] is grpc.StatusCode.OK
    assert (await call(server.target, GET_RATE, bearer("ops")))[0] is grpc.StatusCode.OK
    update = "/ingest.v1.RateControl/UpdateRate"
    assert (await call(server.target, update, bearer("ops")))[0] is grpc.StatusCode.OK
    assert server.rate.rate == 500


async def test_a_reader_may_ask_the_rate_but_not_seal_the_blocks(server: SluiceServer) -> None:
    """GetRate(seal_blocks=True) cut every receiver's open block and fsynced it: a dashboard's reader
    polling with it made the blocks small. Sealing needs consumer or operator."""
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.RateControlStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused_call:
            await stub.GetRate(pb.GetRateRequest(seal_blocks=True), metadata=bearer("watcher"), timeout=10)
        assert refused_call.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "'watcher' may call /ingest.v1.RateControl/GetRate but not with seal_blocks set" in str(
            refused_call.value.details()
        )
        assert "consumer or operator" in str(refused_call.value.details())
        await stub.GetRate(pb.GetRateRequest(), metadata=bearer("watcher"), timeout=10)  # without: served
        await stub.GetRate(pb.GetRateRequest(seal_blocks=True), metadata=bearer("ops"), timeout=10)


async def test_a_stream_not_granted_is_permission_denied_without_naming_streams(server: SluiceServer) -> None:
    before = taken(server)
    for stream in ("orders", "secret", "no-such-stream", ""):
        code, details = await call(server.target, PUBLISH, bearer("clicks-app"), stream=stream)
        assert code is grpc.StatusCode.PERMISSION_DENIED, (stream, code, details)
        # an outsider learns nothing of the server's streams, not even whether this one exists
        for name in STREAMS[1:]:
            assert name not in details.replace(f"stream {stream!r}", "")
    assert taken(server) == before
    # through the SDK: a terminal error, no reconnect loop
    producer = Producer(server.target, "secret", credentials=as_principal("clicks-app"), start_timeout=30)
    started = asyncio.get_running_loop().time()
    info = await refused(producer)
    assert info.status is grpc.StatusCode.PERMISSION_DENIED
    assert not info.retriable
    assert asyncio.get_running_loop().time() - started < 10
    assert producer.reconnects == 0
    assert taken(server) == before


async def test_a_granted_stream_not_served_names_only_the_principals_streams(tmp_path: Path) -> None:
    """NOT_FOUND listed every served stream, so a producer learnt the names of streams not granted to it."""
    auth = write_auth_file(tmp_path / "auth.toml", clicks_app_streams=("clicks", "gone"))
    async with secured_server(tmp_path / "data", auth) as server:
        code, details = await call(server.target, PUBLISH, bearer("clicks-app"), stream="gone")
        assert code is grpc.StatusCode.NOT_FOUND, details
        assert "(streams: clicks)" in details
        assert "secret" not in details and "orders" not in details


async def test_an_sdk_producer_without_or_with_a_wrong_token_fails_at_once(server: SluiceServer) -> None:
    for credentials in (Credentials(), Credentials(token=new_token())):
        producer = Producer(server.target, "clicks", credentials=credentials, start_timeout=30)
        assert (await refused(producer)).status is grpc.StatusCode.UNAUTHENTICATED


# ---- mutual TLS ----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def mtls_server(
    tmp_path: Path,
    ca: CertificateAuthority,
    table: AuthTable | None,
    authenticator: Authenticator | None = None,
) -> AsyncIterator[tuple[str, dict[str, Receiver]]]:
    """Publish and Sessions behind grpc.ssl_server_credentials(require_client_auth=True); `authenticator`
    (of `table`, with client certificates) when the test reloads it."""
    store = WalBlockStore(tmp_path / "mtls-blocks")
    receivers = {"clicks": Receiver("clicks", store, ReceiverConfig(block_interval=0.02))}
    authenticator = authenticator or Authenticator(table, client_certificates=True)
    issued = ca.issue("server", server=True)
    server = grpc.aio.server()
    PublishService(receivers, authenticator=authenticator).add_to_server(server)
    add_parsed_servicer(server, SessionsService(receivers), "Sessions", authenticator=authenticator)
    credentials = grpc.ssl_server_credentials(
        [(issued.key_pem, issued.cert_pem)], root_certificates=ca.cert_pem, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    for receiver in receivers.values():
        await receiver.start()
    await server.start()
    try:
        yield f"localhost:{port}", receivers
    finally:
        for receiver in receivers.values():
            await receiver.stop()
        await server.stop(None)
        store.close()


def client_credentials(ca: CertificateAuthority, name: str, **kwargs: Any) -> Credentials:
    issued = ca.issue(name, **kwargs)
    return Credentials.from_files(ca_file=ca.cert_file, cert_file=issued.cert_file, key_file=issued.key_file)


async def test_a_client_certificate_names_the_principal(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    table = AuthTable.load(write_auth_file(tmp_path / "auth.toml"))
    async with mtls_server(tmp_path, ca, table) as (target, receivers):
        credentials = client_credentials(ca, "mtls-client")
        async with Producer(target, "clicks", credentials=credentials, linger=0) as producer:
            await send_and_ack(producer, 5)
            async with credentials.channel(target) as channel:
                listing = await pb_grpc.SessionsStub(channel).ListSessions(pb.ListSessionsRequest())
            assert [s.principal for s in listing.sessions] == ["mtls-client"]
        # a verified certificate that names no principal here
        stranger = client_credentials(ca, "stranger")
        info = await refused(Producer(target, "clicks", credentials=stranger, start_timeout=5))
        assert info.status is grpc.StatusCode.PERMISSION_DENIED
        assert "stranger" in info.message
        # a token wins over the certificate: a producer-only token cannot list sessions
        with_token = Credentials(
            root_certificates=credentials.root_certificates,
            certificate_chain=credentials.certificate_chain,
            private_key=credentials.private_key,
            token=TOKENS["clicks-app"],
        )
        async with with_token.channel(target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                await pb_grpc.SessionsStub(channel).ListSessions(
                    pb.ListSessionsRequest(), metadata=with_token.metadata
                )
        assert denied.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert receivers["clicks"].stats.records_received == 5


async def test_a_reload_ends_a_certificate_session_only_when_its_principal_goes(tmp_path: Path) -> None:
    """One principal with a certificate and a token: removing the token ends the token's session
    (UNAUTHENTICATED) and not the certificate's; the certificate's ends PERMISSION_DENIED once the
    principal itself is removed, as before sessions remembered their token."""
    ca = CertificateAuthority(tmp_path / "pki")
    token = new_token()
    auth = write_auth_file(tmp_path / "auth.toml")
    base = auth.read_text()
    auth.write_text(base + f'token_sha256 = ["{token_hash(token)}"]\n')  # mtls-client's section is last
    authenticator = Authenticator(AuthTable.load(auth), client_certificates=True)
    async with mtls_server(tmp_path, ca, None, authenticator) as (target, receivers):
        certificate = client_credentials(ca, "mtls-client")
        by_token = Credentials(  # the server requires a certificate; the token wins over it
            root_certificates=certificate.root_certificates,
            certificate_chain=certificate.certificate_chain,
            private_key=certificate.private_key,
            token=token,
        )
        cert_producer = Producer(target, "clicks", credentials=certificate, linger=0, start_timeout=10)
        token_producer = Producer(target, "clicks", credentials=by_token, linger=0, start_timeout=10)
        for producer in (cert_producer, token_producer):
            await producer.start()
            await send_and_ack(producer, 5)
        auth.write_text(base)  # the token removed, the principal kept
        authenticator.reload(AuthTable.load(auth))
        assert revoke(receivers.values(), authenticator) == 1
        with pytest.raises(RPCError) as info:
            await token_producer.send_many([b"late"])
            await token_producer.flush(10)
        assert info.value.status is grpc.StatusCode.UNAUTHENTICATED and "revoked" in info.value.message
        await send_and_ack(cert_producer, 5)
        auth.write_text(base.replace('[principals."mtls-client"]', '[principals."someone-else"]'))
        authenticator.reload(AuthTable.load(auth))
        assert revoke(receivers.values(), authenticator) == 1
        with pytest.raises(RPCError) as info:
            await cert_producer.send_many([b"late"])
            await cert_producer.flush(10)
        assert info.value.status is grpc.StatusCode.PERMISSION_DENIED, info.value
        assert "no longer exists" in info.value.message
        for producer in (cert_producer, token_producer):
            await producer.abort()


async def test_expired_or_foreign_certificates_never_reach_a_service(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    other = CertificateAuthority(tmp_path / "other", "another-ca")
    async with mtls_server(tmp_path, ca, None) as (target, receivers):
        cases = {
            "expired": client_credentials(ca, "late", expired=True),
            "another CA": Credentials.from_files(
                ca_file=ca.cert_file,
                cert_file=(foreign := other.issue("foreign")).cert_file,
                key_file=foreign.key_file,
            ),
            "no certificate": Credentials(root_certificates=ca.cert_pem),
            "server not trusted": client_credentials(other, "trusting-the-wrong-ca"),
        }
        for case, credentials in cases.items():
            producer = Producer(target, "clicks", credentials=credentials, start_timeout=3)
            assert (await refused(producer)).status is grpc.StatusCode.UNAVAILABLE, case
        assert receivers["clicks"].stats.sessions_opened == 0
        # without an auth file a verified certificate is a principal with every role
        async with Producer(target, "clicks", credentials=client_credentials(ca, "anyone"), linger=0) as ok:
            await send_and_ack(ok, 3)
        assert [s.principal.name for s in receivers["clicks"].sessions] in ([], ["anyone"])


async def test_a_server_certificate_it_cannot_trust_fails_the_producer_at_once(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    other = CertificateAuthority(tmp_path / "other", "another-ca")
    async with mtls_server(tmp_path, ca, None) as (target, _):
        producer = Producer(target, "clicks", credentials=client_credentials(other, "x"), start_timeout=30)
        started = asyncio.get_running_loop().time()
        assert "handshake" in (await refused(producer)).message.lower()
        assert asyncio.get_running_loop().time() - started < 10  # not 30 s of retries


def test_certificate_names_count_only_when_the_server_verified_them() -> None:
    table = AuthTable.parse({"principals": {"ops": {"roles": ["operator"]}}})
    context = {"x509_common_name": [b"ops"], "peer_dns": [b"ops.example.com"]}
    # a TLS server without a client CA never verified a certificate: its names are no one's
    with pytest.raises(Unauthenticated):
        Authenticator(table).authenticate((), context)
    assert Authenticator(table, client_certificates=True).authenticate((), context).name == "ops"
    # DNS and URI SANs, as grpcio gives them; not email or IP SANs, not names no principal can have
    sans = {"x509_subject_alternative_name": [b"ops", b"10.0.0.1"], "peer_uri": [b"spiffe://x/ops"]}
    with pytest.raises(PermissionDenied):
        Authenticator(table, client_certificates=True).authenticate((), sans)
    bad = {"x509_common_name": [b"ops\x00evil", b"o" * 300]}
    with pytest.raises(Unauthenticated):
        Authenticator(table, client_certificates=True).authenticate((), bad)


# ---- producer ids belong to their principal -----------------------------------------------------


async def test_another_principal_cannot_fence_or_shadow_a_producer_id(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.toml")
    async with secured_server(tmp_path / "data", auth) as server:
        victim = Producer(server.target, "clicks", producer_id="p1", credentials=as_principal("clicks-app"))
        await victim.start()
        await send_and_ack(victim, 10)
        # the attacker takes the same id and runs ahead of the victim's sequence numbers
        async with Producer(
            server.target, "clicks", producer_id="p1", credentials=as_principal("orders-app"), linger=0
        ) as attacker:
            await send_and_ack(attacker, 50)
            await send_and_ack(victim, 30)  # not fenced (ABORTED), not dropped as duplicates
        await victim.close()
        receiver = server.receivers["clicks"]
        assert receiver.stats.records_deduplicated == 0
        assert receiver.stats.sessions_fenced == 0
        assert receiver.stats.records_received == 90
        assert receiver.producer("p1") is None  # never the bare id on a server with authentication
    # the marks survive a restart, per principal: the victim's resend is dropped, the attacker's
    # numbering does not reach it
    async with secured_server(tmp_path / "data", auth) as server:
        async with Producer(
            server.target,
            "clicks",
            producer_id="p1",
            credentials=as_principal("clicks-app"),
            resume=True,  # a resend (a new run from 0 would be refused: ALREADY_EXISTS)
            linger=0,
        ) as again:
            await send_and_ack(again, 40)  # seqs 0..39: all held already
        receiver = server.receivers["clicks"]
        assert receiver.stats.records_deduplicated == 40
        assert receiver.stats.records_received == 0
        async with Producer(
            server.target,
            "clicks",
            producer_id="p1",
            credentials=as_principal("orders-app"),
            first_seq=50,
            linger=0,
        ) as attacker:
            await send_and_ack(attacker, 5)  # continues its own numbering at 50
        assert receiver.stats.records_received == 5


async def test_a_flood_of_new_producer_ids_evicts_only_the_flooders_own(tmp_path: Path) -> None:
    """One LRU table for every principal: orders-app opening sessions with fresh ids pushed clicks-app's
    producer out, so its resume was refused (OUT_OF_RANGE) and an SDK resend was stored twice."""
    security = SecurityConfig(auth_file=write_auth_file(tmp_path / "auth.toml"))
    async with running_server(tmp_path / "data", *STREAMS, security=security, max_producers=5) as server:
        async with Producer(
            server.target, "clicks", producer_id="victim", credentials=as_principal("clicks-app"), linger=0
        ) as victim:
            await send_and_ack(victim, 10)
        for i in range(20):  # the flood: each a new id, one record
            async with Producer(
                server.target, "clicks", producer_id=f"flood-{i}", credentials=as_principal("orders-app")
            ) as flood:
                await send_and_ack(flood, 1)
        receiver = server.receivers["clicks"]
        assert receiver.known_producers == 5
        assert server.auth.table is not None
        assert receiver.producer("victim", server.auth.table.principals["clicks-app"]) is not None
        async with Producer(
            server.target,
            "clicks",
            producer_id="victim",
            credentials=as_principal("clicks-app"),
            first_seq=5,  # resends 5..9, then 5 new ones
            resume=True,
            linger=0,
        ) as again:
            await send_and_ack(again, 10)
        assert receiver.stats.records_deduplicated == 5


async def test_a_producer_id_with_nul_is_refused(tmp_path: Path) -> None:
    """An anonymous id "\0app\0victim" taken before authentication was turned on was the same key as
    principal app's producer "victim": app's records were then dropped as duplicates of it."""
    with pytest.raises(ValueError, match="producer_id must not contain NUL"):
        Producer("127.0.0.1:1", "clicks", producer_id="\0clicks-app\0victim")  # the SDK refuses it first
    async with running_server(tmp_path / "data", "clicks") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:  # another client's Open
            call = pb_grpc.IngestStub(channel).Publish()
            await call.write(
                pb.PublishRequest(open=pb.Open(stream="clicks", producer_id="\0clicks-app\0victim"))
            )
            with pytest.raises(grpc.aio.AioRpcError) as said:
                await call.read()
        assert said.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "must not contain NUL" in (said.value.details() or "")


async def test_list_sessions_names_each_session_principal(server: SluiceServer) -> None:
    async with (
        Producer(server.target, "clicks", credentials=as_principal("clicks-app")) as a,
        Producer(server.target, "orders", credentials=as_principal("orders-app")) as b,
    ):
        await asyncio.gather(send_and_ack(a, 1), send_and_ack(b, 1))
        async with grpc.aio.insecure_channel(server.target) as channel:
            listing = await pb_grpc.SessionsStub(channel).ListSessions(
                pb.ListSessionsRequest(), metadata=bearer("watcher")
            )
        assert sorted((s.stream, s.principal) for s in listing.sessions) == [
            ("clicks", "clicks-app"),
            ("orders", "orders-app"),
        ]


# ---- reload --------------------------------------------------------------------------------------


async def test_a_reload_revokes_the_sessions_it_no_longer_allows(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.toml", clicks_app_streams=("clicks", "orders"))
    async with secured_server(tmp_path / "data", auth) as server:
        kept = Producer(server.target, "clicks", credentials=as_principal("clicks-app"), linger=0)
        dropped = Producer(server.target, "orders", credentials=as_principal("clicks-app"), linger=0)
        other = Producer(server.target, "orders", credentials=as_principal("orders-app"), linger=0)
        for producer in (kept, dropped, other):
            await producer.start()
            await send_and_ack(producer, 5)
        write_auth_file(auth, clicks_app_streams=("clicks",))
        server.auth.reload(AuthTable.load(auth))
        assert revoke(server.receivers.values(), server.auth) == 1
        with pytest.raises(RPCError) as info:
            await dropped.flush(10)
            await dropped.send_many([b"late"])
            await dropped.flush(10)
        assert info.value.status is grpc.StatusCode.PERMISSION_DENIED
        assert "orders" in info.value.message
        assert dropped.acked == 5  # what it sent before was taken and acked
        await send_and_ack(kept, 5)
        await send_and_ack(other, 5)
        assert revoke(server.receivers.values(), server.auth) == 0
        # a principal removed altogether
        auth.write_text(auth.read_text().replace("[principals.orders-app]", "[principals.renamed-app]"))
        server.auth.reload(AuthTable.load(auth))
        assert revoke(server.receivers.values(), server.auth) == 1
        orders = server.receivers["orders"]
        await wait_until(lambda: not any(s.principal.name == "orders-app" for s in orders.sessions))
        with pytest.raises(RPCError) as info:
            await other.send_many([b"late"])
            await other.flush(10)
        assert info.value.status is grpc.StatusCode.UNAUTHENTICATED  # its token went with it
        assert "revoked" in info.value.message
        await send_and_ack(kept, 5)
        for producer in (kept, dropped, other):
            await producer.abort()


async def test_a_token_removed_on_reload_ends_only_the_sessions_opened_with_it(tmp_path: Path) -> None:
    """A leaked token rotated out of the auth file: on reload (what SIGHUP runs) the sessions opened with
    it end UNAUTHENTICATED, saying the token was revoked, and the SDK fails without reconnecting; the
    same principal's sessions on its other token keep publishing. Before, sessions did not remember
    their token: the leaked one published on until it closed."""
    leaked, kept = new_token(), new_token()
    auth = tmp_path / "auth.toml"

    def write(*tokens: str) -> None:
        hashes = ", ".join(f'"{token_hash(t)}"' for t in tokens)
        auth.write_text(
            f'[principals.app]\nroles = ["producer"]\nstreams = ["clicks"]\ntoken_sha256 = [{hashes}]\n'
        )

    write(leaked, kept)
    async with secured_server(tmp_path / "data", auth) as server:
        old = Producer(server.target, "clicks", credentials=Credentials(token=leaked), linger=0)
        new = Producer(server.target, "clicks", credentials=Credentials(token=kept), linger=0)
        for producer in (old, new):
            await producer.start()
            await send_and_ack(producer, 5)
        clicks = server.receivers["clicks"]
        assert len(clicks.sessions) == 2
        write(kept)
        assert server.reload_security() == ["auth file: 1 principals, 1 tokens; 1 live calls revoked"]
        # promptly: the revoked session is gone from the server at once, nothing sent meanwhile (3 s:
        # the suite runs beside a Spark test on a 2-core machine)
        await wait_until(lambda: [s.producer_id for s in clicks.sessions] == [new.producer_id], timeout=3)
        with pytest.raises(RPCError) as info:
            await asyncio.wait_for(old.flush(5), 5)
            await old.send_many([b"late"])
            await asyncio.wait_for(old.flush(5), 5)
        assert info.value.status is grpc.StatusCode.UNAUTHENTICATED, info.value
        assert "revoked" in info.value.message, info.value.message
        assert leaked not in info.value.message and token_hash(leaked) not in info.value.message
        assert old.acked == 5 and old.reconnects == 0  # what it sent before was acked; no retry loop
        with pytest.raises(RPCError):
            old.check_open()  # the producer stays failed
        for _ in range(3):
            await send_and_ack(new, 5)  # the other token's session goes on undisturbed
        assert new.reconnects == 0 and new.acked == 20
        # a new call with the removed token is refused; the kept one may still open sessions
        retry = Producer(server.target, "clicks", credentials=Credentials(token=leaked), start_timeout=5)
        assert (await refused(retry)).status is grpc.StatusCode.UNAUTHENTICATED
        async with Producer(server.target, "clicks", credentials=Credentials(token=kept), linger=0) as again:
            await send_and_ack(again, 5)
        await old.abort()
        await new.close()


async def test_a_reload_of_an_auth_file_without_principals_changes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A truncated auth file was taken on SIGHUP ("0 principals, 0 tokens", at INFO): every session
    revoked, every caller UNAUTHENTICATED. It is refused as a malformed file is: an ERROR, the old
    table stays."""
    auth = write_auth_file(tmp_path / "auth.toml")
    async with secured_server(tmp_path / "data", auth) as server:
        table = server.auth.table
        producer = Producer(server.target, "clicks", credentials=as_principal("clicks-app"), linger=0)
        await producer.start()
        await send_and_ack(producer, 5)
        for text in ("", "[defaults]\nmax_sessions = 4\n", "[principals]\n"):
            auth.write_text(text)
            caplog.clear()
            with caplog.at_level(logging.INFO, logger="ingest.server"):
                assert server.reload_security() == []
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and "auth file not reloaded" in errors[0], errors
            assert "no principals" in errors[0]
            assert server.auth.table is table
        await send_and_ack(producer, 5)  # its session lives on
        async with grpc.aio.insecure_channel(server.target) as ch:
            await pb_grpc.RateControlStub(ch).GetRate(pb.GetRateRequest(), metadata=bearer("ops"), timeout=10)
        await producer.close()


async def test_an_auth_file_granting_an_invalid_stream_name_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside tester: a grant that is no stream name ("../x", "Default " with a space) was taken,
    and the principal could publish nowhere, without a word. Refused as --stream refuses such a name, at
    parse and on reload (an ERROR naming the principal and the name; the old table stays). "*" stays."""
    for grant in ("../x", "Default ", "a/b", "-x"):
        with pytest.raises(
            AuthFileError, match=re.escape(f"[principals.p] streams: invalid stream name {grant!r}")
        ):
            AuthTable.parse({"principals": {"p": {"roles": ["producer"], "streams": ["clicks", grant]}}})
    assert AuthTable.parse({"principals": {"p": {"roles": ["producer"], "streams": "*"}}}).principals["p"]
    auth = write_auth_file(tmp_path / "auth.toml")
    async with secured_server(tmp_path / "data", auth) as server:
        table = server.auth.table
        write_auth_file(auth, clicks_app_streams=("clicks", "../x"))
        with caplog.at_level(logging.INFO, logger="ingest.server"):
            assert server.reload_security() == []
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "auth file not reloaded" in errors[0], errors
        assert "[principals.clicks-app] streams: invalid stream name '../x'" in errors[0], errors
        assert server.auth.table is table


async def test_an_auth_file_no_caller_can_authenticate_with_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's auth file whose hash line never reached it (`$(cat ops.hash)` of an empty file):
    principals, and not one token_sha256, on a server without a client CA. `sluice serve` started and
    answered every call "unknown bearer token". Refused at the start and by `config check` (exit 2,
    naming the file and why), and on reload (the old table stays); under mutual TLS a certificate names
    a principal, so such a file stays valid there."""
    empty = tmp_path / "empty.toml"
    empty.write_text('[principals.ops]\nroles = ["operator", "reader"]\n\n')
    says = "no principal has a token_sha256, and without a client CA (--client-ca) no certificate"
    with pytest.raises(AuthFileError, match=re.escape(f"{empty}: {says}")):
        async with running_server(tmp_path / "d1", security=SecurityConfig(auth_file=empty)):
            pass
    check = [*SLUICE, "config", "check", "--no-spark", "--data-dir", str(tmp_path / "d2"), "--auth-file"]
    checked = await asyncio.to_thread(
        subprocess.run, [*check, str(empty)], capture_output=True, text=True, timeout=120, check=False
    )
    assert checked.returncode == 2 and says in checked.stderr, checked.stderr
    assert "Traceback" not in checked.stderr, checked.stderr
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:51101\n")
    driver = [*check[:-1], "--role", "driver", "--nodes", str(nodes), "--auth-file", str(empty)]
    checked = await asyncio.to_thread(
        subprocess.run, [a for a in driver if a != "--no-spark"], capture_output=True, text=True, timeout=120
    )
    assert checked.returncode == 2 and says in checked.stderr, checked.stderr  # a cluster's driver alike
    auth = write_auth_file(tmp_path / "auth.toml")
    async with secured_server(tmp_path / "data", auth) as server:
        table = server.auth.table
        auth.write_text(empty.read_text())
        with caplog.at_level(logging.INFO, logger="ingest.server"):
            assert server.reload_security() == []
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "auth file not reloaded" in errors[0] and says in errors[0], errors
        assert server.auth.table is table
    assert AuthTable.load(empty, client_ca=True).principals["ops"]  # a certificate may name it


# ---- the Spark source on a secured server --------------------------------------------------------


async def fill(server: SluiceServer, n: int) -> None:
    async with Producer(server.target, "clicks", credentials=as_principal("clicks-app"), linger=0) as p:
        for _ in range(n // 100):  # blocks of 100
            await p.send_many([b"y"] * 100)
            await p.flush(10)


def source_cap(options: Mapping[str, str]) -> Callable[[], Any]:
    from pyspark.sql.streaming.datasource import ReadAllAvailable

    from ingest.spark.source import SluiceStreamReader

    reader = SluiceStreamReader({"streams": "clicks", "triggerSeconds": "0.5", **options})

    async def cap() -> Any:
        return positions(await asyncio.to_thread(reader.latestOffset, {"clicks": 0}, ReadAllAvailable()))

    return cap


async def test_the_source_asks_a_secured_server_with_the_pipeline_token(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.toml")
    async with secured_server(tmp_path / "data", auth) as server:
        await fill(server, 1000)
        server.rate.update(700)  # x 0.5 s: 350 records a batch
        token = server.pipeline_token_file
        assert oct(token.stat().st_mode & 0o777) == "0o600"
        path = str(server.config.blocks_dir)
        capped = source_cap({"path": path, "rateTarget": server.rate_target, "rateTokenFile": str(token)})
        assert await capped() == {"clicks": 350}
        # without it the server refuses the source (UNAUTHENTICATED): it cannot steer the batches
        unsteered = source_cap({"path": path, "rateTarget": server.rate_target})
        assert await unsteered() == {"clicks": 1000}
        # the server's own token outlives a reload of the auth file
        assert server.reload_security()
        server.rate.update(400)
        assert await capped() == {"clicks": 200}
        # and it may only steer: no Publish
        producer = Producer(server.target, "clicks", credentials=Credentials.from_files(token_file=token))
        assert (await refused(producer)).status is grpc.StatusCode.PERMISSION_DENIED
        old = token.read_text().strip()
    # the file outlives stop (Spark drains after it), the token does not: the next run refuses it
    assert token.read_text().strip() == old
    async with secured_server(tmp_path / "data", auth) as server:
        assert token.read_text().strip() != old
        stale = Producer(server.target, "clicks", credentials=Credentials(token=old))
        assert (await refused(stale)).status is grpc.StatusCode.UNAUTHENTICATED


async def test_the_source_of_a_tls_server(tmp_path: Path) -> None:
    from ingest.config import TlsConfig

    ca = CertificateAuthority(tmp_path / "pki")
    issued = ca.issue("server", server=True)
    ops_token = tmp_path / "ops.token"
    ops_token.write_text(TOKENS["ops"])
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path / "data",
        streams=STREAMS,
        receiver=ReceiverConfig(block_interval=0.02),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        spark=False,
        security=SecurityConfig(
            auth_file=write_auth_file(tmp_path / "auth.toml"),
            tls=TlsConfig(issued.cert_file, issued.key_file),
        ),
    )
    server = SluiceServer(config)
    await server.start()
    try:
        tls = Credentials(root_certificates=ca.cert_pem, token=TOKENS["clicks-app"])
        async with Producer(f"localhost:{server.port}", "clicks", credentials=tls, linger=0) as producer:
            await producer.send_many([b"y"] * 1000)
            await producer.flush(10)
        server.rate.update(700)
        path = str(config.blocks_dir)
        # sluice serve's own source: a plaintext port on loopback, with the pipeline token
        assert server.rate_target != server.target and server.rate_target.startswith("127.0.0.1:")
        token = str(server.pipeline_token_file)
        own = {"path": path, "rateTarget": server.rate_target, "rateTokenFile": token}
        assert await source_cap(own)() == {"clicks": 350}
        # which still wants a token, this run's own: the auth file's do not get around TLS there
        assert await source_cap({"path": path, "rateTarget": server.rate_target})() == {"clicks": 1000}
        for name in ("ops", "clicks-app"):
            code, details = await call(server.rate_target, "/ingest.v1.RateControl/GetRate", bearer(name))
            assert code is grpc.StatusCode.UNAUTHENTICATED, details
            assert "only the server's own tokens" in details
        code, _ = await call(server.rate_target, PUBLISH, bearer("clicks-app"), stream="clicks")
        assert code is grpc.StatusCode.UNIMPLEMENTED  # nothing but RateControl there
        # a separate Spark job: TLS to the server's port with a CA file and an operator's token
        job = {
            "path": path,
            "rateTarget": f"localhost:{server.port}",
            "rateCaFile": str(ca.cert_file),
            "rateTokenFile": str(ops_token),
        }
        assert await source_cap(job)() == {"clicks": 350}
    finally:
        await server.stop(grace=1)


@pytest.mark.spark
async def test_batches_flow_capped_on_a_server_with_an_auth_file(spark: Any, tmp_path: Path) -> None:
    from ingest.driver import SparkDriver, drive_rate

    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path / "data",
        streams=("clicks",),
        receiver=ReceiverConfig(block_interval=0.02),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=1.0,
        security=SecurityConfig(auth_file=write_auth_file(tmp_path / "auth.toml")),
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(
        spark,
        config,
        query_name="secured",
        rate_target=server.rate_target,
        rate_token_file=server.pipeline_token_file,
    )
    sizes: list[int] = []
    driver.on_batch(lambda batch: sizes.append(batch.num_input_rows))
    drive_rate(driver, server, asyncio.get_running_loop())
    try:
        await fill(server, 3000)  # all there before the first batch: uncapped, one batch takes it
        server.rate.update(1000)  # x 1 s: 1,000 records a batch
        await asyncio.to_thread(driver.start)
        await wait_until(lambda: driver.records_processed >= 3000 or driver.error() is not None, timeout=180)
        assert driver.error() is None, driver.error()
        assert driver.records_processed == 3000
        assert max(sizes) <= 1000, sizes  # the source had the live rate: it asked with its token
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


def test_the_serve_limit_flags_are_the_base_of_auth_file_principals(tmp_path: Path) -> None:
    """`--max-sessions-per-principal` and the other limit flags hold for principals of the auth file
    that set no limit of their own ([defaults] and a principal's own keys still win)."""
    from receivers.principal import Limits

    path = tmp_path / "auth.toml"
    path.write_text(
        "[defaults]\nidle_timeout_seconds = 30\n"
        '[principals.plain]\nroles = ["reader"]\n'
        f'[principals.own]\nroles = ["reader"]\nmax_sessions = 3\ntoken_sha256 = "{token_hash("own")}"\n'
    )
    server = SluiceServer(
        ServeConfig(
            port=0,
            metrics_port=None,
            data_dir=tmp_path / "data",
            spark=False,
            security=SecurityConfig(auth_file=path, limits=Limits(max_sessions=7, max_streams=2)),
        )
    )
    try:
        table = server.auth.table
        assert table is not None
        plain, own = table.principals["plain"].limits, table.principals["own"].limits
        assert (plain.max_sessions, plain.max_streams, plain.idle_timeout) == (7, 2, 30.0)
        assert (own.max_sessions, own.max_streams) == (3, 2)
    finally:
        server.store.close()
        server._release_lock()


async def test_a_drivers_refusals_of_publish_and_sessions_come_after_authentication(tmp_path: Path) -> None:
    """A cluster's driver takes no records: a push or a sessions call aimed at it by mistake is told
    to go to the receiver nodes (it said only UNIMPLEMENTED "Method not found!"), once the caller is
    authenticated; an outsider gets UNAUTHENTICATED, as on every other method."""
    from ingest.admin_service import DriverIngestService, DriverSessionsService

    authenticator = Authenticator(AuthTable.load(write_auth_file(tmp_path / "auth.toml")))
    server = grpc.aio.server()
    add_parsed_servicer(server, DriverIngestService(authenticator), "Ingest")
    add_parsed_servicer(server, DriverSessionsService(), "Sessions", authenticator=authenticator)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            ingest, sessions = pb_grpc.IngestStub(channel), pb_grpc.SessionsStub(channel)
            for metadata, code in (
                ((), grpc.StatusCode.UNAUTHENTICATED),
                (bearer("watcher"), grpc.StatusCode.PERMISSION_DENIED),  # a reader may not publish
                (bearer("clicks-app"), grpc.StatusCode.UNIMPLEMENTED),
            ):
                # refused before anything is read: no Open written, whose write could race the refusal
                # and end the call INTERNAL on the client instead (grpc/grpc#36066)
                call = ingest.Publish(metadata=metadata)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
                assert refused.value.code() == code, refused.value
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    assert "publish to the receiver nodes" in (refused.value.details() or "")
            with pytest.raises(grpc.aio.AioRpcError) as outsider:
                await sessions.ListSessions(pb.ListSessionsRequest())
            assert outsider.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                await sessions.ListSessions(pb.ListSessionsRequest(), metadata=bearer("watcher"))
            assert elsewhere.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "sluice sessions --target NODE" in (elsewhere.value.details() or "")
    finally:
        await server.stop(None)


async def test_a_server_reachable_from_the_network_without_authentication_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """TLS without an auth file or a client CA: every caller is the anonymous principal, operator too."""
    security = SecurityConfig(insecure=True)
    async with running_server(tmp_path / "wide", "clicks", host="0.0.0.0", security=security):
        assert "without --auth-file or --client-ca: every client that reaches it" in caplog.text
    caplog.clear()
    async with running_server(tmp_path / "local", "clicks"):
        assert "without --auth-file" not in caplog.text


def test_an_auth_file_principal_may_not_take_the_servers_own_names() -> None:
    """ "sluice-pipeline" (the server's own Spark source) and "anonymous" (every caller of a server
    without auth) name the server in audit lines and metrics; a principal of the file that took one
    would be mistaken for it, so the file is refused."""
    for name in ("sluice-pipeline", "anonymous"):
        with pytest.raises(AuthFileError, match=re.escape(f"{name!r} is the server's own principal name")):
            AuthTable.parse({"principals": {name: {"roles": ["reader"]}}})
    assert AuthTable.parse({"principals": {"sluice-pipeline-2": {"roles": ["reader"]}}}).principals


def test_a_principals_message_limit_too_small_for_any_record_is_refused() -> None:
    """A principal's max_message_bytes of 10 was taken: every record of its producers was refused by
    the SDK, "over the -54-byte limit of a record", the limit no record could meet. Refused at parse
    below 1024, as `sluice serve --max-message-bytes` is."""
    for small in (10, "1000B"):
        with pytest.raises(AuthFileError, match=r"\[principals.p\]: max_message_bytes must be >= 1024"):
            AuthTable.parse(
                {"principals": {"p": {"roles": ["producer"], "streams": "*", "max_message_bytes": small}}}
            )
    limits = AuthTable.parse(
        {"principals": {"p": {"roles": ["producer"], "streams": "*", "max_message_bytes": "1KiB"}}}
    )
    assert limits.principals["p"].limits.max_message_bytes == 1024
