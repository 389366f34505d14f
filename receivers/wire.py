"""Batches on the wire -> Arrow record batches, without one Python object per record; the wire's limits.
(The client encodes them: sluice_client.wire.)

A Batch carries keys and values in Arrow's binary layout (concatenated bytes plus little-endian int32
offsets), so the receiver wraps the message's bytes as Arrow buffers and validates them in C.

Every value a client sends that reaches the block log is bounded here and checked where it comes in
(Open, Batch), so a client's input can fail its own session and nothing else:

- sequence numbers: a record's seq is below SEQ_LIMIT, so a batch ends at SEQ_LIMIT at the latest;
- producer id: at most MAX_PRODUCER_ID_BYTES (sluice_client.wire) bytes of UTF-8, no NUL;
- record values and keys: int32 offsets (sluice_client.wire.MAX_OFFSET bytes per batch), under the
  server's message size limit (`ServeConfig.max_message_bytes`, enforced by gRPC: RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf.message import DecodeError

from receivers.block import BLOCK_SCHEMA, arrivals
from receivers.errors import InvalidBatch, InvalidMessage, SequenceOutOfRange
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.wire import MAX_PRODUCER_ID_BYTES  # the protocol's; the SDK checks it at construction

if sys.byteorder != "little":  # pragma: no cover - the wire layout is little-endian
    raise ImportError("Sluice's wire layout needs a little-endian host")

SEQ_LIMIT = 2**64 - 1
"""The end of the sequence range: every record's seq is below it, so first_seq + count <= SEQ_LIMIT.
The seq after a producer's last record is stored as an unsigned 64-bit field in every block's header
(its producer mark) and sent back as Ack.durable_up_to and Cancel.accepted_up_to (uint64), so it must
itself fit in 64 bits: SEQ_LIMIT = 2**64 - 1 is the largest such value. Python ints, the producer table
and released.json hold any of them; Spark never sees producer seqs."""


@dataclass(frozen=True, slots=True)
class WireBatch:
    """A PublishRequest{batch} read in place: its bytes fields are views of the message, not copies
    (protobuf's parse copies every value once more). Duck-types pb.Batch for decode_batch."""

    first_seq: int
    count: int
    values: memoryview
    value_offsets: memoryview
    keys: memoryview
    key_offsets: memoryview
    key_validity: memoryview


_EMPTY = memoryview(b"")
# Batch's fields by tag byte (number << 3 | wire type): varints with the bound of their type (uint64,
# uint32: a larger varint, which protobuf truncates, is left to protobuf), bytes fields by their slot in
# _read_batch's list
_FIRST_SEQ, _COUNT = 0x08, 0x10
_BYTES_SLOTS = {0x1A: 0, 0x22: 1, 0x2A: 2, 0x32: 3, 0x3A: 4}


class _NotPlain(Exception):
    """The message is not a batch in the plain form: protobuf parses it."""


def decode_request(data: bytes) -> pb.PublishRequest | WireBatch:
    """Parse a client message; an undecodable one (garbage, a string field that is not UTF-8) is an
    InvalidMessage, so the call ends INVALID_ARGUMENT rather than with gRPC's UNKNOWN.

    A message that is a Batch alone, each of its fields present once with its own wire type, is read in
    place (WireBatch); anything else (other kinds, unknown or repeated fields, bad lengths) is parsed
    by protobuf, so both give the same fields for every input."""
    try:
        return _read_batch(data)
    except _NotPlain:
        pass
    try:
        return pb.PublishRequest.FromString(data)
    except DecodeError as exc:
        raise InvalidMessage(f"undecodable PublishRequest of {len(data)} bytes: {exc}") from None


def _read_batch(data: bytes) -> WireBatch:
    """`data` as a WireBatch if it is one in the plain form Sluice's SDK writes, else _NotPlain.

    Read once per message on the event loop, so written for few calls: locals, not dicts, and a
    one-byte varint read in line (tags and small values)."""
    end = len(data)
    if not end or data[0] != 0x12:  # field 2 (batch), length-delimited
        raise _NotPlain
    length, at = _varint(data, 1)
    if at + length != end:  # the batch must be the whole message
        raise _NotPlain
    first_seq = count = -1  # -1: not seen
    views: list[memoryview | None] = [None, None, None, None, None]
    view = memoryview(data)
    while at < end:
        tag = data[at]
        at += 1
        if at < end and data[at] < 0x80:
            value, at = data[at], at + 1
        else:
            value, at = _varint(data, at)
        if tag == _FIRST_SEQ:
            if first_seq >= 0 or value >= 2**64:
                raise _NotPlain
            first_seq = value
        elif tag == _COUNT:
            if count >= 0 or value >= 2**32:
                raise _NotPlain
            count = value
        else:
            slot = _BYTES_SLOTS.get(tag)
            if slot is None or views[slot] is not None or at + value > end:
                raise _NotPlain
            views[slot], at = view[at : at + value], at + value
    values, value_offsets, keys, key_offsets, key_validity = views
    return WireBatch(
        first_seq=max(first_seq, 0),
        count=max(count, 0),
        values=_EMPTY if values is None else values,
        value_offsets=_EMPTY if value_offsets is None else value_offsets,
        keys=_EMPTY if keys is None else keys,
        key_offsets=_EMPTY if key_offsets is None else key_offsets,
        key_validity=_EMPTY if key_validity is None else key_validity,
    )


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and the position after it; _NotPlain if it runs past the end or over 10
    bytes."""
    value = shift = 0
    for i in range(at, min(at + 10, len(data))):
        byte = data[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, i + 1
        shift += 7
    raise _NotPlain


def check_open_flags(*, fresh: bool, resume: bool) -> None:
    """Raise InvalidMessage for an Open with both fresh and resume: a producer either starts afresh or
    continues an earlier run."""
    if fresh and resume:
        raise InvalidMessage(
            "Open.fresh and Open.resume both set: a producer either starts afresh or continues an earlier run"
        )


def check_producer_id(producer_id: str) -> None:
    """Raise InvalidMessage unless `producer_id` fits the block log (UTF-8, MAX_PRODUCER_ID_BYTES)."""
    try:
        size = len(producer_id.encode())
    except UnicodeEncodeError:  # a lone surrogate: only possible in process, protobuf checks UTF-8
        raise InvalidMessage("Open.producer_id is not valid UTF-8") from None
    if size > MAX_PRODUCER_ID_BYTES:
        raise InvalidMessage(
            f"Open.producer_id has {size} bytes of UTF-8: at most {MAX_PRODUCER_ID_BYTES} bytes"
        )
    if "\0" in producer_id:
        # an authenticated principal's ids are keyed "\0<principal>\0<id>" (producer_key): an anonymous
        # id of that form, taken before authentication was turned on, would be that principal's producer
        raise InvalidMessage("Open.producer_id must not contain NUL")


def check_seq_range(first_seq: int, count: int, what: str) -> None:
    """Raise SequenceOutOfRange unless records first_seq .. first_seq + count - 1 lie in the range."""
    if not 0 <= first_seq <= first_seq + count <= SEQ_LIMIT:
        raise SequenceOutOfRange(
            f"{what} {first_seq} with {count} records ends at {first_seq + count}: sequence numbers run "
            f"from 0 to {SEQ_LIMIT - 1}, a batch ends at {SEQ_LIMIT} at the latest"
        )


def check_record_bytes(records: pa.RecordBatch, limit: int, first_seq: int, whose: str) -> None:
    """Raise InvalidBatch naming the first record whose key + value bytes exceed `limit` (a principal's
    max_record_bytes); computed from the offsets, without a Python object per record."""
    sizes = pc.add(
        pc.fill_null(pc.binary_length(records.column("key")), 0), pc.binary_length(records.column("value"))
    )
    if pc.max(sizes).as_py() <= limit:
        return
    index = int(np.argmax(sizes.to_numpy(zero_copy_only=False) > limit))
    raise InvalidBatch(
        f"record {index} of the batch (sequence number {first_seq + index}) has {sizes[index].as_py()} "
        f"bytes of key and value: over max_record_bytes {limit} of {whose}; nothing of the batch was taken"
    )


def decode_batch(batch: pb.Batch | WireBatch, timestamp_us: int) -> pa.RecordBatch:
    """Validate a Batch and view it as a record batch with BLOCK_SCHEMA; raise InvalidBatch if malformed."""
    count = batch.count
    if count <= 0:
        raise InvalidBatch("Batch.count must be > 0")
    values = _binary_array(count, batch.value_offsets, batch.values, b"", "value")
    if values.null_count:  # pragma: no cover - no validity bitmap is passed for values
        raise InvalidBatch("values must not be null")
    if batch.key_offsets:
        keys = _binary_array(count, batch.key_offsets, batch.keys, batch.key_validity, "key")
    elif batch.keys or batch.key_validity:
        raise InvalidBatch("Batch.keys or key_validity set without key_offsets")
    else:
        keys = _no_keys(count) if count <= _SHARED_NO_KEYS else pa.nulls(count, pa.binary())
    return pa.RecordBatch.from_arrays([keys, values, arrivals(count, timestamp_us)], schema=BLOCK_SCHEMA)


_SHARED_NO_KEYS = 65_536
"""Batches of up to this many records share their all-null key column (256 KiB at most, four sizes
kept): a larger one is the client's to pay for and is freed with its batch."""


@functools.lru_cache(maxsize=4)
def _no_keys(count: int) -> pa.Array:
    """The key column of `count` records without keys: immutable, so batches of a size share one (it
    is allocated and zeroed otherwise, 4 bytes a record, for every batch)."""
    return pa.nulls(count, pa.binary())


def _binary_array(
    count: int, offsets: bytes | memoryview, data: bytes | memoryview, validity: bytes | memoryview, what: str
) -> pa.Array:
    if len(offsets) != 4 * (count + 1):
        raise InvalidBatch(
            f"Batch.{what}_offsets has {len(offsets)} bytes; count {count} needs 4 * (count + 1) = "
            f"{4 * (count + 1)}"
        )
    if validity and len(validity) < (count + 7) // 8:
        raise InvalidBatch(
            f"Batch.{what}_validity has {len(validity)} bytes; count {count} needs {(count + 7) // 8}"
        )
    try:
        array = pa.Array.from_buffers(
            pa.binary(),
            count,
            [
                pa.py_buffer(validity) if validity else None,
                # a view into a message may start anywhere: int32s get an aligned copy of their own
                pa.py_buffer(bytes(offsets) if isinstance(offsets, memoryview) else offsets),
                pa.py_buffer(data),
            ],
        )
        array.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise InvalidBatch(f"Batch.{what}s or {what}_offsets are malformed: {exc}") from exc
    first = int.from_bytes(offsets[:4], "little", signed=True)
    if first != 0:
        raise InvalidBatch(f"Batch.{what}_offsets must start at 0, got {first}")
    end = int.from_bytes(offsets[-4:], "little", signed=True)
    if end != len(data):  # bytes past the last record would be stored and counted as no record's
        raise InvalidBatch(f"Batch.{what}s has {len(data)} bytes, but its offsets end at {end}")
    if validity and array.null_count:
        # protocol.md: a record without a key has a zero-length slice (Arrow allows any for a null)
        lengths = np.diff(np.frombuffer(offsets, dtype="<i4", count=count + 1))
        present = np.unpackbits(np.frombuffer(validity, dtype=np.uint8), count=count, bitorder="little")
        holding = np.flatnonzero((present == 0) & (lengths != 0))
        if len(holding):
            raise InvalidBatch(
                f"Batch.{what}_validity says record {int(holding[0])} has no {what}, but its "
                f"{what}_offsets give it {int(lengths[holding[0]])} bytes: a missing {what} has an "
                "empty slice"
            )
    return array
