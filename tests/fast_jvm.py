"""JVM options that start Spark about three times faster in the tests.

The suite starts Spark's JVM dozens of times (`sluice serve` in subprocesses, crash and restart tests),
and on a 2-core machine each start took 25-40 s, most of the run's time. Measured here (a session, then
one small query; `python tests/fast_jvm.py --measure`): the defaults 28-35 s; C1 only
(`-XX:TieredStopAtLevel=1`: no C2 compiler threads competing for the two cores) and the serial GC
17-22 s; with a class-data sharing archive of Spark's classes as well, 11-12 s.

The archive (Java's AppCDS, a dynamic archive written at a JVM's exit) is made once per machine, Java
and Spark, by one JVM that runs a session, a batch query and a streaming query into Parquet; it is
kept under pytest's cache. A truncated archive crashes the JVM that maps it (SIGBUS), so it is written
under a temporary name, checked by a JVM that maps it, and only then renamed into place.

Tests only: the service keeps Java's defaults (C2 is what long-running batches want).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OPTIONS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
QUIET_CDS = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")  # the dump warns about every class it skips

_DUMP = """
import sys, tempfile, time
from pyspark import SparkContext
from ingest.spark.session import build_session

spark = build_session("local[2]", app_name="sluice-cds")
proc = SparkContext._gateway.proc
spark.range(10000).selectExpr("id % 7 AS k").groupBy("k").count().collect()
with tempfile.TemporaryDirectory() as d:
    q = (
        spark.readStream.format("rate").option("rowsPerSecond", 100).load()
        .writeStream.format("parquet").option("path", d + "/sink")
        .option("checkpointLocation", d + "/cp").trigger(processingTime="200 milliseconds").start()
    )
    deadline = time.monotonic() + 60
    while (q.lastProgress is None or q.lastProgress["numInputRows"] == 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    q.stop()
    spark.read.parquet(d + "/sink").count()
spark.stop()
proc.stdin.close()  # the JVM exits on EOF and writes the archive as it exits
sys.exit(proc.wait(timeout=300))
"""


def _key() -> str:
    """What an archive is valid for: this Java and this Spark's jars."""
    import pyspark  # only where Spark tests run

    version = subprocess.run(["java", "-version"], check=False, capture_output=True, text=True, timeout=60)
    java = version.stderr
    jars = sorted(p.name for p in (Path(pyspark.__file__).parent / "jars").glob("*.jar"))
    return hashlib.sha256("\n".join([java, sys.version, *jars]).encode()).hexdigest()[:16]


def _usable(archive: Path) -> bool:
    check = subprocess.run(
        ["java", f"-XX:SharedArchiveFile={archive}", *QUIET_CDS, "-version"],
        check=False,
        capture_output=True,
        timeout=120,
    )
    return check.returncode == 0


def archive(cache: Path) -> Path | None:
    """The class-data archive of Spark's classes for this machine, made if missing; None if it could
    not be made (then the tests run without it)."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        # parallel test workers (pytest -n) all ask at once: one makes it, the others wait and map it
        with (cache / "make.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return _archive(cache)
    except (OSError, subprocess.SubprocessError):
        return None


def _archive(cache: Path) -> Path | None:
    path = cache / f"spark-{_key()}.jsa"
    if path.exists():
        return path if _usable(path) else None
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        dump = Path(tmp) / "spark.jsa"
        env = {
            **os.environ,
            "SPARK_SUBMIT_OPTS": " ".join([*OPTIONS, *QUIET_CDS, f"-XX:ArchiveClassesAtExit={dump}"]),
        }
        made = subprocess.run(
            [sys.executable, "-c", _DUMP],
            check=False,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=600,
        )
        if made.returncode != 0 or not dump.exists() or not _usable(dump):
            return None
        dump.replace(path)
    return path


def submit_options(cache: Path) -> str:
    """SPARK_SUBMIT_OPTS for every Spark JVM the tests start (in this process and in subprocesses)."""
    options = [*OPTIONS]
    made = archive(cache)
    if made is not None:
        options += [f"-XX:SharedArchiveFile={made}", *QUIET_CDS]
    given = os.environ.get("SPARK_SUBMIT_OPTS", "")
    return " ".join([given, *options]).strip()


def _measure() -> None:
    """Time a session and one query with and without the options (run from the repository root)."""
    script = (
        "import time; t = time.monotonic()\n"
        "from ingest.spark.session import build_session\n"
        "build_session('local[2]').range(100000).selectExpr('id % 7 AS k').groupBy('k').count().collect()\n"
        "print(f'{time.monotonic() - t:.1f}')\n"
    )
    with tempfile.TemporaryDirectory() as cache:
        started = time.monotonic()
        fast = submit_options(Path(cache))
        print(f"archive made in {time.monotonic() - started:.0f} s")
        for _ in range(2):
            for name, opts in (("defaults", os.environ.get("SPARK_SUBMIT_OPTS", "")), ("fast", fast)):
                env = {**os.environ, "SPARK_SUBMIT_OPTS": opts}
                out = subprocess.run(
                    [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
                )
                print(f"{name}: session + first query {out.stdout.strip()} s")


if __name__ == "__main__" and sys.argv[1:] == ["--measure"]:
    _measure()
