"""Full speed from the first record, with bounded batches: `sluice serve`'s default (the model estimator,
unlimited initial rate) tells its source to cap a batch at the receivers' memory bound until the
estimator has measured one; an operator's fixed unlimited rate is not capped."""

from __future__ import annotations

import math
from pathlib import Path

import grpc
from support import running_server

from ingest.config import RateConfig
from ratecontrol import BatchMetrics
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
