"""Adapters between reactivex (RxPY) and the Flow contract.

Rx has no backpressure: an Observable pushes as fast as it likes. `from_observable` puts a bounded buffer
with an explicit OverflowStrategy between the two, so what happens when the Flow subscriber is slower is
a decision, never an accident. `to_observable` goes the other way with a bounded prefetch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterable, Callable, Iterable
from typing import Generic, TypeVar

import reactivex
from reactivex import Observable, abc
from reactivex.disposable import Disposable, SingleAssignmentDisposable

from sluice_client.flow import Publisher, Subscriber, Subscription
from sluice_client.publishers import (
    BufferedPublisher,
    IterablePublisher,
    OverflowStrategy,
    _require,
    count_arg,
)

__all__ = ["ObservablePublisher", "from_async_iterable", "from_observable", "to_observable"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class ObservablePublisher(Generic[T]):
    """A unicast Flow Publisher over an Rx Observable; see from_observable."""

    def __init__(
        self,
        observable: Observable[T],
        *,
        capacity: int,
        overflow: OverflowStrategy = OverflowStrategy.ERROR,
        loop: asyncio.AbstractEventLoop | None = None,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self._observable = observable
        self._loop = loop
        self._rx = SingleAssignmentDisposable()  # disposed when the buffer closes, even before assignment
        self._buffer = BufferedPublisher[T](capacity, overflow, on_drop=on_drop, on_close=self._rx.dispose)
        self._started = False

    @property
    def dropped(self) -> int:
        """Items lost to overflow so far."""
        return self._buffer.dropped

    def subscribe(self, subscriber: Subscriber[T]) -> None:
        _require(subscriber, "subscriber")
        if self._loop is not None and _running_loop() is not self._loop:
            self._loop.call_soon_threadsafe(self.subscribe, subscriber)
            return
        first = not self._started
        self._buffer.subscribe(subscriber)  # a second subscriber is rejected there
        self._started = True
        if not first or self._buffer.closed:
            return  # not the first subscriber, or it cancelled in on_subscribe: never subscribe to Rx
        loop = asyncio.get_running_loop()
        thread = threading.get_ident()
        buffer = self._buffer

        def on_loop(method: Callable[..., None], *args: object) -> None:
            # Rx may call from any thread; the buffer lives on the loop
            if threading.get_ident() == thread:
                method(*args)
                return
            try:
                loop.call_soon_threadsafe(method, *args)
            except RuntimeError:
                self._rx.dispose()  # the loop is closed: nobody is left to deliver to

        def offer(value: T) -> None:
            if value is None:
                buffer.fail(TypeError("the Observable emitted None; items must not be None (rule 2.13)"))
            else:
                buffer.offer(value)

        self._rx.disposable = self._observable.subscribe(
            on_next=lambda value: on_loop(offer, value),
            on_error=lambda error: on_loop(buffer.fail, error),
            on_completed=lambda: on_loop(buffer.complete),
        )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def from_observable(
    observable: Observable[T],
    *,
    capacity: int,
    overflow: OverflowStrategy = OverflowStrategy.ERROR,
    loop: asyncio.AbstractEventLoop | None = None,
    on_drop: Callable[[int], None] | None = None,
) -> ObservablePublisher[T]:
    """A Flow Publisher of what `observable` emits, for one subscriber.

    The Observable is subscribed when the Flow subscriber subscribes (a cold Observable starts then).
    Items it emits, from any thread, are handed to the loop and buffered; up to `capacity` of them wait
    for demand, beyond that `overflow` decides (see OverflowStrategy; `on_drop(1)` per item lost).
    on_error and on_completed become on_error and on_complete after the buffered items; cancelling, an
    ERROR overflow or the end of the stream dispose the Rx subscription. `loop`: the loop that serves the
    subscriber; given, subscribe() may be called from any thread, else it must run on the loop.
    """
    return ObservablePublisher(observable, capacity=capacity, overflow=overflow, loop=loop, on_drop=on_drop)


def from_async_iterable(source: AsyncIterable[T] | Iterable[T]) -> Publisher[T]:
    """A Flow Publisher pulling from `source` on demand: an IterablePublisher."""
    return IterablePublisher(source)


class _ObserverSubscriber(Generic[T]):
    """A Flow Subscriber feeding an Rx observer: at most `prefetch` items requested, refilled at half."""

    def __init__(self, observer: abc.ObserverBase[T], prefetch: int) -> None:
        self._observer = observer
        self._prefetch = prefetch
        self._outstanding = 0
        self._subscription: Subscription | None = None
        self._done = False  # terminated or disposed: ignore whatever still arrives (rules 2.4, 2.8)
        self._loop = asyncio.get_running_loop()
        self._thread = threading.get_ident()

    def on_subscribe(self, subscription: Subscription) -> None:
        _require(subscription, "subscription")
        if self._subscription is not None or self._done:
            subscription.cancel()  # rule 2.5, or the Rx side disposed before the subscription came
            return
        self._subscription = subscription
        self._outstanding = self._prefetch
        subscription.request(self._prefetch)

    def on_next(self, item: T) -> None:
        _require(item, "item")
        if self._done or self._subscription is None:
            return
        self._outstanding -= 1
        try:
            self._observer.on_next(item)
        except Exception:
            log.exception("an Rx observer raised from on_next: cancelling its subscription")
            self.cancel()
            return
        if not self._done and self._outstanding <= self._prefetch // 2:
            more, self._outstanding = self._prefetch - self._outstanding, self._prefetch
            self._subscription.request(more)

    def on_error(self, error: BaseException) -> None:
        _require(error, "error")
        if self._end():
            # Rx observers take Exception; a BaseException (e.g. KeyboardInterrupt) is wrapped
            failure = error if isinstance(error, Exception) else RuntimeError(f"stream failed: {error!r}")
            self._signal(self._observer.on_error, failure)

    def on_complete(self) -> None:
        if self._end():
            self._signal(self._observer.on_completed)

    def cancel(self) -> None:
        """Dispose from Rx, from any thread: the subscription is called on the loop only (rule 2.7)."""
        if threading.get_ident() != self._thread:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to cancel
                self._loop.call_soon_threadsafe(self.cancel)
            return
        if self._done:
            return
        self._done = True
        subscription, self._subscription = self._subscription, None
        if subscription is not None:
            subscription.cancel()

    def _end(self) -> bool:
        if self._done:
            return False
        self._done = True
        self._subscription = None  # rules 2.3, 2.4: never called again
        return True

    @staticmethod
    def _signal(method: Callable[..., None], *args: object) -> None:
        try:
            method(*args)
        except Exception:
            log.exception("an Rx observer raised from its terminal signal")  # ours must return normally


def to_observable(publisher: Publisher[T], *, request: int = 64) -> Observable[T]:
    """`publisher` as an Rx Observable, for in-process consumers.

    Each Rx subscription subscribes a new Flow subscriber to `publisher`; it requests `request` items,
    and tops demand back up to `request` whenever half of it is used, so at most `request` items are ever
    requested ahead of the observer. Disposing cancels the Flow subscription (from any thread). Subscribe
    on the event loop thread.
    """
    request = count_arg(request, "request")

    def subscribe(
        observer: abc.ObserverBase[T], scheduler: abc.SchedulerBase | None = None
    ) -> abc.DisposableBase:
        subscriber = _ObserverSubscriber(observer, request)
        publisher.subscribe(subscriber)
        return Disposable(subscriber.cancel)

    return reactivex.create(subscribe)
