"""`sluice push`'s input reader: the records it hands on are the input's lines, whatever the chunking."""

from __future__ import annotations

import asyncio
import io
import itertools
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.input_lines import InputLines, _gather


def expected(text: bytes) -> list[bytes]:
    """A line ends at a newline (not part of it); a last line without one is a record too."""
    lines = text.split(b"\n")
    return lines[:-1] if lines[-1] == b"" else lines


def read_all(text: bytes, chunk: int, skip: int = 0) -> tuple[list[bytes], InputLines, bool]:
    reader = InputLines(io.BytesIO(text))
    reader.CHUNK_BYTES = chunk  # small chunks: lines cross them

    async def go() -> tuple[list[bytes], bool]:
        enough = await reader.skip(skip)
        records: list[bytes] = []
        while (lines := await reader.next_lines()) is not None:
            bounds = lines.offsets.tolist()
            records += [lines.data[a:b] for a, b in itertools.pairwise(bounds)]
        return records, enough

    records, enough = asyncio.run(go())
    return records, reader, enough


# lines from a small alphabet, so that newlines, carriage returns and empty lines are common
TEXT = st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\r\n", b"\n\n", b"x" * 40]), max_size=60).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(TEXT, st.integers(1, 50), st.integers(0, 70))
def test_records_are_the_lines_for_any_chunking(text: bytes, chunk: int, skip: int) -> None:
    records, reader, enough = read_all(text, chunk, skip)
    lines = expected(text)
    assert enough == (skip <= len(lines))
    if enough:
        assert records == lines[skip:]
        assert reader.records == len(lines) - skip
        assert reader.skipped == skip
    assert reader.ended
    assert reader.done_bytes == len(text)


def test_a_line_longer_than_many_chunks_is_one_record() -> None:
    long = b"y" * 10_000
    records, _, _ = read_all(b"a\n" + long + b"\nb", chunk=7)
    assert records == [b"a", long, b"b"]


def test_empty_input_has_no_records() -> None:
    records, reader, enough = read_all(b"", chunk=4)
    assert (records, reader.records, enough) == ([], 0, True)
    assert read_all(b"", chunk=4, skip=1)[2] is False


def cut_by_hand(line: bytes, separator: bytes) -> tuple[bytes | None, bytes]:
    """`sluice push --key-separator`: the key before the first separator, the value after; no separator,
    no key."""
    at = line.find(separator)
    return (None, line) if at < 0 else (line[:at], line[at + len(separator) :])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([b"a", b"ab", b"b", b"\t", b":", b"\n", b"aab", b""]), max_size=40).map(
        b"".join
    ),
    st.sampled_from([b"\t", b":", b"a", b"ab", b"aa", b"ba", b"aab", b"\t:"]),
    st.integers(1, 30),
    st.integers(0, 5),
)
def test_keyed_lines_are_cut_at_the_first_separator(
    text: bytes, separator: bytes, chunk: int, skip: int
) -> None:
    """Whatever the chunking: every line's key and value as cut by hand, separators that overlap
    themselves (aa in aaa) or would run across two lines (lines are back to back) included."""
    reader = InputLines(io.BytesIO(text))
    reader.CHUNK_BYTES = chunk

    async def go() -> list[tuple[bytes | None, bytes]]:
        await reader.skip(skip)
        records: list[tuple[bytes | None, bytes]] = []
        while (lines := await reader.next_lines()) is not None:
            cut = lines.keyed(separator)
            values = [cut.values[a:b] for a, b in itertools.pairwise(cut.value_offsets.tolist())]
            keys = [cut.keys[a:b] for a, b in itertools.pairwise(cut.key_offsets.tolist())]
            valid = cut.key_validity.tolist()
            assert all(keys[i] == b"" for i in range(len(keys)) if not valid[i])  # a null's span is empty
            records += [(k if v else None, value) for k, v, value in zip(keys, valid, values, strict=True)]
        return records

    assert asyncio.run(go()) == [cut_by_hand(line, separator) for line in expected(text)[skip:]]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2_000).map(lambda b: b * 3), st.lists(st.integers(0, 6_000), max_size=30))
def test_gathered_ranges_are_the_ranges_back_to_back(data: bytes, cuts: list[int]) -> None:
    """Ranges in order and apart, mostly long (values) or mostly short (keys), or long with long gaps,
    empty ones among them: every way of gathering gives the bytes by hand."""
    bounds = sorted(min(c, len(data)) for c in cuts)
    pairs = list(zip(bounds[::2], bounds[1::2], strict=False))
    starts = np.array([a for a, _ in pairs], dtype=np.int64)
    ends = np.array([b for _, b in pairs], dtype=np.int64)
    assert _gather(np.frombuffer(data, np.uint8), starts, ends) == b"".join(data[a:b] for a, b in pairs)


def test_lines_from_a_pipe_come_as_they_arrive() -> None:
    """`tail -f log | sluice push -` sent nothing: each read waited for a whole 1 MiB chunk or the end."""
    import os

    read_end, write_end = os.pipe()

    async def go() -> list[list[bytes]]:
        got = []
        with os.fdopen(read_end, "rb") as source:
            lines = InputLines(source)
            os.write(write_end, b"1\n2\n")
            first = await asyncio.wait_for(lines.next_lines(), 10)  # the writer is still open
            assert first is not None
            got.append(records(first))
            os.write(write_end, b"3\n")
            os.close(write_end)
            while (more := await asyncio.wait_for(lines.next_lines(), 10)) is not None:
                got.append(records(more))
        return got

    def records(lines: Any) -> list[bytes]:
        bounds = lines.offsets.tolist()
        return [lines.data[a:b] for a, b in itertools.pairwise(bounds)]

    got = asyncio.run(go())
    assert got[0] == [b"1", b"2"]
    assert list(itertools.chain(*got)) == [b"1", b"2", b"3"]
