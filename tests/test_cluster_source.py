"""The "sluice" source in cluster mode (option receivers): offsets, partitions and reads over the Blocks
service of real receiver nodes (grpc.aio servers on loopback, each with its own data dir), and a real
streaming query over them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import types
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from ingest.server import SluiceServer
from ingest.spark.cluster_source import (
    INCARNATIONS,
    BlocksClient,
    ClusterPartition,
    ClusterStreamReader,
    ClusterView,
    DriverFencedError,
    NodeListError,
    PartitionUnreadableError,
    RangeSpec,
    flatten,
    is_cluster_offset,
    nest,
    read_range,
)
from ingest.spark.source import ARROW_SCHEMA, SCHEMA, SluiceDataSource
from receivers.block import countable
from receivers.cluster import Cluster
from sluice_client import Producer
from sluice_client.credentials import Credentials
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import free_ports, loopback_cluster, running_server, wait_until
from tests.test_status_cli import status as status_cli


@contextlib.asynccontextmanager
async def nodes(
    tmp_path: Path, clusters: list[Cluster], *streams: str
) -> AsyncIterator[dict[int, SluiceServer]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for cluster in clusters:
            me = cluster.me
            port = int(me.target.rsplit(":", 1)[1])
            servers[me.id] = await stack.enter_async_context(
                running_server(tmp_path / f"node{me.id}", *(streams or ("s",)), cluster=cluster, port=port)
            )
        yield servers


def receivers_option(clusters: list[Cluster]) -> str:
    return ",".join(f"{n.id}={n.target}" for n in clusters[0].nodes)


def reader(clusters: list[Cluster], streams: str = "s", **options: str) -> ClusterStreamReader:
    return ClusterStreamReader({"receivers": receivers_option(clusters), "streams": streams, **options})


async def push(target: str, n: int, tag: str, stream: str = "s") -> list[bytes]:
    values = [f"{tag}{i}".encode() for i in range(n)]
    async with Producer(target, stream, producer_id=f"p-{tag}", linger=0) as producer:
        await producer.send_many(values)
        await producer.flush(timeout=30)
        assert producer.acked == n
    return values


def plain(offset: dict[str, Any]) -> dict[str, Any]:
    """An offset of the source without the incarnations it names (INCARNATIONS)."""
    return {k: v for k, v in offset.items() if k != INCARNATIONS}


def read_all(r: ClusterStreamReader, parts: list[ClusterPartition]) -> pa.Table:
    batches = [b for p in parts for b in r.read(p)]
    return pa.Table.from_batches(batches, schema=ARROW_SCHEMA)


# ---- pure parts ------------------------------------------------------------------------------------


def test_offsets_nest_sorted_with_string_owner_keys() -> None:
    flat = {"s/10": 5, "a/2": 1, "s/2": 7}
    assert list(nest(flat)) == ["a", "s"]
    assert list(nest(flat)["s"]) == ["2", "10"]  # by node number: stable JSON text
    assert flatten(nest(flat)) == flat
    assert is_cluster_offset({"s": {"0": 3}}, ["s"])
    assert not is_cluster_offset({"s": 3}, ["s"])
    assert not is_cluster_offset({"x": {"0": 3}}, ["s"])


def test_bad_options_are_clear_value_errors() -> None:
    for options, words in (
        ({"streams": "s"}, "exactly one of option 'path'"),
        ({"streams": "s", "path": "/tmp/x", "receivers": "0=a:1"}, "exactly one of option 'path'"),
    ):
        with pytest.raises(ValueError, match=words):
            SluiceDataSource(options).streamReader(SCHEMA)
    for receivers, words in (
        ("0=a", "expected 'ID HOST:PORT'"),
        ("x=a:1", "expected 'ID HOST:PORT'"),
        ("0=a:1,0=b:2", "repeats"),
        ("0=a:1,1=a:1", "repeats"),
        ("0=a:70000", "port"),
    ):
        with pytest.raises(ValueError, match=words):
            ClusterStreamReader({"receivers": receivers, "streams": "s"})
    with pytest.raises(ValueError, match="names no stream"):
        ClusterStreamReader({"receivers": "0=a:1", "streams": ","})
    r = ClusterStreamReader({"receivers": "0=a:1", "streams": "s", "rateTokenFile": "/nonexistent/token"})
    with pytest.raises(ValueError, match="receiver nodes' credentials"):
        r.initialOffset()
    chosen = SluiceDataSource({"receivers": "0=a:1", "streams": "s"}).streamReader(SCHEMA)
    assert isinstance(chosen, ClusterStreamReader)
    # startingOffsets (a swapped-in query's start): nested as the offsets, or flat as the listener's
    for given in ('{"s": {"0": 5, "1": 0}}', '{"s/0": 5, "s/1": 0}'):
        r = ClusterStreamReader({"receivers": "0=a:1", "streams": "s", "startingOffsets": given})
        assert r.starting_offsets == {"s/0": 5, "s/1": 0}
    for bad in (
        '{"s": 5}',
        '{"s/x": 1}',
        '{"s/0": -1}',
        '{"s/0": 1.5}',
        '["s/0"]',
        "{",
        '{"/0": 1}',
        '{"s/²": 1}',
    ):
        with pytest.raises(ValueError, match="startingOffsets"):
            ClusterStreamReader({"receivers": "0=a:1", "streams": "s", "startingOffsets": bad})


def view(*answers: tuple[int, list[tuple[int, int, int]]]) -> ClusterView:
    """A ClusterView of nodes 0..2 from (node, [(owner, start, end)]) answers for stream s."""
    v = ClusterView([0, 1, 2])
    for node_id, parts in answers:
        v.add(
            pb.ListPartitionsResponse(
                node_id=node_id,
                partitions=[
                    pb.PartitionInfo(stream="s", owner=o, start_offset=a, end_offset=b, leader=o == node_id)
                    for o, a, b in parts
                ],
            ),
            ["s"],
        )
    return v


def test_view_merges_holders_ends_floors_and_orders_owner_first() -> None:
    v = view((1, [(1, 0, 50), (0, 40, 90)]), (2, [(2, 0, 0), (1, 10, 70), (0, 0, 0)]), (0, [(0, 60, 100)]))
    assert v.end("s/0") == 100 and v.end("s/1") == 70 and v.end("s/2") == 0
    assert v.floor("s/0") == 40  # lowest start still held: node 1's copy was not released as far
    assert v.floor("s/1") == 0 and v.floor("s/2") == 0  # a new node's partition starts at record 0
    assert v.holders("s/0", 60, 90) == [0, 1, 2]  # owner, then the follower; node 2 only reported
    assert v.holders("s/0", 40, 90) == [1, 0, 2]  # the owner released 40..59: not first
    assert v.holders("s/1", 10, 50) == [1, 2]
    assert ClusterView([5, 3, 4]).holders("s/4", 0, 1) == [4, 5, 3]  # nobody answered: all, owner first


def test_the_records_a_partition_can_be_read_are_those_some_holder_has_not_lost() -> None:
    """ClusterView.readable (the driver's node backlog): records gone from the owner's log
    (PartitionInfo.gone: its lost.json's) are readable where a copy holds them, and where none does
    they are not; a holder that predates the field (no gone) is taken to serve its whole range."""

    def holding(node: int, start: int, end: int, gone: list[tuple[int, int]]) -> pb.ListPartitionsResponse:
        ranges = [pb.OffsetRange(first_offset=a, end_offset=b) for a, b in gone]
        info = pb.PartitionInfo(
            stream="s", owner=0, start_offset=start, end_offset=end, leader=node == 0, gone=ranges
        )
        return pb.ListPartitionsResponse(node_id=node, partitions=[info])

    def readable(*answers: pb.ListPartitionsResponse) -> list[tuple[int, int]]:
        v = ClusterView([0, 1, 2])
        for answer in answers:
            v.add(answer, ["s"])
        return v.readable("s/0")

    owner = holding(0, 0, 240, [(40, 100), (150, 200)])
    assert readable(owner) == [(0, 40), (100, 150), (200, 240)]
    assert readable(owner, holding(1, 0, 240, [])) == [(0, 240)]  # its copy has them all
    assert readable(owner, holding(1, 20, 120, [])) == [(0, 150), (200, 240)]
    assert readable(owner, holding(1, 20, 240, [(30, 180)])) == [(0, 40), (100, 150), (180, 240)]
    assert readable(holding(1, 60, 90, []), holding(2, 0, 0, [])) == [(60, 90)]  # the owner did not answer
    assert readable() == []


def test_admission_water_fills_over_partitions_with_stream_weights_shared() -> None:
    r = ClusterStreamReader({"receivers": "0=a:1,1=b:2", "streams": "a,b"})
    r._weights_for = ["a/0", "a/1", "b/0"]
    start = {"a/0": 0, "a/1": 0, "b/0": 0}
    end = r._plan(start, {"a/0": 1000, "a/1": 1000, "b/0": 1000}, ReadMaxRows(300), None, 0.0)
    # streams 1:1, stream a's share halved over its two partitions
    assert end == {"a/0": 75, "a/1": 75, "b/0": 150}
    end = r._plan(start, {"a/0": 10, "a/1": 1000, "b/0": 1000}, ReadMaxRows(300), None, 0.0)
    assert end["a/0"] == 10 and sum(end.values()) == 300  # a partition needing less leaves the rest


def test_records_no_holder_serves_take_none_of_a_batchs_cap() -> None:
    """A capped plan over partitions with gaps (records gone from every holder's log) gives the whole
    budget to records some holder serves, and says only those to the rate server's StartBatch."""
    r = ClusterStreamReader({"receivers": "0=a:1,1=b:2", "streams": "s"})
    r._weights_for = ["s/0", "s/1"]
    start = {"s/0": 32, "s/1": 0}
    available = {"s/0": 240, "s/1": 1000}
    end = r._plan(start, available, ReadMaxRows(32), None, 0.0, gaps={"s/0": [(40, 200)]})
    assert end == {"s/0": 208, "s/1": 16}  # 32..39 and 200..207: was 48
    end = r._plan({"s/0": 50, "s/1": 0}, available, ReadMaxRows(32), None, 0.0, gaps={"s/0": [(40, 200)]})
    assert end == {"s/0": 216, "s/1": 16}  # from inside the gap: was 66


def test_a_batchs_cap_holds_when_a_node_that_did_not_answer_serves_what_the_others_lack() -> None:
    """The owner (node 0) did not answer the plan's ListPartitions, and its follower's copy lacks
    records 40..199 (PartitionInfo.gone). Taken as a gap, the plan with a cap of 16 from offset 32 went
    to 208; the owner answered the tasks' look (partitions() asks again), served 32..207, and the batch
    read 176 records. Now, while a node of the list has not answered, nothing counts as a gap (it may
    hold any record), and the batch reads 16; with every node answering, gaps count as before."""

    def holding(node: int, gone: list[tuple[int, int]]) -> pb.ListPartitionsResponse:
        ranges = [pb.OffsetRange(first_offset=a, end_offset=b) for a, b in gone]
        info = pb.PartitionInfo(
            stream="s", owner=0, start_offset=0, end_offset=240, leader=node == 0, gone=ranges
        )
        return pb.ListPartitionsResponse(node_id=node, partitions=[info])

    def view(*answers: pb.ListPartitionsResponse) -> ClusterView:
        v = ClusterView([0, 1])
        for answer in answers:
            v.add(answer, ["s"])
        return v.settle({})

    r = ClusterStreamReader({"receivers": "0=a:1,1=b:2", "streams": "s"})
    r._weights_for = ["s/0"]
    owner, follower = holding(0, []), holding(1, [(40, 200)])
    planned = view(follower)  # the owner did not answer
    assert planned.readable("s/0") == [(0, 40), (200, 240)]  # what the follower serves
    assert planned.gaps("s/0", 32, 240) == []  # but the owner may serve the rest
    end = r._plan(
        {"s/0": 32}, {"s/0": 240}, ReadMaxRows(16), None, 0.0, gaps={"s/0": planned.gaps("s/0", 32, 240)}
    )
    assert end == {"s/0": 48}  # was 208
    read = view(owner, follower)  # the tasks' look: the owner answers, and serves every record
    assert read.holders("s/0", 32, 48)[0] == 0 and read.gaps("s/0", 32, 48) == []
    assert countable(32, end["s/0"], read.gaps("s/0", 32, end["s/0"])) == 16  # was 176
    # every node answered, and no holder serves 40..199: a gap, the cap goes to records past it
    both_lack = view(holding(0, [(40, 200)]), follower)
    assert both_lack.gaps("s/0", 32, 240) == [(40, 200)]
    gaps = {"s/0": both_lack.gaps("s/0", 32, 240)}
    assert r._plan({"s/0": 32}, {"s/0": 240}, ReadMaxRows(16), None, 0.0, gaps=gaps) == {"s/0": 208}


# ---- against real receiver nodes ---------------------------------------------------------------


async def test_offsets_partitions_and_reads_over_three_nodes(tmp_path: Path) -> None:
    clusters = loopback_cluster(3, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters) as servers:
        r = reader(clusters, minPartitions="4")
        initial = await asyncio.to_thread(r.initialOffset)
        assert plain(initial) == {"s": {"0": 0, "1": 0, "2": 0}}
        sent = {i: await push(servers[i].target, n, f"n{i}-") for i, n in ((0, 300), (1, 200), (2, 100))}
        end = await asyncio.to_thread(r.latestOffset, initial, ReadAllAvailable())
        assert plain(end) == {"s": {"0": 300, "1": 200, "2": 100}}
        assert await asyncio.to_thread(r.reportLatestOffset) == plain(end)
        parts = list(await asyncio.to_thread(r.partitions, initial, end))
        assert len(parts) >= 4
        for p in parts:  # each names the owner first, then its follower (ring: owner + 1)
            owner = p.spec.owner
            assert [n for n, _ in p.spec.targets][:2] == [owner, (owner + 1) % 3]
        table = await asyncio.to_thread(read_all, r, parts)
        assert table.schema == ARROW_SCHEMA
        rows = table.to_pylist()
        assert len(rows) == 600
        for i, values in sent.items():
            mine = sorted((r["offset"], r["value"]) for r in rows if r["partition"] == i)
            assert mine == list(enumerate(values))
        assert {r["topic"] for r in rows} == {"s"}
        assert {r["timestampType"] for r in rows} == {1}
        # a capped batch: admission over partitions, every partition gets its part
        capped = await asyncio.to_thread(r.latestOffset, initial, ReadMaxRows(150))
        assert sum(capped["s"].values()) == 150
        assert all(49 <= n <= 51 for n in capped["s"].values()), capped  # thirds of floats
        # the next batch from there; committed blocks leave every holder
        await asyncio.to_thread(r.commit, end)
        for i, server in servers.items():
            assert server.store.blocks("s") == [], f"node {i} kept committed blocks"
        assert await asyncio.to_thread(r.latestOffset, end, ReadAllAvailable()) == end


async def test_a_new_partition_starts_at_record_zero_and_an_idle_one_adds_no_offset(tmp_path: Path) -> None:
    clusters = loopback_cluster(2)
    async with nodes(tmp_path, clusters) as servers:
        await push(servers[0].target, 10, "a")
        r = reader(clusters)
        start = {"s": {"0": 10}}  # the query saw only node 0's partition so far
        assert plain(await asyncio.to_thread(r.latestOffset, start, ReadAllAvailable())) == start
        await push(servers[1].target, 5, "b")
        end = await asyncio.to_thread(r.latestOffset, start, ReadAllAvailable())
        assert plain(end) == {"s": {"0": 10, "1": 5}}
        parts = await asyncio.to_thread(r.partitions, start, end)
        table = await asyncio.to_thread(read_all, r, list(parts))
        assert table.column("value").to_pylist() == [f"b{i}".encode() for i in range(5)]
        assert table.column("offset").to_pylist() == list(range(5))


async def test_a_query_starts_at_its_starting_offsets_and_plans_nothing_while_held(tmp_path: Path) -> None:
    """A pipeline swap on a cluster's driver: the new query starts where the old one's commits end
    (startingOffsets), and while the driver's rate server holds batches the old one plans none."""
    clusters = loopback_cluster(2)
    async with nodes(tmp_path, clusters) as servers:
        await push(servers[0].target, 10, "a")
        await push(servers[1].target, 4, "b")
        r = reader(clusters, startingOffsets='{"s/0": 7}')
        assert plain(await asyncio.to_thread(r.initialOffset)) == {"s": {"0": 7, "1": 0}}
        # a node's rate server stands in for the driver's: it serves RateStatus.hold_batches
        held = reader(clusters, rateTarget=servers[0].target)
        start = {"s": {"0": 2}}
        assert plain(await asyncio.to_thread(held.latestOffset, start, ReadAllAvailable())) == {
            "s": {"0": 10, "1": 4}
        }
        servers[0].hold_batches = True
        assert plain(await asyncio.to_thread(held.latestOffset, start, ReadAllAvailable())) == start
        servers[0].hold_batches = False
        assert plain(await asyncio.to_thread(held.latestOffset, start, ReadAllAvailable())) == {
            "s": {"0": 10, "1": 4}
        }


async def test_the_driver_tells_a_swapped_in_query_whether_records_wait(tmp_path: Path) -> None:
    """ClusterDriver.unread (the pipeline manager's idle check): past the given offsets, or past a
    partition's first record still held; with no node answering it cannot tell, so records may wait."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    clusters = loopback_cluster(2)
    async with nodes(tmp_path, clusters) as servers:
        await push(servers[0].target, 10, "a")
        targets = {n.id: n.target for n in clusters[0].nodes}
        driver = ClusterDriver(DriverConfig(nodes=targets, streams=("s",), data_dir=tmp_path / "d"))
        try:
            assert await asyncio.to_thread(driver.unread, {"s/0": 10}) is False  # node 1 holds nothing
            assert await asyncio.to_thread(driver.unread, {"s/0": 4}) is True
            assert await asyncio.to_thread(driver.unread, {}) is True  # from the first record held
        finally:
            driver.blocks.close()
    gone = ClusterDriver(DriverConfig(nodes=targets, streams=("s",), data_dir=tmp_path / "d"))
    try:
        assert await asyncio.to_thread(gone.unread, {"s/0": 10}) is True  # no node answers
    finally:
        gone.blocks.close()


async def test_a_new_drivers_node_backlog_leaves_out_what_was_released_before_its_first_batch(
    tmp_path: Path,
) -> None:
    """A driver that has not seen a batch yet (a restart, an idle cluster: no batch runs while no
    record comes) took Spark's commit as offset 0 and counted every record a node ever took: node 0,
    30 records all read and released, showed a backlog of 30 (sluice_node_backlog_records; the brake
    once records come) until the first batch. Now what its holders still serve: 0, then 5 for 5 new."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    clusters = loopback_cluster(2)
    async with nodes(tmp_path, clusters) as servers:
        await push(servers[0].target, 30, "a")
        targets = {n.id: n.target for n in clusters[0].nodes}
        driver = ClusterDriver(DriverConfig(nodes=targets, streams=("s",), data_dir=tmp_path / "d"))
        watch = asyncio.create_task(driver._watch_backlog())
        try:
            await wait_until(lambda: driver.backlog()[0] == 30, 15)
            await asyncio.to_thread(driver.release, {"s/0": 30})  # an earlier driver read them
            await asyncio.sleep(1.5)  # its next look at the nodes
            assert driver.backlog() == {0: 0, 1: 0}  # was {0: 30, 1: 0}
            await push(servers[0].target, 5, "b")
            await wait_until(lambda: driver.backlog()[0] == 5, 15)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            driver.blocks.close()


async def test_a_holder_that_is_down_is_skipped_for_its_copy(tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=2)  # acked: on both
    async with nodes(tmp_path, clusters) as servers:
        values = await push(servers[0].target, 200, "v")
        r = reader(clusters)
        initial = await asyncio.to_thread(r.initialOffset)
        planned = await asyncio.to_thread(r.partitions, initial, {"s": {"0": 200}})
        assert [n for n, _ in planned[0].spec.targets] == [0, 1]
        await servers[0].stop(grace=1)  # the owner dies after the batch was planned
        table = await asyncio.to_thread(read_all, r, list(planned))
        assert table.column("value").to_pylist() == values
        assert set(table.column("partition").to_pylist()) == {0}
        # planning goes on without it: its partition is read from node 1's copy
        started = time.monotonic()
        end = await asyncio.to_thread(r.latestOffset, initial, ReadAllAvailable())
        assert time.monotonic() - started < 10
        assert end["s"]["0"] == 200
        parts = await asyncio.to_thread(r.partitions, initial, end)
        assert [n for n, _ in parts[0].spec.targets] == [1]


async def test_a_receivers_list_that_disagrees_with_the_nodes_ids_is_refused_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The source took each node's answer as it came: a list naming one node's address twice read that
    node's partitions and never another's (its acked records left unread, not a word), and a list with
    two ids swapped sent every read to a node that does not hold the range. A node's answer names its
    id: a list that disagrees stops planning, and the driver's start, with both ids and the address. So
    does an address that serves no Blocks (a single `sluice serve`): before, a WARNING at each plan said
    its partitions were read from their copies, and the query went on reading nothing of it. And a list
    that lacks a node of the nodes' own (a node added to the cluster, the driver's file not changed):
    under replication 1 its partitions were never read, without a word."""
    clusters = loopback_cluster(3)
    async with (
        nodes(tmp_path, clusters) as servers,
        running_server(tmp_path / "single", "s") as single,
    ):
        for node_id, server in servers.items():
            await push(server.target, 10, f"n{node_id}")
        a, b, c = (cluster.me.target for cluster in clusters)
        again = a.replace("127.0.0.1", "localhost")  # node 0 by another name
        for listed, words in (
            ({0: a, 1: b, 2: again}, f"{again}, listed as node 2, is node 0"),
            ({0: b, 1: a, 2: c}, f"{b}, listed as node 0, is node 1; {a}, listed as node 1, is node 0"),
            ({0: a, 1: b, 2: single.target}, f"{single.target}, listed as node 2, serves no Blocks"),
            ({0: a, 1: b}, f"node 0 ({a}) has node(s) 2 in its own node list, and this list does not"),
        ):
            receivers = ",".join(f"{n}={t}" for n, t in listed.items())
            r = ClusterStreamReader({"receivers": receivers, "streams": "s"})
            with pytest.raises(NodeListError) as caught:
                await asyncio.to_thread(r.initialOffset)
            assert words in str(caught.value), caught.value
            assert "--node-id" in str(caught.value)
        # the list as the nodes have it plans every node's partition
        initial = await asyncio.to_thread(reader(clusters).initialOffset)
        assert plain(initial) == {"s": {"0": 0, "1": 0, "2": 0}}
        # the driver stops at its start with one line, before its query would need Spark
        from ingest.cluster_driver import ClusterDriver, _run
        from ingest.driver_config import DriverConfig

        config = DriverConfig(nodes={0: a, 1: b}, streams=("s",), data_dir=tmp_path / "driver")
        no_spark = types.SimpleNamespace(stop=lambda: None)
        assert await _run(ClusterDriver(config), asyncio.Event(), lambda: no_spark) == 1
        said = capsys.readouterr().err
        assert "cannot start the driver: sluice source: the receivers list disagrees" in said, said
        assert "has node(s) 2 in its own node list" in said and "Traceback" not in said, said


async def test_a_running_driver_stops_in_one_line_when_a_node_lists_an_id_its_nodes_lack(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """While the driver runs, a node starts listing a node id its --nodes lacks (a node added to the
    cluster, the driver's file not changed): it stops (exit 1) naming the node and the id, within its
    backlog watch's second, in one line. Carrying on with the known nodes would leave that node's
    partitions unread and its blocks unreleased without a word; before, the watch logged it and the
    driver ran on until the query's next plan failed with it inside Spark's traceback."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    clusters = loopback_cluster(3)
    async with nodes(tmp_path, clusters):
        a, b = clusters[0].me.target, clusters[1].me.target
        config = DriverConfig(nodes={0: a, 1: b}, streams=("s",), data_dir=tmp_path / "driver")
        driver = ClusterDriver(config)
        try:
            assert driver.error() is None
            await asyncio.wait_for(driver._watch_backlog(), 10)  # it returns: nothing more to watch
            error = driver.error()
            assert error is not None
            assert f"node 0 ({a}) has node(s) 2 in its own node list, and this list does not" in error
            assert "Correct the list (the driver's --nodes file" in error
            assert [r.levelname for r in caplog.records if "has node(s) 2" in r.getMessage()] == ["ERROR"]
        finally:
            driver.blocks.close()


async def test_no_holder_serving_the_range_names_every_holders_error(tmp_path: Path) -> None:
    clusters = loopback_cluster(1)
    dead = f"127.0.0.1:{free_ports(1)[0]}"
    async with nodes(tmp_path, clusters) as servers:
        await push(servers[0].target, 10, "v")
        spec = RangeSpec("s", 0, 5, 20, ((3, dead), (0, clusters[0].me.target)))

        def read() -> list[pa.RecordBatch]:
            return list(read_range(spec, Credentials(), timeout=5))

        with pytest.raises(PartitionUnreadableError) as caught:
            await asyncio.to_thread(read)
        message = str(caught.value)
        assert "'s'/0" in message and "5..19" in message
        assert f"node 3 ({dead}): UNAVAILABLE" in message
        assert "node 0" in message and "FAILED_PRECONDITION" in message


# ---- a streaming query -------------------------------------------------------------------------


@pytest.mark.spark
async def test_a_query_over_the_cluster_reads_every_record_once(spark: Any, tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=2)
    async with nodes(tmp_path, clusters, "s", "t") as servers:
        df = (
            spark.readStream.format("sluice")
            .option("receivers", receivers_option(clusters))
            .option("streams", "s,t")
            .option("maxRecordsPerBatch", "700")
            .load()
        )
        sink = tmp_path / "sink"
        query = await asyncio.to_thread(
            lambda: (
                df.writeStream.format("parquet")
                .option("path", str(sink))
                .option("checkpointLocation", str(tmp_path / "checkpoint"))
                .trigger(processingTime="200 milliseconds")
                .start()
            )
        )
        try:
            sent = set()
            for i, (stream, n) in enumerate((("s", 1000), ("t", 500))):
                for node in (0, 1):
                    values = await push(servers[node].target, n, f"{stream}{node}-{i}", stream)
                    sent |= {(stream, node, v) for v in values}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert query.exception() is None, query.exception()
                progress = query.lastProgress
                if progress and sum(p["numInputRows"] for p in query.recentProgress) >= len(sent):
                    break
                await asyncio.sleep(0.5)
            await asyncio.to_thread(query.processAllAvailable)
        finally:
            await asyncio.to_thread(query.stop)
        rows = await asyncio.to_thread(
            lambda: spark.read.parquet(str(sink)).select("topic", "partition", "offset", "value").collect()
        )
        got = [(r["topic"], r["partition"], bytes(r["value"])) for r in rows]
        assert len(got) == len(sent)
        assert set(got) == sent
        assert len({(r["topic"], r["partition"], r["offset"]) for r in rows}) == len(rows)


async def test_one_driver_holds_the_nodes_until_its_lease_lapses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two drivers over one cluster (another data dir, started by mistake) each released what the other
    had not read: each sink missed records. The nodes now take one driver's ListPartitions and
    ReleaseBlocks, until it has not called for the lease's length."""
    from ingest.cluster_driver import driver_id
    from receivers import blocks_service

    monkeypatch.setattr(blocks_service, "DRIVER_LEASE", 1.5)
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters):
        targets = {n.id: n.target for n in clusters[0].nodes}
        first_id = driver_id(tmp_path / "first")
        assert driver_id(tmp_path / "first") == first_id  # kept: a restarted driver is the same one
        first = BlocksClient(targets, Credentials(), driver_id=first_id)
        second = BlocksClient(targets, Credentials(), driver_id=driver_id(tmp_path / "second"))
        anyone = BlocksClient(targets, Credentials())  # `sluice status`, a peer: no driver named
        dead = f"127.0.0.1:{free_ports(1)[0]}"  # drivers that reach one node of the two
        only_node_0 = BlocksClient({0: targets[0], 1: dead}, Credentials(), driver_id="0" * 32)
        only_node_1 = BlocksClient({0: dead, 1: targets[1]}, Credentials(), driver_id="1" * 32)
        try:
            # refused by one node, a driver gives back what the others granted: it would lock the one
            # running out of them (both down)
            await asyncio.to_thread(only_node_0.view, ["s"], seal=False)
            with pytest.raises(DriverFencedError):
                await asyncio.to_thread(first.view, ["s"], seal=False)
            await asyncio.to_thread(only_node_1.view, ["s"], seal=False)  # node 1 was given back
            for client in (only_node_0, only_node_1):  # a stopping driver gives its leases back
                await asyncio.to_thread(client.give_back)
            first.fenced = None
            await asyncio.to_thread(first.view, ["s"], seal=False)
            with pytest.raises(DriverFencedError) as held:
                await asyncio.to_thread(second.view, ["s"], seal=False)
            for node in (0, 1):
                assert f"node {node} is consumed by another driver" in str(held.value), held.value
            assert "FAILED_PRECONDITION" in str(held.value) and first_id[:12] in str(held.value)
            with pytest.raises(grpc.RpcError) as release:  # its release is refused as well
                await asyncio.to_thread(second._release, 0, "s", 0, 0, 5)
            assert release.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
            await asyncio.to_thread(anyone.view, ["s"], seal=False)
            for _ in range(3):  # the holder's calls renew its lease past its length
                await asyncio.sleep(0.75)
                await asyncio.to_thread(first.release, {"s": {"0": 0}})
                assert first.fenced is None
            with pytest.raises(DriverFencedError):
                await asyncio.to_thread(second.view, ["s"], seal=False)
            # the first stops calling: after the lease the second takes over, and the first is refused
            await asyncio.sleep(1.7)
            second.fenced = None
            await asyncio.to_thread(second.view, ["s"], seal=False)
            await asyncio.to_thread(first.release, {"s": {"0": 0}})
            assert first.fenced is not None and "another driver" in first.fenced, first.fenced
        finally:
            for client in (first, second, anyone, only_node_0, only_node_1):
                client.close()


# ---- the driver: committed cluster offsets released on every node -------------------------------


def blocks_held(server: SluiceServer) -> int:
    """Blocks of stream s a node holds: its own and its copies of other nodes'."""
    node = server.node
    assert node is not None
    copies = sum(len(node.replicas.store(o).blocks("s")) for o in node.replicas.owners())
    return len(server.store.blocks("s")) + copies


def test_last_commit_reads_the_cluster_sources_nested_offset(tmp_path: Path) -> None:
    from ingest.driver import _sluice_offset, last_commit

    (tmp_path / "commits").mkdir()
    (tmp_path / "offsets").mkdir()
    (tmp_path / "commits" / "3").write_text("v1\n{}\n")
    (tmp_path / "offsets" / "3").write_text('v1\n{"batchWatermarkMs":0}\n{"s":{"0":12,"10":4},"t":{"1":7}}\n')
    assert last_commit(tmp_path, ["s", "t"]) == (3, {"s/0": 12, "s/10": 4, "t/1": 7})
    assert _sluice_offset({"s/0": 5, "t/2": 1}, ["s", "t"]) == {"s/0": 5, "t/2": 1}  # the listener's
    assert _sluice_offset({"s": 5}, ["s"]) == {"s": 5}  # the single-node source's, as before
    assert _sluice_offset({"x/0": 5}, ["s"]) is None  # another source's
    assert _sluice_offset({"topic": {"0": 5}}, ["s"]) is None  # Kafka's


@pytest.mark.spark
async def test_the_cluster_driver_runs_the_query_and_releases_on_every_node(
    spark: Any, tmp_path: Path
) -> None:
    from ingest.cluster_driver import ClusterDriver
    from ingest.config import RateConfig
    from ingest.driver_config import DriverConfig
    from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters) as servers:
        config = DriverConfig(
            nodes={n.id: n.target for n in clusters[0].nodes},
            streams=("s",),
            data_dir=tmp_path / "driver",
            trigger_interval=0.5,
            rate=RateConfig(estimator="fixed", initial_rate=100_000.0),
            metrics_port=0,
            health_port=0,
        )
        driver = ClusterDriver(config)
        await driver.start(spark)
        try:
            # a second driver (another data dir) over the same nodes stops before it starts anything
            second = ClusterDriver(
                dataclasses.replace(config, data_dir=tmp_path / "second", metrics_port=None)
            )
            with pytest.raises(DriverFencedError, match="consumed by another driver"):
                await second.start(spark)
            second.blocks.close()
            assert second.spark_driver is None and second.rate_target is None
            sent = {v for i in (0, 1) for v in await push(servers[i].target, 400, f"n{i}-")}
            sink = config.serve_config().sink_dir
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert driver.error() is None, driver.error()
                if (driver.spark_driver and driver.spark_driver.records_processed) == len(sent):
                    break
                await asyncio.sleep(0.5)
            rows = await asyncio.to_thread(lambda: spark.read.parquet(str(sink)).select("value").collect())
            assert sorted(bytes(r["value"]) for r in rows) == sorted(sent)
            # the batch's progress event released its blocks on both holders of both partitions,
            # with no later batch to commit it
            deadline = time.monotonic() + 30
            while any(blocks_held(s) for s in servers.values()):
                assert time.monotonic() < deadline, "committed blocks were not released"
                await asyncio.sleep(0.2)
            # the driver's own rate server: the source's rateTarget, with the node table
            async with grpc.aio.insecure_channel(driver.rate_target or "") as channel:
                status = await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest())
            assert {n.node_id for n in status.nodes} == {0, 1}
            # `sluice status` on the driver: its pipeline and the nodes' table (no streams of its own)
            shown = await status_cli("--target", driver.rate_target or "", token=None)
            assert shown.returncode == 0, shown.stderr
            assert "receiver nodes" in shown.stdout and "built-in Parquet sink" in shown.stdout, shown.stdout
            for node in clusters[0].nodes:
                assert node.target in shown.stdout, shown.stdout
            assert "100,000 rec/s" in shown.stdout and "sessions" not in shown.stdout, shown.stdout
            # a push aimed at the driver by mistake is told where to go; the driver refuses before it
            # reads anything, so no Open is written: a write racing that refusal can end the call
            # INTERNAL "Internal error from Core" on the client instead (grpc/grpc#36066)
            async with grpc.aio.insecure_channel(driver.rate_target or "") as channel:
                call = pb_grpc.IngestStub(channel).Publish()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call.read()
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
            assert "publish to the receiver nodes" in (refused.value.details() or "")
            await asyncio.sleep(1.5)  # a look at the nodes after the release
            assert driver.backlog() == {0: 0, 1: 0}
            # /metrics: each node's share, up and backlog; the global rate; the batches
            url = f"http://127.0.0.1:{driver.metrics_port}/metrics"
            page = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read().decode())
            for node in (0, 1):
                assert f'sluice_node_up{{node="{node}"}} 1.0' in page
                assert f'sluice_node_backlog_records{{node="{node}"}} 0.0' in page
                assert f'sluice_node_rate_records_per_second{{node="{node}"}}' in page
            assert "sluice_cluster_rate_records_per_second 100000.0" in page
            assert "sluice_batches_completed_total" in page
            # grpc.health.v1 on the rate server and on the plaintext health port: SERVING while it runs
            for target in (driver.rate_target or "", f"127.0.0.1:{driver.health_port}"):
                async with grpc.aio.insecure_channel(target) as channel:
                    check = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
                assert check.status == health_pb2.HealthCheckResponse.SERVING, target
        finally:
            await driver.stop()


def test_the_listener_reports_cluster_offsets_per_partition() -> None:
    from types import SimpleNamespace

    from ingest.spark.listener import _source_offset

    progress = SimpleNamespace(sources=[SimpleNamespace(endOffset='{"s":{"0":12,"1":4}}')])
    assert _source_offset(progress, "endOffset") == {"s/0": 12, "s/1": 4}
    progress = SimpleNamespace(sources=[SimpleNamespace(endOffset='{"s":12}')])
    assert _source_offset(progress, "endOffset") == {"s": 12}


async def test_credentials_serve_every_call_and_a_refusal_is_clear(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ingest.config import SecurityConfig
    from ingest.spark.cluster_source import ClusterRefusedError
    from receivers.auth import new_token, token_hash

    tokens = {name: new_token() for name in ("pipeline", "app", "watcher")}
    auth = tmp_path / "auth.toml"
    auth.write_text(
        "".join(
            f'[principals.{name}]\nroles = {roles}\ntoken_sha256 = ["{token_hash(tokens[name])}"]\n\n'
            for name, roles in (
                ("pipeline", '["consumer", "operator"]'),
                ("app", '["producer"]\nstreams = ["s"]'),
                ("watcher", '["consumer"]'),
            )
        )
    )
    files = {}
    for name, token in tokens.items():
        files[name] = tmp_path / f"{name}.token"
        files[name].write_text(token + "\n")
    clusters = loopback_cluster(1)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    security = SecurityConfig(auth_file=auth)
    async with running_server(
        tmp_path / "node0", "s", cluster=clusters[0], port=port, security=security
    ) as server:
        values = [f"v{i}".encode() for i in range(50)]
        credentials = Credentials(token=tokens["app"])
        async with Producer(clusters[0].me.target, "s", linger=0, credentials=credentials) as producer:
            await producer.send_many(values)
            await producer.flush(timeout=30)
        r = reader(clusters, rateTokenFile=str(files["pipeline"]))
        end = await asyncio.to_thread(r.latestOffset, {"s": {"0": 0}}, ReadAllAvailable())
        assert plain(end) == {"s": {"0": 50}}
        parts = await asyncio.to_thread(r.partitions, {"s": {"0": 0}}, end)
        table = await asyncio.to_thread(read_all, r, list(parts))
        assert table.column("value").to_pylist() == values
        # a consumer without the operator role reads, and its release is refused: logged, not raised
        watcher = reader(clusters, rateTokenFile=str(files["watcher"]))
        await asyncio.to_thread(watcher.commit, end)
        assert "cannot release partition s/0 below 50 on node 0 (PERMISSION_DENIED" in caplog.text
        assert server.store.blocks("s")
        await asyncio.to_thread(r.commit, end)
        assert server.store.blocks("s") == []
        # no token: every node refuses, and planning says so instead of finding nothing for ever
        with pytest.raises(ClusterRefusedError, match="UNAUTHENTICATED") as caught:
            await asyncio.to_thread(reader(clusters).latestOffset, {"s": {"0": 50}}, ReadAllAvailable())
        assert "consumer and operator roles" in str(caught.value)


async def test_a_block_over_grpcs_default_4_mib_is_read(tmp_path: Path) -> None:
    clusters = loopback_cluster(1)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    node = tmp_path / "n0"
    async with running_server(node, "s", cluster=clusters[0], port=port, block_interval=2.0) as server:
        values = [f"{i:08d}".encode() * 40 for i in range(20_000)]  # 6.4 MB within one block interval
        async with Producer(server.target, "s", batch_size=2_000, linger=0) as producer:
            await producer.send_many(values)
            await producer.flush(timeout=60)
        assert max(b.count for b in server.store.blocks("s")) * 320 > 4 * 2**20
        spec = RangeSpec("s", 0, 0, len(values), ((0, server.target),))
        batches = await asyncio.to_thread(lambda: list(read_range(spec, Credentials())))
        table = pa.Table.from_batches(batches, schema=ARROW_SCHEMA)
        assert table.column("value").to_pylist() == values


async def test_run_driver_refuses_bad_files_before_starting_spark(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ingest.cluster_driver import run_driver
    from ingest.driver_config import DriverConfig

    missing = tmp_path / "nope.token"
    config = DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), data_dir=tmp_path, token_file=missing)
    assert await run_driver(config) == 2
    assert str(missing) in capsys.readouterr().err
    bad_auth = tmp_path / "auth.toml"
    bad_auth.write_text("[principals.x]\nroles = []\n")
    assert await run_driver(DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), auth_file=bad_auth)) == 2
    assert "roles is empty" in capsys.readouterr().err
    with pytest.raises(ValueError, match="receiver nodes"):
        DriverConfig(nodes={}, streams=("s",))


@pytest.mark.spark
async def test_a_query_reads_a_dead_nodes_partition_from_its_copy(spark: Any, tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters) as servers:
        sent = {(i, v) for i in (0, 1) for v in await push(servers[i].target, 300, f"n{i}-")}
        await servers[0].stop(grace=1)  # node 0's records live on in node 1's copy
        df = (
            spark.readStream.format("sluice")
            .option("receivers", receivers_option(clusters))
            .option("streams", "s")
            .load()
        )
        query = await asyncio.to_thread(
            lambda: df.writeStream.format("memory").queryName("dead_node").trigger(availableNow=True).start()
        )
        try:
            await asyncio.to_thread(query.awaitTermination, 120)
            assert query.exception() is None, query.exception()
            rows = await asyncio.to_thread(spark.sql("select partition, value from dead_node").collect)
        finally:
            await asyncio.to_thread(query.stop)
        got = [(r["partition"], bytes(r["value"])) for r in rows]
        assert len(got) == len(sent) and set(got) == sent


async def test_a_query_never_starts_past_records_only_a_down_copy_holds_after_an_owners_lost_log(
    tmp_path: Path,
) -> None:
    """Node 0's log is lost (an empty data dir): it goes on past its copy on node 1. It counted what it
    skipped as released, so with node 1 down, a query without a checkpoint (a new driver) started node
    0's partition at the skip, past 100 acked records only node 1 held, and its releases would have
    deleted them there. The skip now counts as read only what the copies released: the query starts
    at record 0, says no holder serves those records while node 1 is down (naming it), and reads them
    once it is back; what Spark did read stays released, so a start after that does not wait for it."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    async with contextlib.AsyncExitStack() as outer:
        stacks = {i: await outer.enter_async_context(contextlib.AsyncExitStack()) for i in range(2)}

        async def start(i: int, folder: str) -> SluiceServer:
            return await stacks[i].enter_async_context(
                running_server(tmp_path / folder, "s", cluster=clusters[i], port=port[i])
            )

        servers = {i: await start(i, f"node{i}") for i in range(2)}
        owner = servers[0].node
        assert owner is not None
        await asyncio.wait_for(_in_sync(owner), 20)
        sent = await push(clusters[0].me.target, 100, "a")  # on node 0 and its copy on node 1
        await stacks[0].aclose()
        servers[0] = await start(0, "node0-lost")  # node 0's log lost: it goes on past node 1's copy
        assert servers[0].receivers["s"].log_end[1] == 100
        sent += await push(clusters[0].me.target, 10, "c")  # on both (min-insync 2)
        await stacks[1].aclose()  # node 1, the only holder of records 0..99, is down
        r = reader(clusters)
        initial = await asyncio.to_thread(r.initialOffset)
        # not 100: nothing was read (node 1's own, empty partition is listed when its copy on node 0
        # was set up before node 1 went down, a race under load)
        ours = plain(initial)["s"]
        assert ours["0"] == 0 and set(ours) <= {"0", "1"} and set(ours.values()) == {0}
        end = await asyncio.to_thread(r.latestOffset, initial, ReadAllAvailable())
        assert plain(end)["s"] == {**ours, "0": 110}
        parts = list(await asyncio.to_thread(r.partitions, initial, end))
        with pytest.raises(PartitionUnreadableError) as caught:
            await asyncio.to_thread(read_all, r, parts)
        assert f"node 1 ({clusters[1].me.target}): UNAVAILABLE" in str(caught.value)
        servers[1] = await start(1, "node1")  # back: the batch reads every record, once
        table = await asyncio.to_thread(read_all, r, parts)
        assert table.column("value").to_pylist() == sent
        assert table.column("offset").to_pylist() == list(range(110))
        for node in clusters[0].nodes:  # Spark committed them: the driver releases them on every node
            async with grpc.aio.insecure_channel(node.target) as channel:
                request = pb.ReleaseBlocksRequest(stream="s", owner=0, before_offset=110)
                await pb_grpc.BlocksStub(channel).ReleaseBlocks(request)
        await stacks[1].aclose()
        fresh = reader(clusters)
        assert (await asyncio.to_thread(fresh.initialOffset))["s"]["0"] == 110  # read: not waited for
        # node 0's log lost again, once everything was read: it counts the skip as read (node 1's
        # releases say so), and a new query starts past it without node 1
        servers[1] = await start(1, "node1")
        await stacks[0].aclose()
        servers[0] = await start(0, "node0-lost-again")
        assert servers[0].receivers["s"].log_end[1] == 110
        await stacks[1].aclose()
        fresh = reader(clusters)
        assert (await asyncio.to_thread(fresh.initialOffset))["s"]["0"] == 110


async def _in_sync(node: Any) -> None:
    while not node.replicator.in_sync():
        await asyncio.sleep(0.01)


async def test_a_query_starts_past_what_was_released_though_a_lagging_copy_kept_it(tmp_path: Path) -> None:
    """Node 1 was down while the driver read and released node 0's records 0..199; back, its copy goes
    on after the gap and keeps records 0..99 (receivers.replica_store: it cannot tell a release from a
    lost log). A query without a checkpoint started at its lowest start, 0, and its first batch failed
    at the gap (no holder has 100..199), at every start, with nothing to release node 1's copy: a new
    driver could not start. No partition starts below where a holder's releases end (Spark read it)."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    async with contextlib.AsyncExitStack() as outer:
        stacks = {i: await outer.enter_async_context(contextlib.AsyncExitStack()) for i in range(2)}

        async def start(i: int) -> SluiceServer:
            return await stacks[i].enter_async_context(
                running_server(tmp_path / f"node{i}", "s", cluster=clusters[i], port=port[i])
            )

        servers = {i: await start(i) for i in range(2)}
        owner = servers[0].node
        assert owner is not None
        await asyncio.wait_for(_in_sync(owner), 20)
        await push(clusters[0].me.target, 100, "a")  # on both
        await stacks[1].aclose()
        await push(clusters[0].me.target, 100, "b")  # on node 0 alone (min-insync 1)
        async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:  # the driver read 0..199
            request = pb.ReleaseBlocksRequest(stream="s", owner=0, before_offset=200)
            await pb_grpc.BlocksStub(channel).ReleaseBlocks(request)
        sent = await push(clusters[0].me.target, 10, "c")
        servers[1] = await start(1)  # catches up after the gap, keeping records 0..99
        follower = servers[1].node
        assert follower is not None
        await wait_until(lambda: follower.replicas.committed(0, "s") == owner.local.durable_seq("s"), 20)
        assert follower.replicas.blocks(0, "s")[0].first_offset == 0  # kept
        r = reader(clusters)
        initial = await asyncio.to_thread(r.initialOffset)
        assert initial["s"]["0"] == 200
        end = await asyncio.to_thread(r.latestOffset, initial, ReadAllAvailable())
        parts = list(await asyncio.to_thread(r.partitions, initial, {"s": {"0": end["s"]["0"]}}))
        table = await asyncio.to_thread(read_all, r, parts)
        assert table.column("value").to_pylist() == sent


async def test_tasks_after_one_that_could_not_reach_a_holder_go_to_its_copies_first(tmp_path: Path) -> None:
    """A holder that accepts connections and answers nothing (a hung node, a host cut off) cost every
    read task gRPC's connect deadline, 20 s, before the task went to the copy: a batch of N tasks on
    one executor, N x 20 s. Now the first pays CONNECT_TIMEOUT (5 s) and the next tasks of the process
    try that holder last for UNREACHABLE_SECONDS, so they read from the copy at once."""
    import socket

    from ingest.spark import cluster_source

    clusters = loopback_cluster(1)
    hung = socket.socket()  # listens, never accepts nor answers: the kernel completes the TCP handshake
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    silent = f"127.0.0.1:{hung.getsockname()[1]}"
    cluster_source._unreachable.clear()
    try:
        async with nodes(tmp_path, clusters) as servers:
            values = await push(servers[0].target, 120, "v")
            live = clusters[0].me.target
            specs = [RangeSpec("s", 0, lo, lo + 20, ((7, silent), (0, live))) for lo in range(0, 120, 20)]

            def read_each() -> tuple[list[bytes], list[float]]:
                got, took = [], []
                for spec in specs:  # one executor's worker runs its tasks one after another
                    started = time.monotonic()
                    table = pa.Table.from_batches(list(read_range(spec, Credentials())), schema=ARROW_SCHEMA)
                    took.append(time.monotonic() - started)
                    got += table.column("value").to_pylist()
                return got, took

            got, took = await asyncio.to_thread(read_each)
    finally:
        hung.close()
        cluster_source._unreachable.clear()
    assert got == values
    # six tasks: before, 6 x 20 s; now one connect timeout, then the copy at once (generous bounds)
    assert took[0] < cluster_source.CONNECT_TIMEOUT + 10, took
    assert sum(took[1:]) < 5, took
    assert sum(took) < 2 * cluster_source.CONNECT_TIMEOUT + 10, took


async def test_a_holder_found_unreachable_is_tried_still_and_soon_first_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note that a holder was unreachable only orders the holders: a node back on its port serves
    a task at once when no other holder can, and after UNREACHABLE_SECONDS it comes first again."""
    from ingest.spark import cluster_source

    monkeypatch.setattr(cluster_source, "UNREACHABLE_SECONDS", 0.5)
    cluster_source._unreachable.clear()
    clusters = loopback_cluster(1)
    target = clusters[0].me.target
    spec = RangeSpec("s", 0, 0, 30, ((0, target),))
    try:
        async with nodes(tmp_path, clusters) as servers:
            values = await push(servers[0].target, 30, "v")
        # the node is down: the task fails, and the node is noted as unreachable
        with pytest.raises(PartitionUnreadableError):
            await asyncio.to_thread(lambda: list(read_range(spec, Credentials())))
        assert target in cluster_source._unreachable
        other = ((5, "127.0.0.1:1"), (0, target))
        assert cluster_source._in_reach_first(((0, target), (5, "127.0.0.1:1"))) == list(other)
        async with nodes(tmp_path, clusters):  # back on its port, with its log: read at once
            batches = await asyncio.to_thread(lambda: list(read_range(spec, Credentials())))
        got = pa.Table.from_batches(batches, schema=ARROW_SCHEMA).column("value").to_pylist()
        assert got == values
        assert target not in cluster_source._unreachable  # it answered: first again
        cluster_source._note_unreachable(target)
        await asyncio.sleep(0.6)
        assert cluster_source._in_reach_first(((0, target), (5, "127.0.0.1:1")))[0] == (0, target)
    finally:
        cluster_source._unreachable.clear()
