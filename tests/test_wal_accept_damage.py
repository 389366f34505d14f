"""Going on past damage in a stream's block log (WalBlockStore's accept_damage, `sluice serve
--accept-wal-damage`): the blocks lost are recorded, named and counted, the blocks after them kept and
read, the numbering kept; without the switch recovery refuses as before. Real logs, damaged on disk."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from test_wal import damage_older_segment, expected, fill, frame_starts, rolled, segments, span, values

from receivers.config import FsyncPolicy
from receivers.files import DataDirStateError
from receivers.wal import (
    DAMAGED_FOLDER,
    HEADER,
    LOST_FILE,
    DamagedLogError,
    LostBlocks,
    LostFileError,
    WalBlockStore,
)


def logged(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "receivers.wal"]


def without(records: list[bytes], lo: int, hi: int) -> list[bytes]:
    """`records` (r0, r1, ...) but those with offsets lo..hi-1."""
    return [v for v in records if not lo <= int(v[1:]) < hi]


def lost_file(root: Path) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = json.loads((root / "s" / LOST_FILE).read_text())["lost"]
    return entries


def refused_without_the_switch(root: Path, fsync: FsyncPolicy | None = None) -> str:
    """Recovery without the switch (and with it for another stream) refuses, changing nothing on disk;
    the refusal names the switch."""
    before = {p.name: p.read_bytes() for p in segments(root)}
    message = ""
    for store in (
        WalBlockStore(root, fsync=fsync),
        WalBlockStore(root, fsync=fsync, accept_damage=["other"]),
    ):
        with pytest.raises(DamagedLogError) as refused:
            store.recover("s")
        message = str(refused.value)
        assert "start once with --accept-wal-damage s" in message, message
    assert {p.name: p.read_bytes() for p in segments(root)} == before
    assert not (root / "s" / LOST_FILE).exists()
    return message


@pytest.mark.parametrize("where", ["payload", "header", "first"])
def test_a_bad_frame_with_sound_ones_after_it_is_gone_past_keeping_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    """Under every-block a bad frame followed by sound ones is refused (acked blocks damaged). With
    the switch the bad block alone is lost: recorded in lost.json, named in one ERROR, counted; the
    segment as it was is kept under damaged/; the sound blocks after it are read back, new blocks follow
    the highest one, and later starts without the switch neither refuse nor count it again."""
    store = WalBlockStore(tmp_path)
    fill(store, 6)  # one segment; block i holds records 3i..3i+2
    store.close()
    segment = segments(tmp_path)[0]
    starts = frame_starts(segment)
    bad = 0 if where == "first" else 2
    data = bytearray(segment.read_bytes())
    data[starts[bad] + (20 if where == "header" else HEADER.size + 40)] ^= 0xFF  # header: its payload_len
    segment.write_bytes(bytes(data))
    refused_without_the_switch(tmp_path)

    with caplog.at_level(logging.INFO, "receivers.wal"):
        store = WalBlockStore(tmp_path, accept_damage=["s"])
        assert store.recover("s") == (6, 18)
    errors = logged(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    assert errors[0].startswith(
        f"stream 's': --accept-wal-damage: block {bad} (records {3 * bad}..{3 * bad + 2}) is lost: the log "
        f"segment {segment.name} is damaged at byte {starts[bad]:,} "
        + ("(its first block)" if bad == 0 else f"(after block {bad - 1})")
    ), errors[0]
    assert f"Recorded in {tmp_path / 's' / LOST_FILE}" in errors[0], errors[0]
    assert f"the log goes on with the blocks after them (from block {bad + 1})" in errors[0], errors[0]
    kept = tmp_path / "s" / DAMAGED_FOLDER / f"{segment.name}.at-{starts[bad]}"
    assert f"kept in {kept}" in errors[0] and kept.read_bytes() == bytes(data)
    assert store.stream_stats("s").blocks_lost == 1 and store.stats.blocks_lost == 1
    assert store.stats.frames_recovered == 5  # each sound frame once, though recovery ran twice
    [lost] = store.lost_blocks("s")
    assert (lost.first_seq, lost.end_seq, lost.first_offset, lost.end_offset) == (
        bad,
        bad + 1,
        3 * bad,
        3 * bad + 3,
    )
    assert lost_file(tmp_path) == [
        {
            "first_seq": bad,
            "end_seq": bad + 1,
            "first_offset": 3 * bad,
            "end_offset": 3 * bad + 3,
            "at": lost.at,
        }
    ]
    # the sound blocks, read back (the ones before the damage in the cut segment, the ones after in
    # a segment named after the first of them)
    assert [b.seq for b in store.blocks("s")] == [s for s in range(6) if s != bad]
    assert values(store) == without(expected(18), 3 * bad, 3 * bad + 3)
    names = [p.name for p in segments(tmp_path)]
    assert names == ([] if bad == 0 else [segment.name]) + [f"{bad + 1:020d}.wal"]
    fill(store, 1)  # numbering goes on after the highest surviving block
    assert store.blocks("s")[-1].seq == 6 and store.blocks("s")[-1].first_offset == 18
    store.close()

    # a later start without the switch: the gap is known, not refused, not counted again
    caplog.clear()
    with caplog.at_level(logging.INFO, "receivers.wal"):
        again = WalBlockStore(tmp_path)
        assert again.recover("s") == (7, 21)
    assert again.stats.blocks_lost == 0 and logged(caplog, logging.ERROR) == []
    warnings = logged(caplog, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert (
        f"block {bad} (records {3 * bad}..{3 * bad + 2}) is not in the log: lost at a start with "
        f"--accept-wal-damage ({lost.at}" in warnings[0]
    ), warnings[0]
    assert values(again) == without(expected(21), 3 * bad, 3 * bad + 3)
    # once Spark has released past the gap it is nothing to speak of
    again.release("s", 7)
    again.close()
    caplog.clear()
    with caplog.at_level(logging.INFO, "receivers.wal"):
        assert WalBlockStore(tmp_path).recover("s") == (7, 21)
    assert logged(caplog, logging.WARNING) == []


@pytest.mark.parametrize("fsync", ["every-block", "interval:50"])
@pytest.mark.parametrize("missing", ["middle", "oldest"])
def test_a_missing_segment_is_gone_past_keeping_the_later_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fsync: str, missing: str
) -> None:
    policy = FsyncPolicy.parse(fsync)
    paths = rolled(tmp_path, policy)
    index = 1 if missing == "middle" else 0
    first, after = int(paths[index].stem), int(paths[index + 1].stem)
    paths[index].unlink()
    refused_without_the_switch(tmp_path, policy)

    with caplog.at_level(logging.INFO, "receivers.wal"):
        store = WalBlockStore(
            tmp_path, fsync=policy, segment_bytes=1500, direct_io=False, accept_damage=["s"]
        )
        assert store.recover("s") == (12, 240)
    errors = logged(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    where = (
        f"between segments {paths[0].name} and {paths[2].name}"
        if missing == "middle"
        else f"before {paths[1].name}, the oldest segment"
    )
    assert errors[0].startswith(
        f"stream 's': --accept-wal-damage: {span('block', first, after - 1)} (records {first * 20}.."
        f"{after * 20 - 1}) {'is' if after - first == 1 else 'are'} lost: missing from the log {where}"
    ), errors[0]
    assert "kept in" not in errors[0] and not (tmp_path / "s" / DAMAGED_FOLDER).exists()  # nothing cut
    assert store.stats.blocks_lost == after - first
    assert [(r.first_seq, r.end_seq, r.first_offset, r.end_offset) for r in store.lost_blocks("s")] == [
        (first, after, first * 20, after * 20)
    ]
    assert values(store) == without(expected(240), first * 20, after * 20)
    fill(store, 1, per_block=20)
    assert store.blocks("s")[-1].seq == 12
    store.close()
    again = WalBlockStore(tmp_path, fsync=policy)
    assert again.recover("s") == (13, 260) and again.stats.blocks_lost == 0
    assert values(again) == without(expected(260), first * 20, after * 20)


@pytest.mark.parametrize("fsync", ["every-block", "interval:50"])
@pytest.mark.parametrize("damage", ["truncated", "zeroed", "zeroed-head"])
def test_damage_to_an_older_segment_is_gone_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fsync: str, damage: str
) -> None:
    """An older segment cut mid-frame, zeroed whole, or its first frame's header zeroed: the blocks
    lost are those not sound in it (a zeroed head loses its first block alone, under "interval" too:
    the sound frames after it are kept), and the later segments are kept whole."""
    policy = FsyncPolicy.parse(fsync)
    middle, first, after, at = damage_older_segment(rolled(tmp_path, policy), damage)
    lost = {"truncated": (first + 1, after), "zeroed": (first, after)}.get(damage, (first, first + 1))
    damaged = middle.read_bytes()
    refused_without_the_switch(tmp_path, policy)

    with caplog.at_level(logging.INFO, "receivers.wal"):
        store = WalBlockStore(tmp_path, fsync=policy, accept_damage=["s"])
        assert store.recover("s") == (12, 240)
    errors = logged(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    blocks = span("block", lost[0], lost[1] - 1)
    assert errors[0].startswith(
        f"stream 's': --accept-wal-damage: {blocks} (records {lost[0] * 20}..{lost[1] * 20 - 1}) "
        f"{'is' if lost[1] - lost[0] == 1 else 'are'} lost: the log segment {middle.name} is damaged at "
        f"byte {at:,}"
    ), errors[0]
    assert (tmp_path / "s" / DAMAGED_FOLDER / f"{middle.name}.at-{at}").read_bytes() == damaged
    assert store.stats.blocks_lost == lost[1] - lost[0]
    assert values(store) == without(expected(240), lost[0] * 20, lost[1] * 20)
    store.close()
    again = WalBlockStore(tmp_path, fsync=policy)
    assert again.recover("s") == (12, 240) and again.stats.blocks_lost == 0
    fill(again, 1, per_block=20)
    assert values(again) == without(expected(260), lost[0] * 20, lost[1] * 20)


def test_two_damages_in_one_start_are_each_gone_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A missing segment and a bad frame in a later one: one ERROR each, both recorded."""
    paths = rolled(tmp_path)
    paths[1].unlink()
    gap = (int(paths[1].stem), int(paths[2].stem))
    later = paths[3]
    assert len(frame_starts(later)) >= 2
    data = bytearray(later.read_bytes())
    data[HEADER.size + 10] ^= 0x01  # its first frame, a sound one after it
    later.write_bytes(bytes(data))
    bad = int(later.stem)
    with caplog.at_level(logging.INFO, "receivers.wal"):
        store = WalBlockStore(tmp_path, accept_damage=["s"])
        assert store.recover("s") == (12, 240)
    assert len(logged(caplog, logging.ERROR)) == 2
    assert [(r.first_seq, r.end_seq) for r in store.lost_blocks("s")] == [gap, (bad, bad + 1)]
    assert store.stats.blocks_lost == gap[1] - gap[0] + 1
    left = without(without(expected(240), gap[0] * 20, gap[1] * 20), bad * 20, bad * 20 + 20)
    assert values(store) == left
    store.close()
    assert WalBlockStore(tmp_path).recover("s") == (12, 240)


def test_a_mend_cut_short_by_a_crash_is_refused_or_made_again(tmp_path: Path) -> None:
    """A crash after the sound frames were copied to their own segment and before the damaged one was
    cut: the damage is still there, refused without the switch; with it, mended as if the first time."""
    store = WalBlockStore(tmp_path)
    fill(store, 6)
    store.close()
    segment = segments(tmp_path)[0]
    starts = frame_starts(segment)
    data = bytearray(segment.read_bytes())
    data[starts[2] + HEADER.size + 40] ^= 0xFF
    segment.write_bytes(bytes(data))
    (tmp_path / "s" / f"{3:020d}.wal").write_bytes(bytes(data[starts[3] :]))  # the copy, made
    with pytest.raises(DamagedLogError, match=f"damaged at byte {starts[2]:,}"):
        WalBlockStore(tmp_path).recover("s")
    store = WalBlockStore(tmp_path, accept_damage=["s"])
    assert store.recover("s") == (6, 18)
    assert [b.seq for b in store.blocks("s")] == [0, 1, 3, 4, 5]
    assert values(store) == without(expected(18), 6, 9)
    assert [(r.first_seq, r.end_seq) for r in store.lost_blocks("s")] == [(2, 3)]


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000], ids=["not-json", "nested-too-deeply"])
def test_an_unreadable_record_of_lost_blocks_stops_the_start_naming_it(tmp_path: Path, text: str) -> None:
    """Nested too deeply (valid JSON as far as it goes), json.loads raised RecursionError: a traceback."""
    paths = rolled(tmp_path)
    paths[1].unlink()
    WalBlockStore(tmp_path, accept_damage=["s"]).recover("s")
    path = tmp_path / "s" / LOST_FILE
    path.write_text(text)
    with pytest.raises(LostFileError) as refused:
        WalBlockStore(tmp_path).recover("s")
    assert isinstance(refused.value, DataDirStateError)
    assert str(refused.value).startswith(
        f"{path} (the blocks of stream 's' that a start with --accept-wal-damage"
    )
    # removed, the gap is refused again until the switch records it again
    path.unlink()
    with pytest.raises(DamagedLogError):
        WalBlockStore(tmp_path).recover("s")
    assert WalBlockStore(tmp_path, accept_damage=["s"]).recover("s") == (12, 240)
    assert WalBlockStore(tmp_path).recover("s") == (12, 240)


def test_damage_where_nothing_is_lost_or_nothing_follows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Damage to released blocks only is mended with a WARNING, nothing lost or counted; a torn newest
    tail is cut as it always was (no refusal, nothing for the switch to do)."""
    store = WalBlockStore(tmp_path)
    fill(store, 6)
    store.release("s", 3)  # blocks 0..2 released; the segment stays (the newest is never deleted)
    store.close()
    segment = segments(tmp_path)[0]
    starts = frame_starts(segment)
    data = bytearray(segment.read_bytes())
    data[starts[1] + HEADER.size + 40] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(DamagedLogError):
        WalBlockStore(tmp_path).recover("s")
    with caplog.at_level(logging.INFO, "receivers.wal"):
        store = WalBlockStore(tmp_path, accept_damage=["s"])
        assert store.recover("s") == (6, 18)
    assert logged(caplog, logging.ERROR) == [] and store.stats.blocks_lost == 0
    assert any("nothing is lost" in w for w in logged(caplog, logging.WARNING))
    assert store.lost_blocks("s") == [] and values(store) == expected(18)[9:]
    store.close()
    # a torn newest tail
    os.truncate(segments(tmp_path)[-1], os.path.getsize(segments(tmp_path)[-1]) - 5)
    store = WalBlockStore(tmp_path, accept_damage=["s"])
    assert store.recover("s") == (5, 15) and store.stats.blocks_lost == 0


def test_lost_blocks_of_a_log_without_a_record_is_empty(tmp_path: Path) -> None:
    store = WalBlockStore(tmp_path)
    assert store.lost_blocks("s") == []
    fill(store, 1)
    assert store.lost_blocks("s") == []
    assert LostBlocks(1, 3, 10, None).records() == "records from offset 10"
