"""What several benchmarks share: a real `sluice serve` process, the rows a file sink has committed, and one
event loop for a benchmark's gRPC clients."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pyarrow.parquet as pq

SLUICE = [sys.executable, "-m", "ingest.cli"]


# every run's grpc.aio client on one event loop: a loop closed by asyncio.run after a run could still be
# called by grpc.aio's completion queue for that run's channel ("Event loop is closed" printed at teardown)
@functools.cache
def client_loop() -> asyncio.AbstractEventLoop:
    return asyncio.new_event_loop()


def start_serve(data: Path, extra: list[str], timeout: float = 180) -> tuple[subprocess.Popen[str], str]:
    """`sluice serve` on `data` (a free port, no metrics), started in its own process group and waited
    for until it says its Spark query runs (with --no-spark: that it serves); (the process, its target).
    Its stderr is drained after."""
    spark = "--no-spark" not in extra
    serve = subprocess.Popen(
        [*SLUICE, "serve", "--data-dir", str(data), "--port", "0", "--metrics-port", "-1", *extra],
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert serve.stderr is not None
    target = None
    started = time.monotonic()
    for line in serve.stderr:
        found = re.search(r"serving streams .* on (\S+?)[;,]", line)
        if found:
            target = found.group(1)
            if not spark:
                break
        if "Spark query running" in line or "query-started" in line:
            break
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"sluice serve did not start in {timeout:g} s")
    if target is None:
        raise RuntimeError("sluice serve said no serving line")
    # keep reading its stderr, or a full pipe would stall it
    threading.Thread(target=serve.stderr.read, daemon=True).start()
    return serve, target


def committed_files(sink: Path) -> set[str]:
    """The files the sink's _spark_metadata log has committed (added and not removed)."""
    log = sink / "_spark_metadata"
    if not log.is_dir():
        return set()
    files: set[str] = set()
    entries = [p for p in log.iterdir() if p.name[0].isdigit() and not p.name.endswith(".tmp")]
    for entry in sorted(entries, key=lambda p: int(p.name.split(".")[0])):
        try:
            lines = entry.read_text().splitlines()[1:]
        except FileNotFoundError:  # deleted by compaction meanwhile: the compact file has it
            continue
        for line in lines:
            record = json.loads(line)
            path = urllib.parse.urlparse(record["path"]).path
            if record["action"] == "add":
                files.add(path)
            else:
                files.discard(path)
    return files


def committed_rows(sink: Path, seen: dict[str, int]) -> int:
    """Rows in the files the sink has committed (each file's footer read once, kept in `seen`)."""
    total = 0
    for path in committed_files(sink):
        if path not in seen:
            seen[path] = pq.read_metadata(path).num_rows
        total += seen[path]
    return total
