"""Block store: sealed blocks, durable on local disk, read by Spark and released after Spark commits.

Reads go through the BlockStore interface so that a store fetching blocks from a remote receiver over
gRPC can replace the local one without touching the Spark side.

Layout under the root folder: `<stream>/<seq>_<first_offset>_<count>_<receiver>.arrow`, one Arrow IPC
file per block. A block is written to a temporary name, fsynced, renamed and its folder fsynced, so a
block file that exists is complete and durable; readers never see a partial block.

Producer marks (idempotent producers): a block written with `producers` carries them as JSON in its
schema metadata (key `sluice.producers`: producer id -> next sequence number after its last record in the
block), so a mark is durable exactly when its records are. Before release deletes blocks it folds their
marks into `<stream>/producers.json` (written atomically), so `producers(stream)` survives releases.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pyarrow as pa

from receivers.block import BLOCK_SCHEMA, BlockInfo, check_stream_name

_SUFFIX = ".arrow"
_TMP_SUFFIX = ".tmp"
_PRODUCERS_KEY = b"sluice.producers"
_PRODUCERS_FILE = "producers.json"


class BlockStore(ABC):
    """Where sealed blocks live until Spark has committed them."""

    @abstractmethod
    def write(  # noqa: PLR0917 - the store contract shared with the WAL store
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> tuple[BlockInfo, int]:
        """Write a block durably; return it and its size in bytes. Blocking: call from a worker thread.

        `producers`: for each producer with records in this block, the sequence number after its last
        record in it. They must be durable together with the block: `producers()` recovers them.
        """

    @abstractmethod
    def producers(self, stream: str) -> dict[str, int]:
        """The producer table of `stream` as written: producer id -> the highest mark ever written for
        it (the next sequence number after its last durable record), released blocks included."""

    @abstractmethod
    def blocks(self, stream: str, from_seq: int = 0) -> list[BlockInfo]:
        """The sealed blocks of `stream` with seq >= from_seq, in order."""

    @abstractmethod
    def read(self, block: BlockInfo) -> Iterator[pa.RecordBatch]:
        """The record batches of a sealed block, with BLOCK_SCHEMA."""

    @abstractmethod
    def release(self, stream: str, before_seq: int) -> int:
        """Drop the blocks of `stream` with seq < before_seq; return how many were dropped."""


class LocalBlockStore(BlockStore):
    """Blocks as Arrow IPC files under a local folder. Safe for one writer and many readers."""

    def __init__(self, root: Path | str, *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self._lock = threading.Lock()

    # ---- writing (receiver side) --------------------------------------------------------------

    def write(  # noqa: PLR0917 - the store contract shared with the WAL store
        self,
        stream: str,
        seq: int,
        first_offset: int,
        receiver: int,
        batches: Sequence[pa.RecordBatch],
        producers: Mapping[str, int] | None = None,
    ) -> tuple[BlockInfo, int]:
        folder = self._folder(stream)
        folder.mkdir(parents=True, exist_ok=True)
        count = sum(b.num_rows for b in batches)
        info = BlockInfo(stream, seq, first_offset, count, receiver)
        final = folder / _file_name(info)
        tmp = final.with_suffix(_TMP_SUFFIX)
        schema = BLOCK_SCHEMA
        if producers:
            schema = schema.with_metadata({_PRODUCERS_KEY: json.dumps(dict(producers)).encode()})
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for batch in batches:
                writer.write_batch(batch)
        size = tmp.stat().st_size
        if self.fsync:
            _fsync_path(tmp)
        os.replace(tmp, final)
        if self.fsync:
            _fsync_path(folder)
        return info, size

    def recover(self, stream: str) -> tuple[int, int]:
        """Remove partial writes of `stream`; return (next block seq, next offset) after what is on disk."""
        folder = self._folder(stream)
        if not folder.is_dir():
            return 0, 0
        for tmp in folder.glob("*" + _TMP_SUFFIX):
            tmp.unlink(missing_ok=True)
        blocks = self.blocks(stream)
        if blocks:
            return blocks[-1].seq + 1, blocks[-1].end_offset
        # every block was released: continue after the high-water mark recorded at release time
        mark = folder / "released"
        if mark.exists():
            seq, offset = (int(x) for x in mark.read_text().split())
            return seq, offset
        return 0, 0

    # ---- reading (Spark side) -----------------------------------------------------------------

    def blocks(self, stream: str, from_seq: int = 0) -> list[BlockInfo]:
        folder = self._folder(stream)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return []
        found = []
        for name in names:
            info = _parse_file_name(stream, name)
            if info is not None and info.seq >= from_seq:
                found.append(info)
        found.sort()
        return found

    def read(self, block: BlockInfo) -> Iterator[pa.RecordBatch]:
        path = self._folder(block.stream) / _file_name(block)
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i).replace_schema_metadata(None)

    def producers(self, stream: str) -> dict[str, int]:
        with self._lock:
            return self._producers(stream, self.blocks(stream))

    def _producers(self, stream: str, blocks: Sequence[BlockInfo]) -> dict[str, int]:
        """The snapshot folded with the marks of `blocks` (in order: the latest mark of a producer last)."""
        folder = self._folder(stream)
        table: dict[str, int] = {}
        with contextlib.suppress(FileNotFoundError):
            table.update(json.loads((folder / _PRODUCERS_FILE).read_text()))
        for block in blocks:
            try:
                with pa.memory_map(str(folder / _file_name(block))) as source:
                    metadata = pa.ipc.open_file(source).schema.metadata or {}
            except FileNotFoundError:  # released meanwhile by another store object: its marks are folded
                continue
            raw = metadata.get(_PRODUCERS_KEY)
            if raw:
                for producer, mark in json.loads(raw).items():
                    # re-insert so the dict is ordered by last use (the receiver bounds it as an LRU)
                    table[producer] = max(mark, table.pop(producer, 0))
        return table

    def release(self, stream: str, before_seq: int) -> int:
        folder = self._folder(stream)
        dropped = 0
        with self._lock:
            doomed = [b for b in self.blocks(stream) if b.seq < before_seq]
            if doomed:
                # remember where the stream stands so a restart with no blocks left does not reuse seqs
                last = doomed[-1]
                # fold the marks of the doomed blocks into the snapshot before they go
                table = self._producers(stream, doomed)
                if table:
                    snapshot = folder / (_PRODUCERS_FILE + ".tmp")
                    snapshot.write_text(json.dumps(table))
                    if self.fsync:
                        _fsync_path(snapshot)
                    os.replace(snapshot, folder / _PRODUCERS_FILE)
                    if self.fsync:
                        _fsync_path(folder)
                mark = folder / "released"
                tmp = folder / "released.tmp"
                tmp.write_text(f"{last.seq + 1} {last.end_offset}\n")
                os.replace(tmp, mark)
            for block in doomed:
                (folder / _file_name(block)).unlink(missing_ok=True)
                dropped += 1
        return dropped

    def _folder(self, stream: str) -> Path:
        return self.root / check_stream_name(stream)


def _file_name(info: BlockInfo) -> str:
    return f"{info.seq:012d}_{info.first_offset:016d}_{info.count}_{info.receiver}{_SUFFIX}"


def _parse_file_name(stream: str, name: str) -> BlockInfo | None:
    if not name.endswith(_SUFFIX):
        return None
    parts = name[: -len(_SUFFIX)].split("_")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return None
    seq, first, count, receiver = (int(p) for p in parts)
    return BlockInfo(stream, seq, first, count, receiver)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
