"""The reactivex adapters: from_observable (bounded buffer + overflow strategy) and to_observable."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import reactivex
from reactivex.disposable import Disposable
from reactivex.subject import Subject

from sluice_client.flow import MAX_DEMAND
from sluice_client.publishers import (
    BufferOverflowError,
    IterablePublisher,
    ManualSubscriber,
    OverflowStrategy,
    RecordingSubscriber,
)
from sluice_client.rx import from_async_iterable, from_observable, to_observable

from .probes import CapturePublisher, ProbeSubscription, RxRecorder, eventually


class Boom(Exception):
    pass


# capacity 3, no demand yet, the Observable emits 1..6 then completes; then all demand
OVERFLOW = [
    pytest.param(OverflowStrategy.ERROR, [1, 2, 3], 1, id="error"),
    pytest.param(OverflowStrategy.DROP_LATEST, [1, 2, 3], 3, id="drop_latest"),
    pytest.param(OverflowStrategy.DROP_OLDEST, [4, 5, 6], 3, id="drop_oldest"),
    pytest.param(OverflowStrategy.LATEST, [1, 2, 6], 3, id="latest"),
]


@pytest.mark.parametrize(("strategy", "delivered", "dropped"), OVERFLOW)
async def test_from_observable_overflow_strategies(
    strategy: OverflowStrategy, delivered: list[int], dropped: int
) -> None:
    subject: Subject[int] = Subject()
    drops: list[int] = []
    publisher = from_observable(subject, capacity=3, overflow=strategy, on_drop=drops.append)
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    for i in range(1, 7):
        subject.on_next(i)
    subject.on_completed()
    assert publisher.dropped == dropped
    assert drops == [1] * dropped
    sub.request(100)
    await sub.wait_for()
    assert sub.items == delivered
    if strategy is OverflowStrategy.ERROR:
        assert isinstance(sub.error, BufferOverflowError)
        assert subject.observers == []  # the overflow disposed the Rx subscription at once
    else:
        assert sub.completed
    assert sub.violations == []


async def test_from_observable_error_and_completion_follow_the_buffered_items() -> None:
    failing: Subject[int] = Subject()
    failed = ManualSubscriber[int]()
    from_observable(failing, capacity=4).subscribe(failed)
    failing.on_next(1)
    error = Boom("rx failed")
    failing.on_error(error)
    await failed.expect_no_signal()  # the error waits behind the item, which needs demand
    failed.request(1)
    await failed.wait_for()
    assert failed.items == [1]
    assert failed.error is error

    completing: Subject[int] = Subject()
    completed = ManualSubscriber[int]()
    from_observable(completing, capacity=4).subscribe(completed)
    completing.on_completed()
    await completed.wait_for()  # nothing buffered: on_complete without demand
    assert completed.completed


async def test_from_observable_subscribes_on_subscribe_and_cancel_disposes() -> None:
    subscribed: list[bool] = []
    disposed: list[bool] = []

    def subscribe(observer: Any, scheduler: Any = None) -> Disposable:
        subscribed.append(True)
        return Disposable(lambda: disposed.append(True))

    publisher = from_observable(reactivex.create(subscribe), capacity=4)
    assert subscribed == []  # cold: nothing happens before a Flow subscriber comes
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    assert subscribed == [True]
    assert disposed == []
    sub.cancel()
    assert disposed == [True]

    subject: Subject[int] = Subject()
    other = ManualSubscriber[int]()
    from_observable(subject, capacity=4).subscribe(other)
    assert len(subject.observers) == 1
    other.cancel()
    assert subject.observers == []


async def test_from_observable_cancel_in_on_subscribe_never_subscribes_rx() -> None:
    class Quitter(ManualSubscriber[int]):
        def on_subscribe(self, subscription: Any) -> None:
            super().on_subscribe(subscription)
            self.cancel()

    subject: Subject[int] = Subject()
    from_observable(subject, capacity=4).subscribe(Quitter())
    assert subject.observers == []


async def test_from_observable_items_from_another_thread() -> None:
    subject: Subject[int] = Subject()
    sub = RecordingSubscriber[int](MAX_DEMAND)
    from_observable(subject, capacity=1000).subscribe(sub)

    def emit() -> None:
        for i in range(1000):
            subject.on_next(i)
        subject.on_completed()

    emitter = threading.Thread(target=emit)
    emitter.start()
    await sub.wait_for()
    emitter.join()
    assert sub.items == list(range(1000))
    assert sub.completed
    assert sub.violations == []  # every signal on the loop thread, none nested


async def test_from_observable_subscribe_from_another_thread_with_loop() -> None:
    publisher = from_observable(
        reactivex.from_iterable(range(3)), capacity=3, loop=asyncio.get_running_loop()
    )
    sub = RecordingSubscriber[int](10)
    subscriber = threading.Thread(target=publisher.subscribe, args=(sub,))
    subscriber.start()
    subscriber.join()
    await sub.wait_for()
    assert sub.items == [0, 1, 2]
    assert sub.violations == []


async def test_from_observable_none_is_an_error() -> None:
    sub = RecordingSubscriber[Any](10)
    from_observable(reactivex.from_iterable([1, None, 2]), capacity=4).subscribe(sub)
    await sub.wait_for()
    assert sub.items == [1]
    assert isinstance(sub.error, TypeError)


async def test_from_async_iterable_is_an_iterable_publisher() -> None:
    async def items() -> AsyncIterator[int]:
        for i in range(3):
            yield i

    publisher = from_async_iterable(items())
    assert isinstance(publisher, IterablePublisher)
    sub = RecordingSubscriber[int](10)
    publisher.subscribe(sub)
    await sub.wait_for()
    assert sub.items == [0, 1, 2]


# ---- to_observable ---------------------------------------------------------------------------------


async def test_to_observable_prefetches_and_refills_at_half() -> None:
    capture, recorder = CapturePublisher(), RxRecorder()
    to_observable(capture, request=4).subscribe(recorder)
    assert capture.subscriber is not None
    probe = ProbeSubscription()
    capture.subscriber.on_subscribe(probe)
    assert probe.calls == [("request", 4)]
    for i in range(6):
        capture.subscriber.on_next(i)
    # topped up to 4 each time 2 are used: never more than 4 requested ahead
    assert probe.calls == [("request", 4), ("request", 2), ("request", 2), ("request", 2)]
    assert recorder.items == list(range(6))


async def test_to_observable_refills_to_the_end() -> None:
    recorder = RxRecorder()
    to_observable(IterablePublisher(range(100)), request=1).subscribe(recorder)
    await asyncio.wait_for(recorder.done.wait(), 10)
    assert recorder.items == list(range(100))
    assert recorder.completed


async def test_to_observable_error_and_dispose() -> None:
    async def failing() -> AsyncIterator[int]:
        yield 1
        raise Boom("source failed")

    recorder = RxRecorder()
    to_observable(IterablePublisher(failing())).subscribe(recorder)
    await asyncio.wait_for(recorder.done.wait(), 10)
    assert recorder.items == [1]
    assert isinstance(recorder.error, Boom)

    # both ways round: Rx -> Flow -> Rx, disposed from another thread
    subject: Subject[int] = Subject()
    downstream = RxRecorder()
    disposable = to_observable(from_observable(subject, capacity=8)).subscribe(downstream)
    subject.on_next(1)
    await eventually(lambda: downstream.items == [1])
    disposer = threading.Thread(target=disposable.dispose)
    disposer.start()
    disposer.join()
    await eventually(lambda: subject.observers == [])
    assert downstream.threads == {threading.get_ident()}


async def test_to_observable_observer_raising_cancels(caplog: pytest.LogCaptureFixture) -> None:
    capture = CapturePublisher()

    def on_next(item: int) -> None:
        raise Boom("observer failed")

    to_observable(capture, request=4).subscribe(on_next=on_next)
    assert capture.subscriber is not None
    probe = ProbeSubscription()
    capture.subscriber.on_subscribe(probe)
    capture.subscriber.on_next(1)  # returns normally (rule 2.13)
    assert probe.cancelled
    assert "observer raised" in caplog.text
    with pytest.raises(ValueError, match="request"):
        to_observable(capture, request=0)
