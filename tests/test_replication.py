"""Replication before ack, reads over the Blocks service, and failover without duplicates, on real
receiver nodes (grpc.aio servers on loopback, each with its own data dir)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from ingest.server import SluiceServer
from receivers import wal
from receivers.block import BLOCK_SCHEMA, PLAIN_SCHEMA
from receivers.block_store import BlockStore
from receivers.cluster import Cluster, ClusterConfigError, Node, parse_nodes
from receivers.producer_marks import ASK_TIMEOUT
from receivers.receiver import REPLICATION
from receivers.replication import ReplicatedBlockStore
from receivers.wire import decode_batch
from sluice_client import Producer
from sluice_client.errors import RPCError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.producer import FIRST_ANSWER_SECONDS
from sluice_client.wire import encode_batch
from tests.support import loopback_cluster, running_server, wait_until


@contextlib.asynccontextmanager
async def nodes(
    tmp_path: Path, clusters: list[Cluster], *, skip: frozenset[int] = frozenset()
) -> AsyncIterator[dict[int, SluiceServer]]:
    """Start the nodes of `clusters` (but those in `skip`); stop them at the end."""
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for cluster in clusters:
            me = cluster.me
            if me.id in skip:
                continue
            port = int(me.target.rsplit(":", 1)[1])
            servers[me.id] = await stack.enter_async_context(
                running_server(tmp_path / f"node{me.id}", "s", cluster=cluster, port=port)
            )
        yield servers


async def read_partition(target: str, owner: int, lo: int, hi: int) -> list[bytes]:
    async with grpc.aio.insecure_channel(target) as channel:
        values: list[bytes] = []
        request = pb.ReadBlocksRequest(stream="s", owner=owner, from_offset=lo, to_offset=hi)
        async for chunk in pb_grpc.BlocksStub(channel).ReadBlocks(request):
            table = pa.ipc.open_stream(chunk.arrow_ipc).read_all()
            assert table.num_rows == chunk.count
            values.extend(table.column("value").to_pylist())
        return values


async def partitions(target: str) -> dict[int, tuple[int, int]]:
    async with grpc.aio.insecure_channel(target) as channel:
        response = await pb_grpc.BlocksStub(channel).ListPartitions(
            pb.ListPartitionsRequest(seal_blocks=True)
        )
        return {p.owner: (p.start_offset, p.end_offset) for p in response.partitions if p.stream == "s"}


def values(n: int, tag: str = "r") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_the_node_list_and_placement() -> None:
    listed = parse_nodes(["# three nodes", "0 a:1", "1=b:2", "", "2 c:3  # last"])
    cluster = Cluster(listed, 2, replication=2)
    assert [n.id for n in cluster.followers(2)] == [0]  # a ring
    assert [n.id for n in cluster.holders(0)] == [0, 1]
    assert [n.id for n in cluster.followed(0)] == [2]
    for bad, word in (
        (lambda: parse_nodes(["x a:1"]), "expected"),
        (lambda: parse_nodes(["0 a:99999"]), "port"),
        (lambda: Cluster((Node(0, "a:1"), Node(0, "b:1"))), "repeats node id"),
        (lambda: Cluster((Node(0, "a:1"), Node(1, "a:1"))), "repeats target"),
        (lambda: Cluster(listed, 7), "not in the node list"),
        (lambda: Cluster(listed, 0, replication=4), "replication must be 1..3"),
        (lambda: Cluster(listed, 0, replication=2, min_insync=3), "min-insync"),
    ):
        with pytest.raises(ClusterConfigError, match=word):
            bad()


async def test_a_cluster_nodes_store_passes_every_hook_to_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ReplicatedBlockStore wraps the local log: each BlockStore method is its own, so no optional hook
    falls back to BlockStore's default (prepare() did: a cluster node encoded no block ahead, and its
    log's thread copied between writes); and a prepared block is the frame the next write appends."""
    hooks = {name for name, member in vars(BlockStore).items() if callable(member) and name[0] != "_"}
    assert hooks <= set(vars(ReplicatedBlockStore)), hooks - set(vars(ReplicatedBlockStore))
    built = []
    build = wal._build_frame
    monkeypatch.setattr(wal, "_build_frame", lambda *args: built.append(1) or build(*args))
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:
        assert servers[0].node is not None
        store = servers[0].node.store  # what the node's receivers write to
        assert isinstance(store, ReplicatedBlockStore)
        store.recover("t")  # a stream no receiver writes: the test is its only writer
        batch = decode_batch(encode_batch(0, [b"a", b"b"]), 0)
        built.clear()
        store.prepare("t", 0, 0, 0, [batch], {"p": 2})
        assert built == [1]
        store.write("t", 0, 0, 0, [batch], {"p": 2})
        assert built == [1]  # the prepared frame, not a second encoding
        assert [r.column("value").to_pylist() for r in store.local.read(store.local.blocks("t")[0])] == [
            [b"a", b"b"]
        ]


async def test_a_block_is_acked_once_its_follower_has_it_and_reads_from_either_holder(tmp_path: Path) -> None:
    clusters = loopback_cluster(3, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters) as servers:
        await wait_until(lambda: servers[0].node is not None and servers[0].node.replicator.can_ack)
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(500))
            await producer.flush(timeout=10)
        # acked: so node 1 (node 0's follower) holds it durably, node 2 holds none of node 0's
        assert (await partitions(clusters[1].me.target))[0] == (0, 500)
        assert 0 not in await partitions(clusters[2].me.target)
        assert await read_partition(clusters[1].me.target, 0, 0, 500) == values(500)
        assert await read_partition(clusters[0].me.target, 0, 100, 200) == values(500)[100:200]
        # a holder that lacks the range says so, and the reader asks another
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await read_partition(clusters[2].me.target, 0, 0, 500)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_without_enough_copies_in_sync_nothing_is_acked_and_credit_pauses(tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:  # node 0's follower is down
        receiver = servers[0].receivers["s"]
        await wait_until(lambda: REPLICATION in receiver.paused)
        producer = Producer(clusters[0].me.target, "s", producer_id="p", linger=0)
        await producer.start()
        await producer.send_many(values(50))
        await asyncio.sleep(0.5)
        assert producer.acked == 0
        # the follower comes: it catches up, joins the in-sync set, and the records are acked
        port = int(clusters[1].me.target.rsplit(":")[1])
        async with running_server(tmp_path / "node1", "s", cluster=clusters[1], port=port):
            await producer.flush(timeout=10)
            assert producer.acked == 50
            await wait_until(lambda: REPLICATION not in receiver.paused)
            await producer.close()


async def test_with_min_insync_1_a_dead_follower_leaves_the_set_and_acks_go_on(tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(50))
            await producer.flush(timeout=10)
        assert servers[0].receivers["s"].paused == {}
        assert servers[0].node is not None and servers[0].node.replicator.in_sync() == []


async def test_a_follower_that_refuses_is_named_with_its_reason(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower configured otherwise (here replication 1 against the owner's 2) refuses the owner with
    FAILED_PRECONDITION, which was logged at DEBUG only: the owner said "node 1 down" and, under
    min_insync 1, acked with one copy without a word."""
    import dataclasses

    clusters = loopback_cluster(2, replication=2, min_insync=1)
    clusters[1] = dataclasses.replace(clusters[1], replication=1)
    async with nodes(tmp_path, clusters) as servers:
        node = servers[0].node
        assert node is not None
        await wait_until(lambda: "refuses replication" in caplog.text, timeout=20)
        assert "follower 1 (" in caplog.text and "has 2 nodes and replication 1" in caplog.text
        assert "node 1 down: FAILED_PRECONDITION" in node.replicator.status()


async def test_a_follower_that_refuses_a_block_after_the_hello_is_said_once_not_at_each_retry(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower that takes the hello and then refuses a block (here one of a stream it does not serve:
    the nodes were given different --stream flags) was logged at WARNING at every reconnect, every 2 s
    for as long as it lasted: each hello that went through cleared the error the refusal was compared
    with. Said once; again only once the follower was in sync in between."""
    caplog.set_level(logging.WARNING, logger="receivers.replication")
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with contextlib.AsyncExitStack() as stack:
        for cluster, streams in zip(clusters, (("s", "t"), ("s",)), strict=True):
            port = int(cluster.me.target.rsplit(":", 1)[1])
            await stack.enter_async_context(
                running_server(tmp_path / f"node{cluster.me.id}", *streams, cluster=cluster, port=port)
            )
        async with Producer(clusters[0].me.target, "t", producer_id="p", linger=0) as producer:
            await producer.send_many(values(10))
            await producer.flush(timeout=10)
        refusal = "follower 1 ({}) refuses replication: FAILED_PRECONDITION: stream 't' is not served here"
        await wait_until(lambda: refusal.format(clusters[1].me.target) in caplog.text, timeout=20)
        await asyncio.sleep(6)  # reconnects at 0.1, 0.2, 0.4, 0.8, 1.6, then every 2 s
        assert caplog.text.count("refuses replication") == 1, caplog.text


async def test_both_nodes_of_a_configuration_mismatch_say_it_once_and_count_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the owner logged a follower's refusal (WARNING), in words that read "this node 3" as a node
    id; the node configured otherwise, which refused, said nothing, served, and acked with one copy."""
    import dataclasses

    caplog.set_level(logging.ERROR)
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    clusters[1] = dataclasses.replace(clusters[1], replication=1)
    async with nodes(tmp_path, clusters) as servers:
        owner, follower = servers[0].node, servers[1].node
        assert owner is not None and follower is not None
        await wait_until(lambda: bool(owner.mismatches.peers() and follower.mismatches.peers()), timeout=20)
        await asyncio.sleep(3)  # the owner retries (every 2 s at most): said once all the same
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        t0, t1 = clusters[0].me.target, clusters[1].me.target
        refused = f"refused the replication of node 0 ({t0}): node 0 has 2 nodes and replication 2; "
        refused += "node 1 (this node) has 2 nodes and replication 1"
        refusing = (
            f"follower 1 ({t1}) refuses replication: node 0 (this node) has 2 nodes and replication 2; "
        )
        refusing += "node 1 has 2 nodes and replication 1"
        assert sum(refused in e for e in errors) == 1, errors
        assert sum(refusing in e for e in errors) == 1, errors
        assert "node 1 down: FAILED_PRECONDITION: node 0 (this node) has" in owner.replicator.status()
        for server in servers.values():
            assert server.registry.get_sample_value("sluice_cluster_config_mismatch_peers") == 1


async def test_a_node_whose_log_was_replaced_goes_on_past_its_copies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node restarted on an empty data dir numbered new records from offset 0 again: offsets the
    cluster had used, and the driver, having processed up to them, released the new records unread
    (acked, then lost). It now goes on where its copy on a peer ends."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    async with nodes(tmp_path, clusters, skip=frozenset({0})):
        async with (
            running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port),
            Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer,
        ):
            await producer.send_many(values(100))
            await producer.flush(timeout=20)
        # the same node on a new, empty data dir
        async with running_server(tmp_path / "node0-new", "s", cluster=clusters[0], port=port) as node0:
            assert "this node's log ends at block 0 (offset 0)" in caplog.text
            assert node0.receivers["s"].log_end[1] == 100
            async with Producer(clusters[0].me.target, "s", producer_id="q", linger=0) as producer:
                await producer.send_many([b"new"] * 10)
                await producer.flush(timeout=20)
            blocks = node0.store.blocks("s")
            assert blocks and blocks[0].first_offset == 100 and blocks[-1].end_offset == 110
            # the old records are read from the copy, the new ones from the node
            assert await read_partition(clusters[1].me.target, 0, 0, 100) == values(100)
            assert await read_partition(clusters[0].me.target, 0, 100, 110) == [b"new"] * 10


async def test_a_node_whose_log_was_replaced_waits_for_every_follower(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The furthest copy is past every acked record only when every follower answered: with one of them
    down, a node whose log was lost does not guess where to go on, it stops its start and says why."""
    from ingest import receiver_node

    monkeypatch.setattr(receiver_node, "LOST_LOG_WAIT", 1.0)
    clusters = loopback_cluster(3, replication=3, min_insync=3)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    async with nodes(tmp_path, clusters, skip=frozenset({0, 2})):
        port2 = int(clusters[2].me.target.rsplit(":", 1)[1])
        async with (
            running_server(tmp_path / "node2", "s", cluster=clusters[2], port=port2),
            running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port),
            Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer,
        ):
            await producer.send_many(values(50))
            await producer.flush(timeout=20)
        # node 2 stays down; node 0 comes back on an empty data dir
        with pytest.raises(ValueError, match=r"node 2 \(127\.0\.0\.1:\d+\) did not say where its copy ends"):
            async with running_server(tmp_path / "node0-new", "s", cluster=clusters[0], port=port):
                pass


async def test_a_resend_to_another_node_after_failover_is_not_stored_twice(tmp_path: Path) -> None:
    # min_insync 1: node 2's follower is node 0, which dies; node 2 goes on with one copy
    clusters = loopback_cluster(3, replication=2, min_insync=1)
    async with nodes(tmp_path, clusters) as servers:
        # in sync first: with min_insync 1 a block written before its follower joined is acked with one copy
        await wait_until(
            lambda: all(s.node is not None and s.node.replicator.in_sync() for s in servers.values())
        )
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(300))
            await producer.flush(timeout=10)
        await servers[0].stop(grace=1)  # node 0 dies; its blocks live on in node 1's copy
        # a new run of p (not a resend) on node 2, which holds no copy of node 0's blocks: it asks its
        # peers, learns p's mark from node 1's copy, and refuses the run rather than drop its records
        fresh = Producer(clusters[2].me.target, "s", producer_id="p", linger=0)
        with pytest.raises(RPCError) as refused:
            await asyncio.wait_for(fresh.start(), 20)
        assert refused.value.status is grpc.StatusCode.ALREADY_EXISTS
        assert "the next sequence number it expects of it is 300" in refused.value.message
        # the producer never saw the acks of its last 100 records and of nothing after: it resends from
        # 200 to node 2, which asks its peers the same way
        async with Producer(clusters[2].me.target, "s", producer_id="p", linger=0, first_seq=200) as again:
            await again.send_many(values(300)[200:] + values(50, "new"))
            await again.flush(timeout=10)
        stored = await read_partition(clusters[2].me.target, 2, 0, 50)
        assert stored == values(50, "new")  # the resent 100 were duplicates of node 0's
        assert (await partitions(clusters[2].me.target))[2] == (0, 50)


async def test_a_replication_stream_out_of_order_or_with_a_bad_block_is_refused_and_stores_nothing(
    tmp_path: Path,
) -> None:
    clusters = loopback_cluster(2, replication=2)
    async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:

        async def replicate(*messages: pb.ReplicateRequest) -> tuple[grpc.StatusCode, str]:
            async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
                call = pb_grpc.ReplicationStub(channel).Replicate()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    for message in messages:
                        await call.write(message)
                    await call.done_writing()
                    async for _ in call:
                        pass
                return info.value.code(), info.value.details() or ""

        hello = pb.ReplicateRequest(hello=pb.ReplicaHello(owner=1, nodes=2, replication=2))
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, BLOCK_SCHEMA):
            pass
        empty = sink.getvalue().to_pybytes()  # a sound block of no records: only its seq is wrong
        block = pb.ReplicaBlock(stream="s", seq=0, first_offset=0, count=3, arrow_ipc=b"not arrow")
        cases = [
            ((pb.ReplicateRequest(block=block),), grpc.StatusCode.FAILED_PRECONDITION, "first message"),
            (
                (pb.ReplicateRequest(hello=pb.ReplicaHello(owner=1, nodes=5, replication=2)),),
                grpc.StatusCode.FAILED_PRECONDITION,
                "same node list",
            ),
            (
                (pb.ReplicateRequest(hello=pb.ReplicaHello(owner=0, nodes=2, replication=2)),),
                grpc.StatusCode.FAILED_PRECONDITION,
                "not a follower",
            ),
            (
                (hello, pb.ReplicateRequest(block=block)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "not an Arrow IPC stream",
            ),
            (
                (
                    hello,
                    pb.ReplicateRequest(block=pb.ReplicaBlock(stream="s", seq=5, count=0, arrow_ipc=empty)),
                ),
                grpc.StatusCode.FAILED_PRECONDITION,
                "5 of node 1",
            ),
        ]
        for messages, status, words in cases:
            code, details = await replicate(*messages)
            assert code == status and words in details, (code, details)
        node = servers[0].node
        assert node is not None and node.replicas.blocks(1, "s") == []


async def test_a_copied_block_past_the_offset_range_is_refused_and_every_listing_goes_on(
    tmp_path: Path,
) -> None:
    """A block whose records would end past int64 (a forged or broken owner) was stored and acked, and
    from then on every ListPartitions of the follower failed UNKNOWN (its end offset did not fit the
    answer), with a traceback in its log, for the driver and `sluice status` alike, until its copy was
    removed by hand."""
    clusters = loopback_cluster(2, replication=2)
    async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:
        sink = pa.BufferOutputStream()
        row = pa.table({"key": [None], "value": [b"v"], "timestamp": [0]}, schema=PLAIN_SCHEMA)
        with pa.ipc.new_stream(sink, PLAIN_SCHEMA) as writer:
            writer.write_table(row)
        one = sink.getvalue().to_pybytes()
        hello = pb.ReplicateRequest(hello=pb.ReplicaHello(owner=1, nodes=2, replication=2))
        for seq, first in ((0, 2**63 - 1), (0, 2**62), (2**63 - 1, 0)):
            block = pb.ReplicaBlock(stream="s", seq=seq, first_offset=first, count=1, arrow_ipc=one)
            commit = pb.ReplicateRequest(commit=pb.ReplicaCommit(committed_seq={"s": 1}))
            async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
                call = pb_grpc.ReplicationStub(channel).Replicate()
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    for message in (hello, pb.ReplicateRequest(block=block), commit):
                        await call.write(message)
                    await call.done_writing()
                    async for _ in call:
                        pass
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
                assert f"block {seq} of stream 's'" in (info.value.details() or "")
            node = servers[0].node
            assert node is not None and node.replicas.blocks(1, "s") == []
            async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
                listed = await pb_grpc.BlocksStub(channel).ListPartitions(pb.ListPartitionsRequest())
            assert {p.owner for p in listed.partitions} == {0, 1}


async def test_two_processes_replicating_as_one_node_are_refused_not_acked_unstored(tmp_path: Path) -> None:
    """Two processes run as node 1 (one --node-id given twice, each with its own node list and data dir):
    both replicate to node 0, each hello naming its own log's incarnation. The follower took each one's
    blocks into one copy: the first stream's block 0 was stored, the second's block 0 acked as "here
    already" without being stored, so that process acked its producers records no follower held. A
    block whose stream's hello named another incarnation than the copy's now is refused."""
    clusters = loopback_cluster(2, replication=2)
    async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:
        node = servers[0].node
        assert node is not None

        def hello(incarnation: str) -> pb.ReplicateRequest:
            said = pb.ReplicaHello(owner=1, nodes=2, replication=2, incarnation={"s": incarnation})
            return pb.ReplicateRequest(hello=said)

        def block(tag: bytes) -> pb.ReplicateRequest:
            sink = pa.BufferOutputStream()
            rows = pa.table({"key": [None], "value": [tag], "timestamp": [0]}, schema=PLAIN_SCHEMA)
            with pa.ipc.new_stream(sink, PLAIN_SCHEMA) as writer:
                writer.write_table(rows)
            payload = sink.getvalue().to_pybytes()
            return pb.ReplicateRequest(
                block=pb.ReplicaBlock(stream="s", seq=0, first_offset=0, count=1, arrow_ipc=payload)
            )

        async with (
            grpc.aio.insecure_channel(clusters[0].me.target) as one,
            grpc.aio.insecure_channel(clusters[0].me.target) as two,
        ):
            first = pb_grpc.ReplicationStub(one).Replicate()
            second = pb_grpc.ReplicationStub(two).Replicate()
            await first.write(hello("a" * 32))
            assert (await first.read()).WhichOneof("kind") == "state"
            await second.write(hello("b" * 32))
            assert (await second.read()).WhichOneof("kind") == "state"
            await second.write(block(b"second"))
            assert (await second.read()).ack == pb.ReplicaAck(stream="s", seq=0)
            await first.write(block(b"first"))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await first.read()
            second.cancel()
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"is of incarnation {'b' * 32} now" in (refused.value.details() or ""), refused.value
        assert "two processes run as node 1" in (refused.value.details() or "")
        held = node.replicas.blocks(1, "s")
        assert len(held) == 1
        stored = pa.Table.from_batches(list(node.replicas.store(1).read(held[0])))
        assert stored.column("value").to_pylist() == [b"second"]


async def test_a_damaged_log_is_internal_with_one_error_line_and_the_read_goes_to_a_copy(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A block that fails its checksum on one holder, or an incarnation file that holds no incarnation,
    escaped from Blocks as UNKNOWN "Unexpected <class ...>", with a traceback in the node's log at every
    call (ListPartitions: the driver's, each second). Now INTERNAL with the log's own words, said in
    one ERROR line; a reader goes on to another holder, whose copy is whole."""
    from ingest.spark.cluster_source import RangeSpec, read_range
    from sluice_client.credentials import Credentials

    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters) as servers:
        await wait_until(lambda: servers[0].node is not None and servers[0].node.replicator.can_ack)
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(500))
            await producer.flush(timeout=10)
        (segment,) = sorted((tmp_path / "node0" / "blocks" / "s").glob("*.wal"))
        with segment.open("r+b") as file:  # a byte of block 0's records flipped (bit rot)
            file.seek(200)
            byte = file.read(1)
            file.seek(200)
            file.write(bytes([byte[0] ^ 0xFF]))
        for _ in range(2):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await read_partition(clusters[0].me.target, 0, 0, 500)
            assert info.value.code() == grpc.StatusCode.INTERNAL, info.value
            assert "node 0: block 0 of stream 's' fails its checksum" in (info.value.details() or "")
        targets = tuple((c.me.id, c.me.target) for c in clusters)
        batches = await asyncio.to_thread(
            lambda: list(read_range(RangeSpec("s", 0, 0, 500, targets), Credentials()))
        )
        assert [v for b in batches for v in b.column("value").to_pylist()] == values(500)

        (tmp_path / "node1" / "replicas" / "0" / "s" / "incarnation").write_text("not one!\n")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await partitions(clusters[1].me.target)
        assert info.value.code() == grpc.StatusCode.INTERNAL, info.value
        assert "holds 'not one!', not an incarnation" in (info.value.details() or ""), info.value
    said = [r.getMessage() for r in caplog.records if r.name == "receivers.blocks_service"]
    assert len(said) == 2 and all(m.startswith("cannot serve Blocks: ") for m in said), said
    assert "Unexpected" not in caplog.text and "Traceback" not in caplog.text


async def test_a_damaged_copy_refuses_its_owner_internal_with_one_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower whose copy's incarnation file holds no incarnation ended each of the owner's Replicate
    streams UNKNOWN "Unexpected <class ...>", with a traceback in its log at every reconnect (each 2 s).
    Now INTERNAL with the log's words, said once in an ERROR line on each side."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with nodes(tmp_path, clusters) as servers:
        await wait_until(lambda: servers[0].node is not None and servers[0].node.replicator.can_ack)
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(50))
            await producer.flush(timeout=10)
        marker = tmp_path / "node1" / "replicas" / "0" / "s" / "incarnation"
        await wait_until(marker.exists)
        marker.write_text("not one!\n")
        async with Producer(clusters[0].me.target, "s", producer_id="q", linger=0) as producer:
            await producer.send_many(values(50))
            await producer.flush(timeout=10)
        await wait_until(lambda: "refuses replication: INTERNAL: node 1: " in caplog.text, timeout=20)
        await asyncio.sleep(5)  # reconnects at 0.1, 0.2, 0.4, 0.8, 1.6, then every 2 s
    said = [r.getMessage() for r in caplog.records if r.name == "receivers.replication_service"]
    assert len(said) == 1 and "holds 'not one!', not an incarnation" in said[0], said
    assert "Unexpected" not in caplog.text and "Traceback" not in caplog.text


async def test_a_lagging_follower_keeps_its_copy_across_an_owners_lost_log(tmp_path: Path) -> None:
    """Node 0's log is lost while node 1's copy of it lags (node 1 was down): node 0 goes on past node
    2's copy, and the first block it sends node 1 comes after a gap that was never released (no driver
    read anything here). Node 1 treated that gap as released by Spark: it moved its released mark past
    it and deleted every block of its copy, acked records no one had read, which then had one copy
    fewer (none, should node 2's disk go too). It now keeps them and holds the gap as a gap."""
    clusters = loopback_cluster(3, replication=3, min_insync=2)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    first, second, third = values(100, "a"), values(100, "b"), values(10, "c")
    async with contextlib.AsyncExitStack() as outer:
        stacks = {i: await outer.enter_async_context(contextlib.AsyncExitStack()) for i in range(3)}

        async def start(i: int, folder: str) -> SluiceServer:
            return await stacks[i].enter_async_context(
                running_server(tmp_path / folder, "s", cluster=clusters[i], port=port[i])
            )

        servers = {i: await start(i, f"node{i}") for i in range(3)}
        owner = servers[0].node
        assert owner is not None
        await wait_until(lambda: len(owner.replicator.in_sync()) == 2, timeout=20)
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(first)
            await producer.flush(timeout=20)  # on nodes 1 and 2
            await stacks[1].aclose()  # node 1 goes down: its copy ends here
            await producer.send_many(second)
            await producer.flush(timeout=20)  # on node 0 and node 2 (min-insync 2)
        await stacks[0].aclose()
        servers[1] = await start(1, "node1")  # back, lagging: node 0 is not there to catch it up
        servers[0] = await start(0, "node0-lost")  # node 0's log lost: it goes on past node 2's copy
        assert servers[0].receivers["s"].log_end[1] == 200
        async with Producer(clusters[0].me.target, "s", producer_id="q", linger=0) as producer:
            await producer.send_many(third)
            await producer.flush(timeout=20)
        owner, lagging = servers[0].node, servers[1].node
        assert owner is not None and lagging is not None
        end = owner.local.durable_seq("s")
        await wait_until(lambda: lagging.replicas.next_seq(0, "s") == end, timeout=20)
        await wait_until(lambda: lagging.replicas.committed(0, "s") == end, timeout=20)
        copy = lagging.replicas.store(0)
        assert copy.released_offset("s") == 0  # nothing was released: no driver read anything
        target = clusters[1].me.target
        assert await read_partition(target, 0, 0, 100) == first  # kept: still two copies of them
        assert await read_partition(target, 0, 200, 210) == third  # and the copy goes on past the gap
        with pytest.raises(grpc.aio.AioRpcError) as info:  # the gap is not held here ...
            await read_partition(target, 0, 100, 200)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # ... but on the furthest copy, with the rest
        assert await read_partition(clusters[2].me.target, 0, 0, 210) == first + second + third
        await stacks[1].aclose()  # a log with a gap is recovered as it was
        servers[1] = await start(1, "node1")
        assert await read_partition(target, 0, 0, 100) == first
        assert await read_partition(target, 0, 200, 210) == third
        async with grpc.aio.insecure_channel(target) as channel:  # the driver's release, across the gap
            request = pb.ReleaseBlocksRequest(stream="s", owner=0, before_offset=210)
            await pb_grpc.BlocksStub(channel).ReleaseBlocks(request)
        lagging = servers[1].node
        assert lagging is not None
        assert lagging.replicas.store(0).released_offset("s") == 210
        assert lagging.replicas.blocks(0, "s") == []


async def test_replication_leaves_no_task_exception_unretrieved_nor_a_task_pending(tmp_path: Path) -> None:
    """A follower that comes and goes under an owner that writes, then both stop: no task of either side
    may end with an exception nobody retrieved, nor be left pending. The follower's read of the owner's
    next message ended with StopAsyncIteration, unretrieved, when the owner's stream ended as the
    handler was cancelled ("Task exception was never retrieved"), and the owner's send loop, cancelled
    while it waited, left its two waits pending for good ("Task was destroyed but it is pending")."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        clusters = loopback_cluster(2, replication=2, min_insync=1)
        port = int(clusters[1].me.target.rsplit(":", 1)[1])
        async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:
            owner = servers[0].node
            assert owner is not None
            for round_ in range(3):
                async with running_server(tmp_path / "node1", "s", cluster=clusters[1], port=port):
                    await wait_until(lambda: len(owner.replicator.in_sync()) == 1, timeout=20)
                    async with Producer(clusters[0].me.target, "s", producer_id=f"p{round_}", linger=0) as p:
                        await p.send_many(values(50))
                        await p.flush(timeout=20)
                await wait_until(lambda: not owner.replicator.in_sync(), timeout=20)
        for _ in range(3):  # what is left unreferenced is collected, and what was cancelled ends
            gc.collect()
            await asyncio.sleep(0.05)
    finally:
        loop.set_exception_handler(before)
    assert not reported, [
        str(context.get("message")) + ": " + repr(context.get("task") or context.get("future"))
        for context in reported
    ]


class _EndsAfterTheHello(pb_grpc.ReplicationServicer):
    """A follower that answers the owner's hello and then ends the call, as a stopping node does."""

    def __init__(self) -> None:
        self.calls = 0

    async def Replicate(  # type: ignore[override]  # the generated servicer's stubs are looser
        self,
        request_iterator: AsyncIterator[pb.ReplicateRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReplicateResponse]:
        self.calls += 1
        async for _ in request_iterator:  # the hello
            break
        yield pb.ReplicateResponse(state=pb.ReplicaState())
        await context.abort(grpc.StatusCode.UNAVAILABLE, "node 1 is stopping")

    async def ProducerMarks(  # type: ignore[override]
        self, request: pb.ProducerMarksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ProducerMarksResponse:
        return pb.ProducerMarksResponse()  # holds no copy


async def test_a_follower_that_ends_the_call_as_the_owner_writes_is_retried_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner writes blocks into a call its follower has just ended (UNAVAILABLE, stopping): the write
    raised asyncio.InvalidStateError ("RPC already finished"), which the owner logged with a traceback as
    a failure of replication (seen in test_cluster_failover's SIGTERM test). The call's status is what
    counts: UNAVAILABLE, retried without a word."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    follower = grpc.aio.server()
    ends = _EndsAfterTheHello()
    pb_grpc.add_ReplicationServicer_to_server(ends, follower)
    follower.add_insecure_port(clusters[1].me.target)
    await follower.start()
    try:
        async with running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port[0]) as server:
            async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
                await producer.send_many(values(50))  # blocks to send at every connection
                await producer.flush(timeout=20)
            await wait_until(lambda: ends.calls >= 4, timeout=30)
            assert server.node is not None
            link = server.node.replicator.links[0]
            # None while a call is connected. A write racing the follower's end came back now and then
            # as gRPC core's INTERNAL "Internal error from Core" (CI): retried quietly too, and the
            # next call's end is the follower's UNAVAILABLE
            stopping = "UNAVAILABLE: node 1 is stopping"
            await wait_until(lambda: link.error == stopping, timeout=30)
    finally:
        await follower.stop(None)
    assert "InvalidStateError" not in caplog.text and "Traceback" not in caplog.text, caplog.text
    assert "replication to node 1 failed" not in caplog.text, caplog.text
    assert "refuses replication" not in caplog.text, caplog.text


async def test_a_copy_counts_a_block_held_only_once_it_is_synced_under_fsync_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--fsync interval:MS: a follower syncs each copied block before it acks it. The sync came after
    the copy's stream lock was let go, so another Replicate stream of the same owner (its reconnect
    while the old call's store still ran) was told in its state that the follower held the block
    before that sync had finished: the owner counted it on the follower, and a power loss there then
    would lose a block the owner took for replicated. Here the follower's sync of the block is held
    (its segment's fsync waits), a second stream says hello meanwhile, and its state must not count the
    block before that fsync has finished. (No power is cut: what is checked is the order, the state
    told after the sync, which is what makes the copy survive one.)"""
    from receivers.config import FsyncPolicy

    clusters = loopback_cluster(2, replication=2, min_insync=1)
    port = int(clusters[1].me.target.rsplit(":", 1)[1])
    copies = tmp_path / "node1" / "replicas" / "0"
    real_fsync = os.fsync
    held, release = threading.Event(), threading.Event()
    synced: list[float] = []  # when an fsync of the copy's segment finished

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        copy = path.startswith(str(copies)) and path.endswith(wal.SEGMENT_SUFFIX)
        if copy:
            held.set()
            release.wait(30)
        real_fsync(fd)
        if copy:
            synced.append(time.monotonic())

    monkeypatch.setattr(os, "fsync", fsync)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, BLOCK_SCHEMA) as ipc:
        ipc.write_batch(decode_batch(encode_batch(0, values(3)), 0))
    block = pb.ReplicaBlock(
        stream="s", seq=0, first_offset=0, count=3, arrow_ipc=sink.getvalue().to_pybytes()
    )
    # block 0 committed (a follower catching up is sent committed blocks): the second hello, which
    # drops what the copy holds past what it knew committed, keeps it
    hello = pb.ReplicateRequest(
        hello=pb.ReplicaHello(owner=0, nodes=2, replication=2, log_end={"s": 1}, committed_seq={"s": 1})
    )
    interval = FsyncPolicy.interval(600_000)  # no background fsync in this test: only the copy's own
    async with (
        running_server(tmp_path / "node1", "s", cluster=clusters[1], port=port, fsync=interval),
        grpc.aio.insecure_channel(clusters[1].me.target) as channel,
    ):
        stub = pb_grpc.ReplicationStub(channel)
        first = stub.Replicate()
        await first.write(hello)
        assert (await first.read()).state.next_seq.get("s", 0) == 0
        await first.write(pb.ReplicateRequest(block=block))
        assert await asyncio.to_thread(held.wait, 30)  # stored, its sync under way
        second = stub.Replicate()  # the owner's reconnect
        await second.write(hello)
        told: list[float] = []
        state = asyncio.ensure_future(second.read())
        state.add_done_callback(lambda _: told.append(time.monotonic()))
        await asyncio.wait((state,), timeout=2)  # the old code told it at once, before the release
        release.set()
        assert (await state).state.next_seq["s"] == 1
        ack = await first.read()
        assert (ack.ack.stream, ack.ack.seq) == ("s", 0)
        first.cancel()
        second.cancel()
    assert synced and told and synced[0] <= told[0], "block 0 was counted held before its sync ended"


async def test_start_waits_out_a_marks_lookup_that_a_black_holed_peer_holds_up(tmp_path: Path) -> None:
    """A node asks its peers for a producer's mark before it decides on a session, for up to
    producer_marks.ASK_TIMEOUT (3 s) when a peer takes the connection and never answers. start() waited
    2 s for the first answer: it returned before the node decided, and the new run's ALREADY_EXISTS
    failed the first send or flush instead. It waits longer than the lookup now."""
    assert FIRST_ANSWER_SECONDS >= ASK_TIMEOUT + 1.0  # the lookup, and room for the decision after it
    clusters = loopback_cluster(2, replication=1)
    host, port = clusters[1].me.target.rsplit(":", 1)
    with socket.socket() as black_hole:  # node 1: connections are taken (backlog), never answered
        black_hole.bind((host, int(port)))
        black_hole.listen(16)
        async with nodes(tmp_path, clusters, skip=frozenset({1})) as servers:
            target = servers[0].target
            # fresh with resume is refused before the lookup (INVALID_ARGUMENT at once, not in 3 s)
            async with grpc.aio.insecure_channel(target) as channel:
                opening = pb.Open(stream="s", producer_id="both", fresh=True, resume=True)
                call = pb_grpc.IngestStub(channel).Publish(iter([pb.PublishRequest(open=opening)]))
                started = asyncio.get_running_loop().time()
                assert await call.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert asyncio.get_running_loop().time() - started < 1.0
                assert "Open.fresh and Open.resume both set" in await call.details()
            async with Producer(target, "s", producer_id="held", linger=0) as producer:
                await producer.send_many([b"a", b"b", b"c"])
            again = Producer(target, "s", producer_id="held", linger=0)
            loop = asyncio.get_running_loop()
            started = loop.time()
            with pytest.raises(RPCError) as refused:
                await asyncio.wait_for(again.start(), 20)  # not at a later send or flush
            assert ASK_TIMEOUT - 0.5 < loop.time() - started < FIRST_ANSWER_SECONDS + 1
            assert refused.value.status is grpc.StatusCode.ALREADY_EXISTS
            assert "the next sequence number it expects of it is 3" in refused.value.message


async def test_a_follower_drops_an_uncommitted_block_its_owner_then_replaced(tmp_path: Path) -> None:
    """Node 1 holds block N of node 0, copied but never committed (node 2 was down: min-insync 3), and
    is down when node 0 restarts: node 0 drops its uncommitted N and writes a different block N' at the
    same offsets. Node 1 came back with its end at (not past) node 0's log end, so it dropped nothing,
    and its stale N became committed: read in place of N' (records never acked, the acked ones missing
    from that copy), its producer marks counted as stored. A follower now drops what it holds past what
    it knows committed at each hello, and the owner sends it again."""
    clusters = loopback_cluster(3, replication=3, min_insync=3)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    acked, stale, fresh = values(30, "a"), values(20, "stale"), values(20, "fresh")
    async with contextlib.AsyncExitStack() as outer:
        stacks = {i: await outer.enter_async_context(contextlib.AsyncExitStack()) for i in range(3)}

        async def start(i: int) -> SluiceServer:
            return await stacks[i].enter_async_context(
                running_server(tmp_path / f"node{i}", "s", cluster=clusters[i], port=port[i])
            )

        servers = {i: await start(i) for i in range(3)}
        owner = servers[0].node
        assert owner is not None
        await wait_until(lambda: len(owner.replicator.in_sync()) == 2, timeout=20)
        producer = Producer(clusters[0].me.target, "s", producer_id="p", linger=0)
        await producer.start()
        await producer.send_many(acked)
        await producer.flush(timeout=20)
        await stacks[2].aclose()  # node 2 goes: nothing more is committed (min-insync 3)
        await producer.send_many(stale)
        copies = servers[1].node
        assert copies is not None
        await wait_until(lambda: sum(b.count for b in owner.local.blocks("s")) == 50, timeout=20)
        end = owner.local.durable_seq("s")
        await wait_until(lambda: copies.replicas.next_seq(0, "s") == end, timeout=20)  # node 1 holds them
        assert producer.acked == 30
        await producer.abort()
        await stacks[1].aclose()
        await stacks[0].aclose()
        servers[0] = await start(0)  # drops the stale tail (never committed); its followers are down
        owner = servers[0].node
        assert owner is not None and sum(b.count for b in owner.local.blocks("s")) == 30
        again = Producer(clusters[0].me.target, "s", producer_id="q", linger=0)
        await again.start()
        await again.send_many(fresh)  # written at the stale block's offsets, not acked yet
        await wait_until(lambda: sum(b.count for b in owner.local.blocks("s")) == 50, timeout=20)
        assert owner.local.durable_seq("s") == end  # the same seqs as the stale block(s)
        servers[2] = await start(2)
        servers[1] = await start(1)
        await again.flush(timeout=30)
        await again.close()
        copies = servers[1].node
        assert copies is not None
        await wait_until(lambda: copies.replicas.committed(0, "s") == end, timeout=20)
        for i in range(3):
            target = clusters[i].me.target
            assert await read_partition(target, 0, 0, 50) == acked + fresh, f"node {i}"


def test_a_copy_keeps_what_it_holds_below_where_its_owners_lost_log_went_on(tmp_path: Path) -> None:
    """Past what a copy knows committed, its blocks are dropped at the owner's hello (the owner sends
    them again), except below where the owner's log went on after it was lost (skipped_to): the owner
    never held those, and the copy may be their only one."""
    from receivers.replica_store import ReplicaStore
    from receivers.wal import RawBlock, WalBlockStore

    def block(seq: int) -> RawBlock:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, BLOCK_SCHEMA) as ipc:
            ipc.write_batch(decode_batch(encode_batch(0, values(2)), 0))
        return RawBlock(seq, 2 * seq, 2, 0, 0.0, {}, sink.getvalue().to_pybytes())

    replicas = ReplicaStore(tmp_path / "replicas")
    for seq in range(4):
        replicas.append(0, "s", block(seq), after_release=False)
    replicas.set_committed(0, {"s": 1})
    assert replicas.drop_uncommitted(0, "s", 10, skipped_to=4) == 0  # all below the lost log's skip
    assert replicas.drop_uncommitted(0, "s", 10, skipped_to=3) == 1
    assert replicas.drop_uncommitted(0, "s", 10) == 2  # past committed block 0
    assert replicas.next_seq(0, "s") == 1
    replicas.close()
    # the owner's log keeps where it went on after a loss, releases past it or not
    log = WalBlockStore(tmp_path / "log")
    log.recover("s")
    log.skip_to("s", 5, 10)
    log.write("s", 5, 10, 0, [decode_batch(encode_batch(0, values(2)), 0)])
    log.release("s", 6)
    assert log.skipped_to("s") == 5
    assert WalBlockStore(tmp_path / "log").skipped_to("s") == 5
    log.close()


def test_a_copy_from_an_owner_that_writes_a_timestamp_a_record_is_taken_and_read(tmp_path: Path) -> None:
    """An owner not yet upgraded sends blocks with one timestamp a record (PLAIN_SCHEMA): the follower
    takes them and serves them as the log's batches now are; a payload of any other schema is refused."""
    from receivers.block import PLAIN_SCHEMA, plain_arrivals
    from receivers.replication_service import InvalidBlockError, _check_payload
    from receivers.wal import RawBlock, WalBlockStore

    def block(schema: pa.Schema, columns: list[pa.Array]) -> RawBlock:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, schema) as ipc:
            ipc.write_batch(pa.RecordBatch.from_arrays(columns, schema=schema))
        return RawBlock(0, 0, 2, 0, 0.0, {}, sink.getvalue().to_pybytes())

    keys, vals = pa.nulls(2, pa.binary()), pa.array(values(2), pa.binary())
    old = block(PLAIN_SCHEMA, [keys, vals, pa.array([5, 6], PLAIN_SCHEMA.field("timestamp").type)])
    _check_payload(old)
    other = pa.schema([("key", pa.binary()), ("value", pa.binary()), ("timestamp", pa.int64())])
    with pytest.raises(InvalidBlockError, match="not 2 of the block schema"):
        _check_payload(block(other, [keys, vals, pa.array([5, 6], pa.int64())]))
    copy = WalBlockStore(tmp_path)
    info, _ = copy.append_raw("s", old)
    (batch,) = copy.read(info)
    assert batch.schema.equals(BLOCK_SCHEMA)
    assert [t.value for t in plain_arrivals(batch.column("timestamp"))] == [5, 6]
    assert batch.column("value").to_pylist() == values(2)
    copy.close()


def test_config_mismatches_are_said_once_per_configuration_and_forgotten_once_agreed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from receivers.cluster import ConfigMismatches

    cluster = loopback_cluster(3, replication=2)[2]
    seen = ConfigMismatches(cluster, memory=60)
    for _ in range(3):  # an owner retrying
        words = seen.seen(1, 3, 1, refused_by_peer=False)
    assert words.startswith(
        "node 1 has 3 nodes and replication 1; node 2 (this node) has 3 nodes and replication 2"
    )
    seen.seen(1, 2, 1, refused_by_peer=False)  # its list changed: said again
    seen.seen(0, 3, 3, refused_by_peer=True)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3, errors
    assert (
        "node 2 (this node) has 3 nodes and replication 2; node 0 has 3 nodes and replication 3" in errors[2]
    )
    assert sorted(seen.peers()) == [0, 1]
    seen.agreed(1)
    assert sorted(seen.peers()) == [0]
    seen.seen(1, 3, 1, refused_by_peer=False)  # wrong again after a fix: said again
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 4
    forgetful = ConfigMismatches(cluster, memory=0)
    forgetful.seen(1, 3, 1, refused_by_peer=False)
    time.sleep(0.01)
    assert forgetful.peers() == {}  # no refused hello lately (the peer was fixed, or stopped)


def test_a_committed_seqs_file_nested_too_deeply_is_named(tmp_path: Path) -> None:
    """An outside tester's finding: the committed seqs file holding valid JSON nested past what Python's
    parser takes raised RecursionError, past read_committed's handler of a damaged file; it is the
    ValueError naming the file and what to do that a file of any other damage gets."""
    from receivers.replication import read_committed

    path = tmp_path / "committed.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"committed seqs \(JSON nested too deeply") as caught:
        read_committed(path)
    assert str(path) in str(caught.value) and "restore the file" in str(caught.value)
