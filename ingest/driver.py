"""The Spark side of a running service: one streaming query over the receivers' sealed blocks.

Wires ingest.spark (source, pipeline, listener) to a server's configuration. Listener callbacks arrive on
py4j threads; this module only counts them there (an int increment), anything touching the event loop
must be handed over with loop.call_soon_threadsafe, and blocking work (releasing blocks) goes to the
driver's own release thread.

Releasing what Spark committed. The source releases blocks in commit(end), but Spark calls that for
batch N only when it plans batch N + 1, i.e. once new data arrives: under a disk budget that a batch
fills, intake pauses until blocks are released, no new data comes, and ingestion stalls for good. So the
driver releases, as each batch completes, the blocks wholly below the batch's end offset (a block the
batch ended in is kept: the next batch reads the rest of it). That is safe only once Spark's commit log
holds the batch, since a restarted query re-runs an uncommitted batch from its start offset. Spark's
MicroBatchExecution (apache/spark, sql/core/.../streaming/runtime/MicroBatchExecution.scala) runs
`runBatch` -> `markMicroBatchEnd` -> `commitLog.add(batchId)` inside the trigger, and only after it
`finishTrigger` -> ProgressReporter.updateProgress -> `postEvent(QueryProgressEvent)`: a progress event
for a batch is posted after its commit log entry is written. Async progress tracking
(asyncProgressTrackingEnabled) writes the commit log in the background instead, so the driver also
checks that `commits/<batchId>` exists in a local checkpoint before it releases. Events can be dropped
(a full listener bus) or lost in a crash: on start the driver also releases what the checkpoint's last
commit covers, which also frees a restarted query's store when no new data would ever plan a batch,
again on every idle event of the query, and at stop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from py4j.protocol import Py4JError, Py4JJavaError

from ingest.config import ServeConfig
from ingest.server import SluiceServer
from ingest.spark.cluster_source import flatten, is_cluster_offset
from ingest.spark.listener import BatchCompleted, BatchListener
from ingest.spark.pipeline import (
    Pipeline,
    PipelineContext,
    load_pipeline,
    parquet_pipeline,
    start_query,
)
from ingest.spark.source import (
    INCARNATIONS,
    OPTION_FAIL_ON_DATA_LOSS,
    OPTION_FOLLOW_STREAMS,
    OPTION_STARTING_OFFSETS,
    incarnations_of,
    plain_offset,
)
from ratecontrol import BatchMetrics
from receivers.block_store import BlockStore, release_below
from receivers.files import parse_json
from receivers.wal import WalBlockStore

log = logging.getLogger(__name__)

QUERY_NAME = "sluice"


@dataclass(frozen=True)
class QueryPlan:
    """One query the driver runs: its pipeline, checkpoint, trigger and where a fresh one starts."""

    pipeline: Pipeline
    checkpoint: Path
    trigger_interval: float
    streams: tuple[str, ...]
    """What the source reads at start (with a rate target it follows the server's set after that)."""
    starting_offsets: Mapping[str, int] | None = None
    """Where a fresh checkpoint starts (the last query's committed end); None: the first blocks."""
    starting_incarnations: Mapping[str, str] | None = None
    """The incarnations of the logs starting_offsets are of (the single-node source's {stream: id}, the
    cluster source's {"stream/owner": id}): the new query fails with DataLossError, rather than skip
    records, if one was lost since."""
    context: PipelineContext | None = None


class SparkDriver:
    """Runs the pipeline's streaming query on `spark` and counts completed batches."""

    def __init__(
        self,
        spark: Any,
        config: ServeConfig,
        pipeline: Pipeline | None = None,
        *,
        query_name: str = QUERY_NAME,
        rate_target: str | None = None,
        rate_token_file: Path | None = None,
        store: BlockStore | None = None,
        release: Callable[[Mapping[str, int], Mapping[str, str]], object] | None = None,
        source_options: Mapping[str, str] | None = None,
        streams: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.spark = spark
        self.rate_target = rate_target
        """host:port of the server whose live rate caps each batch; None: no cap."""
        self.rate_token_file = rate_token_file
        """The token the source asks the rate with (SluiceServer.pipeline_token_file); None: none."""
        self.query_name = query_name
        self.config = config
        self._pipeline = pipeline
        self.last_batch: BatchCompleted | None = None
        self._batches = 0
        self._records = 0
        self._lock = threading.Lock()
        self._listener = BatchListener(self._on_batch, on_idle=self._on_idle)
        self._subscribers: list[Callable[[BatchCompleted], None]] = []
        self.query: Any = None
        if store is None and release is None:
            store = WalBlockStore(config.blocks_dir, fsync=config.fsync)
        self.store: BlockStore | None = store
        """Where committed blocks are released (the server's store in `sluice serve`)."""
        self._release = release
        """Releases a committed end offset instead of the store: a cluster's driver passes one that
        asks every receiver node (ReleaseBlocks); it gets {"stream/owner": offset} (see _sluice_offset)
        and the incarnations of those partitions' logs that the offset names ({"stream/owner": id}: a
        node whose log of a partition is another one releases nothing of it)."""
        self.source_options = dict(source_options or {})
        """Options of the "sluice" source instead of the block store's path: a cluster's `receivers`
        and the credentials."""
        self._checkpoint: Path | None = None  # the query's checkpoint root, when it is a local path
        self._streams = streams or (lambda: config.streams)
        """Every stream a committed offset may name (streams come and go at run time)."""
        self._commit_subscribers: list[Callable[[dict[str, int]], None]] = []
        self._listening = False
        self.plan: QueryPlan | None = None
        """What the running (or last) query was started with."""
        # one thread: releases are blocking file work, off Spark's listener thread, and run in order
        self._releaser = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-release")

    @property
    def batches_completed(self) -> int:
        return self._batches

    @property
    def records_processed(self) -> int:
        """Input rows of every completed micro-batch of this query."""
        return self._records

    def _on_batch(self, batch: BatchCompleted) -> None:
        if self.query is not None and batch.query_id != str(self.query.id):
            return  # another query on a shared session
        with self._lock:
            self._batches += 1
            self._records += batch.num_input_rows
            self.last_batch = batch
        end = _sluice_offset(batch.end_offset, self._streams())
        if self.query is not None and end is not None:
            # (an event before start() knows its query is covered by start()'s checkpoint release)
            self._submit_release(batch.batch_id, end, batch.end_incarnations or {})
        for subscriber in self._subscribers:
            subscriber(batch)

    def _on_idle(self, query_id: str) -> None:
        # a batch event lost on the way (a full listener bus, a bad event) would leave the last batch's
        # blocks in the store while the stream waits for data: Spark's idle event (every 10 s while
        # idle) has the commit log checked again
        if self.query is not None and query_id == str(self.query.id):
            self._release_last_commit()

    def _submit_release(
        self, batch_id: int, end: Mapping[str, int], incarnations: Mapping[str, str] | None = None
    ) -> None:
        try:
            self._releaser.submit(self._release_committed, batch_id, dict(end), dict(incarnations or {}))
        except RuntimeError:  # stopped: the next start releases it from the checkpoint
            log.debug("batch %d completed after stop: its blocks are released at the next start", batch_id)

    def _release_committed(
        self, batch_id: int, end: Mapping[str, int], incarnations: Mapping[str, str]
    ) -> None:
        """Release the blocks wholly below `end`, the end offset of batch `batch_id`, once the
        checkpoint's commit log has the batch (see the module docstring). On the release thread."""
        try:
            if self._checkpoint is not None and not (self._checkpoint / "commits" / str(batch_id)).exists():
                # async progress tracking: not committed yet; a later batch's release covers these blocks
                log.debug("batch %d reported before its commit log entry: not released yet", batch_id)
                return
            if self._release is not None:
                self._release(end, incarnations)
            elif self.store is not None:
                # a log of another incarnation than the batch's (lost under the checkpoint) keeps its blocks
                release_below(self.store, list(end), end, incarnations)
        except Exception:  # the next batch (or start) releases them; ingestion must not die of it
            log.exception("releasing the blocks of committed batch %d failed", batch_id)
            return
        for subscriber in self._commit_subscribers:
            try:
                subscriber(dict(end))
            except Exception:
                log.exception("a commit subscriber failed for batch %d", batch_id)

    def on_batch(self, callback: Callable[[BatchCompleted], None]) -> None:
        """Call `callback` for every completed batch of this query, ON A PY4J THREAD: hand it over."""
        self._subscribers.append(callback)

    def on_commit(self, callback: Callable[[dict[str, int]], None]) -> None:
        """Call `callback` with the end offset ({stream: offset}) of every batch found in the commit log
        and released, ON THE RELEASE THREAD: hand it over."""
        self._commit_subscribers.append(callback)

    @property
    def trigger_interval(self) -> float:
        """The running query's trigger interval (seconds)."""
        return self.plan.trigger_interval if self.plan is not None else self.config.trigger_interval

    @property
    def checkpoint(self) -> Path | None:
        """The running query's checkpoint root, when it is on the local file system."""
        return self._checkpoint

    @property
    def pipeline(self) -> Pipeline:
        """The pipeline given, else the config's, loaded at the first call (not at construction: a
        query started with a plan of its own, as PipelineManager's are, never needs it, and a load
        imports the user's module anew, running its top level again)."""
        if self._pipeline is None:
            config = self.config
            self._pipeline = (
                load_pipeline(config.pipeline) if config.pipeline else parquet_pipeline(config.sink_dir)
            )
        return self._pipeline

    def default_plan(self) -> QueryPlan:
        return QueryPlan(
            pipeline=self.pipeline,
            checkpoint=self.config.checkpoint_dir / self.query_name,
            trigger_interval=self.config.trigger_interval,
            streams=tuple(self.config.streams),
        )

    def start(self, plan: QueryPlan | None = None) -> None:
        """Start the query (blocking for a few seconds: call from a worker thread in async code); `plan`
        by default: the config's pipeline, checkpoint and trigger. Raises what Spark or the pipeline
        raise when it cannot start (the query is None then)."""
        plan = plan or self.default_plan()
        _clear_interrupted_writes(plan.checkpoint)
        if not self._listening:
            self.spark.streams.addListener(self._listener)
            self._listening = True
        options = dict(self.source_options)
        if not self.source_options:  # this service's own store: streams come and go with the server's
            options[OPTION_FOLLOW_STREAMS] = "true"
            options[OPTION_FAIL_ON_DATA_LOSS] = "true" if self.config.fail_on_data_loss else "false"
        if plan.starting_offsets:
            starting: dict[str, object] = dict(sorted(plan.starting_offsets.items()))
            if plan.starting_incarnations:
                starting[INCARNATIONS] = dict(sorted(plan.starting_incarnations.items()))
            options[OPTION_STARTING_OFFSETS] = json.dumps(starting)
        self.query = None
        self.plan = plan
        name = self._free_query_name()
        self.query = start_query(
            self.spark,
            store_root=None if self.source_options else str(self.config.blocks_dir),
            source_options=options,
            streams=list(plan.streams),
            pipeline=plan.pipeline,
            checkpoint_dir=str(plan.checkpoint),
            trigger_seconds=plan.trigger_interval,
            query_name=name,
            rate_target=self.rate_target,
            rate_token_file=self.rate_token_file,
            context=plan.context,
        )
        log.debug("Spark query %s started", self.query.id)  # said by `sluice serve`, and by swaps
        self._checkpoint = _local_checkpoint(self.query)
        self._release_last_commit()

    def _free_query_name(self) -> str:
        """The driver's query name, or while a query left behind by a stop (_stop) still holds it the
        first free "<name>-<n>": Spark refuses to start a second active query of one name."""
        taken = {query.name for query in self.spark.streams.active}
        name, n = self.query_name, 1
        while name in taken:
            name, n = f"{self.query_name}-{n}", n + 1
        if name != self.query_name:
            log.warning(
                "query name %s is still held by a query left behind: this one is %s", self.query_name, name
            )
        return name

    def _stop(self) -> None:
        """Stop the query. Spark waits spark.sql.streaming.stopTimeout for its running batch to end (see
        ingest.spark.session.STOP_TIMEOUT_MS), then gives up: the batch is left behind rather than
        the caller (a rollback, the shutdown) hung with it."""
        _quiet_job_cancel(self.spark)
        try:
            self.query.stop()
        except Py4JJavaError as exc:
            if "java.util.concurrent.TimeoutException" not in str(exc):
                raise
            timeout = self.spark.conf.get("spark.sql.streaming.stopTimeout", "?")
            log.error(  # noqa: TRY400 - what happened and what it means, in one line; Spark's stack is long
                "the query's running batch did not end within %s ms of its stop "
                "(spark.sql.streaming.stopTimeout): it is left behind, still running (a Python function "
                "cannot be interrupted), until it returns or the service exits; whatever it writes then "
                "is not counted (its records are processed again by the next query)",
                timeout,
            )

    def stop_query(self) -> None:
        """Stop the running query only (blocking); the driver can start another. Idempotent."""
        if self.query is not None and self.query.isActive:
            self._stop()
        self._release_last_commit()

    def _release_last_commit(self) -> None:
        """Release what the checkpoint's last commit covers: what a crash (or a stop) left between a
        batch's commit and its event's release, which no later batch may ever come to release."""
        if self._checkpoint is not None:
            committed = last_commit_named(self._checkpoint, self._streams())
            if committed is not None:
                self._submit_release(*committed)

    def drain(self) -> None:
        """Process every sealed block now (blocking)."""
        if self.query is not None and self.query.isActive:
            self.query.processAllAvailable()

    def stop(self) -> None:
        """Stop the query and remove the listener (blocking). Idempotent."""
        if self.query is not None:
            self._stop()
        if self._listening:
            self.spark.streams.removeListener(self._listener)
            self._listening = False
        # the last batch's event may still be on its way (the listener bus is asynchronous) and is
        # dropped with the listener: release from the commit log, then wait for the releases
        self._release_last_commit()
        self._releaser.shutdown(wait=True)

    def error(self) -> str | None:
        """Why the query died, if it did."""
        if self.query is None or self.query.isActive:
            return None
        exc = self.query.exception()
        return str(exc) if exc is not None else "query stopped"


def last_commit(checkpoint: Path, streams: Sequence[str]) -> tuple[int, dict[str, int]] | None:
    """The last batch in the checkpoint's commit log and the Sluice source's end offset of it, from the
    offset log (`offsets/<id>`: a version line, a metadata line, then one offset per source: the first
    that is the Sluice source's over `streams` is ours, see _sluice_offset); None when there is none or
    it is unreadable.
    """
    found = last_commit_named(checkpoint, streams)
    return None if found is None else found[:2]


def last_commit_named(
    checkpoint: Path, streams: Sequence[str], sink: Path | None = None
) -> tuple[int, dict[str, int], dict[str, str]] | None:
    """last_commit, and the incarnations the offset names (incarnations_of). With `sink`, the file sink
    the checkpoint's query wrote to: a later batch its _spark_metadata already lists counts as committed.
    A query stopped or killed between the sink's commit and the commit log's has that batch's records
    in the sink; its own restart redoes the batch and the sink skips it, but a new query (a reset, a
    swap) that started at the commit log's end wrote those records a second time."""
    try:
        ids = [int(name) for name in _listdir(checkpoint / "commits") if name.isdigit()]
        written = _last_sink_batch(sink) if sink is not None else -1
        batch_id = max([*ids, written])
        if batch_id < 0:
            return None
        read = _offset_lines(checkpoint, batch_id, fallback=max(ids, default=-1))
    except (OSError, ValueError):
        log.debug("cannot read the commit log under %s", checkpoint, exc_info=True)
        return None
    if read is None:
        return None
    batch_id, lines = read
    for line in lines[2:]:
        try:
            offset = parse_json(line)
        except ValueError:
            continue  # "-": a source without an offset in this batch
        end = _sluice_offset(offset, streams)
        if end is not None:
            return batch_id, end, incarnations_of(offset)
    return None


def _last_sink_batch(sink: Path) -> int:
    """The last batch id a file sink's _spark_metadata lists ("7", "9.compact"); -1 for none."""
    try:
        names = os.listdir(sink / "_spark_metadata")
    except OSError:
        return -1
    return max((int(n.split(".")[0]) for n in names if n.split(".")[0].isdigit()), default=-1)


def _offset_lines(checkpoint: Path, batch_id: int, fallback: int) -> tuple[int, list[str]] | None:
    """The batch id and lines of offsets/<batch_id>; of `fallback` (the last commit) if it cannot be
    read; None if neither can."""
    for wanted in dict.fromkeys((batch_id, fallback)):
        if wanted < 0:
            continue
        try:
            return wanted, (checkpoint / "offsets" / str(wanted)).read_text().splitlines()
        except OSError:
            continue
    return None


def _sluice_offset(offset: object, streams: Sequence[str]) -> dict[str, int] | None:
    """The Sluice source's offset in one flat form, or None when `offset` is another source's (of a
    pipeline that reads several: the listener reports the first source's). The single-node source's
    {stream: record offset} as it is (its incarnations left out: incarnations_of); the cluster
    source's {stream: {"<owner>": record offset}} (or the listener's flat {"stream/owner": record
    offset}) as {"stream/owner": record offset}."""
    if not isinstance(offset, dict) or not offset:
        return None
    plain = plain_offset(offset) if isinstance(offset.get(INCARNATIONS, {}), dict) else offset
    if _is_sluice_offset(plain, streams):
        return dict(plain)
    if is_cluster_offset(offset, streams):
        return flatten(offset)
    if all(isinstance(k, str) and type(v) is int for k, v in offset.items()):
        keys = [k.rpartition("/") for k in offset]
        if all(sep and s in streams and o.isdigit() for s, sep, o in keys):
            return dict(offset)
    return None


def _is_sluice_offset(offset: object, streams: Sequence[str]) -> TypeGuard[dict[str, int]]:
    """Whether `offset` is the single-node Sluice source's ({stream: record offset} over some of
    `streams`)."""
    return (
        isinstance(offset, dict)
        and bool(offset)
        and set(offset) <= set(streams)
        and all(type(v) is int for v in offset.values())
    )


_SPARK_TEMP_FILE = re.compile(r"^\.\.?\d+\.[0-9a-fA-F-]+\.tmp(\.crc)?$")
"""A metadata log entry Spark was writing (`.<batch>.<uuid>.tmp`, and Hadoop's `..<same>.crc`): it writes
each entry to such a file and renames it into place."""


def _clear_interrupted_writes(checkpoint: Path) -> None:
    """Remove what a kill -9 left of an entry Spark was writing to the offset or commit log.

    Spark ignores those files when it reads the logs, but a query with no complete offset log entry
    (killed while writing batch 0's) checks that offsets/ and commits/ are empty
    (verifyNewCheckpointDirectory, spark.sql.streaming.verifyCheckpointDirectoryEmptyOnStart) and fails
    with STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY on every start after. The query is not running (the
    data dir is this server's), so no such file is a write in progress.
    """
    for log_dir in ("offsets", "commits"):
        for name in _listdir(checkpoint / log_dir):
            if _SPARK_TEMP_FILE.match(name):
                log.info("removing %s/%s, left by an interrupted checkpoint write", log_dir, name)
                (checkpoint / log_dir / name).unlink(missing_ok=True)


def _listdir(path: Path) -> list[str]:
    try:
        return [p.name for p in path.iterdir()]
    except FileNotFoundError:
        return []


def _local_checkpoint(query: Any) -> Path | None:
    """The query's checkpoint root (the pipeline may have set its own) when it is on the local file
    system; None when it is not, or Spark's internals do not say: then releases trust the event order."""
    try:
        root = str(query._jsq.streamingQuery().resolvedCheckpointRoot())
    except (AttributeError, Py4JError):  # Spark Connect, or Spark changed its internals
        log.debug("cannot resolve the query's checkpoint", exc_info=True)
        return None
    parsed = urllib.parse.urlparse(root)
    if parsed.scheme not in ("", "file"):
        return None  # e.g. hdfs://, s3a://: trust the event order alone
    return Path(urllib.parse.unquote(parsed.path))


def batch_metrics(
    batch: BatchCompleted,
    interval: float,
    received_at: Callable[[str, int], float | None],
    records: Callable[[str, int, int], int] | None = None,
) -> BatchMetrics:
    """A completed batch as the estimator sees it.

    Scheduling delay, for Structured Streaming: how long the batch's oldest record waited before its
    batch started, i.e. the trigger's start minus when the receiver took the batch's first record
    (`received_at(stream, offset)`), over the batch's streams. Unknown (the first batch, records from
    before a restart) counts as 0. Processing delay: the trigger's whole duration. Backlog: records that
    were available when the batch was planned but left for later: between Spark's endOffset and its
    latestOffset (the source's reportLatestOffset, a position), the records `records(key, lo, hi)`
    says [lo, hi) of a stream (or a cluster's partition) holds. Offsets in a gap of its log (records
    lost: receivers.block.gaps) hold none, and counted as records they made a batch that stopped
    before a gap seem to leave the whole gap behind. None: every offset counts (no gaps known).
    """
    waited = [
        batch.started_at - taken
        for stream, offset in (batch.start_offset or {}).items()
        if (taken := received_at(stream, offset)) is not None
    ]
    backlog = None
    if batch.latest_offset is not None and batch.end_offset is not None:
        end = batch.end_offset
        count = records or _offsets
        backlog = sum(
            count(s, end[s], latest) if s in end and latest > end[s] else 0
            for s, latest in batch.latest_offset.items()
        )
    return BatchMetrics(
        batch_id=batch.batch_id,
        completed_at=batch.started_at + batch.processing_seconds,
        records=batch.num_input_rows,
        processing_delay=batch.processing_seconds,
        scheduling_delay=max([0.0, *waited]),
        batch_interval=interval,
        backlog=backlog,
    )


def _offsets(key: str, lo: int, hi: int) -> int:
    """The offsets of [lo, hi), as batch_metrics counts records when it knows no gaps."""
    return max(0, hi - lo)


def drive_rate(driver: SparkDriver, server: SluiceServer, loop: asyncio.AbstractEventLoop) -> None:
    """Close the loop: every completed batch's metrics go to the server's rate controller, on its loop;
    the driver releases committed blocks in the server's own store (one index, one cache) and tells
    the server what was committed (draining streams end there)."""
    driver.store = server.store

    def on_loop(batch: BatchCompleted) -> None:
        # what the batch left behind is the records its streams' logs hold past its end: a gap in
        # a log (records lost) is none
        metrics = batch_metrics(batch, driver.trigger_interval, server.received_at, server.readable_records)
        server.rate.on_batch(metrics)

    def hand_over(batch: BatchCompleted) -> None:  # on a py4j thread
        if loop.is_closed():
            return  # the server's loop ended before Spark's last event: nobody to steer any more
        loop.call_soon_threadsafe(on_loop, batch)

    def committed(end: dict[str, int]) -> None:  # on the release thread
        if not loop.is_closed():
            loop.call_soon_threadsafe(server.on_committed, end)

    driver.on_batch(hand_over)
    driver.on_commit(committed)
    server.rate.attach_query()


def _quiet_job_cancel(spark: Any) -> None:
    """Stopping a query that is between batches makes Spark 4's DAGScheduler warn, twice, that it
    "Failed to cancel job group ... Cannot find active jobs for it": nothing was wrong, and a clean
    stop should print nothing an operator has to read. Only that logger, only from here on."""
    try:
        jvm = spark.sparkContext._jvm
        level = jvm.org.apache.logging.log4j.Level.ERROR
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
            "org.apache.spark.scheduler.DAGScheduler", level
        )
    except Py4JError:  # another logging backend: the two lines stay
        log.debug("could not quiet the DAGScheduler's job-cancel warning", exc_info=True)
