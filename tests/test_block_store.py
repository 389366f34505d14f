"""The local block store: durable Arrow files, recovery after a restart, release after commit."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from receivers.block import InvalidStreamNameError
from receivers.block_store import LocalBlockStore
from receivers.wire import decode_batch, encode_batch


def records(n: int, start: int = 0) -> pa.RecordBatch:
    return decode_batch(encode_batch(0, [f"r{i}".encode() for i in range(start, start + n)]), 0)


def test_write_read_recover_release(tmp_path: Path) -> None:
    store = LocalBlockStore(tmp_path)
    assert store.recover("s") == (0, 0)
    first, size = store.write("s", 0, 0, 3, [records(2), records(3, 2)])
    second, _ = store.write("s", 1, 5, 3, [records(4, 5)])
    assert size > 0
    assert (first.count, first.end_offset, second.first_offset, second.receiver) == (5, 5, 5, 3)
    values = [
        v for b in store.blocks("s") for batch in store.read(b) for v in batch.column("value").to_pylist()
    ]
    assert values == [f"r{i}".encode() for i in range(9)]
    # a crash mid-write leaves a temporary file: recovery removes it and continues after the last block
    (tmp_path / "s" / "000000000002_0000000000000009_1_3.tmp").write_bytes(b"partial")
    restarted = LocalBlockStore(tmp_path)
    assert restarted.recover("s") == (2, 9)
    assert not list((tmp_path / "s").glob("*.tmp"))
    assert restarted.blocks("s", from_seq=1) == [second]
    # once every block is released, a restart still continues the numbering
    assert restarted.release("s", before_seq=2) == 2
    assert restarted.blocks("s") == []
    assert LocalBlockStore(tmp_path).recover("s") == (2, 9)


def test_stream_names_are_checked(tmp_path: Path) -> None:
    store = LocalBlockStore(tmp_path)
    for bad in ["", "../etc", "a/b", ".hidden", "x" * 129]:
        with pytest.raises(InvalidStreamNameError):
            store.blocks(bad)
