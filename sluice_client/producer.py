"""Asyncio Producer: the Publisher side of a Publish session, an idempotent producer.

Records are buffered locally and leave in batches of up to `batch_size` records or `batch_bytes` bytes,
after at most `linger` seconds, and never beyond the credit the server granted. A record stays in memory
until the server acks it as durable: `max_buffered` records and `max_buffered_bytes` (256 MiB of values
and keys by default; None: no byte bound) bound the records not yet sent plus those sent and not yet
acked, so `send` waits when either is reached.

Resending: every record gets a sequence number (0, 1, 2, ... per producer). When the session ends with a
retriable status (UNAVAILABLE: the server is stopping, went away, or the connection dropped) the producer
reconnects with exponential backoff and jitter (`reconnect_backoff` doubling to `max_reconnect_backoff`),
opens a new session with Open{producer_id, resume_from_seq = first unacked}, and resends every unacked
record in order, within the new credit. The server drops what it had already accepted (deduplication by
producer id and sequence number), so each record is stored once. If no session could be re-established
within `reconnect_timeout` seconds the producer fails with ReconnectTimeoutError. The first session is
retried the same way (a producer may start a moment before its server, or its node may end the first
session UNAVAILABLE after Open), for up to `start_timeout` seconds, then StartTimeoutError. Every other status
(INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND, OUT_OF_RANGE, RESOURCE_EXHAUSTED, CANCELLED, ABORTED:
fenced by a newer session of the same producer id, UNAUTHENTICATED, PERMISSION_DENIED, ...) fails the
producer: resending would not help or would fight the newer session. So does a TLS handshake that fails
on the certificates (an untrusted or expired server certificate), which no retry mends.

Failover: `target` may name several receiver nodes ("a:7000,b:7000" or a sequence). The producer uses
one at a time (`producer.target`). When its session is lost with a retriable status it tries the next
target in order, then the one after, round robin from the one after the failed node; a target that
cannot be reached is skipped at once, and the backoff comes between full rounds. Each attempt resumes
as above: Open{producer_id, resume_from_seq = first unacked}, then every unacked record in order.
`reconnect_timeout` bounds the whole outage over all targets, and the first session goes round the
targets the same way within `start_timeout`. A status that is not retriable on one node fails the
producer without trying the others: another node would refuse the same client the same way. The
producer ids and marks are per node, so a record acked by neither node before the failover is sent to
both once; the cluster (nodes replicate blocks and producer marks, and a node asks its peers for a
producer's mark before taking its session) makes that exactly once. Without it, failover loses
nothing but may store such records twice.

Credentials (sluice_client.credentials): TLS roots, a client certificate and a bearer token, sent on
every session's call.
"""

from __future__ import annotations

import array
import asyncio
import collections
import contextlib
import enum
import logging
import math
import numbers
import random
import sys
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from types import TracebackType
from typing import TYPE_CHECKING, Any

import grpc

from sluice_client.allocator import tune_malloc
from sluice_client.credentials import Credentials
from sluice_client.errors import (
    FlushTimeoutError,
    ProducerClosedError,
    ProtocolError,
    ReconnectTimeoutError,
    RecordTooLargeError,
    RecordTypeError,
    RPCError,
    SequenceRangeError,
    SluiceError,
    StartTimeoutError,
    UnackedRecordsError,
)
from sluice_client.flow import MAX_DEMAND
from sluice_client.keepalive import KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS, channel_options
from sluice_client.lazy_numpy import LazyNumpy
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.tasks import reap
from sluice_client.wire import (
    MAX_PRODUCER_ID_BYTES,
    Keys,
    PackedKeys,
    is_key,
    lay_out_keys,
    publish_parts,
    serialize_request,
)

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
else:
    np = LazyNumpy(globals())

log = logging.getLogger(__name__)


DEFAULT_MAX_MESSAGE_BYTES = 32 * 1024 * 1024
"""The largest message a producer sends: gRPC's send limit on its channel, and a server's default. A
server with a lower one says so on its Requests (Request.max_message_bytes), and the producer cuts its
batches under it."""
MESSAGE_FRAMING = 64
"""Bytes a message of one record takes beside the record's key and value, at most (field tags, lengths,
sequence number, two offsets each for value and key, a validity byte)."""
MAX_RECORD_BYTES = DEFAULT_MAX_MESSAGE_BYTES - MESSAGE_FRAMING
"""A record's key and value together, at most: what a message of that record alone can carry. A larger
one is refused when it is given (RecordTooLargeError), as is one over what a lower message limit of
the server carries, once a session was told it."""
_OFFSET_BYTES = 4  # a record's value offset in a batch (int32); as much again for its key's
DEFAULT_MAX_BUFFERED = 500_000
"""Records a Producer holds unsent + unacked by default: room for a server's default prefetch (250k)."""
DEFAULT_MAX_BUFFERED_BYTES = 256 * 1024 * 1024
"""Bytes of values and keys a Producer holds unsent + unacked by default: a server's default memory budget
per stream (more is never in flight to it), and a bound on the client's memory whatever the records'
size (500,000 records of 64 KiB would be 32 GB; Kafka's producer bounds its buffer in bytes too)."""
_FAILED_PRECONDITION = 9  # gRPC status code carried in-band by Error
_SEQ_END = 2**64 - 1  # sequence numbers are below it: acks and producer marks are uint64
RECONNECT_STATUSES = frozenset({grpc.StatusCode.UNAVAILABLE})
"""Statuses after which the producer reconnects and resends; any other status fails it, except a
transport failure that grpc reports as INTERNAL (see `reconnectable`)."""
_TRANSPORT_FAILURES = ("Internal error from Core", "RST_STREAM")


def reconnectable(error: RPCError, *, cancelled_in_band: bool = False) -> bool:
    """Whether the producer reconnects and resends after a session ended with `error`: UNAVAILABLE (the
    server is stopping or unreachable, the connection dropped); INTERNAL raised by grpc itself when
    the stream broke under a write or was reset by the peer (the server did not choose that status);
    or CANCELLED without an in-band Cancel before it: the server process tore the call down (a
    shutdown past its grace period), where an operator's cancel always says so in-band first."""
    if error.status in RECONNECT_STATUSES:
        return not tls_refused(error)
    if error.status is grpc.StatusCode.CANCELLED:
        return not cancelled_in_band
    return _transport_failure(error)


_TLS_REFUSALS = ("handshake failed", "CERTIFICATE_VERIFY_FAILED", "Failed to create security handshaker")


def tls_refused(error: RPCError) -> bool:
    """UNAVAILABLE because the TLS handshake failed on certificates (the server's is not trusted, or
    expired; the client's refused) or could not start (the client's key unusable): grpc reports it as
    an unreachable server, but retrying cannot help."""
    return error.status is grpc.StatusCode.UNAVAILABLE and any(s in error.message for s in _TLS_REFUSALS)


def _transport_failure(error: RPCError) -> bool:
    """INTERNAL raised by grpc itself when the stream broke under a write or the peer reset it."""
    return error.status is grpc.StatusCode.INTERNAL and any(s in error.message for s in _TRANSPORT_FAILURES)


_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


GRPC_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds"})
"""The schemes of gRPC's own target URIs (dns:///host:port, unix:///path, ...)."""


def check_target(name: str) -> None:
    """ValueError for one target gRPC would not refuse but never reach, retrying for the whole timeout:
    whitespace in it ("a b:5": a DNS name that resolves nowhere), a URL's scheme (http://, https://,
    grpc://: gRPC takes an unknown scheme for part of a DNS name), a port that is not a number. A
    target is "host:port" or one of gRPC's own URIs (GRPC_SCHEMES); TLS is the credentials' (a CA
    file), not a scheme."""
    if not name.isascii() and not _utf8(name):  # gRPC raised UnicodeEncodeError at start()
        raise ValueError(f"invalid target {name!r}: it is not valid UTF-8 text")
    if any(c.isspace() for c in name):
        raise ValueError(f"invalid target {name!r}: it holds whitespace; use 'host:port'")
    if "\0" in name:  # gRPC reads the name up to the NUL: another target than the one given
        raise ValueError(f"invalid target {name!r}: it holds a NUL; use 'host:port'")
    scheme, sep, rest = name.partition("://")
    if sep and scheme.lower() not in GRPC_SCHEMES:
        secure = (
            " (TLS comes from a CA file, not from the scheme)" if scheme.lower() in ("https", "grpcs") else ""
        )
        raise ValueError(
            f"invalid target {name!r}: a {scheme}:// URL is no gRPC target; use 'host:port', "
            f"here {rest.rstrip('/')!r}{secure}"
        )
    if name.partition(":")[0].lower() not in GRPC_SCHEMES:  # dns:, unix:, ipv4: ...: gRPC's own syntax
        _check_host_port(name)


def _check_host_port(name: str) -> None:
    """host:port, [ipv6]:port: gRPC could not parse another port ("5/", "", a non-ASCII digit) or an
    empty host, and retried that for the whole timeout. A host alone (gRPC's default port 443) and a
    bare IPv6 address are as gRPC takes them."""
    if name.startswith("["):
        _, bracket, port = name.partition("]")
        if not bracket:
            raise ValueError(f"invalid target {name!r}: the IPv6 host's '[' has no ']'")
        if not port:
            return
        if not port.startswith(":"):
            raise ValueError(f"invalid target {name!r}: use '[ipv6]:port'")
        port = port[1:]
    elif name.count(":") == 1:
        host, _, port = name.partition(":")
        if not host:
            raise ValueError(f"invalid target {name!r}: no host before the port; use 'host:port'")
    else:
        return
    if not (port.isascii() and port.isdigit()):
        raise ValueError(f"invalid target {name!r}: port {port!r} is not a number; use 'host:port'")


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate (a name decoded with surrogateescape)
        return False
    return True


def parse_targets(target: str | Sequence[str]) -> tuple[str, ...]:
    """The receiver nodes named by `target`: one "host:port", a comma-separated list of them, or a
    sequence of either; ValueError for an empty list, an empty entry, a target named twice, or one
    check_target refuses (a URL's scheme, whitespace)."""
    if isinstance(target, (bytes, bytearray, memoryview)):  # iterated, its items were ints
        raise TypeError(f"a target is a str such as 'host:port', not {type(target).__name__}")
    given = [target] if isinstance(target, str) else list(target)
    targets: list[str] = []
    for item in given:
        if not isinstance(item, str):
            raise TypeError(f"a target is a str such as 'host:port', not {type(item).__name__}")
        for entry in item.split(","):
            name = entry.strip()
            if not name:
                raise ValueError(f"invalid target {target!r}: an empty entry; use 'host:port[,host:port]'")
            check_target(name)
            _, colon, port = name.rpartition(":")
            if colon and port.isdigit() and not 0 < int(port) <= 65535:  # a typo gRPC would retry for ever
                raise ValueError(f"invalid target {target!r}: port {port} of {name!r} is not 1-65535")
            if name in targets:
                # a round would visit it twice: more likely a typo for another node than meant
                raise ValueError(f"invalid target {target!r}: {name!r} is named twice")
            targets.append(name)
    if not targets:
        raise ValueError(f"invalid target {target!r}: no target; give at least one 'host:port'")
    return tuple(targets)


Call = grpc.aio.StreamStreamCall[pb.PublishRequest | bytes, pb.PublishResponse]
PUBLISH = "/ingest.v1.Ingest/Publish"


_CALL_ENDED = (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError)
_ERROR_DELIVERY = 1.0
"""Seconds a protocol error waits for the server to end the call after telling it in-band."""
FIRST_ANSWER_SECONDS = 5.0
"""start() waits at most this long for the server's answer to a first session (credit, or a refusal
it then raises); a server with no credit to give yet (paused) sends nothing, and start() returns.
Longer than a cluster node's producer-mark lookup before it decides on a session (ASK_TIMEOUT, 3 s, in
receivers/producer_marks.py, which this package must not import: a peer that takes the connection and
never answers holds it up that long), with 2 s for the decision after it; else start() returned before
the node decided and a refusal (ALREADY_EXISTS) failed the first send or flush instead. Change both
together (tests/test_replication.py checks the order)."""


class _State(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _Listed:
    """Records given one by one (send, send_many): values, their lengths, and keys once one has a key.
    Sending takes from the front: a head index, compacted now and then, so that taking a batch does not
    move the whole backlog. Lengths are measured once, as records come in: the byte budget and the
    batch's layout both need them, and measuring is a Python call per record."""

    __slots__ = ("_head", "_keys", "_lengths", "_values")

    def __init__(self) -> None:
        self._values: list[bytes] = []
        self._lengths = array.array("q")  # len() of each value, in step with _values
        self._keys: list[bytes | None] | None = None  # None while no record here has a key
        self._head = 0

    def __len__(self) -> int:
        return len(self._values) - self._head

    def append(self, value: bytes, key: bytes | None) -> int:
        """Add a record; return the bytes of its value and key."""
        key_size = len(key) if key is not None else 0
        if key is not None and self._keys is None:
            self._keys = [None] * len(self._values)
        self._values.append(value)
        size = len(value)
        self._lengths.append(size)
        if self._keys is not None:
            self._keys.append(key)
        return size + key_size

    def extend(
        self,
        values: Sequence[bytes],
        keys: Sequence[bytes | None] | None = None,
        lengths: npt.NDArray[np.int64] | None = None,
        key_size: int | None = None,
        limit: int = MAX_RECORD_BYTES,
    ) -> int:
        """Add records (keys: one per value, or None for none; `lengths` and `key_size`: the values'
        lengths and the keys' bytes, if measured already); return the bytes of their values and keys.
        _OverLimit for a record over `limit` bytes of key and value (nothing added)."""
        if lengths is None:
            lengths = _value_lengths(values)
        if key_size is None:
            key_size = _key_bytes(keys) if keys is not None else 0
        if len(values) and int(lengths.max()) + key_size > limit:  # maybe one is too large
            sizes = lengths + (_key_lengths(keys) if keys is not None else 0)
            if (over := int(np.argmax(sizes > limit))) or sizes[0] > limit:
                raise _OverLimit(over, int(sizes[over]))
        if keys is not None and self._keys is None:
            self._keys = [None] * len(self._values)
        self._values.extend(values)
        self._lengths.frombytes(lengths.tobytes())
        if self._keys is not None:
            self._keys.extend(keys if keys is not None else [None] * len(values))
        return int(lengths.sum()) + key_size

    def values(self, n: int) -> list[bytes]:
        return self._values[self._head : self._head + n]

    @property
    def keyed(self) -> bool:
        return self._keys is not None

    def keys_of(self, n: int) -> list[bytes | None] | None:
        return self._keys[self._head : self._head + n] if self._keys is not None else None

    def ends(self, n: int) -> npt.NDArray[np.int64]:
        """Where each of the first `n` values ends in their concatenation (wire.value_ends of them)."""
        # a copy, not a view: a buffer exported from the array would keep it from growing
        lengths = np.frombuffer(self._lengths, dtype=np.int64, count=n, offset=8 * self._head).copy()
        return np.cumsum(lengths, out=lengths)

    def drop(self, n: int) -> None:
        """Take the first `n` records away (sent)."""
        self._head += n
        if self._head >= len(self._values):
            self._values, self._lengths, self._keys, self._head = [], array.array("q"), None, 0
        elif self._head >= 65536 and self._head * 2 >= len(self._values):  # amortized: O(1) a record
            del self._values[: self._head]
            del self._lengths[: self._head]
            if self._keys is not None:
                del self._keys[: self._head]
            self._head = 0


class _KeyColumn:
    """The keys of a _Packed's records in Arrow's layout: key i is data[offsets[i]:offsets[i + 1]],
    and record i has none where valid[i] is False (its span is empty). `valid` None: all have one."""

    __slots__ = ("data", "offsets", "valid")

    def __init__(
        self, data: bytes, offsets: npt.NDArray[np.int64], valid: npt.NDArray[np.bool_] | None
    ) -> None:
        self.data = data
        self.offsets = offsets  # records + 1, non-decreasing, within data
        self.valid = valid

    @classmethod
    def of(cls, keys: Keys, skip: int) -> _KeyColumn:
        """A batch's keys from record `skip` on, as a column (a copy: to be sent again)."""
        laid = keys if isinstance(keys, PackedKeys) else lay_out_keys(keys)  # sent once: flat bytes
        offsets = np.zeros(len(laid) + 1, dtype=np.int64)
        offsets[1:] = laid.ends
        valid = laid.valid[skip:] if laid.valid is not None else None
        return cls(b"".join(laid.parts), offsets[skip:], valid)

    def slice(self, start: int, end: int) -> _KeyColumn:
        """Records start .. end - 1's keys, over the same data (no copy, offsets not rebased)."""
        valid = self.valid[start:end] if self.valid is not None else None
        return _KeyColumn(self.data, self.offsets[start : end + 1], valid)

    def part(self, head: int, n: int) -> PackedKeys:
        """Records head .. head + n - 1's keys, laid out for the wire (views, no copy)."""
        offsets = self.offsets
        start, end = int(offsets[head]), int(offsets[head + n])
        valid = self.valid[head : head + n] if self.valid is not None else None
        return PackedKeys([memoryview(self.data)[start:end]], offsets[head + 1 : head + n + 1] - start, valid)

    def listed(self, head: int, n: int) -> list[bytes | None]:
        """Records head .. head + n - 1's keys, one object each."""
        data, offsets = self.data, self.offsets[head : head + n + 1].tolist()
        valid = self.valid[head : head + n].tolist() if self.valid is not None else [True] * n
        return [data[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(n)]


class _Packed:
    """Records given as one buffer (send_packed; and records put back to be sent again): record i is
    data[offsets[i]:offsets[i + 1]], its key (if `keys`) in a column beside it. Taking records moves a
    head index; nothing is copied."""

    __slots__ = ("_head", "data", "keys", "offsets")

    def __init__(self, data: bytes, offsets: npt.NDArray[np.int64], keys: _KeyColumn | None = None) -> None:
        self.data = data
        self.offsets = offsets  # count + 1, non-decreasing, within data
        self.keys = keys  # None: no record has a key
        self._head = 0

    def __len__(self) -> int:
        return len(self.offsets) - 1 - self._head

    def nbytes(self, n: int) -> int:
        """Bytes of the first `n` records' values and keys (the keys' span: what the column holds)."""
        return int(self.offsets[self._head + n] - self.offsets[self._head]) + self.key_bytes(n)

    def part(self, n: int) -> memoryview:
        """The first `n` records' values, back to back."""
        offsets = self.offsets
        return memoryview(self.data)[int(offsets[self._head]) : int(offsets[self._head + n])]

    def values(self, n: int) -> list[bytes]:
        data, offsets = self.data, self.offsets[self._head : self._head + n + 1].tolist()
        return [data[offsets[i] : offsets[i + 1]] for i in range(n)]

    @property
    def keyed(self) -> bool:
        return self.keys is not None

    def keys_of(self, n: int) -> list[bytes | None] | None:
        return self.keys.listed(self._head, n) if self.keys is not None else None

    def key_bytes(self, n: int) -> int:
        """Bytes of the first `n` records' keys (their span in the column)."""
        if self.keys is None:
            return 0
        offsets = self.keys.offsets
        return int(offsets[self._head + n] - offsets[self._head])

    def key_part(self, n: int) -> PackedKeys | None:
        """The first `n` records' keys, laid out for the wire; None if no record here has a key."""
        return self.keys.part(self._head, n) if self.keys is not None else None

    def ends(self, n: int) -> npt.NDArray[np.int64]:
        head = self._head
        ends: npt.NDArray[np.int64] = self.offsets[head + 1 : head + n + 1] - self.offsets[head]
        return ends

    def drop(self, n: int) -> None:
        self._head += n


class _Run:
    """Consecutive records taken for one batch: the values' bytes as `parts` (concatenated, the values
    back to back), where each value ends (`ends`, from 0), and their keys (one per record, or laid out
    when they came packed) or None."""

    __slots__ = ("ends", "keys", "parts")

    def __init__(
        self,
        parts: list[bytes | memoryview],
        ends: npt.NDArray[np.int64],
        keys: Keys | None,
    ) -> None:
        self.parts = parts
        self.ends = ends
        self.keys = keys

    def __len__(self) -> int:
        return len(self.ends)

    def packed(self, skip: int = 0) -> _Packed:
        """These records from `skip` on as one buffer (a copy: to be sent again, or returned)."""
        data = b"".join(self.parts)
        offsets = np.zeros(len(self.ends) + 1, dtype=np.int64)
        offsets[1:] = self.ends
        keys = _KeyColumn.of(self.keys, skip) if self.keys is not None else None
        return _Packed(data, offsets[skip:], keys)

    def key_bytes(self, skip: int = 0) -> int:
        """Bytes of the keys of these records from `skip` on."""
        keys = self.keys
        if keys is None:
            return 0
        if isinstance(keys, PackedKeys):
            ends = keys.ends
            return int(ends[-1]) - (int(ends[skip - 1]) if skip else 0) if len(ends) else 0
        return _key_bytes(keys[skip:] if skip else keys)

    def key_size(self, i: int) -> int:
        """Bytes of record i's key (0 without one)."""
        keys = self.keys
        if isinstance(keys, PackedKeys):
            return keys.size(i)
        key = keys[i] if keys is not None else None
        return len(key) if key is not None else 0


class _Pending:
    """Records not sent yet, in order: runs of records given one by one (_Listed) and of records given
    as buffers (_Packed). A batch may take records from several runs."""

    __slots__ = ("_count", "_runs")

    def __init__(self) -> None:
        self._runs: collections.deque[_Listed | _Packed] = collections.deque()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def _listed(self) -> _Listed:
        if not self._runs or not isinstance(self._runs[-1], _Listed):
            self._runs.append(_Listed())
        run = self._runs[-1]
        assert isinstance(run, _Listed)
        return run

    def append(self, value: bytes, key: bytes | None) -> int:
        """Add a record; return its value's length."""
        size = self._listed().append(value, key)
        self._count += 1
        return size

    def extend(
        self,
        values: Sequence[bytes],
        keys: Sequence[bytes | None] | None = None,
        lengths: npt.NDArray[np.int64] | None = None,
        key_size: int | None = None,
        limit: int = MAX_RECORD_BYTES,
    ) -> int:
        """Add records (keys: one per value, or None); return the bytes of their values (_OverLimit: a
        record over `limit` bytes, nothing added)."""
        size = self._listed().extend(values, keys, lengths, key_size, limit)
        self._count += len(values)
        return size

    def extend_packed(self, packed: _Packed) -> None:
        if len(packed):
            self._runs.append(packed)
            self._count += len(packed)

    def prepend(self, runs: Sequence[_Packed]) -> None:
        """Put records back in front (to be sent again, before the others)."""
        for run in reversed(runs):
            if len(run):
                self._runs.appendleft(run)
                self._count += len(run)

    def _spans(self, n: int) -> list[tuple[_Listed | _Packed, int]]:
        """(run, records of it) covering the first `n` records."""
        spans = []
        for run in self._runs:
            k = min(n, len(run))
            spans.append((run, k))
            n -= k
            if n == 0:
                break
        return spans

    def ends(self, n: int) -> npt.NDArray[np.int64]:
        """Where each of the first `n` values ends in their concatenation (wire.value_ends of them)."""
        spans = self._spans(n)
        if len(spans) == 1:
            run, k = spans[0]
            return run.ends(k)
        pieces, total = [], 0
        for run, k in spans:
            ends = run.ends(k)
            pieces.append(ends + total)
            total += int(ends[-1]) if k else 0
        return np.concatenate(pieces)

    def peek(self, n: int, ends: npt.NDArray[np.int64] | None = None) -> _Run:
        """The first `n` records, without taking them (`ends`: self.ends(n), if the caller has it)."""
        spans = self._spans(n)
        parts: list[bytes | memoryview] = []
        for run, k in spans:
            if isinstance(run, _Listed):
                parts.extend(run.values(k))
            else:
                parts.append(run.part(k))
        return _Run(parts, self.ends(n) if ends is None else ends, _batch_keys(spans))

    def records(self, n: int) -> tuple[list[bytes], list[bytes | None] | None]:
        """The first `n` records as (values, keys or None), one object per record."""
        values: list[bytes] = []
        keys: list[bytes | None] = []
        keyed = False
        for run, k in self._spans(n):
            values.extend(run.values(k))
            run_keys = run.keys_of(k)
            keyed = keyed or run_keys is not None
            keys.extend(run_keys if run_keys is not None else [None] * k)
        return values, keys if keyed else None

    def drop(self, n: int) -> None:
        """Take the first `n` records away (sent)."""
        self._count -= n
        while n:
            run = self._runs[0]
            k = min(n, len(run))
            run.drop(k)
            n -= k
            if not len(run):
                self._runs.popleft()


def _key_bytes(keys: Sequence[bytes | None]) -> int:
    """Bytes of the keys (None: none), measured in C; RecordTypeError for one that is not bytes."""
    try:
        return len(b"".join(keys))  # type: ignore[arg-type] # the common case: no None; 4 ns a key
    except TypeError:
        pass
    try:
        return len(b"".join(filter(is_key, keys)))  # type: ignore[arg-type] # no None left
    except TypeError:
        bad = next(k for k in keys if k is not None and not isinstance(k, bytes | bytearray | memoryview))
        raise RecordTypeError(f"record keys must be bytes, not {type(bad).__name__}") from None


def _value_lengths(values: Sequence[bytes]) -> npt.NDArray[np.int64]:
    """Each value's length, measured in C; RecordTypeError for one without a length."""
    try:
        return np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    except TypeError:
        bad = next(v for v in values if not isinstance(v, bytes | bytearray | memoryview))
        raise RecordTypeError(f"record values must be bytes, not {type(bad).__name__}") from None


def _cut(ends: npt.NDArray[np.int64], start: int, end: int, room: float) -> int:
    """Where records start .. end - 1 of a call end so that their bytes fit `room` (ends: bytes of the
    call's records before each, ends[0] == 0); at least one record, as send() takes one while the buffer
    is below its bound: past it by one record at most."""
    if ends[end] - ends[start] <= room:
        return end
    fit = int(np.searchsorted(ends, ends[start] + room, side="right")) - 1
    return max(start + 1, min(end, fit))


def _key_lengths(keys: Sequence[bytes | None]) -> npt.NDArray[np.int64]:
    return np.fromiter((len(k) if k is not None else 0 for k in keys), dtype=np.int64, count=len(keys))


class _OverLimit(Exception):
    """Record `index` of the records given has `size` bytes of key and value, over the record limit."""

    def __init__(self, index: int, size: int) -> None:
        super().__init__(index, size)
        self.index, self.size = index, size


def _too_large(
    index: int, size: int, queued: int = 0, message_limit: int = DEFAULT_MAX_MESSAGE_BYTES
) -> RecordTooLargeError:
    """The error for record `index` of a call (send: 0), of `size` bytes of key and value; the call's
    first `queued` records were queued (a send_many larger than the buffer's room goes in pieces);
    `message_limit`: the message size limit in force (the server's, once a session was told it)."""
    taken = f"its records before {queued} were queued, the rest not" if queued else "nothing of it was queued"
    limit = _record_limit(message_limit)
    whose = "" if message_limit >= DEFAULT_MAX_MESSAGE_BYTES else " (the server's max_message_bytes)"
    return RecordTooLargeError(
        f"record {index} of the call has {size} bytes of key and value: over the {limit}-byte limit of a "
        f"record (a message is at most {message_limit} bytes{whose}); {taken}",
        index,
        size,
        limit,
    )


def _batch_cut(ends: npt.NDArray[np.int64], batch_bytes: int, message_limit: int) -> int:
    """How many of the records whose values end at `ends` (in their concatenation) one batch takes:
    roughly within batch_bytes (the record that crosses it too), and whole within the message limit:
    values, their offsets and the framing (keys are counted once laid out, by the encoding's size).
    At least one. Cut at batch_bytes alone, a batch passed a limit of batch_bytes (1 MiB) every time."""
    n = len(ends)
    if ends[-1] > batch_bytes:
        n = max(1, int(np.searchsorted(ends, batch_bytes)) + 1)
    if int(ends[n - 1]) + _OFFSET_BYTES * (n + 1) + MESSAGE_FRAMING > message_limit:
        sizes = ends[:n] + _OFFSET_BYTES * np.arange(2, n + 2) + MESSAGE_FRAMING
        n = max(1, int(np.searchsorted(sizes, message_limit, side="right")))
    return n


def _record_limit(message_limit: int) -> int:
    """The most bytes of key and value one record may have under a message size limit."""
    return min(MAX_RECORD_BYTES, message_limit - MESSAGE_FRAMING)


def _packed_sizes_check(
    offsets: npt.NDArray[np.int64], keys: _KeyColumn | None, message_limit: int = DEFAULT_MAX_MESSAGE_BYTES
) -> None:
    """RecordTooLargeError for send_packed's first record over the record limit (one pass, only when
    the records together are over it)."""
    limit = _record_limit(message_limit)
    total = int(offsets[-1] - offsets[0]) + (int(keys.offsets[-1] - keys.offsets[0]) if keys else 0)
    if total <= limit:
        return
    sizes = np.diff(offsets) + (np.diff(keys.offsets) if keys is not None else 0)
    over = np.flatnonzero(sizes > limit)
    if len(over):
        raise _too_large(int(over[0]), int(sizes[over[0]]), message_limit=message_limit)


def _batch_keys(spans: list[tuple[_Listed | _Packed, int]]) -> Keys | None:
    """The keys of a batch taken from `spans`: None if none has a key; laid out (PackedKeys, no object
    per record) when every keyed span came packed; else one per record."""
    if not any(run.keyed for run, _ in spans):
        return None
    if any(isinstance(run, _Listed) and run.keyed for run, _ in spans):
        keys: list[bytes | None] = []
        for run, k in spans:
            run_keys = run.keys_of(k)
            keys.extend(run_keys if run_keys is not None else [None] * k)
        return keys
    pieces = [(run.key_part(k) if isinstance(run, _Packed) else None, k) for run, k in spans]
    if len(pieces) == 1 and pieces[0][0] is not None:
        return pieces[0][0]
    parts: list[bytes | memoryview] = []
    ends, valid, total = [], [], 0
    for piece, k in pieces:
        if piece is None:  # records without keys: empty spans
            ends.append(np.full(k, total, dtype=np.int64))
            valid.append(np.zeros(k, dtype=bool))
            continue
        parts.extend(piece.parts)
        ends.append(piece.ends + total)
        valid.append(piece.valid if piece.valid is not None else np.ones(k, dtype=bool))
        total += int(piece.ends[-1])
    return PackedKeys(parts, np.concatenate(ends), np.concatenate(valid))


def _failure_of(exc: BaseException, where: str) -> SluiceError:
    """What flush, send and close raise after `exc` ended a background task of the producer (`where`):
    a SluiceError as it is, any other (a defect, an on_room callback that raised) as the cause of a
    ProducerClosedError."""
    if isinstance(exc, SluiceError):
        return exc
    error = ProducerClosedError(f"producer failed: its {where} raised {exc!r}")
    error.__cause__ = exc
    return error


def _check_sequence(records: object, what: str) -> None:
    """TypeError unless send_many's `records` (`what`: "values" or "keys") is a sequence it can slice,
    one item a record: not an iterator (no len), a dict or a set (a slice of them failed: "unhashable
    type: 'slice'"), nor one record's bytes or str (a sequence of ints or characters)."""
    kind = type(records).__name__
    if isinstance(records, str | bytes | bytearray | memoryview):
        raise TypeError(
            f"send_many takes a sequence of records (a list or tuple) as {what}, not one {kind}: "
            "give [record], or use send() for one record"
        )
    if isinstance(records, Mapping):
        hint = "give list(d.values()) for its values"
    elif isinstance(records, AbstractSet):
        hint = "give a list in the order the records go"
    elif not (hasattr(records, "__getitem__") and hasattr(records, "__len__")):
        hint = "give list(...) of an iterator, or use publish() to pull from one as credit comes"
    else:
        return
    raise TypeError(f"send_many takes a sequence of records (a list or tuple) as {what}, not {kind}; {hint}")


def _closed_with(unacked: int) -> ProducerClosedError:
    """What flush() raises on a closed producer."""
    if not unacked:
        return ProducerClosedError("producer is closed")
    return ProducerClosedError(
        f"producer is closed with {unacked} records not acked: they will never be (unacked_records() "
        "returns them)"
    )


def _check_flat(item: object, what: str) -> None:
    """TypeError unless `item` is bytes, a bytearray or a memoryview of single bytes: a view of 4-byte
    items has a len() of items, not bytes, and failed the producer when its batch was encoded."""
    if not isinstance(item, bytes | bytearray | memoryview):
        raise TypeError(f"record {what} must be bytes, not {type(item).__name__}")
    if isinstance(item, memoryview) and item.nbytes != len(item):
        raise TypeError(
            f"record {what} is a memoryview of {item.itemsize}-byte items, not bytes: give "
            "view.cast('B') (or bytes(view))"
        )


def _record_type_error(
    first_seq: int, values: list[bytes], keys: list[bytes | None] | None, ends: npt.NDArray[np.int64]
) -> RecordTypeError:
    """The error naming the first record of a batch whose value or key is not flat bytes, or whose
    value is no longer the size it had when given (`ends`: where each value ended then)."""

    def flat(item: object) -> bool:
        return isinstance(item, bytes | bytearray) or (
            isinstance(item, memoryview) and item.nbytes == len(item)
        )

    for i, value in enumerate(values):
        key = keys[i] if keys is not None else None
        for what, item in (("value", value), ("key", key)):
            if item is not None and not flat(item):
                kind = type(item).__name__
                if isinstance(item, memoryview):
                    kind = f"a memoryview of {item.itemsize}-byte items"
                return RecordTypeError(
                    f"record {first_seq + i}: its {what} is {kind}, not bytes; the "
                    "producer cannot send it (its unsent records: abort() returns them)"
                )
    for i, (value, end) in enumerate(zip(values, ends.tolist(), strict=True)):
        size = end - (int(ends[i - 1]) if i else 0)
        if len(value) != size:  # a bytearray resized after the call that gave it
            return RecordTypeError(
                f"record {first_seq + i}: its value changed size after it was given ({size} bytes then, "
                f"{len(value)} now: a bytearray resized before it was sent); give bytes, or leave it "
                "as it is until it is acked (the unsent records: abort() returns them)"
            )
    return RecordTypeError(f"a record of the batch at {first_seq} is not bytes")  # pragma: no cover


Buffer = bytes | bytearray | memoryview


def _packed_input(
    values: Buffer, offsets: npt.ArrayLike, what: str = "values", offsets_name: str = "offsets"
) -> tuple[int, bytes, npt.NDArray[np.int64]]:
    """(records, values to keep, their offsets) of send_packed's arguments (`what`: "values" or
    "keys"); TypeError or ValueError saying what is wrong with them."""
    try:
        view = memoryview(values).cast("B")
    except TypeError:
        raise TypeError(
            f"{what} must be a contiguous bytes-like object, not {type(values).__name__}"
        ) from None
    bounds = np.asarray(offsets)
    if bounds.ndim != 1 or len(bounds) == 0:
        raise ValueError(f"{offsets_name} must be a one-dimensional sequence of records + 1 integers")
    if bounds.dtype.kind not in "iu":
        raise TypeError(f"{offsets_name} must be integers, got {bounds.dtype}")
    # one pass (this runs for every call): non-decreasing, then its ends bound them all
    decreasing = bounds[1:] < bounds[:-1]
    if decreasing.any():
        at = int(np.argmax(decreasing))
        raise ValueError(f"{offsets_name} must not decrease: {offsets_name}[{at}] > {offsets_name}[{at + 1}]")
    low, high = int(bounds[0]), int(bounds[-1])
    if low < 0 or high > len(view):
        raise ValueError(f"{offsets_name} must lie within the {len(view)} bytes of {what}, got {low}..{high}")
    bounds = bounds.astype(np.int64, copy=False)
    if isinstance(values, bytes):
        return len(bounds) - 1, values, bounds
    first, last = int(bounds[0]), int(bounds[-1])
    return len(bounds) - 1, view[first:last].tobytes(), bounds - first  # a copy: the caller's may change


_ARROW_OFFSETS = {"binary": "int32", "string": "int32", "large_binary": "int64", "large_string": "int64"}


def _without_offsets(arrow_type: Any) -> bool:
    """Whether `arrow_type` holds binary or string values without an offsets buffer: views, fixed-size
    binary, or a dictionary of binary or string values (numbers, which cast to strings, are not)."""
    name = str(arrow_type)
    if name in ("binary_view", "string_view") or name.startswith("fixed_size_binary["):
        return True
    values = getattr(arrow_type, "value_type", None)  # a dictionary's
    return name.startswith("dictionary<") and (str(values) in _ARROW_OFFSETS or _without_offsets(values))


def _arrow_binary(
    array: Any, what: str
) -> tuple[int, memoryview, npt.NDArray[np.int64], npt.NDArray[np.bool_] | None]:
    """(length, data, offsets into it, validity or None without nulls) of a pyarrow binary or string
    array, read from its buffers where its slice starts (pyarrow is not imported: the SDK does not
    need it, and an array brings its own)."""
    if hasattr(array, "combine_chunks"):  # a ChunkedArray: one array (a copy when it has several)
        array = array.combine_chunks()
    kind = getattr(array, "type", None)
    if _without_offsets(kind) and hasattr(array, "buffers"):  # an array, not a scalar of that type
        array = array.cast("large_binary")  # no offsets to read: laid out with them (a copy)
    dtype = _ARROW_OFFSETS.get(str(getattr(array, "type", None)))
    if dtype is None or not hasattr(array, "buffers"):
        shown = kind if kind is not None and hasattr(array, "buffers") else type(array).__name__
        raise TypeError(f"{what} must be a pyarrow binary or string array, not {shown}")
    count, start = len(array), int(array.offset)
    _, offsets_buffer, data_buffer = array.buffers()[:3]
    if count == 0:
        return 0, memoryview(b""), np.zeros(1, dtype=np.int64), None
    skip = start * np.dtype(dtype).itemsize
    offsets = np.frombuffer(offsets_buffer, dtype=dtype, count=count + 1, offset=skip)
    data = memoryview(data_buffer) if data_buffer is not None else memoryview(b"")
    valid = array.is_valid().to_numpy(zero_copy_only=False) if array.null_count else None
    return count, data, offsets.astype(np.int64), valid


def _packed_keys(
    count: int, keys: Buffer | None, key_offsets: npt.ArrayLike | None, key_validity: npt.ArrayLike | None
) -> _KeyColumn | None:
    """The key column of send_packed's key arguments (None: no record has a key); TypeError or
    ValueError saying what is wrong with them."""
    if keys is None and key_offsets is None:
        if key_validity is not None:
            raise ValueError("key_validity needs keys and key_offsets")
        return None
    if keys is None or key_offsets is None:
        raise ValueError("keys and key_offsets go together: give both, or neither for records without keys")
    n, data, bounds = _packed_input(keys, key_offsets, "keys", "key_offsets")
    if n != count:
        raise ValueError(f"key_offsets gives {n} keys for {count} records: one key per record")
    if key_validity is None:
        return _KeyColumn(data, bounds, None)
    valid = np.asarray(key_validity)
    if valid.dtype != np.bool_:
        raise TypeError(f"key_validity must be booleans (True: the record has a key), got {valid.dtype}")
    if valid.shape != (count,):
        raise ValueError(f"key_validity has shape {valid.shape}: one boolean per record, {count}")
    if valid.all():
        return _KeyColumn(data, bounds, None)
    lengths = np.diff(bounds)
    if lengths[~valid].any():  # Arrow lets a null's span hold bytes: leave them out of the column
        start = int(bounds[0])
        raw = np.frombuffer(data, dtype=np.uint8)[start : int(bounds[-1])]
        data = raw[np.repeat(valid, lengths)].tobytes()
        bounds = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(np.where(valid, lengths, 0), out=bounds[1:])
    return _KeyColumn(data, bounds, valid.copy())


def _int_arg(name: str, value: object, low: int, high: int | None = None, *, none: str = "") -> int:
    """`value` as an int in low..high (high None: no upper bound); TypeError unless it is an integer
    (a bool or a float is not: 1e4 or 1.5 failed the producer when it sent), ValueError out of range.
    `none`: how the message goes on when None is allowed ("or None")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, not {type(value).__name__} ({value!r})")
    number = int(value)
    if number < low or (high is not None and number > high):
        bounds = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bounds}{' ' + none if none else ''}, got {number}")
    return number


def _check_producer_id(producer_id: str) -> None:
    """ValueError unless the server can take `producer_id` (it refused it only when the session opened,
    INVALID_ARGUMENT): at most MAX_PRODUCER_ID_BYTES of UTF-8, without NUL."""
    try:
        size = len(producer_id.encode())
    except UnicodeEncodeError:  # a lone surrogate: protobuf cannot send it
        raise ValueError(f"producer_id must be valid UTF-8 text, got {producer_id!r}") from None
    if size > MAX_PRODUCER_ID_BYTES:
        raise ValueError(
            f"producer_id must be at most {MAX_PRODUCER_ID_BYTES} bytes of UTF-8, got {size} "
            f"({producer_id[:40]!r}...)"
        )
    if "\0" in producer_id:
        raise ValueError(f"producer_id must not contain NUL, got {producer_id!r}")


def warn_dropped_on_error(count: int, error: BaseException) -> None:
    """Log the records an `async with`/`with` body's error dropped: its exit aborts (the body's error
    is what it raises) and the records never acked went without a word."""
    if count:
        log.warning(
            "producer left with %s: %d record(s) never acked were dropped (abort()); close() or "
            "flush() before leaving delivers them",
            type(error).__name__,
            count,
        )


def warn_never_closed(kind: str, target: str, count: int) -> None:
    """Log the records a producer that was never closed dropped, its loop or the process ending."""
    if count:
        log.warning(
            "%s for %s was never closed: %d record(s) never acked were dropped; close() delivers them",
            kind,
            target,
            count,
        )


def check_timeout(timeout: float | None) -> None:
    """TypeError unless `timeout` (flush's, close's) is None or a number, ValueError unless it is >= 0:
    NaN too, which asyncio takes as a timeout that has run out already."""
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(
            f"timeout must be a number of seconds or None, not {type(timeout).__name__} ({timeout!r})"
        )
    if not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds (or None: no limit), got {timeout}")
    _float_seconds("timeout", timeout, "None")


def _float_seconds(name: str, value: numbers.Real, unbounded: str) -> float:
    """`value` as a float; ValueError for an int too large for one (10**400): float() raised
    OverflowError there, or asyncio did when it added the timeout to its clock."""
    try:
        return float(value)
    except OverflowError:
        raise ValueError(
            f"{name} is out of range: the largest number of seconds is {sys.float_info.max:.1e}"
            f"{f' ({unbounded}: no limit)' if unbounded else ''}"
        ) from None


_INT_OPTION_MAX = 2**31 - 1  # a gRPC channel option is a C int


def _option_ms(seconds: float) -> int:
    """`seconds` as milliseconds for a gRPC channel option: within a C int (a backoff of a year is
    taken as about 24 days there; the producer's own backoff still waits the year)."""
    return min(int(seconds * 1000), _INT_OPTION_MAX)


def seconds_arg(name: str, value: object, *, finite: bool = False) -> float:
    """`value` as seconds >= 0 (a float); TypeError unless it is a number (not a bool), ValueError for
    a negative or NaN one, or an infinite one where `finite`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__} ({value!r})")
    seconds = _float_seconds(name, value, "" if finite else "inf")
    if not seconds >= 0 or (finite and seconds == math.inf):
        allowed = "finite and >= 0" if finite else ">= 0"
        raise ValueError(f"{name} must be {allowed} seconds, got {value}")
    return seconds


class _Sent:
    """A batch sent and not yet acked: kept to be resent after a reconnect. `skip` of its records, at
    the front, were acked since."""

    __slots__ = ("_key_bytes", "first_seq", "run", "skip")

    def __init__(self, first_seq: int, run: _Run) -> None:
        self.first_seq = first_seq  # of its first record not acked
        self.run = run
        self.skip = 0
        self._key_bytes = run.key_bytes()  # measured once: a batch is mostly acked whole

    def __len__(self) -> int:
        return len(self.run) - self.skip

    @property
    def nbytes(self) -> int:
        """Bytes of its unacked records' values and keys (as they counted while pending)."""
        ends, skip = self.run.ends, self.skip
        if not skip:
            return int(ends[-1]) + self._key_bytes
        return int(ends[-1]) - int(ends[skip - 1]) + self.run.key_bytes(skip)

    def unacked(self) -> _Packed:
        return self.run.packed(self.skip)


class Producer:
    """Sends records to one stream of a Sluice server, resending across reconnects.

    Use as `async with Producer(target, stream) as producer: await producer.send(b"...")`.

    `target`: "host:port", or several receiver nodes ("a:7000,b:7000" or a sequence) to fail over
    between, in order (module docstring); `targets` holds them, `target` is the one in use.

    `producer_id` names the producer for deduplication (default: a random id, so one Producer object is
    one producer); give the same id to one producer at a time only: a second session with the same id
    fences the first (it fails with ABORTED).

    `first_seq` is the sequence number of the first record (default 0). A producer numbering from 0
    without `resume` is a new run and says so to the server (Open.fresh): when the server already holds
    records of the id, they are an earlier run's and this run's records would be dropped as their
    duplicates, so start() raises RPCError ALREADY_EXISTS naming the sequence number the server expects
    next (give it as `first_seq`, or resume, or use a new id). A `first_seq` above 0 continues the id's
    numbering from there, e.g. an app restarted after a crash at its last acked sequence number: what
    the server already has from there on is dropped as duplicates, the rest stored. `resume=True` does
    the same and also checks that the server knows the id (a mistyped one: OUT_OF_RANGE). Past the
    server's mark a batch is OUT_OF_RANGE. `acked`, `sent` and `ever_sent` are sequence numbers, so
    they start at it.

    `start_timeout` bounds how long start() retries a server that cannot be reached or ends the first
    session before taking it (UNAVAILABLE), with
    the reconnect backoff, logging a WARNING that names the targets; then StartTimeoutError. 0: one
    round of the targets.

    `channel`: a channel of the caller's (one target only), used as is and left open by close().

    `credentials` (sluice_client.credentials.Credentials, e.g. `Credentials.from_env()`): TLS and a
    bearer token; default plaintext without a token. UNAUTHENTICATED and PERMISSION_DENIED end the
    producer at once (RPCError), as does RESOURCE_EXHAUSTED from a per-principal limit.
    """

    def __init__(  # noqa: PLR0915 - one assignment per setting
        self,
        target: str | Sequence[str],
        stream: str,
        *,
        producer_id: str | None = None,
        batch_size: int = 4096,
        batch_bytes: int = 1024 * 1024,
        linger: float = 0.005,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_buffered_bytes: int | None = DEFAULT_MAX_BUFFERED_BYTES,
        reconnect_backoff: float = 0.05,
        max_reconnect_backoff: float = 5.0,
        reconnect_timeout: float = 60.0,
        start_timeout: float = 60.0,
        first_seq: int = 0,
        resume: bool = False,
        channel: grpc.aio.Channel | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        # checked before anything is kept: a float size (1e4) was taken and failed the sender later,
        # an infinite backoff failed start(), a producer_id that is not a str failed in protobuf
        if not isinstance(stream, str):
            raise TypeError(f"stream must be a str, not {type(stream).__name__} ({stream!r})")
        if not stream.isascii() and not _utf8(stream):  # protobuf raised UnicodeEncodeError at start()
            raise ValueError(f"stream must be valid UTF-8 text, got {stream!r}")
        if producer_id is not None and not isinstance(producer_id, str):
            raise TypeError(
                f"producer_id must be a str (or None: a random id), not {type(producer_id).__name__} "
                f"({producer_id!r})"
            )
        if producer_id is not None:
            _check_producer_id(producer_id)
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be a bool, not {type(resume).__name__} ({resume!r})")
        if credentials is not None and not isinstance(credentials, Credentials):  # else failed at start
            raise TypeError(
                f"credentials must be a sluice_client.Credentials or None, not {type(credentials).__name__}"
            )
        batch_size = _int_arg("batch_size", batch_size, 1)
        batch_bytes = _int_arg("batch_bytes", batch_bytes, 1)
        max_buffered = _int_arg("max_buffered", max_buffered, 1)
        if max_buffered < batch_size:
            raise ValueError(
                f"max_buffered must be >= batch_size: got max_buffered {max_buffered}, "
                f"batch_size {batch_size}"
            )
        if max_buffered_bytes is not None:
            max_buffered_bytes = _int_arg("max_buffered_bytes", max_buffered_bytes, 1, none="or None")
        first_seq = _int_arg("first_seq", first_seq, 0, _SEQ_END - 1)
        # inf: no limit (wait for a full batch or a flush; retry for good); a backoff is a pause
        linger = seconds_arg("linger", linger)
        reconnect_timeout = seconds_arg("reconnect_timeout", reconnect_timeout)
        start_timeout = seconds_arg("start_timeout", start_timeout)
        reconnect_backoff = seconds_arg("reconnect_backoff", reconnect_backoff, finite=True)
        max_reconnect_backoff = seconds_arg("max_reconnect_backoff", max_reconnect_backoff, finite=True)
        if not 0 < reconnect_backoff <= max_reconnect_backoff:
            raise ValueError(
                "need 0 < reconnect_backoff <= max_reconnect_backoff; got reconnect_backoff "
                f"{reconnect_backoff}, max_reconnect_backoff {max_reconnect_backoff}"
            )
        self._targets = parse_targets(target)
        if channel is not None and len(self._targets) > 1:
            raise ValueError(
                f"channel= serves one target, not {len(self._targets)}: {', '.join(self._targets)}"
            )
        self._current = 0  # index in targets of the node in use (or tried last)
        # the settings: read-only once constructed (properties below): a change later went unchecked
        self._stream = stream
        self._producer_id = producer_id or uuid.uuid4().hex
        self._resume = resume
        self._taken = False  # a server granted a session of this Producer credit: the id is not a typo
        self._fresh = first_seq == 0 and not resume  # a new run: its first session sets Open.fresh
        self._batch_size = batch_size
        self._batch_bytes = batch_bytes
        self._linger = linger
        self._max_buffered = max_buffered
        self._max_buffered_bytes = max_buffered_bytes
        self._reconnect_backoff = reconnect_backoff
        self._max_reconnect_backoff = max_reconnect_backoff
        self._reconnect_timeout = reconnect_timeout
        self._start_timeout = start_timeout
        self._credentials = credentials or Credentials()  # its token goes on `channel`'s calls too
        # one channel per target used, made on first use; a caller's channel is theirs to close
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._own_channel = channel is None
        if channel is not None:
            self._channels[self._targets[0]] = channel
        self._state = _State.NEW
        self._call: Call | None = None
        self._pending = _Pending()  # not sent yet (in this session), from _sent_seq on
        self._buffered_bytes = 0
        self._unacked: collections.deque[_Sent] = collections.deque()  # sent, not acked, in order
        self._unacked_count = 0
        self._unacked_bytes = 0
        self._sent_seq = first_seq  # records numbered below were sent (in this session, or acked before it)
        self._acked_seq = first_seq  # records numbered below are durable
        self._ever_sent = first_seq  # records numbered below were sent at least once, in any session
        self._credit = 0
        self._max_message = DEFAULT_MAX_MESSAGE_BYTES
        """The largest message the server takes from this producer, as its last Request said."""
        self._flushing = 0
        self._error: SluiceError | None = None
        self._changed = asyncio.Event()
        self._torn_down = asyncio.Event()  # set once closed or aborted: a second close() waits for it
        self._close_error: BaseException | None = None  # what the close() under way raised, for a second
        self._dropped_unsaid = False  # a close() cut short dropped records no one was told of
        self._tasks: list[asyncio.Task[None]] = []
        self._starting: asyncio.Task[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # start()'s, where the tasks run
        """The task running start() while it tries to open the first session."""
        self._room_listeners: list[Callable[[], None]] = []
        self._write_lock = asyncio.Lock()  # grpc.aio allows one write at a time per call
        self._lost_since: float | None = None  # when the session was lost, until a new one is up
        # while start() waits for the first answer: when it began (a failover then keeps to
        # start_timeout from there)
        self._start_began: float | None = None
        # when the session in use wrote its Open, while it runs (the first answer is awaited from there)
        self._opened_at: float | None = None
        self._outage_backoff = reconnect_backoff  # before the next round of targets in this outage
        self._outage_rounds = 0  # rounds of targets tried in this outage
        self.cancel_reason: str | None = None
        """Why the server last cancelled a session, if it did."""
        self.reconnects = 0
        """Sessions opened again after the previous one ended with a retriable status."""
        self.resent = 0
        """Records queued again for sending after a reconnect (sent before, not acked)."""

    # ---- settings: read-only, checked by the constructor ----------------------------------------

    @property
    def targets(self) -> tuple[str, ...]:
        """The receiver nodes to use, in failover order."""
        return self._targets

    @property
    def stream(self) -> str:
        return self._stream

    @property
    def producer_id(self) -> str:
        """The id the server deduplicates by (the one given, or a random one)."""
        return self._producer_id

    @property
    def resume(self) -> bool:
        """`first_seq` continues an earlier run of this producer id, whose records from there on the
        server may have (resent: dropped as duplicates); a server that does not know the id (a mistyped
        one) refuses the session (OUT_OF_RANGE) instead of taking it from first_seq on. Without it and
        with first_seq 0 the producer is a new run (Open.fresh): refused (ALREADY_EXISTS) where the
        server has records of the id. Either only until a server has taken a session of this Producer:
        later sessions resume from its own acks, also on a node (or a server) that no longer knows the
        id."""
        return self._resume

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def batch_bytes(self) -> int:
        return self._batch_bytes

    @property
    def linger(self) -> float:
        return self._linger

    @property
    def max_buffered(self) -> int:
        return self._max_buffered

    @property
    def max_buffered_bytes(self) -> int | None:
        return self._max_buffered_bytes

    @property
    def reconnect_backoff(self) -> float:
        return self._reconnect_backoff

    @property
    def max_reconnect_backoff(self) -> float:
        return self._max_reconnect_backoff

    @property
    def reconnect_timeout(self) -> float:
        return self._reconnect_timeout

    @property
    def start_timeout(self) -> float:
        return self._start_timeout

    @property
    def credentials(self) -> Credentials:
        return self._credentials

    @property
    def target(self) -> str:
        """The target of the session in use (or being opened): one of `targets`."""
        return self._targets[self._current]

    # ---- counters --------------------------------------------------------------------------------

    @property
    def sent(self) -> int:
        """Records sent to the server (after a reconnect: acked ones plus those sent again since)."""
        return self._sent_seq

    @property
    def ever_sent(self) -> int:
        """Records sent at least once, in any session (those from `acked` on may or may not be stored)."""
        return self._ever_sent

    @property
    def acked(self) -> int:
        """Records the server reported durable: every record numbered below is (resume from here)."""
        return self._acked_seq

    @property
    def credit(self) -> int:
        """Records the producer may send now."""
        return self._credit

    @property
    def unacked(self) -> int:
        """Records accepted by send() and not yet acked."""
        return self._sent_seq + len(self._pending) - self._acked_seq

    def unacked_records(self) -> list[tuple[bytes, bytes | None]]:
        """The records not acked yet, as (value, key) in sequence order from `acked` on."""
        pending = _Pending()
        pending.prepend([sent.unacked() for sent in self._unacked])
        values, keys = pending.records(len(pending))
        more, more_keys = self._pending.records(len(self._pending))
        none: list[bytes | None] = [None]
        records = list(zip(values, keys or none * len(values), strict=True))
        records.extend(zip(more, more_keys or none * len(more), strict=True))
        return records

    # ---- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the session; returns once the server took it (its first credit), or after
        FIRST_ANSWER_SECONDS (5 s) without an answer (a server with no credit to give yet). While no
        target can be reached or takes the session (UNAVAILABLE: not up yet, restarting, stopping, not
        ready) this goes round the targets, backing off between rounds, for up to `start_timeout`
        seconds, then raises StartTimeoutError; any other
        status raises RPCError at once: ALREADY_EXISTS for a new run of a producer id whose earlier run's
        records the server holds from `first_seq` on (see the class docstring), OUT_OF_RANGE for a
        resume of an id the server does not know, NOT_FOUND, PERMISSION_DENIED, ..."""
        if self._state is not _State.NEW:
            raise ProducerClosedError(f"producer is {self._state.value}; a producer starts once")
        tune_malloc()  # batches are large buffers: keep them off mmap (sluice_client.allocator)
        self._state = _State.OPEN
        self._loop = asyncio.get_running_loop()
        self._start_began = self._loop.time()
        starting = self._starting = asyncio.current_task()  # a close or abort meanwhile ends the attempt
        try:
            call = await self._open_first_call()
        except asyncio.CancelledError:
            self._starting = None
            # the teardown's cancel, and no other: start() ends with why (the caller's own goes on)
            if self._state is _State.CLOSED and starting is not None and starting.uncancel() == 0:
                raise ProducerClosedError("producer was closed while it started") from None
            if self._state is not _State.CLOSED:
                await self._teardown()
            raise
        except BaseException:
            self._starting = None  # its own teardown: a close now must not cancel it
            await self._teardown()
            raise
        finally:
            self._starting = None
        self._tasks = [asyncio.create_task(self._supervise(call), name="sluice-producer")]
        self._tasks[0].add_done_callback(self._task_done)
        await self._first_answer()

    async def _first_answer(self) -> None:
        """Wait until the server answered the first session: credit (it took the session), or a status
        that failed the producer (a refusal of this run, a resume of an unknown id, an unknown stream,
        ...), raised here with the producer torn down. A session that ends UNAVAILABLE meanwhile (a
        stopping server, a node not ready, a cluster that cannot tell the producer's mark yet) is failed
        over and retried at once, within start_timeout, and this waits on for the next one's answer. A
        session open FIRST_ANSWER_SECONDS without an answer ends the wait: a server with no credit to
        give yet (paused) says nothing, and a refusal after that fails the calls that send or wait."""
        loop = asyncio.get_running_loop()
        try:
            # until the session task ends, not merely until _error is set: a protocol error is told to
            # the server in-band before the task ends, and a teardown would cut it
            session = self._tasks[0]
            while not self._taken and not session.done() and self._state is _State.OPEN:
                opened = self._opened_at
                if opened is None:  # between sessions: failing over, backing off
                    await self._wait_change()
                    continue
                left = opened + FIRST_ANSWER_SECONDS - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._wait_change()
        except asyncio.CancelledError:  # as a cancel of start() before: no producer left half started
            if self._state is not _State.CLOSED:
                await self._teardown()
            raise
        finally:
            self._start_began = None
        if self._error is not None and self._state is _State.OPEN:
            error = self._error
            await self._teardown()
            raise error

    async def _open_first_call(self) -> Call:
        """Open the first session, retrying what a reconnect retries, for up to start_timeout."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        delay = self._reconnect_backoff
        attempts = 0
        while True:
            for index in self._round(0):
                attempts += 1
                try:
                    call = await self._open_call(index)
                except RPCError as exc:
                    if not reconnectable(exc):
                        raise
                    failure = exc
                    continue
                if attempts > 1:
                    log.info("connected to %s after %.1f s", self.target, loop.time() - started)
                return call
            elapsed = loop.time() - started
            if elapsed >= self._start_timeout:
                raise StartTimeoutError(
                    ", ".join(self._targets), failure, attempts, elapsed, tls=self._credentials.secure
                )
            if attempts == len(self._targets):
                log.warning(
                    "waiting for server at %s (%s: %s); retrying for up to %g s",
                    ", ".join(self._targets),
                    failure.status.name,
                    failure.message,
                    self._start_timeout,
                )
            await asyncio.sleep(min(delay * random.uniform(0.5, 1.0), self._start_timeout - elapsed))  # noqa: S311
            delay = min(delay * 2, self._max_reconnect_backoff)

    def _round(self, first: int) -> list[int]:
        """Indexes of every target once, in order, from `first` (wrapping round)."""
        n = len(self._targets)
        return [(first + i) % n for i in range(n)]

    def _channel_for(self, target: str) -> grpc.aio.Channel:
        channel = self._channels.get(target)
        if channel is None:
            backoff_ms = _option_ms(self._reconnect_backoff)
            channel = self._credentials.channel(
                target,
                options=[
                    ("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                    # the channel's own reconnects must not lag behind ours after a server restart
                    ("grpc.initial_reconnect_backoff_ms", backoff_ms),
                    ("grpc.min_reconnect_backoff_ms", backoff_ms),
                    ("grpc.max_reconnect_backoff_ms", _option_ms(self._max_reconnect_backoff)),
                    # a server that stops answering with its connection open (frozen, partitioned
                    # away) is lost only when a ping goes unanswered: without these the session
                    # waited on it for good instead of failing over
                    *channel_options(KEEPALIVE_SECONDS, KEEPALIVE_TIMEOUT_SECONDS),
                ],
            )
            self._channels[target] = channel
        return channel

    async def _open_call(self, index: int) -> Call:
        """Open a session with targets[index] (now `target`): Open written, or RPCError."""
        self._current = index
        publish = self._channel_for(self.target).stream_stream(
            PUBLISH,
            request_serializer=serialize_request,
            response_deserializer=pb.PublishResponse.FromString,
            _registered_method=True,  # type: ignore[call-arg]  # as the generated stub does; stubs lag
        )
        call: Call = publish(metadata=self._credentials.metadata)  # type: ignore[call-arg]  # stubs lag
        first = not self._taken  # no server took a session of this Producer yet: no record was sent
        opening = pb.Open(
            stream=self._stream,
            producer_id=self._producer_id,
            resume_from_seq=self._acked_seq,
            resume=self._resume and first,
            # a new run from 0: a server holding records of this id refuses it (ALREADY_EXISTS) rather
            # than drop this run's records as duplicates of those. A first_seq > 0 goes on from there
            # as it always did (records the server has from there on are dropped as duplicates): an
            # app restarted after a crash at first_seq=<its last ack> must not be refused
            fresh=first and self._fresh,
        )
        try:
            try:
                await call.write(pb.PublishRequest(open=opening))
            except grpc.aio.AioRpcError as exc:
                raise RPCError.from_grpc(exc) from None
            except asyncio.InvalidStateError:
                # the call ended before Open went out (the node failed it at once): its status says why
                code, details, trailers = (
                    await call.code(),
                    await call.details(),
                    await call.trailing_metadata(),
                )
                raise RPCError.from_status(code, details or "", trailers) from None
        except BaseException:
            call.cancel()
            raise
        self._call = call
        self._opened_at = asyncio.get_running_loop().time()
        self._wake()
        return call

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            await self.close()
        else:
            warn_dropped_on_error(len(await self.abort()), exc)

    async def close(self, timeout: float | None = None) -> None:
        """Send what is buffered, wait until it is acked (across reconnects), complete the session and
        release the channel, all within `timeout` seconds (one deadline; once every record is acked, a
        server that has not ended the call by then is cancelled, no error). From the moment it begins,
        sends raise ProducerClosedError: it flushes the records queued before it; a second close()
        meanwhile returns once this one is done.

        When records remain unacked (the timeout ran out, the producer failed or gave up reconnecting)
        the producer is torn down all the same and UnackedRecordsError is raised: `.records` holds every
        record never acked, `.unacked` their count, `__cause__` the FlushTimeoutError, RPCError or other
        error that stopped delivery. A failure with nothing left unacked raises that error itself.
        """
        check_timeout(timeout)  # before anything changes: a bad one leaves the producer as it was
        self._check_loop()
        if self._state is _State.CLOSING:  # another close() is under way: done when it is, as it is
            await self._torn_down.wait()
            failed = self._close_error
            if isinstance(failed, UnackedRecordsError):  # this caller too must not take it as delivered
                raise UnackedRecordsError(failed.records, failed.first_seq, failed) from failed
            if isinstance(failed, Exception):
                raise ProducerClosedError(f"the close() under way failed: {failed}") from failed
            return
        if self._state is _State.CLOSED:
            self.raise_dropped()
            return
        if self._state is _State.NEW:
            self._state = _State.CLOSED
            return
        if self._starting is not None:  # closed while it started: no session to complete
            records = self.unacked_records()
            await self._teardown()
            if records:
                closed = ProducerClosedError("producer was closed while it started")
                raise UnackedRecordsError(records, self._acked_seq, closed) from closed
            return
        # from here every send refuses (ProducerClosedError): what close() flushes is what was queued
        # before it began. A send racing it (another task, another thread of a SyncProducer) was taken
        # after the flush had counted its records, and went out after Complete: never acked
        self._state = _State.CLOSING
        self._wake()  # a producer waiting for records to reconnect with has none coming
        # one deadline for the whole close: the flush, then Complete and the server's end of the call
        # (each waited the whole timeout: close(1) took up to 2 s)
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        try:
            try:
                await self.flush(timeout)
                await self._complete(deadline)
                if self._error is not None:
                    raise self._error
            except (SluiceError, TimeoutError) as exc:
                if self.unacked:
                    raise UnackedRecordsError(self.unacked_records(), self._acked_seq, exc) from exc
                raise
        except BaseException as exc:
            self._close_error = exc
            # cut short (cancelled, interrupted): what it dropped is said by the next close()
            self._dropped_unsaid = not isinstance(exc, Exception)
            raise
        finally:
            await self._teardown()

    def raise_dropped(self) -> None:
        """For a close() of a producer closed already: UnackedRecordsError with the records never
        acked if the close before was cut short (cancelled: asyncio.wait_for's timeout, a task's cancel;
        interrupted) and no one was given them since (abort() returns them). That close raised no word
        of them, and a second close() returned None, as if everything was delivered."""
        if self._dropped_unsaid and self.unacked:
            cause = ProducerClosedError("the close() before was cut short (cancelled) before they were acked")
            raise UnackedRecordsError(self.unacked_records(), self._acked_seq, cause) from cause

    async def _complete(self, deadline: float | None) -> None:
        """After close()'s flush: send Complete and wait for the server to end the call, until
        `deadline` (the loop's clock; None: no limit)."""
        assert self._call is not None
        try:
            async with asyncio.timeout_at(deadline):
                with contextlib.suppress(*_CALL_ENDED):
                    async with self._write_lock:
                        await self._call.write(pb.PublishRequest(complete=pb.Complete()))
                        await self._call.done_writing()
                # the server ends the call once everything is acked
                await asyncio.shield(self._tasks[0])
        except TimeoutError:
            if self.unacked:  # pragma: no cover - the flush returned: nothing is unacked
                raise
            # every record is acked (durable): the server's end of the call is all that is missing,
            # and the teardown cancels the call (this raised a bare TimeoutError after all was acked)
            log.debug("closing: the server did not end the session in time; every record was acked")

    async def abort(self) -> list[tuple[bytes, bytes | None]]:
        """End the session now, dropping what is not acked; return those records (value, key), in order."""
        records = self.unacked_records()
        self._dropped_unsaid = False  # handed back
        await self._teardown()
        return records

    async def _teardown(self) -> None:
        self._state = _State.CLOSED
        try:
            starting = self._starting
            if starting is not None and starting is not asyncio.current_task():
                starting.cancel()  # start() raises ProducerClosedError
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                # its error is the producer's (_task_done), raised by the calls that wait: not by
                # abort(), which would hide the error of an `async with` body; a cancel of abort()'s
                # caller goes on
                with contextlib.suppress(Exception):
                    await reap(task)
            if self._call is not None:
                self._call.cancel()
            channels, self._channels = self._channels, {}
            if self._own_channel:
                for channel in channels.values():
                    await channel.close(None)
        finally:
            self._torn_down.set()  # a close() waiting on this one returns, also when it was cancelled
            self._wake()

    def __del__(self) -> None:
        if getattr(self, "_state", _State.CLOSED) is _State.OPEN:
            warnings.warn(f"Producer for {self.target} was never closed", ResourceWarning, stacklevel=1)

    # ---- sending ---------------------------------------------------------------------------------

    async def send(self, value: bytes, key: bytes | None = None) -> None:
        """Queue one record; waits while the local buffer is full (backpressure)."""
        await self._room_for(1)
        self._check_seq_room(1)
        self._append(value, key)

    async def send_many(self, values: Sequence[bytes], keys: Sequence[bytes | None] | None = None) -> None:
        """Queue many records at once; cheaper per record than send()."""
        _check_sequence(values, "values")
        if keys is not None:
            _check_sequence(keys, "keys")
        count = len(values)
        if keys is not None and len(keys) != count:
            raise ValueError(f"{len(keys)} keys for {count} values")
        self._check_open()  # no records either: a closed producer says so, as send() does
        self._check_seq_room(count)
        lengths = _value_lengths(values)
        key_total = _key_bytes(keys) if keys is not None else 0  # measured once: a whole call's too
        total = int(lengths.sum()) + key_total
        given = 0  # of total, the bytes of the pieces taken so far
        ends: npt.NDArray[np.int64] | None = None  # bytes before each record: made if the bound may cut
        start = 0
        while start < count:
            await self._room_for_more(start, count)
            end = min(count, start + self._max_buffered - self._held)
            room = self._bytes_room()
            if room < math.inf and (ends is not None or total - given > room):
                if ends is None:
                    ends = np.zeros(count + 1, dtype=np.int64)
                    np.cumsum(lengths, out=ends[1:])
                    if keys is not None:
                        ends[1:] += np.cumsum(_key_lengths(keys))
                end = _cut(ends, start, end, room)
            try:
                whole = start == 0 and end == count  # the common case: its keys are measured
                added = self._pending.extend(
                    values[start:end],
                    keys[start:end] if keys is not None else None,
                    lengths[start:end],
                    key_total if whole else None,
                    _record_limit(self._max_message),
                )
            except _OverLimit as over:
                raise _too_large(start + over.index, over.size, start, self._max_message) from None
            self._buffered_bytes += added
            given += added
            self._wake()
            start = end
            if len(self._pending) >= self._batch_size:
                # a batch is ready: let the sender take it (and start its write) before more records
                # are queued, or a caller filling a large buffer would hold the sender up meanwhile
                await asyncio.sleep(0)

    async def send_packed(
        self,
        values: Buffer,
        offsets: npt.ArrayLike,
        keys: Buffer | None = None,
        key_offsets: npt.ArrayLike | None = None,
        key_validity: npt.ArrayLike | None = None,
    ) -> None:
        """Queue records given in Arrow's binary layout: record i is values[offsets[i]:offsets[i + 1]]
        (len(offsets) - 1 records; offsets non-decreasing integers within `values`). Keys, if given,
        are laid out the same way: record i's key is keys[key_offsets[i]:key_offsets[i + 1]], and
        with `key_validity` (one bool per record) a record whose entry is False has no key; without
        keys no record has one. The cheapest way in: no Python object per record, values and keys go
        into the batch as one piece each. A `bytes` buffer is kept as it is (it cannot change), any
        other is copied once; waits while the local buffer is full, as send_many does."""
        count, data, bounds = _packed_input(values, offsets)
        key_column = _packed_keys(count, keys, key_offsets, key_validity)
        _packed_sizes_check(bounds, key_column, self._max_message)
        self._check_open()  # no records either: a closed producer says so, as send() does
        self._check_seq_room(count)
        ends: npt.NDArray[np.int64] | None = None  # bytes before each record: made if the bound may cut
        start = 0
        while start < count:
            await self._room_for_more(start, count)
            end = min(count, start + self._max_buffered - self._held)
            room = self._bytes_room()
            rest = int(bounds[count] - bounds[start])  # the rest's bytes: no array unless it may not fit
            if key_column is not None:
                rest += int(key_column.offsets[count] - key_column.offsets[start])
            if rest > room:
                if ends is None:
                    ends = bounds - bounds[0]
                    if key_column is not None:
                        ends = ends + (key_column.offsets - key_column.offsets[0])
                end = _cut(ends, start, end, room)
            chunk_keys = key_column.slice(start, end) if key_column is not None else None
            chunk = _Packed(data, bounds[start : end + 1], chunk_keys)
            self._pending.extend_packed(chunk)
            self._buffered_bytes += chunk.nbytes(end - start)
            self._wake()
            start = end
            if len(self._pending) >= self._batch_size:
                await asyncio.sleep(0)  # as in send_many: let the sender take a ready batch

    async def send_arrow(self, values: Any, keys: Any = None) -> None:
        """Queue records from a pyarrow array of binary or string values (a ChunkedArray too), one
        record per element, and their keys from a second such array of the same length (a null key:
        a record without one). Sliced arrays are fine; view, fixed-size binary and dictionary arrays are
        laid out as large_binary first (a copy); a null value is refused (a record has a value: send an
        empty one). send_packed underneath: no Python object per record."""
        count, data, offsets, present = _arrow_binary(values, "values")
        if present is not None:
            at = int(np.argmin(present))
            raise ValueError(f"values[{at}] is null: every record has a value (an empty one is fine)")
        if keys is None:
            await self.send_packed(data, offsets)
            return
        key_count, key_data, key_offsets, valid = _arrow_binary(keys, "keys")
        if key_count != count:
            raise ValueError(f"{key_count} keys for {count} values")
        await self.send_packed(data, offsets, key_data, key_offsets, valid)

    def _append(self, value: bytes, key: bytes | None) -> None:
        _check_flat(value, "value")
        if key is not None:
            _check_flat(key, "key")
        if (size := len(value) + (len(key) if key is not None else 0)) > _record_limit(self._max_message):
            raise _too_large(0, size, message_limit=self._max_message)
        self._buffered_bytes += self._pending.append(value, key)
        # the first record starts the linger clock (and an idle producer's reconnect); a full batch goes
        held = len(self._pending)
        if held == 1 or held >= self._batch_size or self._buffered_bytes >= self._batch_bytes:
            self._wake()

    @property
    def _held(self) -> int:
        """Records in memory: unsent plus sent and unacked."""
        return len(self._pending) + self._unacked_count

    def _bytes_room(self) -> float:
        """Bytes the local buffer takes before the byte bound (inf: no bound)."""
        limit = self._max_buffered_bytes
        return math.inf if limit is None else limit - self._buffered_bytes - self._unacked_bytes

    def _bytes_full(self) -> bool:
        limit = self._max_buffered_bytes
        return limit is not None and self._buffered_bytes + self._unacked_bytes >= limit

    @property
    def room(self) -> int:
        """Records the local buffer takes now without waiting; -1 before start or after close."""
        if self._state is not _State.OPEN or self._error is not None:
            return -1
        return 0 if self._bytes_full() else self._max_buffered - self._held

    def offer(self, value: bytes, key: bytes | None = None) -> None:
        """Queue one record without waiting; raise BufferError when the buffer is full (`max_buffered`
        records; the byte bound applies to send and send_many only).

        For code that manages demand itself (sluice_client.publish): it asks only for `room` records.
        """
        self._check_open()
        if self._held >= self._max_buffered:
            raise BufferError(f"producer buffer is full ({self._max_buffered} records); wait for room")
        self._check_seq_room(1)
        self._append(value, key)

    def on_room(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` whenever records leave the local buffer (acked); returns a function that
        unregisters."""
        self._room_listeners.append(callback)
        return lambda: self._room_listeners.remove(callback)

    async def _room_for_more(self, taken: int, count: int) -> None:
        """_room_for(1) within a call queuing `count` records, `taken` of them already queued: a close
        or a failure that ends the wait says how many of the call's records were taken (queued, so
        delivered by the flush or listed by close()'s UnackedRecordsError), so a caller that sends them
        elsewhere does not send those twice. `ProducerClosedError.taken` holds the count."""
        try:
            await self._room_for(1)
        except ProducerClosedError as exc:
            if not taken:
                raise
            error = ProducerClosedError(
                f"{exc}; the first {taken} of this call's {count} records were taken before it (sent "
                f"as any queued record), the other {count - taken} were not"
            )
            error.taken = taken
            raise error from exc

    async def _room_for(self, n: int) -> None:
        # every send checks the loop, also one with room that would not wait: it would queue from a
        # foreign thread, racing the sender, and wake it through an Event of another loop
        self._check_loop()
        self._check_open()
        while self._held + n > self._max_buffered or self._bytes_full():
            await self._wait_change()
            self._check_open()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every record queued so far is acked, across reconnects; FlushTimeoutError when
        `timeout` runs out (the records stay queued), or the error that failed the producer."""
        check_timeout(timeout)
        self._check_loop()
        if self._state is _State.NEW:
            raise ProducerClosedError("producer not started")
        if self._closed:  # nothing unacked or not: as every call that waits does
            raise _closed_with(self.unacked)
        target = self._sent_seq + len(self._pending)
        self._flushing += 1
        self._wake()
        try:
            async with asyncio.timeout(timeout):
                while self._acked_seq < target:
                    if self._error is not None:
                        raise self._error
                    if self._closed:  # closed meanwhile (abort, a failed close): none will come
                        raise _closed_with(target - self._acked_seq)
                    await self._wait_change()
        except TimeoutError:
            unsent = max(0, target - self._sent_seq)
            raise FlushTimeoutError(target - self._acked_seq, timeout or 0.0, unsent) from None
        finally:
            self._flushing -= 1

    @property
    def _closed(self) -> bool:
        return self._state is _State.CLOSED

    def _check_seq_room(self, count: int) -> None:
        """SequenceRangeError unless `count` more records fit below the end of the sequence range; the
        server would refuse their batch (OUT_OF_RANGE), failing the producer at flush instead."""
        following = self._sent_seq + len(self._pending)  # the seq the next queued record takes
        if following + count > _SEQ_END:
            raise SequenceRangeError(
                f"{count} more records would take sequence numbers up to {following + count - 1}: they "
                f"end at {_SEQ_END - 1} (this producer's next is {following}, room for "
                f"{_SEQ_END - following}); nothing of them was queued: go on under another producer id"
            )

    def check_open(self) -> None:
        """Raise the error the producer failed with, or ProducerClosedError unless it is open."""
        self._check_open()

    async def changed(self) -> None:
        """Return at the producer's next change: records acked or queued, credit, a failure, a close."""
        await self._wait_change()

    def _check_open(self) -> None:
        if self._error is not None:
            raise self._error
        if self._state is _State.NEW:
            raise ProducerClosedError("producer not started")  # as flush() says
        if self._state is not _State.OPEN:
            raise ProducerClosedError(f"producer is {self._state.value}")

    def _wake(self) -> None:
        self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        try:
            await self._changed.wait()
        except RuntimeError:  # asyncio's "bound to a different event loop", naming an Event
            self._check_loop()
            raise

    def _check_loop(self) -> None:
        """RuntimeError when called on another event loop than start()'s: the producer's tasks run on
        that one (and a second asyncio.run() finds them cancelled with the first's loop), so a wait
        here failed in asyncio's words, naming one of its Events, or never ended."""
        if self._loop is not None and asyncio.get_running_loop() is not self._loop:
            raise RuntimeError(
                "this Producer was started on another event loop, where its tasks run: use it on that "
                "loop only (one asyncio.run() for its whole life), or SyncProducer from other threads"
            )

    # ---- sessions --------------------------------------------------------------------------------

    async def _supervise(self, call: Call) -> None:
        """Run sessions one after the other until the producer closes or fails."""
        while True:
            failure = await self._run_session(call)
            if failure is None:
                return
            if self._state is not _State.OPEN and not self.unacked:
                return  # closing with everything acked: nothing to resend
            if self._error is not None:  # the producer failed itself (a record it cannot send)
                raise self._error
            if not reconnectable(failure, cancelled_in_band=self.cancel_reason is not None):
                self._error = failure
                raise failure
            if self._taken:
                # nothing to send or resend (the server ended an idle session): reconnect once there
                # is, rather than hold credit idle until the next idle timeout
                while not self.unacked and self._state is _State.OPEN:
                    await self._wait_change()
                if not self.unacked:
                    return
            # else no server took a session of this Producer yet (it ended UNAVAILABLE after Open: a
            # stopping server, a node not ready, a cluster that cannot tell the producer's mark): fail
            # over at once, within start_timeout, as start() waits for a first answer
            call = await self._reconnect(failure)

    async def _run_session(self, call: Call) -> RPCError | None:
        """One session: None when it ended well, the RPCError when it ended with a status."""
        sender = asyncio.create_task(self._send_loop(call), name="sluice-producer-send")
        try:
            await self._read_loop(call)
        except RPCError as exc:
            return exc
        finally:
            self._opened_at = None
            self._wake()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await reap(sender)
        if self._acked_seq < self._sent_seq and self._error is None:
            self._error = ProducerClosedError(
                f"server ended the session with {self._sent_seq - self._acked_seq} records unacked"
            )
            raise self._error
        if self._state is _State.OPEN and self._error is None:
            # a server ends a session OK only once the producer completed it (close()): ended now, the
            # producer had no session and nothing to fail it, and a flush() waited for good
            self._error = ProtocolError(
                f"server at {self.target} ended the session (status OK) before the producer completed "
                "it (not a Sluice server?)"
            )
            raise self._error
        return None

    async def _reconnect(self, failure: RPCError) -> Call:
        """Open a new session resuming at the first unacked record, trying the targets in turn from
        the one after the lost one, backing off between rounds; give up after reconnect_timeout seconds
        without a session that a server answered (start_timeout, StartTimeoutError, before any server
        took a session of this Producer)."""
        loop = asyncio.get_running_loop()
        lost = self.target
        # before any server took a session of this Producer, it is still starting: start_timeout
        # bounds it (from start() while start() waits, else from this outage)
        starting = not self._taken
        limit = self._start_timeout if starting else self._reconnect_timeout
        if self._lost_since is None:
            began = self._start_began if starting else None
            self._lost_since = loop.time() if began is None else began
            self._outage_backoff = self._reconnect_backoff
            self._outage_rounds = 0
            others = f" (then {', '.join(self._targets[i] for i in self._round(self._current + 1))})"
            log.warning(
                "session with the server at %s lost (%s: %s); reconnecting%s for up to %g s",
                lost,
                failure.status.name,
                failure.message,
                others if len(self._targets) > 1 else "",
                limit,
            )
        attempts = 0
        while True:
            elapsed = loop.time() - self._lost_since
            if elapsed >= limit:
                if starting:
                    targets = ", ".join(self._targets)
                    secure = self._credentials.secure
                    self._error = StartTimeoutError(targets, failure, attempts, elapsed, tls=secure)
                else:
                    self._error = ReconnectTimeoutError(failure, attempts, elapsed, targets=self._targets)
                raise self._error
            # back off per round of targets, not per target: a dead node is skipped at once. The first
            # round of an outage starts at once at the next node; with one target, that is the server
            # just lost, so wait first. The backoff grows over the outage, also when nodes take Open
            # and then end the session before granting credit (not ready)
            if self._outage_rounds or len(self._targets) == 1:
                pause = self._outage_backoff * random.uniform(0.5, 1.0)  # noqa: S311
                await asyncio.sleep(min(pause, limit - elapsed))
                self._outage_backoff = min(self._outage_backoff * 2, self._max_reconnect_backoff)
            self._outage_rounds += 1
            self._requeue_unacked()
            for index in self._round(self._current + 1):
                attempts += 1
                try:
                    call = await self._open_call(index)
                except RPCError as exc:
                    failure = exc
                    if not reconnectable(failure):
                        self._error = failure
                        raise
                    if loop.time() - self._lost_since >= limit:
                        break
                    continue
                self.reconnects += 1
                self.cancel_reason = None  # a new session: the old one's cancel is history
                if self.target != lost:
                    log.info(
                        "failed over from %s to %s after %.1f s; resending %d unacked records",
                        lost,
                        self.target,
                        loop.time() - self._lost_since,
                        self.unacked,
                    )
                return call

    def _requeue_unacked(self) -> None:
        """Put the sent, unacked records back in front of the unsent ones, to be sent again in order."""
        self._credit = 0
        if not self._unacked:
            return
        runs = [sent.unacked() for sent in self._unacked]
        self.resent += sum(map(len, runs))
        self._pending.prepend(runs)
        self._buffered_bytes += self._unacked_bytes
        self._sent_seq = self._acked_seq
        self._unacked.clear()
        self._unacked_count = 0
        self._unacked_bytes = 0

    async def _send_loop(self, call: Call) -> None:
        # one write in flight while the next batch is encoded: gRPC moves a message through its
        # transport in its own threads, so encoding (Python) and sending overlap instead of taking
        # turns; at most one batch waits besides the one being written
        writing: asyncio.Task[bool] | None = None
        try:
            while True:
                try:
                    request = await self._next_request()
                except (RecordTypeError, RecordTooLargeError) as exc:
                    self._fail(exc, call)
                    return
                if writing is not None and not await writing:
                    return  # the call ended; the read loop has (or will have) the status that says why
                writing = asyncio.create_task(self._write(call, request))
                await asyncio.sleep(0)  # let the write start before the next batch is encoded
        except Exception as exc:  # noqa: BLE001 - a defect: else the read loop goes on, every flush waits
            self._fail(_failure_of(exc, "send loop"), call)
        finally:
            if writing is not None and not writing.done():
                await reap(writing)

    def _fail(self, error: SluiceError, call: Call) -> None:
        """Fail the producer with `error` (what flush, send and close raise; _supervise keeps it) and
        end the session: its read loop ends, and _supervise with it."""
        if self._error is None:
            self._error = error
        self._wake()
        call.cancel()

    async def _write(self, call: Call, request: bytes) -> bool:
        """Write one message; False if the call has ended."""
        try:
            async with self._write_lock:
                await call.write(request)
        except _CALL_ENDED:
            return False
        return True

    async def _next_request(self) -> bytes:
        """The next Batch to send, serialized, taken from the pending records within the credit (its
        records count as sent from here on)."""
        while True:
            # wait for credit and a batch worth sending: full, lingered long enough, or flushing
            while not (self._credit > 0 and self._pending):
                await self._wait_change()
            small = len(self._pending) < self._batch_size and self._buffered_bytes < self._batch_bytes
            if small and not self._flushing and self._linger > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._linger):
                        while len(self._pending) < self._batch_size and not self._flushing:
                            await self._wait_change()
            n = min(self._credit, len(self._pending), self._batch_size)
            if n == 0:
                # the linger waited through a change that took the credit or the records away (a
                # failover resets the credit, a requeue moves records): wait for both again
                continue
            limit = self._max_message
            ends = self._pending.ends(n)  # the batch's byte cut and its layout
            n = _batch_cut(ends, self._batch_bytes, limit)
            ends = ends[:n]
            while True:
                run = self._pending.peek(n, ends)
                try:
                    if run.keys is not None and not isinstance(run.keys, PackedKeys):
                        # laid out here rather than by the encoder: their size is then known
                        # without another pass (max_buffered_bytes counts keys), and a resend's
                        # copy (_KeyColumn.of) finds them laid out
                        run.keys = lay_out_keys(run.keys)
                    request: bytes | None = publish_parts(self._sent_seq, run.parts, run.ends, run.keys)
                except TypeError:
                    raise _record_type_error(self._sent_seq, *self._pending.records(n), ends) from None
                except ValueError:  # over int32 offsets
                    request = None
                if request is not None and len(request) <= limit:
                    break
                if n == 1:  # no session could ever take it: resending would loop
                    size = int(ends[0]) + run.key_size(0)
                    whose = "" if limit >= DEFAULT_MAX_MESSAGE_BYTES else f" of the server at {self.target}"
                    raise RecordTooLargeError(
                        f"record {self._sent_seq} has {size} bytes of key and value: over the {limit}-byte "
                        f"message limit{whose} (a record takes at most {_record_limit(limit)}); the producer "
                        "cannot send it (its unsent records: abort() returns them)",
                        size=size,
                        limit=_record_limit(limit),
                    )
                # over the limit with its keys (or batch_bytes above it): fewer records, in proportion
                over = len(request) if request is not None else 2 * limit
                n = max(1, min(n - 1, n * limit // over))
                ends = ends[:n]
            self._pending.drop(n)
            sent = _Sent(self._sent_seq, run)
            self._unacked.append(sent)
            self._unacked_count += n
            self._unacked_bytes += sent.nbytes
            # nothing pending holds no bytes: a bytearray key changed after its send call (measured
            # then, laid out now) must not leave a count behind that blocks send() for good
            self._buffered_bytes = self._buffered_bytes - sent.nbytes if self._pending else 0
            self._credit -= n
            self._sent_seq += n
            self._ever_sent = max(self._ever_sent, self._sent_seq)
            return request

    def _acked_to(self, up_to: int) -> None:
        """Drop the records below `up_to` from memory: they are durable."""
        if up_to <= self._acked_seq:
            return
        self._acked_seq = up_to
        while self._unacked:
            head = self._unacked[0]
            end = head.first_seq + len(head)
            if end <= up_to:
                self._unacked.popleft()
                self._unacked_count -= len(head)
                self._unacked_bytes -= head.nbytes
                continue
            if head.first_seq < up_to:
                k = up_to - head.first_seq
                before = head.nbytes
                head.skip += k
                head.first_seq = up_to
                self._unacked_count -= k
                self._unacked_bytes -= before - head.nbytes
            break
        if not self._unacked:
            self._unacked_bytes = 0  # as in _next_request: no count outlives its records
        for listener in list(self._room_listeners):
            listener()

    async def _read_loop(self, call: Call) -> None:
        cancelled: grpc.StatusCode | None = None  # the code of the server's in-band Cancel, once sent
        try:
            async for response in call:
                if response is None:  # grpc's answer to bytes its deserializer could not parse
                    await self._protocol_error(
                        call, "server sent a message that is not a PublishResponse (not a Sluice server?)"
                    )
                kind = response.WhichOneof("kind")
                if kind == "request":
                    if response.request.n <= 0:
                        await self._protocol_error(
                            call, f"server sent Request(n={response.request.n}); n must be > 0 (rule 3.9)"
                        )
                    if response.request.max_message_bytes:  # 0: a server before the field (32 MiB)
                        self._max_message = min(DEFAULT_MAX_MESSAGE_BYTES, response.request.max_message_bytes)
                    if cancelled is None:  # no credit after a Cancel (rule 3.6)
                        self._credit = min(MAX_DEMAND, self._credit + response.request.n)
                        self._lost_since = None  # the server took this session: reconnected
                        self._taken = True
                elif kind == "ack":
                    if response.ack.durable_up_to > self._sent_seq:
                        await self._protocol_error(
                            call,
                            f"server acked up to {response.ack.durable_up_to}, beyond the "
                            f"{self._sent_seq} records sent",
                        )
                    self._acked_to(response.ack.durable_up_to)
                elif kind == "cancel":
                    # the server takes nothing more: stop sending; records from accepted_up_to on were
                    # not accepted and stay unacked (resent after a reconnect, if the status allows)
                    cancelled = _STATUS_BY_NUMBER.get(response.cancel.code, grpc.StatusCode.CANCELLED)
                    self.cancel_reason = response.cancel.reason or "cancelled"
                    self._credit = 0
                self._wake()
        except grpc.aio.AioRpcError as exc:
            error = RPCError.from_grpc(exc)
            if cancelled is not None and _transport_failure(error):
                # the Cancel said how the call ends; grpc.aio's client may report a write that raced
                # that end as INTERNAL "Internal error from Core" (grpc/grpc#36066), which must not turn
                # a fenced (ABORTED) or refused session into a reconnect
                error = RPCError(cancelled, self.cancel_reason or "cancelled")
            raise error from None

    async def _protocol_error(self, call: Call, message: str) -> None:
        """The server broke the contract: tell it in-band (gRPC has no client status), end, raise."""
        error = ProtocolError(message)
        self._error = error
        with contextlib.suppress(*_CALL_ENDED):
            async with self._write_lock:
                error_message = pb.Error(code=_FAILED_PRECONDITION, message=message)
                await call.write(pb.PublishRequest(error=error_message))
                await call.done_writing()
        # written is only queued: let the server end the call (briefly), so that an abort() right
        # after this raises does not cancel the message in flight
        with contextlib.suppress(*_CALL_ENDED, TimeoutError):
            await asyncio.wait_for(call.code(), _ERROR_DELIVERY)
        raise error

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() and self._state is _State.OPEN:
            # not by the teardown (it closes first): its event loop ended with the producer open, as
            # asyncio.run() does, cancelling every task, when the code returns without close()
            warn_never_closed("Producer", self.target, self.unacked)
        # a background loop that dies fails everything waiting on the producer
        exc = task.exception() if not task.cancelled() else None
        if exc is not None:
            if self._error is None:
                self._error = _failure_of(exc, "session")
            if self._call is not None:
                self._call.cancel()  # nothing reads it any more: the server may stop waiting on it
        self._wake()
