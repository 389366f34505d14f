"""Replication before ack: an owner copies each block to its followers and acks it once enough have it.

The owner's receivers write blocks to the local log through ReplicatedBlockStore; one FollowerLink per
follower streams them, in order per stream, over Replication.Replicate, and the follower acks each once
durable. ReplicatedBlockStore.durable_seq, which the receiver acks by, is the seq below which a block is
durable here and on every in-sync follower, and only while 1 + in-sync followers >= min_insync: with
fewer, nothing more is acked and the server pauses credit (reason "replication") rather than ack with
fewer copies than the operator asked for (Kafka's min.insync.replicas).

In sync (Kafka's ISR): a follower joins once it has caught up with the log (a new or returning follower
is first sent what it misses, read back from the log, without holding acks up meanwhile), and leaves
when its connection drops or it makes no progress for `lag_timeout` while behind. Each change is logged
(WARNING when a follower leaves, INFO when it joins) and shown by in_sync() for metrics and operators.

Blocks this node no longer has when a follower needs them (Spark released them, or this node's log was
lost: ingest.receiver_node's continue_logs) are not sent: the first block sent then says so
(after_release) and carries the released producers table, and the copy goes on after a gap, keeping
what it holds (receivers.replica_store).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa

from receivers.block import BlockInfo, LogSpan
from receivers.block_store import BlockStore
from receivers.cluster import CONFIG_HEADER, Cluster, ConfigMismatches, Node
from receivers.files import parse_json, replace_json
from receivers.wal import WalBlockStore
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.tasks import reap

log = logging.getLogger(__name__)

_TRANSIENT = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
)
"""How a follower that is down, restarting or slow ends a session: retried without a word."""


def _transient(error: str) -> bool:
    return error.split(":", 1)[0] in {code.name for code in _TRANSIENT} or error == _CORE_RACE


_CORE_RACE = "INTERNAL: Internal error from Core"
"""gRPC core's own status, not a follower's refusal: seen now and then (under load) when the follower
ends the call (stopping: UNAVAILABLE) while the owner writes into it. Retried quietly as well."""


FRAGMENT_BYTES = 4 * 1024 * 1024
"""A block's payload goes to a follower in messages of at most this many bytes (see fragments())."""
WINDOW_BLOCKS = 64
"""Blocks sent to a follower and not yet acked, at most: bounds what a slow follower costs in memory."""
LAG_TIMEOUT = 5.0
RECONNECT_MIN, RECONNECT_MAX = 0.1, 2.0


class FollowerAnswerError(ValueError):
    """A follower's answer on its Replicate stream is not one it can give (an ack of a block never sent
    to it, a committed seq it was never told, or one that goes back): a bug or a forgery. Its stream is
    ended (cancelled), said once in an ERROR line and in the link's status, the follower out of the
    in-sync set; the owner reconnects, as after any refusal, and other followers go on."""

    def __init__(self, message: str, *, kind: str, status: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.kind = kind
        """What was wrong, without the values (which differ at each reconnect): said once per kind."""
        self.status = status


ChannelFactory = Callable[[str], grpc.aio.Channel]
"""target -> a channel to it (with the node's TLS credentials); the caller closes it."""
Metadata = tuple[tuple[str, str], ...]
Call = grpc.aio.StreamStreamCall[pb.ReplicateRequest, pb.ReplicateResponse]


class FollowerLink:
    """The stream of blocks to one follower, and what it has acked."""

    def __init__(self, follower: Node, replicator: Replicator) -> None:
        self.follower = follower
        self._replicator = replicator
        self.acked: dict[str, int] = {}
        """Stream -> the seq of the next block the follower needs (every lower one is durable there)."""
        self.connected = False
        self.sessions = 0
        """Replicate streams that got past the hello (one per connection to the follower)."""
        self.in_sync = False
        self.progress_at = time.monotonic()
        self.error: str | None = None
        self._said: str | None = None  # the refusal last logged: not again until the follower is in sync
        self._answers_said: set[str] = set()  # the kinds of FollowerAnswerError logged at ERROR
        self._sent: dict[str, int] = {}
        self._told: dict[str, int] = {}  # the committed seqs this follower was last told
        self.knows: dict[str, int] = {}
        """Stream -> the committed seq the follower confirmed it took (it serves below it)."""
        self._ack_arrived = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"replicate-to-{self.follower.id}")

    async def stop(self) -> None:
        if self._task is not None:
            await reap(self._task)

    def behind(self) -> bool:
        local = self._replicator.local
        return any(self.acked.get(s, 0) < local.durable_seq(s) for s in self._replicator.streams)

    def check(self, now: float) -> None:
        """Join or leave the in-sync set (called by the replicator on each round)."""
        if not self.connected:
            self._leave("it is not connected" + (f" ({self.error})" if self.error else ""))
        elif not self.behind():
            self.progress_at = now
            if not self.in_sync:
                self.in_sync, self._said = True, None
                log.info("follower %d (%s) is in sync", self.follower.id, self.follower.target)
        elif now - self.progress_at > self._replicator.lag_timeout:
            self._leave(f"it acked nothing for {self._replicator.lag_timeout:g} s while behind")

    def _leave(self, why: str) -> None:
        if self.in_sync:
            self.in_sync = False
            node = self.follower
            log.warning("follower %d (%s) left the in-sync set: %s", node.id, node.target, why)

    async def _run(self) -> None:
        backoff = RECONNECT_MIN
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as exc:
                error = f"{exc.code().name}: {exc.details()}"
                differs = _config_of(exc)
                if differs is not None:  # another node list or replication: ERROR once per configuration
                    words = self._replicator.mismatches.seen(self.follower.id, *differs, refused_by_peer=True)
                    error = f"{exc.code().name}: {words}"
                elif not _transient(error) and error != self._said:
                    # a follower that answers and refuses (a log replaced, a missing peer role) is an
                    # operator's to fix: say it where it is seen. Once: compared with self.error, which
                    # a hello that went through clears, one refused after it was said at every reconnect
                    self._said = error
                    log.warning(
                        "follower %d (%s) refuses replication: %s",
                        self.follower.id,
                        self.follower.target,
                        error,
                    )
                self.error = error
            except FollowerAnswerError as exc:
                error = f"{exc.status}: {exc}"
                # once per kind: the follower answers so again at each reconnect, with other values
                level = logging.DEBUG if exc.kind in self._answers_said else logging.ERROR
                self._answers_said.add(exc.kind)
                log.log(level, "%s", error)
                self.error = error
            except Exception as exc:
                self.error = repr(exc)
                log.exception("replication to node %d failed", self.follower.id)
            self.connected = False
            self._replicator.changed()
            await asyncio.sleep(backoff)
            backoff = min(RECONNECT_MAX, backoff * 2)
            if self.error is not None and backoff == RECONNECT_MAX:
                log.debug("replication to node %d: %s", self.follower.id, self.error)

    async def _session(self) -> None:
        replicator = self._replicator
        channel = replicator.channel(self.follower.target)
        try:
            stub = pb_grpc.ReplicationStub(channel)
            call: Call = stub.Replicate(metadata=replicator.metadata)  # type: ignore[call-arg]  # stubs lag
            try:
                await self._converse(call)
            except asyncio.InvalidStateError:
                # a message written after the follower ended the call ("RPC already finished", logged
                # with a traceback as a failure): its status says why (UNAVAILABLE "node N is stopping"
                # is retried without a word)
                raise await _ended(call) from None
        finally:
            await channel.close(None)

    async def _converse(self, call: Call) -> None:
        """Hello, the follower's state, then blocks and commits until the call ends."""
        replicator = self._replicator
        hello = pb.ReplicaHello(
            owner=replicator.cluster.me.id,
            nodes=len(replicator.cluster.nodes),
            replication=replicator.cluster.replication,
            log_end={s: replicator.local.durable_seq(s) for s in replicator.streams},
            committed_seq=replicator.persisted(),
            skipped_to={s: n for s in replicator.streams if (n := replicator.local.skipped_to(s))},
            incarnation={s: i for s in replicator.streams if (i := replicator.local.incarnation(s))},
        )
        await call.write(pb.ReplicateRequest(hello=hello))
        responses = aiter(call)
        first = await anext(responses, None)
        if first is None or first.WhichOneof("kind") != "state":
            raise ConnectionError("the follower did not answer the hello with its state")
        self.acked = {s: first.state.next_seq.get(s, 0) for s in replicator.streams}
        ahead = [s for s in replicator.streams if self.acked[s] > replicator.local.durable_seq(s)]
        if ahead:  # acking on top would let the copy drop this node's new blocks as ones it has
            where = ", ".join(f"{s}: it needs block {self.acked[s]} next" for s in ahead)
            raise FollowerAnswerError(
                f"{self._name()} holds blocks of stream(s) {', '.join(ahead)} beyond this node's log "
                f"({where}; this log ends at block "
                f"{', '.join(str(replicator.local.durable_seq(s)) for s in ahead)}): this node's log was "
                "lost or replaced; restore it from the follower's copy",
                kind="ahead",
                status="FAILED_PRECONDITION",
            )
        self._sent = dict(self.acked)
        self._told = dict(hello.committed_seq)  # taken before the follower answered the hello
        self.knows = dict(self._told)
        self.connected, self.error = True, None
        self.sessions += 1
        replicator.mismatches.agreed(self.follower.id)
        self.progress_at = time.monotonic()
        replicator.changed()
        reader = asyncio.create_task(self._read_acks(responses))
        try:
            await self._send_loop(call, reader)
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await reader
            call.cancel()

    def _name(self) -> str:
        return f"follower {self.follower.id} ({self.follower.target})"

    async def _read_acks(self, responses: AsyncIterator[pb.ReplicateResponse]) -> None:
        """Take the follower's acks and committed seqs, each checked against what this node sent and
        told it: taken as they came, an ack of a block never sent counted blocks durable on a follower
        that lacks them, and a committed seq never told let blocks be acked to producers before that
        follower would serve them (each a bug or forgery of the follower: FollowerAnswerError)."""
        async for response in responses:
            kind = response.WhichOneof("kind")
            if kind == "committed":
                for stream, seq in response.committed.committed_seq.items():
                    self._check_committed(stream, seq)
                    self.knows[stream] = seq
                self._replicator.changed()
                continue
            if kind != "ack":
                continue
            stream, seq = response.ack.stream, response.ack.seq
            self._check_ack(stream, seq)
            if seq + 1 > self.acked.get(stream, 0):
                self.acked[stream] = seq + 1
                self.progress_at = time.monotonic()
            self._ack_arrived.set()
            self._replicator.changed()
        raise ConnectionError("the follower ended the replication stream")

    def _check_ack(self, stream: str, seq: int) -> None:
        sent, acked = self._sent.get(stream), self.acked.get(stream, 0)
        if sent is None:
            raise FollowerAnswerError(
                f"{self._name()} acked block {seq} of stream {stream!r}, which this node does not replicate",
                kind=f"ack of {stream!r}",
            )
        if not acked <= seq < sent:
            why = "past every block sent to it" if seq >= sent else "below a block it acked before"
            raise FollowerAnswerError(
                f"{self._name()} acked block {seq} of stream {stream!r}, {why} (it acked blocks below "
                f"{acked}, and was sent blocks below {sent} on this stream)",
                kind=f"ack of {stream!r}",
            )

    def _check_committed(self, stream: str, seq: int) -> None:
        told, knew = self._told.get(stream), self.knows.get(stream, 0)
        if told is None or seq > told:
            raise FollowerAnswerError(
                f"{self._name()} says it took committed seq {seq} of stream {stream!r}, past the "
                f"{'none' if told is None else told} this node told it on this stream",
                kind=f"committed of {stream!r}",
            )
        if seq < knew:
            raise FollowerAnswerError(
                f"{self._name()} says it took committed seq {seq} of stream {stream!r}, going back from "
                f"the {knew} it took before on this stream",
                kind=f"committed of {stream!r}",
            )

    async def _send_loop(self, call: Call, reader: asyncio.Task[None]) -> None:
        replicator = self._replicator
        while True:
            if reader.done():
                reader.result()  # raises why the follower's side ended
            sent_any = False
            for stream in replicator.streams:
                in_flight = sum(self._sent.get(s, 0) - self.acked.get(s, 0) for s in replicator.streams)
                room = WINDOW_BLOCKS - in_flight
                if room <= 0:
                    break
                blocks = await asyncio.to_thread(
                    _pending_blocks, replicator.local, stream, self._sent[stream], room
                )
                for block, message in blocks:
                    # counted sent first: the follower's ack may be read before the last write returns
                    self._sent[stream] = block.seq + 1
                    for piece in fragments(message):
                        await call.write(pb.ReplicateRequest(block=piece))
                    sent_any = True
            committed = replicator.persisted()
            if committed != self._told:
                self._told = committed  # first, as for blocks: its echo may come before the write returns
                await call.write(pb.ReplicateRequest(commit=pb.ReplicaCommit(committed_seq=committed)))
            if not sent_any:
                waits = [
                    asyncio.ensure_future(replicator.wake.wait()),
                    asyncio.ensure_future(self._ack_arrived.wait()),
                ]
                try:
                    await asyncio.wait([*waits, reader], timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
                finally:  # also when the session is cancelled here: left, they waited for good
                    for waiter in waits:
                        waiter.cancel()
                self._ack_arrived.clear()


def _config_of(exc: grpc.aio.AioRpcError) -> tuple[int, int] | None:
    """(nodes, replication) of a follower that refused the hello for another configuration, else None."""
    if exc.code() is not grpc.StatusCode.FAILED_PRECONDITION:
        return None
    entries: Any = exc.trailing_metadata() or ()  # (key, value) pairs; grpc's stubs type them opaquely
    for key, value in entries:
        if key == CONFIG_HEADER:
            with contextlib.suppress(ValueError):
                nodes, replication = (int(v) for v in str(value).split())
                return nodes, replication
    return None


async def _ended(call: Call) -> grpc.aio.AioRpcError:
    """How a finished call ended, as the error reading it raises."""
    code, details = await call.code(), await call.details()
    return grpc.aio.AioRpcError(
        code, await call.initial_metadata(), await call.trailing_metadata(), details, None
    )


def fragments(block: pb.ReplicaBlock, size: int = FRAGMENT_BYTES) -> list[pb.ReplicaBlock]:
    """`block` as messages of at most about `size` bytes of payload each: the first with its header,
    the others with the rest of its payload (`more` set on all but the last)."""
    payload = block.arrow_ipc
    if len(payload) <= size:
        return [block]
    first = pb.ReplicaBlock()
    first.CopyFrom(block)
    first.arrow_ipc, first.more = payload[:size], True
    found = [first]
    for at in range(size, len(payload), size):
        last = at + size >= len(payload)
        piece = payload[at : at + size]
        found.append(pb.ReplicaBlock(stream=block.stream, seq=block.seq, arrow_ipc=piece, more=not last))
    return found


def _pending_blocks(
    local: WalBlockStore, stream: str, from_seq: int, limit: int
) -> list[tuple[BlockInfo, pb.ReplicaBlock]]:
    """The next blocks a follower needs, from seq `from_seq`, as messages (blocking: reads the log)."""
    durable = local.durable_seq(stream)
    found: list[tuple[BlockInfo, pb.ReplicaBlock]] = []
    for block in local.blocks(stream, from_seq):
        if block.seq >= durable or len(found) >= limit:
            break
        raw = local.read_raw(block)
        producers = raw.producers
        after_release = block.seq > from_seq
        if after_release:  # the copy goes on after blocks this log no longer has: their producers too
            producers = {**local.released_producers(stream)}
            for key, mark in raw.producers.items():
                producers[key] = max(mark, producers.get(key, 0))
        message = pb.ReplicaBlock(
            stream=stream,
            seq=raw.seq,
            first_offset=raw.first_offset,
            count=raw.count,
            received_at=raw.received_at,
            after_release=after_release,
            producers=producers,
            arrow_ipc=bytes(raw.payload),
        )
        found.append((block, message))
        from_seq = block.seq + 1
    return found


class Replicator:
    """This node's links to its followers, and the seq below which each stream's blocks may be acked."""

    def __init__(
        self,
        cluster: Cluster,
        local: WalBlockStore,
        streams: Sequence[str],
        *,
        channel: ChannelFactory,
        metadata: Metadata = (),
        lag_timeout: float = LAG_TIMEOUT,
        committed_file: Path | None = None,
        mismatches: ConfigMismatches | None = None,
    ) -> None:
        self.cluster = cluster
        self.mismatches = mismatches if mismatches is not None else ConfigMismatches(cluster)
        """Followers that refused this node for another configuration (shared with the follower side)."""
        self.local = local
        self.streams = list(streams)
        self.channel = channel
        self.metadata = metadata
        self.lag_timeout = lag_timeout
        self.links = [FollowerLink(node, self) for node in cluster.followers(cluster.me.id)]
        self.wake = asyncio.Event()
        self._committed: dict[str, int] = {}
        """Stream -> the highest seq found committable (on enough copies), maybe not yet persisted."""
        self.committed_file = committed_file
        self._persisted: dict[str, int] = read_committed(committed_file) if committed_file else {}
        """Stream -> the committed seq on disk: what is acked, read, and told to followers."""
        self._acked: dict[str, int] = {}  # stream -> what committed_seq last returned (it only grows)
        self._persist_wanted = asyncio.Event()
        self._persister: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._checker: asyncio.Task[None] | None = None
        self._listeners: list[Callable[[], None]] = []

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for link in self.links:
            link.start()
        self._checker = asyncio.create_task(self._check_loop(), name="replication-isr")
        if self.committed_file is not None:
            self._persister = asyncio.create_task(self._persist_loop(), name="replication-committed")

    async def stop(self) -> None:
        for task in (self._checker, self._persister):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for link in self.links:
            await link.stop()

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` (on the event loop) when acks or the in-sync set change."""
        self._listeners.append(listener)

    def notify_written(self) -> None:
        """A block was written to the local log (any thread): send it."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake_links)

    def _wake_links(self) -> None:
        self.wake.set()
        self.wake = asyncio.Event()

    def changed(self) -> None:
        now = time.monotonic()
        for link in self.links:
            link.check(now)
        for listener in self._listeners:
            listener()

    def in_sync(self) -> list[Node]:
        return [link.follower for link in self.links if link.in_sync]

    @property
    def copies_in_sync(self) -> int:
        """This node plus its in-sync followers."""
        return 1 + sum(link.in_sync for link in self.links)

    @property
    def can_ack(self) -> bool:
        return self.copies_in_sync >= self.cluster.min_insync

    def status(self) -> str:
        parts = []
        for link in self.links:
            state = "in sync" if link.in_sync else ("catching up" if link.connected else "down")
            refused = link.error if not link.connected and link.error and not _transient(link.error) else None
            parts.append(f"node {link.follower.id} {state}" + (f": {refused}" if refused else ""))
        return ", ".join(parts) or "no followers"

    def committed_seq(self, stream: str) -> int:
        """Blocks of `stream` below this seq are durable on enough copies to be acked and read, and that
        is on disk (committed_file): a restarted owner drops what is past it (truncate_uncommitted), so
        nothing acked or read may be."""
        local = self.local.durable_seq(stream)
        previous = self._committed.get(stream, 0)
        committed = previous
        if self.can_ack:
            committed = min([local, *(link.acked.get(stream, 0) for link in self.links if link.in_sync)])
            committed = max(previous, committed)
            self._committed[stream] = committed
        if self.committed_file is None:
            return committed
        persisted = self._persisted.get(stream, 0)
        if committed > persisted:
            self._want_persist()
        # acked (and read here) once every in-sync follower also knows it committed, so that it serves
        # it should this node die: otherwise an acked block could be unreadable until this node returns
        known = min([persisted, *(link.knows.get(stream, 0) for link in self.links if link.in_sync)])
        acked = max(self._acked.get(stream, 0), known)
        self._acked[stream] = acked
        return acked

    def _want_persist(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._persist_wanted.set()
        else:  # Blocks reads ask from worker threads
            loop.call_soon_threadsafe(self._persist_wanted.set)

    def persisted(self) -> dict[str, int]:
        """Stream -> the committed seq on disk (what followers are told)."""
        return dict(self._persisted)

    async def _persist_loop(self) -> None:
        """Write the committed seqs whenever they advance: one write covers every advance since the
        last (group commit), then the receivers ack up to them (changed())."""
        assert self.committed_file is not None
        while True:
            await self._persist_wanted.wait()
            self._persist_wanted.clear()
            wanted = {**self._persisted, **self._committed}
            if wanted == self._persisted:
                continue
            sync = self.local.fsync.mode == "every-block"
            await asyncio.to_thread(write_committed, self.committed_file, wanted, sync=sync)
            self._persisted = wanted
            self._wake_links()
            self.changed()

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            self.changed()


def read_committed(path: Path) -> dict[str, int]:
    """The committed seqs persisted at `path` ({} when there is none)."""
    try:
        data = parse_json(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{path}: cannot read the committed seqs ({exc}); the node cannot tell acked "
            "blocks from unacked ones: restore the file or remove the data dir"
        ) from exc
    if not isinstance(data, dict) or not all(isinstance(v, int) and v >= 0 for v in data.values()):
        raise ValueError(f"{path}: not a map of stream to committed seq")
    return {str(k): v for k, v in data.items()}


def write_committed(path: Path, committed: Mapping[str, int], *, sync: bool) -> None:
    """Replace the file atomically (temp, fsync when `sync`, rename, fsync of the folder)."""
    replace_json(path, dict(committed), sync=sync)


def truncate_uncommitted(
    local: WalBlockStore,
    streams: Sequence[str],
    committed_file: Path,
    *,
    replicated: bool = True,
    cut: bool = True,
) -> None:
    """At an owner's start, before its receivers recover: drop the blocks past each stream's persisted
    committed seq. They were written by a run with replication > 1 and never committed (never acked nor
    readable anywhere), and their producers resend them, here or on another node (which took them: a
    peer's marks did not have them); kept, they would be read twice. Never below what Spark released
    (read, so acked). A data dir without the file (from before committed seqs were kept, or last run
    with replication 1): its whole log counts as committed.

    `replicated` False (this node has no followers: replication 1): after that cut, the file is removed
    (durably), for every block written from now on is acked once durable in this log alone, and no
    committed seq follows it; a later start with replication > 1 then counts the whole log as committed.
    Left in place, the file said less than what was acked, and that start deleted acked blocks.

    `cut` False: nothing is dropped (with replication 1 when the last run's replication is unknown: a
    version from before this one left the file in place under replication 1, and what is past it may
    have been acked since)."""
    if not committed_file.exists():
        if replicated:
            # kept for the receivers' recovery, which then does not read each log a second time
            ends = {s: local.recover(s, keep=True)[0] for s in streams}
            write_committed(committed_file, ends, sync=True)
        return
    committed = read_committed(committed_file)
    for stream in streams if cut else ():
        keep_below = max(committed.get(stream, 0), local.released_seq(stream))
        blocks, records = local.truncate_from(stream, keep_below)
        if blocks:
            log.warning(
                "stream %r: dropped %d block(s), %d record(s), written before a crash and never committed "
                "(not on enough copies, never acked): their producers resend them",
                stream,
                blocks,
                records,
            )
    if not replicated:
        committed_file.unlink()
        _fsync_folder(committed_file.parent)
        log.info(
            "replication 1: %s removed; every block this node writes is acked once in its own log, and a "
            "later start with replication > 1 counts the whole log as committed",
            committed_file,
        )


def _fsync_folder(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ReplicatedBlockStore(BlockStore):
    """The local log, with durable_seq meaning "durable on enough copies" (see the module docstring)."""

    def __init__(self, local: WalBlockStore, replicator: Replicator) -> None:
        self.local = local
        self.replicator = replicator

    def recover(self, stream: str) -> tuple[int, int]:
        return self.local.recover(stream)

    def write(  # noqa: PLR0917 - BlockStore's signature
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> tuple[BlockInfo, int]:
        written = self.local.write(stream, seq, first_offset, receiver, batches, producers)
        self.replicator.notify_written()
        return written

    def prepare(  # noqa: PLR0917 - BlockStore's signature
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> None:
        # the local log encodes the next block while this one is written, as on a single node
        self.local.prepare(stream, seq, first_offset, receiver, batches, producers)

    def producers(self, stream: str) -> dict[str, int]:
        return self.local.producers(stream)

    def blocks(self, stream: str, from_seq: int = 0) -> list[BlockInfo]:
        committed = self.replicator.committed_seq(stream)
        return [b for b in self.local.blocks(stream, from_seq) if b.seq < committed]

    def extent(self, stream: str) -> tuple[int, int] | None:
        return self.local.extent(stream, below_seq=self.replicator.committed_seq(stream))

    def span(self, stream: str) -> LogSpan | None:
        return self.local.span(stream, below_seq=self.replicator.committed_seq(stream))

    def read(self, block: BlockInfo) -> Iterator[pa.RecordBatch]:
        return self.local.read(block)

    def release(self, stream: str, before_seq: int) -> int:
        return self.local.release(stream, before_seq)

    def durable_seq(self, stream: str) -> int:
        if not self.replicator.links:
            return self.local.durable_seq(stream)
        return self.replicator.committed_seq(stream)

    def on_durable(self, stream: str, listener: Callable[[], None]) -> Callable[[], None]:
        # the local fsync may complete a commit; followers' acks reach the receivers by on_change
        return self.local.on_durable(stream, listener)

    def flush(self) -> None:
        self.local.flush()

    def disk_bytes(self, stream: str | None = None) -> int:
        return self.local.disk_bytes(stream)

    def trim(self, stream: str) -> int:
        return self.local.trim(stream)

    def incarnation(self, stream: str) -> str:
        return self.local.incarnation(stream)
