"""What `sluice serve` writes on stderr: lifecycle lines, no Spark noise, no stack trace on a clean stop,
and with --log-format json nothing but JSON lines (Spark's JVM and its Python workers included)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import stop
from test_cli import SLUICE, sluice, wait_for_line

from ingest.logs import JsonFormatter
from ingest.spark.session import log4j2_properties

FALLING_BEHIND = "Current batch is falling behind"
ADAPTIVE = "spark.sql.adaptive.enabled is not supported in streaming"


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")} | {"PYTHONUNBUFFERED": "1"}


@pytest.mark.spark
@pytest.mark.parametrize(
    ("log_format", "spark_log_level"), [("plain", "quiet"), ("json", "quiet"), ("json", "warn")]
)
def test_serve_logs_its_lifecycle_and_stops_cleanly(
    tmp_path: Path, log_format: str, spark_log_level: str
) -> None:
    log = tmp_path / "serve.log"
    env = clean_env()
    # the format from the environment, the Spark level from the file: both reach the JVM's log4j
    env["SLUICE_LOG_FORMAT"] = log_format
    config = tmp_path / "sluice.toml"
    config.write_text(f'spark-log-level = "{spark_log_level}"\nmaster = "local[1]"\ntrigger-interval = 0.5\n')
    with log.open("wb") as log_file:
        serve = subprocess.Popen(
            [
                *SLUICE,
                "serve",
                "--config",
                str(config),
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--data-dir",
                str(tmp_path / "data"),
            ],
            stderr=log_file,
            env=env,
        )
    try:
        match = wait_for_line(serve, log, r"serving streams default on (127\.0\.0\.1:\d+)", 120)
        target = match.group(1).decode()
        wait_for_line(serve, log, r"Spark query running", 120)
        source = tmp_path / "in.txt"
        source.write_text("".join(f"record {i}\n" for i in range(5000)))
        pushed = sluice("push", str(source), "--target", target, "--no-progress")
        assert pushed.returncode == 0, pushed.stderr.decode()
        # let a few batches run: the first one (seconds) falls behind a 0.5 s trigger
        deadline = time.monotonic() + 60
        while not list((tmp_path / "data" / "sink").glob("*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)
        sets = sluice("rate", "set", "20000", "--target", target)
        assert sets.returncode == 0, sets.stderr.decode()
    finally:
        code = stop(serve, 180)
    text = log.read_text(errors="replace")
    assert code == 0, text
    assert "Traceback" not in text and "Exception" not in text, text
    if spark_log_level == "warn":  # all of Spark's warnings: the test can see the ones held back
        assert ADAPTIVE in text, text
    else:
        assert FALLING_BEHIND not in text and ADAPTIVE not in text, text
        assert "native-hadoop" not in text, text
    assert "Using incubator modules" not in text, text
    if log_format == "plain":
        for line in (
            "sluice: starting",
            "sluice: serving streams default",
            "sluice: Spark query running",
            "sluice: stopping",
            "sluice: stopped",
        ):
            assert line in text, text
        assert re.search(r"INFO ingest.rate_service: rate \S+ -> 20000 records/s, set by", text), text
        return
    lines = [line for line in text.splitlines() if line.strip()]
    entries = []
    for line in lines:
        entry = json.loads(line)  # every line, Spark's included
        assert isinstance(entry, dict), line
        entries.append(entry)
    events = [e.get("event") for e in entries]
    assert events.count("start") == events.count("serving") == events.count("query-started") == 1, events
    assert events[-1] == "stopped" and events.count("stopping") == 1, events
    rate_set = [e for e in entries if e.get("logger") == "ingest.rate_service" and "-> 20000" in e["message"]]
    assert len(rate_set) == 1, lines
    assert all("time" in e or "ts" in e for e in entries), lines  # ts: Spark's own layout


def test_json_formatter_makes_one_object_per_record() -> None:
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "a %s", ("message",), None)
        record.exc_info = sys.exc_info()
    line = JsonFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["message"] == "a message" and entry["level"] == "ERROR" and entry["logger"] == "x"
    assert "ValueError: boom" in entry["exception"]


def test_log4j_configuration_quiets_only_the_known_noise() -> None:
    quiet = log4j2_properties("quiet", json_lines=True)
    assert "rootLogger.level = warn" in quiet and "JsonTemplateLayout" in quiet
    assert "streaming.runtime.ProcessingTimeExecutor" in quiet and "ResolveWriteToStream" in quiet
    loud = log4j2_properties("info", json_lines=False)
    assert "rootLogger.level = info" in loud and "ProcessingTimeExecutor" not in loud
    with pytest.raises(ValueError, match="Spark log level"):
        log4j2_properties("chatty")


def test_a_usage_error_is_a_json_line_in_json_mode() -> None:
    result = subprocess.run(
        [*SLUICE, "config", "check", "--port", "70000", "--no-spark"],
        capture_output=True,
        env=clean_env() | {"SLUICE_LOG_FORMAT": "json"},
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    (line,) = result.stderr.decode().splitlines()
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["message"] == "--port must be 0-65535, got 70000"


def test_failed_tls_handshakes_write_no_grpc_core_lines_in_json_mode(tmp_path: Path) -> None:
    """Each connection that failed the TLS handshake wrote a raw gRPC-core line on stderr
    ("I... Handshake failed ..."): not JSON under --log-format json, and one per connection. gRPC's
    core logs only its errors now, unless the user sets GRPC_VERBOSITY."""
    from pki import CertificateAuthority

    cert = CertificateAuthority(tmp_path / "pki").issue("localhost", server=True, file_stem="server")

    def serve(name: str, env: dict[str, str]) -> list[str]:
        log = tmp_path / f"{name}.log"
        argv = [*SLUICE, "--log-format", "json", "serve", "--no-spark", "--port", "0", "--metrics-port", "-1"]
        argv += ["--data-dir", str(tmp_path / name), "--tls-cert", str(cert.cert_file)]
        argv += ["--tls-key", str(cert.key_file)]
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stderr=out, env=env)
        try:
            serving = wait_for_line(proc, log, r"serving streams default on 127\.0\.0\.1:(\d+)", 60)
            port = int(serving.group(1))
            for _ in range(20):  # plaintext clients at a TLS port
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    sock.recv(1024)
            time.sleep(0.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                assert proc.wait(timeout=60) == 0, log.read_text(errors="replace")
            finally:
                proc.kill()
        return log.read_text(errors="replace").splitlines()

    unset = {k: v for k, v in clean_env().items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}
    lines = serve("default", unset)
    for line in lines:
        assert isinstance(json.loads(line), dict), line  # every line
    assert json.loads(lines[-1]).get("event") == "stopped", lines
    asked = serve("asked", clean_env() | {"GRPC_VERBOSITY": "INFO"})  # the user's own setting holds
    entries = [json.loads(line) for line in asked]  # as JSON lines (ingest.native_stderr)
    failed = [e for e in entries if e["logger"] == "grpc" and "Handshake failed" in e["message"]]
    assert len(failed) >= 20 and {e["level"] for e in failed} == {"INFO"}, asked


def _serving(proc: subprocess.Popen[bytes], log: Path) -> int:
    return int(wait_for_line(proc, log, r"serving streams default on 127\.0\.0\.1:(\d+)", 60).group(1))


def test_grpc_core_errors_are_json_lines_in_json_mode(tmp_path: Path) -> None:
    """gRPC's C core writes its errors on fd 2 in absl's own format ("E1127 22:04:43.216 ... file.cc:164]
    ..."), past Python's logging: a raw line among the JSON ones, which broke a JSON log consumer. Made
    here by running the server out of file descriptors, so that gRPC cannot accept connections ("File
    descriptor limit reached"): each of its lines is a JSON record now (logger grpc, its level), and
    every line on stderr is a JSON object."""
    argv = [*SLUICE, "--log-format", "json", "serve", "--no-spark", "--port", "0", "--metrics-port", "-1"]

    def serve(name: str, files: int | None) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f"{name}.log"
        command = [*argv, "--data-dir", str(tmp_path / name)]
        if files is not None:  # the sluice command, exec'd under a limit of `files` open files
            limit = "import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (%d, %d)); "
            limit += "os.execv(sys.argv[1], sys.argv[1:])"
            command = [sys.executable, "-c", limit % (files, files), *command]
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stderr=out, env=clean_env())
        return proc, log

    proc, log = serve("measured", None)  # how many files a server holds, serving
    try:
        _serving(proc, log)
        held = len(os.listdir(f"/proc/{proc.pid}/fd"))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    proc, log = serve("limited", held + 8)
    try:
        port = _serving(proc, log)
        connections = []
        for _ in range(40):  # more than it may open: gRPC's listener cannot accept the rest
            with contextlib.suppress(OSError):
                connections.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        deadline = time.monotonic() + 30
        while "File descriptor limit reached" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        for connection in connections:
            connection.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=60) == 0, log.read_text(errors="replace")
        finally:
            proc.kill()
    lines = log.read_text(errors="replace").splitlines()
    entries = [json.loads(line) for line in lines]  # every line
    assert all(isinstance(entry, dict) for entry in entries), lines
    limit = [e for e in entries if "File descriptor limit reached" in e["message"]]
    assert limit and all((e["logger"], e["level"]) == ("grpc", "ERROR") for e in limit), lines
    assert all(e["source"].startswith("posix_engine_listener") for e in limit), limit
    assert entries[-1].get("event") == "stopped", lines


def test_what_the_process_wrote_on_fd_2_before_a_crash_is_still_said(tmp_path: Path) -> None:
    """A crash ends the process at once (gRPC's fatal checks call abort(), the interpreter's fatal
    errors too): what the relay had not read yet must not die with it. The relay is a process of its
    own, which writes out what the pipe holds once the crashed one is gone; the interpreter's fatal
    error report is written there too, as JSON lines."""
    program = """if True:
        import ctypes, logging, os, sys
        from ingest import logs
        logs.setup("info", "json", whole_process=True)
        logging.getLogger("sluice").warning("before the crash")
        fatal = b"F1127 22:01:07.824891   25436 chttp2_transport.cc:1234] Check failed: a C core's check"
        os.write(2, fatal + b"\\n")
        if sys.argv[1] == "abort":
            os.abort()
        ctypes.pythonapi.Py_FatalError(b"a fatal error of the interpreter")
    """
    for how in ("abort", "fatal"):
        crashed = subprocess.run(
            [sys.executable, "-c", program, how],
            capture_output=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
        assert crashed.returncode == -signal.SIGABRT, crashed.stderr
        entries = [json.loads(line) for line in crashed.stderr.decode().splitlines()]  # every line
        said = [(e["logger"], e["level"], e["message"]) for e in entries]
        assert ("sluice", "WARNING", "before the crash") in said, said
        assert ("grpc", "CRITICAL", "Check failed: a C core's check") in said, said
        if how == "fatal":
            assert ("stderr", "ERROR", "Fatal Python error: a fatal error of the interpreter") in said, said


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state
                    found.append(int(entry))
    return found


def _cmdline(pid: int) -> bytes:
    """A process's command line; empty once it has ended (a child may exit between the listing and
    the read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_killed_relay_gives_fd_2_back_to_stderr(tmp_path: Path) -> None:
    """After a `kill -9` of the relay (ingest.native_stderr) a write on fd 2 failed with EPIPE: gRPC's
    core lines were lost, and a child started then with SIGPIPE at its default (subprocess's) died of
    SIGPIPE at its first line on stderr. The server watches the relay: fd 2 goes back to the real
    stderr, a JSON warning says so, and raw lines reach stderr from then on. Made here with failed TLS
    handshakes under GRPC_VERBOSITY=INFO, each of which gRPC's core writes a line on fd 2 for."""
    from pki import CertificateAuthority

    cert = CertificateAuthority(tmp_path / "pki").issue("localhost", server=True, file_stem="server")
    log = tmp_path / "serve.log"
    argv = [*SLUICE, "--log-format", "json", "serve", "--no-spark", "--port", "0", "--metrics-port", "-1"]
    argv += ["--data-dir", str(tmp_path / "data"), "--tls-cert", str(cert.cert_file)]
    argv += ["--tls-key", str(cert.key_file)]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stderr=out, env=clean_env() | {"GRPC_VERBOSITY": "INFO"})
    try:
        port = _serving(proc, log)
        relays = [pid for pid in _children(proc.pid) if b"native_stderr" in _cmdline(pid)]
        assert len(relays) == 1, relays
        os.kill(relays[0], signal.SIGKILL)
        wait_for_line(proc, log, r"stderr relay \(pid \d+\) ended \(killed by signal 9\)", 30)
        for _ in range(5):  # plaintext clients at a TLS port: a raw "Handshake failed" line each
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\n\r\n")
                sock.recv(1024)
        wait_for_line(proc, log, r"\n[I]\d{4} [^\n]*Handshake failed", 30)
        assert proc.poll() is None, log.read_text(errors="replace")
    finally:
        code = stop(proc, 60)
    text = log.read_text(errors="replace")
    assert code == 0, text
    warned = [json.loads(line) for line in text.splitlines() if "stderr relay" in line]
    assert len(warned) == 1 and warned[0]["level"] == "WARNING", text
    assert warned[0]["logger"] == "ingest.native_stderr", text
    assert json.loads(text.splitlines()[-1]).get("event") == "stopped", text


def test_a_child_started_after_the_relay_died_can_write_on_stderr() -> None:
    """The same in a process of its own: a child started with subprocess once the relay is gone (a
    user pipeline's `sh -c 'echo warn >&2'`) was killed by SIGPIPE (rc -13); its line reaches stderr
    now. A normal exit, where the relay ends because the exit gives fd 2 back, warns of nothing."""
    program = """if True:
        import os, signal, subprocess, sys, time
        from ingest import logs
        logs.setup("info", "json", whole_process=True)
        def parent(p):
            try:  # a process may end between the listing and the read
                with open(f"/proc/{p}/stat") as stat:
                    return stat.read().rsplit(")", 1)[1].split()[1]
            except OSError:
                return None
        if sys.argv[1] == "kill":
            relay = [p for p in os.listdir("/proc") if p.isdigit() and p != str(os.getpid())
                     and parent(p) == str(os.getpid())]
            os.kill(int(relay[0]), signal.SIGKILL)
            time.sleep(1)  # the watcher gives fd 2 back
        child = subprocess.run(["sh", "-c", "echo warn >&2"], check=False)
        print(f"child rc {child.returncode}", file=sys.stderr)
    """
    for how in ("kill", "exit"):
        ran = subprocess.run(
            [sys.executable, "-c", program, how],
            capture_output=True,
            env=clean_env(),
            timeout=60,
            check=False,
        )
        lines = ran.stderr.decode().splitlines()
        assert ran.returncode == 0 and "child rc 0" in lines, lines
        warned = [line for line in lines if "stderr relay" in line]
        if how == "exit":
            assert not warned, lines
            said = [json.loads(line) for line in lines if line.startswith("{")]
            assert ("stderr", "ERROR", "warn") in [(e["logger"], e["level"], e["message"]) for e in said], (
                lines
            )
            continue
        assert "warn" in lines, lines  # raw: no relay to make it JSON
        (warning,) = warned
        assert json.loads(warning)["level"] == "WARNING" and "killed by signal 9" in warning, lines


def test_py4j_lines_logged_through_the_root_logger_keep_to_py4js_level() -> None:
    """A py4j call whose JVM connection breaks (as when a stop signal ends a starting Spark) is retried
    on a new connection, and py4j logs "Exception while sending command." with a traceback at INFO
    through the root logger: at the default level that was a traceback on the operator's stderr."""
    script = """
import logging, socket, sys, threading
from ingest import logs
from py4j.java_gateway import GatewayClient, GatewayParameters

logs.setup("info")
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen(2)

def serve():  # the first connection is answered with nothing, the retry's with "void"
    for answer in (b"", b"!yv\\n"):
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.sendall(answer)
        conn.close()

threading.Thread(target=serve, daemon=True).start()
client = GatewayClient(gateway_parameters=GatewayParameters(port=listener.getsockname()[1]))
print("answer", client.send_command("c\\nt\\ngetX\\ne\\n"), file=sys.stderr)
logging.info("a line of our own through the root logger")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "answer yv" in done.stderr, done.stderr  # retried after the broken connection
    assert "Exception while sending command" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "a line of our own through the root logger" in done.stderr  # the filter is py4j's only
