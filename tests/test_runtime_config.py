"""Settings changed while the service runs: the Admin service and `sluice config`, on a real server.

Every change is validated whole first (an invalid one changes nothing and says why), applied at once
(a new block interval shows in the time to an ack), counted, and kept across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import grpc
import pytest
from prometheus_client import generate_latest

from ingest.config import RateConfig, parse_estimator_params
from ingest.server import SluiceServer
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import running_server


@contextlib.asynccontextmanager
async def admin(server: SluiceServer) -> AsyncIterator[pb_grpc.AdminStub]:
    async with grpc.aio.insecure_channel(server.target) as channel:
        yield pb_grpc.AdminStub(channel)


def settings(view: pb.ConfigView) -> dict[str, tuple[str, str]]:
    return {s.key: (s.value, s.source) for s in view.settings}


async def ack_seconds(server: SluiceServer, n: int = 10) -> float:
    async with Producer(server.target, "s", linger=0) as producer:
        start = time.monotonic()
        await producer.send_many([b"x"] * n)
        await producer.flush(30)
        return time.monotonic() - start


async def test_a_setting_changes_at_once_and_survives_a_restart(tmp_path: Path) -> None:
    # without the linger, an ack waits for the block interval
    async with (
        running_server(tmp_path / "d", "s", block_interval=2.0, block_linger=None) as server,
        admin(server) as stub,
    ):
        assert await ack_seconds(server) > 1.0  # a block every 2 s
        view = await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.05", "max-rate": "5000"}))
        assert settings(view)["block-interval"] == ("0.05", "dynamic")
        assert view.version == 1
        assert await ack_seconds(server) < 1.0  # the next block is sealed at the new interval
        assert server.receivers["s"].config.block_interval == 0.05
        assert server.rate.bounds.max_rate == 5000 and server.rate.rate <= 5000
        got = settings(await stub.GetConfig(pb.GetConfigRequest(keys=["block-interval", "prefetch"])))
        assert got == {"block-interval": ("0.05", "dynamic"), "prefetch": ("", "command-line")}
    # a restart with the same command line: the dynamic value wins, and is still reported as such
    async with (
        running_server(tmp_path / "d", "s", block_interval=2.0, block_linger=None) as server,
        admin(server) as stub,
    ):
        assert server.receivers["s"].config.block_interval == 0.05
        assert server.rate.bounds.max_rate == 5000
        view = await stub.GetConfig(pb.GetConfigRequest())
        assert view.version == 1 and settings(view)["block-interval"] == ("0.05", "dynamic")
        view = await stub.SetConfig(pb.SetConfigRequest(reset=["block-interval", "max-rate"]))
        assert settings(view)["block-interval"] == ("2", "command-line")
        assert server.receivers["s"].config.block_interval == 2.0
        assert math.isinf(server.rate.bounds.max_rate)


async def test_a_disk_budget_taken_away_lifts_its_pause(tmp_path: Path) -> None:
    """`config reset disk-budget` after the budget paused credit: the budget was gone but the pause
    stayed for good (its check skipped streams without a budget), and every push timed out."""
    async with running_server(tmp_path / "d", "s", disk_poll_interval=0.05) as server, admin(server) as stub:
        assert await ack_seconds(server) < 10  # something on disk
        await stub.SetConfig(pb.SetConfigRequest(set={"disk-budget": "1"}))
        receiver = server.receivers["s"]
        deadline = time.monotonic() + 10
        while "disk_budget" not in receiver.paused:
            assert time.monotonic() < deadline, "the budget did not pause credit"
            await asyncio.sleep(0.05)
        view = await stub.SetConfig(pb.SetConfigRequest(reset=["disk-budget"]))
        assert settings(view)["disk-budget"][0] == "none"
        assert await ack_seconds(server) < 10
        assert "disk_budget" not in receiver.paused


async def test_the_servers_memory_budget_is_a_setting_of_every_stream(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d", "s", "t") as server, admin(server) as stub:
        view = await stub.SetConfig(pb.SetConfigRequest(set={"memory-budget": "1KiB"}))
        assert settings(view)["memory-budget"] == ("1024", "dynamic")
        assert {r.config.memory_budget_bytes for r in server.receivers.values()} == {1024}
        assert await ack_seconds(server, 2_000) < 20  # within 1 KiB at a time, but on
        view = await stub.SetConfig(pb.SetConfigRequest(reset=["memory-budget"]))
        assert settings(view)["memory-budget"][0] == "none"
        assert {r.config.memory_budget_bytes for r in server.receivers.values()} == {None}
        assert await ack_seconds(server) < 10
        assert all("server_memory_budget" not in r.paused for r in server.receivers.values())
        assert server.memory.held == 0


async def test_the_block_linger_is_a_setting_off_by_name(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s", block_interval=3.0) as server, admin(server) as stub:
        assert await ack_seconds(server) < 1.0  # the default linger seals the lull's block
        view = await stub.SetConfig(pb.SetConfigRequest(set={"block-linger": "off"}))
        assert settings(view)["block-linger"] == ("off", "dynamic")
        assert server.receivers["s"].config.block_linger is None
        assert await ack_seconds(server) > 1.5  # now it waits for the interval
        view = await stub.SetConfig(pb.SetConfigRequest(set={"block-linger": "0.02"}))
        assert settings(view)["block-linger"] == ("0.02", "dynamic")
        assert await ack_seconds(server) < 1.0
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.SetConfig(pb.SetConfigRequest(set={"block-linger": "-1"}))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block-linger" in (refused.value.details() or "")


INVALID = [
    ({"block-interval": "nan"}, grpc.StatusCode.INVALID_ARGUMENT, "NaN"),
    ({"block-interval": "-1"}, grpc.StatusCode.INVALID_ARGUMENT, "block-interval"),
    ({"block-interval": "inf"}, grpc.StatusCode.INVALID_ARGUMENT, "finite"),
    (
        {"prefetch": "10", "low-tide": "10"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "low-tide 10 must be below prefetch 10",
    ),
    # a prefetch past the buffer was taken silently; each refusal names both settings and their values
    (
        {"prefetch": "600000"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "prefetch 600000 must be at most buffer-records 500000",
    ),
    (
        {"buffer-records": "100", "prefetch": "200"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "prefetch 200 must be at most buffer-records 100",
    ),
    (
        {"low-tide": "300000"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "low-tide 300000 must be below prefetch, 250000 by default (half of buffer-records 500000)",
    ),
    ({"prefetch": "1e9"}, grpc.StatusCode.INVALID_ARGUMENT, "integer"),
    ({"buffer-bytes": "lots"}, grpc.StatusCode.INVALID_ARGUMENT, "buffer-bytes"),
    ({"min-rate": "500", "max-rate": "100"}, grpc.StatusCode.INVALID_ARGUMENT, "rate"),
    ({"estimator": "magic"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown estimator"),
    ({"block-interval": "0.1", "no-such-thing": "1"}, grpc.StatusCode.NOT_FOUND, "no setting"),
    ({"master": "local[2]"}, grpc.StatusCode.NOT_FOUND, "no setting"),
    ({"trigger-interval": "0"}, grpc.StatusCode.INVALID_ARGUMENT, "trigger interval"),
    ({"trigger-interval": "inf"}, grpc.StatusCode.INVALID_ARGUMENT, "trigger interval"),
    # extreme but finite: 1e300 s was taken and nothing was acked again; counts past int64 ended
    # `sluice rate get` and `sluice status` with UNKNOWN (a field of RateStatus overflowed)
    ({"trigger-interval": "1e300"}, grpc.StatusCode.INVALID_ARGUMENT, "at most 86400 seconds"),
    # an outside tester's: taken and shown as "trigger 1e-09 s" while Spark (whole milliseconds) ran 0 ms
    (
        {"trigger-interval": "1e-9"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "trigger interval must be at least 0.01",
    ),
    (
        {"trigger-interval": "0.009"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "trigger interval must be at least 0.01",
    ),
    ({"block-interval": "1e300"}, grpc.StatusCode.INVALID_ARGUMENT, "at most 3600 seconds"),
    # and tiny: each interval wakes the receiver, and 1e-300 spun a core on an idle server
    ({"block-interval": "1e-300"}, grpc.StatusCode.INVALID_ARGUMENT, "at least 0.01 seconds"),
    ({"block-linger": "3601"}, grpc.StatusCode.INVALID_ARGUMENT, "at most 3600 seconds"),
    # a 3 MB value was taken (0.111111) and kept verbatim: a 3 MB runtime-config.json read at every start
    (
        {"block-interval": "0." + "1" * 100_000},
        grpc.StatusCode.INVALID_ARGUMENT,
        "block-interval: a value of 100,002 characters; a setting's value has at most 4,096",
    ),
    # past int()'s 4,300 digits: "not an integer", and for a size Python's advice to call
    # sys.set_int_max_str_digits()
    (
        {"prefetch": "1" * 5_000},
        grpc.StatusCode.INVALID_ARGUMENT,
        "prefetch: an integer of 5,000 digits is out",
    ),
    (
        {"buffer-bytes": "9" * 5_000},
        grpc.StatusCode.INVALID_ARGUMENT,
        "buffer-bytes: a size of 5,000 digits is",
    ),
    # Python's digit separators: "1_0" was taken as 10 and kept as "1_0" (a size refused it already)
    (
        {"trigger-interval": "1_0"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "trigger-interval: '1_0' is not a number",
    ),
    (
        {"buffer-records": "1_000"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "buffer-records: '1_000' is not an integer",
    ),
    ({"buffer-records": "9" * 23}, grpc.StatusCode.INVALID_ARGUMENT, "at most 1,000,000,000,000"),
    ({"prefetch": str(2**63)}, grpc.StatusCode.INVALID_ARGUMENT, "prefetch must be at most"),
    ({"block-records": str(10**12 + 1)}, grpc.StatusCode.INVALID_ARGUMENT, "block-records must be at most"),
    ({"buffer-bytes": "99999999TiB"}, grpc.StatusCode.INVALID_ARGUMENT, "(1 EiB)"),
    ({"disk-budget": "99999999TiB"}, grpc.StatusCode.INVALID_ARGUMENT, "disk-budget must be at most"),
    ({"memory-budget": "99999999TiB"}, grpc.StatusCode.INVALID_ARGUMENT, "memory-budget must be at most"),
    ({"memory-budget": "0"}, grpc.StatusCode.INVALID_ARGUMENT, "memory-budget must be >= 1"),
    # an unset shell variable must not lift a budget: "none" does, "" is refused
    ({"memory-budget": ""}, grpc.StatusCode.INVALID_ARGUMENT, "an empty budget"),
    ({"disk-budget": " "}, grpc.StatusCode.INVALID_ARGUMENT, "an empty budget"),
    # nor turn the linger off ("off" does), as `serve --block-linger ''` is refused
    ({"block-linger": ""}, grpc.StatusCode.INVALID_ARGUMENT, "block-linger: an empty value"),
    ({"estimator-params": "horizon"}, grpc.StatusCode.INVALID_ARGUMENT, "name=value"),
    ({"estimator-params": "horizon=fast"}, grpc.StatusCode.INVALID_ARGUMENT, "not a number"),
    ({"estimator-params": "kp=1"}, grpc.StatusCode.INVALID_ARGUMENT, "no parameter 'kp'"),
    (
        {"estimator": "spark-pid", "estimator-params": "horizon=3"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "horizon",
    ),
    (
        {"estimator": "spark-pid", "estimator-params": "integral=-1"},
        grpc.StatusCode.INVALID_ARGUMENT,
        "integral",
    ),
]


async def test_the_estimator_and_its_parameters_change_together(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        view = await stub.SetConfig(
            pb.SetConfigRequest(
                set={"estimator": "spark-pid", "estimator-params": "proportional=0.5,integral=0"}
            )
        )
        assert settings(view)["estimator-params"] == ("integral=0,proportional=0.5", "dynamic")
        assert server.rate.estimator.name == "spark-pid"
        assert server.rate.estimator.state()["proportional"] == 0.5
        # parameters of one estimator do not fit another: the operator changes both at once
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"estimator": "model"}))
        said = caught.value.details() or ""
        assert "proportional" in said and "sluice config set estimator=model estimator-params=" in said, said
        await stub.SetConfig(pb.SetConfigRequest(set={"estimator": "model", "estimator-params": ""}))
        assert server.rate.estimator.name == "model"


async def test_a_buffer_below_the_prefetch_given_is_refused_naming_both(tmp_path: Path) -> None:
    """The prefetch at most the buffer holds at run time as at the start: a buffer lowered below a
    prefetch given (here, the command line's) is refused naming both and their values, nothing changed;
    both lowered in one change are taken."""
    async with (
        running_server(tmp_path / "d", "s", buffer_records=2_000, prefetch=1_000) as server,
        admin(server) as stub,
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"buffer-records": "500"}))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        said = caught.value.details() or ""
        assert "prefetch 1000 must be at most buffer-records 500" in said, said
        assert server.receivers["s"].config.buffer_records == 2_000 and server.runtime.version == 0
        await stub.SetConfig(pb.SetConfigRequest(set={"buffer-records": "500", "prefetch": "500"}))
        assert server.receivers["s"].config.fill_to == 500
        # a reset brings the command line's prefetch back: the buffer must hold that one too
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"buffer-records": "100"}, reset=["prefetch"]))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "prefetch 1000 must be at most buffer-records 100" in (caught.value.details() or "")
        assert server.receivers["s"].config.fill_to == 500 and server.runtime.version == 1


async def test_an_invalid_change_changes_nothing_and_says_why(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        before = settings(await stub.GetConfig(pb.GetConfigRequest()))
        config = server.receivers["s"].config
        for changes, code, words in INVALID:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SetConfig(pb.SetConfigRequest(set=changes))
            assert caught.value.code() is code, (changes, caught.value.details())
            assert words in (caught.value.details() or ""), (changes, caught.value.details())
        after = before_view = await stub.GetConfig(pb.GetConfigRequest())
        assert settings(after) == before and after.version == 0
        assert server.receivers["s"].config == config
        assert not (tmp_path / "d" / "runtime-config.json").exists()
        # validate only: answers what it would be, changes nothing
        view = await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "1000"}, validate_only=True))
        assert settings(view)["prefetch"] == ("1000", "dynamic") and server.runtime.version == 0
        assert settings(view)["block-interval"] == settings(before_view)["block-interval"]
        assert server.receivers["s"].config.fill_to == 250000
        # two operators: the second, who read version 1, is refused once the first changed it
        await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "900"}))
        await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "1000"}, expected_version=1))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "2000"}, expected_version=1))
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert server.receivers["s"].config.prefetch == 1000
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.GetConfig(pb.GetConfigRequest(keys=["nope"]))
        assert caught.value.code() is grpc.StatusCode.NOT_FOUND
        counts = server.runtime.changes
        assert counts[("prefetch", "applied")] == 2 and counts[("block-interval", "invalid")] >= 3
        page = generate_latest(server.registry).decode()
        assert 'sluice_config_changes_total{key="prefetch",result="applied"} 2.0' in page
        assert "sluice_config_version 2.0" in page


async def test_estimator_parameters_given_twice_are_refused_naming_them(tmp_path: Path) -> None:
    """`horizon=3,horizon=4` was taken (the last won), and 100,000 such pairs were kept verbatim (1 MB
    in runtime-config.json); 100,000 unknown names made a message of as much."""
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        for params, words in (
            ("horizon=3,horizon=4", "estimator parameters given more than once: 'horizon'; give each once"),
            ("horizon=3," * 100_000, "more than once: 'horizon'"),
            (",".join(f"p{i}=1" for i in range(100_000)), "no parameter 'p0', 'p1', "),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SetConfig(
                    pb.SetConfigRequest(set={"estimator": "model", "estimator-params": params})
                )
            details = caught.value.details() or ""
            assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT, details
            assert words in details and len(details) < 1_000, details[:2_000]
        assert server.runtime.version == 0 and not (tmp_path / "d" / "runtime-config.json").exists()
    with pytest.raises(ValueError, match="given more than once: 'a', 'b'; give each once"):
        parse_estimator_params("a=1,b=2,a=3,b=4,c=5")


async def test_a_long_value_kept_before_is_logged_cut_at_the_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A value `config set` took before values were bounded (a 3 MB "0.111...") was logged whole at every
    start: one line of 3 MB. It is still in force, and its line is cut, saying its length."""
    caplog.set_level("INFO", logger="ingest.runtime_config")
    data = tmp_path / "d"
    data.mkdir()
    value = "0." + "1" * 3_000_000
    (data / "runtime-config.json").write_text(
        json.dumps({"version": 1, "overrides": {"block-interval": value}})
    )
    async with running_server(data, "s") as server:
        assert server.receivers["s"].config.block_interval == pytest.approx(0.1111111111111111)
    (line,) = [r.getMessage() for r in caplog.records if "setting block-interval" in r.getMessage()]
    assert len(line) < 1_000 and "(3000002 characters)" in line, line[:2_000]


async def test_a_corrupt_settings_file_stops_the_start_with_its_name(tmp_path: Path) -> None:
    data = tmp_path / "d"
    data.mkdir()
    (data / "runtime-config.json").write_text('{"version": 1, "overrides": {"block-interval": "-5"}}')
    refusal = r"runtime-config\.json: block-interval must be at least 0.01 seconds"
    with pytest.raises(ValueError, match=refusal) as refused:
        async with running_server(data, "s"):
            pass
    assert "delete the file to start from the command line's settings" in str(refused.value)
    (data / "runtime-config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"runtime-config\.json"):
        async with running_server(data, "s"):
            pass


async def test_sluice_config_get_set_reset(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d", "s") as server:

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "ingest.cli", "config", *args, "--target", server.target]
            return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

        done = await asyncio.to_thread(cli, "set", "block-interval=0.1", "prefetch=5000")
        assert done.returncode == 0, done.stderr
        assert "block-interval" in done.stdout and "dynamic" in done.stdout
        assert server.receivers["s"].config.prefetch == 5000
        done = await asyncio.to_thread(cli, "get", "prefetch")
        assert done.returncode == 0 and "5000" in done.stdout and "block-interval" not in done.stdout
        done = await asyncio.to_thread(cli, "set", "low-tide=9000")
        assert done.returncode == 1 and "INVALID_ARGUMENT" in done.stderr and "low-tide" in done.stderr
        done = await asyncio.to_thread(cli, "set", "prefetch")  # no value: a usage error
        assert done.returncode == 2 and "KEY=VALUE" in done.stderr
        done = await asyncio.to_thread(cli, "reset", "prefetch", "block-interval")
        assert done.returncode == 0, done.stderr
        assert server.receivers["s"].config.prefetch is None  # half the buffer again
        assert server.receivers["s"].config.fill_to == 250_000
        saved = json.loads((tmp_path / "d" / "runtime-config.json").read_text())
        assert saved == {"version": 2, "overrides": {}}
        done = await asyncio.to_thread(cli, "reset", "prefetch")  # not set now: nothing to reset
        assert done.returncode == 0, done.stderr
        assert "nothing to reset for prefetch: not set at run time" in done.stderr
        assert "(version 2)" in done.stdout and server.runtime.version == 2


async def test_a_reset_of_a_setting_not_set_changes_nothing_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """100,000 resets of a key that was not set bumped the version, rewrote the file and logged a line
    of 900 KB. Nothing to reset is no change; the answer and one short log line say so."""
    caplog.set_level("INFO", logger="ingest.admin_service")
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        view = await stub.SetConfig(pb.SetConfigRequest(reset=["prefetch"] * 100_000))
        assert (view.version, list(view.not_set)) == (0, ["prefetch"])
        assert not (tmp_path / "d" / "runtime-config.json").exists()
        await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.1"}))
        view = await stub.SetConfig(pb.SetConfigRequest(reset=["block-interval", "prefetch"] * 50_000))
        assert (view.version, list(view.not_set)) == (2, ["prefetch"])  # block-interval was reset
        assert server.receivers["s"].config.block_interval == 0.02
        with pytest.raises(grpc.aio.AioRpcError) as unknown:  # a key that is no setting: as before
            await stub.SetConfig(pb.SetConfigRequest(reset=["prefetch", "nope"]))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    lines = [r.getMessage() for r in caplog.records if r.name == "ingest.admin_service"]
    assert lines[0].startswith("settings unchanged (version 0) by ")
    assert lines[0].endswith(": nothing to reset for prefetch (not set at run time)")
    assert lines[-1].endswith(": reset block-interval; nothing to reset for prefetch (not set at run time)")
    assert max(map(len, lines)) < 300, max(map(len, lines))


async def test_a_huge_name_in_a_request_gets_its_own_error_not_resource_exhausted(tmp_path: Path) -> None:
    """A 100,000-character key or estimator, echoed in the error, went over gRPC's metadata limit: the
    client saw RESOURCE_EXHAUSTED "received metadata size exceeds hard limit". Messages are cut."""
    huge = "a" * 100_000
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.GetConfig(pb.GetConfigRequest(keys=[huge]))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert (unknown.value.details() or "").endswith("characters)")
        async with grpc.aio.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as estimator:
                await pb_grpc.RateControlStub(channel).SetEstimator(pb.SetEstimatorRequest(estimator=huge))
        assert estimator.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown estimator" in (estimator.value.details() or "")


async def test_a_key_both_set_and_reset_and_a_tiny_rate_bound_are_refused(tmp_path: Path) -> None:
    """A change that sets and resets one key was taken (the set won, silently); rate bounds of 5e-324
    were refused as "rate must be > 0, got 0.0" (the arithmetic underflowed)."""
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as both:
            await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.1"}, reset=["block-interval"]))
        assert both.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "block-interval: both set and reset in one change" in (both.value.details() or "")
        async with grpc.aio.insecure_channel(server.target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as tiny:
                await pb_grpc.RateControlStub(channel).SetBounds(
                    pb.SetBoundsRequest(min_rate=5e-324, max_rate=math.inf)
                )
        assert tiny.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "min_rate must be >= 1e-06 and finite, got 4.94066e-324" in (tiny.value.details() or "")


async def test_a_change_that_cannot_be_saved_changes_nothing(tmp_path: Path) -> None:
    """The settings file could not be written (a full or read-only disk; here a folder in the way of its
    temporary file): SetConfig ended UNKNOWN, with gRPC's traceback in the server's log."""
    async with running_server(tmp_path / "d", "s") as server, admin(server) as stub:
        in_the_way = tmp_path / "d" / "runtime-config.json.tmp"
        in_the_way.mkdir()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.5"}))
        assert caught.value.code() == grpc.StatusCode.INTERNAL
        assert "nothing changed: the settings could not be saved" in (caught.value.details() or "")
        assert server.receivers["s"].config.block_interval == 0.02 and server.runtime.version == 0
        async with grpc.aio.insecure_channel(server.target) as channel:
            rate = pb_grpc.RateControlStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as bounds:
                await rate.SetBounds(pb.SetBoundsRequest(min_rate=200, max_rate=1000))
            assert bounds.value.code() == grpc.StatusCode.INTERNAL
            assert math.isinf(server.rate.bounds.max_rate)
            in_the_way.rmdir()
            await rate.SetBounds(pb.SetBoundsRequest(min_rate=200, max_rate=1000))
        assert server.rate.bounds.max_rate == 1000 and server.runtime.version == 1


async def test_a_rate_set_past_the_bounds_says_the_rate_is_held_at_the_bound(tmp_path: Path) -> None:
    """`sluice rate set 50 --pin` under bounds 200 .. 300 pinned 200 and exited 0 with "rate: 200
    records/s", no word that 50 was not taken (nor that `inf` was held at 300). It still applies the
    bound (exit 0), and says on stderr which bound held it; a rate within the bounds says nothing."""
    async with running_server(tmp_path / "d", "s") as server:

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            command = [sys.executable, "-m", "ingest.cli", "rate", *args, "--target", server.target]
            return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

        assert (await asyncio.to_thread(cli, "bounds", "200", "300")).returncode == 0
        done = await asyncio.to_thread(cli, "set", "50", "--pin")
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("rate: 200 records/s"), done.stdout
        assert "50 records/s is below the min-rate (200 records/s): the rate is held at it" in done.stderr
        done = await asyncio.to_thread(cli, "set", "inf")
        assert done.returncode == 0 and done.stdout.startswith("rate: 300 records/s"), done.stdout
        assert "unlimited records/s is above the max-rate (300 records/s)" in done.stderr, done.stderr
        done = await asyncio.to_thread(cli, "set", "250")
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout.startswith("rate: 250 records/s"), done.stdout


async def test_the_rate_apis_bounds_and_estimator_are_the_settings_in_force(tmp_path: Path) -> None:
    """`sluice rate bounds` and `rate estimator` changed the controller alone: `config get` showed the
    old values, a `config set` of those old values was taken and changed nothing, and a restart lost
    the bounds. They are settings now, kept and shown like any other."""
    async with (
        running_server(tmp_path / "d", "s") as server,
        admin(server) as stub,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        rate = pb_grpc.RateControlStub(channel)
        await rate.SetBounds(pb.SetBoundsRequest(min_rate=500, max_rate=1000))
        await rate.SetEstimator(pb.SetEstimatorRequest(estimator="spark-pid"))
        got = settings(await stub.GetConfig(pb.GetConfigRequest(keys=["min-rate", "max-rate", "estimator"])))
        assert got == {
            "min-rate": ("500", "dynamic"),
            "max-rate": ("1000", "dynamic"),
            "estimator": ("spark-pid", "dynamic"),
        }
        # the values the command line gave, set back: in force again
        back = {"min-rate": "100", "max-rate": "inf", "estimator": "fixed"}
        await stub.SetConfig(pb.SetConfigRequest(set=back))
        assert server.rate.bounds.min_rate == 100 and math.isinf(server.rate.bounds.max_rate)
        assert server.rate.estimator.name == "fixed"
        # the same estimator set again still starts afresh and unpins a pinned rate
        await rate.UpdateRate(pb.UpdateRateRequest(records_per_second=5000, pin=True))
        status = await rate.SetEstimator(pb.SetEstimatorRequest(estimator="fixed"))
        assert not status.pinned
        # parameters set for one estimator go when the rate API switches to another
        model = {"estimator": "model", "estimator-params": "horizon=3"}
        await stub.SetConfig(pb.SetConfigRequest(set=model))
        await rate.SetEstimator(pb.SetEstimatorRequest(estimator="spark-pid"))
        assert server.rate.estimator.name == "spark-pid"
        params = settings(await stub.GetConfig(pb.GetConfigRequest(keys=["estimator-params"])))
        assert params["estimator-params"][1] != "dynamic"
        await rate.SetBounds(pb.SetBoundsRequest(min_rate=300, max_rate=4000))
    async with running_server(tmp_path / "d", "s") as server:  # kept across a restart
        assert (server.rate.bounds.min_rate, server.rate.bounds.max_rate) == (300, 4000)
        assert server.rate.estimator.name == "spark-pid"


async def test_the_rate_api_switches_away_from_the_estimator_the_start_gave_parameters(
    tmp_path: Path,
) -> None:
    """`sluice serve --estimator spark-pid --estimator-params proportional=0.5`, then `sluice rate
    estimator model`: refused INVALID_ARGUMENT "estimator 'model' has no parameter 'proportional'" (and
    fixed likewise): the switch reset the estimator-params set at run time only, and the start's stayed
    in force for an estimator they are not of. Another estimator now runs with its own defaults (kept
    so across a restart); back to spark-pid, the start's parameters are in force again, as on a
    cluster's driver."""
    start = RateConfig(estimator="spark-pid", initial_rate=math.inf, estimator_params={"proportional": 0.5})

    def serving() -> AbstractAsyncContextManager[SluiceServer]:
        return running_server(tmp_path / "d", "s", rate=start)

    async with (
        serving() as server,
        grpc.aio.insecure_channel(server.target) as channel,
        admin(server) as stub,
    ):
        rate = pb_grpc.RateControlStub(channel)
        assert server.rate.estimator.state()["proportional"] == 0.5
        for name in ("model", "fixed", "model"):
            status = await rate.SetEstimator(pb.SetEstimatorRequest(estimator=name))
            assert status.estimator == name and server.rate.estimator.name == name
            got = settings(await stub.GetConfig(pb.GetConfigRequest(keys=["estimator-params"])))
            assert got == {"estimator-params": ("", "dynamic")}
        # the bounds still change alone
        await rate.SetBounds(pb.SetBoundsRequest(min_rate=200, max_rate=9000))
        assert server.rate.estimator.name == "model"
    async with serving() as server, grpc.aio.insecure_channel(server.target) as channel:
        assert server.rate.estimator.name == "model"  # its own defaults, kept
        assert server.rate.estimator.state()["horizon"] == 4.0
        rate = pb_grpc.RateControlStub(channel)
        await rate.SetEstimator(pb.SetEstimatorRequest(estimator="spark-pid"))
        assert server.rate.estimator.name == "spark-pid"
        assert server.rate.estimator.state()["proportional"] == 0.5  # the start's, in force again
        assert "estimator-params" not in server.runtime.overrides


async def test_new_bounds_that_move_a_pinned_rate_move_the_kept_one_too(tmp_path: Path) -> None:
    """A rate pinned at 200, then bounds of 500 .. 1e6: the rate in force was 500 (pinned), the file
    still said 200, and a restart pinned 200, under bounds that had since come back down to 5. The pin
    kept is the rate in force: new bounds (`rate bounds`, `config set min-rate`/`max-rate`) clamp it in
    the same write as the settings."""
    data = tmp_path / "d"
    async with running_server(data, "s") as server, admin(server) as stub:
        async with grpc.aio.insecure_channel(server.target) as channel:
            rate = pb_grpc.RateControlStub(channel)
            await rate.UpdateRate(pb.UpdateRateRequest(records_per_second=200, pin=True))
            await rate.SetBounds(pb.SetBoundsRequest(min_rate=500, max_rate=1e6))
            await rate.SetBounds(pb.SetBoundsRequest(min_rate=5, max_rate=1e6))
        assert (server.rate.pinned, server.rate.rate) == (True, 500)
        assert json.loads((data / "runtime-config.json").read_text())["pinned_rate"] == 500
        await stub.SetConfig(pb.SetConfigRequest(set={"max-rate": "300"}))
        assert (server.rate.pinned, server.rate.rate) == (True, 300)
        assert json.loads((data / "runtime-config.json").read_text())["pinned_rate"] == 300
        await stub.SetConfig(pb.SetConfigRequest(set={"max-rate": "inf"}))
    async with running_server(data, "s") as server:
        assert (server.rate.pinned, server.rate.rate) == (True, 300)


async def test_a_pinned_rate_is_kept_across_a_restart_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`sluice rate set R --pin` was lost at a restart without a word (the service came back
    unthrottled), while every other run-time change was kept. The pin and the unpin are kept now, in
    runtime-config.json, and the start says the pinned rate is in force."""
    data = tmp_path / "d"

    async def restarted() -> SluiceServer:
        caplog.clear()
        async with running_server(data, "s") as server:
            return server

    async with running_server(data, "s") as server, grpc.aio.insecure_channel(server.target) as channel:
        rate = pb_grpc.RateControlStub(channel)
        await rate.UpdateRate(pb.UpdateRateRequest(records_per_second=5000, pin=True))
        for bad in (math.nan, -1.0):  # refused before anything is kept
            with pytest.raises(grpc.aio.AioRpcError):
                await rate.UpdateRate(pb.UpdateRateRequest(records_per_second=bad, pin=True))
    caplog.set_level("INFO", logger="ingest.rate_service")  # pin_again's, the driver's too
    server = await restarted()
    assert (server.rate.pinned, server.rate.rate) == (True, 5000)
    assert "rate pinned at 5000 records/s" in caplog.text and "runtime-config.json" in caplog.text
    async with running_server(data, "s") as server, grpc.aio.insecure_channel(server.target) as channel:
        assert server.rate.pinned
        rate = pb_grpc.RateControlStub(channel)
        await rate.UpdateRate(pb.UpdateRateRequest(records_per_second=7000))  # unpinned, kept so
    server = await restarted()
    assert not server.rate.pinned and math.isinf(server.rate.rate)  # the command line's rate
    assert "rate pinned" not in caplog.text
    async with (
        running_server(data, "s") as server,
        admin(server) as stub,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        rate = pb_grpc.RateControlStub(channel)
        await rate.UpdateRate(pb.UpdateRateRequest(records_per_second=math.inf, pin=True))
        assert json.loads((data / "runtime-config.json").read_text())["pinned_rate"] == "inf"
        await stub.SetConfig(pb.SetConfigRequest(set={"estimator": "spark-pid"}))  # a new estimator unpins
        assert not server.rate.pinned
    server = await restarted()
    assert not server.rate.pinned and server.rate.estimator.name == "spark-pid"


async def test_a_session_list_cannot_be_forged_by_a_producer_id(tmp_path: Path) -> None:
    """A producer id with escape codes, newlines and tabs reached the operator's terminal raw through
    `sluice sessions list` (clearing or recolouring it, forging rows); it is shown escaped."""
    forged = "\x1b[2J\x1b[31mEVIL\n99\ts\tops\tfake\t0\t0\t0\topen\u202e"
    command = [sys.executable, "-m", "ingest.cli", "sessions", "list", "--target"]
    async with (
        running_server(tmp_path / "d", "s") as server,
        Producer(server.target, "s", producer_id=forged) as producer,
    ):
        await producer.send(b"x")
        await producer.flush(30)
        done = await asyncio.to_thread(
            subprocess.run, [*command, server.target], capture_output=True, text=True, timeout=60, check=False
        )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and lines[1].count("\t") == 7, done.stdout
    assert "\x1b" not in done.stdout and "\u202e" not in done.stdout
    assert "\\x1b[2J\\x1b[31mEVIL\\n99\\ts" in lines[1] and "\\u202e" in lines[1]


async def test_config_get_says_where_each_value_came_from_and_what_a_rule_gives(tmp_path: Path) -> None:
    """`config get` said "command-line" for values from a config file or the environment, and "(none)"
    for low-tide and block-records, whose rules give a value (config check showed both right)."""
    from ingest.config import RateConfig, ServeConfig
    from receivers.config import ReceiverConfig

    config = ServeConfig(
        port=0,
        metrics_port=None,
        data_dir=tmp_path,
        spark=False,
        rate=RateConfig(estimator="fixed", initial_rate=math.inf),
        receiver=ReceiverConfig(block_interval=0.4, block_linger=0.05, prefetch=1000),
    )
    defaults = ServeConfig(port=0, metrics_port=None, data_dir=tmp_path, spark=False)
    origins = {"block-interval": "file /etc/sluice.toml", "block-linger": "env SLUICE_BLOCK_LINGER"}
    server = SluiceServer(config, defaults=defaults, origins=origins)
    await server.start()
    try:
        async with admin(server) as stub:
            view = await stub.GetConfig(pb.GetConfigRequest())
            rows = {s.key: (s.value, s.source, s.effective) for s in view.settings}
            assert rows["block-interval"] == ("0.4", "file /etc/sluice.toml", "")
            assert rows["block-linger"] == ("0.05", "env SLUICE_BLOCK_LINGER", "")
            assert rows["prefetch"] == ("1000", "command-line", "")
            assert rows["low-tide"] == ("", "default", "500")
            assert rows["block-records"] == ("", "default", "125000")
            view = await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.5", "low-tide": "100"}))
            rows = {s.key: (s.value, s.source, s.effective) for s in view.settings}
            assert rows["block-interval"] == ("0.5", "dynamic", "")
            assert rows["low-tide"] == ("100", "dynamic", "")
    finally:
        await server.stop()


async def test_a_stream_added_while_a_setting_changes_takes_the_new_setting(tmp_path: Path) -> None:
    """An outside tester's AddStream racing SetConfig: a setting applied while the new stream's receiver
    started went to the streams already served only; the new one kept the old value (a lowered budget,
    say) until the next change."""
    async with running_server(tmp_path, "a") as server:
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        for i in range(10):
            add = asyncio.ensure_future(stub.AddStream(pb.AddStreamRequest(stream=f"s{i}")))
            await asyncio.sleep(0.001 * (i % 3))
            await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": str(1000 + i)}))
            await add
            prefetch = {name: receiver.config.prefetch for name, receiver in server.receivers.items()}
            assert set(prefetch.values()) == {1000 + i}, prefetch


async def test_the_first_change_can_be_conditional_on_version_0(tmp_path: Path) -> None:
    """An outside tester's two operators who both read version 0 (settings never changed) and set
    expected_version=0: both changes applied, the second over the first unseen, since 0 meant "any".
    The field is optional now: 0 given is version 0, unset is any."""
    async with running_server(tmp_path, "s") as server, admin(server) as stub:
        assert (await stub.GetConfig(pb.GetConfigRequest())).version == 0
        first = stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "900"}, expected_version=0))
        second = stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "2000"}, expected_version=0))
        done = await asyncio.gather(first, second, return_exceptions=True)
        refused = [r for r in done if isinstance(r, grpc.aio.AioRpcError)]
        assert len(refused) == 1 and refused[0].code() is grpc.StatusCode.FAILED_PRECONDITION, done
        assert server.runtime.version == 1
        await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "1000"}))  # unset: any version
        assert server.receivers["s"].config.prefetch == 1000 and server.runtime.version == 2


async def test_a_prefetch_left_to_its_rule_follows_a_new_buffer(tmp_path: Path) -> None:
    """An outside tester's `sluice config set buffer-records=...` on a server started without --prefetch
    (half the buffer): `config get` still showed the start's prefetch, and it was the one in force too,
    since serve had fixed it at the start (a buffer raised 10x still topped sessions up to the old
    prefetch). The prefetch left to its rule is shown as that rule's value now, and follows the buffer,
    the low tide with it, in what is shown and in the credit a session gets."""
    async with (
        running_server(tmp_path / "d", "s", buffer_records=2_000) as server,
        admin(server) as stub,
        Producer(server.target, "s", linger=0) as producer,
    ):
        sessions = pb_grpc.SessionsStub(grpc.aio.insecure_channel(server.target))

        async def credit() -> int:
            listing = await sessions.ListSessions(pb.ListSessionsRequest(stream="s"))
            assert len(listing.sessions) == 1, listing
            return listing.sessions[0].credit

        def rows(view: pb.ConfigView) -> dict[str, tuple[str, str]]:
            return {s.key: (s.value, s.effective) for s in view.settings}

        shown = rows(await stub.GetConfig(pb.GetConfigRequest(keys=["prefetch", "low-tide"])))
        assert shown == {"prefetch": ("", "1000"), "low-tide": ("", "500")}
        await producer.send_many([b"x"] * 10)
        await producer.flush(30)
        assert await credit() == 1_000 - 10  # the first grant: half the buffer
        view = await stub.SetConfig(pb.SetConfigRequest(set={"buffer-records": "20000"}))
        shown = rows(view)
        assert shown["prefetch"] == ("", "10000") and shown["low-tide"] == ("", "5000")
        assert rows(await stub.GetConfig(pb.GetConfigRequest(keys=["prefetch"]))) == {
            "prefetch": ("", "10000")
        }
        assert server.receivers["s"].config.fill_to == 10_000
        # in force: the session, now below the new low tide, is topped up to the new prefetch
        deadline = time.monotonic() + 10
        while await credit() != 10_000:
            assert time.monotonic() < deadline, await credit()
            await asyncio.sleep(0.02)
        # a prefetch given stays as given, whatever the buffer; reset, it follows the buffer again
        await stub.SetConfig(pb.SetConfigRequest(set={"prefetch": "3000", "buffer-records": "40000"}))
        assert rows(await stub.GetConfig(pb.GetConfigRequest(keys=["prefetch"]))) == {
            "prefetch": ("3000", "")
        }
        view = await stub.SetConfig(pb.SetConfigRequest(reset=["prefetch"]))
        assert rows(view)["prefetch"] == ("", "20000")
        # a low tide that the derived prefetch would leave above it is refused, naming both
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"low-tide": "15000", "buffer-records": "20000"}))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        said = caught.value.details() or ""
        assert (
            "low-tide 15000 must be below prefetch, 10000 by default (half of buffer-records 20000)" in said
        )
    # kept across a restart: the prefetch is still the buffer's half
    async with running_server(tmp_path / "d", "s", buffer_records=2_000) as server, admin(server) as stub:
        assert rows(await stub.GetConfig(pb.GetConfigRequest(keys=["prefetch"]))) == {
            "prefetch": ("", "20000")
        }
        assert server.receivers["s"].config.fill_to == 20_000
    # and `sluice config check`, which shows what serve would run, says the same
    command = [
        sys.executable,
        "-m",
        "ingest.cli",
        "config",
        "check",
        "--no-spark",
        "--data-dir",
        str(tmp_path / "d"),
    ]
    checked = await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, timeout=60, check=False
    )
    assert checked.returncode == 0, checked.stderr
    shown_check = {line.split()[0]: line.split()[1] for line in checked.stdout.splitlines() if line.strip()}
    assert shown_check["buffer-records"] == "40000" and shown_check["prefetch"] == "20000", checked.stdout
    assert shown_check["low-tide"] == "10000", checked.stdout


async def test_a_setting_asked_many_times_is_answered_once(tmp_path: Path) -> None:
    """An outside tester's GetConfig(keys=["prefetch"] * 300_000), a reader's call: 300,000 rows came back
    (19 MB from a 3 MB request, some seconds of the server's event loop, every other client waiting).
    Each setting is answered once, as `config set` takes each once."""
    async with running_server(tmp_path, "s") as server, admin(server) as stub:
        view = await stub.GetConfig(pb.GetConfigRequest(keys=["prefetch", "block-interval"] * 100_000))
        assert [s.key for s in view.settings] == ["prefetch", "block-interval"]
