"""A log's span (BlockStore.span, receivers.block.LogSpan): its first offset, its end and its gaps,
which count its records (a stream's backlog, a completed batch's backlog, the source's batch cap)
without listing every block. It must give what the one definition of a gap gives on the blocks
(receivers.block.gaps, records_between): real logs with real gaps (a segment lost under --fsync off, a
lost.json range under --accept-wal-damage, a copy gone on after a gap), released prefixes, empty
logs, lo and hi at and around every edge and past the end."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_wal import fill, records, rolled

from receivers.block import BlockInfo, LogSpan, gaps, records_between, span_of
from receivers.config import FsyncPolicy
from receivers.wal import WalBlockStore

OFF = FsyncPolicy.off()


class Counting(WalBlockStore):
    """A real store that counts how often its blocks are listed."""

    listed = 0

    def blocks(self, stream: str, from_seq: int = 0) -> list[BlockInfo]:
        self.listed += 1
        return super().blocks(stream, from_seq)


def referencerecords(blocks: list[BlockInfo], lo: int, hi: int | None) -> int:
    """What SluiceServer.readable_records counted from the blocks (before the span)."""
    if not blocks:
        return 0
    end = blocks[-1].end_offset if hi is None else hi
    return records_between(blocks, max(lo, blocks[0].first_offset), end)


def points(blocks: list[BlockInfo]) -> list[int]:
    """Offsets at and around every edge of `blocks` (and of their gaps), 0 and past the end."""
    edges = {0, 1}
    for b in blocks:
        edges |= {b.first_offset, b.end_offset}
    return sorted({max(0, e + d) for e in edges for d in (-1, 0, 1)} | {max(edges) + 7})


def check(
    store: WalBlockStore, stream: str = "s", *, below_seq: int | None = None, full: bool = True
) -> LogSpan | None:
    """The store's span of `stream` is span_of(its blocks) (found without listing them, when they are
    in order), and counts and finds gaps as the reference does for every lo, hi around an edge."""
    blocks = [b for b in store.blocks(stream) if below_seq is None or b.seq < below_seq]
    if isinstance(store, Counting):
        before = store.listed
        span = store.span(stream, below_seq=below_seq)
        assert store.listed == before, "the span listed every block"
    else:
        span = store.span(stream, below_seq=below_seq)
    assert span == span_of(blocks)
    assert (span is None) == (not blocks)
    if span is None or not full:
        return span
    assert span.blocks is None  # the fast path: a log's blocks are in order
    at = points(blocks)
    for lo in at:
        for hi in [*at, None]:
            assert span.records(lo, hi) == referencerecords(blocks, lo, hi), (lo, hi)
            if hi is not None:
                assert span.gaps(lo, hi) == gaps(blocks, lo, hi), (lo, hi)
    return span


def test_a_segment_lost_under_fsync_off_is_one_gap(tmp_path: Path) -> None:
    """Segments deleted (a power loss under --fsync off: the start goes on with an ERROR): their
    records are gaps, between segments and below the oldest one; the count leaves them out."""
    paths = rolled(tmp_path, OFF)  # 12 blocks of 20 records, a few to a segment
    paths[1].unlink()
    paths[3].unlink()
    store = Counting(tmp_path, fsync=OFF, segment_bytes=1500, direct_io=False)
    assert store.recover("s") == (12, 240)
    span = check(store)
    assert span is not None and len(span.holes) == 2
    assert span.records(0) == 240 - sum(b - a for a, b in span.holes)
    # a reader that never recovered the log (Spark's worker) sees the same
    check(Counting(tmp_path))
    # the oldest segment gone too: the log begins past it
    paths[0].unlink()
    reader = Counting(tmp_path)
    span = check(reader)
    assert span is not None and span.first == int(paths[1 + 1].stem) * 20


def test_lost_json_ranges_are_gaps(tmp_path: Path) -> None:
    """--accept-wal-damage: a missing segment is recorded in lost.json and gone past; the log's span
    leaves its records out, before and after later blocks and releases."""
    paths = rolled(tmp_path)
    paths[2].unlink()
    store = Counting(tmp_path, segment_bytes=1500, direct_io=False, accept_damage=["s"])
    store.recover("s")
    lost = store.lost_blocks("s")
    assert len(lost) == 1
    span = check(store)
    assert span is not None and span.holes == ((lost[0].first_offset, lost[0].end_offset),)
    fill(store, 3, per_block=20)
    check(store)
    released = lost[0].first_seq  # up to the gap: the log begins after it
    store.release("s", released)
    span = check(store)
    assert span is not None and span.first == lost[0].end_offset and span.holes == ()


def test_gaps_inside_a_segment_and_released_prefixes(tmp_path: Path) -> None:
    """A copy that went on after gaps (continue_at) holds them inside one segment; each write grows
    the index a frame at a time. Releases move the log's first offset, never counting released
    records, up to every block released (no span), and a new block after that."""
    store = Counting(tmp_path / "copy", fsync=OFF, gaps=True)
    assert store.span("s") is None  # never written
    assert store.recover("s") == (0, 0)
    assert store.span("s") is None  # empty
    seq, offset, layout = 0, 0, [(3, 0), (2, 0), (4, 5), (1, 2), (2, 0), (3, 9), (2, 1)]
    for blocks, skip in layout:  # runs of blocks of 4 records, `skip` records lost before each run
        if skip:
            offset += skip
            store.continue_at("s", seq, offset)
        for _ in range(blocks):
            store.write("s", seq, offset, 1, [records(4, offset)])
            seq, offset = seq + 1, offset + 4
            check(store, full=False)
    span = check(store)
    assert span is not None and [b - a for a, b in span.holes] == [5, 2, 9, 1]
    assert span.records(0) == 17 * 4
    check(Counting(tmp_path / "copy"))  # a reader process
    for before_seq in range(1, seq + 1):
        store.release("s", before_seq)
        check(store)
        check(Counting(tmp_path / "copy"))
    assert store.span("s") is None  # every block released, the newest segment still there
    store.write("s", seq, offset + 3, 1, [records(4, offset + 3)])
    span = check(store)
    assert span == LogSpan(offset + 3, offset + 7)


def test_a_span_below_a_seq(tmp_path: Path) -> None:
    """A cluster node's store (ReplicatedBlockStore) counts blocks below what enough copies hold:
    the span below each seq is span_of those blocks."""
    paths = rolled(tmp_path, OFF)
    paths[1].unlink()
    store = Counting(tmp_path, fsync=OFF, segment_bytes=1500, direct_io=False)
    store.recover("s")
    store.release("s", 1)
    for below in range(15):
        check(store, below_seq=below)


@st.composite
def logs(draw: st.DrawFn) -> list[BlockInfo]:
    """Blocks in a log's order: seqs increasing, each at or past the one before's end (empty blocks
    too)."""
    blocks, offset = [], draw(st.integers(0, 5))
    for seq in range(draw(st.integers(0, 8))):
        offset += draw(st.sampled_from([0, 0, 0, 1, 3]))
        count = draw(st.integers(0, 4))
        blocks.append(BlockInfo("s", seq, offset, count, 0))
        offset += count
    return blocks


@given(logs())
def test_a_span_counts_as_the_blocks_do(blocks: list[BlockInfo]) -> None:
    """Any log's span (empty blocks, gaps at either end of a range) gives what gaps() and
    records_between() give on its blocks; one out of order is counted from its blocks."""
    for listed in (blocks, blocks[::-1]):
        span = span_of(listed)
        if span is None:
            assert not listed
            continue
        at = points(listed)
        for lo, hi in itertools.product(at, [*at, None]):
            assert span.records(lo, hi) == referencerecords(listed, lo, hi)
            if hi is not None:
                assert span.gaps(lo, hi) == gaps(listed, lo, hi)


@pytest.mark.parametrize("blocks", [1, 50])
def test_an_index_grows_with_its_gaps(tmp_path: Path, blocks: int) -> None:
    """A reader's index of a segment the writer appends to (and leaves gaps in) grows a frame at a
    time, its gaps with it."""
    writer = WalBlockStore(tmp_path, fsync=OFF, gaps=True)
    reader = Counting(tmp_path)
    seq, offset = writer.recover("s")
    for i in range(blocks):
        if i % 7 == 3:
            offset += 2
            writer.continue_at("s", seq, offset)
        writer.write("s", seq, offset, 1, [records(3, offset)])
        seq, offset = seq + 1, offset + 3
        check(reader, full=i == blocks - 1)


def test_a_log_cut_and_written_again_is_seen_anew(tmp_path: Path) -> None:
    """Blocks cut from a log (truncate_from: an owner's unacked tail) and others written in their
    place, after a gap, in the same segment files: the span a look before took is not kept."""
    store = Counting(tmp_path, fsync=OFF, segment_bytes=1500, direct_io=False, gaps=True)
    fill(store, 10, per_block=20)
    check(store)
    store.truncate_from("s", 6)
    seq, offset = store.recover("s")
    assert (seq, offset) == (6, 120)
    check(store)
    store.continue_at("s", 6, 127)
    for i in range(4):
        store.write("s", 6 + i, 127 + 20 * i, 1, [records(20, 127 + 20 * i)])
    span = check(store)
    assert span is not None and span.holes == ((120, 127),) and span.records(0) == 200
    check(Counting(tmp_path))
