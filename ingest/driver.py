"""The Spark side of a running service: one streaming query over the receivers' sealed blocks.

Wires ingest.spark (source, pipeline, listener) to a server's configuration. Listener callbacks arrive on
py4j threads; this module only counts them there (an int increment), anything touching the event loop
must be handed over with loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from ingest.config import ServeConfig
from ingest.server import SluiceServer
from ingest.spark.listener import BatchCompleted, BatchListener
from ingest.spark.pipeline import Pipeline, load_pipeline, parquet_pipeline, start_query
from ratecontrol import BatchMetrics

log = logging.getLogger(__name__)

QUERY_NAME = "sluice"


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
    ) -> None:
        self.spark = spark
        self.rate_target = rate_target
        """host:port of the server whose live rate caps each batch; None: no cap."""
        self.query_name = query_name
        self.config = config
        if pipeline is None:
            pipeline = (
                load_pipeline(config.pipeline) if config.pipeline else parquet_pipeline(config.sink_dir)
            )
        self.pipeline = pipeline
        self.last_batch: BatchCompleted | None = None
        self._batches = 0
        self._records = 0
        self._lock = threading.Lock()
        self._listener = BatchListener(self._on_batch)
        self._subscribers: list[Callable[[BatchCompleted], None]] = []
        self.query: Any = None

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
        for subscriber in self._subscribers:
            subscriber(batch)

    def on_batch(self, callback: Callable[[BatchCompleted], None]) -> None:
        """Call `callback` for every completed batch of this query, ON A PY4J THREAD: hand it over."""
        self._subscribers.append(callback)

    def start(self) -> None:
        """Start the query (blocking for a few seconds: call from a worker thread in async code)."""
        self.spark.streams.addListener(self._listener)
        self.query = start_query(
            self.spark,
            store_root=str(self.config.blocks_dir),
            streams=list(self.config.streams),
            pipeline=self.pipeline,
            checkpoint_dir=str(self.config.checkpoint_dir / self.query_name),
            trigger_seconds=self.config.trigger_interval,
            query_name=self.query_name,
            rate_target=self.rate_target,
        )
        log.info("Spark query %s started", self.query.id)

    def drain(self) -> None:
        """Process every sealed block now (blocking)."""
        if self.query is not None and self.query.isActive:
            self.query.processAllAvailable()

    def stop(self) -> None:
        """Stop the query and remove the listener (blocking). Idempotent."""
        if self.query is not None:
            self.query.stop()
        self.spark.streams.removeListener(self._listener)

    def error(self) -> str | None:
        """Why the query died, if it did."""
        if self.query is None or self.query.isActive:
            return None
        exc = self.query.exception()
        return str(exc) if exc is not None else "query stopped"


def batch_metrics(
    batch: BatchCompleted, interval: float, received_at: Callable[[str, int], float | None]
) -> BatchMetrics:
    """A completed batch as the estimator sees it.

    Scheduling delay, for Structured Streaming: how long the batch's oldest record waited before its
    batch started, i.e. the trigger's start minus when the receiver took the batch's first record
    (`received_at(stream, offset)`), over the batch's streams. Unknown (the first batch, records from
    before a restart) counts as 0. Processing delay: the trigger's whole duration. Backlog: records that
    were available when the batch was planned but left for later (Spark's latestOffset - endOffset).
    """
    waited = [
        batch.started_at - taken
        for stream, offset in (batch.start_offset or {}).items()
        if (taken := received_at(stream, offset)) is not None
    ]
    backlog = None
    if batch.latest_offset is not None and batch.end_offset is not None:
        end = batch.end_offset
        backlog = sum(max(0, latest - end.get(s, latest)) for s, latest in batch.latest_offset.items())
    return BatchMetrics(
        batch_id=batch.batch_id,
        completed_at=batch.started_at + batch.processing_seconds,
        records=batch.num_input_rows,
        processing_delay=batch.processing_seconds,
        scheduling_delay=max([0.0, *waited]),
        batch_interval=interval,
        backlog=backlog,
    )


def drive_rate(driver: SparkDriver, server: SluiceServer, loop: asyncio.AbstractEventLoop) -> None:
    """Close the loop: every completed batch's metrics go to the server's rate controller, on its loop."""
    interval = driver.config.trigger_interval

    def on_loop(batch: BatchCompleted) -> None:
        server.rate.on_batch(batch_metrics(batch, interval, server.received_at))

    def hand_over(batch: BatchCompleted) -> None:  # on a py4j thread
        if loop.is_closed():
            return  # the server's loop ended before Spark's last event: nobody to steer any more
        loop.call_soon_threadsafe(on_loop, batch)

    driver.on_batch(hand_over)
