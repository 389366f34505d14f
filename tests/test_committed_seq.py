"""A restarted owner serves nothing it never committed (Kafka's high watermark, adapted).

The owner persists each stream's committed seq before acking below it; at a restart it drops the blocks
past it (written before a crash, never on enough copies, never acked), and tells its followers, which
serve, and report producer marks from, only committed blocks and drop what the owner dropped. So a
producer that resent its unacked records to another node finds them there once, not twice."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import grpc
import pytest

from receivers.wal import WalBlockStore
from sluice_client import Producer
from tests.support import loopback_cluster, running_server, wait_until
from tests.test_replication import partitions, read_partition, values

T = TypeVar("T")


async def retried(call: Callable[[str], Awaitable[T]], target: str) -> T:
    """`call(target)`, retried while the target is UNAVAILABLE: in one process gRPC shares a
    subchannel, which stays in backoff a while after the node was down."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return await call(target)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def _node(tmp_path: Path, cluster: object, **kwargs: object) -> contextlib.AbstractAsyncContextManager:  # type: ignore[type-arg]
    port = int(cluster.me.target.rsplit(":", 1)[1])  # type: ignore[attr-defined]
    return running_server(tmp_path / f"node{cluster.me.id}", "s", cluster=cluster, port=port)  # type: ignore[attr-defined,arg-type]


async def test_an_unacked_tail_is_dropped_at_restart_and_its_resend_is_stored_once(tmp_path: Path) -> None:
    # a ring of 4, replication 2: node 0's follower is node 1, node 2's is node 3
    clusters = loopback_cluster(4, replication=2, min_insync=2)
    async with _node(tmp_path, clusters[2]), _node(tmp_path, clusters[3]):
        async with _node(tmp_path, clusters[1]) as node1, _node(tmp_path, clusters[0]) as node0:
            await wait_until(lambda: bool(node0.node and node0.node.replicator.in_sync()))
            async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
                await producer.send_many(values(100))
                await producer.flush(timeout=10)
                await node1.stop(grace=1)  # the follower dies: node 0 writes on, cannot ack
                await producer.send_many(values(150)[100:])
                local = node0.node.local  # type: ignore[union-attr]
                await wait_until(lambda: sum(b.count for b in local.blocks("s")) == 150, 10)
                assert producer.acked == 100
                await producer.abort()
        # node 0 is gone with records 100..149 in its log alone. Its follower comes back, and the
        # producer resends them to node 2, which asks node 0's follower how far "p" got: 100
        async with _node(tmp_path, clusters[1]):
            node2 = clusters[2].me.target
            async with Producer(node2, "s", producer_id="p", linger=0, first_seq=100) as again:
                await again.send_many(values(150)[100:])
                await again.flush(timeout=15)
            async with _node(tmp_path, clusters[0]) as back:  # node 0 returns
                assert back.node is not None
                assert sum(b.count for b in back.node.local.blocks("s")) == 100  # its tail dropped
                await wait_until(lambda: bool(back.node and back.node.replicator.in_sync()))
                await asyncio.sleep(0.5)
                for holder in (clusters[0], clusters[1]):
                    assert (await retried(partitions, holder.me.target))[0] == (0, 100)
                assert await read_partition(clusters[1].me.target, 0, 0, 100) == values(100)
        assert await read_partition(clusters[2].me.target, 2, 0, 50) == values(150)[100:]


async def test_blocks_acked_with_one_copy_survive_a_restart(tmp_path: Path) -> None:
    # min-insync 1, the follower never up: node 0 acks alone, and its committed seq is on disk
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with _node(tmp_path, clusters[0]) as node0:
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(50))
            await producer.flush(timeout=10)
        assert node0.node is not None and node0.node.replicator.persisted()["s"] >= 1
    async with _node(tmp_path, clusters[0]) as again:
        assert again.node is not None
        assert sum(b.count for b in again.node.local.blocks("s")) == 50  # nothing acked was dropped
        assert await retried(lambda t: read_partition(t, 0, 0, 50), clusters[0].me.target) == values(50)


async def test_a_follower_serves_and_marks_only_what_its_owner_committed(tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with _node(tmp_path, clusters[1]) as node1, _node(tmp_path, clusters[0]) as node0:
        await wait_until(lambda: bool(node0.node and node0.node.replicator.in_sync()))
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            await producer.send_many(values(30))
            await producer.flush(timeout=10)
        replicas = node1.node.replicas  # type: ignore[union-attr]
        await wait_until(lambda: replicas.committed(0, "s") >= 1)
        (key,) = node0.receivers["s"]._producers  # the producer's key, as the log writes it
        # the owner's word is all that counts: told less, the copy serves and marks less
        committed = replicas.committed(0, "s")
        replicas._committed[0]["s"] = 0  # as if the owner had not said so yet
        replicas._marks.clear()
        assert (await partitions(clusters[1].me.target))[0] == (0, 0)
        assert replicas.marks("s", [key]) == {}
        replicas.set_committed(0, {"s": committed})
        assert (await partitions(clusters[1].me.target))[0] == (0, 30)
        assert replicas.marks("s", [key]) == {key: 30}


async def test_records_acked_under_replication_1_survive_a_start_with_replication_2(tmp_path: Path) -> None:
    """A node run once with replication 1 (an operator's mistake) acked its blocks once in its own log
    but left committed.json where its last run with replication 2 had put it; started again with
    replication 2, it took those acked blocks for an unacked tail and deleted them."""
    import dataclasses

    clusters = loopback_cluster(2, replication=2, min_insync=1)  # node 1 never runs: node 0 acks alone
    alone = dataclasses.replace(clusters[0], replication=1)
    async with _node(tmp_path, clusters[0]) as node0:
        async with Producer(clusters[0].me.target, "s", producer_id="a", linger=0) as producer:
            await producer.send_many(values(100, "a"))
            await producer.flush(timeout=10)
        assert node0.node is not None and node0.node.replicator.persisted()["s"] >= 1
    async with _node(tmp_path, alone), Producer(alone.me.target, "s", producer_id="t", linger=0) as producer:
        await producer.send_many(values(50, "t"))
        await producer.flush(timeout=10)
        assert producer.acked == 50
    async with _node(tmp_path, clusters[0]) as again:
        assert again.node is not None
        assert sum(b.count for b in again.node.local.blocks("s")) == 150  # nothing acked was dropped
        read = await retried(lambda t: read_partition(t, 0, 0, 150), clusters[0].me.target)
        assert read == values(100, "a") + values(50, "t")


async def test_a_start_with_replication_1_drops_the_unacked_tail_of_a_run_with_2(tmp_path: Path) -> None:
    """The other way: a run with replication 2 leaves blocks its follower never had (never acked, their
    producer resent them elsewhere); a start with replication 1 kept them, and served them as acked,
    twice in the cluster. Then 1 -> 2 again keeps all that replication 1 acked."""
    import dataclasses

    clusters = loopback_cluster(2, replication=2, min_insync=2)  # node 1 never runs: node 0 cannot ack
    alone = dataclasses.replace(clusters[0], replication=1, min_insync=1)
    acked_alone = dataclasses.replace(clusters[0], min_insync=1)
    first = Producer(clusters[0].me.target, "s", producer_id="a", linger=0)
    async with _node(tmp_path, acked_alone), first:
        await first.send_many(values(100, "a"))
        await first.flush(timeout=10)
    async with _node(tmp_path, clusters[0]) as node0:  # min-insync 2 now: what it writes is not acked
        producer = Producer(clusters[0].me.target, "s", producer_id="u", linger=0)
        await producer.start()
        await producer.send_many(values(30, "u"))
        local = node0.node.local  # type: ignore[union-attr]
        await wait_until(lambda: sum(b.count for b in local.blocks("s")) == 130, 10)
        assert producer.acked == 0
        await producer.abort()
    async with _node(tmp_path, alone) as one:
        assert one.node is not None
        assert sum(b.count for b in one.node.local.blocks("s")) == 100  # the unacked tail is gone
        assert not (tmp_path / "node0" / "committed.json").exists()
        async with Producer(alone.me.target, "s", producer_id="t", linger=0) as producer:
            await producer.send_many(values(50, "t"))
            await producer.flush(timeout=10)
    async with _node(tmp_path, acked_alone) as again:
        assert again.node is not None
        assert sum(b.count for b in again.node.local.blocks("s")) == 150
        read = await retried(lambda t: read_partition(t, 0, 0, 150), clusters[0].me.target)
        assert read == values(100, "a") + values(50, "t")


async def test_a_first_start_with_replication_1_after_an_older_version_keeps_what_that_acked(
    tmp_path: Path,
) -> None:
    """A data dir an older version ran with replication 1 after replication 2: its committed.json is
    stale and the blocks past it were acked. This version's first start keeps them, with replication 1
    (the last run's replication is unknown: no cut) as with 2 once the file is gone."""
    import dataclasses

    from ingest.receiver_node import COMMITTED_FILE
    from receivers.node_identity import NODE_FILE

    clusters = loopback_cluster(2, replication=2, min_insync=1)
    alone = dataclasses.replace(clusters[0], replication=1)
    first = Producer(clusters[0].me.target, "s", producer_id="a", linger=0)
    async with _node(tmp_path, clusters[0]), first:
        await first.send_many(values(100, "a"))
        await first.flush(timeout=10)
    data_dir = tmp_path / "node0"
    stale = (data_dir / COMMITTED_FILE).read_text()
    async with _node(tmp_path, alone), Producer(alone.me.target, "s", producer_id="t", linger=0) as producer:
        await producer.send_many(values(50, "t"))
        await producer.flush(timeout=10)
    # as the older version left it: committed.json where replication 2 put it, and no node.json
    (data_dir / COMMITTED_FILE).write_text(stale)
    (data_dir / NODE_FILE).unlink()
    async with _node(tmp_path, alone) as one:
        assert one.node is not None
        assert sum(b.count for b in one.node.local.blocks("s")) == 150
    async with _node(tmp_path, clusters[0]) as again:
        assert again.node is not None
        assert sum(b.count for b in again.node.local.blocks("s")) == 150
        read = await retried(lambda t: read_partition(t, 0, 0, 150), clusters[0].me.target)
        assert read == values(100, "a") + values(50, "t")


def test_a_start_never_cuts_below_what_spark_released(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A committed seq behind the released mark (a file left stale, as replication 1 once left it): the
    blocks Spark had read were cut too, and counted among those "never acked" in the WARNING."""
    from receivers.replication import truncate_uncommitted, write_committed
    from tests.test_wal import fill

    store = WalBlockStore(tmp_path / "blocks")
    fill(store, 5)  # 3 records a block
    store.release("s", 3)  # Spark read blocks 0..2
    committed = tmp_path / "committed.json"
    write_committed(committed, {"s": 1}, sync=False)
    truncate_uncommitted(store, ["s"], committed)
    assert "dropped 2 block(s), 6 record(s)" in caplog.text  # blocks 3 and 4, never committed
    again = WalBlockStore(tmp_path / "blocks")
    assert again.recover("s") == (3, 9)
