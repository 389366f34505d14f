"""Reactive Streams conformance of the in-process Flow implementations: one test per rule, TCK style.

Named after reactive-streams-jvm's TCK (PublisherVerification, SubscriberWhiteboxVerification):
test_{required|optional|untested}_spec{rule}_{what}. Publisher and subscription rules run against every
publisher below; subscriber rules against the subscribers this package ships (MapProcessor's upstream
side and the subscriber behind rx.to_observable), driven through a probe subscription. Rules that cannot
be checked in Python are skipped with the reason. tests/tck/README.md maps every rule to its test.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
import reactivex
from reactivex.disposable import Disposable

from sluice_client.flow import MAX_DEMAND, Publisher, Subscriber
from sluice_client.publishers import (
    BufferedPublisher,
    IterablePublisher,
    ManualSubscriber,
    MapProcessor,
    RecordingSubscriber,
    SubscriptionRejected,
)
from sluice_client.rx import from_observable, to_observable

from .probes import CapturePublisher, ProbeSubscription, RxRecorder, eventually


class Boom(Exception):
    """What the failing publishers fail with."""


# ---- publishers under test: make(n) publishes 0..n-1 then completes; make_failing(n, e) then fails ----


async def _numbers(n: int, error: Exception | None = None) -> AsyncIterator[int]:
    for i in range(n):
        yield i
    if error is not None:
        raise error


def _numbers_sync(n: int, error: Exception | None = None) -> Iterator[int]:
    yield from range(n)
    if error is not None:
        raise error


def _buffered(n: int, error: Exception | None = None) -> BufferedPublisher[int]:
    publisher = BufferedPublisher[int](capacity=max(n, 1))
    for i in range(n):
        assert publisher.offer(i)
    if error is None:
        publisher.complete()
    else:
        publisher.fail(error)
    return publisher


def _mapped(n: int, error: Exception | None = None) -> MapProcessor[int, int]:
    def half(x: int) -> int:
        if x == 2 * n and error is not None:
            raise error  # the processor's own failure becomes on_error (rule 1.4)
        return x // 2

    processor = MapProcessor(half)
    IterablePublisher(range(0, 2 * n + 1 if error else 2 * n, 2)).subscribe(processor)
    return processor


def _rx(n: int, error: Exception | None = None) -> Publisher[int]:
    source: reactivex.Observable[int] = reactivex.from_iterable(range(n))
    if error is not None:
        source = reactivex.concat(source, reactivex.throw(error))
    return from_observable(source, capacity=max(n, 1))


@dataclass(frozen=True)
class Case:
    build: Callable[[int, Exception | None], Publisher[int]]

    def make(self, n: int) -> Publisher[int]:
        return self.build(n, None)

    def make_failing(self, n: int, error: Exception) -> Publisher[int]:
        return self.build(n, error)


CASES = {
    "iterable": Case(lambda n, e: IterablePublisher(_numbers(n, e))),
    "iterable-sync": Case(lambda n, e: IterablePublisher(_numbers_sync(n, e))),
    "buffered": Case(_buffered),
    "map": Case(_mapped),
    "rx": Case(_rx),
}
publishers = pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))


def manual(publisher: Publisher[int]) -> ManualSubscriber[int]:
    subscriber = ManualSubscriber[int]()
    publisher.subscribe(subscriber)
    return subscriber


def names(subscriber: RecordingSubscriber[Any]) -> list[str]:
    return [name for name, _ in subscriber.signals]


# ---- subscribers under test, driven through a ProbeSubscription ---------------------------------


@dataclass
class Subject:
    subscriber: Subscriber[int]
    output: Any
    """What the subscriber passed on: has items, error, completed."""
    stop: Callable[[], None]
    """Its consumer no longer wants items (downstream cancel, Rx dispose)."""


def _map_subject(demand: int = 4) -> Subject:
    processor = MapProcessor[int, int](lambda x: x)
    downstream = ManualSubscriber[int]()
    processor.subscribe(downstream)
    if demand:
        downstream.request(demand)
    return Subject(processor, downstream, downstream.cancel)


def _rx_subject(demand: int = 4) -> Subject:
    # the observer's subscriber always requests on subscribe: `demand` only sets how much
    capture, output = CapturePublisher(), RxRecorder()
    disposable = to_observable(capture, request=max(demand, 1)).subscribe(output)
    assert capture.subscriber is not None
    return Subject(capture.subscriber, output, disposable.dispose)


SUBJECTS: dict[str, Callable[..., Subject]] = {"map": _map_subject, "rx-observer": _rx_subject}
subscribers = pytest.mark.parametrize("make_subject", list(SUBJECTS.values()), ids=list(SUBJECTS))


# ---- 1.x Publisher --------------------------------------------------------------------------------


@publishers
async def test_required_spec101_request_bounds_on_next(case: Case) -> None:
    sub = manual(case.make(10))
    await sub.expect_no_signal()
    sub.request(3)
    await sub.wait_for(3)
    await sub.expect_no_signal()
    sub.request(2)
    await sub.wait_for(5)
    await sub.expect_no_signal()
    assert sub.items == [0, 1, 2, 3, 4]
    assert sub.violations == []


@publishers
async def test_required_spec102_may_signal_fewer_and_terminate(case: Case) -> None:
    sub = manual(case.make(3))
    sub.request(10)
    await sub.wait_for()
    assert sub.items == [0, 1, 2]
    assert sub.completed
    assert sub.violations == []


@publishers
async def test_required_spec103_signals_are_serial(case: Case) -> None:
    # requests from inside on_next and, at the same time, from another thread: signals must still come
    # one at a time, on the loop thread, never nested (the recorder notes any of that as a violation)
    sub = RecordingSubscriber[int](1, request_more=1)
    case.make(300).subscribe(sub)
    assert sub.subscription is not None
    subscription = sub.subscription

    def request_elsewhere() -> None:
        for _ in range(50):
            subscription.request(1)

    other = threading.Thread(target=request_elsewhere)
    other.start()
    await sub.wait_for()
    other.join()
    assert sub.violations == []
    assert sub.items == list(range(300))
    assert sub.completed


@publishers
async def test_optional_spec104_error_signals_on_error(case: Case) -> None:
    error = Boom("the source failed")
    sub = manual(case.make_failing(2, error))
    sub.request(10)
    await sub.wait_for()
    assert sub.items == [0, 1]
    assert sub.error is error
    assert sub.violations == []


@publishers
@pytest.mark.parametrize("n", [0, 3])
async def test_required_spec105_finite_stream_signals_on_complete(case: Case, n: int) -> None:
    sub = manual(case.make(n))
    for i in range(n):
        sub.request(1)
        await sub.wait_for(i + 1)
    sub.request(1)
    await sub.wait_for()
    assert sub.completed
    assert sub.items == list(range(n))
    assert sub.violations == []


@publishers
async def test_required_spec106_terminal_signal_cancels_the_subscription(case: Case) -> None:
    sub = manual(case.make(1))
    sub.request(5)
    await sub.wait_for()
    # the subscription is over: not even request(0) may signal (rule 3.9 no longer applies)
    sub.request(0)
    sub.request(7)
    sub.cancel()
    await sub.expect_no_signal()
    assert names(sub) == ["on_subscribe", "on_next", "on_complete"]


@publishers
async def test_required_spec107_no_signal_after_a_terminal_one(case: Case) -> None:
    done = manual(case.make(2))
    done.request(1)
    await done.wait_for(1)
    done.request(5)
    await done.wait_for()
    done.request(5)
    failed = manual(case.make_failing(1, Boom()))
    failed.request(5)
    await failed.wait_for()
    failed.request(5)
    await done.expect_no_signal()
    assert names(done) == ["on_subscribe", "on_next", "on_next", "on_complete"]
    assert names(failed) == ["on_subscribe", "on_next", "on_error"]
    assert done.violations == failed.violations == []


@publishers
async def test_required_spec108_cancelled_subscriber_stops_being_signalled(case: Case) -> None:
    sub = manual(case.make(3))
    sub.request(10)
    sub.cancel()  # in the same loop step: ours stop at once, before any item or the completion
    await sub.expect_no_signal()
    assert names(sub) == ["on_subscribe"]


@publishers
async def test_required_spec109_subscribe_signals_on_subscribe_first(case: Case) -> None:
    publisher = case.make(3)
    with pytest.raises(TypeError):
        publisher.subscribe(None)  # type: ignore[arg-type]
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)  # returns normally, having called on_subscribe
    assert names(sub) == ["on_subscribe"]
    sub.request(3)
    await sub.wait_for(3)
    assert sub.violations == []


@publishers
async def test_required_spec110_same_subscriber_twice_is_ignored(
    case: Case, caplog: pytest.LogCaptureFixture
) -> None:
    publisher = case.make(3)
    sub = manual(publisher)
    publisher.subscribe(sub)  # the caller breaks rule 1.10; a second on_subscribe would break 2.12
    sub.request(10)
    await sub.wait_for()
    assert names(sub) == ["on_subscribe", "on_next", "on_next", "on_next", "on_complete"]
    assert sub.violations == []
    assert "subscribed twice" in caplog.text


@publishers
async def test_optional_spec111_unicast_rejects_other_subscribers(case: Case) -> None:
    publisher = case.make(3)
    first = manual(publisher)
    others = [manual(publisher) for _ in range(3)]
    for other in others:
        assert names(other) == ["on_subscribe", "on_error"]  # rule 1.9: rejected after on_subscribe
        assert isinstance(other.error, SubscriptionRejected)
        other.request(5)
    first.request(10)
    await first.wait_for()
    assert first.items == [0, 1, 2]
    assert first.completed
    assert all(names(other) == ["on_subscribe", "on_error"] for other in others)


# ---- 2.x Subscriber ---------------------------------------------------------------------------------


@subscribers
async def test_required_spec201_signals_demand_via_request(make_subject: Callable[..., Subject]) -> None:
    subject, probe = make_subject(), ProbeSubscription()
    subject.subscriber.on_subscribe(probe)
    assert probe.requested >= 4
    for i in range(4):
        subject.subscriber.on_next(i)
    assert subject.output.items == [0, 1, 2, 3]


def test_untested_spec202_should_dispatch_asynchronously() -> None:
    pytest.skip(
        "advice (SHOULD) for subscribers with slow processing, not checkable: MapProcessor and the Rx "
        "adapter do O(1) work per signal besides the caller's own function or observer"
    )


@subscribers
@pytest.mark.parametrize("terminal", ["complete", "error"])
async def test_required_spec203_terminal_signals_call_nothing(
    make_subject: Callable[..., Subject], terminal: str
) -> None:
    subject, probe = make_subject(), ProbeSubscription()
    subject.subscriber.on_subscribe(probe)
    subject.subscriber.on_next(0)
    before = list(probe.calls)
    if terminal == "complete":
        subject.subscriber.on_complete()
        assert subject.output.completed
    else:
        error = Boom()
        subject.subscriber.on_error(error)
        assert subject.output.error is error
    assert probe.calls == before


@subscribers
async def test_required_spec204_after_terminal_the_subscription_is_not_used(
    make_subject: Callable[..., Subject],
) -> None:
    subject, probe = make_subject(), ProbeSubscription()
    subject.subscriber.on_subscribe(probe)
    subject.subscriber.on_complete()
    before = list(probe.calls)
    subject.subscriber.on_next(1)  # a broken publisher: ignored, and no refill is requested
    subject.stop()  # the consumer stops: there is nothing left to cancel
    await asyncio.sleep(0)
    assert probe.calls == before
    assert subject.output.items == []


@subscribers
async def test_required_spec205_cancels_a_second_subscription(make_subject: Callable[..., Subject]) -> None:
    subject, first, second = make_subject(), ProbeSubscription(), ProbeSubscription()
    subject.subscriber.on_subscribe(first)
    subject.subscriber.on_subscribe(second)
    assert second.calls == [("cancel", None)]
    assert not first.cancelled


@subscribers
async def test_required_spec206_cancels_when_no_longer_needed(make_subject: Callable[..., Subject]) -> None:
    subject, probe = make_subject(), ProbeSubscription()
    subject.subscriber.on_subscribe(probe)
    subject.subscriber.on_next(0)
    assert not probe.cancelled
    subject.stop()
    assert probe.cancelled


@subscribers
async def test_required_spec207_subscription_calls_are_serial(make_subject: Callable[..., Subject]) -> None:
    # the consumer stops from another thread: the subscription is still only called from the loop thread
    subject, probe = make_subject(), ProbeSubscription()
    subject.subscriber.on_subscribe(probe)
    stopper = threading.Thread(target=subject.stop)
    stopper.start()
    stopper.join()
    await eventually(lambda: probe.cancelled)
    assert probe.threads == {threading.get_ident()}


@subscribers
async def test_required_spec208_accepts_on_next_after_cancel(make_subject: Callable[..., Subject]) -> None:
    subject, probe = make_subject(), ProbeSubscription()
    subject.subscriber.on_subscribe(probe)
    subject.stop()
    assert probe.cancelled
    subject.subscriber.on_next(0)  # still in flight when the cancel went out: returns normally
    subject.subscriber.on_next(1)
    subject.subscriber.on_complete()
    assert subject.output.items == []
    assert not subject.output.completed


@subscribers
async def test_required_spec209_accepts_on_complete_with_or_without_request(
    make_subject: Callable[..., Subject],
) -> None:
    idle = make_subject(demand=0)  # MapProcessor: nothing requested downstream, so nothing upstream
    idle.subscriber.on_subscribe(ProbeSubscription())
    idle.subscriber.on_complete()
    assert idle.output.completed
    busy, probe = make_subject(), ProbeSubscription()
    busy.subscriber.on_subscribe(probe)
    assert probe.requested > 0
    busy.subscriber.on_next(0)
    busy.subscriber.on_complete()
    assert busy.output.items == [0]
    assert busy.output.completed


@subscribers
async def test_required_spec210_accepts_on_error_with_or_without_request(
    make_subject: Callable[..., Subject],
) -> None:
    error = Boom()
    idle = make_subject(demand=0)
    idle.subscriber.on_subscribe(ProbeSubscription())
    idle.subscriber.on_error(error)
    assert idle.output.error is error
    busy, probe = make_subject(), ProbeSubscription()
    busy.subscriber.on_subscribe(probe)
    assert probe.requested > 0
    busy.subscriber.on_next(0)
    busy.subscriber.on_error(error)
    assert busy.output.items == [0]
    assert busy.output.error is error


def test_untested_spec211_signal_calls_happen_before_processing() -> None:
    pytest.skip(
        "JVM memory-model rule: a Python signal is a call on the loop thread, and what it did is visible "
        "when it returns; there is no separate publication step to get wrong"
    )


def test_untested_spec212_on_subscribe_at_most_once() -> None:
    pytest.skip(
        "a rule for whoever calls on_subscribe: our publishers' side is "
        "test_required_spec110_same_subscriber_twice_is_ignored, and our subscribers cancel a second "
        "subscription (test_required_spec205_cancels_a_second_subscription)"
    )


async def _subscriber_rejects_none(make_subject: Callable[..., Subject], caplog: Any) -> None:
    subject, probe = make_subject(), ProbeSubscription()
    with pytest.raises(TypeError):
        subject.subscriber.on_subscribe(None)  # type: ignore[arg-type]
    subject.subscriber.on_subscribe(probe)
    with pytest.raises(TypeError):
        subject.subscriber.on_next(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        subject.subscriber.on_error(None)  # type: ignore[arg-type]
    subject.subscriber.on_next(0)  # None was not taken for an item
    assert subject.output.items == [0]


async def _raising_subscriber_counts_as_cancelled(case: Case, caplog: Any) -> None:
    class Raising(ManualSubscriber[int]):
        def on_next(self, item: int) -> None:
            super().on_next(item)
            raise Boom("on_next failed")

    sub = Raising()
    case.make(10).subscribe(sub)
    sub.request(5)
    await sub.wait_for(1)
    await sub.expect_no_signal()
    assert sub.items == [0]  # treated as cancelled: nothing more, not even a terminal signal
    assert "rule 2.13" in caplog.text


SPEC213_CHECKS = [
    *(
        pytest.param(partial(_subscriber_rejects_none, make), id=f"subscriber-{name}")
        for name, make in SUBJECTS.items()
    ),
    *(
        pytest.param(partial(_raising_subscriber_counts_as_cancelled, case), id=f"publisher-{name}")
        for name, case in CASES.items()
    ),
]


@pytest.mark.parametrize("check", SPEC213_CHECKS)
async def test_required_spec213_signals_return_normally_and_reject_none(
    check: Callable[[Any], Awaitable[None]], caplog: pytest.LogCaptureFixture
) -> None:
    # subscribers: None raises TypeError (Java: NPE); publishers: a subscriber that raises anyway is
    # treated as cancelled and the error is logged
    await check(caplog)


# ---- 3.x Subscription ---------------------------------------------------------------------------------


@publishers
async def test_optional_spec301_calls_from_other_threads_run_on_the_loop(case: Case) -> None:
    sub = manual(case.make(5))
    other = threading.Thread(target=sub.request, args=(6,))
    other.start()
    other.join()
    await sub.wait_for()
    assert sub.items == [0, 1, 2, 3, 4]
    assert sub.violations == []  # every signal on the loop thread


@publishers
async def test_required_spec302_request_from_on_subscribe_and_on_next(case: Case) -> None:
    sub = RecordingSubscriber[int](1, request_more=1)
    case.make(3).subscribe(sub)
    await sub.wait_for()
    assert sub.items == [0, 1, 2]
    assert sub.completed


@publishers
async def test_required_spec303_request_recursion_is_bounded(case: Case) -> None:
    class Deep(ManualSubscriber[int]):
        depth = max_depth = 0

        def on_next(self, item: int) -> None:
            self.depth += 1
            self.max_depth = max(self.max_depth, self.depth)
            super().on_next(item)
            self.request(1)
            self.depth -= 1

    sub = Deep()
    case.make(500).subscribe(sub)
    sub.request(1)
    await sub.wait_for()
    assert len(sub.items) == 500
    assert sub.max_depth == 1


@publishers
async def test_optional_spec304_request_returns_without_signalling(case: Case) -> None:
    sub = manual(case.make(3))
    sub.request(3)
    assert names(sub) == ["on_subscribe"]  # request only counted and scheduled
    await sub.wait_for(3)


@publishers
async def test_required_spec305_cancel_is_idempotent_and_thread_safe(case: Case) -> None:
    sub = manual(case.make(1000))
    sub.request(5)
    await sub.wait_for(5)
    assert sub.subscription is not None
    cancels = [threading.Thread(target=sub.subscription.cancel) for _ in range(4)]
    started = time.monotonic()
    for thread in cancels:
        thread.start()
    sub.cancel()
    sub.cancel()
    for thread in cancels:
        thread.join()
    assert time.monotonic() - started < 5.0  # generous: cancel only hands over to the loop
    sub.request(100)
    await sub.expect_no_signal()
    assert sub.items == [0, 1, 2, 3, 4]
    assert not sub.terminated


@publishers
async def test_required_spec306_request_after_cancel_is_a_no_op(case: Case) -> None:
    sub = manual(case.make(10))
    sub.request(2)
    await sub.wait_for(2)
    sub.cancel()
    sub.request(5)
    sub.request(0)  # no on_error either (rule 3.9 applies only while not cancelled)
    sub.request(-1)
    await sub.expect_no_signal()
    assert names(sub) == ["on_subscribe", "on_next", "on_next"]


@publishers
async def test_required_spec307_cancel_after_cancel_is_a_no_op(case: Case) -> None:
    sub = manual(case.make(10))
    sub.cancel()
    sub.cancel()
    sub.cancel()
    await sub.expect_no_signal()
    assert names(sub) == ["on_subscribe"]


@publishers
async def test_required_spec308_request_adds_to_demand(case: Case) -> None:
    sub = manual(case.make(10))
    sub.request(2)
    sub.request(3)
    await sub.wait_for(5)
    await sub.expect_no_signal()
    assert sub.items == [0, 1, 2, 3, 4]


@publishers
async def test_required_spec309_request_zero_signals_error(case: Case) -> None:
    for n in (0, -1, -MAX_DEMAND):
        sub = manual(case.make(10))
        sub.request(n)
        await sub.wait_for()
        assert isinstance(sub.error, ValueError)
        assert "3.9" in str(sub.error)
        assert sub.items == []

    class ZeroInOnNext(ManualSubscriber[int]):
        busy = False
        nested = False

        def on_next(self, item: int) -> None:
            self.busy = True
            super().on_next(item)
            self.request(0)
            self.busy = False

        def on_error(self, error: BaseException) -> None:
            self.nested = self.busy
            super().on_error(error)

    inner = ZeroInOnNext()
    case.make(10).subscribe(inner)
    inner.request(3)
    await inner.wait_for()
    assert isinstance(inner.error, ValueError)
    assert not inner.nested  # on_error came after on_next returned (rule 1.3)
    assert inner.items == [0]  # request(0) cancelled: the 2 items still requested never come
    await inner.expect_no_signal()


def test_optional_spec310_request_may_call_on_next_synchronously() -> None:
    pytest.skip(
        "MAY, not used: our subscriptions never signal from inside request() "
        "(test_optional_spec304_request_returns_without_signalling)"
    )


def test_optional_spec311_request_may_terminate_synchronously() -> None:
    pytest.skip(
        "MAY, not used: our subscriptions never signal from inside request(), not even the rule 3.9 "
        "on_error (test_optional_spec304_request_returns_without_signalling, "
        "test_required_spec309_request_zero_signals_error)"
    )


@publishers
async def test_required_spec312_cancel_stops_signalling(case: Case) -> None:
    sub = RecordingSubscriber[int](MAX_DEMAND, cancel_after=10)
    case.make(1000).subscribe(sub)
    await sub.wait_for(10)
    await sub.expect_no_signal()
    assert sub.items == list(range(10))
    assert not sub.terminated


@publishers
async def test_required_spec313_cancel_drops_the_subscriber(case: Case) -> None:
    publisher = case.make(10)
    sub = manual(publisher)
    sub.request(2)
    await sub.wait_for(2)
    sub.cancel()
    await asyncio.sleep(0.01)  # let a cancelled pull task finish
    gone = weakref.ref(sub)
    del sub
    gc.collect()
    assert gone() is None, [type(r) for r in gc.get_referrers(gone())]
    assert publisher is not None  # the publisher itself is alive and no longer holds the subscriber


# 3.14 and 3.15: publishers with a visible shutdown (closing the source, on_close, disposing Rx)


def _endless_source(closed: list[bool], hostile: bool) -> AsyncIterator[int]:
    async def items() -> AsyncIterator[int]:
        try:
            for i in itertools.count():
                yield i
        finally:
            closed.append(True)
            if hostile:
                raise Boom("cleanup failed")

    return items()


def _iterable_shutdown(closed: list[bool], hostile: bool) -> Publisher[int]:
    return IterablePublisher(_endless_source(closed, hostile))


def _map_shutdown(closed: list[bool], hostile: bool) -> Publisher[int]:
    processor = MapProcessor[int, int](lambda x: x)
    IterablePublisher(_endless_source(closed, hostile)).subscribe(processor)
    return processor


def _buffered_shutdown(closed: list[bool], hostile: bool) -> Publisher[int]:
    def on_close() -> None:
        closed.append(True)
        if hostile:
            raise Boom("on_close failed")

    publisher = BufferedPublisher[int](4, on_close=on_close)
    for i in range(4):
        publisher.offer(i)
    return publisher


def _rx_shutdown(closed: list[bool], hostile: bool) -> Publisher[int]:
    def dispose() -> None:
        closed.append(True)
        if hostile:
            raise Boom("dispose failed")

    def subscribe(observer: Any, scheduler: Any = None) -> Disposable:
        observer.on_next(0)
        return Disposable(dispose)

    return from_observable(reactivex.create(subscribe), capacity=4)


SHUTDOWNS = [
    pytest.param(_iterable_shutdown, id="iterable"),
    pytest.param(_buffered_shutdown, id="buffered"),
    pytest.param(_map_shutdown, id="map"),
    pytest.param(_rx_shutdown, id="rx"),
]


@pytest.mark.parametrize("build", SHUTDOWNS)
async def test_optional_spec314_cancel_shuts_the_publisher_down(
    build: Callable[[list[bool], bool], Publisher[int]],
) -> None:
    closed: list[bool] = []
    sub = manual(build(closed, False))
    sub.request(1)
    await sub.wait_for(1)
    assert closed == []
    sub.cancel()
    await eventually(lambda: closed == [True])


@pytest.mark.parametrize("build", SHUTDOWNS)
async def test_required_spec315_cancel_returns_normally(
    build: Callable[[list[bool], bool], Publisher[int]], caplog: pytest.LogCaptureFixture
) -> None:
    closed: list[bool] = []
    sub = manual(build(closed, True))  # shutting down raises
    sub.request(1)
    await sub.wait_for(1)
    sub.cancel()  # returns normally all the same
    sub.cancel()
    await eventually(lambda: closed == [True])
    await eventually(lambda: any(r.levelno == logging.ERROR for r in caplog.records))
    assert "failed" in caplog.text


@publishers
async def test_required_spec316_request_returns_normally(case: Case) -> None:
    sub = manual(case.make(3))
    for n in (1, MAX_DEMAND, 2**70, 0, -1, 5):  # none raises: a bad n becomes on_error
        sub.request(n)
    await sub.wait_for()
    assert isinstance(sub.error, ValueError)
    sub.request(1)  # after the terminal signal too


@publishers
async def test_required_spec317_demand_saturates_at_max(case: Case) -> None:
    sub = manual(case.make(5))
    sub.request(MAX_DEMAND)
    sub.request(MAX_DEMAND)
    sub.request(1)
    assert getattr(sub.subscription, "demand", None) == MAX_DEMAND
    await sub.wait_for()
    assert sub.items == [0, 1, 2, 3, 4]
    assert sub.completed
    assert sub.violations == []
