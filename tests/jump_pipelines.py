"""A pipeline whose per-record cost the test changes while it runs (tests/test_cost_jumps.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame
from pyspark.sql.streaming.readwriter import DataStreamWriter

from ingest.spark.pipeline import PipelineContext

COST_SECONDS = 40e-6
"""Per record at factor 1."""


def factor_file(sink_dir: Path) -> Path:
    return sink_dir.parent / "cost-factor"


def costly(df: DataFrame, context: PipelineContext) -> DataStreamWriter:
    """offset and value into Parquet, after a busy-wait of COST_SECONDS x the factor in the file per
    record (read per Arrow batch by the executors, so a change lands mid-batch)."""
    path = str(factor_file(Path(context.sink_dir)))

    def spin(batches: Iterator[Any]) -> Iterator[Any]:
        import time

        for batch in batches:
            try:
                with open(path, encoding="utf-8") as f:
                    factor = float(f.read() or 1)
            except (OSError, ValueError):
                factor = 1.0
            until = time.perf_counter() + COST_SECONDS * factor * batch.num_rows
            while time.perf_counter() < until:
                pass
            yield batch

    out = df.select("offset", "value").mapInArrow(spin, "offset long, value binary")
    return out.writeStream.format("parquet").outputMode("append").option("path", str(context.sink_dir))
