"""Time to an ack when records come in lulls: block_linger against waiting for the block interval.

Run: python bench/ack_latency.py [--records 50] [--push-records 1000] [--trickle-seconds 5]

Two `sluice serve --no-spark` processes on fresh data dirs, one with every default (block_linger 10 ms)
and one with `--block-linger off` (the baseline: a record waits for the block interval, 0.2 s), each
measured in turn in the same run:
  send + flush      one record sent, then flush() until it is acked, --records times (p50, p99)
  push              a Producer opened, --push-records sent with send_many, flushed and closed: what
                    `sluice push` of a small file waits for, without the process start
  trickle           --producers SyncProducers each sending one record at a time, each waiting for its ack,
                    for --trickle-seconds: records acked per second and blocks sealed per second (the
                    cost side: a lull seals a block of its own)
Ratios are the default's figure against the baseline's in the same run (lower is better for times).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from sluice_process import start_serve  # this folder: run as python bench/ack_latency.py

from receivers.config import FsyncPolicy
from receivers.wal import WalBlockStore
from sluice_client import SyncProducer


def send_flush(target: str, records: int) -> np.ndarray:
    times = []
    with SyncProducer(target, "default") as producer:
        producer.send(b"warm-up")
        producer.flush(timeout=30)
        for i in range(records):
            started = time.perf_counter()
            producer.send(b"record %d" % i)
            producer.flush(timeout=30)
            times.append(time.perf_counter() - started)
    return np.array(times)


def push(target: str, records: int, repeat: int) -> float:
    """The median seconds of `repeat` pushes of `records` 100 B records."""
    values = [b"v" * 100] * records
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        with SyncProducer(target, "default") as producer:
            producer.send_many(values)
            producer.flush(timeout=30)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def trickle(target: str, producers: int, seconds: float) -> int:
    """Records acked by `producers` threads each sending one record and waiting for its ack."""
    acked = [0] * producers
    stop = time.monotonic() + seconds

    def one(i: int) -> None:
        with SyncProducer(target, "default") as producer:
            while time.monotonic() < stop:
                producer.send(b"t")
                producer.flush(timeout=30)
                acked[i] += 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(acked)


def measure(args: argparse.Namespace, extra: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="sluice-ack-") as tmp:
        data = Path(tmp)
        serve, target = start_serve(data, ["--no-spark", *extra])
        try:
            flushes = send_flush(target, args.records)
            pushed = push(target, args.push_records, 5)
            store = WalBlockStore(data / "blocks", fsync=FsyncPolicy.off())
            before = len(store.blocks("default"))
            acked = trickle(target, args.producers, args.trickle_seconds)
            blocks = len(WalBlockStore(data / "blocks", fsync=FsyncPolicy.off()).blocks("default")) - before
        finally:
            serve.terminate()
            serve.wait(timeout=60)
    return {
        "p50": float(np.percentile(flushes, 50)),
        "p99": float(np.percentile(flushes, 99)),
        "push": pushed,
        "trickle_rate": acked / args.trickle_seconds,
        "trickle_blocks": blocks / args.trickle_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=50, help="send + flush of one record, this many times")
    parser.add_argument("--push-records", type=int, default=1000)
    parser.add_argument("--producers", type=int, default=8, help="SyncProducers in the trickle")
    parser.add_argument("--trickle-seconds", type=float, default=5.0)
    parser.add_argument("--quick", action="store_true", help="20 records, a 2 s trickle")
    args = parser.parse_args()
    if args.quick:
        args.records, args.trickle_seconds = 20, 2.0
    base = measure(args, ["--block-linger", "off"])
    linger = measure(args, [])
    print(f"{'':34s}{'block-linger off (baseline)':>28s}{'default (10 ms)':>18s}{'ratio':>8s}")
    rows = [
        ("send + flush of one record, p50", "p50", 1e3, "ms"),
        ("send + flush of one record, p99", "p99", 1e3, "ms"),
        (f"push of {args.push_records:,} records (median of 5)", "push", 1e3, "ms"),
        (f"trickle of {args.producers} sync producers", "trickle_rate", 1, "rec/s"),
        ("  blocks sealed meanwhile", "trickle_blocks", 1, "/s"),
    ]
    for what, key, scale, unit in rows:
        ratio = linger[key] / base[key] if base[key] else float("nan")
        old, new = base[key] * scale, linger[key] * scale
        print(f"{what:34s}{old:>22,.1f} {unit:5s}{new:>12,.1f} {unit:5s}{ratio:>8.3f}")
    figures = [
        {
            "what": "send + flush of one record, p50 (block_linger 10 ms)",
            "value": round(linger["p50"] * 1e3, 2),
            "unit": "ms",
            "baseline": "the same with --block-linger off (records wait for the block interval)",
            "baseline_value": round(base["p50"] * 1e3, 2),
            "ratio": round(linger["p50"] / base["p50"], 3),
            "goal": None,
            "met": None,
        }
    ]
    print("RESULT " + json.dumps({"bench": "ack_latency", "figures": figures}))


if __name__ == "__main__":
    main()
