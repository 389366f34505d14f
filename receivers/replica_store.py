"""A follower's copies of other nodes' partitions: one write-ahead log per owner, as the owner's own.

Layout: ``<root>/<owner id>/<stream>/...`` (receivers.wal). Blocks arrive in order from the owner
(receivers.replication); a block already here is acked again (the owner resends after a reconnect), one
past a gap is refused unless the owner says everything before it was released (the follower was down
while Spark read and released them): then the copy skips ahead. Producer marks ride in the blocks, so a
copy knows how far each of the owner's producers got: receivers.producer_marks asks it at failover.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

from receivers.block import BlockInfo
from receivers.wal import FsyncPolicy, RawBlock, WalBlockStore


class ReplicaGapError(ValueError):
    """A block arrived past the end of the copy with the blocks between missing."""


class ReplicaStore:
    """The copies this node holds, by owner node id."""

    def __init__(
        self, root: Path, *, fsync: FsyncPolicy | None = None, segment_bytes: int | None = None
    ) -> None:
        self.root = root
        self._fsync = fsync
        self._segment_bytes = segment_bytes
        self._stores: dict[int, WalBlockStore] = {}
        self._next: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()
        self._stream_locks: dict[tuple[int, str], threading.Lock] = {}

    def owners(self) -> list[int]:
        """Owners with a copy here (on disk, whether or not this process wrote to it)."""
        found = set(self._stores)
        if self.root.is_dir():
            found.update(int(p.name) for p in self.root.iterdir() if p.is_dir() and p.name.isdigit())
        return sorted(found)

    def store(self, owner: int) -> WalBlockStore:
        with self._lock:
            store = self._stores.get(owner)
            if store is None:
                kwargs = {} if self._segment_bytes is None else {"segment_bytes": self._segment_bytes}
                store = WalBlockStore(self.root / str(owner), fsync=self._fsync, **kwargs)
                self._stores[owner] = store
            return store

    def next_seq(self, owner: int, stream: str) -> int:
        """The seq of the next block of `owner`'s partition of `stream` this copy needs. Blocking."""
        with self._stream_lock(owner, stream):
            return self._next_locked(owner, stream)

    def append(self, owner: int, stream: str, block: RawBlock, *, after_release: bool) -> bool:
        """Store a block of `owner`'s partition durably; False if it was here already. Blocking."""
        with self._stream_lock(owner, stream):
            store = self.store(owner)
            expected = self._next_locked(owner, stream)
            if block.seq < expected:
                return False
            if block.seq > expected:
                if not after_release:
                    raise ReplicaGapError(
                        f"block {block.seq} of node {owner}'s stream {stream!r} arrived, {expected} expected"
                    )
                store.skip_to(stream, block.seq, block.first_offset, block.producers)
            store.append_raw(stream, block)
            self._next[(owner, stream)] = block.seq + 1
            return True

    def blocks(self, owner: int, stream: str) -> list[BlockInfo]:
        return self.store(owner).blocks(stream)

    def marks(self, stream: str, producers: Iterable[str]) -> dict[str, int]:
        """Producer key -> the highest seq any copy here holds of it (keys with none left out)."""
        wanted = set(producers)
        found: dict[str, int] = {}
        for owner in self.owners():
            table = self.store(owner).producers(stream)
            for key in wanted & table.keys():
                found[key] = max(found.get(key, 0), table[key])
        return found

    def flush(self) -> None:
        for store in list(self._stores.values()):
            store.flush()

    def close(self) -> None:
        for store in list(self._stores.values()):
            store.close()

    def _next_locked(self, owner: int, stream: str) -> int:
        key = (owner, stream)
        if key not in self._next:
            self._next[key] = self.store(owner).recover(stream)[0]
        return self._next[key]

    def _stream_lock(self, owner: int, stream: str) -> threading.Lock:
        with self._lock:
            return self._stream_locks.setdefault((owner, stream), threading.Lock())


def merge_marks(into: dict[str, int], marks: Mapping[str, int]) -> None:
    for key, mark in marks.items():
        if mark > into.get(key, -1):
            into[key] = mark
