"""What a peer says on a Replicate stream is checked against what is known where it is taken: an owner
checks its follower's acks and committed seqs against what it sent and told it, a follower checks that
its owner's committed seq never goes back. A bug or forgery ends that peer's stream with an error naming
the peer, the stream and the values, said once; other peers go on. Real nodes on loopback; the forging
follower is a gRPC server of the test's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster, running_server, wait_until


class _Forger(pb_grpc.ReplicationServicer):
    """A follower that answers the hello, stores nothing, and acks each block it is sent; `mode` says what
    it gets wrong: "ack-ahead" acks a block 100 seqs past the one sent, "committed-ahead" says it took a
    committed seq 100 past the one it was told, "committed-back" says it took 0 after the seq it was
    told."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.calls = 0

    async def Replicate(  # type: ignore[override]  # the generated servicer's stubs are looser
        self,
        request_iterator: AsyncIterator[pb.ReplicateRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReplicateResponse]:
        self.calls += 1
        requests = aiter(request_iterator)
        await anext(requests)  # the hello
        yield pb.ReplicateResponse(state=pb.ReplicaState())
        async for request in requests:
            if request.WhichOneof("kind") == "block" and not request.block.more:
                seq = request.block.seq + (100 if self.mode == "ack-ahead" else 0)
                yield pb.ReplicateResponse(ack=pb.ReplicaAck(stream=request.block.stream, seq=seq))
            elif request.WhichOneof("kind") == "commit":
                told = dict(request.commit.committed_seq)
                yield pb.ReplicateResponse(committed=pb.ReplicaCommit(committed_seq=told))
                if self.mode == "committed-ahead":
                    ahead = {s: n + 100 for s, n in told.items()}
                    yield pb.ReplicateResponse(committed=pb.ReplicaCommit(committed_seq=ahead))
                elif self.mode == "committed-back" and any(told.values()):
                    back = dict.fromkeys(told, 0)
                    yield pb.ReplicateResponse(committed=pb.ReplicaCommit(committed_seq=back))

    async def ProducerMarks(  # type: ignore[override]
        self, request: pb.ProducerMarksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ProducerMarksResponse:
        return pb.ProducerMarksResponse()


@pytest.mark.parametrize(
    ("mode", "words"),
    [
        ("ack-ahead", "acked block 100 of stream 's', past every block sent to it (it acked blocks below 0"),
        ("committed-ahead", "this node told it on this stream"),
        ("committed-back", "says it took committed seq 0 of stream 's', going back from the "),
    ],
)
async def test_a_followers_forged_answer_ends_its_stream_and_the_other_follower_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, words: str
) -> None:
    """Node 0 replicates to node 1 (a forger) and node 2 (a real node), min-insync 2. Taken as they came,
    node 1's forged ack counted blocks durable on it that it never got (acked to their producers with
    fewer copies than asked), and a forged committed seq let blocks be acked before node 1 would serve
    them. Now its stream ends INVALID_ARGUMENT naming it, the stream and the values, said once in an
    ERROR line though the owner reconnects and node 1 does it again; node 0 acks with node 2's copy all
    along: the other follower is not affected."""
    clusters = loopback_cluster(3, replication=3, min_insync=2)
    port = {c.me.id: int(c.me.target.rsplit(":", 1)[1]) for c in clusters}
    forger = _Forger(mode)
    fake = grpc.aio.server()
    pb_grpc.add_ReplicationServicer_to_server(forger, fake)
    fake.add_insecure_port(clusters[1].me.target)
    await fake.start()
    try:
        async with (
            running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port[0]) as owner,
            running_server(tmp_path / "node2", "s", cluster=clusters[2], port=port[2]),
        ):
            assert owner.node is not None
            links = {link.follower.id: link for link in owner.node.replicator.links}
            await wait_until(lambda: links[2].in_sync, timeout=10)
            round_ = 0
            while forger.calls < 3:  # node 1 answered wrongly and was reconnected, more than once
                assert round_ < 40, forger.calls
                async with Producer(owner.target, "s", producer_id=f"p{round_}", linger=0) as producer:
                    await producer.send_many([b"x"] * 20)
                    await producer.flush(timeout=20)  # acked: node 2's copy and node 0's make 2
                round_ += 1
                await asyncio.sleep(0.3)
            said = [
                r.getMessage() for r in caplog.records if r.levelname == "ERROR" and words in r.getMessage()
            ]
            assert len(said) == 1, [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
            assert said[0].startswith(f"INVALID_ARGUMENT: follower 1 ({clusters[1].me.target}) "), said
            assert links[2].in_sync
            await wait_until(lambda: node_2_has_all(owner))  # every block on node 2's copy
    finally:
        await fake.stop(None)
    assert "Traceback" not in caplog.text


def node_2_has_all(owner: Any) -> bool:
    link = next(link for link in owner.node.replicator.links if link.follower.id == 2)
    return bool(link.acked.get("s", 0) == owner.node.local.durable_seq("s") > 0)


async def test_an_owners_committed_seq_going_back_is_refused_naming_the_values(tmp_path: Path) -> None:
    """An owner's committed seq only grows; one that goes back on a Replicate stream (a bug, a forgery)
    ends it INVALID_ARGUMENT naming the owner, the stream and both values. Before, it was taken in
    silence (the copy kept the highest)."""
    clusters = loopback_cluster(2, replication=2)
    port = int(clusters[0].me.target.rsplit(":", 1)[1])
    async with (
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=port) as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        call = pb_grpc.ReplicationStub(channel).Replicate()
        hello = pb.ReplicaHello(owner=1, nodes=2, replication=2, committed_seq={"s": 0})
        await call.write(pb.ReplicateRequest(hello=hello))
        assert (await call.read()).WhichOneof("kind") == "state"
        await call.write(pb.ReplicateRequest(commit=pb.ReplicaCommit(committed_seq={"s": 0})))
        assert dict((await call.read()).committed.committed_seq) == {"s": 0}
        await call.write(pb.ReplicateRequest(commit=pb.ReplicaCommit(committed_seq={"s": 7})))
        assert dict((await call.read()).committed.committed_seq) == {"s": 7}
        await call.write(pb.ReplicateRequest(commit=pb.ReplicaCommit(committed_seq={"s": 3})))
        assert await call.code() is grpc.StatusCode.INVALID_ARGUMENT
        details = await call.details()
        assert "node 1 said committed seq 3 of stream 's' after 7" in details, details
        assert "a committed seq never goes back" in details
