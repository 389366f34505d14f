"""The "sluice" streaming source, pipelines and listener: on real blocks and a real local Spark."""

from __future__ import annotations

import functools
import logging
import math
import pickle
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows

from ingest.spark.java import _java_major
from ingest.spark.listener import BatchCompleted, BatchListener
from ingest.spark.pipeline import load_pipeline, parquet_pipeline, pipeline_name, start_query
from ingest.spark.session import CHECKPOINT_MANAGER_KEY, FILE_SYSTEM_CHECKPOINT_MANAGERS
from ingest.spark.source import (
    ARROW_SCHEMA,
    LOG_APPEND_TIME,
    MAX_RECORDS_PER_PARTITION,
    PARTITION_RECORDS,
    SCHEMA,
    SCHEMA_DDL,
    BlockPartition,
    DataLossError,
    SluiceDataSource,
    SluiceStreamReader,
    _admit,
    _advance,
    _countable,
)
from receivers.block import PLAIN_SCHEMA, BlockInfo
from receivers.config import FsyncPolicy
from receivers.wal import HEADER, LOST_FILE, WalBlockStore

BASE_US = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z in microseconds

Row = tuple[str, int, int, bytes | None, bytes, int]
"""(topic: the stream, offset, partition: the receiver, key, value, timestamp in microseconds): one record
as the tests expect it."""


# ---- helpers ------------------------------------------------------------------------------------


def record(stream: str, offset: int, receiver: int) -> Row:
    # every third record has no key, to check null keys survive the trip
    key = None if offset % 3 == 0 else f"{stream}-k{offset}".encode()
    return (stream, offset, receiver, key, f"{stream}-v{offset}".encode(), BASE_US + offset)


def write_block(
    store: WalBlockStore, stream: str, seq: int, first_offset: int, count: int, receiver: int = 7
) -> list[Row]:
    """Write a block of `count` records in two record batches; return the records it holds."""
    rows = [record(stream, first_offset + i, receiver) for i in range(count)]
    half = count // 2
    batches = [
        pa.RecordBatch.from_arrays(
            [
                pa.array([r[3] for r in part], pa.binary()),
                pa.array([r[4] for r in part], pa.binary()),
                pa.array([r[5] for r in part], pa.timestamp("us", tz="UTC")),
            ],
            schema=PLAIN_SCHEMA,
        )
        for part in (rows[:half], rows[half:])
    ]
    store.write(stream, seq, first_offset, receiver, batches)
    return rows


def write_blocks(store: WalBlockStore, stream: str, sizes: list[int]) -> list[Row]:
    """Append blocks of the given sizes to `stream`, as its receiver would; return their records."""
    rows: list[Row] = []
    seq, offset = store.recover(stream)
    for size in sizes:
        rows += write_block(store, stream, seq, offset, size, receiver=seq % 3)
        seq, offset = seq + 1, offset + size
    return rows


def reader_for(root: Path, streams: str = "a", **options: str) -> SluiceStreamReader:
    return SluiceStreamReader({"path": str(root), "streams": streams, **options})


def rows_of(batches: list[pa.RecordBatch]) -> list[Row]:
    table = pa.Table.from_batches(batches, ARROW_SCHEMA)
    out = []
    for r in table.to_pylist():
        ts = r["timestamp"]
        micros = int(ts.timestamp()) * 1_000_000 + ts.microsecond
        assert r["timestampType"] == LOG_APPEND_TIME, r
        out.append((r["topic"], r["offset"], r["partition"], r["key"], r["value"], micros))
    return out


def sink_rows(spark: Any, sink: Path) -> list[Row]:
    df = spark.read.schema(SCHEMA).parquet(str(sink))
    result = df.selectExpr(
        "topic", "offset", "partition", "key", "value", "unix_micros(timestamp) AS ts", "timestampType"
    ).collect()
    assert {r.timestampType for r in result} <= {LOG_APPEND_TIME}
    return [
        (r.topic, r.offset, r.partition, None if r.key is None else bytes(r.key), bytes(r.value), r.ts)
        for r in result
    ]


def wait_for_rows(spark: Any, query: Any, sink: Path, expected: int, timeout: float = 120.0) -> None:
    """Poll the Parquet sink until it holds `expected` rows (read via its commit log: no partial files)."""
    deadline = time.monotonic() + timeout
    count = 0
    while True:
        if not query.isActive:
            raise AssertionError(f"query stopped: {query.exception()}")
        if (sink / "_spark_metadata").is_dir():
            count = spark.read.schema(SCHEMA).parquet(str(sink)).count()
            if count >= expected:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"sink holds {count} of {expected} rows after {timeout} s")
        query.awaitTermination(0.3)


def wait_until(condition: Any, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


# ---- the reader on its own ----------------------------------------------------------------------


def test_arrow_schema_is_what_spark_expects() -> None:
    # PySpark rejects yielded batches unless their schema equals this conversion exactly
    assert ARROW_SCHEMA.equals(to_arrow_schema(SCHEMA, timezone="UTC"))
    # Spark's Kafka source's columns and types (without headers, which needs includeHeaders=true), so a
    # Kafka pipeline reads this source unchanged
    kafka = [
        ("key", "binary"),
        ("value", "binary"),
        ("topic", "string"),
        ("partition", "int"),
        ("offset", "bigint"),
        ("timestamp", "timestamp"),
        ("timestampType", "int"),
    ]
    assert [(f.name, f.dataType.simpleString()) for f in SCHEMA.fields] == kafka
    assert LOG_APPEND_TIME == 1  # Kafka: 0 CreateTime (the producer's clock), 1 LogAppendTime (the broker's)


def test_read_yields_kafka_like_columns(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    expected = write_block(store, "a", 0, 0, 5, receiver=3) + write_block(store, "a", 1, 5, 4, receiver=4)
    reader = reader_for(tmp_path)
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    assert (start, end) == ({"a": 0}, {"a": 9})
    batches = [b for p in reader.partitions(start, end) for b in reader.read(p)]
    assert all(b.schema.equals(ARROW_SCHEMA) for b in batches)
    assert rows_of(batches) == expected
    assert expected[0][3] is None  # null keys are in there


def slices_of(parts: Any) -> list[list[tuple[str, int, int, int]]]:
    """(stream, seq, lo, hi) of every slice of every partition."""
    return [[(s[0], s[1], s[5], s[6]) for s in p.slices] for p in parts]


def test_partitions_balance_records_across_blocks(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    write_blocks(store, "a", [10] * 20)
    write_blocks(store, "b", [10] * 3)
    reader = reader_for(tmp_path, "a,b", minPartitions="3")
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    assert end == {"a": 200, "b": 30}
    parts = reader.partitions(start, end)
    # 230 records in 3 tasks of 77, 77 and 76: blocks are cut where a partition is full
    assert [p.records for p in parts] == [77, 77, 76]
    assert slices_of(parts)[1][0] == ("a", 7, 7, 10)
    assert sorted(r for p in parts for b in reader.read(p) for r in rows_of([b])) == sorted(
        rows_of([b for p in reader.partitions(start, end) for b in reader.read(p)])
    )
    assert len(rows_of([b for p in parts for b in reader.read(p)])) == 230
    # partitions and the reader travel to other processes
    assert pickle.loads(pickle.dumps(parts[0])).slices == parts[0].slices
    copy = pickle.loads(pickle.dumps(reader))
    assert rows_of(list(copy.read(parts[-1]))) == rows_of(list(reader.read(parts[-1])))
    assert reader.partitions(end, end) == []
    # a large batch still splits at MAX_RECORDS_PER_PARTITION
    assert MAX_RECORDS_PER_PARTITION >= 100_000


def test_min_partitions_spreads_a_small_batch(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    expected = write_blocks(store, "a", [10] * 5)
    reader = reader_for(tmp_path, "a", minPartitions="2")
    start = reader.initialOffset()
    parts = reader.partitions(start, reader.latestOffset(start, ReadAllAvailable()))
    assert slices_of(parts) == [
        [("a", 0, 0, 10), ("a", 1, 0, 10), ("a", 2, 0, 5)],
        [("a", 2, 5, 10), ("a", 3, 0, 10), ("a", 4, 0, 10)],
    ]
    assert rows_of([b for p in parts for b in reader.read(p)]) == expected
    many = reader_for(tmp_path, "a", minPartitions="64")  # never more partitions than records
    assert len(many.partitions(start, {"a": 5})) == 5


def test_a_small_batch_is_not_spread_below_min_partition_records(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    expected = write_blocks(store, "a", [10] * 10)
    reader = reader_for(tmp_path, "a", minPartitions="4", minPartitionRecords="30")
    start = reader.initialOffset()
    # 25 records: one task (a second would hold fewer than 30)
    assert [p.records for p in reader.partitions(start, {"a": 25})] == [25]
    # 70 records: two tasks of at least 30, not four of 17 or 18
    assert [p.records for p in reader.partitions(start, {"a": 70})] == [35, 35]
    # 100 records: three, the most that hold 30 each; never more than minPartitions
    parts = reader.partitions(start, {"a": 100})
    assert [p.records for p in parts] == [34, 34, 32]
    assert rows_of([b for p in parts for b in reader.read(p)]) == expected
    wide = reader_for(tmp_path, "a", minPartitions="2", minPartitionRecords="1")
    assert len(wide.partitions(start, {"a": 100})) == 2


def test_start_query_sizes_partitions_by_records() -> None:
    options: dict[str, str] = {}

    class Reader:
        def format(self, _name: str) -> Reader:
            return self

        def option(self, key: str, value: str) -> Reader:
            options[key] = value
            return self

        def load(self) -> None:
            raise RuntimeError("stop here")

    spark = SimpleNamespace(readStream=Reader(), sparkContext=SimpleNamespace(defaultParallelism=2))
    with pytest.raises(RuntimeError, match="stop here"):
        start_query(
            spark,  # type: ignore[arg-type]
            store_root="root",
            streams=["a"],
            pipeline=parquet_pipeline("sink"),
            checkpoint_dir="checkpoint",
            trigger_seconds=1.0,
            query_name="q",
        )
    assert options["minPartitions"] == "2"
    assert options["minPartitionRecords"] == str(PARTITION_RECORDS)


def test_a_capped_batch_is_shared_by_the_streams_weights() -> None:
    # the server splits intake by --stream-weight; a batch's cap follows the same weights, so a
    # backlog drains in the proportions it was taken in (an even split would let a=3's backlog grow)
    start = {"a": 0, "b": 0}
    assert _admit(start, {"a": 1000, "b": 1000}, 100, {"a": 3.0, "b": 1.0}) == {"a": 75, "b": 25}
    # a stream needing less than its weighted part leaves the rest to the others
    assert _admit(start, {"a": 1000, "b": 10}, 100, {"a": 1.0, "b": 3.0}) == {"a": 90, "b": 10}
    # unknown, zero or non-finite weights count as 1: an even split, as without weights
    even = _admit(start, {"a": 1000, "b": 1000}, 100, None)
    assert even == {"a": 50, "b": 50}
    assert _admit(start, {"a": 1000, "b": 1000}, 100, {"a": 0.0, "b": float("nan")}) == even
    # never more than the cap, never more than is there, at least one record when any is there
    assert _admit(start, {"a": 5, "b": 0}, 100, {"a": 2.0}) == {"a": 5, "b": 0}
    assert sum(_admit(start, {"a": 9, "b": 9}, 1, {"a": 1.0, "b": 100.0}).values()) == 1


def test_offsets_gone_from_the_log_take_none_of_a_batchs_budget() -> None:
    """The planning rule: offsets in a stream's gaps (records gone from its log, passed with
    failOnDataLoss=false) are no records. A cap of 16 and a gap of 160 (10x): before, the batches
    that reach it read 16, 8, then 10 batches of nothing; now the batch that reads the last records
    before the gap reads the first ones after it too."""
    gap = [(40, 200)]
    assert _countable(0, 240, gap) == 80 and _countable(50, 150, gap) == 0 and _countable(30, 210, gap) == 20
    assert _advance(32, 16, 240, gap) == 208  # 32..39 and 200..207
    assert _advance(24, 16, 240, gap) == 200  # 24..39: and past the gap, to the next record
    assert _advance(50, 16, 240, gap) == 216  # a start inside the gap
    assert _advance(32, 0, 240, gap) == 32  # no records: no move
    assert _advance(32, 16, 100, gap) == 100  # never past the available end
    gaps = [(2, 4), (4, 6), (7, 9)]  # adjacent ones too: the records are 0, 1, 6, 9, 10, ...
    assert [_advance(0, n, 100, gaps) for n in range(1, 6)] == [1, 6, 9, 10, 11]
    ends, batches = 0, 0
    while ends < 240:
        ends = _admit({"a": ends}, {"a": 240}, 16, None, {"a": gap})["a"]
        batches += 1
    assert batches == 5  # 80 records, 16 a batch; was 15
    # the budget a gap does not take goes to the other streams' records, shared by their weights
    start = {"a": 32, "b": 0}
    assert _admit(start, {"a": 240, "b": 1000}, 100, None, {"a": gap}) == {"a": 240, "b": 52}
    assert _admit(start, {"a": 190, "b": 1000}, 100, None, {"a": gap}) == {"a": 190, "b": 92}


def test_read_max_rows_caps_a_batch_to_the_record(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    expected = write_blocks(store, "a", [10, 10, 10, 10])
    write_blocks(store, "b", [30, 5])
    reader = reader_for(tmp_path, "a,b")
    start = reader.initialOffset()
    assert start == {"a": 0, "b": 0}
    # shared evenly, cutting blocks: b gets 25 // 2, a the rest
    assert reader.latestOffset(start, ReadMaxRows(25)) == {"a": 13, "b": 12}
    # a stream needing less than its share leaves the rest to the others
    assert reader.latestOffset({"a": 38, "b": 0}, ReadMaxRows(25)) == {"a": 40, "b": 23}
    assert reader.latestOffset(start, ReadMaxRows(1)) == {"a": 0, "b": 1}
    assert reader.latestOffset(start, ReadMaxRows(1000)) == {"a": 40, "b": 35}
    assert reader.latestOffset(start, ReadAllAvailable()) == {"a": 40, "b": 35}
    # nothing new: the start offset comes back unchanged
    assert reader.latestOffset({"a": 40, "b": 35}, ReadMaxRows(5)) == {"a": 40, "b": 35}
    # consecutive capped batches read every record once, in order
    got: list[Row] = []
    at: dict[str, int] = {"a": 0}
    only_a = reader_for(tmp_path, "a")
    while at["a"] < 40:
        nxt = only_a.latestOffset(at, ReadMaxRows(7))
        assert nxt["a"] - at["a"] == min(7, 40 - at["a"])
        got += rows_of([b for p in only_a.partitions(at, nxt) for b in only_a.read(p)])
        at = nxt
    assert got == expected


def test_default_read_limit_from_options(tmp_path: Path) -> None:
    assert reader_for(tmp_path).getDefaultReadLimit() == ReadAllAvailable()
    assert reader_for(tmp_path, maxRecordsPerBatch="500").getDefaultReadLimit() == ReadMaxRows(500)
    for bad in ("0", "-1", "many"):
        with pytest.raises(ValueError, match="maxRecordsPerBatch"):
            reader_for(tmp_path, maxRecordsPerBatch=bad)
    with pytest.raises(ValueError, match="streams"):
        reader_for(tmp_path, " , ")
    with pytest.raises(ValueError, match="invalid stream name"):
        reader_for(tmp_path, "a,../etc")
    with pytest.raises(ValueError, match="'path' is required"):
        SluiceStreamReader({"streams": "a"})


def test_bad_trigger_seconds_and_follow_streams_options_name_the_option(tmp_path: Path) -> None:
    # triggerSeconds "nan" or "inf" was taken, and failed a later batch's planning with a bare
    # "cannot convert float NaN to integer"; "abc" failed with float()'s message, naming no option
    assert reader_for(tmp_path).trigger_seconds == 1.0
    assert reader_for(tmp_path, triggerSeconds="0").trigger_seconds == 0.0
    assert reader_for(tmp_path, triggerSeconds="0.5").trigger_seconds == 0.5
    for bad in ("abc", "nan", "inf", "-1", "1e400"):
        with pytest.raises(ValueError, match="option 'triggerSeconds' must be a number of seconds"):
            reader_for(tmp_path, triggerSeconds=bad)
    # followServerStreams "yes" or "1" silently meant false
    assert reader_for(tmp_path, followServerStreams="TRUE").follow_streams is True
    assert reader_for(tmp_path, followServerStreams="false").follow_streams is False
    assert reader_for(tmp_path).follow_streams is False
    for bad in ("yes", "1", "maybe"):
        with pytest.raises(ValueError, match="option 'followServerStreams' must be true or false"):
            reader_for(tmp_path, followServerStreams=bad)


def test_a_pipeline_is_named_by_module_and_qualified_name_never_its_repr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Errors named a pipeline by its repr, "<function enrich at 0x7f...>": now as a spec names it."""

    class Enrich:
        def __call__(self, df: Any) -> Any:
            return df

    assert (
        pipeline_name(parquet_pipeline(tmp_path))
        == "ingest.spark.pipeline:parquet_pipeline.<locals>.pipeline"
    )
    assert pipeline_name(record) == "test_spark_source:record"
    here = "test_spark_source:test_a_pipeline_is_named_by_module_and_qualified_name_never_its_repr.<locals>"
    assert pipeline_name(Enrich()) == f"{here}.Enrich (an instance)"
    assert pipeline_name(Enrich().__call__) == f"{here}.Enrich.__call__"
    assert pipeline_name(functools.partial(record, "s")) == "test_spark_source:record (a functools.partial)"
    # loaded by a spec: named by it, whatever its function is called
    (tmp_path / "mypipes.py").write_text(
        "def make():\n    def pipeline(df):\n        return df\n    return pipeline\n\nenrich = make()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mypipes", raising=False)
    assert pipeline_name(load_pipeline("mypipes:enrich")) == "mypipes:enrich"
    assert pipeline_name(load_pipeline("mypipes:make")) == "mypipes:make"


def test_start_query_refuses_a_trigger_that_is_no_interval_naming_it(spark: Any, tmp_path: Path) -> None:
    """start_query(trigger_seconds=nan) was taken (only a negative one was checked): it failed after the
    pipeline was built with round()'s "cannot convert float NaN to integer", a bool was 1 s, 1e-4 ran
    batches back to back. Each is now refused by name before anything starts; 0 (back to back) and the
    service's own range are taken."""
    store = WalBlockStore(tmp_path / "blocks", fsync=FsyncPolicy.off())
    write_blocks(store, "s", [3])
    active = {q.id for q in spark.streams.active}
    for value, error, says in (
        (math.nan, ValueError, r"^trigger_seconds must be finite and >= 0 seconds, got nan$"),
        (math.inf, ValueError, r"^trigger_seconds must be finite and >= 0 seconds, got inf$"),
        (-1, ValueError, r"^trigger_seconds must be finite and >= 0 seconds, got -1$"),
        (1e-4, ValueError, r"^trigger_seconds must be 0 \(batches back to back\) or at least 0\.01 seconds"),
        (86_401, ValueError, r"^trigger_seconds must be at most 86400 seconds \(a day\), got 86401$"),
        (10**400, ValueError, r"^trigger_seconds is out of range"),
        (True, TypeError, r"^trigger_seconds must be a number of seconds, not bool \(True\)$"),
        ("1", TypeError, r"^trigger_seconds must be a number of seconds, not str \('1'\)$"),
        (None, TypeError, r"^trigger_seconds must be a number of seconds, not NoneType \(None\)$"),
    ):
        with pytest.raises(error, match=says):
            start_query(
                spark,
                store_root=tmp_path / "blocks",
                streams=["s"],
                pipeline=parquet_pipeline(tmp_path / "sink"),
                checkpoint_dir=tmp_path / "checkpoint",
                trigger_seconds=value,
                query_name="sluice_test_bad_trigger",
            )
    assert {q.id for q in spark.streams.active} == active
    assert not (tmp_path / "checkpoint").exists() and not (tmp_path / "sink").exists()
    for good in (0, 0.01):  # back to back, and the service's shortest interval
        query = start_query(
            spark,
            store_root=tmp_path / "blocks",
            streams=["s"],
            pipeline=parquet_pipeline(tmp_path / f"sink-{good}"),
            checkpoint_dir=tmp_path / f"checkpoint-{good}",
            trigger_seconds=good,
            query_name="sluice_test_good_trigger",
        )
        try:
            wait_for_rows(spark, query, tmp_path / f"sink-{good}", 3)
        finally:
            query.stop()


def test_a_misspelt_option_fails_the_query_naming_it(spark: Any, tmp_path: Path) -> None:
    """maxRecordPerBatch (no s) was ignored without a word: the query ran with no cap. Any option
    the source does not take now fails the query's start, naming it and the one it looks like; the
    case of a known one does not matter (Spark's options are case-insensitive)."""
    store = WalBlockStore(tmp_path / "blocks", fsync=FsyncPolicy.off())
    write_blocks(store, "a", [5])
    root = str(tmp_path / "blocks")
    assert SluiceDataSource({"path": root, "streams": "a", "FAILONDATALOSS": "false"}).streamReader(SCHEMA)
    with pytest.raises(ValueError, match="unknown option 'rowsPerSecond'; the options are path, "):
        SluiceDataSource({"path": root, "streams": "a", "rowsPerSecond": "5"}).streamReader(SCHEMA)
    query = start_query(
        spark,
        store_root=tmp_path / "blocks",
        streams=["a"],
        pipeline=parquet_pipeline(tmp_path / "sink"),
        checkpoint_dir=tmp_path / "checkpoint",
        trigger_seconds=0.2,
        query_name="sluice_test_misspelt_option",
        source_options={"maxRecordPerBatch": "2"},
    )
    try:
        with pytest.raises(StreamingQueryException) as failed:
            query.awaitTermination(60)
        # Spark hands the options over lower-cased
        said = "unknown option 'maxrecordperbatch' (did you mean 'maxRecordsPerBatch'?)"
        assert said in str(failed.value), str(failed.value)[:2000]
    finally:
        query.stop()
    assert not (tmp_path / "sink").exists() or sink_rows(spark, tmp_path / "sink") == []


def test_commit_releases_blocks_and_fresh_query_starts_after_them(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    write_blocks(store, "a", [3, 3, 3, 3])
    reader = reader_for(tmp_path, "a,empty")
    assert reader.initialOffset() == {"a": 0, "empty": 0}
    reader.commit({"a": 10, "empty": 0})  # mid-block: only the blocks wholly below go
    assert [b.seq for b in store.blocks("a")] == [3]
    # a fresh query starts at the first block still there, not at released records
    fresh = reader_for(tmp_path, "a,empty")
    assert fresh.initialOffset() == {"a": 9, "empty": 0}
    reader.commit({"a": 12})
    assert store.blocks("a") == []
    # a stream emptied by releases continues at a higher seq; reading from 0 skips the released ones
    empty_start = reader_for(tmp_path).initialOffset()
    assert empty_start == {"a": 0}
    rows = write_block(store, "a", 4, 12, 2)
    end = reader.latestOffset(empty_start, ReadAllAvailable())
    assert end == {"a": 14, "empty": 0}
    assert rows_of([b for p in reader.partitions(empty_start, end) for b in reader.read(p)]) == rows


def test_missing_blocks_are_data_loss(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    write_blocks(store, "a", [3, 3, 3])
    reader = reader_for(tmp_path)
    store.release("a", 2)  # as if another query had committed them
    with pytest.raises(DataLossError, match=r"records 3\.\.8 but .* cover \[\(6, 9\)\]"):
        reader.partitions({"a": 3}, {"a": 9})
    store.release("a", 3)
    with pytest.raises(DataLossError, match="cover nothing"):
        reader.partitions({"a": 0}, {"a": 9})


def gapped_log(root: Path) -> tuple[list[Row], tuple[int, int]]:
    """A log of 12 blocks of 20 records in "a", several to a segment, that lost a middle segment (a
    power loss under --fsync off), recovered past it as a start does: (the records left, the offsets
    lost [lo, hi))."""
    store = WalBlockStore(root, fsync=FsyncPolicy.off(), segment_bytes=3000, direct_io=False)
    rows = write_blocks(store, "a", [20] * 12)
    store.close()
    segments = sorted((root / "a").glob("*.wal"))
    assert len(segments) >= 3, segments
    lost_from, lost_to = int(segments[1].stem), int(segments[2].stem)
    segments[1].unlink()
    assert WalBlockStore(root, fsync=FsyncPolicy.off()).recover("a") == (12, 240)  # passed, with an ERROR
    lost = (lost_from * 20, lost_to * 20)
    return [r for r in rows if not lost[0] <= r[1] < lost[1]], lost


def test_a_gap_in_the_log_is_data_loss_or_skipped_with_fail_on_data_loss_false(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A log that went on past lost blocks (a start under --fsync off after a power loss, or under
    --no-fail-on-data-loss): every batch over the gap raised DataLossError, also with
    failOnDataLoss=false, and its message asked whether another query had released them. The query
    failed at every start for good. Now the error names the lost records and where they went, and
    failOnDataLoss=false reads the records there with a WARNING."""
    left, (lo, hi) = gapped_log(tmp_path)
    with pytest.raises(DataLossError) as lost:
        reader_for(tmp_path).partitions({"a": 0}, {"a": 240})
    message = str(lost.value)
    assert f"records {lo}..{hi - 1} are gone from its log" in message, message
    assert "sluice_wal_lost_blocks_total" in message and "--no-fail-on-data-loss" in message, message
    assert "another query" not in message
    reader = reader_for(tmp_path, failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, "ingest.spark.source"):
        parts = reader.partitions({"a": 0}, {"a": 240})
    assert rows_of([b for p in parts for b in reader.read(p)]) == left
    assert any(f"records {lo}..{hi - 1} are gone" in r.getMessage() for r in caplog.records)
    # a batch wholly inside the gap reads nothing, and one past it is whole
    assert reader.partitions({"a": lo}, {"a": hi}) == []
    assert sum(p.records for p in reader.partitions({"a": hi}, {"a": 240})) == 240 - hi


def accepted_log(root: Path, damage: str) -> tuple[list[Row], tuple[int, int]]:
    """A log of 12 blocks of 20 records in "a" written under every-block and damaged (a middle segment
    deleted, or a frame corrupted in the middle of a segment), which recovery refuses; recovered past
    the damage as `sluice serve --accept-wal-damage a` does: (the records left, the offsets lost)."""
    missing = damage == "missing"
    store = WalBlockStore(root, segment_bytes=3000 if missing else 1 << 20, direct_io=False)
    rows = write_blocks(store, "a", [20] * 12)
    store.close()
    segments = sorted((root / "a").glob("*.wal"))
    if missing:
        assert len(segments) >= 3, segments
        lost_from, lost_to = int(segments[1].stem), int(segments[2].stem)
        segments[1].unlink()
    else:
        data = bytearray(segments[0].read_bytes())
        at = 0
        for _ in range(5):  # past blocks 0..4
            header = HEADER.unpack_from(data, at)
            at += HEADER.size + header[4] + header[5]
        data[at + HEADER.size + 30] ^= 0xFF  # block 5
        segments[0].write_bytes(bytes(data))
        lost_from, lost_to = 5, 6
    assert WalBlockStore(root, accept_damage=["a"]).recover("a") == (12, 240)  # with an ERROR
    lost = (lost_from * 20, lost_to * 20)
    return [r for r in rows if not lost[0] <= r[1] < lost[1]], lost


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_blocks_a_start_went_on_without_past_damage_are_data_loss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    """Blocks `sluice serve --accept-wal-damage` recorded as lost are records gone from the log, as
    those --fsync off lost: DataLossError naming them and where the loss was recorded, or with
    failOnDataLoss=false a WARNING and the records after them."""
    left, (lo, hi) = accepted_log(tmp_path, damage)
    with pytest.raises(DataLossError) as lost:
        reader_for(tmp_path).partitions({"a": 0}, {"a": 240})
    message = str(lost.value)
    assert f"records {lo}..{hi - 1} are gone from its log" in message, message
    recorded = tmp_path / "a" / LOST_FILE
    assert (
        f"a start with --accept-wal-damage went on without them, and recorded them in {recorded}" in message
    )
    reader = reader_for(tmp_path, failOnDataLoss="false")
    with caplog.at_level(logging.WARNING, "ingest.spark.source"):
        parts = reader.partitions({"a": 0}, {"a": 240})
    assert rows_of([b for p in parts for b in reader.read(p)]) == left
    assert any(f"records {lo}..{hi - 1} are gone" in r.getMessage() for r in caplog.records)
    # a batch that does not reach the gap says nothing of it
    assert sum(p.records for p in reader_for(tmp_path).partitions({"a": hi}, {"a": 240})) == 240 - hi


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_records_gone_from_the_log_take_none_of_a_batchs_cap(tmp_path: Path, damage: str) -> None:
    """With failOnDataLoss=false the query passes records gone from the log (`--accept-wal-damage`'s
    lost.json); the read limit counted their offsets as records, so a gap of 20 or more under a cap of
    2 took ten batches or more that read nothing. Now the batch that reads the last record before the
    gap reads the first one after it."""
    _, (lo, hi) = accepted_log(tmp_path, damage)
    reader = reader_for(tmp_path, failOnDataLoss="false")
    end = reader.latestOffset({"a": lo - 1}, ReadMaxRows(2))
    assert end["a"] == hi + 1  # was lo + 1
    assert sum(p.records for p in reader.partitions({"a": lo - 1}, end)) == 2
    assert reader.latestOffset({"a": lo + 1}, ReadMaxRows(2))["a"] == hi + 2  # from inside the gap


def test_available_now_stops_at_the_blocks_present_when_it_started(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    write_blocks(store, "a", [10, 10, 10])
    reader = reader_for(tmp_path, "a,b")
    start = reader.initialOffset()
    reader.prepareForTriggerAvailableNow()
    write_blocks(store, "a", [10])
    write_blocks(store, "b", [10])
    mid = reader.latestOffset(start, ReadMaxRows(20))
    assert mid == {"a": 20, "b": 0}
    assert reader.latestOffset(mid, ReadMaxRows(20)) == {"a": 30, "b": 0}
    assert reader.latestOffset({"a": 30, "b": 0}, ReadAllAvailable()) == {"a": 30, "b": 0}


def test_partition_carries_plain_tuples() -> None:
    p = BlockPartition("/x", [("a", 0, 0, 1, 2, 0, 1)])
    assert BlockInfo(*p.slices[0][:5]) == BlockInfo("a", 0, 0, 1, 2)
    assert p.records == 1


# ---- pipelines, listener, session helpers -------------------------------------------------------


def test_load_pipeline_errors_name_the_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sluice_test_pipes.py").write_text("def pipe(df):\n    return df.writeStream\n\nNUMBER = 3\n")
    (tmp_path / "sluice_test_broken.py").write_text("import sluice_no_such_dependency\n")
    (tmp_path / "sluice_test_exits.py").write_text("import sys\n\nsys.exit('usage: pipes.py FILE')\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    assert callable(load_pipeline("sluice_test_pipes:pipe"))
    cases = {
        "sluice_test_pipes.pipe": "not of the form",
        ":pipe": "not of the form",
        "sluice_test_pipes:": "not of the form",
        "sluice_no_such_module:pipe": "no module named 'sluice_no_such_module'",
        "sluice_test_broken:pipe": "failed to import",
        # SystemExit is no Exception: it went past this, and a swap's handlers, and ended the service
        "sluice_test_exits:pipe": r"failed to import: SystemExit\('usage: pipes.py FILE'\)",
        "sluice_test_pipes:nope": "has no attribute 'nope'",
        "sluice_test_pipes:NUMBER": "is a int, not a callable",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message):
            load_pipeline(spec)


def test_load_pipeline_reads_the_source_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each load imports the module anew (a swap after an edit runs the edit); one whose new version
    fails to import leaves the loaded one in place, and what was loaded keeps its own globals."""
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "sluice_test_edited.py"
    module.write_text("WHO = 'one'\n\ndef pipe(df):\n    return WHO\n")
    first = load_pipeline("sluice_test_edited:pipe")
    module.write_text("WHO = 'two, edited'\n\ndef pipe(df):\n    return WHO\n")
    second = load_pipeline("sluice_test_edited:pipe")
    assert (first(None), second(None)) == ("one", "two, edited")
    module.write_text("WHO = 'three'\nraise RuntimeError('half way')\n")
    with pytest.raises(ValueError, match="half way"):
        load_pipeline("sluice_test_edited:pipe")
    assert sys.modules["sluice_test_edited"].pipe is second
    assert (first(None), second(None)) == ("one", "two, edited")
    monkeypatch.delitem(sys.modules, "sluice_test_edited")


def _progress_event(batch_id: int, rows: int) -> Any:
    progress = SimpleNamespace(
        id="q-1",
        batchId=batch_id,
        numInputRows=rows,
        durationMs={"triggerExecution": 1500, "addBatch": 1200},
        timestamp="2026-01-01T00:00:00.000Z",
    )
    return SimpleNamespace(progress=progress)


def test_listener_survives_a_failing_callback(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[BatchCompleted] = []

    def callback(batch: BatchCompleted) -> None:
        seen.append(batch)
        if batch.batch_id == 0:
            raise RuntimeError("consumer broke")

    listener = BatchListener(callback)
    with caplog.at_level(logging.ERROR, logger="ingest.spark.listener"):
        listener.onQueryProgress(_progress_event(0, 10))
        listener.onQueryProgress(_progress_event(1, 20))
        listener.onQueryProgress(SimpleNamespace())  # malformed: logged, not counted
    assert seen == [
        BatchCompleted("q-1", 0, 10, 1.5, "2026-01-01T00:00:00.000Z"),
        BatchCompleted("q-1", 1, 20, 1.5, "2026-01-01T00:00:00.000Z"),
    ]
    assert listener.batches_completed == 2
    assert "consumer broke" in caplog.text
    assert "cannot read streaming query progress" in caplog.text


def test_java_version_parsing() -> None:
    assert _java_major('openjdk version "17.0.15" 2025-04-15') == 17
    assert _java_major('java version "1.8.0_292"') == 8
    assert _java_major('openjdk version "21" 2023-09-19') == 21
    assert _java_major("no java here") is None


# ---- on a real Spark ----------------------------------------------------------------------------


@pytest.mark.spark
def test_schema_ddl_matches_struct(spark: Any) -> None:
    assert spark.createDataFrame([], SCHEMA_DDL).schema == SCHEMA


@pytest.mark.spark
def test_local_sessions_write_checkpoints_through_the_file_system_api(spark: Any) -> None:
    # a class this Spark has (a wrong name would fail every query at its start)
    name = spark.conf.get(CHECKPOINT_MANAGER_KEY)
    assert name in FILE_SYSTEM_CHECKPOINT_MANAGERS
    spark.sparkContext._jvm.java.lang.Class.forName(name)


@pytest.mark.spark
def test_query_streams_blocks_to_parquet_and_releases_them(spark: Any, tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path / "blocks", fsync=FsyncPolicy.off())
    sink = tmp_path / "sink"
    expected = write_blocks(store, "a", [5, 7, 3]) + write_blocks(store, "b", [4])
    query = start_query(
        spark,
        store_root=tmp_path / "blocks",
        streams=["a", "b"],
        pipeline=parquet_pipeline(sink),
        checkpoint_dir=tmp_path / "checkpoint",
        trigger_seconds=0.2,
        query_name="sluice_test_parquet",
    )
    try:
        wait_for_rows(spark, query, sink, len(expected))
        # blocks sealed while the query runs are picked up too
        expected += write_blocks(store, "a", [6]) + write_blocks(store, "b", [2, 2])
        wait_for_rows(spark, query, sink, len(expected))

        # the first wave was committed when the next batch was planned, so it has left the store
        def first_wave_released() -> bool:
            return all(b.seq >= 3 for b in store.blocks("a")) and all(b.seq >= 1 for b in store.blocks("b"))

        wait_until(first_wave_released, "the committed blocks to be released")
    finally:
        query.stop()
    got = sink_rows(spark, sink)
    assert len(got) == len(expected)
    assert sorted(got, key=lambda r: (r[0], r[1])) == sorted(expected, key=lambda r: (r[0], r[1]))
    assert any(r[3] is None for r in got)


@pytest.mark.parametrize("fail_on_data_loss", ["true", "false"])
def test_a_query_over_a_gap_in_the_log_fails_or_goes_on(
    spark: Any, tmp_path: Path, fail_on_data_loss: str
) -> None:
    """A real query over a log that went on past lost blocks: it stopped with DataLossError whatever
    failOnDataLoss said. With failOnDataLoss=false it now writes every record still in the log."""
    left, lost = gapped_log(tmp_path / "blocks")
    _query_over_lost_records(spark, tmp_path, fail_on_data_loss, left, lost, "gap")


def _query_over_lost_records(
    spark: Any,
    tmp_path: Path,
    fail_on_data_loss: str,
    left: list[Any],
    lost: tuple[int, int],
    name: str,
    *said: str,
) -> None:
    """Run a query over tmp_path/blocks, whose records lost[0]..lost[1] - 1 are gone: with
    failOnDataLoss=true it fails naming them (and `said`); with false it writes `left`, every record
    still in the log."""
    lo, hi = lost
    sink = tmp_path / "sink"
    query = start_query(
        spark,
        store_root=tmp_path / "blocks",
        streams=["a"],
        pipeline=parquet_pipeline(sink),
        checkpoint_dir=tmp_path / "checkpoint",
        trigger_seconds=0.2,
        query_name=f"sluice_test_{name}_{fail_on_data_loss}",
        source_options={"failOnDataLoss": fail_on_data_loss},
    )
    try:
        if fail_on_data_loss == "true":
            with pytest.raises(StreamingQueryException) as failed:
                query.awaitTermination(120)
            assert f"records {lo}..{hi - 1} are gone from its log" in str(failed.value), failed.value
            for text in said:
                assert text in str(failed.value), failed.value
        else:
            wait_for_rows(spark, query, sink, len(left))
    finally:
        query.stop()
    if fail_on_data_loss == "false":
        got = sink_rows(spark, sink)
        assert sorted(got, key=lambda r: r[1]) == left


@pytest.mark.spark
@pytest.mark.parametrize("fail_on_data_loss", ["true", "false"])
def test_a_query_across_blocks_lost_past_damage_fails_or_goes_on(
    spark: Any, tmp_path: Path, fail_on_data_loss: str
) -> None:
    """A real query over a log a start went on past damage in (a frame corrupted in the middle of a
    segment, `--accept-wal-damage`): with failOnDataLoss=true it stops naming the records lost; with
    false it writes every record after them too."""
    left, lost = accepted_log(tmp_path / "blocks", "corrupt")
    _query_over_lost_records(spark, tmp_path, fail_on_data_loss, left, lost, "damage", "--accept-wal-damage")


@pytest.mark.spark
def test_max_records_per_batch_splits_a_backlog(spark: Any, tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path / "blocks", fsync=FsyncPolicy.off())
    sink = tmp_path / "sink"
    own_checkpoint = tmp_path / "own-checkpoint"
    expected = write_blocks(store, "s", [100] * 10)
    events: list[BatchCompleted] = []
    listener = BatchListener(events.append)  # list.append is atomic: fine from the py4j thread

    def pipeline(df: Any) -> Any:
        # a pipeline that picks its own checkpoint keeps it
        return parquet_pipeline(sink)(df).option("checkpointLocation", str(own_checkpoint))

    spark.streams.addListener(listener)
    query = start_query(
        spark,
        store_root=tmp_path / "blocks",
        streams=["s"],
        pipeline=pipeline,
        checkpoint_dir=tmp_path / "unused-checkpoint",
        trigger_seconds=0,
        query_name="sluice_test_max_records",
        max_records_per_batch=250,
    )
    try:
        wait_for_rows(spark, query, sink, len(expected))
        query_id = str(query.id)

        def mine() -> list[BatchCompleted]:
            return [e for e in events if e.query_id == query_id]

        wait_until(lambda: sum(e.num_input_rows for e in mine()) == len(expected), "progress events")
    finally:
        query.stop()
        spark.streams.removeListener(listener)
    sizes = [e.num_input_rows for e in mine() if e.num_input_rows]
    assert sizes == [250] * 4  # at most 250 records a batch, blocks of 100 cut where needed
    # the progress as the listener's JSON bridge hands it over: the source's offsets, to the record
    done = [e for e in mine() if e.num_input_rows]
    # (Spark reports no start offset for a query's first batch)
    assert [(e.start_offset, e.end_offset) for e in done] == [
        (None if i == 0 else {"s": i}, {"s": i + 250}) for i in range(0, 1000, 250)
    ]
    assert all(e.latest_offset == {"s": 1000} for e in done)
    assert [e.batch_id for e in done] == sorted(e.batch_id for e in done)
    assert all(e.processing_seconds > 0 for e in mine())
    assert listener.batches_completed >= 4
    assert (own_checkpoint / "offsets").is_dir()
    assert not (tmp_path / "unused-checkpoint").exists()
    assert sorted(sink_rows(spark, sink), key=lambda r: r[1]) == expected


def test_a_fresh_query_into_a_file_sink_that_holds_batches_is_refused(tmp_path: Path) -> None:
    """Spark's file sink skips every batch id its _spark_metadata lists: a query with a new checkpoint
    writing there had its first batches dropped without a word."""
    from ingest.spark.pipeline import check_file_sink

    sink, checkpoint = tmp_path / "sink", tmp_path / "checkpoint"
    check_file_sink(str(sink), checkpoint)  # nothing there yet
    (sink / "_spark_metadata").mkdir(parents=True)
    check_file_sink(str(sink), checkpoint)  # no batch listed
    for name in ("0", "1", "9.compact"):
        (sink / "_spark_metadata" / name).write_text("v1\n")
    with pytest.raises(ValueError, match=r"holding batches up to 9 of another query"):
        check_file_sink(f"file://{sink}", checkpoint)
    (checkpoint / "commits").mkdir(parents=True)
    with pytest.raises(ValueError, match="new checkpoint"):
        check_file_sink(str(sink), checkpoint)  # nothing planned or committed yet: still fresh
    (checkpoint / "offsets").mkdir()
    (checkpoint / "offsets" / "0").write_text("v1\n{}\n{}")
    check_file_sink(str(sink), checkpoint)  # killed after its sink wrote batch 0, before the commit
    check_file_sink(str(sink), f"file://{checkpoint}")
    (checkpoint / "commits" / "9").write_text("v1\n{}")
    check_file_sink(str(sink), checkpoint)  # its own query going on
    check_file_sink("s3a://bucket/sink", checkpoint)  # not a local path: not looked at
    check_file_sink(str(sink), "s3a://bucket/checkpoint")  # a checkpoint elsewhere: not looked at
