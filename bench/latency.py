"""Latency from `send` to visible in the Parquet sink, at 25%, 50% and 90% of the measured capacity.

Run: python bench/latency.py [--seconds 30] [--settle 5] [--levels 0.25,0.5,0.9] [--quick]

A real `sluice serve` process with every default (the user's configuration: the model estimator, a 1 s
trigger, 0.2 s blocks, the built-in Parquet pipeline) on a fresh data dir. First its capacity, in the
same run: after a warm-up push of half as many (the JVM compiles the write path in the first batches), a
publisher process pushes --capacity-records as fast as credit allows, timed from the first send to the
last record committed in the sink. Then, per load level, a publisher process sends at that
share of the capacity for --seconds, in ticks of 10 ms, with the SDK's default Producer; each record's
value starts with its send time (time.time() just before send_many, as a double), padded to
--record-bytes.

Visible in the sink: a record is visible once the file sink has committed the batch that wrote it, that
is once `_spark_metadata/<batch>` (or `<batch>.compact`) is in place: Spark's readers of the sink list
its files from that log only. Its modification time is the commit time. The batch of a record comes from
the query's offset log (`offsets/<batch>`: where each batch ended); both logs are copied while the run
goes (Spark deletes old entries). After the run the sink's files are read back (offset and value of every
record) and each record's latency is the commit time of its batch minus its send time. The first
--settle seconds of each level are left out (the rate control follows the new load). Prints p50 and p99
per level, in seconds and in trigger intervals. The goal (issue 17): p99 at most 2 intervals at 50%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
from sluice_process import start_serve

STREAM = "default"
QUERY = "sluice"
GOAL_INTERVALS = 2.0
STAMP = struct.Struct("<d")


# ---- the publisher (a subprocess) ---------------------------------------------------------------


def publish(target: str, rate: float, seconds: float, records: int, record_bytes: int) -> None:
    """Send at `rate` records/s for `seconds` (or, rate 0: `records` as fast as credit allows), each
    value stamped with its send time; print 'sent N first last' when everything is acked."""
    from sluice_client import Producer  # noqa: PLC0415 - the subprocess imports only what it needs

    pad = b"x" * max(0, record_bytes - STAMP.size)

    async def main() -> None:
        async with Producer(target, STREAM) as producer:
            sent = 0
            start = time.time()
            if rate <= 0:
                while sent < records:
                    n = min(4096, records - sent)
                    await producer.send_many([STAMP.pack(time.time()) + pad] * n)
                    sent += n
            else:
                tick = 0.01
                while (now := time.time()) < start + seconds:
                    due = int(rate * (now - start)) - sent
                    if due > 0:
                        await producer.send_many([STAMP.pack(time.time()) + pad] * due)
                        sent += due
                    await asyncio.sleep(max(0.0, tick - (time.time() - now)))
            last = time.time()
            await producer.flush(timeout=600)
        print(f"sent {sent} {start} {last}", flush=True)

    asyncio.run(main())


def run_publisher(target: str, rate: float, seconds: float, records: int, record_bytes: int) -> tuple:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--publish",
            target,
            str(rate),
            str(seconds),
            str(records),
            str(record_bytes),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=seconds + 900,
    )
    _, sent, first, last = out.stdout.split()
    return int(sent), float(first), float(last)


# ---- the logs, copied while the run goes --------------------------------------------------------


class LogWatcher(threading.Thread):
    """Copies the query's offset log (end offset per batch) and the sink's commit times (mtime of
    _spark_metadata/<batch>[.compact]) every 50 ms: Spark deletes old entries of both."""

    def __init__(self, data: Path) -> None:
        super().__init__(daemon=True)
        self.offsets_dir = data / "checkpoints" / QUERY / "offsets"
        self.metadata_dir = data / "sink" / "_spark_metadata"
        self.ends: dict[int, int] = {}
        self.committed: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.poll()
            self.stop.wait(0.05)

    def poll(self) -> None:
        for name in _names(self.offsets_dir):
            if name.isdigit() and int(name) not in self.ends:
                try:
                    lines = (self.offsets_dir / name).read_text().splitlines()
                    self.ends[int(name)] = int(json.loads(lines[2])[STREAM])
                except (OSError, IndexError, ValueError, KeyError):
                    continue  # being written, or not our source's line yet
        for name in _names(self.metadata_dir):
            batch = name.removesuffix(".compact")
            if batch.isdigit() and int(batch) not in self.committed:
                try:
                    self.committed[int(batch)] = (self.metadata_dir / name).stat().st_mtime
                except OSError:
                    continue

    def rows_committed(self, total_until: int) -> bool:
        """Whether every record below offset `total_until` is in a committed batch."""
        return any(end >= total_until and batch in self.committed for batch, end in self.ends.items())


def _names(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def wait_committed(watcher: LogWatcher, total: int, timeout: float = 600) -> float:
    deadline = time.monotonic() + timeout
    while not watcher.rows_committed(total):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sink did not commit {total} records in {timeout} s")
        time.sleep(0.05)
    return time.time()


# ---- the run ------------------------------------------------------------------------------------


def latencies(sink: Path, watcher: LogWatcher, lo: int, hi: int, after: float) -> np.ndarray:
    """Send-to-commit seconds of the records with offsets [lo, hi) sent at or after `after`."""
    batches = sorted(watcher.ends)
    ends = np.array([watcher.ends[b] for b in batches])
    commit = np.array([watcher.committed.get(b, np.nan) for b in batches])
    files = [str(p) for p in sink.glob("*.parquet")]
    table = ds.dataset(files, format="parquet").to_table(
        columns=["offset", "value"], filter=(ds.field("offset") >= lo) & (ds.field("offset") < hi)
    )
    offsets = table.column("offset").to_numpy()
    sent = np.array([STAMP.unpack_from(v)[0] for v in table.column("value").to_pylist()])
    # the batch of offset o: the first whose end is above o
    visible = commit[np.searchsorted(ends, offsets, side="right")]
    keep = sent >= after
    return (visible - sent)[keep]


def main_run(args: argparse.Namespace) -> None:
    levels = [float(x) for x in args.levels.split(",")]
    with tempfile.TemporaryDirectory(prefix="sluice-latency-") as tmp:
        data = Path(tmp) / "data"
        serve, target = start_serve(data, args.serve_args)
        watcher = LogWatcher(data)
        watcher.start()
        try:
            # warm-up: the first batches with records pay for the JVM compiling the write path
            total, _, _ = run_publisher(target, 0, 0, args.capacity_records // 2, args.record_bytes)
            wait_committed(watcher, total)
            time.sleep(2)
            # the same run's capacity: an unthrottled push into the sink
            n, first, _ = run_publisher(target, 0, 0, args.capacity_records, args.record_bytes)
            total += n
            done = wait_committed(watcher, total)
            capacity = n / (done - first)
            if args.verbose:  # the capacity push, batch by batch
                prev = 0
                for b in sorted(watcher.ends):
                    if watcher.ends[b] <= total - n:
                        prev = watcher.ends[b]
                        continue
                    at = watcher.committed.get(b, float("nan")) - first
                    print(f"  batch {b}: {watcher.ends[b] - prev:>9,} records, committed at {at:6.2f} s")
                    prev = watcher.ends[b]
            print(
                f"capacity: {args.capacity_records:,} records in {done - first:.2f} s, {capacity:,.0f} rec/s"
            )
            time.sleep(2)
            results = []
            for level in levels:
                rate = level * capacity
                n, first, last = run_publisher(target, rate, args.seconds, 0, args.record_bytes)
                lo, total = total, total + n
                wait_committed(watcher, total)
                time.sleep(0.5)
                watcher.poll()
                lat = latencies(data / "sink", watcher, lo, total, first + args.settle)
                results.append((level, rate, n / (last - first), lat))
                print(
                    f"{level:4.0%} of capacity ({rate:,.0f} rec/s asked, {n / (last - first):,.0f} sent): "
                    f"p50 {np.percentile(lat, 50):.3f} s, p99 {np.percentile(lat, 99):.3f} s, "
                    f"max {lat.max():.3f} s over {len(lat):,} records",
                    flush=True,
                )
                time.sleep(2)
        finally:
            watcher.stop.set()
            os.killpg(serve.pid, signal.SIGTERM)
            serve.wait(timeout=180)
    interval = args.trigger_interval
    print(f"\ntrigger interval {interval:g} s; capacity {capacity:,.0f} rec/s (same run)")
    print(f"{'load':>6} {'rec/s':>10} {'p50 s':>8} {'p99 s':>8} {'p50 iv':>7} {'p99 iv':>7}")
    figures = []
    for level, rate, _sent, lat in results:
        p50, p99 = np.percentile(lat, 50), np.percentile(lat, 99)
        print(
            f"{level:6.0%} {rate:>10,.0f} {p50:8.3f} {p99:8.3f} {p50 / interval:7.2f} {p99 / interval:7.2f}"
        )
        for name, value in (("p50", p50), ("p99", p99)):
            goal = level == 0.5 and name == "p99"
            figures.append(
                {
                    "what": f"{name} send to sink at {level:.0%} of capacity",
                    "value": round(float(value / interval), 3),
                    "unit": "trigger intervals",
                    "baseline": f"trigger interval ({interval:g} s)",
                    "baseline_value": interval,
                    "ratio": round(float(value / interval), 3),
                    "goal": f"<= {GOAL_INTERVALS:g} intervals" if goal else "",
                    "met": bool(value / interval <= GOAL_INTERVALS) if goal else None,
                }
            )
    print("RESULT " + json.dumps({"bench": "latency", "figures": figures}))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--publish":
        target, rate, seconds, records, record_bytes = sys.argv[2:7]
        publish(target, float(rate), float(seconds), int(records), int(record_bytes))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds of sending per level")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds left out at each level's start")
    parser.add_argument("--levels", default="0.25,0.5,0.9", help="shares of the capacity")
    parser.add_argument("--capacity-records", type=int, default=2_000_000)
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--trigger-interval", type=float, default=1.0, help="sluice serve's (its default)")
    parser.add_argument("--verbose", action="store_true", help="print the capacity push's batches")
    parser.add_argument("--quick", action="store_true", help="10 s per level, 3 s settling, 1M for capacity")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.settle, args.capacity_records = 10.0, 3.0, 1_000_000
    args.serve_args = ["--trigger-interval", str(args.trigger_interval)]
    main_run(args)


if __name__ == "__main__":
    main()
