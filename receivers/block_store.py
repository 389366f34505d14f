"""Block store: where sealed blocks live, durable, until Spark has committed them.

Reads go through the BlockStore interface so that a store fetching blocks from a remote receiver over
gRPC can replace the local one without touching the Spark side. The store of a server is the write-ahead
log, receivers.wal.WalBlockStore.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence

import pyarrow as pa

from receivers.block import BlockInfo, LogSpan, span_of


class BlockStore(ABC):
    """Where sealed blocks live until Spark has committed them."""

    # ---- writing (the receiver of a stream, one write at a time per stream) ---------------------

    @abstractmethod
    def recover(self, stream: str) -> tuple[int, int]:
        """Make the stored blocks of `stream` consistent after a restart; return (next block seq, next
        record offset), which continue after every block ever written, released ones included."""

    @abstractmethod
    def write(  # noqa: PLR0917 - the receiver calls it positionally
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> tuple[BlockInfo, int]:
        """Store a block (BLOCK_SCHEMA batches) durably; return it and its size in bytes. Blocking.

        `producers` maps each producer id with records in the block to the sequence number after its
        last record in the block (for idempotent producers); see producers().
        """

    def prepare(  # noqa: PLR0917, B027 - write()'s arguments; a hint that a store may ignore
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> None:
        """Get ready for a write() with these arguments, the next after the one in progress (called
        from another thread while it runs): a store may encode the block meanwhile. Never raises:
        errors are write()'s. Default: nothing."""

    @abstractmethod
    def producers(self, stream: str) -> dict[str, int]:
        """Producer id -> the sequence number after its last record stored (released blocks included)."""

    # ---- reading (Spark) ------------------------------------------------------------------------

    @abstractmethod
    def blocks(self, stream: str, from_seq: int = 0) -> list[BlockInfo]:
        """The sealed blocks of `stream` with seq >= from_seq, in order."""

    def extent(self, stream: str) -> tuple[int, int] | None:
        """(the first block's first offset, the last block's end offset) of blocks(stream), or None when
        it lists none: what a backlog needs, which a store may know without listing every block."""
        blocks = self.blocks(stream)
        return (blocks[0].first_offset, blocks[-1].end_offset) if blocks else None

    def span(self, stream: str) -> LogSpan | None:
        """span_of(blocks(stream)): the first offset, the end and the gaps between of the blocks it
        lists, None when it lists none; what counting its records (a backlog, a batch's records) needs,
        which a store may know without listing every block (WalBlockStore.span)."""
        return span_of(self.blocks(stream))

    @abstractmethod
    def read(self, block: BlockInfo) -> Iterator[pa.RecordBatch]:
        """The record batches of a sealed block, with BLOCK_SCHEMA."""

    @abstractmethod
    def release(self, stream: str, before_seq: int) -> int:
        """Drop the blocks of `stream` with seq < before_seq; return how many were dropped. Idempotent,
        and safe from several processes at once (Spark's worker and the server both release): what is
        released stays released, whatever order the calls land in."""

    # ---- resources (the writing process) ---------------------------------------------------------

    def durable_seq(self, stream: str) -> int:
        """Every block of `stream` with a lower seq is durable; the receiver acks only those. By
        default every block is durable when write() returns."""
        return sys.maxsize

    def on_durable(self, stream: str, listener: Callable[[], None]) -> Callable[[], None]:
        """Have `listener()` called (from any thread, quickly) whenever blocks of `stream` written
        earlier became durable since (a background fsync), so that their acks need not wait for the
        receiver's next look; return what stops the calls. Stores durable on write never call it."""
        return _no_op

    def flush(self) -> None:  # noqa: B027 - an optional hook: most stores are durable on write
        """Make every block written so far durable now (stores that sync in the background). Blocking."""

    def disk_bytes(self, stream: str | None = None) -> int:
        """Bytes the store's blocks take on disk, of one stream or of all (0 if the store does not
        know): what a disk budget counts, so only what releasing blocks frees, never bookkeeping."""
        return 0

    def trim(self, stream: str) -> int:
        """Free what released blocks still take that release() left behind; return the bytes freed."""
        return 0

    def incarnation(self, stream: str) -> str:
        """The identity of the log of `stream` (a random id made with it, gone with it), "" when it has
        none or the store keeps none (WalBlockStore.ensure_incarnation). Blocking."""
        return ""


def release_below(
    store: BlockStore,
    streams: Sequence[str],
    end: Mapping[str, int],
    incarnations: Mapping[str, str] | None = None,
) -> int:
    """Release, per stream, the blocks wholly below the record offset `end[stream]` (a committed batch's
    end offset); return how many blocks left the store. Idempotent: Spark's commit() calls it in the
    source, the driver as each committed batch's progress arrives. `incarnations` ({stream: id}, the
    offset's): a log of another incarnation now (it was lost and started afresh under the checkpoint)
    releases nothing, since its offsets are other records, unread."""
    released = 0
    for stream in streams:
        offset = end.get(stream)
        if offset is None:
            continue
        expected = (incarnations or {}).get(stream)
        if expected:
            held = store.incarnation(stream)
            if held and held != expected:
                continue
        done = [b.seq for b in store.blocks(stream) if b.end_offset <= offset]
        if done:
            released += store.release(stream, done[-1] + 1)
    return released


def _no_op() -> None:
    return None
