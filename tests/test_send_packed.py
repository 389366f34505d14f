"""Producer.send_packed: records handed over as one buffer and Arrow offsets, over real gRPC on loopback,
in order with records sent one by one, checked at the door."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import running_server

from ingest.server import SluiceServer
from sluice_client import Producer, SyncProducer
from sluice_client.errors import RecordTooLargeError
from sluice_client.producer import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_RECORD_BYTES,
    _KeyColumn,
    _Packed,
    _Pending,
    _Sent,
)
from sluice_client.wire import Keys, PackedKeys, lay_out_keys


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    async with running_server(tmp_path, "events", buffer_records=10_000, prefetch=1_000) as srv:
        yield srv


def rows(server: SluiceServer) -> list[tuple[bytes | None, bytes]]:
    store = server.store
    return [
        (row["key"], row["value"])
        for block in store.blocks("events")
        for batch in store.read(block)
        for row in batch.to_pylist()
    ]


def packed(values: list[bytes], start: int = 0) -> tuple[bytes, list[int]]:
    """`values` in Arrow's layout, after `start` bytes of something else."""
    offsets = [start]
    for value in values:
        offsets.append(offsets[-1] + len(value))
    return b"#" * start + b"".join(values), offsets


async def test_packed_records_are_stored_in_order_with_the_others(server: SluiceServer) -> None:
    """Batches (of 7 here) take records across the runs of each call, keyed and packed alike."""
    expected: list[tuple[bytes | None, bytes]] = []
    async with Producer(server.target, "events", batch_size=7, linger=0.001) as producer:
        for round_ in range(20):
            await producer.send(f"one-{round_}".encode(), key=b"k")
            expected.append((b"k", f"one-{round_}".encode()))
            values = [f"p{round_}-{i}".encode() * (i % 3) for i in range(round_ + 1)]  # some empty
            data, offsets = packed(values, start=round_ % 4)
            await producer.send_packed(data, np.asarray(offsets, dtype=np.int32) if round_ % 2 else offsets)
            expected += [(None, v) for v in values]
            listed = [f"m{round_}-{i}".encode() for i in range(3)]
            await producer.send_many(listed, keys=[None, b"x", None])
            expected += list(zip([None, b"x", None], listed, strict=True))
        await producer.flush(timeout=10)
        assert producer.acked == len(expected)
    assert rows(server) == expected


def packed_keys(keys: list[bytes | None], start: int = 0, junk: bytes = b"") -> dict[str, object]:
    """send_packed's key arguments for `keys` (None: no key), after `start` bytes of something else;
    a null's span holds `junk` (Arrow allows bytes there)."""
    data, offsets = packed([k if k is not None else junk for k in keys], start)
    return {"keys": data, "key_offsets": offsets, "key_validity": np.array([k is not None for k in keys])}


def listed(keys: Keys | None, n: int) -> list[bytes | None]:
    """A batch's keys one per record, whichever form the Producer laid them out in."""
    if keys is None:
        return [None] * n
    if not isinstance(keys, PackedKeys):
        return list(keys)
    data, ends = b"".join(keys.parts), [0, *keys.ends.tolist()]
    valid = keys.valid.tolist() if keys.valid is not None else [True] * n
    assert len(ends) == n + 1
    assert all(ends[i] == ends[i + 1] for i in range(n) if not valid[i])  # a null's span is empty
    return [data[ends[i] : ends[i + 1]] if valid[i] else None for i in range(n)]


async def test_packed_keys_are_stored_with_their_records(server: SluiceServer) -> None:
    """Keys laid out beside the values: empty keys stay empty, a False in key_validity is no key even
    where its span holds bytes, and batches spanning packed, listed and unkeyed calls keep every key."""
    expected: list[tuple[bytes | None, bytes]] = []
    async with Producer(server.target, "events", batch_size=5, linger=0.001) as producer:
        for round_ in range(12):
            values = [f"v{round_}-{i}".encode() for i in range(round_ + 1)]
            keys = [None if i % 4 == 1 else f"k{round_}-{i}".encode() * (i % 3) for i in range(round_ + 1)]
            data, offsets = packed(values, start=round_ % 3)
            if round_ % 3 == 0:  # every record has a key: no validity given
                keys = [k if k is not None else b"" for k in keys]
                data_keys, key_offsets = packed(keys, start=1)  # type: ignore[arg-type]
                await producer.send_packed(data, offsets, data_keys, np.array(key_offsets, dtype=np.uint32))
            else:
                await producer.send_packed(
                    data, offsets, **packed_keys(keys, round_ % 2, b"junk" * (round_ % 2))
                )
            expected += list(zip(keys, values, strict=True))
            await producer.send_packed(*packed([b"plain"]))
            expected.append((None, b"plain"))
            if round_ % 4 == 3:
                await producer.send(b"listed", key=b"lk")
                expected.append((b"lk", b"listed"))
        await producer.flush(timeout=10)
    assert rows(server) == expected


async def test_keys_from_an_arrow_arrays_buffers(server: SluiceServer) -> None:
    keys = pa.array([b"k1", None, b"", b"k4"], pa.binary())
    _, offsets, data = keys.buffers()
    async with Producer(server.target, "events", linger=0) as producer:
        validity = keys.is_valid().to_numpy(zero_copy_only=False)
        await producer.send_packed(b"abcd", [0, 1, 2, 3, 4], data, np.frombuffer(offsets, np.int32), validity)
        await producer.flush(timeout=10)
    assert rows(server) == [(b"k1", b"a"), (None, b"b"), (b"", b"c"), (b"k4", b"d")]


async def test_send_arrow_reads_sliced_chunked_and_large_arrays(server: SluiceServer) -> None:
    """send_arrow reads each array where its slice starts (an offset into shared buffers), of every
    binary and string type, chunked or not; null keys are records without a key."""
    values = pa.array([b"skip", b"a", b"bb", b"", b"dddd", b"tail"], pa.binary())
    keys = pa.array(["x", "k1", None, "", "k4", "y"], pa.large_string())
    async with Producer(server.target, "events", linger=0) as producer:
        await producer.send_arrow(values.slice(1, 4), keys.slice(1, 4))
        await producer.send_arrow(pa.chunked_array([pa.array(["e"]), pa.array(["ff", "g"])]))
        chunked_keys = pa.chunked_array([pa.array([None, b"ki"], pa.binary())])
        await producer.send_arrow(pa.array([b"h", b"i"], pa.large_binary()), chunked_keys)
        await producer.send_arrow(pa.array([], pa.binary()), pa.array([], pa.binary()))
        await producer.flush(timeout=10)
    assert rows(server) == [
        (b"k1", b"a"),
        (None, b"bb"),
        (b"", b""),
        (b"k4", b"dddd"),
        (None, b"e"),
        (None, b"ff"),
        (None, b"g"),
        (None, b"h"),
        (b"ki", b"i"),
    ]
    sync = await asyncio.to_thread(SyncProducer, server.target, "events", linger=0)
    try:
        await asyncio.to_thread(sync.send_arrow, pa.array([b"j"]), pa.array([b"kj"]))
        await asyncio.to_thread(sync.flush, 10)
    finally:
        await asyncio.to_thread(sync.close, 10)
    assert rows(server)[-1] == (b"kj", b"j")


async def test_send_arrow_lays_out_view_fixed_size_and_dictionary_arrays(server: SluiceServer) -> None:
    """Arrays without an offsets buffer (views, fixed-size binary, dictionaries of strings) are sent as
    their values, sliced where their slice starts, nulls kept as null keys."""
    views = pa.array(["skip", "a long value past twelve bytes", "b", None], pa.string_view())
    async with Producer(server.target, "events", linger=0) as producer:
        await producer.send_arrow(views.slice(1, 2), pa.array([b"k1", None], pa.binary_view()))
        await producer.send_arrow(pa.array([b"ab", b"cd", b"ef"], pa.binary(2)).slice(1))
        keys = pa.array(["x", None, "x"]).dictionary_encode()
        await producer.send_arrow(pa.array(["v", "w", "v"]).dictionary_encode(), keys)
        await producer.flush(timeout=10)
    assert rows(server) == [
        (b"k1", b"a long value past twelve bytes"),
        (None, b"b"),
        (None, b"cd"),
        (None, b"ef"),
        (b"x", b"v"),
        (None, b"w"),
        (b"x", b"v"),
    ]


@pytest.mark.parametrize(
    ("values", "keys", "error", "message"),
    [
        (pa.array([b"a", None, b"c"]).slice(1), None, ValueError, r"values\[0\] is null"),
        (pa.array([1, 2]), None, TypeError, "values must be a pyarrow binary or string array, not int64"),
        ([b"a"], None, TypeError, "not list"),
        (pa.scalar(b"a", pa.binary_view()), None, TypeError, "not BinaryViewScalar"),
        (pa.array([b"a"]), pa.array([b"k", b"l"]), ValueError, "2 keys for 1 values"),
        (pa.array([b"a"]), pa.array([7]), TypeError, "keys must be a pyarrow binary or string array"),
        (pa.array([b"a"]), pa.array([7]).dictionary_encode(), TypeError, "keys must be a pyarrow binary"),
        (pa.array([b"a"]), pa.array([1.5], pa.float64()), TypeError, "keys must be a pyarrow binary"),
    ],
)
async def test_send_arrow_refuses_what_it_cannot_send(
    server: SluiceServer, values: object, keys: object, error: type[Exception], message: str
) -> None:
    async with Producer(server.target, "events", linger=0) as producer:
        with pytest.raises(error, match=message):
            await producer.send_arrow(values, keys)
        await producer.send_arrow(pa.array([b"ok"]))
        await producer.flush(timeout=10)
    assert rows(server) == [(None, b"ok")]


async def test_a_batch_of_packed_keys_none_of_them_set_sends_no_keys(server: SluiceServer) -> None:
    async with Producer(server.target, "events", linger=0) as producer:
        await producer.send_packed(b"ab", [0, 1, 2], b"xy", [0, 1, 2], [False, False])
        await producer.send_packed(bytearray(b"cd"), [0, 1, 2], bytearray(b"k"), [0, 0, 1])
        await producer.flush(timeout=10)
    assert rows(server) == [(None, b"a"), (None, b"b"), (b"", b"c"), (b"k", b"d")]


async def test_a_mutable_buffer_is_copied_at_the_call(server: SluiceServer) -> None:
    data = bytearray(b"aaabbb")
    view = np.frombuffer(b"cccddd", dtype=np.uint8)
    async with Producer(server.target, "events", linger=0.5) as producer:  # still unsent below
        await producer.send_packed(data, [0, 3, 6])
        await producer.send_packed(view, [3, 6])
        data[:] = b"zzzzzz"
        await producer.flush(timeout=10)
    assert [v for _, v in rows(server)] == [b"aaa", b"bbb", b"ddd"]


@pytest.mark.parametrize(
    ("values", "offsets", "error", "message"),
    [
        (b"abc", [0, 2, 1], ValueError, r"must not decrease: offsets\[1\] > offsets\[2\]"),
        (b"abc", [0, 4], ValueError, "within the 3 bytes of values, got 0..4"),
        (b"abc", [-1, 2], ValueError, "within the 3 bytes of values, got -1..2"),
        (b"abc", [], ValueError, "one-dimensional sequence of records \\+ 1 integers"),
        (b"abc", [[0, 1], [1, 2]], ValueError, "one-dimensional"),
        (b"abc", [0.0, 1.5], TypeError, "offsets must be integers, got float64"),
        (b"abc", np.array([0, 2**63], dtype=np.uint64), ValueError, "within the 3 bytes"),
        ("abc", [0, 3], TypeError, "contiguous bytes-like object, not str"),
        (memoryview(b"abcdef")[::2], [0, 1], TypeError, "contiguous bytes-like object, not memoryview"),
        (b"ab", {"keys": b"k"}, ValueError, "keys and key_offsets go together"),
        (b"ab", {"key_offsets": [0, 1, 1]}, ValueError, "keys and key_offsets go together"),
        (b"ab", {"key_validity": [True, True]}, ValueError, "key_validity needs keys and key_offsets"),
        (b"ab", {"keys": b"k", "key_offsets": [0, 1]}, ValueError, "gives 1 keys for 2 records"),
        (b"ab", {"keys": b"kk", "key_offsets": [0, 2, 1]}, ValueError, r"key_offsets\[1\] > key_offsets"),
        (b"ab", {"keys": b"k", "key_offsets": [0, 1, 2]}, ValueError, "within the 1 bytes of keys"),
        (b"ab", {"keys": "k", "key_offsets": [0, 1, 1]}, TypeError, "keys must be a contiguous"),
        (b"ab", {"keys": b"k", "key_offsets": [0, 0.5, 1]}, TypeError, "key_offsets must be integers"),
        (b"ab", {"keys": b"k", "key_offsets": [0, 1, 1], "key_validity": [1, 0]}, TypeError, "booleans"),
        (b"ab", {"keys": b"k", "key_offsets": [0, 1, 1], "key_validity": [True]}, ValueError, "one boolean"),
    ],
)
async def test_packed_input_is_checked_at_the_call(
    server: SluiceServer, values: object, offsets: object, error: type[Exception], message: str
) -> None:
    """A bad call raises at once and queues nothing: the producer goes on."""
    async with Producer(server.target, "events", linger=0) as producer:
        with pytest.raises(error, match=message):
            if isinstance(offsets, dict):  # key arguments, with two records' values
                await producer.send_packed(values, [0, 1, 2], **offsets)  # type: ignore[arg-type]
            else:
                await producer.send_packed(values, offsets)  # type: ignore[arg-type]
        await producer.send_packed(b"ok", [0, 2])
        await producer.send_packed(b"", [0])  # no records: nothing to do
        await producer.flush(timeout=10)
        assert producer.acked == 1
    assert [v for _, v in rows(server)] == [b"ok"]


async def test_a_packed_record_over_the_message_limit_is_refused_when_given(server: SluiceServer) -> None:
    big = DEFAULT_MAX_MESSAGE_BYTES + 1
    async with Producer(server.target, "events", linger=0) as producer:
        await producer.send_packed(b"a", [0, 1])
        with pytest.raises(
            RecordTooLargeError, match=f"record 1 of the call has {big + 2} bytes of key and value"
        ):
            await producer.send_packed(b"c" + b"b" * big, [0, 1, big + 1], b"kkk", [0, 1, 3])
        # the key counts: a value under the limit with a key that takes it over
        value = MAX_RECORD_BYTES - 1
        with pytest.raises(RecordTooLargeError, match="record 0 of the call"):
            await producer.send_packed(b"v" * value, [0, value], b"kk", [0, 2])
        await producer.send_packed(b"v" * value, [0, value], b"k", [0, 1])  # exactly at the limit
        await producer.flush(timeout=60)
    assert [len(v) for _, v in rows(server)] == [1, value]


async def test_a_large_buffer_waits_for_room_in_pieces(server: SluiceServer) -> None:
    """A call with more records than max_buffered is taken in pieces as room frees up, without copies
    of the caller's bytes."""
    values = [i.to_bytes(4, "little") for i in range(50_000)]
    data, offsets = packed(values)
    async with Producer(server.target, "events", max_buffered=4_096, batch_size=512) as producer:
        await producer.send_packed(data, offsets)
        await producer.flush(timeout=30)
    assert [v for _, v in rows(server)] == values


async def test_the_sync_producer_sends_packed(server: SluiceServer) -> None:
    def push() -> None:  # in a thread of its own: the server's loop runs on here
        with SyncProducer(server.target, "events") as producer:
            producer.send_packed(b"onetwo", [0, 3, 6])
            producer.send_packed(b"three", [0, 5], b"k3", [0, 2])
            producer.flush(timeout=10)

    await asyncio.to_thread(push)
    assert rows(server) == [(None, b"one"), (None, b"two"), (b"k3", b"three")]


OPS = ["one", "many", "packed", "take", "ack", "requeue"]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["one", "many", "packed", "packed-keys", "take", "ack", "requeue"]),
            st.integers(0, 9),
        )
    )
)
def test_pending_records_keep_their_order_across_runs(ops: list[tuple[str, int]]) -> None:
    """The Producer's queues (_Pending of runs, _Sent batches) against a plain list: records taken in
    batches across runs, partly acked, put back in front, come out as they went in; and the bytes they
    count (values and keys: what max_buffered_bytes bounds) are the model's, however they moved."""
    pending, unacked = _Pending(), []
    held = 0  # bytes pending, as the Producer counts them (_buffered_bytes)

    def size(records: list[tuple[bytes, bytes | None]]) -> int:
        return sum(len(v) + len(k or b"") for v, k in records)

    model: list[tuple[bytes, bytes | None]] = []  # pending, in order
    sent_model: list[tuple[bytes, bytes | None]] = []  # sent, not acked, in order
    counter = 0

    def fresh(n: int) -> list[bytes]:
        nonlocal counter
        counter += n
        return [f"v{counter - n + i}".encode() * (i % 3) for i in range(n)]

    for op, n in ops:
        if op == "one":
            value = fresh(1)[0]
            key = f"k{counter}".encode() if n % 2 else None
            held += pending.append(value, key)
            model.append((value, key))
        elif op == "many":
            values = fresh(n)
            many_keys = [None if i % 2 else b"key" * i for i in range(n)] if n % 2 else None
            held += pending.extend(values, many_keys)
            model += list(zip(values, many_keys or [None] * n, strict=True))
        elif op == "packed":
            values = fresh(n)
            data, offsets = packed(values, start=n % 3)
            chunk = _Packed(data, np.asarray(offsets, dtype=np.int64))
            held += chunk.nbytes(n)
            pending.extend_packed(chunk)
            model += [(v, None) for v in values]
        elif op == "packed-keys":
            values = fresh(n)
            data, offsets = packed(values, start=n % 3)
            keys: list[bytes | None] = [
                None if (counter + i) % 3 == 0 else v[:2] for i, v in enumerate(values)
            ]
            key_data, key_offsets = packed([k or b"" for k in keys], start=n % 2)
            valid = np.array([k is not None for k in keys]) if n % 4 else None  # None: every key set
            if valid is None:
                keys = [k or b"" for k in keys]
            column = _KeyColumn(key_data, np.asarray(key_offsets, dtype=np.int64), valid)
            chunk = _Packed(data, np.asarray(offsets, dtype=np.int64), column)
            held += chunk.nbytes(n)
            pending.extend_packed(chunk)
            model += list(zip(values, keys, strict=True))
        elif op == "take" and len(pending):
            k = min(len(pending), n + 1)
            run = pending.peek(k)
            assert b"".join(run.parts) == b"".join(v for v, _ in model[:k])
            assert list(run.ends) == list(itertools.accumulate(len(v) for v, _ in model[:k]))
            assert listed(run.keys, k) == [key for _, key in model[:k]]
            if run.keys is not None and not isinstance(run.keys, PackedKeys) and n % 2:
                run.keys = lay_out_keys(run.keys)  # as the Producer does before it sends them
            pending.drop(k)
            unacked.append(_Sent(0, run))
            assert unacked[-1].nbytes == size(model[:k])
            held -= unacked[-1].nbytes
            sent_model += model[:k]
            del model[:k]
        elif op == "ack" and unacked:
            head = unacked[0]
            k = min(len(head), n)
            before = head.nbytes
            head.skip += k
            assert before - head.nbytes == size(sent_model[:k])
            del sent_model[:k]
            if not len(head):
                unacked.pop(0)
        elif op == "requeue":
            held += sum(sent.nbytes for sent in unacked)
            pending.prepend([sent.unacked() for sent in unacked])
            model = sent_model + model
            unacked, sent_model = [], []
        assert len(pending) == len(model)
        assert held == size(model)
        assert sum(sent.nbytes for sent in unacked) == size(sent_model)
        values, keys = pending.records(len(pending))
        assert list(zip(values, keys or [None] * len(values), strict=True)) == model
