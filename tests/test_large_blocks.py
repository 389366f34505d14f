"""Blocks far larger than a gRPC message (a quarter of the buffer's records, big records) still travel
between nodes: Blocks.ReadBlocks cuts them into chunks of about CHUNK_BYTES."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pyarrow as pa

from ingest.server import SluiceServer
from receivers.blocks_service import CHUNK_BYTES
from receivers.cluster import Cluster
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, running_server

RECORD = 1_000_000
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
    import pytest

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
