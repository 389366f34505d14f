"""Asyncio Producer: the Publisher side of a Publish session.

Records are buffered locally (bounded: `send` waits when `max_buffered` records are unsent) and leave in
batches of up to `batch_size` records or `batch_bytes` bytes, after at most `linger` seconds, and never
beyond the credit the server granted: records in flight (sent, not yet granted again) never exceed
credit. Acks say which records are durable; `flush()` waits for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import uuid
import warnings
from collections.abc import Callable, Sequence
from types import TracebackType

import grpc

from ingest.errors import FlushTimeoutError, ProducerClosedError, ProtocolError, RPCError, SluiceError
from receivers.flow import MAX_DEMAND
from receivers.pb.ingest.v1 import ingest_pb2 as pb
from receivers.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from receivers.wire import encode_batch

DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
_FAILED_PRECONDITION = 9  # gRPC status code carried in-band by Error


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Producer:
    """Sends records to one stream of a Sluice server.

    Use as `async with Producer(target, stream) as producer: await producer.send(b"...")`.
    """

    def __init__(
        self,
        target: str,
        stream: str,
        *,
        producer_id: str | None = None,
        batch_size: int = 4096,
        batch_bytes: int = 1024 * 1024,
        linger: float = 0.005,
        max_buffered: int = 200_000,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        if batch_size < 1 or batch_bytes < 1 or max_buffered < batch_size:
            raise ValueError("need batch_size >= 1, batch_bytes >= 1 and max_buffered >= batch_size")
        if linger < 0:
            raise ValueError(f"linger must be >= 0 seconds, got {linger}")
        self.target = target
        self.stream = stream
        self.producer_id = producer_id or uuid.uuid4().hex
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.linger = linger
        self.max_buffered = max_buffered
        self._own_channel = channel is None
        self._channel = channel
        self._state = _State.NEW
        self._call: grpc.aio.StreamStreamCall[pb.PublishRequest, pb.PublishResponse] | None = None
        self._values: list[bytes] = []
        self._keys: list[bytes | None] | None = None  # None while no buffered record has a key
        self._buffered_bytes = 0
        self._sent_seq = 0  # records numbered below were sent
        self._acked_seq = 0  # records numbered below are durable
        self._credit = 0
        self._flushing = 0
        self._error: SluiceError | None = None
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._room_listeners: list[Callable[[], None]] = []
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time per call
        self.cancel_reason: str | None = None
        """Why the server cancelled the session, if it did."""

    # ---- counters --------------------------------------------------------------------------------

    @property
    def sent(self) -> int:
        """Records sent to the server."""
        return self._sent_seq

    @property
    def acked(self) -> int:
        """Records the server reported durable."""
        return self._acked_seq

    @property
    def credit(self) -> int:
        """Records the producer may send now."""
        return self._credit

    @property
    def unacked(self) -> int:
        """Records accepted by send() and not yet acked."""
        return self._sent_seq + len(self._values) - self._acked_seq

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the session; returns once the server has taken Open."""
        if self._state is not _State.NEW:
            raise ProducerClosedError(f"producer is {self._state.value}; a producer starts once")
        self._state = _State.OPEN
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                self.target,
                options=[
                    ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                ],
            )
        self._call = pb_grpc.IngestStub(self._channel).Publish()  # type: ignore[call-arg]  # stubs lag grpc.aio
        opening = pb.Open(stream=self.stream, producer_id=self.producer_id, resume_from_seq=0)
        try:
            await self._call.write(pb.PublishRequest(open=opening))
        except grpc.aio.AioRpcError as exc:
            await self._teardown()
            raise RPCError.from_grpc(exc) from None
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="sluice-producer-read"),
            asyncio.create_task(self._send_loop(), name="sluice-producer-send"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.close()
        else:
            await self.abort()

    async def close(self, timeout: float | None = None) -> None:
        """Send what is buffered, wait until it is acked, complete the session and release the channel.

        Raises FlushTimeoutError (with the count never acked) when `timeout` runs out, or the error that
        ended the session.
        """
        if self._state in (_State.CLOSING, _State.CLOSED):
            return
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        try:
            await self.flush(timeout)
            self._state = _State.CLOSING
            assert self._call is not None
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                async with self._write_lock:
                    await self._call.write(pb.PublishRequest(complete=pb.Complete()))
                    await self._call.done_writing()
            # the server ends the call once everything is acked
            await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout)
            if self._error is not None:
                raise self._error
        finally:
            await self._teardown()

    async def abort(self) -> None:
        """Drop what is buffered and end the session now. Unacked records are not retried."""
        await self._teardown()

    async def _teardown(self) -> None:
        self._state = _State.CLOSED
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, SluiceError):
                await task
        if self._call is not None:
            self._call.cancel()
        if self._own_channel and self._channel is not None:
            await self._channel.close(None)
            self._channel = None
        self._wake()

    def __del__(self) -> None:
        if getattr(self, "_state", _State.CLOSED) is _State.OPEN:
            warnings.warn(f"Producer for {self.target} was never closed", ResourceWarning, stacklevel=1)

    # ---- sending ---------------------------------------------------------------------------------

    async def send(self, value: bytes, key: bytes | None = None) -> None:
        """Queue one record; waits while the local buffer is full (backpressure)."""
        await self._room_for(1)
        self._append(value, key)

    async def send_many(self, values: Sequence[bytes], keys: Sequence[bytes | None] | None = None) -> None:
        """Queue many records at once; cheaper per record than send()."""
        if keys is not None and len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        start = 0
        while start < len(values):
            await self._room_for(1)
            room = self.max_buffered - len(self._values)
            end = min(len(values), start + room)
            chunk = values[start:end]
            if keys is None and self._keys is None:
                self._values.extend(chunk)
                self._buffered_bytes += sum(map(len, chunk))
                self._wake()
            else:
                for i in range(start, end):
                    self._append(values[i], None if keys is None else keys[i])
            start = end

    def _append(self, value: bytes, key: bytes | None) -> None:
        if not isinstance(value, bytes | bytearray | memoryview):
            raise TypeError(f"record value must be bytes, not {type(value).__name__}")
        if key is not None and self._keys is None:
            self._keys = [None] * len(self._values)
        self._values.append(value)
        if self._keys is not None:
            self._keys.append(key)
        self._buffered_bytes += len(value)
        if len(self._values) >= self.batch_size or self._buffered_bytes >= self.batch_bytes:
            self._wake()

    @property
    def room(self) -> int:
        """Records the local buffer takes now without waiting; -1 before start or after close."""
        if self._state is not _State.OPEN or self._error is not None:
            return -1
        return self.max_buffered - len(self._values)

    def offer(self, value: bytes, key: bytes | None = None) -> None:
        """Queue one record without waiting; raise BufferError when the buffer is full.

        For code that manages demand itself (ingest.client.flow): it asks only for `room` records.
        """
        self._check_open()
        if len(self._values) >= self.max_buffered:
            raise BufferError(f"producer buffer is full ({self.max_buffered} records); wait for room")
        self._append(value, key)

    def on_room(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` whenever records leave the local buffer; returns a function that unregisters."""
        self._room_listeners.append(callback)
        return lambda: self._room_listeners.remove(callback)

    async def _room_for(self, n: int) -> None:
        self._check_open()
        while len(self._values) + n > self.max_buffered:
            await self._wait_change()
            self._check_open()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every record queued so far is acked; FlushTimeoutError when `timeout` runs out."""
        if self._state is _State.NEW:
            raise ProducerClosedError("producer not started")
        target = self._sent_seq + len(self._values)
        self._flushing += 1
        self._wake()
        try:
            async with asyncio.timeout(timeout):
                while self._acked_seq < target:
                    if self._error is not None:
                        raise self._error
                    await self._wait_change()
        except TimeoutError:
            raise FlushTimeoutError(target - self._acked_seq, timeout or 0.0) from None
        finally:
            self._flushing -= 1

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state is not _State.OPEN:
            raise ProducerClosedError(f"producer is {self._state.value}")

    def _wake(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _send_loop(self) -> None:
        assert self._call is not None
        while True:
            # wait for credit and a batch worth sending: full, lingered long enough, or flushing
            while not (self._credit > 0 and self._values):
                await self._wait_change()
            small = len(self._values) < self.batch_size and self._buffered_bytes < self.batch_bytes
            if small and not self._flushing and self.linger > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.linger):
                        while len(self._values) < self.batch_size and not self._flushing:
                            await self._wait_change()
            n = self._batch_length()
            values = self._values[:n]
            keys = self._keys[:n] if self._keys is not None else None
            del self._values[:n]
            if self._keys is not None:
                del self._keys[:n]
                if not self._values:
                    self._keys = None
            batch = encode_batch(self._sent_seq, values, keys)
            self._buffered_bytes -= len(batch.values)
            self._credit -= n
            self._sent_seq += n
            self._wake()  # room in the buffer
            for listener in list(self._room_listeners):
                listener()
            try:
                async with self._write_lock:
                    await self._call.write(pb.PublishRequest(batch=batch))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                # the call ended; the read loop has (or will have) the status that says why
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._tasks[0])
                return

    def _batch_length(self) -> int:
        """Records in the next batch: within credit, batch_size and (roughly) batch_bytes."""
        n = min(self._credit, len(self._values), self.batch_size)
        if self._buffered_bytes > self.batch_bytes:
            size = 0
            for i in range(n):
                size += len(self._values[i])
                if size >= self.batch_bytes:
                    return i + 1
        return n

    async def _read_loop(self) -> None:
        assert self._call is not None
        try:
            async for response in self._call:
                kind = response.WhichOneof("kind")
                if kind == "request":
                    if response.request.n <= 0:
                        await self._protocol_error(
                            f"server sent Request(n={response.request.n}); n must be > 0 (rule 3.9)"
                        )
                    if self.cancel_reason is None:  # no credit after a Cancel (rule 3.6)
                        self._credit = min(MAX_DEMAND, self._credit + response.request.n)
                elif kind == "ack":
                    if response.ack.durable_up_to > self._sent_seq:
                        await self._protocol_error(
                            f"server acked up to {response.ack.durable_up_to}, beyond the "
                            f"{self._sent_seq} records sent"
                        )
                    self._acked_seq = max(self._acked_seq, response.ack.durable_up_to)
                elif kind == "cancel":
                    # the server takes nothing more: stop sending; records from accepted_up_to on were
                    # not accepted and stay unacked
                    self.cancel_reason = response.cancel.reason or "cancelled"
                    self._credit = 0
                self._wake()
        except grpc.aio.AioRpcError as exc:
            self._error = RPCError.from_grpc(exc)
            raise self._error from None
        if self._acked_seq < self._sent_seq and self._error is None:
            self._error = ProducerClosedError(
                f"server ended the session with {self._sent_seq - self._acked_seq} records unacked"
            )

    async def _protocol_error(self, message: str) -> None:
        """The server broke the contract: tell it in-band (gRPC has no client status), end, raise."""
        assert self._call is not None
        error = ProtocolError(message)
        self._error = error
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
            async with self._write_lock:
                await self._call.write(
                    pb.PublishRequest(error=pb.Error(code=_FAILED_PRECONDITION, message=message))
                )
                await self._call.done_writing()
        raise error

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # a background loop that dies fails everything waiting on the producer
        if not task.cancelled() and task.exception() is not None and self._error is None:
            exc = task.exception()
            self._error = exc if isinstance(exc, SluiceError) else SluiceError(repr(exc))
        self._wake()
