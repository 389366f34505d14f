"""A Producer fed by a Flow Publisher: in-process Reactive Streams in, the Flow contract on the wire out.

`publish(producer, publisher)` subscribes a bridge to `publisher` and asks it for records only as fast as
the producer can take them: demand is the room in the producer's bounded buffer, which empties only as
the server grants credit. So backpressure runs from the server's receiver through the wire to the
upstream publisher, with no unbounded queue anywhere.

Items are a value (bytes) or a (key, value) pair.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TypeAlias

from reactivex import Observable

from sluice_client.errors import SluiceError
from sluice_client.flow import Publisher, Subscription
from sluice_client.metrics import RECORDS_DROPPED
from sluice_client.producer import Producer, check_timeout
from sluice_client.publishers import OverflowStrategy, overflow_arg
from sluice_client.rx import from_observable as _from_observable

__all__ = ["Record", "from_observable", "publish"]

log = logging.getLogger(__name__)

Record: TypeAlias = bytes | tuple[bytes | None, bytes]


class _Bridge:
    """The Flow Subscriber between an upstream Publisher and a Producer."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self._subscription: Subscription | None = None
        self._requested = 0  # asked for, not yet delivered
        self.count = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    # ---- Subscriber ------------------------------------------------------------------------------

    def on_subscribe(self, subscription: Subscription) -> None:
        if self._subscription is not None:  # rule 2.5: a second subscription is cancelled
            subscription.cancel()
            return
        self._subscription = subscription
        self.top_up()

    def on_next(self, item: Record) -> None:
        if self.done.done():
            # publish() ended (an item that was no record, the upstream's error) or was cancelled:
            # what the upstream still emits (it may, rule 2.8) is not taken, or it would be sent after
            # the item publish() failed at, unknown to its caller
            return
        self._requested -= 1
        try:
            if isinstance(item, tuple):
                key, value = _pair(item)
                self._producer.offer(value, key)
            else:
                self._producer.offer(item)
        except BufferError:
            self._cancel()
            self._finish(RuntimeError("the publisher sent more items than were requested (rule 1.1)"))
            return
        except (SluiceError, TypeError, ValueError) as exc:
            # the producer failed, or the item is not a record: stop the upstream (rule 2.13 for the
            # item's fault) and report it
            self._cancel()
            self._finish(exc)
            return
        self.count += 1

    def on_error(self, error: BaseException) -> None:
        self._finish(error)

    def on_complete(self) -> None:
        self._finish(None)

    # ---- demand --------------------------------------------------------------------------------

    def top_up(self) -> None:
        """Request what the producer's buffer has room for, less what is already requested."""
        if self._subscription is None or self.done.done():
            return
        room = self._producer.room - self._requested
        # ask in chunks, not one record at a time: half the buffer's worth, or whatever is left of it
        if room > 0 and (room >= self._producer.max_buffered // 2 or self._requested == 0):
            self._requested += room
            self._subscription.request(room)

    def _cancel(self) -> None:
        if self._subscription is not None:
            self._subscription.cancel()

    def _finish(self, error: BaseException | None) -> None:
        if self.done.done():
            return
        if error is None:
            self.done.set_result(None)
        else:
            self.done.set_exception(error)


def _pair(item: tuple[bytes | None, bytes]) -> tuple[bytes | None, bytes]:
    """A keyed record's (key, value); TypeError for a tuple of another length."""
    if len(item) != 2:
        raise TypeError(f"a record is a value (bytes) or a (key, value) pair, not a tuple of {len(item)}")
    return item


async def publish(
    producer: Producer, publisher: Publisher[Record], *, flush_timeout: float | None = None
) -> int:
    """Send everything `publisher` emits through `producer`; return how many records once all are acked.

    Raises the publisher's error if it fails (what it emitted before is still sent), or the producer's
    error. Cancelling the call cancels the upstream subscription.
    """
    # before subscribing: else the whole upstream was taken and queued, and only then refused
    check_timeout(flush_timeout)
    if producer.room < 0:  # not started, closing or closed, or failed: say which
        producer.check_open()
    bridge = _Bridge(producer)
    remove = producer.on_room(bridge.top_up)
    # the bridge asks for more only as acks make room: a producer that fails or is closed meanwhile
    # makes none, and the bridge would wait for ever
    stopped = asyncio.create_task(_stopped(producer))
    try:
        publisher.subscribe(bridge)
        await asyncio.wait({bridge.done, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not bridge.done.done():
            producer.check_open()  # raises its error, or ProducerClosedError
        await bridge.done
    except BaseException:
        bridge._cancel()
        bridge.done.cancel()  # an item still in flight is not reported to no one
        raise
    finally:
        remove()
        stopped.cancel()
    await producer.flush(flush_timeout)
    return bridge.count


async def _stopped(producer: Producer) -> None:
    """Return once `producer` takes no more records (failed, closing or closed)."""
    while producer.room >= 0:
        await producer.changed()


def from_observable(
    observable: Observable[Record], *, capacity: int, overflow: OverflowStrategy = OverflowStrategy.ERROR
) -> Publisher[Record]:
    """sluice_client.rx.from_observable with its drops counted in `sluice_client_records_dropped_total`."""
    dropped = RECORDS_DROPPED.labels(overflow=overflow_arg(overflow).name)
    return _from_observable(observable, capacity=capacity, overflow=overflow, on_drop=dropped.inc)
