"""The node's rate goes where the demand is (issue 12, item 9): a real server, real publishers over gRPC,
two streams under one fixed rate. An equal split gave an idle second stream half of it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import wait_until

from ingest import cli
from ingest.config import RateConfig, ServeConfig
from ingest.server import SluiceServer
from ratecontrol import StreamPolicy
from receivers.config import ReceiverConfig
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

TOTAL = 20_000.0
WINDOW = 3.0


@contextlib.asynccontextmanager
async def saturating(target: str, stream: str) -> AsyncIterator[None]:
    """A publisher that always has more to send than it is granted."""
    async with Producer(target, stream, linger=0, batch_size=2_000) as producer:
        sending = asyncio.create_task(producer.send_many([b"r" * 20] * 2_000_000))
        try:
            yield
        finally:
            sending.cancel()
            await producer.abort()


async def taken_per_second(server: SluiceServer, seconds: float) -> dict[str, float]:
    """Records/s each stream's receiver took over the next `seconds`."""
    before = {s: r.stats.records_received for s, r in server.receivers.items()}
    await asyncio.sleep(seconds)
    return {s: (r.stats.records_received - before[s]) / seconds for s, r in server.receivers.items()}


def rate_get(target: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["rate", "get", "--target", target]) == 0
    return out.getvalue()


def rate_shares(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {
        sample.labels["stream"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sluice_rate_share"
    }


async def test_an_idle_stream_leaves_its_share_to_the_busy_one_and_gets_it_back(tmp_path: Path) -> None:
    config = ServeConfig(
        port=0,
        metrics_port=0,
        data_dir=tmp_path,
        streams=("a", "b"),
        receiver=ReceiverConfig(block_interval=0.02),
        rate=RateConfig(estimator="fixed", initial_rate=TOTAL, stream_policies={"a": StreamPolicy(weight=3)}),
        spark=False,
    )
    server = SluiceServer(config)
    await server.start()
    try:
        a, b = server.receivers["a"], server.receivers["b"]
        async with saturating(server.target, "a"):
            await asyncio.sleep(1.0)
            took = await taken_per_second(server, WINDOW)
            # before: an equal split, 10k records/s on a, whatever b did
            assert took["a"] >= 0.85 * TOTAL, took
            assert b.rate <= 0.05 * TOTAL
            async with grpc.aio.insecure_channel(server.target) as channel:
                status = await pb_grpc.RateControlStub(channel).GetRate(pb.GetRateRequest())
            shown = {s.stream: s for s in status.streams}
            assert shown["a"].busy and shown["a"].weight == 3
            assert shown["a"].share_reason == "busy, weight 3"
            assert shown["a"].taken_per_second > 0.5 * TOTAL
            assert not shown["b"].busy and shown["b"].share_reason == "idle: keeps a floor to ramp from"
            assert shown["a"].records_per_second + shown["b"].records_per_second == pytest.approx(TOTAL)
            text = await asyncio.to_thread(rate_get, server.target)
            print(text)
            assert "stream a: 19750 records/s (busy, weight 3, takes " in text, text
            assert "stream b: 250 records/s (idle: keeps a floor to ramp from)\n" in text, text
            assert server.metrics_port is not None
            shares = await asyncio.to_thread(rate_shares, server.metrics_port)
            assert shares == pytest.approx({"a": 0.9875, "b": 0.0125})

            # b gets busy: its share is back within a tick or two, and the two split by weight, 3:1
            async with saturating(server.target, "b"):
                started = time.monotonic()
                await wait_until(lambda: b.rate >= 0.8 * TOTAL / 4, timeout=3.0)  # loaded machine: generous
                print(f"b's share back in {time.monotonic() - started:.2f} s")
                await asyncio.sleep(0.5)
                took = await taken_per_second(server, WINDOW)
                assert took["a"] + took["b"] >= 0.85 * TOTAL, took
                assert 2.0 <= took["a"] / took["b"] <= 4.5, took
                text = await asyncio.to_thread(rate_get, server.target)
                assert "stream a: 15000 records/s (busy, weight 3, takes " in text, text
                assert "stream b: 5000 records/s (busy, weight 1, takes " in text, text
        # both stopped; a saturating b alone gets the rate back from a, as a's intake fades
        async with saturating(server.target, "b"):
            await wait_until(lambda: b.rate >= 0.9 * TOTAL, timeout=5.0)
            took = await taken_per_second(server, 2.0)
            assert took["b"] >= 0.85 * TOTAL, took
        print(f"shares: a {a.rate:,.0f}, b {b.rate:,.0f} records/s; last window {took}")
    finally:
        await server.stop(grace=1)


def test_serve_refuses_bad_stream_weights_and_bounds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["serve", "--no-spark", "--port", "0", "--metrics-port", "-1", "--data-dir", str(tmp_path)]
    cases = [
        (["--stream", "a", "--stream-weight", "b=3"], "names 'b', which this node does not serve"),
        (["--stream", "a", "--stream-weight", "a=0"], "stream 'a': a stream's weight must be"),
        # two such weights summed to inf and every stream's rate came out 0
        (["--stream", "a", "--stream-weight", "a=1e308"], "must be a number in 1e-06..1e+06"),
        (["--stream", "a", "--stream-weight", "a"], "expected STREAM=NUMBER"),
        (["--stream", "a", "--stream-max-rate", "a=5", "--stream-max-rate", "a=6"], "names stream 'a' twice"),
        (["--stream", "a", "--stream-min-rate", "a=50", "--stream-max-rate", "a=6"], "max rate must be"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) if "=" not in flags[-1] else contextlib.nullcontext():
            code = cli.main([*base, *flags])
            assert code == cli.EXIT_USAGE
        assert message in capsys.readouterr().err
