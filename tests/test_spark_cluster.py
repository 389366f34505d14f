"""The whole cluster on loopback, every part a real process: Spark's own standalone master and worker
(from the installed pyspark), three `sluice serve --role receiver` nodes with replication 2, a
`sluice serve --role driver` on the standalone master, and two `sluice push` producers. One receiver
is killed with SIGKILL while both push: every record is acked, and the driver's sink holds each record
exactly once. A few minutes on 2 cores; run it alone with `pytest -m cluster`."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyspark
import pytest

from tests.support import free_ports, sink_values

pytestmark = pytest.mark.cluster

RECORDS = 300_000
"""Per producer."""
SPARK_HOME = Path(pyspark.__file__).parent


def wait_for(what: str, condition: object, timeout: float, logs: list[Path]) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in logs if p.exists())
            raise AssertionError(f"{what} not within {timeout:g} s\n{tails}")
        time.sleep(0.2)


def text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


class Processes:
    """Subprocesses with their output in `<tmp>/<name>.log`; stop() ends those still running."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        self.tmp_path = tmp_path
        self.env = env
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.files = contextlib.ExitStack()

    def start(self, name: str, command: list[str]) -> None:
        log = self.files.enter_context(open(self.tmp_path / f"{name}.log", "wb"))  # noqa: SIM115
        self.running[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def stop(self) -> None:
        for proc in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.files.close()


@pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"), reason="needs Java")
def test_a_standalone_spark_cluster_reads_three_replicated_nodes_through_a_sigkill(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "SPARK_HOME": str(SPARK_HOME),
        "PYSPARK_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
    }
    master_port, master_ui, worker_ui, driver_port, *node_ports = free_ports(7)
    (tmp_path / "nodes").write_text("".join(f"{i} 127.0.0.1:{p}\n" for i, p in enumerate(node_ports)))
    sluice = [sys.executable, "-m", "ingest.cli"]
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    master_url = f"spark://127.0.0.1:{master_port}"
    logs = [tmp_path / f"{n}.log" for n in ("master", "worker", "driver", "node0", "node1", "node2")]
    procs = Processes(tmp_path, env)
    start = procs.start
    try:
        java = "org.apache.spark.deploy"
        start(
            "master",
            [
                spark_class,
                f"{java}.master.Master",
                *f"--host 127.0.0.1 --port {master_port}".split(),
                "--webui-port",
                str(master_ui),
            ],
        )
        wait_for("the master", lambda: "ALIVE" in text(tmp_path / "master.log"), 90, logs)
        worker = f"--host 127.0.0.1 --cores 2 --memory 1g --webui-port {worker_ui}".split()
        start("worker", [spark_class, f"{java}.worker.Worker", master_url, *worker])
        wait_for("the worker", lambda: "Successfully registered" in text(tmp_path / "worker.log"), 90, logs)
        nodes = ["--nodes", str(tmp_path / "nodes"), "--metrics-port", "-1"]
        for i, port in enumerate(node_ports):
            node = [
                "--node-id",
                str(i),
                "--port",
                str(port),
                "--replication",
                "2",
                "--data-dir",
                str(tmp_path / f"d{i}"),
            ]
            start(f"node{i}", [*sluice, "serve", "--role", "receiver", *nodes, *node])
        driver = ["--master", master_url, "--port", str(driver_port), "--data-dir", str(tmp_path / "drv")]
        start("driver", [*sluice, "serve", "--role", "driver", *nodes, *driver])
        wait_for(
            "the driver", lambda: "driver of 3 receiver nodes" in text(tmp_path / "driver.log"), 180, logs
        )
        wait_for(
            "the in-sync followers",
            lambda: all("is in sync" in text(tmp_path / f"node{i}.log") for i in range(3)),
            60,
            logs,
        )
        targets = [f"127.0.0.1:{p}" for p in node_ports]
        for name, order in (("a", targets), ("b", [*targets[1:], targets[0]])):
            (tmp_path / f"{name}.txt").write_text("".join(f"{name}{i}\n" for i in range(RECORDS)))
            start(
                f"push-{name}",
                [
                    *sluice,
                    "push",
                    str(tmp_path / f"{name}.txt"),
                    "--target",
                    ",".join(order),
                    "--no-progress",
                ],
            )
        # kill node 0 once producer a has records on it (its follower, node 1, holds copies of them)
        wait_for(
            "records on node 0",
            lambda: any((tmp_path / "d1" / "replicas" / "0").rglob("*.wal")),
            60,
            [*logs, tmp_path / "push-a.log"],
        )
        os.kill(procs.running["node0"].pid, signal.SIGKILL)
        for name in ("push-a", "push-b"):
            assert procs.running[name].wait(timeout=180) == 0, text(tmp_path / f"{name}.log")
            assert "all acked" in text(tmp_path / f"{name}.log")
        assert "failed over" in text(tmp_path / "push-a.log")

        sink = tmp_path / "drv" / "sink"  # files Spark committed only: others may be half written
        wait_for("the sink", lambda: len(sink_values(sink)) >= 2 * RECORDS, 180, logs)
        time.sleep(3)  # a batch more, were any record doubled
    finally:
        procs.stop()
    values = sink_values(tmp_path / "drv" / "sink")
    counts = collections.Counter(values)
    expected = {f"{name}{i}".encode() for name in "ab" for i in range(RECORDS)}
    assert set(counts) == expected, f"{len(expected - set(counts))} records lost"
    assert len(values) == len(expected), f"{len(values) - len(expected)} records doubled"
