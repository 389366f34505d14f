"""The Admin service's stream and pipeline methods on a real server without Spark: what they refuse, with
which status, and what they keep across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from support import running_server, wait_until
from test_cli import SLUICE, wait_for_line

from ingest import cli
from ingest.streams import StreamStateError
from receivers.wal import WalBlockStore
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

DRAIN, KEEP = pb.RemoveStreamRequest.DRAIN, pb.RemoveStreamRequest.KEEP


async def refused(call: object, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as exc:
        await call  # type: ignore[misc]
    assert exc.value.code() == code, exc.value.details()
    details = exc.value.details() or ""
    assert len(details) < 600
    return details


async def test_stream_changes_are_checked_and_kept(tmp_path: Path) -> None:
    async with running_server(tmp_path, "a", metrics=True) as server:
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        for name in ("", "x" * 10_000, "bad name", "../etc"):
            await refused(stub.AddStream(pb.AddStreamRequest(stream=name)), grpc.StatusCode.INVALID_ARGUMENT)
        await refused(stub.AddStream(pb.AddStreamRequest(stream="a")), grpc.StatusCode.ALREADY_EXISTS)
        await refused(stub.RemoveStream(pb.RemoveStreamRequest(stream="a")), grpc.StatusCode.INVALID_ARGUMENT)
        said = await refused(
            stub.RemoveStream(pb.RemoveStreamRequest(stream="y" * 10_000, backlog=KEEP)),
            grpc.StatusCode.NOT_FOUND,
        )
        assert "streams: a" in said
        await refused(
            stub.RemoveStream(pb.RemoveStreamRequest(stream="a", backlog=DRAIN)),
            grpc.StatusCode.FAILED_PRECONDITION,
        )
        view = await stub.AddStream(pb.AddStreamRequest(stream="b"))
        assert [(s.stream, s.state) for s in view.streams] == [("a", "serving"), ("b", "serving")]
        async with Producer(server.target, "b") as producer:  # served at once
            await producer.send_many([b"1", b"2", b"3"])
            await producer.flush(timeout=10)
        # no query runs here: a drained stream waits (draining) with its backlog
        view = await stub.RemoveStream(
            pb.RemoveStreamRequest(stream="b", backlog=DRAIN, reason="r" * 100_000)
        )
        assert [(s.stream, s.state, s.backlog) for s in view.streams] == [
            ("a", "serving", 0),
            ("b", "draining", 3),
        ]
        await refused(
            stub.RemoveStream(pb.RemoveStreamRequest(stream="b", backlog=KEEP)), grpc.StatusCode.NOT_FOUND
        )
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        metrics = (await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())).decode()
        assert 'sluice_streams{state="draining"} 1.0' in metrics
        assert 'sluice_stream_changes_total{action="add",result="applied"} 1.0' in metrics
        assert 'sluice_stream_changes_total{action="add",result="refused"} 5.0' in metrics
        # the pipeline methods need a query
        await refused(stub.GetPipeline(pb.GetPipelineRequest()), grpc.StatusCode.FAILED_PRECONDITION)
        for timeout in (math.nan, -1.0, math.inf, 1e9):
            await refused(
                stub.SwapPipeline(
                    pb.SwapPipelineRequest(pipeline="m:f", first_batch_timeout_seconds=timeout)
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        await refused(
            stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="m:" + "f" * 5000)),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        await refused(
            stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="m:f")), grpc.StatusCode.FAILED_PRECONDITION
        )
    assert json.loads((tmp_path / "streams.json").read_text()) == {
        "streams": {"a": "serving", "b": "draining"}
    }
    # after a restart with the same flags: b is still draining, not served
    async with running_server(tmp_path, "a") as server:
        assert list(server.receivers) == ["a"] and server.streams.states["b"] == "draining"
        assert server.stream_backlog("b") == 3
    # a flag naming a new stream serves it
    async with running_server(tmp_path, "a", "c") as server:
        assert sorted(server.receivers) == ["a", "c"]


@pytest.mark.parametrize(
    "content",
    [
        '{"streams": {"a": "flying"}}',
        "null",  # was taken for no file: every stream added at run time forgotten, unseen
        '{"streams": {}}',  # Sluice never writes it: the file keeps every stream's state once one changed
    ],
)
async def test_a_bad_streams_file_stops_the_start_naming_it(tmp_path: Path, content: str) -> None:
    (tmp_path / "streams.json").write_text(content)
    with pytest.raises(StreamStateError, match=r"streams\.json.*delete it"):
        async with running_server(tmp_path, "a"):
            pass


async def test_a_new_stream_named_as_another_but_for_case_is_refused_naming_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Streams `a` and `A` were both taken, and each has a folder in the data dir: on a case-insensitive
    file system (macOS, Windows) the two are one folder, one log for two streams. Kafka refuses topic
    names that collide so; a new stream whose name differs from another's only in case is refused now,
    naming both: AddStream ALREADY_EXISTS, a start whose streams do StreamNameClashError. A data dir
    an earlier version left with such a pair starts as before, with a WARNING."""
    from ingest.streams import StreamNameClashError

    data = tmp_path / "data"
    async with running_server(data, "a", "b") as server:
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        for name, other, where in (("A", "a", "serving"), ("B", "b", "kept")):
            if name == "B":
                await stub.RemoveStream(
                    pb.RemoveStreamRequest(stream="b", backlog=pb.RemoveStreamRequest.KEEP)
                )
            details = await refused(
                stub.AddStream(pb.AddStreamRequest(stream=name)), grpc.StatusCode.ALREADY_EXISTS
            )
            assert details == (
                f"stream '{name}' differs from stream '{other}' ({where}) only in letter case: each stream "
                "has a folder in the data dir, and on a case-insensitive file system (macOS, Windows) the "
                "two would be one; name it otherwise"
            ), details
        view = await stub.AddStream(pb.AddStreamRequest(stream="c"))  # another name is taken
        assert [(v.stream, v.state) for v in view.streams] == [
            ("a", "serving"),
            ("b", "kept"),
            ("c", "serving"),
        ]
        await stub.AddStream(pb.AddStreamRequest(stream="b"))  # as is the stream itself, back again
        assert not (data / "blocks" / "A").exists() and not (data / "blocks" / "B").exists()
    # at a start: a new one beside one the data dir holds, or two new ones
    for streams, says in (
        (("a", "A"), "stream 'A' differs from stream 'a' (in this data dir already) only in letter case"),
        (("A",), "stream 'A' differs from stream 'a' (in this data dir already) only in letter case"),
        (("a", "x", "X"), "stream 'x' differs from stream 'X' (also among the streams to serve) only in"),
    ):
        with pytest.raises(StreamNameClashError, match=re.escape(says)):
            async with running_server(data, *streams):
                pass
    assert sorted(p.name for p in (data / "blocks").iterdir()) == ["a", "b", "c"]
    # a pair an earlier version made (on a case-sensitive file system): the folder of stream D, made in
    # a data dir of its own, moved beside d's
    async with running_server(data, "a", "d"):
        pass
    async with (
        running_server(tmp_path / "other", "D") as other,
        Producer(other.target, "D", producer_id="p-D") as producer,
    ):
        await producer.send_many([b"D1", b"D2"])
    (tmp_path / "other" / "blocks" / "D").rename(data / "blocks" / "D")
    caplog.set_level(logging.WARNING)
    async with running_server(data, "a", "d", "D") as server:
        assert sorted(server.receivers) == ["D", "a", "b", "c", "d"]
        assert server.stream_backlog("D") == 2
        warned = [r.getMessage() for r in caplog.records if "differ only in letter case" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith("streams D and d differ only"), warned
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        await stub.RemoveStream(pb.RemoveStreamRequest(stream="D", backlog=pb.RemoveStreamRequest.KEEP))
        view = await stub.AddStream(pb.AddStreamRequest(stream="D"))  # its own: added back
        assert ("D", "serving") in [(v.stream, v.state) for v in view.streams]


async def test_a_stream_dropped_from_the_flags_is_named_and_listed_with_its_acked_backlog(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_server(tmp_path, "a", "b", "c") as server:
        for stream, n in (("b", 1000), ("c", 5)):
            async with Producer(server.target, stream, producer_id=f"p-{stream}") as producer:
                await producer.send_many([b"r%d" % i for i in range(n)])
                await producer.flush(timeout=10)
    # c's records were processed (released), as a query's commit does: nothing of c waits
    store = WalBlockStore(tmp_path / "blocks")
    store.release("c", store.blocks("c")[-1].seq + 1)
    caplog.set_level(logging.INFO)
    async with running_server(tmp_path, "a") as server:  # b and c dropped from the flags
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        said = warnings[0]
        assert said.startswith("stream b is not served")
        assert "1,000 acked records" in said and str(tmp_path / "blocks" / "b") in said
        assert "sluice streams add b" in said and "sluice streams remove b --drain" in said
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        view = await stub.ListStreams(pb.ListStreamsRequest())
        assert [(s.stream, s.state, s.backlog) for s in view.streams] == [
            ("a", "serving", 0),
            ("b", "kept", 1000),
        ]
        rows = server.status.snapshot()["streams"]
        assert [(r["stream"], r["state"], r["backlog"]) for r in rows] == [
            ("a", "serving", 0),
            ("b", "kept", 1000),
        ]
        assert server.query_streams() == ("a",)  # not read by the query, as a kept stream
        assert not (tmp_path / "streams.json").exists()  # the next start's flags decide again
        # brought back: its records wait for the query where they were, then it takes more
        view = await stub.AddStream(pb.AddStreamRequest(stream="b"))
        assert [(s.stream, s.state, s.backlog) for s in view.streams] == [
            ("a", "serving", 0),
            ("b", "serving", 1000),
        ]
        async with Producer(server.target, "b", producer_id="p-b", first_seq=1000) as producer:
            await producer.send_many([b"more"])
            await producer.flush(timeout=10)
        assert server.stream_backlog("b") == 1001
    assert json.loads((tmp_path / "streams.json").read_text()) == {
        "streams": {"a": "serving", "b": "serving"}
    }
    caplog.clear()
    async with running_server(tmp_path, "a"):  # added at run time: kept in streams.json, served
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def _serve_log(tmp_path: Path, data: Path, *streams: str) -> str:
    """What `sluice serve --no-spark` on `data` logs from its start to a clean stop."""
    log = tmp_path / f"serve-{data.name}.log"
    flags = [f"--stream={stream}" for stream in streams]
    with log.open("wb") as log_file:
        serve = subprocess.Popen(
            [
                *SLUICE,
                "serve",
                "--no-spark",
                "--port",
                "0",
                "--metrics-port",
                "-1",
                f"--data-dir={data}",
                *flags,
            ],
            stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        wait_for_line(serve, log, r"sluice: serving streams", 60)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)
    assert serve.returncode == 0, log.read_text()
    return log.read_text()


async def test_a_stream_removed_at_run_time_is_named_once_at_the_start_as_it_is_now(tmp_path: Path) -> None:
    """A start whose streams.json holds a stream the command line names in another state logged "stream
    default is draining (changed at run time, ...); the command line names it" twice (the settings'
    check before the start read the file too). Once now, saying it is not served and why; and a stream
    left draining whose log holds nothing is drained (removed) at the start, not said to be draining
    and listed so, backlog 0, until a batch commits (which an idle query never does)."""
    data = tmp_path / "d"
    async with running_server(data, "default", "other") as server:
        async with Producer(server.target, "default") as producer:
            await producer.send_many([b"1", b"2", b"3"])
            await producer.flush(timeout=10)
        await server.remove_stream("default", drain=True, reason="")
    empty = tmp_path / "e"
    empty.mkdir()
    (empty / "streams.json").write_text(json.dumps({"streams": {"default": "draining", "other": "serving"}}))
    said = await asyncio.to_thread(_serve_log, tmp_path, data, "default", "other")
    lines = [line for line in said.splitlines() if "stream default" in line]
    assert len(lines) == 1, said
    assert "stream default is draining, not served, though it is among the streams to serve" in lines[0]
    assert "its 3 acked records left" in lines[0] and "`sluice streams add default`" in lines[0]
    said = await asyncio.to_thread(_serve_log, tmp_path, empty, "default", "other")
    lines = [line for line in said.splitlines() if "stream default" in line]
    assert len(lines) == 2, said
    assert "stream default drained: every acked record was processed; removed" in lines[0]
    assert "stream default is removed, not served" in lines[1]
    assert json.loads((empty / "streams.json").read_text()) == {
        "streams": {"default": "removed", "other": "serving"}
    }


async def test_a_swap_cut_by_a_crash_resumes_the_query_that_committed(tmp_path: Path) -> None:
    """pipeline.json after a crash mid-swap: the new query is kept only if it committed a batch."""
    from ingest.driver import SparkDriver
    from ingest.pipeline_manager import PipelineManager, PipelineStateError

    def state(trial_base: int) -> str:
        old = {"spec": "m:old", "number": 0, "checkpoint": "sluice", "sink": "sink"}
        new = {"spec": "m:new", "number": 1, "checkpoint": "sluice-g1", "sink": "sink-g1",
               "starting_offsets": {"s": 10}}  # fmt: skip
        return json.dumps({"current": new, "previous": old, "trial": True, "trial_base": trial_base})

    async with running_server(tmp_path, "s") as server:
        loop = asyncio.get_running_loop()
        # the new query never committed: back to the old one, and the file says so
        (tmp_path / "pipeline.json").write_text(state(-1))
        manager = PipelineManager(SparkDriver(None, server.config, store=server.store), server, loop)
        assert manager.current.spec == "m:old"
        assert json.loads((tmp_path / "pipeline.json").read_text())["trial"] is False
        # it committed batch 0: kept (its output exists; going back would process those records twice)
        (tmp_path / "checkpoints" / "sluice-g1" / "commits").mkdir(parents=True)
        (tmp_path / "checkpoints" / "sluice-g1" / "commits" / "0").write_text("v1\n{}")
        (tmp_path / "pipeline.json").write_text(state(-1))
        manager = PipelineManager(SparkDriver(None, server.config, store=server.store), server, loop)
        assert (manager.current.spec, manager.current.starting_offsets) == ("m:new", {"s": 10})
        # a swapped-in pipeline that no longer loads (its module gone from the path) stops the start
        # with what to do, before Spark is asked for anything
        gone = {"spec": "no_such_module_here:p", "number": 1, "checkpoint": "sluice-g1", "sink": "sink-g1"}
        (tmp_path / "pipeline.json").write_text(
            json.dumps({"current": gone, "previous": None, "trial": False})
        )
        manager = PipelineManager(SparkDriver(None, server.config, store=server.store), server, loop)
        with pytest.raises(
            PipelineStateError, match=r"generation 1, swapped in .*make its module importable"
        ):
            await manager.start()
        # a file that points outside the data dir, or is not one, stops the start naming it
        for bad in ('{"current": {"spec": "", "number": 0, "checkpoint": "../../etc", "sink": "x"}}', "[1"):
            (tmp_path / "pipeline.json").write_text(bad)
            with pytest.raises(PipelineStateError, match=r"pipeline\.json"):
                PipelineManager(SparkDriver(None, server.config, store=server.store), server, loop)


async def test_reset_pipeline_starts_the_flags_pipeline_where_the_swapped_in_one_committed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pipeline swapped in at run time that fails at every start had no way back: --pipeline was
    ignored without a word, and only editing pipeline.json by hand helped."""
    import dataclasses

    from ingest.driver import SparkDriver
    from ingest.pipeline_manager import PipelineManager

    swapped = {"spec": "m:bad", "number": 1, "checkpoint": "sluice-g1", "sink": "sink-g1",
               "starting_offsets": {"s": 10}}  # fmt: skip
    async with running_server(tmp_path, "s") as server:
        loop = asyncio.get_running_loop()
        state = json.dumps({"current": swapped, "previous": None, "trial": False})
        (tmp_path / "pipeline.json").write_text(state)
        checkpoint = tmp_path / "checkpoints" / "sluice-g1"
        for folder in ("commits", "offsets"):
            (checkpoint / folder).mkdir(parents=True)
        (checkpoint / "commits" / "3").write_text("v1\n{}")
        (checkpoint / "offsets" / "3").write_text('v1\n{"batchWatermarkMs":0}\n{"s":250}')
        (checkpoint / "offsets" / "4").write_text('v1\n{"batchWatermarkMs":0}\n{"s":300}')  # not committed
        (tmp_path / "sink-g2").mkdir()  # a failed try of generation 2: its folders are never taken again
        # without the flag, the swap stands (as runtime-config.json overrides flags), and says so
        flagged = dataclasses.replace(server.config, pipeline="swap_pipelines:tag_a")
        manager = PipelineManager(SparkDriver(None, flagged, store=server.store), server, loop)
        assert manager.current.spec == "m:bad"
        assert "runs, not --pipeline swap_pipelines:tag_a" in caplog.text
        # --reset-pipeline: generation 2 of the flag's pipeline, where generation 1 committed (250)
        reset = dataclasses.replace(flagged, reset_pipeline=True)
        manager = PipelineManager(SparkDriver(None, reset, store=server.store), server, loop)
        current = manager.current
        assert (current.spec, current.number, current.checkpoint, current.sink) == (
            "swap_pipelines:tag_a",
            2,
            "sluice-g2-try2",
            "sink-g2-try2",
        )
        assert current.starting_offsets == {"s": 250}
        assert (tmp_path / "sink-g2").is_dir()  # left as it was: a query left running may write there
        # a trial, as a swap's new query is, until it commits a batch
        saved = json.loads((tmp_path / "pipeline.json").read_text())
        assert saved["current"]["spec"] == "swap_pipelines:tag_a" and saved["trial"] is True
        assert saved["previous"]["spec"] == "m:bad" and saved["trial_base"] == -1
        # it never committed (it failed at its first start, say): the next start without the flag runs
        # the generation it replaced, as after a swap cut short (it was the one in force until then)
        manager = PipelineManager(SparkDriver(None, flagged, store=server.store), server, loop)
        assert (manager.current.spec, manager.current.number) == ("m:bad", 1)
        assert json.loads((tmp_path / "pipeline.json").read_text())["trial"] is False
        # reset again: the same generation number, started where generation 1 committed
        manager = PipelineManager(SparkDriver(None, reset, store=server.store), server, loop)
        assert (manager.current.number, manager.current.starting_offsets) == (2, {"s": 250})
        # once it committed a batch, the next start (with or without the flag) runs it: reset once
        commits = tmp_path / "checkpoints" / manager.current.checkpoint / "commits"
        commits.mkdir(parents=True)
        (commits / "0").write_text("v1\n{}")
        for config in (reset, flagged, server.config):
            manager = PipelineManager(SparkDriver(None, config, store=server.store), server, loop)
            current = manager.current
            assert (current.spec, current.number, current.starting_offsets) == (
                "swap_pipelines:tag_a",
                2,
                {"s": 250},
            )


async def test_a_swap_before_the_query_started_says_it_is_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`sluice serve` attaches the manager before its query starts (Spark's Python workers warm up
    first): a swap then was told "no Spark query runs here", the words for a node without one."""
    from ingest.driver import SparkDriver
    from ingest.pipeline_manager import PipelineManager

    async with running_server(tmp_path, "s") as server:
        driver = SparkDriver(None, server.config, store=server.store)
        server.pipeline_control = PipelineManager(driver, server, asyncio.get_running_loop())
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = pb_grpc.AdminStub(channel)
            for call in (  # one after the other: a call starts when it is made
                lambda: stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="")),
                lambda: stub.SetConfig(pb.SetConfigRequest(set={"trigger-interval": "2"})),
            ):
                details = await refused(call(), grpc.StatusCode.FAILED_PRECONDITION)
                assert "still starting; try again" in details, details
            # and `pipeline get` says so: it said "stopped", as if the query had died
            view = await stub.GetPipeline(pb.GetPipelineRequest())
            assert (view.state, view.generation, view.query_id) == ("starting", 0, "")
        args = ["pipeline", "get", "--target", server.target]
        assert await asyncio.to_thread(cli.main, args) == 0
        said = capsys.readouterr().out
        assert "pipeline: built-in Parquet sink (generation 0, starting)" in said, said
        assert "query: none yet (Spark is starting it)" in said, said


async def test_the_cli_says_what_a_drain_left_waiting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """RemoveStream returns before a drain is done; on a server without a query it waits for good."""
    async with running_server(tmp_path, "a", "c") as server:
        async with Producer(server.target, "c") as producer:
            await producer.send_many([b"1", b"2"])
            await producer.flush(timeout=10)
        args = ["streams", "remove", "c", "--drain", "--target", server.target]
        assert await asyncio.to_thread(cli.main, args) == 0
        said = capsys.readouterr()
        assert "c\tdraining\t2\t" in said.out
        assert "c stays draining until the query has processed its backlog (2 records now)" in said.err
        assert "--no-spark" in said.err
        args = ["streams", "remove", "a", "--keep", "--target", server.target]  # nothing left waiting
        assert await asyncio.to_thread(cli.main, args) == 0
        assert capsys.readouterr().err == ""


FORGED = "\n2026-11-28 01:00:00,000 INFO ingest.admin_service: FORGED LINE"
RAW = ("\n", "\r", "\x1b", "\x00")


class _RefusingControl:
    """A PipelineControl that refuses every spec, as a bad spec is refused (after the log line)."""

    changes: dict[tuple[str, str], int] = {}  # noqa: RUF012 - read only
    generation = 0

    def view(self) -> pb.PipelineView:
        return pb.PipelineView()

    async def swap(self, spec: str, *, keep_state: bool, first_batch_timeout: float) -> pb.PipelineView:
        from ingest.pipeline_control import InvalidPipeline

        raise InvalidPipeline(f"pipeline spec {spec!r} is no pipeline")

    async def restart(self, *, trigger_interval: float) -> None:
        raise AssertionError


async def test_client_strings_are_escaped_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside tester's log forging: SwapPipeline(pipeline='good:build\\n2026-... INFO ...: FORGED
    LINE') wrote a line of its own to the plain log, and ESC and NUL went there raw. Every client string
    an Admin call logs is quoted or escaped now: a setting's value too (SetConfig takes "0.3\\n" for a
    float), and a stream's removal reason."""
    caplog.set_level(logging.DEBUG)
    async with running_server(tmp_path, "a", "b") as server:
        server.pipeline_control = _RefusingControl()  # type: ignore[assignment]
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        for spec in (f"good:build{FORGED}", "good:\x1b[31mred\x00"):
            await refused(
                stub.SwapPipeline(pb.SwapPipelineRequest(pipeline=spec)), grpc.StatusCode.INVALID_ARGUMENT
            )
        await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.3\n"}))
        await stub.RemoveStream(
            pb.RemoveStreamRequest(stream="b", backlog=KEEP, reason=f"why{FORGED}\x1b\x00")
        )
    said = [r.getMessage() for r in caplog.records]
    swaps = [m for m in said if m.startswith("pipeline swap to")]
    assert len(swaps) == 2 and "FORGED LINE" in swaps[0] and "red" in swaps[1], said
    settings = [m for m in said if m.startswith("settings version")]
    assert len(settings) == 1 and "block-interval=0.3" in settings[0], said
    removed = [m for m in said if "removed" in m and "FORGED" in m]
    assert removed, said
    caplog.clear()
    async with running_server(tmp_path, "a"):  # the saved setting, logged at the start
        pass
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("setting block-interval")]
    assert len(started) == 1, started
    for message in [*swaps, *settings, *removed, *started]:
        assert not any(c in message for c in RAW), repr(message)


async def test_a_stream_change_whose_caller_went_away_runs_to_its_end(tmp_path: Path) -> None:
    """An outside tester's AddStream / RemoveStream with deadlines of a few milliseconds: a deadline
    that cut the change between saving streams.json and starting (or stopping) the receiver left the
    stream listed "serving" without a receiver, which could then be neither added (ALREADY_EXISTS) nor
    removed (NOT_FOUND, "it is serving") until a restart. The change now runs to its end on the server."""
    async with running_server(tmp_path, "a") as server:
        stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(server.target))
        for i in range(200):
            call = (
                stub.AddStream(pb.AddStreamRequest(stream="b"), timeout=0.0005 + 0.0001 * (i % 100))
                if i % 2 == 0
                else stub.RemoveStream(pb.RemoveStreamRequest(stream="b", backlog=KEEP), timeout=0.001)
            )
            with contextlib.suppress(grpc.aio.AioRpcError):
                await call
            # a change left to run alone ends soon; generous, for a loaded machine (CI once ran out of 2 s)
            deadline = time.monotonic() + 30
            while (server.streams.states.get("b") == "serving") != ("b" in server.receivers):
                if time.monotonic() > deadline:
                    state = server.streams.states.get("b")
                    raise AssertionError(f"{state} without a receiver after call {i}")
                await asyncio.sleep(0.01)
        # the last changes, left to run alone, end. A call whose deadline passed on this side may still
        # reach the server after the lock was free (its RemoveStream then took b away just before the
        # one below, NOT_FOUND "it is kept"): wait for a second with no change
        quiet: tuple[object, ...] = ()
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.0:
            now = (server.streams.states.get("b"), "b" in server.receivers, server._stream_lock.locked())
            if now != quiet or server._stream_lock.locked():
                quiet, quiet_since = now, time.monotonic()
            await asyncio.sleep(0.01)
        if "b" in server.receivers:
            await stub.RemoveStream(pb.RemoveStreamRequest(stream="b", backlog=KEEP))
        await stub.AddStream(pb.AddStreamRequest(stream="b"))
        assert sorted(server.receivers) == ["a", "b"]


async def test_an_operators_cancel_of_a_session_is_logged_with_who_and_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside tester: an operator's CancelSession ended a producer's session (it failed with the
    operator's status and reason) and the server's log said nothing of it, while a rate, a setting or
    a stream changed at run time is logged with the peer that changed it. The log names the session,
    its stream, producer and principal, the status, the peer and the reason, escaped to one line."""
    caplog.set_level(logging.INFO)
    async with (
        running_server(tmp_path / "data", "s") as server,
        Producer(server.target, "s", producer_id="victim", linger=0.001) as producer,
    ):
        await producer.send(b"x")
        await producer.flush(timeout=10)
        (session,) = server.receivers["s"].sessions
        async with grpc.aio.insecure_channel(server.target) as channel:
            answer = await pb_grpc.SessionsStub(channel).CancelSession(
                pb.CancelSessionRequest(
                    session_id=session.id,
                    code=grpc.StatusCode.FAILED_PRECONDITION.value[0],
                    reason="maintenance\nFORGED LINE",
                ),
                timeout=10,
            )
        assert answer.cancelled
        with contextlib.suppress(Exception):
            await producer.close(5)
    lines = [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
    assert len(lines) == 1, lines
    (line,) = lines
    assert f"session {session.id} on stream 's'" in line, line
    assert "'victim'" in line and "FAILED_PRECONDITION" in line and "127.0.0.1" in line, line
    assert "maintenance\\nFORGED LINE" in line and "\n" not in line, line


async def test_a_cancel_of_a_session_that_ended_says_it_ended_not_that_it_was_cancelled(
    tmp_path: Path,
) -> None:
    """`sluice sessions cancel ID` of a session its producer had closed said "session ID was already
    cancelled": nobody had cancelled it. Cancel stays idempotent (exit 0), and says the session had
    ended or been cancelled; an id never issued is NOT_FOUND, exit 1."""
    async with running_server(tmp_path / "data", "s") as server:
        async with Producer(server.target, "s", producer_id="p", linger=0.001) as producer:
            await producer.send(b"x")
            await producer.flush(timeout=10)
            (session,) = server.receivers["s"].sessions
        await wait_until(lambda: not server.receivers["s"].sessions)

        def cancel(session_id: int) -> subprocess.CompletedProcess[str]:
            command = [*SLUICE, "sessions", "cancel", str(session_id), "--target", server.target]
            return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)

        done = await asyncio.to_thread(cancel, session.id)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"session {session.id} {cli.ALREADY_OVER}\n", done.stdout
        done = await asyncio.to_thread(cancel, session.id + 1000)
        assert done.returncode == 1 and f"NOT_FOUND: no session with id {session.id + 1000}" in done.stderr
