"""block_linger: a lull seals the pending block early (a flush, a lone record), a steady stream does not.

Real gRPC server on loopback, real block log; timed bounds are generous (a loaded CI machine)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from support import running_server, wait_until

from ingest.cli import _parser
from ingest.runtime_config import SETTINGS, SettingError
from receivers.config import ReceiverConfig
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.wire import encode_batch

INTERVAL = 3.0  # a block interval far longer than any lull below: what seals early is the linger


async def flush_seconds(target: str) -> float:
    async with Producer(target, "s") as producer:
        started = time.monotonic()
        await producer.send(b"lone")
        await producer.flush(timeout=30)
        return time.monotonic() - started


async def test_a_lone_record_is_acked_after_the_linger_not_the_block_interval(tmp_path: Path) -> None:
    async with running_server(tmp_path / "on", block_interval=INTERVAL, block_linger=0.01) as server:
        assert await flush_seconds(server.target) < INTERVAL / 3
        assert [b.count for b in server.store.blocks("s")] == [1]
    async with running_server(tmp_path / "off", block_interval=INTERVAL, block_linger=None) as server:
        # off: the record waits for the block interval, as before
        assert await flush_seconds(server.target) > INTERVAL / 2


async def test_a_steady_stream_is_not_cut_by_the_linger(tmp_path: Path) -> None:
    linger = 0.4
    async with running_server(tmp_path, block_interval=30, block_linger=linger) as server:
        receiver = server.receivers["s"]
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.IngestStub(channel).Publish()
            await call.write(pb.PublishRequest(open=pb.Open(stream="s", producer_id="steady")))
            gaps, last = 0, time.monotonic()
            for seq in range(0, 600, 10):  # a batch every 20 ms for about 1.2 s: three lingers
                await call.write(pb.PublishRequest(batch=encode_batch(seq, [b"x"] * 10)))
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps += now - last >= linger * 0.8  # the machine stalled the sender near a lull
                last = now
            assert receiver.stats.blocks_sealed <= gaps
            await wait_until(lambda: receiver.stats.blocks_sealed > gaps, timeout=10)
            assert sum(b.count for b in server.store.blocks("s")) == 600
            await call.done_writing()


async def test_turning_the_linger_off_and_on_at_run_time(tmp_path: Path) -> None:
    async with running_server(tmp_path, block_interval=INTERVAL, block_linger=0.01) as server:
        receiver = server.receivers["s"]
        receiver.reconfigure(ReceiverConfig(block_interval=INTERVAL, block_linger=None))
        assert await flush_seconds(server.target) > INTERVAL / 2
        receiver.reconfigure(ReceiverConfig(block_interval=INTERVAL, block_linger=0.01))
        assert await flush_seconds(server.target) < INTERVAL / 3


@pytest.mark.parametrize("bad", [-0.1, float("inf"), float("nan")])
def test_a_linger_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="block_linger"):
        ReceiverConfig(block_linger=bad)


def test_the_flag_and_the_setting_take_seconds_or_off(capsys: pytest.CaptureFixture[str]) -> None:
    parser = _parser()
    assert parser.parse_args(["serve", "--block-linger", "off"]).block_linger is None
    assert parser.parse_args(["serve", "--block-linger", "0.05"]).block_linger == 0.05
    assert parser.parse_args(["serve"]).block_linger == ReceiverConfig.block_linger
    for bad in ("-1", "inf", "soon"):
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["serve", "--block-linger", bad])
        assert exit_info.value.code == 2
        assert "--block-linger" in capsys.readouterr().err
    setting = SETTINGS["block-linger"]
    assert setting.parse("off") is None
    assert setting.parse("0.02") == 0.02
    for bad in ("soon", ""):  # empty: an unset shell variable must not turn the linger off unseen
        with pytest.raises(SettingError):
            setting.parse(bad)


async def test_a_failing_disk_is_retried_at_the_block_interval_not_at_every_lull(tmp_path: Path) -> None:
    async with running_server(tmp_path, block_interval=0.5, block_linger=0.01) as server:
        receiver = server.receivers["s"]
        write = receiver.store.write
        failing = True

        def full_disk(*args: object) -> object:
            if failing:
                raise OSError(28, "No space left on device")
            return write(*args)  # type: ignore[arg-type]

        receiver.store.write = full_disk  # type: ignore[method-assign]
        async with Producer(server.target, "s", linger=0) as producer:
            started = time.monotonic()
            for i in range(20):  # a batch every 60 ms: a lull after each
                await producer.send(b"%d" % i)
                await asyncio.sleep(0.06)
            elapsed = time.monotonic() - started
            # the first lull's seal fails; then retries come every block interval (0.5 s), not at
            # each of the 20 lulls
            assert 1 <= receiver.stats.block_write_errors <= 2 + elapsed / 0.5
            failing = False
            await producer.flush(timeout=30)
        assert sum(b.count for b in server.store.blocks("s")) == 20
