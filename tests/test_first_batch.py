"""Full speed from the first record, with bounded batches: `sluice serve`'s default (the model estimator,
unlimited initial rate) tells its source to cap a batch at the receivers' memory bound until the
estimator has measured one; an operator's fixed unlimited rate is not capped."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import grpc
from support import running_server, wait_until

from ingest.config import RateConfig
from ratecontrol import BatchMetrics
from receivers.receiver import RATE_HOLD
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc


async def status(target: str) -> pb.RateStatus:
    async with grpc.aio.insecure_channel(target) as channel:
        return await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest())


async def test_unmeasured_batches_are_bounded_by_the_receivers_memory(tmp_path: Path) -> None:
    async with running_server(tmp_path, "a", "b", buffer_records=1000, prefetch=500) as server:
        # running_server's rate is the operator's fixed unlimited one: never capped
        assert (await status(server.target)).unmeasured_batch_records == 0
        server.rate.set_estimator("model")
        answer = await status(server.target)
        assert math.isinf(answer.records_per_second)
        assert answer.unmeasured_batch_records == 2000  # two streams of 1,000 buffered records
        # once batches are measured, the estimator's rate and capacity cap batches instead
        for k in range(6):
            server.rate.on_batch(
                BatchMetrics(
                    batch_id=k,
                    completed_at=100.0 + k,
                    records=20_000,
                    processing_delay=0.5,
                    scheduling_delay=0.0,
                    batch_interval=1.0,
                    backlog=0,
                )
            )
        answer = await status(server.target)
        assert answer.unmeasured_batch_records == 0 and not math.isinf(answer.records_per_second)


def test_sluice_serve_starts_unthrottled_with_the_model_estimator() -> None:
    from ingest.cli import _parser, _rate_config  # the CLI's own defaults

    args = _parser().parse_args(["serve"])
    rate = _rate_config(args, receive_only=False)
    assert (rate.estimator, rate.initial_rate) == ("model", math.inf)
    args = _parser().parse_args(["serve", "--estimator", "spark-pid"])
    assert _rate_config(args, receive_only=False).initial_rate == 10_000.0
    assert RateConfig().initial_rate == 10_000.0  # the library's default is unchanged


async def test_intake_waits_for_a_query_that_has_not_planned_its_first_batch(tmp_path: Path) -> None:
    """While a query starts (its first trigger, its Python workers) no batch runs, and a saturating
    publisher filled the log unbounded: 7.3M records before a first batch of 500,000, 80 s of backlog
    for a 90k records/s pipeline, and every later batch later still (bench/control_loop.py). Until the
    first batch is planned, intake stops once the first batch's bound waits, as while one runs."""
    async with running_server(tmp_path, "a", buffer_records=1000, prefetch=500) as server:
        server.rate.set_estimator("model")  # sluice serve's start: unlimited, unmeasured
        server.rate.attach_query()  # what drive_rate does when the query is wired
        receiver = server.receivers["a"]
        async with Producer(server.target, "a", linger=0) as producer:

            async def saturate() -> None:  # ~20k records/s, as long as credit comes
                while True:
                    await producer.send_many([b"x"] * 200)
                    await asyncio.sleep(0.01)

            sending = asyncio.create_task(saturate())
            await wait_until(lambda: RATE_HOLD in receiver.paused, 10)
            await asyncio.sleep(0.3)
            taken = receiver.stats.records_received
            # the bound, and what came in before the watchdog's next look (0.1 s) and credit was out
            assert 1000 <= taken < 6000, taken
            await asyncio.sleep(0.5)
            assert receiver.stats.records_received == taken  # held
            # the first batch is planned (its StartBatch), taking the bound: what is left over still
            # fills the next one, so intake stays held until a batch completes
            server.rate.batch_started(1000, backlog=taken - 1000)
            await asyncio.sleep(0.3)
            assert RATE_HOLD in receiver.paused and receiver.stats.records_received == taken
            server.rate.on_batch(
                BatchMetrics(
                    batch_id=0,
                    completed_at=time.time(),
                    records=1000,
                    processing_delay=0.2,
                    scheduling_delay=0.0,
                    batch_interval=1.0,
                    backlog=taken - 1000,
                )
            )
            await wait_until(lambda: receiver.stats.records_received > taken, 10)
            sending.cancel()
            await producer.abort()
    # an operator's fixed unlimited rate (and --no-spark's) is never held this way
    async with running_server(tmp_path / "fixed", "a", buffer_records=1000, prefetch=500) as server:
        server.rate.attach_query()
        async with Producer(server.target, "a", linger=0) as producer:
            await producer.send_many([b"x"] * 20_000)
            await producer.flush(30)
        assert server.receivers["a"].stats.records_received == 20_000
