"""Keepalive between cluster peers (sluice_client.keepalive): a peer's pings are taken over a long idle
stream, a client pinging past the policy is sent GOAWAY, and a Replicate stream to a peer that stops
answering with its connection open (no FIN: a host gone, a network cut) ends on both sides within the
keepalive timeout. Real receiver nodes on loopback, and a real TCP proxy between them that can be told
to stop forwarding."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ingest.server import SluiceServer
from receivers.cluster import Cluster, ClusterConfigError, Node
from sluice_client.keepalive import channel_options
from tests.support import Proxy, loopback_cluster, running_server, wait_until

KEEPALIVE = 0.2
TIMEOUT = 1.0


def short(clusters: list[Cluster]) -> list[Cluster]:
    return [dataclasses.replace(c, keepalive=KEEPALIVE, keepalive_timeout=TIMEOUT) for c in clusters]


@contextlib.asynccontextmanager
async def started(tmp_path: Path, clusters: list[Cluster]) -> AsyncIterator[dict[int, SluiceServer]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for cluster in clusters:
            port = int(cluster.me.target.rsplit(":", 1)[1])
            servers[cluster.me.id] = await stack.enter_async_context(
                running_server(tmp_path / f"node{cluster.me.id}", "s", cluster=cluster, port=port)
            )
        yield servers


def test_the_peer_keepalive_is_checked() -> None:
    nodes = (Node(0, "a:1"), Node(1, "b:1"))
    for bad in ({"keepalive": 0.0}, {"keepalive_timeout": -1.0}, {"keepalive": 1e9}):
        with pytest.raises(ClusterConfigError, match="peer keepalive"):
            Cluster(nodes, 0, **bad)  # type: ignore[arg-type]


async def test_a_peers_pings_are_taken_over_a_long_idle_stream_and_faster_ones_get_goaway(
    tmp_path: Path,
) -> None:
    """Peers ping every Cluster.keepalive (0.2 s here; gRPC sends a client's pings a second apart at
    most) and a node takes them: the Replicate stream of an idle cluster stays connected over 7 s, as
    does a call of a channel with the peers' options. The policy is in force: a server whose clients
    ping every 10 s at most (a single server: producers) takes pings a second apart, without data, as
    abuse (GOAWAY ENHANCE_YOUR_CALM after 2 strikes) and the call ends UNAVAILABLE. Before, the servers'
    option had a name gRPC does not know, their policy was gRPC's default (5 minutes between pings
    without data), and only max_ping_strikes 0 kept any client from a GOAWAY, however fast it pinged."""
    clusters = short(loopback_cluster(2, replication=2, min_insync=2))
    async with (
        started(tmp_path, clusters) as servers,
        running_server(tmp_path / "single", "s") as single,
    ):
        node0 = servers[0].node
        assert node0 is not None
        link = node0.replicator.links[0]
        await wait_until(lambda: link.in_sync, timeout=10)
        sessions = link.sessions
        async with (
            grpc.aio.insecure_channel(clusters[1].me.target, options=clusters[0].channel_options()) as peer,
            grpc.aio.insecure_channel(single.target, options=channel_options(0.2, 1.0)) as abusive,
        ):
            request = health_pb2.HealthCheckRequest(service="")
            watched = health_pb2_grpc.HealthStub(peer).Watch(request)
            flooding = health_pb2_grpc.HealthStub(abusive).Watch(request)
            await watched.read()  # the calls are open, their first answer taken
            await flooding.read()
            deadline = time.monotonic() + 7
            while time.monotonic() < deadline:
                assert link.connected and link.in_sync, link.error
                assert not watched.done()
                await asyncio.sleep(0.01)
            assert link.sessions == sessions  # the same Replicate stream all along
            assert flooding.done()
            assert await flooding.code() is grpc.StatusCode.UNAVAILABLE
            assert not watched.done()
            watched.cancel()


async def test_a_replicate_stream_to_a_peer_that_stops_answering_ends_within_the_keepalive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Node 0 replicates to node 1 through a proxy that then stops forwarding, keeping both connections
    open (no FIN). The owner's stream ends within keepalive + its timeout (the follower leaves the
    in-sync set, credit pauses with min-insync 2), and so does the follower's handler of it (its own
    pings go unanswered): before, both waited for ever on a stream nothing would ever end."""
    plain = short(loopback_cluster(2, replication=2, min_insync=2))
    proxy = Proxy(plain[1].me.target)
    through = await proxy.start()
    nodes = (plain[0].nodes[0], Node(1, through))  # node 0 reaches node 1 through the proxy only
    clusters = [dataclasses.replace(plain[0], nodes=nodes), plain[1]]
    try:
        async with started(tmp_path, clusters) as servers:
            owner, follower = servers[0].node, servers[1].node
            assert owner is not None and follower is not None
            link = owner.replicator.links[0]
            await wait_until(lambda: link.in_sync, timeout=10)
            service = follower._replication
            assert service is not None
            assert service._handlers == 1
            proxy.frozen = True
            frozen_at = time.monotonic()
            await wait_until(lambda: not link.connected, timeout=KEEPALIVE + TIMEOUT + 3)
            assert time.monotonic() - frozen_at < KEEPALIVE + TIMEOUT + 2
            assert not owner.replicator.can_ack
            assert link.error is not None and link.error.startswith("UNAVAILABLE"), link.error
            await wait_until(lambda: service._handlers == 0, timeout=KEEPALIVE + TIMEOUT + 3)
            assert time.monotonic() - frozen_at < KEEPALIVE + TIMEOUT + 2
            assert f"follower 1 ({through}) left the in-sync set" in caplog.text
            proxy.thaw()  # the network is back: the owner reconnects and the follower joins again
            await wait_until(lambda: link.in_sync, timeout=15)
            await wait_until(lambda: service._handlers == 1)
    finally:
        await proxy.close()
