"""A damaged block log on a cluster's receiver node. At its start an owner drops the blocks past its
committed seq (never acked: receivers.replication's truncate_uncommitted, WalBlockStore.truncate_from)
before its receivers recover the log. That cut checks the blocks below the committed seq first: cut
first, an older segment's bad tail or a bad frame became the newest segment's torn tail (cut with a
WARNING) and a deleted segment the log's end, acked blocks were gone without a word and new blocks took
their seqs and offsets. Now damage to acked blocks stops the start as on a single server (naming it and
--accept-wal-damage), or with the flag is recorded and gone past, keeping every acked block that
survives; damage in blocks never acked goes with them. A follower's copy of another node's log is not
the flag's: a damaged copy is refused naming what to do, untouched, and taken again once moved aside.
Real logs damaged on disk, real nodes (in process, and `sluice serve --role receiver`). And, on a
single server too, the backlog leaves out the records recorded as lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pyarrow as pa
import pytest
from support import loopback_cluster, running_server, wait_until
from test_cli import sluice
from test_wal import damage_older_segment, expected, fill, frame_starts, rolled, segments, values
from test_wal_accept_damage import without

from receivers import wal
from receivers.block_store import release_below
from receivers.cluster import Cluster
from receivers.config import FsyncPolicy
from receivers.replica_store import ReplicaStore
from receivers.replication import read_committed, truncate_uncommitted, write_committed
from receivers.wal import HEADER, LOST_FILE, DamagedLogError, WalBlockStore
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ingest.cluster_driver import ClusterDriver


def lost(root: Path) -> list[tuple[int, int, int, int | None]]:
    entries = json.loads((root / "s" / LOST_FILE).read_text())["lost"]
    return [(e["first_seq"], e["end_seq"], e["first_offset"], e["end_offset"]) for e in entries]


def on_disk(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in segments(root)}


def committed_at(tmp_path: Path, seq: int) -> Path:
    path = tmp_path / "committed.json"
    write_committed(path, {"s": seq}, sync=False)
    return path


def damage(paths: list[Path], kind: str) -> tuple[int, int]:
    """Damage the second segment of a rolled log (blocks 2 and 3 of 20 records each): the blocks lost,
    [first, end)."""
    if kind == "missing":
        paths[1].unlink()
        return 2, 4
    damage_older_segment(paths, kind)  # "zeroed-head": block 2 bad, block 3 sound after it
    return (2, 3) if kind == "zeroed-head" else (3, 4)


@pytest.mark.parametrize("kind", ["missing", "truncated", "zeroed-head"])
def test_damage_to_acked_blocks_stops_the_cut_or_is_gone_past_keeping_them(tmp_path: Path, kind: str) -> None:
    """Blocks 0..5 committed (acked), 6..11 not, a segment of acked blocks damaged. Before, the cut
    deleted the later segments first and recovery took what was left for a sound log or a torn tail:
    the damaged acked blocks were gone without a word (no refusal, nothing recorded) and the log went
    on at block 2 or 3, seqs and offsets its followers held."""
    root = tmp_path / "blocks"
    paths = rolled(root)  # segments 0, 2, 4, ..., 10: two blocks of 20 records each
    first, end = damage(paths, kind)
    committed = committed_at(tmp_path, 6)
    before = on_disk(root)
    with pytest.raises(DamagedLogError) as refused:
        truncate_uncommitted(WalBlockStore(root), ["s"], committed)
    assert "start once with --accept-wal-damage s" in str(refused.value), refused.value
    assert on_disk(root) == before and not (root / "s" / LOST_FILE).exists()  # nothing cut

    store = WalBlockStore(root, accept_damage=["s"])
    truncate_uncommitted(store, ["s"], committed)
    assert lost(root) == [(first, end, 20 * first, 20 * end)]
    assert store.recover("s") == (6, 120)  # the next block after the acked ones, not over the loss
    kept = [s for s in range(6) if not first <= s < end]
    assert [b.seq for b in store.blocks("s")] == kept  # every acked block that survives; none past 5
    assert values(store) == without(expected(120), 20 * first, 20 * end)
    fill(store, 1, per_block=20)
    assert (store.blocks("s")[-1].seq, store.blocks("s")[-1].first_offset) == (6, 120)
    store.close()
    assert WalBlockStore(root).recover("s") == (7, 140)  # a later start without the flag serves


@pytest.mark.parametrize("fsync", ["every-block", "interval:50"])
def test_a_bad_frame_before_unacked_ones_is_gone_past_without_keeping_them(
    tmp_path: Path, fsync: str
) -> None:
    """One segment, blocks 0..5, block 2's frame bad, blocks 3 acked and 4, 5 not. The flag keeps the
    sound frames after a bad one (moved to a segment of their own): the unacked 4 and 5 were kept too
    (their producers had resent them: read twice); without the cut checking first, block 2 was cut as
    a torn tail once the cut removed 3..5, and the log went on at block 2. Under the interval policy a
    bad frame in the newest segment is a torn tail, sound frames after it or not (never acked: written
    after the last fsync), but not one before a block the node committed: acked, so durable."""
    policy = FsyncPolicy.parse(fsync)
    store = WalBlockStore(tmp_path, fsync=policy)
    fill(store, 6)  # 3 records a block
    store.close()
    segment = segments(tmp_path)[0]
    data = bytearray(segment.read_bytes())
    data[frame_starts(segment)[2] + HEADER.size + 40] ^= 0xFF
    segment.write_bytes(bytes(data))
    committed = committed_at(tmp_path, 4)
    with pytest.raises(DamagedLogError, match="--accept-wal-damage s"):
        truncate_uncommitted(WalBlockStore(tmp_path, fsync=policy), ["s"], committed)
    assert segment.read_bytes() == bytes(data)  # nothing cut
    store = WalBlockStore(tmp_path, fsync=policy, accept_damage=["s"])
    truncate_uncommitted(store, ["s"], committed)
    assert lost(tmp_path) == [(2, 3, 6, 9)]
    assert store.recover("s") == (4, 12)
    assert [b.seq for b in store.blocks("s")] == [0, 1, 3]
    assert values(store) == without(expected(12), 6, 9)
    store.close()


def test_damage_in_blocks_never_acked_goes_with_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Block 2's header bad, blocks 2..5 never committed: not refused (nothing acked is damaged), cut
    with them, nothing recorded as lost. Before, the cut saw no frame past the bad header and cut
    nothing, and recovery refused the bad frame with sound ones after it."""
    store = WalBlockStore(tmp_path)
    fill(store, 6)
    store.close()
    segment = segments(tmp_path)[0]
    data = bytearray(segment.read_bytes())
    data[frame_starts(segment)[2] + 20] ^= 0xFF  # its payload length
    segment.write_bytes(bytes(data))
    store = WalBlockStore(tmp_path)
    with caplog.at_level(logging.WARNING):
        truncate_uncommitted(store, ["s"], committed_at(tmp_path, 2))
    assert "in blocks never committed (never acked): cut with them" in caplog.text
    assert store.recover("s") == (2, 6) and values(store) == expected(6)
    assert not (tmp_path / "s" / LOST_FILE).exists() and store.stats.blocks_lost == 0


def test_a_loss_across_the_committed_seq_numbers_past_it(tmp_path: Path) -> None:
    """Blocks 2 and 3 missing, block 2 acked and 3 not: recorded lost together (where block 3 began is
    known, where an unacked block 3 would end is what numbering needs), the blocks after dropped, and
    the log goes on at block 4: block 2's seq and offsets are its followers' copy's."""
    root = tmp_path / "blocks"
    paths = rolled(root)
    paths[1].unlink()
    store = WalBlockStore(root, accept_damage=["s"])
    truncate_uncommitted(store, ["s"], committed_at(tmp_path, 3))
    assert lost(root) == [(2, 4, 40, 80)]
    assert store.recover("s") == (4, 80) and [b.seq for b in store.blocks("s")] == [0, 1]
    store.close()
    assert WalBlockStore(root).recover("s") == (4, 80)


@pytest.mark.parametrize("accept", [False, True])
def test_acked_blocks_gone_from_the_end_stop_the_start(tmp_path: Path, accept: bool) -> None:
    """The newest segment (blocks 10, 11, acked) deleted: the log ends before the committed seq. Before,
    the start went on at block 10, giving acked blocks' seqs and offsets again. Where block 12 begins is
    not known here, so the flag does not go past it either."""
    root = tmp_path / "blocks"
    paths = rolled(root)
    paths[-1].unlink()
    before = on_disk(root)
    store = WalBlockStore(root, accept_damage=["s"] if accept else [])
    with pytest.raises(DamagedLogError) as refused:
        truncate_uncommitted(store, ["s"], committed_at(tmp_path, 12))
    message = str(refused.value)
    assert "ends at block 10 (offset 200), but this node committed (acked) the blocks up to 11" in message
    assert "blocks 10..11 are gone from the end of the log" in message, message
    assert "replicas/<this node's id>/s/" in message, message
    assert on_disk(root) == before and not (root / "s" / LOST_FILE).exists()
    # a log with nothing but blocks never committed past what it holds is no damage
    truncate_uncommitted(WalBlockStore(root), ["s"], committed_at(tmp_path, 10))
    assert WalBlockStore(root).recover("s") == (10, 200)


def _passes(store: WalBlockStore) -> list[str]:
    """The streams of each pass `store` makes over a whole log from now on (a _recover call reads and
    checks every frame), in order: a spy on the real store, which goes on doing the work."""
    calls: list[str] = []
    recover = store._recover

    def counted(stream: str, folder: Path) -> Any:
        calls.append(stream)
        return recover(stream, folder)

    store._recover = counted  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("kind", ["sound", "missing", "truncated", "zeroed-head"])
def test_an_owners_start_reads_its_log_once_when_the_cut_drops_nothing(tmp_path: Path, kind: str) -> None:
    """Every block committed, so the cut at the start drops nothing. The check below the committed seq
    reads the whole log (going past damage with the flag), and the recovery after the cut read it all
    again: a second pass, 0.06-0.1 s more for a log of 326 MB in the page cache, a whole read of the
    disk for one that is not. Now the recovery takes what the check found: what a pass of its own finds
    (a later store's recovery of the same log agrees: its end, its producers' marks, its frame count)."""
    root = tmp_path / "blocks"
    paths = rolled(root)
    if kind != "sound":
        damage(paths, kind)
    store = WalBlockStore(root, accept_damage=["s"])
    passes = _passes(store)
    truncate_uncommitted(store, ["s"], committed_at(tmp_path, 12))
    checked = len(passes)
    assert checked >= 1
    end = store.recover("s")
    assert len(passes) == checked  # no pass of its own: was one more
    producers, frames = store.producers("s"), store.stats.frames_recovered
    store.close()
    again = WalBlockStore(root)
    assert again.recover("s") == end == (12, 240)
    assert again.producers("s") == producers
    assert (
        again.stats.frames_recovered
        == frames
        == (12 if kind == "sound" else 12 - len(range(*damage_span(kind))))
    )


def damage_span(kind: str) -> tuple[int, int]:
    """The blocks damage(kind) loses."""
    return {"missing": (2, 4), "zeroed-head": (2, 3), "truncated": (3, 4)}[kind]


@pytest.mark.parametrize("change", ["cut", "write", "release"])
def test_the_recovery_after_the_check_reads_the_log_again_once_it_changed(
    tmp_path: Path, change: str
) -> None:
    """What the check below the committed seq found is taken only for the log it read: blocks cut past
    the committed seq, a block written or blocks released since (by anything) and the recovery reads
    the log itself, and numbers on from what is there."""
    root = tmp_path / "blocks"
    rolled(root)
    store = WalBlockStore(root)
    passes = _passes(store)
    truncate_uncommitted(store, ["s"], committed_at(tmp_path, 6 if change == "cut" else 12))
    want = (6, 120) if change == "cut" else (12, 240)
    if change != "cut":
        other = WalBlockStore(root)
        if change == "write":
            fill(other, 1, per_block=20)
            want = (13, 260)
        else:
            assert release_below(other, ["s"], {"s": 100}) == 5  # blocks 0..4
        other.close()
    checked = len(passes)
    assert store.recover("s") == want
    assert len(passes) == checked + 1
    assert [b.seq for b in store.blocks("s")][-1] == want[0] - 1
    store.close()


@pytest.mark.parametrize("kind", ["sound", "torn", "missing", "truncated", "zeroed-head"])
def test_an_owners_start_without_a_committed_file_reads_its_log_once(tmp_path: Path, kind: str) -> None:
    """No committed.json (a data dir from before committed seqs were kept, or whose last run had
    replication 1): nothing is cut, the whole log counts as committed, and truncate_uncommitted
    recovers each log to write its end to the file; the receivers' recovery then read every log a
    second time (and counted its frames twice). Now it takes what that pass found, torn tail cut and
    damage gone past and recorded with the flag: what a later store's pass of its own finds."""
    root = tmp_path / "blocks"
    paths = rolled(root)
    if kind == "torn":
        newest = paths[-1]
        os.truncate(newest, frame_starts(newest)[-1] + 5)  # block 11 torn
    elif kind != "sound":
        damage(paths, kind)
    store = WalBlockStore(root, accept_damage=["s"])
    passes = _passes(store)
    committed = tmp_path / "committed.json"
    truncate_uncommitted(store, ["s"], committed)
    want = (11, 220) if kind == "torn" else (12, 240)
    assert read_committed(committed) == {"s": want[0]}
    checked = len(passes)
    assert checked >= 1  # one, or one more after each damage recorded
    end = store.recover("s")
    assert len(passes) == checked  # no pass of its own: was one more
    assert end == want
    fresh = WalBlockStore(root)  # a pass of its own over the log as the start left it
    assert fresh.recover("s") == end
    assert fresh.producers("s") == store.producers("s")
    lost_blocks = 0 if kind in {"sound", "torn"} else len(range(*damage_span(kind)))
    frames = fresh.stats.frames_recovered
    fresh.close()
    assert store.stats.frames_recovered == frames == want[0] - lost_blocks  # was twice as many
    fill(store, 1, per_block=20)  # the writer taken goes on where the log ends
    store.close()
    assert WalBlockStore(root).recover("s") == (want[0] + 1, want[1] + 20)


@pytest.mark.parametrize("change", ["write", "release", "made"])
def test_the_recovery_after_a_start_without_a_committed_file_reads_the_log_again_once_it_changed(
    tmp_path: Path, change: str
) -> None:
    """What truncate_uncommitted's pass found (no committed.json) is taken only for the log it read: a
    block written or blocks released since (by anything), and the recovery reads the log itself. And
    a folder that pass could not read (none yet: a new stream) matches no folder made since: taken,
    the writer did not know its folder, and a deletion of it while the node runs went unnoticed
    (deleted_folders; before, a failed read's fingerprint was an empty folder's)."""
    root = tmp_path / "blocks"
    stream = "s" if change != "made" else "new"
    if change != "made":
        rolled(root)
    store = WalBlockStore(root)
    passes = _passes(store)
    truncate_uncommitted(store, [stream], tmp_path / "committed.json")
    want = (12, 240) if change != "made" else (0, 0)
    other = WalBlockStore(root)
    if change == "write":
        fill(other, 1, per_block=20)
        want = (13, 260)
    elif change == "release":
        assert release_below(other, ["s"], {"s": 100}) == 5  # blocks 0..4
    else:
        (root / stream).mkdir(parents=True)
    other.close()
    checked = len(passes)
    assert store.recover(stream) == want
    assert len(passes) == checked + 1
    if change == "made":
        shutil.rmtree(root / stream)  # rm -rf while the node runs
        assert store.deleted_folders([stream]) == [root / stream]
    else:
        assert [b.seq for b in store.blocks("s")][-1] == want[0] - 1
    store.close()


async def test_a_nodes_start_without_a_committed_file_reads_its_log_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real node (node 0 of 2, replication 2, node 1 down) started on a data dir without
    committed.json, as a run with replication 1 leaves it: one pass over its log, was two (its start
    wrote the log's end to the file, then its receiver read the log again), and it serves on from the
    log's end."""
    data_dir, clusters = await _node_data(tmp_path, 60, 4096)
    (data_dir / "committed.json").unlink()
    log_folder = data_dir / "blocks" / "s"
    held = WalBlockStore(data_dir / "blocks").blocks("s")
    passes: list[Path] = []
    recover = WalBlockStore._recover

    def counted(store: WalBlockStore, stream: str, folder: Path) -> Any:
        passes.append(folder)
        return recover(store, stream, folder)

    monkeypatch.setattr(WalBlockStore, "_recover", counted)
    async with running_server(data_dir, "s", cluster=clusters[0], port=_port(clusters[0])) as node:
        assert [f for f in passes if f == log_folder] == [log_folder]  # was two
        async with Producer(clusters[0].me.target, "s", producer_id="q", linger=0) as producer:
            await producer.send_many([b"after"] * 5)
            await producer.flush(timeout=10)
        assert node.node is not None
        newest = node.node.local.blocks("s")[-1]
        assert (newest.seq, newest.first_offset) == (held[-1].seq + 1, held[-1].end_offset)
    assert read_committed(data_dir / "committed.json")["s"] == held[-1].seq + 2


def test_a_folder_that_could_not_be_read_matches_no_later_one(tmp_path: Path) -> None:
    """The fingerprint the recovery after a check compares its folder with: one taken when the folder
    could not be read (gone, not a folder) is None, which matches nothing, not even another None; an
    empty folder's is (). Before, a failed read gave () too, and so matched an empty folder made since
    (a pass that found no folder taken for one over it). As root here, so no chmod 000: the reads that
    fail are those of a path that is missing or a file. Function-level: a fingerprint of the check
    below the committed seq fails only in a race (its folder is read just before)."""
    empty, gone, file = tmp_path / "empty", tmp_path / "gone", tmp_path / "file"
    empty.mkdir()
    file.write_bytes(b"")
    assert wal._fingerprint(empty) == ()
    assert wal._fingerprint(gone) is None
    assert wal._fingerprint(file) is None
    assert wal._same_files(wal._fingerprint(empty), wal._fingerprint(empty))
    assert not wal._same_files(wal._fingerprint(gone), wal._fingerprint(empty))
    assert not wal._same_files(wal._fingerprint(gone), wal._fingerprint(gone))
    assert not wal._same_files(wal._fingerprint(empty), wal._fingerprint(gone))


# ---- real nodes ----------------------------------------------------------------------------------


async def _node_data(tmp_path: Path, records: int, segment_bytes: int) -> tuple[Path, list[Cluster]]:
    """Node 0 of two (replication 2, min-insync 1: node 1 never runs, node 0 acks alone) after taking
    `records` records in blocks of 10: its data dir."""
    clusters = loopback_cluster(2, replication=2, min_insync=1)
    data_dir = tmp_path / "node0"
    async with (
        running_server(
            data_dir, "s", cluster=clusters[0], port=_port(clusters[0]), segment_bytes=segment_bytes
        ),
        Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer,
    ):
        for i in range(0, records, 10):
            await producer.send_many([f"r{j}".encode() for j in range(i, i + 10)])
            await producer.flush(timeout=10)
    return data_dir, clusters


async def test_a_receiver_node_refuses_a_damaged_log_and_goes_on_past_it_with_the_flag(
    tmp_path: Path,
) -> None:
    """`sluice serve --role receiver` on a log with a segment of acked blocks deleted, the blocks after
    it never committed (a crash before its follower had them): exit 1 naming the blocks and
    --accept-wal-damage, no traceback. Before, it served: the cut of the uncommitted blocks left the
    gap at the log's end, and new blocks took the lost blocks' seqs and offsets. In process with the
    flag, the node serves, records the loss, and numbers new blocks after it."""
    data_dir, clusters = await _node_data(tmp_path, 200, 4096)
    blocks = data_dir / "blocks"
    paths = segments(blocks)
    assert len(paths) >= 4, paths
    held = {b.seq: b for b in WalBlockStore(blocks).blocks("s")}
    gone = range(int(paths[1].stem), int(paths[2].stem))
    paths[1].unlink()
    write_committed(data_dir / "committed.json", {"s": gone[-1] + 1}, sync=False)  # later: unacked
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("".join(f"{n.id} {n.target}\n" for n in clusters[0].nodes))
    port = clusters[0].me.target.rsplit(":", 1)[1]
    flags = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--replication", "2"]
    flags += [
        "--stream",
        "s",
        "--min-insync",
        "1",
        "--port",
        port,
        "--metrics-port",
        "-1",
        "--data-dir",
        str(data_dir),
    ]
    refused = sluice("serve", *flags, timeout=60)
    stderr = refused.stderr.decode()
    assert refused.returncode == 1, stderr
    assert "cannot start the server: stream 's': " in stderr and "--accept-wal-damage s" in stderr, stderr
    assert f"between segments {paths[0].name} and {paths[2].name}" in stderr, stderr
    assert "Traceback" not in stderr, stderr

    async with running_server(
        data_dir, "s", cluster=clusters[0], port=int(port), segment_bytes=4096, accept_wal_damage=("s",)
    ) as node:
        assert node.node is not None
        local = node.node.local
        assert [b.seq for b in local.blocks("s")] == [s for s in held if s < gone[0]]
        async with Producer(clusters[0].me.target, "s", producer_id="q", linger=0) as producer:
            await producer.send_many([b"after"] * 5)
            await producer.flush(timeout=10)
        newest = local.blocks("s")[-1]
        assert (newest.seq, newest.first_offset) == (gone[-1] + 1, held[gone[-1]].end_offset)
    first = held[gone[0]]
    assert lost(blocks) == [(gone[0], gone[-1] + 1, first.first_offset, held[gone[-1]].end_offset)]


async def test_a_damaged_copy_is_refused_untouched_by_the_flag_and_taken_again_once_moved(
    tmp_path: Path,
) -> None:
    """A follower's copy of node 0's log with a bad frame before sound ones: --accept-wal-damage is for
    the node's own log and does not touch it; the copy is refused (its owner's Replicate ends INTERNAL
    with words that say to move the copy aside, not to use the flag, which did nothing for it), and
    once moved aside, the follower takes a whole new copy from its owner."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    want = [f"r{j}".encode() for j in range(60)]

    async with (
        running_server(tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1])),
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=_port(clusters[0])) as node0,
    ):
        await wait_until(lambda: bool(node0.node and node0.node.replicator.in_sync()), 15)
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            for i in range(0, 60, 10):
                await producer.send_many(want[i : i + 10])
                await producer.flush(timeout=10)
    copy = tmp_path / "node1" / "replicas" / "0"
    [segment] = segments(copy)
    starts = frame_starts(segment)
    assert len(starts) >= 4, starts
    data = bytearray(segment.read_bytes())
    data[starts[1] + HEADER.size + 40] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(DamagedLogError) as refused:
        ReplicaStore(tmp_path / "node1" / "replicas").next_seq(0, "s")
    message = str(refused.value)
    assert "a copy of another node's log" in message and "--accept-wal-damage (for" in message, message
    assert "start once with --accept-wal-damage" not in message, message
    assert f"move the copy's folder, {copy / 's'}, out of {copy}" in message, message

    async with (
        running_server(
            tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1]), accept_wal_damage=("s",)
        ),
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=_port(clusters[0])) as node0,
    ):
        replicator = node0.node.replicator  # type: ignore[union-attr]
        await wait_until(lambda: "INTERNAL" in replicator.status(), 15)
        assert "a copy of another node's log" in replicator.status(), replicator.status()
        assert not replicator.in_sync()
    assert segment.read_bytes() == bytes(data) and not (copy / "s" / LOST_FILE).exists()

    shutil.move(copy / "s", tmp_path / "copy-aside")

    async with (
        running_server(tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1])),
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=_port(clusters[0])) as node0,
    ):
        replicator = node0.node.replicator  # type: ignore[union-attr]
        await wait_until(lambda: bool(replicator.in_sync()), 15)
        assert await _read(clusters[1].me.target, 0, 60) == want


def _port(cluster: object) -> int:
    return int(cluster.me.target.rsplit(":", 1)[1])  # type: ignore[attr-defined]


async def _read(target: str, owner: int, end: int) -> list[bytes]:
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        try:
            async with grpc.aio.insecure_channel(target) as channel:
                stub = pb_grpc.BlocksStub(channel)
                found: list[bytes] = []
                request = pb.ReadBlocksRequest(stream="s", owner=owner, from_offset=0, to_offset=end)
                async for chunk in stub.ReadBlocks(request):
                    found.extend(pa.ipc.open_stream(chunk.arrow_ipc).read_all().column("value").to_pylist())
                return found
        except grpc.aio.AioRpcError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


# ---- the backlog ---------------------------------------------------------------------------------


async def test_the_backlog_leaves_out_records_recorded_as_lost(tmp_path: Path) -> None:
    """Blocks 4, 5 (records 80..119 of 240) gone past with --accept-wal-damage: they can never be read.
    Before, the backlog (sluice streams list, the status page) counted them, 240, until Spark passed
    the gap; now 200, the records there are to read."""
    paths = rolled(tmp_path / "data" / "blocks")
    paths[2].unlink()

    async with running_server(tmp_path / "data", "s", accept_wal_damage=("s",)) as server:
        assert server.stream_backlog("s") == 200
        async with grpc.aio.insecure_channel(server.target) as channel:
            view = await pb_grpc.AdminStub(channel).ListStreams(pb.ListStreamsRequest())
        assert {s.stream: s.backlog for s in view.streams}["s"] == 200
        server.committed["s"] = 60  # Spark read 0..59: left are 60..79 and 120..239
        assert server.stream_backlog("s") == 140
        server.committed["s"] = 100  # past the gap's start: 120..239
        assert server.stream_backlog("s") == 120


async def test_the_backlog_leaves_out_records_a_start_under_fsync_off_found_missing(tmp_path: Path) -> None:
    """The same gap (blocks 4, 5, records 80..119 of 240, a segment gone) after a power loss under
    --fsync off: the start goes on past it with an ERROR, recording nothing in lost.json. The backlog
    (sluice streams list, the status page) subtracted only lost.json's records, so it counted 240 where
    the query reads 200; now it counts what the log's blocks hold, as the source does
    (receivers.block.gaps), whatever made the gap."""
    paths = rolled(tmp_path / "data" / "blocks")
    paths[2].unlink()

    async with running_server(tmp_path / "data", "s", fsync=FsyncPolicy.off()) as server:
        assert not (tmp_path / "data" / "blocks" / "s" / LOST_FILE).exists()  # said in an ERROR alone
        assert server.stream_backlog("s") == 200
        async with grpc.aio.insecure_channel(server.target) as channel:
            view = await pb_grpc.AdminStub(channel).ListStreams(pb.ListStreamsRequest())
        assert {s.stream: s.backlog for s in view.streams}["s"] == 200
        assert server.status.snapshot()["streams"][0]["backlog"] == 200
        server.committed["s"] = 60  # Spark read 0..59: left are 60..79 and 120..239
        assert server.stream_backlog("s") == 140
        server.committed["s"] = 100  # inside the gap: 120..239
        assert server.stream_backlog("s") == 120


async def test_a_log_cut_short_of_its_committed_seq_goes_on_from_the_copies_once_moved_aside(
    tmp_path: Path,
) -> None:
    """Node 0's newest segment (acked, on node 1 too) deleted: the start stops, the flag or not (before,
    node 0 numbered new blocks over it). Its segments moved aside as the refusal says, it goes on past
    node 1's copy, whose records stay readable there."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    want = [f"r{j}".encode() for j in range(60)]

    async with (
        running_server(tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1])),
        running_server(
            tmp_path / "node0", "s", cluster=clusters[0], port=_port(clusters[0]), segment_bytes=4096
        ) as node0,
    ):
        await wait_until(lambda: bool(node0.node and node0.node.replicator.in_sync()), 15)
        async with Producer(clusters[0].me.target, "s", producer_id="p", linger=0) as producer:
            for i in range(0, 60, 10):
                await producer.send_many(want[i : i + 10])
                await producer.flush(timeout=10)
    blocks = tmp_path / "node0" / "blocks"
    paths = segments(blocks)
    assert len(paths) >= 3, paths
    paths[-1].unlink()
    for accept in ((), ("s",)):
        with pytest.raises(DamagedLogError, match="gone from the end of the log"):
            async with running_server(
                tmp_path / "node0",
                "s",
                cluster=clusters[0],
                port=_port(clusters[0]),
                accept_wal_damage=accept,
            ):
                pass
    aside = tmp_path / "aside"
    aside.mkdir()
    for path in segments(blocks):
        shutil.move(path, aside / path.name)
    async with (
        running_server(tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1])),
        running_server(tmp_path / "node0", "s", cluster=clusters[0], port=_port(clusters[0])) as node0,
    ):
        assert node0.receivers["s"].log_end == (6, 60)  # past the copy's end: nothing given twice
        await wait_until(lambda: bool(node0.node and node0.node.replicator.in_sync()), 15)
        async with Producer(clusters[0].me.target, "s", producer_id="q", linger=0) as producer:
            await producer.send_many([b"after"] * 5)
            await producer.flush(timeout=10)
        assert await _read(clusters[1].me.target, 0, 60) == want


async def test_the_drivers_node_backlog_leaves_out_records_gone_from_every_holders_log(
    tmp_path: Path,
) -> None:
    """Node 0 of two (replication 1) started past three deleted segments with --accept-wal-damage:
    records 40..199 of 240 are recorded lost and no holder has them. The driver's backlog of node 0
    (NodeRates' brake, `sluice_node_backlog_records`, the backlog column of `sluice rate get`) counted
    them: it took each partition's readable end less Spark's commit, and nodes did not say what was
    gone (PartitionInfo.gone, now). With Spark's commit at 40, before the gap, node 0 showed 200 and
    its intake was braked (200 over one interval's 100 records at 200 records/s shared by two idle
    nodes), until Spark's commits passed the gap; now 40, not braked. Before any commit it counted
    from offset 0; now from the first record held."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    clusters = loopback_cluster(2)
    paths = rolled(tmp_path / "node0" / "blocks")  # 12 blocks of 20 records, 2 to a segment
    assert len(paths) == 6, paths
    for path in paths[1:5]:
        path.unlink()  # blocks 2..9, records 40..199
    (tmp_path / "node0" / "node.json").write_text('{"node_id": 0}')  # its blocks name receiver 1

    async with (
        running_server(
            tmp_path / "node0", "s", cluster=clusters[0], port=_port(clusters[0]), accept_wal_damage=("s",)
        ),
        running_server(tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1])),
    ):
        assert lost(tmp_path / "node0" / "blocks") == [(2, 10, 40, 200)]
        async with grpc.aio.insecure_channel(clusters[0].me.target) as channel:
            listed = await pb_grpc.BlocksStub(channel).ListPartitions(pb.ListPartitionsRequest())
        [info] = [p for p in listed.partitions if p.owner == 0]
        assert (info.start_offset, info.end_offset) == (0, 240)
        assert [(r.first_offset, r.end_offset) for r in info.gone] == [(40, 200)]

        driver = _driver(clusters, tmp_path)
        watch: asyncio.Task[None] | None = None
        try:
            await driver.serve_rate()  # `sluice rate get` shows its node table
            driver.node_rates.start()
            watch = asyncio.create_task(driver._watch_backlog())
            await wait_until(lambda: driver.backlog()[0] > 0, 15)
            assert driver.backlog() == {0: 80, 1: 0}  # 0..39 and 200..239; no commit yet
            driver._committed["s/0"] = 40  # Spark read 0..39 (as a batch's progress says)
            assert driver.backlog() == {0: 40, 1: 0}  # 200..239: was 200
            await wait_until(lambda: all(n.up for n in driver.node_rates.snapshot()), 15)
            driver.node_rates.split()
            shares = {n.node_id: n for n in driver.node_rates.snapshot()}
            assert shares[0].backlog == 40
            assert "braked" not in shares[0].reason, shares[0].reason  # was braked
            assert shares[0].records_per_second == pytest.approx(100), shares[0]
            families = text_string_to_metric_families(generate_latest(driver.registry).decode())
            samples = {(s.name, s.labels.get("node")): s.value for family in families for s in family.samples}
            assert samples[("sluice_node_backlog_records", "0")] == 40  # was 200
            shown = await asyncio.to_thread(sluice, "rate", "get", "--target", driver.rate_target or "")
            assert shown.returncode == 0, shown.stderr
            lines = shown.stdout.decode().splitlines()
            header = next(line.split() for line in lines if line.split()[:2] == ["node", "target"])
            row = next(line.split() for line in lines if line.split()[:2] == ["0", clusters[0].me.target])
            assert row[header.index("backlog")] == "40", shown.stdout.decode()  # was 200
            # Spark past the gap: the last 40 records are what is left either way
            driver._committed["s/0"] = 220
            assert driver.backlog() == {0: 20, 1: 0}
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            await driver.stop()


# ---- a batch's cap -------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _past_a_gap(tmp_path: Path, *, node1: bool = True) -> AsyncIterator[list[Cluster]]:
    """Two nodes (replication 1); node 0 started past three deleted segments with --accept-wal-damage:
    records 40..199 of its 240 are gone and no holder has them (ListPartitions says so in gone).
    `node1` False: node 1 does not run."""
    clusters = loopback_cluster(2)
    paths = rolled(tmp_path / "node0" / "blocks")  # 12 blocks of 20 records, 2 to a segment
    for path in paths[1:5]:
        path.unlink()  # blocks 2..9, records 40..199
    (tmp_path / "node0" / "node.json").write_text('{"node_id": 0}')
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(
            running_server(
                tmp_path / "node0",
                "s",
                cluster=clusters[0],
                port=_port(clusters[0]),
                accept_wal_damage=("s",),
            )
        )
        if node1:
            await stack.enter_async_context(
                running_server(tmp_path / "node1", "s", cluster=clusters[1], port=_port(clusters[1]))
            )
        assert lost(tmp_path / "node0" / "blocks") == [(2, 10, 40, 200)]
        yield clusters


def _driver(clusters: list[Cluster], tmp_path: Path) -> ClusterDriver:
    """A cluster driver (no Spark) over `clusters`' nodes, at a fixed 200 records/s."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.config import RateConfig
    from ingest.driver_config import DriverConfig

    config = DriverConfig(
        nodes={n.id: n.target for n in clusters[0].nodes},
        streams=("s",),
        data_dir=tmp_path / "driver",
        trigger_interval=1.0,
        rate=RateConfig(estimator="fixed", initial_rate=200.0),
    )
    return ClusterDriver(config)


def _options(clusters: list[Cluster]) -> dict[str, str]:
    return {
        "receivers": ",".join(f"{n.id}={n.target}" for n in clusters[0].nodes),
        "streams": "s",
        "failOnDataLoss": "false",
    }


async def test_records_gone_from_every_holders_log_take_none_of_a_batchs_cap(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With failOnDataLoss=false a query passes records gone from every holder's log; its read limit
    (or live cap) counted their offsets as records, so a gap of 160 under a cap of 16 took ten
    batches that read nothing. Now the batch that reads the last records before it reads the first
    ones past it: 32..39 and 200..207 (the end was 48)."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from ingest.spark.cluster_source import ClusterStreamReader

    async with _past_a_gap(tmp_path) as clusters:
        reader = ClusterStreamReader(_options(clusters))
        start = {"s": {"0": 32, "1": 0}}
        end = await asyncio.to_thread(reader.latestOffset, start, ReadMaxRows(16))
        assert end["s"] == {"0": 208, "1": 0}
        with caplog.at_level(logging.WARNING, "ingest.spark.cluster_source"):
            parts = await asyncio.to_thread(reader.partitions, start, end)
            got = [
                v for p in parts for b in await asyncio.to_thread(list, reader.read(p)) for v in b["value"]
            ]
        assert [v.as_py() for v in got] == expected(240)[32:40] + expected(240)[200:208]
        assert any("records 40..199" in r.getMessage() for r in caplog.records), caplog.text
        # from inside the gap (a batch planned before the fix, say), the next 16 records
        end = await asyncio.to_thread(reader.latestOffset, {"s": {"0": 48, "1": 0}}, ReadMaxRows(16))
        assert end["s"] == {"0": 216, "1": 0}


async def test_records_gone_from_the_nodes_that_answered_count_while_one_does_not(tmp_path: Path) -> None:
    """The same gap with node 1 down: it may hold a copy of 40..199 (the plan knows no placement) and
    serve it to the batch's tasks once back, so the plan counts those offsets as records and holds its
    cap of 16 (taken as a gap, a batch could read 176)."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from ingest.spark.cluster_source import ClusterStreamReader

    async with _past_a_gap(tmp_path, node1=False) as clusters:
        reader = ClusterStreamReader(_options(clusters))
        end = await asyncio.to_thread(reader.latestOffset, {"s": {"0": 32, "1": 0}}, ReadMaxRows(16))
        assert end["s"] == {"0": 48, "1": 0}  # was 208


@pytest.mark.parametrize("node1", [True, False])
async def test_what_a_capped_batch_left_behind_leaves_out_records_gone_from_every_holders_log(
    tmp_path: Path, node1: bool
) -> None:
    """The driver's rate controller takes what a batch left behind (BatchMetrics.backlog) from Spark's
    progress: latestOffset (a position, the partition's end: 240) less the batch's end (32). It counted
    the offsets, 208; the records some holder serves there are 32..39 and 200..239, 48. With node 1
    down, it may hold a copy of 40..199: they count, 208."""
    from ingest.spark.listener import BatchCompleted

    async with _past_a_gap(tmp_path, node1=node1) as clusters:
        driver = _driver(clusters, tmp_path)
        watch = asyncio.create_task(driver._watch_backlog())
        try:
            await wait_until(lambda: driver.backlog().get(0, 0) > 0, 15)
            batch = BatchCompleted(
                query_id="q",
                batch_id=3,
                num_input_rows=16,
                processing_seconds=0.1,
                timestamp="2026-11-29T12:00:00.000Z",
                start_offset={"s/0": 16, "s/1": 0},
                end_offset={"s/0": 32, "s/1": 0},
                latest_offset={"s/0": 240, "s/1": 0},
            )
            await asyncio.to_thread(driver._on_batch, batch, asyncio.get_running_loop())
            await wait_until(lambda: driver.rate.last_batch is not None, 5)
            assert driver.rate.last_batch is not None
            assert driver.rate.last_batch.backlog == (48 if node1 else 208)  # up: was 208
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            await driver.stop()


@pytest.mark.spark
async def test_a_query_passes_a_gap_ten_times_its_cap_in_one_batch(spark: Any, tmp_path: Path) -> None:
    """A query with maxRecordsPerBatch 16 and failOnDataLoss=false over node 0's 80 records left of
    240 (160 gone from every holder's log): five batches of 16, the third across the gap; before,
    fifteen, ten of them reading nothing."""
    async with _past_a_gap(tmp_path) as clusters:
        reader = spark.readStream.format("sluice")
        for name, value in {**_options(clusters), "maxRecordsPerBatch": "16"}.items():
            reader = reader.option(name, value)
        query = await asyncio.to_thread(
            lambda: (
                reader.load()
                .writeStream.format("memory")
                .queryName("past_a_gap")
                .option("checkpointLocation", str(tmp_path / "checkpoint"))
                .trigger(availableNow=True)
                .start()
            )
        )
        try:
            await asyncio.to_thread(query.awaitTermination, 120)
            assert query.exception() is None, query.exception()
            batches = [p["numInputRows"] for p in query.recentProgress]
            rows = await asyncio.to_thread(
                spark.sql("select partition, offset, value from past_a_gap").collect
            )
        finally:
            await asyncio.to_thread(query.stop)
        assert batches == [16] * 5, batches  # was [16, 16, 8, 0, ..., 0, 16, 16] (15 batches)
        got = sorted((r["offset"], bytes(r["value"])) for r in rows)
        kept = [*range(40), *range(200, 240)]
        assert got == [(i, expected(240)[i]) for i in kept]
        assert {r["partition"] for r in rows} == {0}
