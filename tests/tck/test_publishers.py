"""What the publishers promise beyond the rules: pulling on demand, overflow strategies, put(), the
processor's failure paths, and the recording subscriber's own checks."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sluice_client.flow import FlowViolation, Subscriber
from sluice_client.publishers import (
    BufferedPublisher,
    BufferFullTimeout,
    BufferOverflowError,
    IterablePublisher,
    ManualSubscriber,
    MapProcessor,
    OverflowStrategy,
    RecordingSubscriber,
)

from .probes import ProbeSubscription

# ---- IterablePublisher ------------------------------------------------------------------------------


class Counted:
    """An async source of 0..n-1 that counts how often it was pulled."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[int]:
        for i in range(self.n):
            self.pulled += 1
            yield i


async def test_iterable_pulls_only_on_demand_and_stops_on_cancel() -> None:
    source = Counted(100)
    sub = ManualSubscriber[int]()
    IterablePublisher(source).subscribe(sub)
    await sub.expect_no_signal()
    assert source.pulled == 0
    sub.request(3)
    await sub.wait_for(3)
    await sub.expect_no_signal()
    assert source.pulled == 3
    sub.cancel()
    sub.request(10)
    await sub.expect_no_signal()
    assert source.pulled == 3


async def test_iterable_end_is_found_by_a_pull() -> None:
    # exactly n items with n requested: the end is only seen by the next pull, which needs demand
    exact = ManualSubscriber[int]()
    IterablePublisher([1, 2, 3]).subscribe(exact)
    exact.request(3)
    await exact.wait_for(3)
    await exact.expect_no_signal()
    assert not exact.completed
    exact.request(1)
    await exact.wait_for()
    assert exact.completed
    # more demand than items: on_complete at once, with demand left over
    more = ManualSubscriber[int]()
    IterablePublisher([1, 2, 3]).subscribe(more)
    more.request(10)
    await more.wait_for()
    assert more.items == [1, 2, 3]
    assert more.completed


async def test_iterable_none_item_is_an_error() -> None:
    sub = RecordingSubscriber[Any](10)
    IterablePublisher(["a", None, "b"]).subscribe(sub)
    await sub.wait_for()
    assert sub.items == ["a"]
    assert isinstance(sub.error, TypeError)


async def test_iterable_cancel_interrupts_a_pull_that_waits() -> None:
    started, closed = asyncio.Event(), asyncio.Event()

    async def stuck() -> AsyncIterator[int]:
        try:
            started.set()
            await asyncio.Event().wait()  # a source with nothing to give, ever
            yield 0
        finally:
            closed.set()

    sub = ManualSubscriber[int]()
    IterablePublisher(stuck()).subscribe(sub)
    sub.request(1)
    await asyncio.wait_for(started.wait(), 10)
    sub.cancel()
    await asyncio.wait_for(closed.wait(), 10)
    assert names_of(sub) == ["on_subscribe"]


def names_of(sub: RecordingSubscriber[Any]) -> list[str]:
    return [name for name, _ in sub.signals]


# ---- BufferedPublisher: overflow ---------------------------------------------------------------------

# capacity 3, no demand yet, offers 1..6, then complete(); then all demand
OVERFLOW = [
    pytest.param(OverflowStrategy.ERROR, [True, True, True, False, False, False], [1, 2, 3], 1, id="error"),
    pytest.param(
        OverflowStrategy.DROP_LATEST, [True, True, True, False, False, False], [1, 2, 3], 3, id="drop_latest"
    ),
    pytest.param(OverflowStrategy.DROP_OLDEST, [True] * 6, [4, 5, 6], 3, id="drop_oldest"),
    pytest.param(OverflowStrategy.LATEST, [True] * 6, [1, 2, 6], 3, id="latest"),
]


@pytest.mark.parametrize(("strategy", "taken", "delivered", "dropped"), OVERFLOW)
async def test_buffered_overflow_strategies(
    strategy: OverflowStrategy, taken: list[bool], delivered: list[int], dropped: int
) -> None:
    drops: list[int] = []
    publisher = BufferedPublisher[int](3, strategy, on_drop=drops.append)
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    assert [publisher.offer(i) for i in range(1, 7)] == taken
    publisher.complete()
    assert publisher.dropped == dropped
    assert drops == [1] * dropped
    sub.request(100)
    await sub.wait_for()
    assert sub.items == delivered
    if strategy is OverflowStrategy.ERROR:
        # the buffered items first, then the error: nothing is lost without a signal
        assert isinstance(sub.error, BufferOverflowError)
        assert sub.error.capacity == 3
    else:
        assert sub.completed


async def test_buffered_error_overflow_waits_for_demand_before_failing() -> None:
    publisher = BufferedPublisher[int](2)
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    for i in range(3):
        publisher.offer(i)
    assert publisher.closed
    await sub.expect_no_signal()  # the error comes after the 2 buffered items, which need demand
    sub.request(1)
    await sub.wait_for(1)
    await sub.expect_no_signal()
    sub.request(1)
    await sub.wait_for()
    assert sub.items == [0, 1]
    assert isinstance(sub.error, BufferOverflowError)


async def test_buffered_capacity_counts_items_beyond_demand() -> None:
    publisher = BufferedPublisher[int](2, OverflowStrategy.DROP_LATEST)
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    sub.request(2)
    # all offered in one loop step: 2 are owed to the demand, 2 more wait, the 5th overflows
    assert [publisher.offer(i) for i in range(5)] == [True, True, True, True, False]
    await sub.wait_for(2)
    await sub.expect_no_signal()
    sub.request(5)
    await sub.wait_for(4)
    assert sub.items == [0, 1, 2, 3]
    assert publisher.dropped == 1


async def test_buffered_items_before_subscribe_and_empty_complete() -> None:
    early = BufferedPublisher[int](4)
    early.offer(1)
    early.complete()
    assert not early.offer(2)  # closed
    sub = RecordingSubscriber[int](10)
    early.subscribe(sub)
    await sub.wait_for()
    assert sub.items == [1]
    assert sub.completed
    # nothing buffered: on_complete without any request (rule 2.9)
    empty = BufferedPublisher[int](4)
    idle = ManualSubscriber[int]()
    empty.subscribe(idle)
    empty.complete()
    await idle.wait_for()
    assert idle.completed
    assert idle.requested == 0


async def test_buffered_rejects_none_and_other_threads() -> None:
    publisher = BufferedPublisher[int](4)
    with pytest.raises(TypeError):
        publisher.offer(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        publisher.fail(None)  # type: ignore[arg-type]
    publisher.subscribe(ManualSubscriber[int]())
    errors: list[BaseException] = []

    def offer() -> None:
        try:
            publisher.offer(1)
        except RuntimeError as error:
            errors.append(error)

    other = threading.Thread(target=offer)
    other.start()
    other.join()
    assert len(errors) == 1
    assert "call_soon_threadsafe" in str(errors[0])
    with pytest.raises(ValueError, match="capacity"):
        BufferedPublisher[int](0)


async def test_buffered_on_close_once_and_cancel_clears_the_buffer() -> None:
    closes: list[bool] = []
    publisher = BufferedPublisher[int](4, on_close=lambda: closes.append(True))
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    publisher.offer(1)
    sub.cancel()
    sub.cancel()
    publisher.complete()
    assert closes == [True]
    assert publisher.closed
    assert not publisher.offer(2)
    await sub.expect_no_signal()
    assert names_of(sub) == ["on_subscribe"]


# ---- BufferedPublisher: put() --------------------------------------------------------------------


async def test_put_stays_blocked_without_demand_and_resumes_with_it() -> None:
    publisher = BufferedPublisher[int](2)
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    assert await publisher.put(1)
    assert await publisher.put(2)
    blocked = asyncio.create_task(publisher.put(3))
    await asyncio.sleep(0.1)
    assert not blocked.done()  # no demand: the producer waits, nothing overflows
    assert publisher.dropped == 0
    sub.request(1)
    assert await asyncio.wait_for(blocked, 10) is True
    await sub.wait_for(1)
    # 2 and 3 wait again, so the next put blocks again until the next request
    again = asyncio.create_task(publisher.put(4))
    await asyncio.sleep(0.1)
    assert not again.done()
    sub.request(10)
    assert await asyncio.wait_for(again, 10) is True
    await sub.wait_for(4)
    assert sub.items == [1, 2, 3, 4]


async def test_put_times_out_with_buffer_full_timeout() -> None:
    publisher = BufferedPublisher[int](1)
    assert await publisher.put(1)  # no subscriber yet: waits in the buffer
    with pytest.raises(BufferFullTimeout) as caught:
        await publisher.put(2, timeout=0.05)
    assert caught.value.capacity == 1
    assert isinstance(caught.value, TimeoutError)


@pytest.mark.parametrize(
    ("timeout", "error", "message"),
    [
        (-1, ValueError, r"^timeout must be >= 0 seconds \(or None: no limit\), got -1$"),
        (float("nan"), ValueError, r"^timeout must be >= 0 seconds .*, got nan$"),
        (10**400, ValueError, r"^timeout must be >= 0 seconds .*, got a number too large for a float$"),
        ("1", TypeError, r"^timeout must be a number of seconds or None, not str \('1'\)$"),
    ],
)
async def test_put_refuses_a_timeout_that_is_not_one(
    timeout: Any, error: type[Exception], message: str
) -> None:
    """put(x, timeout=-1) or NaN timed out at once as if the buffer had stayed full; "1" failed in
    asyncio ("unsupported operand type(s) for +"), 10**400 with OverflowError. Nothing is taken."""
    publisher = BufferedPublisher[int](1)
    with pytest.raises(error, match=message):
        await publisher.put(1, timeout=timeout)
    assert await publisher.put(2, timeout=float("inf"))  # no limit, and there is room
    with pytest.raises(BufferFullTimeout):
        await publisher.put(3, timeout=0)


async def test_put_returns_false_when_the_subscriber_cancels() -> None:
    publisher = BufferedPublisher[int](1)
    sub = ManualSubscriber[int]()
    publisher.subscribe(sub)
    await publisher.put(1)
    blocked = asyncio.create_task(publisher.put(2))
    await asyncio.sleep(0.01)
    sub.cancel()
    assert await asyncio.wait_for(blocked, 10) is False


# ---- MapProcessor ----------------------------------------------------------------------------------


def _processor_with_probe(
    function: Callable[[int], int | None],
) -> tuple[MapProcessor[int, int | None], ProbeSubscription, ManualSubscriber[int | None]]:
    processor = MapProcessor[int, int | None](function)
    downstream = ManualSubscriber[int | None]()
    processor.subscribe(downstream)
    probe = ProbeSubscription()
    processor.on_subscribe(probe)
    return processor, probe, downstream


async def test_map_demand_goes_upstream_one_to_one() -> None:
    processor, probe, downstream = _processor_with_probe(lambda x: x * 10)
    assert probe.calls == []
    downstream.request(2)
    downstream.request(3)
    assert probe.calls == [("request", 2), ("request", 3)]
    processor.on_next(1)
    assert downstream.items == [10]


async def test_map_function_failure_cancels_upstream_and_fails_downstream() -> None:
    def fail(x: int) -> int:
        raise ValueError("bad item")

    processor, probe, downstream = _processor_with_probe(fail)
    downstream.request(1)
    processor.on_next(1)
    assert probe.cancelled
    assert isinstance(downstream.error, ValueError)
    processor.on_next(2)  # in flight after the cancel: ignored
    assert downstream.items == []


async def test_map_none_result_is_a_type_error() -> None:
    processor, probe, downstream = _processor_with_probe(lambda x: None)
    downstream.request(1)
    processor.on_next(1)
    assert probe.cancelled
    assert isinstance(downstream.error, TypeError)


async def test_map_unrequested_item_is_a_protocol_violation() -> None:
    processor, probe, downstream = _processor_with_probe(lambda x: x)
    processor.on_next(1)  # nothing was requested (rule 1.1)
    assert probe.cancelled
    assert isinstance(downstream.error, FlowViolation)


async def test_map_upstream_end_before_a_downstream_subscribes() -> None:
    processor = MapProcessor[int, int](lambda x: x)
    processor.on_subscribe(ProbeSubscription())
    processor.on_complete()
    late = ManualSubscriber[int]()
    processor.subscribe(late)
    assert names_of(late) == ["on_subscribe", "on_complete"]


async def test_map_demand_before_the_upstream_is_passed_on() -> None:
    processor = MapProcessor[int, str](str)
    downstream = RecordingSubscriber[str](5)
    processor.subscribe(downstream)
    IterablePublisher(range(3)).subscribe(processor)
    await downstream.wait_for()
    assert downstream.items == ["0", "1", "2"]
    assert downstream.completed


async def test_map_composes() -> None:
    first = MapProcessor[int, int](lambda x: x + 1)
    second = MapProcessor[int, str](lambda x: f"#{x}")
    IterablePublisher(range(3)).subscribe(first)
    first.subscribe(second)
    sub = RecordingSubscriber[str](1, request_more=1)
    second.subscribe(sub)
    await sub.wait_for()
    assert sub.items == ["#1", "#2", "#3"]
    assert sub.violations == []


# ---- RecordingSubscriber: it must see a broken publisher ---------------------------------------------


class Rogue:
    """A publisher that breaks rules 1.1, 1.7 and 2.12 on purpose."""

    def __init__(self) -> None:
        self.second = ProbeSubscription()

    def subscribe(self, subscriber: Subscriber[int]) -> None:
        subscriber.on_subscribe(ProbeSubscription())
        subscriber.on_next(1)  # nothing requested
        subscriber.on_complete()
        subscriber.on_next(2)  # after the terminal signal
        subscriber.on_subscribe(self.second)  # twice


class Reentrant:
    """A publisher whose request() calls on_next at once: signals nest (rule 1.3)."""

    def subscribe(self, subscriber: Subscriber[int]) -> None:
        sent = 0

        class Eager:
            def request(self, n: int) -> None:
                nonlocal sent
                if sent < 3:
                    sent += 1
                    subscriber.on_next(sent)

            def cancel(self) -> None:
                pass

        subscriber.on_subscribe(Eager())


async def test_recording_subscriber_reports_violations() -> None:
    rogue, sub = Rogue(), RecordingSubscriber[int]()
    rogue.subscribe(sub)
    text = " ".join(sub.violations)
    for rule in ("rule 1.1", "rule 1.7", "rule 2.12"):
        assert rule in text
    assert rogue.second.cancelled  # and it cancels the second subscription itself (rule 2.5)

    nested = RecordingSubscriber[int](1, request_more=1)
    Reentrant().subscribe(nested)
    assert nested.items == [1, 2, 3]
    assert any("while on_next was running (rule 1.3)" in v for v in nested.violations)

    elsewhere = RecordingSubscriber[int](1)
    elsewhere.on_subscribe(ProbeSubscription())
    other = threading.Thread(target=elsewhere.on_next, args=(1,))
    other.start()
    other.join()
    assert elsewhere.violations == ["on_next on another thread (rule 1.3)"]


async def test_wait_for_reports_an_early_end_and_a_timeout() -> None:
    sub = RecordingSubscriber[int](10)
    IterablePublisher([1]).subscribe(sub)
    with pytest.raises(AssertionError, match="ended before 5 items"):
        await sub.wait_for(5)
    quiet = ManualSubscriber[int]()
    IterablePublisher([1]).subscribe(quiet)
    with pytest.raises(AssertionError, match=r"within 0\.05 s"):
        await quiet.wait_for(1, timeout=0.05)
