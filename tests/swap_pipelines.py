"""Pipelines the swap tests swap in (loaded by spec, "swap_pipelines:tag_a")."""

from __future__ import annotations

import time
from typing import Any

from hung_batches import HANG_NEXT, HANGING, RELEASE_HUNG  # shared across the fresh imports of a swap
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.streaming.readwriter import DataStreamWriter

from ingest.spark.pipeline import PipelineContext


def _tagged(df: DataFrame, context: PipelineContext, tag: str) -> DataStreamWriter:
    out = df.select("topic", "offset", "value", F.lit(tag).alias("pipeline"))
    return out.writeStream.format("parquet").outputMode("append").option("path", str(context.sink_dir))


def tag_a(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    return _tagged(df, context, "a")


def tag_b(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    return _tagged(df, context, "b")


def worker_late_once(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """tag_b, whose first start fails as Spark does when a Python worker misses its 10 s to connect back
    (a loaded machine)."""
    marker = context.sink_dir.parent / "worker-late-once"
    if not marker.exists():
        marker.touch()
        raise RuntimeError(
            "java.net.SocketTimeoutException: Timed out while waiting for the Python worker to connect back"
        )
    return _tagged(df, context, "b")


def broken_at_start(df: DataFrame) -> DataStreamWriter:
    raise RuntimeError("this pipeline cannot be built")


def fails_first_batch(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    def write(batch: DataFrame, batch_id: int) -> None:
        raise RuntimeError(f"the sink refuses batch {batch_id}")

    return df.writeStream.foreachBatch(write)


def not_a_writer(df: DataFrame) -> Any:
    return df


def _factory() -> Any:
    def pipeline(df: DataFrame) -> Any:
        return df

    return pipeline


made_by_a_factory = _factory()
"""not_a_writer's error, from a pipeline whose function is named otherwise (make_pipeline.<locals>)."""


def writes_to_the_first_sink(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """An earlier generation's sink folder (generation 0's): its file sink's metadata lists batches."""
    out = df.select("topic", "offset", "value", F.lit("x").alias("pipeline"))
    return out.writeStream.format("parquet").option("path", str(context.sink_dir.with_name("sink")))


def slow_first_batch(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """Tagged as tag_a's, but its first batch takes 8 s (a pipeline warming a cache, say)."""

    def write(batch: DataFrame, batch_id: int) -> None:
        if batch_id == 0:
            time.sleep(8)
        out = batch.select("topic", "offset", "value", F.lit("slow").alias("pipeline"))
        out.write.mode("append").parquet(str(context.sink_dir))

    return df.writeStream.foreachBatch(write)


def hangs_first_batch(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """A sink that hangs (a foreachBatch that does not return until RELEASE_HUNG)."""

    def write(batch: DataFrame, batch_id: int) -> None:
        _say_first_batch_started(context, batch_id)
        RELEASE_HUNG.wait()
        # then writes by path, as a sink does: into its folder, wherever that is now
        marker = context.sink_dir / "left-behind"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(batch_id))

    return df.writeStream.foreachBatch(write)


def _say_first_batch_started(context: PipelineContext, batch_id: int) -> None:
    context.sink_dir.mkdir(parents=True, exist_ok=True)
    (context.sink_dir / "first-batch-started").write_text(str(batch_id))


def fails_when_told(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """Its first batch says it started (a file in its sink folder), waits (up to 120 s) for a file named
    fail-now there, then fails: a pipeline whose first batch fails while a test does something."""

    def write(batch: DataFrame, batch_id: int) -> None:
        _say_first_batch_started(context, batch_id)
        deadline = time.monotonic() + 120
        while not (context.sink_dir / "fail-now").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        raise RuntimeError(f"the sink refuses batch {batch_id}")

    return df.writeStream.foreachBatch(write)


def hangs_once_started(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """Its first batch says it started (as fails_when_told), then does not return for an hour: a process
    killed meanwhile dies with the batch uncommitted."""

    def write(batch: DataFrame, batch_id: int) -> None:
        _say_first_batch_started(context, batch_id)
        time.sleep(3600)

    return df.writeStream.foreachBatch(write)


def hangs_when_asked(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """tag_a's records, through a foreachBatch whose batch hangs once HANG_NEXT is set (a sink that
    stalls mid-stream), until RELEASE_HUNG; that batch then writes nothing."""

    def write(batch: DataFrame, batch_id: int) -> None:
        if HANG_NEXT.is_set():
            HANG_NEXT.clear()
            HANGING.set()
            RELEASE_HUNG.wait()
            return
        out = batch.select("topic", "offset", "value", F.lit("a").alias("pipeline"))
        out.write.mode("append").parquet(str(context.sink_dir))

    return df.writeStream.foreachBatch(write)


def fails_after_first_batch(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """Writes its first batch (a swap to it is kept), then raises at every later one: a swapped-in
    pipeline that fails at every start, the case `--reset-pipeline` is the way back from."""

    def write(batch: DataFrame, batch_id: int) -> None:
        if batch_id >= 1:
            raise RuntimeError(f"boom at batch {batch_id}")
        out = batch.select("topic", "offset", "value", F.lit("r").alias("pipeline"))
        out.write.mode("append").parquet(str(context.sink_dir))

    return df.writeStream.foreachBatch(write)


def exits_when_built(df: DataFrame) -> DataStreamWriter:
    """A pipeline that ends the program as it is built (a CLI's main() called by mistake, say)."""
    raise SystemExit("usage: my_pipeline.py [--sink DIR]")


def exits_in_batch(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """A foreachBatch function that ends the program (sys.exit on a bad record, say)."""

    def write(batch: DataFrame, batch_id: int) -> None:
        raise SystemExit(f"bad record in batch {batch_id}")

    return df.writeStream.foreachBatch(write)


def starts_its_own_query(df: DataFrame, context: PipelineContext) -> Any:
    """A pipeline that starts the query itself (`.start()` at the end) and returns the StreamingQuery."""
    return df.writeStream.format("noop").option("checkpointLocation", str(context.sink_dir) + "-own").start()
