"""Probes for the conformance tests: a subscription that records what a subscriber calls, and friends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from reactivex.abc import ObserverBase

from sluice_client.flow import Subscriber


class ProbeSubscription:
    """A Subscription that records every call of the subscriber under test, and from which thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int | None]] = []
        self.threads: set[int] = set()

    def request(self, n: int) -> None:
        self.calls.append(("request", n))
        self.threads.add(threading.get_ident())

    def cancel(self) -> None:
        self.calls.append(("cancel", None))
        self.threads.add(threading.get_ident())

    @property
    def requested(self) -> int:
        return sum(n or 0 for name, n in self.calls if name == "request")

    @property
    def cancelled(self) -> bool:
        return ("cancel", None) in self.calls


class CapturePublisher:
    """A Publisher that only keeps the subscriber it is given, for the test to drive."""

    def __init__(self) -> None:
        self.subscriber: Subscriber[int] | None = None

    def subscribe(self, subscriber: Subscriber[int]) -> None:
        self.subscriber = subscriber


class RxRecorder(ObserverBase[int]):
    """An Rx observer that records what it gets."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.error: Exception | None = None
        self.completed = False
        self.threads: set[int] = set()
        self.done = asyncio.Event()

    def on_next(self, value: int) -> None:
        self.threads.add(threading.get_ident())
        self.items.append(value)

    def on_error(self, error: Exception) -> None:
        self.error = error
        self.done.set()

    def on_completed(self) -> None:
        self.completed = True
        self.done.set()


async def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until `condition()` holds (things that happen on the loop or another thread)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.001)
