"""Recovery after kill -9 with a large backlog of unconsumed blocks in the write-ahead log.

Run: python bench/recovery.py [--gigabytes 1.0] [--record-bytes 1000]

1. Baseline: `sluice serve --no-spark` on an empty data dir, timed from spawn until it takes a Publish
   session and acks a record (interpreter start, imports, gRPC bind, an empty recovery).
2. The same server is fed GIGABYTES of records by a producer (no Spark: nothing is consumed, every
   block stays in the log), then killed with SIGKILL in the middle of ingesting.
3. Restart on the same data dir, timed the same way: recovery scans and checksums every frame of the
   log, truncates the torn tail, rebuilds the producer table, then serves.
Prints both times and their ratio, the log size, and what recovery reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sluice_process import client_loop  # this folder: run as python bench/recovery.py

from sluice_client import Producer
from sluice_client.errors import SluiceError

STREAM = "default"
SLUICE = [str(Path(sys.executable).parent / "sluice")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                *SLUICE,
                "serve",
                "--no-spark",
                "--port",
                str(port),
                "--metrics-port",
                "-1",
                "--data-dir",
                str(data),
            ],
            stderr=out,
            start_new_session=True,
        )


async def first_ack(target: str, timeout: float = 600) -> None:
    """Open a session and get one record acked, retrying until the server is up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with Producer(target, STREAM, linger=0, reconnect_timeout=0) as producer:
                await producer.send(b"probe")
                await producer.flush(timeout=60)
        except SluiceError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)
        else:
            return


def timed_start(data: Path, port: int, log: Path) -> tuple[subprocess.Popen[bytes], float]:
    started = time.perf_counter()
    proc = spawn(data, port, log)
    client_loop().run_until_complete(first_ack(f"127.0.0.1:{port}"))
    return proc, time.perf_counter() - started


async def fill(target: str, total_bytes: int, record_bytes: int) -> int:
    """Push records until total_bytes are acked; return the records acked."""
    value = b"r" * record_bytes
    async with Producer(target, STREAM, batch_size=2048, max_buffered=200_000) as producer:
        batch = [value] * 2048
        while producer.acked * record_bytes < total_bytes:
            await producer.send_many(batch)
        return producer.acked


async def keep_sending(target: str, record_bytes: int) -> None:
    """Ingest until the server dies under us (so the kill lands mid-write)."""
    value = b"t" * record_bytes
    producer = Producer(target, STREAM, batch_size=2048, reconnect_timeout=0)
    await producer.start()
    try:
        while True:
            await producer.send_many([value] * 2048)
    except SluiceError:
        pass  # the server died: that was the point
    finally:
        await producer.abort()


def log_bytes(data: Path) -> int:
    return sum(f.stat().st_size for f in data.rglob("*.wal"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--record-bytes", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sluice-recovery-") as tmp:
        data, log = Path(tmp) / "data", Path(tmp) / "serve.log"
        port = free_port()
        target = f"127.0.0.1:{port}"

        proc, baseline = timed_start(data, port, log)
        print(f"start on an empty log:        {baseline:6.2f} s (baseline)", flush=True)
        started = time.perf_counter()
        acked = client_loop().run_until_complete(fill(target, int(args.gigabytes * 1e9), args.record_bytes))
        took = time.perf_counter() - started
        print(
            f"filled: {acked:,} records of {args.record_bytes} B acked in {took:.1f} s; "
            f"log {log_bytes(data) / 1e9:.2f} GB",
            flush=True,
        )

        async def kill_mid_ingest() -> None:
            sender = asyncio.create_task(keep_sending(target, args.record_bytes))
            await asyncio.sleep(1.0)
            os.killpg(proc.pid, signal.SIGKILL)
            await sender

        client_loop().run_until_complete(kill_mid_ingest())
        proc.wait()
        size = log_bytes(data)
        restarted, recovery = timed_start(data, port, log)
        print(
            f"restart after kill -9:        {recovery:6.2f} s with {size / 1e9:.2f} GB in the log "
            f"({recovery / baseline:.1f}x the baseline, {size / 1e6 / max(recovery - baseline, 1e-3):,.0f} "
            "MB/s of log scanned beyond it)",
            flush=True,
        )
        restarted.send_signal(signal.SIGTERM)
        restarted.wait(60)
        reported = re.findall(r".*(?:truncat|recover).*", log.read_text(errors="replace"), re.I)
        for line in reported[-5:]:
            print(f"  log: {line.strip()}")


if __name__ == "__main__":
    main()
