"""Failover without duplicates: before a node takes a producer's session, it asks the cluster how far
that producer got.

A producer whose node died resends, to another node, every record it has no ack for. Some of those may
be in blocks the dead node had already copied to a follower (durable there, the ack lost with the node):
taking them again would store them twice. So a node asks every peer (Replication.ProducerMarks) for the
producer's mark on the stream, over all the partitions each holds, and takes the highest as accepted and
durable (Receiver.learn_producer_mark): the resent records below it are dropped as duplicates and acked.

A peer that does not answer is fine as long as another holder of its partitions did (its followers hold
copies of everything it acked). Otherwise, with replication > 1, the session is refused UNAVAILABLE,
which the SDK retries: better a short wait than a duplicate. With replication 1 there are no copies to
ask: the node goes on with what answered.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from receivers.cluster import Cluster
from receivers.errors import ClusterUnavailable
from receivers.replica_store import ReplicaStore
from receivers.replication import ChannelFactory, Metadata
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ASK_TIMEOUT = 3.0
"""Seconds a peer may take to answer. The SDK's start() waits longer for a first session's answer
(sluice_client.producer.FIRST_ANSWER_SECONDS, 5 s): change both together."""


class PeerMarks:
    """Asks the cluster for a producer's mark (see the module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        replicas: ReplicaStore,
        channel: ChannelFactory,
        *,
        metadata: Metadata = (),
        timeout: float = ASK_TIMEOUT,
    ) -> None:
        self._cluster = cluster
        self._replicas = replicas
        self._channel = channel
        self._metadata = metadata
        self._timeout = timeout
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)
        self._channels.clear()

    async def mark(self, stream: str, producer_key: str) -> int | None:
        """The highest seq the cluster holds of the producer on `stream`; None if nobody knows it."""
        found = await asyncio.to_thread(self._replicas.marks, stream, [producer_key])
        peers = self._cluster.peers
        answers = await asyncio.gather(*(self._ask(n.target, stream, producer_key) for n in peers))
        answered = {self._cluster.node_id}
        silent = []
        for node, answer in zip(peers, answers, strict=True):
            if isinstance(answer, str):
                silent.append(f"node {node.id} ({answer})")
                continue
            answered.add(node.id)
            if producer_key in answer:
                found[producer_key] = max(found.get(producer_key, 0), answer[producer_key])
        if self._cluster.replication > 1:
            for node in peers:
                holders = self._cluster.holders(node.id)
                if node.id not in answered and not any(h.id in answered for h in holders):
                    raise ClusterUnavailable(
                        f"cannot tell how far this producer got on stream {stream!r}: node {node.id} and "
                        f"every node holding its copies do not answer ({'; '.join(silent)}); retry"
                    )
        if silent:
            log.debug("producer marks on %r without %s", stream, ", ".join(silent))
        return found.get(producer_key)

    async def _ask(self, target: str, stream: str, key: str) -> dict[str, int] | str:
        channel = self._channels.get(target)
        if channel is None:
            channel = self._channels[target] = self._channel(target)
        try:
            response = await pb_grpc.ReplicationStub(channel).ProducerMarks(
                pb.ProducerMarksRequest(stream=stream, producers=[key]),
                timeout=self._timeout,
                metadata=self._metadata,
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return dict(response.marks)
