"""The receiver of one stream: grants credit, takes batches, seals blocks, acks durable records.

Flow roles: the receiver is the Subscriber of every publisher session on its stream, and each session a
Subscription (`subscription(session)` gives it as one): Open is onSubscribe (`open_session`), each record
of a Batch an onNext (`accept`), Complete and Error are onComplete and onError (`complete`, `fail`);
request(n) goes out as Request(n), cancel() as Cancel.

Demand policy: a session gets `prefetch` credits when it opens and is topped up to `prefetch` whenever
its unused credit falls to `low_tide`. All of it is bounded by the buffer: records buffered (taken, not
yet in a durable block) plus credit outstanding never exceed `buffer_records`; credit returns to the pool
as records leave the buffer for durable blocks, and a token bucket meters it at the stream's rate.
Credit is shared fairly by owner (receivers.fairness: the principal, else the producer id, else the
session), each owner's grant going to its sessions in rotating order, so a fast or many-session
publisher cannot starve a slow one; a session silent for `reclaim_after` while its owner holds more
than its share and another owner is short of room is cancelled (UNAVAILABLE), the only way to take
credit back. A session holding credit unused for its principal's idle_timeout ends UNAVAILABLE too.

Every `block_interval` (or sooner: once `block_records` wait, or a quarter of `buffer_bytes`, or once no
batch has come for `block_linger`) the block generator seals what was taken into one block, writes it
durably to the block store, then acks each session up to its last record in it.

Resource budgets (credit pauses). New credit is withheld, for one of three reasons, while:

- memory_budget: the bytes of records taken and not yet sealed plus the bytes the outstanding credit may
  bring reach `buffer_bytes`. Credit is counted in records, so it is converted with an estimate of bytes
  per record: `INITIAL_RECORD_BYTES` (1 KiB) until records were seen, then the larger of a moving average
  (EWMA over about the last 1,024 records) of the batches' bytes per record and the last batch's.
  Records larger than the estimate (the first grant, a producer switching to large records) can bring
  more than the credit's estimated bytes: once the records taken reach `buffer_bytes`, each session's
  next message stays unread (gRPC's flow control holds its producer back) until blocks are written, so
  the buffer exceeds the budget by at most one message per session (`max_message_bytes`). Credit
  resumes as blocks are sealed. With nothing buffered and no credit outstanding one record is always
  granted, so a budget below one record never stalls a stream.
- disk_budget: the block store takes `disk_budget_bytes` or more on disk (the whole store, every stream:
  it is the disk that is protected). Polled at most every `disk_poll_interval` seconds from the block
  generator (a stat of each file of the store; sealed blocks are added at once), since blocks are
  released (segments deleted) by Spark's commit in another process. Resumes when Spark releases blocks.
- disk_error: the last block write failed (ENOSPC, EIO, ...). The records stay buffered and the write is
  retried every block_interval; nothing is acked before it is durable. Resumes once a write succeeds.
  A write that fails for lack of room (ENOSPC, EDQUOT) is retried at once with half the block's bytes
  (whole chunks: a chunk is one client message, the smallest block), halved again until a part fits or
  a single chunk does not; what fits is written and acked. Until a block the cap did not cut short is
  written, blocks stay within the cap, which doubles with each write that succeeds in a later seal;
  such a seal writes everything it took, as far as the disk has room, and credit resumes once it has
  (one ERROR for the first failure, the retries at DEBUG). Other errors retry the whole block.

A write that fails with anything but an OSError may have failed on what was in the block, and no
session's input may stop the block generator: each producer's records (each anonymous session's) are
then written as a block of their own, and those the log still refuses are dropped and fail that
producer's sessions (INVALID_ARGUMENT for data it cannot encode, else UNAVAILABLE), the producer's
accepted mark set back so that a resend is taken; everyone else's records are sealed and acked. One of
those writes that fails with an OSError is a failed block write as above (for lack of room, cut down to
what fits at once), the producers' records after it pending again behind it.

While paused for a disk reason, the receiver also asks the store to drop its newest segment if Spark has
released every block in it (`BlockStore.trim`), since Spark's release never deletes the newest segment.
Credit already granted is honoured and records taken are always sealed, so the disk budget can be
exceeded by at most what the memory budget holds. Publishers see no error, only no credit (backpressure);
operators see `paused` (reason -> since), `stats.credit_pauses`, the `sluice_credit_paused` gauge, a
WARNING when credit pauses and an INFO line when it resumes (memory-budget pauses come and go with every
sealed block under load, so they are logged at most once a minute, the rest at DEBUG).

Idempotent producers (deduplication by producer id and sequence number, like Kafka's idempotent
producer): the receiver keeps a producer table, producer id -> (accepted_up_to: the sequence number after
the last record it accepted of that producer, durable_up_to: every record below is durable). A session
that opens with a producer id starts at its `resume_from_seq`; within a session batches must be
consecutive (a repeat or a step back is INVALID_ARGUMENT), and each batch is checked against the table:

- the part of a batch below accepted_up_to is a duplicate: dropped and counted
  (`stats.records_deduplicated`), its credit goes back to the pool at once (it takes no buffer room), and
  the session is acked up to min(its next seq, the producer's durable_up_to) as soon as the originals are
  durable, whichever session accepted them (acks are routed by producer);
- a batch that starts beyond accepted_up_to is a gap: the session fails with OUT_OF_RANGE, naming the
  expected and the received sequence number. A producer the table does not know is accepted from its
  resume point.
- a session that opens afresh (Open.fresh: a new run of the producer, not a reconnect or a resume) of a
  producer whose accepted_up_to is beyond its resume point is refused, ALREADY_EXISTS naming
  accepted_up_to: its records would be dropped as duplicates of an earlier run's;
- a new session of a producer that still has an accepting session fences the old one: it gets Cancel
  (ABORTED, "superseded by a newer session of producer X"); what it had accepted is still sealed and acked.

The table is seeded from the store (`store.producers(stream)`: the marks written with every block, so it
survives restarts; recovered producers start with accepted_up_to = durable_up_to = their mark) and bounded
(`max_producers`, the least recently used of the principal holding the most evicted first, so that one
principal's flood of new ids evicts its own; never one with a session open or records not yet durable;
the table may exceed the bound while all are so): an evicted producer
is unknown again, so a replay of its old records would be accepted twice. Anonymous producers (empty
producer_id) are not deduplicated, not fenced and not in the table. The table is keyed by principal too
(receivers.principal.producer_key): on a server with authentication the same id under two principals is
two producers, so no principal can fence another's producer or have its records dropped as duplicates.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import errno
import logging
import math
import struct
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, cast

import pyarrow as pa
from reactivex.subject import Subject

from ratecontrol import UNLIMITED, TokenBucket
from receivers.block import BlockInfo, first_arrival_us
from receivers.block_store import BlockStore
from receivers.config import ReceiverConfig
from receivers.errors import (
    InvalidBatch,
    ProducerExists,
    ProtocolViolation,
    ReceiverError,
    ReceiverStopped,
    SequenceGap,
    SessionCancelled,
    UnloggableRecords,
    cut,
    detached,
    shown,
)
from receivers.fairness import OwnerDemand, allocate, owner_of
from receivers.memory_pool import MemoryPool
from receivers.names import check_stream_name
from receivers.principal import ANONYMOUS, Principal, producer_key
from receivers.producer_table import ProducerTable
from receivers.session import SESSION_IDS, Session
from receivers.wire import check_open_flags, check_producer_id, check_seq_range
from sluice_client.flow import MAX_DEMAND, Subscription
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

log = logging.getLogger(__name__)

UNAVAILABLE = 14
"""gRPC status code for 'not accepted, safe to retry' (kept numeric: receivers do not import gRPC)."""
CANCELLED = 1
_ARRIVALS_KEPT = 10_000
"""Blocks whose arrival times are remembered while Spark commits nothing: far more than a batch spans
(at most ~100 s of a trickle that block_linger seals record by record, 2,000 s of the interval's)."""
_COMMITS_KEPT = 3
"""Arrival times are forgotten below the end of the third-last commit the receiver was told of: a
batch's metrics ask for its start (the end of the commit before it), and may arrive after a later
commit (they travel on another thread)."""
_DATA_ERRORS = (ValueError, ArithmeticError, TypeError, LookupError, struct.error, pa.ArrowCapacityError)
"""What a block write raises on records or producer marks it cannot encode, as opposed to a broken store."""
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Errnos of a block write that a smaller block may get past: the disk (or the quota) is full."""
ABORTED = 10
"""gRPC status code a fenced session ends with: a newer session of its producer took over."""

INITIAL_RECORD_BYTES = 1024
"""Bytes per record the memory budget assumes until records were seen."""
_EWMA_RECORDS = 1024
"""The bytes-per-record averages weigh each record, over about this many of the latest: weighing each
batch alike, one batch of a single 30 MiB record kept a stream's estimate at MiBs for some 80 batches
of small records, and new producers (budgeted at the stream's estimate) got almost no credit."""
_MEMORY_LOG_EVERY = 60.0  # seconds: memory-budget pauses are logged at WARNING at most this often
_SHORT_WITHIN = 0.5  # seconds: an owner short of room this recently lets silent over-share sessions go
_ROOM_POLL = 0.1
# seconds: how often the block generator of a stream with no session and nothing pending looks in (its
# disk budget); it ticks every credit_tick otherwise. A new session or a wanted seal wakes it at once.
_IDLE_TICK = 1.0
"""Seconds between looks of a session waiting for room to read (room_to_read) at its own state."""

MEMORY_BUDGET = "memory_budget"
SERVER_MEMORY = "server_memory_budget"
"""Every stream's records together fill the server's memory budget (ReceiverConfig.memory_budget_bytes)."""
DISK_BUDGET = "disk_budget"
DISK_ERROR = "disk_error"
REPLICATION = "replication"
RATE_HOLD = "rate_hold"
"""The rate controller holds intake for a moment (ratecontrol: RateEstimator.intake_held)."""
PAUSE_REASONS = (MEMORY_BUDGET, SERVER_MEMORY, DISK_BUDGET, DISK_ERROR, REPLICATION, RATE_HOLD)
"""Why credit can be paused (the `reason` label of sluice_credit_paused)."""


class _SealWanted(asyncio.Event):
    """Set when a seal is wanted; it also ends the block generator's sleep between ticks. A future and
    a timer a tick rather than asyncio.wait_for, which made a task a tick: 1,000 idle streams took a
    core with it."""

    def __init__(self) -> None:
        super().__init__()
        self._sleeper: asyncio.Future[None] | None = None

    def set(self) -> None:
        super().set()
        self.wake()

    def wake(self) -> None:
        """End the sleep now (the seal is not wanted for it)."""
        if self._sleeper is not None and not self._sleeper.done():
            self._sleeper.set_result(None)

    async def sleep(self, timeout: float) -> None:
        """Until set, wake() or `timeout` seconds."""
        if self.is_set():
            return
        loop = asyncio.get_running_loop()
        sleeper: asyncio.Future[None] = loop.create_future()
        self._sleeper = sleeper
        timer = loop.call_later(timeout, self.wake)
        try:
            await sleeper
        finally:
            self._sleeper = None
            timer.cancel()


@dataclass
class ReceiverStats:
    """Counters of one receiver, read by the metrics exporter."""

    records_received: int = 0
    batches_received: int = 0
    records_acked: int = 0
    records_not_accepted: int = 0
    blocks_sealed: int = 0
    block_bytes: int = 0
    block_write_errors: int = 0
    sessions_opened: int = 0
    sessions_failed: int = 0
    sessions_cancelled: int = 0
    credit_granted: int = 0
    records_deduplicated: int = 0
    """Records dropped because their (producer id, sequence number) had been accepted before."""
    sessions_fenced: int = 0
    """Sessions cancelled because a newer session of the same producer opened."""
    sessions_idle: int = 0
    """Sessions cancelled (UNAVAILABLE) after holding credit unused for their principal's idle_timeout."""
    sessions_reclaimed: int = 0
    """Sessions cancelled (UNAVAILABLE) to take back credit their owner held over its fair share, unused
    for reclaim_after, while another owner waited for room."""
    credit_pauses: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PAUSE_REASONS, 0))
    """Reason -> times credit was paused for it."""
    credit_paused_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PAUSE_REASONS, 0.0))
    """Reason -> seconds credit was paused for it, pauses that ended (see Receiver.paused_seconds)."""


@dataclass
class ProducerState:
    """What the receiver knows of one (non-anonymous) producer."""

    accepted_up_to: int
    """The sequence number after the last record accepted (buffered or durable)."""
    durable_up_to: int
    """Every record below this sequence number is durable."""
    sessions: list[Session] = field(default_factory=list)
    """Its sessions on this receiver not yet ended, the newest last (older ones are fenced)."""


@dataclass
class _Owner:
    """What one owner (receivers.fairness.owner_of) has in this receiver."""

    sessions: int = 0
    buffered: int = 0
    """Records taken and not yet in a durable block."""
    buffered_bytes: int = 0
    record_bytes_avg: float = float(INITIAL_RECORD_BYTES)
    record_bytes_last: float = float(INITIAL_RECORD_BYTES)
    records_seen: bool = False


@dataclass
class _Chunk:
    records: pa.RecordBatch
    session: Session
    end_seq: int
    nbytes: int


class _Unwritten(NamedTuple):
    """A block write that failed with an OSError: its records, records after it not tried yet (pending
    again after them), and the error."""

    block: list[_Chunk]
    after: list[_Chunk]
    error: OSError


class Receiver:
    """Receiver of one stream on this node."""

    def __init__(
        self,
        stream: str,
        store: BlockStore,
        config: ReceiverConfig | None = None,
        *,
        rate: float = UNLIMITED,
        clock: Callable[[], float] = time.monotonic,
        pool: MemoryPool | None = None,
    ) -> None:
        """`pool`: the memory the server's receivers share (memory_budget_bytes); None: one of its own."""
        self.stream = check_stream_name(stream)
        self.store = store
        self.config = config or ReceiverConfig()
        self.stats = ReceiverStats()
        self.tap: Subject[pa.RecordBatch] = Subject()
        """Every accepted batch (BLOCK_SCHEMA), for in-process consumers; emitted on the event loop."""
        self._clock = clock
        self._bucket = TokenBucket(rate, now=clock())
        self._sessions: list[Session] = []
        self._owners: dict[str, _Owner] = {}
        self._rotation = 0
        self._short_at = -math.inf  # when an owner under its fair share last found no room
        self._over_share: set[str] = set()  # owners holding more than their fair share, last round
        self._pending: list[_Chunk] = []
        self._pending_records = self._pending_bytes = 0
        self._seal_wanted = _SealWanted()
        self._room = asyncio.Event()  # set when the buffer's bytes fall: sessions waiting to read go on
        self._seal_rounds = 0  # seals the block generator has run (written or failed)
        self._sealing = False  # a seal is running: what is pending now goes into the next one
        self._seal_waiters: list[tuple[int, asyncio.Future[None]]] = []  # (round to wait for, waiter)
        self._last_batch_at = -math.inf  # when a batch last added pending records (clock)
        self._linger: asyncio.TimerHandle | None = None  # the block_linger check, while records pend
        self._buffered = self._buffered_bytes = 0
        self._pool = pool if pool is not None else MemoryPool()
        self._waiting_to_read = 0  # sessions held unread by a full budget (room_to_read)
        self._outstanding = 0
        self._record_bytes_avg = float(INITIAL_RECORD_BYTES)
        self._record_bytes_last = float(INITIAL_RECORD_BYTES)
        self._paused: dict[str, float] = {}  # reason -> since (clock)
        self._credit_starved_at = -math.inf  # when the rate last held back a session out of credit
        self._pause_logged: set[str] = set()
        self._memory_logged_at = -math.inf
        self._disk_used: int | None = None
        self._disk_polled_at = -math.inf
        self._write_error: str | None = None
        # bytes a block may hold while the disk lacks room for a whole one (None: blocks of normal size):
        # halved by each write that fails for lack of room, doubled by each that succeeds; a block
        # holds one message (chunk) at least. _space_cut: the last block taken was cut short by it
        self._space_cap: int | None = None
        self._space_cut = False
        self._replication_status = ""
        self._next_block_seq, self._next_offset = store.recover(self.stream)
        self._pool.join(self)  # once recovered: a receiver that failed to start is no member
        self._task: asyncio.Task[None] | None = None
        self._unwatch_durable: Callable[[], None] | None = None
        self._stopping = False
        # per recent block: its first offset, and (first offset, arrival time) of each batch in it, in
        # arrays (16 bytes a batch: a block holds a batch of every busy session); forgotten below
        # what Spark committed (`committed`), and beyond _ARRIVALS_KEPT blocks without commits
        self._arrivals: deque[tuple[int, array[int], array[float]]] = deque(maxlen=_ARRIVALS_KEPT)
        self._commits: deque[int] = deque(maxlen=_COMMITS_KEPT)
        # written blocks not yet durable (fsync interval): (seq, anonymous sessions' acks, producer marks)
        self._awaiting_durable: deque[tuple[int, dict[Session, int], dict[str, int]]] = deque()
        self._producers: ProducerTable[ProducerState] = ProducerTable()
        for producer, mark in store.producers(self.stream).items():
            self._producers.add(producer, ProducerState(mark, mark))
        self._evict_producers()

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            if self.config.disk_budget_bytes is not None:  # measured before the first grant
                self._disk_polled_at = self._clock()
                self._disk_used = await asyncio.to_thread(self.store.disk_bytes)
                self._set_paused(DISK_BUDGET, self._disk_used >= self.config.disk_budget_bytes)
            loop = asyncio.get_running_loop()

            def durable_moved() -> None:  # the store's thread (a background fsync)
                with contextlib.suppress(RuntimeError):  # the loop closed: nothing left to ack
                    loop.call_soon_threadsafe(self._ack_durable)

            self._unwatch_durable = self.store.on_durable(self.stream, durable_moved)
            self._task = asyncio.create_task(self._run(), name=f"receiver-{self.stream}")
            self._task.add_done_callback(self._run_ended)

    def _run_ended(self, task: asyncio.Task[None]) -> None:
        self._release_seal_waiters(everyone=True)  # no seal comes any more
        self._cancel_linger()
        # the block generator must never die quietly: clients would wait for acks forever
        if task.cancelled() or task.exception() is None:
            return
        log.error("block generator of stream %r died", self.stream, exc_info=task.exception())
        self._stopping = True
        self._pool.leave(self, self._buffered_bytes)  # its records will never be written: let them go
        error = ReceiverStopped(f"receiver for stream {self.stream!r} failed: {task.exception()!r}")
        for session in list(self._sessions):
            self.fail(session, error, ack_first=False)

    async def stop(self, *, code: int = UNAVAILABLE, reason: str = "receiver stopping") -> None:
        """Stop granting credit, seal and ack what was taken, then cancel every session with `code` and
        `reason` (UNAVAILABLE by default: a restart, the client retries; a removed stream says so)."""
        if self._stopping:
            return
        self._stopping = True
        try:
            self._room.set()
            self._cancel_linger()
            if self._task is not None:
                # let the block generator finish the seal it may be in, rather than cancel it: a block
                # written but cancelled before its bookkeeping would be in the log and never acked
                self._seal_wanted.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            await self._seal()
            self._release_seal_waiters(everyone=True)
            if self._awaiting_durable:
                # group commit: make the last blocks durable now rather than at the next background fsync
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(self.store.flush)
                self._ack_durable()
            if self._unwatch_durable is not None:
                self._unwatch_durable()
            for session in list(self._sessions):
                if session.completed and session.durable_up_to == session.next_seq:
                    session.outbox.finish()
                else:
                    self.cancel(session, code, reason)
                # records whose block could not be written are not acked: end the call all the same
                session.outbox.finish(ReceiverStopped(f"receiver for stream {self.stream!r} stopped"))
            if self._buffered:
                log.warning(
                    "stream %r: %d records taken and never made durable are dropped with the stop (%s); they "
                    "were not acked: their producers send them again",
                    self.stream,
                    self._buffered,
                    self._write_error or "not written",
                )
            self.tap.on_completed()
        finally:  # cancelled part-way too: stop() does not run twice
            self._pool.leave(self, self._buffered_bytes)  # what no write took is dropped with it

    # ---- rate ----------------------------------------------------------------------------------

    @property
    def rate(self) -> float:
        return self._bucket.rate

    def set_rate(self, rate: float) -> None:
        """Meter credit at `rate` records/s from now on (inf: unlimited). Raises InvalidRateError."""
        self._bucket.set_rate(rate, self._clock())
        self._replenish()

    def credit_starved(self, within: float) -> bool:
        """Whether, within the last `within` seconds, a session ran (almost) out of credit while the rate
        had none to give it: the stream's publishers want more than its share of the node's rate. The
        demand signal the rate controller splits the rate by (with stats.records_received)."""
        return self._clock() - self._credit_starved_at <= within

    # ---- state read by metrics and operators ---------------------------------------------------

    @property
    def credit_outstanding(self) -> int:
        return self._outstanding

    @property
    def buffered_records(self) -> int:
        return self._buffered

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the records taken and not yet in a durable block."""
        return self._buffered_bytes

    @property
    def record_bytes_estimate(self) -> float:
        """Bytes per record the memory budget assumes for outstanding credit."""
        return max(self._record_bytes_avg, self._record_bytes_last, 1.0)

    def owner_record_bytes(self, owner: str) -> float:
        """Bytes per record the memory budget assumes for `owner`'s credit: its own estimate once it sent
        records (big records of one client must not shrink everyone's credit), the stream's before."""
        state = self._owners.get(owner)
        if state is None or not state.records_seen:
            return self.record_bytes_estimate
        return max(state.record_bytes_avg, state.record_bytes_last, 1.0)

    @property
    def committed_bytes(self) -> float:
        """What the memory budget counts: bytes buffered plus each owner's outstanding credit at its
        bytes per record."""
        credit: dict[str, int] = {}
        for session in self._sessions:
            if session.credit > 0:
                credit[session.owner] = credit.get(session.owner, 0) + session.credit
        return self._buffered_bytes + sum(n * self.owner_record_bytes(o) for o, n in credit.items())

    @property
    def disk_used(self) -> int | None:
        """The block store's bytes on disk as last measured (None: not measured: no disk budget)."""
        return self._disk_used

    @property
    def paused(self) -> dict[str, float]:
        """Why credit is paused now: reason (see PAUSE_REASONS) -> since when (the receiver's clock)."""
        return dict(self._paused)

    def paused_seconds(self, reason: str) -> float:
        """Seconds credit was paused for `reason`, the current pause included."""
        since = self._paused.get(reason)
        current = self._clock() - since if since is not None else 0.0
        return self.stats.credit_paused_seconds.get(reason, 0.0) + current

    @property
    def active_sessions(self) -> int:
        return len(self._sessions)

    def reconfigure(self, config: ReceiverConfig) -> None:
        """Take new buffering, credit and sealing settings at run time (its receiver id is kept). Credit
        and budgets follow at the next refill; a new block interval at once (the block being filled is
        sealed now, the next one after the new interval)."""
        old = self.config
        self.config = dataclasses.replace(config, receiver_id=old.receiver_id)
        if (config.block_interval, config.seal_at, config.seal_bytes) != (
            old.block_interval,
            old.seal_at,
            old.seal_bytes,
        ):
            self._seal_wanted.set()
        self._room.set()  # a larger budget lets waiting sessions read on
        if config.block_linger != old.block_linger:
            self._cancel_linger()
            if self._pending:
                self._arm_linger()
        self._replenish()

    @property
    def sessions(self) -> list[Session]:
        return list(self._sessions)

    def producer(self, producer_id: str, principal: Principal = ANONYMOUS) -> ProducerState | None:
        """The table entry of `principal`'s producer, if it is known (for operators and tests)."""
        return self._producers.get(producer_key(principal, producer_id))

    def producer_state(self, key: str) -> ProducerState | None:
        """The table entry of a producer key (receivers.principal.producer_key)."""
        return self._producers.get(key)

    def learn_producer_mark(self, key: str, mark: int) -> None:
        """Another node holds this producer's records below `mark` (copies of a failed node's blocks):
        take them as accepted and durable here, so that a resend of them is dropped as duplicates and
        acked. Left alone while the producer has records here not durable yet."""
        state = self._producers.get(key)
        if state is None:
            self._producers.add(key, ProducerState(mark, mark))
            self._evict_producers()
        elif mark > state.accepted_up_to and state.durable_up_to >= state.accepted_up_to:
            state.accepted_up_to = state.durable_up_to = mark

    def ack_durable(self) -> None:
        """Ack what became durable since the last look (the store says so: e.g. a follower acked)."""
        self._ack_durable()

    def hold_credit(self, held: bool) -> None:
        """Grant no new credit while `held`, whatever the rate (the rate controller's short pauses:
        a rate of min_rate would still let records trickle in); released, credit flows at once."""
        if held == (RATE_HOLD in self._paused):
            return
        self._set_paused(RATE_HOLD, held)
        if not held:
            self._replenish()

    def set_replication_paused(self, paused: bool, status: str) -> None:
        """Withhold new credit while too few copies are in sync to ack (receivers.replication)."""
        self._replication_status = status
        self._set_paused(REPLICATION, paused)

    @property
    def known_producers(self) -> int:
        return len(self._producers)

    def received_at(self, offset: int) -> float | None:
        """When the record at stream offset `offset` was taken (epoch seconds), if this receiver sealed
        it lately: the start of a batch minus this is how long the batch's oldest record waited."""
        arrivals = self._arrivals
        if not arrivals or offset < arrivals[0][0]:
            return None
        block = bisect.bisect_right(arrivals, offset, key=lambda a: a[0]) - 1
        _, offsets, times = arrivals[block]
        if block == len(arrivals) - 1 and offset >= self._next_offset:
            return None  # not sealed yet (or never)
        return times[bisect.bisect_right(offsets, offset) - 1]

    def committed(self, end: int) -> None:
        """Spark committed a batch ending at stream offset `end`: arrival times from before the end of
        the third-last commit are forgotten (no batch's metrics ask for them any more), so what is kept
        follows the backlog, not the time the server has run."""
        self._commits.append(end)
        if len(self._commits) < _COMMITS_KEPT:
            return
        below = min(self._commits)
        arrivals = self._arrivals
        while len(arrivals) > 1 and arrivals[1][0] <= below:
            arrivals.popleft()  # the block after it starts at or below: nothing in it is asked for

    @property
    def arrivals_kept(self) -> int:
        """Blocks whose arrival times are remembered (for tests and diagnosis)."""
        return len(self._arrivals)

    @property
    def log_end(self) -> tuple[int, int]:
        """(seq, record offset) of the next block this receiver seals."""
        return self._next_block_seq, self._next_offset

    def continue_at(self, seq: int, offset: int) -> None:
        """Before start: the log goes on at block `seq`, record `offset` (its store skipped there: a
        cluster node whose own log is behind a copy of it, ReceiverNode.continue_logs)."""
        if self._task is not None:
            raise RuntimeError("continue_at after start")
        self._next_block_seq = max(self._next_block_seq, seq)
        self._next_offset = max(self._next_offset, offset)

    # ---- sessions ------------------------------------------------------------------------------

    def open_session(
        self,
        producer_id: str,
        resume_from_seq: int,
        principal: Principal = ANONYMOUS,
        *,
        resume: bool = False,
        fresh: bool = False,
        token_sha256: str | None = None,
    ) -> Session:
        """onSubscribe: `principal` opened a session; it gets its prefetch as far as the buffer allows.
        `resume` (Open.resume): the producer must be known here, else SequenceGap (OUT_OF_RANGE).
        `fresh` (Open.fresh): a new run of the producer; ProducerExists (ALREADY_EXISTS) if records of
        it at or beyond `resume_from_seq` were taken already (from this node's log, its producer table,
        or another node's mark learnt before: learn_producer_mark).
        `token_sha256`: the hash of the bearer token it came with (kept to revoke it on an auth reload)."""
        if self._stopping:
            raise ReceiverStopped(f"receiver for stream {self.stream!r} is stopping; retry later")
        # validated before anything is registered: these values end up in the block log's headers
        check_producer_id(producer_id)
        check_seq_range(resume_from_seq, 0, "Open.resume_from_seq")
        check_open_flags(fresh=fresh, resume=resume)
        known_state = self._producers.get(producer_key(principal, producer_id)) if producer_id else None
        if fresh and known_state is not None and known_state.accepted_up_to > resume_from_seq:
            expected = known_state.accepted_up_to
            raise ProducerExists(
                f"producer {shown(producer_id)} already has records on stream {self.stream!r}: the next "
                f"sequence number it expects of it is {expected}, and this new run starts at "
                f"{resume_from_seq}, so its records {resume_from_seq}..{expected - 1} would be dropped as "
                f"duplicates of the earlier run's. To go on after that run, start at {expected} "
                f"(first_seq={expected}; sluice push: --resume-from {expected} with the same input); to "
                "resend an earlier run's records from where its acks ended, resume (resume=True); else "
                "use a new producer id",
                expected,
            )
        known = known_state is not None
        if resume and resume_from_seq > 0 and producer_id and not known:
            raise SequenceGap(
                f"producer {producer_id!r} is not known on stream {self.stream!r}: nothing to resume from "
                f"sequence number {resume_from_seq} (a mistyped producer id, or one forgotten after "
                f"{self.config.max_producers:,} newer producers); the records before it would never be sent"
            )
        seq = resume_from_seq
        session = Session(SESSION_IDS.next(), self.stream, producer_id, seq, seq, principal=principal)
        session.token_sha256 = token_sha256
        session.owner = owner_of(principal, producer_id, session.id)
        session.active_at = self._clock()
        self._owners.setdefault(session.owner, _Owner()).sessions += 1
        if producer_id:
            key = session.producer_key  # the id scoped by principal: another principal's is another producer
            state = self._producers.get(key)
            if state is None:
                # unknown (new, or forgotten): take it from its resume point
                state = ProducerState(resume_from_seq, resume_from_seq)
                self._producers.add(key, state)
                self._evict_producers()
            else:
                self._producers.touch(key)
                reason = f"superseded by a newer session of producer {producer_id!r}"
                for old in state.sessions:
                    if self.cancel(old, ABORTED, reason):
                        self.stats.sessions_fenced += 1
            state.sessions.append(session)
        self._sessions.append(session)
        self.stats.sessions_opened += 1
        self._replenish()
        self._seal_wanted.wake()  # an idle stream's block generator looks in seldom: it ticks for sessions
        return session

    def _evict_producers(self) -> None:
        """Forget producers beyond max_producers, the least recently used of the principal with the most
        first (receivers.producer_table), but none with a session open or records not yet durable (their
        durable mark must still be applied when the block is sealed)."""
        self._producers.evict(
            self.config.max_producers,
            lambda state: not state.sessions and state.durable_up_to >= state.accepted_up_to,
        )

    @property
    def over_memory_budget(self) -> bool:
        """The records taken and not yet durable hold the whole memory budget, the stream's or the
        server's (a compare or two: asked before every message read)."""
        if self._buffered_bytes >= self.config.buffer_bytes:
            return True
        limit = self.config.memory_budget_bytes
        return limit is not None and self._pool.held >= limit

    def pool_room(self) -> None:
        """The server's memory pool has room again (another stream's block was written)."""
        self._room.set()
        self._replenish()

    async def room_to_read(self, session: Session) -> None:
        """Return once the memory budget has room for `session`'s next message (or the session or the
        receiver ends). Credit counts records and is sized with an estimate of their bytes: records
        larger than it (a first grant sized at INITIAL_RECORD_BYTES, a producer that switches to large
        records) would fill memory without bound. Its next message stays unread instead, and gRPC's flow
        control holds its producer back until blocks are written: the buffer exceeds the budget by at
        most one message per session."""
        while self.over_memory_budget and not (self._stopping or session.ended or session.cancelled):
            if self._pending and DISK_ERROR not in self._paused:  # a failing write keeps its own pace
                self._seal_wanted.set()  # what is pending goes to the log now: its write makes room
            limit = self.config.memory_budget_bytes
            if limit is not None and self._pool.held >= limit:
                self._pool.short(self, True)  # room another stream's write frees wakes this one too
            self._room.clear()
            self._waiting_to_read += 1
            try:
                with contextlib.suppress(TimeoutError):  # and looks again: the session may have ended
                    await asyncio.wait_for(self._room.wait(), _ROOM_POLL)
            finally:
                self._waiting_to_read -= 1

    def check_credit(self, session: Session, count: int) -> None:
        """ProtocolViolation if a batch of `count` records exceeds the session's credit (rule 1.1). Asked
        before a batch is decoded as well: a batch far over its credit costs nothing to refuse. (A
        cancelled, ended or completed session's batch is accept()'s to drop or refuse.)"""
        if count > session.credit and not (session.cancelled or session.ended or session.completed):
            raise ProtocolViolation(
                f"Batch of {count} records exceeds the {session.credit} credits outstanding (rule 1.1): "
                "send at most what Request(n) granted"
            )

    def accept(self, session: Session, first_seq: int, records: pa.RecordBatch) -> None:
        """onNext for each record of a batch; raise a ReceiverError when it breaks the protocol."""
        count = records.num_rows
        if session.cancelled or session.ended or self._stopping:
            # in flight when the Cancel went out (or the call ended): not accepted, as
            # Cancel.accepted_up_to told the client. Stopping: the stop seals what was taken before it,
            # then waits for that write; a batch taken meanwhile would be in no block, never acked,
            # yet below the accepted_up_to of the Cancel the stop sends
            self.stats.records_not_accepted += count
            return
        if session.completed:
            raise ProtocolViolation("Batch after Complete (rule 1.7): the publisher signalled completion")
        self.check_credit(session, count)
        if first_seq != session.next_seq:
            raise InvalidBatch(
                f"Batch.first_seq is {first_seq} but this session's next sequence number is "
                f"{session.next_seq}: records must be numbered consecutively, without repeats"
            )
        check_seq_range(first_seq, count, "Batch.first_seq")
        state = self._producers.get(session.producer_key) if session.producer_id else None
        duplicates = 0
        if state is not None:
            if first_seq > state.accepted_up_to:
                raise SequenceGap(
                    f"Batch.first_seq is {first_seq} but producer {session.producer_id!r} is expected to "
                    f"continue at sequence number {state.accepted_up_to}: records "
                    f"{state.accepted_up_to}..{first_seq - 1} are missing"
                )
            duplicates = min(count, state.accepted_up_to - first_seq)
        elif session.producer_id:
            # forgotten while its session was open (cannot happen: eviction skips those); start over
            state = ProducerState(first_seq, first_seq, [session])
            self._producers.add(session.producer_key, state)
        # the buffers the batch holds in memory (a slice of it below holds them all as well); computed
        # once: RecordBatch.nbytes (the ranges each column refers to) costs 50x as much
        nbytes = records.get_total_buffer_size()
        self._observe_record_bytes(nbytes, count, self._owners[session.owner])
        session.active_at = self._clock()
        session.credit -= count
        self._outstanding -= count  # duplicates' credit returns to the pool: they take no buffer room
        session.next_seq += count
        self.stats.batches_received += 1
        if duplicates:
            self.stats.records_deduplicated += duplicates
            records = records.slice(duplicates)
        if count > duplicates:
            self._buffer(session, records, nbytes)
        if state is not None:
            state.accepted_up_to = max(state.accepted_up_to, session.next_seq)
            if duplicates:
                self._ack(session, min(session.next_seq, state.durable_up_to))
        self._replenish()

    def _buffer(self, session: Session, records: pa.RecordBatch, nbytes: int) -> None:
        """Take `records` (new ones, ending at the session's next seq) into the next block."""
        fresh = records.num_rows
        self._buffered += fresh
        self._buffered_bytes += nbytes
        self._pool.take(nbytes, self)
        owner = self._owners[session.owner]
        owner.buffered += fresh
        owner.buffered_bytes += nbytes
        self._pending.append(_Chunk(records, session, session.next_seq, nbytes))
        self._pending_records += fresh
        self._pending_bytes += nbytes
        self._last_batch_at = session.active_at
        if self._block_full():
            self._seal_wanted.set()
        elif self._linger is None:
            self._arm_linger()
        self.stats.records_received += fresh
        self.tap.on_next(records)

    def _observe_record_bytes(self, nbytes: int, count: int, owner: _Owner) -> None:
        """Feed the bytes-per-record estimates of the memory budget (the stream's and the owner's) with a
        batch of `count` records in `nbytes` (duplicates included: they show what the producer sends)."""
        if count:
            per_record = nbytes / count
            # `count` records' worth of the average, from the assumption before any (INITIAL_RECORD_BYTES):
            # a first batch of one huge record does not set it alone (`last` has it while it lasts)
            weight = 1 - (1 - 1 / _EWMA_RECORDS) ** count
            self._record_bytes_last = per_record
            self._record_bytes_avg += weight * (per_record - self._record_bytes_avg)
            owner.record_bytes_last = per_record
            owner.record_bytes_avg += weight * (per_record - owner.record_bytes_avg)
            owner.records_seen = True

    def complete(self, session: Session) -> None:
        """onComplete: return the session's credit; end the call once everything it sent is acked."""
        if session.completed:
            raise ProtocolViolation("Complete sent twice (rule 1.7)")
        session.completed = True
        self._take_back_credit(session)
        self._end_if_settled(session)
        self._replenish()

    def cancel(self, session: Session, code: int, reason: str) -> bool:
        """Cancel a session (rule 3.5: idempotent). Returns False if it was already cancelled or ended.

        The client gets Cancel{code, reason, accepted_up_to}; what it sent before is acked once durable,
        then the call ends with status `code`. What it sends after is dropped as not accepted.
        """
        if session.cancelled or session.ended or session.completed:
            return False
        reason = cut(reason)  # an operator's reason becomes the call's status message: keep it short
        session.cancelled = True
        session.cancel_error = SessionCancelled(code, reason)
        self.stats.sessions_cancelled += 1
        self._take_back_credit(session)
        session.outbox.cancel(pb.Cancel(code=code, reason=reason, accepted_up_to=session.next_seq))
        self._end_if_settled(session)
        self._replenish()
        return True

    def fail(self, session: Session, error: ReceiverError, *, ack_first: bool = True) -> None:
        """End a session with an error status. Its records already taken are still sealed and, unless
        `ack_first` is False (they never will be), acked before the error ends the call: what a client
        sent before its mistake is then acked or refused, never stored without its knowing."""
        if session.ended:
            return
        error = detached(error)  # kept by the session until its call ends
        self.stats.sessions_failed += 1
        log.warning(
            "session %d on stream %r (producer %r) ends with %s: %s",
            session.id,
            self.stream,
            session.producer_id,
            error.status,
            error,
        )
        if ack_first and not session.cancelled and session.durable_up_to < session.next_seq:
            # a Cancel without the message: nothing more is taken, the error follows the last ack
            session.cancelled = True
            session.cancel_error = error
            self._take_back_credit(session)
            self._replenish()
            return
        session.outbox.finish(error)
        self.close_session(session)

    def close_session(self, session: Session) -> None:
        """Forget a session (its call ended); unused credit returns to the pool."""
        if session in self._sessions:
            self._sessions.remove(session)
            state = self._producers.get(session.producer_key) if session.producer_id else None
            if state is not None and session in state.sessions:
                state.sessions.remove(session)
            self._take_back_credit(session)
            owner = self._owners.get(session.owner)
            if owner is not None:
                owner.sessions -= 1
                self._forget_owner(session.owner)
            session.outbox.finish()
            self._replenish()

    def _forget_owner(self, key: str) -> None:
        """Drop an owner with no session and nothing buffered (its share is free for the others)."""
        owner = self._owners.get(key)
        if owner is not None and owner.sessions <= 0 and owner.buffered <= 0:
            del self._owners[key]

    def _unbuffer(self, chunks: list[_Chunk]) -> None:
        """The chunks left the buffer (sealed, or dropped): their owners hold them no more, nor does the
        server's memory pool."""
        self._pool.release(sum(c.nbytes for c in chunks), self)
        for chunk in chunks:
            owner = self._owners.get(chunk.session.owner)
            if owner is not None:
                owner.buffered -= chunk.records.num_rows
                owner.buffered_bytes -= chunk.nbytes
                self._forget_owner(chunk.session.owner)

    def _take_back_credit(self, session: Session) -> None:
        self._outstanding -= session.credit
        session.credit = 0

    def _end_if_settled(self, session: Session) -> None:
        if session.durable_up_to == session.next_seq:
            if session.cancelled:
                session.outbox.finish(session.cancel_error)
            elif session.completed:
                session.outbox.finish()

    def _replenish(self) -> None:
        """Top up sessions at or below low tide within buffer, budgets and rate, fairly by owner
        (receivers.fairness): an owner holding its share of the buffer gets nothing more while others
        want, and a round's room and tokens are split among the owners that want; each owner's grant
        goes to its sessions in rotating order."""
        if self._stopping:
            return
        active = [s for s in self._sessions if s.accepting]
        refill_at = self.config.refill_at
        prefetch = self.config.fill_to
        wanting = [s for s in active if s.credit <= refill_at]
        if not wanting:  # the common case under load: cheap
            self._set_paused(MEMORY_BUDGET, False)
            self._set_paused(SERVER_MEMORY, False)
            if not self._waiting_to_read:  # sessions held unread still want their share of the room
                self._pool.short(self, False)
            return
        estimates = {key: self.owner_record_bytes(key) for key in self._owners}
        smallest = min((estimates[s.owner] for s in wanting), default=self.record_bytes_estimate)
        empty = self._buffered == 0 and self._outstanding <= 0
        free_bytes = self._free_bytes(smallest, empty)
        by_bytes = math.floor(free_bytes / smallest)
        if DISK_ERROR in self._paused or DISK_BUDGET in self._paused or RATE_HOLD in self._paused:
            return
        free = self.config.buffer_records - self._buffered - self._outstanding
        budget_bytes: float = self.config.budget_bytes  # the owners' shares: of what the stream may hold
        if by_bytes < 1 and empty:
            # a budget below one record slows ingestion to a record at a time, never stalls it
            free, free_bytes, budget_bytes = min(free, 1), math.inf, math.inf
        self._rotation += 1
        now = self._clock()
        # under a rate, credit goes out a tick's worth at a time (the block generator tops up every
        # tick), not a few records per accepted batch, which made both sides spin on tiny messages
        rate = self._bucket.rate
        quantum = math.ceil(rate * self.config.credit_tick) if math.isfinite(rate) else 1  # rate > 0
        demands = self._owner_demands(active, wanting, estimates)
        tokens = self._bucket.available(now)
        wanted = sum(d.want for d in demands.values())
        if math.isfinite(tokens) and tokens < min(wanted, quantum, self._bucket.burst // 1):
            tokens = 0.0  # too few to be worth a message: wait for a tick's worth
        order = [key for key, demand in demands.items() if demand.want > 0]
        turn = self._rotation % len(order)
        allocation = allocate(
            demands,
            order[turn:] + order[:turn],
            buffer_records=self.config.buffer_records,
            buffer_bytes=budget_bytes,
            free_records=max(0, free),
            free_bytes=max(0.0, free_bytes),
            tokens=tokens,
        )
        self._over_share = {str(key) for key in allocation.over}
        if allocation.short:
            self._short_at = now
        total = sum(allocation.grants.values())
        if total > 0:
            self._bucket.take(total, now)
        for key, grant in allocation.grants.items():
            mine = [s for s in wanting if s.owner == key]
            turn = self._rotation % len(mine)
            left = grant
            for session in mine[turn:] + mine[:turn]:
                n = min(prefetch - session.credit, left)
                if n > 0:
                    self._grant(session, n)
                    left -= n
        held_back = allocation.rate_limited or (tokens == 0 and free > 0)
        if held_back and any(s.credit < quantum for s in active):
            # the rate holds back a session that has under a tick's worth left: its publisher
            # wants more than the stream's share (a quiet one keeps credit saved up instead)
            self._credit_starved_at = now

    def _free_bytes(self, smallest: float, empty: bool) -> float:
        """Bytes this stream may still commit within its memory budget and the server's (records of at
        least `smallest` bytes want room); pauses credit for the one that is full. Either way the round
        goes on: its owners' shares mark who is short, and a session hoarding credit is reclaimed."""
        free_bytes = self.config.buffer_bytes - self.committed_bytes
        stream_full = free_bytes < smallest
        pool_full = False
        limit = self.config.memory_budget_bytes
        if limit is not None:
            pool_bytes = self._pool.room_for(self, limit)
            # short: the server's budget, not the stream's, keeps this stream from a full top-up
            self._pool.short(self, pool_bytes < min(free_bytes, smallest * self.config.fill_to))
            pool_full = pool_bytes < smallest
            if pool_full and self._pending and DISK_ERROR not in self._paused:
                self._seal_wanted.set()  # what waits goes to the log now: its write makes room
            free_bytes = min(free_bytes, pool_bytes)
        self._set_paused(MEMORY_BUDGET, stream_full and not empty)
        self._set_paused(SERVER_MEMORY, pool_full and not stream_full and not empty)
        return free_bytes

    def _owner_demands(
        self, active: list[Session], wanting: list[Session], estimates: dict[str, float]
    ) -> dict[str, OwnerDemand]:
        """Each owner's holdings and wishes in this round (receivers.fairness.OwnerDemand)."""
        prefetch = self.config.fill_to
        want: dict[str, int] = dict.fromkeys(self._owners, 0)
        for session in wanting:
            want[session.owner] += prefetch - session.credit
        reserve: dict[str, int] = dict.fromkeys(self._owners, 0)
        for session in active:
            reserve[session.owner] += prefetch
        credit: dict[str, int] = dict.fromkeys(self._owners, 0)
        for session in self._sessions:
            credit[session.owner] += max(0, session.credit)
        return {
            key: OwnerDemand(
                held_records=owner.buffered + credit[key],
                held_bytes=owner.buffered_bytes + credit[key] * estimates[key],
                want=want[key],
                record_bytes=estimates[key],
                reserve=reserve[key],
            )
            for key, owner in self._owners.items()
        }

    # ---- credit pauses -------------------------------------------------------------------------

    def _set_paused(self, reason: str, paused: bool) -> None:
        """Record a transition of `reason` (no-op without one); log it and count it."""
        if paused == (reason in self._paused):
            return
        now = self._clock()
        if paused:
            self._paused[reason] = now
            self.stats.credit_pauses[reason] += 1
            level = logging.DEBUG if reason == RATE_HOLD else logging.WARNING
            if reason in (MEMORY_BUDGET, SERVER_MEMORY):
                if now - self._memory_logged_at < _MEMORY_LOG_EVERY:
                    level = logging.DEBUG
                else:
                    self._memory_logged_at = now
            if level == logging.WARNING:
                self._pause_logged.add(reason)
            log.log(level, "stream %r: credit paused: %s", self.stream, self._pause_text(reason))
            return
        since = self._paused.pop(reason)
        self.stats.credit_paused_seconds[reason] += now - since
        level = logging.INFO if reason in self._pause_logged else logging.DEBUG
        self._pause_logged.discard(reason)
        log.log(
            level,
            "stream %r: credit resumed after %.1f s: %s",
            self.stream,
            now - since,
            self._resume_text(reason),
        )

    def _pause_text(self, reason: str) -> str:
        if reason == MEMORY_BUDGET:
            return (
                f"memory budget {_size(self.config.buffer_bytes)} reached ({_size(self._buffered_bytes)} "
                f"buffered + {self._outstanding} records of credit outstanding at "
                f"~{_size(self.record_bytes_estimate)}/record); resumes as blocks are sealed"
            )
        if reason == SERVER_MEMORY:
            return (
                f"the server's memory budget {_size(self.config.memory_budget_bytes or 0)} is full "
                f"({_size(self._pool.held)} buffered by {self._pool.members} streams, and this one's credit "
                "outstanding); resumes as blocks are sealed"
            )
        if reason == REPLICATION:
            status = self._replication_status
            return f"too few copies in sync to ack ({status}); resumes when followers catch up"
        if reason == RATE_HOLD:
            return "the rate controller holds intake while the pipeline drains what piled up"
        if reason == DISK_BUDGET:
            return (
                f"disk budget {_size(self.config.disk_budget_bytes or 0)} reached "
                f"({_size(self._disk_used or 0)} on disk in the block store); resumes when Spark "
                "releases blocks"
            )
        return self._write_error_text()

    def _write_error_text(self) -> str:
        said = (
            f"writing block {self._next_block_seq} failed: {self._write_error}; {self._buffered} records kept"
        )
        if self._space_cap is not None:  # lack of room: what fits is written (_write_failed)
            return (
                f"{said} buffered, written in smaller blocks as far as the disk has room and retried every "
                f"{self.config.block_interval:g} s; resumes when every record taken is written"
            )
        return (
            f"{said} buffered, retried every {self.config.block_interval:g} s; resumes when a write succeeds"
        )

    def _resume_text(self, reason: str) -> str:
        if reason == MEMORY_BUDGET:
            return (
                f"memory budget ({_size(self.committed_bytes)} of {_size(self.config.buffer_bytes)} in use)"
            )
        if reason == DISK_BUDGET:
            budget = self.config.disk_budget_bytes
            if budget is None:
                return "disk budget (taken away at run time)"
            return f"disk budget ({_size(self._disk_used or 0)} on disk of {_size(budget)})"
        limit = self.config.memory_budget_bytes
        in_use = f"{_size(self._pool.held)} buffered of {_size(limit)}" if limit else "taken away at run time"
        texts = {
            SERVER_MEMORY: f"the server's memory budget ({in_use})",
            REPLICATION: f"enough copies in sync ({self._replication_status})",
            RATE_HOLD: "the rate controller's hold ended",
        }
        return texts.get(reason, f"block {self._next_block_seq - 1} written after failed writes")

    async def _check_disk(self) -> None:
        """Poll the store's disk use (at most every disk_poll_interval) against the disk budget; while
        paused for the disk, drop this stream's newest segment if Spark released all of it."""
        budget = self.config.disk_budget_bytes
        if budget is None:
            self._set_paused(DISK_BUDGET, False)  # the budget was taken away at run time
            if DISK_ERROR not in self._paused:
                return
        now = self._clock()
        if now - self._disk_polled_at < self.config.disk_poll_interval:
            return
        self._disk_polled_at = now
        try:
            if DISK_BUDGET in self._paused or DISK_ERROR in self._paused:
                await asyncio.to_thread(self.store.trim, self.stream)
            if budget is not None:
                self._disk_used = await asyncio.to_thread(self.store.disk_bytes)
        except OSError:
            log.debug("stream %r: polling the block store's disk use failed", self.stream, exc_info=True)
            return
        if budget is not None and self._disk_used is not None:
            self._set_paused(DISK_BUDGET, self._disk_used >= budget)

    def _grant(self, session: Session, n: int) -> None:
        session.credit = min(MAX_DEMAND, session.credit + n)
        self._outstanding += n
        self.stats.credit_granted += n
        session.outbox.grant(n)

    def subscription(self, session: Session) -> Subscription:
        """`session` as a Flow Subscription: request(n) sends Request(n) beyond the demand policy (an
        operator's or a test's override; the buffer bound then no longer holds), cancel() sends Cancel."""
        return _SessionSubscription(self, session)

    # ---- block generator -----------------------------------------------------------------------

    async def _run(self) -> None:
        next_seal = self._clock() + self.config.block_interval
        while not self._stopping:
            if self._idle():
                await self._seal_wanted.sleep(max(self.config.credit_tick, _IDLE_TICK))
            else:
                await self._seal_wanted.sleep(
                    max(0.0, min(self.config.credit_tick, next_seal - self._clock()))
                )
            if self._seal_wanted.is_set() or self._clock() >= next_seal:
                self._seal_wanted.clear()
                self._sealing = True
                try:
                    sealed = await self._seal()
                finally:
                    self._sealing = False
                    self._seal_rounds += 1
                    self._release_seal_waiters()
                next_seal = self._clock() + self.config.block_interval
                if sealed and self._block_full():
                    self._seal_wanted.set()  # more piled up during the write; a failed write waits
            self._ack_durable()
            await self._check_disk()
            self._police_idle()
            self._replenish()

    def _idle(self) -> bool:
        """No session, nothing pending, acked or waited for, no pause: nothing to do every tick."""
        return not (
            self._sessions or self._pending or self._awaiting_durable or self._seal_waiters or self._paused
        )

    def _arm_linger(self, delay: float | None = None) -> None:
        """Check for a lull `delay` (default: block_linger) from now. One timer while records pend,
        however many batches come: each check re-arms for what is left of the lull since the last."""
        linger = self.config.block_linger
        if linger is None or self._task is None or self._stopping or DISK_ERROR in self._paused:
            return  # a failing disk is retried every block interval, not at every lull
        self._linger = asyncio.get_running_loop().call_later(
            linger if delay is None else delay, self._linger_due
        )

    def _linger_due(self) -> None:
        self._linger = None
        linger = self.config.block_linger
        if linger is None or not self._pending:
            return  # off, or sealed meanwhile: the next batch arms it again
        rest = self._last_batch_at + linger - self._clock()
        if rest > 0:
            self._arm_linger(rest)
        else:
            self._seal_wanted.set()

    def _cancel_linger(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None

    def _police_idle(self) -> None:
        """End sessions that hold credit and send nothing: after their principal's idle_timeout, or after
        reclaim_after when their owner holds more than its fair share while another owner is short of
        room. Both UNAVAILABLE: the publisher reconnects once it has something to send. A session with
        no credit is waiting for it, which is not idle."""
        now = self._clock()
        reclaim = now - self._short_at <= _SHORT_WITHIN
        for session in list(self._sessions):
            if not session.accepting:
                continue
            if session.credit <= 0:
                session.active_at = now
                continue
            idle = now - session.active_at
            timeout = session.principal.limits.idle_timeout
            if timeout is not None and idle >= timeout:
                reason = (
                    f"idle for {timeout:g} s: no batch while holding {session.credit} credits "
                    f"(idle_timeout of principal {session.principal.name!r}); reconnect when there is "
                    "something to send"
                )
                if self.cancel(session, UNAVAILABLE, reason):
                    self.stats.sessions_idle += 1
            elif reclaim and session.owner in self._over_share and idle >= self.config.reclaim_after:
                reason = (
                    f"holding {session.credit} credits unused for {idle:.1f} s while other publishers wait "
                    f"for room: over its fair share of stream {self.stream!r}; reconnect when there is "
                    "something to send"
                )
                if self.cancel(session, UNAVAILABLE, reason):
                    self.stats.sessions_reclaimed += 1

    async def seal_now(self) -> None:
        """Seal what is pending into a block now rather than at the end of the block interval, and
        return once that seal has run (the block written, or the write failed and the records kept).

        A reader that plans a batch right after sees every record taken so far: the Sluice source asks
        so (through RateControl.GetRate), so that a batch is not one block short by the phase of the
        block generator against Spark's trigger. Bound the wait with a timeout: a failing disk retries
        only every block interval.
        """
        if self._stopping or self._task is None or not (self._pending or self._sealing):
            return
        waiter = asyncio.get_running_loop().create_future()
        if self._pending:
            # the pending records go into the next seal that starts, not one already running
            self._seal_waiters.append((self._seal_rounds + (2 if self._sealing else 1), waiter))
            self._seal_wanted.set()
        else:
            # a seal (the linger's, a full block's) runs with every record taken so far: its write may
            # still be under way, and a batch planned before it ends would be that block short
            self._seal_waiters.append((self._seal_rounds + 1, waiter))
        await waiter

    def _release_seal_waiters(self, everyone: bool = False) -> None:
        waiting = []
        for target, waiter in self._seal_waiters:
            if everyone or target <= self._seal_rounds:
                if not waiter.done():
                    waiter.set_result(None)
            else:
                waiting.append((target, waiter))
        self._seal_waiters = waiting

    async def _seal(self) -> bool:
        """Seal what is pending into durable blocks (a block's worth each: _take_pending) and ack them;
        False if a write failed."""
        if not self._pending:
            return True
        last = self._pending[-1]  # the last record pending now (seal_now() and stop() wait for it)
        chunks = self._take_pending()
        # while a block is written, the next one (records that piled up meanwhile) is encoded, so the
        # log's thread goes from one write to the next; for at most a block interval, so that the
        # block generator's other duties (disk checks, idle sessions) keep their pace
        chain_until = self._clock() + self.config.block_interval
        shrunk = False  # a block was cut smaller in this seal: it grows again in the next one
        while chunks:
            written = chunks
            failed: _Unwritten | None = None
            try:
                # no block is prepared ahead while blocks are cut small for a full disk
                ahead = self._space_cap is None and self._clock() < chain_until
                chunks = await self._write_block(chunks, ahead=ahead) or []
            except OSError as exc:
                failed = _Unwritten(chunks, [], exc)
            except Exception:  # a session's data the log cannot hold must not kill the stream
                log.exception(
                    "stream %r: block %d could not hold its records; writing each producer's apart",
                    self.stream,
                    self._next_block_seq,
                )
                failed = await self._seal_apart(chunks)
                chunks = []
            if failed is not None:
                if not self._write_failed(failed):
                    return False
                shrunk = True
                if not any(chunk is last for chunk in self._pending):
                    # `last` was written (or refused) in this seal, and what failed was taken after it (a
                    # block prepared ahead) or with it (a write apart's, and the producers' after it): due
                    last = (failed.after or failed.block)[-1]
                chunks = self._take_pending()  # a smaller block at once: it may fit
                continue
            if self._space_cap is not None:
                self._grow_space_cap(written, grow=not shrunk)
            # more than a block's worth was pending: the rest goes on now if a block's worth waits or
            # someone waits for it, or blocks are cut small for a full disk (what this seal took is
            # written, as far as the disk has room); else it starts the next block, with what follows
            wanted = self._block_full() or self._seal_waiters or self._stopping or self._space_cap is not None
            if not chunks and wanted and any(chunk is last for chunk in self._pending):
                chunks = self._take_pending()
        if DISK_ERROR in self._paused:  # written in smaller blocks: every record due is durable
            self._write_succeeded()
        return True

    def _take_pending(self) -> list[_Chunk]:
        """The pending chunks, oldest first, until a block's worth (`seal_at` records or `seal_bytes`:
        at most one chunk, one message, more): however far the log falls behind, a block (and the log's
        frame buffers, kept at the largest block's size) stays that size; the rest waits for the next.
        While the disk lacks room for a whole block (_space_cap), at most that many bytes (one chunk at
        least), and _space_cut says whether the cap cut the block short."""
        pending, cap_records, cap_bytes = self._pending, self.config.seal_at, self.config.seal_bytes
        limit = self._space_cap
        self._space_cut = False
        if limit is None and self._pending_records < cap_records and self._pending_bytes < cap_bytes:
            self._pending = []
            self._pending_records = self._pending_bytes = 0
            return pending
        cut, records, nbytes = len(pending), 0, 0
        for i, chunk in enumerate(pending):
            if i and (records >= cap_records or nbytes >= cap_bytes):
                cut = i
                break
            if i and limit is not None and nbytes + chunk.nbytes > limit:
                cut, self._space_cut = i, True
                break
            records += chunk.records.num_rows
            nbytes += chunk.nbytes
        chunks, self._pending = pending[:cut], pending[cut:]
        self._pending_records -= records
        self._pending_bytes -= nbytes
        return chunks

    def _grow_space_cap(self, written: list[_Chunk], *, grow: bool) -> None:
        """A block cut small for a full disk was written: the next may be twice as large (if `grow`:
        not after a write that failed in the same seal, as the disk is as full as it was then); one the
        cap did not cut short was a block of normal size, and blocks are of normal size again."""
        cap = self._space_cap
        if cap is None or not self._space_cut:
            self._space_cap = None
        elif grow:
            self._space_cap = 2 * max(cap, sum(c.nbytes for c in written))

    def _recount_pending(self) -> None:
        self._pending_records = sum(c.records.num_rows for c in self._pending)
        self._pending_bytes = sum(c.nbytes for c in self._pending)

    def _block_full(self) -> bool:
        """A block's worth waits: seal it before the interval ends (by count, or by bytes)."""
        return self._pending_records >= self.config.seal_at or self._pending_bytes >= self.config.seal_bytes

    async def _seal_apart(self, chunks: list[_Chunk]) -> _Unwritten | None:
        """Write the chunks of each producer (or anonymous session) as a block of their own: those the log
        refuses fail their producer's sessions (INVALID_ARGUMENT for data it cannot encode, else
        UNAVAILABLE), everyone else's are sealed and acked. None once every producer's were; else the
        block whose write failed with an OSError, and the producers' after it, not tried: the caller
        treats them as any failed write (_seal: for lack of room, cut down to what fits at once)."""
        groups: dict[str | Session, list[_Chunk]] = {}
        for chunk in chunks:
            groups.setdefault(chunk.session.producer_key or chunk.session, []).append(chunk)
        owners = list(groups)
        for i, owner in enumerate(owners):
            try:
                await self._write_block(groups[owner])
            except OSError as exc:
                return _Unwritten(groups[owner], [c for o in owners[i + 1 :] for c in groups[o]], exc)
            except Exception as exc:  # noqa: BLE001 - see _seal
                self._refuse(owner, groups[owner], exc)
        return None

    def _refuse(self, owner: str | Session, chunks: list[_Chunk], exc: Exception) -> None:
        """The block log cannot hold these records of `owner` (a producer key, or an anonymous session):
        drop them and what else of it is pending, and fail its sessions; nothing of it was acked."""
        log.error("stream %r: the block log refused records of %s: %r", self.stream, owner, exc)

        def mine(chunk: _Chunk) -> bool:
            return chunk.session.producer_key == owner if isinstance(owner, str) else chunk.session is owner

        dropped = chunks + [c for c in self._pending if mine(c)]
        self._pending = [c for c in self._pending if not mine(c)]
        self._recount_pending()
        for chunk in dropped:
            self._buffered -= chunk.records.num_rows
            self._buffered_bytes -= chunk.nbytes
            self.stats.records_not_accepted += chunk.records.num_rows
        self._unbuffer(dropped)
        self._room.set()
        sessions = {c.session for c in dropped}
        if isinstance(owner, str) and (state := self._producers.get(owner)) is not None:
            # what it sent from the first dropped record on was never written: a resend must be taken
            state.accepted_up_to = min(c.end_seq - c.records.num_rows for c in dropped)
            sessions.update(state.sessions)
        error: ReceiverError
        if isinstance(exc, _DATA_ERRORS):
            error = UnloggableRecords(f"the block log cannot hold this session's records: {exc}")
        else:  # the store broke on them, not knowably their fault: not accepted, safe to retry
            error = ReceiverStopped(f"writing this session's records failed: {exc!r}; retry")
        for session in sessions:
            self.fail(session, error, ack_first=False)  # its records were dropped: no ack comes

    async def _write_block(self, chunks: list[_Chunk], ahead: bool = False) -> list[_Chunk] | None:
        """Write `chunks` as the next block and do its bookkeeping (ack, or queue for the group commit).
        Raises what the store raises, with nothing of the block in the log.

        With `ahead`, if a block's worth of records is pending, they are taken and the store prepares
        them as the block after this one while this one is written: returned, for the caller to write
        next (on an error they are pending again, after this block's)."""
        marks = _producer_marks(chunks)
        write = asyncio.ensure_future(
            asyncio.to_thread(
                self.store.write,
                self.stream,
                self._next_block_seq,
                self._next_offset,
                self.config.receiver_id,
                [c.records for c in chunks],
                marks,
            )
        )
        after: list[_Chunk] | None = None
        prepared: asyncio.Future[None] | None = None
        try:
            if ahead:
                after, prepared = await self._prepare_ahead(write, chunks)
            info, size = await write
        except BaseException:
            if after is not None:
                self._pending = after + self._pending
                self._recount_pending()
            raise
        finally:
            if prepared is not None:
                # the store's prepare never raises; it runs on (to its end) if this was cancelled
                await asyncio.wait([prepared])
        offsets, times, at = array("q"), array("d"), info.first_offset
        for chunk in chunks:  # a batch's records share their arrival time
            offsets.append(at)
            times.append(first_arrival_us(chunk.records) / 1e6)
            at += chunk.records.num_rows
        self._arrivals.append((info.first_offset, offsets, times))
        self._next_block_seq += 1
        self._next_offset += info.count
        self._buffered -= info.count
        self._buffered_bytes -= sum(c.nbytes for c in chunks)
        self._unbuffer(chunks)
        self._room.set()
        if self._space_cap is None:  # else once the seal has written what it took (_seal)
            self._write_succeeded()
        budget = self.config.disk_budget_bytes
        if budget is not None and self._disk_used is not None:
            self._disk_used += size
            self._set_paused(DISK_BUDGET, self._disk_used >= budget)
        self.stats.blocks_sealed += 1
        self.stats.block_bytes += size
        self.stats.records_acked += info.count
        acked: dict[Session, int] = {}
        for chunk in chunks:
            if not chunk.session.producer_id:
                acked[chunk.session] = chunk.end_seq
        if self.store.durable_seq(self.stream) > info.seq:
            self._acknowledge(acked, marks)
        else:  # group commit (fsync interval): acked once the background fsync has covered the block
            self._awaiting_durable.append((info.seq, acked, marks))
        self._replenish()
        return after

    async def _prepare_ahead(
        self, write: asyncio.Future[tuple[BlockInfo, int]], chunks: list[_Chunk]
    ) -> tuple[list[_Chunk] | None, asyncio.Future[None] | None]:
        """While `write` (of `chunks`) runs, wait for a block's worth of records to pile up; then take
        them and have the store prepare them as the next block: (them, the preparation), or Nones."""
        wanted: asyncio.Future[object] = asyncio.ensure_future(self._seal_wanted.wait())
        either = [cast("asyncio.Future[object]", write), wanted]
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        wanted.cancel()
        if write.done() or not self._block_full() or self._chain_stopped():
            return None, None
        self._seal_wanted.clear()  # taken here: the block generator need not seal them
        after = self._take_pending()
        prepared = asyncio.ensure_future(
            asyncio.to_thread(
                self.store.prepare,
                self.stream,
                self._next_block_seq + 1,
                self._next_offset + sum(c.records.num_rows for c in chunks),
                self.config.receiver_id,
                [c.records for c in after],
                _producer_marks(after),
            )
        )
        return after, prepared

    def _chain_stopped(self) -> bool:
        """No block is prepared ahead: stopping, or a seal_now() waits for the round to end."""
        return self._stopping or bool(self._seal_waiters)

    def _write_failed(self, failed: _Unwritten) -> bool:
        """Keep the records buffered and try again next interval; no new credit until a write succeeds.
        True if a smaller block should be tried at once: the disk lacked room for this one, of more
        than one message (the cap it leaves, _space_cap, holds at most half of it). The records after
        it not tried yet (a write apart's other producers, _seal_apart) are pending again after its."""
        chunks, exc = failed.block, failed.error
        self.stats.block_write_errors += 1
        self._pending = chunks + failed.after + self._pending
        self._recount_pending()
        no_room = exc.errno in _NO_ROOM
        split = no_room and len(chunks) > 1
        # for lack of room, what fits of it is written: halved until it fits, down to one message;
        # another error retries the whole block (EIO says nothing of what a smaller block would meet)
        self._space_cap = sum(c.nbytes for c in chunks) // 2 if no_room else None
        first = DISK_ERROR not in self._paused
        self._write_error = str(exc)
        log.log(  # an OSError says it all (a full disk, an I/O error): no traceback
            logging.ERROR if first else logging.DEBUG,
            "writing block %d of stream %r failed: %s%s",
            self._next_block_seq,
            self.stream,
            exc,
            f" ({len(chunks)} messages, {_size(sum(c.nbytes for c in chunks))}); retrying at once in smaller "
            "blocks, as far as the disk has room"
            if split
            else "",
        )
        self._set_paused(DISK_ERROR, True)
        return split

    def _write_succeeded(self) -> None:
        """Blocks are written again: credit paused for a failed write resumes."""
        self._write_error = None
        self._set_paused(DISK_ERROR, False)

    def _ack_durable(self) -> None:
        """Ack the blocks that the store has made durable since they were written."""
        if not self._awaiting_durable:
            return
        durable = self.store.durable_seq(self.stream)
        while self._awaiting_durable and self._awaiting_durable[0][0] < durable:
            _, acked, marks = self._awaiting_durable.popleft()
            self._acknowledge(acked, marks)

    def _acknowledge(self, acked: dict[Session, int], marks: dict[str, int]) -> None:
        """A block is durable: ack its anonymous sessions, and every session of its producers."""
        for session, up_to in acked.items():
            self._ack(session, up_to)
        for producer, mark in marks.items():
            # route by producer: every session of it (a fenced one, a newer one that sent these records
            # again as duplicates) is acked up to what it sent
            state = self._producers.get(producer)
            if state is None:
                continue
            state.durable_up_to = max(state.durable_up_to, mark)
            for session in list(state.sessions):
                self._ack(session, min(session.next_seq, state.durable_up_to))

    def _ack(self, session: Session, up_to: int) -> None:
        if up_to > session.durable_up_to:
            session.durable_up_to = up_to
            session.outbox.ack(up_to)
            self._end_if_settled(session)


def _producer_marks(chunks: list[_Chunk]) -> dict[str, int]:
    """Producer key -> the seq after its last record in these chunks (a block's producers table)."""
    marks: dict[str, int] = {}
    for chunk in chunks:
        if chunk.session.producer_id:
            marks[chunk.session.producer_key] = chunk.end_seq
    return marks


def _size(n: float) -> str:
    """Bytes for a log line: 512 B, 1.5 KiB, 100 MiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


class _SessionSubscription:
    """A publisher session seen through the Flow Subscription interface (rules 3.5-3.9, 3.17)."""

    def __init__(self, receiver: Receiver, session: Session) -> None:
        self._receiver = receiver
        self._session = session

    def request(self, n: int) -> None:
        if n <= 0:  # rule 3.9: a protocol error of the subscriber's, reported to it
            raise ValueError(f"request({n}): n must be > 0 (rule 3.9)")
        if self._session.accepting:  # rule 3.6: a no-op after cancel or the end
            self._receiver._grant(self._session, n)

    def cancel(self) -> None:
        self._receiver.cancel(self._session, CANCELLED, "cancelled")
