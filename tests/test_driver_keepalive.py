"""Keepalive on the Spark side's channels to receiver nodes and Sluice servers
(sluice_client.keepalive.node_channel_options): an executor's ReadBlocks from a holder that stops
answering mid-read, and the cluster driver's kept channels (node rates, planning) and the live rate's
to a server whose connection was dropped without a FIN, fail or connect anew within the peers'
keepalive and its timeout (20 s), with the options as shipped; and every server they ping takes the
pings. Real receiver nodes and servers on loopback, and the TCP proxy of tests/support.py between them
and the client, which stops forwarding with the connection left open."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pyarrow as pa

from ingest.cluster_driver import ClusterDriver
from ingest.config import SecurityConfig, TlsConfig
from ingest.driver_config import DriverConfig
from ingest.node_rates import NodeRates
from ingest.spark.cluster_source import BlocksClient, PartitionUnreadableError, RangeSpec, read_range
from ingest.spark.live_rate import LiveRateCap
from ingest.spark.source import ARROW_SCHEMA
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.keepalive import PEER_KEEPALIVE_SECONDS, PEER_KEEPALIVE_TIMEOUT_SECONDS, channel_options
from tests.pki import CertificateAuthority
from tests.support import Proxy, loopback_cluster, running_server, wait_until

GONE_WITHIN = PEER_KEEPALIVE_SECONDS + PEER_KEEPALIVE_TIMEOUT_SECONDS
"""A connection that stops answering is closed this long after its last frame, at most."""
SLACK = 30.0
"""Beyond GONE_WITHIN: the calls' own timeouts, a reconnect, a loaded machine. Still far below the
300 s an executor's read waited (READ_TIMEOUT), and a kept channel never connected anew at all."""


async def test_a_read_from_a_holder_that_stops_answering_mid_read_ends_within_the_keepalive(
    tmp_path: Path,
) -> None:
    """Two nodes with replication 2; node 0 is reached through a proxy that forwards 1 MiB of each
    connection's answers and then nothing (the connection stays open: a host gone, a flow dropped).
    A read of node 0 alone yields its first records and then fails UNAVAILABLE (PartitionUnreadableError,
    the task's failure that Spark retries) within keepalive + timeout; a read of node 0 then node 1 goes
    on from node 1 at the first record not yet given, every record once. Before, both waited on the
    open connection until the call's deadline (300 s; 90 here) and failed DEADLINE_EXCEEDED."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    # a proxy for each read: through one, the two reads could share a connection and its 1 MiB
    proxy, proxy_2 = (Proxy(clusters[0].me.target, stall_after=2**20) for _ in range(2))
    through, through_2 = await proxy.start(), await proxy_2.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            for cluster in clusters:
                port = int(cluster.me.target.rsplit(":", 1)[1])
                await stack.enter_async_context(
                    running_server(tmp_path / f"node{cluster.me.id}", "s", cluster=cluster, port=port)
                )
            values = [f"{i:08d}".encode() * 40 for i in range(16_000)]  # 5 MB in blocks of ~100 KB
            async with Producer(clusters[0].me.target, "s", batch_size=300, linger=0) as producer:
                for at in range(0, len(values), 2_000):
                    await producer.send_many(values[at : at + 2_000])
                    await producer.flush(timeout=60)
            alone = RangeSpec("s", 0, 0, len(values), ((0, through),))
            then_node_1 = RangeSpec("s", 0, 0, len(values), ((0, through_2), (1, clusters[1].me.target)))

            def read(spec: RangeSpec, got: list[pa.RecordBatch]) -> None:
                # 90 s: a read that still waits then is not ended by keepalive
                for batch in read_range(spec, Credentials(), timeout=90):
                    got.append(batch)

            got_alone: list[pa.RecordBatch] = []
            got_both: list[pa.RecordBatch] = []
            began = time.monotonic()
            failed, finished = await asyncio.gather(
                asyncio.to_thread(read, alone, got_alone),
                asyncio.to_thread(read, then_node_1, got_both),
                return_exceptions=True,
            )
            took = time.monotonic() - began
            assert finished is None, finished
            assert isinstance(failed, PartitionUnreadableError), failed
            assert took < GONE_WITHIN + SLACK, took
            read_alone = sum(b.num_rows for b in got_alone)
            assert 0 < read_alone < len(values)  # cut mid-read
            assert f"served records {read_alone}..{len(values) - 1}" in str(failed)
            assert f"node 0 ({through}): UNAVAILABLE" in str(failed), failed
            table = pa.Table.from_batches(got_both, schema=ARROW_SCHEMA)
            assert table.column("value").to_pylist() == values
            assert table.column("offset").to_pylist() == list(range(len(values)))
    finally:
        await proxy.close()
        await proxy_2.close()


async def test_the_drivers_kept_channels_connect_anew_after_a_dropped_connection(tmp_path: Path) -> None:
    """The cluster driver's channels to a receiver node (NodeRates: GetRate/UpdateRate every 0.1 s;
    BlocksClient: ListPartitions) and the live rate's to a server (LiveRateCap: GetRate) go through
    proxies whose open connections are then cut (no FIN; new connections are forwarded: a NAT that
    forgot its flows). Each call on a cut connection times out, and within keepalive + timeout the
    connection is closed and the next call connects anew: the node is up again, planning lists its
    partitions, the live rate answers. Before, the channels kept the dead connection: the node stayed
    down, its partitions unlisted and the batches under the last cap, as long as the kernel kept it."""
    clusters = loopback_cluster(1)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    async with (
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port) as node,
        running_server(tmp_path / "single", "s") as single,
    ):
        to_node, to_single = Proxy(node.target), Proxy(single.target)
        try:
            node_through, single_through = await to_node.start(), await to_single.start()
            blocks = BlocksClient({0: node_through}, Credentials())
            cap = LiveRateCap(single_through)
            try:
                async with NodeRates({0: node_through}, lambda: 1_000.0, interval=0.1) as node_rates:

                    def node_up() -> bool:
                        return node_rates.snapshot()[0].up

                    def listed() -> bool:
                        return 0 in blocks.view(["s"], seal=False).answered

                    def capped() -> bool:
                        cap.records_per_batch(1.0)
                        return cap.answered

                    await wait_until(node_up)
                    assert await asyncio.to_thread(listed)
                    assert await asyncio.to_thread(capped)
                    to_node.cut()
                    to_single.cut()
                    cut_at = time.monotonic()
                    await wait_until(lambda: not node_up(), timeout=5)  # its calls time out (1 s)
                    assert not await asyncio.to_thread(listed)  # ListPartitions times out (3 s)
                    assert not await asyncio.to_thread(capped)

                    async def again(what: str, answers: Callable[[], bool]) -> float:
                        while not await asyncio.to_thread(answers):
                            assert time.monotonic() - cut_at < GONE_WITHIN + SLACK, f"{what} never again"
                        return time.monotonic() - cut_at

                    async def up_again() -> float:
                        await wait_until(node_up, timeout=GONE_WITHIN + SLACK)
                        return time.monotonic() - cut_at

                    took = await asyncio.gather(up_again(), again("listed", listed), again("capped", capped))
                    assert max(took) < GONE_WITHIN + SLACK, took
                    assert min(took) > PEER_KEEPALIVE_SECONDS / 2, took  # not before keepalive could act
                    # the new connections: two more through each proxy (NodeRates' aio channel and
                    # BlocksClient's sync one to the node)
                    assert len(to_node.flows) >= 4 and len(to_single.flows) >= 2
            finally:
                blocks.close()
                cap.close()
        finally:
            await to_node.close()
            await to_single.close()


PINGS = 5.5
"""The idle channels' keepalive in the ping policy test: more often than the Spark side's channels
(PEER_KEEPALIVE_SECONDS), above the half of it that the servers take (a ping every 5 s)."""
IDLE = 4 * PINGS + 3
"""How long they stay idle: gRPC's default policy sends GOAWAY at the 4th ping on a connection without
calls (the 2nd, 3rd and 4th are strikes); and the servers close a connection without a call for
DEFAULT_CONNECTION_IDLE (30 s) themselves."""


async def test_every_server_the_spark_side_calls_takes_its_pings(tmp_path: Path) -> None:
    """A channel with no call that pings every PINGS seconds (the Spark side's channels ping every
    10 s, and so while idle too) stays connected over IDLE seconds to each server the Spark side
    calls: a receiver node, a single server, its plaintext loopback port under TLS (its own query's
    live rate) and the cluster driver's RateControl. Before, the last two had gRPC's default policy,
    which takes a ping on a connection without a call as abuse (GOAWAY too_many_pings at the fourth,
    after 22 s here)."""
    ca = CertificateAuthority(tmp_path / "pki")
    issued = ca.issue("localhost", server=True, file_stem="server")
    tls = SecurityConfig(tls=TlsConfig(issued.cert_file, issued.key_file))
    clusters = loopback_cluster(1)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    config = DriverConfig(nodes={0: clusters[0].me.target}, streams=("s",), data_dir=tmp_path / "driver")
    driver = ClusterDriver(config)
    async with (
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port) as node,
        running_server(tmp_path / "single", "s") as single,
        running_server(tmp_path / "tls", "s", security=tls) as secured,
    ):
        try:
            await driver.serve_rate()
            assert driver.rate_target is not None
            assert secured.rate_target != secured.target  # the loopback port

            async def stays_connected(target: str) -> str | None:
                """None, or how the channel's connection ended (a GOAWAY leaves READY)."""
                options = channel_options(PINGS, PEER_KEEPALIVE_TIMEOUT_SECONDS, without_calls=True)
                async with grpc.aio.insecure_channel(target, options=options) as channel:
                    await asyncio.wait_for(channel.channel_ready(), 10)
                    deadline = time.monotonic() + IDLE
                    while time.monotonic() < deadline:
                        if (state := channel.get_state()) is not grpc.ChannelConnectivity.READY:
                            return (
                                f"{target}: {state.name} after {IDLE - (deadline - time.monotonic()):.1f} s"
                            )
                        await asyncio.sleep(0.05)
                return None

            targets = [node.target, single.target, secured.rate_target, driver.rate_target]
            assert await asyncio.gather(*map(stays_connected, targets)) == [None] * 4
        finally:
            driver.blocks.fenced = "not claimed"  # nothing to give back: this driver never claimed nodes
            await driver.stop()
