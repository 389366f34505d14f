"""A user's first push: a fresh `sluice serve` with every default, then `sluice push` of a 1M-line file,
timed from the first send to the last record in the Parquet sink; against the same from a fresh start
with an unthrottled rate (`--estimator fixed --initial-rate inf`), measured in the same run.

Run: python bench/first_push.py [--records 1000000] [--rounds 1]

Each run is a real `sluice serve` process on a fresh data dir (the README's command), started and waited
for until it says its Spark query runs; then a real `sluice push` process. The sink is counted from the
file sink's committed files (their Parquet footers), every 0.2 s. The goal (issue 17): defaults reach at
least 80% of the unthrottled end-to-end rate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from sluice_process import SLUICE, committed_rows, start_serve


def run_once(records_file: Path, records: int, extra: list[str], label: str) -> float:
    with tempfile.TemporaryDirectory(prefix="sluice-first-") as tmp:
        data = Path(tmp) / "data"
        started = time.monotonic()
        serve, target = start_serve(data, extra)
        ready = time.monotonic() - started
        push = subprocess.Popen(
            [*SLUICE, "push", "--target", target, "--no-progress", str(records_file)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        first_send = time.monotonic()
        seen: dict[str, int] = {}
        acked_at = None
        while True:
            if acked_at is None and push.poll() is not None:
                acked_at = time.monotonic() - first_send
                if push.returncode != 0:
                    raise RuntimeError(f"sluice push failed: {push.stderr.read() if push.stderr else ''}")
            if committed_rows(data / "sink", seen) >= records:
                break
            if time.monotonic() - first_send > 600:
                raise RuntimeError("the sink did not get every record in 600 s")
            time.sleep(0.2)
        in_sink = time.monotonic() - first_send
        os.killpg(serve.pid, signal.SIGTERM)
        serve.wait(timeout=180)
    print(
        f"{label:<12} ready after {ready:5.1f} s; all acked {acked_at or in_sink:5.1f} s, all in the sink "
        f"{in_sink:5.1f} s after the first send: {records / in_sink:,.0f} records/s",
        flush=True,
    )
    return in_sink


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="200k records, for a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.records = 200_000
    with tempfile.TemporaryDirectory() as tmp:
        records_file = Path(tmp) / "records.txt"
        records_file.write_text("".join(f"record {i}\n" for i in range(args.records)))
        ratios = []
        for _ in range(args.rounds):
            unthrottled = run_once(
                records_file, args.records, ["--estimator", "fixed", "--initial-rate", "inf"], "unthrottled"
            )
            defaults = run_once(records_file, args.records, [], "defaults")
            ratios.append(unthrottled / defaults)
            print(f"defaults reach {ratios[-1]:.2f}x of the unthrottled end-to-end rate (goal: >= 0.80)")
            rates = {"defaults": args.records / defaults, "unthrottled": args.records / unthrottled}
        ratio = min(ratios)
        figure = {
            "what": f"first push of {args.records:,} records into Parquet from a fresh `sluice serve`",
            "value": round(rates["defaults"]),
            "unit": "rec/s",
            "baseline": "the same with an unthrottled rate (fixed estimator, rate inf), fresh start",
            "baseline_value": round(rates["unthrottled"]),
            "ratio": round(ratio, 3),
            "goal": ">= 0.8",
            "met": ratio >= 0.8,
        }
        print("RESULT " + json.dumps({"bench": "first_push", "figures": [figure]}))


if __name__ == "__main__":
    main()
