"""Creating the Spark session Sluice runs its streaming queries in, and checking Java first."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from py4j.protocol import Py4JError
from pyspark.sql import SparkSession

import ingest
from ingest.logs import SPARK_LOG_LEVELS, JsonFormatter
from ingest.logs import SPARK_QUIET as QUIET
from ingest.pipeline_control import STOP_TIMEOUT
from ingest.spark.java import java_problem
from ingest.spark.source import SluiceDataSource

log = logging.getLogger(__name__)

_ANY_MASTER = {
    # the time a Python worker (the streaming source's planner among them) has to connect back to the
    # JVM and authenticate: Spark's 15 s failed the query ("CANNOT_OPEN_SOCKET ... timed out") on a
    # loaded 2-core machine, where starting a worker that imports pyarrow took longer
    "spark.python.authenticate.socketTimeout": "60s",
}

_LOCAL_DEFAULTS = {
    # a handful of rows per micro-batch does not need 200 shuffle tasks
    "spark.sql.shuffle.partitions": "4",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    # block timestamps are UTC; showing them in the machine's zone only confuses
    "spark.sql.session.timeZone": "UTC",
    # containers often have a hostname that does not resolve; local mode needs loopback only
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    **_ANY_MASTER,
}


CHECKPOINT_MANAGER_KEY = "spark.sql.streaming.checkpointFileManagerClass"
FILE_SYSTEM_CHECKPOINT_MANAGERS = (
    "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager",  # 4.1+
    "org.apache.spark.sql.execution.streaming.FileSystemBasedCheckpointFileManager",  # before
)
"""Spark's checkpoint file manager that writes through Hadoop's FileSystem API, by its name in each Spark.

Every micro-batch writes three small files: the offset log's, the commit log's and the file sink's
_spark_metadata entry. Spark's default manager writes them through Hadoop's FileContext API, which
creates a file (and its .crc) with an explicit permission; without Hadoop's native library (pip's
pyspark has none) the local file system sets it by forking `chmod`, twice a file, six processes a
batch. Measured on 2 cores (offsets and commit log, 25,000-record batches): walCommit 35-57 ms and
commitOffsets 40-71 ms with the default, 7-18 ms and 6-15 ms with this one, and a Parquet batch's fixed
cost fell from about 470 to 200 ms. Both write a temporary file and rename it into place (atomic on a
local disk, and what Spark falls back to where FileContext is missing), with the same temporary names
(ingest.driver._clear_interrupted_writes), so exactly-once is unchanged. Only in local mode, where the
checkpoint is on a local disk; a setting the caller gives wins."""

STOP_TIMEOUT_KEY = "spark.sql.streaming.stopTimeout"
STOP_TIMEOUT_MS = str(int(STOP_TIMEOUT * 1000))
"""How long a query's stop() waits for its running batch, unless the user set it. Spark's default (0)
waits forever: a batch that never ends (a foreachBatch hung on a sink) then hung a swap's rollback
and the service's shutdown for good. A batch running at a stop is waited for, as a swap's first batch
may commit while it stops (docs/runtime.md), so this is long; past it the driver leaves the batch
behind (ingest.driver.SparkDriver.stop_query)."""

NOISY_LOGGERS = (
    # "Current batch is falling behind. The trigger interval is ...": every idle trigger of a query
    # whose batch took longer than its interval; Sluice's rate control and metrics say it better
    "org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor",
    "org.apache.spark.sql.execution.streaming.ProcessingTimeExecutor",  # before Spark 4.1
    # "spark.sql.adaptive.enabled is not supported in streaming DataFrames/Datasets and will be
    # disabled.": at every query start, about a default the user did not choose
    "org.apache.spark.sql.execution.streaming.runtime.ResolveWriteToStream",
    "org.apache.spark.sql.execution.streaming.ResolveWriteToStream",
    # "Unable to load native-hadoop library for your platform...": at every start, harmless
    "org.apache.hadoop.util.NativeCodeLoader",
)

JVM_NOISE = (b"WARNING: Using incubator modules:",)
"""Lines the JVM itself (not log4j) prints at every start: dropped from the JVM's stderr."""


def log4j2_properties(level: str = QUIET, json_lines: bool = False) -> str:
    """A log4j2 configuration for Spark's JVM: stderr, one line per event (Spark's own JSON layout with
    `json_lines`), at `level` (SPARK_LOG_LEVELS)."""
    if level not in SPARK_LOG_LEVELS:
        raise ValueError(f"Spark log level {level!r}: one of {', '.join(SPARK_LOG_LEVELS)}")
    lines = [
        f"rootLogger.level = {'warn' if level == QUIET else level}",
        "rootLogger.appenderRef.stderr.ref = console",
        "appender.console.type = Console",
        "appender.console.name = console",
        "appender.console.target = SYSTEM_ERR",
    ]
    if json_lines:
        lines += [
            "appender.console.layout.type = JsonTemplateLayout",
            "appender.console.layout.eventTemplateUri = classpath:org/apache/spark/SparkLayout.json",
        ]
    else:
        lines += [
            "appender.console.layout.type = PatternLayout",
            "appender.console.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %p spark.%c{1}: %m%n%ex",
        ]
    quiet = [("jetty", "org.sparkproject.jetty", "warn")]
    if level == QUIET:
        quiet += [(f"noisy{i}", name, "error") for i, name in enumerate(NOISY_LOGGERS)]
    for ref, name, at in quiet:
        lines += [f"logger.{ref}.name = {name}", f"logger.{ref}.level = {at}"]
    return "\n".join(lines) + "\n"


def build_session(
    master: str = "local[*]",
    app_name: str = "sluice",
    conf: Mapping[str, str] | None = None,
    *,
    log_level: str = QUIET,
    log_json: bool | None = None,
) -> SparkSession:
    """Get or create the Spark session, with the "sluice" data source registered.

    `conf` overrides the defaults. An already running session is reused (Spark's getOrCreate): then
    only runtime settings take effect. Raises RuntimeError with java_problem()'s message when Java is
    missing, rather than letting Spark fail with a launcher error.

    `log_level` (SPARK_LOG_LEVELS) applies to Spark's log4j loggers. With `log_json` set (True: JSON
    lines, False: plain) the JVM starts with log4j2_properties(), so that even its first lines, before
    the session exists, have that format and level; otherwise Spark's default configuration prints
    those and the levels are set once the session is up.
    """
    problem = java_problem()
    if problem is not None:
        raise RuntimeError(problem)
    if log_level not in SPARK_LOG_LEVELS:
        raise ValueError(f"Spark log level {log_level!r}: one of {', '.join(SPARK_LOG_LEVELS)}")
    local = master.startswith("local")
    _point_workers_at_this_python(local)
    settings = dict(_LOCAL_DEFAULTS) if local else {"spark.sql.session.timeZone": "UTC", **_ANY_MASTER}
    settings.update(conf or {})
    if log_json is not None:
        with tempfile.NamedTemporaryFile(
            "w", prefix="sluice-log4j2-", suffix=".properties", delete=False
        ) as f:
            f.write(log4j2_properties(log_level, log_json))
        log4j_file = Path(f.name)
        atexit.register(log4j_file.unlink, missing_ok=True)  # log4j may read it again while Spark runs
        option = f"-Dlog4j2.configurationFile={log4j_file.as_uri()}"
        given = settings.get("spark.driver.extraJavaOptions", "")
        settings["spark.driver.extraJavaOptions"] = f"{given} {option}".strip()
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    with _filtered_stderr(log_json) if log_json is not None else contextlib.nullcontext():
        # the JVM inherits stderr, and its Python workers from it
        _launch_jvm_apart({"spark.master": master, "spark.app.name": app_name, **settings})
        spark: SparkSession = builder.getOrCreate()
    set_spark_log_level(spark, log_level)
    if local and CHECKPOINT_MANAGER_KEY not in settings:
        use_file_system_checkpoints(spark)
    if not spark.sparkContext.getConf().contains(STOP_TIMEOUT_KEY):  # `conf`, spark-defaults.conf
        spark.conf.set(STOP_TIMEOUT_KEY, STOP_TIMEOUT_MS)
    spark.dataSource.register(SluiceDataSource)
    return spark


def _launch_jvm_apart(settings: Mapping[str, str]) -> None:
    """Start Spark's JVM (its py4j gateway) in a session of its own, unless one runs already.

    A signal to this process's whole group (`timeout`, `kill -TERM -PGID`, a supervisor killing as a
    group) would otherwise reach the JVM too, which exits at once while the server drains into it.
    pyspark already keeps SIGINT (Ctrl-C) from it; the JVM still ends with this process, through the
    pipe pyspark holds on its stdin. With a gateway already given (PYSPARK_GATEWAY_PORT, spark-submit)
    pyspark connects to that one."""
    from pyspark import SparkConf, SparkContext  # noqa: PLC0415 - with pyspark.sql, already loaded
    from pyspark.java_gateway import launch_gateway  # noqa: PLC0415

    if SparkContext._gateway is not None:
        return
    conf = SparkConf(loadDefaults=False)
    for key, value in settings.items():
        conf.set(key, value)
    gateway = launch_gateway(conf, popen_kwargs={"start_new_session": True})  # type: ignore[no-untyped-call]
    SparkContext._ensure_initialized(gateway=gateway)


def use_file_system_checkpoints(spark: SparkSession) -> str | None:
    """Have the session's streaming queries write their checkpoint and sink logs through Hadoop's
    FileSystem API (see FILE_SYSTEM_CHECKPOINT_MANAGERS); returns the class set, None when this Spark
    has none of them (then its default stays)."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a running session has its gateway
    for name in FILE_SYSTEM_CHECKPOINT_MANAGERS:
        try:
            jvm.java.lang.Class.forName(name)
        except Py4JError:  # ClassNotFoundException: not in this Spark
            log.debug("no %s in this Spark", name)
            continue
        spark.conf.set(CHECKPOINT_MANAGER_KEY, name)
        return name
    return None


@contextlib.contextmanager
def _filtered_stderr(json_lines: bool) -> Iterator[None]:
    """While in the block, fd 2 is a pipe, so that a process started then (Spark's JVM) writes its
    stderr there for good; a thread copies each line onto the real stderr, without JVM_NOISE and, with
    `json_lines`, each line that is not a JSON object (a JVM message outside log4j, a Python worker's
    traceback) wrapped in one (logger "spark.stderr")."""
    read_fd, write_fd = os.pipe()
    sys.stderr.flush()
    real = os.dup(2)
    # the copy goes where Python's stderr does: with --log-format json fd 2 is itself a pipe
    # (ingest.native_stderr), which the copier, alive until the JVM ends, would hold open at exit
    out = os.dup(_stderr_fd())
    threading.Thread(
        target=_copy_lines, args=(read_fd, out, json_lines), name="sluice-jvm-stderr", daemon=True
    ).start()
    os.dup2(write_fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(real, 2)
        os.close(real)
        os.close(write_fd)  # the pipe ends (and the thread with it) when the JVM and its workers do


def _stderr_fd() -> int:
    """The file descriptor sys.stderr writes to; 2 when it has none (a test's capture)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, OSError):  # io.UnsupportedOperation is both
        return 2


def _copy_lines(read_fd: int, out_fd: int, json_lines: bool) -> None:
    """Copy the JVM's stderr lines onto `out_fd` until the pipe ends. If `out_fd` fails (no one reads
    the real stderr any more, a full disk under it) it goes on reading and drops them: this thread ended
    with a BrokenPipeError, the pipe's read end closed with it, and the JVM and its Python workers wrote
    their stderr into a pipe no one read (EPIPE, or SIGPIPE for a child that has it at its default)."""
    writing = True
    with os.fdopen(read_fd, "rb") as pipe, os.fdopen(out_fd, "wb", buffering=0) as out:
        for line in pipe:
            if not writing or line.startswith(JVM_NOISE):
                continue
            data = line
            if json_lines and not _is_json_object(line):
                text = line.decode(errors="replace").rstrip("\r\n")
                record = logging.LogRecord("spark.stderr", logging.WARNING, __file__, 0, text, None, None)
                data = JsonFormatter().format(record).encode() + b"\n"
            try:
                out.write(data)
            except OSError:
                writing = False


def _is_json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def set_spark_log_level(spark: SparkSession, level: str = QUIET) -> None:
    """Spark's log4j levels at run time: the root's, and NOISY_LOGGERS' at ERROR when `level` is quiet."""
    spark.sparkContext.setLogLevel("WARN" if level == QUIET else level.upper())
    if level != QUIET:
        return
    jvm = spark.sparkContext._jvm
    assert jvm is not None  # a running session has its gateway
    error = jvm.org.apache.logging.log4j.Level.ERROR
    for name in NOISY_LOGGERS:
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, error)


def _point_workers_at_this_python(local: bool) -> None:
    """Make Spark's Python workers run this interpreter and find this project's packages.

    Workers unpickle the data source by reference to ingest.spark.source, so they need the same
    interpreter (same pyspark, pyarrow) and the project on their path; otherwise they fail with
    "Timed out while waiting for the Python worker to connect back" or an ImportError. On a cluster
    the executors' Python is the cluster's business, so only fill in what is unset there.
    """
    if local:
        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
        # skips the JVM's "hostname resolves to a loopback address" probing and warning
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        # a source checkout is not on the workers' path unless they happen to start in it
        root = str(Path(ingest.__file__).resolve().parent.parent)
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
    else:
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
