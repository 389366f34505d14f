"""What `sluice serve` writes on stderr: lifecycle lines, no Spark noise, no stack trace on a clean stop,
and with --log-format json nothing but JSON lines (Spark's JVM and its Python workers included)."""

from __future__ import annotations

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
        serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(timeout=180)
        finally:
            serve.kill()
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
    assert sum("Handshake failed" in line for line in asked) >= 20, asked
