"""What Spark has committed leaves the block store without waiting for another batch: on a real Spark
query (the shared session) against a real server, under a disk budget below one batch, after a restart
over the budget, and with a progress event lost; a checkpoint a kill left mid-write still starts. And the
released mark stays sound while several processes release at once (the server and Spark's worker)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from support import running_server

from ingest.config import RateConfig, ServeConfig
from ingest.driver import SparkDriver, drive_rate
from ingest.server import SluiceServer
from ingest.spark.pipeline import parquet_pipeline, start_query
from receivers.block import ARRIVAL, PLAIN_SCHEMA
from receivers.config import FsyncPolicy, ReceiverConfig
from receivers.wal import STATE_FILE, WalBlockStore
from sluice_client import Producer

N = 20_000


def sink_values(spark: Any, sink: Path) -> list[bytes]:
    from pyspark.errors import AnalysisException

    try:
        return [bytes(r["value"]) for r in spark.read.parquet(str(sink)).select("value").collect()]
    except AnalysisException:  # no batch committed yet
        return []


@pytest.mark.spark
async def test_a_disk_budget_below_one_batch_still_moves_data(spark: Any, tmp_path: Path) -> None:
    # as `sluice serve --disk-budget 1KB` runs it: a metered rate (credit a tick's worth at a time, so
    # the first sealed block pauses intake), the live cap on each batch, the listener wired to the server
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        receiver=ReceiverConfig(disk_budget_bytes=1000),
        rate=RateConfig(estimator="fixed", initial_rate=10_000),
        trigger_interval=0.5,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="disk-budget", rate_target=server.target)
    server.batches_completed = lambda: driver.batches_completed
    drive_rate(driver, server, asyncio.get_running_loop())
    await asyncio.to_thread(driver.start)
    try:
        values = [f"record {i}".encode() for i in range(N)]
        started = time.monotonic()
        async with Producer(server.target, "s", producer_id="budget") as producer:
            await producer.send_many(values)
            await producer.flush(timeout=120)  # stalled for good before: the last batch was never released
            assert producer.acked == N
        print(f"{N} records acked under a 1 KB disk budget in {time.monotonic() - started:.1f} s")
        receiver = server.receivers["s"]
        assert receiver.stats.credit_pauses["disk_budget"] > 0  # the budget really was below a batch
        deadline = time.monotonic() + 120
        while len(got := sink_values(spark, config.sink_dir)) < N and time.monotonic() < deadline:
            assert driver.error() is None, driver.error()
            await asyncio.sleep(0.5)
        assert Counter(got) == Counter(values)  # every record exactly once
        # and the idle stream's last batch leaves the store too (it used to wait for a next batch)
        deadline = time.monotonic() + 30
        while server.store.blocks("s") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert server.store.blocks("s") == []
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


@pytest.mark.spark
async def test_a_restart_with_committed_blocks_over_the_budget_resumes(spark: Any, tmp_path: Path) -> None:
    # a run that ended (a crash, or the old code) after Spark committed its last batch but before the
    # blocks were released: restarted over the disk budget, intake pauses at once, so no new data would
    # ever plan the batch whose commit() releases them; the driver releases from the checkpoint
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        receiver=ReceiverConfig(disk_budget_bytes=1000),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
    )
    before = [f"before {i}".encode() for i in range(1000)]
    async with running_server(tmp_path, "s") as first:
        async with Producer(first.target, "s", producer_id="first") as producer:
            await producer.send_many(before)
            await producer.flush(timeout=30)
        # the first run's query, without the driver (nothing but commit(end) releases)
        checkpoint = config.checkpoint_dir / "restart"
        query = await asyncio.to_thread(
            start_query,
            spark,
            store_root=config.blocks_dir,
            streams=["s"],
            pipeline=parquet_pipeline(config.sink_dir),
            checkpoint_dir=checkpoint,
            trigger_seconds=0.5,
            query_name="restart",
        )
        try:
            deadline = time.monotonic() + 120
            while not (checkpoint / "commits" / "0").exists() and time.monotonic() < deadline:
                assert query.exception() is None
                await asyncio.sleep(0.2)
        finally:
            await asyncio.to_thread(query.stop)
    assert WalBlockStore(config.blocks_dir).blocks("s")  # committed, still in the store
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="restart")
    try:
        receiver = server.receivers["s"]
        assert "disk_budget" in receiver.paused  # over the budget from the start
        await asyncio.to_thread(driver.start)
        after = [f"after {i}".encode() for i in range(1000)]
        async with Producer(server.target, "s", producer_id="second") as producer:
            await producer.send_many(after)
            await producer.flush(timeout=60)  # paused for good before
        deadline = time.monotonic() + 120
        while len(got := sink_values(spark, config.sink_dir)) < 2000 and time.monotonic() < deadline:
            assert driver.error() is None, driver.error()
            await asyncio.sleep(0.5)
        assert Counter(got) == Counter(before + after)
    finally:
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


@pytest.mark.spark
async def test_an_idle_query_releases_a_batch_whose_event_was_lost(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    idle_interval = "spark.sql.streaming.noDataProgressEventInterval"
    spark.conf.set(idle_interval, "500")  # read when a query starts; Spark's default is 10 s
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
    )
    server = SluiceServer(config)
    await server.start()
    driver = SparkDriver(spark, config, query_name="idle")
    # the batch's progress never reaches the driver (a full listener bus drops events)
    monkeypatch.setattr(driver._listener, "onQueryProgress", lambda event: None)
    try:
        await asyncio.to_thread(driver.start)
        async with Producer(server.target, "s") as producer:
            await producer.send_many([b"only"] * 100)
            await producer.flush(timeout=30)
        deadline = time.monotonic() + 120
        while sink_values(spark, config.sink_dir) != [b"only"] * 100 and time.monotonic() < deadline:
            assert driver.error() is None, driver.error()
            await asyncio.sleep(0.2)
        deadline = time.monotonic() + 30
        while server.store.blocks("s") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert server.store.blocks("s") == []  # released on the query's idle event, no batch needed
    finally:
        spark.conf.unset(idle_interval)
        await server.stop(grace=1)
        await asyncio.to_thread(driver.stop)


@pytest.mark.spark
async def test_a_kill_while_spark_wrote_its_first_offsets_does_not_block_every_restart(
    spark: Any, tmp_path: Path
) -> None:
    # what `sluice serve` killed -9 while Spark wrote batch 0's offset log entry leaves (seen in
    # test_crash): Spark's temp file, which Spark's check for a new checkpoint then found non-empty
    # (STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY) at every start
    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        streams=("s",),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        trigger_interval=0.5,
    )
    offsets = config.checkpoint_dir / "killed" / "offsets"
    offsets.mkdir(parents=True)
    temp = ".0.05e0796a-48bd-4d84-bfc8-5680154f6ba5.tmp"
    (offsets / temp).write_text('v1\n{"batchWatermarkMs":0,"batchTimestampMs":1,"conf":{}}\n{"s": 3}\n')
    (offsets / f".{temp}.crc").write_bytes(b"crc\x00")
    async with running_server(tmp_path, "s") as server, Producer(server.target, "s") as producer:
        await producer.send_many([b"a", b"b", b"c"])
        await producer.flush(timeout=30)
    driver = SparkDriver(spark, config, query_name="killed")
    try:
        await asyncio.to_thread(driver.start)
        deadline = time.monotonic() + 120
        while sorted(sink_values(spark, config.sink_dir)) != [b"a", b"b", b"c"]:
            assert driver.error() is None, driver.error()
            assert time.monotonic() < deadline, "the records did not reach the sink"
            await asyncio.sleep(0.2)
        assert sorted(p.name for p in offsets.iterdir() if not p.name.startswith(".")) == ["0"]
    finally:
        await asyncio.to_thread(driver.stop)


# ---- concurrent releases ---------------------------------------------------------------------------

RELEASER = """
import sys, time
from pathlib import Path
from receivers.wal import WalBlockStore
from receivers.config import FsyncPolicy

root, go, first, last, step = sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:])
store = WalBlockStore(root, fsync=FsyncPolicy.off())
while not go.exists():
    time.sleep(0.001)
for before in range(first, last, step):
    store.release("s", before)
"""


def test_processes_releasing_at_once_never_move_the_mark_back_nor_lose_producers(tmp_path: Path) -> None:
    # one block per segment, each of its own producer: a release that writes the mark from a stale
    # view, after another process deleted segments, moves the mark back and drops their producers,
    # which only the mark then held (duplicates after the next restart)
    blocks = 150
    writer = WalBlockStore(tmp_path, fsync=FsyncPolicy.off(), segment_bytes=1)
    seq, offset = writer.recover("s")
    for i in range(blocks):
        keys = pa.array([None] * 3, pa.binary())
        values = pa.array([f"v{i}".encode()] * 3, pa.binary())
        times = pa.array([1] * 3, ARRIVAL)
        batch = pa.RecordBatch.from_arrays([keys, values, times], schema=PLAIN_SCHEMA)
        writer.write("s", seq + i, offset + 3 * i, 0, [batch], {f"p{i}": i + 1})
    go = tmp_path / "go"
    # two in step, one striding ahead, one behind: the server's release, Spark's commit(), a restart's
    ranges = [(1, blocks + 1, 1), (1, blocks + 1, 1), (5, blocks + 1, 7), (blocks, 0, -3)]
    procs = [
        subprocess.Popen([sys.executable, "-c", RELEASER, str(tmp_path), str(go), *map(str, r)])
        for r in ranges
    ]
    marks: list[int] = []
    done = threading.Event()

    def watch() -> None:  # the mark as any reader sees it, all along
        while not done.is_set():
            with contextlib.suppress(FileNotFoundError):
                marks.append(json.loads((tmp_path / "s" / STATE_FILE).read_text())["next_seq"])
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    go.touch()
    try:
        trimmed = 0
        while any(p.poll() is None for p in procs):
            trimmed += writer.trim("s")  # the writer drops the newest segment once it is all released
            time.sleep(0.001)
        trimmed += writer.trim("s")
    finally:
        done.set()
        watcher.join()
        for p in procs:
            p.wait(60)
    assert [p.returncode for p in procs] == [0] * len(procs)
    assert marks == sorted(marks), "the released mark went back"
    assert trimmed > 0
    writer.close()
    fresh = WalBlockStore(tmp_path, fsync=FsyncPolicy.off())
    assert fresh.recover("s") == (blocks, 3 * blocks)
    assert fresh.producers("s") == {f"p{i}": i + 1 for i in range(blocks)}
    assert fresh.blocks("s") == []
