"""The hand-written halves of the wire against protobuf's: the SDK's serialized batch (publish_batch) and
the receiver's in-place read of one (decode_request's WireBatch) must agree with protobuf on every input,
or a client and a server that use protobuf would see different records."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from receivers.errors import InvalidMessage
from receivers.wire import _SHARED_NO_KEYS, WireBatch, decode_batch, decode_request
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.wire import PackedKeys, encode_batch, publish_batch, publish_parts, value_ends

Drawn = tuple[int, list[bytes], list[bytes | None] | None]
"""first_seq, values, keys (None: no record has a key)"""
BATCH_FIELDS = ("first_seq", "count", "values", "value_offsets", "keys", "key_offsets", "key_validity")

records = st.lists(st.binary(max_size=300), min_size=1, max_size=40)
seqs = st.one_of(st.sampled_from([0, 1, 127, 128, 2**63, 2**64 - 2]), st.integers(0, 2**64 - 1))


@st.composite
def batches(draw: st.DrawFn) -> Drawn:
    values = draw(records)
    n = len(values)
    keys = draw(st.none() | st.lists(st.none() | st.binary(max_size=50), min_size=n, max_size=n))
    return draw(seqs), values, keys


@given(batches())
@settings(max_examples=300, deadline=None)
def test_publish_batch_is_what_protobuf_writes(batch: Drawn) -> None:
    first_seq, values, keys = batch
    expected = pb.PublishRequest(batch=encode_batch(first_seq, values, keys)).SerializeToString()
    assert publish_batch(first_seq, values, keys) == expected


def test_publish_batch_refuses_what_encode_batch_refuses() -> None:
    with pytest.raises(ValueError, match="at least one record"):
        publish_batch(0, [])
    with pytest.raises(TypeError, match="must be bytes"):
        publish_batch(0, [memoryview(b"abcd").cast("I")])  # one item, four bytes
    with pytest.raises(ValueError, match="keys for"):
        publish_batch(0, [b"a", b"b"], [b"k"])
    with pytest.raises(TypeError, match="keys must be bytes"):  # among nulls, or not
        publish_batch(0, [b"a", b"b"], [memoryview(b"abcd").cast("I"), None])
    with pytest.raises(TypeError, match="keys must be bytes"):
        publish_batch(0, [b"a", b"b"], [memoryview(b"abcd").cast("I"), b"k"])


@given(batches(), st.integers(1, 5))
@settings(max_examples=300, deadline=None)
def test_keys_reach_the_receiver_as_sent_one_by_one_or_laid_out(batch: Drawn, pieces: int) -> None:
    """Keys given one per record and the same keys laid out (PackedKeys, in `pieces` parts) are the same
    bytes on the wire, and the receiver reads back each key, empty ones and nulls apart."""
    first_seq, values, keys = batch
    ends = value_ends(values)
    sent = publish_parts(first_seq, values, ends, keys)
    got = decode_batch(decode_request(sent), 0)
    assert got.column("key").to_pylist() == (keys if keys is not None else [None] * len(values))
    if keys is None:
        return
    flat = [k if k is not None else b"" for k in keys]
    data = b"".join(flat)
    cuts = sorted({0, len(data), *(len(data) * i // pieces for i in range(pieces))})
    laid_out = PackedKeys(
        [memoryview(data)[a:b] for a, b in itertools.pairwise(cuts)],
        value_ends(flat),
        np.array([k is not None for k in keys]),
    )
    assert publish_parts(first_seq, values, ends, laid_out) == sent


def _same_as_protobuf(data: bytes) -> None:
    """decode_request(data) gives what protobuf parses, or fails as it does."""
    try:
        expected = pb.PublishRequest.FromString(data)
    except Exception:  # any refusal: the fast path must refuse too
        with pytest.raises(InvalidMessage):
            decode_request(data)
        return
    got = decode_request(data)
    if isinstance(got, WireBatch):
        assert expected.WhichOneof("kind") == "batch"
        for name in BATCH_FIELDS:
            value = getattr(got, name)
            assert (bytes(value) if isinstance(value, memoryview) else value) == getattr(expected.batch, name)
    else:
        assert got == expected


@given(batches())
@settings(max_examples=200, deadline=None)
def test_a_plain_batch_is_read_in_place(batch: Drawn) -> None:
    first_seq, values, keys = batch
    data = publish_batch(first_seq, values, keys)
    got = decode_request(data)
    assert isinstance(got, WireBatch)
    _same_as_protobuf(data)
    decoded = decode_batch(got, 7)
    assert decoded.column("value").to_pylist() == values
    if keys is not None:
        assert decoded.column("key").to_pylist() == keys


@given(batches(), st.data())
@settings(max_examples=500, deadline=None)
def test_any_change_to_a_batch_reads_as_protobuf_reads_it(batch: Drawn, data: st.DataObject) -> None:
    """Bytes flipped, cut, inserted, or fields appended (repeated, unknown, other kinds)."""
    message = bytearray(publish_batch(*batch))
    for _ in range(data.draw(st.integers(1, 3))):
        how = data.draw(st.sampled_from(["flip", "cut", "insert", "append"]))
        at = data.draw(st.integers(0, len(message)))
        if how == "flip" and at < len(message):
            message[at] = data.draw(st.integers(0, 255))
        elif how == "cut":
            del message[at:]
        elif how == "insert":
            message[at:at] = data.draw(st.binary(min_size=1, max_size=12))
        else:
            extra = data.draw(
                st.sampled_from(
                    [
                        b"\x08\x05",  # a top-level varint field 1: the wrong wire type for Open
                        b"\x1a\x00",  # Complete after the batch: the oneof's last one wins
                        b"\x12\x02\x10\x03",  # a second batch: merged into the first
                        b"\x12\x03\x78\x01\x00",  # a batch with an unknown field 15
                    ]
                )
            )
            message += extra
    _same_as_protobuf(bytes(message))


@given(st.binary(max_size=64))
@settings(max_examples=500, deadline=None)
def test_garbage_reads_as_protobuf_reads_it(data: bytes) -> None:
    _same_as_protobuf(data)


def test_field_values_at_their_limits() -> None:
    """A count over uint32 or a seq over uint64 is left to protobuf (which truncates): the same fields."""
    for raw in (
        b"\x12\x0b\x10" + b"\xff" * 9 + b"\x01",  # count: a 10-byte varint
        b"\x12\x0b\x08" + b"\xff" * 9 + b"\x7f",  # first_seq beyond 2**64
        b"\x12\x06\x10\x80\x80\x80\x80\x10",  # count = 2**32
        b"\x12\x03\x10\x80\x00",  # count 0 in a non-minimal varint
        b"\x12\x00",  # an empty batch
    ):
        _same_as_protobuf(raw)


def test_batches_without_keys_share_a_key_column_up_to_a_bound() -> None:
    """The all-null key column is shared by batches of a size (not allocated per message), but never
    for a batch large enough that keeping its column would pin memory a client chose to spend."""
    small = [decode_batch(decode_request(publish_batch(i * 10, [b"v"] * 10)), 1) for i in range(2)]
    assert small[0].column("key").buffers()[1].address == small[1].column("key").buffers()[1].address
    assert small[0].column("key").null_count == 10
    count = _SHARED_NO_KEYS + 1
    large = [decode_batch(decode_request(publish_batch(0, [b""] * count)), 1) for _ in range(2)]
    assert large[0].column("key").null_count == count
    assert large[0].column("key").buffers()[1].address != large[1].column("key").buffers()[1].address


def test_bytes_past_the_last_offset_and_a_missing_key_with_bytes_are_refused() -> None:
    """protocol.md: values end where the offsets say, and a record without a key has an empty slice;
    both were taken (bytes past the end were stored and counted as no record's)."""
    from receivers.errors import InvalidBatch

    offsets = np.array([0, 1, 3], dtype="<i4").tobytes()
    longer = pb.Batch(first_seq=0, count=2, values=b"abcXX", value_offsets=offsets)
    with pytest.raises(InvalidBatch, match=r"Batch\.values has 5 bytes, but its offsets end at 3"):
        decode_batch(longer, 0)
    keyed = pb.Batch(
        first_seq=0,
        count=2,
        values=b"abc",
        value_offsets=offsets,
        keys=b"kzz",
        key_offsets=np.array([0, 1, 3], dtype="<i4").tobytes(),
        key_validity=bytes([0b01]),  # record 1 has no key, yet 2 bytes
    )
    with pytest.raises(InvalidBatch, match="says record 1 has no key, but its key_offsets give it 2 bytes"):
        decode_batch(keyed, 0)
    keyed.keys, keyed.key_offsets = b"k", np.array([0, 1, 1], dtype="<i4").tobytes()
    assert decode_batch(keyed, 0).column("key").to_pylist() == [b"k", None]


def test_the_ingest_path_does_not_import_pandas(tmp_path: Path) -> None:
    """pyarrow imports pandas on the first pa.array() from a list, half a second or more: a server's
    first message waited for it. A server without Spark takes, stores and acks records without it."""
    script = f"""
import asyncio, sys
from pathlib import Path
from sluice_client import Producer
from tests.support import running_server

async def main() -> None:
    async with running_server(Path({str(tmp_path)!r})) as server:
        async with Producer(server.target, "s") as producer:
            await producer.send_many([b"a", b"bc"] * 1000)
            await producer.flush(timeout=60)
    print("pandas" in sys.modules)

asyncio.run(main())
"""
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
