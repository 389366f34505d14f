"""Crashes with real processes: `sluice serve` killed with SIGKILL at random moments under load and
restarted, and a SIGTERM drain. The sink (Parquet, read through Spark's commit log) must hold every
acknowledged record exactly once, compared by content."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from test_cli import SLUICE, sink_values, wait_for_line

PRODUCER = Path(__file__).with_name("crash_producer.py")
SERVING = r"serving streams default on (127\.0\.0\.1:\d+)"
QUERY_RUNNING = r"Spark query running"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    """`sluice serve` on a fixed port and data dir, in its own process group (so SIGKILL takes its
    Spark JVM down with it, as a machine crash would), restartable."""

    def __init__(self, tmp: Path, port: int) -> None:
        self.tmp, self.port = tmp, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.runs = 0

    @property
    def log(self) -> Path:
        return self.tmp / f"serve-{self.runs}.log"

    def start(self) -> None:
        self.runs += 1
        with self.log.open("wb") as log_file:
            self.proc = subprocess.Popen(
                [
                    *SLUICE,
                    "serve",
                    "--port",
                    str(self.port),
                    "--metrics-port",
                    "-1",
                    "--data-dir",
                    str(self.tmp / "data"),
                    "--master",
                    "local[2]",
                    "--trigger-interval",
                    "0.5",
                ],
                stderr=log_file,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
            )

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        assert self.proc is not None
        wait_for_line(self.proc, self.log, pattern, timeout)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self, timeout: float = 180, group: bool = False) -> int:
        """SIGTERM to the server, or (`group`) to its whole process group, as `timeout` or a
        supervisor that kills as a group sends it; either way it drains and exits 0."""
        assert self.proc is not None
        if group:
            os.killpg(self.proc.pid, signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)


def read_state(path: Path) -> tuple[int, int]:
    sent, acked = (int(x) for x in path.read_text().split())
    return sent, acked


def start_producer(tmp: Path, port: int) -> tuple[subprocess.Popen[bytes], Path, Path]:
    stop, state = tmp / "stop-producer", tmp / "producer.state"
    with (tmp / "producer.log").open("wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(PRODUCER), f"127.0.0.1:{port}", "default", str(stop), str(state)],
            stderr=log,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return proc, stop, state


def wait_for_acked(state: Path, at_least: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (state.exists() and read_state(state)[1] >= at_least):
        assert proc.poll() is None, "the producer exited"
        assert time.monotonic() < deadline, f"fewer than {at_least} records acked in {timeout} s"
        time.sleep(0.1)


def assert_exactly_once(sink: Path, expected: int) -> None:
    counts = Counter(sink_values(sink))
    doubled = [v for v, n in counts.items() if n > 1]
    assert not doubled, f"{len(doubled)} records more than once, e.g. {doubled[:5]}"
    missing = [i for i in range(expected) if str(i).encode() not in counts]
    assert not missing, f"{len(missing)} acked records missing, e.g. {missing[:5]}"
    extra = [v for v in counts if not v.isdigit() or int(v) >= expected]
    assert not extra, f"records never sent: {extra[:5]}"


@pytest.mark.spark
@pytest.mark.timeout(900)  # five Spark starts, a minute each on a slow, loaded machine
def test_sigkill_at_random_moments_loses_and_doubles_nothing(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("SLUICE_CRASH_SEED", "5")))
    port = free_port()
    service = Service(tmp_path, port)
    service.start()
    service.wait_for(SERVING, 60)
    producer, stop, state = start_producer(tmp_path, port)
    try:
        for kill in range(5):
            # anywhere from before Spark is up to well into steady ingestion and batch processing
            if kill % 2:
                service.wait_for(QUERY_RUNNING, 120)
            time.sleep(rng.uniform(0.5, 6.0))
            acked_before = read_state(state)[1] if state.exists() else 0
            service.kill()
            service.start()
            service.wait_for(SERVING, 60)
            # the producer resends and goes on after each crash
            wait_for_acked(state, acked_before + 1, producer)
        stop.touch()
        assert producer.wait(timeout=300) == 0, (tmp_path / "producer.log").read_text()
        sent, acked = read_state(state)
        assert acked == sent > 0
        service.wait_for(QUERY_RUNNING, 120)
        deadline = time.monotonic() + 240
        while len(sink_values(tmp_path / "data" / "sink")) < acked and time.monotonic() < deadline:
            assert service.proc is not None and service.proc.poll() is None, service.log.read_text()
            time.sleep(1)
        assert service.terminate() == 0, service.log.read_text()
    finally:
        if producer.poll() is None:
            producer.kill()
        producer.wait()
        if service.proc is not None and service.proc.poll() is None:
            os.killpg(service.proc.pid, signal.SIGKILL)
            service.proc.wait()  # reaped: not a "still running" warning in a later test
    assert_exactly_once(tmp_path / "data" / "sink", acked)


@pytest.mark.spark
@pytest.mark.parametrize("group", [False, True], ids=["server", "process-group"])
def test_sigterm_drains_everything_acked_into_the_sink_and_exits_0(tmp_path: Path, group: bool) -> None:
    """Also when the whole group gets it: Spark's JVM runs in a session of its own, so it outlives the
    drain (before, it exited at once and the drain logged py4j errors)."""
    port = free_port()
    service = Service(tmp_path, port)
    service.start()
    service.wait_for(QUERY_RUNNING, 120)
    producer, stop, state = start_producer(tmp_path, port)
    try:
        wait_for_acked(state, 20_000, producer)
        # SIGTERM under load: credit stops, what was taken is sealed and acked, Spark processes it
        assert service.terminate(group=group) == 0, service.log.read_text()
        log = service.log.read_text()
        assert "sluice: stopped" in log
        # a clean stop is quiet: Spark drains after the gRPC server stopped, so the source's rate
        # requests are refused; that is expected, not worth a grpc error dump per batch
        for noise in ("Traceback", "RpcError", "live rate", "Failed to cancel job group"):
            assert noise not in log, log
        time.sleep(1)  # the producer saw the Cancel and is retrying a server that is gone
        _, acked = read_state(state)
        assert acked > 0
        # exactly what was acked is in the sink: drained before exit, without a restart
        assert_exactly_once(tmp_path / "data" / "sink", acked)
        assert len(sink_values(tmp_path / "data" / "sink")) == acked
    finally:
        stop.touch()
        producer.kill()
        producer.wait(timeout=30)
