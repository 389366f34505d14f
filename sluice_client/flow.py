"""The Reactive Streams contract (java.util.concurrent.Flow) for asyncio: the four interfaces.

Sluice speaks this contract on the wire and in process; the roles map one to one:

    interface       in process (this package)            on the wire (proto/ingest/v1)
    Publisher       IterablePublisher, BufferedPublisher  the client SDK (Producer)
    Subscriber      any object with the four on_* methods the server's receiver
    Subscription    what Publisher.subscribe hands over   one Publish session (Open ... end of call)
    request(n)      Subscription.request(n)              Request{n}, cumulative credit
    cancel()        Subscription.cancel()                Cancel
    onNext(item)    Subscriber.on_next(item)             each record of a Batch
    onComplete()    Subscriber.on_complete()             Complete
    onError(e)      Subscriber.on_error(e)               Error (client) or an error status

Signals are plain synchronous method calls made on the event loop thread, as on the JVM: an
implementation must not block in any of them (no I/O, no waiting; hand slow work to a task). The asyncio
implementations in `sluice_client.publishers` deliver signals serially from the loop, never from inside
another signal of the same subscriber, and accept request/cancel from any thread (they hop to the loop).

The rules (github.com/reactive-streams/reactive-streams-jvm, README "Specification"), and how they read in
Python. "n/a" marks the ones that do not apply; tests/tck/README.md names the test of every other one.

    1.1  onNext signals never exceed the total requested
    1.2  a publisher may signal fewer than requested and then terminate (complete or error)
    1.3  signals to a subscriber are serial: here, on the loop thread, never nested in another signal
    1.4  a publisher that fails signals onError
    1.5  a publisher that ends signals onComplete, with or without outstanding demand
    1.6  after onError/onComplete the subscription counts as cancelled: request/cancel become no-ops
    1.7  no signal after a terminal signal
    1.8  after cancel, signals eventually stop (ours stop at once)
    1.9  subscribe calls onSubscribe before any other signal and returns normally; None raises
         TypeError (Java: NullPointerException); rejecting a subscriber is onSubscribe then onError
    1.10 subscribe may be called many times, with a different subscriber each time
    1.11 a publisher may support several subscribers (ours are unicast: one subscriber each)
    2.1  a subscriber signals demand with request(n) to receive onNext
    2.2  n/a as a check: advice to dispatch slow processing asynchronously (SHOULD)
    2.3  onComplete/onError must not call the subscription or the publisher
    2.4  after onComplete/onError the subscriber considers the subscription cancelled
    2.5  a subscriber that already has an active subscription cancels a second one
    2.6  a subscriber cancels a subscription it no longer needs
    2.7  a subscriber calls request/cancel serially (ours: from the loop thread)
    2.8  a subscriber accepts onNext still in flight after its cancel
    2.9  a subscriber accepts onComplete with or without a preceding request
    2.10 a subscriber accepts onError with or without a preceding request
    2.11 n/a: happens-before between a signal call and its processing is a JVM memory-model rule; a Python
         signal is a call on one thread and its effects are visible when it returns
    2.12 onSubscribe is called at most once per subscriber
    2.13 signal methods return normally; a None argument raises TypeError (Java: NullPointerException), and
         None is never an item (publishers reject it with TypeError); a subscriber that raises anyway is
         treated as cancelled and the error is logged (the "adequate fashion" for Python)
    3.1  request/cancel are called from the subscriber's context; ours also accept other threads
    3.2  request may be called synchronously from onNext and onSubscribe
    3.3  request bounds recursion: ours never call onNext from inside request (delivery is scheduled)
    3.4  request returns promptly (SHOULD): ours only count and schedule
    3.5  cancel returns promptly, is idempotent and thread-safe
    3.6  after cancel, request is a no-op
    3.7  after cancel, cancel is a no-op
    3.8  request(n) adds n to the demand
    3.9  request(n) with n <= 0 signals onError(ValueError) (Java: IllegalArgumentException) naming rule 3.9
    3.10 request may call onNext synchronously (MAY; ours never do, see 3.3)
    3.11 request may call onComplete/onError synchronously (MAY; ours never do)
    3.12 cancel makes the publisher eventually stop signalling
    3.13 cancel makes the publisher eventually drop its reference to the subscriber
    3.14 cancel may shut a stateful publisher down when no other subscription exists (ours do)
    3.15 cancel returns normally (errors while shutting down are logged)
    3.16 request returns normally (a bad n becomes onError, rule 3.9)
    3.17 demand up to 2**63 - 1 is supported; beyond, it saturates at MAX_DEMAND ("effectively unbounded");
         Python ints do not overflow, but the wire's Request.n is an int64
"""

from __future__ import annotations

from typing import Protocol, TypeVar


class FlowViolation(Exception):
    """A Reactive Streams rule was broken (e.g. rule 1.1: an item that was not requested)."""


__all__ = ["MAX_DEMAND", "FlowViolation", "Processor", "Publisher", "Subscriber", "Subscription"]

MAX_DEMAND = 2**63 - 1
"""Demand saturates here (rule 3.17): Long.MAX_VALUE on the JVM, the largest Request.n on the wire."""

T_contra = TypeVar("T_contra", contravariant=True)
T_co = TypeVar("T_co", covariant=True)
R_co = TypeVar("R_co", covariant=True)


class Subscription(Protocol):
    """One subscriber's link to one publisher: how the subscriber asks for items or stops them."""

    def request(self, n: int) -> None:
        """Add `n` (> 0) to the demand; `n <= 0` ends the stream with onError (rule 3.9). Never raises."""
        ...

    def cancel(self) -> None:
        """Ask the publisher to stop signalling and to forget the subscriber. Idempotent; never raises."""
        ...


class Subscriber(Protocol[T_contra]):
    """Gets onSubscribe once, then onNext at most as often as requested, then at most one terminal signal."""

    def on_subscribe(self, subscription: Subscription) -> None:
        """First signal, exactly once (rules 1.9, 2.12)."""
        ...

    def on_next(self, item: T_contra) -> None:
        """One item, never None; only while demand is outstanding (rule 1.1)."""
        ...

    def on_error(self, error: BaseException) -> None:
        """Terminal: the stream failed (rule 1.4). May come without any request (rule 2.10)."""
        ...

    def on_complete(self) -> None:
        """Terminal: the stream ended (rule 1.5). May come without any request (rule 2.9)."""
        ...


class Publisher(Protocol[T_co]):
    """A source of items that sends at most what its subscribers request."""

    def subscribe(self, subscriber: Subscriber[T_co]) -> None:
        """Call `subscriber.on_subscribe` before any other signal; return normally (rule 1.9)."""
        ...


class Processor(Subscriber[T_contra], Publisher[R_co], Protocol[T_contra, R_co]):
    """Both: a subscriber of T upstream and a publisher of R downstream."""
