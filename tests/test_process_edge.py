"""The process edge with real processes: one server per port and per data dir, a push that fails says
how far it got and resumes without duplicates, and producers wait for a server that is not up yet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from support import running_server, stop
from test_cli import SLUICE, sluice, wait_for_line

from ingest.config import RateConfig, SecurityConfig, ServeConfig
from ingest.preflight import DataDirInUseError, DataDirLock
from ingest.server import SluiceServer
from receivers.config import FsyncPolicy
from receivers.wal import HEADER, WalBlockStore
from sluice_client import Producer, SyncProducer
from sluice_client.errors import RPCError, StartTimeoutError

SERVING = r"serving streams default on (127\.0\.0\.1:\d+)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """`sluice serve --no-spark` in its own process group, its stderr in a file."""

    def __init__(self, tmp: Path, name: str, *args: str) -> None:
        self.log = tmp / f"{name}.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [*SLUICE, "serve", *args],
                stderr=log,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    def wait_serving(self) -> None:
        wait_for_line(self.proc, self.log, SERVING, 60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def servers() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for serve in started:
        serve.kill()


def no_spark(port: int, data_dir: Path, *more: str) -> list[str]:
    return ["--no-spark", "--port", str(port), "--metrics-port", "-1", "--data-dir", str(data_dir), *more]


# ---- item 1: one server per port and per data dir --------------------------------------------------


def test_a_second_server_on_a_taken_port_or_data_dir_fails_at_once(
    tmp_path: Path, servers: list[Serve]
) -> None:
    port = free_port()
    first = Serve(tmp_path, "first", *no_spark(port, tmp_path / "a"))
    servers.append(first)
    first.wait_serving()

    # the same gRPC port, another data dir: gRPC's default SO_REUSEPORT would have let it start
    started = time.monotonic()
    same_port = sluice("serve", *no_spark(port, tmp_path / "b"), timeout=60)
    assert same_port.returncode == 1, same_port.stderr.decode()
    assert f"cannot bind gRPC to 127.0.0.1:{port}: address in use".encode() in same_port.stderr
    assert b"Traceback" not in same_port.stderr

    # the same data dir, another port: refused, naming the live server's pid
    same_dir = sluice("serve", *no_spark(free_port(), tmp_path / "a"), timeout=60)
    assert same_dir.returncode == 1, same_dir.stderr.decode()
    message = f"data dir {tmp_path / 'a'} is in use by another sluice server (pid {first.proc.pid})"
    assert message.encode() in same_dir.stderr
    assert b"Traceback" not in same_dir.stderr
    assert time.monotonic() - started < 30  # two interpreter starts on a loaded machine, no waiting
    assert first.proc.poll() is None  # the first one is untouched

    # kill -9 leaves no stale lock: a new server takes the data dir and the port at once
    first.kill()
    again = Serve(tmp_path, "again", *no_spark(port, tmp_path / "a"))
    servers.append(again)
    again.wait_serving()
    assert (tmp_path / "a" / "sluice.lock").read_text().strip() == str(again.proc.pid)


@pytest.mark.spark
def test_a_taken_port_or_data_dir_fails_before_spark_starts(tmp_path: Path, servers: list[Serve]) -> None:
    port, metrics_port = free_port(), free_port()
    first = Serve(tmp_path, "first", *no_spark(port, tmp_path / "a"))
    servers.append(first)
    first.wait_serving()
    with socket.socket() as metrics_busy:
        metrics_busy.bind(("127.0.0.1", metrics_port))
        metrics_busy.listen()
        cases = {
            "port": (["--port", str(port), "--data-dir", str(tmp_path / "b")], b"cannot bind gRPC to"),
            "data dir": (["--port", "0", "--data-dir", str(tmp_path / "a")], b"is in use by another sluice"),
            "metrics": (
                ["--port", "0", "--data-dir", str(tmp_path / "c"), "--metrics-port", str(metrics_port)],
                f"cannot serve metrics on 127.0.0.1:{metrics_port}: address in use".encode(),
            ),
            "health": (  # the metrics socket: the health port binds every address, so it is taken too
                ["--port", "0", "--data-dir", str(tmp_path / "d"), "--health-port", str(metrics_port)],
                f"cannot serve health on 0.0.0.0:{metrics_port}: address in use".encode(),
            ),
        }
        for name, (flags, message) in cases.items():
            started = time.monotonic()
            result = sluice("serve", "--metrics-port", "-1", *flags, timeout=120)
            took = time.monotonic() - started
            assert result.returncode == 1, (name, result.stderr.decode())
            assert message in result.stderr, (name, result.stderr.decode())
            # Spark's JVM would have said hello on stderr and taken 10 s+ here
            assert b"Spark" not in result.stderr, (name, result.stderr.decode())
            assert took < 15, (name, took)  # Spark's start alone takes 25 s+ on this machine


def test_a_second_cluster_driver_on_a_taken_data_dir_or_port_fails_before_spark_starts(
    tmp_path: Path,
) -> None:
    """Two drivers on one data dir share its checkpoint (one fails the other's batches once records
    come); a driver on a taken rate port started and shared it (gRPC's SO_REUSEPORT). Both now fail at
    once, before Spark's JVM, and leave what holds them alone."""
    nodes = tmp_path / "nodes"
    nodes.write_text(f"0 127.0.0.1:{free_port()}\n")
    held = DataDirLock(tmp_path / "held")  # as a running driver holds its data dir
    port, metrics_port = free_port(), free_port()
    with socket.socket() as rate_busy, socket.socket() as metrics_busy:
        for sock, taken in ((rate_busy, port), (metrics_busy, metrics_port)):
            sock.bind(("127.0.0.1", taken))
            sock.listen()
        driver = ["serve", "--role", "driver", "--nodes", str(nodes)]
        cases = {
            "data dir": (
                ["--data-dir", str(tmp_path / "held"), "--port", "0", "--metrics-port", "-1"],
                f"data dir {tmp_path / 'held'} is in use by another sluice server (pid {os.getpid()})",
            ),
            "rate port": (
                ["--data-dir", str(tmp_path / "a"), "--port", str(port), "--metrics-port", "-1"],
                f"cannot serve the rate on 127.0.0.1:{port}: address in use",
            ),
            "metrics port": (
                ["--data-dir", str(tmp_path / "b"), "--port", "0", "--metrics-port", str(metrics_port)],
                f"cannot serve metrics on 127.0.0.1:{metrics_port}: address in use",
            ),
            "driver id": (  # DATA_DIR/driver-id (one driver per cluster) cannot be read or written
                ["--data-dir", str(tmp_path / "c"), "--port", "0", "--metrics-port", "-1"],
                f"[Errno 21] Is a directory: '{tmp_path / 'c' / 'driver-id'}'",
            ),
        }
        (tmp_path / "c" / "driver-id").mkdir(parents=True)
        for name, (flags, message) in cases.items():
            started = time.monotonic()
            result = sluice(*driver, *flags, timeout=120)
            took = time.monotonic() - started
            assert result.returncode == 1, (name, result.stderr.decode())
            assert f"cannot start the driver: {message}".encode() in result.stderr, (name, result.stderr)
            assert b"Traceback" not in result.stderr and b"Spark" not in result.stderr, name
            assert took < 15, (name, took)  # Spark's start alone takes 25 s+ on this machine
    assert held.held
    # the lock is the process's: once the holder is gone, a driver may take the data dir (checked
    # without starting Spark)
    held.release()
    from ingest.cluster_driver import prepare_driver
    from ingest.driver_config import DriverConfig

    lock = prepare_driver(DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), data_dir=tmp_path / "held"))
    assert (tmp_path / "held" / "sluice.lock").read_text().strip() == str(os.getpid())
    lock.release()


LOST_RACE = (
    "import sys; import ingest.preflight as p; p.check_ports = lambda *args: None; "
    "from ingest.cli import main; sys.exit(main(sys.argv[1:]))"
)
"""`sluice` whose port probe passes whatever holds the port: a start that lost the race for it, as one
whose port a second server took while its Spark started (seconds), binds into the taken port itself."""


def listed(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (relative), with a file's bytes (None: a folder)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))
    }


@pytest.mark.parametrize("lost", ["check", "race"])
def test_a_start_that_finds_its_port_taken_leaves_a_new_data_dir_as_it_found_it(
    tmp_path: Path, lost: str
) -> None:
    """A start whose gRPC (or health) port is taken left a new data dir half made: blocks/ and the lock
    file when its check saw the port taken, node.json and committed.json too when it lost the race for
    the port after the check (node.json names the node it was started as: started by mistake as node 0,
    the data dir then refused node 1). Now a new or empty data dir is left as it was found, and one that
    held anything keeps all of it, untouched but for its lock file."""
    port, health = free_port(), free_port()
    nodes = tmp_path / "nodes"
    nodes.write_text(f"0 127.0.0.1:{port}\n1 127.0.0.1:{free_port()}\n")
    command = [*SLUICE] if lost == "check" else [sys.executable, "-c", LOST_RACE]
    grpc_taken = f"cannot bind gRPC to 127.0.0.1:{port}"
    health_taken = (
        f"cannot serve health on 0.0.0.0:{health}: address in use"
        if lost == "check"
        else f"cannot bind the health port {health}"
    )
    new, empty, used = tmp_path / "new" / "data", tmp_path / "empty", tmp_path / "used"
    empty.mkdir()
    (used / "blocks").mkdir(parents=True)
    (used / "notes").write_text("an operator's\n")
    (used / "node.json").write_text('{"node_id": 0, "nodes": null}')
    used_before = listed(used)
    node_0 = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--replication", "2"]
    no_health = ["--no-spark", "--stream", "s", "--metrics-port", "-1"]
    starts = [
        (new, ["--port", str(port), "--metrics-port", "-1", *node_0], grpc_taken),
        (empty, ["--port", str(port), *no_health], grpc_taken),
        (new, ["--port", "0", "--health-port", str(health), *no_health], health_taken),
        (empty, ["--port", "0", "--health-port", str(health), *no_health], health_taken),
        (used, ["--port", str(port), "--metrics-port", "-1", *node_0], grpc_taken),
    ]
    with socket.socket() as grpc_port, socket.socket() as health_port:
        grpc_port.bind(("127.0.0.1", port))
        health_port.bind(("0.0.0.0", health))  # as the health port binds
        for sock in (grpc_port, health_port):
            sock.listen()
        for data_dir, flags, message in starts:
            result = subprocess.run(
                [*command, "serve", "--data-dir", str(data_dir), *flags],
                capture_output=True,
                timeout=120,
                check=False,
            )
            stderr = result.stderr.decode()
            assert result.returncode == 1, (flags, stderr)
            assert f"cannot start the server: {message}" in stderr, (flags, stderr)
            assert "Traceback" not in stderr, (flags, stderr)
            assert not (tmp_path / "new").exists(), (flags, stderr)
            assert listed(empty) == {}, (flags, stderr)
            # a start on a data dir that held anything is a start like any other: it may add to it
            # (node.json records the node list), never take from it
            after = listed(used)
            assert used_before.keys() <= after.keys() and after["notes"] == used_before["notes"], flags
            assert json.loads(after["node.json"] or b"")["node_id"] == 0, flags


def test_serve_refuses_unusable_data_dirs_ports_and_settings_at_once(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("not a directory")
    for data_dir, message in [
        (a_file, f"{a_file} is a file, not a directory"),
        (a_file / "sub", f"cannot create {a_file / 'sub'}: a file stands in its path"),
    ]:
        result = sluice("serve", *no_spark(0, data_dir), timeout=60)
        assert result.returncode == 1, result.stderr.decode()
        assert message.encode() in result.stderr, result.stderr.decode()
        assert b"Traceback" not in result.stderr
    blocks_file = tmp_path / "d" / "blocks"
    blocks_file.parent.mkdir()
    blocks_file.write_text("")
    result = sluice("serve", *no_spark(0, tmp_path / "d"), timeout=60)
    assert result.returncode == 1 and f"{blocks_file} is a file".encode() in result.stderr
    port = str(free_port())
    same = sluice("serve", "--no-spark", "--port", port, "--metrics-port", port, timeout=60)
    assert same.returncode == 2 and b"--port and --metrics-port are both" in same.stderr
    out_of_range = sluice("serve", "--no-spark", "--port", "70000", timeout=60)
    assert out_of_range.returncode == 2 and b"--port must be 0-65535, got 70000" in out_of_range.stderr
    (tmp_path / "e" / "sluice.lock").mkdir(parents=True)
    result = sluice("serve", *no_spark(0, tmp_path / "e"), timeout=60)
    assert result.returncode == 1 and b"cannot open the lock file" in result.stderr
    # an explicit 0 is checked, not read as "the default"; an endless interval would ack nothing; each
    # message names the flag, not the field (ingest.config_sources)
    for flags, message in [
        (["--prefetch", "0"], b"--prefetch must be >= 1, got 0"),
        (["--initial-rate", "0"], b"--initial-rate: rate must be > 0 records/s"),
        (["--block-interval", "inf"], b"--block-interval must be finite"),
        (["--trigger-interval", "inf"], b"--trigger-interval must be > 0 seconds and finite"),
        (["--trigger-interval", "1e300"], b"--trigger-interval must be at most 86400 seconds (a day)"),
        (["--block-interval", "1e300"], b"--block-interval must be finite, at most 3600 seconds"),
        (["--buffer-records", "9" * 23], b"--buffer-records must be at most 1,000,000,000,000"),
        # gRPC's option is a C int: 3 GiB crashed the server's creation with a traceback
        (["--max-message-bytes", "3GiB"], b"--max-message-bytes must be 1024..2,147,483,647"),
        (["--segment-bytes", "2TiB"], b"--segment-bytes must be at most 1,099,511,627,776 (1 TiB)"),
        # Spark's JVM would check it seconds later and die with a Java and a Python stack trace
        (["--master", "bogus"], b"--master 'bogus': Spark takes yarn, spark://..., k8s://... or local..."),
    ]:
        spark = flags[0] == "--master"
        where = ["--port", "0", "--data-dir", str(tmp_path / "f")]
        result = sluice("serve", *(where if spark else no_spark(0, tmp_path / "f")), *flags, timeout=60)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr.decode())
        assert b"Traceback" not in result.stderr


async def test_sluice_server_locks_its_data_dir_until_stopped(tmp_path: Path) -> None:
    def config() -> ServeConfig:
        return ServeConfig(
            port=0,
            metrics_port=None,
            data_dir=tmp_path,
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),
            spark=False,
            fsync=FsyncPolicy.off(),
        )

    first = SluiceServer(config())
    await first.start()
    try:
        # refused before its receivers recover (cut the tail of) the live server's block log
        with pytest.raises(DataDirInUseError) as refused:
            SluiceServer(config())
        assert refused.value.holder == os.getpid()
        # readers (Spark's source) open the store without the lock
        assert WalBlockStore(tmp_path / "blocks").blocks("default") == []
    finally:
        await first.stop()
    second = SluiceServer(config())  # released by stop()
    await second.stop()
    lock = DataDirLock(tmp_path)
    with pytest.raises(DataDirInUseError):
        DataDirLock(tmp_path)
    lock.release()
    DataDirLock(tmp_path).release()


@pytest.mark.parametrize("removed", ["data dir", "block log"])
def test_a_server_whose_data_dir_is_removed_stops_and_a_new_one_starts_there(
    tmp_path: Path, servers: list[Serve], removed: str
) -> None:
    """`rm -rf` of a live server's data dir took its lock file: a second `serve` started on the same
    path beside it, and the first went on acking into folders it made again. Now the first stops with
    exit 1 and a message that says why, and only then does a server start there. The same for the
    block log's folder alone: the log would not make it again, and credit stayed paused for good."""
    data_dir = tmp_path / "data"
    first = Serve(tmp_path, "first", *no_spark(free_port(), data_dir))
    servers.append(first)
    first.wait_serving()
    target = re.search(SERVING, first.log.read_text())
    assert target is not None
    with SyncProducer(target.group(1), "default") as producer:
        producer.send_many([b"before"] * 1000)
        producer.flush(timeout=30)

    shutil.rmtree(data_dir if removed == "data dir" else data_dir / "blocks")
    assert first.proc.wait(timeout=30) == 1
    stderr = first.log.read_text()
    if removed == "data dir":
        lock_file = data_dir / "sluice.lock"
        assert f"the lock file {lock_file} was deleted: the data dir {data_dir} was removed" in stderr
        assert "stopping, since nothing could be made durable there any more" in stderr
    else:
        folder = data_dir / "blocks" / "default"
        assert f"the block log's folder {folder} was deleted or replaced while this server ran" in stderr
    assert "Traceback" not in stderr
    assert not (data_dir / "blocks").exists()  # the log made none of its folders again

    second = Serve(tmp_path, "second", *no_spark(free_port(), data_dir))
    servers.append(second)
    second.wait_serving()
    assert (data_dir / "sluice.lock").read_text().strip() == str(second.proc.pid)


@pytest.mark.parametrize("damage", ["missing", "cut"])
def test_serve_refuses_a_log_that_lost_acked_blocks(
    tmp_path: Path, servers: list[Serve], damage: str
) -> None:
    """An older segment removed (or cut mid-frame) between a stop and a start: serve started with no
    word, its log's seqs and offsets with a gap (`streams list` counted the lost records in the
    backlog), new records appended after it; or cut the damaged segment with an ERROR and served. Under
    the default fsync (every block before its ack) both are acked blocks gone: serve exits 1 naming the
    stream, the blocks, the files and what to do, and leaves the log as it is."""
    data_dir = tmp_path / "data"
    flags = no_spark(free_port(), data_dir, "--segment-bytes", "16384")
    first = Serve(tmp_path, "first", *flags)
    servers.append(first)
    first.wait_serving()
    target = re.search(SERVING, first.log.read_text())
    assert target is not None
    with SyncProducer(target.group(1), "default") as producer:
        for i in range(12):  # a block or more per flush, a direct write's page or more each
            producer.send_many([f"r{i}-{j}".encode() for j in range(1000)])
            producer.flush(timeout=30)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0
    folder = data_dir / "blocks" / "default"
    paths = sorted(folder.glob("*.wal"))
    assert len(paths) >= 3, paths
    if damage == "missing":
        paths[1].unlink()
    else:
        os.truncate(paths[1], 100)
    kept = {p.name: p.read_bytes() for p in sorted(folder.glob("*.wal"))}

    again = sluice("serve", *flags, timeout=120)
    stderr = again.stderr.decode()
    assert again.returncode == 1, stderr
    assert "cannot start the server: stream 'default': " in stderr, stderr
    if damage == "missing":
        first_lost, last_lost = int(paths[1].stem), int(paths[2].stem) - 1
        lost = f"block {first_lost}" if first_lost == last_lost else f"blocks {first_lost}..{last_lost}"
        assert f"{lost} (record" in stderr, stderr
        assert f"between segments {paths[0].name} and {paths[2].name}" in stderr, stderr
        assert "Restore the missing segment" in stderr, stderr
    else:
        assert f"the log segment {paths[1]} is damaged at byte 0 (its first block)" in stderr, stderr
        assert "not the torn tail a crash leaves" in stderr, stderr
    assert "Traceback" not in stderr
    assert {p.name: p.read_bytes() for p in sorted(folder.glob("*.wal"))} == kept


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_serve_goes_on_past_damage_with_accept_wal_damage(
    tmp_path: Path, servers: list[Serve], damage: str
) -> None:
    """A middle segment deleted, or a frame in the middle of a segment corrupted: serve refuses (exit 1),
    naming --accept-wal-damage; started with `--accept-wal-damage default` it serves: the ERROR names the
    blocks lost, sluice_wal_lost_blocks_total counts them, the blocks after them are kept and new blocks
    follow the highest one; a later start without the flag serves too (the loss is recorded)."""
    data_dir = tmp_path / "data"
    port = free_port()
    segment = "16384" if damage == "missing" else "1MiB"  # several segments; or one of many blocks
    flags = no_spark(port, data_dir, "--segment-bytes", segment)
    first = Serve(tmp_path, "first", *flags)
    servers.append(first)
    first.wait_serving()
    target = f"127.0.0.1:{port}"
    sent = [f"r{i}-{j}".encode() for i in range(12) for j in range(1000)]
    with SyncProducer(target, "default") as producer:
        for i in range(12):  # a block or more per flush
            producer.send_many(sent[i * 1000 : (i + 1) * 1000])
            producer.flush(timeout=30)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(timeout=60) == 0
    folder = data_dir / "blocks" / "default"
    paths = sorted(folder.glob("*.wal"))
    store = WalBlockStore(data_dir / "blocks")
    held = {
        b.seq: [v for batch in store.read(b) for v in batch.column("value").to_pylist()]
        for b in store.blocks("default")
    }
    assert sorted(v for vs in held.values() for v in vs) == sorted(sent)
    if damage == "missing":
        assert len(paths) >= 3, paths
        lost = list(range(int(paths[1].stem), int(paths[2].stem)))
        paths[1].unlink()
    else:
        assert len(paths) == 1 and len(held) >= 5, (paths, len(held))
        starts = []
        data = bytearray(paths[0].read_bytes())
        at = 0
        while at < len(data):
            starts.append(at)
            header = HEADER.unpack_from(data, at)
            at += HEADER.size + header[4] + header[5]
        middle = len(starts) // 2
        data[starts[middle] + HEADER.size + 100] ^= 0xFF
        paths[0].write_bytes(bytes(data))
        lost = [sorted(held)[middle]]
    refused = sluice("serve", *flags, timeout=120)
    stderr = refused.stderr.decode()
    assert refused.returncode == 1, stderr
    assert "cannot start the server: stream 'default': " in stderr and "--accept-wal-damage default" in stderr
    assert "Traceback" not in stderr
    typo = sluice("serve", *flags, "--accept-wal-damage", "defualt", timeout=120)
    assert typo.returncode == 1, typo.stderr.decode()
    assert "--accept-wal-damage names 'defualt', which this node does not hold" in typo.stderr.decode()

    metrics_port = free_port()
    second = Serve(
        tmp_path, "second", *flags, "--metrics-port", str(metrics_port), "--accept-wal-damage", "default"
    )
    servers.append(second)
    second.wait_serving()
    log_text = second.log.read_text()
    blocks = f"block {lost[0]}" if len(lost) == 1 else f"blocks {lost[0]}..{lost[-1]}"
    assert f"stream 'default': --accept-wal-damage: {blocks} (records " in log_text, log_text
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    assert f'sluice_wal_lost_blocks_total{{stream="default"}} {float(len(lost))}' in scraped, scraped
    more = [f"after-{j}".encode() for j in range(100)]
    with SyncProducer(target, "default") as producer:
        producer.send_many(more)
        producer.flush(timeout=30)
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=60) == 0

    after = WalBlockStore(data_dir / "blocks")
    now = {
        b.seq: [v for batch in after.read(b) for v in batch.column("value").to_pylist()]
        for b in after.blocks("default")
    }
    survivors = {seq: values for seq, values in held.items() if seq not in lost}
    assert {seq: now[seq] for seq in survivors} == survivors  # every block after the gap is kept
    new = sorted(seq for seq in now if seq not in held)
    assert new and new[0] == max(held) + 1  # numbered after the highest surviving block
    assert [v for seq in new for v in now[seq]] == more

    # a later start without the flag: the loss is recorded, so it serves (a WARNING names the gap)
    third = Serve(tmp_path, "third", *flags)
    servers.append(third)
    third.wait_serving()
    third.proc.send_signal(signal.SIGTERM)
    assert third.proc.wait(timeout=60) == 0
    assert "is not in the log: lost at a start with --accept-wal-damage" in third.log.read_text()


def test_a_lock_whose_file_was_replaced_is_lost(tmp_path: Path) -> None:
    lock = DataDirLock(tmp_path)
    try:
        assert lock.lost() is None
        (tmp_path / "sluice.lock").unlink()
        assert "was deleted" in (lock.lost() or "")
        (tmp_path / "sluice.lock").write_text("123\n")  # another server's, in a data dir made again
        assert "was replaced" in (lock.lost() or "")
    finally:
        lock.release()
    assert lock.lost() is None  # released: nothing to lose


# ---- item 6: a failed push says how far it got; the printed command resumes without duplicates ------


def stored_values(data_dir: Path) -> Counter[bytes]:
    store = WalBlockStore(data_dir / "blocks", fsync=FsyncPolicy.off())
    batches = (batch for block in store.blocks("default") for batch in store.read(block))
    return Counter(v for batch in batches for v in batch.column("value").to_pylist())


def acked_by(metrics_port: int) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    match = re.search(r'^sluice_records_acked_total\{stream="default"\} (\S+)', text, re.M)
    return float(match.group(1)) if match else 0.0


def throttled_serve(tmp_path: Path, servers: list[Serve], rate: int) -> tuple[Serve, int, int, Path]:
    """`sluice serve --no-spark` at `rate` records/s, serving: (it, its port, its metrics port, data dir)."""
    port, metrics_port, data = free_port(), free_port(), tmp_path / "data"
    throttled = ["--initial-rate", str(rate), "--block-interval", "0.05", "--metrics-port", str(metrics_port)]
    serve = Serve(tmp_path, "first", *no_spark(port, data, *throttled))
    servers.append(serve)
    serve.wait_serving()
    return serve, port, metrics_port, data


def test_a_failed_push_prints_how_to_resume_and_the_resume_doubles_nothing(
    tmp_path: Path, servers: list[Serve]
) -> None:
    total = 200_000
    source = tmp_path / "records.txt"
    # keyed lines, their separator (->) given escaped and reading as a flag unless one token: the resume
    # command keeps it as given
    source.write_text("".join(f"k{i % 7}->{i}\n" for i in range(total)))
    # throttled (5 s for the input), so that the push is still running when the server dies
    first, port, metrics_port, data = throttled_serve(tmp_path, servers, 40_000)
    target = f"127.0.0.1:{port}"
    flags = ["--timeout", "3", "--batch-size", "1000", "--key-separator=\\x2d>"]
    push = subprocess.Popen(
        [*SLUICE, "push", str(source), "--target", target, *flags],
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while acked_by(metrics_port) < 20_000:
            assert time.monotonic() < deadline and push.poll() is None, "no acks"
            time.sleep(0.05)
        first.kill()  # kill -9: acks in flight are lost, the records they covered may be durable
        _, err = push.communicate(timeout=60)
    finally:
        push.kill()
    stderr = err.decode().replace("\r", "\n")
    assert push.returncode == 1, stderr
    counts = re.search(r"of the input's records ([\d,]+) are acked \(durable\), ([\d,]+) sent", stderr)
    assert counts, stderr
    acked, sent = (int(g.replace(",", "")) for g in counts.groups())
    assert 0 < acked <= sent < total, stderr
    resume = re.search(r"to resume without duplicates, run: (.+)", stderr)
    assert resume, stderr
    command = shlex.split(resume.group(1))
    assert command[:2] == ["sluice", "push"] and f"--resume-from {acked}" in resume.group(1)
    held = sum(stored_values(data).values())
    assert held >= acked  # what was acked is durable (more may be: acks lost with the process)

    again = Serve(tmp_path, "again", *no_spark(port, data))
    servers.append(again)
    again.wait_serving()
    resumed = subprocess.run([*SLUICE, *command[1:]], capture_output=True, timeout=120, check=False)
    assert resumed.returncode == 0, resumed.stderr.decode()
    assert f"pushed {total - acked:,} records".encode() in resumed.stderr
    stored = stored_values(data)
    doubled = [v for v, n in stored.items() if n > 1]
    assert not doubled, f"{len(doubled)} records stored twice, e.g. {doubled[:5]}"
    assert sorted(stored) == sorted(str(i).encode() for i in range(total))
    store = WalBlockStore(data / "blocks", fsync=FsyncPolicy.off())
    rows = (
        row for block in store.blocks("default") for batch in store.read(block) for row in batch.to_pylist()
    )
    assert all(row["key"] == f"k{int(row['value']) % 7}".encode() for row in rows)


def test_a_push_stopped_by_sigterm_says_how_to_resume(tmp_path: Path, servers: list[Serve]) -> None:
    """systemd, Kubernetes and `timeout` stop with SIGTERM: the push ended with 143 and said nothing
    (Ctrl-C printed the acked count and the command that resumes)."""
    total = 100_000
    source = tmp_path / "records.txt"
    source.write_text("".join(f"{i}\n" for i in range(total)))
    _, port, metrics_port, data = throttled_serve(tmp_path, servers, 20_000)
    target = f"127.0.0.1:{port}"
    push = subprocess.Popen([*SLUICE, "push", str(source), "--target", target], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while acked_by(metrics_port) < 10_000:
            assert time.monotonic() < deadline and push.poll() is None, "no acks"
            time.sleep(0.05)
        push.terminate()
        _, err = push.communicate(timeout=60)
    finally:
        push.kill()
    stderr = err.decode().replace("\r", "\n")
    assert push.returncode == 128 + signal.SIGTERM, stderr
    resume = re.search(r"to resume without duplicates, run: (.+)", stderr)
    assert resume, stderr
    resumed = subprocess.run(
        [*SLUICE, *shlex.split(resume.group(1))[1:]], capture_output=True, timeout=120, check=False
    )
    assert resumed.returncode == 0, resumed.stderr.decode()
    stored = stored_values(data)
    assert sorted(stored.elements()) == sorted(str(i).encode() for i in range(total))


def test_a_resume_with_a_mistyped_producer_id_is_refused(tmp_path: Path, servers: list[Serve]) -> None:
    """It skipped the input's first N records, started an unknown producer at N and exited 0: those
    records were never stored. Now the server refuses it, and the push says to fix the cause."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{i}\n" for i in range(100)))
    data, port = tmp_path / "data", free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, data))
    servers.append(serve)
    serve.wait_serving()
    target = f"127.0.0.1:{port}"
    first = sluice("push", str(source), "--target", target, "--producer-id", "p-1", timeout=60)
    assert first.returncode == 0, first.stderr.decode()
    typo = sluice(
        "push", str(source), "--target", target, "--producer-id", "p-l", "--resume-from", "50", timeout=60
    )
    assert typo.returncode == 1, typo.stderr.decode()
    assert b"OUT_OF_RANGE: producer 'p-l' is not known on stream 'default'" in typo.stderr
    assert b"no record was sent: fix the cause first" in typo.stderr
    longer = tmp_path / "longer.txt"
    longer.write_text("".join(f"{i}\n" for i in range(200)))
    past = sluice(
        "push", str(longer), "--target", target, "--producer-id", "p-1", "--resume-from", "150", timeout=60
    )  # past what the server holds of p-1 (100): a gap, and no count or resume command that cannot work
    assert past.returncode == 1, past.stderr.decode()
    assert b"no record of this run was acked: fix the cause first" in past.stderr
    assert b"to resume" not in past.stderr and b"are acked (durable)" not in past.stderr
    resumed = sluice(
        "push", str(source), "--target", target, "--producer-id", "p-1", "--resume-from", "50", timeout=60
    )
    assert resumed.returncode == 0, resumed.stderr.decode()  # its records 50.. are all duplicates
    assert sorted(stored_values(data).elements()) == sorted(f"{i}".encode() for i in range(100))


def test_a_second_push_under_the_same_producer_id_is_refused_not_dropped(
    tmp_path: Path, servers: list[Serve]
) -> None:
    """A push run again with the same --producer-id and no --resume-from numbered its records from 0
    again: the server dropped them as duplicates of the first push's, and the push said "all acked".
    It is refused now, saying where the server has the id; --resume-from goes on (0 too: the command a
    push that had nothing acked prints, which resends)."""
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{i}\n" for i in range(100)))
    data, port = tmp_path / "data", free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, data))
    servers.append(serve)
    serve.wait_serving()
    flags = ["--target", f"127.0.0.1:{port}", "--producer-id", "p-1", "--no-progress"]
    first = sluice("push", str(source), *flags, timeout=60)
    assert first.returncode == 0, first.stderr.decode()
    other = tmp_path / "other.txt"
    other.write_text("".join(f"other {i}\n" for i in range(20)))
    again = sluice("push", str(other), *flags, timeout=60)
    stderr = again.stderr.decode()
    assert again.returncode == 1, stderr
    assert "ALREADY_EXISTS: producer 'p-1' already has records on stream 'default'" in stderr, stderr
    assert "--resume-from 100" in stderr and "no record was sent: fix the cause first" in stderr, stderr
    # in the push's terms: --resume-from skips input lines, right for the same input only
    assert "To resume that same input" in stderr and "skips the input's first 100 lines" in stderr, stderr
    assert "for a new input, use another --producer-id" in stderr, stderr
    assert "first_seq=" not in stderr and "resume=True" not in stderr, stderr
    longer = tmp_path / "longer.txt"
    longer.write_text("".join(f"{i}\n" for i in range(150)))
    on = sluice("push", str(longer), *flags, "--resume-from", "100", timeout=60)
    assert on.returncode == 0 and b"pushed 50 records" in on.stderr, on.stderr.decode()
    resent = sluice("push", str(source), *flags, "--resume-from", "0", timeout=60)
    assert resent.returncode == 0, resent.stderr.decode()  # all 100 held already: duplicates
    serve.kill()
    assert sorted(stored_values(data).elements()) == sorted(f"{i}".encode() for i in range(150))


def test_push_resume_flags_are_checked(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\nb\n")
    # gRPC would take 127.0.0.1:99999 as port 34463 (modulo 2^16): some other server
    for bad in ("127.0.0.1:99999", "nohost", "", "::1:50051"):
        result = sluice("push", str(source), "--target", bad, timeout=60)
        assert result.returncode == 2 and b"argument --target: invalid target" in result.stderr, bad
    result = sluice("rate", "get", "--target", "127.0.0.1:0", timeout=60)
    assert result.returncode == 2 and b"argument --target: invalid target" in result.stderr
    # a URL or a name with whitespace retried DNS for the whole timeout: refused at once, as a bad port
    for command in (["push", str(source)], ["rate", "get"], ["pipeline", "swap", "builtin"]):
        for bad, says in (
            ("http://127.0.0.1:5", b"a http:// URL is no gRPC target"),
            ("grpc://127.0.0.1:5", b"a grpc:// URL is no gRPC target"),
            ("a b:5", b"it holds whitespace"),
        ):
            result = sluice(*command, "--target", bad, timeout=60)
            assert result.returncode == 2, (command, bad, result.stderr)
            assert b"argument --target: invalid target" in result.stderr and says in result.stderr, (
                result.stderr
            )
    no_id = sluice("push", str(source), "--resume-from", "1", timeout=60)
    assert no_id.returncode == 2 and b"--resume-from needs the --producer-id" in no_id.stderr
    negative = sluice("push", str(source), "--resume-from", "-1", "--producer-id", "p", timeout=60)
    assert negative.returncode == 2 and b"--resume-from must be >= 0" in negative.stderr


def test_a_resume_past_the_input_is_refused(tmp_path: Path, servers: list[Serve]) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\nb\nc")  # three records, the last without a newline
    port = free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, tmp_path / "data"))
    servers.append(serve)
    serve.wait_serving()
    target = f"127.0.0.1:{port}"
    flags = ["--target", target, "--producer-id", "p1", "--no-progress"]
    short = sluice("push", str(source), *flags, "--resume-from", "4", timeout=60)
    assert short.returncode == 1 and b"the input has 3 records, fewer than --resume-from 4" in short.stderr
    first = tmp_path / "first.txt"
    first.write_text("a\n")  # the run to resume: a resume needs a producer the server knows
    assert sluice("push", str(first), *flags, timeout=60).returncode == 0
    done = sluice("push", str(source), *flags, "--resume-from", "1", timeout=60)
    assert done.returncode == 0, done.stderr.decode()
    assert b"pushed 2 records" in done.stderr
    serve.kill()
    assert sorted(stored_values(tmp_path / "data")) == [b"a", b"b", b"c"]


def test_a_line_no_message_can_carry_is_named_and_the_lines_before_it_are_acked(
    tmp_path: Path, servers: list[Serve]
) -> None:
    """A 40 MiB line failed the push's producer when its batch was encoded, with the lines sent just
    before it in flight and never acked; now they are acked, the push names the line, and its resume
    command starts at it (the line fixed, the rest goes without duplicates)."""
    source = tmp_path / "in.txt"
    source.write_bytes(b"a\nb\n" + b"x" * (40 * 1024 * 1024) + b"\nc\n")
    port = free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, tmp_path / "data"))
    servers.append(serve)
    serve.wait_serving()
    flags = ["--target", f"127.0.0.1:{port}", "--no-progress"]
    pushed = sluice("push", str(source), *flags, timeout=120)
    stderr = pushed.stderr.decode()
    assert pushed.returncode == 1, stderr
    # found before its end: the push holds no more of a line than a record can carry
    assert "line 3 of the input has over 33,554,4" in stderr, stderr
    assert "bytes (read so far): over the 33,554,368-byte limit of a record" in stderr, stderr
    assert "of the input's records 2 are acked (durable), 2 sent" in stderr, stderr
    resume = re.search(r"to resume without duplicates, once the cause is fixed, run: (.+)", stderr)
    assert resume and "--resume-from 2" in resume.group(1), stderr
    source.write_bytes(b"a\nb\nfixed\nc\n")
    resumed = sluice(*shlex.split(resume.group(1))[1:], timeout=120)
    assert resumed.returncode == 0, resumed.stderr.decode()
    serve.kill()
    assert sorted(stored_values(tmp_path / "data").elements()) == [b"a", b"b", b"c", b"fixed"]


def test_an_input_without_newlines_is_refused_at_the_record_limit_not_held_whole(
    tmp_path: Path, servers: list[Serve]
) -> None:
    """`sluice push /dev/zero` (or a binary file, a stream that never sends a newline) held the line in
    memory until it ended: 14 GB within 40 s, until the machine killed it. It reads no further than a
    record can carry now, then names the line, exit 1."""
    port = free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, tmp_path / "data"))
    servers.append(serve)
    serve.wait_serving()
    pushed = sluice("push", "/dev/zero", "--target", f"127.0.0.1:{port}", "--no-progress", timeout=60)
    stderr = pushed.stderr.decode()
    assert pushed.returncode == 1, stderr
    assert "line 1 of the input has over 33,554,432 bytes (read so far): over the" in stderr, stderr
    assert "Traceback" not in stderr


def test_an_input_that_fails_to_read_is_named_and_the_lines_before_it_are_acked(
    tmp_path: Path, servers: list[Serve]
) -> None:
    """A read error of the input (EIO of a failing disk, a socket on stdin reset by its peer) ended the
    push with a traceback, the lines read before it sent and never reported: nothing said how far the
    push got or how to resume. Now those lines are acked, the error names the input, exit 1, and the
    resume command starts after them; a closed stdin is said too, not an AttributeError."""
    _, port, metrics_port, data = throttled_serve(tmp_path, servers, 1_000_000)
    flags = ["--target", f"127.0.0.1:{port}", "--no-progress", "--timeout", "10"]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        reader = socket.create_connection(listener.getsockname())
        writer, _ = listener.accept()
    with reader, writer:
        push = subprocess.Popen(
            [*SLUICE, "push", "-", *flags, "--producer-id", "reset"], stdin=reader, stderr=subprocess.PIPE
        )
        try:
            writer.sendall(b"".join(b"%d\n" % i for i in range(100)))
            deadline = time.monotonic() + 60
            while acked_by(metrics_port) < 100:
                assert time.monotonic() < deadline and push.poll() is None, "no acks"
                time.sleep(0.05)
            # a reset, not an end: the peer closes with SO_LINGER 0
            writer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            writer.close()
            _, err = push.communicate(timeout=60)
        finally:
            push.kill()
    stderr = err.decode()
    assert push.returncode == 1, stderr
    assert "Traceback" not in stderr, stderr
    assert "cannot read standard input after line 100: Connection reset by peer" in stderr, stderr
    assert "of the input's records 100 are acked (durable), 100 sent, 100 read" in stderr, stderr
    assert "--producer-id reset --resume-from 100" in stderr, stderr
    assert sorted(stored_values(data)) == sorted(b"%d" % i for i in range(100))

    for more in ([], ["--producer-id", "reset", "--resume-from", "100"]):  # the skip reads it too
        eio = sluice("push", "/proc/self/mem", *flags, *more, timeout=60)
        stderr = eio.stderr.decode()
        assert eio.returncode == 1 and "Traceback" not in stderr, stderr
        assert "cannot read /proc/self/mem: Input/output error" in stderr, stderr
    closed = subprocess.run(
        ["sh", "-c", 'exec "$@" <&-', "sh", *SLUICE, "push", "-", *flags],
        capture_output=True,
        timeout=60,
        check=False,
    )
    stderr = closed.stderr.decode()
    assert closed.returncode == 2 and "Traceback" not in stderr, stderr
    assert "cannot read standard input: it is closed" in stderr, stderr


def _push_from_a_pipe(
    tmp_path: Path, servers: list[Serve], *args: str, blocking: bool = True
) -> tuple[Serve, subprocess.Popen[bytes], int]:
    """A server without Spark on a free port and `sluice push - ARGS` to it reading a pipe: (the
    server, the push, the pipe's write end); `blocking` False leaves the push's end O_NONBLOCK."""
    port = free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, tmp_path / "data"))
    servers.append(serve)
    serve.wait_serving()
    reader, writer = os.pipe()
    os.set_blocking(reader, blocking)
    try:
        push = subprocess.Popen(
            [*SLUICE, "push", "-", "--target", f"127.0.0.1:{port}", "--no-progress", *args],
            stdin=reader,
            stderr=subprocess.PIPE,
        )
    finally:
        os.close(reader)
    return serve, push, writer


def test_a_non_blocking_stdin_is_read_to_its_end(tmp_path: Path, servers: list[Serve]) -> None:
    """A stdin left non-blocking (O_NONBLOCK on the pipe, as some parents leave it) read as ended the
    first time no data was there yet: the push said "pushed 2 records; all acked", exit 0, and the
    rest of the input was never sent. It waits for the input now, as on a blocking pipe."""
    serve, push, writer = _push_from_a_pipe(tmp_path, servers, "--timeout", "10", blocking=False)
    try:
        os.write(writer, b"a\nb\n")
        time.sleep(1.5)  # the push has read those and finds the pipe empty meanwhile
        assert push.poll() is None, push.communicate()[1].decode()
        os.write(writer, b"c\nd")
        os.close(writer)
        _, err = push.communicate(timeout=60)
    finally:
        push.kill()
    assert push.returncode == 0, err.decode()
    assert b"pushed 4 records" in err, err.decode()
    serve.kill()
    assert sorted(stored_values(tmp_path / "data")) == [b"a", b"b", b"c", b"d"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_while_the_input_waits_ends_the_push(
    tmp_path: Path, servers: list[Serve], sig: signal.Signals
) -> None:
    """`sluice push -` on a pipe with no data coming (`kill` of the push alone, systemd, Kubernetes:
    the writer lives on) said how far it got on SIGTERM or Ctrl-C and then hung for good: asyncio.run
    waited for the thread blocked in the read. It exits now, 143 or 130, what it read acked."""
    _, push, writer = _push_from_a_pipe(tmp_path, servers, "--producer-id", "p")
    try:
        os.write(writer, b"a\nb\n")
        deadline = time.monotonic() + 60
        while sum(stored_values(tmp_path / "data").values()) < 2:  # acked: stored, its block written
            assert time.monotonic() < deadline and push.poll() is None, "no acks"
            time.sleep(0.1)
        push.send_signal(sig)
        _, err = push.communicate(timeout=30)
    finally:
        push.kill()
        os.close(writer)
    stderr = err.decode()
    assert push.returncode == 128 + sig, stderr
    assert "of the input's records 2 are acked (durable), 2 sent, 2 read" in stderr, stderr
    assert "--producer-id p --resume-from 2" in stderr, stderr


async def test_the_resume_command_keeps_the_credential_flags_and_the_timeout(tmp_path: Path) -> None:
    """A failed push printed its resume command without --token-file (or --ca-file, --cert-file,
    --key-file): run as printed against the server that took the push, it was refused UNAUTHENTICATED.
    And --timeout went as %g: 1234567 came back as 1.23457e+06, another timeout."""
    from receivers.auth import new_token, token_hash

    token = new_token()
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    auth_file = tmp_path / "auth.toml"
    auth_file.write_text(
        '[principals.pusher]\nroles = ["producer"]\nstreams = ["default"]\n'
        f'token_sha256 = ["{token_hash(token)}"]\n'
    )
    source = tmp_path / "in.txt"
    source.write_bytes(b"a\nb\n" + b"x" * (40 * 1024 * 1024) + b"\nc\n")  # line 3: no record carries it
    data = tmp_path / "data"
    async with running_server(data, "default", security=SecurityConfig(auth_file=auth_file)) as server:
        flags = ["--target", server.target, "--token-file", str(token_file), "--timeout", "1234567"]
        pushed = await asyncio.to_thread(sluice, "push", str(source), *flags, "--no-progress")
        stderr = pushed.stderr.decode()
        assert pushed.returncode == 1, stderr
        assert "of the input's records 2 are acked (durable)" in stderr, stderr
        resume = re.search(r"to resume without duplicates, once the cause is fixed, run: (.+)", stderr)
        assert resume, stderr
        command = shlex.split(resume.group(1))
        assert command[command.index("--token-file") + 1] == str(token_file), stderr
        assert command[command.index("--timeout") + 1] == "1234567", stderr
        source.write_bytes(b"a\nb\nfixed\nc\n")
        resumed = await asyncio.to_thread(sluice, *command[1:])
        assert resumed.returncode == 0, resumed.stderr.decode()
    assert sorted(stored_values(data).elements()) == [b"a", b"b", b"c", b"fixed"]


# ---- item 7: the first connection waits for a server that is not up yet ----------------------------


def test_push_started_before_the_server_waits_for_it(tmp_path: Path, servers: list[Serve]) -> None:
    source = tmp_path / "in.txt"
    source.write_text("".join(f"{i}\n" for i in range(1000)))
    port = free_port()
    push = subprocess.Popen(
        [*SLUICE, "push", str(source), "--target", f"127.0.0.1:{port}", "--timeout", "60", "--no-progress"],
        stderr=subprocess.PIPE,
    )
    try:
        time.sleep(1.5)
        serve = Serve(tmp_path, "serve", *no_spark(port, tmp_path / "data"))
        servers.append(serve)
        _, err = push.communicate(timeout=90)
    finally:
        push.kill()
    assert push.returncode == 0, err.decode()
    assert f"waiting for server at 127.0.0.1:{port}".encode() in err
    assert b"pushed 1,000 records" in err
    serve.kill()
    assert len(stored_values(tmp_path / "data")) == 1000


def test_push_gives_up_waiting_after_its_timeout(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\n")
    port = free_port()
    started = time.monotonic()
    result = sluice("push", str(source), "--target", f"127.0.0.1:{port}", "--timeout", "1", timeout=60)
    assert result.returncode == 1
    assert f"waiting for server at 127.0.0.1:{port}".encode() in result.stderr
    assert f"no server at 127.0.0.1:{port} within".encode() in result.stderr
    assert b"no record was sent: the same command can run again" in result.stderr
    assert time.monotonic() - started < 30


class LaterServer:
    """A SluiceServer on `port`, started `delay` s from now on an event loop of its own thread (the
    test's loop stays free for the producer), until stop()."""

    def __init__(self, port: int, data_dir: Path, delay: float) -> None:
        self.config = ServeConfig(
            port=port,
            metrics_port=None,
            data_dir=data_dir,
            rate=RateConfig(estimator="fixed", initial_rate=math.inf),
            spark=False,
        )
        self.delay = delay
        self.serving = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),), daemon=True)
        self._thread.start()

    async def _run(self) -> None:
        await asyncio.sleep(self.delay)
        server = SluiceServer(self.config)
        await server.start()
        self.serving.set()
        while not self._stop.is_set():
            await asyncio.sleep(0.05)
        await server.stop(grace=1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


async def test_a_producer_started_before_its_server_waits_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    server = LaterServer(port, tmp_path, delay=1.5)
    try:
        started = time.monotonic()
        async with Producer(f"127.0.0.1:{port}", "default", start_timeout=60) as producer:
            await producer.send_many([b"a", b"b"])
            await producer.flush(timeout=30)
        assert producer.acked == 2
        assert 1.0 < time.monotonic() - started < 30
        waiting = [r for r in caplog.records if "waiting for server at" in r.getMessage()]
        assert waiting and waiting[0].levelname == "WARNING"
        assert f"127.0.0.1:{port}" in waiting[0].getMessage()
    finally:
        server.stop()


def test_a_sync_producer_started_before_its_server_waits_for_it(tmp_path: Path) -> None:
    port = free_port()
    server = LaterServer(port, tmp_path, delay=1.5)
    try:
        with SyncProducer(f"127.0.0.1:{port}", "default", start_timeout=60) as producer:
            producer.send_many([b"x"] * 10)
            producer.flush(30)
            assert producer.acked == 10
    finally:
        server.stop()


async def test_with_no_server_a_producer_fails_after_its_start_timeout(tmp_path: Path) -> None:
    target = f"127.0.0.1:{free_port()}"
    producer = Producer(target, "default", start_timeout=0.5, max_reconnect_backoff=0.1)
    started = time.monotonic()
    with pytest.raises(StartTimeoutError) as info:
        await producer.start()
    assert 0.4 < time.monotonic() - started < 10
    assert info.value.status == grpc.StatusCode.UNAVAILABLE
    assert info.value.attempts >= 2
    assert f"no server at {target} within" in str(info.value)
    with pytest.raises(StartTimeoutError):
        SyncProducer(target, "default", start_timeout=0.2)


async def test_a_refused_first_session_is_not_retried(tmp_path: Path) -> None:
    port = free_port()
    server = LaterServer(port, tmp_path, delay=0)
    try:
        assert await asyncio.to_thread(server.serving.wait, 30)
        started = time.monotonic()
        producer = Producer(f"127.0.0.1:{port}", "no-such-stream", start_timeout=60)
        with pytest.raises(RPCError) as info:
            await producer.start()  # the server refuses the stream at once: start() raises it
        assert info.value.status == grpc.StatusCode.NOT_FOUND
        assert time.monotonic() - started < 10  # not retried for start_timeout
        await producer.abort()
    finally:
        server.stop()


def test_the_lock_is_not_inherited_by_children(tmp_path: Path) -> None:
    # Spark's JVM and its Python workers are children of `sluice serve`: holding the lock they would
    # keep the data dir locked after the server died
    # in a process of its own: a fork by any other thread of the test run (between its fork and its
    # exec) holds every descriptor for a moment, which once made this check fail in CI
    script = """
import subprocess, sys
from pathlib import Path
from ingest.preflight import DataDirLock
lock = DataDirLock(Path(sys.argv[1]))
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], close_fds=False)
try:
    lock.release()
    DataDirLock(Path(sys.argv[1])).release()  # free although the child lives on
finally:
    child.kill()
    child.wait()
print("free")
"""
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, timeout=60, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == b"free", result.stderr


async def test_first_seq_resumes_a_producer_and_a_gap_past_its_mark_is_refused(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s") as server:
        async with Producer(server.target, "s", producer_id="p") as first:
            await first.send_many([b"0", b"1", b"2"])
        # a second run resumes at 1: what the server holds of it (1, 2) is dropped, 3 is new
        async with Producer(server.target, "s", producer_id="p", first_seq=1) as resumed:
            await resumed.send_many([b"1", b"2", b"3"])
            await resumed.flush(timeout=30)
            assert resumed.acked == resumed.ever_sent == 4
        gap = Producer(server.target, "s", producer_id="p", first_seq=10)
        await gap.start()
        with pytest.raises(RPCError) as info:
            await gap.send(b"10")
            await gap.flush(timeout=30)
        assert info.value.status == grpc.StatusCode.OUT_OF_RANGE
        await gap.abort()
        batches = [batch for block in server.store.blocks("s") for batch in server.store.read(block)]
        values = [v for batch in batches for v in batch.column("value").to_pylist()]
    assert values == [b"0", b"1", b"2", b"3"]
    with pytest.raises(ValueError, match="first_seq"):
        Producer("127.0.0.1:1", "s", first_seq=-1)


def _vm(pid: int, field: str) -> int:
    """A VmRSS/VmHWM line of /proc/<pid>/status, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def test_an_unauthenticated_unary_call_is_refused_before_its_body_is_read(
    tmp_path: Path, servers: list[Serve]
) -> None:
    """Unary requests were read whole (up to the 32 MiB message limit) before the caller was checked:
    16 calls of 31 MiB without a token took a server from 108 to 1,056 MiB, and it kept them."""
    from receivers.auth import new_token, token_hash

    auth = tmp_path / "auth.toml"
    auth.write_text(f'[principals.ops]\nroles = ["operator"]\ntoken_sha256 = ["{token_hash(new_token())}"]\n')
    port = free_port()
    serve = Serve(tmp_path, "serve", *no_spark(port, tmp_path / "data", "--auth-file", str(auth)))
    servers.append(serve)
    serve.wait_serving()
    before = _vm(serve.proc.pid, "VmHWM")
    body = b"\x0a" * (24 * 1024 * 1024)

    async def flood() -> list[grpc.StatusCode]:
        options = [("grpc.max_send_message_length", 64 * 1024 * 1024)]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            get_rate = channel.unary_unary("/ingest.v1.RateControl/GetRate")

            async def one() -> grpc.StatusCode:
                try:
                    await get_rate(body, timeout=60)
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            return list(await asyncio.gather(*(one() for _ in range(8))))

    assert asyncio.run(flood()) == [grpc.StatusCode.UNAUTHENTICATED] * 8
    grown = _vm(serve.proc.pid, "VmHWM") - before
    # read whole and copied, the 8 bodies (192 MiB) grew it by 260-335 MiB; refused first, by 8-103
    # MiB: what HTTP/2's flow-control windows let in before the refusal, more on a slower machine
    bodies = 8 * len(body)
    assert grown < bodies * 3 // 4, f"the server's peak RSS grew by {grown / 2**20:.0f} MiB"


async def test_a_producer_fails_over_from_a_frozen_server(tmp_path: Path, servers: list[Serve]) -> None:
    """A server that stops answering with its connection open (SIGSTOP: frozen, partitioned away) held
    a producer's session for good: no keepalive, so nothing told it from a quiet server."""
    port = free_port()
    frozen = Serve(tmp_path, "frozen", *no_spark(port, tmp_path / "frozen"))
    servers.append(frozen)
    await asyncio.to_thread(frozen.wait_serving)
    async with running_server(tmp_path / "healthy", "default") as healthy:
        producer = Producer([f"127.0.0.1:{port}", healthy.target], "default", linger=0, reconnect_timeout=120)
        async with producer:
            await producer.send_many([b"before"] * 10)
            await producer.flush(timeout=30)
            assert producer.target == f"127.0.0.1:{port}"
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                await producer.send_many([b"after"] * 10)
                await producer.flush(timeout=90)
                took = time.monotonic() - started
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)
            assert producer.target == healthy.target
            assert producer.acked == 20
            assert took < 45, f"failed over after {took:.0f} s"


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT], ids=["hup", "term", "int"])
def test_a_signal_while_serve_starts_ends_it_cleanly_or_is_ignored(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """Signals right after "starting:", before the event loop had taken them: SIGHUP (meant to be
    ignored while starting) ended the server silently, SIGTERM ended it without its cleanup, and SIGINT
    reached asyncio.run's own handler, which cancelled the start half-way into gRPC's server (a
    CancelledError and an InvalidStateError traceback)."""
    log = tmp_path / "serve.log"
    command = [*SLUICE, "serve", "--no-spark", "--port", "0", "--metrics-port", "-1"]
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [*command, "--data-dir", str(tmp_path / "data")],
            stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    last = sig
    try:
        deadline = time.monotonic() + 60
        while b"sluice: starting:" not in log.read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.001)
        if sig == signal.SIGHUP:  # ignored while starting: it serves, and stops on SIGTERM as ever
            proc.send_signal(sig)
            wait_for_line(proc, log, r"sluice: serving", 60)
            last = signal.SIGTERM
    finally:
        code = stop(proc, 60, last)
    said = log.read_text()
    assert "Traceback" not in said and "Error" not in said, said
    assert code == (130 if sig == signal.SIGINT and "stopped" not in said else 0), (code, said)


def importing_the_cli(proc: subprocess.Popen[bytes]) -> None:
    """Wait until the process has loaded asyncio's C module: its console script is importing the CLI's
    modules then (a few tenths of a second more), and the interpreter's own start (some 20 ms, where
    no code of Sluice's can take a signal) is over."""
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError):
            if b"/_asyncio." in maps.read_bytes():
                return
        assert proc.poll() is None and time.monotonic() < deadline, proc.poll()
        time.sleep(0.001)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["int", "term", "hup"])
def test_a_signal_while_the_cli_is_imported_ends_as_once_it_runs(tmp_path: Path, sig: signal.Signals) -> None:
    """Signals in the first tenths of a second of a `sluice` command, while the console script imported
    the CLI's modules (before main() and its handlers): Ctrl-C printed a KeyboardInterrupt traceback
    (exit -2), and SIGTERM or SIGHUP ended `sluice serve` by their default actions (exit -15 or -1,
    without a word or its cleanup). The console script holds them from its first line (ingest.console)
    and the CLI acts on them where it would have a moment later: Ctrl-C exit 130 with one line, serve
    stopped by SIGTERM (exit 0) and deaf to SIGHUP while it starts."""
    rng = random.Random()
    with socket.socket() as silent:  # takes connections and never answers: `rate get` waits on it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        target = f"127.0.0.1:{silent.getsockname()[1]}"
        for attempt in range(5):
            delay = rng.uniform(0, 0.2)
            serve = sig != signal.SIGINT or attempt % 2 == 0
            argv = [*SLUICE, "rate", "get", "--target", target]
            if serve:
                argv = [*SLUICE, "serve", *no_spark(0, tmp_path / f"data{attempt}")]
            log = tmp_path / f"{attempt}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)
            last = sig
            try:
                importing_the_cli(proc)
                time.sleep(delay)
                if sig == signal.SIGHUP:  # ignored while serve starts: it serves, and SIGTERM stops it
                    proc.send_signal(sig)
                    wait_for_line(proc, log, r"sluice: serving", 60)
                    last = signal.SIGTERM
            finally:
                code = stop(proc, 60, last)
            said = log.read_text()
            seen = f"{argv[1]} {delay:.3f} s into the imports: exit {code}\n{said}"
            assert "Traceback" not in said, seen
            if sig == signal.SIGINT and not serve:
                assert (code, said) == (130, "sluice: interrupted\n"), seen
            elif sig == signal.SIGINT:  # before its event loop took Ctrl-C over, or after (a clean stop)
                ended = (code, said.splitlines()[-1])
                assert ended in ((130, "sluice: interrupted"), (0, "sluice: stopped")), seen
            else:
                assert code == 0 and said.splitlines()[-1].startswith("sluice: stopped"), seen


def jvm_child(proc: subprocess.Popen[bytes]) -> bool:
    """Whether `proc` has started Spark's JVM (a java child): its Spark start is under way."""
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            with contextlib.suppress(OSError):
                if b"java" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return True
    return False


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_stop_signal_while_spark_starts_ends_the_start_promptly(tmp_path: Path) -> None:
    """Ctrl-C (twice, as a user does) or SIGTERM while Spark's JVM starts: nothing looked at the stop
    until Spark, the server and the query had all started (a minute or two on a slow machine), then it
    served for a moment and exited 0. Now the start ends within seconds: Ctrl-C exit 130, SIGTERM exit 0
    with its "before ... was up" line, no server, the data dir free; for `sluice serve` and a cluster's
    driver alike."""
    nodes = tmp_path / "nodes"
    nodes.write_text(f"0 127.0.0.1:{free_port()}\n")
    cases = {
        "serve": (
            ["serve", "--port", "0", "--metrics-port", "-1", "--master", "local[1]"],
            (signal.SIGINT, signal.SIGINT),
        ),
        "driver": (
            ["serve", "--role", "driver", "--nodes", str(nodes), "--port", "0", "--metrics-port", "-1"],
            (signal.SIGTERM,),
        ),
    }
    procs = {}
    for name, (command, _) in cases.items():
        log = tmp_path / f"{name}.log"
        with log.open("wb") as out:
            procs[name] = subprocess.Popen(
                [*SLUICE, *command, "--data-dir", str(tmp_path / name)],
                stderr=out,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )
    try:
        for name, (_, signals) in cases.items():
            proc, log = procs[name], tmp_path / f"{name}.log"
            deadline = time.monotonic() + 60
            while not jvm_child(proc):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            time.sleep(1)  # into the JVM's start
            started = time.monotonic()
            for sig in signals:
                proc.send_signal(sig)
                time.sleep(0.2)
            code = proc.wait(timeout=240)
            took = time.monotonic() - started
            said = log.read_text(errors="replace")
            assert "Traceback" not in said and "serving" not in said and "query running" not in said, said
            if name == "serve":  # the first Ctrl-C's stop, or the second's exit at once: 130 either way
                assert code == 130, (code, said)
                assert re.search(r"sluice: (interrupted before the server was up|second SIGINT)", said), said
            else:
                assert code == 0, (code, said)
                assert said.splitlines()[-1] == "sluice: stopped (SIGTERM) before the driver was up", said
            assert took < 30, (name, took, said)  # Spark's and the query's start: a minute and more here
            DataDirLock(tmp_path / name).release()  # free: the lock went with the process
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_one_sigterm_sent_to_serve_and_to_its_group_is_one_stop(tmp_path: Path, servers: list[Serve]) -> None:
    """GNU `timeout`, itself sent SIGTERM (a supervisor stopping a `timeout 1h sluice serve`), signals
    its child and then the child's process group: two SIGTERMs microseconds apart. The second was taken
    for an operator's second stop: exit 143 at once, without the drain. The same SIGTERM again within a
    second is the same stop: a clean drain, exit 0. Here the two come 20 ms apart (the event loop has
    taken the first by then), with a producer's records waiting."""
    serve = Serve(tmp_path, "serve", *no_spark(free_port(), tmp_path / "data"))
    servers.append(serve)
    serve.wait_serving()
    target = re.search(SERVING, serve.log.read_text())
    assert target is not None
    with SyncProducer(target.group(1), "default") as producer:
        producer.send_many([b"record"] * 100)
        producer.flush(timeout=30)
    serve.proc.send_signal(signal.SIGTERM)
    time.sleep(0.02)
    serve.proc.send_signal(signal.SIGTERM)
    code = serve.proc.wait(timeout=60)
    said = serve.log.read_text()
    assert code == 0, (code, said)
    assert "second SIGTERM" not in said and said.splitlines()[-1] == "sluice: stopped", said

    # a timeout of its own (`timeout -s TERM`) sent to the process and its group the same way
    again = subprocess.run(
        ["timeout", "-s", "TERM", "3", *SLUICE, "serve", *no_spark(free_port(), tmp_path / "data")],
        capture_output=True,
        timeout=60,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    assert again.returncode == 124, again.stderr.decode()  # timeout's own code: the child ended by itself
    assert again.stderr.decode().splitlines()[-1] == "sluice: stopped", again.stderr.decode()


# ---- state under the data dir that cannot be read ------------------------------------------------


@pytest.fixture(scope="module")
def logged_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data dir a real `sluice serve --no-spark` left: stream default from the flags and stream tmp
    added at run time (streams.json), each with records in its log. Copy it before changing it."""
    tmp = tmp_path_factory.mktemp("logged")
    data_dir = tmp / "data"
    serve = Serve(tmp, "serve", *no_spark(free_port(), data_dir))
    try:
        serve.wait_serving()
        target = re.search(SERVING, serve.log.read_text())
        assert target is not None
        added = sluice("streams", "add", "tmp", "--target", target.group(1), timeout=60)
        assert added.returncode == 0, added.stderr.decode()
        for stream in ("default", "tmp"):
            with SyncProducer(target.group(1), stream) as producer:
                producer.send_many([b"record"] * 10)
                producer.flush(timeout=30)
    finally:
        assert stop(serve.proc, 60) == 0
    for stream in ("default", "tmp"):
        assert list((data_dir / "blocks" / stream).glob("*.wal")), stream
    return data_dir


def start_on(tmp_path: Path, data_dir: Path, name: str) -> tuple[int | None, str]:
    """`sluice serve --no-spark` on `data_dir`: (its exit code, its stderr) when it stops at its start,
    (None, stderr) when it serves (then it is stopped)."""
    serve = Serve(tmp_path, name, *no_spark(free_port(), data_dir))
    deadline = time.monotonic() + 60
    while serve.proc.poll() is None and time.monotonic() < deadline:
        if re.search(r"serving streams .+ on 127", serve.log.read_text()):
            stop(serve.proc, 60)
            return None, serve.log.read_text()
        time.sleep(0.2)
    serve.kill()
    return serve.proc.returncode, serve.log.read_text()


@pytest.mark.parametrize(
    ("stream", "content"),
    [("default", b""), ("default", b"hello world\n"), ("tmp", b"\xff\xfe")],
    ids=["empty", "not-an-id", "not-text"],
)
def test_a_damaged_incarnation_beside_a_log_stops_the_start_naming_it(
    tmp_path: Path, logged_data_dir: Path, stream: str, content: bytes
) -> None:
    """An outside tester's finding: an emptied or invalid incarnation file beside a log was silently
    replaced by a new id (a surviving checkpoint then saw a lost log), and one of bytes that are not
    text stopped the start with a bare "'utf-8' codec can't decode byte 0xff", naming no file. Both stop
    the start with exit 1, naming the file and what to do; the file is left as it was."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    path = data_dir / "blocks" / stream / "incarnation"
    path.write_bytes(content)
    code, stderr = start_on(tmp_path, data_dir, "damaged")
    assert code == 1, stderr
    assert f"{path} (the identity, or incarnation, of the block log of stream {stream!r})" in stderr
    assert "restore the file" in stderr and "remove it to have the log take a new identity" in stderr
    assert "Traceback" not in stderr
    assert path.read_bytes() == content

    # removed, as the message offers (or a data dir from before incarnations): the log takes a new id
    path.unlink()
    code, stderr = start_on(tmp_path, data_dir, "removed")
    assert code is None, stderr
    assert re.fullmatch(r"[0-9a-f]{32}\n", path.read_text())


def _made_a_fifo(name: str) -> Callable[[Path], Path]:
    def replace(data_dir: Path) -> Path:
        path = data_dir / name
        path.unlink(missing_ok=True)
        os.mkfifo(path)
        return path

    return replace


def _made_dev_zero(name: str) -> Callable[[Path], Path]:
    def replace(data_dir: Path) -> Path:
        path = data_dir / name
        path.unlink(missing_ok=True)
        path.symlink_to("/dev/zero")
        return path

    return replace


def _segment_made_a_fifo(data_dir: Path) -> Path:
    return _made_a_fifo(str(next((data_dir / "blocks" / "tmp").glob("*.wal")).relative_to(data_dir)))(
        data_dir
    )


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_made_a_fifo("node.json"), "cannot read which node this data dir belongs to: not a regular file"),
        (_made_dev_zero("node.json"), "cannot read which node this data dir belongs to: not a regular file"),
        (_made_a_fifo("streams.json"), "cannot read the stream states: not a regular file"),
        (_made_a_fifo("runtime-config.json"), "cannot read the runtime settings: not a regular file"),
        (_segment_made_a_fifo, "is not a regular file (a FIFO, a socket or a device) where the block log"),
        (_made_a_fifo("blocks/tmp/99999999999999999999.wal"), "is not a regular file (a FIFO, a socket or"),
        (_made_a_fifo("blocks/tmp/released.json"), "is not a regular file (a FIFO, a socket or a device)"),
        (_made_a_fifo("blocks/tmp/incarnation"), "cannot be read (not a regular file"),
    ],
    ids=[
        "node-json",
        "node-json-dev-zero",
        "streams-json",
        "runtime-config",
        "segment",
        "new-segment",
        "released-json",
        "incarnation",
    ],
)
def test_a_fifo_or_device_where_the_data_dir_has_a_file_stops_the_start_naming_it(
    tmp_path: Path, logged_data_dir: Path, damage: Callable[[Path], Path], says: str
) -> None:
    """An outside tester's finding: a FIFO where the start reads a file (a segment, a stream's
    incarnation or released mark, node.json, streams.json, runtime-config.json) held `sluice serve` for
    ever in the open, which waits for a writer, deaf to SIGTERM (the event loop was blocked in it); a
    node.json linked to /dev/zero was read without end. Each stops the start now with exit 1 naming the
    file; none is opened to wait or read."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    path = damage(data_dir)
    started = time.monotonic()
    code, stderr = start_on(tmp_path, data_dir, "damaged")
    assert code == 1, stderr
    assert f"{path}" in stderr and says in stderr, stderr
    assert "Errno" not in stderr and "Traceback" not in stderr, stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("node.json", "cannot read which node this data dir belongs to: JSON nested too deeply"),
        ("streams.json", "cannot read the stream states: JSON nested too deeply"),
        ("runtime-config.json", "cannot read the runtime settings: JSON nested too deeply"),
        ("blocks/tmp/released.json", None),
    ],
    ids=["node-json", "streams-json", "runtime-config", "released-json"],
)
def test_a_state_file_of_json_nested_too_deeply_is_named_not_a_traceback(
    tmp_path: Path, logged_data_dir: Path, name: str, says: str | None
) -> None:
    """An outside tester's finding: a state file of JSON nested past what Python's parser takes (100,000
    `[`, valid JSON) ended the start in a traceback, a RecursionError that no reader's handler of a
    damaged file (ValueError) took. node.json, streams.json and runtime-config.json stop the start
    with exit 1 naming the file, as any damage does; a stream's released mark is passed over with the
    one ERROR a damaged mark gets, and the server serves."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    path = data_dir / name
    path.write_text("[" * 100_000 + "]" * 100_000)
    code, stderr = start_on(tmp_path, data_dir, "nested")
    if says is None:
        assert code is None, stderr
        assert f"{path} is unreadable: JSON nested too deeply to be read; ignoring it" in stderr, stderr
        assert "RecursionError" not in stderr and "Traceback" not in stderr, stderr
    else:
        assert code == 1, stderr
        assert f"{path}: {says}" in stderr, stderr
        assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize(
    "name",
    [
        "blocks/tmp/SEGMENT",
        "blocks/default/99999999999999999999.wal",
        "blocks/tmp/released.json",
        "blocks/default/incarnation",
        "node.json",
        "streams.json",
        "runtime-config.json",
    ],
    ids=[
        "segment",
        "new-segment",
        "released-json",
        "incarnation",
        "node-json",
        "streams-json",
        "runtime-config",
    ],
)
def test_a_symlink_to_nowhere_where_the_data_dir_has_a_file_stops_the_start_naming_it(
    tmp_path: Path, logged_data_dir: Path, name: str
) -> None:
    """An outside tester's finding: a symlink whose target does not exist, named as a segment of the
    log, was taken for no file at all: the start served without the acked records of that segment (the
    only one, or the newest: a gap before a later one was refused as missing blocks, which the link's
    own name contradicted), and numbered new blocks over them. The released mark, the incarnation and
    the data dir's state files the same (a new incarnation, streams added at run time no longer served).
    Each stops the start with exit 1, naming the file and where it leads; the link is left as it was."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    if "SEGMENT" in name:
        name = str(next((data_dir / "blocks" / "tmp").glob("*.wal")).relative_to(data_dir))
    path = data_dir / name
    target = tmp_path / "elsewhere" / path.name
    if path.exists():  # moved, and linked to where it is not: a disk not mounted, say
        path.rename(tmp_path / path.name)
    path.symlink_to(target)
    code, stderr = start_on(tmp_path, data_dir, "linked")
    assert code == 1, stderr
    assert str(path) in stderr and f"a symlink to {target}, which does not exist" in stderr, stderr
    assert "Errno" not in stderr and "Traceback" not in stderr, stderr
    assert path.is_symlink() and os.readlink(path) == str(target) and not target.exists()


def test_a_segment_linked_to_a_file_elsewhere_is_read_and_written_there(
    tmp_path: Path, logged_data_dir: Path
) -> None:
    """Symlinks in the data dir are followed, a segment's too, and what they lead to is judged as the
    file would be (a FIFO or a device refused, a regular file used): a segment moved to another disk and
    linked back keeps its records, and the log appends to it there."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    (segment,) = (data_dir / "blocks" / "default").glob("*.wal")
    elsewhere = tmp_path / "elsewhere.wal"
    segment.rename(elsewhere)
    segment.symlink_to(elsewhere)
    size = elsewhere.stat().st_size
    serve = Serve(tmp_path, "linked", *no_spark(free_port(), data_dir))
    try:
        target = wait_for_line(
            serve.proc, serve.log, r"serving streams default, tmp on (127\.0\.0\.1:\d+)", 60
        )
        with SyncProducer(target.group(1).decode(), "default") as producer:
            producer.send_many([b"after"] * 5)
            producer.flush(timeout=30)
    finally:
        assert stop(serve.proc, 60) == 0
    assert segment.is_symlink() and elsewhere.stat().st_size > size
    store = WalBlockStore(data_dir / "blocks")
    assert [
        v
        for b in store.blocks("default")
        for batch in store.read(b)
        for v in batch.column("value").to_pylist()
    ] == [b"record"] * 10 + [b"after"] * 5


@pytest.mark.parametrize("kind", ["fifo", "dev-null"])
def test_a_lock_file_that_is_not_a_file_is_named(tmp_path: Path, kind: str) -> None:
    """A FIFO (or a link to /dev/null) at DATA_DIR/sluice.lock was opened and locked, then refused as
    "data dir ... is not writable: Invalid argument" (ftruncate's EINVAL), naming neither the file nor
    what to do. Now the lock file is named, exit 1."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lock = data_dir / "sluice.lock"
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        lock.symlink_to("/dev/null")
    code, stderr = start_on(tmp_path, data_dir, kind)
    assert code == 1, stderr
    assert (
        f"cannot open the lock file {lock}: not a regular file (a FIFO, a socket or a device); remove it"
        in stderr
    )
    assert "Traceback" not in stderr and "not writable" not in stderr, stderr


def test_a_fifo_left_where_the_pipeline_token_goes_is_replaced(tmp_path: Path, logged_data_dir: Path) -> None:
    """The pipeline token, written anew at every start, was opened in place: a FIFO there (or a symlink,
    refused by O_NOFOLLOW) held the start for ever waiting for a reader. A new file replaces it."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    token = _made_a_fifo("pipeline.token")(data_dir)
    code, stderr = start_on(tmp_path, data_dir, "fifo")
    assert code is None, stderr
    assert token.is_file() and not token.is_symlink() and oct(token.stat().st_mode & 0o777) == "0o600"
    assert not token.with_name("pipeline.token.tmp").exists()


def _segment_made_a_folder(data_dir: Path) -> Path:
    segment = next((data_dir / "blocks" / "tmp").glob("*.wal"))
    segment.unlink()
    segment.mkdir()
    return segment


def _stream_folder_made_a_file(data_dir: Path) -> Path:
    folder = data_dir / "blocks" / "tmp"
    shutil.rmtree(folder)
    folder.write_text("x\n")
    return folder


def _replaced(name: str, content: str) -> Callable[[Path], Path]:
    def replace(data_dir: Path) -> Path:
        (data_dir / name).write_text(content)
        return data_dir / name

    return replace


@pytest.mark.parametrize(
    ("damage", "remedy"),
    [
        (_replaced("node.json", "{"), 'restore it, or write {"node_id": ID} to it'),
        (_replaced("runtime-config.json", "{"), "restore it, or delete it to start from the command line's"),
        (_replaced("runtime-config.json", "[]"), "restore it, or delete it to start from the command line's"),
        (_replaced("streams.json", ""), "restore it, or delete it to serve the --stream flags' streams"),
        (_segment_made_a_folder, "put back what was there, or move"),
        (_stream_folder_made_a_file, "put back what was there, or move"),
    ],
    ids=[
        "node-json",
        "runtime-config-json",
        "runtime-config-not-one",
        "streams-json",
        "segment",
        "stream-folder",
    ],
)
def test_state_under_the_data_dir_that_cannot_be_read_stops_the_start_with_exit_1_naming_it(
    tmp_path: Path, logged_data_dir: Path, damage: Callable[[Path], Path], remedy: str
) -> None:
    """An outside tester's finding: a damaged node.json or runtime-config.json stopped `sluice serve`
    with exit 2, a damaged streams.json with exit 1, a segment replaced by a folder or a stream's folder
    by a file with exit 1 and a bare "[Errno 21] Is a directory" / "[Errno 20] Not a directory" (naming
    released.json, which is not there). Each is now exit 1 (a failure, as a damaged block log; exit 2
    is bad usage) and one line naming the file and what to do."""
    data_dir = tmp_path / "data"
    shutil.copytree(logged_data_dir, data_dir)
    path = damage(data_dir)
    code, stderr = start_on(tmp_path, data_dir, "damaged")
    assert code == 1, stderr
    assert f"{path}" in stderr and remedy in stderr, stderr
    assert "Errno" not in stderr and "Traceback" not in stderr, stderr
