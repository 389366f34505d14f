"""Memory at 10x overload (issue 17, item 5): RSS of `sluice serve` (its Python process and Spark's JVM)
under 10x overload from 50 publishers, against Spark's socket source under the same overload, in one run.

Run: python bench/overload_memory.py [--duration 600] [--warmup 60] [--quick]

Sluice: a real `sluice serve` process with every default (data in a temp dir), but a pipeline with a
per-record cost (`--cost-us`, a busy-wait in a mapInArrow stage before the default Parquet sink:
bench.overload_memory:costly), so that 10x overload is reachable on a 2-core machine.

1. Capacity, measured in the same run: 4 publishers sending as fast as credit allows for `--calibrate`
   seconds; capacity = records/s into the sink over the last two thirds of that.
2. Overload: 50 publishers (Producers, spread over `--procs` subprocesses) offer `--overload` (10) x
   capacity in all, for `--duration` seconds: each one's source produces its share at that rate and
   hands it to its Producer as fast as credit allows (sends block on credit, so a publisher is always
   behind and always sending). Offered and acked counts are reported.
3. The end: the publishers stop (what they sent and was not acked is dropped), the sink catches up, and
   the server's acked count (sluice_records_acked_total) must all be in the sink.

Every second the RSS of the `sluice serve` process, of Spark's JVM (its child) and of the Python
workers (the JVM's children) is read from /proc, and the JVM's used heap with `jstat` (if on PATH).
Warm-up: the first `--warmup` seconds of the overload. After it: min, max and mean RSS, the spread
(max - min) / mean (goal <= 0.10), and the slope of a line fitted to RSS over time.

The baseline: Spark's Structured Streaming socket source (`spark.readStream.format("socket")`) with the
same cost stage and Parquet sink, in its own driver process with spark.driver.memory `--socket-heap`
(4g, as in the issue), fed by a TCP server in this process writing 100-byte lines at the same offered
rate (10x Sluice's capacity) as fast as the socket takes them. Why this source: it has no admission
control at all. A reader thread appends every line it reads to an in-memory list on the driver heap,
and each micro-batch takes all of them; only committed batches are dropped from the list. Offered at
10x what the pipeline processes, the list grows by ~9/10 of the offered rate until the heap is full.
(The DStream receiver, socketTextStream, is the other candidate: with backpressure off its blocks
also pile up on the heap, but its default storage level spills to disk (MEMORY_AND_DISK_SER_2) and with
backpressure on it is rate limited, see bench/control_loop.py; the structured source is the one a
Structured Streaming user would compare with.) It runs until its heap is 90% full, its JVM dies, or
`--duration` passes; its RSS growth is fitted the same way.

Prints one RESULT line (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from line_server import LineServer

ROOT = Path(__file__).resolve().parent.parent
SLUICE = [sys.executable, "-m", "ingest.cli"]
COST_ENV = "OVERLOAD_BENCH_COST_US"
PAGE_MB = 1 / 1024  # /proc/PID/status reports kB


# ---- the pipeline (imported by `sluice serve --pipeline bench.overload_memory:costly`) ---------------


def cost_stage(cost_us: float) -> Callable[[Iterator[Any]], Iterator[Any]]:
    """mapInArrow function: per Arrow batch, busy-wait cost_us per row, then pass the batch on."""
    seconds = cost_us / 1e6

    def fn(batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            end = time.perf_counter() + batch.num_rows * seconds
            while time.perf_counter() < end:
                pass
            yield batch

    return fn


def costly(df: Any, context: Any) -> Any:
    """The default Parquet sink (every column, appended under the service's sink folder) behind a
    per-record busy-wait of $OVERLOAD_BENCH_COST_US microseconds."""
    stage = cost_stage(float(os.environ.get(COST_ENV, "30")))
    return (
        df.mapInArrow(stage, df.schema)
        .writeStream.format("parquet")
        .outputMode("append")
        .option("path", str(context.sink_dir))
    )


# ---- /proc ---------------------------------------------------------------------------------------


def _status(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile of a process in kB (empty if it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _descendants(pid: int, tree: dict[int, list[int]]) -> list[int]:
    out, todo = [], list(tree.get(pid, []))
    while todo:
        child = todo.pop()
        out.append(child)
        todo += tree.get(child, [])
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def find_jvm(pid: int) -> int | None:
    """The java process among pid's descendants (Spark's JVM, started by PySpark's launcher)."""
    for child in sorted(_descendants(pid, _children())):
        args = _cmdline(child)
        if args and os.path.basename(args[0]) == "java":
            return child
    return None


def max_heap_mb(jvm: int) -> float | None:
    for arg in _cmdline(jvm):
        found = re.fullmatch(r"-Xmx(\d+)([kKmMgG]?)", arg)
        if found:
            scale = {"": 1 / 2**20, "k": 1 / 1024, "m": 1, "g": 1024}[found.group(2).lower()]
            return int(found.group(1)) * scale
    return None


class Jstat:
    """`jstat -gc PID 1000` in the background: the JVM's used heap (MB), read from its perf data, so
    it answers even while the JVM is busy collecting garbage."""

    def __init__(self, pid: int) -> None:
        self.used_mb: float | None = None
        self.old_mb: float | None = None
        self.proc: subprocess.Popen[str] | None = None
        jstat = shutil.which("jstat")
        if jstat is None:
            return
        self.proc = subprocess.Popen(
            [jstat, "-gc", str(pid), "1000"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        header: list[str] = []
        for line in self.proc.stdout:
            cells = line.split()
            if not cells:
                continue
            if cells[0] == "S0C":
                header = cells
                continue
            if not header or len(cells) != len(header):
                continue
            try:
                row = dict(zip(header, map(float, cells), strict=True))
            except ValueError:
                continue
            self.used_mb = (row["S0U"] + row["S1U"] + row["EU"] + row["OU"]) / 1024
            self.old_mb = row["OU"] / 1024

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)


@dataclass
class Sample:
    t: float
    python_mb: float
    jvm_mb: float
    workers_mb: float
    python_anon_mb: float
    jvm_anon_mb: float
    heap_mb: float | None
    sink_rows: int | None = None

    @property
    def total_mb(self) -> float:
        return self.python_mb + self.jvm_mb


class Sampler:
    """Samples a Python driver process, its JVM child and the JVM's Python workers every `interval`."""

    def __init__(self, python_pid: int, interval: float = 1.0) -> None:
        self.python_pid = python_pid
        self.interval = interval
        self.jvm_pid = find_jvm(python_pid)
        self.jstat = Jstat(self.jvm_pid) if self.jvm_pid is not None else None
        self.samples: list[Sample] = []
        self.extra: Callable[[], int | None] | None = None
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def start(self, t0: float) -> Sampler:
        self.t0 = t0
        self._thread.start()
        return self

    def sample(self) -> Sample:
        py = _status(self.python_pid)
        jvm = _status(self.jvm_pid) if self.jvm_pid is not None else {}
        workers = 0
        if self.jvm_pid is not None:
            workers = sum(_status(p).get("VmRSS", 0) for p in _descendants(self.jvm_pid, _children()))
        return Sample(
            t=time.monotonic() - self.t0,
            python_mb=py.get("VmRSS", 0) * PAGE_MB,
            jvm_mb=jvm.get("VmRSS", 0) * PAGE_MB,
            workers_mb=workers * PAGE_MB,
            python_anon_mb=py.get("RssAnon", 0) * PAGE_MB,
            jvm_anon_mb=jvm.get("RssAnon", 0) * PAGE_MB,
            heap_mb=self.jstat.used_mb if self.jstat is not None else None,
        )

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            s = self.sample()
            if self.extra is not None:
                with contextlib.suppress(Exception):
                    s.sink_rows = self.extra()
            self.samples.append(s)
            next_at += self.interval
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if self.jstat is not None:
            self.jstat.stop()


# ---- the sink --------------------------------------------------------------------------------------


class SinkCounter:
    """Rows in the files a Parquet file sink's _spark_metadata log has committed (footers read once)."""

    def __init__(self, sink: Path) -> None:
        self.sink = sink
        self._rows: dict[str, int] = {}
        self._lock = threading.Lock()

    def __call__(self) -> int:
        from sluice_process import committed_rows  # noqa: PLC0415 - the publishers' processes do not need it

        with self._lock:
            return committed_rows(self.sink, self._rows)


# ---- publishers ------------------------------------------------------------------------------------


def publisher_process(
    target: str,
    producers: int,
    rate_each: float,
    record_bytes: int,
    stop: Any,
    results: Any,
    max_buffered: int,
) -> None:
    """`producers` Producers in one process; each one's source makes records at rate_each/s (inf: as
    fast as it can) and hands them to its Producer, which sends them as fast as credit allows."""
    import asyncio  # noqa: PLC0415

    from sluice_client import Producer  # noqa: PLC0415

    async def one(values: list[bytes], t0: float) -> tuple[int, int, int]:
        producer = Producer(target, "default", max_buffered=max_buffered, start_timeout=120)
        await producer.start()
        queued = 0
        try:
            while not stop.is_set():
                if rate_each == float("inf"):
                    due = queued + len(values)
                else:
                    due = int(rate_each * (time.monotonic() - t0))
                n = min(len(values), due - queued)
                if n <= 0:
                    await asyncio.sleep(0.01)
                    continue
                try:  # blocks while the producer's buffer is full: sends wait for credit
                    await asyncio.wait_for(producer.send_many(values[:n]), 0.5)
                    queued += n
                except TimeoutError:
                    pass  # see whether to stop; send_many may have queued part of it
        finally:
            acked, sent = producer.acked, producer.ever_sent
            await producer.abort()
        offered = queued if rate_each == float("inf") else int(rate_each * (time.monotonic() - t0))
        return acked, sent, offered

    async def main() -> None:
        values = [b"v" * record_bytes] * 4096
        t0 = time.monotonic()
        done = await asyncio.gather(*(one(values, t0) for _ in range(producers)))
        results.put([list(d) for d in done])

    asyncio.run(main())


class Publishers:
    def __init__(
        self, target: str, total: int, procs: int, rate: float, record_bytes: int, max_buffered: int
    ) -> None:
        ctx = mp.get_context("spawn")
        self.stop_event = ctx.Event()
        self.results: Any = ctx.Queue()
        per = [total // procs + (1 if i < total % procs else 0) for i in range(procs)]
        self.procs = [
            ctx.Process(
                target=publisher_process,
                args=(target, n, rate / total, record_bytes, self.stop_event, self.results, max_buffered),
                daemon=True,
            )
            for n in per
            if n
        ]
        for p in self.procs:
            p.start()

    def stop(self) -> tuple[int, int, int]:
        """Stop them; (acked, sent, offered) summed over every producer."""
        self.stop_event.set()
        rows: list[list[int]] = []
        for _ in self.procs:
            with contextlib.suppress(Exception):
                rows += self.results.get(timeout=60)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        return tuple(sum(r[i] for r in rows) for i in range(3))  # type: ignore[return-value]


# ---- Sluice ----------------------------------------------------------------------------------------


def _metric(metrics_url: str, name: str) -> float | None:
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


def measure_capacity(status_url: str, batches: int, timeout: float) -> tuple[float, int]:
    """Records per second of batch time (sum of records / sum of batch durations) of the last `batches`
    batches, once at least that many completed after the first two (they carry the start) and the
    last one's scheduling delay is under 3 s (the backlog a start under saturation leaves is drained:
    the overload then starts from a steady state), or after `timeout` seconds. What the pipeline
    processes when it is busy all the time; and the number of batches it came from."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(status_url, timeout=10) as resp:
            data = json.loads(resp.read())["batches"]
        rows = zip(data["records"], data["batch_duration"], data["scheduling_delay"], strict=True)
        done = [(r, d, s) for r, d, s in rows if r and d][2:]
        steady = len(done) >= batches and done[-1][2] < 3.0
        if steady or (time.monotonic() > deadline and done):
            done = done[-batches:]
            return sum(r for r, _, _ in done) / sum(d for _, d, _ in done), len(done)
        if time.monotonic() > deadline + 300:
            raise RuntimeError(f"fewer than 3 batches with records in {timeout + 300:g} s")
        time.sleep(1)


@dataclass
class Run:
    name: str
    samples: list[Sample]
    start: float
    """Seconds into the samples when the overload began."""
    end: float
    processed_per_s: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)


TRACE_ENV = "OVERLOAD_BENCH_TRACEMALLOC"
SITECUSTOMIZE = f"""
import os
_path = os.environ.pop({TRACE_ENV!r}, None)  # popped: Spark's JVM and its workers do not inherit it
if _path:
    import gc, itertools, json, signal, tracemalloc
    tracemalloc.start(12)
    _n = itertools.count()
    def _dump(*_):
        i = next(_n)
        tracemalloc.take_snapshot().dump(f"{{_path}}.{{i}}")
        about = {{"traced": tracemalloc.get_traced_memory(), "objects": len(gc.get_objects())}}
        try:
            import pyarrow
            about["arrow_allocated"] = pyarrow.total_allocated_bytes()
        except ImportError:
            pass
        with open(f"{{_path}}.{{i}}.json", "w") as f:
            json.dump(about, f)
    signal.signal(signal.SIGUSR2, _dump)
"""


def start_serve(
    data: Path, cost_us: float, log_path: Path, trace: Path | None = None
) -> tuple[subprocess.Popen[bytes], str, int]:
    # the pipeline is this module (bench.overload_memory) and it imports its sibling line_server
    paths = [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ)
    if trace is not None:  # diagnosis: tracemalloc in the serve process, a snapshot per SIGUSR2
        site = trace.parent / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        paths.insert(0, str(site))
        env[TRACE_ENV] = str(trace)
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env[COST_ENV] = str(cost_us)
    log_file = open(log_path, "wb")  # noqa: SIM115 - the server writes it while it runs
    serve = subprocess.Popen(
        [
            *SLUICE,
            "serve",
            "--data-dir",
            str(data),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--pipeline",
            "bench.overload_memory:costly",
        ],
        stdout=log_file,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
        cwd=data.parent,
    )
    log_file.close()
    target, metrics_port, started = None, None, time.monotonic()
    while time.monotonic() - started < 240:
        text = log_path.read_text(errors="replace")
        found = re.search(r"serving streams .*? on (\S+?)[;,]", text)
        if found:
            target = found.group(1)
        port = re.search(r"metrics on \S*:(\d+)/metrics", text)
        if port:
            metrics_port = int(port.group(1))
        if "Spark query running" in text and target and metrics_port:
            return serve, target, metrics_port
        if serve.poll() is not None:
            break
        time.sleep(0.2)
    serve.kill()
    raise RuntimeError(f"sluice serve did not start:\n{log_path.read_text(errors='replace')[-3000:]}")


def run_sluice(args: argparse.Namespace, tmp: Path) -> Run:
    data = tmp / "sluice-data"
    log_path = tmp / "serve.log"
    print(f"sluice: starting `sluice serve` (pipeline cost {args.cost_us:g} us/record)...", flush=True)
    trace = tmp / "trace" / "snapshot" if args.tracemalloc else None
    if trace is not None:
        trace.parent.mkdir()
    serve, target, metrics_port = start_serve(data, args.cost_us, log_path, trace)
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    status_url = f"http://127.0.0.1:{metrics_port}/status.json"
    sink = SinkCounter(data / "sink")
    t0 = time.monotonic()
    sampler = Sampler(serve.pid, args.interval)
    sampler.extra = sink
    sampler.start(t0)
    run = Run("sluice", sampler.samples, 0.0, 0.0)
    try:
        # 1. capacity
        print(
            f"sluice: capacity: 4 publishers as fast as credit allows, until {args.calibrate_batches} "
            f"batches after the first two and the backlog drained (at most {args.calibrate:g} s)...",
            flush=True,
        )
        calib = Publishers(target, 4, 1, float("inf"), args.record_bytes, args.max_buffered)
        capacity, measured_over = measure_capacity(status_url, args.calibrate_batches, args.calibrate)
        calib.stop()
        offered = args.overload * capacity
        run.notes["capacity"] = capacity
        run.notes["offered_rate"] = offered
        print(
            f"sluice: capacity {capacity:,.0f} records/s (records per second of batch time, "
            f"{measured_over} batches, {time.monotonic() - t0:.0f} s after the start); offering "
            f"{args.overload:g}x = {offered:,.0f} records/s from {args.publishers} publishers in "
            f"{args.procs} processes for {args.duration:g} s",
            flush=True,
        )
        # 2. overload
        run.start = time.monotonic() - t0
        rows_at_start = sink()
        pubs = Publishers(target, args.publishers, args.procs, offered, args.record_bytes, args.max_buffered)
        deadline = time.monotonic() + args.duration
        next_report = time.monotonic() + 30
        snapshot_at = time.monotonic() + args.warmup if trace is not None else math.inf
        while time.monotonic() < deadline:
            if time.monotonic() >= snapshot_at:
                snapshot_at = math.inf
                serve.send_signal(signal.SIGUSR2)
            if serve.poll() is not None:
                raise RuntimeError(f"sluice serve died:\n{log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(1)
            if time.monotonic() >= next_report:
                next_report += 30
                s = sampler.samples[-1]
                print(
                    f"  {s.t - run.start:5.0f} s: serve {s.python_mb:6.0f} MB, JVM {s.jvm_mb:6.0f} MB "
                    f"(heap {s.heap_mb or 0:5.0f} MB), workers {s.workers_mb:5.0f} MB, sink {s.sink_rows:,}",
                    flush=True,
                )
        run.end = time.monotonic() - t0
        if trace is not None:
            serve.send_signal(signal.SIGUSR2)
        rows_at_end = sink()
        run.processed_per_s = (rows_at_end - rows_at_start) / (run.end - run.start)
        acked, sent, offered_n = pubs.stop()
        run.notes.update(client_acked=acked, client_sent=sent, offered=offered_n)
        # 3. nothing lost: every record the server acked reaches the sink
        server_acked = _metric(metrics_url, "sluice_records_acked_total") or 0
        waited = time.monotonic()
        while sink() < server_acked and time.monotonic() - waited < 180:
            time.sleep(1)
            server_acked = _metric(metrics_url, "sluice_records_acked_total") or 0
        run.notes.update(server_acked=int(server_acked), sink_rows=sink())
        if trace is not None:
            report_tracemalloc(trace)
    finally:
        sampler.stop()
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
    return run


def report_tracemalloc(trace: Path) -> None:
    """What grew in the serve process between the snapshot at the end of the warm-up and the last."""
    import tracemalloc  # noqa: PLC0415

    first, last = Path(f"{trace}.0"), Path(f"{trace}.1")
    for _ in range(120):
        if Path(f"{last}.json").exists():
            break
        time.sleep(1)
    else:
        print("tracemalloc: no snapshot at the end")
        return
    a, b = tracemalloc.Snapshot.load(str(first)), tracemalloc.Snapshot.load(str(last))
    about = [json.loads(Path(f"{p}.json").read_text()) for p in (first, last)]
    print(f"tracemalloc, serve process, from the end of the warm-up to the end: {about[0]} -> {about[1]}")
    for stat in b.compare_to(a, "lineno")[:25]:
        print(f"  {stat}")
    for stat in b.compare_to(a, "traceback")[:4]:
        print(f"  {stat}")
        for line in stat.traceback.format()[-16:]:
            print(f"    {line}")


# ---- Spark's socket source ---------------------------------------------------------------------------


def socket_child(args: argparse.Namespace) -> None:
    """The socket source's driver process: a Spark session with the given heap, the same cost stage and
    Parquet sink, a 1 s trigger; runs until killed."""
    import warnings  # noqa: PLC0415

    from ingest.spark.session import build_session  # noqa: PLC0415

    warnings.filterwarnings("ignore", category=FutureWarning)
    spark = build_session(
        "local[*]", app_name="socket-overload", conf={"spark.driver.memory": args.socket_heap}
    )
    out = Path(args.child_dir)
    df = spark.readStream.format("socket").option("host", "127.0.0.1").option("port", args.child_port).load()
    stage = cost_stage(args.cost_us)
    query = (
        df.mapInArrow(stage, df.schema)
        .writeStream.format("parquet")
        .outputMode("append")
        .option("path", str(out / "sink"))
        .option("checkpointLocation", str(out / "checkpoint"))
        .trigger(processingTime="1 second")
        .start()
    )
    print("QUERY STARTED", flush=True)
    query.awaitTermination()


def run_socket(args: argparse.Namespace, tmp: Path, offered: float, sluice_peak_mb: float) -> Run:
    lines = LineServer(args.record_bytes, offered)
    out = tmp / "socket"
    out.mkdir()
    log_path = tmp / "socket.log"
    print(
        f"socket: Spark's socket source, spark.driver.memory {args.socket_heap}, lines offered at "
        f"{offered:,.0f}/s...",
        flush=True,
    )
    with open(log_path, "wb") as log_file:
        child = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--socket-child",
                "--child-port",
                str(lines.port),
                "--child-dir",
                str(out),
                "--socket-heap",
                args.socket_heap,
                "--cost-us",
                str(args.cost_us),
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])),
            start_new_session=True,
        )
    sink = SinkCounter(out / "sink")
    t0 = time.monotonic()
    run = Run("socket", [], 0.0, 0.0)
    sampler: Sampler | None = None
    try:
        while lines.connected_at is None:
            if child.poll() is not None or time.monotonic() - t0 > 240:
                raise RuntimeError(f"the socket query did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.1)
        sampler = Sampler(child.pid, args.interval)
        sampler.extra = sink
        sampler.start(t0)
        run.samples = sampler.samples
        run.start = lines.connected_at - t0
        assert sampler.jvm_pid is not None, "no JVM under the socket driver"
        heap_max = max_heap_mb(sampler.jvm_pid)
        run.notes["heap_max_mb"] = heap_max
        deadline = time.monotonic() + args.duration
        reason = f"the duration ({args.duration:g} s) passed"
        passed_sluice: float | None = None
        next_report = time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if not sampler.samples:
                continue
            s = sampler.samples[-1]
            if passed_sluice is None and s.total_mb > sluice_peak_mb:
                passed_sluice = s.t - run.start
            if child.poll() is not None or s.jvm_mb == 0:
                reason = f"its driver exited (code {child.poll()})"
                break
            if heap_max and s.heap_mb is not None and s.heap_mb >= 0.9 * heap_max:
                reason = f"its heap was 90% full ({s.heap_mb:,.0f} of {heap_max:,.0f} MB)"
                break
            if time.monotonic() >= next_report:
                next_report += 10
                print(
                    f"  {s.t - run.start:5.0f} s: driver {s.python_mb:6.0f} MB, JVM {s.jvm_mb:6.0f} MB "
                    f"(heap {s.heap_mb or 0:5.0f} MB), lines sent {lines.sent:,}, sink {s.sink_rows}",
                    flush=True,
                )
        run.end = time.monotonic() - t0
        run.notes.update(
            stopped=reason,
            passed_sluice_peak_after=passed_sluice,
            lines_sent=lines.sent,
            line_rate=lines.sent / max(1e-9, run.end - run.start),
        )
        rows = sink()
        run.processed_per_s = rows / max(1e-9, run.end - run.start)
        run.notes["sink_rows"] = rows
        print(f"socket: stopped after {run.end - run.start:.0f} s: {reason}", flush=True)
    finally:
        if sampler is not None:
            sampler.stop()
        lines.stop()
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    return run


# ---- results -----------------------------------------------------------------------------------------


@dataclass
class Stats:
    n: int
    lo: float
    hi: float
    mean: float
    slope: float
    """MB/s, least squares over the window."""

    @property
    def spread(self) -> float:
        return (self.hi - self.lo) / self.mean if self.mean else float("nan")


def stats(points: list[tuple[float, float]]) -> Stats:
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    n = len(points)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0
    return Stats(n, min(ys), max(ys), my, slope)


def window(run: Run, since: float) -> list[Sample]:
    return [s for s in run.samples if run.start + since <= s.t <= run.end and s.jvm_mb > 0]


def describe(label: str, st: Stats) -> str:
    return (
        f"  {label:<26} min {st.lo:7.0f}  max {st.hi:7.0f}  mean {st.mean:7.0f} MB  "
        f"spread {st.spread:6.1%}  slope {st.slope * 60:+7.2f} MB/min"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of overload per system")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds of overload counted as warm-up")
    parser.add_argument(
        "--calibrate", type=float, default=240.0, help="at most this many seconds measuring capacity"
    )
    parser.add_argument("--calibrate-batches", type=int, default=8, help="batches capacity is measured over")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke test: 60 s of overload, 20 s warm-up, capacity within 60 s (may not reach a steady "
        "state)",
    )
    parser.add_argument("--publishers", type=int, default=50)
    parser.add_argument("--procs", type=int, default=5, help="processes the publishers are spread over")
    parser.add_argument("--overload", type=float, default=10.0, help="offered load / capacity")
    parser.add_argument("--cost-us", type=float, default=30.0, help="pipeline busy-wait per record")
    parser.add_argument("--record-bytes", type=int, default=100)
    parser.add_argument("--max-buffered", type=int, default=20_000, help="each Producer's buffer")
    parser.add_argument("--socket-heap", default="4g", help="spark.driver.memory of the socket run")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("--skip-socket", action="store_true")
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="diagnosis: trace the serve process's Python allocations (slower) and print what grew "
        "after the warm-up",
    )
    parser.add_argument("--samples", type=Path, help="write every sample of both runs here (JSON)")
    parser.add_argument("--socket-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.socket_child:
        socket_child(args)
        return
    # a SIGTERM (timeout, a CI runner) unwinds like ^C, so that the servers started are stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.duration, args.warmup, args.calibrate, args.calibrate_batches = 60.0, 20.0, 60.0, 4

    with tempfile.TemporaryDirectory(prefix="sluice-overload-") as tmp_name:
        tmp = Path(tmp_name)
        sluice = run_sluice(args, tmp)
        after = window(sluice, args.warmup)
        total = stats([(s.t, s.total_mb) for s in after])
        py = stats([(s.t, s.python_mb) for s in after])
        jvm = stats([(s.t, s.jvm_mb) for s in after])
        heap_points = [(s.t, s.heap_mb) for s in after if s.heap_mb is not None]
        workers = stats([(s.t, s.workers_mb) for s in after])
        peak = max(s.total_mb for s in sluice.samples)
        notes = sluice.notes
        lost = notes["server_acked"] - notes["sink_rows"]
        print()
        print(
            f"sluice: {args.duration:g} s at {args.overload:g}x overload "
            f"({notes['offered_rate']:,.0f} records/s offered, capacity {notes['capacity']:,.0f}), "
            f"warm-up: the first {args.warmup:g} s; after it ({total.n} samples):"
        )
        print(describe("serve + JVM", total))
        print(describe("serve (Python)", py))
        print(describe("JVM", jvm))
        if heap_points:
            print(describe("JVM heap used", stats(heap_points)))
        print(describe("Python workers (sum)", workers))
        print(
            f"  processed {sluice.processed_per_s:,.0f} records/s "
            f"({(sluice.processed_per_s or 0) / notes['capacity']:.2f}x capacity); publishers offered "
            f"{notes['offered']:,}, sent {notes['client_sent']:,}, acked {notes['client_acked']:,}; "
            f"server acked {notes['server_acked']:,}, in the sink {notes['sink_rows']:,} (lost {lost:,})"
        )
        figures: list[dict[str, Any]] = [
            {
                "what": f"sluice serve + JVM RSS spread after warm-up, {args.duration:g} s at "
                f"{args.overload:g}x overload",
                "value": round(total.spread, 4),
                "unit": "(max-min)/mean",
                "baseline": None,
                "baseline_value": None,
                "ratio": None,
                "goal": "<= 0.10",
                "met": total.spread <= 0.10,
            },
            {
                "what": "sluice serve (Python) RSS spread after warm-up",
                "value": round(py.spread, 4),
                "unit": "(max-min)/mean",
                "baseline": None,
                "baseline_value": None,
                "ratio": None,
                "goal": "<= 0.10",
                "met": py.spread <= 0.10,
            },
            {
                "what": "sluice JVM RSS spread after warm-up",
                "value": round(jvm.spread, 4),
                "unit": "(max-min)/mean",
                "baseline": None,
                "baseline_value": None,
                "ratio": None,
                "goal": "<= 0.10",
                "met": jvm.spread <= 0.10,
            },
            {
                "what": "records acked by the server and not in the sink",
                "value": lost,
                "unit": "records",
                "baseline": None,
                "baseline_value": None,
                "ratio": None,
                "goal": "0",
                "met": lost == 0,
            },
            {
                "what": f"records/s processed at {args.overload:g}x overload",
                "value": round(sluice.processed_per_s or 0),
                "unit": "records/s",
                "baseline": "capacity measured in the same run",
                "baseline_value": round(notes["capacity"]),
                "ratio": round((sluice.processed_per_s or 0) / notes["capacity"], 3),
                "goal": None,
                "met": None,
            },
        ]
        socket = None
        if not args.skip_socket:
            print()
            socket = run_socket(args, tmp, notes["offered_rate"], peak)
            ss = [s for s in socket.samples if socket.start <= s.t <= socket.end and s.jvm_mb > 0]
            s_total = stats([(s.t, s.total_mb) for s in ss])
            s_heap = [(s.t, s.heap_mb) for s in ss if s.heap_mb is not None]
            s_peak = max(s.total_mb for s in socket.samples)
            sn = socket.notes
            print(
                f"socket source: {socket.end - socket.start:.0f} s at {sn['line_rate']:,.0f} lines/s "
                f"({sn['lines_sent']:,} lines), stopped because {sn['stopped']}:"
            )
            print(describe("driver + JVM", s_total))
            if s_heap:
                print(describe("JVM heap used", stats(s_heap)))
            print(
                f"  processed {socket.processed_per_s:,.0f} records/s; passed Sluice's peak RSS "
                f"({peak:,.0f} MB) after "
                + (
                    "never"
                    if sn["passed_sluice_peak_after"] is None
                    else f"{sn['passed_sluice_peak_after']:.0f} s"
                )
            )
            figures += [
                {
                    "what": "sluice peak RSS (serve + JVM) vs Spark's socket source's (driver + JVM)",
                    "value": round(peak),
                    "unit": "MB",
                    "baseline": f"socket source, spark.driver.memory {args.socket_heap}, until "
                    + sn["stopped"],
                    "baseline_value": round(s_peak),
                    "ratio": round(peak / s_peak, 3),
                    "goal": None,
                    "met": None,
                },
                {
                    "what": "RSS growth after warm-up (serve + JVM), MB/s",
                    "value": round(total.slope, 4),
                    "unit": "MB/s",
                    "baseline": "Spark's socket source under the same overload",
                    "baseline_value": round(s_total.slope, 2),
                    "ratio": round(total.slope / s_total.slope, 4) if s_total.slope else None,
                    "goal": None,
                    "met": None,
                },
            ]
        if args.samples:
            args.samples.write_text(
                json.dumps(
                    {
                        r.name: {"start": r.start, "end": r.end, "samples": [vars(s) for s in r.samples]}
                        for r in (sluice, socket)
                        if r is not None
                    }
                )
            )
        print("RESULT " + json.dumps({"bench": "overload_memory", "figures": figures}))


if __name__ == "__main__":
    main()
