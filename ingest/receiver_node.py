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
from receivers.cluster import Cluster, ConfigMismatches
from receivers.node_identity import last_replication, record_replication
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
"""In the data dir: each stream's committed seq (receivers.replication), with replication > 1; none
with replication 1 (its whole log is acked: see truncate_uncommitted)."""
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
        replicated = bool(cluster.followers(cluster.me.id))
        committed_file = config.data_dir / COMMITTED_FILE
        # before the receivers recover: what a run with more copies left past its committed seqs goes
        # (with replication 1 too), and with replication 1 the file, which would fall behind the acks
        # a replication 1 start cuts only after a replicated run of this version (which keeps the file
        # in step with its acks); after an older version's replication 1 run the file fell behind them
        last = last_replication(config.data_dir)
        cut = replicated or (last is not None and last > 1)
        truncate_uncommitted(local, config.streams, committed_file, replicated=replicated, cut=cut)
        record_replication(config.data_dir, cluster.replication)
        self.mismatches = ConfigMismatches(cluster)
        """Peers configured otherwise (another node list or replication), as Replicate hellos showed."""
        self.replicator = Replicator(
            cluster,
            local,
            config.streams,
            channel=self.channel,
            metadata=self.metadata,
            committed_file=committed_file if replicated else None,
            mismatches=self.mismatches,
        )
        self.store: BlockStore = ReplicatedBlockStore(local, self.replicator)
        """What this node's receivers write to: acked (durable_seq) once on enough copies."""
        self.peer_marks = PeerMarks(cluster, self.replicas, self.channel, metadata=self.metadata)
        self._receivers: Mapping[str, Receiver] = {}
        self._replication: ReplicationService | None = None

    def channel(self, target: str) -> grpc.aio.Channel:
        """A channel to a peer, with this node's certificate when it serves TLS, and keepalive: a peer
        gone without a FIN (its host down, the network cut) ends the calls to it within
        Cluster.keepalive + keepalive_timeout (a Replicate stream waited on it for ever)."""
        tls = self._config.security.tls
        options = self.cluster.channel_options()
        if tls is None:
            return grpc.aio.insecure_channel(target, options=options)
        # read again for each connection (a SIGHUP may have replaced them), bounded and never blocking
        roots = read_settings_file(tls.client_ca_file) if tls.client_ca_file is not None else None
        credentials = grpc.ssl_channel_credentials(
            root_certificates=roots,
            private_key=read_settings_file(tls.key_file),
            certificate_chain=read_settings_file(tls.cert_file),
        )
        return grpc.aio.secure_channel(target, credentials, options=options)

    def add_services(
        self, server: grpc.aio.Server, receivers: Mapping[str, Receiver], auth: Authenticator
    ) -> None:
        self._receivers = receivers
        me = self.cluster.me.id
        ids = [n.id for n in self.cluster.nodes]
        blocks = BlocksService(me, receivers, self.store, self.local, self.replicas, nodes=ids)
        add_parsed_servicer(server, blocks, "Blocks", authenticator=auth)
        sync_each = self._config.fsync.mode == "interval"
        replication = ReplicationService(
            self.cluster,
            self.replicas,
            receivers,
            auth,
            sync_each=sync_each,
            mismatches=self.mismatches,
            max_message_bytes=self._config.max_message_bytes,
        )
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
        rather than past acked records only a copy holds (WalBlockStore.skip_to).

        Each log has an identity, its incarnation (WalBlockStore.ensure_incarnation), made here when the
        log is new. A node that goes on from a copy takes the copy's (its offsets go on). A copy of
        another incarnation than this log's is not this log's past (this log was lost before, and went
        on from 0 with no follower to say where its copy ended): it does not move this log, and its
        holder sets it aside when this node connects (ReplicaStore.meet_incarnation). Whether a log
        that is new here was lost with every follower down cannot be told here; the driver tells, from
        the incarnation its checkpoint names (the cluster source's DataLossError)."""
        me = self.cluster.me.id
        followers = {node.id: node.target for node in self.cluster.followers(me)}
        # new: no incarnation and nothing in it (a log from before incarnations gets one, but is not new)
        new = {
            s
            for s in receivers
            if receivers[s].log_end == (0, 0) and not await asyncio.to_thread(self.local.incarnation, s)
        }
        own = {s: await asyncio.to_thread(self.local.ensure_incarnation, s) for s in receivers}
        answers: dict[int, list[pb.PartitionInfo]] = {}
        deadline = time.monotonic() + LOST_LOG_WAIT
        while True:
            asked = [n for n in followers if n not in answers]
            found = await asyncio.gather(*(self._copies_on(n, followers[n]) for n in asked))
            refusals = [answer for answer in found if isinstance(answer, str)]
            if refusals:
                raise ValueError("; ".join(refusals))
            answers.update(
                {n: copies for n, copies in zip(asked, found, strict=True) if isinstance(copies, list)}
            )
            behind = self._behind(receivers, [p for copies in answers.values() for p in copies], own)
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
        self._say_what_is_unknown(receivers, answers, followers, new, own)
        for stream, (seq, offset, incarnation) in behind.items():  # all followers answered, or none is behind
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
            if incarnation and incarnation != own[stream]:
                # first: offsets go on from the copy's, so the log is the copy's incarnation (a crash
                # before the skip finds an empty log again, and takes it again)
                await asyncio.to_thread(self.local.set_incarnation, stream, incarnation)
            await asyncio.to_thread(
                functools.partial(self.local.skip_to, stream, seq, offset, read_to=read_to)
            )
            receivers[stream].continue_at(seq, offset)

    @staticmethod
    def _say_what_is_unknown(
        receivers: Mapping[str, Receiver],
        answers: Mapping[int, list[pb.PartitionInfo]],
        followers: Mapping[int, str],
        new: set[str],
        own: Mapping[str, str],
    ) -> None:
        """Warn of the starts where this node cannot tell whether its log was lost: a log made now
        while followers did not answer, and copies of another incarnation than this log's."""
        for node_id, held in answers.items():
            for p in held:
                if p.stream in own and p.incarnation and p.incarnation != own[p.stream]:
                    if receivers[p.stream].log_end[0] == 0:
                        continue  # an empty log takes the copy's incarnation
                    log.warning(
                        "stream %r: node %d holds a copy of another incarnation (%s) of this node's log "
                        "(%s): this log was lost and started afresh before; node %d sets that copy "
                        "aside when this node connects",
                        p.stream,
                        node_id,
                        p.incarnation,
                        own[p.stream],
                        node_id,
                    )
        silent = [f"node {n} ({t})" for n, t in followers.items() if n not in answers]
        if not silent or not new:
            return
        log.warning(
            "the log of stream(s) %s is new on this node (incarnation %s) and %s did not answer: if this "
            "node's data dir was lost or replaced, its offsets start again at 0, and a driver that read "
            "its old log stops with a DataLossError (its checkpoint names the old incarnation); the "
            "followers set their copies of the old log aside when they are back (docs/cluster.md)",
            ", ".join(sorted(new)),
            ", ".join(own[s] for s in sorted(new)),
            ", ".join(silent),
        )

    async def _copies_on(self, node_id: int, target: str) -> list[pb.PartitionInfo] | str | None:
        """The copies of this node's partitions follower `node_id` holds; None when it does not answer
        (down, or not up yet: a cluster's first start). What it answers that no start can go past is
        the words of the refusal: it refuses this node's credentials (its auth file does not grant
        them the peer role), or it is another node than the list says. Taken for a follower down, each
        went by as "did not answer": replication to it then failed at every try, and a node whose data
        dir was lost started its partitions at offset 0 again although that follower held where they
        ended."""
        me = self.cluster.me.id
        channel = self.channel(target)
        try:
            answer = await pb_grpc.BlocksStub(channel).ListPartitions(
                pb.ListPartitionsRequest(), metadata=self.metadata, timeout=PEER_ASK_TIMEOUT
            )
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            said = f"{code.name}: {exc.details()}"
            if code in {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}:
                return (
                    f"node {node_id} ({target}) refuses this node's credentials ({said}): give each node "
                    "a --peer-token-file holding a token that every node's --auth-file grants the peer "
                    "role (or, under mutual TLS without a token, a certificate whose name is such a "
                    "principal)"
                )
            log.debug("node at %s did not say where its copies end: %s", target, code.name)
            return None
        finally:
            await channel.close(None)
        if answer.node_id != node_id:
            itself = " (this node)" if answer.node_id == me else ""
            return (
                f"node {node_id} is listed at {target} (--nodes), but the node there answers as node "
                f"{answer.node_id}{itself}: the node list names that address under two ids, or two "
                "nodes' addresses are swapped; give every node the same, right node list"
            )
        return [p for p in answer.partitions if p.owner == me and not p.leader]

    @staticmethod
    def _behind(
        receivers: Mapping[str, Receiver], copies: list[pb.PartitionInfo], own: Mapping[str, str]
    ) -> dict[str, tuple[int, int, str]]:
        """Stream -> (seq, offset, incarnation) of the furthest copy, for the streams whose own log ends
        before it. Only copies of this log count: of its incarnation, or of an unknown one (a follower
        that predates incarnations), or any when this log is empty (new: it takes the copy's). A copy
        of another incarnation is of a log this one replaced: its holder sets it aside."""
        ahead: dict[str, tuple[int, int, str]] = {}
        for copy in copies:
            if copy.stream not in receivers:
                continue
            log_end = receivers[copy.stream].log_end
            if copy.incarnation and copy.incarnation != own.get(copy.stream) and log_end[0] > 0:
                continue
            end = (copy.next_seq, copy.next_offset)
            if end[0] > log_end[0] and end > ahead.get(copy.stream, (-1, -1, ""))[:2]:
                ahead[copy.stream] = (*end, copy.incarnation)
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
