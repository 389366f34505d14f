"""The "sluice" PySpark streaming data source: sealed blocks from a block store as a streaming DataFrame.

Usage::

    spark.dataSource.register(SluiceDataSource)
    df = (spark.readStream.format("sluice")
          .option("path", "/var/lib/sluice/blocks")     # root of the block store (WAL)
          .option("streams", "clicks,orders")           # comma-separated stream names
          .option("maxRecordsPerBatch", "100000")       # optional admission control
          .option("rateTarget", "sluice.example.com:50051")  # optional: cap batches at the live rate
          .option("rateCaFile", "/etc/sluice/ca.crt")   # TLS to it; rateCertFile/rateKeyFile: mTLS
          .option("rateTokenFile", "/etc/sluice/pipeline.token")  # an operator's token
          .option("startingOffsets", '{"clicks": 1200}')  # optional: where a new query starts
          .load())

With option ``receivers`` ("ID=HOST:PORT,...") instead of ``path``, the source reads a cluster's
receiver nodes over the network, with per-partition offsets: see ingest.spark.cluster_source.

An option the source does not take (OPTIONS lists those it does, in any case) fails the query's start,
naming it and the known one it looks like: a misspelt ``maxRecordPerBatch`` is not ignored.

Columns (Spark's Kafka source's names and types, so Kafka pipelines read it unchanged; see SCHEMA_DDL):

    key            binary     record key, null when the producer sent none
    value          binary     record payload
    topic          string     stream name
    partition      int        id of the receiver that sealed the block (cluster mode: the owner node)
    offset         long       offset of the record in its stream (cluster mode: in its partition)
    timestamp      timestamp  time the receiver took the record, UTC
    timestampType  int        always 1 (Kafka's LogAppendTime: set by the broker, not the producer)

Kafka's ``headers`` column (includeHeaders=true) is not there: records carry no headers yet.

Offsets are ``{stream: next record offset}``, like the Kafka source's: everything of a stream below
that offset belongs to earlier micro-batches. A fresh query starts at ``startingOffsets`` (JSON, as the
Kafka source's option) for the streams it names, else at the first block still in the store.

With ``rateTarget``, the server's answer before each batch can hold batches back while the service
stops the query at a batch boundary (RateStatus.hold_batches, for a pipeline swap); with
``followServerStreams`` ("true", as `sluice serve` runs its own query) it also names the streams to read
(RateStatus.pipeline_streams: streams added at run time come in, removed ones leave). A stream that
leaves keeps its offset in every later offset, frozen, so a stream added back resumes where it stopped
and nothing is read twice.

A record offset is a position in the stream's block log:
blocks hold consecutive offsets without gaps, each knows its first one, so a batch is the slices of
the blocks that cover [start[s], end[s]) of every stream. Admission control is therefore exact to the
record (ReadMaxRows(n) admits n records, cutting a block if need be), and a batch is split into
partitions of about equal record counts whatever the block sizes.

Blocks leave the store only after Spark has recorded the batch as done, so a query restarted from its
checkpoint re-reads an unfinished batch from blocks that are still there. ``commit`` releases them, but
Spark commits batch N to the source only when it plans batch N + 1, that is once new blocks arrive: on
its own the last batch's blocks would stay while a stream is idle, and a disk budget they fill would
stall intake for good. So the Sluice driver (ingest.driver) releases them as soon as the batch is in
Spark's commit log, from the listener's progress event; ``commit`` is then a no-op, kept for queries
run without the driver. A fresh query (no checkpoint) starts at the first block still in the store, so
it reads those again: delivery is at-least-once across checkpoint loss. One query owns a store's
streams: a second query would release blocks under the first one's feet, which the reader reports as
data loss.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import time
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
from receivers.block import BlockInfo, LogSpan, plain_arrivals, uncovered
from receivers.block import countable as _countable
from receivers.block_store import BlockStore, release_below
from receivers.names import check_stream_name
from receivers.wal import LOST_FILE, WalBlockStore, WalError
from sluice_client.credentials import Credentials, CredentialsError

log = logging.getLogger(__name__)

SOURCE_NAME = "sluice"

SCHEMA_DDL = (
    "key BINARY, value BINARY, topic STRING, partition INT, offset BIGINT, timestamp TIMESTAMP, "
    "timestampType INT"
)
"""Output schema as a DDL string: the Kafka source's columns (without headers), all nullable like its."""

LOG_APPEND_TIME = 1
"""The `timestampType` of every record: Kafka's LogAppendTime (0 is CreateTime, set by the producer); the
timestamp is when the receiver took the record."""

SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
    ]
)
"""Output schema as a StructType (the same as SCHEMA_DDL)."""

ARROW_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary()),
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("offset", pa.int64()),
        pa.field("timestamp", pa.timestamp("us", tz="UTC")),
        pa.field("timestampType", pa.int32()),
    ]
)
"""The Arrow schema read() yields. PySpark compares it (types and nullability) with the declared schema
converted with timezone UTC, and rejects the batch on any difference (int32 vs int64, ms vs us...)."""

MAX_RECORDS_PER_PARTITION = 1_000_000

OPTION_PATH = "path"
OPTION_RECEIVERS = "receivers"
"""A cluster's receiver nodes, "ID=HOST:PORT,...", instead of `path`: see ingest.spark.cluster_source."""
OPTION_STREAMS = "streams"
OPTION_FOLLOW_STREAMS = "followServerStreams"
""""true": read the streams the rate server names before each batch instead of the `streams` option's."""
OPTION_STARTING_OFFSETS = "startingOffsets"
"""JSON {stream: record offset}: where a fresh query starts reading those streams (a swapped-in query
starts at the last one's committed end); more streams than `streams` are carried, frozen."""
OPTION_MAX_RECORDS = "maxRecordsPerBatch"
OPTION_MIN_PARTITIONS = "minPartitions"
"""Spread each batch's blocks over at least this many partitions (as far as there are blocks), each of at
least minPartitionRecords records."""
OPTION_MIN_PARTITION_RECORDS = "minPartitionRecords"
"""A batch is cut into more partitions (up to minPartitions) only as far as each gets at least this many
records (default 1). Every partition is a task, and a task has a fixed cost that a small batch pays for
nothing: see PARTITION_RECORDS."""
PARTITION_RECORDS = 1
"""The minPartitionRecords start_query gives: 1, every batch spread over the cores. A larger value saves
a task's fixed cost on small batches (on 2 cores, Parquet sink, 100 B records: about 60 ms of CPU a
task; a 25,000-record batch took 6.3-7.1 us of CPU per record in one partition and 9.2-9.3 in two), but
it runs a costly pipeline's small batches on one core: `bench/control_loop.py --profile jumps` (20 us a
record) with 100,000 measured half the capacity for small batches, and the model estimator, which fits
one per-record cost for every batch size, swung between the two speeds (76 s peak delay and 15 starved
batches in one run; 2.2 s and none with 1, the next run). A pipeline cheap per record can set it
(source_options)."""
OPTION_RATE_TARGET = "rateTarget"
"""host:port of the Sluice server whose live rate caps each batch (rate x trigger interval)."""
OPTION_TRIGGER_SECONDS = "triggerSeconds"
OPTION_RATE_CA_FILE = "rateCaFile"
"""PEM CA file the rate server's certificate must chain to: the live rate is asked over TLS."""
OPTION_RATE_CERT_FILE = "rateCertFile"
"""PEM client certificate (with rateKeyFile) for a rate server that wants mutual TLS."""
OPTION_RATE_KEY_FILE = "rateKeyFile"
OPTION_DRIVER_ID = "driverId"
"""A cluster driver's id (ingest.cluster_driver.driver_id): the cluster source's ListPartitions and
ReleaseBlocks carry it, so the nodes hold them to that driver's lease (receivers.blocks_service)."""
OPTION_FAIL_ON_DATA_LOSS = "failOnDataLoss"
""""true" (the default) fails the query with DataLossError when a stream's log (cluster mode: a
partition's, ingest.spark.cluster_source) was lost or replaced under its checkpoint; "false" warns and
reads the new log from its start (Spark's Kafka source has the same option)."""
OPTION_RATE_TOKEN_FILE = "rateTokenFile"  # noqa: S105 - an option's name
"""A file holding the bearer token of a principal with the operator role (GetRate, StartBatch): a
path, not the token, so that the token never shows in the query's plan, UI or logs. Read by the
worker that plans batches, so it must be there (on the driver's host)."""
RATE_CREDENTIAL_OPTIONS = (
    OPTION_RATE_CA_FILE,
    OPTION_RATE_CERT_FILE,
    OPTION_RATE_KEY_FILE,
    OPTION_RATE_TOKEN_FILE,
)
"""The files of Credentials.from_files (ca_file, cert_file, key_file, token_file), in its order."""
OPTIONS = (
    OPTION_PATH,
    OPTION_RECEIVERS,
    OPTION_STREAMS,
    OPTION_FOLLOW_STREAMS,
    OPTION_STARTING_OFFSETS,
    OPTION_MAX_RECORDS,
    OPTION_MIN_PARTITIONS,
    OPTION_MIN_PARTITION_RECORDS,
    OPTION_RATE_TARGET,
    OPTION_TRIGGER_SECONDS,
    *RATE_CREDENTIAL_OPTIONS,
    OPTION_DRIVER_ID,
    OPTION_FAIL_ON_DATA_LOSS,
)
"""Every option the source takes (Spark hands them over case-insensitively): any other is refused."""

CATCH_UP_MIN_SHARE = 0.5
"""A catch-up trigger whose batch would hold less than this share of the cap waits for the grid.

Spark's ProcessingTime trigger keeps a grid (multiples of the interval since the epoch): a batch that
ends past a grid point is followed at once by the next one, off the grid, which then holds only what
arrived since the last one started, say 0.3 s worth. Under a live cap that is a batch paying the whole
fixed cost of a trigger for a fraction of the records (seen: 3k and 22k records among 80k ones, each
right after the rate rose). Such a batch is deferred to the next grid point, where it holds a full
interval's arrivals: what Spark's Kafka source offers as minOffsetsPerTrigger with maxTriggerDelay."""
CATCH_UP_WINDOW = 0.75
"""Only a trigger less than this many intervals after the last batch was planned is deferred: that
bounds the wait, whatever the trigger (a triggerSeconds option that is not the query's trigger). Nor
is one deferred unless the server answered for this trigger: a stopped server (`sluice serve` drains
Spark with processAllAvailable after stopping its server) takes no more records, and a trigger that
finds no new data would end processAllAvailable with records left."""
ON_GRID = 0.1
"""A trigger within this share of the interval (at most 0.1 s) after a grid point is on the grid."""

Offset = dict[str, int]
"""{stream: next record offset}: the offset as the reader plans with it. Spark gets and gives it with
the streams' incarnations under INCARNATIONS (with_incarnations, incarnations_of)."""
INCARNATIONS = "_incarnations"
"""The key of an offset's incarnations ({"_incarnations": {stream: id}}; the cluster source's are
{"stream/owner": id}): no stream's name (a stream's starts with a letter or digit)."""
BlockTuple = tuple[str, int, int, int, int]
"""A BlockInfo as a plain tuple (stream, seq, first_offset, count, receiver): cheap to pickle."""
SliceTuple = tuple[str, int, int, int, int, int, int]
"""Rows [lo, hi) of a block: (stream, seq, first_offset, count, receiver, lo, hi), cheap to pickle."""


class DataLossError(RuntimeError):
    """Blocks that a micro-batch must read are no longer in the store, or a stream's log was lost or
    replaced under the query's checkpoint (the option failOnDataLoss, default true)."""


class BlockPartition(InputPartition):
    """Slices of consecutive blocks (rows [lo, hi) of each), read by one Spark task."""

    def __init__(self, root: str, slices: Sequence[SliceTuple]) -> None:
        super().__init__(None)
        self.root = root
        self.slices = list(slices)

    @property
    def records(self) -> int:
        return sum(hi - lo for *_, lo, hi in self.slices)


class LiveCapPlanning:
    """Batch planning under a read limit and the live rate cap, shared by the single-node reader and
    the cluster one (ingest.spark.cluster_source): the live cap, the catch-up deferral, the StartBatch
    report. The reader sets the attributes below in its __init__."""

    rate_target: str | None
    rate_files: tuple[str | None, ...]
    trigger_seconds: float
    _rate_client: LiveRateCap | None
    _planned_at: float | None
    _available_now_target: Any

    def _read_planning_options(self, options: Mapping[str, str]) -> None:
        """The options both readers take: streams, limits, the live rate server and its files."""
        self.streams = parse_streams(_required(options, OPTION_STREAMS))
        self.max_records_per_batch = _positive_int_option(options, OPTION_MAX_RECORDS)
        self.min_partitions = _positive_int_option(options, OPTION_MIN_PARTITIONS) or 1
        self.min_partition_records = _positive_int_option(options, OPTION_MIN_PARTITION_RECORDS) or 1
        self.rate_target = options.get(OPTION_RATE_TARGET) or None
        # paths only: the files are read where the rate is asked (see _live_cap)
        self.rate_files = tuple(options.get(option) or None for option in RATE_CREDENTIAL_OPTIONS)
        self.trigger_seconds = _seconds_option(options, OPTION_TRIGGER_SECONDS, 1.0)
        self.starting_offsets = self._parse_starting_offsets(options.get(OPTION_STARTING_OFFSETS))
        self.follow_streams = parse_bool_option(options, OPTION_FOLLOW_STREAMS, default=False)
        self._rate_client = None
        self._planned_at = None  # time.monotonic() of the last batch planned with records

    @staticmethod
    def _parse_starting_offsets(value: str | None) -> Offset:
        """The startingOffsets option as this reader's offsets ({key: record offset})."""
        return parse_starting_offsets(value)

    def _plan(
        self,
        start: Mapping[str, int],
        available: Mapping[str, int],
        limit: ReadLimit,
        live: int | None,
        phase: float,
        *,
        gaps: Mapping[str, Sequence[tuple[int, int]]] | None = None,
    ) -> Offset:
        """The end offset of the batch planned now over `available` ({key: available end}; a key is a
        stream, or a cluster's partition): the read limit or the live cap, water-filled over the keys
        by _stream_weights; deferred (end = start) when it is a catch-up trigger too small to run.
        `gaps` ({key: sorted disjoint [a, b)}) are offsets no log holds (records lost, passed with
        failOnDataLoss=false): they take none of the budget, nor count as the batch's records."""
        gaps = gaps or {}
        if live is not None and (
            isinstance(limit, ReadAllAvailable) or (isinstance(limit, ReadMaxRows) and live < limit.max_rows)
        ):
            # the live rate caps every batch (getDefaultReadLimit is asked once per query start):
            # a backlog after a restart never becomes one giant batch, the first batch is bounded too
            limit = ReadMaxRows(live)
        if isinstance(limit, ReadAllAvailable):
            end = _sorted(available)
        elif isinstance(limit, ReadMaxRows):
            end = _sorted(_admit(start, available, limit.max_rows, self._stream_weights(), gaps))
        else:
            raise TypeError(f"sluice source: unsupported read limit {limit!r}")
        records = sum(_countable(start.get(s, 0), end[s], gaps.get(s, ())) for s in end)
        if records == 0:
            return end
        now = time.monotonic()
        if live is not None and self._catch_up_too_small(records, limit, phase, now):
            log.debug("catch-up trigger with %d records: deferred to the grid", records)
            return _sorted({s: start.get(s, 0) for s in end})  # no new data: Spark waits for the grid
        self._planned_at = now
        if self._rate_client is not None:
            # Spark runs a batch now: the server's watchdog looks at it while it overruns
            backlog = sum(_countable(end.get(s, 0), available[s], gaps.get(s, ())) for s in available)
            self._rate_client.start_batch(records, backlog)
        return end

    def _catch_up_too_small(self, records: int, limit: ReadLimit, phase: float, now: float) -> bool:
        """Whether this trigger, under a live cap, is a catch-up one, off the grid and soon after the
        last batch, whose batch would hold under CATCH_UP_MIN_SHARE of the cap in force (see
        CATCH_UP_WINDOW)."""
        return (
            self._rate_client is not None
            and self._rate_client.answered  # a server that steers; not one stopped to drain
            and isinstance(limit, ReadMaxRows)  # the live cap or a smaller limit applies
            and records < CATCH_UP_MIN_SHARE * limit.max_rows
            and self._available_now_target is None
            and self._planned_at is not None
            and now - self._planned_at < CATCH_UP_WINDOW * self.trigger_seconds
            and phase >= min(ON_GRID * self.trigger_seconds, 0.1)
        )

    def _live_cap(self) -> int | None:
        if self.rate_target is None:
            return None
        if self._rate_client is None:
            try:  # read here, in the worker that plans batches: no token travels in a pickled reader
                ca_file, cert_file, key_file, token_file = self.rate_files
                credentials = Credentials.from_files(
                    ca_file=ca_file, cert_file=cert_file, key_file=key_file, token_file=token_file
                )
            except CredentialsError as exc:
                raise ValueError(f"sluice source: the rate server's credentials: {exc}") from None
            self._rate_client = LiveRateCap(self.rate_target, credentials=credentials)
        return self._rate_client.records_per_batch(self.trigger_seconds)

    def _stream_weights(self) -> Mapping[str, float] | None:
        return self._rate_client.weights if self._rate_client is not None else None

    def _current_streams(self) -> list[str]:
        """The streams to read now: the server's set as of its last answer when following it, else the
        option's."""
        live = self._rate_client.streams if self._rate_client is not None and self.follow_streams else None
        return live if live else self.streams

    def _held(self) -> bool:
        """Whether the server holds batches back (it is stopping the query at a batch boundary)."""
        return self._rate_client is not None and self._rate_client.hold


class SluiceStreamReader(LiveCapPlanning, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches over sealed blocks and reads them as Arrow record batches.

    Spark keeps one instance per query in a long-lived Python worker (offsets, partitions, commit) and
    pickles another into the tasks that call read(); hence no open resources at construction.
    """

    def __init__(self, options: Mapping[str, str]) -> None:
        self.root = _required(options, OPTION_PATH)
        self._read_planning_options(options)
        self.starting_incarnations = incarnations_of(json_option(options.get(OPTION_STARTING_OFFSETS) or ""))
        self.fail_on_data_loss = parse_fail_on_data_loss(options)
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

    def initialOffset(self) -> dict[str, Any]:
        # records below the first block present were released (processed by an earlier query) or
        # never existed; 0 when the stream is empty, and partitions() tolerates the missing prefix then
        offsets = dict(self.starting_offsets)
        for stream in self.streams:
            if stream not in offsets:
                present = self.store.blocks(stream)
                offsets[stream] = present[0].first_offset if present else 0
        # the logs' incarnations; the starting offsets' own ones (a swap's), which the first plan checks
        held = {s: i for s in offsets if (i := self.store.incarnation(s))}
        return with_incarnations(offsets, {**held, **self.starting_incarnations})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_records_per_batch is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_records_per_batch)

    def latestOffset(self, start: Mapping[str, Any], limit: ReadLimit) -> dict[str, Any]:
        phase = time.time() % self.trigger_seconds if self.trigger_seconds > 0 else 0.0
        live = self._live_cap()  # first: it may wait for the last batch's metrics
        offered, known = plain_offset(start), incarnations_of(start)
        if self._held():
            # no new data: the batch that runs now is the query's last
            return with_incarnations(offered, known)
        current = self._current_streams()
        held = {s: self.store.incarnation(s) for s in current}
        lost = self._check_lost(offered, known, held)
        # a stream whose log was replaced (failOnDataLoss=false) starts at the new log's first record
        begun = {**offered, **{s: self._floor(s) for s in lost}}
        # one look at each log for both below: its ends and gaps (not a list of its blocks)
        spans = {s: self.store.span(s) for s in current}
        available = {s: self._available_end(s, begun.get(s, 0), spans[s]) for s in current}
        # records in no block (gone from the log: lost.json's, or a gap --fsync off left) take none of
        # the read limit's or the live cap's budget (receivers.block.gaps on the log's blocks)
        gaps = {s: _gaps(spans[s], begun.get(s, 0), available[s]) for s in current}
        # a stream not read now keeps its offset, frozen: added back, it resumes there
        end = _sorted({**begun, **self._plan(begun, available, limit, live, phase, gaps=gaps)})
        # a log's incarnation joins the offset with a batch that differs anyway (one read from it, or
        # a replaced log's): an offset from before incarnations makes no empty batch to get them
        joined = {
            s: i for s, i in held.items() if i and (s in lost or s in known or end[s] != offered.get(s))
        }
        return with_incarnations(end, {**{s: i for s, i in known.items() if s not in lost}, **joined})

    def _check_lost(self, offered: Offset, known: Mapping[str, str], held: Mapping[str, str]) -> set[str]:
        """The streams of `held` ({stream: its log's incarnation now}) whose log was lost or replaced
        under the offset the query read (`offered`, of the logs `known`): DataLossError naming them, or
        with failOnDataLoss=false a warning (they start again at the new log's first record). Lost: the
        incarnation is another than the offset's (read past 0), or the log ends below the offset."""
        lost: dict[str, str] = {}
        for stream, new in sorted(held.items()):
            offset, old = offered.get(stream, 0), known.get(stream, "")
            log_end = self._log_end(stream)
            if old and new and old != new:
                if offset == 0:
                    continue  # nothing read of the old log: the new one is read from its start
                lost[stream] = (
                    f"the log of stream {stream!r} ({self.root}/{stream}) is now incarnation {new} (it "
                    f"ends at offset {log_end}), and the query read incarnation {old} up to offset {offset}"
                )
            elif log_end < offset:
                lost[stream] = (
                    f"the log of stream {stream!r} ({self.root}/{stream}, incarnation {new or 'unknown'}) "
                    f"ends at offset {log_end}, and the query's offset is {offset} (of incarnation "
                    f"{old or 'unknown'}: its checkpoint's, or startingOffsets)"
                )
        if lost:
            self._lost("; ".join(lost.values()), "it reads the new log from its start")
        return set(lost)

    def _lost(self, what: str, instead: str) -> None:
        """A stream's log was lost under the checkpoint (`what`): DataLossError, or with
        failOnDataLoss=false a WARNING saying what the query does `instead`."""
        if self.fail_on_data_loss:
            raise DataLossError(
                f"sluice source: data loss: {what}. That log was lost or replaced (its data dir, or the "
                "stream's folder in it, started afresh while the query's checkpoint survived, e.g. a "
                "pipeline's own checkpointLocation outside the data dir): records of the old log the "
                "query had not read are not in it, and offsets the query read are given again to other "
                "records, which it would skip. Set the source option failOnDataLoss=false (`sluice "
                "serve --no-fail-on-data-loss`) to read the new log from its start instead, or start "
                "the query on a new checkpoint"
            )
        log.warning("sluice source: data loss: %s. failOnDataLoss=false: %s", what, instead)

    def _hole(
        self, stream: str, lo: int, hi: int, blocks: Sequence[BlockInfo], holes: Sequence[tuple[int, int]]
    ) -> None:
        """Records [lo, hi) of `stream` planned for a batch, `holes` of them in no block: DataLossError,
        or with failOnDataLoss=false a WARNING (the batch reads what is there). A hole below the log's
        released mark was released by another query; above it, it is a gap in the log itself: blocks
        a start under --fsync off (or with --accept-wal-damage) went on without, with an ERROR. Before,
        either stopped the query at every start, whatever failOnDataLoss said."""
        released = self.store.released_offset(stream)
        missing = ", ".join(f"{a}..{b - 1}" for a, b in holes)
        why = (
            "released: is another query reading this data dir?"
            if all(b <= released for _, b in holes)
            else "gone from its log: the server's start said so in an ERROR and counted them in "
            "sluice_wal_lost_blocks_total" + self._recorded_lost(stream, holes)
        )
        have = [(b.first_offset, b.end_offset) for b in blocks]
        what = (
            f"stream {stream!r} needs records {lo}..{hi - 1} but the store's blocks cover "
            f"{have or 'nothing'}: records {missing} are {why}"
        )
        if self.fail_on_data_loss:
            raise DataLossError(
                f"sluice source: data loss: {what}. Set the source option failOnDataLoss=false (`sluice "
                "serve --no-fail-on-data-loss`) to read the records there and skip the missing ones"
            )
        log.warning(
            "sluice source: data loss: %s. failOnDataLoss=false: the batch reads the %d records there",
            what,
            sum(min(hi, b.end_offset) - max(lo, b.first_offset) for b in blocks),
        )

    def _recorded_lost(self, stream: str, holes: Sequence[tuple[int, int]]) -> str:
        """Where the lost records among `holes` were recorded, if a start with --accept-wal-damage went
        on without them ("": none were, or the record cannot be read)."""
        try:
            recorded = self.store.lost_blocks(stream)
        except (WalError, OSError):
            return ""
        for lost in recorded:
            end = lost.end_offset if lost.end_offset is not None else math.inf
            if any(a < end and b > lost.first_offset for a, b in holes):
                return (
                    f" (a start with --accept-wal-damage went on without them, and recorded them in "
                    f"{self.root}/{stream}/{LOST_FILE})"
                )
        return ""

    def _floor(self, stream: str) -> int:
        """The offset of the first record of `stream` still in its log (0 for an empty new log)."""
        span = self.store.span(stream)
        return span.first if span is not None else self.store.released_offset(stream)

    def _log_end(self, stream: str) -> int:
        """The offset after the last record the log of `stream` ever held (released ones included)."""
        span = self.store.span(stream)  # each plan, each stream: not a list of every block
        return max(self.store.released_offset(stream), span.end if span is not None else 0)

    def reportLatestOffset(self) -> Offset:
        # what is there now: Spark reports it as the source's latestOffset in the query's progress (and
        # does nothing else with it). A position, as every offset: the records a capped batch left
        # behind are those the log holds in [end, latest), a gap inside it none (ingest.driver's
        # batch_metrics counts them so)
        latest = {}
        for stream in self._current_streams():
            span = self.store.span(stream)
            if span is not None:
                latest[stream] = span.end
        return _sorted(latest)

    def prepareForTriggerAvailableNow(self) -> None:
        # Trigger.AvailableNow: read what is there now, in as many batches as the read limit needs
        self._available_now_target = self.reportLatestOffset()

    def partitions(self, start: Mapping[str, Any], end: Mapping[str, Any]) -> Sequence[BlockPartition]:
        begun, ends = plain_offset(start), plain_offset(end)
        was, now = incarnations_of(start), incarnations_of(end)
        slices: list[SliceTuple] = []
        for stream in sorted(ends):
            lo, hi = begun.get(stream, 0), ends[stream]
            held = self.store.incarnation(stream) if hi > lo or now.get(stream) else ""
            if now.get(stream) and held and held != now[stream]:
                # a batch planned on a log lost since (a restarted query's unfinished batch)
                self._lost(
                    f"the log of stream {stream!r} ({self.root}/{stream}) is now incarnation {held}, and "
                    f"the batch planned records {lo}..{hi - 1} of incarnation {now[stream]}",
                    f"this batch reads nothing of stream {stream!r}, the next one the new log from its start",
                )
                continue
            if was.get(stream) and now.get(stream) and was[stream] != now[stream]:
                lo = min(self._floor(stream), hi)  # a replaced log (failOnDataLoss=false): from its start
            elif hi < lo:
                # a log now ending below the start (failOnDataLoss=false; same or unknown incarnation):
                # latestOffset planned it from the log's first record, as the cluster source does
                lo = min(self._floor(stream), hi)
            if hi <= lo:
                continue
            blocks = [b for b in self.store.blocks(stream) if b.end_offset > lo and b.first_offset < hi]
            holes = _holes(lo, hi, blocks)
            if holes:
                self._hole(stream, lo, hi, blocks, holes)
            for b in blocks:
                first, last = max(lo, b.first_offset), min(hi, b.end_offset)
                slices.append(
                    (
                        stream,
                        b.seq,
                        b.first_offset,
                        b.count,
                        b.receiver,
                        first - b.first_offset,
                        last - b.first_offset,
                    )
                )
        return [
            BlockPartition(self.root, part)
            for part in _balanced(slices, self.min_partitions, self.min_partition_records)
        ]

    def commit(self, end: Mapping[str, Any]) -> None:
        # Spark has durably recorded every batch up to `end`: the blocks wholly below it are done (the
        # driver has usually released them already, on the batch's progress event: then this is a no-op);
        # of a log of another incarnation than the offset's, nothing
        plain = plain_offset(end)
        release_below(self.store, list(plain), plain, incarnations_of(end))

    # ---- reading (executor-side worker) -------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BlockPartition)
        store = WalBlockStore(partition.root)
        for stream, seq, first_offset, count, receiver, lo, hi in partition.slices:
            yield from read_block(store, BlockInfo(stream, seq, first_offset, count, receiver), lo, hi)

    # ---- helpers ------------------------------------------------------------------------------

    def _available_end(self, stream: str, start: int, span: LogSpan | None) -> int:
        """Offset after the last record of `stream` (whose log's blocks span `span`) that a batch from
        `start` may read."""
        end = max(start, span.end) if span is not None else start
        target = self._available_now_target
        if target is not None:
            end = min(end, max(start, target.get(stream, start)))
        return end


class SluiceDataSource(DataSource):
    """The "sluice" streaming source; see the module docstring for options and columns."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def schema(self) -> StructType:
        return SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        if schema != SCHEMA:
            raise ValueError(
                f"sluice source: the schema is fixed ({SCHEMA_DDL}); got {schema.simpleString()}"
            )
        check_option_names(self.options)
        has_path = bool(self.options.get(OPTION_PATH))
        has_receivers = bool(self.options.get(OPTION_RECEIVERS))
        if has_path == has_receivers:
            raise ValueError(
                f"sluice source: give exactly one of option {OPTION_PATH!r} (a block store on this host) "
                f"and option {OPTION_RECEIVERS!r} (a cluster's receiver nodes, 'ID=HOST:PORT,...')"
            )
        if has_receivers:
            from ingest.spark.cluster_source import ClusterStreamReader  # noqa: PLC0415 - it imports this module

            return ClusterStreamReader(self.options)
        return SluiceStreamReader(self.options)


def read_block(
    store: BlockStore, block: BlockInfo, lo: int = 0, hi: int | None = None
) -> Iterator[pa.RecordBatch]:
    """Rows [lo, hi) of `block` (all by default) as record batches with ARROW_SCHEMA, column-wise."""
    hi = block.count if hi is None else hi
    row = 0  # block row of the current batch's first row
    for batch in store.read(block):
        n = batch.num_rows
        a, b = max(lo, row), min(hi, row + n)
        if a < b:
            part = batch.slice(a - row, b - a)
            yield positioned(part, block.stream, block.receiver, block.first_offset + a)
        row += n
        if row >= hi:
            return


def positioned(part: pa.RecordBatch, stream: str, receiver: int, first: int) -> pa.RecordBatch:
    """Block rows (BLOCK_SCHEMA) as ARROW_SCHEMA rows: their stream as topic, receiver as partition, and
    offsets (`first` on)."""
    n = part.num_rows
    return pa.RecordBatch.from_arrays(
        [
            part.column("key"),
            part.column("value"),
            pa.repeat(pa.scalar(stream, pa.string()), n),
            pa.repeat(pa.scalar(receiver, pa.int32()), n),
            pa.array(np.arange(first, first + n, dtype=np.int64)),
            plain_arrivals(part.column("timestamp")),
            pa.repeat(pa.scalar(LOG_APPEND_TIME, pa.int32()), n),
        ],
        schema=ARROW_SCHEMA,
    )


def check_option_names(options: Mapping[str, str]) -> None:
    """ValueError naming an option the source does not take (and the one it looks like): a misspelt
    one (maxRecordPerBatch; the case does not matter) was ignored without a word, the query running
    without the limit or check it asked for."""
    known = {name.lower(): name for name in OPTIONS}
    for name in options:
        if name.lower() in known:
            continue
        near = difflib.get_close_matches(name.lower(), list(known), n=1, cutoff=0.7)
        hint = f" (did you mean {known[near[0]]!r}?)" if near else ""
        raise ValueError(
            f"sluice source: unknown option {name!r}{hint}; the options are {', '.join(OPTIONS)}"
        )


def parse_streams(value: str) -> list[str]:
    """Stream names from a comma-separated option value; duplicates dropped, order kept."""
    names = [part.strip() for part in value.split(",") if part.strip()]
    if not names:
        raise ValueError(f"sluice source: option {OPTION_STREAMS!r} names no stream: {value!r}")
    return [check_stream_name(name) for name in dict.fromkeys(names)]


def json_option(value: str) -> object:
    """An option's JSON value, or None when it is not JSON (the caller names the option)."""
    try:
        return json.loads(value)
    except ValueError:
        return None


def incarnations_of(offset: object) -> dict[str, str]:
    """The incarnations an offset names under INCARNATIONS ({} for one without: from before they were
    kept, or of a store whose logs have none)."""
    table = offset.get(INCARNATIONS) if isinstance(offset, dict) else None
    if not isinstance(table, dict):
        return {}
    return {k: v for k, v in table.items() if isinstance(k, str) and isinstance(v, str) and v}


def plain_offset(offset: Mapping[str, Any]) -> Offset:
    """The single-node source's offset without its incarnations: {stream: record offset}."""
    return {k: v for k, v in offset.items() if k != INCARNATIONS}


def with_incarnations(offset: Mapping[str, int], incarnations: Mapping[str, str]) -> dict[str, Any]:
    """`offset` ({stream: record offset}) sorted, and the incarnations of its streams' logs (the known
    ones) under INCARNATIONS, last, sorted: Spark compares offsets by their JSON text."""
    out: dict[str, Any] = dict(_sorted(offset))
    known = {s: incarnations[s] for s in sorted(incarnations) if s in offset and incarnations[s]}
    if known:
        out[INCARNATIONS] = known
    return out


def parse_fail_on_data_loss(options: Mapping[str, str]) -> bool:
    """The failOnDataLoss option: "true" (the default) or "false"."""
    return parse_bool_option(options, OPTION_FAIL_ON_DATA_LOSS, default=True)


def parse_bool_option(options: Mapping[str, str], name: str, *, default: bool) -> bool:
    """A true/false option (any case; absent or empty: `default`); anything else is a ValueError naming
    it, not a silent false ("yes", "1" or a typo would otherwise turn the option off)."""
    value = options.get(name)
    text = (value or str(default)).strip().lower()
    if text not in {"true", "false"}:
        raise ValueError(f"sluice source: option {name!r} must be true or false, got {value!r}")
    return text == "true"


def parse_starting_offsets(value: str | None) -> Offset:
    """The startingOffsets option: JSON {stream: record offset >= 0}, maybe with the incarnations of
    those streams' logs under INCARNATIONS (incarnations_of); {} when absent."""
    if not value:
        return {}
    parsed = json_option(value)
    if isinstance(parsed, dict):
        parsed = plain_offset(parsed)
    if not isinstance(parsed, dict) or not all(
        isinstance(k, str) and type(v) is int and v >= 0 for k, v in parsed.items()
    ):
        raise ValueError(
            f"sluice source: option {OPTION_STARTING_OFFSETS!r} must be a JSON object of stream -> "
            f"record offset >= 0, got {value!r}"
        )
    return _sorted({check_stream_name(k): v for k, v in parsed.items()})


def _admit(
    start: Mapping[str, int],
    available: Mapping[str, int],
    max_rows: int,
    weights: Mapping[str, float] | None = None,
    gaps: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> Offset:
    """End offsets admitting at most max_rows records (at least 1 when any is there), shared out over
    the streams that have records by their weights (the operator's --stream-weight, as the server
    splits intake; 1 each when unknown): a stream needing less than its share leaves the rest to the
    others (water-filling), so no stream starves another, and a backlog drains in the proportions it
    was taken in. Offsets in a stream's `gaps` (records gone from its log, which no batch reads) are
    no records: they take none of the budget, and an end lands past a gap its records reach (before,
    a gap of G records took G / max_rows batches that read nothing)."""
    gaps = gaps or {}
    want = {s: _countable(start.get(s, 0), available[s], gaps.get(s, ())) for s in available}
    end = {s: start.get(s, 0) for s in available}
    weight = {s: _weight(weights, s) for s in want}
    budget = max(1, max_rows)
    # least wanted per weight first: each takes at most its weighted part of what is left
    hungry = sorted((s for s in want if want[s] > 0), key=lambda s: want[s] / weight[s])
    while hungry and budget > 0:
        total = sum(weight[s] for s in hungry)
        stream = hungry.pop(0)
        share = max(1, int(budget * weight[stream] / total))
        take = min(want[stream], share, budget)
        end[stream] = _advance(end[stream], take, available[stream], gaps.get(stream, ()))
        budget -= take
    return end


def _gaps(span: LogSpan | None, lo: int, hi: int) -> list[tuple[int, int]]:
    """receivers.block.gaps of the log `span` spans over [lo, hi): every offset when it has no block."""
    if span is None:
        return [(lo, hi)] if hi > lo else []
    return span.gaps(lo, hi)


def _advance(lo: int, records: int, hi: int, gaps: Sequence[tuple[int, int]]) -> int:
    """The offset `records` records after `lo` (at most `hi`), offsets in `gaps` (disjoint ranges
    [a, b)) not counted: past the gaps up to the next record (or `hi`) once they are taken, so that the
    batch that reads the last records before a gap passes it too. No records: `lo`."""
    if records <= 0:
        return lo
    at = lo
    for a, b in sorted(gaps):
        if b <= at:
            continue
        if a >= hi:
            break
        run = max(0, a - at)  # records [at, a) before this gap
        if records < run:
            return at + records
        records -= run
        at = max(at, b)
    return min(hi, at + records)


def _weight(weights: Mapping[str, float] | None, stream: str) -> float:
    w = weights.get(stream, 1.0) if weights else 1.0
    return w if w > 0 and math.isfinite(w) else 1.0


def _balanced(
    slices: Sequence[SliceTuple], min_partitions: int, min_partition_records: int = 1
) -> list[list[SliceTuple]]:
    """Cut the batch's slices into at least min_partitions runs of about equal record counts (at most
    MAX_RECORDS_PER_PARTITION each), splitting blocks where a cut falls: like the Kafka source's
    minPartitions, a batch of a few blocks still uses every core, and no task gets twice another's work.
    A batch too small to give each of min_partitions runs min_partition_records gets fewer runs (one per
    min_partition_records, at least one): a task's fixed cost is not worth paying for a few records.
    """
    total = sum(hi - lo for *_, lo, hi in slices)
    if total == 0:
        return []
    spread = min(min_partitions, max(1, total // max(1, min_partition_records)))
    parts = max(spread, -(-total // MAX_RECORDS_PER_PARTITION))
    per_part = -(-total // min(parts, total))
    runs: list[list[SliceTuple]] = []
    run: list[SliceTuple] = []
    room = per_part
    for stream, seq, first, count, receiver, lo, hi in slices:
        at = lo
        while at < hi:
            take = min(hi - at, room)
            run.append((stream, seq, first, count, receiver, at, at + take))
            at += take
            room -= take
            if room == 0:
                runs.append(run)
                run, room = [], per_part
    if run:
        runs.append(run)
    return runs


def _holes(lo: int, hi: int, blocks: Sequence[BlockInfo]) -> list[tuple[int, int]]:
    """The ranges of record offsets in [lo, hi) that `blocks` (sorted, those overlapping it) do not
    cover. A missing prefix is expected only from offset 0, before blocks that are there: the initial
    offset of a stream that was empty when the query started, whose earlier blocks had been released."""
    holes = uncovered(lo, hi, blocks)
    if lo == 0 and blocks and blocks[0].first_offset > 0:
        return holes[1:]  # that prefix
    return holes


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


def _seconds_option(options: Mapping[str, str], name: str, default: float) -> float:
    """A number of seconds >= 0 (absent or empty: `default`): "abc", "nan", "inf" or a negative value
    is a ValueError naming the option (a NaN or infinite interval failed a later batch's planning
    with a bare "cannot convert float NaN to integer")."""
    value = options.get(name)
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (math.isfinite(number) and number >= 0):
        raise ValueError(f"sluice source: option {name!r} must be a number of seconds >= 0, got {value!r}")
    return number


def _sorted(offset: Mapping[str, int]) -> Offset:
    # Spark compares offsets by their JSON text: keep key order stable
    return dict(sorted(offset.items()))
