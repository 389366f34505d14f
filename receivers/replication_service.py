"""The follower's side of replication (Replication.Replicate), and producer marks (ProducerMarks).

Replicate: the owner says hello (its id and its view of the cluster), the follower answers with the next
block seq it needs per stream, then stores each block durably and acks it (receivers.replica_store).

ProducerMarks: how far this node knows a producer got on a stream, over the partitions it holds: its
copies of other nodes' blocks, and its own receiver's table, where records the producer has in flight
are first waited for (up to MARK_WAIT) so that a node asking at failover never takes records that are
about to be written here too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Mapping
from typing import Any

import grpc
import pyarrow as pa
from google.protobuf.message import DecodeError

from receivers.auth import Authenticator
from receivers.block import BLOCK_SCHEMA, PLAIN_SCHEMA
from receivers.cluster import CONFIG_HEADER, Cluster, ConfigMismatches, config_mismatch
from receivers.errors import ReceiverError
from receivers.receiver import Receiver
from receivers.replica_store import (
    OwnerLogLostError,
    ReplicaGapError,
    ReplicaIncarnationError,
    ReplicaStore,
    SetAside,
    merge_marks,
)
from receivers.wal import RawBlock, WalError, valid_incarnation
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

log = logging.getLogger(__name__)

REFUSED_SAY_SECONDS = 60.0
"""A Replicate call refused its credentials is said (WARNING) at most once in this many seconds."""

REPLICATE = "/ingest.v1.Replication/Replicate"
HELLO_TIMEOUT = 10.0
STOP_WAIT = 2.0
"""At most this long, on stop, for the Replicate handlers to end (a copy being stored is finished)."""
MARK_WAIT = 5.0
MAX_MARK_KEYS = 1000
MAX_POSITION = 2**62
"""A copied block's seq and the record offset after it, at most: far past any log's, and what is
computed from them (the seq after it, ListPartitions' offsets) stays within the wire's int64."""
MAX_BLOCK_BYTES = 2**31 - 1
"""A copied block's payload, at most (its offsets are int32; a receiver's memory budget bounds it far
below this: block_limit)."""
DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
"""The server's message size limit when none is given (ServeConfig.max_message_bytes' default)."""


def block_limit(budget_bytes: int, max_message_bytes: int) -> int:
    """The most bytes of a block's payload a follower gathers from its fragments, for a stream whose
    memory budget (ReceiverConfig.budget_bytes: --buffer-bytes, or --memory-budget when smaller) is
    `budget_bytes`: twice the budget (a block holds what a receiver buffered, at most the budget and one
    message per session past it, and its Arrow encoding adds offsets) plus one message, and never past
    MAX_BLOCK_BYTES. An owner configured as this node is never refused; before, a follower gathered up
    to 2 GiB per owner's stream from whatever it was sent."""
    return min(MAX_BLOCK_BYTES, 2 * budget_bytes + max_message_bytes)


class InvalidBlockError(ValueError):
    """A replicated block's payload is not the Arrow IPC stream its header says."""


def _check_payload(block: RawBlock) -> None:
    try:
        table = pa.ipc.open_stream(block.payload).read_all()
    except pa.ArrowException as exc:
        raise InvalidBlockError(f"block {block.seq}: its payload is not an Arrow IPC stream: {exc}") from None
    schema_known = table.schema.equals(BLOCK_SCHEMA) or table.schema.equals(PLAIN_SCHEMA)  # an older owner's
    if not schema_known or table.num_rows != block.count:
        raise InvalidBlockError(
            f"block {block.seq}: its payload holds {table.num_rows} rows of {table.schema}, "
            f"not {block.count} of the block schema"
        )


def _known(values: Mapping[str, int], streams: list[str]) -> dict[str, int]:
    """The entries for streams served here with a sane seq (others are ignored, not stored)."""
    return {s: n for s, n in values.items() if s in streams and 0 <= n < MAX_POSITION}


def _log_set_aside(aside: SetAside) -> None:
    held = aside.end_offset - aside.first_offset
    if held:
        what = (
            f"records {aside.first_offset}..{aside.end_offset - 1} that were not released (not read by "
            f"the driver), of which those below {aside.committed_end} were acked to their producers"
        )
    else:
        what = "no record that was not released"
    log.error(
        "node %d's log of stream %r is now incarnation %s: it was lost (a data dir started afresh) and "
        "this node's copy of it, of incarnation %s, is not its log any more. Node %d's log lost %s; "
        'this copy is kept whole in %s (see docs/cluster.md, "A log lost while its followers were '
        'down"), and a new copy of incarnation %s starts',
        aside.owner,
        aside.stream,
        aside.replaced_by,
        aside.incarnation,
        aside.owner,
        what,
        aside.path,
        aside.replaced_by,
    )


class FragmentError(ValueError):
    """A block's payload fragments came out of order."""


class BlockTooLargeError(FragmentError):
    """A block's payload fragments add up past what the follower gathers of one block (block_limit)."""


class _Assembler:
    """Joins a block sent in fragments (receivers.replication.fragments) back into one message."""

    def __init__(self) -> None:
        self._first: pb.ReplicaBlock | None = None
        self._pieces: list[bytes] = []
        self._size = 0

    @property
    def size(self) -> int:
        """Bytes of the block being joined held now."""
        return self._size

    def take(
        self, block: pb.ReplicaBlock, limit: int = MAX_BLOCK_BYTES, *, elsewhere: int = 0
    ) -> pb.ReplicaBlock | None:
        """The whole block once its last fragment arrived, else None; BlockTooLargeError (nothing kept)
        once its fragments, with `elsewhere` bytes the same owner's other streams hold, add up past
        `limit` bytes."""
        first = self._first
        if first is None:
            if not block.more:
                return block
            self._first, self._pieces, self._size = block, [], 0
            first = block
        elif (block.stream, block.seq) != (first.stream, first.seq):
            raise FragmentError(
                f"block {first.seq} of stream {first.stream!r} was cut off by block {block.seq} of "
                f"{block.stream!r}"
            )
        size = self._size + len(block.arrow_ipc)
        if size + elsewhere > limit:
            self._first, self._pieces, self._size = None, [], 0
            also = f", with {elsewhere:,} of its other Replicate streams" if elsewhere else ""
            raise BlockTooLargeError(
                f"block {first.seq} of stream {first.stream!r}: it is over {limit:,} bytes ({size:,} in the "
                f"fragments taken so far{also})"
            )
        self._pieces.append(block.arrow_ipc)
        self._size = size
        if block.more:
            return None
        whole = pb.ReplicaBlock()
        whole.CopyFrom(first)
        whole.arrow_ipc, whole.more = b"".join(self._pieces), False
        self._first, self._pieces, self._size = None, [], 0
        return whole


async def _finished(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` (a copy's store, in its thread) to its end even when the call is cancelled meanwhile
    (a revoked token: Authenticator.revocable; the owner gone; the server's stop): a thread cannot be
    stopped, so the cancellation takes effect once the copy is written whole, or refused. Otherwise the
    call ended, and the service counted no stream (so a stop could close the copies), while the thread
    still wrote a block the owner was never told of."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        while not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait((task,))
        if not task.cancelled():
            task.exception()  # retrieved: the stream ends as it was asked to, whatever the store said
        raise


def _retrieve(task: asyncio.Future[Any]) -> None:
    """A done callback: what `task` ended with is taken (its caller may have gone, cancelled)."""
    if not task.cancelled():
        task.exception()


class ReplicationService:
    """Serves Replication for this node's copies (register with add_parsed_servicer)."""

    def __init__(
        self,
        cluster: Cluster,
        replicas: ReplicaStore,
        receivers: Mapping[str, Receiver],
        authenticator: Authenticator,
        *,
        sync_each: bool = False,
        mismatches: ConfigMismatches | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self._cluster = cluster
        self._max_message_bytes = max_message_bytes
        self.mismatches = mismatches if mismatches is not None else ConfigMismatches(cluster)
        """Owners whose hello this node refused for another configuration (shared with the Replicator)."""
        self._replicas = replicas
        self._receivers = receivers
        self._authenticator = authenticator
        self._sync_each = sync_each  # the fsync policy is group commit: sync each copy before its ack
        self._stopping = asyncio.Event()
        self._handlers = 0  # Replicate calls in progress
        self._idle = asyncio.Event()
        self._idle.set()
        self._damage_said: set[str] = set()
        self._refused_said_at: float | None = None  # when a refused peer was last said (WARNING)
        self._gathering: dict[int, list[_Assembler]] = {}
        """Owner -> the blocks being joined on its Replicate streams (two processes run as one node, a
        stale stream beside a new one): what an owner's streams hold together is bounded (block_limit)."""

    async def stop(self) -> None:
        """End every Replicate stream UNAVAILABLE ("stopping", which the owner retries quietly) where it
        waits for the owner's next message, refuse new ones, and wait (up to STOP_WAIT) until they have
        ended, so that none still writes to the copies once they are closed. Left to gRPC's stop
        instead, a stream held the server's stop for its whole grace, its handler was cancelled, and
        the call's task could still be pending when the process's loop ended (a CancelledError
        traceback)."""
        self._stopping.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), STOP_WAIT)

    async def _next(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes | None:
        """The owner's next message (None: it finished the stream); the call ends UNAVAILABLE instead
        once this node stops."""
        reading = asyncio.ensure_future(anext(requests))
        # taken however this ends: cancelled (the owner's call ended) in the turn the read ended with
        # StopAsyncIteration, the finally below found it done and left it, and asyncio logged "Task
        # exception was never retrieved"
        reading.add_done_callback(_retrieve)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait((reading, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # the call ends anyway
                    await reading
        if not reading.done() or reading.cancelled():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self._cluster.node_id} is stopping")
        try:
            return reading.result()
        except StopAsyncIteration:
            return None

    async def Replicate(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ReplicateResponse]:
        try:
            credential = self._authenticator.credential(context, REPLICATE)
        except ReceiverError as error:
            self._say_refused(context.peer(), error)
            await context.abort(getattr(grpc.StatusCode, error.status), str(error))
        if self._stopping.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node {self._cluster.node_id} is stopping")
        self._handlers += 1
        self._idle.clear()
        try:
            # a reload of the auth file that drops the peer's token (or its role) ends the stream
            replicated = self._replicate(request_iterator, context)
            async for response in self._authenticator.revocable(credential, REPLICATE, context, replicated):
                yield response
        finally:
            self._handlers -= 1
            if not self._handlers:
                self._idle.set()

    def _say_refused(self, peer: str, error: ReceiverError) -> None:
        """A Replicate call refused its credentials: said here too, at most once every
        REFUSED_SAY_SECONDS (any caller can make refusals), since an operator looking at this node saw
        nothing while the owner's copies failed at every try."""
        now = time.monotonic()
        if self._refused_said_at is not None and now - self._refused_said_at < REFUSED_SAY_SECONDS:
            log.debug("refused replication from %s: %s", peer, error)
            return
        self._refused_said_at = now
        log.warning(
            "refused replication from %s: %s (a node replicates with the token of its --peer-token-file: "
            "this node's --auth-file must give it the peer role)",
            peer,
            error,
        )

    async def _replicate(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ReplicateResponse]:
        """The stream; a copy found damaged (an incarnation file that holds no incarnation, a segment
        that cannot be read) ends it INTERNAL with the log's words, said once in an ERROR line: it
        escaped as UNKNOWN, with a traceback in this node's log at each of the owner's reconnects."""
        try:
            async for response in self._converse(request_iterator, context):
                yield response
        except WalError as exc:
            if str(exc) not in self._damage_said:
                self._damage_said.add(str(exc))
                log.error("cannot take copies: %s", exc)  # noqa: TRY400 - its words say it all
            await context.abort(grpc.StatusCode.INTERNAL, f"node {self._cluster.node_id}: {exc}")

    async def _converse(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.ReplicateResponse]:
        requests = aiter(request_iterator)
        try:
            hello = await asyncio.wait_for(self._next(requests, context), HELLO_TIMEOUT)
        except TimeoutError:
            hello = None
        if hello is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no ReplicaHello first")
        try:
            first = pb.ReplicateRequest.FromString(hello)
        except DecodeError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable ReplicateRequest: {exc}")
        owner = await self._check_hello(first, context)
        streams = list(self._receivers)
        await self._align(owner, first.hello, streams, context)
        state = {s: await asyncio.to_thread(self._replicas.next_seq, owner, s) for s in streams}
        assembler = _Assembler()
        gathering = self._gathering.setdefault(owner, [])
        gathering.append(assembler)
        try:
            async for response in self._take(
                owner, first.hello, state, streams, requests, assembler, context
            ):
                yield response
        finally:
            gathering.remove(assembler)
            if not gathering:
                del self._gathering[owner]

    async def _take(  # noqa: PLR0917 - one stream's state, passed on
        self,
        owner: int,
        hello: pb.ReplicaHello,
        state: dict[str, int],
        streams: list[str],
        requests: AsyncIterator[bytes],
        assembler: _Assembler,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.ReplicateResponse]:
        """The stream past the hello: the follower's state, then the owner's blocks and commits."""
        told = _known(hello.committed_seq, streams)  # the owner's committed seqs on this stream
        yield pb.ReplicateResponse(state=pb.ReplicaState(next_seq=state))
        while (raw := await self._next(requests, context)) is not None:
            try:
                message = pb.ReplicateRequest.FromString(raw)
            except DecodeError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable ReplicateRequest: {exc}")
            kind = message.WhichOneof("kind")
            if kind == "commit":
                committed = await self._commit(owner, message.commit, told, streams, context)
                yield pb.ReplicateResponse(committed=pb.ReplicaCommit(committed_seq=committed))
                continue
            if kind != "block":
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "only ReplicaBlock or ReplicaCommit after the hello"
                )
            block = await self._gather(owner, assembler, message.block, streams, context)
            if block is None:  # more of its payload to come
                continue
            await self._keep(owner, block, streams, hello.incarnation, context)
            yield pb.ReplicateResponse(ack=pb.ReplicaAck(stream=block.stream, seq=block.seq))

    async def _commit(
        self,
        owner: int,
        commit: pb.ReplicaCommit,
        told: dict[str, int],
        streams: list[str],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> dict[str, int]:
        """Take the owner's committed seqs (`told`: what it said before on this Replicate stream, kept up
        to date). An owner's committed seq only grows (Replicator.committed_seq): going back on one
        stream is a bug or a forgery, refused INVALID_ARGUMENT rather than taken in silence (the copy
        keeps the highest it was told either way)."""
        committed = _known(commit.committed_seq, streams)
        for stream, seq in committed.items():
            if seq < told.get(stream, 0):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"node {owner} said committed seq {seq} of stream {stream!r} after {told[stream]} on "
                    f"this Replicate stream to node {self._cluster.node_id}: a committed seq never goes back",
                )
        told.update(committed)
        await asyncio.to_thread(self._replicas.set_committed, owner, committed)
        return committed

    async def _gather(
        self,
        owner: int,
        assembler: _Assembler,
        fragment: pb.ReplicaBlock,
        streams: list[str],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.ReplicaBlock | None:
        """The whole block once `fragment` is its last, else None; the stream ends at the first fragment
        of a stream not served here, and RESOURCE_EXHAUSTED past block_limit."""
        receiver = self._receivers.get(fragment.stream)
        if receiver is None:  # at its first fragment: nothing of it is gathered
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stream {fragment.stream!r} is not served here (streams: {', '.join(streams)})",
            )
        assert receiver is not None
        limit = block_limit(receiver.config.budget_bytes, self._max_message_bytes)
        elsewhere = sum(other.size for other in self._gathering.get(owner, ()) if other is not assembler)
        try:
            return assembler.take(fragment, limit, elsewhere=elsewhere)
        except BlockTooLargeError as exc:
            await self._too_large(owner, receiver, exc, context)
        except FragmentError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        return None  # not reached: abort raises

    async def _too_large(
        self,
        owner: int,
        receiver: Receiver,
        exc: BlockTooLargeError,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """End the stream RESOURCE_EXHAUSTED: a block of `receiver`'s stream is past block_limit (said
        once in an ERROR line per owner, stream and budget: the owner retries it)."""
        budget = receiver.config.budget_bytes
        words = (
            f"node {self._cluster.node_id} refuses node {owner}'s {exc}: more than twice this node's memory "
            f"budget for the stream ({budget:,} bytes: --buffer-bytes, or --memory-budget when smaller) "
            f"plus its largest message ({self._max_message_bytes:,} bytes: --max-message-bytes); give "
            "every node the same --buffer-bytes, --memory-budget and --max-message-bytes"
        )
        key = f"{owner} {receiver.stream} {budget}"
        if key not in self._damage_said:  # once per owner, stream and budget: the owner retries it
            self._damage_said.add(key)
            log.error("refused the replication of node %d: %s", owner, words)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, words)

    async def _keep(
        self,
        owner: int,
        block: pb.ReplicaBlock,
        streams: list[str],
        incarnations: Mapping[str, str],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Check a copied block and store it durably (aborting the call when it cannot be); its log is
        of the incarnation the stream's hello said (`incarnations`)."""
        if block.stream not in self._receivers:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"stream {block.stream!r} is not served here (streams: {', '.join(streams)})",
            )
        if block.seq < 0 or block.first_offset < 0 or block.count < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "negative seq, offset or count")
        if block.seq >= MAX_POSITION or block.first_offset + block.count > MAX_POSITION:
            # stored, it made every ListPartitions of this node fail (its end offset past int64)
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"block {block.seq} of stream {block.stream!r} (records {block.first_offset}.."
                f"{block.first_offset + block.count - 1}) is past seq or offset {MAX_POSITION}",
            )
        copy = RawBlock(
            block.seq,
            block.first_offset,
            block.count,
            owner,
            block.received_at,
            dict(block.producers),
            block.arrow_ipc,
        )
        incarnation = incarnations.get(block.stream, "")
        after = block.after_release
        try:
            await _finished(asyncio.to_thread(self._store, owner, block.stream, copy, after, incarnation))
        except InvalidBlockError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (ReplicaGapError, ReplicaIncarnationError) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:  # the log refused it (seq/offset order): the owner's view is off
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"block refused: {exc}")

    async def _align(
        self,
        owner: int,
        hello: pb.ReplicaHello,
        streams: list[str],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> None:
        """Drop what the copy holds past what it knew committed (the owner sends it again: it may have
        dropped those blocks at a restart and written others at their seqs), then take the owner's
        committed seqs. In that order: told first, the copy would count a stale block committed once
        the owner committed its own block at that seq while this follower was away.

        First of all, a copy of another incarnation of the owner's log than the one it says it has now
        is set aside (ReplicaStore.meet_incarnation): the owner's log was lost and started afresh, and
        that copy is the only place the records it held (acked ones among them) still are."""
        told = {s: v for s, v in hello.incarnation.items() if s in streams and v}
        bad = [v for v in told.values() if not valid_incarnation(v)]
        if bad:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid incarnation {bad[0][:80]!r}")
        for stream, incarnation in told.items():
            aside = await asyncio.to_thread(self._replicas.meet_incarnation, owner, stream, incarnation)
            if aside is not None:
                _log_set_aside(aside)
        skipped = _known(hello.skipped_to, streams)
        for stream, end in _known(hello.log_end, streams).items():
            try:
                dropped = await asyncio.to_thread(
                    self._replicas.drop_uncommitted, owner, stream, end, skipped.get(stream, 0)
                )
            except OwnerLogLostError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            if dropped:
                log.info(
                    "stream %r: dropped %d block(s) of node %d's copy past what it knew committed; "
                    "node %d sends them again",
                    stream,
                    dropped,
                    owner,
                    owner,
                )
        await asyncio.to_thread(self._replicas.set_committed, owner, _known(hello.committed_seq, streams))

    def _store(self, owner: int, stream: str, block: RawBlock, after_release: bool, incarnation: str) -> None:
        _check_payload(block)  # a copy that cannot be read back would fail Spark's tasks much later
        self._replicas.append(
            owner, stream, block, after_release=after_release, sync=self._sync_each, incarnation=incarnation
        )

    async def _check_hello(
        self, first: pb.ReplicateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> int:
        if first.WhichOneof("kind") != "hello":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the first message must be ReplicaHello")
        hello = first.hello
        cluster = self._cluster
        mine = (len(cluster.nodes), cluster.replication)
        if (hello.nodes, hello.replication) != mine:
            # said here too (ERROR, once per owner and configuration): only the owner logged it, and this
            # node, configured otherwise maybe, served and acked with fewer copies without a word
            self.mismatches.seen(hello.owner, hello.nodes, hello.replication, refused_by_peer=False)
            me = cluster.node_id if cluster.node_id is not None else -1
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                config_mismatch((hello.owner, hello.nodes, hello.replication), (me, *mine), None),
                ((CONFIG_HEADER, f"{mine[0]} {mine[1]}"),),
            )
        if hello.owner == cluster.node_id:
            # this node's own replication, come back to it (its address listed under a follower's id
            # too), or a second process run as this node: "not a follower of node 0" said neither
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {cluster.node_id} ({cluster.me.target}) is not a follower of node {hello.owner}, "
                "its own id: the hello came from this node itself (the node list, --nodes, names its "
                f"address under a follower's id too) or from another process run as node {cluster.node_id} "
                "(one --node-id given twice); give each node its own address and --node-id",
            )
        known = hello.owner in {n.id for n in cluster.nodes}
        if not known or cluster.node_id not in {n.id for n in cluster.followers(hello.owner)}:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {cluster.node_id} is not a follower of node {hello.owner} in its node list",
            )
        self.mismatches.agreed(hello.owner)
        return hello.owner

    async def ProducerMarks(
        self, request: pb.ProducerMarksRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ProducerMarksResponse:
        if len(request.producers) > MAX_MARK_KEYS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_MARK_KEYS} producers per call"
            )
        receiver = self._receivers.get(request.stream)
        if receiver is None:
            return pb.ProducerMarksResponse()
        keys = list(dict.fromkeys(request.producers))
        marks = await asyncio.to_thread(self._replicas.marks, request.stream, keys)
        deadline = time.monotonic() + MARK_WAIT
        for key in keys:
            while (state := receiver.producer_state(key)) and state.durable_up_to < state.accepted_up_to:
                if time.monotonic() > deadline:
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"records of a producer on stream {request.stream!r} are not durable here yet; retry",
                    )
                await asyncio.sleep(0.02)
            if state is not None:
                merge_marks(marks, {key: state.durable_up_to})
        return pb.ProducerMarksResponse(marks=marks)
