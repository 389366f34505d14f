"""Acked ingest throughput of 1, 2 and 3 receiver nodes, and the cost of replication 2 vs 1.

Each configuration starts real `sluice serve --role receiver` processes on loopback and one
`sluice push` process per node (its own producer), all at once, and times until every push has every
record acked. Ratios are against one node with replication 1, measured in the same run. On a machine
with few cores the nodes and producers share them: read the ratios as what the processes cost, not
as what separate machines would give.

    python bench/cluster_throughput.py --records 300000
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = [(1, 1), (2, 1), (3, 1), (2, 2), (3, 2)]
"""(nodes, replication)."""


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def run(nodes: int, replication: int, records_file: Path, records: int, fsync: str) -> float:
    """Records/s acked over all producers."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ports = free_ports(nodes)
        (root / "nodes").write_text("".join(f"{i} 127.0.0.1:{p}\n" for i, p in enumerate(ports)))
        servers = []
        for i, port in enumerate(ports):
            command = [sys.executable, "-m", "ingest.cli", "--log-level", "warning", "serve"]
            command += ["--role", "receiver"]
            command += ["--nodes", str(root / "nodes"), "--node-id", str(i), "--port", str(port)]
            command += ["--metrics-port", "-1", "--replication", str(replication), "--fsync", fsync]
            command += ["--data-dir", str(root / f"d{i}")]
            servers.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            for port in ports:
                _wait_port(port)
            time.sleep(1.0)  # followers connect and join the in-sync set
            started = time.perf_counter()
            push_command = [sys.executable, "-m", "ingest.cli", "push", str(records_file), "--no-progress"]
            pushes = [
                subprocess.Popen(
                    [*push_command, "--target", f"127.0.0.1:{port}"],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
                for port in ports
            ]
            for push in pushes:
                _, err = push.communicate(timeout=600)
                if push.returncode != 0:
                    raise RuntimeError(f"push failed: {err.decode()}")
            elapsed = time.perf_counter() - started
        finally:
            for server in servers:
                server.send_signal(signal.SIGTERM)
            for server in servers:
                server.wait(timeout=60)
    return records * nodes / elapsed


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no server on port {port}")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=300_000, help="records per producer (one per node)")
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--fsync", default="every-block", help="the nodes' --fsync (default: %(default)s)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        records_file = Path(tmp) / "records"
        line = "x" * (args.record_bytes - 1) + "\n"
        records_file.write_text(line * args.records)
        print(f"{os.cpu_count()} cores; {args.records:,} records of {args.record_bytes} B per producer")
        baseline = None
        for nodes, replication in CONFIGS:
            rate = run(nodes, replication, records_file, args.records, args.fsync)
            baseline = baseline or rate
            print(
                f"{nodes} node(s), replication {replication}: {rate:10,.0f} records/s acked "
                f"({rate / baseline:.2f}x one node)",
                flush=True,
            )


if __name__ == "__main__":
    main()
