"""Errors the Sluice SDK and service raise: one boundary between gRPC and the user.

SluiceError                 base of everything the SDK raises
├── RPCError                a gRPC call failed; `status` is the grpc.StatusCode, `retriable` says
│   │                       whether trying again later can succeed; `next_seq`, for ALREADY_EXISTS
│   │                       of a new run of a producer id, the sequence number the server expects next
│   ├── ReconnectTimeoutError   the producer lost its session and could not open a new one within
│   │                           its `reconnect_timeout`; `status` is that of the last failure
│   └── StartTimeoutError   the producer could not open its first session within `start_timeout`
│                           (the server was not there); `status` is that of the last failure
├── ProtocolError           the server broke the Flow contract (e.g. Request(n <= 0), rule 3.9)
├── ProducerClosedError     the producer was closed, or failed, and takes no more records
├── FlushTimeoutError       flush() ran out of time with records not yet acked; `unacked` says how many
└── UnackedRecordsError     close() ended with records never acked: `unacked` (how many) and `records`
                            (the records themselves, in order); `__cause__` says why
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import grpc

__all__ = [
    "NEXT_SEQ_METADATA",
    "FlushTimeoutError",
    "ProducerClosedError",
    "ProtocolError",
    "RPCError",
    "ReconnectTimeoutError",
    "SluiceError",
    "StartTimeoutError",
    "UnackedRecordsError",
]

NEXT_SEQ_METADATA = "sluice-next-seq"
"""The trailing metadata key of a Publish call refused ALREADY_EXISTS (a new run, Open.fresh, of a
producer id the server holds records of): the sequence number it expects of the id next, in decimal."""

_SEQ_END = 2**64 - 1  # sequence numbers run from 0 to 2**64 - 2; 2**64 - 1 is where the range ends

_RETRIABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}
)


class SluiceError(Exception):
    """Base of every error the SDK raises."""


class RPCError(SluiceError):
    """A gRPC call ended with a status other than OK."""

    def __init__(self, status: grpc.StatusCode, message: str, *, next_seq: int | None = None) -> None:
        super().__init__(f"{status.name}: {message}")
        self.status = status
        self.message = message
        self.next_seq = next_seq
        """For ALREADY_EXISTS, a new run of a producer id the server holds records of (Open.fresh): the
        sequence number the server expects of that id next (give it as first_seq to go on after the
        earlier run). None otherwise, and from an older server that does not send it
        (NEXT_SEQ_METADATA): its message names the number then."""

    @property
    def retriable(self) -> bool:
        """True when the same call may succeed later (server busy, stopping, or over a limit)."""
        return self.status in _RETRIABLE

    @classmethod
    def from_grpc(cls, error: grpc.aio.AioRpcError) -> RPCError:
        return cls.from_status(error.code(), error.details() or "", error.trailing_metadata())

    @classmethod
    def from_status(cls, status: grpc.StatusCode, message: str, trailing_metadata: object) -> RPCError:
        """The error of a call that ended with `status`, `message` and `trailing_metadata`."""
        next_seq = None
        if status is grpc.StatusCode.ALREADY_EXISTS:
            next_seq = _next_seq(trailing_metadata)
        return cls(status, message, next_seq=next_seq)


def _next_seq(trailing_metadata: object) -> int | None:
    """The NEXT_SEQ_METADATA value of `trailing_metadata` (gRPC's key-value pairs), or None: absent, or
    not a sequence number (a broken or hostile server's value is not trusted into a command line)."""
    if not isinstance(trailing_metadata, Iterable):
        return None
    for item in trailing_metadata:
        if not isinstance(item, tuple) or len(item) != 2 or item[0] != NEXT_SEQ_METADATA:
            continue
        value = item[1]
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
            seq = int(value)
            return seq if seq <= _SEQ_END else None
        return None
    return None


class ProtocolError(SluiceError):
    """The server broke the Flow contract."""


class ProducerClosedError(SluiceError):
    """The producer takes no more records: it was closed or it failed."""

    taken: int = 0
    """For send_many/send_packed: how many of the call's first records were queued before it was
    refused part way (waiting for room in the buffer). Those are sent as any queued record."""


class RecordTypeError(SluiceError, TypeError):
    """A record's value or key is not bytes (send_many takes them unchecked: it is found when the batch
    is encoded, and the producer fails with this error, its unsent records still in it)."""


class RecordTooLargeError(SluiceError, ValueError):
    """A record is larger than a message may be. The call that gives it raises this error (`index`:
    the record's place in that call, `size`: its bytes of key and value, `limit`: the most a record may
    have) and the producer goes on; a record that grows past the limit after it was given (a
    bytearray), or one given before a session told the producer the server's lower message limit,
    fails the producer when it comes to be sent (`index` None), its unsent records still in it."""

    def __init__(
        self, message: str, index: int | None = None, size: int | None = None, limit: int | None = None
    ) -> None:
        super().__init__(message)
        self.index = index
        self.size = size
        self.limit = limit


class SequenceRangeError(SluiceError, ValueError):
    """The records given would take sequence numbers past the end of the range (2**64 - 2 is the last):
    nothing of the call is queued, and the producer goes on with what it holds. A producer id that
    ran out of numbers continues under another id."""


class FlushTimeoutError(SluiceError, TimeoutError):
    """Records were still unacked when the time ran out."""

    def __init__(self, unacked: int, timeout: float, unsent: int = 0) -> None:
        waiting = f" ({unsent} of them not sent yet: no credit for them came)" if unsent else ""
        super().__init__(f"{unacked} records not acked within {timeout:g} s{waiting}")
        self.unacked = unacked
        self.unsent = unsent
        """Of them, those still waiting for credit (never sent)."""


class ReconnectTimeoutError(RPCError):
    """The producer's session ended with a retriable status and no new session could be opened within
    `reconnect_timeout` seconds; `status` and the message name the last failure (and the `targets`
    tried, when given)."""

    def __init__(self, last: RPCError, attempts: int, elapsed: float, *, targets: Sequence[str] = ()) -> None:
        to = f" to {', '.join(targets)}" if targets else ""
        super().__init__(
            last.status,
            f"gave up reconnecting after {attempts} attempt(s){to} in {elapsed:.2f} s; "
            f"last error: {last.message}",
        )
        self.last = last
        self.attempts = attempts
        self.targets = tuple(targets)


class StartTimeoutError(RPCError):
    """The producer could not open its first session within `start_timeout` seconds: the server at
    `target` did not answer (UNAVAILABLE) at any of `attempts` tries; `last` is the last failure."""

    def __init__(
        self, target: str, last: RPCError, attempts: int, elapsed: float, *, tls: bool = False
    ) -> None:
        # a server that refuses the client's certificate closes the socket in the handshake: on the
        # client that looks like no server at all, so say what else it may be
        hint = ""
        if tls and "Socket closed" in last.message:
            hint = (
                " (if the server is up, it may have refused this client's TLS certificate: a server with "
                "a client CA needs a certificate it signed, unexpired)"
            )
        super().__init__(
            last.status,
            f"no server at {target} within {elapsed:.1f} s ({attempts} attempt(s)); "
            f"last error: {last.message}{hint}",
        )
        self.target = target
        self.last = last
        self.attempts = attempts


class UnackedRecordsError(SluiceError):
    """close() ended (timeout, failure) with records the server never acked.

    `records` holds them as (value, key) in sequence order, the first numbered `first_seq`; they may or
    may not have reached the server. `__cause__` is the error that stopped the delivery.
    """

    def __init__(
        self, records: list[tuple[bytes, bytes | None]], first_seq: int, cause: BaseException
    ) -> None:
        super().__init__(f"{len(records)} records never acked ({cause})")
        self.__cause__ = cause  # as `raise ... from cause` sets it: the cause whoever raises it
        self.records = records
        self.first_seq = first_seq
        self.unacked = len(records)
