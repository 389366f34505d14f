"""Flow publishers for asyncio, a map processor, and subscribers that record what they get (for tests).

Every publisher here is unicast: it serves one subscriber, once. A second subscriber gets onSubscribe
with a dead subscription, then onError(SubscriptionRejected) (rules 1.9, 1.11); the same subscriber
subscribing again while its subscription is active is ignored with a warning, since a second onSubscribe
would break rule 2.12 (rule 1.10 makes that the caller's error).

How signals go out (rules 1.3, 3.3): onSubscribe is called from subscribe(); every other signal is sent
from the event loop (a task or a loop callback), never from inside request(), cancel(), offer() or
another signal. A request() made inside on_next only adds demand; the running delivery picks it up, so
recursion is bounded whatever the subscriber does. subscribe() must be called on the loop thread;
request() and cancel() may be called from any thread (they hop to the loop).

A subscriber that raises from a signal broke rule 2.13: its subscription counts as cancelled and the
error is logged, which is the "adequate fashion" for a Python library.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import numbers
import sys
import threading
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar, cast

from sluice_client.flow import MAX_DEMAND, FlowViolation, Subscriber, Subscription

__all__ = [
    "BufferFullTimeout",
    "BufferOverflowError",
    "BufferedPublisher",
    "IterablePublisher",
    "ManualSubscriber",
    "MapProcessor",
    "OverflowStrategy",
    "RecordingSubscriber",
    "SubscriptionRejected",
]

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class SubscriptionRejected(RuntimeError):
    """onError of a subscriber that a unicast publisher cannot serve (rules 1.9, 1.11)."""


class BufferOverflowError(Exception):
    """onError of a BufferedPublisher (OverflowStrategy.ERROR) offered an item it had no room for."""

    def __init__(self, capacity: int) -> None:
        super().__init__(
            f"buffer overflow: {capacity} items were already waiting for demand "
            "(OverflowStrategy.ERROR; the subscriber requests too slowly for this producer)"
        )
        self.capacity = capacity


class BufferFullTimeout(TimeoutError):
    """BufferedPublisher.put waited `timeout` seconds and the subscriber made no room."""

    def __init__(self, capacity: int, timeout: float | None) -> None:
        super().__init__(f"no room within {timeout} s: {capacity} items are waiting for demand")
        self.capacity = capacity
        self.timeout = timeout


# ---- shared machinery --------------------------------------------------------------------------


def _require(value: object, what: str) -> None:
    """Rules 1.9, 2.13: None is never a subscriber, subscription, item or error (Java throws NPE)."""
    if value is None:
        raise TypeError(f"{what} must not be None (Reactive Streams rule 2.13)")


def count_arg(value: object, name: str) -> int:
    """`value`, a count of items, as an int >= 1: TypeError for a float (NaN passed `< 1` and the
    buffer then said "nan items were already waiting"), a bool or another type; ValueError below 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def overflow_arg(value: object) -> OverflowStrategy:
    """`value` if it is an OverflowStrategy, else TypeError: any other value ("DROP_OLDEST", None) was
    taken and acted as ERROR, failing the stream at the first overflow it was meant to survive."""
    if not isinstance(value, OverflowStrategy):
        raise TypeError(f"overflow must be an OverflowStrategy, not {type(value).__name__} ({value!r})")
    return value


def _check_timeout(timeout: object) -> None:
    """TypeError unless `timeout` is None or a number of seconds, ValueError unless it is >= 0 and a
    float can hold it: a string failed in asyncio's arithmetic, NaN and negatives ran out at once, and
    10**400 raised OverflowError."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds or None, not {type(timeout).__name__} ({timeout!r})"
        )
    seconds = cast(float, timeout)  # a Real: comparable as one
    if not seconds >= 0 or (seconds > sys.float_info.max and seconds != math.inf):
        shown = "a number too large for a float" if seconds > sys.float_info.max else seconds
        raise ValueError(f"timeout must be >= 0 seconds (or None: no limit), got {shown}")


def _call(signal: Callable[..., None], *args: object) -> bool:
    """Send one signal; False when the subscriber raised (rule 2.13: it is then treated as cancelled)."""
    try:
        signal(*args)
    except Exception:
        log.exception(
            "%s raised: a subscriber must return normally (rule 2.13); its subscription is cancelled",
            getattr(signal, "__qualname__", signal),
        )
        return False
    return True


class _Dead:
    """The subscription handed to a rejected subscriber: nothing to request, nothing to cancel."""

    def request(self, n: int) -> None:
        pass

    def cancel(self) -> None:
        pass


class _LoopBound:
    """Something used from its event loop's thread; calls from other threads are handed to the loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.thread = threading.get_ident()

    def _elsewhere(self, method: Callable[..., None], *args: object) -> bool:
        """True when called off the loop thread: `method(*args)` then runs on the loop (rules 2.7, 3.5)."""
        if threading.get_ident() == self.thread:
            return False
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing is left to request or cancel
            self.loop.call_soon_threadsafe(method, *args)
        return True


class _Subscription(_LoopBound, Generic[T]):
    """The subscription of a publisher's one subscriber: demand, cancellation and guarded signals.

    The owning publisher sends `next`, `complete` and `error` from the loop, one at a time; `on_request(n)`
    tells it about new demand and `on_cancel()` that it must stop (called once, not after a terminal signal).
    """

    def __init__(
        self,
        subscriber: Subscriber[T],
        *,
        on_request: Callable[[int], None],
        on_cancel: Callable[[], None],
    ) -> None:
        super().__init__()
        self.subscriber: Subscriber[T] | None = subscriber
        """None once cancelled or terminated: dropped so it can be collected (rule 3.13)."""
        self.demand = 0
        """Requested and not yet delivered, saturating at MAX_DEMAND (rule 3.17)."""
        self._on_request = on_request
        self._on_cancel = on_cancel

    @property
    def active(self) -> bool:
        return self.subscriber is not None

    def start(self) -> None:
        assert self.subscriber is not None
        if not _call(self.subscriber.on_subscribe, self):
            self.cancel()

    def request(self, n: int) -> None:
        if self._elsewhere(self.request, n) or self.subscriber is None:
            return  # rule 3.6
        if n <= 0:
            subscriber = self.subscriber
            self.cancel()
            error = ValueError(f"request({n}): demand must be positive (Reactive Streams rule 3.9)")
            # from the loop, not from here: request() may have been called inside a signal (rule 1.3)
            self.loop.call_soon(_call, subscriber.on_error, error)
            return
        self.demand = min(MAX_DEMAND, self.demand + n)
        try:
            self._on_request(n)
        except Exception:
            log.exception("passing on request(%d) failed", n)  # request must return normally (3.16)

    def cancel(self) -> None:
        if self._elsewhere(self.cancel) or self.subscriber is None:
            return  # rule 3.7
        self.subscriber = None
        try:
            self._on_cancel()
        except Exception:
            log.exception("shutting down after cancel failed")  # cancel must return normally (3.15)

    def next(self, item: T) -> None:
        subscriber = self.subscriber
        if subscriber is None:
            return
        assert self.demand > 0, "on_next without demand (rule 1.1)"
        self.demand -= 1
        if not _call(subscriber.on_next, item):
            self.cancel()

    def complete(self) -> None:
        subscriber, self.subscriber = self.subscriber, None
        if subscriber is not None:
            _call(subscriber.on_complete)

    def error(self, error: BaseException) -> None:
        subscriber, self.subscriber = self.subscriber, None
        if subscriber is not None:
            _call(subscriber.on_error, error)


def _admit(publisher: object, current: _Subscription[Any] | None, subscriber: Subscriber[Any]) -> bool:
    """Apply the unicast rules of subscribe(); True when `subscriber` becomes the one subscriber."""
    _require(subscriber, "subscriber")  # rule 1.9: the only case in which subscribe raises
    if current is None:
        return True
    if current.subscriber is subscriber:
        log.warning("%r subscribed twice to %r: ignored (rules 1.10, 2.12)", subscriber, publisher)
        return False
    error = SubscriptionRejected(
        f"{type(publisher).__name__} is unicast and already has its subscriber (rules 1.9, 1.11)"
    )
    if _call(subscriber.on_subscribe, _Dead()):
        _call(subscriber.on_error, error)
    return False


# ---- publishers ----------------------------------------------------------------------------------


class IterablePublisher(Generic[T]):
    """A Publisher over an async (or plain) iterable, pulling the next item only while demand is outstanding.

    The iterable's end is found by the pull that hits it, and becomes on_complete at once, however much
    demand is left (rules 1.2, 1.5): a source of exactly n items completes on the request after the n-th
    item, since looking ahead would pull an item nobody asked for. An exception from the iterable becomes
    on_error (rule 1.4); a None item becomes on_error(TypeError). Cancelling stops pulling and closes the
    iterator (aclose / close), which runs a generator's cleanup (rule 3.14).
    """

    def __init__(self, source: AsyncIterable[T] | Iterable[T]) -> None:
        self._source = source
        self._subscription: _Subscription[T] | None = None
        self._task: asyncio.Task[None] | None = None
        self._wakeup = asyncio.Event()

    def subscribe(self, subscriber: Subscriber[T]) -> None:
        if not _admit(self, self._subscription, subscriber):
            return
        subscription = _Subscription(subscriber, on_request=self._requested, on_cancel=self._cancelled)
        self._subscription = subscription
        self._task = subscription.loop.create_task(self._pull(subscription), name=f"pull {self._source!r}")
        subscription.start()

    def _requested(self, n: int) -> None:
        self._wakeup.set()

    def _cancelled(self) -> None:
        self._wakeup.set()
        # interrupt a pull that may wait forever; from inside the task, the loop below just ends
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()

    async def _pull(self, subscription: _Subscription[T]) -> None:
        items = _async_iterator(self._source)
        try:
            while subscription.active:
                if subscription.demand == 0:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                try:
                    item = await anext(items)
                except StopAsyncIteration:
                    subscription.complete()
                    return
                except Exception as error:  # noqa: BLE001 - the source failed: that is on_error (rule 1.4)
                    subscription.error(error)
                    return
                if item is None:
                    subscription.error(
                        TypeError("the source yielded None; items must not be None (rule 2.13)")
                    )
                    return
                subscription.next(item)
                await asyncio.sleep(0)  # a plain iterable never suspends: let the loop run between items
        finally:
            await _close(items)


def _async_iterator(source: AsyncIterable[T] | Iterable[T]) -> AsyncIterator[T]:
    # the source's own iterator, so that closing it runs the source's cleanup
    return aiter(source) if isinstance(source, AsyncIterable) else _from_iterable(source)


async def _from_iterable(source: Iterable[T]) -> AsyncIterator[T]:
    iterator: Iterator[T] = iter(source)
    try:
        for item in iterator:
            yield item
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()


async def _close(items: AsyncIterator[object]) -> None:
    aclose = getattr(items, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.exception("closing the source of an IterablePublisher failed")


class OverflowStrategy(enum.Enum):
    """What a BufferedPublisher does with an item offered when `capacity` items already wait for demand."""

    ERROR = "error"
    """Refuse the item and fail: the subscriber gets the items buffered so far, then
    on_error(BufferOverflowError); offer() returns False from then on. Nothing is dropped silently."""
    DROP_LATEST = "drop_latest"
    """Drop the offered item (offer() returns False); the buffer keeps the oldest items."""
    DROP_OLDEST = "drop_oldest"
    """Drop the oldest buffered item and append the offered one: the buffer keeps the newest items."""
    LATEST = "latest"
    """Replace the newest buffered item with the offered one: the first capacity - 1 items stay, the last
    slot always holds the most recent item (with capacity 1: "latest value" semantics)."""


class BufferedPublisher(Generic[T]):
    """A push-based Publisher: a producer offers items, a bounded buffer holds those not yet requested.

    `capacity` counts the items waiting beyond the subscriber's outstanding demand: an offer overflows only
    when `capacity` items already wait for demand (items before a subscriber arrives wait too). `dropped`
    counts the items lost to overflow, whichever the strategy, and `on_drop(1)` is called for each (e.g. a
    Prometheus counter). complete() and fail() end the stream after the items buffered before them, so
    on_complete may come without demand once the buffer is empty (rule 2.9).

    `on_close()` is called once, when the publisher stops accepting items for any reason (complete, fail,
    an ERROR overflow, or the subscriber cancelling), e.g. to stop the producer. Call offer, put, complete
    and fail on the loop thread (from others: loop.call_soon_threadsafe).
    """

    def __init__(
        self,
        capacity: int,
        overflow: OverflowStrategy = OverflowStrategy.ERROR,
        *,
        on_drop: Callable[[int], None] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.capacity = count_arg(capacity, "capacity")
        self.overflow = overflow_arg(overflow)
        self.dropped = 0
        """Items lost to overflow (ERROR: the one refused; the DROP strategies and LATEST: each evicted)."""
        self._on_drop = on_drop
        self._on_close = on_close
        self._buffer: deque[T] = deque()
        self._ending = (
            False  # complete(), fail() or an ERROR overflow: the terminal signal follows the buffer
        )
        self._error: BaseException | None = None
        self._closed = False
        self._subscription: _Subscription[T] | None = None
        self._scheduled = False
        self._room = asyncio.Event()

    @property
    def closed(self) -> bool:
        """True once no more items are accepted (completed, failed, overflowed or cancelled)."""
        return self._closed

    def subscribe(self, subscriber: Subscriber[T]) -> None:
        if not _admit(self, self._subscription, subscriber):
            return
        self._subscription = _Subscription(subscriber, on_request=self._requested, on_cancel=self._cancelled)
        self._subscription.start()
        self._schedule()

    def offer(self, item: T) -> bool:
        """Buffer `item` for delivery; False when it was not taken (dropped, refused, or closed)."""
        _require(item, "item")
        self._check_thread()
        if self._closed:
            return False
        if self._has_room():
            self._buffer.append(item)
        elif self.overflow is OverflowStrategy.DROP_LATEST:
            self._drop()
            return False
        elif self.overflow is OverflowStrategy.DROP_OLDEST:
            self._buffer.popleft()
            self._buffer.append(item)
            self._drop()
        elif self.overflow is OverflowStrategy.LATEST:
            self._buffer[-1] = item
            self._drop()
        else:
            self._drop()
            self._end(BufferOverflowError(self.capacity))
            return False
        self._schedule()
        return True

    async def put(self, item: T, timeout: float | None = None) -> bool:
        """Wait for room (demand), then offer `item`: never overflows. False when the publisher closed.

        Raises BufferFullTimeout when `timeout` seconds pass without room.
        """
        _require(item, "item")
        _check_timeout(timeout)  # before it waits: asyncio took NaN or -1 as run out at once
        try:
            async with asyncio.timeout(timeout):
                while not (self._closed or self._has_room()):
                    self._room.clear()
                    await self._room.wait()
        except TimeoutError:
            raise BufferFullTimeout(self.capacity, timeout) from None
        return self.offer(item)

    def complete(self) -> None:
        """End the stream after the buffered items (on_complete). No-op once closed."""
        self._check_thread()
        if not self._closed:
            self._end(None)

    def fail(self, error: BaseException) -> None:
        """End the stream after the buffered items with on_error(error). No-op once closed."""
        _require(error, "error")
        self._check_thread()
        if not self._closed:
            self._end(error)

    # ---- internals ---------------------------------------------------------------------------------

    def _check_thread(self) -> None:
        if self._subscription is not None and threading.get_ident() != self._subscription.thread:
            raise RuntimeError(
                "call BufferedPublisher from its event loop's thread (use call_soon_threadsafe)"
            )

    def _has_room(self) -> bool:
        demand = self._subscription.demand if self._subscription is not None else 0
        return len(self._buffer) < self.capacity + demand

    def _drop(self) -> None:
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(1)

    def _end(self, error: BaseException | None) -> None:
        self._ending = True
        self._error = error
        self._close()
        self._schedule()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._room.set()  # producers waiting in put() return False
        if self._on_close is not None:
            try:
                self._on_close()
            except Exception:
                log.exception("on_close of a BufferedPublisher raised")  # cancel must return normally (3.15)

    def _requested(self, n: int) -> None:
        self._room.set()  # demand makes room at once
        self._schedule()

    def _cancelled(self) -> None:
        self._buffer.clear()
        self._close()

    def _schedule(self) -> None:
        subscription = self._subscription
        if subscription is not None and subscription.active and not self._scheduled:
            self._scheduled = True
            subscription.loop.call_soon(self._drain)

    def _drain(self) -> None:
        subscription = self._subscription
        assert subscription is not None
        # on_next may request or offer more: this loop picks it up (rule 3.3), _scheduled stops a second drain
        while subscription.active and subscription.demand > 0 and self._buffer:
            subscription.next(self._buffer.popleft())
        if self._ending and not self._buffer:
            if self._error is None:
                subscription.complete()
            else:
                subscription.error(self._error)
        self._scheduled = False


class MapProcessor(Generic[T, R]):
    """A Processor applying `function` to each item; downstream demand goes upstream 1:1, as it arrives.

    Subscribe it upstream and subscribe a downstream to it, in either order: demand requested before the
    upstream subscription arrives is passed on when it does, and an upstream that ends before a downstream
    subscribes ends the downstream right after its on_subscribe. If `function` raises or returns None, the
    upstream is cancelled and the downstream gets on_error. An upstream sending more than was requested
    breaks rule 1.1: it is cancelled and the downstream gets on_error(FlowViolation).
    """

    def __init__(self, function: Callable[[T], R]) -> None:
        self._function = function
        self._upstream: Subscription | None = None
        self._downstream: _Subscription[R] | None = None
        self._unforwarded = 0  # demand requested downstream before the upstream subscription arrived
        self._stopped = False  # the upstream ended or was cancelled: ignore what it still sends (2.4, 2.8)
        self._upstream_end: tuple[BaseException | None] | None = None  # its terminal signal, until delivered

    # ---- Subscriber (upstream side) ----------------------------------------------------------------

    def on_subscribe(self, subscription: Subscription) -> None:
        _require(subscription, "subscription")
        if self._upstream is not None or self._stopped:
            subscription.cancel()  # rule 2.5 (or the downstream already cancelled)
            return
        self._upstream = subscription
        if self._unforwarded:
            n, self._unforwarded = self._unforwarded, 0
            subscription.request(n)

    def on_next(self, item: T) -> None:
        _require(item, "item")
        if self._stopped:
            return
        downstream = self._downstream
        if downstream is None or downstream.demand == 0:
            self._fail(FlowViolation("the upstream sent an item that was not requested (rule 1.1)"))
            return
        try:
            result = self._function(item)
        except Exception as error:  # noqa: BLE001 - the processor failed: on_error downstream (rule 1.4)
            self._fail(error)
            return
        if result is None:
            self._fail(TypeError(f"{self._function!r} returned None; items must not be None (rule 2.13)"))
            return
        downstream.next(result)

    def on_error(self, error: BaseException) -> None:
        _require(error, "error")
        if not self._stopped:
            self._upstream_ended(error)

    def on_complete(self) -> None:
        if not self._stopped:
            self._upstream_ended(None)

    # ---- Publisher (downstream side) ---------------------------------------------------------------

    def subscribe(self, subscriber: Subscriber[R]) -> None:
        if not _admit(self, self._downstream, subscriber):
            return
        downstream = _Subscription(subscriber, on_request=self._forward, on_cancel=self._cancel_upstream)
        self._downstream = downstream
        downstream.start()
        self._deliver_end()

    # ---- internals ---------------------------------------------------------------------------------

    def _forward(self, n: int) -> None:
        if self._stopped:
            return
        if self._upstream is None:
            self._unforwarded = min(MAX_DEMAND, self._unforwarded + n)
        else:
            self._upstream.request(n)

    def _cancel_upstream(self) -> None:
        self._stopped = True
        upstream, self._upstream = self._upstream, None
        if upstream is not None:
            upstream.cancel()

    def _fail(self, error: BaseException) -> None:
        self._cancel_upstream()
        self._upstream_end = (error,)
        self._deliver_end()

    def _upstream_ended(self, error: BaseException | None) -> None:
        self._stopped = True
        self._upstream = None  # rule 2.4: the subscription is over; never call it again
        self._upstream_end = (error,)
        self._deliver_end()

    def _deliver_end(self) -> None:
        if self._downstream is None or self._upstream_end is None:
            return
        (error,) = self._upstream_end
        self._upstream_end = None
        if error is None:
            self._downstream.complete()
        else:
            self._downstream.error(error)


# ---- recording subscribers (test doubles, also for the wire suite) ------------------------------


class RecordingSubscriber(Generic[T]):
    """A Subscriber that records every signal in order, and every rule its publisher breaks.

    `request`: requested in on_subscribe; `request_more`: requested again inside each on_next (rule 3.2);
    `cancel_after`: cancel inside on_next once that many items arrived. `violations` lists the publisher's
    breaches it can see (rules 1.1, 1.3, 1.7, 1.9, 2.12); a conforming publisher leaves it empty. Signals
    must come on the loop thread of the waiting test (wait_for).
    """

    def __init__(self, request: int = 0, *, request_more: int = 0, cancel_after: int | None = None) -> None:
        self.subscription: Subscription | None = None
        self.signals: list[tuple[str, object]] = []
        """("on_subscribe", subscription), ("on_next", item), ("on_error", error), ("on_complete", None)."""
        self.items: list[T] = []
        self.error: BaseException | None = None
        self.completed = False
        self.cancelled = False
        self.requested = 0
        """Total requested through this object, saturating at MAX_DEMAND."""
        self.violations: list[str] = []
        self._initial = request
        self._more = request_more
        self._cancel_after = cancel_after
        self._in_signal: str | None = None
        self._thread: int | None = None
        self._changed = asyncio.Event()

    @property
    def terminated(self) -> bool:
        return self.completed or self.error is not None

    def describe(self) -> str:
        return (
            f"{len(self.items)} items, completed={self.completed}, error={self.error!r}, "
            f"violations={self.violations}"
        )

    # ---- Subscriber ----------------------------------------------------------------------------------

    def on_subscribe(self, subscription: Subscription) -> None:
        _require(subscription, "subscription")
        with self._signal("on_subscribe", subscription):
            if self.subscription is not None:
                self.violations.append("on_subscribe called twice (rule 2.12)")
                subscription.cancel()  # rule 2.5
                return
            self.subscription = subscription
            if self._initial:
                self._request(self._initial)

    def on_next(self, item: T) -> None:
        _require(item, "item")
        with self._signal("on_next", item):
            self.items.append(item)
            if len(self.items) > self.requested:
                self.violations.append(
                    f"item {len(self.items)} exceeds the {self.requested} requested (rule 1.1)"
                )
            if self._cancel_after is not None and len(self.items) >= self._cancel_after:
                self._cancel()
            elif self._more:
                self._request(self._more)

    def on_error(self, error: BaseException) -> None:
        _require(error, "error")
        with self._signal("on_error", error):
            self.error = error

    def on_complete(self) -> None:
        with self._signal("on_complete", None):
            self.completed = True

    # ---- waiting -----------------------------------------------------------------------------------

    async def wait_for(self, items: int | None = None, *, timeout: float = 10.0) -> None:
        """Wait for `items` items (None: for a terminal signal); AssertionError on timeout or early end."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    if items is None and self.terminated:
                        return
                    if items is not None and len(self.items) >= items:
                        return
                    if items is not None and self.terminated:
                        raise AssertionError(f"ended before {items} items: {self.describe()}")
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            wanted = "a terminal signal" if items is None else f"{items} items"
            raise AssertionError(f"no {wanted} within {timeout} s: {self.describe()}") from None

    async def expect_no_signal(self, within: float = 0.05) -> None:
        """Assert that no signal arrives for `within` seconds."""
        before = len(self.signals)
        await asyncio.sleep(within)
        assert len(self.signals) == before, f"unexpected signals: {self.signals[before:]}"

    # ---- internals ---------------------------------------------------------------------------------

    def _request(self, n: int) -> None:
        assert self.subscription is not None, "no subscription yet"
        if n > 0:
            self.requested = min(MAX_DEMAND, self.requested + n)
        self.subscription.request(n)

    def _cancel(self) -> None:
        assert self.subscription is not None, "no subscription yet"
        self.cancelled = True
        self.subscription.cancel()

    @contextlib.contextmanager
    def _signal(self, name: str, value: object) -> Iterator[None]:
        if self._in_signal is not None:
            self.violations.append(f"{name} while {self._in_signal} was running (rule 1.3)")
        thread = threading.get_ident()
        if self._thread is None:
            self._thread = thread
        elif thread != self._thread:
            self.violations.append(f"{name} on another thread (rule 1.3)")
        if name != "on_subscribe" and self.subscription is None:
            self.violations.append(f"{name} before on_subscribe (rule 1.9)")
        if self.terminated:
            self.violations.append(f"{name} after the terminal signal (rule 1.7)")
        self.signals.append((name, value))
        outer, self._in_signal = self._in_signal, name
        try:
            yield
        finally:
            self._in_signal = outer
            self._changed.set()


class ManualSubscriber(RecordingSubscriber[T]):
    """A RecordingSubscriber that requests nothing by itself: the test calls request() and cancel()."""

    def request(self, n: int) -> None:
        self._request(n)

    def cancel(self) -> None:
        self._cancel()
