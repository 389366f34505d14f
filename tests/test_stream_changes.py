"""Streams and settings changed while records flow, on real parts (server, Spark, producers that keep
pushing): what every sink holds is compared with what was acked, each record exactly once."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_service import Load, admin, offsets_in, service, wait_for_offsets

from sluice_client import Producer as Producer_
from sluice_client.errors import RPCError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

pytestmark = pytest.mark.spark


def stream_offsets(spark: Any, sink: Path, stream: str) -> list[int]:
    from pyspark.errors import AnalysisException

    try:
        rows = spark.read.parquet(str(sink)).where(f"topic = '{stream}'").select("offset").collect()
    except AnalysisException:
        return []
    return [r["offset"] for r in rows]


async def states(stub: Any) -> dict[str, str]:
    view = await stub.ListStreams(pb.ListStreamsRequest())
    return {s.stream: s.state for s in view.streams}


async def test_remove_drain_then_keep_then_add_back(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, "a", "b", pipeline="swap_pipelines:tag_a") as server:
        stub = admin(server)
        a, b = Load(server.target, "a"), Load(server.target, "b")
        push_a, push_b = asyncio.create_task(a.run()), asyncio.create_task(b.run())
        await asyncio.sleep(2)
        # the operator must choose what happens to the backlog
        with pytest.raises(grpc.aio.AioRpcError) as unchosen:
            await stub.RemoveStream(pb.RemoveStreamRequest(stream="b"))
        assert unchosen.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.RemoveStream(pb.RemoveStreamRequest(stream="zz", backlog=pb.RemoveStreamRequest.DRAIN))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

        # KEEP: b's publisher is cancelled with the reason; its unprocessed blocks wait in the log
        await stub.RemoveStream(
            pb.RemoveStreamRequest(stream="b", backlog=pb.RemoveStreamRequest.KEEP, reason="maintenance")
        )
        with pytest.raises(RPCError) as cancelled:
            await push_b
        assert cancelled.value.status == grpc.StatusCode.NOT_FOUND
        assert "maintenance" in str(cancelled.value)
        acked_b = b.ack_times[-1][1] if b.ack_times else 0
        assert (await states(stub))["b"] == "kept"
        # a new publisher is refused, naming the stream unknown
        with pytest.raises(RPCError) as refused:
            async with Producer_(server.target, "b") as producer:
                await producer.send(b"x")
                await producer.flush(timeout=10)
        assert refused.value.status == grpc.StatusCode.NOT_FOUND
        await asyncio.sleep(2)
        # a batch planned before the removal may still commit b's records: the backlog is read between
        # two reads of the sink that agree (a first batch committed between them failed it, 3 runs in 4)
        for _ in range(60):
            processed = stream_offsets(spark, tmp_path / "sink", "b")
            view = await stub.ListStreams(pb.ListStreamsRequest())
            if len(stream_offsets(spark, tmp_path / "sink", "b")) == len(processed):
                break
            await asyncio.sleep(0.5)
        assert len(processed) == len(set(processed)) and set(processed) <= set(range(acked_b))
        kept = next(s for s in view.streams if s.stream == "b")
        assert kept.backlog == acked_b - len(processed)

        # added back: it resumes where the query stopped reading it
        await stub.AddStream(pb.AddStreamRequest(stream="b"))
        with pytest.raises(grpc.aio.AioRpcError) as again:
            await stub.AddStream(pb.AddStreamRequest(stream="b"))
        assert again.value.code() == grpc.StatusCode.ALREADY_EXISTS
        b2 = Load(server.target, "b")
        b2.sent = acked_b  # its values go on from where b stopped (the offsets do anyway)
        push_b2 = asyncio.create_task(b2.run())
        await asyncio.sleep(2)

        # DRAIN: what was acked is processed, then the stream is gone
        await stub.RemoveStream(pb.RemoveStreamRequest(stream="b", backlog=pb.RemoveStreamRequest.DRAIN))
        with pytest.raises(RPCError):
            await push_b2
        total_b = b2.ack_times[-1][1] + acked_b
        a.stop()
        await push_a
        await wait_for_offsets(spark, a.sent + total_b, tmp_path / "sink")
        assert sorted(stream_offsets(spark, tmp_path / "sink", "b")) == list(range(total_b))
        assert sorted(stream_offsets(spark, tmp_path / "sink", "a")) == list(range(a.sent))
        for _ in range(40):
            if "b" not in await states(stub):
                break
            await asyncio.sleep(0.5)
        assert await states(stub) == {"a": "serving"}
        saved = json.loads((tmp_path / "streams.json").read_text())["streams"]
        assert saved == {"a": "serving", "b": "removed"}
        # the last stream the query reads cannot go
        with pytest.raises(grpc.aio.AioRpcError) as last:
            await stub.RemoveStream(pb.RemoveStreamRequest(stream="a", backlog=pb.RemoveStreamRequest.KEEP))
        assert last.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_block_and_trigger_interval_change_under_load(spark: Any, tmp_path: Path) -> None:
    async with service(spark, tmp_path, pipeline="swap_pipelines:tag_a") as server:
        stub = admin(server)
        load = Load(server.target, "events")
        pushing = asyncio.create_task(load.run())
        await asyncio.sleep(2)
        await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.4"}))
        await asyncio.sleep(2)
        before = await stub.GetPipeline(pb.GetPipelineRequest())
        # a bad trigger interval changes nothing and stops nothing
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stub.SetConfig(pb.SetConfigRequest(set={"trigger-interval": "-1"}))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (await stub.GetPipeline(pb.GetPipelineRequest())).query_id == before.query_id
        view = await stub.SetConfig(pb.SetConfigRequest(set={"trigger-interval": "1.5"}))
        assert {s.key: s.value for s in view.settings}["trigger-interval"] == "1.5"
        after = await stub.GetPipeline(pb.GetPipelineRequest())
        # the same query (its id is the checkpoint's) restarted, its first batch proven
        assert after.trigger_interval_seconds == 1.5 and after.query_id == before.query_id
        assert after.generation == before.generation and after.checkpoint == before.checkpoint
        assert after.last_swap.outcome == "done" and after.last_swap.duration_seconds > 0.5
        await asyncio.sleep(3)
        load.stop()
        await pushing
        offsets = await wait_for_offsets(spark, load.sent, tmp_path / "sink")
        assert sorted(offsets) == list(range(load.sent))
    saved = json.loads((tmp_path / "runtime-config.json").read_text())["overrides"]
    assert saved == {"block-interval": "0.4", "trigger-interval": "1.5"}
    assert offsets_in(spark, tmp_path / "sink")
