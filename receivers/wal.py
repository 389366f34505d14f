"""The write-ahead log block store: every sealed block appended to a checksummed log, durable before acks.

Layout under the root folder, per stream::

    <root>/<stream>/<first_seq:020d>.wal    segments, oldest first; blocks are appended to the newest
    <root>/<stream>/released.json           released high-water mark + producers snapshot (release()),
                                            and where a lost log's unreleased records begin (skip_to())
    <root>/<stream>/incarnation             the log's identity (ensure_incarnation(), set_incarnation()):
                                            a random id made with the log, gone with it
    <root>/<stream>/lost.json               blocks a start went on past damage without (accept_damage)
    <root>/<stream>/damaged/                a copy of each segment as it was before accept_damage cut it

A new segment is started, named after the seq of its first block, once the newest one has grown past
`segment_bytes`. So the blocks of a segment have seqs >= its name and < the next segment's name.

Each block is one frame, written with a single write (O_APPEND)::

    header (little-endian, HEADER.size = 60 bytes)
        magic         4s   b"SLWL"
        version       H    1
        flags         H    0 (reserved)
        crc           I    zlib.crc32 of every other header byte, then of the producers section and payload
        producers_len I    bytes of the producers section
        payload_len   Q    bytes of the payload
        seq           Q    block seq
        first_offset  Q    stream offset of the block's first record
        count         Q    records in the block
        receiver      i    id of the receiver that sealed it
        received_at   d    epoch seconds when the block's first record was taken (0.0 for no records)
    producers section: n (I), then n x (id length H, id UTF-8 bytes, next_seq Q)
    payload: the block's record batches as an Arrow IPC *stream* (BLOCK_SCHEMA: the timestamp run-end
             encoded, one run a client message; frames written before that hold PLAIN_SCHEMA, one
             timestamp a record, and read as BLOCK_SCHEMA)

Durability (FsyncPolicy): "every-block" (the default) fsyncs the segment before write() returns, and
the folder when a segment is created, so an acked block survives a power loss. "interval:MS" is group
commit: write() returns after the OS write, a background thread fsyncs every MS milliseconds, and
durable_seq() says how far that got; the receiver acks a block only once it is below durable_seq(), so
acked blocks survive a power loss here too, at up to MS ms more ack latency and one fsync per MS ms
instead of one per block. "off" never fsyncs (benchmarks, throwaway data).

Recovery (recover(), at receiver start) reads every frame and checks magic, version, lengths, CRC and
that seqs increase. At the first bad or incomplete frame of a segment the segment is truncated there (and
fsynced): a WARNING names stream, segment, offset and bytes cut, and the truncation is counted in
`stats`. A torn tail of the newest segment is the normal trace of a crash mid-write (such a block was
never acked under "every-block"). Acknowledged blocks never released are not cut or passed over under
"every-block" and "interval": recovery raises DamagedLogError naming them and what to do when
  - a bad frame has sound frames after it in its segment, under "every-block" (each block is written
    after the one before it was fsynced, so that is no crash's trace: _refuse_if_intact_after);
  - a bad frame in an older segment loses blocks the later segments do not hold: a segment is on disk
    whole before the next one is made (every block fsynced, or under "interval" the segment fsynced at
    the roll-over), so that is damage (_refuse_lost_blocks);
  - blocks above the released mark are missing between segments or before the oldest one: a segment
    deleted or lost (_refuse_missing; not for a copy that goes on after gaps, `gaps`).
Under "off" a power loss can take any part of the log: those are cut or passed with an ERROR naming the
blocks lost (counted in `stats`: blocks_lost). (etcd's WAL refuses such damage the same way; the
operator restores the segment or moves it and the later ones aside.) For the streams of `accept_damage`
(`sluice serve --accept-wal-damage`) recovery goes on past each such damage instead, keeping the blocks
after it (_accept): a copy of a damaged segment is kept under damaged/, the blocks lost are recorded in
lost.json (so later recoveries take that gap as known), named in an ERROR and counted in blocks_lost,
and the log is mended to be sound but for the gap (the sound frames after a bad one moved to a segment
of their own, the damaged segment cut at the bad frame). Otherwise bad data on disk never makes
recovery fail; only real I/O errors (permissions, ...) raise.

Readers (Spark executors, other processes) index segments by their frame headers, seeking over payloads,
and cache that index per segment, re-scanning only the part that grew; a frame not yet complete on disk is
not visible. read() checks the frame's CRC. No payload is cached: unconsumed blocks live on disk.

release() (the server once Spark's commit log has a batch, and Spark's commit() in its Python worker:
two processes) first writes released.json atomically (tmp, fsync, rename, folder fsync): the next
seq/offset after the released blocks and the producers table of every block released so far. Then it
deletes the segments whose blocks are all released, never the newest one (the writer may be appending to
it). It reads, merges and writes the mark and deletes segments under an flock on released.lock (trim()
and recovery's clean-up of temp files too), re-reading the mark from the file: without it a release from
a stale view moved the mark back and dropped the producers of segments another process had deleted.
Released blocks still in a kept segment are hidden from blocks().
The writing process may delete the newest segment itself once every block in it is released (trim(),
which the receiver calls while credit is paused for the disk): the log then starts a new segment at the
next write, and the released mark (written first, with the full producers table) keeps the numbering.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import fcntl
import itertools
import json
import logging
import mmap
import os
import re
import shutil
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa

try:  # the same CRC-32 as zlib's (same values, the log's format), with ISA-L's SIMD: ~60 GB/s, not ~7
    from isal.isal_zlib import crc32
except ImportError:  # pragma: no cover - isal comes with the server's extra; zlib's is the fallback
    from zlib import crc32

from receivers.block import BLOCK_SCHEMA, BlockInfo, LogSpan, as_block_batch, first_arrival_us, span_of
from receivers.block_store import BlockStore
from receivers.config import DEFAULT_SEGMENT_BYTES, FsyncPolicy
from receivers.files import DataDirStateError, broken_link, open_regular, parse_json, read_regular
from receivers.names import check_stream_name, stream_folders

log = logging.getLogger(__name__)

MAGIC = b"SLWL"
VERSION = 1
HEADER = struct.Struct("<4sHHIIQQQQid")
_CRC_AT = 8  # the crc field's offset: the checksum covers the header bytes before and after it
_AFTER_CRC = _CRC_AT + 4
_PRODUCER_COUNT = struct.Struct("<I")
_PRODUCER_ID_LEN = struct.Struct("<H")
_PRODUCER_SEQ = struct.Struct("<Q")
SEGMENT_SUFFIX = ".wal"
_SEGMENT_NAME = re.compile(r"^(\d{20})\.wal$")
STATE_FILE = "released.json"
LOST_FILE = "lost.json"
"""Blocks a start with `accept_damage` went on without (LostBlocks), kept so that later starts do not
refuse the gap again."""
DAMAGED_FOLDER = "damaged"
"""In a stream's folder: a copy of each segment as it was before `accept_damage` cut it."""
_TEMP_FILE = re.compile(r"^(released\.json|lost\.json|\d{20}\.wal)\.tmp\.")
LOCK_FILE = "released.lock"
"""flock()ed by whoever rewrites released.json or deletes segments (see _mark_lock)."""
ALIGN = 4096
"""Segments are written with O_DIRECT (every fsync policy) where the file system allows it: the data goes
from the frame's buffer to the disk without a copy into the page cache, which on the development VM cost
as much CPU as the rest of the ingest path. Direct writes must start and end on this boundary (the page
size, a multiple of every common logical block size), so such frames are padded to it."""
SYNC_BYTES = 8 * 1024 * 1024
"""Under the interval policy, the background fsync starts early once a stream has this many bytes
appended and not yet fsynced: acks wait for that fsync, and a publisher's window (unacked records: 500k
by default) covers only so many milliseconds of records at full speed, so waiting out the whole interval
halved the throughput. Under load this is about one fsync per 16 MB block, as under every-block, but off
the writing thread; a slow stream still gets one fsync per interval."""
_OLD_MARK = "released"  # the high-water mark of the file-per-block store this log replaced
INCARNATION_FILE = "incarnation"
"""In a stream's folder: the identity of that log (see WalBlockStore.ensure_incarnation)."""
_INCARNATION = re.compile(r"^[A-Za-z0-9-]{1,64}$")


def valid_incarnation(value: str) -> bool:
    """Whether `value` can be an incarnation (it names a folder where a copy of it is set aside)."""
    return bool(_INCARNATION.match(value))


class WalError(RuntimeError):
    """A block cannot be read from the log."""


class IncarnationError(WalError, DataDirStateError):
    """A stream's incarnation file is there but cannot be read or holds no incarnation."""


class LostFileError(WalError, DataDirStateError):
    """A stream's LOST_FILE is there but cannot be read or is not what Sluice writes."""


class CorruptBlockError(WalError):
    """A block's frame fails its checksum (or does not hold the block asked for)."""


class BlockNotFoundError(WalError, LookupError):
    """A block is not in the log (released, or never written)."""


class DamagedLogError(WalError):
    """Acknowledged blocks never released are damaged or missing (a bad frame with intact frames after
    it, an older segment's bad tail, a segment deleted), under a policy that makes each block durable
    before its ack: not a crash's torn tail. Recovery refuses to cut or pass over them, unless the store
    was told to go on past damage in that stream (`accept_damage`)."""

    def __init__(self, message: str, damage: _Damage | None = None) -> None:
        super().__init__(message)
        self.damage = damage
        """What is damaged, for recovery to go on past it (`accept_damage`); None: it cannot."""


@dataclass(frozen=True)
class _Damage:
    """Damage recovery refused (DamagedLogError.damage): blocks from `first_seq` on are lost, either
    missing between segments (`segment` None) or in `segment`, whose sound part ends at byte `bad`."""

    first_seq: int
    """The first block lost (at or above the released mark)."""
    first_offset: int
    """Its first record."""
    where: str
    """What, for the ERROR: "missing from the log between segments A and B", "the log segment A is
    damaged at byte N (after block K)"."""
    next_seq: int | None
    """Blocks missing: the block found after them. A damaged segment: the next segment's name (None: it
    is the newest); sound frames after the bad one in it are kept, and the loss ends at them."""
    next_offset: int | None = None
    """The first record of `next_seq`'s block, where it is known."""
    segment: Path | None = None
    bad: int = 0
    last_seq: int = -1
    """The seq of the last sound block before `bad` (frames after it must have higher seqs)."""
    next_segment: Path | None = None
    """The segment named `next_seq` (a damaged segment's)."""

    @property
    def key(self) -> tuple[int, str, int]:
        return self.first_seq, str(self.segment), self.bad


@dataclass(frozen=True)
class LostBlocks:
    """Blocks [first_seq, end_seq) (records [first_offset, end_offset)) that a start with
    `accept_damage` (`sluice serve --accept-wal-damage`) went on without: recorded in the stream's
    LOST_FILE, so later starts take the gap they leave as known, not as damage."""

    first_seq: int
    end_seq: int
    first_offset: int
    end_offset: int | None
    """None: not known (the block after the gap was damaged too)."""
    at: str = ""
    """When (UTC, ISO 8601)."""

    def records(self) -> str:
        """The records, for a message: "records 10..19", or "records from offset 10"."""
        if self.end_offset is not None and self.end_offset > self.first_offset:
            return _span("record", self.first_offset, self.end_offset - 1)
        return f"records from offset {self.first_offset}"


# ---- statistics ----------------------------------------------------------------------------------


@dataclass
class WalStats:
    """What recovery found, per stream (WalBlockStore.stream_stats) or summed (WalBlockStore.stats)."""

    corrupt_tails_truncated: int = 0
    """Segments cut at a bad or incomplete frame."""
    bytes_truncated: int = 0
    """Bytes cut off by those truncations."""
    frames_recovered: int = 0
    """Frames found valid by recovery."""
    segments_removed: int = 0
    """Empty (or emptied) segments other than the newest removed by recovery."""
    blocks_lost: int = 0
    """Blocks above the released mark that recovery went on without (each named in an ERROR): missing
    between segments or before the oldest, or in an older segment's cut tail. Only where that is
    allowed: under --fsync off, or in a copy that goes on after gaps (`gaps`); other policies refuse."""

    def add(self, other: WalStats) -> None:
        self.corrupt_tails_truncated += other.corrupt_tails_truncated
        self.bytes_truncated += other.bytes_truncated
        self.frames_recovered += other.frames_recovered
        self.segments_removed += other.segments_removed
        self.blocks_lost += other.blocks_lost


# ---- frames --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Header:
    producers_len: int
    payload_len: int
    seq: int
    first_offset: int
    count: int
    receiver: int
    received_at: float
    crc: int

    @property
    def frame_len(self) -> int:
        return HEADER.size + self.producers_len + self.payload_len


def _parse_header(raw: bytes) -> _Header | None:
    """The header in `raw` (HEADER.size bytes), or None if it is not one (bad magic or version)."""
    magic, version, _flags, crc, plen, paylen, seq, first, count, receiver, received_at = HEADER.unpack(raw)
    if magic != MAGIC or version != VERSION:
        return None
    return _Header(plen, paylen, seq, first, count, receiver, received_at, crc)


def _encode_producers(producers: Mapping[str, int] | None) -> bytes:
    if not producers:
        return b""
    parts = [_PRODUCER_COUNT.pack(len(producers))]
    for producer, next_seq in producers.items():
        raw = producer.encode()
        if len(raw) > 0xFFFF:
            raise ValueError(f"producer id of {len(raw)} bytes: at most 65535")
        if next_seq < 0:
            raise ValueError(f"producer {producer!r}: next seq must be >= 0, got {next_seq}")
        parts += [_PRODUCER_ID_LEN.pack(len(raw)), raw, _PRODUCER_SEQ.pack(next_seq)]
    return b"".join(parts)


def _decode_producers(raw: bytes | memoryview) -> dict[str, int]:
    """The producers section; ValueError (or struct.error, UnicodeDecodeError) if it is malformed."""
    if not raw:
        return {}
    (n,) = _PRODUCER_COUNT.unpack_from(raw, 0)
    pos = _PRODUCER_COUNT.size
    table: dict[str, int] = {}
    for _ in range(n):
        (length,) = _PRODUCER_ID_LEN.unpack_from(raw, pos)
        pos += _PRODUCER_ID_LEN.size
        producer = bytes(raw[pos : pos + length]).decode()
        pos += length
        (table[producer],) = _PRODUCER_SEQ.unpack_from(raw, pos)
        pos += _PRODUCER_SEQ.size
    if pos != len(raw):
        raise ValueError("producers section longer than its entries")
    return table


def _frame_crc(header: bytes | bytearray | memoryview, rest: Sequence[bytes | memoryview | pa.Buffer]) -> int:
    crc = crc32(header[_AFTER_CRC:], crc32(header[:_CRC_AT]))
    for part in rest:
        crc = crc32(part, crc)
    return crc


def _span(noun: str, first: int, last: int) -> str:
    """`first`..`last` (inclusive) for a message: "blocks 3..7", or "block 3" when it is one."""
    return f"{noun} {first}" if first == last else f"{noun}s {first}..{last}"


def _are(first: int, last: int) -> str:
    """The verb for a `_span`: "is" for one, "are" for more."""
    return "is" if first == last else "are"


def _merge_producers(into: dict[str, int], table: Mapping[str, int]) -> None:
    for producer, next_seq in table.items():
        if next_seq > into.get(producer, -1):
            into[producer] = next_seq


# ---- the reader's index --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Frame:
    offset: int
    header: _Header


@dataclass(frozen=True)
class _SegmentIndex:
    """What a segment held when it was indexed: replaced, never changed, when it grows."""

    ident: tuple[int, int]
    scanned: int = 0
    """Bytes indexed: the end of the last complete frame."""
    frames: tuple[_Frame, ...] = ()
    holes: tuple[tuple[int, int, int], ...] = ()
    """(i, a, b): frame i starts at offset b, past the end a of the frame before it (records lost in
    between): what WalBlockStore.span counts without going over every frame. Meaningless unless
    `ordered`."""
    ordered: bool = True
    """Every frame's seq above the one's before, its first offset at or past that one's end (a log
    recovery passed always is)."""

    def grown(self, scanned: int, more: Sequence[_Frame]) -> _SegmentIndex:
        """This index with the frames `more` found after it, up to byte `scanned`."""
        holes, ordered = list(self.holes), self.ordered
        before = self.frames[-1].header if self.frames else None
        for i, frame in enumerate(more, start=len(self.frames)):
            h = frame.header
            if before is not None:
                end = before.first_offset + before.count
                if h.seq <= before.seq or h.first_offset < end:
                    ordered = False
                elif h.first_offset > end:
                    holes.append((i, end, h.first_offset))
            before = h
        return _SegmentIndex(self.ident, scanned, (*self.frames, *more), tuple(holes), ordered)


@dataclass
class _Released:
    next_seq: int = 0
    next_offset: int = 0
    producers: dict[str, int] = field(default_factory=dict)
    lost_from: int | None = None
    """After a lost log (skip_to): the offset of the first record below next_offset that may not have
    been read; the numbering went on past records this log never released. None: every record below
    next_offset was released here."""
    skipped_to: int = 0
    """The seq where the log went on after it was last lost (skip_to): it never held the blocks below
    (0: never lost). Kept for good, releases past it or not."""
    damaged: bool = False
    """released.json was there but unreadable (read as nothing released): where the log must begin is
    not known, so recovery does not take the blocks below its first segment for missing."""


@dataclass
class _Expected:
    """Recovery's view of the block the log must hold next: the released mark's, then the one after
    each block found (blocks below the mark may be gone: Spark read them)."""

    seq: int
    offset: int
    released_seq: int
    released_offset: int
    after: Path | None = None
    """The segment holding the block before (None: none yet, the released mark's)."""
    known: bool = True
    """False: the released mark is unreadable, so where the log must begin is not known."""

    def passed(self, seq: int, offset: int, path: Path) -> None:
        self.seq = max(seq, self.released_seq)
        self.offset = max(offset, self.released_offset)
        self.after = path
        self.known = True


@dataclass
class _Writer:
    """The append state of one stream, owned by the process that writes it."""

    folder: Path
    next_seq: int
    next_offset: int
    producers: dict[str, int]
    segment: Path | None
    """The newest segment, appended to (None: none yet)."""
    size: int
    """Bytes of `segment` as this writer knows them."""
    fd: int | None = None
    dirty: bool = False
    unsynced: int = 0
    """Under the interval policy, bytes appended since the last fsync began (its early fsync: SYNC_BYTES)."""
    folder_dirty: bool = False
    changes: int = 0
    """Counts what sets `dirty` or `folder_dirty` (appends, new segments): an fsync clears them only if
    nothing changed while it ran."""
    folder_id: tuple[int, int] | None = None
    """(device, inode) of `folder` once a segment was made in it: a folder deleted (or replaced) while
    this writer lived is not made again (_segment_for)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    durable_seq: int = 0
    """Every block with a lower seq is durable under the policy (fsynced, or "off")."""
    direct: bool = False
    """`fd` was opened with O_DIRECT: frames are padded to ALIGN."""
    _frame: mmap.mmap | None = None
    _spare: mmap.mmap | None = None
    """The buffer prepare() encodes the next block in while `_frame`'s is written."""
    prepared: _Prepared | None = None
    prepare_lock: threading.Lock = field(default_factory=threading.Lock)
    """Held while `_spare` is written (prepare) or handed over (an append that takes `prepared`)."""

    def frame_buffer(self, size: int) -> memoryview:
        """A page-aligned buffer of at least `size` bytes to build a frame in, kept for the next block
        (a fresh one per block costs a page fault per page)."""
        self._frame = _at_least(self._frame, size)
        return memoryview(self._frame)[:size]

    def spare_buffer(self, size: int) -> memoryview:
        """frame_buffer's twin, for prepare(): call with prepare_lock held."""
        self._spare = _at_least(self._spare, size)
        return memoryview(self._spare)[:size]

    def take_prepared(self, key: _BlockKey) -> _Prepared | None:
        """The frame prepare() encoded for a block of this key, made the writer's frame buffer (the
        old one becomes the spare); None if there is none for it. Call with prepare_lock held."""
        prepared = self.prepared
        if prepared is None:
            return None
        if not prepared.key.matches(key):
            if prepared.key.seq <= key.seq:  # stale (its write came with other records): never used
                self.prepared = None
            return None  # or the next block's, prepared before this write took the lock: kept
        self.prepared = None
        self._frame, self._spare = self._spare, self._frame
        return prepared


def _at_least(buffer: mmap.mmap | None, size: int) -> mmap.mmap:
    """`buffer`, or a larger one when it holds fewer than `size` bytes (the old one goes once its views
    do)."""
    return buffer if buffer is not None and len(buffer) >= size else frame_memory(size)


HUGE_PAGE = 2 * 1024 * 1024
"""x86-64's and arm64's transparent huge page: frame buffers are made of whole ones."""


def frame_memory(size: int) -> mmap.mmap:
    """Page-aligned memory to build frames in, `size` rounded up to whole huge pages: private (shared
    anonymous memory is shmem, which gets no transparent huge pages by default) and advised to be
    backed by huge pages where the kernel allows it (THP "always" or "madvise").

    A direct write pins each page of its buffer for the device and unpins it on completion: with 4 KiB
    pages that is about 4,000 pages per 16 MB block, some 7% of the machine's CPU at 12M records/s
    (get_user_pages, the bio's page list, the completion worker); with 2 MiB pages, eight."""
    size = -(-max(size, 1) // HUGE_PAGE) * HUGE_PAGE
    private = getattr(mmap, "MAP_PRIVATE", None)
    if private is None:  # pragma: no cover - Windows: no flags
        buffer = mmap.mmap(-1, size)
    else:
        buffer = mmap.mmap(-1, size, flags=private | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no MADV_HUGEPAGE (not Linux), or refused
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


@dataclass(frozen=True)
class _BlockKey:
    """What a block's frame is built from: a prepared frame serves a write of the same."""

    seq: int
    first_offset: int
    receiver: int
    batches: tuple[pa.RecordBatch, ...]
    producers: dict[str, int]

    def matches(self, other: _BlockKey) -> bool:
        return (
            (self.seq, self.first_offset, self.receiver) == (other.seq, other.first_offset, other.receiver)
            and len(self.batches) == len(other.batches)
            and all(a is b for a, b in zip(self.batches, other.batches, strict=True))
            and self.producers == other.producers
        )


@dataclass(frozen=True)
class _Prepared:
    key: _BlockKey
    frame: memoryview
    """The whole frame, padded for `direct`."""
    direct: bool


@dataclass(frozen=True)
class RawBlock:
    """A block as the log stores it: header fields, producers table, Arrow IPC payload."""

    seq: int
    first_offset: int
    count: int
    receiver: int
    received_at: float
    producers: dict[str, int]
    payload: bytes | pa.Buffer


# ---- the store -----------------------------------------------------------------------------------


class WalBlockStore(BlockStore):
    """Blocks in per-stream append-only logs. One writing process per stream (its receiver), writes to a
    stream from one thread at a time; any number of reading processes; release() from another process."""

    def __init__(
        self,
        root: Path | str,
        *,
        fsync: FsyncPolicy | None = None,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        direct_io: bool = True,
        gaps: bool = False,
        accept_damage: Iterable[str] = (),
    ) -> None:
        """`direct_io`: write segments with O_DIRECT where the file system allows (see ALIGN), under
        every fsync policy (through the page cache, not fsyncing saved nothing: the copy into the cache
        and its writeback cost more CPU than the device's write); False writes through the page cache
        (and pads nothing). `gaps`: the log may lack blocks between others by design (a copy that went
        on after a gap, continue_at), so recovery takes blocks missing before a segment or a cut older
        segment as it always did (an ERROR for the cut); False (an owner's log): under "every-block" and
        "interval" they stop recovery with DamagedLogError. `accept_damage`: streams whose recovery goes
        on past such damage instead, keeping the blocks after it (_accept: the lost blocks are recorded
        in LOST_FILE, named in an ERROR and counted in `stats`; `sluice serve --accept-wal-damage`)."""
        if segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {segment_bytes}")
        self.root = Path(root)
        self.fsync = fsync if fsync is not None else FsyncPolicy.every_block()
        self.segment_bytes = segment_bytes
        self.direct_io = direct_io
        self.gaps = gaps
        self.accept_damage = frozenset(check_stream_name(s) for s in accept_damage)
        self._acked_below: dict[str, int] = {}
        """Stream -> the committed seq of a cluster's owner while _check_below recovers its log: blocks
        below it were acked, under the interval policy too (a sound one after a bad frame is damage)."""
        self._checked: dict[str, _Checked] = {}
        """Stream -> the state _check_below's pass over the whole log found (or a recover(keep=True)'s),
        the log untouched since: the next recover() takes it rather than read the log again (a
        cluster's owner read it twice at its start, truncate_from's check or truncate_uncommitted's
        recovery, and its receiver's)."""
        self._accepted: dict[str, list[LostBlocks]] = {}
        """Stream -> the losses this process accepted or warned of as recorded ones (not warned about
        again: a cluster's owner whose start cut blocks recovers twice, truncate_from and its receiver)."""
        self._writers: dict[str, _Writer] = {}
        self._writers_lock = threading.Lock()
        self._index: dict[Path, _SegmentIndex] = {}
        self._index_lock = threading.Lock()
        self._release_lock = threading.Lock()
        self._released: dict[str, tuple[tuple[int, int, int], _Released]] = {}
        self._stats: dict[str, WalStats] = {}
        self._flusher: threading.Thread | None = None
        self._closing = threading.Event()
        self._sync_wanted = threading.Event()  # SYNC_BYTES appended: the flusher need not wait longer
        self._durable_listeners: dict[str, list[Callable[[], None]]] = {}
        self._listeners_lock = threading.Lock()
        self._fsync_failed: dict[Path, str] = {}
        """Stream folder -> the error of an fsync of its log that failed (interval policy): sticky for
        this process. After a failed fsync the kernel may have dropped the dirty pages it covered (and
        report the next fsync of the file as a success), so what was not durable before it never counts
        as durable: durable_seq stays, and appends are refused (_refuse_if_failed) until a restart
        recovers the log from what reached the disk."""

    # ---- statistics ----------------------------------------------------------------------------

    @property
    def stats(self) -> WalStats:
        """What recovery found in every stream of this store (in this process)."""
        total = WalStats()
        for stats in list(self._stats.values()):
            total.add(stats)
        return total

    def stream_stats(self, stream: str) -> WalStats:
        """What recovery found in `stream` (in this process)."""
        return self._stats.setdefault(check_stream_name(stream), WalStats())

    # ---- writing (receiver side) ---------------------------------------------------------------

    def recover(self, stream: str, *, keep: bool = False) -> tuple[int, int]:
        """Check the log of `stream`, cut bad or torn tails; return (next block seq, next offset).

        Call once per stream in the writing process, before its first write (write() calls it if not).
        `keep`: a start that recovers the log before its receivers do (truncate_uncommitted, without a
        committed file) keeps what this pass found for the next recover(), which takes it rather than
        read the whole log again when the stream's folder is as this pass left it (_take_checked).
        """
        folder = self._folder(stream)
        self._refuse_if_failed(folder)  # the page cache may hold blocks the disk lost: restart
        self._drop_writer(stream)
        writer = self._take_checked(stream, folder) or self._recover_past_damage(stream, folder)
        if keep:
            # a writer of its own (this one may write meanwhile), as fresh as this one; its frames
            # were counted by this pass
            kept = replace(
                writer,
                producers=dict(writer.producers),
                lock=threading.Lock(),
                prepare_lock=threading.Lock(),
            )
            self._checked[stream] = _Checked(kept, 0, _fingerprint(folder))
        with self._writers_lock:
            self._writers[stream] = writer
        return writer.next_seq, writer.next_offset

    def _take_checked(self, stream: str, folder: Path) -> _Writer | None:
        """The writer _check_below's pass (or a recover(keep=True)) made, if the stream's folder holds
        the same files as that pass left (names, inodes, sizes, mtimes: truncate_from cut nothing,
        nothing was written or released since), its frames counted now; else None (the log is
        recovered again). Taken once."""
        checked = self._checked.pop(stream, None)
        if checked is None or not _same_files(checked.fingerprint, _fingerprint(folder)):
            return None
        self.stream_stats(stream).frames_recovered += checked.frames
        return checked.writer

    def _recover_past_damage(self, stream: str, folder: Path) -> _Writer:
        """_recover(), which raises DamagedLogError at the first damage; for a stream of
        `accept_damage` each damage is recorded as lost and mended (_accept) and recovery starts over,
        until the log is sound but for the gaps recorded."""
        stats = self.stream_stats(stream)
        accepted: set[tuple[int, str, int]] = set()
        while True:
            frames_before = stats.frames_recovered
            try:
                return self._recover(stream, folder)
            except DamagedLogError as exc:
                damage = exc.damage
                if stream not in self.accept_damage or damage is None or damage.key in accepted:
                    raise
                accepted.add(damage.key)
                stats.frames_recovered = frames_before  # counted again by the next pass
                if not self._accept(stream, folder, damage):
                    raise

    def write(  # noqa: PLR0917 - the receiver's positional call, kept
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> tuple[BlockInfo, int]:
        """Append a block; return it and its frame's size in bytes. Durable on return under the
        "every-block" policy. Blocking: call from a worker thread, one at a time per stream.

        `seq` must be the stream's next seq (as recover() returned, plus one per block written since).
        `producers` maps each producer with records in the block to the seq after its last one there.
        On an error (OSError) nothing of the block stays in the log: the same block can be written again.
        """
        key = _BlockKey(seq, first_offset, receiver, tuple(batches), dict(producers or {}))
        block, measure, encode = _encoding(key)
        return self._append(stream, block, measure, encode, key)

    def prepare(  # noqa: PLR0917 - write()'s arguments
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> None:
        """Encode the frame of the block a write() with these arguments will append, while the block
        before it is written (another thread), so that the log's thread does not copy between writes.
        A hint: write() encodes the block itself when nothing (or something else) was prepared, and an
        error here (the block's data) is left for write() to raise."""
        try:
            writer = self._writer(stream)
        except (OSError, ValueError):
            return
        key = _BlockKey(seq, first_offset, receiver, tuple(batches), dict(producers or {}))
        with writer.prepare_lock:
            writer.prepared = None
            direct = self._direct_wanted() if writer.fd is None else writer.direct
            try:
                block, measure, encode = _encoding(key)
                payload_size = measure()
                producers_raw, padded = _frame_layout(block, payload_size, direct)
                frame = writer.spare_buffer(padded)
                _build_frame(frame, block, producers_raw, payload_size, encode)
            except Exception:  # noqa: BLE001 - write() meets it again and raises it where it is handled
                return
            writer.prepared = _Prepared(key, frame, direct)

    def append_raw(self, stream: str, block: RawBlock) -> tuple[BlockInfo, int]:
        """Append a block already encoded (a replica of another node's block, as read_raw() gave it
        there); as write(), whose checks and durability it shares."""
        payload = memoryview(block.payload)

        def copy(into: memoryview) -> None:
            into[:] = payload

        return self._append(stream, block, payload.nbytes, copy)

    def _append(
        self,
        stream: str,
        block: RawBlock,
        payload_size: int | Callable[[], int],
        fill: Callable[[memoryview], None],
        key: _BlockKey | None = None,
    ) -> tuple[BlockInfo, int]:
        """Append `block` (its payload, `payload_size` bytes (or what calling it says), written by
        `fill` into the frame; or the frame prepare() built for `key`)."""
        seq, first_offset, count, receiver = block.seq, block.first_offset, block.count, block.receiver
        producers = block.producers
        writer = self._writer(stream)
        with writer.lock:
            if self._fsync_failed:  # an empty dict's test: nothing added to the every-block path
                self._refuse_if_failed(writer.folder)
            if seq != writer.next_seq:
                raise ValueError(f"stream {stream!r}: block seq {seq} written, {writer.next_seq} expected")
            if first_offset < writer.next_offset:
                raise ValueError(
                    f"stream {stream!r}: block first_offset {first_offset} below {writer.next_offset}"
                )
            fd = self._segment_for(writer, seq)
            with writer.prepare_lock:  # waits for a prepare() still encoding
                prepared = writer.take_prepared(key) if key is not None else None
            if prepared is not None and prepared.direct == writer.direct:
                frame = prepared.frame
                padded = len(frame)
            else:
                payload = payload_size if isinstance(payload_size, int) else payload_size()
                producers_raw, padded = _frame_layout(block, payload, writer.direct)
                frame = writer.frame_buffer(padded)
                _build_frame(frame, block, producers_raw, payload, fill)
            before = writer.size
            try:
                _write_all(fd, frame[:padded], writer.direct)
                if self.fsync.mode == "every-block":
                    os.fsync(fd)
                _check_linked(fd, writer.segment)
            except BaseException:
                # leave no partial frame behind, so the retried block lands where this one began
                self._undo_append(writer, before)
                raise
            writer.size += padded
            writer.dirty = True
            writer.changes += 1
            if self.fsync.mode == "interval":
                writer.unsynced += padded
                if writer.unsynced >= SYNC_BYTES:
                    self._sync_wanted.set()
            writer.next_seq = seq + 1
            if self.fsync.mode != "interval":
                writer.durable_seq = writer.next_seq
            writer.next_offset = first_offset + count
            if producers:
                _merge_producers(writer.producers, producers)
        if self.fsync.mode == "interval":
            self._start_flusher()
        return BlockInfo(stream, seq, first_offset, count, receiver), padded

    def durable_seq(self, stream: str) -> int:
        """Every block of `stream` with a lower seq is durable: at once under "every-block" and "off",
        after the next background fsync under "interval" (its group commit: acks wait for it)."""
        with self._writers_lock:
            writer = self._writers.get(check_stream_name(stream))
        if writer is None:
            return 0
        with writer.lock:
            return writer.durable_seq

    def producers(self, stream: str) -> dict[str, int]:
        """Producer id -> the seq after its last record in the log (or released): the snapshot of the
        last release, updated by every frame still in the log. In the writing process, as of its last
        write; elsewhere, as read from disk now."""
        with self._writers_lock:
            writer = self._writers.get(check_stream_name(stream))
        if writer is not None:
            with writer.lock:
                return dict(writer.producers)
        table = dict(self._read_released(stream).producers)
        for _, segment in self._segments(self._folder(stream)):
            for frame in self._segment_frames(segment):
                with contextlib.suppress(OSError, ValueError, struct.error, UnicodeDecodeError):
                    _merge_producers(table, self._read_producers(segment, frame))
        return table

    def close(self) -> None:
        """Stop the background fsync (fsyncing what is pending) and close the segments (idempotent)."""
        self._closing.set()
        self._sync_wanted.set()  # wakes the flusher now
        if self._flusher is not None:
            self._flusher.join()
            self._flusher = None
        with self._writers_lock:
            writers = list(self._writers.values())
            self._writers.clear()
        failure: OSError | None = None
        for writer in writers:  # every one closed, though an fsync fails (raised after)
            with writer.lock:
                try:
                    self._close_writer(writer)
                except OSError as exc:
                    failure = failure or exc
        self._closing.clear()  # usable again: a later write recovers its stream first
        self._sync_wanted.clear()
        if failure is not None:
            raise failure

    # ---- reading (Spark side) ------------------------------------------------------------------

    def blocks(self, stream: str, from_seq: int = 0) -> list[BlockInfo]:
        folder = self._folder(stream)
        start = max(from_seq, self._read_released(stream).next_seq)
        segments = self._segments(folder)
        # a segment holds seqs from its name up to the next one's: skip those wholly below `start`
        first = 0
        for i, (name_seq, _) in enumerate(segments):
            if name_seq <= start:
                first = i
        found = []
        for _, path in segments[first:]:
            for frame in self._segment_frames(path):
                h = frame.header
                if h.seq >= start:
                    found.append(BlockInfo(stream, h.seq, h.first_offset, h.count, h.receiver))
        self._forget_index(folder, {path for _, path in segments})
        return found

    def extent(self, stream: str, below_seq: int | None = None) -> tuple[int, int] | None:
        """As blocks(stream) would give it (of its blocks below `below_seq`), from the first segment with
        unreleased blocks and the last ones alone: a metrics scrape, the status page and every commit
        asked it of each stream, and listing every block made that cost grow with the backlog (65 us a
        stream at 50 blocks)."""
        start = self._read_released(stream).next_seq
        segments = self._segments(self._folder(stream))
        first = 0
        for i, (name_seq, _) in enumerate(segments):
            if name_seq <= start:
                first = i
        head: _Header | None = None
        for _, path in segments[first:]:
            head = next((f.header for f in self._segment_frames(path) if f.header.seq >= start), None)
            if head is not None:
                break
        if head is None or (below_seq is not None and head.seq >= below_seq):
            return None
        for _, path in reversed(segments):
            frames = self._segment_frames(path)
            if below_seq is not None:
                frames = [f for f in frames if f.header.seq < below_seq]
            if frames:
                tail = frames[-1].header
                return head.first_offset, tail.first_offset + tail.count
        return None  # the segments went between the two looks (released meanwhile)

    def span(self, stream: str, below_seq: int | None = None) -> LogSpan | None:
        """span_of(blocks(stream)) (of its blocks below `below_seq`), from each segment's index: where
        its unreleased blocks begin and end and the gaps between, without going over every block (a
        completed batch's backlog, the status page and `sluice streams list` asked it of each stream:
        16 ms at 10,000 blocks). The index keeps each segment's gaps (_SegmentIndex.holes); those
        between segments are seen at their edges. A log out of order (never one recovery passed) is
        listed: span_of then keeps its blocks."""
        folder = self._folder(stream)
        start = self._read_released(stream).next_seq
        below = below_seq if below_seq is not None else 1 << 64
        head: _Header | None = None
        tail: _Header | None = None
        holes: list[tuple[int, int]] = []
        for path in _from_segment_of(self._segments(folder), start):
            index = self._segment_index(path)
            if not index.ordered:
                return self._listed_span(stream, below_seq)
            frames = index.frames
            lo, hi = _between(frames, start, below)
            if lo >= hi:
                continue
            h = frames[lo].header
            if tail is None:
                head = h
            else:
                end = tail.first_offset + tail.count
                if h.seq <= tail.seq or h.first_offset < end:
                    return self._listed_span(stream, below_seq)
                if h.first_offset > end:
                    holes.append((end, h.first_offset))
            if index.holes:
                holes.extend((a, b) for i, a, b in index.holes if lo < i < hi)
            tail = frames[hi - 1].header
        if head is None or tail is None:
            return None
        return LogSpan(head.first_offset, tail.first_offset + tail.count, tuple(holes))

    def _listed_span(self, stream: str, below_seq: int | None) -> LogSpan | None:
        blocks = self.blocks(stream)
        return span_of(blocks if below_seq is None else [b for b in blocks if b.seq < below_seq])

    def read(self, block: BlockInfo) -> Iterator[pa.RecordBatch]:
        path, frame = self._locate(block)
        h = frame.header
        body = self._read_frame(block, path, frame)
        reader = pa.ipc.open_stream(pa.py_buffer(body[h.producers_len :]))
        if reader.schema.equals(BLOCK_SCHEMA):
            yield from reader
        else:  # written before the timestamp was run-end encoded (or copied from such a node)
            yield from map(as_block_batch, reader)

    def _read_frame(self, block: BlockInfo, path: Path, frame: _Frame) -> memoryview:
        """The frame's bytes after its header, checked against its CRC and `block`."""
        h = frame.header
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            _refuse_broken_link(path)
            raise BlockNotFoundError(
                f"block {block.seq} of stream {block.stream!r} is no longer in the log (released?)"
            ) from None
        try:
            raw = os.pread(fd, h.frame_len, frame.offset)
        finally:
            os.close(fd)
        view = memoryview(raw)
        body = view[HEADER.size :]
        if len(raw) != h.frame_len or _frame_crc(view[: HEADER.size], [body]) != h.crc:
            raise CorruptBlockError(
                f"block {block.seq} of stream {block.stream!r} fails its checksum "
                f"({path.name} at offset {frame.offset}): the log is damaged"
            )
        if (h.first_offset, h.count) != (block.first_offset, block.count):
            raise CorruptBlockError(
                f"block {block.seq} of stream {block.stream!r} holds offsets {h.first_offset}+{h.count}, "
                f"not {block.first_offset}+{block.count}"
            )
        return body

    def read_raw(self, block: BlockInfo) -> RawBlock:
        """The block as stored: its producers table and its payload (an Arrow IPC stream), checked
        against its CRC, for a replica elsewhere (append_raw there)."""
        path, frame = self._locate(block)
        h = frame.header
        body = self._read_frame(block, path, frame)
        producers = _decode_producers(body[: h.producers_len])
        payload = bytes(body[h.producers_len :])
        return RawBlock(h.seq, h.first_offset, h.count, h.receiver, h.received_at, producers, payload)

    def block_producers(self, block: BlockInfo) -> dict[str, int]:
        """The producer marks written with `block` (its header's table; the payload is not read)."""
        path, frame = self._locate(block)
        return self._read_producers(path, frame)

    def truncate_from(self, stream: str, seq: int) -> tuple[int, int]:
        """Drop the blocks of `stream` with seq >= `seq` (never acked ones, on a restart of their owner:
        receivers.replication); return (blocks, records) dropped. The stream's writer is closed: the next
        recover() (or write) rebuilds its state, producers table included, from what is left.

        The blocks below `seq` (acked) are checked first, as recovery checks them (_check_below):
        damage to them raises DamagedLogError, or under accept_damage is gone past and recorded; damage
        from `seq` on is cut with the blocks it is in."""
        folder = self._folder(stream)
        self._drop_writer(stream)
        self._checked.pop(stream, None)
        blocks = records = 0
        if not folder.is_dir():
            return 0, 0
        self._check_below(stream, folder, seq)
        cut: list[tuple[Path, int]] = []
        # the newest first, and those segments' deletion durable before an older one is cut: a crash
        # midway leaves a log that ends early, never one with blocks missing before later ones (which
        # recovery refuses as damage)
        for name_seq, path in reversed(self._segments(folder)):
            frames = [f for f in self._segment_frames(path) if f.header.seq >= seq]
            blocks += len(frames)
            records += sum(f.header.count for f in frames)
            if name_seq >= seq and name_seq > 0:
                path.unlink(missing_ok=True)  # wholly past the cut (the first segment stays, emptied)
            elif frames:
                cut.append((path, frames[0].offset))
        if self.fsync.mode != "off":
            _fsync_path(folder)
        for path, at in cut:
            with open(path, "r+b") as file:
                file.truncate(at)
                if self.fsync.mode != "off":
                    os.fsync(file.fileno())
        self._forget_index(folder, set())
        return blocks, records

    def _check_below(self, stream: str, folder: Path, seq: int) -> None:
        """Recover the log of `stream` as far as block `seq`, before truncate_from cuts it there. Damage
        to a block below `seq` (acked) stops it with DamagedLogError, as it stops recovery, or for a
        stream of accept_damage is recorded as lost and mended (_accept); the first damage from `seq`
        on is in blocks never acked, all of them past it too: a damaged segment is cut at its bad frame
        here, and truncate_from drops the rest. Checked after the cut instead, the damage had lost what
        gave it away: with the later segments gone, an older segment's bad tail or a bad frame was the
        newest segment's torn tail (cut with a WARNING), a segment deleted the log's end, and new
        blocks were numbered over acked ones. Under --fsync off nothing is refused (as in recovery)."""
        if self.fsync.mode == "off":
            return
        stats = self.stream_stats(stream)
        frames_before = stats.frames_recovered
        accepted: set[tuple[int, str, int]] = set()
        self._acked_below[stream] = seq
        try:
            while True:
                stats.frames_recovered = frames_before  # counted by the recovery after the cut
                try:
                    writer = self._recover(stream, folder)
                except DamagedLogError as exc:
                    damage = exc.damage
                    if damage is not None and damage.first_seq >= seq:
                        if damage.segment is not None:
                            self._cut_uncommitted(stream, folder, damage)
                        return
                    if stream not in self.accept_damage or damage is None or damage.key in accepted:
                        raise
                    accepted.add(damage.key)
                    if not self._accept(stream, folder, damage):
                        raise
                else:
                    self._refuse_short_end(stream, folder, writer, seq)
                    # the recovery after the cut takes it when the cut changed nothing (_take_checked):
                    # the same pass over the same files, what it found the same (its checks here only
                    # stricter: it passed them)
                    frames = stats.frames_recovered - frames_before
                    self._checked[stream] = _Checked(writer, frames, _fingerprint(folder))
                    return
        finally:
            stats.frames_recovered = frames_before
            self._acked_below.pop(stream, None)

    def _refuse_short_end(self, stream: str, folder: Path, writer: _Writer, seq: int) -> None:
        """DamagedLogError (that accept_damage cannot go past) when the log holds blocks but ends before
        block `seq`, which its owner committed: the blocks between were acked and are gone from the
        log's end (its newest segments deleted, or a tail cut as torn that was durable). Numbered from
        the end, new blocks took seqs and offsets of acked blocks its followers hold, without a word;
        and where the next block begins is not known here, so the log cannot go on past them. A log
        without segments is a lost one, which the node goes on from its followers' copies
        (ingest.receiver_node's continue_logs)."""
        if writer.next_seq >= seq or not self._segments(folder):
            return
        first = writer.next_seq
        raise DamagedLogError(
            f"stream {stream!r}: the log in {folder} ends at block {first} (offset {writer.next_offset}), "
            f"but this node committed (acked) the blocks up to {seq - 1}: {_span('block', first, seq - 1)} "
            f"{_are(first, seq - 1)} gone from the end of the log (its newest segments deleted or "
            "damaged). Numbered from there, new blocks would take the seqs and offsets of acked blocks "
            "its followers hold, and where the next block begins is not known here, so --accept-wal-damage "
            "does not go past this. Restore the missing segments (a backup, or this node's blocks "
            "from a follower's copy, DATA_DIR/replicas/<this node's id>/"
            f"{stream}/ on that node), or move every segment of the stream out of {folder} and start "
            "again: the node then goes on from its followers' copies as after a lost log "
            "(docs/cluster.md)"
        )

    def _cut_uncommitted(self, stream: str, folder: Path, damage: _Damage) -> None:
        """Cut the segment `damage` names at its bad frame: that block and every one after it were
        never acked (truncate_from drops them)."""
        segment = damage.segment
        assert segment is not None
        with open(segment, "r+b") as file:
            file.truncate(damage.bad)
            os.fsync(file.fileno())
        self._forget_index(folder, set())
        log.warning(
            "stream %r: %s, in blocks never committed (never acked): cut with them",
            stream,
            damage.where,
        )

    def released_offset(self, stream: str) -> int:
        """The record offset after the last block released so far (0: none)."""
        return self._read_released(stream).next_offset

    def released_seq(self, stream: str) -> int:
        """The seq after the last block released so far (0: none)."""
        return self._read_released(stream).next_seq

    def skipped_to(self, stream: str) -> int:
        """The seq where the log of `stream` went on after it was last lost (skip_to): it never held
        the blocks below. 0: it was never lost."""
        return self._read_released(stream).skipped_to

    def released_producers(self, stream: str) -> dict[str, int]:
        """The producers table of the blocks released so far (the released mark's)."""
        return dict(self._read_released(stream).producers)

    def skip_to(
        self,
        stream: str,
        seq: int,
        offset: int,
        producers: Mapping[str, int] | None = None,
        *,
        read_to: int = 0,
    ) -> None:
        """Continue the log of `stream` at block `seq` and record `offset`: what the log held is
        dropped; the released mark keeps the numbering and the producers. For a node whose own log was
        lost (ReceiverNode.continue_logs: it holds nothing before `seq` and never will); a copy that
        misses blocks keeps what it holds (continue_at). Writing process only.

        The records skipped are not counted as read: known_released_offset() stays where this log's
        releases ended, or at `read_to` (where the copies' releases end: Spark read what is below it)
        if that is further, until release_lost() moves it. Taken for released, they let a query
        without a checkpoint start past acked records that only a copy on another node held."""
        writer = self._writer(stream)
        with writer.lock:
            self._refuse_if_failed(writer.folder)
            if seq <= writer.next_seq:
                return
            writer.folder.mkdir(parents=True, exist_ok=True)
            with self._mark_lock(writer.folder):
                released = self._read_released(stream, fresh=True)
                table = dict(released.producers)
                _merge_producers(table, writer.producers)
                _merge_producers(table, producers or {})
                self._close_writer(writer)
                next_offset = max(offset, released.next_offset)
                known = released.lost_from if released.lost_from is not None else released.next_offset
                lost_from = max(known, read_to)
                state = _Released(
                    max(seq, released.next_seq),
                    next_offset,
                    table,
                    lost_from if lost_from < next_offset else None,
                    max(seq, released.skipped_to),
                )
                self._write_released(writer.folder, state)
                for _, path in self._segments(writer.folder):
                    path.unlink(missing_ok=True)
                self._forget_index(writer.folder, set())
                writer.segment, writer.size = None, 0
                writer.next_seq, writer.next_offset = state.next_seq, state.next_offset
                writer.durable_seq = writer.next_seq
                writer.producers = dict(table)

    def continue_at(self, stream: str, seq: int, offset: int) -> None:
        """Continue the log of `stream` at block `seq` and record `offset`, keeping every block it holds
        and releasing nothing: the blocks between were never written here (a copy whose owner no longer
        has them to send: Spark released them there, or the owner's log was lost). The log then has a
        gap, which readers see as blocks missing (a release removes what is below it as usual). Nothing
        is written until the next block, which is appended after the gap; a restart before it forgets
        the gap, and the owner sends that block again. Writing process only."""
        writer = self._writer(stream)
        with writer.lock:
            self._refuse_if_failed(writer.folder)
            if seq <= writer.next_seq:
                return
            if offset < writer.next_offset:
                raise ValueError(
                    f"stream {stream!r}: block {seq} at offset {offset}, below {writer.next_offset}"
                )
            self._close_writer(writer)  # what the interval policy has not synced yet is synced now
            writer.next_seq, writer.next_offset = seq, offset
            writer.durable_seq = seq

    def known_released_offset(self, stream: str) -> int:
        """The offset below which every record of `stream` was released (read) as far as this log
        knows: released_offset(), or lower after a lost log (skip_to), whose skipped records were
        never released here and may still be unread (copies on other nodes hold those)."""
        released = self._read_released(stream)
        return released.next_offset if released.lost_from is None else released.lost_from

    def release_lost(self, stream: str, before_offset: int) -> None:
        """Every record of `stream` below `before_offset` was read (Spark committed it): the records a
        lost log skipped (skip_to) count as released up to there, all of them once it reaches the
        skip. Nothing is deleted (the log holds none of them). Idempotent."""
        folder = self._folder(stream)
        if not folder.is_dir():
            return
        with self._release_lock, self._mark_lock(folder):
            released = self._read_released(stream, fresh=True)
            if released.lost_from is None or before_offset <= released.lost_from:
                return
            lost_from = before_offset if before_offset < released.next_offset else None
            self._write_released(folder, replace(released, lost_from=lost_from))

    def release(self, stream: str, before_seq: int) -> int:
        folder = self._folder(stream)
        if not folder.is_dir():
            return 0  # nothing was ever written
        # two processes release (the server on Spark's progress, Spark's worker in commit()), and the
        # writer trims: read, merge and write the mark and delete segments as one step under the lock
        with self._release_lock, self._mark_lock(folder):
            released = self._read_released(stream, fresh=True)
            doomed_blocks = [b for b in self.blocks(stream) if b.seq < before_seq]
            if not doomed_blocks:
                return 0
            segments = self._segments(folder)
            # every block of a segment is below the next segment's name; the newest is never deleted
            doomed = [
                path for (_, path), (next_name, _) in itertools.pairwise(segments) if next_name <= before_seq
            ]
            table = dict(released.producers)
            for path in doomed:
                for frame in self._segment_frames(path):
                    _merge_producers(table, self._read_producers(path, frame))
            last = doomed_blocks[-1]
            # never backwards (blocks() hides what the mark covers, so `last` is above it anyway)
            state = _Released(
                max(released.next_seq, last.seq + 1),
                max(released.next_offset, last.end_offset),
                table,
                released.lost_from,
                released.skipped_to,
            )
            self._write_released(folder, state)
            for path in doomed:
                path.unlink(missing_ok=True)
            if doomed and self.fsync.mode != "off":
                _fsync_path(folder)
            self._forget_index(folder, {p for _, p in segments} - set(doomed))
        return len(doomed_blocks)

    def trim(self, stream: str) -> int:
        """In the writing process: delete the newest segment of `stream` when every block in it has been
        released (release() never deletes the newest one), first writing the released mark with the
        whole producers table so that it survives the segment. Return the bytes freed (0: nothing)."""
        with self._writers_lock:
            writer = self._writers.get(check_stream_name(stream))
        if writer is None:
            return 0
        with writer.lock:
            if writer.segment is None:
                return 0
            with self._mark_lock(writer.folder):
                released = self._read_released(stream, fresh=True)
                if released.next_seq < writer.next_seq:
                    return 0  # blocks in it are not released yet (or there are none released at all)
                try:
                    size = _file_size(writer.segment)
                except FileNotFoundError:
                    size = 0
                table = dict(released.producers)
                _merge_producers(table, writer.producers)
                if table != released.producers:
                    self._write_released(writer.folder, replace(released, producers=table))
                self._close_writer(writer)
                segment, writer.segment, writer.size = writer.segment, None, 0
                segment.unlink(missing_ok=True)
                if self.fsync.mode != "off":
                    _fsync_path(writer.folder)
                self._forget_index(writer.folder, set())
        log.debug("stream %r: dropped segment %s: every block in it is released", stream, segment.name)
        return size

    def deleted_folders(self, streams: Iterable[str]) -> list[Path]:
        """The folders of `streams` (those served) that this process writes and that were deleted or
        replaced since (`rm -rf` of the block log while the server runs): the log makes none of them
        again (_segment_for), so nothing more of those streams can be made durable. A folder that
        cannot be looked at (permissions) is not taken for deleted."""
        wanted = set(streams)
        with self._writers_lock:
            writers = [w for s, w in self._writers.items() if s in wanted]
        deleted = []
        for writer in writers:
            if writer.folder_id is None:
                continue
            try:
                now = _path_id(writer.folder)
            except OSError:
                continue
            if now != writer.folder_id:
                deleted.append(writer.folder)
        return deleted

    def stream_names(self) -> list[str]:
        """The streams with a folder in the store (whatever they hold), sorted; folders whose name is
        not a stream's are not among them."""
        return stream_folders(self.root)

    def disk_bytes(self, stream: str | None = None) -> int:
        """Bytes the log's segments take on disk: of one stream, or of all. Not the bookkeeping beside
        them (released.json, the lock, a mark's temp file): release() cannot free it, and counted against
        a disk budget below it (`config set disk-budget=1`) it held credit paused for good."""
        folders = [self._folder(stream)] if stream is not None else _subfolders(self.root)
        total = 0
        for folder in folders:
            try:
                entries = list(os.scandir(folder))
            except FileNotFoundError:
                continue
            for entry in entries:
                if not _SEGMENT_NAME.match(entry.name):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_file():  # a segment linked elsewhere too: the log reads and appends there
                        total += entry.stat().st_size
        return total

    # ---- identity -------------------------------------------------------------------------------

    def incarnation(self, stream: str) -> str:
        """The identity of the log of `stream` (its incarnation), "" when it has none (a log made
        before incarnations were kept, or a copy not told its owner's yet). IncarnationError when the
        file is there but cannot be read or holds no incarnation (damage: never taken for none).
        Blocking."""
        path = self._folder(stream) / INCARNATION_FILE
        try:
            text = read_regular(path).decode("ascii").strip()
        except (FileNotFoundError, NotADirectoryError):
            return ""
        except OSError as exc:
            raise self._bad_incarnation(stream, path, f"cannot be read ({exc.strerror})") from None
        except UnicodeDecodeError:
            raise self._bad_incarnation(stream, path, "holds bytes that are not text") from None
        if not valid_incarnation(text):
            shown = repr(text[:40]) if text else "nothing"
            raise self._bad_incarnation(stream, path, f"holds {shown}, not an incarnation")
        return text

    def _bad_incarnation(self, stream: str, path: Path, why: str) -> IncarnationError:
        return IncarnationError(
            f"{path} (the identity, or incarnation, of the block log of stream {stream!r}) {why}: restore "
            "the file (one line, the id a query's checkpoint names under _incarnations), or remove it "
            "to have the log take a new identity, which a query whose checkpoint read this log then "
            "takes for a lost log (DataLossError, docs/durability.md)"
        )

    def ensure_incarnation(self, stream: str) -> str:
        """The incarnation of the log of `stream`, made (a random 128-bit id) if it has none: an owner's
        log gets one when it is first created on a node, and keeps it in its folder, so a log lost and
        started afresh (an empty data dir, a new disk) gets another, and offsets of the two are never
        taken for each other (Kafka's topic id, or a partition's leader epoch, serve the same end).
        A log from before incarnations (segments, no file) gets one too. A damaged file
        (IncarnationError) is replaced only while the stream has no segments; beside a log it is
        raised: a new id would make a surviving checkpoint take the log for a lost one. Blocking."""
        try:
            current = self.incarnation(stream)
        except IncarnationError:
            if self._segments(self._folder(stream)):
                raise
            current = ""
        if current:
            return current
        made = uuid.uuid4().hex
        self.set_incarnation(stream, made)
        return made

    def set_incarnation(self, stream: str, incarnation: str) -> None:
        """Record the incarnation of the log of `stream` (a copy takes its owner's; an owner going on
        from a copy of its lost log takes the copy's), durably. Blocking."""
        if not valid_incarnation(incarnation):
            raise ValueError(f"invalid incarnation {incarnation!r}")
        folder = self._folder(stream)
        made = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        if made and self.fsync.mode != "off":
            _fsync_path(folder.parent)
        with self._writers_lock:
            writer = self._writers.get(stream)
        if writer is not None and writer.folder_id is None:  # made here: a deletion is noticed too
            writer.folder_id = _path_id(folder)
        self._replace_file(folder, INCARNATION_FILE, incarnation)

    def set_aside(self, stream: str, root: Path) -> Path | None:
        """Move the whole log of `stream` (segments, released mark, incarnation) to `root`/<stream>, a
        log this class reads as it is (WalBlockStore(root).blocks(stream)); this store then holds an
        empty log of `stream`. None when there was no folder. For a copy of another incarnation of its
        owner's log (receivers.replica_store): it may hold the only copy of acked records. Blocking."""
        folder = self._folder(stream)
        self._drop_writer(stream)
        if not folder.is_dir():
            return None
        dest = root / folder.name
        root.mkdir(parents=True, exist_ok=True)
        os.rename(folder, dest)
        if self.fsync.mode != "off":
            _fsync_path(root)
            _fsync_path(folder.parent)
        self._forget_index(folder, set())
        self._released.pop(stream, None)
        return dest

    # ---- recovery ------------------------------------------------------------------------------

    def _recover(self, stream: str, folder: Path) -> _Writer:
        stats = self.stream_stats(stream)
        released = self._read_released(stream)
        next_seq, next_offset = released.next_seq, released.next_offset
        producers = dict(released.producers)
        if not folder.is_dir():
            writer = _Writer(folder, next_seq, next_offset, producers, None, 0)
            writer.durable_seq = next_seq
            return writer
        with self._mark_lock(folder):  # a temp file of a release in progress elsewhere is no leftover
            for name in os.listdir(folder):
                if _TEMP_FILE.match(name):
                    (folder / name).unlink(missing_ok=True)
        if any(name.endswith(".arrow") for name in os.listdir(folder)):
            log.warning(
                "stream %r: %s holds .arrow block files of the old file-per-block store; the log does "
                "not read them",
                stream,
                folder,
            )
        segments = self._segments(folder)
        last_seq = -1
        newest_path: Path | None = None
        newest_size = 0
        emptied = []
        # the next block the log must hold: blocks below the released mark may be gone (Spark read them)
        expect = _Expected(
            released.next_seq,
            released.next_offset,
            released.next_seq,
            released.next_offset,
            None,
            not released.damaged,
        )
        for i, (name_seq, path) in enumerate(segments):
            newest = i == len(segments) - 1
            next_seq = max(next_seq, name_seq)
            later = [p for _, p in segments[i + 1 :]]
            try:
                size, frames, last_seq = self._check_segment(path, last_seq, producers, stats)
                self._refuse_missing(
                    stream, path=path, name_seq=name_seq, frames=frames, expect=expect, later=later
                )
                self._refuse_if_intact_after(
                    stream,
                    path,
                    size,
                    last_seq,
                    later,
                    name_seq=name_seq,
                    frames=frames,
                    expect=expect,
                    next_name=None if newest else segments[i + 1][0],
                )
                if size < _file_size(path) or (not frames and not newest):
                    self._cut(
                        stream=stream,
                        path=path,
                        good=size,
                        next_name=None if newest else segments[i + 1][0],
                        frames=frames,
                        name_seq=name_seq,
                        released=released.next_seq,
                        stats=stats,
                        later=later,
                        expect=expect,
                        last_seq=last_seq,
                    )
            except FileNotFoundError:
                # released meanwhile (by Spark, in another process); a symlink to nowhere named as a
                # segment is not that: open_regular raised BrokenLinkError, which stops the recovery
                continue
            if frames:
                next_offset = max(next_offset, frames[-1].header.first_offset + frames[-1].header.count)
                next_seq = max(next_seq, last_seq + 1)
            if size == 0 and not newest:
                emptied.append(path)
            newest_path, newest_size = path, size
        # an emptied segment other than the newest holds nothing: remove it
        for path in emptied:
            path.unlink(missing_ok=True)
            stats.segments_removed += 1
        if segments:
            self._sync_recovered(folder)
        self._forget_index(folder, set())
        next_seq, next_offset = self._past_recorded_loss(stream, next_seq, next_offset)
        writer = _Writer(folder, next_seq, next_offset, producers, newest_path, newest_size)
        writer.durable_seq = next_seq
        writer.folder_id = _path_id(folder)
        return writer

    def _sync_recovered(self, folder: Path) -> None:
        if self.fsync.mode == "interval":
            # frames a crashed process wrote may sit unsynced in the page cache: make them durable
            # before they count as such (under "every-block" each was fsynced before its ack)
            for _, path in self._segments(folder):
                with contextlib.suppress(FileNotFoundError):
                    _fsync_path(path)
        if self.fsync.mode != "off":
            _fsync_path(folder)

    def _check_segment(
        self, path: Path, last_seq: int, producers: dict[str, int], stats: WalStats
    ) -> tuple[int, list[_Frame], int]:
        """Validate the frames of a segment: (bytes that are good, the good frames, last good seq)."""
        frames: list[_Frame] = []
        with open(open_regular(path), "rb") as file:  # a FIFO named as a segment: refused, not waited on
            size = os.fstat(file.fileno()).st_size
            pos = 0
            while pos < size:
                frame = _valid_frame(file.fileno(), pos, size, last_seq)
                if frame is None:
                    break
                header, table = frame
                frames.append(_Frame(pos, header))
                _merge_producers(producers, table)
                last_seq = header.seq
                pos += header.frame_len
        stats.frames_recovered += len(frames)
        return pos, frames, last_seq

    def _refuse_missing(
        self,
        stream: str,
        *,
        path: Path,
        name_seq: int,
        frames: list[_Frame],
        expect: _Expected,
        later: list[Path],
    ) -> None:
        """DamagedLogError if blocks that were never released are missing before `path` or between its
        frames (a segment deleted or lost): a segment is named after its first block and each block
        follows the one before, so such a gap is not a crash's trace but acknowledged blocks gone, which
        the log went on without a word (and Spark's offsets with it). Under "off" (no fsync: a power loss
        can take any part of the log) an ERROR names them and recovery goes on. A copy (`gaps`) skips
        the check: it goes on after gaps by design (continue_at)."""
        if self.gaps:
            return
        # a segment without frames (the newest, made at a crash right before its first block) still
        # says, by its name, that every block before it was written
        found: list[tuple[int, int | None, int | None]] = [
            (f.header.seq, f.header.first_offset, f.header.first_offset + f.header.count) for f in frames
        ]
        for seq, first_offset, end in found or [(name_seq, None, None)]:
            # a release (Spark's commit, in another process) may have moved the mark and deleted the
            # segments below it while this read the log: the mark is written before the deletes, so
            # read now it covers every segment missing for that reason
            if expect.known and seq > expect.seq and self._read_released(stream, fresh=True).next_seq < seq:
                if self._recorded_lost(stream, expect, seq):
                    expect.seq = seq  # the frame of `seq` follows: not a gap twice
                else:
                    self._missing(
                        stream, path=path, expect=expect, seq=seq, first_offset=first_offset, later=later
                    )
            if end is not None:
                expect.passed(seq + 1, end, path)

    def _missing(
        self,
        stream: str,
        *,
        path: Path,
        expect: _Expected,
        seq: int,
        first_offset: int | None,
        later: list[Path],
    ) -> None:
        """Blocks expect.seq..seq-1 are missing before the frame of `seq` in `path`: refuse, or (under
        "off") log it."""
        records = (
            _span("record", expect.offset, first_offset - 1)
            if first_offset is not None and first_offset > expect.offset
            else f"records from offset {expect.offset}"
        )
        if expect.after is None:
            where = (
                f"before {path.name}, the oldest segment (the released mark, {STATE_FILE}, is at block "
                f"{expect.released_seq}: every block from there on was never released)"
            )
        elif expect.after == path:
            where = f"inside {path.name}, before block {seq}"
        else:
            where = f"between segments {expect.after.name} and {path.name}"
        if self.fsync.mode == "off":
            log.error(
                "stream %r: the log is damaged: %s (%s) %s missing %s: lost (under --fsync off a "
                "power loss may take any part of the log)",
                stream,
                _span("block", expect.seq, seq - 1),
                records,
                _are(expect.seq, seq - 1),
                where,
            )
            self.stream_stats(stream).blocks_lost += seq - expect.seq
            expect.seq = seq  # the frame of `seq` follows: not a gap twice
            return
        move = [path, *later]
        damage = _Damage(expect.seq, expect.offset, f"missing from the log {where}", seq, first_offset)
        raise DamagedLogError(
            f"stream {stream!r}: {_span('block', expect.seq, seq - 1)} ({records}) "
            f"{_are(expect.seq, seq - 1)} missing from the log in "
            f"{path.parent}, {where}: a segment of acknowledged blocks that were never released was "
            "deleted or lost, not the torn tail a crash leaves, so the log does not go on without them. "
            "Restore the missing segment (a backup, a replica's copy), or move "
            + (f"{path.name} and every later segment ({len(move)} files)" if later else path.name)
            + " out of the folder and start again: their blocks are then lost too, and the log goes on "
            f"at block {expect.seq}; or start once with --accept-wal-damage {stream} to go on without "
            "the missing blocks alone, keeping the blocks after them (docs/durability.md)",
            damage,
        )

    def _refuse_lost_blocks(
        self,
        stream: str,
        *,
        path: Path,
        good: int,
        frames: list[_Frame],
        name_seq: int,
        next_name: int | None,
        released: int,
        later: list[Path],
        expect: _Expected,
        last_seq: int,
    ) -> None:
        """DamagedLogError if cutting the older segment `path` at `good` loses blocks that were never
        released (the later segments start past them). Under "every-block" each block was fsynced before
        the next one was written, and under "interval" a segment is fsynced whole before the next one is
        made: an older segment is on disk whole before a later one exists, so a bad frame in it is damage
        to acknowledged blocks, not a torn tail. (A failed write whose undo failed leaves bytes at the end
        of a segment and goes on in a new one named after that very block: cut, nothing lost.) Under
        "off" a power loss may leave an older segment's tail unwritten while a later one is on disk:
        cut, with the ERROR _cut logs."""
        if self.gaps or self.fsync.mode == "off" or next_name is None:
            return
        lost_from = max(frames[-1].header.seq + 1 if frames else name_seq, released)
        if next_name <= lost_from:
            return
        after = f"after block {frames[-1].header.seq}" if frames else "its first block"
        damage = _Damage(
            lost_from,
            expect.offset,
            f"the log segment {path.name} is damaged at byte {good:,} ({after})",
            next_name,
            segment=path,
            bad=good,
            last_seq=last_seq,
            next_segment=later[0],
        )
        raise DamagedLogError(
            f"stream {stream!r}: the log segment {path} is damaged at byte {good:,} ({after}): "
            f"{_span('block', lost_from, next_name - 1)} {_are(lost_from, next_name - 1)} "
            f"not whole in it, and the later segment {later[0].name} "
            f"starts at block {next_name}. Under --fsync {self.fsync} a segment is on disk whole before "
            "the next one is made, so this is not the torn tail a crash leaves but damage to acknowledged "
            "blocks, and it is not cut. Keep a copy of the segment, then restore it (a backup, a "
            f"replica's copy), or move it and every later segment ({1 + len(later)} files) out of the "
            "folder and start again: their blocks are then lost, and the log goes on after the blocks "
            f"before it; or start once with --accept-wal-damage {stream} to go on without the damaged "
            "blocks alone, keeping the blocks after them (docs/durability.md)",
            damage,
        )

    def _refuse_if_intact_after(
        self,
        stream: str,
        path: Path,
        bad: int,
        last_seq: int,
        later: Sequence[Path],
        *,
        name_seq: int,
        frames: list[_Frame],
        expect: _Expected,
        next_name: int | None,
    ) -> None:
        """DamagedLogError if the segment's good part ends at `bad` and sound frames follow. Under
        "every-block" a block is written only after the one before it was fsynced, so a crash can tear
        the last frame alone: a bad frame with sound ones after it is damage (a bad sector, a stray
        write), and cutting there would delete acked blocks that are intact. (Under "interval" or
        "off" the frames after the last fsync were never acked and a power loss may leave them in any
        state: cut as before, in the newest segment; _refuse_lost_blocks refuses an older one's. But
        not those below the committed seq of a cluster's owner, _check_below's `acked_below`: acked.)"""
        acked_below = self._acked_below.get(stream)
        if bad >= _file_size(path) or (self.fsync.mode != "every-block" and acked_below is None):
            return
        intact = [f.header for f in _intact_after(path, bad, last_seq)]
        if self.fsync.mode != "every-block":
            intact = [h for h in intact if acked_below is not None and h.seq < acked_below]
        if intact:
            move = f"it and every later segment ({1 + len(later)} files)" if later else "it"
            lost_from = max(frames[-1].header.seq + 1 if frames else name_seq, expect.released_seq)
            after = f"after block {frames[-1].header.seq}" if frames else "its first block"
            damage = _Damage(
                lost_from,
                expect.offset,
                f"the log segment {path.name} is damaged at byte {bad:,} ({after})",
                next_name,
                segment=path,
                bad=bad,
                last_seq=last_seq,
                next_segment=later[0] if later else None,
            )
            found = (
                f"stream {stream!r}: the log segment {path} is damaged at byte {bad:,} (the block after "
                f"seq {last_seq}) and {len(intact)} intact "
                + ("block follows" if len(intact) == 1 else "blocks follow")
                + f" it ({_span('seq', intact[0].seq, intact[-1].seq)}): not the torn tail a crash "
                "leaves, but damage to acknowledged blocks, so it is not cut. "
            )
            if self.gaps:  # a copy of another node's log (receivers.replica_store): not --accept-wal-damage's
                raise DamagedLogError(
                    found + "This is a copy of another node's log, which --accept-wal-damage (for this "
                    f"node's own log) does not touch: move the copy's folder, {path.parent}, out of "
                    f"{path.parent.parent} and this node takes a new copy from its owner (keep it until "
                    "the owner's log is known sound: it may hold acked blocks no other node does)",
                )
            raise DamagedLogError(
                found + "Keep a copy of the segment, then restore it (a backup, a "
                f"replica's copy), or move {move} out of the folder and start again: their blocks are "
                "then lost, and the log goes on after the blocks before it; or start once with "
                f"--accept-wal-damage {stream} to go on without the damaged blocks alone, keeping the "
                "intact ones (docs/durability.md)",
                damage,
            )

    def _cut(
        self,
        *,
        stream: str,
        path: Path,
        good: int,
        next_name: int | None,
        frames: list[_Frame],
        name_seq: int,
        released: int,
        stats: WalStats,
        later: list[Path],
        expect: _Expected,
        last_seq: int,
    ) -> None:
        """Cut `path` at `good` (a torn or bad tail), or refuse to (_refuse_lost_blocks)."""
        self._refuse_lost_blocks(
            stream,
            path=path,
            good=good,
            frames=frames,
            name_seq=name_seq,
            next_name=next_name,
            released=released,
            later=later,
            expect=expect,
            last_seq=last_seq,
        )
        size = _file_size(path)
        cut = size - good
        if cut > 0:
            with open(path, "r+b") as file:
                file.truncate(good)
                if self.fsync.mode != "off":
                    os.fsync(file.fileno())
            stats.corrupt_tails_truncated += 1
            stats.bytes_truncated += cut
            log.warning(
                "stream %r: segment %s has a bad or incomplete frame at offset %d: truncated %d bytes",
                stream,
                path.name,
                good,
                cut,
            )
        # blocks Spark already committed (below the released mark) are no loss
        lost_from = max(frames[-1].header.seq + 1 if frames else name_seq, released)
        if next_name is not None and next_name > lost_from:
            log.error(
                "stream %r: the log is damaged: %s of segment %s %s lost",
                stream,
                _span("block", lost_from, next_name - 1),
                path.name,
                _are(lost_from, next_name - 1),
            )
            stats.blocks_lost += next_name - lost_from
        if next_name is not None:  # the blocks cut, if any, were named in that ERROR: no gap after it
            expect.passed(next_name, expect.offset, path)

    # ---- going on past damage (accept_damage) ----------------------------------------------------

    def lost_blocks(self, stream: str) -> list[LostBlocks]:
        """The blocks of `stream` that starts with `accept_damage` went on without (LOST_FILE), in the
        order recorded; LostFileError when the file is there but cannot be read."""
        folder = self._folder(stream)
        path = folder / LOST_FILE
        try:
            data = parse_json(read_regular(path))  # a file nested too deeply is damage too
            return [
                LostBlocks(
                    int(entry["first_seq"]),
                    int(entry["end_seq"]),
                    int(entry["first_offset"]),
                    None if entry.get("end_offset") is None else int(entry["end_offset"]),
                    str(entry.get("at", "")),
                )
                for entry in data["lost"]
            ]
        except (FileNotFoundError, NotADirectoryError):
            _refuse_broken_link(path)
            return []
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            why = (
                "holds bytes that are not text"
                if isinstance(exc, UnicodeDecodeError)
                else "is not what Sluice writes"
            )
            raise self._bad_lost_file(stream, path, why) from None
        except OSError as exc:
            raise self._bad_lost_file(stream, path, f"cannot be read ({exc.strerror})") from None

    def _bad_lost_file(self, stream: str, path: Path, why: str) -> LostFileError:
        return LostFileError(
            f"{path} (the blocks of stream {stream!r} that a start with --accept-wal-damage went on "
            f"without) {why}: restore it, or remove it; the gaps it recorded are then refused as damage "
            f"again, until a start with --accept-wal-damage {stream} records them again"
        )

    def _write_lost(self, folder: Path, lost: Sequence[LostBlocks]) -> None:
        self._replace_file(folder, LOST_FILE, json.dumps({"lost": [asdict(r) for r in lost]}, indent=1))

    def _recorded_lost(self, stream: str, expect: _Expected, seq: int) -> bool:
        """Whether blocks expect.seq..seq-1, missing from the log, were recorded as lost (LOST_FILE): a
        gap a start with accept_damage went on past. A WARNING names it, unless this process did."""
        first = expect.seq
        recorded = self.lost_blocks(stream)
        if not _covers(recorded, first, seq):
            return False
        if not _covers(self._accepted.get(stream, []), first, seq):
            named = [r for r in recorded if r.first_seq < seq and r.end_seq > first]
            log.warning(
                "stream %r: %s %s not in the log: lost at a start with --accept-wal-damage (%s, recorded "
                "in %s); a Spark query that reaches them takes them for data loss (failOnDataLoss)",
                stream,
                "; ".join(f"{_span('block', r.first_seq, r.end_seq - 1)} ({r.records()})" for r in named),
                _are(first, seq - 1) if len(named) == 1 else "are",
                ", ".join(sorted({r.at for r in named if r.at})) or "earlier",
                self._folder(stream) / LOST_FILE,
            )
            self._accepted.setdefault(stream, []).extend(named)
        return True

    def _past_recorded_loss(self, stream: str, next_seq: int, next_offset: int) -> tuple[int, int]:
        """(next seq, next offset) past every block recorded as lost whose end is known: the log may end
        inside such a gap (a cluster's owner cut the blocks after it, never acked: truncate_from), and
        the lost blocks' seqs and offsets were given (acked, held by its followers). A LOST_FILE that
        cannot be read changes nothing here (the gap checks refuse it where they need it)."""
        if not (self._folder(stream) / LOST_FILE).exists():
            return next_seq, next_offset
        with contextlib.suppress(LostFileError):
            for lost in self.lost_blocks(stream):
                if lost.end_seq > next_seq and lost.end_offset is not None:
                    next_seq, next_offset = lost.end_seq, max(next_offset, lost.end_offset)
        return next_seq, next_offset

    def _accept(self, stream: str, folder: Path, damage: _Damage) -> bool:
        """Go on past `damage` (a stream of accept_damage), keeping every sound block after it: keep a
        copy of a damaged segment as it is under DAMAGED_FOLDER, record the blocks lost in LOST_FILE,
        then mend the log so that it is sound but for a gap where they were (_mend). An ERROR names the
        blocks and records lost, and they are counted (stats.blocks_lost). False: recovery cannot go on
        past it (nothing follows the damage)."""
        split, end_seq, end_offset = self._resume_after(damage)
        if end_seq is None:
            return False
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        lost = (
            LostBlocks(damage.first_seq, end_seq, damage.first_offset, end_offset, at)
            if end_seq > damage.first_seq
            else None
        )
        kept = self._mend(stream, folder, damage, split, lost)
        then = f"; the damaged segment as it was is kept in {kept}" if kept is not None else ""
        if split is not None:
            moved = f"{split.header.seq:020d}{SEGMENT_SUFFIX}"
            then += f"; the sound blocks after the damage moved to segment {moved}"
        if lost is None:
            log.warning(
                "stream %r: --accept-wal-damage: %s, where every block was released already: nothing "
                "is lost%s",
                stream,
                damage.where,
                then,
            )
            return True
        log.error(
            "stream %r: --accept-wal-damage: %s (%s) %s lost: %s. Recorded in %s; "
            "the log goes on with the blocks after them (from block %d)%s",
            stream,
            _span("block", lost.first_seq, lost.end_seq - 1),
            lost.records(),
            _are(lost.first_seq, lost.end_seq - 1),
            damage.where,
            folder / LOST_FILE,
            lost.end_seq,
            then,
        )
        self.stream_stats(stream).blocks_lost += lost.end_seq - lost.first_seq
        self._accepted.setdefault(stream, []).append(lost)
        return True

    def _resume_after(self, damage: _Damage) -> tuple[_Frame | None, int | None, int | None]:
        """Where the log goes on after `damage`: (the first sound frame after the bad one in a damaged
        segment, if any; the seq and the first record of the block the loss ends at, None where that is
        not known)."""
        end_seq, end_offset = damage.next_seq, damage.next_offset
        segment = damage.segment
        if segment is None:
            return None, end_seq, end_offset
        intact = _intact_after(segment, damage.bad, damage.last_seq)
        below = end_seq if end_seq is not None else 1 << 64
        if intact and int(segment.name[:20]) < intact[0].header.seq < below:
            split = intact[0]
            return split, split.header.seq, split.header.first_offset
        if damage.next_segment is not None:
            head = next(iter(self._segment_frames(damage.next_segment)), None)
            end_offset = head.header.first_offset if head is not None else None
        return None, end_seq, end_offset

    def _mend(
        self, stream: str, folder: Path, damage: _Damage, split: _Frame | None, lost: LostBlocks | None
    ) -> Path | None:
        """Keep a copy of the damaged segment, record `lost`, move the frames from `split` on to a
        segment of their own and cut the damaged one at the bad frame (remove it when nothing before
        that was sound). Each step is durable before the next: a crash midway leaves the damage there
        (refused again, or mended again by the next start with accept_damage), never a gap that is not
        recorded. The copy's path (None: no segment was damaged)."""
        sync = self.fsync.mode != "off"
        segment = damage.segment
        kept: Path | None = None
        with self._mark_lock(folder):
            if segment is not None:
                kept = self._keep_damaged(folder, segment, damage.bad)
            if lost is not None:
                key = (lost.first_seq, lost.end_seq)
                recorded = [r for r in self.lost_blocks(stream) if (r.first_seq, r.end_seq) != key]
                self._write_lost(folder, [*recorded, lost])
            if segment is None:
                return None
            if split is not None:
                moved = folder / f"{split.header.seq:020d}{SEGMENT_SUFFIX}"
                _copy_from(segment, split.offset, moved, sync=sync)
            if damage.bad == 0:
                segment.unlink()
            else:
                with open(segment, "r+b") as file:
                    file.truncate(damage.bad)
                    if sync:
                        os.fsync(file.fileno())
            if sync:
                _fsync_path(folder)
        self._forget_index(folder, set())
        return kept

    def _keep_damaged(self, folder: Path, segment: Path, bad: int) -> Path:
        """A copy of `segment` under DAMAGED_FOLDER, named after it and the damaged byte (made again
        when a start mended nothing after making it: the same bytes)."""
        kept_in = folder / DAMAGED_FOLDER
        made = not kept_in.is_dir()
        kept_in.mkdir(exist_ok=True)
        sync = self.fsync.mode != "off"
        if made and sync:
            _fsync_path(folder)
        kept = kept_in / f"{segment.name}.at-{bad}"
        _copy_from(segment, 0, kept, sync=sync)
        if sync:
            _fsync_path(kept_in)
        return kept

    # ---- appending -----------------------------------------------------------------------------

    def _writer(self, stream: str) -> _Writer:
        with self._writers_lock:
            writer = self._writers.get(check_stream_name(stream))
        if writer is None:
            self.recover(stream)
            with self._writers_lock:
                writer = self._writers[stream]
        return writer

    def _segment_for(self, writer: _Writer, seq: int) -> int:
        """The fd to append block `seq` to: the newest segment, or a new one when that one is full."""
        if writer.fd is not None and writer.size < self.segment_bytes:
            return writer.fd
        # a segment written without direct I/O (an older version, another policy) may end off a page
        reusable = not self._direct_wanted() or writer.size % ALIGN == 0
        if writer.fd is None and writer.segment is not None and writer.size < self.segment_bytes and reusable:
            with contextlib.suppress(FileNotFoundError):  # removed by hand: start a new one
                fd, direct = self._open_segment(writer.segment, 0)
                if os.fstat(fd).st_size == writer.size:
                    writer.fd, writer.direct = fd, direct
                    return fd
                os.close(fd)  # a failed append left bytes behind: start afresh in a new segment
        self._close_writer(writer)
        folder_id = _path_id(writer.folder)
        if writer.folder_id is not None and folder_id != writer.folder_id:
            # rm -rf of a live data dir: made again, the folder would take acked blocks that no
            # restart finds in order (the released mark and the earlier segments went with it)
            raise OSError(
                errno.ENOENT,
                f"the log's folder {writer.folder} was deleted or replaced while this server wrote to it: "
                "nothing more is written there; restart the server",
            )
        if folder_id is None:
            writer.folder.mkdir(parents=True, exist_ok=True)
            if self.fsync.mode == "every-block":
                _fsync_path(writer.folder.parent)
            folder_id = _path_id(writer.folder)
        writer.folder_id = folder_id
        path = writer.folder / f"{seq:020d}{SEGMENT_SUFFIX}"
        if path == writer.segment:  # the newest segment is empty but a failed append left bytes in it
            with contextlib.suppress(FileNotFoundError):
                os.truncate(path, 0)
        fd, writer.direct = self._open_segment(path, os.O_CREAT)
        writer.fd, writer.segment, writer.size = fd, path, os.fstat(fd).st_size
        if self.fsync.mode == "every-block":
            _fsync_path(writer.folder)
        else:
            writer.folder_dirty = True
            writer.changes += 1
        return fd

    def _direct_wanted(self) -> bool:
        return self.direct_io and hasattr(os, "O_DIRECT")

    def _open_segment(self, path: Path, create: int) -> tuple[int, bool]:
        """Open a segment to append to: (fd, whether with O_DIRECT). Falls back to buffered writes
        where the file system refuses direct I/O (EINVAL: tmpfs on older kernels, some FUSE mounts)."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | create
        if self._direct_wanted():
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                log.info("%s: no direct I/O on this file system; the log writes through the page cache", path)
                self.direct_io = False
        return os.open(path, flags, 0o644), False

    def _undo_append(self, writer: _Writer, size: int) -> None:
        """Cut a failed append off the segment and close it (the next append opens it again, or starts
        a new segment if the cut failed). Under "interval" the blocks before it that wait for an fsync
        are fsynced first: with no segment open, the next flush counts every block durable."""
        if writer.fd is None:
            return
        try:
            os.ftruncate(writer.fd, size)
        except OSError:
            log.exception("cannot cut a failed append off %s: a new segment follows", writer.segment)
            writer.size = -1  # never append to it again: _segment_for sees the size differ
        try:
            self._sync_before_undo(writer)
        finally:
            with contextlib.suppress(OSError):
                os.close(writer.fd)
            writer.fd = None

    def _sync_before_undo(self, writer: _Writer) -> None:
        """Under "interval", fsync what `writer` appended and did not fsync yet, before its fd closes. A
        failure is sticky (_fsync_error) and logged; the failed append's own error is the one raised.
        durable_seq is left to the next flush, which then tells the listeners (acks wait for them)."""
        if self.fsync.mode != "interval" or writer.folder in self._fsync_failed or writer.fd is None:
            return
        try:
            if writer.dirty:
                os.fsync(writer.fd)
            if writer.folder_dirty:
                _fsync_path(writer.folder)
        except OSError as exc:
            self._fsync_error(writer, exc)
            return
        writer.dirty = writer.folder_dirty = False
        writer.unsynced = 0

    def _drop_writer(self, stream: str) -> None:
        """Forget the writer of `stream` and close it, if there is one (the next write or recover()
        makes a new one from what is on disk)."""
        with self._writers_lock:
            old = self._writers.pop(stream, None)
        if old is not None:
            with old.lock:
                self._close_writer(old)

    def _close_writer(self, writer: _Writer) -> None:
        """fsync what the interval policy has not synced yet (a segment roll, close) and close the fd.
        A failed fsync is sticky (_fsync_failed): durable_seq stays where it was, and the error is raised."""
        if writer.fd is None:
            return
        try:
            if writer.folder in self._fsync_failed:
                return  # never counted durable; nothing more to fsync (the finally closes the fd)
            try:
                if writer.dirty and self.fsync.mode == "interval":
                    os.fsync(writer.fd)
                if writer.folder_dirty and self.fsync.mode == "interval":
                    _fsync_path(writer.folder)
            except OSError as exc:
                raise self._fsync_error(writer, exc) from exc
            writer.durable_seq = writer.next_seq
        finally:
            os.close(writer.fd)
            writer.fd = None
            writer.dirty = writer.folder_dirty = False
            writer.unsynced = 0

    def _fsync_error(self, writer: _Writer, exc: OSError) -> OSError:
        """Record that an fsync of `writer`'s log failed (sticky: _fsync_failed) and log it once; the
        error to raise. Call with writer.lock held."""
        if writer.folder not in self._fsync_failed:
            self._fsync_failed[writer.folder] = f"{exc}"
            log.error(
                "fsync of the log %s failed (%s): blocks from %d on may not be on disk; they are not "
                "acked, and the log takes no more writes until the server restarts",
                writer.folder,
                exc,
                writer.durable_seq,
            )
        return self._failed_error(writer.folder)

    def _failed_error(self, folder: Path) -> OSError:
        return OSError(
            errno.EIO,
            f"an fsync of the log {folder} failed ({self._fsync_failed[folder]}): what it covered may not "
            "be on disk, so nothing since is acked and the log takes no more writes; restart the server "
            "to recover the log from what reached the disk",
        )

    def _refuse_if_failed(self, folder: Path) -> None:
        """Raise OSError if an fsync of the log in `folder` failed in this process (_fsync_failed)."""
        if folder in self._fsync_failed:
            raise self._failed_error(folder)

    def _start_flusher(self) -> None:
        with self._writers_lock:
            if self._flusher is None and not self._closing.is_set():
                self._flusher = threading.Thread(target=self._flush_loop, name="wal-fsync", daemon=True)
                self._flusher.start()

    def _flush_loop(self) -> None:
        """fsync every interval, or sooner once a stream has SYNC_BYTES unsynced."""
        period = self.fsync.interval_ms / 1000
        while True:
            self._sync_wanted.wait(period)
            if self._closing.is_set():
                return
            self._sync_wanted.clear()
            self.flush()

    def on_durable(self, stream: str, listener: Callable[[], None]) -> Callable[[], None]:
        """As BlockStore.on_durable: called from flush() (the interval policy's flusher thread)."""
        with self._listeners_lock:
            self._durable_listeners.setdefault(stream, []).append(listener)

        def stop() -> None:
            with self._listeners_lock, contextlib.suppress(ValueError):
                self._durable_listeners.get(stream, []).remove(listener)

        return stop

    def flush(self) -> None:
        """fsync every segment with appends not yet fsynced (the interval policy's background work)."""
        with self._writers_lock:
            writers = list(self._writers.items())
        self._flush(writers)

    def sync(self, stream: str) -> None:
        """fsync what `stream` appended and did not fsync yet: every block written before the call is
        durable on return (flush() for one stream). Blocking."""
        with self._writers_lock:
            writer = self._writers.get(check_stream_name(stream))
        if writer is not None:
            self._flush([(stream, writer)])
            self._refuse_if_failed(writer.folder)

    def _flush(self, writers: Sequence[tuple[str, _Writer]]) -> None:
        moved: list[str] = []  # streams whose durable_seq this flush advanced
        for stream, writer in writers:
            before = writer.durable_seq
            self._flush_writer(writer)
            if writer.durable_seq > before:
                moved.append(stream)
        for stream in moved:
            with self._listeners_lock:
                listeners = list(self._durable_listeners.get(stream, ()))
            for listener in listeners:
                try:
                    listener()
                except Exception:
                    log.exception("a listener of stream %r's durable blocks failed", stream)

    def _flush_writer(self, writer: _Writer) -> None:
        """fsync `writer`'s segment if appends wait for it, and move its durable_seq.

        The appends stay marked unsynced until the fsync has finished: another flush meanwhile (the
        background thread's, a copy's own before its ack) or a segment roll then fsyncs them itself.
        Marked synced as the fsync began, they were counted durable by those at once, while it still
        ran: a block could be acked that a power loss then took."""
        with writer.lock:
            if writer.folder in self._fsync_failed:
                return  # what the failed fsync covered is never counted durable (_fsync_failed)
            if writer.fd is None or not (writer.dirty or writer.folder_dirty):
                writer.durable_seq = writer.next_seq  # nothing unsynced (a finished fsync covered it)
                return
            fd = os.dup(writer.fd)  # fsync outside the lock: appends go on meanwhile
            folder_dirty = writer.folder_dirty
            covered = writer.next_seq  # what this fsync makes durable
            changes = writer.changes
            writer.unsynced = 0
        try:
            os.fsync(fd)
            if folder_dirty:
                _fsync_path(writer.folder)
        except OSError as exc:
            with writer.lock:
                self._fsync_error(writer, exc)  # sticky: a later fsync that succeeds proves nothing
        else:
            with writer.lock:
                if writer.folder in self._fsync_failed:  # a roll's fsync failed meanwhile
                    return
                writer.durable_seq = max(writer.durable_seq, covered)
                if writer.changes == changes:  # nothing appended, no segment made, while it ran
                    writer.dirty = writer.folder_dirty = False
        finally:
            os.close(fd)

    # ---- the index -----------------------------------------------------------------------------

    def _segments(self, folder: Path) -> list[tuple[int, Path]]:
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            match = _SEGMENT_NAME.match(name)
            if match:
                found.append((int(match.group(1)), folder / name))
        found.sort()
        return found

    def _segment_frames(self, path: Path) -> Sequence[_Frame]:
        """The complete frames of a segment by their headers (no CRC check), indexed incrementally."""
        return self._segment_index(path).frames

    def _segment_index(self, path: Path) -> _SegmentIndex:
        """The index of a segment's complete frames as it is now (empty if it is gone), re-reading
        only the headers of frames appended since the last look."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            _refuse_broken_link(path)  # its blocks are not released: never passed over as if they were
            return _SegmentIndex((0, 0))  # released meanwhile
        with self._index_lock:
            index = self._index.get(path)
        if index is not None and index.ident == (st.st_dev, st.st_ino) and st.st_size == index.scanned:
            return index  # unchanged since: a stat, not an open (span() looks at every segment)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            _refuse_broken_link(path)  # its blocks are not released: never passed over as if they were
            return _SegmentIndex((0, 0))  # released meanwhile
        try:
            st = os.fstat(fd)
            ident = (st.st_dev, st.st_ino)
            with self._index_lock:
                index = self._index.get(path)
                if index is None or index.ident != ident or st.st_size < index.scanned:
                    index = self._index[path] = _SegmentIndex(ident)
            pos, more = index.scanned, []
            while pos + HEADER.size <= st.st_size:
                raw = os.pread(fd, HEADER.size, pos)
                header = _parse_header(raw) if len(raw) == HEADER.size else None
                if header is None or pos + header.frame_len > st.st_size:
                    break  # garbage (recovery will cut it) or a frame still being written
                more.append(_Frame(pos, header))
                pos += header.frame_len
            if not more:
                return index
            grown = index.grown(pos, more)
            with self._index_lock:
                current = self._index.get(path)
                if current is index or (
                    current is not None and current.ident == ident and pos > current.scanned
                ):
                    self._index[path] = grown
        finally:
            os.close(fd)
        return grown

    def _forget_index(self, folder: Path, keep: set[Path]) -> None:
        with self._index_lock:
            for path in [p for p in self._index if p.parent == folder and p not in keep]:
                del self._index[path]

    def _locate(self, block: BlockInfo) -> tuple[Path, _Frame]:
        segments = self._segments(self._folder(block.stream))
        # the segment named at or below the seq first, then (a log renamed by hand...) every other
        ordered = sorted(segments, key=lambda s: (s[0] > block.seq, -s[0]))
        for _, path in ordered:
            for frame in self._segment_frames(path):
                if frame.header.seq == block.seq:
                    return path, frame
        raise BlockNotFoundError(
            f"block {block.seq} of stream {block.stream!r} is not in the log (released, or not written)"
        )

    def _read_producers(self, path: Path, frame: _Frame) -> dict[str, int]:
        h = frame.header
        if not h.producers_len:
            return {}
        with open(path, "rb") as file:
            raw = os.pread(file.fileno(), h.producers_len, frame.offset + HEADER.size)
        return _decode_producers(raw)

    # ---- the released mark ---------------------------------------------------------------------

    def _read_released(self, stream: str, *, fresh: bool = False) -> _Released:
        """The released mark; `fresh`: from the file, not the cache (whose key, an inode reused by the
        next rename with the same size and mtime tick, can miss a change made by another process)."""
        folder = self._folder(stream)
        path = folder / STATE_FILE
        try:
            st = path.stat()
        except FileNotFoundError:
            _refuse_broken_link(path)  # a mark that cannot be read is not one that was never written
            return _read_old_mark(folder)
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._released.get(stream)
        if cached is not None and cached[0] == key and not fresh:
            return cached[1]
        try:
            data = parse_json(read_regular(path))
            lost_from = data.get("lost_from")
            state = _Released(
                int(data["next_seq"]),
                int(data["next_offset"]),
                {str(k): int(v) for k, v in data.get("producers", {}).items()},
                None if lost_from is None else int(lost_from),
                int(data.get("skipped_to", 0)),
            )
        except FileNotFoundError:
            return _read_old_mark(folder)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # written atomically, so this is damage: numbering then continues from the log alone. One
            # line naming the file and why, as the log's other damage: no traceback (it was log.exception)
            why = (
                str(exc)
                if isinstance(exc, ValueError)
                else "not a released mark (a map with next_seq and next_offset, numbers)"
            )
            log.error(  # noqa: TRY400 - damage is one line naming the file and why, as elsewhere
                "stream %r: %s is unreadable: %s; ignoring it: the numbering goes on from the log alone",
                stream,
                path,
                why,
            )
            state = _Released(damaged=True)
        self._released[stream] = (key, state)
        return state

    @contextlib.contextmanager
    def _mark_lock(self, folder: Path) -> Iterator[None]:
        """Hold the stream's release lock: an flock, so it serialises processes (Spark's worker and the
        server both release) and, taken on its own open file, threads and stores of one process too;
        the OS drops it when its holder dies, so a kill -9 leaves no stale lock."""
        fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def _replace_file(self, folder: Path, name: str, text: str) -> None:
        """Write `folder/name` whole (a temporary file renamed over it), durably unless fsync is off."""
        tmp = folder / f"{name}.tmp.{os.getpid()}.{threading.get_ident()}"
        try:
            with open(tmp, "w") as file:
                file.write(text + "\n")
                file.flush()
                if self.fsync.mode != "off":
                    os.fsync(file.fileno())
            os.replace(tmp, folder / name)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk leaves no half file behind
            raise
        if self.fsync.mode != "off":
            _fsync_path(folder)

    def _write_released(self, folder: Path, state: _Released) -> None:
        fields: dict[str, object] = {
            "next_seq": state.next_seq,
            "next_offset": state.next_offset,
            "producers": state.producers,
        }
        if state.lost_from is not None:
            fields["lost_from"] = state.lost_from
        if state.skipped_to:
            fields["skipped_to"] = state.skipped_to
        self._replace_file(folder, STATE_FILE, json.dumps(fields, sort_keys=True))

    def _folder(self, stream: str) -> Path:
        return self.root / check_stream_name(stream)


def _seq_of(frame: _Frame) -> int:
    return frame.header.seq


def _from_segment_of(segments: list[tuple[int, Path]], start: int) -> list[Path]:
    """The segments (sorted by their first seq) from the one that holds block `start` on."""
    first = 0
    for i, (name_seq, _) in enumerate(segments):
        if name_seq <= start:
            first = i
    return [path for _, path in segments[first:]]


def _between(frames: Sequence[_Frame], start: int, below: int) -> tuple[int, int]:
    """The frames [lo, hi) of a segment (seqs in order) with seqs in [start, below)."""
    if not frames:
        return 0, 0
    lo = 0 if frames[0].header.seq >= start else bisect.bisect_left(frames, start, key=_seq_of)
    if frames[-1].header.seq < below:
        return lo, len(frames)
    return lo, bisect.bisect_left(frames, below, lo=lo, key=_seq_of)


def _intact_after(path: Path, bad: int, last_seq: int) -> list[_Frame]:
    """The sound frames after a bad one at `bad`: found by their magic (the bad frame's own lengths
    cannot be trusted), then followed frame by frame."""
    found: list[_Frame] = []
    with open(path, "rb") as file:
        fd = file.fileno()
        size = os.fstat(fd).st_size
        data = os.pread(fd, size - bad, bad)  # the error path only: the rest of one segment
        at = data.find(MAGIC, 1)
        while at != -1:
            frame = _valid_frame(fd, bad + at, size, last_seq)
            if frame is None:
                at = data.find(MAGIC, at + 1)
                continue
            header = frame[0]
            found.append(_Frame(bad + at, header))
            last_seq = header.seq
            at += header.frame_len
            if at >= len(data) or data[at : at + len(MAGIC)] != MAGIC:
                at = data.find(MAGIC, at)
    return found


def _covers(ranges: Iterable[LostBlocks], first: int, end: int) -> bool:
    """Whether `ranges` together cover the seqs [first, end)."""
    at = first
    for lost in sorted(ranges, key=lambda r: r.first_seq):
        if lost.first_seq > at:
            break
        at = max(at, lost.end_seq)
    return at >= end


def _copy_from(source: Path, start: int, dest: Path, *, sync: bool) -> None:
    """Make `dest` a copy of `source` from byte `start` on: written aside, fsynced (`sync`), renamed
    over it (the caller fsyncs the folder)."""
    tmp = dest.with_name(f"{dest.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    try:
        with open(source, "rb") as reader, open(tmp, "wb") as writer:
            reader.seek(start)
            shutil.copyfileobj(reader, writer, 1 << 20)
            writer.flush()
            if sync:
                os.fsync(writer.fileno())
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half copy behind
        raise


def _valid_frame(fd: int, pos: int, size: int, last_seq: int) -> tuple[_Header, dict[str, int]] | None:
    """The frame at `pos` with its producers table if it is whole and sound, else None."""
    if pos + HEADER.size > size:
        return None
    raw = os.pread(fd, HEADER.size, pos)
    header = _parse_header(raw) if len(raw) == HEADER.size else None
    if header is None or pos + header.frame_len > size or header.seq <= last_seq:
        return None
    body = os.pread(fd, header.producers_len + header.payload_len, pos + HEADER.size)
    if len(body) != header.producers_len + header.payload_len or _frame_crc(raw, [body]) != header.crc:
        return None
    try:
        table = _decode_producers(memoryview(body)[: header.producers_len])
    except (ValueError, struct.error, UnicodeDecodeError):
        return None
    return header, table


def _encoding(key: _BlockKey) -> tuple[RawBlock, Callable[[], int], Callable[[memoryview], None]]:
    """The block's header fields, how to measure its payload, and how to encode that into a frame."""
    batches = [as_block_batch(b) for b in key.batches]  # the receiver's are; a caller's may be plain
    count = sum(b.num_rows for b in batches)
    received_at = 0.0
    for batch in batches:
        if batch.num_rows:
            received_at = first_arrival_us(batch) / 1e6
            break

    def write(sink: pa.NativeFile) -> None:
        with pa.ipc.new_stream(sink, BLOCK_SCHEMA) as ipc:
            if all(batch.num_rows for batch in batches):
                # the same bytes as a write_batch() per batch, in one call without the GIL: each call
                # gave it back and took it again, and with the event loop busy in Python every retake
                # waited up to the switch interval (5 ms): a block of 38 batches took 199 ms, not 12
                ipc.write_table(pa.Table.from_batches(batches, schema=BLOCK_SCHEMA))
            else:  # a table drops an empty batch (one alone) that write_batch() writes
                for batch in batches:
                    ipc.write_batch(batch)

    def measure() -> int:  # the payload's size first: it is encoded in place, in the frame
        sizer = pa.MockOutputStream()
        write(sizer)
        return int(sizer.size())

    def encode(into: memoryview) -> None:
        write(pa.FixedSizeBufferWriter(pa.py_buffer(into)))

    block = RawBlock(key.seq, key.first_offset, count, key.receiver, received_at, key.producers, b"")
    return block, measure, encode


def _frame_layout(block: RawBlock, payload_size: int, direct: bool) -> tuple[bytes, int]:
    """(the producers section, the frame's size) of `block` with a payload of `payload_size` bytes."""
    producers_raw = _encode_producers(block.producers)
    size = HEADER.size + len(producers_raw) + payload_size
    # direct I/O writes whole pages: the payload is padded with zeros to end on one, which the Arrow
    # IPC stream (read up to its end-of-stream marker) and the CRC (it covers them) allow
    return producers_raw, -(-size // ALIGN) * ALIGN if direct else size


def _build_frame(
    frame: memoryview,
    block: RawBlock,
    producers_raw: bytes,
    payload_size: int,
    fill: Callable[[memoryview], None],
) -> None:
    """Write the frame of `block` into `frame` (its padded size): header, producers, payload, zeros."""
    start = HEADER.size + len(producers_raw)
    size = start + payload_size
    padded = len(frame)
    frame[HEADER.size : start] = producers_raw
    fill(frame[start:size])
    frame[size:padded] = bytes(padded - size)
    HEADER.pack_into(
        frame,
        0,
        MAGIC,
        VERSION,
        0,
        0,
        len(producers_raw),
        padded - start,
        block.seq,
        block.first_offset,
        block.count,
        block.receiver,
        block.received_at,
    )
    struct.pack_into("<I", frame, _CRC_AT, _frame_crc(frame[: HEADER.size], [frame[HEADER.size : padded]]))


def _refuse_broken_link(path: Path) -> None:
    """Raise BrokenLinkError when `path`, not found, is a symlink to nowhere: a file of the log that
    cannot be read, not one that is gone."""
    dangling = broken_link(path)
    if dangling is not None:
        raise dangling


_Fingerprint = tuple[tuple[str, int, int, int], ...]
"""A folder's entries as _fingerprint reads them."""


@dataclass(frozen=True)
class _Checked:
    """What _check_below's pass over a stream's log found, for the recovery after the cut (or a
    recover(keep=True)'s, for the next recover())."""

    writer: _Writer
    frames: int
    """Frames that pass found and did not count (WalStats.frames_recovered, which counts the
    recovery's): _check_below's; 0 for a recover(), which counted them."""
    fingerprint: _Fingerprint | None
    """The folder's files as that pass left them (_fingerprint; None: they could not be read)."""


def _fingerprint(folder: Path) -> _Fingerprint | None:
    """(name, inode, size, mtime in ns) of every entry of `folder`, sorted: a write, a cut, a release
    (segments deleted, its mark renamed over), a segment made or removed all change it. None when the
    folder cannot be read (gone, not a folder, no permission, an entry gone midway), which matches no
    other (_same_files); an empty folder's is ()."""
    try:
        with os.scandir(folder) as entries:
            found = []
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                found.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    return tuple(sorted(found))


def _same_files(before: _Fingerprint | None, now: _Fingerprint | None) -> bool:
    """The folder holds the same files now as `before`: both read, and equal. One not read (None)
    matches nothing, itself included: what the folder held then is not known."""
    return before is not None and now is not None and before == now


def _path_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of `path`, None if it is not a directory (or gone); OSError when it cannot be
    looked at (permissions)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None


def _check_linked(fd: int, segment: Path | None) -> None:
    """OSError if the segment open at `fd` was deleted (rm -rf of a live data dir): what was written
    to it is not durable, however fsynced, since no restart will find it."""
    if os.fstat(fd).st_nlink == 0:
        raise OSError(
            errno.ENOENT,
            f"log segment {segment} was deleted while open: the blocks in it are gone, and this one is "
            "written again to a new segment",
        )


def _write_all(fd: int, frame: memoryview, direct: bool) -> None:
    rest = frame
    while rest:  # a short write (signal, disk nearly full): write the rest, which raises if it must
        n = os.write(fd, rest)
        if direct and n % ALIGN:  # the rest would start off a page: give up, the caller cuts it
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: a direct write stopped at {n} bytes")
        rest = rest[n:]


def _read_old_mark(folder: Path) -> _Released:
    with contextlib.suppress(FileNotFoundError, ValueError):
        seq, offset = (int(x) for x in (folder / _OLD_MARK).read_text().split())
        return _Released(seq, offset)
    return _Released()


def _subfolders(root: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _file_size(path: Path) -> int:
    return os.stat(path).st_size


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
