"""Errors a receiver raises when a publisher breaks the protocol or a limit.

    ReceiverError                      base; carries the gRPC status code name that reports it
    ├── ProtocolViolation              FAILED_PRECONDITION: the Flow contract was broken (e.g. rule 1.1)
    ├── InvalidMessage                 INVALID_ARGUMENT: undecodable, or a value over a documented limit
    │   ├── InvalidBatch               a malformed Batch
    │   └── UnloggableRecords          the block log cannot hold the session's records (found at write)
    ├── UnknownStream                  NOT_FOUND: Open named a stream this server does not have
    ├── SequenceGap                    OUT_OF_RANGE: a known producer skipped sequence numbers
    ├── SequenceOutOfRange             OUT_OF_RANGE: sequence numbers past the range the log can hold
    ├── ProducerExists                 ALREADY_EXISTS: a fresh producer whose id already has records
    ├── ReceiverStopped                UNAVAILABLE: not accepted, safe to retry elsewhere or later
    ├── Unauthenticated                UNAUTHENTICATED: no credentials, or an unknown token
    ├── PermissionDenied               PERMISSION_DENIED: the principal lacks the role or the stream
    ├── LimitExceeded                  RESOURCE_EXHAUSTED: a per-principal limit was reached
    └── SessionCancelled               the code the canceller chose (shutdown, operator, stream removed)

The service turns each into a gRPC status with the message; the status code is named by string so this
module stays free of gRPC.
"""

from __future__ import annotations

import re
from typing import TypeVar

from sluice_client.errors import NEXT_SEQ_METADATA
from sluice_client.flow import FlowViolation

SHOWN_CHARS = 200
"""Client-supplied text echoed in a status message is cut to this many characters: a status message
travels in an HTTP/2 trailer, and one over the peer's metadata limit replaces the status itself."""


def cut(text: str) -> str:
    """`text` cut to SHOWN_CHARS characters, saying so."""
    return text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"


def shown(text: str) -> str:
    """`text` quoted as a status message may quote it: repr, cut to SHOWN_CHARS, saying so."""
    return repr(text) if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]!r}... ({len(text)} characters)"


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with its control characters (and bidi overrides) escaped, as \\x1b or \\u202e: a
    client's string (a producer id) shown on an operator's terminal cannot clear or recolour it, nor
    forge a line or a column of a listing."""
    return _UNPRINTABLE.sub(lambda match: match.group(0).encode("unicode_escape").decode("ascii"), text)


E = TypeVar("E", bound=BaseException)


def detached(error: E) -> E:
    """`error` without its traceback and the exceptions chained to it, to keep past its except block (a
    session's end status): a raised error keeps every frame it passed through alive, with the message
    and the batch they held, in a reference cycle (the session holds the error) that only a full
    garbage collection frees: 100 sessions failing on a 4 MB batch held 400 MB."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error


class ReceiverError(Exception):
    """Base class; `status` names the gRPC status code the session ends with."""

    status = "INTERNAL"
    code: int | None = None
    """A numeric gRPC status code, when it was given as a number (it then wins over `status`)."""
    trailers: tuple[tuple[str, str], ...] = ()
    """Trailing metadata the call ends with besides the status: what a client reads without parsing the
    message (ProducerExists: the next sequence number)."""


class ProtocolViolation(ReceiverError, FlowViolation):
    status = "FAILED_PRECONDITION"


class InvalidMessage(ReceiverError):
    status = "INVALID_ARGUMENT"


class InvalidBatch(InvalidMessage):
    pass


class UnloggableRecords(InvalidMessage):
    """Writing a block failed on a session's data itself (not on the disk): that producer's sessions
    fail, the stream goes on. The edge validation should make this unreachable; it is the safety net."""


class UnknownStream(ReceiverError):
    status = "NOT_FOUND"


class SequenceGap(ReceiverError):
    """A known producer's batch starts beyond the next sequence number the server expects of it."""

    status = "OUT_OF_RANGE"


class SequenceOutOfRange(ReceiverError):
    """Sequence numbers beyond the last one the block log can hold (see receivers.wire.SEQ_LIMIT)."""

    status = "OUT_OF_RANGE"


class ProducerExists(ReceiverError):
    """A producer that starts afresh (Open.fresh) under an id the server already took records of at or
    beyond its resume point: they would be dropped as duplicates of the earlier run's. `next_seq`, the
    sequence number the server expects of the id next, also goes in the trailing metadata
    (NEXT_SEQ_METADATA), for clients to read without parsing the message."""

    status = "ALREADY_EXISTS"

    def __init__(self, message: str, next_seq: int) -> None:
        super().__init__(message)
        self.next_seq = next_seq
        self.trailers = ((NEXT_SEQ_METADATA, str(next_seq)),)


class ReceiverStopped(ReceiverError):
    status = "UNAVAILABLE"


class ClusterUnavailable(ReceiverError):
    """The cluster cannot answer safely now (peers that hold what is needed do not answer); retry."""

    status = "UNAVAILABLE"


class SessionCancelled(ReceiverError):
    """The server cancelled the session; the call ends with the canceller's code and reason."""

    status = "CANCELLED"

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason or "session cancelled")
        self.code = code


class Unauthenticated(ReceiverError):
    """No credentials, or credentials no principal has (an unknown token)."""

    status = "UNAUTHENTICATED"


class PermissionDenied(ReceiverError):
    """An authenticated principal without the role or the stream the call needs."""

    status = "PERMISSION_DENIED"


class LimitExceeded(ReceiverError):
    """A per-principal limit (sessions, streams, message bytes) was reached."""

    status = "RESOURCE_EXHAUSTED"
