"""The Spark side of a running service: one streaming query over the receivers' sealed blocks.

Wires ingest.spark (source, pipeline, listener) to a server's configuration. Listener callbacks arrive on
py4j threads; this module only counts them there (an int increment), anything touching the event loop
must be handed over with loop.call_soon_threadsafe.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from ingest.config import ServeConfig
from ingest.spark.listener import BatchCompleted, BatchListener
from ingest.spark.pipeline import Pipeline, load_pipeline, parquet_pipeline, start_query

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
    ) -> None:
        self.spark = spark
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
