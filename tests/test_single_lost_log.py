"""A single server's block log lost (or replaced) under a query's surviving checkpoint: real server, real
Spark query, real files. The checkpoint is the pipeline's own, outside the data dir, as a pipeline that
sets checkpointLocation has it."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver
from ingest.server import SluiceServer
from ingest.spark.source import INCARNATIONS, DataLossError
from receivers.config import FsyncPolicy, ReceiverConfig
from receivers.wal import INCARNATION_FILE, IncarnationError, WalBlockStore, valid_incarnation
from sluice_client import Producer
from tests.test_spark_source import reader_for, rows_of, write_blocks


def sink_offsets(spark: Any, sink: Path) -> list[tuple[int, bytes]]:
    from pyspark.errors import AnalysisException

    try:
        rows = spark.read.parquet(str(sink)).select("offset", "value").collect()
    except AnalysisException:  # no batch committed yet
        return []
    return sorted((r["offset"], bytes(r["value"])) for r in rows)


async def push(server: SluiceServer, values: list[bytes]) -> None:
    async with Producer(server.target, "events", batch_size=10) as producer:
        await producer.send_many(values)
        await producer.flush(timeout=60)
        assert producer.acked == len(values)


async def wait_for(condition: Any, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.5)


@pytest.mark.spark
async def test_a_lost_data_dir_under_a_surviving_checkpoint_is_data_loss(spark: Any, tmp_path: Path) -> None:
    """The data dir is wiped while the pipeline's checkpoint (elsewhere) survives: the new log numbers
    its records from 0 again. The query used to go on from the checkpoint's offset: the new log's first
    records (below it) were skipped without a word, and released unread. Now the log's incarnation in
    the offsets tells the logs apart: the query stops with DataLossError naming the way on, nothing of
    the new log is released, and with fail_on_data_loss=False (`--no-fail-on-data-loss`) the query
    reads the new log from its start."""
    data, sink, checkpoint = tmp_path / "data", tmp_path / "sink", tmp_path / "checkpoint"

    def pipeline(df: Any) -> Any:
        return (
            df.writeStream.format("parquet")
            .outputMode("append")
            .option("path", str(sink))
            .option("checkpointLocation", str(checkpoint))
        )

    def config(*, fail_on_data_loss: bool = True) -> ServeConfig:
        return ServeConfig(
            port=0,
            metrics_port=None,
            data_dir=data,
            streams=("events",),
            receiver=ReceiverConfig(block_interval=0.05, block_records=10),
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),
            trigger_interval=0.3,
            fail_on_data_loss=fail_on_data_loss,
        )

    async def run(values: list[bytes], until: Any, *, fail_on_data_loss: bool = True) -> str | None:
        """Serve, push `values`, run the query until `until`; why the query died (None: it runs)."""
        server = SluiceServer(config(fail_on_data_loss=fail_on_data_loss))
        await server.start()
        driver = SparkDriver(spark, server.config, pipeline, query_name=f"lost_log_{len(values)}")
        try:
            if values:
                await push(server, values)
            await asyncio.to_thread(driver.start)
            await wait_for(lambda: until(driver, server), "the query")
            await asyncio.sleep(1.0)  # a batch past the first one would show in the sink
            return driver.error()
        finally:
            await asyncio.to_thread(driver.stop)
            await server.stop(grace=1)

    first = [f"first-{i}".encode() for i in range(30)]
    await run(first, lambda d, s: len(sink_offsets(spark, sink)) >= 30 or d.error() is not None)
    assert sink_offsets(spark, sink) == list(enumerate(first))

    shutil.rmtree(data)  # the data dir is lost; the checkpoint is not
    second = [f"second-{i}".encode() for i in range(50)]
    failure = await run(second, lambda d, s: d.error() is not None or len(sink_offsets(spark, sink)) > 30)
    assert failure is not None, f"the query went on: sink {sink_offsets(spark, sink)[30:]}"
    assert "DataLossError" in failure, failure
    assert "'events'" in failure, failure
    assert "failOnDataLoss=false" in failure, failure
    assert "--no-fail-on-data-loss" in failure, failure
    assert sink_offsets(spark, sink) == list(enumerate(first))  # nothing of the new log read

    # nothing of the new log was released: all 50 records wait in it
    store = WalBlockStore(data / "blocks")
    blocks = store.blocks("events")
    assert blocks, "the new log's blocks were released unread"
    assert (blocks[0].first_offset, blocks[-1].end_offset) == (0, 50)
    store.close()

    # --no-fail-on-data-loss: the new log is read from its start
    def read_all(d: SparkDriver, s: SluiceServer) -> bool:
        return d.error() is not None or len(sink_offsets(spark, sink)) >= 80

    error = await run([], read_all, fail_on_data_loss=False)
    assert error is None, error
    got = sink_offsets(spark, sink)
    assert sorted(got) == sorted(list(enumerate(first)) + list(enumerate(second)))


# ---- the reader on real block logs (no Spark) ------------------------------------------------------


def test_offsets_name_the_logs_incarnations_and_a_replaced_log_is_data_loss(tmp_path: Path) -> None:
    """The reader's offsets carry each log's incarnation; a log of another one under an offset read past
    0 is DataLossError (failOnDataLoss=false: read from the new log's start), and nothing of it is
    released by a commit of the old one's offsets."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    old = store.ensure_incarnation("a")
    write_blocks(store, "a", [5, 5])
    reader = reader_for(tmp_path, "a,b")
    start = reader.initialOffset()
    assert start == {"a": 0, "b": 0, INCARNATIONS: {"a": old}}  # b has no log yet
    end = reader.latestOffset(start, ReadAllAvailable())
    assert end == {"a": 10, "b": 0, INCARNATIONS: {"a": old}}
    assert list(end)[-1] == INCARNATIONS  # last: Spark compares offsets by their JSON text
    reader.commit(end)
    store.close()

    # the log is lost and started afresh: 7 records, offsets 0..6 again
    shutil.rmtree(tmp_path / "a")
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    new = store.ensure_incarnation("a")
    rows = write_blocks(store, "a", [3, 4])
    fresh = reader_for(tmp_path, "a,b")
    with pytest.raises(DataLossError) as lost:
        fresh.latestOffset(end, ReadAllAvailable())
    message = str(lost.value)
    for part in (f"incarnation {new}", f"incarnation {old} up to offset 10", "ends at offset 7"):
        assert part in message, message
    assert "failOnDataLoss=false" in message and "--no-fail-on-data-loss" in message, message
    # a commit of the old log's offsets releases nothing of the new one
    fresh.commit(end)
    assert [b.seq for b in store.blocks("a")] == [0, 1]

    # a restarted query's unfinished batch, planned on the old log, is data loss too
    with pytest.raises(DataLossError, match=f"planned records 10..14 of incarnation {old}"):
        fresh.partitions(end, {"a": 15, "b": 0, INCARNATIONS: {"a": old}})

    # failOnDataLoss=false: the new log is read from its start, and the offset names it
    going_on = reader_for(tmp_path, "a,b", failOnDataLoss="false")
    after = going_on.latestOffset(end, ReadAllAvailable())
    assert after == {"a": 7, "b": 0, INCARNATIONS: {"a": new}}
    read = [b for p in going_on.partitions(end, after) for b in going_on.read(p)]
    assert rows_of(read) == rows
    assert going_on.partitions(end, {"a": 15, "b": 0, INCARNATIONS: {"a": old}}) == []
    with pytest.raises(ValueError, match="failOnDataLoss"):
        reader_for(tmp_path, failOnDataLoss="maybe")


def test_an_offset_without_incarnations_is_taken_and_a_log_below_it_is_data_loss(tmp_path: Path) -> None:
    """A checkpoint from before incarnations (its offsets name none) goes on over its log, which the
    first batch that reads it names; a log that ends below such an offset was lost all the same."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    write_blocks(store, "a", [5, 5])
    reader = reader_for(tmp_path, "a")
    assert reader.latestOffset({"a": 5}, ReadAllAvailable()) == {"a": 10}  # a log without one either
    made = store.ensure_incarnation("a")  # the server's first start with incarnations
    assert reader.latestOffset({"a": 10}, ReadAllAvailable()) == {"a": 10}  # no empty batch for it
    assert reader.latestOffset({"a": 5}, ReadAllAvailable()) == {"a": 10, INCARNATIONS: {"a": made}}
    store.release("a", 2)  # read and released: the log still knows where it ended
    assert reader.latestOffset({"a": 10}, ReadAllAvailable()) == {"a": 10}
    with pytest.raises(DataLossError, match=r"ends at offset 10, and the query's offset is 12"):
        reader.latestOffset({"a": 12}, ReadAllAvailable())
    # a swap's new query starts at the old one's committed end, of the log it names
    other = "0" * 32
    swapped = reader_for(tmp_path, "a", startingOffsets=json.dumps({"a": 10, INCARNATIONS: {"a": other}}))
    start = swapped.initialOffset()
    assert start == {"a": 10, INCARNATIONS: {"a": other}}
    with pytest.raises(DataLossError, match=f"incarnation {made}"):
        swapped.latestOffset(start, ReadAllAvailable())


def test_a_damaged_incarnation_is_refused_beside_a_log_and_replaced_without_one(tmp_path: Path) -> None:
    """An incarnation file that cannot be read or holds no id is not taken for none: beside segments
    ensure_incarnation raises IncarnationError naming it (a new id would make a surviving checkpoint take
    the log for a lost one), and reading it raises too; a stream with no segments yet gets a new id.
    A log from before incarnations (segments, no file) still gets one."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    made = store.ensure_incarnation("a")
    write_blocks(store, "a", [5])
    path = tmp_path / "a" / INCARNATION_FILE
    for content in (b"", b"\n", b"hello world\n", b"x" * 65, b"\xff\xfe"):
        path.write_bytes(content)
        for call in (store.ensure_incarnation, store.incarnation):
            with pytest.raises(IncarnationError, match="restore the file") as damaged:
                call("a")
            assert str(path) in str(damaged.value)
        assert path.read_bytes() == content
    path.unlink()
    path.mkdir()
    with pytest.raises(IncarnationError, match="cannot be read"):
        store.ensure_incarnation("a")
    path.rmdir()
    path.write_text(made + "\n")
    assert store.ensure_incarnation("a") == made
    path.unlink()  # as a log from before incarnations: it gets one
    again = store.ensure_incarnation("a")
    assert valid_incarnation(again) and again != made
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / INCARNATION_FILE).write_bytes(b"\xff")  # no log yet: nothing to keep
    fresh = store.ensure_incarnation("b")
    assert valid_incarnation(fresh) and store.incarnation("b") == fresh


async def test_a_single_server_gives_its_logs_incarnations(tmp_path: Path) -> None:
    """`sluice serve` (one node) makes each served stream's log an incarnation at its start, and a
    stream added at run time gets one too; a restart keeps them; a log lost gets another."""
    config = ServeConfig(port=0, metrics_port=None, data_dir=tmp_path, streams=("a",))

    async def incarnations() -> dict[str, str]:
        server = SluiceServer(config)
        await server.start()
        try:
            if "b" not in server.receivers:  # served again at a restart (streams.json)
                await server.add_stream("b")
            return {s: server.store.incarnation(s) for s in ("a", "b")}
        finally:
            await server.stop(grace=1)

    first = await incarnations()
    assert all(first.values()), first
    assert await incarnations() == first
    shutil.rmtree(tmp_path / "blocks" / "a")
    again = await incarnations()
    assert again["b"] == first["b"] and again["a"] and again["a"] != first["a"]


def test_a_log_below_an_offset_without_incarnations_is_read_from_its_start_when_loss_is_allowed(
    tmp_path: Path,
) -> None:
    """failOnDataLoss=false and a checkpoint's old-style offset (no incarnations) above where the log now
    ends: latestOffset planned the log from its first record, but the batch's partitions skipped it
    (its start was above its end) and the commit then released those blocks unread."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    rows = write_blocks(store, "a", [5, 5])  # the log now: offsets 0..9
    going_on = reader_for(tmp_path, "a", failOnDataLoss="false")
    start = {"a": 12}  # the checkpoint's, from a log that had reached 12
    end = going_on.latestOffset(start, ReadAllAvailable())
    assert end["a"] == 10
    read = [b for p in going_on.partitions(start, end) for b in going_on.read(p)]
    assert rows_of(read) == rows  # every record of the log, once
    going_on.commit(end)
    assert store.blocks("a") == []  # released after being read, not instead
