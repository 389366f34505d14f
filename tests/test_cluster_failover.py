"""Two `sluice serve --role receiver` processes with replication 2; `sluice push` to both; the node it
pushes to is killed with SIGKILL mid-push. Every record is acked, and the survivor holds each record
exactly once: its copy of the dead node's blocks plus its own (the resend of what was copied but not
acked is dropped by the producer marks)."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from receivers.wal import WalBlockStore
from tests.support import free_ports

pytestmark = pytest.mark.cluster


def values(root: Path, committed_file: Path) -> list[bytes]:
    """The records of the log at `root` that its node serves: those below the committed seq (a block
    past it was never acked; its records were resent and are elsewhere)."""
    limit = json.loads(committed_file.read_text()).get("default", 0) if committed_file.exists() else 0
    store = WalBlockStore(root)
    found: list[bytes] = []
    for block in store.blocks("default"):
        if block.seq >= limit:
            continue
        for batch in store.read(block):
            found.extend(batch.column("value").to_pylist())
    return found


def serve(tmp_path: Path, node: int, port: int, log: IO[bytes]) -> subprocess.Popen[bytes]:
    command = [
        sys.executable,
        "-m",
        "ingest.cli",
        "serve",
        "--role",
        "receiver",
        "--nodes",
        str(tmp_path / "nodes"),
    ]
    command += ["--node-id", str(node), "--port", str(port), "--metrics-port", "-1", "--replication", "2"]
    command += ["--data-dir", str(tmp_path / f"d{node}")]
    # paced (fixed estimator, receiver role) so the push lasts ~4 s and the kill lands mid-push: unpaced,
    # 200,000 records could all be acked before node 0's first replica showed up on node 1
    command += ["--initial-rate", str(RATE)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)


def wait_listening(log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while b"serving streams" not in (log.read_bytes() if log.exists() else b""):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


def test_sigkill_of_the_node_a_push_goes_to_loses_and_doubles_nothing(tmp_path: Path) -> None:
    ports = free_ports(2)
    (tmp_path / "nodes").write_text("".join(f"{i} 127.0.0.1:{p}\n" for i, p in enumerate(ports)))
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(open(tmp_path / f"n{i}.log", "wb")) for i in range(2)]
        run_cluster(tmp_path, ports, logs)
    d1 = tmp_path / "d1"
    held = values(d1 / "replicas" / "0", d1 / "replicas" / "0.committed.json")
    held += values(d1 / "blocks", d1 / "committed.json")
    counts = collections.Counter(held)
    assert len(counts) == TOTAL, "records lost"
    assert len(held) == TOTAL, f"{len(held) - TOTAL} records doubled"


TOTAL = 200_000
RATE = 50_000


def run_cluster(tmp_path: Path, ports: list[int], logs: list[IO[bytes]]) -> None:
    nodes = [serve(tmp_path, i, p, logs[i]) for i, p in enumerate(ports)]
    try:
        for i in range(2):
            wait_listening(tmp_path / f"n{i}.log")
        (tmp_path / "records").write_text("".join(f"{i}\n" for i in range(TOTAL)))
        targets = ",".join(f"127.0.0.1:{p}" for p in ports)
        push = subprocess.Popen(
            [sys.executable, "-m", "ingest.cli", "push", str(tmp_path / "records"), "--target", targets],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        # kill node 0 once it has taken some of the records
        deadline = time.monotonic() + 60
        while not any((tmp_path / "d1" / "replicas" / "0").rglob("*.wal")):
            assert time.monotonic() < deadline and push.poll() is None
            time.sleep(0.02)
        assert push.poll() is None, "the push ended before the kill: nothing failed over"
        os.kill(nodes[0].pid, signal.SIGKILL)
        out, _ = push.communicate(timeout=120)
        assert push.returncode == 0, out.decode()
        assert b"all acked" in out
        assert b"failed over" in out  # it did go through a failover
    finally:
        for node in nodes:
            node.send_signal(signal.SIGTERM)
        for node in nodes:
            node.wait(timeout=30)


def test_a_receiver_started_with_the_wrong_node_id_or_port_is_refused(tmp_path: Path) -> None:
    (tmp_path / "nodes").write_text("0 127.0.0.1:51101\n1 127.0.0.1:51102\n")
    base = [
        sys.executable,
        "-m",
        "ingest.cli",
        "serve",
        "--role",
        "receiver",
        "--nodes",
        str(tmp_path / "nodes"),
    ]
    for extra, words in (
        (["--node-id", "1", "--port", "51101"], "listed at 127.0.0.1:51102"),
        (["--node-id", "7", "--port", "51101"], "not in the node list"),
        (["--port", "51101"], "needs --node-id"),
    ):
        env = {k: v for k, v in os.environ.items() if k != "SLUICE_NODE_ID"}
        done = subprocess.run(
            [*base, *extra, "--data-dir", str(tmp_path / "d")],
            capture_output=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert done.returncode == 2 and words.encode() in done.stderr, done.stderr


def test_a_follower_stopped_with_sigterm_ends_its_replicate_streams_quietly(tmp_path: Path) -> None:
    """SIGTERM of a follower while its owner replicates to it: the follower ends the owner's Replicate
    stream itself (UNAVAILABLE, which the owner retries without a word) and exits at once. Before, the
    stream was left to gRPC's stop, which waited out its 5 s grace, cancelled the handler, and in some
    runs the loop's teardown cancelled the call's task still pending: a CancelledError traceback from
    `_schedule_rpc_coro` for /ingest.v1.Replication/Replicate on the follower's stderr."""
    ports = free_ports(2)
    (tmp_path / "nodes").write_text("".join(f"{i} 127.0.0.1:{p}\n" for i, p in enumerate(ports)))
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(open(tmp_path / f"n{i}.log", "wb")) for i in range(2)]
        nodes = [serve(tmp_path, i, p, logs[i]) for i, p in enumerate(ports)]
        push = None
        try:
            for i in range(2):
                wait_listening(tmp_path / f"n{i}.log")
            (tmp_path / "records").write_text("".join(f"{i}\n" for i in range(TOTAL)))
            command = [sys.executable, "-m", "ingest.cli", "push", str(tmp_path / "records")]
            push = subprocess.Popen(
                [*command, "--target", f"127.0.0.1:{ports[0]}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + 60
            while not any((tmp_path / "d1" / "replicas" / "0").rglob("*.wal")):  # node 0 replicates to 1
                assert time.monotonic() < deadline and push.poll() is None
                time.sleep(0.02)
            assert push.poll() is None, "the push ended before the stop"
            started = time.monotonic()
            nodes[1].send_signal(signal.SIGTERM)
            assert nodes[1].wait(timeout=30) == 0
            took = time.monotonic() - started
            out, _ = push.communicate(timeout=120)  # the owner goes on alone (min-insync 1)
            assert push.returncode == 0, out.decode()
        finally:
            if push is not None and push.poll() is None:
                push.kill()
                push.wait()
            for node in nodes:
                if node.poll() is None:
                    node.send_signal(signal.SIGTERM)
            for node in nodes:
                node.wait(timeout=30)
    follower = (tmp_path / "n1.log").read_text()
    assert "Traceback" not in follower and "CancelledError" not in follower, follower
    assert took < 3, f"the follower took {took:.1f} s to stop:\n{follower}"
    owner = (tmp_path / "n0.log").read_text()
    assert "refuses replication" not in owner and "Traceback" not in owner, owner
