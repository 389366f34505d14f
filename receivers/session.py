"""A publisher session as the server sees it: the Subscription of the Flow contract on the wire.

`request(n)` becomes a Request message, `cancel` a Cancel message. What the server still has to send
lives in an Outbox that coalesces: credit adds up into one Request, only the newest Ack matters, one
Cancel at most. So however slowly a client reads, a session holds a handful of messages, never a queue
that grows.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from functools import cached_property

from receivers.errors import ReceiverError
from receivers.principal import ANONYMOUS, Principal, producer_key
from sluice_client.flow import MAX_DEMAND
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb


class SessionIds:
    """Session ids of this process: 1, 2, 3, ... Knowing the last one issued tells an ended session
    (cancel again: a no-op, rule 3.7) from one that never was (NOT_FOUND), without remembering any."""

    def __init__(self) -> None:
        self.last = 0

    def next(self) -> int:
        self.last += 1
        return self.last

    def issued(self, session_id: int) -> bool:
        return 0 < session_id <= self.last


SESSION_IDS = SessionIds()


class Outbox:
    """Messages owed to one client, coalesced; then how the call ends (None: OK, or an error)."""

    def __init__(self) -> None:
        self._credit = 0
        self._ack: int | None = None
        self._cancel: pb.Cancel | None = None
        self._cancelled = False
        self._finished = False
        self._end: ReceiverError | None = None
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self._finished

    def grant(self, n: int) -> None:
        if not self._finished and not self._cancelled:
            self._credit = min(MAX_DEMAND, self._credit + n)
            self._ready.set()

    def ack(self, durable_up_to: int) -> None:
        if not self._finished:
            self._ack = durable_up_to if self._ack is None else max(self._ack, durable_up_to)
            self._ready.set()

    def cancel(self, message: pb.Cancel) -> None:
        if not self._finished and not self._cancelled:
            self._cancelled = True
            self._cancel = message
            self._credit = 0  # no credit after a cancel
            self._ready.set()

    def finish(self, error: ReceiverError | None = None) -> None:
        """End the call after what is pending is sent; the first finish wins."""
        if not self._finished:
            self._finished = True
            self._end = error
            self._ready.set()

    async def take(self) -> tuple[list[pb.PublishResponse], bool, ReceiverError | None]:
        """Wait for news: (messages in order, whether the call ends now, the error it ends with)."""
        await self._ready.wait()
        self._ready.clear()
        messages = []
        if self._credit:
            messages.append(pb.PublishResponse(request=pb.Request(n=self._credit)))
            self._credit = 0
        if self._ack is not None:
            messages.append(pb.PublishResponse(ack=pb.Ack(durable_up_to=self._ack)))
            self._ack = None
        if self._cancel is not None:
            messages.append(pb.PublishResponse(cancel=self._cancel))
            self._cancel = None  # sent once: _cancelled keeps it from coming back
        return messages, self._finished, self._end


@dataclass(eq=False)
class Session:
    """One publisher session: what the receiver knows of it, and its outbox."""

    id: int
    stream: str
    producer_id: str
    next_seq: int
    """Sequence number the next batch must start at."""
    durable_up_to: int
    """Every record with a lower sequence number is durable and acked."""
    credit: int = 0
    """Credit granted and not yet used."""
    completed: bool = False
    cancelled: bool = False
    cancel_error: ReceiverError | None = None
    """The status the call ends with once a cancelled session's accepted records are acked."""
    outbox: Outbox = field(default_factory=Outbox)
    principal: Principal = ANONYMOUS
    """Who opened it (its limits and its share of the stream go by this)."""
    token_sha256: str | None = None
    """The SHA-256 of the bearer token it was opened with (never the token): a reload of the auth file
    that removes the token ends the session (receivers.auth.revoke). None: a certificate, no token."""
    owner: str = ""
    """Whose share of the stream's credit this session draws on (receivers.fairness.owner_of)."""
    active_at: float = 0.0
    """When it last sent a batch or waited for credit (the receiver's clock): idle since then."""

    @cached_property
    def producer_key(self) -> str:
        """Its producer's key in the producer table: the id, scoped by principal (see producer_key)."""
        return producer_key(self.principal, self.producer_id)

    @property
    def ended(self) -> bool:
        return self.outbox.finished

    @property
    def accepting(self) -> bool:
        return not (self.completed or self.cancelled or self.ended)
