"""The control loop's wiring: batch metrics -> controller -> receivers' credit, and the live cap per batch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import io
import math
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from support import positions, running_server, wait_until

from ingest import cli, rate_service
from ingest.driver import batch_metrics
from ingest.rate_controller import RateController
from ingest.spark.listener import BatchCompleted
from ingest.spark.live_rate import LiveRateCap
from ingest.spark.source import SluiceStreamReader
from ratecontrol import BatchMetrics, ModelEstimator
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

TARGET = inspect.signature(ModelEstimator).parameters["target_utilisation"].default
"""The model's default share of capacity in steady state."""


def batch(batch_id: int, records: int, processing: float, delay: float = 0.0) -> BatchMetrics:
    return BatchMetrics(
        batch_id=batch_id,
        completed_at=float(batch_id),
        records=records,
        processing_delay=processing,
        scheduling_delay=delay,
        batch_interval=1.0,
    )


async def test_estimated_rates_reach_the_receivers_clamped_and_split(tmp_path: Path) -> None:
    async with running_server(tmp_path, "a", "b") as server:
        controller = server.rate
        controller.set_bounds(100, 50_000)
        controller.set_estimator("spark-pid")
        controller.update(20_000)
        # Spark's PID: the first batch only primes it; the second proposes a rate
        controller.on_batch(batch(1, 10_000, 0.5))
        controller.on_batch(batch(2, 10_000, 0.5))
        assert controller.last_batch is not None and controller.last_batch.batch_id == 2
        assert 100 <= controller.rate <= 50_000
        assert server.receivers["a"].rate == server.receivers["b"].rate == pytest.approx(controller.rate / 2)
        # pinned: the estimator is heard but ignored
        controller.update(1_234, pin=True)
        controller.on_batch(batch(3, 100_000, 0.1))
        assert controller.rate == 1_234 and controller.pinned
        controller.set_estimator("model")
        assert not controller.pinned


async def test_an_operators_rate_is_the_one_the_estimator_goes_on_from(tmp_path: Path) -> None:
    """`sluice rate set` (unpinned) under any estimator: GetRate's estimator state shows the rate in
    force, and a model holding intake until a point in the next batch lets the operator's rate in now."""
    async with running_server(tmp_path, "s") as server:
        controller = server.rate
        controller.set_estimator("fixed")
        controller.update(300_000)
        assert controller.rate == controller.estimator.rate == 300_000
        assert controller.estimator.state()["rate"] == 300_000
        controller.set_estimator("model")
        receiver = server.receivers["s"]
        model = controller.estimator
        assert isinstance(model, ModelEstimator)
        started = time.monotonic()
        controller.batch_started(1_000, backlog=0, now=started)
        # the model's plan after a drain batch (_hold_into_next_batch): hold intake until 5 s into the
        # next batch, then 50,000 records/s
        model._paused_until, model._held = (5.0, 50_000.0), True
        controller.check_overrun(now=started + 0.1)
        assert "rate_hold" in receiver.paused
        controller.update(40_000)
        assert not model.intake_held and "rate_hold" not in receiver.paused
        controller.check_overrun(now=started + 6.0)  # the plan's point passes: the operator's rate holds
        assert controller.rate == model.rate == 40_000


async def test_batch_metrics_measure_how_long_the_oldest_record_waited(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s") as server:
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"x"] * 10)
        taken = server.received_at("s", 0)
        assert taken is not None
        completed = BatchCompleted(
            query_id="q",
            batch_id=4,
            num_input_rows=10,
            processing_seconds=0.25,
            timestamp=_iso(taken + 3.5),
            start_offset={"s": 0},
        )
        metrics = batch_metrics(completed, 1.0, server.received_at)
        assert metrics.scheduling_delay == pytest.approx(3.5, abs=1e-3)
        assert (metrics.records, metrics.processing_delay, metrics.batch_interval) == (10, 0.25, 1.0)
        assert metrics.backlog is None  # Spark did not say what was left
        # a batch starting mid-way: its oldest record is the one at its start offset
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"y"] * 5)
        later = server.received_at("s", 12)
        assert later is not None and later > taken
        assert server.received_at("s", 15) is None  # never taken
        capped = dataclasses.replace(
            completed,
            timestamp=_iso(later + 1.0),
            start_offset={"s": 12},
            end_offset={"s": 14},
            latest_offset={"s": 15},
        )
        metrics = batch_metrics(capped, 1.0, server.received_at)
        assert metrics.scheduling_delay == pytest.approx(1.0, abs=1e-3)
        assert metrics.backlog == 1
        unknown = BatchCompleted("q", 0, 10, 9.0, _iso(taken), start_offset=None)
        assert batch_metrics(unknown, 1.0, server.received_at).scheduling_delay == 0.0


async def test_arrival_times_are_forgotten_below_what_spark_committed(tmp_path: Path) -> None:
    """The index of arrival times follows the backlog: the server keeps what batches not yet measured
    may ask for (from the third-last commit on), not every block since it started (it grew with every
    block under load: issue 17's memory at overload)."""
    async with running_server(tmp_path, "s") as server:
        receiver = server.receivers["s"]
        async with Producer(server.target, "s", linger=0) as producer:
            for _ in range(6):  # 6 blocks of 10 records: offsets 0..59
                await producer.send_many([b"x"] * 10)
                await producer.flush()
                await receiver.seal_now()
        assert receiver.arrivals_kept == 6
        first = server.received_at("s", 0)
        assert first is not None
        # commits at 10 and 20: too few to forget anything (a batch's metrics may come after them)
        server.on_committed({"s": 10})
        server.on_committed({"s": 20})
        assert receiver.arrivals_kept == 6 and server.received_at("s", 0) == first
        server.on_committed({"s": 35})  # the third: what lies below the third-last commit (10) goes
        assert receiver.arrivals_kept == 5
        assert server.received_at("s", 5) is None  # block 0 is forgotten
        assert server.received_at("s", 10) is not None and server.received_at("s", 12) is not None
        server.on_committed({"s": 45})  # below 20: blocks 0 and 1
        assert receiver.arrivals_kept == 4
        assert server.received_at("s", 19) is None and server.received_at("s", 20) is not None
        server.on_committed({"s": 60})
        assert receiver.arrivals_kept == 3  # below 35: block 3 (30..39) holds it
        server.on_committed({"s": 60})
        assert receiver.arrivals_kept == 2  # below 45
        server.on_committed({"s": 60})  # everything committed: the last block stays, others go
        assert receiver.arrivals_kept == 1
        assert server.received_at("s", 55) is not None


async def test_the_source_caps_each_batch_at_the_live_rate(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s") as server:
        async with Producer(server.target, "s", linger=0) as producer:
            for _ in range(10):  # 10 blocks of 100
                await producer.send_many([b"y"] * 100)
                await producer.flush(timeout=10)
        assert len(server.store.blocks("s")) == 10
        reader = SluiceStreamReader(
            {
                "path": str(server.config.blocks_dir),
                "streams": "s",
                "rateTarget": server.target,
                "triggerSeconds": "0.5",
            }
        )
        start = {"s": 0}
        # unlimited: everything
        assert (await latest(reader, start, ReadAllAvailable())) == {"s": 1000}
        server.rate.update(700)  # x 0.5 s = 350 records a batch, to the record
        assert (await latest(reader, start, ReadAllAvailable())) == {"s": 350}
        assert (await latest(reader, start, ReadMaxRows(150))) == {"s": 150}
        server.rate.update(math.inf)
        assert (await latest(reader, start, ReadAllAvailable())) == {"s": 1000}


async def at_phase(interval: float, phase: float) -> None:
    """Sleep until wall-clock time is `phase` seconds past a multiple of `interval` (Spark's grid)."""
    await asyncio.sleep((phase - time.time() % interval) % interval)


async def test_a_small_catch_up_batch_waits_for_the_trigger_grid(tmp_path: Path) -> None:
    """A trigger off Spark's grid soon after the last batch was planned (Spark catching up after a late
    batch) whose batch would hold under half the cap is deferred: no new data now, the next grid point
    takes it with a full interval's arrivals. Full catch-up batches and triggers on the grid run."""
    interval = 2.0  # wide phases: a slow machine stays off the grid where the test means to
    async with running_server(tmp_path, "s") as server, Producer(server.target, "s", linger=0) as producer:

        async def send(n: int) -> None:
            await producer.send_many([b"y"] * n)
            await producer.flush(timeout=10)

        async def plan(reader: SluiceStreamReader, start: int, limit: ReadLimit) -> int:
            return (await latest(reader, {"s": start}, limit))["s"]

        await send(100)
        server.rate.update(500)  # x 2 s = a cap of 1,000 records
        options = {"path": str(server.config.blocks_dir), "streams": "s", "rateTarget": server.target}
        reader = SluiceStreamReader({**options, "triggerSeconds": str(interval)})
        # the first batch runs whatever its size and phase: nothing was planned before it
        await at_phase(interval, 0.5)
        assert await plan(reader, 0, ReadAllAvailable()) == 100
        await send(100)
        # right after, off the grid: 100 of 1,000 is a catch-up batch, deferred (no new data)
        assert await plan(reader, 100, ReadAllAvailable()) == 100
        # a catch-up batch of at least half the cap runs
        await send(500)
        assert await plan(reader, 100, ReadAllAvailable()) == 700
        # the cap the batch runs under counts, not the live rate alone: 100 of a 150 limit runs
        await send(100)
        assert await plan(reader, 700, ReadMaxRows(150)) == 800
        # on the grid a small batch runs, however soon after the last one
        await send(100)
        await at_phase(interval, 0.02)
        assert await plan(reader, 800, ReadAllAvailable()) == 900
        # off the grid, but long enough after the last batch: the wait is bounded, it runs
        await send(100)
        await at_phase(interval, 0.4)
        assert await plan(reader, 900, ReadAllAvailable()) == 900
        await asyncio.sleep(0.75 * interval)
        await at_phase(interval, 0.6)
        assert await plan(reader, 900, ReadAllAvailable()) == 1000
        # unthrottled (no live cap): never deferred
        server.rate.update(math.inf)
        await send(10)
        assert await plan(reader, 1000, ReadAllAvailable()) == 1010
        # Trigger.AvailableNow drains what is there without waiting
        server.rate.update(500)
        await send(10)
        drain = SluiceStreamReader({**options, "triggerSeconds": str(interval)})
        drain.prepareForTriggerAvailableNow()
        await at_phase(interval, 0.5)
        assert await plan(drain, 1000, ReadAllAvailable()) == 1020
        assert await plan(drain, 1010, ReadAllAvailable()) == 1020


async def test_no_catch_up_batch_waits_once_the_server_is_gone(tmp_path: Path) -> None:
    """`sluice serve` stops its server, then drains Spark with processAllAvailable, which ends at the
    first trigger that finds no new data: without the server's answer nothing is deferred."""
    interval = 2.0
    async with running_server(tmp_path, "s") as server:
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"y"] * 100)
            await producer.flush(timeout=10)
        server.rate.update(500)  # x 2 s = a cap of 1,000 records
        options = {"path": str(server.config.blocks_dir), "streams": "s", "rateTarget": server.target}
        reader = SluiceStreamReader({**options, "triggerSeconds": str(interval)})
        await at_phase(interval, 0.5)
        assert (await latest(reader, {"s": 0}, ReadMaxRows(50))) == {"s": 50}
        # the server still answers: 50 more of a 1,000 cap, right after, off the grid, wait
        assert (await latest(reader, {"s": 50}, ReadAllAvailable())) == {"s": 50}
        await server.stop(grace=1)
        # the last cap holds, but nobody steers any more: what is there runs
        assert (await latest(reader, {"s": 50}, ReadAllAvailable())) == {"s": 100}


async def test_a_batch_that_overruns_lowers_the_rate_before_it_completes(tmp_path: Path) -> None:
    """The source reports each batch it starts (RateControl.StartBatch); the server's watchdog asks the
    estimator while the batch overruns, and the lower rate reaches the receivers at once."""
    async with running_server(tmp_path, "s") as server:
        controller = server.rate
        controller.on_batch(batch(0, 1, 0.5))  # the query ran before: the model skips no warm-up batch
        controller.set_estimator("model")
        for i, records in enumerate((20_000, 40_000, 30_000, 40_000), start=1):
            controller.on_batch(batch(i, records, 0.4 + records / 75_000))  # 45k records/s at 1 s
        fitted = controller.rate
        assert fitted == pytest.approx(TARGET * 45_000, rel=0.02)
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"y"] * 40_000)
            await producer.flush(timeout=10)
        reader = SluiceStreamReader(
            {"path": str(server.config.blocks_dir), "streams": "s", "rateTarget": server.target}
        )
        assert (await latest(reader, {"s": 0}, ReadAllAvailable())) == {"s": 40_000}
        # 40k records should take 0.93 s; at 2 s the batch proves a per-record cost >= 40 us: capacity
        # under 15k records/s (a batch far below the operating point would prove nothing of the kind)
        await asyncio.sleep(0.5)
        assert controller.rate == fitted
        await asyncio.sleep(1.6)
        assert controller.rate < 0.35 * fitted
        assert server.receivers["s"].rate == pytest.approx(controller.rate)  # the share sums floats
        # the batch completes: the watchdog has nothing to watch, the estimator takes over again
        controller.on_batch(batch(5, 40_000, 2.2))
        after = controller.rate
        await asyncio.sleep(0.3)
        assert controller.rate == after
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.RateControlStub(channel)
            for bad, word in (({"records": 0}, "records"), ({"records": 5, "backlog": -1}, "backlog")):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.StartBatch(pb.StartBatchRequest(**bad))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert word in (info.value.details() or "")
            # a batch that overruns while the next one is already waiting in full: intake pauses
            controller.update(fitted)
            capacity = controller.estimator.capacity
            assert capacity is not None
            await stub.StartBatch(pb.StartBatchRequest(records=1_000, backlog=int(capacity) + 1))
            await asyncio.sleep(1.6)
            assert controller.rate == controller.bounds.min_rate


def _iso(epoch: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


def fitted(controller: RateController) -> float:
    """Fit the model on four batches of a 45k records/s pipeline; the capacity it estimates."""
    controller.on_batch(batch(0, 1, 0.5))  # the query ran before: the model skips no warm-up batch
    controller.set_estimator("model")
    for i, records in enumerate((20_000, 40_000, 30_000, 40_000), start=1):
        controller.on_batch(batch(i, records, 0.4 + records / 75_000))
    capacity = controller.estimator.capacity
    assert capacity == pytest.approx(45_000, rel=0.02)
    return capacity


async def test_a_completed_batch_carries_the_records_waiting_behind_it(tmp_path: Path) -> None:
    """What waits at completion is counted: the backlog the source left when the batch started plus
    what the receivers took while it ran, whatever the rate did meanwhile."""
    async with running_server(tmp_path, "s") as server:
        controller = server.rate
        controller.batch_started(1_000, backlog=500)
        async with Producer(server.target, "s", linger=0) as producer:
            await producer.send_many([b"y"] * 300)
            await producer.flush(timeout=10)
        controller.on_batch(dataclasses.replace(batch(1, 1_000, 0.5), backlog=500))
        assert controller.last_batch is not None and controller.last_batch.waiting == 800
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.RateControlStub(channel)
            shown = (await stub.GetRate(pb.GetRateRequest())).last_batch
            assert (shown.batch_id, shown.backlog, shown.waiting) == (1, 500, 800)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                code = await asyncio.to_thread(cli.main, ["rate", "get", "--target", server.target])
            assert code == 0
            assert "last batch: #1, 1000 records" in out.getvalue()
            assert "500 left behind, 800 waiting at completion" in out.getvalue()
            # no batch reported as started: unknown, and so unset for operators too
            controller.on_batch(batch(2, 1_000, 0.5))
            assert controller.last_batch.waiting is None
            shown = (await stub.GetRate(pb.GetRateRequest())).last_batch
            assert shown.batch_id == 2 and not shown.HasField("waiting") and not shown.HasField("backlog")
        # an idle trigger's empty report is no completion of the batch that runs
        controller.batch_started(1_000, backlog=7)
        controller.on_batch(batch(3, 0, 0.1))
        controller.on_batch(batch(4, 1_000, 0.5))
        assert controller.last_batch.waiting == 7


async def test_no_wait_for_the_metrics_of_a_batch_that_ran_past_its_grid_point(tmp_path: Path) -> None:
    """A batch that ended past the trigger grid point after its start is followed at once by the next
    trigger: the time since it started is its time, so GetRate answers at once, with the watchdog's
    last look applied; its metrics, when they arrive, go into the fit and count what waited up to then.
    A batch that ended before its grid point is waited for: the time since it started holds idle time."""
    async with running_server(tmp_path, "s") as server:
        controller = server.rate
        capacity = fitted(controller)  # 0.4 s + 13.3 us a record; 1 s trigger interval
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.RateControlStub(channel)
            # 40k records should take 0.93 s; this one is still running 1.1 s on, past its grid point
            await at_phase(1.0, 0.3)
            await stub.StartBatch(pb.StartBatchRequest(records=40_000, backlog=100))
            await asyncio.sleep(0.8)
            await at_phase(1.0, 0.4)
            started = time.monotonic()
            status = await stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=5))
            assert time.monotonic() - started < 2.5  # not the 5 s
            assert status.capacity < 0.8 * capacity  # at least (1.1 - 0.4) s / 40k records
            async with Producer(server.target, "s", linger=0) as producer:
                await producer.send_many([b"y"] * 50)
                await producer.flush(timeout=10)
            await stub.StartBatch(pb.StartBatchRequest(records=20_000))
            # the first batch's metrics arrive after the next batch started: they are its own
            controller.on_batch(batch(5, 40_000, 1.15))
            assert controller.last_batch is not None and controller.last_batch.waiting == 100
            # the second ends before its grid point, 0.7 s after it started: its metrics are waited for
            await at_phase(1.0, 0.1)
            await stub.StartBatch(pb.StartBatchRequest(records=30_000))
            await at_phase(1.0, 0.8)
            asked = asyncio.ensure_future(stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=5)))
            await asyncio.sleep(0.15)
            assert not asked.done()
            controller.on_batch(batch(6, 30_000, 0.8))
            status = await asyncio.wait_for(asked, 2)
            assert status.last_batch.batch_id == 6


async def test_the_cap_of_the_next_batch_waits_for_the_last_batch_metrics(tmp_path: Path) -> None:
    """Spark plans the batch after an overrun at once, often before the listener's event is in: the
    source's GetRate waits (briefly) for it, so the next batch's cap follows the batch that just ended."""
    async with running_server(tmp_path, "s") as server:
        controller = server.rate
        capacity = fitted(controller)
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.RateControlStub(channel)
            await stub.StartBatch(pb.StartBatchRequest(records=40_000))
            asked = asyncio.ensure_future(stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=5)))
            await asyncio.sleep(0.3)
            assert not asked.done()
            # the batch took twice as long as it should have; its metrics arrive
            controller.on_batch(batch(5, 40_000, 2 * (0.4 + 40_000 / 75_000)))
            status = await asyncio.wait_for(asked, 2)
            assert status.capacity < 0.8 * capacity
            assert status.last_batch.batch_id == 5
            # nothing running: answered at once
            started = time.monotonic()
            await stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=5))
            assert time.monotonic() - started < 2
            for bad in (-1.0, math.inf, math.nan, 11.0):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=bad))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "wait_for_batch_seconds" in (info.value.details() or "")
            # metrics that never come: one wait times out, later ones do not wait until some arrive
            await stub.StartBatch(pb.StartBatchRequest(records=1_000))
            started = time.monotonic()
            await stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=0.5))
            assert time.monotonic() - started >= 0.45
            await stub.StartBatch(pb.StartBatchRequest(records=1_000))
            started = time.monotonic()
            await stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=5))
            assert time.monotonic() - started < 2
            controller.on_batch(batch(6, 1_000, 0.5))
            await stub.StartBatch(pb.StartBatchRequest(records=1_000))
            asked = asyncio.ensure_future(stub.GetRate(pb.GetRateRequest(wait_for_batch_seconds=5)))
            await asyncio.sleep(0.3)
            assert not asked.done()  # completions arrive again: so does the wait
            controller.on_batch(batch(7, 1_000, 0.5))
            await asyncio.wait_for(asked, 2)


async def test_a_batch_planned_after_asking_for_a_seal_takes_every_record_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source's GetRate asks the receivers to seal what they hold: the batch it plans next is not a
    block short because of where the block generator's interval stood against Spark's trigger."""
    # GetRate waits a second for the seal; a loaded CI machine's fsync once took longer
    monkeypatch.setattr(rate_service, "SEAL_TIMEOUT", 30.0)
    # no lull seal either (block_linger): nothing is sealed until asked
    async with running_server(tmp_path, "a", "b", block_interval=30.0, block_linger=None) as server:
        producers = [Producer(server.target, stream, linger=0) for stream in ("a", "b")]
        for producer in producers:
            await producer.start()
        try:
            for producer in producers:
                await producer.send_many([b"z"] * 25)
            await wait_until(lambda: all(r.stats.records_received == 25 for r in server.receivers.values()))
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = pb_grpc.RateControlStub(channel)
                await stub.GetRate(pb.GetRateRequest())
                assert server.store.blocks("a") == []  # a 30 s block interval: nothing sealed yet
                started = time.monotonic()
                await stub.GetRate(pb.GetRateRequest(seal_blocks=True))
                assert time.monotonic() - started < 20  # once sealed, not at the 30 s block interval
            for stream in ("a", "b"):
                blocks = server.store.blocks(stream)
                assert sum(b.count for b in blocks) == 25
            # nothing pending: answered at once, no empty block
            async with grpc.aio.insecure_channel(server.target) as channel:
                await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest(seal_blocks=True))
            assert len(server.store.blocks("a")) == 1
            for producer in producers:
                await producer.flush(timeout=10)  # sealed, so durable and acked
        finally:
            for producer in producers:
                await producer.close()


async def test_asking_for_a_seal_while_a_lulls_seal_is_written_waits_for_that_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lull's seal (block_linger) took every record taken and is still being written when the source
    asks for a seal: nothing is pending, yet GetRate answers only once that block is in the log (a
    CI machine's slow write once let a batch be planned a block short)."""
    monkeypatch.setattr(rate_service, "SEAL_TIMEOUT", 30.0)
    async with running_server(tmp_path, "a", block_interval=30.0) as server:
        receiver = server.receivers["a"]
        gate, writing = threading.Event(), threading.Event()
        write = receiver.store.write

        def slow_write(*args: Any) -> Any:
            writing.set()
            gate.wait(30)
            return write(*args)

        receiver.store.write = slow_write  # type: ignore[method-assign]
        async with Producer(server.target, "a", linger=0) as producer:
            await producer.send_many([b"z"] * 25)
            await asyncio.to_thread(writing.wait, 10)  # the lull's seal writes, held
            assert receiver.buffered_records == 25 and not receiver._pending
            async with grpc.aio.insecure_channel(server.target) as channel:
                asking = asyncio.ensure_future(
                    pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest(seal_blocks=True))
                )
                await asyncio.sleep(0.5)
                assert not asking.done()  # waits for the write under way
                gate.set()
                await asyncio.wait_for(asking, 20)
            assert sum(b.count for b in server.store.blocks("a")) == 25
            # asked with nothing pending nor being written: answered at once, no block written
            async with grpc.aio.insecure_channel(server.target) as channel:
                await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest(seal_blocks=True))
            assert len(server.store.blocks("a")) == 1


async def test_a_cost_jump_drains_in_one_batch_while_intake_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 17, item 6, the server's side: a batch that overruns by a cost jump while its next batch
    already waits in full holds intake (the receivers grant no credit: rate_hold, not min_rate's
    trickle); the source may then take the whole pile in one batch (RateStatus.drain_batch_records,
    LiveRateCap); intake stays held into that batch until the point the estimator planned, then runs
    at a paced rate."""
    async with running_server(tmp_path, "s") as server:
        controller = server.rate
        fitted(controller)  # 45k records/s at 1 s batches, 0.4 s of it fixed
        receiver = server.receivers["s"]
        usual = max(controller.rate, controller.estimator.capacity or 0.0)
        taken = [0]  # records the receivers took, as the controller counts them
        monkeypatch.setattr(controller, "_taken", lambda: taken[0])
        started = time.monotonic()
        controller.batch_started(40_000, now=started)
        taken[0] = 60_000  # taken while it runs
        controller.check_overrun(now=started + 0.5)
        assert "rate_hold" not in receiver.paused
        controller.check_overrun(now=started + 1.2)  # 40k should have taken 0.93 s
        assert "rate_hold" in receiver.paused and controller.rate == controller.bounds.min_rate
        cap = LiveRateCap(server.target)
        try:
            allowed = await asyncio.to_thread(cap.records_per_batch, 1.0)
            assert allowed is not None and allowed >= 60_000 > usual  # the pile in one batch
            # the batch completes at 2.27 s (the cost rose 3.5x); the pile takes ~3.4 s: still held
            controller.on_batch(
                dataclasses.replace(batch(5, 40_000, 0.4 + 3.5 * 40_000 / 75_000), waiting=60_000)
            )
            assert "rate_hold" in receiver.paused
            drain = time.monotonic()
            controller.batch_started(60_000, now=drain)
            controller.check_overrun(now=drain + 0.1)
            assert "rate_hold" in receiver.paused
            controller.check_overrun(now=drain + 1.5)
            assert "rate_hold" not in receiver.paused
            assert controller.bounds.min_rate < controller.rate < TARGET * 45_000 / 3
            assert receiver.stats.credit_pauses["rate_hold"] == 1
            # the drain batch completes with no pile behind it: the usual cap again
            controller.on_batch(
                dataclasses.replace(batch(6, 60_000, 0.4 + 3.5 * 60_000 / 75_000), waiting=9_000)
            )
            assert controller.drain_batch_records() == 0
            status = await asyncio.to_thread(cap.records_per_batch, 1.0)
            assert status == int(max(controller.rate, controller.estimator.capacity or 0.0))
        finally:
            cap.close()


async def test_an_unlimited_unmeasured_start_holds_intake_once_the_next_batch_is_full(tmp_path: Path) -> None:
    """Unlimited from the first record (sluice serve's model start), but while a start-up batch runs no
    more than the next batch will take (RateStatus.unmeasured_batch_records) is let in: more would only
    wait, and a saturating publisher filled the store for 30 s of slow start-up batches."""
    async with running_server(tmp_path, "s", buffer_records=1_000) as server:
        controller = server.rate
        controller.set_estimator("model")
        assert math.isinf(controller.rate) and controller.unmeasured_batch_records() == 1_000
        receiver = server.receivers["s"]
        started = time.monotonic()
        controller.batch_started(1_000, backlog=400, now=started)
        controller.check_overrun(now=started + 0.1)
        assert "rate_hold" not in receiver.paused
        controller.batch_started(1_000, backlog=1_000, now=started)
        controller.check_overrun(now=started + 0.2)
        assert "rate_hold" in receiver.paused
        # it completes: the next one takes what waits, intake runs again
        controller.on_batch(batch(1, 1_000, 0.3))
        assert "rate_hold" not in receiver.paused
        # an operator's pin wins over any hold
        controller.batch_started(1_000, backlog=5_000, now=started)
        controller.update(math.inf, pin=True)
        controller.check_overrun(now=started + 0.3)
        assert "rate_hold" not in receiver.paused


async def latest(reader: Any, start: dict[str, int], limit: Any) -> dict[str, Any]:
    """The reader's latestOffset, its positions only (ingest.spark.source adds the logs' incarnations)."""
    return positions(await asyncio.to_thread(reader.latestOffset, start, limit))
