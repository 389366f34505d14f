"""Errors a receiver raises when a publisher breaks the protocol or a limit.

    ReceiverError                      base; carries the gRPC status code name that reports it
    ├── ProtocolViolation              FAILED_PRECONDITION: the Flow contract was broken (e.g. rule 1.1)
    ├── InvalidBatch                   INVALID_ARGUMENT: a malformed message
    ├── UnknownStream                  NOT_FOUND: Open named a stream this server does not have
    ├── SequenceGap                    OUT_OF_RANGE: a known producer skipped sequence numbers
    ├── ReceiverStopped                UNAVAILABLE: not accepted, safe to retry elsewhere or later
    └── SessionCancelled               the code the canceller chose (shutdown, operator, stream removed)

The service turns each into a gRPC status with the message; the status code is named by string so this
module stays free of gRPC.
"""

from __future__ import annotations


class ReceiverError(Exception):
    """Base class; `status` names the gRPC status code the session ends with."""

    status = "INTERNAL"
    code: int | None = None
    """A numeric gRPC status code, when it was given as a number (it then wins over `status`)."""


class ProtocolViolation(ReceiverError):
    status = "FAILED_PRECONDITION"


class InvalidBatch(ReceiverError):
    status = "INVALID_ARGUMENT"


class UnknownStream(ReceiverError):
    status = "NOT_FOUND"


class SequenceGap(ReceiverError):
    """A known producer's batch starts beyond the next sequence number the server expects of it."""

    status = "OUT_OF_RANGE"


class ReceiverStopped(ReceiverError):
    status = "UNAVAILABLE"


class SessionCancelled(ReceiverError):
    """The server cancelled the session; the call ends with the canceller's code and reason."""

    status = "CANCELLED"

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason or "session cancelled")
        self.code = code
