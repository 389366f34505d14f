"""A node's log lost while every follower of it was down (an empty data dir, a new disk): the node cannot
tell that from a first start, so it starts its partitions again at offset 0. What tells is the log's
incarnation (a random id made with the log, carried by its copies and by the query's offsets): the
driver fails with DataLossError rather than skip the new log's records below its checkpoint (or, with
failOnDataLoss=false, reads the new log from its start), and a follower back afterwards sets its copy of
the old log aside rather than drop it or mix it with the new one. Real receiver nodes on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming.datasource import ReadAllAvailable

from ingest.server import SluiceServer
from ingest.spark.cluster_source import INCARNATIONS, ClusterStreamReader, DataLossError, flatten
from receivers.cluster import Cluster
from receivers.replica_store import SET_ASIDE, SET_ASIDE_INFO
from receivers.wal import WalBlockStore
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, running_server, sink_values, wait_until
from tests.test_cluster_source import push, read_all, reader, receivers_option
from tests.test_replication import read_partition


class Nodes:
    """Receiver nodes started and stopped one by one, each on a data dir of its choosing."""

    def __init__(self, tmp_path: Path, clusters: list[Cluster], outer: contextlib.AsyncExitStack) -> None:
        self.tmp_path = tmp_path
        self.clusters = clusters
        self.outer = outer
        self.stacks: dict[int, contextlib.AsyncExitStack] = {}
        self.servers: dict[int, SluiceServer] = {}

    async def start(self, i: int, folder: str) -> SluiceServer:
        stack = await self.outer.enter_async_context(contextlib.AsyncExitStack())
        port = int(self.clusters[i].me.target.rsplit(":", 1)[1])
        server = await stack.enter_async_context(
            running_server(self.tmp_path / folder, "s", cluster=self.clusters[i], port=port)
        )
        self.stacks[i], self.servers[i] = stack, server
        return server

    async def stop(self, i: int) -> None:
        await self.stacks.pop(i).aclose()
        del self.servers[i]


async def _in_sync(server: SluiceServer) -> None:
    node = server.node
    assert node is not None
    await wait_until(lambda: bool(node.replicator.in_sync()), timeout=20)


async def _incarnations(target: str) -> dict[int, str]:
    """Owner -> the incarnation of the log of stream s a node reports holding of it."""
    async with grpc.aio.insecure_channel(target) as channel:
        response = await pb_grpc.BlocksStub(channel).ListPartitions(pb.ListPartitionsRequest())
    return {p.owner: p.incarnation for p in response.partitions if p.stream == "s"}


async def _lose_node0_with_its_follower_down(
    nodes: Nodes, r: ClusterStreamReader
) -> tuple[dict[str, Any], list[bytes], str]:
    """Node 0 takes 150 records (both nodes hold them; the driver read and committed the first 100),
    then node 1 and node 0 go down and node 0 comes back on an empty data dir with node 1 still down,
    and takes 30 records more. The driver's end offset, the 50 acked records no one read, and node 0's
    first incarnation."""
    clusters = nodes.clusters
    await nodes.start(1, "node1")
    node0 = await nodes.start(0, "node0")
    await _in_sync(node0)
    await push(clusters[0].me.target, 100, "a")
    first = node0.store.incarnation("s")
    assert first
    initial = await asyncio.to_thread(r.initialOffset)
    end = await asyncio.to_thread(r.latestOffset, initial, ReadAllAvailable())
    assert flatten(end)["s/0"] == 100
    assert end[INCARNATIONS]["s/0"] == first  # the offset names the log it is of
    table = await asyncio.to_thread(read_all, r, list(await asyncio.to_thread(r.partitions, initial, end)))
    assert table.num_rows == 100
    await asyncio.to_thread(r.commit, end)
    unread = await push(clusters[0].me.target, 50, "b")  # acked on both nodes, not read yet
    await nodes.stop(1)
    await nodes.stop(0)
    # node 0's data dir is lost; it starts again with its only follower down: a first start, to it
    lost = await nodes.start(0, "node0-lost")
    assert lost.receivers["s"].log_end == (0, 0)
    assert lost.store.incarnation("s") not in ("", first)
    return end, unread, first


async def test_a_log_lost_while_its_followers_were_down_is_data_loss_to_the_driver(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the new log's records 0..99 were skipped silently (the checkpoint was at 100) and the
    driver's commit released them unread; now planning fails naming the partition, and with
    failOnDataLoss=false the new log is read from offset 0."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        r = reader(clusters)
        end, _, first = await _lose_node0_with_its_follower_down(nodes, r)
        now = nodes.servers[0].store.incarnation("s")
        assert "did not answer: if this node's data dir was lost" in caplog.text
        fresh = await push(clusters[0].me.target, 130, "c")  # acked at offsets 0..129 of the new log
        with pytest.raises(DataLossError) as lost:
            await asyncio.to_thread(r.latestOffset, end, ReadAllAvailable())
        words = str(lost.value)
        for part in ("node 0's log of stream 's'", first, now, "up to offset 100", "failOnDataLoss=false"):
            assert part in words, words
        # a driver restarted on that checkpoint releases its last commit: not in the new log
        await asyncio.to_thread(r.commit, end)
        assert sum(b.count for b in nodes.servers[0].store.blocks("s")) == 130
        # failOnDataLoss=false: a warning, and the new log from its start, none of it skipped
        tolerant = reader(clusters, failOnDataLoss="false")
        with caplog.at_level(logging.WARNING, logger="ingest.spark.cluster_source"):
            after = await asyncio.to_thread(tolerant.latestOffset, end, ReadAllAvailable())
        assert "failOnDataLoss=false: the query reads the new log from its start" in caplog.text
        assert flatten(after)["s/0"] == 130 and after[INCARNATIONS]["s/0"] == now
        parts = list(await asyncio.to_thread(tolerant.partitions, end, after))
        assert [p.spec.incarnation for p in parts] == [now] * len(parts)
        table = await asyncio.to_thread(read_all, tolerant, parts)
        assert table.column("value").to_pylist() == fresh
        assert table.column("offset").to_pylist() == list(range(130))
        # from there on, the offsets are the new log's: no loss is seen again
        assert await asyncio.to_thread(r.latestOffset, after, ReadAllAvailable()) == after


async def test_an_old_checkpoint_without_incarnations_adopts_them_unless_the_log_went_back(
    tmp_path: Path,
) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        await nodes.start(1, "node1")
        node0 = await nodes.start(0, "node0")
        await _in_sync(node0)
        await push(clusters[0].me.target, 20, "a")
        r = reader(clusters)
        old = {"s": {"0": 10}}  # a checkpoint written before offsets named incarnations
        end = await asyncio.to_thread(r.latestOffset, old, ReadAllAvailable())
        assert flatten(end)["s/0"] == 20
        assert end[INCARNATIONS]["s/0"] == node0.store.incarnation("s")
        with pytest.raises(
            DataLossError, match=r"ends at offset 20, and the checkpoint read it up to offset 50"
        ):
            await asyncio.to_thread(r.latestOffset, {"s": {"0": 50}}, ReadAllAvailable())


async def test_a_follower_back_after_its_owners_log_was_lost_sets_its_old_copy_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The follower's copy of the old log held acked records no one read (and the only copy of them
    now). Before, the owner's hello made it refuse the owner for good, or drop its tail and take the new
    log's blocks on top of the old ones (a copy of neither log). Now it moves the whole copy aside,
    readable, says which records the owner lost, and copies the new log afresh."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        r = reader(clusters)
        _, unread, first = await _lose_node0_with_its_follower_down(nodes, r)
        owner = nodes.servers[0]
        now = owner.store.incarnation("s")
        fresh = await push(clusters[0].me.target, 30, "c")
        follower = await nodes.start(1, "node1")  # back, with its copy of the old log
        node = follower.node
        assert node is not None
        await _in_sync(owner)
        local = owner.node.local  # type: ignore[union-attr]
        await wait_until(lambda: node.replicas.committed(0, "s") == local.durable_seq("s"), timeout=20)
        # the old copy, whole and readable, where the error says
        aside = tmp_path / "node1" / "replicas" / SET_ASIDE / f"0-{first}"
        copy = WalBlockStore(aside)
        blocks = copy.blocks("s")
        assert [b.first_offset for b in blocks][:1] == [100] and blocks[-1].end_offset == 150
        values = [v for b in blocks for batch in copy.read(b) for v in batch.column("value").to_pylist()]
        assert values == unread
        info = json.loads((aside / SET_ASIDE_INFO).read_text())
        assert (info["incarnation"], info["replaced_by"]) == (first, now)
        assert (info["first_offset"], info["end_offset"], info["committed_end_offset"]) == (100, 150, 150)
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert any("records 100..149" in e and str(aside) in e for e in errors), errors
        # the new copy is the new log's, and says so
        assert (await _incarnations(clusters[1].me.target))[0] == now
        assert await read_partition(clusters[1].me.target, 0, 0, 30) == fresh
        # a release of the old log's offsets (a driver on an old checkpoint) releases nothing of it
        async with grpc.aio.insecure_channel(clusters[1].me.target) as channel:
            request = pb.ReleaseBlocksRequest(stream="s", owner=0, before_offset=30, incarnation=first)
            await pb_grpc.BlocksStub(channel).ReleaseBlocks(request)
        assert await read_partition(clusters[1].me.target, 0, 0, 30) == fresh
        # and a restart keeps both as they are
        await nodes.stop(1)
        await nodes.start(1, "node1")
        assert len(WalBlockStore(aside).blocks("s")) == len(blocks)
        assert await read_partition(clusters[1].me.target, 0, 0, 30) == fresh


async def test_a_holder_of_another_incarnation_serves_no_read_of_this_one(tmp_path: Path) -> None:
    """While the follower still holds the old log (its owner not connected to it yet), a read or a
    release of the new log's offsets there would give or drop the old log's records."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        r = reader(clusters)
        _, unread, first = await _lose_node0_with_its_follower_down(nodes, r)
        now = nodes.servers[0].store.incarnation("s")
        await nodes.stop(0)
        await nodes.start(1, "node1")  # the owner is down: the copy is still of the old log
        assert (await _incarnations(clusters[1].me.target))[0] == first
        async with grpc.aio.insecure_channel(clusters[1].me.target) as channel:
            stub = pb_grpc.BlocksStub(channel)
            reading = stub.ReadBlocks(
                pb.ReadBlocksRequest(stream="s", owner=0, from_offset=100, to_offset=150, incarnation=now)
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in reading:
                    pass
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"holds incarnation {first}" in (refused.value.details() or "")
            request = pb.ReleaseBlocksRequest(stream="s", owner=0, before_offset=150, incarnation=now)
            assert (await stub.ReleaseBlocks(request)).blocks_released == 0
        assert await read_partition(clusters[1].me.target, 0, 100, 150) == unread


async def test_a_node_that_goes_on_from_a_copy_keeps_its_logs_incarnation(tmp_path: Path) -> None:
    """A log lost while a follower answers goes on past the copy (offsets go on): the same log, the same
    incarnation, and no data loss to the driver."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        await nodes.start(1, "node1")
        node0 = await nodes.start(0, "node0")
        await _in_sync(node0)
        sent = await push(clusters[0].me.target, 100, "a")
        first = node0.store.incarnation("s")
        r = reader(clusters)
        end = await asyncio.to_thread(
            r.latestOffset, await asyncio.to_thread(r.initialOffset), ReadAllAvailable()
        )
        await nodes.stop(0)
        lost = await nodes.start(0, "node0-lost")
        assert lost.receivers["s"].log_end[1] == 100
        assert lost.store.incarnation("s") == first
        await _in_sync(lost)
        sent += await push(clusters[0].me.target, 10, "c")
        assert (await _incarnations(clusters[1].me.target))[0] == first
        assert not (tmp_path / "node1" / "replicas" / SET_ASIDE).exists()
        after = await asyncio.to_thread(r.latestOffset, end, ReadAllAvailable())
        assert flatten(after)["s/0"] == 110 and after[INCARNATIONS]["s/0"] == first
        table = await asyncio.to_thread(read_all, r, list(await asyncio.to_thread(r.partitions, end, after)))
        assert table.column("value").to_pylist() == sent[100:]


@pytest.mark.spark
async def test_a_query_fails_on_a_lost_log_and_reads_the_new_one_with_fail_on_data_loss_false(
    spark: Any, tmp_path: Path
) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    checkpoint, sink = tmp_path / "checkpoint", tmp_path / "sink"

    def run(**options: str) -> Any:
        reading = spark.readStream.format("sluice").option("receivers", receivers_option(clusters))
        for key, value in {"streams": "s", **options}.items():
            reading = reading.option(key, value)
        query = (
            reading.load()
            .writeStream.format("parquet")
            .option("path", str(sink))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        with contextlib.suppress(StreamingQueryException):  # query.exception() says it
            query.awaitTermination(120)
        return query

    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        await nodes.start(1, "node1")
        node0 = await nodes.start(0, "node0")
        await _in_sync(node0)
        sent = await push(clusters[0].me.target, 100, "a")
        query = await asyncio.to_thread(run)
        assert query.exception() is None, query.exception()
        assert sorted(sink_values(sink)) == sorted(sent)
        await nodes.stop(1)
        await nodes.stop(0)
        await nodes.start(0, "node0-lost")  # its follower down
        fresh = await push(clusters[0].me.target, 150, "c")  # offsets 0..149: 0..99 below the checkpoint
        query = await asyncio.to_thread(run)
        failure = str(query.exception())
        assert "DataLossError" in failure and "node 0's log of stream 's'" in failure, failure
        assert sorted(sink_values(sink)) == sorted(sent)  # nothing skipped, nothing taken as read
        started = time.monotonic()
        query = await asyncio.to_thread(run, failOnDataLoss="false")
        assert query.exception() is None, query.exception()
        assert sorted(sink_values(sink)) == sorted(sent + fresh), time.monotonic() - started


@pytest.mark.spark
async def test_the_drivers_query_fails_on_a_lost_log_unless_told_not_to(spark: Any, tmp_path: Path) -> None:
    """`sluice serve --role driver` had no setting for failOnDataLoss: its query always stopped on a
    lost log, and the way on was moving its checkpoint aside. DriverConfig.fail_on_data_loss
    (`--no-fail-on-data-loss`) goes to its query as the source option: a ClusterDriver on real Spark
    stops with DataLossError by default, and with it off reads the new log from its start."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.config import RateConfig
    from ingest.driver_config import DriverConfig
    from ingest.spark.source import OPTION_FAIL_ON_DATA_LOSS

    clusters = loopback_cluster(2, replication=2, min_insync=1)
    data_dir = tmp_path / "driver"
    sink = data_dir / "sink"

    async def drive(until: Any, **options: Any) -> tuple[ClusterDriver, str | None]:
        """Run a driver on `data_dir` until `until(driver)`; it, and its error() then (before its stop)."""
        config = DriverConfig(
            nodes={n.id: n.target for n in clusters[0].nodes},
            streams=("s",),
            data_dir=data_dir,
            trigger_interval=0.5,
            rate=RateConfig(estimator="fixed", initial_rate=100_000.0),
            **options,
        )
        driver = ClusterDriver(config)
        await driver.start(spark)
        try:
            await wait_until(lambda: until(driver), timeout=120)
            error = driver.error()
        finally:
            await driver.stop()
        return driver, error

    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        await nodes.start(1, "node1")
        node0 = await nodes.start(0, "node0")
        await _in_sync(node0)
        sent = await push(clusters[0].me.target, 100, "a")
        first, error = await drive(lambda d: len(sink_values(sink)) >= 100 or d.error() is not None)
        assert error is None and sorted(sink_values(sink)) == sorted(sent), error
        assert node0.rate.pinned  # the driver's share reached the node (its calls name the driver)
        assert first.spark_driver is not None
        assert first.spark_driver.source_options[OPTION_FAIL_ON_DATA_LOSS] == "true"  # the default
        await nodes.stop(1)
        await nodes.stop(0)
        await nodes.start(0, "node0-lost")  # its follower down
        fresh = await push(clusters[0].me.target, 150, "c")  # offsets 0..149: 0..99 below the checkpoint
        _, failure = await drive(lambda d: d.error() is not None)
        assert failure is not None
        assert "DataLossError" in failure and "node 0's log of stream 's'" in failure, failure
        assert "--no-fail-on-data-loss" in failure, failure
        assert sorted(sink_values(sink)) == sorted(sent)  # nothing skipped, nothing taken as read
        # the way on: the setting, not the checkpoint moved aside
        tolerant, error = await drive(
            lambda d: len(sink_values(sink)) >= 250 or d.error() is not None, fail_on_data_loss=False
        )
        assert error is None, error
        assert tolerant.spark_driver is not None
        assert tolerant.spark_driver.source_options[OPTION_FAIL_ON_DATA_LOSS] == "false"
        assert sorted(sink_values(sink)) == sorted(sent + fresh)


async def test_a_new_query_started_at_offsets_of_a_lost_log_fails_too(tmp_path: Path) -> None:
    """A pipeline swap starts its new query at the old one's committed offsets (startingOffsets). Without
    their incarnations it took the new log's for them and started past its records below those offsets;
    with them, it fails as the old query would."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    async with contextlib.AsyncExitStack() as outer:
        nodes = Nodes(tmp_path, clusters, outer)
        end, _, first = await _lose_node0_with_its_follower_down(
            nodes, ClusterStreamReader({"receivers": receivers_option(clusters), "streams": "s"})
        )
        await push(clusters[0].me.target, 130, "c")
        swapped = reader(clusters, startingOffsets=json.dumps(end))
        initial = await asyncio.to_thread(swapped.initialOffset)
        assert flatten(initial)["s/0"] == 100 and initial[INCARNATIONS]["s/0"] == first
        with pytest.raises(DataLossError, match=r"checkpoint read incarnation \w+ up to offset 100"):
            await asyncio.to_thread(swapped.latestOffset, initial, ReadAllAvailable())


def test_the_incarnations_of_a_commit_go_to_the_next_generation_and_its_starting_offsets(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    from ingest.driver import last_commit, last_commit_named
    from ingest.pipeline_manager import _starting_at
    from ingest.pipeline_state import Generation, _json
    from ingest.spark.listener import _source_incarnations, _source_offset

    (tmp_path / "commits").mkdir()
    (tmp_path / "offsets").mkdir()
    (tmp_path / "commits" / "3").write_text("v1\n{}\n")
    offset = '{"s":{"0":12,"1":4},"_incarnations":{"s/0":"abc","s/1":"def"}}'
    (tmp_path / "offsets" / "3").write_text(f'v1\n{{"batchWatermarkMs":0}}\n{offset}\n')
    assert last_commit(tmp_path, ["s"]) == (3, {"s/0": 12, "s/1": 4})
    committed = last_commit_named(tmp_path, ["s"])
    assert committed == (3, {"s/0": 12, "s/1": 4}, {"s/0": "abc", "s/1": "def"})
    new = _starting_at(Generation("", 2, "c2", "s2"), Generation("", 1, "c1", "s1"), committed)
    assert new.starting_incarnations == {"s/0": "abc", "s/1": "def"}
    assert Generation.from_json(json.loads(json.dumps(_json(new)))) == new
    assert "starting_incarnations" not in _json(Generation("", 1, "c1", "s1"))  # as before, without
    # the listener: the offsets as before, and the incarnations beside them (the driver's releases)
    progress = SimpleNamespace(sources=[SimpleNamespace(endOffset=offset)])
    assert _source_offset(progress, "endOffset") == {"s/0": 12, "s/1": 4}
    assert _source_incarnations(progress, "endOffset") == {"s/0": "abc", "s/1": "def"}


def test_a_copy_set_aside_leaves_no_committed_seq_behind_when_the_step_fails_midway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy was moved aside before its old committed seq was forgotten: a crash or a full disk in
    between left that seq over the new, empty copy, so the new log's first blocks counted as committed
    (served to Spark, counted for failover) before the owner acked them."""
    from receivers import replica_store
    from receivers.replica_store import ReplicaStore
    from receivers.wal import RawBlock
    from receivers.wire import decode_batch
    from sluice_client.wire import encode_batch

    def block(seq: int) -> RawBlock:
        import pyarrow as pa

        from receivers.block import BLOCK_SCHEMA

        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, BLOCK_SCHEMA) as ipc:
            ipc.write_batch(decode_batch(encode_batch(0, [b"a", b"b"]), 0))
        return RawBlock(seq, 2 * seq, 2, 0, 0.0, {}, sink.getvalue().to_pybytes())

    old, new = "1" * 32, "2" * 32
    replicas = ReplicaStore(tmp_path)
    assert replicas.meet_incarnation(0, "s", old) is None
    for seq in range(6):
        replicas.append(0, "s", block(seq), after_release=False)
    replicas.set_committed(0, {"s": 6})
    real = replica_store.replace_json

    def full_disk(path: Path, data: Any) -> None:
        if path.name == SET_ASIDE_INFO:
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(replica_store, "replace_json", full_disk)
    with pytest.raises(OSError, match="No space"):
        replicas.meet_incarnation(0, "s", new)
    replicas.close()
    monkeypatch.setattr(replica_store, "replace_json", real)
    again = ReplicaStore(tmp_path)  # the next start: the copy's folder is gone, aside
    assert again.meet_incarnation(0, "s", new) is None
    assert again.committed(0, "s") == 0
    again.close()
