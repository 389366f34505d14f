"""/metrics scraped over HTTP and parsed as Prometheus text; RateControl over gRPC throttles credit."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import running_server

from ingest.config import RateConfig, ServeConfig
from ingest.rate_memory import RateMemory
from ingest.server import SluiceServer
from receivers.config import FsyncPolicy, ReceiverConfig
from receivers.wal import WalBlockStore
from receivers.wire import decode_batch
from sluice_client import Producer, SyncProducer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.wire import encode_batch

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    config = ServeConfig(
        port=0,
        metrics_port=0,
        data_dir=tmp_path,
        streams=("a", "b"),
        receiver=ReceiverConfig(block_interval=0.05),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        spark=False,
    )
    srv = SluiceServer(config, batches_completed=lambda: 7)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop(grace=1)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_metrics_count_what_happened(server: SluiceServer) -> None:
    async with Producer(server.target, "a") as producer:
        await producer.send_many([b"m"] * 1234)
        await producer.flush(timeout=10)
    assert server.metrics_port is not None
    samples = await asyncio.to_thread(scrape, server.metrics_port)
    a, b = (("stream", "a"),), (("stream", "b"),)
    assert samples[("sluice_records_received_total", a)] == 1234
    assert samples[("sluice_records_acked_total", a)] == 1234
    assert samples[("sluice_records_received_total", b)] == 0
    assert samples[("sluice_blocks_sealed_total", a)] >= 1
    assert samples[("sluice_block_bytes_total", a)] > 1234
    assert samples[("sluice_credit_outstanding", a)] == 0  # the session completed: credit returned
    assert samples[("sluice_sessions_opened_total", a)] == 1
    assert samples[("sluice_batches_completed_total", ())] == 7
    assert math.isinf(samples[("sluice_rate_limit", a)])
    assert samples[("sluice_wal_truncations_total", a)] == 0
    assert samples[("sluice_wal_truncated_bytes_total", a)] == 0
    assert samples[("sluice_wal_lost_blocks_total", a)] == 0
    assert samples[("sluice_wal_disk_bytes", a)] >= samples[("sluice_block_bytes_total", a)]


def torn_log(blocks: Path, stream: str, tail: bytes) -> None:
    store = WalBlockStore(blocks)
    seq, offset = store.recover(stream)
    store.write(stream, seq, offset, 0, [decode_batch(encode_batch(0, [b"x"] * 10), 0)])
    store.close()
    segment = next((blocks / stream).glob("*.wal"))
    with open(segment, "ab") as file:
        file.write(tail)  # as if the server crashed in the middle of the next block's write


async def scrape_a_fresh_server(
    data_dir: Path, fsync: FsyncPolicy | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The metrics of a server without Spark started on `data_dir` with streams a and b, then stopped."""
    config = ServeConfig(
        port=0,
        metrics_port=0,
        data_dir=data_dir,
        streams=("a", "b"),
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        spark=False,
        **({} if fsync is None else {"fsync": fsync}),
    )
    srv = SluiceServer(config)
    await srv.start()
    try:
        assert srv.metrics_port is not None
        return await asyncio.to_thread(scrape, srv.metrics_port)
    finally:
        await srv.stop(grace=1)


async def test_wal_truncation_at_start_is_counted(tmp_path: Path) -> None:
    torn_log(tmp_path / "blocks", "a", b"torn frame")
    samples = await scrape_a_fresh_server(tmp_path)
    a, b = (("stream", "a"),), (("stream", "b"),)
    assert samples[("sluice_wal_truncations_total", a)] == 1
    assert samples[("sluice_wal_truncated_bytes_total", a)] == len(b"torn frame")
    assert samples[("sluice_wal_truncations_total", b)] == 0


async def test_wal_blocks_lost_under_fsync_off_are_counted(tmp_path: Path) -> None:
    """A segment a power loss took under --fsync off: the start goes on (an ERROR names the blocks) and
    sluice_wal_lost_blocks_total counts them."""
    blocks = tmp_path / "blocks"
    store = WalBlockStore(blocks, fsync=FsyncPolicy.off(), segment_bytes=1)  # a segment a block
    seq, offset = store.recover("a")
    for _ in range(4):
        store.write("a", seq, offset, 0, [decode_batch(encode_batch(0, [b"x"] * 10), 0)])
        seq, offset = seq + 1, offset + 10
    store.close()
    for gone in (1, 2):
        (blocks / "a" / f"{gone:020d}.wal").unlink()
    samples = await scrape_a_fresh_server(tmp_path, FsyncPolicy.off())
    a, b = (("stream", "a"),), (("stream", "b"),)
    assert samples[("sluice_wal_lost_blocks_total", a)] == 2
    assert samples[("sluice_wal_lost_blocks_total", b)] == 0


async def test_rate_control_validates_and_throttles(server: SluiceServer) -> None:
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = pb_grpc.RateControlStub(channel)
        state = await stub.GetRate(pb.GetRateRequest())
        assert math.isinf(state.records_per_second) and state.estimator == "fixed" and not state.pinned
        assert {s.stream for s in state.streams} == {"a", "b"}
        for bad in (float("nan"), 0.0, -5.0):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.UpdateRate(pb.UpdateRateRequest(records_per_second=bad))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "rate" in (info.value.details() or "")
        for low, high in ((0.0, 10.0), (10.0, 5.0), (float("nan"), 1.0), (-1.0, float("inf"))):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SetBounds(pb.SetBoundsRequest(min_rate=low, max_rate=high))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.SetEstimator(pb.SetEstimatorRequest(estimator="magic"))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model" in (info.value.details() or "")
        # nothing changed by the rejected calls
        state = await stub.GetRate(pb.GetRateRequest())
        assert math.isinf(state.records_per_second) and state.estimator == "fixed"
        assert (state.min_rate, state.max_rate) == (100.0, math.inf)
        # 4,000 records/s over two streams: 2,000 each
        state = await stub.UpdateRate(pb.UpdateRateRequest(records_per_second=4_000, pin=True))
        assert state.records_per_second == 4_000 and state.pinned
        assert {(s.stream, s.records_per_second) for s in state.streams} == {("a", 2_000), ("b", 2_000)}
        state = await stub.SetBounds(pb.SetBoundsRequest(min_rate=10, max_rate=3_000))
        assert state.records_per_second == 3_000  # clamped into the new bounds
        await stub.SetBounds(pb.SetBoundsRequest(min_rate=10, max_rate=4_000))
        state = await stub.UpdateRate(pb.UpdateRateRequest(records_per_second=4_000, pin=True))
        state = await stub.SetEstimator(pb.SetEstimatorRequest(estimator="spark-pid"))
        assert state.estimator == "spark-pid" and not state.pinned
    # 3,000 records on a, b idle: a gets all but b's floor (3,900 records/s of 4,000 once the split
    # sees a busy, burst 0.2 s) and takes about 0.7 s; unthrottled ~0.1 s
    started = time.monotonic()
    async with Producer(server.target, "a", linger=0) as producer:
        await producer.send_many([b"r"] * 3_000)
        await producer.flush(timeout=30)
    elapsed = time.monotonic() - started
    assert 0.5 < elapsed < 10, elapsed


async def test_a_throttled_publisher_gets_credit_in_ticks_not_in_dribbles(tmp_path: Path) -> None:
    """A publisher that always wants more than the rate: credit arrives a tick's worth at a time, so
    both sides exchange a few messages per tick, not one per handful of records (which made a
    throttled publisher and the server each burn a core)."""
    async with running_server(tmp_path, "s") as srv:
        srv.rate.update(20_000.0, pin=True)
        receiver = srv.receivers["s"]
        async with Producer(srv.target, "s", linger=0, batch_size=10_000) as producer:
            sending = asyncio.create_task(producer.send_many([b"r" * 20] * 1_000_000))
            await asyncio.sleep(0.5)
            before = (receiver.stats.batches_received, receiver.stats.records_acked)
            await asyncio.sleep(2.0)
            batches = receiver.stats.batches_received - before[0]
            records = receiver.stats.records_acked - before[1]
            sending.cancel()
            await producer.abort()
    assert 20_000 <= records <= 60_000, records  # throttled: 2 s at 20k/s, plus a burst
    # credit_tick 0.05 s: ~40 grants in 2 s; a dribble was thousands of messages
    assert batches <= 200, (batches, records)


async def test_sync_producer(server: SluiceServer) -> None:
    def user_script() -> None:  # a plain thread with no event loop, as a user's script would be
        with SyncProducer(server.target, "b", linger=0.001) as producer:
            producer.send(b"one", key=b"k")
            producer.send_many([b"two", b"three"])
            producer.flush(timeout=10)
            assert producer.acked == 3

    await asyncio.to_thread(user_script)  # the server's loop keeps running meanwhile
    rows = [
        r for blk in server.store.blocks("b") for batch in server.store.read(blk) for r in batch.to_pylist()
    ]
    assert [(r["key"], r["value"]) for r in rows] == [(b"k", b"one"), (None, b"two"), (None, b"three")]


async def test_metrics_are_promtool_clean(server: SluiceServer) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    async with Producer(server.target, "a") as producer:
        await producer.send(b"p")
    assert server.metrics_port is not None
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=10).read())
    result = await asyncio.to_thread(
        subprocess.run, [promtool, "check", "metrics"], input=text, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
    config = DEPLOY / "prometheus.yml"
    # --syntax-only: the config names the CA and token files of a deployment, absent here
    checked = await asyncio.to_thread(
        subprocess.run,
        [promtool, "check", "config", "--syntax-only", str(config)],
        capture_output=True,
        timeout=60,
    )
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def test_a_scrape_reads_each_streams_rate_a_bounded_number_of_times() -> None:
    """An outside tester with 1,000 streams (added at run time): the idle server used half a core, a
    good part of it in the collector that /metrics and the status page's sampler (every second, on the
    event loop) run: each stream's rate_share summed the rates of every stream, so a scrape read
    streams^2 rates. It reads each stream's rate a bounded number of times."""
    from unittest import mock

    from ingest.metrics import SluiceCollector

    reads = 0

    class CountedRate(mock.MagicMock):
        @property
        def rate(self) -> float:
            nonlocal reads
            reads += 1
            return 10.0

    streams = 300
    receivers = {f"s{i}": CountedRate() for i in range(streams)}
    families = {family.name: family for family in SluiceCollector(receivers, lambda: 0).collect()}
    shares = {sample.labels["stream"]: sample.value for sample in families["sluice_rate_share"].samples}
    assert shares == {stream: pytest.approx(1 / streams) for stream in receivers}
    assert reads <= 3 * streams, reads


async def test_a_finite_rate_past_the_most_there_may_be_is_refused_end_to_end(tmp_path: Path) -> None:
    """An outside tester's `sluice rate set 1e308` (and bounds of 1e308): taken, shown by `sluice rate
    get` as a 309-digit number, kept as the pinned rate across restarts, and at a 2 s trigger the Spark
    source's batch cap (the rate x the interval) overflowed to inf: int() of it raised OverflowError in
    latestOffset. A finite rate or bound past MAX_RATE is refused now (INVALID_ARGUMENT, nothing
    changed), as through `sluice config set` and the CLI; inf is still "unlimited", MAX_RATE itself a
    rate like any other, and a settings file or remembered capacity holding 1e308 does not come back."""
    from ingest.spark.live_rate import LiveRateCap
    from ratecontrol import MAX_RATE

    data = tmp_path / "d"
    async with (
        running_server(data, "a", metrics=True) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.RateControlStub(channel)
        for huge in (1e308, 1.0000001e12):
            for pin in (False, True):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await stub.UpdateRate(pb.UpdateRateRequest(records_per_second=huge, pin=pin))
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert info.value.details() == (
                    f"rate must be at most 1e+12 records/s (or inf for unlimited), got {huge:g}"
                )
        for low, high, words in (
            (1e308, 1e308, "min-rate must be at most 1e+12 records/s, got 1e+308"),
            (100.0, 1e308, "max-rate must be at most 1e+12 records/s (inf: none), got 1e+308"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.SetBounds(pb.SetBoundsRequest(min_rate=low, max_rate=high))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words.replace("-", "_") in (info.value.details() or ""), info.value.details()
        admin = pb_grpc.AdminStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await admin.SetConfig(pb.SetConfigRequest(set={"max-rate": "1e308"}))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max-rate must be at most 1e+12 records/s (inf: none), got 1e+308" in (
            info.value.details() or ""
        )
        state = await stub.GetRate(pb.GetRateRequest())  # nothing changed
        assert math.isinf(state.records_per_second) and (state.min_rate, state.max_rate) == (100, math.inf)
        assert not state.pinned and not (data / "runtime-config.json").exists()
        # the CLI says so in one line, exit 1, as any refused call
        refused = await asyncio.to_thread(
            subprocess.run,
            [str(Path(sys.executable).parent / "sluice"), "rate", "set", "1e308", "--target", server.target],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert refused.returncode == 1 and "INVALID_ARGUMENT" in refused.stderr, refused.stderr
        assert "at most 1e+12 records/s (or inf for unlimited)" in refused.stderr and not refused.stdout

        # the most there may be works everywhere: credit, the source's cap at the longest trigger, metrics
        state = await stub.UpdateRate(pb.UpdateRateRequest(records_per_second=MAX_RATE, pin=True))
        assert state.records_per_second == MAX_RATE and state.streams[0].records_per_second == MAX_RATE
        state = await stub.SetBounds(pb.SetBoundsRequest(min_rate=MAX_RATE, max_rate=MAX_RATE))
        assert (state.min_rate, state.max_rate, state.records_per_second) == (MAX_RATE,) * 3
        async with Producer(server.target, "a", linger=0) as producer:
            await producer.send_many([b"r"] * 2_000)
            await producer.flush(timeout=30)
        cap = LiveRateCap(server.target)
        try:
            for trigger in (1.0, 2.0, 86_400.0):
                records = await asyncio.to_thread(cap.records_per_batch, trigger)
                assert records == int(MAX_RATE * trigger) and records < 2**63, (trigger, records)
        finally:
            cap.close()
        assert server.receivers["a"].rate == MAX_RATE and server.metrics_port is not None
        samples = await asyncio.to_thread(scrape, server.metrics_port)
        assert samples[("sluice_rate_limit", (("stream", "a"),))] == MAX_RATE
        # inf is still unlimited, pinned or not: no cap
        await stub.SetBounds(pb.SetBoundsRequest(min_rate=100, max_rate=math.inf))
        state = await stub.UpdateRate(pb.UpdateRateRequest(records_per_second=math.inf, pin=True))
        assert math.isinf(state.records_per_second)
    saved = json.loads((data / "runtime-config.json").read_text())
    assert saved["pinned_rate"] == "inf"

    # a settings file from before (pinned 1e308) stops the start naming it; a remembered capacity is ignored
    saved["pinned_rate"] = 1e308
    (data / "runtime-config.json").write_text(json.dumps(saved))
    with pytest.raises(
        ValueError, match=r"pinned_rate 1e\+308 is not a rate \(records/s > 0 and at most 1e\+12"
    ):
        async with running_server(data, "a"):
            pass
    memory = RateMemory(tmp_path)
    (tmp_path / "rate-memory.json").write_text(json.dumps({"pipeline": "", "capacity": 1e308}))
    assert memory.recall("") is None
    memory.remember("", 1e308)  # an estimator's, past the most: kept at the most
    assert RateMemory(tmp_path).recall("") == MAX_RATE
