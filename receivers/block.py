"""Blocks: the unit a receiver seals every block interval, stores durably and hands to Spark.

A block holds the records one receiver took for one stream during one block interval, as Arrow record
batches with BLOCK_SCHEMA. Records get consecutive stream offsets (like Kafka offsets); a block knows the
offset of its first record, so offsets need not be stored per record.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

ARRIVAL = pa.timestamp("us", tz="UTC")
"""When the receiver took a record: the `timestamp` Spark sees."""

_RUNS = pa.run_end_encoded(pa.int32(), ARRIVAL)

BLOCK_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary(), nullable=False),
        # run-end encoded: the records of one client message share their arrival time, so a batch stores
        # it once (one run), not 8 bytes a record through the log, its copy and its CRC
        pa.field("timestamp", _RUNS, nullable=False),
    ]
)

PLAIN_SCHEMA = pa.schema(
    [
        pa.field("key", pa.binary()),
        pa.field("value", pa.binary(), nullable=False),
        pa.field("timestamp", ARRIVAL, nullable=False),
    ]
)
"""The layout of blocks written before the timestamp was run-end encoded: logs and copies in it are
still read, as BLOCK_SCHEMA batches (as_block_batch())."""


@functools.lru_cache(maxsize=16)
def _one_run(count: int) -> pa.Array:
    # from buffers, not pa.array([count]): that imports pandas on its first call (half a second or more,
    # which a server's first message waited for)
    run_end = pa.py_buffer(count.to_bytes(4, "little", signed=True))
    return pa.Array.from_buffers(pa.int32(), 1, [None, run_end])


def arrivals(count: int, timestamp_us: int) -> pa.Array:
    """The timestamp column of `count` records taken at `timestamp_us`: one run."""
    value = pa.Array.from_buffers(
        ARRIVAL, 1, [None, pa.py_buffer(timestamp_us.to_bytes(8, "little", signed=True))]
    )
    # from buffers: RunEndEncodedArray.from_arrays checks its inputs in Python, about 4x slower
    return pa.Array.from_buffers(_RUNS, count, [None], children=[_one_run(count), value])


def as_block_batch(batch: pa.RecordBatch) -> pa.RecordBatch:
    """`batch` with BLOCK_SCHEMA: a batch in the plain layout (PLAIN_SCHEMA) gets its timestamps run-end
    encoded; any other schema is a ValueError."""
    if batch.schema.equals(BLOCK_SCHEMA):
        return batch
    if not batch.schema.equals(PLAIN_SCHEMA):
        raise ValueError(f"a block's batch has schema {batch.schema}, not the block schema")
    runs = pc.run_end_encode(batch.column(2), run_end_type=pa.int32())
    return pa.RecordBatch.from_arrays([batch.column(0), batch.column(1), runs], schema=BLOCK_SCHEMA)


def plain_arrivals(column: pa.Array) -> pa.Array:
    """A block batch's timestamp column as one timestamp a record (what Spark's rows hold)."""
    return pc.run_end_decode(column) if pa.types.is_run_end_encoded(column.type) else column


def first_arrival_us(batch: pa.RecordBatch) -> int:
    """The timestamp of a non-empty block batch's first record, in microseconds."""
    column = batch.column(2)
    if pa.types.is_run_end_encoded(column.type):
        column = pc.run_end_decode(column.slice(0, 1)) if column.offset else column.values
    return int(column[0].value)


@dataclass(frozen=True, order=True)
class BlockInfo:
    """Where a sealed block sits in its stream. Ordered by (stream, seq)."""

    stream: str
    seq: int
    """Position of the block in its stream: 0, 1, 2, ... with no gaps."""
    first_offset: int
    """Stream offset of the block's first record."""
    count: int
    """Number of records in the block."""
    receiver: int
    """Id of the receiver that sealed the block (the analogue of a Kafka partition)."""

    @property
    def end_offset(self) -> int:
        """Stream offset one past the block's last record."""
        return self.first_offset + self.count


def uncovered(lo: int, hi: int, blocks: Sequence[BlockInfo]) -> list[tuple[int, int]]:
    """The ranges of record offsets in [lo, hi) that `blocks` (sorted, those overlapping it) do not
    cover."""
    missing: list[tuple[int, int]] = []
    at = lo
    for block in blocks:
        if block.first_offset > at:
            missing.append((at, block.first_offset))
        at = max(at, block.end_offset)
    if at < hi:
        missing.append((at, hi))
    return missing


# ---- gaps: offsets no block of a log holds -----------------------------------------------------
# A log's offsets are positions: records lost from it (blocks a start with --accept-wal-damage went on
# without, recorded in its lost.json; blocks a start under --fsync off found missing) leave their
# offsets behind, in no block. No batch reads them (failOnDataLoss=false passes them), so whatever
# counts a log's records to read counts its blocks' records, not offsets: the sources' batch caps, the
# server's stream backlog, a batch's backlog as the rate controller sees it. Offsets are never
# renumbered.


def gaps(blocks: Sequence[BlockInfo], lo: int, hi: int) -> list[tuple[int, int]]:
    """The offsets of [lo, hi) in none of a log's `blocks` (sorted, as BlockStore.blocks lists them):
    no batch reads them. Below the first block too (released records, when `lo` is under it)."""
    if hi <= lo:
        return []
    return uncovered(lo, hi, [b for b in blocks if b.end_offset > lo and b.first_offset < hi])


def countable(lo: int, hi: int, gaps: Sequence[tuple[int, int]]) -> int:
    """The records of [lo, hi) outside `gaps` (disjoint ranges [a, b))."""
    return max(0, hi - lo) - sum(max(0, min(b, hi) - max(a, lo)) for a, b in gaps)


def records_between(blocks: Sequence[BlockInfo], lo: int, hi: int) -> int:
    """How many records of [lo, hi) a log's `blocks` hold: its offsets less its gaps."""
    return countable(lo, hi, gaps(blocks, lo, hi))


@dataclass(frozen=True)
class LogSpan:
    """What counting a log's records needs of its blocks (BlockStore.span): the first block's first
    offset, the last one's end and the gaps between (the offsets of [first, end) in no block), so that a
    store that knows them need not list every block (gaps are rare: records lost at a start). gaps()
    and records() give what gaps() and records_between() give on the blocks, at a cost of the gaps'
    number, not the blocks'. `blocks`: the blocks themselves, kept when they are not in order (seqs
    increasing, offsets never going back; a log's always are): then both are the reference's on them."""

    first: int
    end: int
    holes: tuple[tuple[int, int], ...] = ()
    """The offsets of [first, end) in no block: sorted disjoint [a, b) (as uncovered() splits them)."""
    blocks: tuple[BlockInfo, ...] | None = None

    def gaps(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """gaps(blocks, lo, hi): the offsets of [lo, hi) in no block, below the first one and past the
        last one too."""
        if self.blocks is not None:
            return gaps(self.blocks, lo, hi)
        if hi <= lo:
            return []
        found = [(lo, min(self.first, hi))] if lo < self.first else []
        found.extend((max(a, lo), min(b, hi)) for a, b in self.holes if b > lo and a < hi)
        if max(lo, self.end) < hi:
            found.append((max(lo, self.end), hi))
        return found

    def records(self, lo: int, hi: int | None = None) -> int:
        """How many records of [lo, hi) (None: up to the end) the blocks hold: records_between(blocks,
        max(lo, first), end if hi is None else hi)."""
        lo = max(lo, self.first)
        hi = self.end if hi is None else hi
        if self.blocks is not None:
            return records_between(self.blocks, lo, hi)
        return countable(lo, min(hi, self.end), self.holes)


def in_order(blocks: Sequence[BlockInfo]) -> bool:
    """Whether `blocks` are a log's in its order: seqs increasing, each block at or past the end of the
    one before (what LogSpan's holes take for granted)."""
    return all(b.seq > a.seq and b.first_offset >= a.end_offset for a, b in itertools.pairwise(blocks))


def span_of(blocks: Sequence[BlockInfo]) -> LogSpan | None:
    """The LogSpan of a log's `blocks` (as BlockStore.blocks lists them), None when there are none: the
    reference a store's own BlockStore.span must equal."""
    if not blocks:
        return None
    first, end = blocks[0].first_offset, blocks[-1].end_offset
    if not in_order(blocks):
        return LogSpan(first, end, blocks=tuple(blocks))
    return LogSpan(first, end, tuple(uncovered(first, end, blocks)))
