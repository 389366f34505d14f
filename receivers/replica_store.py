"""A follower's copies of other nodes' partitions: one write-ahead log per owner, as the owner's own.

Layout: ``<root>/<owner id>/<stream>/...`` (receivers.wal). Blocks arrive in order from the owner
(receivers.replication); a block already here is acked again (the owner resends after a reconnect), one
past a gap is refused unless the owner says it no longer has the blocks before it (Spark released them
while the follower was down, or the owner's log was lost): then the copy goes on after the gap, keeping
what it holds (releases remove what Spark read). Producer marks ride in the blocks (the first after a
gap carries the owner's released table), so a copy knows how far each of the owner's producers got:
receivers.producer_marks asks it at failover. At each connection of the owner, the copy drops what it
holds past the committed seq it was told (drop_uncommitted): the owner may have replaced those blocks.

Each copy carries the incarnation of its owner's log (the hello says it: meet_incarnation). A copy of
another incarnation than the owner's now (its log was lost and started afresh, from offset 0 when no
follower answered it, while this one was away) is not the owner's log: neither dropped nor continued
(its records may be acked ones no other node holds, at offsets the owner's new log uses again), it is
moved whole to ``<root>/set-aside/<owner>-<its incarnation>/<stream>/``, a log as any other (with a
``set-aside.json`` saying what it holds), and a new copy starts.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from receivers.block import BlockInfo
from receivers.config import DEFAULT_SEGMENT_BYTES, FsyncPolicy
from receivers.files import parse_json, replace_json
from receivers.wal import RawBlock, WalBlockStore, valid_incarnation

COMMITTED = "committed.json"
"""<root>/<owner>.committed.json: what the owner said is committed, per stream."""
SET_ASIDE = "set-aside"
"""<root>/set-aside/<owner>-<incarnation>/<stream>/: a copy of an owner's log that the owner's log no
longer is (meet_incarnation), kept whole: a log WalBlockStore reads, and set-aside.json."""
SET_ASIDE_INFO = "set-aside.json"


@dataclass(frozen=True)
class SetAside:
    """A copy set aside (meet_incarnation): where it went and what it holds."""

    owner: int
    stream: str
    incarnation: str
    """The copy's, that its owner's log no longer is."""
    replaced_by: str
    """The owner's log's now."""
    path: Path
    """The copy's folder now (a log of `stream` under path.parent)."""
    first_offset: int
    end_offset: int
    """The records it holds, not released: [first_offset, end_offset) (equal: none)."""
    committed_end: int
    """Records below this offset were committed (acked to their producers) as far as the copy knew."""


class OwnerLogLostError(ValueError):
    """The owner's log ends before blocks this copy knows were committed."""


def _read_committed(path: Path) -> dict[str, int]:
    try:
        data = parse_json(path.read_text())
    except (OSError, ValueError):
        return {}  # none, or torn: the owner says it again on its next connection
    if not isinstance(data, dict):
        return {}
    return {str(k): v for k, v in data.items() if isinstance(v, int) and v >= 0}


class ReplicaGapError(ValueError):
    """A block arrived past the end of the copy with the blocks between missing."""


class ReplicaIncarnationError(ValueError):
    """A block sent under one incarnation of the owner's log (its stream's hello) while the copy is now of
    another (a later stream's hello said so): two processes replicate as the same node."""


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
        self._committed: dict[int, dict[str, int]] = {}  # owner -> stream -> committed seq (as told)
        self._marks: dict[tuple[int, str], tuple[int, dict[str, int]]] = {}  # (folded to seq, table)

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
                segment_bytes = DEFAULT_SEGMENT_BYTES if self._segment_bytes is None else self._segment_bytes
                store = WalBlockStore(
                    self.root / str(owner), fsync=self._fsync, segment_bytes=segment_bytes, gaps=True
                )
                self._stores[owner] = store
            return store

    def next_seq(self, owner: int, stream: str) -> int:
        """The seq of the next block of `owner`'s partition of `stream` this copy needs. Blocking."""
        with self._stream_lock(owner, stream):
            return self._next_locked(owner, stream)

    def append(
        self,
        owner: int,
        stream: str,
        block: RawBlock,
        *,
        after_release: bool,
        sync: bool = False,
        incarnation: str = "",
    ) -> bool:
        """Store a block of `owner`'s partition durably; False if it was here already. `sync`: fsync it
        before it counts as held (the interval policy: group commit writes without one). Blocking.

        It counts as held (next_seq, a copy already here) once durable, and all of it under the stream's
        lock: synced after the lock was let go, another Replicate stream of the owner (its reconnect,
        while the old call's store still ran) was told the follower held the block before that sync had
        finished, and the owner counted it replicated.

        `incarnation`: the owner's log this block is of (what its stream's hello said; "": not said). A
        copy of another one now refuses it (ReplicaIncarnationError): a second process running as the
        same node, whose hello took the copy over while the first one's stream went on. Before, each
        one's block was taken as "here already" when the other's had that seq, and acked unstored."""
        with self._stream_lock(owner, stream):
            store = self.store(owner)
            held = store.incarnation(stream) if incarnation else ""
            if held and held != incarnation:
                raise ReplicaIncarnationError(
                    f"this copy of node {owner}'s log of stream {stream!r} is of incarnation {held} now (the "
                    f"hello of another replication stream from node {owner}), not {incarnation} as this "
                    f"stream's hello said: two processes run as node {owner} (one --node-id given twice?)"
                )
            expected = self._next_locked(owner, stream)
            if block.seq < expected:
                return False
            if block.seq > expected:
                if not after_release:
                    raise ReplicaGapError(
                        f"block {block.seq} of node {owner}'s stream {stream!r} arrived, {expected} expected"
                    )
                # the owner no longer has the blocks between: Spark released them, or its log was lost
                # (then they were never read, and the furthest copy holds them). Which, the owner cannot
                # tell, so the copy keeps what it holds and goes on after a gap: the driver's releases
                # remove what Spark read. Counted as released here, the gap was passed off as read and
                # every block of the copy was deleted, unread acked records among them.
                store.continue_at(stream, block.seq, block.first_offset)
            store.append_raw(stream, block)
            if sync:
                store.sync(stream)
            self._next[(owner, stream)] = block.seq + 1
            return True

    def blocks(self, owner: int, stream: str) -> list[BlockInfo]:
        return self.store(owner).blocks(stream)

    # ---- what the owner committed (its high watermark) -------------------------------------------

    def committed(self, owner: int, stream: str) -> int:
        """The seq below which the owner said `stream`'s blocks are committed (0: it said nothing)."""
        with self._lock:
            table = self._committed.get(owner)
            if table is None:
                table = self._committed[owner] = _read_committed(self._committed_path(owner))
            return table.get(stream, 0)

    def set_committed(self, owner: int, committed: Mapping[str, int]) -> None:
        """The owner says these are committed (they only grow). Kept on disk without fsync: it only has
        to be at most the truth, and the owner says it again on every connection. Blocking."""
        self.committed(owner, "")  # loaded
        with self._lock:
            table = self._committed[owner]
            grown = {s: n for s, n in committed.items() if n > table.get(s, 0)}
            if not grown:
                return
            table.update(grown)
            snapshot = dict(table)
        path = self._committed_path(owner)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".tmp")
        temp.write_text(json.dumps(snapshot))
        os.replace(temp, path)

    def _committed_path(self, owner: int) -> Path:
        return self.root / f"{owner}.{COMMITTED}"

    def drop_uncommitted(self, owner: int, stream: str, log_end: int, skipped_to: int = 0) -> int:
        """The owner (re)connects, its log ending at `log_end`: drop this copy's blocks past the committed
        seq it was told (before this connection), and past `skipped_to` (where the owner's log went on
        after it was lost); the number dropped. Raises OwnerLogLostError when the copy knows blocks past
        `log_end` were committed: the owner's log was lost. Blocking.

        Below the committed seq the copy's blocks are the owner's (a committed block is never dropped).
        Past it, they may not be: the owner drops its uncommitted blocks at a restart and writes others
        at those seqs, and a follower that was away then holds the old ones, which the owner's commit
        would pass off as its own. Dropped, they come again from the owner, which holds every block past
        the committed seq (or released it: Spark read it), except below `skipped_to`: a lost log's,
        which this copy may alone hold (acked records among them), so those are kept."""
        with self._stream_lock(owner, stream):
            held = self._next_locked(owner, stream)
            committed = self.committed(owner, stream)
            if held > log_end and committed > log_end:
                raise OwnerLogLostError(
                    f"node {owner}'s log of stream {stream!r} ends at block {log_end}, but this copy "
                    f"holds blocks committed up to {committed}: its log was lost or "
                    "replaced; restore it from this copy"
                )
            cut = min(log_end, max(committed, skipped_to))
            if held <= cut:
                return 0
            dropped, _ = self.store(owner).truncate_from(stream, cut)
            del self._next[(owner, stream)]
            self._marks.pop((owner, stream), None)
            return dropped

    def incarnation(self, owner: int, stream: str) -> str:
        """The incarnation of `owner`'s log this copy of `stream` is of ("" when not told). Blocking."""
        return self.store(owner).incarnation(stream)

    def meet_incarnation(self, owner: int, stream: str, incarnation: str) -> SetAside | None:
        """The owner says its log of `stream` is `incarnation` (its hello). A copy not told its owner's
        yet takes it. A copy of another one is set aside whole (SET_ASIDE) and a new, empty copy of
        `incarnation` starts; returned, so that the caller says so. Never dropped: the owner's log was
        lost (restarted on an empty data dir while no follower answered it), and this copy may hold
        the only copy of acked records, at offsets the owner's new log gives again. Blocking."""
        if not valid_incarnation(incarnation):
            raise ValueError(f"invalid incarnation {incarnation!r}")
        with self._stream_lock(owner, stream):
            store = self.store(owner)
            held = store.incarnation(stream)
            if held == incarnation:
                return None
            if not held or self._next_locked(owner, stream) == 0:  # never told, or holds nothing
                if held:  # what the owner said committed was of the old log: it would pass new blocks
                    self._forget_committed(owner, stream)
                store.set_incarnation(stream, incarnation)
                return None
            blocks = store.blocks(stream)
            released = store.released_offset(stream)
            committed = self.committed(owner, stream)
            committed_end = max([released, *(b.end_offset for b in blocks if b.seq < committed)])
            root = self.root / SET_ASIDE / f"{owner}-{held}"
            if root.exists():  # set aside before (the owner went back to it, then away again)
                root = root.with_name(f"{root.name}-{time.time_ns()}")
            # forgotten (durably) first: a crash after the move would leave the old log's committed
            # seq over an empty copy, and the new log's blocks below it would count as committed
            self._forget_committed(owner, stream)
            dest = store.set_aside(stream, root)
            assert dest is not None  # it held blocks: its folder is there
            aside = SetAside(
                owner,
                stream,
                held,
                incarnation,
                dest,
                blocks[0].first_offset if blocks else released,
                blocks[-1].end_offset if blocks else released,
                committed_end,
            )
            replace_json(
                root / SET_ASIDE_INFO,
                {
                    "owner": owner,
                    "stream": stream,
                    "incarnation": held,
                    "replaced_by": incarnation,
                    "first_offset": aside.first_offset,
                    "end_offset": aside.end_offset,
                    "committed_end_offset": committed_end,
                    "committed_seq": committed,
                    "set_aside_at": time.time(),
                },
            )
            self._next.pop((owner, stream), None)
            self._marks.pop((owner, stream), None)
            store.set_incarnation(stream, incarnation)
            return aside

    def _forget_committed(self, owner: int, stream: str) -> None:
        """The copy of `stream` starts afresh: what its owner said committed was of its old log."""
        self.committed(owner, stream)  # loaded
        with self._lock:
            table = self._committed[owner]
            if table.pop(stream, None) is None:
                return
            snapshot = dict(table)
        replace_json(self._committed_path(owner), snapshot)

    def marks(self, stream: str, producers: Iterable[str]) -> dict[str, int]:
        """Producer key -> the highest seq any copy here holds of it in a committed block (keys with
        none left out): an uncommitted block may be dropped (its records resent), so its marks do not
        count. Blocking."""
        wanted = set(producers)
        found: dict[str, int] = {}
        for owner in self.owners():
            table = self._committed_marks(owner, stream)
            for key in wanted & table.keys():
                found[key] = max(found.get(key, 0), table[key])
        return found

    def _committed_marks(self, owner: int, stream: str) -> dict[str, int]:
        """The producers table as of the committed seq, folded in from the blocks' own marks as it
        grows (headers only), and from the released mark past a gap (a release or a skip)."""
        with self._stream_lock(owner, stream):
            store = self.store(owner)
            limit = self.committed(owner, stream)
            folded, table = self._marks.get((owner, stream), (0, {}))
            if folded >= limit:
                return table
            table = dict(table)
            blocks = [b for b in store.blocks(stream, folded) if b.seq < limit]
            if not blocks or blocks[0].seq > folded:  # released (or skipped) meanwhile
                merge_marks(table, store.released_producers(stream))
            for block in blocks:
                merge_marks(table, store.block_producers(block))
            self._marks[(owner, stream)] = (limit, table)
            return table

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
