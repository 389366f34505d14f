"""Blocks far larger than a gRPC message (a quarter of the buffer's records, big records) still travel
between nodes: Blocks.ReadBlocks cuts them into chunks of about CHUNK_BYTES."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from ingest.server import SluiceServer
from receivers.blocks_service import CHUNK_BYTES
from receivers.cluster import Cluster
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, running_server, wait_until

RECORD = 1_000_000
PIECE = 1024 * 1024
BIG = {"block_interval": 3.0, "buffer_bytes": 512 * 1024 * 1024}


@contextlib.asynccontextmanager
async def cluster_of(tmp_path: Path, clusters: list[Cluster]) -> AsyncIterator[dict[int, SluiceServer]]:
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for cluster in clusters:
            port = int(cluster.me.target.rsplit(":", 1)[1])
            servers[cluster.me.id] = await stack.enter_async_context(
                running_server(tmp_path / f"n{cluster.me.id}", "s", cluster=cluster, port=port, **BIG)
            )
        yield servers


async def push_big(target: str, n: int) -> list[bytes]:
    values = [bytes([i % 251]) * RECORD for i in range(n)]
    async with Producer(target, "s", linger=0) as producer:
        await producer.send_many(values)
        await producer.flush(60)
    return values


async def read_all(target: str, owner: int, hi: int) -> tuple[list[bytes], int]:
    values: list[bytes] = []
    chunks = 0
    async with grpc.aio.insecure_channel(target, options=[("grpc.max_receive_message_length", -1)]) as ch:
        request = pb.ReadBlocksRequest(stream="s", owner=owner, from_offset=0, to_offset=hi)
        async for chunk in pb_grpc.BlocksStub(ch).ReadBlocks(request):
            assert len(chunk.arrow_ipc) <= CHUNK_BYTES + 2 * RECORD
            values.extend(pa.ipc.open_stream(chunk.arrow_ipc).read_all().column("value").to_pylist())
            chunks += 1
    return values, chunks


async def test_a_block_larger_than_a_message_is_read_in_chunks(tmp_path: Path) -> None:
    async with cluster_of(tmp_path, loopback_cluster(1)) as servers:
        sent = await push_big(servers[0].target, 40)
        # one block of many messages' worth; not necessarily the first, which the block timer may cut
        # early when the client starts late in an interval (seen in CI: 6 records)
        assert max(b.count for b in servers[0].store.blocks("s")) > 8
        values, chunks = await read_all(servers[0].target, 0, len(sent))
        assert values == sent
        assert chunks >= 40 * RECORD // CHUNK_BYTES


async def test_a_block_larger_than_a_message_is_replicated_and_read_from_the_copy(tmp_path: Path) -> None:
    # min-insync 2: before, the copy's message was over the follower's limit, the follower dropped out
    # for good, and nothing was ever acked again
    async with cluster_of(tmp_path, loopback_cluster(2, replication=2, min_insync=2)) as servers:
        sent = await push_big(servers[0].target, 40)
        node1 = servers[1].node
        assert node1 is not None
        assert max(b.count for b in node1.replicas.blocks(0, "s")) > 8  # as above, copied
        values, _ = await read_all(servers[1].target, 0, len(sent))
        assert values == sent


def test_fragments_join_back_and_a_cut_off_block_is_refused() -> None:
    from receivers.replication import fragments
    from receivers.replication_service import FragmentError, _Assembler

    block = pb.ReplicaBlock(stream="s", seq=3, first_offset=7, count=2, arrow_ipc=bytes(range(256)) * 40)
    pieces = fragments(block, size=1000)
    assert len(pieces) == 11 and all(p.more for p in pieces[:-1]) and not pieces[-1].more
    assembler = _Assembler()
    assert [assembler.take(p) for p in pieces[:-1]] == [None] * 10
    assert assembler.take(pieces[-1]) == block
    assert fragments(block, size=len(block.arrow_ipc)) == [block]
    assembler.take(pieces[0])
    with pytest.raises(FragmentError, match="cut off"):
        assembler.take(pb.ReplicaBlock(stream="s", seq=4, arrow_ipc=b"x"))


async def test_a_follower_gathers_a_block_up_to_its_memory_budget_and_refuses_past_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A follower joins a block's fragments in memory: it took up to 2 GiB of them per owner's stream,
    whatever its memory settings. It gathers at most twice the stream's memory budget plus one message
    now (block_limit), and ends the stream RESOURCE_EXHAUSTED past that, naming the block, the bytes and
    the settings, said once in an ERROR line. Blocks of an owner configured as the follower (its
    largest, of big records) are under it, and replicated."""
    from receivers.replication_service import block_limit

    small = {"buffer_bytes": 4 * 1024 * 1024, "max_message_bytes": 2 * 1024 * 1024, "block_interval": 0.5}
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    limit = block_limit(small["buffer_bytes"], small["max_message_bytes"])
    async with contextlib.AsyncExitStack() as stack:
        servers = {}
        for cluster in clusters:
            port = int(cluster.me.target.rsplit(":", 1)[1])
            servers[cluster.me.id] = await stack.enter_async_context(
                running_server(tmp_path / f"n{cluster.me.id}", "s", cluster=cluster, port=port, **small)
            )
        # the owner's own blocks: records of 200 KB, several producers at once, all replicated
        sent: list[bytes] = []

        async def push(tag: int) -> None:
            values = [bytes([tag]) * 200_000 for _ in range(30)]
            async with Producer(servers[0].target, "s", linger=0) as producer:
                await producer.send_many(values)
                await producer.flush(60)
            sent.extend(values)

        await asyncio.gather(*(push(tag) for tag in range(4)))
        node1 = servers[1].node
        assert node1 is not None
        copies = node1.replicas.blocks(0, "s")
        assert sum(b.count for b in copies) == len(sent) == 120
        assert "refused the replication" not in caplog.text

        # an owner (node 1's hello, sent by hand to node 0) whose block goes past the bound
        async def replicate_too_much() -> tuple[grpc.StatusCode, str, int]:
            async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
                call = pb_grpc.ReplicationStub(channel).Replicate()
                sent_bytes = await write_past(call, 4 * limit)
                return await call.code(), await call.details() or "", sent_bytes

        for _ in range(2):
            code, details, sent_bytes = await replicate_too_much()
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert f"block 0 of stream 's': it is over {limit:,} bytes (" in details, details
            # refused as its fragments crossed the bound: no more than one fragment past it was taken
            taken = int(details.split(" bytes (", 1)[1].split(" in the fragments", 1)[0].replace(",", ""))
            assert limit < taken <= limit + PIECE, (taken, sent_bytes)
            assert "node 0 refuses node 1's block 0" in details and "--buffer-bytes" in details
        assert caplog.text.count("refused the replication of node 1") == 1
        node0 = servers[0].node
        assert node0 is not None and node0.replicas.blocks(1, "s") == []

        # two streams of one owner (two processes run as node 1, or a stale stream beside a new one)
        # hold no more together than one may
        service = node0._replication
        assert service is not None
        # node 1's own Replicate stream (it is an owner too, node 0 its follower) is the one left
        await wait_until(lambda: [a.size for a in service._gathering[1]] == [0])
        hello = pb.ReplicateRequest(hello=pb.ReplicaHello(owner=1, nodes=2, replication=2))
        piece = pb.ReplicaBlock(stream="s", seq=0, count=1, arrow_ipc=bytes(PIECE), more=True)
        async with (
            grpc.aio.insecure_channel(clusters[0].me.target) as one,
            grpc.aio.insecure_channel(clusters[0].me.target) as other,
        ):
            first = pb_grpc.ReplicationStub(one).Replicate()
            await first.write(hello)
            for _ in range(6):  # 6 MiB of a block, under the bound alone
                await first.write(pb.ReplicateRequest(block=piece))
            await wait_until(lambda: sum(a.size for a in service._gathering.get(1, ())) == 6 * PIECE)
            second = pb_grpc.ReplicationStub(other).Replicate()
            await write_past(second, 4 * limit)
            assert await second.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            details = await second.details() or ""
            assert f"with {6 * PIECE:,} of its other Replicate streams" in details, details
            assert not first.done()  # the first goes on
            first.cancel()
        await wait_until(lambda: len(service._gathering[1]) == 1)  # the ended streams hold nothing


async def write_past(call: Any, most: int) -> int:
    """As node 1 (an owner), send node 0 fragments of one block, up to `most` bytes, reading its
    answers meanwhile as an owner does (unread, the refusal came back as INTERNAL "Internal error from
    Core" at times); the bytes sent."""

    async def answers() -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            async for _ in call:
                pass

    reading = asyncio.create_task(answers())
    sent = 0
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await call.write(pb.ReplicateRequest(hello=pb.ReplicaHello(owner=1, nodes=2, replication=2)))
        while sent < most and not call.done():
            piece = pb.ReplicaBlock(stream="s", seq=0, count=1, arrow_ipc=bytes(PIECE), more=True)
            await call.write(pb.ReplicateRequest(block=piece))
            sent += PIECE
            await asyncio.sleep(0.01)
    await reading
    return sent
