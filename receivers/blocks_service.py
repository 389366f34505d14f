"""The Blocks service: Spark's executors read a node's partitions over gRPC, never its disk.

ListPartitions says which partitions (stream, owner) this node holds and their readable range: its own
(blocks durable on enough copies: receivers.replication) and its copies of other nodes'. ReadBlocks
streams records [from, to) of one of them as Arrow IPC, a chunk per block; a range this node does not
hold whole is FAILED_PRECONDITION, so the reader asks another holder. Records gone from the middle of
this node's log (blocks a start under --fsync off went on without, above its released mark), or from
its own log's start (between that mark and its oldest block), are said in-band instead, when the
reader asks so (report_gone): a chunk marked gone, then the records after them, so that the reader can
tell records no holder has from an outage (its failOnDataLoss).
ReleaseBlocks drops what Spark committed (idempotent, as the single-node release).

One driver consumes a cluster. A driver names itself on its ListPartitions and ReleaseBlocks calls
(DRIVER_HEADER, an id kept in its data dir); the first to call holds the node until DRIVER_LEASE seconds
pass without a call of its, and another driver is refused FAILED_PRECONDITION meanwhile. Two drivers
would each release what the other had not read yet, so each sink would miss records. Calls that name
no driver (`sluice status`, peers, executors' reads) are not held to it.

Each partition's log has an incarnation (receivers.wal.WalBlockStore.ensure_incarnation), which
ListPartitions reports. ReadBlocks and ReleaseBlocks may name one: a holder whose log of the partition
is another (the owner's log was lost and started afresh; a copy of the old one not set aside yet)
refuses the read and releases nothing, so that offsets of one log are never read or released in
another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pyarrow as pa

from receivers.block import BLOCK_SCHEMA, BlockInfo, gaps
from receivers.block_store import BlockStore, release_below
from receivers.cluster import DRIVER_HEADER, DRIVER_LEASE_HELD, DRIVER_LEAVING_HEADER, REFUSAL_HEADER
from receivers.errors import shown
from receivers.receiver import Receiver
from receivers.replica_store import ReplicaStore
from receivers.wal import BlockNotFoundError, WalBlockStore, WalError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")

CHUNK_BYTES = 4 * 1024 * 1024
"""About this many bytes of records per BlockChunk (more when one record is larger)."""
SEAL_WAIT = 1.0
"""At most this long for a seal asked by ListPartitions, and then as long for its copies."""
DRIVER_LEASE = 30.0
"""Seconds a driver holds a node after its last call. A running driver looks at every node each second
(its backlog), so it renews well within; a driver that stopped lets another take over this long after."""
MAX_DRIVER_ID = 64


@dataclass
class _Lease:
    driver: str
    peer: str
    seen: float


class BlocksService:
    """Serves Blocks for this node (register with add_parsed_servicer)."""

    def __init__(
        self,
        node_id: int,
        receivers: Mapping[str, Receiver],
        store: BlockStore,
        local: WalBlockStore,
        replicas: ReplicaStore | None = None,
        *,
        nodes: Sequence[int] = (),
    ) -> None:
        self._node_id = node_id
        self._nodes = list(nodes)  # the ids of this node's node list, told to readers
        self._receivers = receivers
        self._store = store  # this node's partitions, as readable (committed) blocks
        self._local = local
        self._replicas = replicas
        self._lease: _Lease | None = None
        self.lease_seconds = DRIVER_LEASE
        self._damage_said: set[str] = set()

    async def _read(
        self, context: grpc.aio.ServicerContext[Any, Any], work: Callable[..., T], *args: Any
    ) -> T:
        """`work(*args)` in a thread. A log found damaged (a block that fails its checksum, an
        incarnation file that holds no incarnation) ends the call INTERNAL with its words, said once in
        an ERROR line: it escaped as UNKNOWN, with a traceback in the log at every call (the driver's,
        each second). BlockNotFoundError (released meanwhile) is the caller's."""
        try:
            return await asyncio.to_thread(work, *args)
        except BlockNotFoundError:
            raise
        except WalError as exc:
            if str(exc) not in self._damage_said:
                self._damage_said.add(str(exc))
                log.error("cannot serve Blocks: %s", exc)  # noqa: TRY400 - its words say it all
            await context.abort(grpc.StatusCode.INTERNAL, f"node {self._node_id}: {exc}")
            raise  # abort raised

    async def _hold(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """Take or renew the calling driver's lease (a call naming no driver: nothing to do); abort the
        call FAILED_PRECONDITION if another driver holds this node."""
        metadata = dict(context.invocation_metadata() or ())
        driver = str(metadata.get(DRIVER_HEADER, ""))
        if not driver:
            return
        if metadata.get(DRIVER_LEAVING_HEADER) == "1":  # given back (only by its holder)
            if self._lease is not None and self._lease.driver == driver:
                self._lease = None
            return
        if len(driver) > MAX_DRIVER_ID:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{DRIVER_HEADER} over {MAX_DRIVER_ID} chars"
            )
        now = time.monotonic()
        lease = self._lease
        if lease is not None and lease.driver != driver and now - lease.seen < self.lease_seconds:
            age = now - lease.seen
            context.set_trailing_metadata(((REFUSAL_HEADER, DRIVER_LEASE_HELD),))
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {self._node_id} is consumed by another driver (id {shown(lease.driver[:12])}, at "
                f"{lease.peer}), whose last call came {age:.1f} s ago: one driver per cluster. Stop this "
                f"one; or, if that driver is gone for good, start this one again {self.lease_seconds:g} s "
                "after its last call",
            )
        if lease is None or lease.driver != driver:
            lease = self._lease = _Lease(driver, context.peer() or "", now)
        lease.seen = now

    async def ListPartitions(
        self, request: pb.ListPartitionsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListPartitionsResponse:
        await self._hold(context)
        streams = list(dict.fromkeys(request.streams)) or list(self._receivers)
        unknown = [s for s in streams if s not in self._receivers]
        if unknown:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no stream named {shown(unknown[0])} on this node (streams: {', '.join(self._receivers)})",
            )
        if request.seal_blocks:
            await self._seal(streams)
        partitions = await self._read(context, self._partitions, streams)
        return pb.ListPartitionsResponse(node_id=self._node_id, partitions=partitions, nodes=self._nodes)

    async def _seal(self, streams: list[str]) -> None:
        seals = [self._receivers[s].seal_now() for s in streams]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*seals), SEAL_WAIT)
        deadline = time.monotonic() + SEAL_WAIT  # sealed blocks are readable once copied
        while time.monotonic() < deadline and any(  # noqa: ASYNC110 - polls the followers' acks
            self._store.durable_seq(s) < self._local.durable_seq(s) for s in streams
        ):
            await asyncio.sleep(0.01)

    def _partitions(self, streams: list[str]) -> list[pb.PartitionInfo]:
        found = []
        for stream in streams:
            blocks = self._store.blocks(stream)
            released = self._local.released_offset(stream)
            start, end = _extent(blocks, released)
            found.append(
                pb.PartitionInfo(
                    stream=stream,
                    owner=self._node_id,
                    start_offset=start,
                    end_offset=end,
                    leader=True,
                    next_seq=_log_end(self._local, stream)[0],
                    next_offset=_log_end(self._local, stream)[1],
                    released_offset=self._local.known_released_offset(stream),
                    incarnation=self._local.incarnation(stream),
                    gone=_gone(blocks, released),
                )
            )
        if self._replicas is not None:
            for owner in self._replicas.owners():
                copy = self._replicas.store(owner)
                for stream in streams:
                    readable = self._readable(owner, stream)
                    released = copy.released_offset(stream)
                    start, end = _extent(readable, released)
                    next_seq, next_offset = _log_end(copy, stream)  # committed or not
                    found.append(
                        pb.PartitionInfo(
                            stream=stream,
                            owner=owner,
                            start_offset=start,
                            end_offset=end,
                            next_seq=next_seq,
                            next_offset=next_offset,
                            released_offset=copy.known_released_offset(stream),
                            incarnation=copy.incarnation(stream),
                            gone=_gone(readable, released),
                        )
                    )
        return found

    async def ReadBlocks(
        self, request: pb.ReadBlocksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.BlockChunk]:
        stream, owner, lo, hi = request.stream, request.owner, request.from_offset, request.to_offset
        if stream not in self._receivers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stream named {shown(stream)} on this node")
        if not 0 <= lo < hi:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"need 0 <= from_offset < to_offset, got {lo}, {hi}"
            )
        store = self._holding(owner)
        if store is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {self._node_id} holds no copy of node {owner}'s blocks",
            )
            return
        held = await self._read(context, self._incarnation, owner, stream)
        if request.incarnation and held and held != request.incarnation:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {self._node_id} holds incarnation {held} of node {owner}'s log of stream "
                f"{stream!r}, not {shown(request.incarnation)}: that log was lost and started afresh",
            )
        readable = await self._read(context, self._readable, owner, stream)
        blocks = [b for b in readable if b.end_offset > lo and b.first_offset < hi]
        released = await self._read(context, self._released, owner, stream)
        # where the log's records start as far as it knows: its oldest block; for this node's own log,
        # its released mark, below that block when the oldest blocks not released were lost (the log
        # starts damaged: receivers.wal logs it). Read from the mark, such a range was "not held" on
        # every holder, and the query stopped there for good whatever failOnDataLoss said.
        start = readable[0].first_offset if readable else 0
        if owner == self._node_id:
            start = min(start, released)
        # held from before `lo` to past `hi`: records missing in between are a gap in the log
        spans = bool(readable) and start <= lo and readable[-1].end_offset >= hi
        missing = gaps(blocks, lo, hi)
        # a gap above the released mark is records gone from this log (blocks a start under --fsync
        # off went on without); one below it, records released (a copy that missed releases)
        gone = spans and all(b > released for _, b in missing)
        if not spans or (missing and not (gone and request.report_gone)):
            have = [(b.first_offset, b.end_offset) for b in blocks]
            why = (
                f"records {_ranges(missing)} are gone from its log"
                if gone
                else "released, or not copied here yet"
            )
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {self._node_id} does not hold records {lo}..{hi - 1} of node {owner}'s stream "
                f"{stream!r} (it holds {have or 'none of them'}): {why}",
            )
        at = lo
        for block in blocks:
            if block.first_offset > at:  # a gap (report_gone): said in-band, the records after it follow
                yield pb.BlockChunk(first_offset=at, count=block.first_offset - at, gone=True)
            try:
                chunks = await self._read(context, _chunks, store, block, lo, hi)
            except BlockNotFoundError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                return
            for chunk in chunks:
                yield chunk
            at = block.end_offset
        if at < hi:
            yield pb.BlockChunk(first_offset=at, count=hi - at, gone=True)

    async def ReleaseBlocks(
        self, request: pb.ReleaseBlocksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ReleaseBlocksResponse:
        await self._hold(context)
        if request.stream not in self._receivers:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no stream named {shown(request.stream)} on this node"
            )
        if request.before_offset < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "before_offset must be >= 0")
        store = self._holding(request.owner)
        if store is None:
            return pb.ReleaseBlocksResponse()
        held = await self._read(context, self._incarnation, request.owner, request.stream)
        if request.incarnation and held and held != request.incarnation:
            # offsets of another log: its records below them were never read
            return pb.ReleaseBlocksResponse()
        end = {request.stream: request.before_offset}
        released = await asyncio.to_thread(release_below, store, [request.stream], end)
        if request.owner == self._node_id:  # what a lost log skipped is read up to there too
            await asyncio.to_thread(self._local.release_lost, request.stream, request.before_offset)
        return pb.ReleaseBlocksResponse(blocks_released=released)

    def _readable(self, owner: int, stream: str) -> list[BlockInfo]:
        """The blocks of `owner`'s partition this node serves: its own committed ones, or those of its
        copy below what the owner last said was committed (others may be dropped: never acked).
        Blocking."""
        if owner == self._node_id:
            return self._store.blocks(stream)
        assert self._replicas is not None
        limit = self._replicas.committed(owner, stream)
        return [b for b in self._replicas.store(owner).blocks(stream) if b.seq < limit]

    def _released(self, owner: int, stream: str) -> int:
        """The offset below which this node released `owner`'s partition of `stream`. Blocking."""
        if owner == self._node_id:
            return self._local.released_offset(stream)
        assert self._replicas is not None
        return self._replicas.store(owner).released_offset(stream)

    def _incarnation(self, owner: int, stream: str) -> str:
        """The incarnation of the log of `owner`'s partition of `stream` held here ("": unknown)."""
        if owner == self._node_id:
            return self._local.incarnation(stream)
        assert self._replicas is not None
        return self._replicas.incarnation(owner, stream)

    def _holding(self, owner: int) -> BlockStore | None:
        if owner == self._node_id:
            return self._store
        if self._replicas is not None and owner in self._replicas.owners():
            return self._replicas.store(owner)
        return None


def _log_end(log: WalBlockStore, stream: str) -> tuple[int, int]:
    """(seq, record offset) after the last block `log` holds of `stream`, or after the last released."""
    held = log.blocks(stream)
    if held:
        return held[-1].seq + 1, held[-1].end_offset
    return log.released_seq(stream), log.released_offset(stream)


def _extent(blocks: list[BlockInfo], released: int) -> tuple[int, int]:
    if not blocks:
        return released, released
    return blocks[0].first_offset, blocks[-1].end_offset


def _gone(blocks: list[BlockInfo], released: int) -> list[pb.OffsetRange]:
    """The records between the first and the last of `blocks` that none of them holds, above the
    released mark: gone from the log (PartitionInfo.gone), as ReadBlocks says them (a lost.json's
    records, a gap --fsync off left); below the mark they were released."""
    if not blocks:
        return []
    holes = gaps(blocks, blocks[0].first_offset, blocks[-1].end_offset)
    return [pb.OffsetRange(first_offset=max(a, released), end_offset=b) for a, b in holes if b > released]


def _ranges(ranges: list[tuple[int, int]]) -> str:
    return ", ".join(f"{a}..{b - 1}" for a, b in ranges)


def _chunks(store: BlockStore, block: BlockInfo, lo: int, hi: int) -> list[pb.BlockChunk]:
    """Rows of `block` within offsets [lo, hi) as Arrow IPC streams of about CHUNK_BYTES each: a block
    can be far larger than a gRPC message may be (a quarter of the buffer's records, or one huge batch)."""
    first = max(lo, block.first_offset)
    last = min(hi, block.end_offset)
    chunks: list[pb.BlockChunk] = []
    pending: list[pa.RecordBatch] = []
    pending_bytes = 0
    at = first  # offset of the first row in `pending`

    def cut() -> None:
        nonlocal pending, pending_bytes, at
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, BLOCK_SCHEMA) as ipc:
            for piece in pending:
                ipc.write_batch(piece)
        count = sum(piece.num_rows for piece in pending)
        chunks.append(pb.BlockChunk(first_offset=at, count=count, arrow_ipc=sink.getvalue().to_pybytes()))
        at += count
        pending, pending_bytes = [], 0

    row = block.first_offset  # offset of the current batch's first row
    for batch in store.read(block):
        a, b = max(first, row), min(last, row + batch.num_rows)
        if a < b:
            part = batch.slice(a - row, b - a)
            # rows per piece so that a piece is about CHUNK_BYTES at this batch's mean row size
            step = max(1, CHUNK_BYTES * part.num_rows // max(1, part.nbytes))
            for start in range(0, part.num_rows, step):
                piece = part.slice(start, step)
                if pending and pending_bytes + piece.nbytes > CHUNK_BYTES:
                    cut()
                pending.append(piece)
                pending_bytes += piece.nbytes
        row += batch.num_rows
        if row >= last:
            break
    if pending:
        cut()
    return chunks
