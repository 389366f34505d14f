"""Every performance figure of issue 17 in one run: each benchmark against its own same-run baseline.

Run: python bench/all.py [--quick] [--only NAME ...] [--json results.json] [--markdown table.md]

Runs the benchmarks one after another (each in its own process, so one's Spark session or memory does
not colour the next), shows their output as it comes, collects the `RESULT {json}` line each prints last,
and ends with one table: figure, value, its baseline measured in the same run, the ratio and the goal.
Ratios are what compare across runs and machines; the absolute numbers drift with the machine's load.
The table names the machine it ran on. `--quick` runs each benchmark's short form (a smoke test: the
figures are noisier and some goals, such as memory over 10 minutes, are not judged by it).

The full run takes about an hour on a 2-core machine, most of it the 10-minute memory runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    name: str
    item: str
    args: tuple[str, ...]
    timeout: float
    """Seconds for the full run; --quick allows a quarter of it."""


BENCHES = (
    Bench("ingest_throughput", "1. durable ingest", ("ingest_throughput.py",), 900),
    Bench("first_push", "2. full speed from the first second", ("first_push.py",), 900),
    Bench("end_to_end", "3. end to end into Parquet", ("end_to_end.py",), 1200),
    Bench("latency", "4. latency send -> sink", ("latency.py",), 1800),
    Bench("ack_latency", "4. ack after a lull", ("ack_latency.py",), 300),
    Bench("overload_memory", "5. memory at 10x overload", ("overload_memory.py",), 3600),
    Bench("control_loop", "6. control under cost jumps", ("control_loop.py", "--profile", "jumps"), 2400),
)


def machine() -> str:
    """CPU model, cores, memory, OS and Python: what the figures ran on."""
    model = platform.processor() or platform.machine()
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory = ""
    with open("/proc/meminfo", encoding="utf-8") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                memory = f", {int(line.split()[1]) / 2**20:.0f} GiB"
                break
    return (
        f"{model}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def run(bench: Bench, quick: bool) -> dict[str, Any] | None:
    """Run one benchmark, echoing its output; its RESULT, or None if it printed none."""
    command = [sys.executable, str(BENCH / bench.args[0]), *bench.args[1:], *(["--quick"] if quick else [])]
    print(f"\n=== {bench.item}: {' '.join(command[1:])}", flush=True)
    result = None
    started = time.monotonic()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH.parent), os.environ.get("PYTHONPATH")])),
    }
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=BENCH.parent, env=env
    ) as process:
        assert process.stdout is not None
        try:
            for line in process.stdout:
                if line.startswith("RESULT "):
                    result = json.loads(line.removeprefix("RESULT "))
                else:
                    print(line, end="", flush=True)
                if time.monotonic() - started > (bench.timeout / 4 if quick else bench.timeout):
                    process.kill()
                    print(f"--- {bench.name}: killed after its time limit", flush=True)
                    return None
        finally:
            process.wait()
        if process.returncode != 0:
            print(f"--- {bench.name}: exit code {process.returncode}", flush=True)
    print(f"--- {bench.name}: {time.monotonic() - started:.0f} s", flush=True)
    return result


def number(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not value.is_integer():
        text = f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    else:
        text = f"{value:,.0f}"
    return f"{text} {unit}".strip()


def table(results: dict[str, dict[str, Any] | None]) -> str:
    lines = [
        "| item | figure | value | baseline (same run) | ratio | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for bench in BENCHES:
        if bench.name not in results:
            continue
        result = results[bench.name]
        if result is None:
            lines.append(f"| {bench.item} | no result (see its output) | | | | | no |")
            continue
        for figure in result["figures"]:
            unit = figure.get("unit", "")
            baseline = figure.get("baseline") or "-"
            if figure.get("baseline_value") is not None:
                baseline = f"{baseline}: {number(figure['baseline_value'], unit)}"
            met = {True: "yes", False: "no", None: "-"}[figure.get("met")]
            ratio = figure.get("ratio")
            lines.append(
                f"| {bench.item} | {figure['what']} | {number(figure['value'], unit)} | {baseline} | "
                f"{'-' if ratio is None else f'{ratio:.2f}'} | {figure.get('goal') or '-'} | {met} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="each benchmark's short form (a smoke test)")
    parser.add_argument("--only", action="append", choices=[b.name for b in BENCHES], help="run only these")
    parser.add_argument("--json", type=Path, help="write the results (and the machine) here as JSON")
    parser.add_argument("--markdown", type=Path, help="write the table (and the machine) here")
    args = parser.parse_args()
    chosen = [b for b in BENCHES if not args.only or b.name in args.only]
    results = {bench.name: run(bench, args.quick) for bench in chosen}
    host = machine()
    text = table(results)
    stamp = time.strftime("%Y-%m-%d")
    print(f"\n{'Quick run' if args.quick else 'Run'} of {stamp} on {host}\n\n{text}")
    if args.json:
        args.json.write_text(
            json.dumps({"date": stamp, "machine": host, "quick": args.quick, "results": results})
        )
    if args.markdown:
        args.markdown.write_text(f"Run of {stamp} on {host}{' (--quick)' if args.quick else ''}:\n\n{text}\n")
    return 0 if all(result is not None for result in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
