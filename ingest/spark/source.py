"""The "sluice" PySpark streaming data source: sealed blocks from a block store as a streaming DataFrame.

Usage::

    spark.dataSource.register(SluiceDataSource)
    df = (spark.readStream.format("sluice")
          .option("path", "/var/lib/sluice/blocks")     # root of the block store (WAL)
          .option("streams", "clicks,orders")           # comma-separated stream names
          .option("maxRecordsPerBatch", "100000")       # optional admission control
          .load())

Columns (modelled on Spark's Kafka source; see SCHEMA_DDL):

    key        binary     record key, null when the producer sent none
    value      binary     record payload
    stream     string     stream name                                  (Kafka: topic)
    receiver   int        id of the receiver that sealed the block     (Kafka: partition)
    offset     long       stream offset of the record                  (Kafka: offset)
    timestamp  timestamp  time the receiver took the record, UTC       (Kafka: timestamp)

Offsets are ``{stream: next_block_seq}``: everything of a stream below that block seq belongs to
earlier micro-batches. Block seqs have no gaps, so a batch is the blocks with start[s] <= seq < end[s]
of every stream. Record offsets are not part of the Spark offset; each block knows its first record
offset and the reader derives the per-record ``offset`` column from it.

Blocks leave the store in ``commit``, i.e. only after Spark has recorded the batch as done, so a query
restarted from its checkpoint re-reads an unfinished batch from blocks that are still there. Spark
commits batch N to the source when it plans batch N + 1, that is once new blocks arrive: the last
batch's blocks stay in the store while a stream is idle, and across a restart. A fresh query (no
checkpoint) starts at the first block still in the store, so it reads those again: delivery is
at-least-once across checkpoint loss. One query owns a store's streams:
a second query would release blocks under the first one's feet, which the reader reports as data loss.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import (
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ingest.spark.live_rate import LiveRateCap
from receivers.block import BlockInfo, check_stream_name
from receivers.block_store import BlockStore
from receivers.wal import WalBlockStore

SOURCE_NAME = "sluice"

SCHEMA_DDL = "key BINARY, value BINARY, stream STRING, receiver INT, offset BIGINT, timestamp TIMESTAMP"
"""Output schema as a DDL string; all columns nullable, like the Kafka source's."""

SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("stream", StringType()),
        StructField("receiver", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
    ]
)
"""Output schema as a StructType (the same as SCHEMA_DDL)."""

ARROW_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("stream", pa.string()),
        pa.field("receiver", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
    ]
)
"""The Arrow schema read() yields. PySpark compares it (types and nullability) with the declared schema
converted with timezone UTC, and rejects the batch on any difference (int32 vs int64, ms vs us...)."""

MAX_BLOCKS_PER_PARTITION = 8
MAX_RECORDS_PER_PARTITION = 1_000_000

OPTION_PATH = "path"
OPTION_STREAMS = "streams"
OPTION_MAX_RECORDS = "maxRecordsPerBatch"
OPTION_MIN_PARTITIONS = "minPartitions"
"""Spread each batch's blocks over at least this many partitions (as far as there are blocks)."""
OPTION_RATE_TARGET = "rateTarget"
"""host:port of the Sluice server whose live rate caps each batch (rate x trigger interval)."""
OPTION_TRIGGER_SECONDS = "triggerSeconds"

Offset = dict[str, int]
BlockTuple = tuple[str, int, int, int, int]
"""A BlockInfo as a plain tuple (stream, seq, first_offset, count, receiver): cheap to pickle."""


class DataLossError(RuntimeError):
    """Blocks that a micro-batch must read are no longer in the store."""


class BlockPartition(InputPartition):
    """A run of consecutive blocks of one stream, read by one Spark task."""

    def __init__(self, root: str, blocks: Sequence[BlockTuple]) -> None:
        super().__init__(None)
        self.root = root
        self.blocks = list(blocks)


class SluiceStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches over sealed blocks and reads them as Arrow record batches.

    Spark keeps one instance per query in a long-lived Python worker (offsets, partitions, commit) and
    pickles another into the tasks that call read(); hence no open resources at construction.
    """

    def __init__(self, options: Mapping[str, str]) -> None:
        self.root = _required(options, OPTION_PATH)
        self.streams = parse_streams(_required(options, OPTION_STREAMS))
        self.max_records_per_batch = _positive_int_option(options, OPTION_MAX_RECORDS)
        self.min_partitions = _positive_int_option(options, OPTION_MIN_PARTITIONS) or 1
        self.rate_target = options.get(OPTION_RATE_TARGET) or None
        self.trigger_seconds = float(options.get(OPTION_TRIGGER_SECONDS) or 1.0)
        self._rate_client: LiveRateCap | None = None
        self._store: WalBlockStore | None = None
        self._available_now_target: Offset | None = None

    def __getstate__(self) -> dict[str, Any]:
        # the store holds a lock, which does not pickle; read() opens its own store anyway
        state = self.__dict__.copy()
        state["_store"] = None
        state["_rate_client"] = None
        return state

    @property
    def store(self) -> WalBlockStore:
        if self._store is None:
            # Spark only reads and releases (release() always makes its mark durable before deleting)
            self._store = WalBlockStore(self.root)
        return self._store

    # ---- offsets (driver-side worker) ---------------------------------------------------------

    def initialOffset(self) -> Offset:
        # blocks below the first one present were released (processed by an earlier query) or never
        # existed; 0 when the stream is empty, and partitions() tolerates the missing prefix then
        offsets = {}
        for stream in self.streams:
            present = self.store.blocks(stream)
            offsets[stream] = present[0].seq if present else 0
        return _sorted(offsets)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_records_per_batch is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_records_per_batch)

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:
        end = dict(start)
        pending = {s: self._pending(s, start.get(s, 0)) for s in self.streams}
        live = self._live_cap()
        if live is not None and (
            isinstance(limit, ReadAllAvailable) or (isinstance(limit, ReadMaxRows) and live < limit.max_rows)
        ):
            # the live rate caps every batch (getDefaultReadLimit is asked once per query start):
            # a backlog after a restart never becomes one giant batch, the first batch is bounded too
            limit = ReadMaxRows(live)
        if isinstance(limit, ReadAllAvailable):
            for stream, blocks in pending.items():
                if blocks:
                    end[stream] = blocks[-1].seq + 1
        elif isinstance(limit, ReadMaxRows):
            end.update(_admit(pending, limit.max_rows))
        else:
            raise TypeError(f"sluice source: unsupported read limit {limit!r}")
        return _sorted(end)

    def reportLatestOffset(self) -> Offset:
        latest = {}
        for stream in self.streams:
            blocks = self.store.blocks(stream)
            if blocks:
                latest[stream] = blocks[-1].seq + 1
        return _sorted(latest)

    def prepareForTriggerAvailableNow(self) -> None:
        # Trigger.AvailableNow: read what is there now, in as many batches as the read limit needs
        self._available_now_target = self.reportLatestOffset()

    def partitions(self, start: Offset, end: Offset) -> Sequence[BlockPartition]:
        batch: dict[str, list[BlockInfo]] = {}
        for stream in sorted(end):
            lo, hi = start.get(stream, 0), end[stream]
            if hi <= lo:
                continue
            blocks = [b for b in self.store.blocks(stream, lo) if b.seq < hi]
            _check_complete(stream, lo, hi, blocks)
            batch[stream] = blocks
        # like the Kafka source's minPartitions: a 1 s batch of a few blocks still uses every core
        total = sum(len(blocks) for blocks in batch.values())
        per_partition = max(1, min(MAX_BLOCKS_PER_PARTITION, -(-total // self.min_partitions)))
        return [
            BlockPartition(self.root, run)
            for blocks in batch.values()
            for run in _runs(blocks, per_partition)
        ]

    def commit(self, end: Offset) -> None:
        # Spark has durably recorded every batch up to `end`: the blocks below it are no longer needed
        for stream, next_seq in end.items():
            self.store.release(stream, next_seq)

    # ---- reading (executor-side worker) -------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BlockPartition)
        store = WalBlockStore(partition.root)
        for block in partition.blocks:
            yield from read_block(store, BlockInfo(*block))

    # ---- helpers ------------------------------------------------------------------------------

    def _live_cap(self) -> int | None:
        if self.rate_target is None:
            return None
        if self._rate_client is None:
            self._rate_client = LiveRateCap(self.rate_target)
        return self._rate_client.records_per_batch(self.trigger_seconds)

    def _pending(self, stream: str, from_seq: int) -> list[BlockInfo]:
        blocks = self.store.blocks(stream, from_seq)
        target = self._available_now_target
        if target is not None:
            limit = target.get(stream, from_seq)
            blocks = [b for b in blocks if b.seq < limit]
        return blocks


class SluiceDataSource(DataSource):
    """The "sluice" streaming source; see the module docstring for options and columns."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> SluiceStreamReader:
        if schema != SCHEMA:
            raise ValueError(
                f"sluice source: the schema is fixed ({SCHEMA_DDL}); got {schema.simpleString()}"
            )
        return SluiceStreamReader(self.options)


def read_block(store: BlockStore, block: BlockInfo) -> Iterator[pa.RecordBatch]:
    """The records of `block` as record batches with ARROW_SCHEMA, built column-wise."""
    index = block.first_offset
    for batch in store.read(block):
        n = batch.num_rows
        yield pa.RecordBatch.from_arrays(
            [
                batch.column("key"),
                batch.column("value"),
                pa.repeat(pa.scalar(block.stream, pa.string()), n),
                pa.repeat(pa.scalar(block.receiver, pa.int32()), n),
                pa.array(np.arange(index, index + n, dtype=np.int64)),
                batch.column("timestamp"),
            ],
            schema=ARROW_SCHEMA,
        )
        index += n


def parse_streams(value: str) -> list[str]:
    """Stream names from a comma-separated option value; duplicates dropped, order kept."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise ValueError(f"sluice source: option {OPTION_STREAMS!r} names no stream: {value!r}")
    return [check_stream_name(name) for name in dict.fromkeys(names)]


def _admit(pending: Mapping[str, Sequence[BlockInfo]], max_rows: int) -> Offset:
    """End offsets admitting whole blocks round-robin over the streams, up to max_rows records.

    The first block is admitted whatever its size, so a block larger than the limit cannot stall the
    query. A stream stops at its first block that does not fit, so its admitted blocks stay contiguous.
    """
    queues = {s: deque(blocks) for s, blocks in pending.items() if blocks}
    end: Offset = {}
    rows = 0
    while queues:
        for stream in list(queues):
            queue = queues[stream]
            block = queue[0]
            if end and rows + block.count > max_rows:
                del queues[stream]
                continue
            rows += block.count
            end[stream] = block.seq + 1
            queue.popleft()
            if not queue:
                del queues[stream]
    return end


def _runs(
    blocks: Sequence[BlockInfo], max_blocks: int = MAX_BLOCKS_PER_PARTITION
) -> Iterator[list[BlockTuple]]:
    """Consecutive blocks in runs of at most `max_blocks` blocks / ~MAX_RECORDS_PER_PARTITION."""
    run: list[BlockTuple] = []
    records = 0
    for block in blocks:
        if run and (len(run) >= max_blocks or records + block.count > MAX_RECORDS_PER_PARTITION):
            yield run
            run, records = [], 0
        run.append((block.stream, block.seq, block.first_offset, block.count, block.receiver))
        records += block.count
    if run:
        yield run


def _check_complete(stream: str, lo: int, hi: int, blocks: Sequence[BlockInfo]) -> None:
    """Raise DataLossError unless `blocks` are the seqs up to hi - 1 without gaps.

    A missing prefix is expected only from seq 0: the initial offset of a stream that was empty when
    the query started, whose earlier blocks had been released before.
    """
    have = [b.seq for b in blocks]
    first = have[0] if lo == 0 and have else lo
    if have != list(range(first, hi)):
        raise DataLossError(
            f"sluice source: stream {stream!r} needs blocks {first}..{hi - 1} but the store has {have}; "
            "were they released by another query?"
        )


def _required(options: Mapping[str, str], name: str) -> str:
    value = options.get(name)
    if not value:
        raise ValueError(f"sluice source: option {name!r} is required")
    return value


def _positive_int_option(options: Mapping[str, str], name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"sluice source: option {name!r} must be a positive integer, got {value!r}")
    return number


def _sorted(offset: Mapping[str, int]) -> Offset:
    # Spark compares offsets by their JSON text: keep key order stable
    return dict(sorted(offset.items()))
