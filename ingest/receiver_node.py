"""The wiring of a cluster's receiver node (`sluice serve --role receiver`).

A receiver node is the single-node server (ingest.server.SluiceServer) plus: replication of its blocks
to its followers before acking them (receivers.replication), copies of the blocks of the nodes it
follows (receivers.replica_store, the Replication service), the Blocks service through which Spark's
executors read both, and producer marks asked of its peers when a producer fails over to it
(receivers.producer_marks). Peers are called with this node's TLS certificate (mutual TLS) and, when
given, a peer token.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Mapping
from pathlib import Path

import grpc

from ingest.config import ServeConfig
from receivers.auth import Authenticator
from receivers.block_store import BlockStore
from receivers.blocks_service import BlocksService
from receivers.cluster import Cluster
from receivers.parsed_service import add_parsed_servicer
from receivers.producer_marks import PeerMarks
from receivers.receiver import Receiver
from receivers.replica_store import ReplicaStore
from receivers.replication import Metadata, ReplicatedBlockStore, Replicator, truncate_uncommitted
from receivers.replication_service import ReplicationService
from receivers.wal import WalBlockStore
from sluice_client.credentials import Credentials
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.settings_file import read_settings_file

log = logging.getLogger(__name__)

REPLICAS_DIR = "replicas"
COMMITTED_FILE = "committed.json"
"""In the data dir: each stream's committed seq (receivers.replication), with replication > 1."""
DRAIN_WAIT = 2.0
"""At stop, wait this long at most for followers to ack what was written, so it is acked too."""
PEER_ASK_TIMEOUT = 3.0
"""Seconds a starting node waits for one answer of a peer on where its copies end (continue_logs)."""
LOST_LOG_WAIT = 30.0
"""Seconds a node whose log is behind a copy of it waits for every follower to say where its copy ends
before it stops its start (ReceiverNode.continue_logs)."""


class ReceiverNode:
    """Replication, copies and block reads for one node; SluiceServer drives it."""

    def __init__(self, config: ServeConfig, cluster: Cluster, local: WalBlockStore) -> None:
        self.cluster = cluster
        self.local = local
        self.metadata: Metadata = _peer_metadata(config.peer_token_file)
        self._config = config
        self.replicas = ReplicaStore(
            config.data_dir / REPLICAS_DIR, fsync=config.fsync, segment_bytes=config.wal_segment_bytes
        )
        committed_file = None
        if cluster.followers(cluster.me.id):
            # before the receivers recover: what a crash left past the committed seqs goes
            committed_file = config.data_dir / COMMITTED_FILE
            truncate_uncommitted(local, config.streams, committed_file)
        self.replicator = Replicator(
            cluster,
            local,
            config.streams,
            channel=self.channel,
            metadata=self.metadata,
            committed_file=committed_file,
        )
        self.store: BlockStore = ReplicatedBlockStore(local, self.replicator)
        """What this node's receivers write to: acked (durable_seq) once on enough copies."""
        self.peer_marks = PeerMarks(cluster, self.replicas, self.channel, metadata=self.metadata)
        self._receivers: Mapping[str, Receiver] = {}
        self._replication: ReplicationService | None = None

    def channel(self, target: str) -> grpc.aio.Channel:
        """A channel to a peer, with this node's certificate when it serves TLS."""
        tls = self._config.security.tls
        if tls is None:
            return grpc.aio.insecure_channel(target)
        # read again for each connection (a SIGHUP may have replaced them), bounded and never blocking
        roots = read_settings_file(tls.client_ca_file) if tls.client_ca_file is not None else None
        credentials = grpc.ssl_channel_credentials(
            root_certificates=roots,
            private_key=read_settings_file(tls.key_file),
            certificate_chain=read_settings_file(tls.cert_file),
        )
        return grpc.aio.secure_channel(target, credentials)

    def add_services(
        self, server: grpc.aio.Server, receivers: Mapping[str, Receiver], auth: Authenticator
    ) -> None:
        self._receivers = receivers
        me = self.cluster.me.id
        blocks = BlocksService(me, receivers, self.store, self.local, self.replicas)
        add_parsed_servicer(server, blocks, "Blocks", authenticator=auth)
        sync_each = self._config.fsync.mode == "interval"
        replication = ReplicationService(self.cluster, self.replicas, receivers, auth, sync_each=sync_each)
        add_parsed_servicer(server, replication, "Replication", authenticator=auth)
        self._replication = replication
        self.replicator.on_change(self._replication_changed)

    def _replication_changed(self) -> None:
        paused = not self.replicator.can_ack
        status = self.replicator.status()
        for receiver in self._receivers.values():
            receiver.ack_durable()
            receiver.set_replication_paused(paused, status)

    async def start(self) -> None:
        await self.replicator.start()

    async def continue_logs(self, receivers: Mapping[str, Receiver]) -> None:
        """Where a follower's copy of this node's partition of a stream ends past this node's own log,
        go on past the furthest copy. The log was lost or replaced (a data dir started afresh, another
        disk): numbered from its own end, new records took offsets the cluster had already used, which
        the driver took for processed and released unread. Once one copy shows the log is behind, every
        follower must answer (the furthest copy is past every acked record, which was on all in-sync
        followers): the start waits up to LOST_LOG_WAIT for them, then stops, saying which did not.
        What it skips is not counted as read: only what the copies released (Spark read it) is, so a
        query without a checkpoint starts no later than there and reads the rest from the copies,
        rather than past acked records only a copy holds (WalBlockStore.skip_to)."""
        me = self.cluster.me.id
        followers = {node.id: node.target for node in self.cluster.followers(me)}
        answers: dict[int, list[pb.PartitionInfo]] = {}
        deadline = time.monotonic() + LOST_LOG_WAIT
        while True:
            asked = [n for n in followers if n not in answers]
            found = await asyncio.gather(*(self._copies_on(followers[n]) for n in asked))
            answers.update({n: copies for n, copies in zip(asked, found, strict=True) if copies is not None})
            behind = self._behind(receivers, [p for copies in answers.values() for p in copies])
            if not behind or len(answers) == len(followers):
                break
            if time.monotonic() >= deadline:
                missing = ", ".join(f"node {n} ({followers[n]})" for n in followers if n not in answers)
                raise ValueError(
                    f"this node's log of {', '.join(sorted(behind))} is behind a copy of it on another "
                    f"node (its data dir was lost or replaced), and {missing} did not say where its copy "
                    "ends: starting now could give records offsets the cluster already used; start it "
                    "again once every follower runs"
                )
            await asyncio.sleep(1.0)
        copies = [p for held in answers.values() for p in held]
        for stream, (seq, offset) in behind.items():  # every follower answered, or none is behind
            before = receivers[stream].log_end
            # what Spark read is released on the copies; the rest of what is skipped stays unread here
            read_to = max(
                (p.released_offset for p in copies if p.stream == stream and p.HasField("released_offset")),
                default=0,
            )
            log.warning(
                "stream %r: this node's log ends at block %d (offset %d), a copy of it on another node at "
                "block %d (offset %d): the log was lost or replaced; it goes on from there (what the "
                "copies hold is read from them)",
                stream,
                before[0],
                before[1],
                seq,
                offset,
            )
            await asyncio.to_thread(
                functools.partial(self.local.skip_to, stream, seq, offset, read_to=read_to)
            )
            receivers[stream].continue_at(seq, offset)

    async def _copies_on(self, target: str) -> list[pb.PartitionInfo] | None:
        """The copies of this node's partitions a peer holds; None when it does not answer."""
        me = self.cluster.me.id
        channel = self.channel(target)
        try:
            answer = await pb_grpc.BlocksStub(channel).ListPartitions(
                pb.ListPartitionsRequest(), metadata=self.metadata, timeout=PEER_ASK_TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            log.debug("node at %s did not say where its copies end: %s", target, exc.code().name)
            return None
        finally:
            await channel.close(None)
        return [p for p in answer.partitions if p.owner == me and not p.leader]

    @staticmethod
    def _behind(
        receivers: Mapping[str, Receiver], copies: list[pb.PartitionInfo]
    ) -> dict[str, tuple[int, int]]:
        """Stream -> (seq, offset) of the furthest copy, for the streams whose own log ends before it."""
        ahead: dict[str, tuple[int, int]] = {}
        for copy in copies:
            if copy.stream not in receivers:
                continue
            end = (copy.next_seq, copy.next_offset)
            if end[0] > receivers[copy.stream].log_end[0] and end > ahead.get(copy.stream, (-1, -1)):
                ahead[copy.stream] = end
        return ahead

    async def drain(self) -> None:
        """Give followers a moment to ack what is written, so that it is acked to its producers."""
        deadline = time.monotonic() + DRAIN_WAIT
        while time.monotonic() < deadline and self.replicator.can_ack:
            if all(self.store.durable_seq(s) >= self.local.durable_seq(s) for s in self._receivers):
                return
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        if self._replication is not None:  # the owners' streams end before their copies are closed
            await self._replication.stop()
        await self.replicator.stop()
        await self.peer_marks.close()
        self.replicas.close()


def _peer_metadata(token_file: Path | None) -> Metadata:
    """The bearer token of --peer-token-file as call metadata; CredentialsError (a ValueError) naming the
    file when it cannot be read or holds no token (ingest.preflight.check_security checks it first)."""
    if token_file is None:
        return ()
    return Credentials.from_files(token_file=token_file).metadata
