"""The pipeline's capacity remembered across restarts (ingest.rate_memory): a restart of the same pipeline
bounds its unmeasured first batches by it instead of by the receivers' memory alone; another pipeline,
no file or a broken one starts as a fresh data dir does. One test runs a real Spark query."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
from jump_pipelines import COST_SECONDS, factor_file
from live_service import service, wait_for_offsets
from support import running_server

from ingest.config import RateConfig
from ingest.rate_controller import RECALLED_INTERVALS
from ingest.rate_memory import FILE, SAVE_EVERY, RateMemory
from ratecontrol import BatchMetrics
from sluice_client import Producer


def test_a_capacity_is_recalled_only_for_the_pipeline_it_was_measured_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [100.0]
    memory = RateMemory(tmp_path, clock=lambda: now[0])
    assert memory.recall("") is None  # no file: a fresh data dir
    memory.remember("", 1234.5)
    assert json.loads((tmp_path / FILE).read_text())["capacity"] == 1234.5
    assert RateMemory(tmp_path).recall("") == 1234.5
    assert RateMemory(tmp_path).recall("mod:other") is None
    # a capacity that keeps moving is written at most every SAVE_EVERY seconds; another pipeline at once
    memory.remember("", 2000.0)
    assert RateMemory(tmp_path).recall("") == 1234.5
    now[0] += SAVE_EVERY
    memory.remember("", 2000.0)
    assert RateMemory(tmp_path).recall("") == 2000.0
    memory.remember("mod:other", 50.0)
    assert RateMemory(tmp_path).recall("mod:other") == 50.0
    for value in (0.0, -1.0, math.inf, math.nan):
        memory.remember("mod:other", value)
    assert RateMemory(tmp_path).recall("mod:other") == 50.0
    # a hint, not state: a broken file is logged and ignored, never stops a start
    for text in (
        "{not json",
        '{"pipeline": "", "capacity": "fast"}',
        '{"pipeline": "", "capacity": -5}',
        "[]",
    ):
        (tmp_path / FILE).write_text(text)
        with caplog.at_level(logging.WARNING, "ingest.rate_memory"):
            assert RateMemory(tmp_path).recall("") is None
        assert "ignored: the start goes on as a fresh one" in caplog.text
        caplog.clear()
    # a data dir it cannot write to: one warning, no error
    blocked = RateMemory(tmp_path / FILE / "below")
    with caplog.at_level(logging.WARNING, "ingest.rate_memory"):
        blocked.remember("", 10.0)
        blocked.remember("mod:x", 10.0)
    assert caplog.text.count("cannot keep the measured capacity") == 1


def batch(k: int, records: int, seconds: float) -> BatchMetrics:
    return BatchMetrics(
        batch_id=k,
        completed_at=100.0 + k,
        records=records,
        processing_delay=seconds,
        scheduling_delay=0.0,
        batch_interval=1.0,
        backlog=0,
    )


async def test_a_recalled_capacity_bounds_the_unmeasured_batches_below_memory(tmp_path: Path) -> None:
    async with running_server(tmp_path, "a", "b", buffer_records=1000, prefetch=500) as server:
        controller = server.rate
        controller.set_estimator("model")
        assert controller.unmeasured_batch_records() == 2000  # memory: two streams of 1,000
        controller.recall(300.0)  # x RECALLED_INTERVALS x the 1 s trigger
        assert controller.unmeasured_batch_records() == math.ceil(RECALLED_INTERVALS * 300)
        controller.recall(1e9)  # a fast pipeline: the memory's bound holds
        assert controller.unmeasured_batch_records() == 2000
        controller.recall(None)
        assert controller.unmeasured_batch_records() == 2000
        controller.recall(300.0)
        # measured: the estimator's rate and capacity cap batches, and its capacity is handed on
        seen: list[float] = []
        controller.on_capacity = seen.append
        for k in range(6):
            controller.on_batch(batch(k, 20_000, 0.5))
        assert controller.unmeasured_batch_records() == 0
        assert seen and seen[-1] == controller.estimator.capacity and 0 < seen[-1] < math.inf
        # a batch that kept the pipeline busy under half its interval proves little: not handed on
        count = len(seen)
        controller.on_batch(batch(6, 100, 0.4))
        assert len(seen) == count and controller.estimator.capacity
        controller.set_estimator("fixed")  # an operator's unlimited rate is never capped
        controller.update(math.inf)
        assert controller.unmeasured_batch_records() == 0


async def test_a_restarted_query_takes_first_batches_of_the_capacity_it_showed(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Real Spark: the source plans the first batches of a restart by the recalled capacity. Without it,
    the first batch would take every record waiting (5,000: under the memory bound of 500,000). The
    pipeline costs 1 ms a record, so its batches keep it busy and what it measures is remembered."""
    model = RateConfig(estimator="model", initial_rate=math.inf)
    pipeline = "jump_pipelines:costly"
    factor_file(tmp_path / "sink").write_text(str(1e-3 / COST_SECONDS))
    (tmp_path / FILE).write_text(json.dumps({"pipeline": pipeline, "capacity": 400.0}))
    bound = math.ceil(RECALLED_INTERVALS * 400.0 * 0.5)  # service()'s trigger interval: 0.5 s
    caplog.set_level(logging.INFO, "ingest.spark_side")
    async with service(spark, tmp_path, "events", pipeline=pipeline, rate=model) as server:
        assert server.rate.unmeasured_batch_records() == bound
        assert f"this pipeline showed 400 records/s before ({tmp_path / FILE})" in caplog.text
        assert f"a batch takes at most {bound} records" in caplog.text
        async with Producer(server.target, "events") as producer:
            await producer.send_many([b"r%d" % i for i in range(5_000)])
            await producer.flush(timeout=60)
        offsets = await wait_for_offsets(spark, 5_000, tmp_path / "sink", timeout=120)
        assert sorted(offsets) == list(range(5_000))
        sizes = [b.records for _, b in server.rate.recent_batches if b.records > 0]
        assert sizes and max(sizes[:3]) <= bound, sizes
        # the estimator measured the pipeline: what it found is kept for the next start, at once
        for _ in range(100):
            if server.rate.estimator.capacity:
                break
            await asyncio.sleep(0.1)
        assert server.rate.estimator.capacity, sizes
        kept = json.loads((tmp_path / FILE).read_text())
        assert kept["pipeline"] == pipeline and kept["capacity"] != 400.0 and kept["capacity"] > 0, kept


async def test_a_cluster_driver_starts_its_rate_at_the_capacity_its_pipeline_showed(tmp_path: Path) -> None:
    """A driver runs no receivers, so its first batches are bounded by its rate: the recalled capacity
    (clamped to the rate bounds), not the default 10,000 records/s; never over an operator's choice."""
    from ingest import cli
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    def start_rate(pipeline: str = "", **options: Any) -> tuple[float, float | None]:
        config = DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), data_dir=tmp_path, **options)
        driver = ClusterDriver(config)
        driver.blocks.close()
        driver.recall(pipeline)  # as start() does, for the pipeline in force
        return driver.rate.rate, driver.recalled

    assert start_rate() == (10_000.0, None)  # nothing remembered: the default
    RateMemory(tmp_path).remember("", 123_456.0)
    assert start_rate() == (123_456.0, 123_456.0)
    assert start_rate("mod:other") == (10_000.0, None)  # measured on another pipeline
    assert start_rate(rate=RateConfig(max_rate=50_000.0)) == (50_000.0, 50_000.0)
    assert start_rate(recall_capacity=False) == (10_000.0, None)  # --initial-rate given
    assert start_rate(rate=RateConfig(estimator="fixed")) == (10_000.0, None)  # the operator's rate
    # `sluice serve --role driver`: an initial rate given by the operator is never replaced
    nodes = tmp_path / "nodes"
    nodes.write_text("0 127.0.0.1:7000\n")
    for extra, recall in (([], True), (["--initial-rate", "5000"], False)):
        args = cli._parser().parse_args(["serve", "--role", "driver", "--nodes", str(nodes), *extra])
        args.origins = {}
        assert cli._driver_config(args).recall_capacity is recall
