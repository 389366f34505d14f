"""Records -> a Batch message: keys and values in Arrow's binary layout, built with numpy alone.

The layout (concatenated bytes, little-endian int32 offsets from 0, and for keys a validity bitmap when
one is null) is what the receiver wraps as Arrow buffers without a Python object per record
(receivers.wire.decode_batch). The SDK builds it without pyarrow, so a client needs neither the
server's libraries nor Spark.

The Producer sends `publish_batch`: the serialized PublishRequest{batch}, byte for byte what protobuf
writes, built with one copy of the values (building a Batch, wrapping it in a PublishRequest and
serializing copied every value three more times).
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice_client.lazy_numpy import LazyNumpy
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
else:
    np = LazyNumpy(globals())

if sys.byteorder != "little":  # pragma: no cover - the wire layout is little-endian
    raise ImportError("Sluice's wire layout needs a little-endian host")

MAX_OFFSET = 2**31 - 1
"""int32 offsets: a batch holds at most this many bytes of values (and of keys)."""

MAX_PRODUCER_ID_BYTES = 256
"""Longest producer id, in UTF-8 bytes (a longer one is INVALID_ARGUMENT at Open; the Producer refuses it
at construction). The block log could hold 65535, but every block names its producers and every server
keeps up to `max_producers` of them in memory: 256 bytes bound that table to about 25 MiB at the default
100k producers, and leave room for a UUID, a host name and a path."""


def value_ends(items: Sequence[bytes]) -> npt.NDArray[np.int64]:
    """The running total of the items' lengths: item i ends at byte ends[i] of their concatenation."""
    return np.cumsum(np.fromiter(map(len, items), dtype=np.int64, count=len(items)))


_value_ends = value_ends  # publish_batch's keyword hides the function's name


@dataclass(frozen=True, slots=True)
class PackedKeys:
    """A batch's keys already in Arrow's layout (Producer.send_packed's keys): their bytes are the
    concatenation of `parts`, key i ends at byte ends[i]; where valid[i] is False record i has no key
    (and an empty span). `valid` None: every record has one."""

    parts: Sequence[bytes | memoryview]
    ends: npt.NDArray[np.int64]
    valid: npt.NDArray[np.bool_] | None = None

    def __len__(self) -> int:
        return len(self.ends)

    def size(self, i: int) -> int:
        """Bytes of key i (0 without one)."""
        return int(self.ends[i]) - (int(self.ends[i - 1]) if i else 0)


Keys = Sequence[bytes | None] | PackedKeys
"""A batch's keys: one per record (None: no key), or already laid out."""


def encode_batch(
    first_seq: int,
    values: Sequence[bytes],
    keys: Sequence[bytes | None] | None = None,
    *,
    value_ends: npt.NDArray[np.int64] | None = None,
) -> pb.Batch:
    """Pack records into a Batch message. `keys` is None when no record has a key; `value_ends`, if the
    caller has it, is value_ends(values) (saves a pass over the records)."""
    count = len(values)
    if count == 0:
        raise ValueError("a batch needs at least one record")
    data, offsets = _binary(values, "values", value_ends)
    batch = pb.Batch(first_seq=first_seq, count=count, values=data, value_offsets=offsets)
    key_fields = _key_fields(keys, count)
    if key_fields is not None:
        batch.keys, batch.key_offsets, batch.key_validity = key_fields
    return batch


def publish_batch(
    first_seq: int,
    values: Sequence[bytes],
    keys: Sequence[bytes | None] | None = None,
    *,
    value_ends: npt.NDArray[np.int64] | None = None,
) -> bytes:
    """The serialized PublishRequest{batch: encode_batch(...)} (the same bytes protobuf writes), built
    with one join of the values."""
    if len(values) == 0:
        raise ValueError("a batch needs at least one record")
    ends = _value_ends(values) if value_ends is None else value_ends
    return publish_parts(first_seq, values, ends, keys)


def publish_parts(
    first_seq: int,
    parts: Sequence[bytes | memoryview],
    ends: npt.NDArray[np.int64],
    keys: Keys | None = None,
) -> bytes:
    """publish_batch of the records whose values, concatenated, are the concatenation of `parts` (one
    part per record, or a buffer holding many: Producer.send_packed), record i ending at byte ends[i]."""
    count = len(ends)
    if count == 0:
        raise ValueError("a batch needs at least one record")
    size = int(ends[-1])
    # fields in number order, proto3 defaults (0, empty) left out, as protobuf serializes them
    head = (_varint_field(1, first_seq) if first_seq else b"") + _varint_field(2, count)
    tail = _bytes_field(4, _offsets(ends, "values"))
    key_fields = _key_fields(keys, count)
    if key_fields is not None:
        key_data, key_offsets, key_validity = key_fields
        tail += _bytes_field(5, key_data) + _bytes_field(6, key_offsets) + _bytes_field(7, key_validity)
    if size:
        head += _varint(3 << 3 | 2) + _varint(size)
    batch_size = len(head) + size + len(tail)
    prefix = _varint(2 << 3 | 2) + _varint(batch_size) + head
    data = b"".join([prefix, *parts, tail])
    if len(data) != len(prefix) + size + len(tail):  # an item that is not flat bytes (a typed memoryview)
        raise TypeError("record values must be bytes")
    return data


def serialize_request(request: pb.PublishRequest | bytes) -> bytes:
    """A Publish call's request serializer: batches go out already serialized (publish_batch), the rest
    as messages."""
    return request if isinstance(request, bytes) else request.SerializeToString()


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, data: bytes) -> bytes:
    """A length-delimited field, or nothing for empty bytes (proto3's default)."""
    return _varint(number << 3 | 2) + _varint(len(data)) + data if data else b""


def _key_fields(keys: Keys | None, count: int) -> tuple[bytes, bytes, bytes] | None:
    """(keys, key_offsets, key_validity) of a batch, or None when no record has a key."""
    if isinstance(keys, PackedKeys):
        return _packed_key_fields(keys, count)
    if keys is None:
        return None
    if len(keys) != count:
        raise ValueError(f"{len(keys)} keys for {count} values")
    return _packed_key_fields(lay_out_keys(keys), count)


def lay_out_keys(keys: Sequence[bytes | None]) -> PackedKeys:
    """Keys given one per record (None: no key), laid out: one join, lengths measured in C, and the
    nulls looked for only when there are some. TypeError for a key that is not flat bytes."""
    count = len(keys)
    nulls = keys.count(None)
    if nulls == count:
        return PackedKeys([], np.zeros(count, dtype=np.int64), np.zeros(count, dtype=bool))
    valid = None
    if nulls == 0:  # the common case of keyed records
        data, ends = b"".join(keys), value_ends(keys)  # type: ignore[arg-type] # no None among them
    else:
        # map and filter with a C predicate: no Python frame per key
        valid = np.fromiter(map(is_key, keys), dtype=bool, count=count)
        lengths = np.zeros(count, dtype=np.int64)
        lengths[valid] = np.fromiter(map(len, filter(is_key, keys)), dtype=np.int64)  # type: ignore[arg-type]
        data, ends = b"".join(filter(is_key, keys)), np.cumsum(lengths)  # type: ignore[arg-type]
    if int(ends[-1]) != len(data):  # a key that is not a flat bytes-like object (a typed memoryview)
        raise TypeError("record keys must be bytes")
    return PackedKeys([data], ends, valid)


is_key = functools.partial(operator.is_not, None)
"""k is not None, as a C call."""


def _packed_key_fields(keys: PackedKeys, count: int) -> tuple[bytes, bytes, bytes] | None:
    # Arrow's validity bitmap: bit i (least significant first) set when key i is not null
    if len(keys) != count:
        raise ValueError(f"{len(keys)} keys for {count} values")
    present = np.ones(count, dtype=bool) if keys.valid is None else keys.valid
    if not present.any():
        return None
    data = b"".join(keys.parts)
    if len(data) != int(keys.ends[-1]):  # pragma: no cover - the Producer lays them out
        raise ValueError(f"{len(data)} bytes of keys, their offsets say {int(keys.ends[-1])}")
    return data, _offsets(keys.ends, "keys"), np.packbits(present, bitorder="little").tobytes()


def _offsets(ends: npt.NDArray[np.int64], what: str) -> bytes:
    """Arrow's int32 offsets from 0 for items ending at `ends`; ValueError past MAX_OFFSET."""
    if int(ends[-1]) > MAX_OFFSET:
        raise ValueError(f"a batch holds at most {MAX_OFFSET} bytes of {what}, got {int(ends[-1])}")
    offsets = np.zeros(len(ends) + 1, dtype="<i4")
    offsets[1:] = ends
    return offsets.tobytes()


def _binary(
    items: Sequence[bytes], what: str, ends: npt.NDArray[np.int64] | None = None
) -> tuple[bytes, bytes]:
    """(data, int32 offsets from 0) of `items` in Arrow's binary layout."""
    # join + one length pass is about twice as fast as building an Arrow array from the list
    data = b"".join(items)
    ends = value_ends(items) if ends is None else ends
    if int(ends[-1]) != len(data):  # an item that is not a flat bytes-like object (a typed memoryview)
        raise TypeError(f"record {what} must be bytes")
    return data, _offsets(ends, what)
