"""A blocking Producer for code without an event loop: the async Producer on a private loop thread."""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Coroutine, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from sluice_client.errors import ProducerClosedError
from sluice_client.producer import Producer, check_timeout, warn_dropped_on_error, warn_never_closed

if TYPE_CHECKING:
    import numpy.typing as npt

T = TypeVar("T")

_STOP_GRACE = 5.0
"""Seconds the loop's stop waits for calls other threads handed over before it (they end at once on a
closed producer)."""


_CANCEL_GRACE = 5.0
"""Seconds a call interrupted in its caller's thread (Ctrl-C) waits for its coroutine, cancelled on the
loop, to end before it re-raises (a cancelled send ends at once, a close once its teardown is done)."""


class _Handed(Generic[T]):
    """A call handed to the loop thread, which its caller's thread can cancel there (cancel_soon) and
    see end (ended). The coroutine always starts inside run(), so it ends there too, cancelled before it
    began included (it is closed then, never run)."""

    __slots__ = ("_cancelled", "_coro", "_task", "ended")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        self._task: asyncio.Task[Any] | None = None
        self._cancelled = False
        self.ended = threading.Event()

    async def run(self) -> T:
        try:
            if self._cancelled:
                self._coro.close()  # never run: no "never awaited" warning
                raise asyncio.CancelledError
            self._task = asyncio.current_task()
            return await self._coro
        finally:
            self.ended.set()

    def _cancel(self) -> None:  # on the loop thread
        if self._task is None:
            self._cancelled = True  # not begun: run() closes it instead
        else:
            self._task.cancel()

    def cancel_soon(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Cancel the call on `loop`; False if the loop is closed (nothing runs there any more)."""
        try:
            loop.call_soon_threadsafe(self._cancel)
        except RuntimeError:
            return False
        return True


_open: weakref.WeakSet[SyncProducer] = weakref.WeakSet()
"""SyncProducers started: at exit, those never closed say what they drop (their thread is a daemon's:
the process ends without it, and the records it had not delivered went without a word)."""


@atexit.register
def _warn_never_closed() -> None:
    for producer in list(_open):
        if not producer._stopping:
            warn_never_closed("SyncProducer", producer.target, producer.unacked)


class SyncProducer:
    """Blocking facade over Producer. Same arguments; every method blocks until done (the constructor
    too: it starts the producer, waiting up to `start_timeout` for a server that is not up yet, and
    raises what Producer.start raises, e.g. RPCError ALREADY_EXISTS for a new run of a producer id the
    server holds records of).

    `send_many` amortises the thread hop; `send` costs one hop per record.

    The producer runs on a thread of its own: a method called on that thread (from code the producer
    runs there, such as a logging handler fed by its log lines) raises RuntimeError at once, as it would
    wait for itself; `unacked_records()` and the counters answer there.
    """

    def __init__(self, target: str | Sequence[str], stream: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        # calls from other threads racing the loop's stop: a call handed to a stopped loop never ran
        # and its thread waited for good; under the lock a call is handed over or refused, and the
        # stop fails the ones handed over that the loop did not finish
        self._lock = threading.Lock()
        self._stopping = False
        self._calls: set[concurrent.futures.Future[Any]] = set()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sluice-producer", daemon=True)
        self._thread.start()
        try:  # a bad argument too: the loop's thread would run for ever
            self._producer: Producer = self._run(self._make(target, stream, kwargs))
            self._run(self._producer.start())
        except BaseException:
            self._stop_loop()
            raise
        _open.add(self)

    @staticmethod
    async def _make(target: str | Sequence[str], stream: str, kwargs: dict[str, Any]) -> Producer:
        return Producer(target, stream, **kwargs)  # created on the loop that will use it

    def _refuse_own_thread(self, what: str) -> None:
        """RuntimeError if called on the producer's own loop thread (code the producer runs there: a
        logging handler fed by its log lines, a callback): the call would wait for that thread, which is
        the caller, for good (a deadlock; close() and abort() would join their own thread)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(
                f"SyncProducer.{what}() called from the producer's own event-loop thread (in code the "
                "producer runs, such as a logging handler or a callback): it would wait for this very "
                "thread for good; call it from another thread"
            )

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()  # never run: no "never awaited" warning
            self._refuse_own_thread(getattr(coro, "__name__", "method"))
        with self._lock:
            if self._stopping:  # closed or aborted: as the async Producer says then
                coro.close()
                raise ProducerClosedError("producer is closed")
            handed = _Handed(coro)
            call = asyncio.run_coroutine_threadsafe(handed.run(), self._loop)
            self._calls.add(call)
        try:
            return call.result()
        except BaseException:
            # interrupted while it waited (Ctrl-C: KeyboardInterrupt in this thread), the call itself
            # not done: it ran on on the loop (a send_many went on taking records, a flush kept
            # waiting, a close left the producer half torn down when the loop stopped). It is
            # cancelled there, as a task's cancel ends an async Producer's call, and given a moment
            # to end, so the producer is as that cancel leaves it
            if not call.done() and handed.cancel_soon(self._loop):
                handed.ended.wait(_CANCEL_GRACE)
            raise
        finally:
            with self._lock:
                self._calls.discard(call)

    def send(self, value: bytes, key: bytes | None = None) -> None:
        self._run(self._producer.send(value, key))

    def send_many(self, values: Sequence[bytes], keys: Sequence[bytes | None] | None = None) -> None:
        self._run(self._producer.send_many(values, keys))

    def send_packed(
        self,
        values: bytes | bytearray | memoryview,
        offsets: npt.ArrayLike,
        keys: bytes | bytearray | memoryview | None = None,
        key_offsets: npt.ArrayLike | None = None,
        key_validity: npt.ArrayLike | None = None,
    ) -> None:
        """Producer.send_packed: records in Arrow's binary layout, one buffer and its offsets (and
        their keys so, if any)."""
        self._run(self._producer.send_packed(values, offsets, keys, key_offsets, key_validity))

    def send_arrow(self, values: Any, keys: Any = None) -> None:
        """Producer.send_arrow: records (and keys) from pyarrow binary or string arrays."""
        self._run(self._producer.send_arrow(values, keys))

    def flush(self, timeout: float | None = None) -> None:
        self._run(self._producer.flush(timeout))

    @property
    def target(self) -> str:
        """The target in use (Producer.target)."""
        return self._producer.target

    @property
    def targets(self) -> tuple[str, ...]:
        return self._producer.targets

    @property
    def acked(self) -> int:
        return self._producer.acked

    @property
    def ever_sent(self) -> int:
        return self._producer.ever_sent

    @property
    def unacked(self) -> int:
        return self._producer.unacked

    @property
    def reconnects(self) -> int:
        return self._producer.reconnects

    @property
    def resent(self) -> int:
        return self._producer.resent

    def unacked_records(self) -> list[tuple[bytes, bytes | None]]:
        """The records not acked yet, as (value, key) in order (see Producer.unacked_records)."""

        async def take() -> list[tuple[bytes, bytes | None]]:
            return self._producer.unacked_records()

        if self._stopping or threading.current_thread() is self._thread:
            # after close nothing changes them any more; on the loop's own thread nothing else runs
            return self._producer.unacked_records()
        return self._run(take())

    def abort(self) -> list[tuple[bytes, bytes | None]]:
        """End the session now, dropping what is not acked; return those records, (value, key) in
        order (Producer.abort). After close() or abort(): the records that were never acked."""
        self._refuse_own_thread("abort")  # before the stop: it would join this thread
        if self._stopping:
            return self._producer.unacked_records()
        try:
            return self._run(self._producer.abort())
        finally:
            self._stop_loop()

    def close(self, timeout: float | None = None) -> None:
        """Flush, complete and stop; raises UnackedRecordsError (with `.records`) when records remain
        unacked, as Producer.close does."""
        self._refuse_own_thread("close")  # before the stop: it would join this thread
        check_timeout(timeout)  # before the loop stops: a bad timeout leaves the producer usable
        if self._stopping:  # as Producer.close() then: what was dropped is said, not taken as delivered
            self._producer.raise_dropped()
            return
        try:
            self._run(self._producer.close(timeout))
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C: the close on the loop stops unfinished
                self._producer._dropped_unsaid = True  # said by the next close()
            raise
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        with self._lock:
            stopping, self._stopping = self._stopping, True
            handed = list(self._calls)
        if not stopping:
            # calls of other threads handed over before: the producer is closed, they end at once
            # (ProducerClosedError); stopped first, the loop would never have run them
            concurrent.futures.wait(handed, timeout=_STOP_GRACE)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()  # also when another thread stops it: return once it has
        with self._lock:
            unfinished, self._calls = self._calls, set()
            if not self._loop.is_closed():
                self._loop.close()
        for call in unfinished:  # still running when the loop stopped: they never end
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                call.set_exception(ProducerClosedError("producer is closed"))

    def __enter__(self) -> SyncProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            warn_dropped_on_error(len(self.abort()), exc)
