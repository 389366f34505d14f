"""What a capped batch left behind, as the rate controller sees it (BatchMetrics.backlog), counts the
records the log holds between the batch's end and Spark's latestOffset, not the offsets: a gap in the
log (records lost) is none. On a real query (the shared Spark session) over a real server whose log
lost a segment under --fsync off."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from support import wait_until
from test_wal import rolled

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver, drive_rate
from ingest.server import SluiceServer
from ingest.spark.listener import BatchCompleted
from receivers.config import FsyncPolicy

pytestmark = pytest.mark.spark

GAP = (80, 120)  # records of blocks 4, 5: a lost segment


def _records(lo: int, hi: int) -> int:
    return max(0, hi - lo) - max(0, min(hi, GAP[1]) - max(lo, GAP[0]))


async def test_a_capped_batchs_backlog_leaves_out_a_gap_in_the_log(spark: Any, tmp_path: Path) -> None:
    """Records 0..239 in 12 blocks, 80..119 lost (a segment gone, a start under --fsync off went on
    without it); a live cap (fixed rate 40/s). Spark's progress says latestOffset 240 after each batch;
    the backlog was 240 - end, so each batch before the gap reported 40 records more than were left
    (a batch ending at 50: 190, now 150). The offsets stay positions: latestOffset is still 240."""
    paths = rolled(tmp_path / "blocks")
    paths[2].unlink()
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        fsync=FsyncPolicy.off(),
        fail_on_data_loss=False,
        rate=RateConfig(estimator="fixed", initial_rate=40),
        trigger_interval=0.5,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="backlog-gaps", rate_target=server.target)
    server.batches_completed = lambda: driver.batches_completed
    seen: list[BatchCompleted] = []
    driver.on_batch(seen.append)  # on a py4j thread: a list's append is atomic
    drive_rate(driver, server, asyncio.get_running_loop())
    await asyncio.to_thread(driver.start)
    try:
        await wait_until(lambda: driver.records_processed >= 200 or driver.error() is not None, timeout=120)
        assert driver.error() is None, driver.error()
        await wait_until(
            lambda: len(server.rate.recent_batches) >= len([b for b in seen if b.num_input_rows])
        )
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)
    completed = {b.batch_id: b for b in seen}
    checked = []
    for _, metrics in server.rate.recent_batches:
        batch = completed[metrics.batch_id]
        assert batch.end_offset is not None and batch.latest_offset is not None
        end, latest = batch.end_offset["s"], batch.latest_offset["s"]
        assert latest == 240  # a position: the log's end, the gap inside it
        assert metrics.backlog == _records(end, latest), (batch, metrics)
        checked.append((end, metrics.backlog))
    # batches before the gap (each left 40 records fewer than its offsets: was 240 - end), and past it
    assert any(end <= GAP[0] for end, _ in checked) and any(end >= GAP[1] for end, _ in checked), checked
