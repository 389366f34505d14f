"""Records gone from the middle of a cluster node's log (blocks a start under --fsync off went on without,
after a power loss), read by the cluster source: as the single-node source does (tests/test_spark_source.py,
gapped_log), failOnDataLoss=true stops the read with DataLossError naming the node, the stream and the
records, and failOnDataLoss=false reads the records there with a WARNING. Before, Blocks.ReadBlocks said
only FAILED_PRECONDITION for a range over the gap, the task raised PartitionUnreadableError whatever
failOnDataLoss said, and the query stalled there for good. Real receiver nodes on loopback (grpc.aio
servers, each with its own data dir), and a real streaming query."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming.datasource import ReadAllAvailable

from ingest.server import SluiceServer
from ingest.spark.cluster_source import (
    ClusterPartition,
    ClusterStreamReader,
    DataLossError,
    PartitionUnreadableError,
    RangeSpec,
    read_range,
)
from ingest.spark.source import ARROW_SCHEMA
from receivers.cluster import Cluster
from receivers.config import FsyncPolicy
from receivers.wal import WalBlockStore
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, running_server
from tests.test_spark_source import write_block

Record = tuple[int, bytes]
"""(offset, value) of one record of node 0's partition."""


def gapped_node_log(data_dir: Path, node_id: int) -> tuple[list[Record], tuple[int, int]]:
    """Node `node_id`'s log of stream "s" in `data_dir`: 12 blocks of 20 records, several to a segment,
    that lost a middle segment (a power loss under --fsync off), as gapped_log makes a single server's:
    (the records left, the offsets lost [lo, hi)). The node's start goes on past the gap (an ERROR)."""
    root = data_dir / "blocks"
    store = WalBlockStore(root, fsync=FsyncPolicy.off(), segment_bytes=3000, direct_io=False)
    assert store.recover("s") == (0, 0)
    rows = [r for seq in range(12) for r in write_block(store, "s", seq, seq * 20, 20, receiver=node_id)]
    store.close()
    segments = sorted((root / "s").glob("*.wal"))
    assert len(segments) >= 3, segments
    lost = (int(segments[1].stem) * 20, int(segments[2].stem) * 20)
    segments[1].unlink()
    return [(r[1], r[4]) for r in rows if not lost[0] <= r[1] < lost[1]], lost


@contextlib.asynccontextmanager
async def gapped_cluster(
    tmp_path: Path,
) -> AsyncIterator[tuple[list[Cluster], list[Record], tuple[int, int]]]:
    """Two nodes (replication 1) under --fsync off, node 0's log of "s" with a gap (gapped_node_log)."""
    left, lost = gapped_node_log(tmp_path / "node0", 0)
    async with two_nodes(tmp_path) as clusters:
        yield clusters, left, lost


@contextlib.asynccontextmanager
async def two_nodes(tmp_path: Path) -> AsyncIterator[list[Cluster]]:
    """Two loopback nodes (replication 1) of stream "s" under --fsync off, their data in tmp_path/nodeN."""
    clusters = loopback_cluster(2)
    async with contextlib.AsyncExitStack() as stack:
        for cluster in clusters:
            port = int(cluster.me.target.rsplit(":", 1)[1])
            await stack.enter_async_context(
                running_server(
                    tmp_path / f"node{cluster.me.id}",
                    "s",
                    cluster=cluster,
                    port=port,
                    fsync=FsyncPolicy.off(),
                )
            )
        yield clusters


def receivers_option(clusters: list[Cluster]) -> str:
    return ",".join(f"{n.id}={n.target}" for n in clusters[0].nodes)


def reader(clusters: list[Cluster], **options: str) -> ClusterStreamReader:
    return ClusterStreamReader({"receivers": receivers_option(clusters), "streams": "s", **options})


def records(r: ClusterStreamReader, parts: list[ClusterPartition]) -> list[Record]:
    table = pa.Table.from_batches([b for p in parts for b in r.read(p)], schema=ARROW_SCHEMA)
    assert set(table.column("partition").to_pylist()) <= {0}
    return list(zip(table.column("offset").to_pylist(), table.column("value").to_pylist(), strict=True))


async def test_records_gone_from_a_nodes_log_are_data_loss_or_skipped_with_fail_on_data_loss_false(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with gapped_cluster(tmp_path) as (clusters, left, (lo, hi)):
        strict = reader(clusters)
        initial = await asyncio.to_thread(strict.initialOffset)
        end = await asyncio.to_thread(strict.latestOffset, initial, ReadAllAvailable())
        assert end["s"]["0"] == 240  # planning goes past the gap, as a single server's does
        parts = list(await asyncio.to_thread(strict.partitions, initial, end))
        with pytest.raises(DataLossError) as caught:
            await asyncio.to_thread(records, strict, parts)
        message = str(caught.value)
        assert f"records {lo}..{hi - 1} of node 0's log of stream 's'" in message, message
        assert "gone from the log of node 0" in message and "sluice_wal_lost_blocks_total" in message
        assert "failOnDataLoss=false" in message and "--no-fail-on-data-loss" in message

        lenient = reader(clusters, failOnDataLoss="false")
        parts = list(await asyncio.to_thread(lenient.partitions, initial, end))
        with caplog.at_level(logging.WARNING, "ingest.spark.cluster_source"):
            got = await asyncio.to_thread(records, lenient, parts)
        assert got == left
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"records {lo}..{hi - 1} of node 0's log" in m for m in warned), warned

        # a task's range wholly inside the gap reads nothing (or fails), one past it is whole
        target = ((0, clusters[0].me.target),)
        inside = RangeSpec("s", 0, lo + 5, hi - 5, target, fail_on_data_loss=False)
        assert await asyncio.to_thread(lambda: list(read_range(inside, Credentials()))) == []
        with pytest.raises(DataLossError, match=f"records {lo + 5}..{hi - 6} of node 0's"):
            await asyncio.to_thread(
                lambda: list(read_range(RangeSpec("s", 0, lo + 5, hi - 5, target), Credentials()))
            )
        past = RangeSpec("s", 0, hi, 240, target)
        assert (
            sum(b.num_rows for b in await asyncio.to_thread(lambda: list(read_range(past, Credentials()))))
            == 240 - hi
        )

        # a reader that does not ask for gaps in-band (one from before report_gone) is refused as before,
        # the refusal naming the records gone
        async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
            call = pb_grpc.BlocksStub(channel).ReadBlocks(
                pb.ReadBlocksRequest(stream="s", owner=0, from_offset=0, to_offset=240)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"records {lo}..{hi - 1} are gone from its log" in str(refused.value.details())


async def test_records_gone_from_one_holders_log_are_read_from_another(tmp_path: Path) -> None:
    """Replication 2: node 0 lost a middle segment of its log, node 1's copy of it is whole. The read
    takes the gap from node 1 and the rest from node 0: no data loss, failOnDataLoss or not. A node that
    is down while the only other holder says the records are gone is not taken for data loss: it may
    hold them (PartitionUnreadableError, as before)."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    async with contextlib.AsyncExitStack() as outer:
        stacks = {i: await outer.enter_async_context(contextlib.AsyncExitStack()) for i in range(2)}

        async def start(i: int) -> SluiceServer:
            return await stacks[i].enter_async_context(
                running_server(
                    tmp_path / f"node{i}",
                    "s",
                    cluster=clusters[i],
                    port=port[i],
                    fsync=FsyncPolicy.off(),
                    segment_bytes=4096,
                )
            )

        await start(0)
        await start(1)
        sent: list[bytes] = []
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            for i in range(30):  # a block each (at least): several segments
                values = [f"v{i}-{j}".encode() for j in range(20)]
                await producer.send_many(values)
                await producer.flush(timeout=30)
                sent += values
        await stacks[0].aclose()
        segments = sorted((tmp_path / "node0" / "blocks" / "s").glob("*.wal"))
        assert len(segments) >= 3, segments
        segments[1].unlink()
        owner = await start(0)
        held = owner.store.blocks("s")
        gaps = [
            (a.end_offset, b.first_offset)
            for a, b in itertools.pairwise(held)
            if b.first_offset > a.end_offset
        ]
        assert len(gaps) == 1, held
        target = {i: (i, clusters[i].me.target) for i in range(2)}
        spec = RangeSpec("s", 0, 0, len(sent), (target[0], target[1]))
        batches = await asyncio.to_thread(lambda: list(read_range(spec, Credentials())))
        table = pa.Table.from_batches(batches, schema=ARROW_SCHEMA)
        assert table.column("offset").to_pylist() == list(range(len(sent)))
        assert table.column("value").to_pylist() == sent
        await stacks[1].aclose()  # node 1 down: node 0's gap may be on it still
        lenient = dataclasses.replace(spec, fail_on_data_loss=False)
        with pytest.raises(PartitionUnreadableError) as caught:
            await asyncio.to_thread(lambda: list(read_range(lenient, Credentials(), timeout=5)))
        message = str(caught.value)
        assert f"node 0 ({clusters[0].me.target}): records {gaps[0][0]}..{gaps[0][1] - 1} are gone" in message
        assert f"node 1 ({clusters[1].me.target}): UNAVAILABLE" in message


async def test_records_gone_from_the_start_of_a_nodes_log_are_data_loss_or_skipped_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The oldest segment of node 0's log not released was lost (its start says the log is damaged):
    records from the released mark to its oldest block held. ReadBlocks counted only a gap between two
    blocks it holds as gone: a range from the mark was "not held" on every holder, so the read failed
    PartitionUnreadableError whatever failOnDataLoss said, and the query stopped there at every start."""
    root = tmp_path / "node0" / "blocks"
    store = WalBlockStore(root, fsync=FsyncPolicy.off(), segment_bytes=3000, direct_io=False)
    assert store.recover("s") == (0, 0)
    rows = [r for seq in range(12) for r in write_block(store, "s", seq, seq * 20, 20, receiver=0)]
    store.release("s", 2)  # records 0..39 read: the mark is at 40
    store.close()
    segments = sorted((root / "s").glob("*.wal"))
    lost = (40, int(segments[1].stem) * 20)
    assert int(segments[0].stem) * 20 == lost[0] < lost[1], segments
    segments[0].unlink()
    async with two_nodes(tmp_path) as clusters:
        strict = reader(clusters)
        start = {"s": {"0": 40}}
        end = await asyncio.to_thread(strict.latestOffset, start, ReadAllAvailable())
        assert end["s"]["0"] == 240
        parts = list(await asyncio.to_thread(strict.partitions, start, end))
        with pytest.raises(DataLossError) as caught:
            await asyncio.to_thread(records, strict, parts)
        assert f"records {lost[0]}..{lost[1] - 1} of node 0's log of stream 's'" in str(caught.value)

        lenient = reader(clusters, failOnDataLoss="false")
        parts = list(await asyncio.to_thread(lenient.partitions, start, end))
        with caplog.at_level(logging.WARNING, "ingest.spark.cluster_source"):
            got = await asyncio.to_thread(records, lenient, parts)
        assert got == [(r[1], r[4]) for r in rows if r[1] >= lost[1]]
        assert f"records {lost[0]}..{lost[1] - 1} of node 0's log" in caplog.text
        # records below the mark were released: not held, as before (not data loss)
        async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
            call = pb_grpc.BlocksStub(channel).ReadBlocks(
                pb.ReadBlocksRequest(stream="s", owner=0, from_offset=20, to_offset=240, report_gone=True)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "released, or not copied here yet" in str(refused.value.details())


@pytest.mark.spark
@pytest.mark.parametrize("fail_on_data_loss", ["true", "false"])
async def test_a_cluster_query_over_a_gap_in_a_nodes_log_fails_or_goes_on(
    spark: Any, tmp_path: Path, fail_on_data_loss: str
) -> None:
    """A real query over a cluster whose node 0 lost a middle segment of its log: it stopped with
    PartitionUnreadableError whatever failOnDataLoss said, at every start. Now failOnDataLoss=true stops
    it with DataLossError naming the node, stream and records, and failOnDataLoss=false reads every
    record still there (and node 1's)."""
    async with gapped_cluster(tmp_path) as (clusters, left, (lo, hi)):
        async with Producer(clusters[1].me.target, "s", producer_id="p1", linger=0) as producer:
            theirs = [f"n1-{i}".encode() for i in range(50)]
            await producer.send_many(theirs)
            await producer.flush(timeout=30)
        df = (
            spark.readStream.format("sluice")
            .option("receivers", receivers_option(clusters))
            .option("streams", "s")
            .option("failOnDataLoss", fail_on_data_loss)
            .load()
        )
        name = f"cluster_gap_{fail_on_data_loss}"
        query = await asyncio.to_thread(
            lambda: df.writeStream.format("memory").queryName(name).trigger(availableNow=True).start()
        )
        try:
            if fail_on_data_loss == "true":
                with pytest.raises(StreamingQueryException) as failed:
                    await asyncio.to_thread(query.awaitTermination, 120)
                assert f"records {lo}..{hi - 1} of node 0's log of stream 's'" in str(failed.value), (
                    failed.value
                )
                return
            await asyncio.to_thread(query.awaitTermination, 120)
            assert query.exception() is None, query.exception()
            rows = await asyncio.to_thread(spark.sql(f"select partition, offset, value from {name}").collect)
        finally:
            await asyncio.to_thread(query.stop)
        got = sorted((r["partition"], r["offset"], bytes(r["value"])) for r in rows)
        assert got == sorted([(0, o, v) for o, v in left] + [(1, i, v) for i, v in enumerate(theirs)])
