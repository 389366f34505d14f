"""Swapping the running query under load, on real parts: a real server, real Spark, a producer that keeps
pushing; the sinks are compared with what was acked (every offset exactly once)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from live_service import SWAP_ACK_PAUSE, Load, admin, offsets_in, service, wait_for_offsets
from test_cli import SLUICE, wait_for_line
from test_config_sources import check, rows

from ingest.pipeline_manager import PipelineManager
from sluice_client import Producer, SyncProducer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import free_ports, sink_values

pytestmark = pytest.mark.spark


async def test_swap_under_load_loses_nothing_and_doubles_nothing(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(3)
        # the new query starts where the old one committed: under load the old one may not have
        # committed a batch in 3 s (CI once saw start offset 0)
        await first_batch_committed(tmp_path / "sink")
        stub = admin(server)
        # where Spark runs, the service is SERVING once its query runs (and intake once the log is open)
        health = health_pb2_grpc.HealthStub(grpc.aio.insecure_channel(server.target))
        for name in ("", "ingest.v1.Ingest"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, name
        before = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (before.pipeline, before.generation, before.state) == ("swap_pipelines:tag_a", 0, "running")
        asked = time.monotonic()
        view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        swapped = time.monotonic()
        await asyncio.sleep(2)
        load.stop()
        await pushing
        assert view.pipeline == "swap_pipelines:tag_b" and view.generation == 1 and view.state == "running"
        assert view.last_swap.outcome == "done", view.last_swap
        # where each query's sink writes (the built-in one's too): a swap gets a folder of its own
        assert (before.sink_dir, view.sink_dir) == (str(tmp_path / "sink"), str(tmp_path / "sink-g1"))
        assert view.last_swap.start_offsets["events"] > 0
        # acks kept flowing through the swap: no pause near a trigger interval, let alone the swap's
        pause = load.longest_ack_pause(asked, swapped)
        gap = view.last_swap.processing_gap_seconds
        print(f"swap took {swapped - asked:.1f} s, processing gap {gap:.1f} s, ack pause {pause:.2f} s")
        assert pause < SWAP_ACK_PAUSE
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink", tmp_path / "sink-g1")
        assert sorted(offsets) == list(range(load.sent))  # each acked record once, across both sinks
        old = offsets_in(spark, tmp_path / "sink")
        new = offsets_in(spark, tmp_path / "sink-g1")
        assert old and new and max(old) < min(new)  # the new query started where the old one ended
        assert min(new) == view.last_swap.start_offsets["events"]


async def first_batch_committed(sink: Path, timeout: float = 120) -> None:
    """Once the file sink at `sink` has committed a batch (Spark runs no batch without new data)."""
    metadata = sink / "_spark_metadata"
    deadline = time.monotonic() + timeout
    while not (metadata.is_dir() and any(p.name.split(".")[0].isdigit() for p in metadata.iterdir())):
        assert time.monotonic() < deadline, f"the query wrote no batch to {sink} in {timeout:g} s"
        await asyncio.sleep(0.5)


def named(folder: Path, pattern: str) -> list[str]:
    return sorted(p.name for p in folder.glob(pattern))


def live(folder: Path, pattern: str) -> list[str]:
    """named(), without the folders set aside"""
    return [name for name in named(folder, pattern) if ".abandoned-" not in name]


async def test_a_swap_that_fails_is_rolled_back(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        stub = admin(server)
        await asyncio.sleep(2)
        # the third try below is refused for the first sink's batches: under load the first query may
        # not have committed one in 2 s (then that swap is rightly allowed)
        await first_batch_committed(tmp_path / "sink")
        # a spec that does not load: refused before anything stops
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="no_such_module:nothing"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no_such_module" in (refused.value.details() or "")
        # fails as it is built, then fails its first batch: both rolled back, the old query runs on
        for spec, said in (
            ("swap_pipelines:broken_at_start", "cannot be built"),
            ("swap_pipelines:fails_first_batch", "refuses batch"),
            # Spark's file sink would skip the new query's batch ids that the old one's metadata lists
            ("swap_pipelines:writes_to_the_first_sink", "a file sink holding batches"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec, first_batch_timeout_seconds=60))
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert said in (failed.value.details() or ""), failed.value.details()
            view = await stub.GetPipeline(pb.GetPipelineRequest())
            assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
            assert view.last_swap.outcome == "rolled back" and said in view.last_swap.error
            # the try's folders are moved aside at once: nothing beside the live sink looks like one
            assert live(tmp_path, "sink-g1*") == [] and live(tmp_path / "checkpoints", "*-g1*") == []
        tried = {name.split(".abandoned-")[0] for name in named(tmp_path / "checkpoints", "*-g1*")}
        assert tried, named(tmp_path / "checkpoints", "*")  # the tries that got as far as a checkpoint
        await asyncio.sleep(1)
        # the next swap takes the failed ones' generation number, in folders of its own: it starts where
        # the old query is now, not where a failed try began (its checkpoint would replay that batch).
        # Its first start fails as when Spark's Python worker misses its fixed 10 s to connect back: a
        # loaded machine's, so it is started once more rather than rolled back
        view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:worker_late_once"))
        assert view.last_swap.outcome == "done" and view.generation == 1, view.last_swap
        assert (tmp_path / "worker-late-once").exists()  # it did fail once
        assert Path(view.checkpoint).name not in tried, (view.checkpoint, tried)
        sink = Path(view.sink_dir)
        assert sink.parent == tmp_path and sink.name.startswith("sink-g1-try"), sink
        await asyncio.sleep(1)
        load.stop()
        await pushing
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink", sink)
        assert sorted(offsets) == list(range(load.sent))  # each acked record once, across both sinks
        assert min(offsets_in(spark, sink)) == view.last_swap.start_offsets["events"]


async def test_a_swap_whose_caller_goes_away_still_ends_on_the_server(spark: Any, tmp_path: Path) -> None:
    """Ctrl-C of `sluice pipeline swap` (or its deadline) during the new query's first batch cancelled
    the swap half-way: the lock was free, `current` and pipeline.json never updated ("swapping" for
    good), and the next swap took generation 1 again, set the running query's checkpoint aside and
    failed over released blocks (the service exited, and every restart). The swap ends all the same."""
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(2)
        stub = admin(server)
        slow = pb.SwapPipelineRequest(pipeline="swap_pipelines:slow_first_batch")
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.SwapPipeline(slow, timeout=3)
        assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.aio.AioRpcError) as busy:  # it still holds the pipeline
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        assert busy.value.code() == grpc.StatusCode.ABORTED, busy.value.details()
        deadline = time.monotonic() + 90
        while (view := await stub.GetPipeline(pb.GetPipelineRequest())).state != "running":
            assert time.monotonic() < deadline, view
            await asyncio.sleep(0.5)
        assert (view.pipeline, view.generation) == ("swap_pipelines:slow_first_batch", 1), view
        assert view.last_swap.outcome == "done", view.last_swap
        saved = json.loads((tmp_path / "pipeline.json").read_text())
        assert saved["current"]["number"] == 1 and saved["trial"] is False
        view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        assert (view.generation, view.last_swap.outcome) == (2, "done"), view.last_swap
        await asyncio.sleep(1)
        load.stop()
        await pushing
        sinks = [tmp_path / "sink", tmp_path / "sink-g1", tmp_path / "sink-g2"]
        offsets = await wait_for_offsets(spark, load.sent, *sinks)
        assert sorted(offsets) == list(range(load.sent))  # each acked record once, across the sinks


EDITED_PIPELINE = """
import time

from pyspark.sql import functions as F
from pyspark.sql.types import StringType


def tag(value):
    return "{tag}"


def build(df, context):
    label = F.udf(tag, StringType())  # runs in Spark's Python workers
    sink = str(context.sink_dir)

    def write(batch, batch_id):  # runs on the driver; looks `tag` up in its module at every batch
        out = batch.select("offset", label("value").alias("worker"), F.lit(tag(None)).alias("driver"))
        out.write.mode("append").parquet(sink)

    return df.writeStream.foreachBatch(write)


time.sleep({sleep})  # a module that takes a while to import: the running query's batches go on meanwhile
"""


async def test_a_swap_runs_the_modules_source_as_edited_since_an_earlier_swap(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Swapping to a module, editing it, swapping again ran the first version: the module was taken
    from sys.modules. Now imported anew each time, without touching the running query's copy until
    its boundary, and its UDFs reach Spark's (reused) Python workers in the version loaded."""
    name = f"edited_pipeline_{os.getpid()}_{time.monotonic_ns()}"
    folder = tmp_path / "modules"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    module = folder / f"{name}.py"
    async with service(spark, tmp_path / "data") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        stub = admin(server)
        await asyncio.sleep(1)
        module.write_text('def build(df, context):\n    raise RuntimeError("version 1 of build")\n')
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=f"{name}:build"))
        assert "version 1 of build" in (failed.value.details() or ""), failed.value.details()
        module.write_text(EDITED_PIPELINE.format(tag="v2", sleep=0))  # fixed
        view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=f"{name}:build"))
        assert (view.generation, view.last_swap.outcome) == (1, "done"), view.last_swap
        await asyncio.sleep(1)
        module.write_text(EDITED_PIPELINE.format(tag="v3, edited", sleep=3))
        view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=f"{name}:build"))
        assert (view.generation, view.last_swap.outcome) == (2, "done"), view.last_swap
        await asyncio.sleep(1)
        load.stop()
        await pushing
        sinks = [tmp_path / "data" / "sink", Path(view.sink_dir).with_name("sink-g1"), Path(view.sink_dir)]
        offsets = await wait_for_offsets(spark, load.sent, *sinks)
        assert sorted(offsets) == list(range(load.sent))  # each acked record once, across the sinks
    for sink, version in ((sinks[1], "v2"), (sinks[2], "v3, edited")):
        rows = spark.read.parquet(str(sink)).select("worker", "driver").distinct().collect()
        assert [(r["worker"], r["driver"]) for r in rows] == [(version, version)], sink


async def test_a_first_batch_that_hangs_is_left_behind_and_rolled_back(spark: Any, tmp_path: Path) -> None:
    """A swapped-in first batch that never ends: Spark's stop() waited for it for good (its default
    spark.sql.streaming.stopTimeout), so the rollback never came and the service did not stop even
    on SIGTERM. The stop gives up after the timeout now, the batch is left behind, the old query runs
    again (under another name: the hung query still holds its own)."""
    import swap_pipelines

    from ingest.spark.session import STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS

    assert spark.conf.get(STOP_TIMEOUT_KEY) == STOP_TIMEOUT_MS  # the service's default: not forever
    spark.conf.set(STOP_TIMEOUT_KEY, "2000")  # not a minute here
    try:
        async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
            load = Load(server.target, "events")
            pushing = asyncio.create_task(load.run())
            await asyncio.sleep(2)
            stub = admin(server)
            # 10 s for the new query to reach its batch: with 3, a machine busy with other tests
            # sometimes had not started it, the stop found nothing running, and nothing was left behind
            hangs = pb.SwapPipelineRequest(
                pipeline="swap_pipelines:hangs_first_batch", first_batch_timeout_seconds=10
            )
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await asyncio.wait_for(stub.SwapPipeline(hangs), 120)
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "within 10 s" in (failed.value.details() or ""), failed.value.details()
            # the batch that hangs said so in its folder, set aside by the rollback
            hung = named(tmp_path, "sink-g1.abandoned-*/first-batch-started")
            assert hung, f"the first batch had not started: {named(tmp_path, '*')}"
            view = await stub.GetPipeline(pb.GetPipelineRequest())
            assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
            # the next try of generation 1 gets folders of its own: the hung query, once its batch
            # returns, writes by path into the folders it had, not into the new query's
            await asyncio.sleep(1)
            view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
            assert view.last_swap.outcome == "done" and view.generation == 1, view.last_swap
            sink = Path(view.sink_dir)
            assert sink.name != "sink-g1" and not Path(view.checkpoint).name.endswith("-g1"), view
            swap_pipelines.RELEASE_HUNG.set()
            deadline = time.monotonic() + 90  # a loaded 2-core machine (tests beside it): generous
            while not (tmp_path / "sink-g1" / "left-behind").exists():
                assert time.monotonic() < deadline, named(tmp_path, "*")
                await asyncio.sleep(0.2)
            assert not (sink / "left-behind").exists()
            await asyncio.sleep(1)
            load.stop()
            await pushing
            offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink", sink)
            assert sorted(offsets) == list(range(load.sent))  # each acked record once, across both sinks
    finally:
        swap_pipelines.RELEASE_HUNG.set()
        spark.conf.set(STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS)


async def test_the_clis_swap_deadline_outlasts_a_hung_first_batchs_rollback(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sluice pipeline swap` waited first-batch-timeout + 90 s, and a hung first batch's rollback takes
    the timeout, then Spark's stopTimeout (60 s) for the stop, and the boundary and the starts: the CLI
    said only "no answer within ..." while the swap went on. Its deadline covers them now; past it (a
    server whose stopTimeout is longer than the CLI knows, as here), it says the swap goes on on the
    server and how to see its outcome."""
    import swap_pipelines

    from ingest import cli
    from ingest.pipeline_control import BOUNDARY_TIMEOUT, STOP_TIMEOUT
    from ingest.spark.session import STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS

    assert cli.swap_deadline(120) >= 120 + BOUNDARY_TIMEOUT + 3 * STOP_TIMEOUT + 30
    assert float(STOP_TIMEOUT_MS) / 1000 == STOP_TIMEOUT  # the stopTimeout the service sets
    # this server's stop waits 4 s; the CLI counts on none, with no boundary and no margin: 2 s
    for name, seconds in (("BOUNDARY_TIMEOUT", 0.0), ("STOP_TIMEOUT", 0.0), ("SWAP_MARGIN", 0.0)):
        monkeypatch.setattr(cli, name, seconds)
    swap_pipelines.RELEASE_HUNG.clear()
    spark.conf.set(STOP_TIMEOUT_KEY, "4000")
    try:
        async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
            load = Load(server.target, "events")
            pushing = asyncio.create_task(load.run())
            await asyncio.sleep(2)
            swap = ["pipeline", "swap", "swap_pipelines:hangs_first_batch", "--first-batch-timeout", "2"]
            assert await asyncio.to_thread(cli.main, [*swap, "--target", server.target]) == 1
            said = capsys.readouterr().err
            assert f"pipeline swap on {server.target}: no answer within 2 s; the swap goes on" in said, said
            assert f"`sluice pipeline get --target {server.target}` shows its outcome" in said, said
            assert "Traceback" not in said
            stub = admin(server)
            deadline = time.monotonic() + 60
            while (view := await stub.GetPipeline(pb.GetPipelineRequest())).state != "running":
                assert time.monotonic() < deadline, view
                await asyncio.sleep(0.2)
            assert view.last_swap.outcome == "rolled back" and view.generation == 0, view
            get = ["pipeline", "get", "--target", server.target]
            assert await asyncio.to_thread(cli.main, get) == 0
            assert "rolled back" in capsys.readouterr().out
            load.stop()
            await pushing
    finally:
        swap_pipelines.RELEASE_HUNG.set()
        spark.conf.set(STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS)


async def test_the_clis_swap_deadline_counts_every_stop_a_swap_may_wait_for(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A swap whose old query's batch outlasts the boundary stops that query mid-batch, and Spark's stop
    waits up to its stopTimeout for the batch; a new first batch that hangs is stopped at the rollback,
    stopTimeout again; and the rollback's start of the old query first stops the old run left behind on
    its checkpoint, a third time. `sluice pipeline swap` counted one stop: it said "no answer within
    ..." while the server was still on its way to its answer. Here the server's and the CLI's bounds
    agree, shortened: boundary 2 s, stops 8 s, first batch 10 s (its batch has started by then), the
    CLI's margin for starts 12 s."""
    import swap_pipelines

    from ingest import cli, pipeline_manager
    from ingest.spark.session import STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS

    stop = 8.0
    monkeypatch.setattr(pipeline_manager, "BOUNDARY_TIMEOUT", 2.0)
    for name, seconds in (("BOUNDARY_TIMEOUT", 2.0), ("STOP_TIMEOUT", stop), ("SWAP_MARGIN", 12.0)):
        monkeypatch.setattr(cli, name, seconds)
    swap_pipelines.RELEASE_HUNG.clear()
    spark.conf.set(STOP_TIMEOUT_KEY, str(int(stop * 1000)))
    try:
        async with service(spark, tmp_path, pipeline="swap_pipelines:hangs_when_asked") as server:
            load = Load(server.target, "events")
            pushing = asyncio.create_task(load.run())
            await asyncio.sleep(2)
            swap_pipelines.HANG_NEXT.set()  # the old query's next batch hangs: no boundary comes
            assert await asyncio.to_thread(swap_pipelines.HANGING.wait, 60)
            swap = ["pipeline", "swap", "swap_pipelines:hangs_first_batch", "--first-batch-timeout", "10"]
            started = time.monotonic()
            code = await asyncio.to_thread(cli.main, [*swap, "--target", server.target])
            took = time.monotonic() - started
            said = capsys.readouterr().err
            # the server's answer (its rollback could not restart the old query: the old run left
            # behind holds its checkpoint, docs/runtime.md), not the CLI's deadline
            assert code == 1, said
            assert f"pipeline swap on {server.target}: FAILED_PRECONDITION: " in said, said
            assert "no answer within" not in said, said
            assert took > 3 * stop, took  # each of the three stops waited for its batch
            load.stop()
            await pushing
    finally:
        swap_pipelines.RELEASE_HUNG.set()
        swap_pipelines.HANG_NEXT.clear()
        swap_pipelines.HANGING.clear()
        spark.conf.set(STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS)


async def test_a_trigger_change_whose_caller_goes_away_is_saved_all_the_same(
    spark: Any, tmp_path: Path
) -> None:
    """`sluice config set trigger-interval=...` restarts the query; a client that went away mid-restart
    (Ctrl-C, its deadline) cancelled the call there: the restart ran to its end (the manager's task) but
    the setting was never saved, so the query ran on the new interval while `config get`, the rate
    loop and the next start kept the old one. The change now runs to its end on the server."""
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(2)
        stub = admin(server)
        with pytest.raises(grpc.aio.AioRpcError) as gone:
            await stub.SetConfig(pb.SetConfigRequest(set={"trigger-interval": "2"}), timeout=0.3)
        assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.aio.AioRpcError) as busy:  # the restart still holds the query
            await stub.SetConfig(pb.SetConfigRequest(set={"trigger-interval": "3"}))
        assert busy.value.code() == grpc.StatusCode.ABORTED, busy.value.details()
        deadline = time.monotonic() + 90
        while True:
            config = await stub.GetConfig(pb.GetConfigRequest(keys=["trigger-interval"]))
            if config.settings[0].value == "2":
                break
            assert time.monotonic() < deadline, config
            await asyncio.sleep(0.5)
        assert config.settings[0].source == "dynamic" and config.version == 1, config
        saved = json.loads((tmp_path / "runtime-config.json").read_text())
        assert saved["overrides"] == {"trigger-interval": "2"}, saved
        view = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (view.trigger_interval_seconds, view.state) == (2.0, "running"), view
        assert server.config.trigger_interval == 2.0  # applied: the rate loop's batch interval too
        await asyncio.sleep(1)
        load.stop()
        await pushing
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink")
        assert sorted(offsets) == list(range(load.sent))


async def test_a_reset_pipeline_is_a_trial_until_its_first_batch(spark: Any, tmp_path: Path) -> None:
    """`--reset-pipeline` saved its new generation as final: one that failed at its first start left no
    way back but another reset. It is a trial, as a swap's new query is: the next start runs the
    generation it replaced unless it committed a batch, and its first batch makes it final."""
    sent = 0

    async def push_for(server: Any, seconds: float) -> None:
        nonlocal sent
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(seconds)
        load.stop()
        await pushing
        sent += load.sent

    def saved() -> Any:
        return json.loads((tmp_path / "pipeline.json").read_text())

    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        await push_for(server, 2)
        view = await admin(server).SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        assert view.generation == 1 and view.last_swap.outcome == "done", view.last_swap
        await push_for(server, 1)
    with pytest.raises(Exception, match="cannot be built"):  # what Spark raises
        async with service(spark, tmp_path, pipeline="swap_pipelines:broken_at_start", reset_pipeline=True):
            pass
    assert (saved()["current"]["number"], saved()["trial"]) == (2, True)
    # the next start runs generation 1 again, where it stood (the flag's pipeline is not the reset's)
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        view = await admin(server).GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_b", 1, "running")
        await push_for(server, 1)
        await wait_for_offsets(spark, sent, tmp_path / "sink", Path(view.sink_dir))
    # generation 1's run as if stopped (or killed) between its file sink's commit and its commit log's:
    # the reset must start past the batch the sink holds, or it writes those records twice (CI saw it)
    g1 = Path(view.checkpoint)
    last = max(int(name) for name in os.listdir(g1 / "commits") if name.isdigit())
    assert (Path(view.sink_dir) / "_spark_metadata" / str(last)).exists() or any(
        name.startswith(f"{last}.") for name in os.listdir(Path(view.sink_dir) / "_spark_metadata")
    )
    (g1 / "commits" / str(last)).unlink()
    # a reset that works: a trial until its first batch commits, then kept
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a", reset_pipeline=True) as server:
        assert (saved()["current"]["number"], saved()["trial"]) == (2, True)
        await push_for(server, 2)
        deadline = time.monotonic() + 60
        while saved()["trial"]:
            assert time.monotonic() < deadline, saved()
            await asyncio.sleep(0.2)
        view = await admin(server).GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 2, "running")
        sinks = [tmp_path / "sink", tmp_path / "sink-g1", tmp_path / "sink-g2"]
        offsets = await wait_for_offsets(spark, sent, *sinks)
        assert sorted(offsets) == list(range(sent))  # each acked record once, across the sinks


async def test_an_idle_reset_pipeline_is_kept_once_it_found_nothing_to_read(
    spark: Any, tmp_path: Path
) -> None:
    """A review's worry: a reset generation with nothing to read commits no batch, so it would stay a
    trial for good and the next start without the flag would go back to the pipeline it replaced.
    With real Spark it is not so: the new query's first trigger commits batch 0 (at the offsets it
    starts from), and that keeps it."""

    def saved() -> Any:
        return json.loads((tmp_path / "pipeline.json").read_text())

    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        view = await admin(server).SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        assert view.generation == 1 and view.last_swap.outcome == "done", view.last_swap
        load = Load(server.target, "events")  # generation 1 commits batches: the reset starts at their end
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(1)
        load.stop()
        await pushing
        await wait_for_offsets(spark, load.sent, tmp_path / "sink", Path(view.sink_dir))
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a", reset_pipeline=True):
        deadline = time.monotonic() + 60
        while saved()["trial"]:
            assert time.monotonic() < deadline, saved()
            await asyncio.sleep(0.2)
    assert (saved()["current"]["spec"], saved()["current"]["number"]) == ("swap_pipelines:tag_a", 2)
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        view = await admin(server).GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 2, "running")


@pytest.mark.parametrize(
    "late",
    [
        TimeoutError("the new query did not complete its first batch within 120 s"),
        RuntimeError("the new query stopped before its first batch: its second batch failed"),
    ],
    ids=["deadline", "failure"],
)
async def test_a_try_that_committed_a_batch_is_kept_not_rolled_back(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late: Exception
) -> None:
    """The deadline can pass, or the query fail, after the new query's first batch committed but before
    the manager heard of it (Spark reports a batch after its commit). That batch's blocks are released
    then: rolled back, the old query failed to plan over them and the service's query stopped. Here the
    manager is told so right after the first batch is seen; the commits and releases are real Spark's:
    the new query is kept."""
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        manager = server.pipeline_control
        assert isinstance(manager, PipelineManager)
        prove = manager._start_and_prove

        async def told_after_the_first_batch(new: Any, trigger: float, timeout: float) -> Any:
            await prove(new, trigger, timeout)
            raise late

        monkeypatch.setattr(manager, "_start_and_prove", told_after_the_first_batch)
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(2)
        view = await admin(server).SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
        assert view.last_swap.outcome == "done", view.last_swap
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_b", 1, "running")
        await asyncio.sleep(2)  # the kept query goes on: its later batches land in its sink too
        load.stop()
        await pushing
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink", tmp_path / "sink-g1")
        assert sorted(offsets) == list(range(load.sent))  # each acked record once, across both sinks
        assert named(tmp_path, "*.abandoned-*") == []
        assert named(tmp_path / "checkpoints", "*.abandoned-*") == []
        saved = json.loads((tmp_path / "pipeline.json").read_text())
        assert saved["current"]["spec"] == "swap_pipelines:tag_b" and saved["trial"] is False
        assert (await admin(server).GetPipeline(pb.GetPipelineRequest())).state == "running"


async def test_nexmark_q1_to_q2_under_load(spark: Any, tmp_path: Path) -> None:
    """The issue's case: Nexmark events flow, Q1 (currency conversion) is swapped for Q2 (selection)."""
    from ingest.nexmark.generator import GeneratorConfig, NexmarkGenerator

    generator = NexmarkGenerator(GeneratorConfig(seed=7))
    events: list[Any] = []

    def make(first: int, n: int) -> tuple[list[bytes], list[bytes | None]]:
        made = generator.take(n)
        events.extend(made)
        return [e.encode() for e in made], [e.key for e in made]

    async with service(spark, tmp_path, "nexmark", pipeline="ingest.nexmark.queries:q1") as server:
        load = Load(server.target, "nexmark", per_tick=100, make=make)  # ~5,000 events/s
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(4)
        asked = time.monotonic()
        view = await admin(server).SwapPipeline(pb.SwapPipelineRequest(pipeline="ingest.nexmark.queries:q2"))
        swapped = time.monotonic()
        await asyncio.sleep(3)
        load.stop()
        await pushing
        assert view.last_swap.outcome == "done", view.last_swap
        assert load.longest_ack_pause(asked, swapped) < SWAP_ACK_PAUSE
        start = view.last_swap.start_offsets["nexmark"]
        bids = [(offset, e.bid) for offset, e in enumerate(events) if e.bid is not None]
        q1_expected = sorted(offset for offset, _ in bids if offset < start)
        q2_expected = sorted(offset for offset, bid in bids if offset >= start and bid.auction % 123 == 0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            q1 = await asyncio.to_thread(source_offsets, spark, tmp_path / "sink")
            q2 = await asyncio.to_thread(source_offsets, spark, tmp_path / "sink-g1")
            if len(q1) >= len(q1_expected) and len(q2) >= len(q2_expected):
                break
            await asyncio.sleep(1)
        assert sorted(q1) == q1_expected  # Q1 saw every bid before the swap, once
        assert sorted(q2) == q2_expected  # Q2 every selected bid after it, once
        assert q2_expected, "no bid on a selected auction after the swap: push longer"


def source_offsets(spark: Any, sink: Path) -> list[int]:
    from pyspark.errors import AnalysisException

    try:
        return [r[0] for r in spark.read.parquet(str(sink)).select("source_offset").collect()]
    except AnalysisException:
        return []


async def test_keep_state_continues_the_old_checkpoint(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(3)
        await wait_for_offsets(spark, 1, tmp_path / "sink")  # the old query wrote rows (slow machines)
        stub = admin(server)
        before = await stub.GetPipeline(pb.GetPipelineRequest())
        view = await stub.SwapPipeline(
            pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b", keep_state=True)
        )
        await asyncio.sleep(2)
        load.stop()
        await pushing
        assert view.last_swap.outcome == "done" and view.last_swap.kept_state
        # the same checkpoint (offsets, commits, state) and so the same query id and sink folder
        assert (view.generation, view.checkpoint, view.query_id) == (1, before.checkpoint, before.query_id)
        assert view.sink_dir == before.sink_dir == str(tmp_path / "sink")
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink")
        assert sorted(offsets) == list(range(load.sent))
        rows = await asyncio.to_thread(
            lambda: spark.read.parquet(str(tmp_path / "sink")).select("offset", "pipeline").collect()
        )
        tags = {r["pipeline"] for r in rows}
        assert tags == {"a", "b"}
        last_a = max(r["offset"] for r in rows if r["pipeline"] == "a")
        assert last_a < min(r["offset"] for r in rows if r["pipeline"] == "b")
    # after a restart the kept generation runs again
    saved = json.loads((tmp_path / "pipeline.json").read_text())
    assert saved["current"]["spec"] == "swap_pipelines:tag_b" and saved["trial"] is False


async def test_a_long_trigger_interval_is_taken_by_an_idle_service(spark: Any, tmp_path: Path) -> None:
    """`config set trigger-interval=86400` (the bound the docs give) on a service with nothing to read
    failed after 120 s, rolled back: an idle new query was kept only once idle for a whole interval.
    It is kept once idle through its first trigger (which Spark runs at once) now."""
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(2)
        load.stop()
        await pushing
        await wait_for_offsets(spark, load.sent, tmp_path / "sink")  # everything read: idle now
        started = time.monotonic()
        view = await admin(server).SetConfig(pb.SetConfigRequest(set={"trigger-interval": "86400"}))
        took = time.monotonic() - started
        assert {x.key: x.value for x in view.settings}["trigger-interval"] == "86400"
        assert took < 60, f"{took:.0f} s to restart an idle query"


class _Serve:
    """`sluice serve` (Spark local[2]) in a process group of its own on a fixed port and data dir, the
    tests' pipelines importable; restartable. Killed as a group (SIGKILL), its Spark JVM goes with it."""

    def __init__(self, tmp: Path, *importable: Path) -> None:
        self.tmp, self.port, self.runs = tmp, free_ports(1)[0], 0
        self.importable = [str(Path(__file__).parent), *map(str, importable)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.target = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.target)  # reconnects to each run

    @property
    def log(self) -> Path:
        return self.tmp / f"serve-{self.runs}.log"

    def start(self, *args: str) -> None:
        self.runs += 1
        command = [*SLUICE, "serve", "--port", str(self.port), "--metrics-port", "-1"]
        command += ["--data-dir", str(self.tmp / "data"), "--master", "local[2]", "--trigger-interval", "0.5"]
        path = os.pathsep.join(p for p in (*self.importable, os.environ.get("PYTHONPATH")) if p)
        with self.log.open("wb") as log_file:
            self.proc = subprocess.Popen(
                [*command, *args],
                stderr=log_file,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
                start_new_session=True,
            )
        wait_for_line(self.proc, self.log, "Spark query running", 180)

    def admin(self) -> Any:
        return pb_grpc.AdminStub(self.channel)

    def push(self, values: list[bytes]) -> None:
        with SyncProducer(self.target, "default") as producer:
            producer.send_many(values)
            producer.flush(60)  # acked: durable in the block log

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=180)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)


def _wait_for_file(path: Path, serve: _Serve, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert serve.proc is not None and serve.proc.poll() is None, serve.log.read_text(errors="replace")
        assert time.monotonic() < deadline, f"no {path}:\n{serve.log.read_text(errors='replace')}"
        time.sleep(0.2)


@pytest.mark.timeout(900)  # three starts of Spark in a process of its own: about 2 min here, alone
def test_a_crash_mid_swap_away_from_a_reset_in_trial_comes_back_on_the_generation_before_it(
    tmp_path: Path,
) -> None:
    """kill -9 while a swap replaces a `--reset-pipeline` generation that never committed a batch (its
    first batch failed while the swap waited for it). The swap's trial record in pipeline.json took the
    place of the reset's, so the restart, going back from the swap's uncommitted query, kept the reset
    generation for good: it ran again (and failed again, and at every start after), with nothing to go
    back to. The reset is a trial still: it committed nothing, so the restart runs the generation it
    replaced, and every acked record reaches a sink once."""
    serve = _Serve(tmp_path)
    data = tmp_path / "data"
    sent: list[bytes] = []

    def push(tag: str, n: int) -> None:
        values = [f"{tag}{i}".encode() for i in range(n)]
        serve.push(values)
        sent.extend(values)

    try:
        serve.start()  # generation 0 (the built-in sink), then 1 (tag_b), swapped in at run time
        push("a", 500)
        to_b = pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b")
        view = serve.admin().SwapPipeline(to_b, timeout=300)
        assert (view.generation, view.last_swap.outcome) == (1, "done"), view.last_swap
        push("b", 500)
        assert serve.stop() == 0
        # a reset to a pipeline whose first batch fails: generation 2, a trial
        serve.start("--pipeline", "swap_pipelines:fails_when_told", "--reset-pipeline")
        _wait_for_file(data / "sink-g2" / "first-batch-started", serve)
        push("c", 500)  # acked while no query gets anywhere
        swap = serve.admin().SwapPipeline.future(
            pb.SwapPipelineRequest(pipeline="swap_pipelines:hangs_once_started"), timeout=300
        )
        deadline = time.monotonic() + 60  # the swap waits for generation 2's batch at the boundary
        while serve.admin().GetPipeline(pb.GetPipelineRequest()).state != "swapping":
            assert time.monotonic() < deadline and not swap.done(), serve.log.read_text(errors="replace")
            time.sleep(0.1)
        (data / "sink-g2" / "fail-now").touch()  # generation 2's first batch fails: nothing committed
        _wait_for_file(data / "sink-g3" / "first-batch-started", serve)  # generation 3's hangs
        saved = json.loads((data / "pipeline.json").read_text())
        assert (saved["current"]["number"], saved["trial"]) == (3, True), saved
        serve.kill()
        swap.cancel()
        checked = check("--data-dir", str(data))  # what a start would run, as config check says it
        assert checked.returncode == 0, checked.stderr
        assert rows(checked.stdout)["pipeline"][0] == "swap_pipelines:tag_b", checked.stdout
        # as the service was started before the reset
        serve.start()
        view = serve.admin().GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_b", 1, "running"), (
            view,
            serve.log.read_text(errors="replace"),
        )
        push("d", 500)
        assert serve.stop() == 0  # drains: every acked record is processed
    finally:
        serve.kill()
        serve.channel.close()
    got = Counter(v for sink in ("sink", "sink-g1", "sink-g2", "sink-g3") for v in sink_values(data / sink))
    assert sorted(got) == sorted(sent) and set(got.values()) == {1}, got  # each acked record once


COUNTED = """
from pathlib import Path

_imports = Path(__file__).with_suffix(".imports")  # one line per import of this module
with _imports.open("a") as _out:
    _out.write("imported\\n")


def build(df):
    return df.selectExpr("CAST(value AS STRING) AS line").writeStream.format("noop")
"""
"""A pipeline module that counts its imports (the lines of import_counted.imports beside it)."""


def counted_module(folder: Path) -> Path:
    """import_counted.py in `folder` (made); the file its imports are counted in."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "import_counted.py").write_text(COUNTED)
    return folder / "import_counted.imports"


def imports(counter: Path) -> int:
    return len(counter.read_text().splitlines()) if counter.exists() else 0


async def test_the_start_imports_the_pipelines_module_once(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver loaded the config's pipeline when it was made and the pipeline manager again for the
    generation it starts: the user's module was imported, its top level run, twice per start. Once now
    (a swap still imports it anew, by design)."""
    counter = counted_module(tmp_path / "modules")
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    monkeypatch.delitem(sys.modules, "import_counted", raising=False)
    async with service(spark, tmp_path / "data", pipeline="import_counted:build") as server:
        view = await admin(server).GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.state) == ("import_counted:build", "running"), view
        assert imports(counter) == 1


@pytest.mark.timeout(600)
def test_sluice_serve_imports_the_pipelines_module_once(tmp_path: Path) -> None:
    """`sluice serve --pipeline` imported the user's module three times at its start: its check before
    Spark starts, the driver, the pipeline manager. The check's import is the one the query runs."""
    counter = counted_module(tmp_path / "modules")
    serve = _Serve(tmp_path, tmp_path / "modules")
    try:
        serve.start("--pipeline", "import_counted:build")
        assert imports(counter) == 1, serve.log.read_text(errors="replace")
        assert serve.stop() == 0, serve.log.read_text(errors="replace")
    finally:
        serve.kill()
        serve.channel.close()


async def test_pipeline_get_during_a_swap_shows_one_generation_and_the_gap_skips_idle_time(
    spark: Any, tmp_path: Path
) -> None:
    """An outside tester: `sluice pipeline get` during a swap showed "generation 2, swapping" beside the
    checkpoint of the query being tried (sluice-g3) and the sink of generation 2; and a swap of an idle
    query reported "done in 2.1 s, processing gap 60.4 s": the gap ran from the old query's last batch,
    a minute before the swap was asked. During a swap the view is the generation in force, its
    checkpoint and sink (no query id: the one running is the try); the gap starts at the request when
    the old query was idle."""
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        async with Producer(server.target, "events") as producer:
            await producer.send_many([b"early"] * 50)
            await producer.flush(timeout=30)
        stub = admin(server)
        deadline = time.monotonic() + 60
        while not offsets_in(spark, tmp_path / "sink"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.5)
        before = await stub.GetPipeline(pb.GetPipelineRequest())
        await asyncio.sleep(4)  # the old query idle: nothing to read
        swapping = asyncio.ensure_future(
            stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:slow_first_batch"))
        )
        asked = time.monotonic()
        views = []
        while not swapping.done():
            view = await stub.GetPipeline(pb.GetPipelineRequest())
            if view.state == "swapping" and not views:  # records for the new query's first batch
                async with Producer(server.target, "events", producer_id="late") as producer:
                    await producer.send_many([b"late"] * 50)
                    await producer.flush(timeout=30)
            if view.state == "swapping":
                views.append(view)
            await asyncio.sleep(0.2)
        done = await swapping
        took = time.monotonic() - asked
        assert views, "no view while swapping"
        for view in views:  # generation 0 throughout: its spec, checkpoint and sink, no query of the try
            assert (view.pipeline, view.generation) == ("swap_pipelines:tag_a", 0), view
            assert (view.checkpoint, view.sink_dir) == (before.checkpoint, before.sink_dir), view
            assert view.query_id == "", view
        assert (done.generation, done.state, done.last_swap.outcome) == (1, "running", "done"), done
        assert done.checkpoint != before.checkpoint and done.query_id
        assert 0 < done.last_swap.processing_gap_seconds <= took + 0.5, (done.last_swap, took)


UNPICKLABLE = """
import threading

from pyspark.sql import functions as F
from pyspark.sql.types import StringType

LOCK = threading.Lock()


@F.udf(StringType())
def upper(value):
    with LOCK:
        return value.decode().upper()


def build(df):
    return df.select(upper("value").alias("v")).writeStream.format("noop")


def raises(df):
    return {}["no such setting"]
"""


@pytest.mark.parametrize(
    ("function", "said"),
    [
        # Sluice sends the module's functions by value (fresh_import): a module-level lock goes with them
        ("build", r"did not start: PicklingError: .*cannot pickle '_thread.lock' object \(at lock_global.py "
         r"line 17\); the pipeline module's functions reach Spark's Python workers by value"),
        ("raises", r"did not start: KeyError: 'no such setting' \(at lock_global.py line 21\)$"),
    ],
)  # fmt: skip
async def test_a_pipeline_that_does_not_start_is_named_in_one_line(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, said: str
) -> None:
    """`sluice serve --pipeline` with a pipeline whose build raised, or whose UDF does not pickle, ended
    in a traceback; the start now fails with one line (the CLI's "cannot start the Spark query: ...",
    exit 1) naming the error, the line of the user's file and, for a pickling error, what to do."""
    from ingest.pipeline_state import PipelineStateError

    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "lock_global.py").write_text(UNPICKLABLE)
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    monkeypatch.delitem(sys.modules, "lock_global", raising=False)
    with pytest.raises(PipelineStateError, match=said):
        async with service(spark, tmp_path / "data", pipeline=f"lock_global:{function}"):
            pass


async def test_a_swap_to_a_module_that_exits_is_refused_or_rolled_back(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline module that calls sys.exit() as it is imported (argparse's parse_args() at module level
    sees sluice's own argv and exits), or a pipeline that does so as it is built: SystemExit is no
    Exception, so it went past load_pipeline's and the swap's handlers, out of the event loop. The first
    is now refused like any module that fails to import, the second rolled back like any failed build."""
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "sluice_test_argv.py").write_text(
        "import argparse\n\nARGS = argparse.ArgumentParser().parse_args(['--no-such-flag'])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    async with service(spark, tmp_path / "data", pipeline="swap_pipelines:tag_a") as server:
        stub = admin(server)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="sluice_test_argv:pipe"))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert "sluice_test_argv" in details and "SystemExit" in details, details
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            spec = "swap_pipelines:exits_when_built"
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec, first_batch_timeout_seconds=60))
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        said = (
            "pipeline swap_pipelines:exits_when_built called sys.exit('usage: my_pipeline.py [--sink DIR]')"
        )
        assert said in (failed.value.details() or ""), failed.value.details()
        assert "(at swap_pipelines.py line " in (failed.value.details() or ""), failed.value.details()
        view = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
        assert view.last_swap.outcome == "rolled back"


async def test_a_foreach_batch_function_that_exits_fails_its_batch(spark: Any, tmp_path: Path) -> None:
    """A foreachBatch function that calls sys.exit(): PySpark and py4j catch Exception only, so the
    callback thread ended without answering and the batch waited for ever (the swap was rolled back
    only at its first-batch timeout, a start hung). Now the batch fails, naming the exit, at once."""
    async with service(spark, tmp_path / "data", pipeline="swap_pipelines:tag_a") as server:
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        stub = admin(server)
        await first_batch_committed(tmp_path / "data" / "sink")
        began = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            spec = "swap_pipelines:exits_in_batch"
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec, first_batch_timeout_seconds=120))
        details = failed.value.details() or ""
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "the foreachBatch function called sys.exit('bad record in batch 0')" in details, details
        assert time.monotonic() - began < 60, details
        view = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
        load.stop()
        await pushing


async def test_a_pipeline_that_starts_its_own_query_is_rolled_back_and_that_query_stopped(
    spark: Any, tmp_path: Path
) -> None:
    """A pipeline ending in `.start()` returns a running StreamingQuery: the swap was refused for the
    type, but that query ran on beside the old one, a second reader of the same streams whose commits
    release their blocks. It is now stopped, and the error says to return the writer."""
    async with service(spark, tmp_path / "data", pipeline="swap_pipelines:tag_a") as server:
        stub = admin(server)
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            spec = "swap_pipelines:starts_its_own_query"
            await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec, first_batch_timeout_seconds=60))
        details = failed.value.details() or ""
        assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
        assert "returned a started StreamingQuery" in details and "without .start()" in details, details
        view = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
        assert len(spark.streams.active) == 1, [q.name for q in spark.streams.active]


async def test_a_swap_error_names_the_pipeline_as_it_was_given_not_by_its_repr(
    spark: Any, tmp_path: Path
) -> None:
    """A swap to a pipeline that returns no DataStreamWriter was rolled back saying "pipeline <function
    not_a_writer at 0x7f...>": it names the pipeline as the swap gave it now, module:function, one a
    factory made (whose own name is _factory.<locals>.pipeline) too."""
    async with service(spark, tmp_path / "data", pipeline="swap_pipelines:tag_a") as server:
        stub = admin(server)
        for spec in ("swap_pipelines:not_a_writer", "swap_pipelines:made_by_a_factory"):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec, first_batch_timeout_seconds=60))
            details = failed.value.details() or ""
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
            said = f"TypeError: pipeline {spec} returned DataFrame, not a DataStreamWriter"
            assert said in details and "0x" not in details, details
        view = await stub.GetPipeline(pb.GetPipelineRequest())
        assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_a", 0, "running")
