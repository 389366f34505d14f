"""The write-ahead log block store: round trips, recovery from torn and corrupt logs, release, readers."""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from receivers import wal
from receivers.block import BLOCK_SCHEMA, BlockInfo, plain_arrivals
from receivers.config import FsyncPolicy
from receivers.files import BrokenLinkError
from receivers.names import InvalidStreamNameError
from receivers.wal import ALIGN, HEADER, BlockNotFoundError, CorruptBlockError, DamagedLogError, WalBlockStore
from receivers.wire import decode_batch
from sluice_client.wire import encode_batch

OFF = FsyncPolicy.off()


def records(n: int, start: int = 0) -> pa.RecordBatch:
    return decode_batch(encode_batch(0, [f"r{i}".encode() for i in range(start, start + n)]), 0)


def values(store: WalBlockStore, stream: str = "s") -> list[bytes]:
    return [
        v for b in store.blocks(stream) for batch in store.read(b) for v in batch.column("value").to_pylist()
    ]


def expected(n: int) -> list[bytes]:
    return [f"r{i}".encode() for i in range(n)]


def fill(store: WalBlockStore, blocks: int, per_block: int = 3, stream: str = "s") -> list[BlockInfo]:
    """Append `blocks` blocks of `per_block` records after what the log holds."""
    seq, offset = store.recover(stream)
    written = []
    for _ in range(blocks):
        info, _ = store.write(stream, seq, offset, 1, [records(per_block, offset)], {f"p{seq % 2}": offset})
        written.append(info)
        seq, offset = seq + 1, offset + per_block
    return written


def segments(root: Path, stream: str = "s") -> list[Path]:
    return sorted((root / stream).glob("*.wal"))


def frame_starts(path: Path) -> list[int]:
    """Offsets of the frames of a segment (from their headers)."""
    data = path.read_bytes()
    starts, pos = [], 0
    while pos < len(data):
        starts.append(pos)
        fields = HEADER.unpack_from(data, pos)
        pos += HEADER.size + fields[4] + fields[5]
    return starts


# ---- basics --------------------------------------------------------------------------------------


def test_write_read_recover_release(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path)
    assert store.recover("s") == (0, 0)
    first, size = store.write("s", 0, 0, 3, [records(2), records(3, 2)])
    second, _ = store.write("s", 1, 5, 3, [records(4, 5)])
    assert size > 0
    assert (first.count, first.end_offset, second.first_offset, second.receiver) == (5, 5, 5, 3)
    assert values(store) == expected(9)
    assert [s.name for s in segments(tmp_path)] == [f"{0:020d}.wal"]
    restarted = WalBlockStore(tmp_path)
    assert restarted.recover("s") == (2, 9)
    assert restarted.blocks("s", from_seq=1) == [second]
    assert restarted.stats.corrupt_tails_truncated == 0 and restarted.stats.frames_recovered == 2
    # once every block is released, a restart still continues the numbering
    assert restarted.release("s", before_seq=2) == 2
    assert restarted.blocks("s") == []
    assert restarted.release("s", before_seq=2) == 0
    assert WalBlockStore(tmp_path).recover("s") == (2, 9)
    with pytest.raises(BlockNotFoundError, match="block 7 of stream 's'"):
        list(restarted.read(BlockInfo("s", 7, 0, 1, 3)))


def test_writes_must_continue_the_numbering(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=OFF)
    fill(store, 2)
    with pytest.raises(ValueError, match="block seq 5 written, 2 expected"):
        store.write("s", 5, 6, 0, [records(1)])
    with pytest.raises(ValueError, match="first_offset 1 below 6"):
        store.write("s", 2, 1, 0, [records(1)])


def test_stream_names_are_checked(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path)
    for bad in ["", "../etc", "a/b", ".hidden", "x" * 129]:
        with pytest.raises(InvalidStreamNameError):
            store.blocks(bad)
        with pytest.raises(InvalidStreamNameError):
            store.recover(bad)


def test_fsync_policy_parses_and_rejects() -> None:
    assert FsyncPolicy.parse("every-block") == FsyncPolicy() == FsyncPolicy.every_block()
    assert FsyncPolicy.parse("interval:25") == FsyncPolicy.interval(25)
    assert FsyncPolicy.parse("OFF") == FsyncPolicy.off()
    assert str(FsyncPolicy.interval(25)) == "interval:25" and str(FsyncPolicy()) == "every-block"
    for bad in ["", "always", "interval", "interval:", "interval:0", "interval:-5", "interval:1.5"]:
        with pytest.raises(ValueError, match="invalid fsync policy"):
            FsyncPolicy.parse(bad)
    with pytest.raises(ValueError, match=">= 1 ms"):
        FsyncPolicy("interval", 0)


def test_an_fsync_interval_over_an_hour_is_refused() -> None:
    """An outside tester: `--fsync interval:99999999999` was taken (acks waited up to three years for
    their fsync: nothing was acked), and an interval of 400 digits too, whose flusher thread then died
    on OverflowError (a traceback on stderr, nothing ever acked, the server serving on). An interval is
    at most an hour, as a block interval is."""
    assert FsyncPolicy.parse("interval:3600000") == FsyncPolicy.interval(3_600_000)
    for bad in ["interval:3600001", "interval:99999999999", "interval:1" + "0" * 400]:
        with pytest.raises(ValueError, match="invalid fsync policy"):
            FsyncPolicy.parse(bad)
    with pytest.raises(ValueError, match="at most 3,600,000 ms"):
        FsyncPolicy.interval(10**400)


def test_segments_roll_and_release_deletes_only_whole_old_segments(tmp_path: Path) -> None:
    # through the page cache: frames of their own size (direct ones take a page), several to a segment
    store = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=1500, direct_io=False)
    fill(store, 12, per_block=20)
    names = [int(p.stem) for p in segments(tmp_path)]
    assert len(names) >= 3 and names[0] == 0 and names == sorted(names)
    assert [b.seq for b in store.blocks("s")] == list(range(12))
    assert values(store) == expected(240)
    assert store.disk_bytes("s") == sum(p.stat().st_size for p in segments(tmp_path))
    assert store.disk_bytes() == store.disk_bytes("s")
    # release up to the middle of the second segment: only the first segment can go
    cut = names[1] + 1
    assert store.release("s", cut) == cut
    assert [int(p.stem) for p in segments(tmp_path)] == names[1:]
    assert [b.seq for b in store.blocks("s")] == list(range(cut, 12))  # released ones are hidden
    assert WalBlockStore(tmp_path).blocks("s", 0)[0].seq == cut  # in another store (process) too
    # releasing everything keeps the newest segment (the writer appends to it)
    assert store.release("s", 12) == 12 - cut
    assert [int(p.stem) for p in segments(tmp_path)] == names[-1:]
    assert store.blocks("s") == []
    restarted = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=1500)
    assert restarted.recover("s") == (12, 240)
    fill(restarted, 1, per_block=20)
    assert [b.seq for b in restarted.blocks("s")] == [12]


def listed_extent(store: WalBlockStore, stream: str = "s") -> tuple[int, int] | None:
    blocks = store.blocks(stream)
    return (blocks[0].first_offset, blocks[-1].end_offset) if blocks else None


def test_the_extent_is_what_the_listing_gives_through_rolls_and_releases(tmp_path: Path) -> None:
    """extent() reads the first segment with unreleased blocks and the last one, not every block: it
    must still be the listing's first and last (a backlog, a drain, the status page rest on it)."""
    store = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=1500, direct_io=False)
    assert store.extent("s") is None  # no folder yet
    store.recover("s")
    assert store.extent("s") is None  # a folder, no block
    fill(store, 12, per_block=20)
    assert len(segments(tmp_path)) >= 3
    assert store.extent("s") == listed_extent(store) == (0, 240)
    for cut in (1, 4, 5, 9, 11, 12):  # within segments, at their starts, everything
        store.release("s", cut)
        assert store.extent("s") == listed_extent(store), cut
        assert WalBlockStore(tmp_path).extent("s") == listed_extent(store), cut  # another process's view
    assert store.extent("s") is None
    fill(store, 3, per_block=7)
    assert store.extent("s") == listed_extent(store) == (240, 261)
    # of the blocks below a seq (a cluster node's: those on enough copies)
    assert [store.extent("s", below_seq=seq) for seq in (12, 13, 14, 15, 99)] == [
        None,
        (240, 247),
        (240, 254),
        (240, 261),
        (240, 261),
    ]


# ---- recovery ------------------------------------------------------------------------------------


def test_torn_tail_is_truncated_reported_and_appended_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = WalBlockStore(tmp_path)
    fill(store, 3)
    store.close()
    segment = segments(tmp_path)[0]
    whole = segment.stat().st_size
    last = frame_starts(segment)[-1]
    os.truncate(segment, last + HEADER.size + 5)  # a crash in the middle of the third block's write
    assert [b.seq for b in WalBlockStore(tmp_path).blocks("s")] == [0, 1]  # readers skip the torn frame
    restarted = WalBlockStore(tmp_path)
    with caplog.at_level(logging.WARNING, "receivers.wal"):
        assert restarted.recover("s") == (2, 6)
    assert segment.stat().st_size == last
    warning = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1
    message = warning[0].getMessage()
    assert "'s'" in message and segment.name in message and f"offset {last}" in message
    assert f"truncated {HEADER.size + 5} bytes" in message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a torn tail is no damage
    stats = restarted.stream_stats("s")
    assert (stats.corrupt_tails_truncated, stats.bytes_truncated) == (1, HEADER.size + 5)
    assert restarted.stats.corrupt_tails_truncated == 1
    # the write path appends cleanly after the cut: seq 2 again, then on
    fill(restarted, 2)
    assert segment.stat().st_size > whole
    again = WalBlockStore(tmp_path)
    assert again.recover("s") == (4, 12)
    assert again.stats.corrupt_tails_truncated == 0
    assert values(again) == expected(12)


def test_flipped_payload_byte_is_caught_by_crc(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=OFF)
    fill(store, 4)
    segment = segments(tmp_path)[0]
    starts = frame_starts(segment)
    data = bytearray(segment.read_bytes())
    data[starts[2] + HEADER.size + 40] ^= 0x01  # inside the third block's payload
    segment.write_bytes(bytes(data))
    # a reader's index does not check CRCs, but reading the block does
    reader = WalBlockStore(tmp_path)
    bad = reader.blocks("s")[2]
    with pytest.raises(CorruptBlockError, match="block 2 of stream 's' fails its checksum"):
        list(reader.read(bad))
    restarted = WalBlockStore(tmp_path, fsync=OFF)
    assert restarted.recover("s") == (2, 6)
    assert segment.stat().st_size == starts[2]
    assert restarted.stats.bytes_truncated == len(data) - starts[2]
    assert values(restarted) == expected(6)


@pytest.mark.parametrize("where", ["payload", "header"])
def test_damage_with_intact_blocks_after_it_is_refused_not_cut(tmp_path: Path, where: str) -> None:
    """Under every-block (each block fsynced before the next is written, and before its ack) a bad
    frame followed by sound ones is not a crash's torn tail: cutting there deleted every acked block
    after it (1.2M records for one flipped byte). Recovery refuses, names the segment and the intact
    blocks, and changes nothing on disk; readers still read the sound blocks."""
    store = WalBlockStore(tmp_path)
    fill(store, 5)
    store.close()
    segment = segments(tmp_path)[0]
    starts = frame_starts(segment)
    data = bytearray(segment.read_bytes())
    data[starts[1] + (HEADER.size + 40 if where == "payload" else 20)] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(DamagedLogError) as refused:
        WalBlockStore(tmp_path).recover("s")
    message = str(refused.value)
    assert str(segment) in message and f"damaged at byte {starts[1]:,}" in message, message
    assert "3 intact blocks follow it (seqs 2..4)" in message, message
    assert segment.read_bytes() == bytes(data)  # nothing cut
    reader = WalBlockStore(tmp_path)
    assert [b.seq for b in reader.blocks("s")][-1] == 4 or where == "header"
    # the operator moves the segment aside: the log starts over after its blocks, which are lost
    segment.rename(tmp_path / "kept-for-forensics.wal")
    assert WalBlockStore(tmp_path).recover("s") == (0, 0)


def test_corruption_in_a_middle_segment_keeps_later_segments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=2500, direct_io=False)  # unpadded frames
    fill(store, 12, per_block=20)
    store.close()
    paths = segments(tmp_path)
    assert len(paths) >= 3
    middle = paths[1]
    first_seq, next_seq = int(middle.stem), int(paths[2].stem)
    assert next_seq - first_seq >= 2
    starts = frame_starts(middle)
    data = bytearray(middle.read_bytes())
    data[starts[1] + 20] ^= 0xFF  # the header (seq field) of its second frame
    middle.write_bytes(bytes(data))
    restarted = WalBlockStore(tmp_path, fsync=OFF)
    with caplog.at_level(logging.WARNING, "receivers.wal"):
        assert restarted.recover("s") == (12, 240)
    assert middle.stat().st_size == starts[1]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        f"stream 's': the log is damaged: blocks {first_seq + 1}..{next_seq - 1} "
        f"of segment {middle.name} are lost"
    ]
    kept = [b.seq for b in restarted.blocks("s")]
    assert kept == [s for s in range(12) if not first_seq + 1 <= s < next_seq]
    fill(restarted, 1, per_block=20)
    assert restarted.blocks("s")[-1].seq == 12


def span(noun: str, first: int, last: int) -> str:
    return f"{noun} {first}" if first == last else f"{noun}s {first}..{last}"


def rolled(root: Path, fsync: FsyncPolicy | None = None, blocks: int = 12) -> list[Path]:
    """A closed log of `blocks` blocks of 20 records in several segments (through the page cache:
    frames of their own size, a few to a segment)."""
    store = WalBlockStore(root, fsync=fsync, segment_bytes=1500, direct_io=False)
    fill(store, blocks, per_block=20)
    store.close()
    paths = segments(root)
    assert len(paths) >= 4
    return paths


def files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((root / "s").iterdir()) if p.name != "released.lock"}


@pytest.mark.parametrize("fsync", ["every-block", "interval:50"])
@pytest.mark.parametrize("missing", ["middle", "oldest"])
def test_a_missing_segment_stops_recovery(tmp_path: Path, fsync: str, missing: str) -> None:
    """A segment deleted (or lost) under policies that make every acked block durable: the log went on
    with a gap in its seqs and offsets, without a word, the lost blocks' acked records gone (and new
    blocks appended after the gap). Blocks that were never released are missing: recovery refuses,
    names them, the files and what to do, and changes nothing on disk."""
    paths = rolled(tmp_path, FsyncPolicy.parse(fsync))
    index = 1 if missing == "middle" else 0
    gone = paths[index]
    first, after = int(gone.stem), int(paths[index + 1].stem)
    gone.unlink()
    before = files(tmp_path)
    with pytest.raises(DamagedLogError) as refused:
        WalBlockStore(tmp_path, fsync=FsyncPolicy.parse(fsync)).recover("s")
    message = str(refused.value)
    records_ = f"records {first * 20}..{after * 20 - 1}"
    assert f"stream 's': blocks {first}..{after - 1} ({records_}) are missing" in message, message
    where = (
        f"between segments {paths[0].name} and {paths[2].name}"
        if missing == "middle"
        else f"before {paths[1].name}, the oldest segment"
    )
    assert where in message and str(tmp_path / "s") in message, message
    assert "Restore the missing segment" in message, message
    assert f"move {paths[index + 1].name} and every later segment ({len(paths) - index - 1} files)" in message
    assert files(tmp_path) == before  # nothing cut, nothing removed
    # the operator moves the segments from the gap on aside: the log goes on after the blocks before it
    for path in paths[index + 1 :]:
        path.rename(tmp_path / path.name)
    assert WalBlockStore(tmp_path).recover("s") == (first, first * 20)


@pytest.mark.parametrize("which", ["oldest", "middle", "newest", "new-name"])
def test_a_segment_linked_to_nowhere_stops_recovery_and_readers(tmp_path: Path, which: str) -> None:
    """A symlink to a path that does not exist, named as a segment, was read as no file at all: the
    newest segment's acked blocks (or a whole one-segment log) were passed over without a word and
    their seqs numbered again; a reader (Spark's source) skipped them. Recovery and readers raise
    BrokenLinkError, naming the link and where it leads, and nothing on disk is changed."""
    root = tmp_path / "log"
    paths = rolled(root)
    if which == "new-name":
        link = root / "s" / f"{99_999:020d}.wal"
    else:
        link = paths[{"oldest": 0, "middle": 1, "newest": -1}[which]]
        link.rename(tmp_path / "unmounted")
    link.symlink_to(tmp_path / "gone" / link.name)
    listing = sorted(set(os.listdir(root / "s")) - {"released.lock"})
    says = f"{link}: a symlink to {tmp_path / 'gone' / link.name}, which does not exist"
    for fsync in (None, OFF):  # under "off" too: this is no power loss's trace
        with pytest.raises(BrokenLinkError) as refused:
            WalBlockStore(root, fsync=fsync).recover("s")
        assert f"{refused.value.filename}: {refused.value.strerror}" == says
    with pytest.raises(BrokenLinkError):
        WalBlockStore(root).blocks("s")  # a reader, which never recovers
    assert sorted(set(os.listdir(root / "s")) - {"released.lock"}) == listing and link.is_symlink()
    # the file put back where the link leads: every block is there again
    if which != "new-name":
        (tmp_path / "gone").mkdir()
        (tmp_path / "unmounted").rename(tmp_path / "gone" / link.name)
        assert values(WalBlockStore(root)) == expected(12 * 20)
        assert WalBlockStore(root).recover("s") == (12, 240)


def test_a_segment_linked_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    """Symlinks are followed (receivers.files.open_regular): segments kept elsewhere and linked are
    recovered, read and appended to there; a release deletes the link, not the file it leads to."""
    root = tmp_path / "log"
    paths = rolled(root)
    linked = {paths[0]: tmp_path / "oldest.wal", paths[-1]: tmp_path / "newest.wal"}
    for path, elsewhere in linked.items():
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
    store = WalBlockStore(root, segment_bytes=1 << 20, direct_io=False)
    assert store.recover("s") == (12, 240)
    size = linked[paths[-1]].stat().st_size
    store.write("s", 12, 240, 1, [records(20, 240)])
    assert paths[-1].is_symlink() and linked[paths[-1]].stat().st_size > size
    assert values(store) == expected(13 * 20)
    # the disk the log takes (--disk-budget) counts them where they are
    assert store.disk_bytes("s") == sum(p.stat().st_size for p in paths)
    store.release("s", before_seq=12)
    store.close()
    assert not os.path.lexists(paths[0]) and linked[paths[0]].exists()
    assert values(WalBlockStore(root)) == expected(13 * 20)[240:]


def test_a_missing_segment_under_fsync_off_is_logged_and_passed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under "off" a power loss can take any part of the log: an ERROR names the missing blocks, and
    recovery goes on (as for an older segment's cut tail)."""
    paths = rolled(tmp_path, OFF)
    paths[1].unlink()
    first, after = int(paths[1].stem), int(paths[2].stem)
    with caplog.at_level(logging.WARNING, "receivers.wal"):
        assert WalBlockStore(tmp_path, fsync=OFF).recover("s") == (12, 240)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert (
        len(errors) == 1
        and f"blocks {first}..{after - 1} (records {first * 20}..{after * 20 - 1})" in errors[0]
    )
    assert f"between segments {paths[0].name} and {paths[2].name}" in errors[0]


def test_blocks_lost_under_fsync_off_are_counted(tmp_path: Path) -> None:
    """Under "off" recovery goes on past blocks a power loss took, with an ERROR each time: the blocks
    are counted too (stats.blocks_lost, the metric sluice_wal_lost_blocks_total), a missing segment's
    and an older segment's cut tail alike; a torn newest tail and released blocks are no loss."""
    paths = rolled(tmp_path, OFF)
    assert len(paths) >= 4
    paths[1].unlink()  # a whole segment gone
    missing = int(paths[2].stem) - int(paths[1].stem)
    starts = frame_starts(paths[2])
    os.truncate(paths[2], starts[1] + 5)  # an older segment's tail
    cut = int(paths[3].stem) - int(paths[2].stem) - 1
    newest = paths[-1]
    os.truncate(newest, frame_starts(newest)[-1] + 5)  # the newest one's torn tail: no loss counted
    restarted = WalBlockStore(tmp_path, fsync=OFF)
    restarted.recover("s")
    assert restarted.stream_stats("s").blocks_lost == missing + cut > 0
    assert restarted.stats.blocks_lost == missing + cut
    restarted.close()
    again = WalBlockStore(tmp_path, fsync=OFF)  # the gaps stay: each start logs and counts them again
    again.recover("s")
    assert again.stats.blocks_lost == missing + cut
    # released blocks are no loss: with the mark past the gap and the cut, nothing is counted
    released = tmp_path / "released"
    paths = rolled(released, OFF)
    store = WalBlockStore(released, fsync=OFF)
    store.recover("s")
    store.release("s", int(paths[3].stem))
    store.close()
    for path in paths[1:3]:
        path.unlink(missing_ok=True)  # as a release's deletes would, were they not there already
    restarted = WalBlockStore(released, fsync=OFF)
    restarted.recover("s")
    assert restarted.stats.blocks_lost == 0


def test_logs_that_lack_no_unreleased_block_are_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What releases, crashes and losses of nothing acked leave: segments deleted by release below the
    released mark, a mark past every block, an empty log, a fresh stream, a roll-over right at a crash
    (an empty or torn newest segment), an unreadable mark (where the log begins is then unknown)."""

    def recovers(root: Path, stream: str = "s") -> tuple[int, int]:
        return WalBlockStore(root, segment_bytes=1500, direct_io=False).recover(stream)

    # segments deleted by a release (retention), then a restart and more blocks, then another restart
    root = tmp_path / "released"
    paths = rolled(root)
    store = WalBlockStore(root, segment_bytes=1500, direct_io=False)
    store.release("s", int(paths[2].stem) + 1)
    assert segments(root)[0] == paths[2]
    assert recovers(root) == (12, 240)
    fill(store, 3, per_block=20)
    store.close()
    assert recovers(root) == (15, 300)
    # every block released, the newest segment trimmed too: a mark past everything, no segment at all
    store = WalBlockStore(root, segment_bytes=1500, direct_io=False)
    store.recover("s")
    store.release("s", 15)
    assert store.trim("s") > 0 and segments(root) == []
    assert recovers(root) == (15, 300)
    fill(store, 1, per_block=20)
    store.close()
    assert recovers(root) == (16, 320)
    # a fresh stream, and one whose folder holds nothing (a stream added, no block yet)
    assert recovers(root, "fresh") == (0, 0)
    (root / "empty").mkdir()
    (root / "empty" / "incarnation").write_text("abc\n")
    assert recovers(root, "empty") == (0, 0)
    # a roll-over right at a crash: the newest segment made, its first block not (or torn) on disk
    for torn in (b"", b"SLWL\x01\x00"):
        root = tmp_path / f"rolled-{len(torn)}"
        rolled(root)
        (root / "s" / f"{12:020d}.wal").write_bytes(torn)
        assert recovers(root) == (12, 240)
        store = WalBlockStore(root, segment_bytes=1500, direct_io=False)
        fill(store, 1, per_block=20)
        store.close()
        assert values(WalBlockStore(root)) == expected(260)
    # a released mark that cannot be read: numbering goes on from the log, as before, with one ERROR
    # naming the file and why (it was log.exception: the ERROR and a traceback)
    damages = {
        "{not json": "Expecting property name enclosed in double quotes",
        "[1, 2]": "not a released mark (a map with next_seq and next_offset, numbers)",
        '{"next_seq": 4}': "not a released mark",
        '{"next_seq": "x", "next_offset": 0}': "invalid literal for int()",
    }
    for n, (content, why) in enumerate(damages.items()):
        root = tmp_path / f"unreadable-{n}"
        paths = rolled(root)
        WalBlockStore(root).release("s", int(paths[2].stem))
        (root / "s" / "released.json").write_text(content)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "receivers.wal"):
            assert recovers(root) == (12, 240)
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        message = errors[0].getMessage()
        assert f"{root / 's' / 'released.json'} is unreadable: " in message and why in message, message
        assert "\n" not in message and errors[0].exc_info is None and errors[0].exc_text is None


def damage_older_segment(paths: list[Path], damage: str) -> tuple[Path, int, int, int]:
    """Damage the second of a rolled log's segments `paths`: "truncated" cut inside its second frame,
    "zeroed" whole, "zeroed-head" its first frame's header alone (the frames after it sound). Returns
    (the segment, its first block, the next segment's first block, the byte the damage starts at)."""
    middle = paths[1]
    first, after = int(middle.stem), int(paths[2].stem)
    starts = frame_starts(middle)
    data = middle.read_bytes()
    if damage == "truncated":
        middle.write_bytes(data[: starts[1] + HEADER.size + 3])
        return middle, first, after, starts[1]
    if damage == "zeroed":
        middle.write_bytes(bytes(len(data)))
    else:
        middle.write_bytes(bytes(HEADER.size) + data[HEADER.size :])
    return middle, first, after, 0


@pytest.mark.parametrize("fsync", ["every-block", "interval:50"])
@pytest.mark.parametrize("damage", ["truncated", "zeroed", "zeroed-head"])
def test_damage_to_an_older_segment_stops_recovery(tmp_path: Path, fsync: str, damage: str) -> None:
    """An older segment truncated mid-frame or zeroed while later segments are intact: the rest of it was
    cut with an ERROR and the server served, its acked blocks gone. Under "every-block" each block is
    fsynced before the next is written, and under "interval" a segment is fsynced whole before the next
    one is made, so this is no crash's torn tail: recovery refuses as it does inside one segment."""
    policy = FsyncPolicy.parse(fsync)
    paths = rolled(tmp_path, policy)
    middle, first, after, at = damage_older_segment(paths, damage)
    if damage == "truncated":
        lost = span("block", first + 1, after - 1)
    elif damage == "zeroed":
        lost = span("block", first, after - 1)
    else:  # every-block: the intact frames after the bad one are named (as inside the newest segment)
        lost = (
            span("seq", first + 1, after - 1)
            if policy.mode == "every-block"
            else span("block", first, after - 1)
        )
    before = files(tmp_path)
    with pytest.raises(DamagedLogError) as refused:
        WalBlockStore(tmp_path, fsync=policy).recover("s")
    message = str(refused.value)
    assert str(middle) in message and f"damaged at byte {at:,}" in message and lost in message, message
    assert f"move it and every later segment ({len(paths) - 1} files)" in message, message
    assert files(tmp_path) == before  # nothing cut


@pytest.mark.parametrize("fsync", ["every-block", "off"])
@pytest.mark.parametrize("damage", ["missing", "torn", "one-record"])
def test_one_lost_block_is_named_as_one_block(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fsync: str, damage: str
) -> None:
    """A gap or a cut older segment of a single block said "blocks 1..1" (and "records 3..3" for a
    block of one record): it says "block 1 ... is", "record 3"."""
    policy = FsyncPolicy.parse(fsync)
    per_block = 1 if damage == "one-record" else 3
    store = WalBlockStore(tmp_path, fsync=policy, segment_bytes=1, direct_io=False)  # a segment a block
    fill(store, 3, per_block=per_block)
    store.close()
    paths = segments(tmp_path)
    assert [int(p.stem) for p in paths] == [0, 1, 2]
    if damage == "torn":
        os.truncate(paths[1], HEADER.size + 3)
        said = "damaged at byte 0 (its first block): block 1 is not whole in it"
        logged = f"stream 's': the log is damaged: block 1 of segment {paths[1].name} is lost"
    else:
        paths[1].unlink()
        records_ = "record 1" if damage == "one-record" else "records 3..5"
        said = f"stream 's': block 1 ({records_}) is missing"
        logged = f"stream 's': the log is damaged: block 1 ({records_}) is missing"
    with caplog.at_level(logging.WARNING, "receivers.wal"):
        if policy.mode == "off":
            assert WalBlockStore(tmp_path, fsync=policy).recover("s") == (3, 3 * per_block)
        else:
            with pytest.raises(DamagedLogError) as refused:
                WalBlockStore(tmp_path, fsync=policy).recover("s")
            assert said in str(refused.value), str(refused.value)
    if policy.mode == "off":
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and logged in errors[0], errors


def test_garbage_appended_and_junk_files(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=OFF)
    fill(store, 2)
    store.close()
    segment = segments(tmp_path)[0]
    with open(segment, "ab") as file:
        file.write(b"\x00" * 7 + b"garbage" * 50)
    (tmp_path / "s" / "notes.txt").write_text("not a segment")
    (tmp_path / "s" / "released.json").write_text("{not json")
    assert [b.seq for b in WalBlockStore(tmp_path).blocks("s")] == [0, 1]
    restarted = WalBlockStore(tmp_path, fsync=OFF)
    assert restarted.recover("s") == (2, 6)
    assert restarted.stats.bytes_truncated == 7 + 7 * 50
    assert values(restarted) == expected(6)


def test_empty_and_headerless_segments(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    folder.mkdir()
    (folder / f"{0:020d}.wal").write_bytes(b"")
    (folder / f"{5:020d}.wal").write_bytes(b"SLWL")
    store = WalBlockStore(tmp_path, fsync=OFF)
    # the second segment says blocks from 5 on existed: numbering never goes back below it
    assert store.recover("s") == (5, 0)
    assert [p.name for p in segments(tmp_path)] == [f"{5:020d}.wal"]
    assert store.stats.segments_removed == 1 and store.stats.bytes_truncated == 4
    fill(store, 1)
    assert [b.seq for b in WalBlockStore(tmp_path).blocks("s")] == [5]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut_fraction=st.floats(0, 1), flip=st.booleans())
def test_any_cut_keeps_every_frame_before_it(
    tmp_path_factory: pytest.TempPathFactory, cut_fraction: float, flip: bool
) -> None:
    root = tmp_path_factory.mktemp("wal")
    store = WalBlockStore(root, fsync=OFF)
    fill(store, 5, per_block=4)
    store.close()
    segment = segments(root)[0]
    data = segment.read_bytes()
    cut = int(len(data) * cut_fraction)
    # the frames wholly before the cut (or before the damaged byte) survive; the rest is lost
    whole = sum(1 for end in [*frame_starts(segment)[1:], len(data)] if end <= cut)
    if flip and cut < len(data):
        segment.write_bytes(data[:cut] + bytes([data[cut] ^ 0x5A]) + data[cut + 1 :])
    else:
        segment.write_bytes(data[:cut])
    restarted = WalBlockStore(root, fsync=OFF)
    assert restarted.recover("s") == (whole, 4 * whole)
    assert values(restarted) == expected(4 * whole)
    fill(restarted, 1, per_block=4)
    assert values(WalBlockStore(root)) == expected(4 * whole + 4)


# ---- the producers table ------------------------------------------------------------------------


def test_producers_table_across_restart_release_and_truncation(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=600)
    seq, offset = store.recover("s")
    tables = [{"a": 10}, {"a": 20, "b": 5}, {"c": 7}, {"b": 9}, {}, {"a": 30}, {"d": 1}]
    for table in tables:
        store.write("s", seq, offset, 0, [records(5, offset)], table)
        seq, offset = seq + 1, offset + 5
    everything = {"a": 30, "b": 9, "c": 7, "d": 1}
    assert store.producers("s") == everything
    assert len(segments(tmp_path)) >= 3
    assert WalBlockStore(tmp_path).producers("s") == everything  # read from disk by another store
    restarted = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=600)
    restarted.recover("s")
    assert restarted.producers("s") == everything
    # release deletes old segments: their producers live on in the snapshot
    restarted.release("s", 6)
    assert len(segments(tmp_path)) < 7
    again = WalBlockStore(tmp_path, fsync=OFF)
    again.recover("s")
    assert again.producers("s") == everything
    again.close()
    # a torn last frame takes its producer's entry with it (that block was never acked)
    last = segments(tmp_path)[-1]
    os.truncate(last, frame_starts(last)[-1] + 3)
    cut = WalBlockStore(tmp_path, fsync=OFF)
    assert cut.recover("s") == (6, 30)
    assert cut.producers("s") == {"a": 30, "b": 9, "c": 7}
    cut.write("s", 6, 30, 0, [records(1)], {"d": 2, "a": 31})
    assert cut.producers("s") == {"a": 31, "b": 9, "c": 7, "d": 2}
    with pytest.raises(ValueError, match="65535"):
        cut.write("s", 7, 31, 0, [records(1)], {"x" * 70_000: 1})


# ---- fsync policies and failures -----------------------------------------------------------------


def test_interval_policy_fsyncs_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.interval(20))
    store.recover("s")
    synced.clear()
    fill(store, 3)
    after_writes = len(synced)
    assert after_writes <= 1  # at most the folder of the new segment; no fsync per block
    deadline = time.monotonic() + 5
    # the background thread caught up: its fsync finished (marked synced then, not as it began)
    while (len(synced) == after_writes or store._writers["s"].dirty) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(synced) > after_writes
    assert not store._writers["s"].dirty
    store.close()
    assert store._flusher is None
    assert values(WalBlockStore(tmp_path)) == expected(9)


def test_interval_policy_fsyncs_early_once_sync_bytes_wait(tmp_path: Path) -> None:
    """A stream that appends SYNC_BYTES does not wait out the interval for its fsync (its acks would);
    below that, nothing is fsynced before the interval."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.interval(600_000))  # ten minutes: never in this test
    seq, offset = store.recover("s")
    small = records(3)
    store.write("s", seq, offset, 0, [small])
    time.sleep(0.2)
    assert store.durable_seq("s") == seq  # below SYNC_BYTES: waits for the interval
    value = b"x" * (1024 * 1024)
    big = decode_batch(encode_batch(0, [value] * (wal.SYNC_BYTES // len(value))), 0)
    started = time.monotonic()
    store.write("s", seq + 1, offset + 3, 0, [big])
    while store.durable_seq("s") < seq + 2 and time.monotonic() - started < 30:
        time.sleep(0.01)
    assert store.durable_seq("s") == seq + 2  # both blocks: the early fsync covers what came before
    assert not store._writers["s"].dirty and store._writers["s"].unsynced == 0
    store.close()
    assert store._flusher is None


def test_durable_listeners_hear_of_each_flush_that_moves_their_stream(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.interval(600_000))  # flushed by hand only
    heard: list[str] = []
    stop_s = store.on_durable("s", lambda: heard.append("s"))
    store.on_durable("t", lambda: heard.append("t"))
    seq, offset = store.recover("s")
    store.write("s", seq, offset, 0, [records(3)])
    assert heard == []  # written, not durable
    store.flush()
    assert (heard, store.durable_seq("s")) == (["s"], seq + 1)  # only the stream that moved
    store.flush()
    assert heard == ["s"]  # nothing new became durable
    stop_s()
    store.write("s", seq + 1, offset + 3, 0, [records(3)])
    store.flush()
    assert heard == ["s"] and store.durable_seq("s") == seq + 2  # stopped
    store.close()


def test_no_block_counts_durable_before_an_fsync_that_covers_it_has_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under the interval policy an fsync runs outside the writer's lock, and it marked the appends it
    took as synced when it began: a flush() meanwhile (a follower syncing a copy before its ack) or a
    segment roll found nothing unsynced and counted every block durable while that fsync was still
    running, so a block could be acked that a power loss then took. A block now counts durable only
    once an fsync of it has finished (the one under way, or one of the caller's own)."""
    real_fsync = os.fsync
    done: list[int] = []  # segments whose fsync finished
    busy, release = threading.Event(), threading.Event()

    def fsync(fd: int) -> None:
        segment = os.readlink(f"/proc/self/fd/{fd}").endswith(wal.SEGMENT_SUFFIX)
        if segment and threading.current_thread().name == "slow-fsync":
            busy.set()
            release.wait(30)
        real_fsync(fd)
        if segment:
            done.append(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    for case in ("flush", "roll"):
        busy.clear()
        release.clear()
        done.clear()
        store = WalBlockStore(tmp_path / case, fsync=FsyncPolicy.interval(600_000), segment_bytes=1)
        seq, offset = store.recover("s")
        store.write("s", seq, offset, 0, [records(3)])
        slow = threading.Thread(target=store.flush, name="slow-fsync")  # an fsync under way
        slow.start()
        assert busy.wait(30)
        if case == "flush":
            store.flush()  # a second flush meanwhile
        else:
            store.write("s", seq + 1, offset + 3, 0, [records(3)])  # the next block starts a segment
        assert store.durable_seq("s") == seq or done, "a block counted durable before any fsync of it ended"
        release.set()
        slow.join(30)
        store.flush()
        assert store.durable_seq("s") == seq + (1 if case == "flush" else 2)
        store.close()


def _failing_segment_fsync(monkeypatch: pytest.MonkeyPatch, segment: str | None = None) -> None:
    """os.fsync fails with EIO for the log's segments (those ending in `segment`, if given)."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.endswith(segment or wal.SEGMENT_SUFFIX):
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("where", ["roll", "flush"])
def test_a_failed_interval_fsync_never_counts_what_it_covered_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """After a failed fsync the kernel may have dropped the pages it covered and report the next fsync
    of the file as a success ("fsyncgate"): a later successful fsync (of the next segment after a roll,
    or of the same segment in the background) once counted them durable, and the receiver acked them.
    The failure is now sticky: durable_seq stays, the listeners hear nothing, and the log refuses
    writes until a restart recovers it from the disk."""
    store = WalBlockStore(
        tmp_path, fsync=FsyncPolicy.interval(600_000), segment_bytes=1 if where == "roll" else 1 << 20
    )
    heard: list[int] = []
    store.on_durable("s", lambda: heard.append(store.durable_seq("s")))
    seq, offset = store.recover("s")
    store.write("s", seq, offset, 0, [records(3)])
    _failing_segment_fsync(monkeypatch, f"{seq:020d}{wal.SEGMENT_SUFFIX}")
    if where == "roll":  # the next block starts a segment: the old one's fsync fails
        with pytest.raises(OSError, match="Input/output"):
            store.write("s", seq + 1, offset + 3, 0, [records(3, 3)])
    else:
        store.flush()  # the background fsync fails: logged
    assert store.durable_seq("s") == seq
    monkeypatch.undo()  # fsyncs succeed again: they prove nothing about the pages the failure covered
    with pytest.raises(OSError, match=r"fsync of the log .* failed.*restart the server"):
        store.write("s", seq + 1, offset + 3, 0, [records(3, 3)])
    store.flush()
    assert store.durable_seq("s") == seq and heard == []
    with pytest.raises(OSError, match="restart the server"):
        store.sync("s")
    with pytest.raises(OSError, match="restart the server"):
        store.recover("s")
    store.close()  # no raise: nothing more to fsync
    assert store.durable_seq("s") == 0
    restarted = WalBlockStore(tmp_path, fsync=FsyncPolicy.interval(600_000))
    assert restarted.recover("s") == (seq + 1, offset + 3)  # what the disk holds (here: all of it)
    restarted.close()


def test_every_block_policy_fsyncs_before_returning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = WalBlockStore(tmp_path)
    fill(store, 1)  # creates the segment
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    store.write("s", 1, 3, 0, [records(2)])
    store.write("s", 2, 5, 0, [records(2)])
    assert len(synced) == 2  # one per block (the segment exists)
    off = WalBlockStore(tmp_path / "off", fsync=OFF)
    synced.clear()
    fill(off, 3)
    assert synced == []


def test_a_failed_write_leaves_nothing_and_can_be_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = WalBlockStore(tmp_path)
    fill(store, 2)
    size = segments(tmp_path)[0].stat().st_size

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output"):
        store.write("s", 2, 6, 1, [records(3, 6)])
    assert segments(tmp_path)[0].stat().st_size == size
    monkeypatch.undo()
    store.write("s", 2, 6, 1, [records(3, 6)])
    assert values(store) == expected(9)
    assert WalBlockStore(tmp_path).recover("s") == (3, 9)


# ---- readers in other processes ------------------------------------------------------------------


def test_partial_frames_are_invisible_until_complete(tmp_path: Path) -> None:
    source = WalBlockStore(tmp_path / "src", fsync=OFF)
    fill(source, 3)
    frames = segments(tmp_path / "src")[0].read_bytes()
    starts = frame_starts(segments(tmp_path / "src")[0])
    target = tmp_path / "dst" / "s" / f"{0:020d}.wal"
    target.parent.mkdir(parents=True)
    reader = WalBlockStore(tmp_path / "dst")
    target.write_bytes(frames[: starts[1]])
    assert [b.seq for b in reader.blocks("s")] == [0]
    for partial in (starts[1] + 3, starts[1] + HEADER.size, starts[2] - 1):
        with open(target, "ab") as file:
            file.write(frames[target.stat().st_size : partial])
        assert [b.seq for b in reader.blocks("s")] == [0]
    with open(target, "ab") as file:
        file.write(frames[target.stat().st_size :])
    assert [b.seq for b in reader.blocks("s")] == [0, 1, 2]  # the index grew incrementally
    assert values(reader) == expected(9)


def _read_while_written(root: str, blocks: int, results: mp.Queue) -> None:  # type: ignore[type-arg]
    store = WalBlockStore(root)
    seen = 0
    problems = []
    deadline = time.monotonic() + 60
    while seen < blocks and time.monotonic() < deadline:
        found = store.blocks("s")
        if [b.seq for b in found] != list(range(len(found))):
            problems.append(f"gap: {[b.seq for b in found]}")
        for block in found[seen:]:
            got = [v for batch in store.read(block) for v in batch.column("value").to_pylist()]
            if len(got) != block.count or got[0] != f"r{block.first_offset}".encode():
                problems.append(f"block {block.seq}: {len(got)} records")
        seen = len(found)
    results.put((seen, problems))


def test_a_reader_in_another_process_sees_only_whole_blocks(tmp_path: Path) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    blocks = 60
    reader = ctx.Process(target=_read_while_written, args=(str(tmp_path), blocks, results))
    reader.start()
    try:
        store = WalBlockStore(tmp_path, fsync=OFF, segment_bytes=20_000)
        seq, offset = store.recover("s")
        for _ in range(blocks):
            size = 50 + seq * 7
            store.write(
                "s",
                seq,
                offset,
                0,
                [records(size // 2, offset), records(size - size // 2, offset + size // 2)],
            )
            seq, offset = seq + 1, offset + size
            time.sleep(0.005)
        seen, problems = results.get(timeout=90)
    finally:
        reader.join(30)
        if reader.is_alive():
            reader.kill()
    assert problems == []
    assert seen == blocks
    assert len(segments(tmp_path)) > 1


def test_disk_bytes_of_missing_streams(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path / "none")
    assert store.disk_bytes() == 0 and store.disk_bytes("s") == 0
    assert store.blocks("s") == [] and store.producers("s") == {}
    shutil.rmtree(tmp_path / "none", ignore_errors=True)


def test_a_failed_undo_moves_on_to_a_new_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = WalBlockStore(tmp_path, fsync=OFF, direct_io=False)  # a torn write of 10 bytes: not direct
    fill(store, 2)
    real_write = os.write

    def torn_write(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data)[:10])
        raise OSError(28, "No space left on device")

    def no_truncate(fd: int, size: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "write", torn_write)
    monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError, match="No space"):
        store.write("s", 2, 6, 1, [records(3, 6)])
    monkeypatch.undo()
    store.write("s", 2, 6, 1, [records(3, 6)])  # the torn bytes stay behind: a new segment starts
    assert [int(p.stem) for p in segments(tmp_path)] == [0, 2]
    assert values(store) == expected(9)
    restarted = WalBlockStore(tmp_path, fsync=OFF)
    assert restarted.recover("s") == (3, 9)
    assert restarted.stats.bytes_truncated == 10
    assert values(restarted) == expected(9)


@pytest.mark.parametrize("undo", ["cut", "failed"])
def test_a_failed_interval_write_fsyncs_the_blocks_before_it_before_they_count_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, undo: str
) -> None:
    """Under the interval policy a failed write's undo closed the segment without an fsync while
    blocks before it waited for one: the next flush, finding no segment open, counted them durable
    (acked) with no fsync of them ever (and after a failed undo the log went on in a new segment, the
    old one never fsynced). The undo now fsyncs them first; they count durable at the next flush."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.interval(600_000), direct_io=False)
    heard: list[int] = []
    store.on_durable("s", lambda: heard.append(store.durable_seq("s")))
    seq, offset = store.recover("s")
    store.write("s", seq, offset, 0, [records(3)])  # appended, not fsynced yet
    first = segments(tmp_path)[0]
    real_fsync, real_write = os.fsync, os.write
    synced: list[str] = []  # segments whose fsync finished

    def fsync(fd: int) -> None:
        real_fsync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    def torn_write(fd: int, data: bytes) -> int:
        real_write(fd, bytes(data)[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    def no_truncate(fd: int, size: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "write", torn_write)
    if undo == "failed":
        monkeypatch.setattr(os, "ftruncate", no_truncate)
    with pytest.raises(OSError, match="No space"):
        store.write("s", seq + 1, offset + 3, 0, [records(3, 3)])
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "ftruncate", os.truncate)
    if undo == "failed":  # the torn bytes stay behind: the retry starts a new segment
        store.write("s", seq + 1, offset + 3, 0, [records(3, 3)])
        assert len(segments(tmp_path)) == 2
    store.flush()
    assert store.durable_seq("s") > seq
    assert str(first) in synced, "blocks counted durable with no fsync of them"
    assert heard and heard[-1] == store.durable_seq("s")  # the ack of the blocks before is not held up
    store.close()


def test_a_failed_fsync_in_a_failed_writes_undo_is_sticky(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The undo's fsync (interval policy) fails: the blocks before the failed write never count
    durable, the write raises its own error, and the log takes no more writes until a restart."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.interval(600_000), direct_io=False)
    seq, offset = store.recover("s")
    store.write("s", seq, offset, 0, [records(3)])

    def failing_write(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    _failing_segment_fsync(monkeypatch)
    monkeypatch.setattr(os, "write", failing_write)
    with pytest.raises(OSError, match="No space"):
        store.write("s", seq + 1, offset + 3, 0, [records(3, 3)])
    monkeypatch.undo()
    store.flush()
    assert store.durable_seq("s") == seq
    with pytest.raises(OSError, match="restart the server"):
        store.write("s", seq + 1, offset + 3, 0, [records(3, 3)])
    store.close()


def direct_io_here(path: Path) -> bool:
    try:
        os.close(os.open(path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        (path / "probe").unlink(missing_ok=True)
    return True


def test_every_block_writes_pages_directly_and_reads_back(tmp_path: Path) -> None:
    if not direct_io_here(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    store = WalBlockStore(tmp_path)  # every-block: O_DIRECT, frames padded to whole pages
    written = fill(store, 5, per_block=7)
    assert all(size % ALIGN == 0 for size in (p.stat().st_size for p in segments(tmp_path)))
    assert frame_starts(segments(tmp_path)[0]) == [i * ALIGN for i in range(5)]  # small blocks: a page each
    assert values(store) == expected(35)
    assert store.blocks("s") == written
    raw = store.read_raw(written[2])  # a replica takes the padded payload as it is
    replica = WalBlockStore(tmp_path / "replica", direct_io=False)
    replica.skip_to("s", 2, raw.first_offset)
    replica.append_raw("s", raw)
    assert [
        v for b in replica.blocks("s") for x in replica.read(b) for v in x.column("value").to_pylist()
    ] == (expected(21)[14:])
    restarted = WalBlockStore(tmp_path)
    assert restarted.recover("s") == (5, 35)
    assert restarted.stats.bytes_truncated == 0
    fill(restarted, 1, per_block=7)  # continues the same segment, still aligned
    assert len(segments(tmp_path)) == 1 and segments(tmp_path)[0].stat().st_size % ALIGN == 0
    assert values(restarted) == expected(42)


def test_a_log_written_through_the_page_cache_continues_in_a_new_aligned_segment(tmp_path: Path) -> None:
    if not direct_io_here(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    fill(WalBlockStore(tmp_path, direct_io=False), 2)  # an older version's log: frames end anywhere
    assert segments(tmp_path)[0].stat().st_size % ALIGN != 0
    store = WalBlockStore(tmp_path)
    fill(store, 2)
    assert [int(p.stem) for p in segments(tmp_path)] == [0, 2]
    assert values(store) == expected(12)
    assert WalBlockStore(tmp_path).recover("s") == (4, 12)


def test_no_direct_io_falls_back_to_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = os.open

    def refuse_direct(path: Any, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", refuse_direct)
    store = WalBlockStore(tmp_path)
    fill(store, 3)
    assert not store.direct_io
    assert values(store) == expected(9)
    assert segments(tmp_path)[0].stat().st_size % ALIGN != 0  # unpadded


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_prepared_block_is_written_byte_for_byte_as_an_unprepared_one(
    tmp_path: Path, direct_io: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prepare() encodes the next block while the one before is written (the receiver calls it from
    another thread): the log it leaves is the same bytes; a prepare for other arguments (another seq,
    other batches, other producers), or for data the log cannot hold, is ignored and write() does the
    work (and raises) as without it."""
    logs = {}
    built = []  # frames encoded, by prepare() or write()
    build = wal._build_frame
    monkeypatch.setattr(wal, "_build_frame", lambda *args: built.append(1) or build(*args))
    for prepared in (False, True):
        store = WalBlockStore(tmp_path / str(prepared), fsync=FsyncPolicy.every_block(), direct_io=direct_io)
        store.recover("s")
        seq = offset = 0
        for n in (1, 3, 700, 2, 5000):
            batches, table = [records(n, offset), records(2, offset + n)], {"p": offset + n + 2}
            if prepared:
                store.prepare("s", seq, offset, 1, batches, table)
            info, _ = store.write("s", seq, offset, 1, batches, table)
            seq, offset = seq + 1, offset + info.count
        assert len(built) == 5  # prepared: by prepare() alone
        built.clear()
        if prepared:
            others = [records(3, offset)]
            for args in [(seq + 1, offset, 1, others, None), (seq, offset, 1, [records(3, offset)], None)]:
                store.prepare("s", *args)  # type: ignore[arg-type]
                store.write("s", seq, offset, 1, others)
                seq, offset = seq + 1, offset + 3
            built.clear()
            following = [records(4, offset + 3)]
            store.prepare("s", seq + 1, offset + 3, 1, following)  # the next block's, early
            store.write("s", seq, offset, 1, others)  # encoded here; the next one's frame is kept
            store.write("s", seq + 1, offset + 3, 1, following)
            assert len(built) == 2
            seq, offset = seq + 2, offset + 7
            store.prepare("s", seq, offset, 1, others, {"q": 1})
            store.write("s", seq, offset, 1, others, {"q": 2})
            assert store.producers("s")["q"] == 2
            bad = pa.record_batch([pa.array([1])], names=["x"])
            store.prepare("s", seq + 1, offset + 3, 1, [bad])  # does not raise
            with pytest.raises(Exception, match=r"[Ss]chema"):
                store.write("s", seq + 1, offset + 3, 1, [bad])
        store.close()
        logs[prepared] = b"".join(
            p.read_bytes() for p in sorted((tmp_path / str(prepared) / "s").glob("*.wal"))
        )
    assert logs[True].startswith(logs[False])
    store = WalBlockStore(tmp_path / "True", fsync=OFF)
    store.recover("s")
    assert len(values(store)) == sum((n + 2 for n in (1, 3, 700, 2, 5000)), 16)


def test_blocks_prepared_while_the_one_before_is_written_read_back(tmp_path: Path) -> None:
    """The receiver's pattern, in threads: block n+1 prepared while block n is written."""
    import concurrent.futures

    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.every_block())
    store.recover("s")
    sizes = [50, 3000, 1, 800, 20_000, 7, 4096, 333] * 3
    firsts = list(itertools.accumulate(sizes, initial=0))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        writing = None
        for seq, n in enumerate(sizes):
            batches = [records(n, firsts[seq])]
            if writing is not None:
                store.prepare("s", seq, firsts[seq], 0, batches)  # while seq - 1 is written
                writing.result()
            writing = pool.submit(store.write, "s", seq, firsts[seq], 0, batches)
        writing.result()
    store.close()
    assert values(WalBlockStore(tmp_path, fsync=OFF)) == expected(sum(sizes))


def _mapping_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process that holds `address` (from /proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_frame_memory_is_private_huge_page_memory(tmp_path: Path) -> None:
    """Frames are built in private memory advised for huge pages (what direct writes pin cheaply), whole
    huge pages of it; the log's own buffers are of that kind."""
    thp = Path("/sys/kernel/mm/transparent_hugepage").exists()  # else MADV_HUGEPAGE is refused
    memory = wal.frame_memory(5_000_000)
    assert len(memory) == 3 * wal.HUGE_PAGE
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    assert address % ALIGN == 0
    flags = _mapping_flags(address)
    assert "sh" not in flags, flags  # shared anonymous memory is shmem: no THP by default
    assert ("hg" in flags) == thp, flags  # MADV_HUGEPAGE

    store = WalBlockStore(tmp_path)
    store.write("s", 0, 0, 0, [decode_batch(encode_batch(0, [b"x" * 100] * 10), 1)])
    writer = store._writers["s"]
    frame = writer._frame
    assert frame is not None
    frame_flags = _mapping_flags(ctypes.addressof(ctypes.c_char.from_buffer(frame)))
    assert "sh" not in frame_flags and ("hg" in frame_flags) == thp, frame_flags


@pytest.mark.parametrize("shape", ["mixed", "an empty one among them", "an empty one alone"])
def test_a_blocks_payload_is_the_ipc_stream_of_its_batches_one_by_one(tmp_path: Path, shape: str) -> None:
    """The payload is encoded in one call (no GIL retaken per batch) yet holds exactly the bytes of a
    write_batch() per batch: sliced batches (deduplicated records), keyed ones, empty ones."""
    keyed = decode_batch(encode_batch(0, [b"v1", b"v2", b"v3"], keys=[b"k1", None, b"k3"]), 7)
    empty = records(2).slice(0, 0)
    batches = {
        "mixed": [records(5), records(6, 5).slice(2), keyed],
        "an empty one among them": [records(5), empty, keyed],
        "an empty one alone": [empty],
    }[shape]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, wal.BLOCK_SCHEMA) as ipc:
        for batch in batches:
            ipc.write_batch(batch)
    one_by_one = sink.getvalue().to_pybytes()
    store = WalBlockStore(tmp_path, fsync=OFF)
    info, _ = store.write("s", 0, 0, 1, batches, {})
    payload = bytes(store.read_raw(info).payload)
    assert payload[: len(one_by_one)] == one_by_one
    assert not payload[len(one_by_one) :].strip(b"\0")  # direct I/O's padding, nothing else
    assert [b.num_rows for b in store.read(info)] == [b.num_rows for b in batches]


def test_a_block_is_encoded_without_waiting_on_a_busy_event_loop_per_batch(tmp_path: Path) -> None:
    """The log's thread encodes while the event loop thread runs Python. Each time it retakes the GIL it
    waits up to the switch interval (5 ms) for it: a block of 100 batches encoded batch by batch took
    half a second; in one call without the GIL, a few retakes."""
    batches = [records(50, 50 * i) for i in range(100)]
    store = WalBlockStore(tmp_path, fsync=OFF)
    busy = threading.Event()
    stop = threading.Event()

    def python_loop() -> None:
        busy.set()
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=python_loop)
    spinner.start()
    try:
        busy.wait(10)
        started = time.perf_counter()
        info, _ = store.write("s", 0, 0, 1, batches, {})
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        spinner.join()
    assert info.count == 5000
    # batch by batch: about 0.5 s; 0.35 leaves room for a machine busy with other tests
    assert elapsed < 0.35, f"{elapsed:.3f} s to write a block of 100 batches beside a busy Python thread"


def test_a_write_to_a_deleted_segment_fails_and_goes_again_to_a_new_one(tmp_path: Path) -> None:
    """A live segment deleted by hand: the log went on appending to the deleted file, fsynced and
    acked, and a restart found nothing of it. The write that finds its segment deleted fails (the
    receiver keeps its records and writes them again: credit pauses with the error meanwhile), and the
    next write starts a new segment, on disk. The blocks of the deleted segment were acked: a restart
    refuses the log that lacks them (it went on from the new segment without a word)."""
    root = tmp_path / "blocks"
    store = WalBlockStore(root)
    fill(store, 2)
    segments(root)[0].unlink()
    with pytest.raises(OSError, match="was deleted while open"):
        store.write("s", 2, 6, 1, [records(3, 6)])
    store.write("s", 2, 6, 1, [records(3, 6)])
    store.close()
    assert values(WalBlockStore(root)) == expected(9)[6:]  # block 2 is on disk, in a new segment
    with pytest.raises(DamagedLogError, match=r"blocks 0\.\.1 \(records 0\.\.5\) are missing"):
        WalBlockStore(root).recover("s")


def test_a_log_whose_folder_was_deleted_is_not_made_again(tmp_path: Path) -> None:
    """`rm -rf` of a live server's data dir: the log made its folder again and acked blocks into it,
    without the released mark and the segments before, and without the data dir's lock, so a second
    server could start there beside it. Now every write fails, the retries too (the server stops on the
    lost lock: ingest.preflight.DataDirLock.lost); a restart starts the log afresh."""
    root = tmp_path / "blocks"
    store = WalBlockStore(root)
    fill(store, 2)
    shutil.rmtree(root)
    with pytest.raises(OSError, match="was deleted while open"):
        store.write("s", 2, 6, 1, [records(3, 6)])
    for _ in range(2):
        with pytest.raises(OSError, match="was deleted or replaced while this server wrote to it"):
            store.write("s", 2, 6, 1, [records(3, 6)])
    assert not root.exists()
    store.close()
    again = WalBlockStore(root)
    assert again.recover("s") == (0, 0)
    again.write("s", 0, 0, 1, [records(3, 0)])
    assert values(again) == expected(3)
    again.close()
    recovered = WalBlockStore(root)  # a log that appends to the segment it found at its start
    assert recovered.recover("s") == (1, 3)
    shutil.rmtree(root)
    for _ in range(2):
        with pytest.raises(OSError, match="deleted"):
            recovered.write("s", 1, 3, 1, [records(3, 3)])
    assert not root.exists()


def test_only_the_folders_of_streams_still_served_count_as_deleted(tmp_path: Path) -> None:
    """A removed (or kept) stream's folder deleted to reclaim disk stopped the running server: its writer
    lived on. Only the streams the server serves are looked at."""
    root = tmp_path / "blocks"
    store = WalBlockStore(root)
    for stream in ("a", "b"):
        store.write(stream, 0, 0, 1, [records(3, 0)])
    shutil.rmtree(root / "b")
    assert store.deleted_folders(["a"]) == []
    assert store.deleted_folders(["a", "b"]) == [root / "b"]


PLAIN_LOG = Path(__file__).parent / "data" / "plain_timestamps_log"
"""A log written before block timestamps were run-end encoded (one int64 a record): stream "s", block 0
with records r0-r4 (r0-r2 taken at 1,700,000,000 s, r3-r4 half a second later), block 1 with r5 (a
second after r0), receiver 7, producer "p"."""


def test_a_log_with_a_timestamp_a_record_still_reads_and_grows(tmp_path: Path) -> None:
    shutil.copytree(PLAIN_LOG, tmp_path, dirs_exist_ok=True)
    store = WalBlockStore(tmp_path, fsync=OFF)
    assert store.recover("s") == (2, 6)
    assert store.producers("s") == {"p": 6}
    base = 1_700_000_000_000_000
    for batch in (b for block in store.blocks("s") for b in store.read(block)):
        assert batch.schema.equals(BLOCK_SCHEMA)  # as the log writes now: one schema downstream
    arrivals = [
        t.value for block in store.blocks("s") for b in store.read(block) for t in plain_arrivals(b.column(2))
    ]
    assert arrivals == [base] * 3 + [base + 500_000] * 2 + [base + 1_000_000]
    fill(store, 1)  # appended after the old frames, in the new layout
    assert values(store) == [f"r{i}".encode() for i in range(6)] + [b"r6", b"r7", b"r8"]
    restarted = WalBlockStore(tmp_path, fsync=OFF)
    assert restarted.recover("s") == (3, 9)
    assert len(values(restarted)) == 9


def test_a_records_timestamp_costs_the_log_no_bytes(tmp_path: Path) -> None:
    """The records of one message share their arrival time: a batch stores it once, so a block of 100 B
    records takes the value, its offset and the (absent) key's offset, not 8 bytes more a record."""
    batch = decode_batch(encode_batch(0, [bytes(100)] * 4096), 1_700_000_000_000_000)
    column = batch.column("timestamp")
    assert pa.types.is_run_end_encoded(column.type) and len(column.values) == 1
    assert plain_arrivals(column).to_pylist() == [column.values[0].as_py()] * 4096
    _, size = WalBlockStore(tmp_path, fsync=OFF).write("s", 0, 0, 0, [batch] * 8)
    assert size < 8 * 4096 * (100 + 4 + 4 + 1) + 64 * 1024


@pytest.mark.parametrize("hook", ["_segments", "_check_segment"])
def test_a_release_by_another_process_during_recovery_is_no_gap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook: str
) -> None:
    """Spark's commit (another process) released blocks 0..2 while a restart read the log: the mark the
    recovery had read was older, so the segments the release deleted looked missing, and a healthy log
    was refused as damaged (DamagedLogError)."""
    store = WalBlockStore(tmp_path, fsync=FsyncPolicy.every_block(), segment_bytes=1)
    fill(store, 6)
    store.close()
    spark = WalBlockStore(tmp_path, fsync=FsyncPolicy.every_block(), segment_bytes=1)
    restarted = WalBlockStore(tmp_path, fsync=FsyncPolicy.every_block(), segment_bytes=1)
    original = getattr(restarted, hook)
    calls = [0]

    def releasing_first(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:  # after the recovery read the mark
            spark.release("s", 3)
        return original(*args)

    monkeypatch.setattr(restarted, hook, releasing_first)
    assert restarted.recover("s") == (6, 18)
    assert [b.seq for b in restarted.blocks("s")] == [3, 4, 5]
    restarted.close()
    spark.close()
