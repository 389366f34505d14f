"""`sluice serve` and `sluice push` as real subprocesses, plus the CLI's error paths."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from receivers.config import FsyncPolicy
from sluice_client.errors import NEXT_SEQ_METADATA
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import sink_values

# the console script pip installed beside the interpreter: what a user runs
SLUICE = [str(Path(sys.executable).parent / "sluice")]


def sluice(
    *args: str, stdin: bytes | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*SLUICE, *args], input=stdin, capture_output=True, timeout=timeout, check=False)


def wait_for_line(proc: subprocess.Popen[bytes], log: Path, pattern: str, timeout: float) -> re.Match[bytes]:
    """Wait until the process's log (a file: a pipe left unread would block it) has a matching line."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(pattern.encode(), log.read_bytes())
        if match:
            return match
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r}; the log says:\n{log.read_text(errors='replace')}")


@contextlib.contextmanager
def no_spark_serve(tmp_path: Path, data: Path) -> Iterator[str]:
    """`sluice serve --no-spark` on a free port in a subprocess (its stderr in tmp_path/serve.log); its
    target; SIGTERM at the end."""
    log = tmp_path / "serve.log"
    with log.open("wb") as log_file:
        serve = subprocess.Popen(
            [*SLUICE, "serve", "--no-spark", "--port", "0", "--metrics-port", "-1", "--data-dir", str(data)],
            stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        yield wait_for_line(serve, log, r"on (127\.0\.0\.1:\d+)", 60).group(1).decode()
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=60)


@pytest.mark.spark
def test_serve_and_push_subprocesses(tmp_path: Path) -> None:
    data = tmp_path / "data"
    lines = [f"line {i} {'z' * (i % 20)}" for i in range(20_000)]
    source = tmp_path / "input.txt"
    source.write_text("\n".join(lines) + "\n")
    log = tmp_path / "serve.log"
    with log.open("wb") as log_file:
        serve = subprocess.Popen(
            [
                *SLUICE,
                "serve",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--data-dir",
                str(data),
                "--master",
                "local[1]",
                "--trigger-interval",
                "0.5",
            ],
            stderr=log_file,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        match = wait_for_line(serve, log, r"on (127\.0\.0\.1:\d+), metrics on 127\.0\.0\.1:(\d+)/metrics", 60)
        target, metrics_port = match.group(1).decode(), int(match.group(2))
        pushed = sluice("push", str(source), "--target", target)
        assert pushed.returncode == 0, pushed.stderr.decode()
        assert b"pushed 20,000 records" in pushed.stderr
        # and from stdin
        piped = sluice("push", "-", "--target", target, "--no-progress", stdin=b"from stdin 1\nfrom stdin 2")
        assert piped.returncode == 0, piped.stderr.decode()
        expected = sorted([line.encode() for line in lines] + [b"from stdin 1", b"from stdin 2"])
        deadline = time.monotonic() + 180
        while len(sink_values(data / "sink")) < len(expected) and time.monotonic() < deadline:
            assert serve.poll() is None, "serve exited"
            time.sleep(1)
        assert sorted(sink_values(data / "sink")) == expected
        url = f"http://127.0.0.1:{metrics_port}/metrics"
        metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        assert 'sluice_records_received_total{stream="default"} 20002.0' in metrics
        # progress events reach the listener asynchronously, possibly after the sink shows the rows
        deadline = time.monotonic() + 60
        while not re.search(r"^sluice_batches_completed_total [1-9]", metrics, re.M):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.5)
            metrics = urllib.request.urlopen(url, timeout=10).read().decode()
        rate = sluice("rate", "set", "50000", "--pin", "--target", target)
        assert rate.returncode == 0, rate.stderr.decode()
        shown = sluice("rate", "get", "--target", target).stdout.decode()
        assert "rate: 50000 records/s (model, pinned)" in shown
        assert "stream default: 50000 records/s" in shown
        assert "last batch: #" in shown  # the listener fed the controller
        assert "estimator state (its proposals ignored while pinned): " in shown
        bad = sluice("rate", "set", "nan", "--target", target)
        assert bad.returncode == 1
        assert b"INVALID_ARGUMENT" in bad.stderr
        bad = sluice("rate", "estimator", "magic", "--target", target)
        assert bad.returncode == 1 and b"INVALID_ARGUMENT" in bad.stderr
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            code = serve.wait(timeout=120)
        finally:
            serve.kill()
    assert code == 0, log.read_text(errors="replace")
    assert "sluice: stopped" in log.read_text()


def test_version_prints_the_installed_version_without_the_heavy_imports() -> None:
    """`sluice --version` (docs/development.md timed it before it existed): the installed distribution's
    version, exit 0, with none of numpy, pyarrow or pyspark imported (the console script's own path)."""
    from importlib import metadata

    done = sluice("--version")
    assert (done.returncode, done.stdout.decode(), done.stderr) == (
        0,
        f"sluice {metadata.version('sluice')}\n",
        b"",
    )
    assert sluice("--log-level", "debug", "--version").stdout == done.stdout
    script = (
        "import sys\nsys.argv = ['sluice', '--version']\nfrom ingest import console\n"
        "try:\n    console.main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "heavy = ('numpy', 'pyarrow', 'pyspark', 'pandas')\n"
        "print('exit', code, sorted(m for m in heavy if m in sys.modules))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.stdout.splitlines()[-1] == "exit 0 []", (run.stdout, run.stderr)
    assert "--version" in sluice("--help").stdout.decode()


def test_push_to_a_server_that_is_not_there(tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a\n")
    # it waits for a server for up to --timeout seconds (tests/test_process_edge.py), then gives up
    result = sluice("push", str(source), "--target", "127.0.0.1:1", "--no-progress", "--timeout", "1")
    assert result.returncode == 1
    assert b"UNAVAILABLE" in result.stderr


def test_push_with_a_key_separator(tmp_path: Path) -> None:
    """`sluice push --key-separator` against a real `sluice serve --no-spark`: each line cut at its
    first separator, from a file and from stdin; lines without one go without a key, and it says so."""
    data = tmp_path / "data"
    source = tmp_path / "keyed.txt"
    source.write_bytes(b"user-1\tclicked\nuser-2\tviewed\tpage 2\nno separator here\n\tempty key\n")
    with no_spark_serve(tmp_path, data) as target:
        pushed = sluice("push", str(source), "--target", target, "--no-progress", "--key-separator", "\\t")
        assert pushed.returncode == 0, pushed.stderr.decode()
        assert b"pushed 4 records" in pushed.stderr
        assert b"1 of them had no '\\t' and went without a key" in pushed.stderr
        piped = sluice(
            "push",
            "-",
            "--target",
            target,
            "--no-progress",
            "--key-separator",
            "\\x3d>",
            stdin=b"k=>v=>w\n=>",
        )
        assert piped.returncode == 0, piped.stderr.decode()
        assert b"without a key" not in piped.stderr
        for bad, why in [
            ("", "one or more bytes"),
            ("a\nb", "without a newline"),
            ("\\n", "a backslash starts"),
            ("\\x4", "two hex digits"),
            ("a\\", "a backslash starts"),
        ]:
            refused = sluice("push", str(source), "--target", target, f"--key-separator={bad}")
            assert refused.returncode == 2, bad
            assert f"--key-separator {bad!r}: ".encode() in refused.stderr and why.encode() in refused.stderr
    from receivers.wal import WalBlockStore

    store = WalBlockStore(data / "blocks", fsync=FsyncPolicy.off())
    rows = [
        (r["key"], r["value"]) for b in store.blocks("default") for t in store.read(b) for r in t.to_pylist()
    ]
    assert rows == [
        (b"user-1", b"clicked"),
        (b"user-2", b"viewed\tpage 2"),
        (None, b"no separator here"),
        (b"", b"empty key"),
        (b"k", b"v=>w"),
        (b"", b""),
    ]


def test_a_bare_double_dash_as_a_flags_value_is_a_usage_error(tmp_path: Path) -> None:
    """argparse drops a -- given as a value (--stream=--) and stores an empty list: that crashed push
    and rate with a traceback. Now it is a usage error naming the flag; -- still ends the flags."""
    for command in (
        ["push", "-", "--stream=--"],
        ["push", "-", "--producer-id=--"],
        ["push", "-", "--key-separator=--"],
        ["rate", "set", "--target=--", "5"],
    ):
        result = sluice(*command, stdin=b"a\n", timeout=60)
        flag = next(a for a in command if a.endswith("=--")).removesuffix("=--")
        assert result.returncode == 2, command
        assert f"argument {flag}: -- is not a value here".encode() in result.stderr, result.stderr
        # only the separator reads escapes: only it is told how to give -- anyway
        assert (b"write it escaped: '\\x2d\\x2d'" in result.stderr) == (flag == "--key-separator")
        assert b"Traceback" not in result.stderr
    source = tmp_path / "in.txt"  # -- before the file still ends the flags
    source.write_text("a\n")
    result = sluice("push", "--target", "127.0.0.1:1", "--timeout", "0.5", "--", str(source), timeout=60)
    assert result.returncode == 1 and b"UNAVAILABLE" in result.stderr, result.stderr


def test_a_negative_number_reaches_the_commands_own_check(tmp_path: Path) -> None:
    """argparse read `rate set -inf` (or -nan, -1e3) as an unknown flag and said "the following
    arguments are required: RATE"; the server's own check refuses it now, saying why."""
    with no_spark_serve(tmp_path, tmp_path / "data") as target:
        for command in (["rate", "set", "-inf"], ["rate", "set", "-nan"], ["rate", "bounds", "-1e3", "5"]):
            refused = sluice(*command, "--target", target)
            assert refused.returncode == 1, (command, refused.stderr)
            assert b"INVALID_ARGUMENT" in refused.stderr and b"required" not in refused.stderr, refused.stderr


def test_push_a_missing_file() -> None:
    result = sluice("push", "/nonexistent/file.txt")
    assert result.returncode == 2
    assert b"cannot read /nonexistent/file.txt" in result.stderr


def test_serve_rejects_a_bad_pipeline(tmp_path: Path) -> None:
    result = sluice("serve", "--data-dir", str(tmp_path), "--pipeline", "no_such_module:f")
    assert result.returncode == 2
    assert b"no module named 'no_such_module'" in result.stderr


def test_serve_rejects_a_bad_fsync_policy(tmp_path: Path) -> None:
    for bad in ("sometimes", "interval:0", "interval:x", "interval:99999999999"):
        result = sluice("serve", "--data-dir", str(tmp_path), "--fsync", bad)
        assert result.returncode == 2
        assert b"argument --fsync: invalid fsync policy" in result.stderr
    both = sluice("serve", "--data-dir", str(tmp_path), "--fsync", "off", "--no-fsync")
    assert both.returncode == 2 and b"not allowed with" in both.stderr


def test_serve_parses_fsync_policies() -> None:
    from ingest.cli import _parser

    def policy(*flags: str) -> FsyncPolicy:
        parsed: FsyncPolicy = _parser().parse_args(["serve", *flags]).fsync
        return parsed

    assert policy() == FsyncPolicy.every_block()
    assert policy("--fsync", "interval:20") == FsyncPolicy.interval(20)
    assert policy("--fsync", "off") == policy("--no-fsync") == FsyncPolicy.off()


def test_serve_without_java_says_how_to_get_it(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = str(Path(sys.executable).parent)  # python only, no java
    result = subprocess.run(
        [*SLUICE, "serve", "--data-dir", str(tmp_path)], capture_output=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 2
    assert b"Java" in result.stderr and b"apt-get install openjdk-17" in result.stderr


def test_serve_on_a_busy_port_fails_clearly(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        grpc_busy = sluice(
            "serve", "--no-spark", "--port", port, "--metrics-port", "-1", "--data-dir", str(tmp_path)
        )
        metrics_busy = sluice(
            "serve", "--no-spark", "--port", "0", "--metrics-port", port, "--data-dir", str(tmp_path)
        )
    assert grpc_busy.returncode == 1
    assert f"cannot bind gRPC to 127.0.0.1:{port}".encode() in grpc_busy.stderr
    assert b"Traceback" not in grpc_busy.stderr
    assert metrics_busy.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}".encode() in metrics_busy.stderr
    assert b"Traceback" not in metrics_busy.stderr


def test_serve_parses_sizes() -> None:
    from ingest.cli import _parser
    from ingest.config import ServeConfig
    from receivers.config import ReceiverConfig
    from receivers.sizes import parse_size

    assert parse_size("1048576") == 1 << 20
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("2 GiB") == 2 << 30
    assert parse_size("100MB") == 100_000_000
    assert parse_size("64kib") == 65_536
    assert parse_size("7B") == 7
    args = _parser().parse_args(["serve", "--buffer-bytes", "64MiB", "--disk-budget", "2GiB"])
    assert (args.buffer_bytes, args.disk_budget, args.segment_bytes) == (64 << 20, 2 << 30, None)
    defaults = _parser().parse_args(["serve"])
    assert (defaults.buffer_bytes, defaults.disk_budget) == (256 << 20, None)
    # "none" as `config set` takes it, for both budgets
    none = _parser().parse_args(["serve", "--disk-budget", "none", "--memory-budget", "None"])
    assert (none.disk_budget, none.memory_budget) == (None, None)
    # segments default to a quarter of a small disk budget, so Spark's release can free room
    small = ServeConfig(receiver=ReceiverConfig(disk_budget_bytes=100 << 20))
    assert small.wal_segment_bytes == 25 << 20
    assert ServeConfig().wal_segment_bytes == 64 << 20
    assert ServeConfig(segment_bytes=1 << 20, receiver=small.receiver).wal_segment_bytes == 1 << 20


def test_serve_rejects_bad_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ingest.cli import _parser

    for flag in ("--buffer-bytes", "--disk-budget", "--segment-bytes"):
        for bad in ("lots", "12XB", "-5", "1.5GiB", "0"):
            with pytest.raises(SystemExit) as exited:
                _parser().parse_args(["serve", flag, bad])
            assert exited.value.code == 2, (flag, bad)
            assert f"argument {flag}:" in capsys.readouterr().err
    result = sluice("serve", "--no-spark", "--data-dir", str(tmp_path), "--disk-budget", "12XB")
    assert result.returncode == 2
    assert b"argument --disk-budget: invalid size '12XB'" in result.stderr
    tiny = sluice("serve", "--no-spark", "--data-dir", str(tmp_path), "--segment-bytes", "100")
    assert tiny.returncode == 2 and b"--segment-bytes must be >= 4096" in tiny.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["sessions", "cancel", str(2**64)], b"a session id is in 1..18446744073709551615"),
        (["sessions", "cancel", "-1"], b"a session id is in 1.."),
        (["sessions", "cancel", "5", "--code", str(2**31)], b"a status code is in"),
        # 0 went as the proto's unset code: the session ended CANCELLED, though the server says 1-16
        (["sessions", "cancel", "5", "--code", "0"], b"a status code is in 1..16, got 0"),
        (["sessions", "cancel", "5", "--code", "17"], b"a status code is in 1..16, got 17"),
        (["push", "-", "--batch-size", "99999999999"], b"--batch-size must be 1..500,000"),
        (
            ["push", "-", "--producer-id", "p", "--resume-from", str(2**64 - 1)],
            b"cannot push with these flags",
        ),
    ],
)
def test_values_the_wire_cannot_carry_are_usage_errors(args: list[str], says: bytes) -> None:
    # they failed with a protobuf or SDK stack trace (exit 1), before any connection was tried
    result = sluice(*args, "--target", "127.0.0.1:1", stdin=b"x\n", timeout=60)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and b"Traceback" not in result.stderr, result.stderr


def test_a_bad_node_list_is_said_in_its_own_words(tmp_path: Path) -> None:
    """A node list's errors name its file and line; the word "port" in them is not the --port flag
    (the serve errors' renaming of field names to flags turned it into "--port 99999")."""
    nodes = tmp_path / "nodes.txt"
    nodes.write_text("0 127.0.0.1:99999\n")
    for role in (["--role", "receiver", "--node-id", "0", "--port", "51101"], ["--role", "driver"]):
        result = sluice("serve", *role, "--nodes", str(nodes), "--data-dir", str(tmp_path / "d"), timeout=60)
        assert result.returncode == 2, result.stderr
        assert f"{nodes}, line 1: port 99999 is not 1-65535".encode() in result.stderr, result.stderr
        assert b"Traceback" not in result.stderr


def test_pipeline_swap_refuses_a_blank_pipeline() -> None:
    """`sluice pipeline swap "$SPEC"` with SPEC unset swapped the running pipeline for the built-in
    Parquet sink (the API's ""); the built-in one is asked for by name."""
    for blank in ("", "  "):
        result = sluice("pipeline", "swap", blank, "--target", "127.0.0.1:1", timeout=60)
        assert result.returncode == 2, result.stderr
        assert b"an empty pipeline (an unset variable?)" in result.stderr, result.stderr
        assert b"Traceback" not in result.stderr


def test_arguments_and_files_that_are_not_utf8_are_usage_errors(tmp_path: Path) -> None:
    """Bytes that are not UTF-8 in a stream name, a setting or a config file ended in a
    UnicodeEncodeError or UnicodeDecodeError traceback; now each is a one-line usage error."""
    for command in (
        [b"config", b"get", b"--target", b"127.0.0.1:1", b"\xff"],
        [b"rate", b"estimator", b"--target", b"127.0.0.1:1", b"\xff"],
        [b"push", b"-", b"--target", b"127.0.0.1:1", b"--timeout", b"1", b"--stream", b"s\xff"],
    ):
        result = subprocess.run(
            [os.fsencode(SLUICE[0]), *command], input=b"a\n", capture_output=True, timeout=60, check=False
        )
        assert result.returncode == 2, (command, result.stderr)
        assert b"an argument is not UTF-8 text: '" in result.stderr and b"\\xff" in result.stderr
        assert b"Traceback" not in result.stderr
    config = tmp_path / "bad.toml"
    config.write_bytes(b"\xff\xfe = 1\n")
    result = sluice("config", "check", "--no-spark", "--config", str(config), timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"config file {config}: not UTF-8 text".encode() in result.stderr, result.stderr


def test_status_pointed_at_a_port_that_is_not_http_says_so() -> None:
    """`sluice status --metrics http://HOST:GRPC_PORT` ended in an http.client.BadStatusLine traceback."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer_garbage() -> None:
        with contextlib.suppress(OSError):
            connection, _ = listener.accept()
            with connection:
                connection.recv(1024)
                connection.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00 not http\r\n\r\n")

    thread = threading.Thread(target=answer_garbage, daemon=True)
    thread.start()
    try:
        result = sluice("status", "--once", "--metrics", f"http://127.0.0.1:{port}", timeout=60)
    finally:
        listener.close()
    assert result.returncode == 1, result.stderr
    assert b"no HTTP server answers there (a gRPC port?)" in result.stderr, result.stderr
    assert b"Traceback" not in result.stderr


def test_a_metrics_port_below_minus_one_is_refused(tmp_path: Path) -> None:
    """-1 turns /metrics off; -2 was taken as off too."""
    result = sluice("serve", "--no-spark", "--data-dir", str(tmp_path), "--metrics-port", "-2", timeout=60)
    assert result.returncode == 2, result.stderr
    assert b"argument --metrics-port: a port is 0..65535 (0: any; -1: off), got -2" in result.stderr


def test_a_push_failure_a_rerun_cannot_mend_is_told_apart_through_close() -> None:
    """close() wraps what stopped delivery in UnackedRecordsError: its cause decides."""
    from ingest.cli import _permanent
    from sluice_client.errors import RPCError, UnackedRecordsError

    refused = RPCError(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    away = RPCError(grpc.StatusCode.UNAVAILABLE, "restarting")
    assert _permanent(refused) and not _permanent(away)
    assert _permanent(UnackedRecordsError([(b"x", None)], 0, refused))
    assert not _permanent(UnackedRecordsError([(b"x", None)], 0, away))


def test_ctrl_c_during_a_pipeline_swap_says_it_goes_on_on_the_server(tmp_path: Path) -> None:
    """Ctrl-C of `sluice pipeline swap` ended it with exit 130 and not a word, while the swap goes on on
    the server to its end (past its deadline the CLI said so, and how to see the outcome). It says the
    same on Ctrl-C now; before the connection is up, that nothing was asked. The server here is a real
    gRPC server on loopback whose Admin.SwapPipeline holds the call, as a swap does for its first batch
    (a `--no-spark` server refuses a swap at once, and Spark would take tens of seconds to start)."""
    from concurrent import futures
    from threading import Event

    import grpc

    from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
    from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

    asked, ended = Event(), Event()

    class Swapping(pb_grpc.AdminServicer):
        def SwapPipeline(
            self, request: pb.SwapPipelineRequest, context: grpc.ServicerContext
        ) -> pb.PipelineView:
            asked.set()
            context.add_callback(ended.set)
            ended.wait(60)
            return pb.PipelineView()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AdminServicer_to_server(Swapping(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    silent = socket.create_server(("127.0.0.1", 0))  # takes connections, never speaks HTTP/2
    try:
        for target, says in (
            (
                f"127.0.0.1:{port}",
                "interrupted; the swap goes on on the server to its end (done, or rolled back to the old "
                f"pipeline): `sluice pipeline get --target 127.0.0.1:{port}` shows its outcome",
            ),
            (
                f"127.0.0.1:{silent.getsockname()[1]}",
                "interrupted before the connection was up: nothing was asked",
            ),
        ):
            log = tmp_path / "swap.log"
            with log.open("wb") as out:
                swap = subprocess.Popen(
                    [*SLUICE, "pipeline", "swap", "swap_pipelines:tag_b", "--target", target], stderr=out
                )
            held = contextlib.ExitStack()
            try:
                if target.endswith(f":{port}"):
                    assert asked.wait(60), log.read_text()
                else:  # connected, waiting for the server's HTTP/2 settings
                    silent.settimeout(60)
                    held.enter_context(silent.accept()[0])
                swap.send_signal(signal.SIGINT)
                code = swap.wait(60)
            finally:
                held.close()
                if swap.poll() is None:
                    swap.kill()
                    swap.wait()
            said = log.read_text()
            assert code == 130, said
            assert said == f"sluice: pipeline swap on {target}: {says}\n", said
            if target.endswith(f":{port}"):
                assert ended.wait(60)  # the call ended on the server's side: the client went away
    finally:
        silent.close()
        ended.set()
        server.stop(None)


_DYING_SWAP_SERVER = """
import sys, time
from concurrent import futures
import grpc
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

class Swapping(pb_grpc.AdminServicer):
    def SwapPipeline(self, request, context):
        print("asked", flush=True)
        time.sleep(120)

server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
pb_grpc.add_AdminServicer_to_server(Swapping(), server)
print(server.add_insecure_port("127.0.0.1:0"), flush=True)
server.start()
server.wait_for_termination()
"""


def test_a_server_that_dies_mid_swap_gets_no_tls_hint(tmp_path: Path) -> None:
    """An outside tester: `sluice pipeline swap` whose server died mid-swap printed "UNAVAILABLE: Stream
    removed (Socket closed) (if the server serves TLS, give its CA: --ca-file ...)": a TLS hint for a
    connection that was up (the call had reached the server), and not a word of the swap's outcome,
    which the server may have reached. The hint is only for a connection that never came up now, and
    such a failure says to check the outcome with `sluice pipeline get`, as a Ctrl-C does."""
    server = subprocess.Popen(
        [sys.executable, "-c", _DYING_SWAP_SERVER], stdout=subprocess.PIPE, text=True, env=_no_tls_env()
    )
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        target = f"127.0.0.1:{port}"
        swap = subprocess.Popen(
            [*SLUICE, "pipeline", "swap", "swap_pipelines:tag_b", "--target", target],
            stderr=subprocess.PIPE,
            text=True,
            env=_no_tls_env(),
        )
        try:
            assert server.stdout.readline().strip() == "asked"
            server.kill()  # the server dies mid-swap
            _, said = swap.communicate(timeout=60)
        finally:
            if swap.poll() is None:
                swap.kill()
                swap.wait()
        assert swap.returncode == 1, said
        assert said.startswith(f"sluice: pipeline swap on {target}: UNAVAILABLE"), said
        assert "--ca-file" not in said and "TLS" not in said, said
        assert "the connection dropped after the call went out" in said, said
        assert f"`sluice pipeline get --target {target}` shows its outcome" in said, said
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()
        if server.stdout is not None:
            server.stdout.close()
    # plaintext to a TLS port (never up) keeps its hint: tests/test_tls.py, test_plaintext_client_...


def _no_tls_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}


class _RefusingIngest:
    """A Publish that refuses every Open ALREADY_EXISTS with `message` and, unless None, `next_seq` in
    the trailing metadata (an older server sends no such thing)."""

    def __init__(self, message: str, next_seq: str | None) -> None:
        self.message = message
        self.next_seq = next_seq

    def Publish(self, requests: Iterator[object], context: Any) -> Iterator[object]:
        next(requests)  # the Open
        if self.next_seq is not None:
            context.set_trailing_metadata(((NEXT_SEQ_METADATA, self.next_seq),))
        context.abort(grpc.StatusCode.ALREADY_EXISTS, self.message)
        yield from ()


@contextlib.contextmanager
def refusing_ingest(message: str, next_seq: str | None) -> Iterator[str]:
    """A gRPC server on loopback whose Publish refuses a new run (see _RefusingIngest); its target."""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_IngestServicer_to_server(_RefusingIngest(message, next_seq), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)


# the words of the servers before the next sequence number was sent as such
OLD_WORDS = (
    "producer 'p-1' already has records on stream 'default': the next sequence number it expects of it is "
    "100, and this new run starts at 0, so its records 0..99 would be dropped as duplicates of the earlier "
    "run's. To go on after that run, start at 100 (first_seq=100; sluice push: --resume-from 100 with the "
    "same input); to resend an earlier run's records from where its acks ended, resume (resume=True); "
    "else use a new producer id"
)


@pytest.mark.parametrize(
    ("message", "next_seq", "says", "not_said"),
    [
        pytest.param(
            "taken: the id's earlier run is held, worded as this server words it",
            "12",
            [
                "ALREADY_EXISTS: producer 'p-1' already has records on stream 'default': the server expects "
                "its sequence number 12 next",
                "run it again with --resume-from 12 (it skips the input's first 12 lines)",
                "for a new input, use another --producer-id",
            ],
            ["worded as this server words it"],
            id="next-seq-sent",
        ),
        pytest.param(
            OLD_WORDS,
            None,
            [f"ALREADY_EXISTS: {OLD_WORDS}"],
            ["the server expects its sequence number", "run it again with --resume-from"],
            id="older-server",
        ),
        pytest.param(
            OLD_WORDS,
            "-5; rm -rf /",  # not a sequence number: never put into a command line
            [f"ALREADY_EXISTS: {OLD_WORDS}"],
            ["the server expects its sequence number", "rm -rf"],
            id="not-a-number",
        ),
    ],
)
def test_a_refused_new_run_takes_the_number_the_server_sent_not_its_words(
    tmp_path: Path, message: str, next_seq: str | None, says: list[str], not_said: list[str]
) -> None:
    """The push put the server's refusal in its own terms by matching a regular expression over the
    message text: a server that worded it otherwise lost the advice, and one that sent a changed number
    in the text steered the command. It takes the number the server sends as such (RPCError.next_seq,
    trailing metadata) and shows an older server's refusal, without it, in that server's words."""
    source = tmp_path / "in.txt"
    source.write_text("a\nb\n")
    with refusing_ingest(message, next_seq) as target:
        result = sluice("push", str(source), "--target", target, "--producer-id", "p-1", "--no-progress")
    stderr = result.stderr.decode()
    assert result.returncode == 1, stderr
    assert "no record was sent: fix the cause first" in stderr, stderr
    for text in says:
        assert text in stderr, stderr
    for text in not_said:
        assert text not in stderr, stderr


def test_rate_get_says_unlimited_and_unknown_never_inf_or_nan(capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice rate get` said the rate was "unlimited" but its estimator state "rate=inf, max_rate=inf",
    a node's measured rate and a batch's delays printed "inf" or "nan" raw, a NaN rate (a broken
    server's) was "nan" and -inf "unlimited", and a rate of a million was "1.23457e+06". Infinite rates
    are "unlimited" everywhere, what is no number "unknown", and no number has an exponent."""
    from ingest.cli import _show_rate
    from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

    inf, nan = math.inf, math.nan
    status = pb.RateStatus(
        records_per_second=inf,
        min_rate=100,
        max_rate=inf,
        estimator="model",
        estimator_state={
            "rate": "inf",
            "max_rate": "inf",
            "capacity_rps": "nan",
            "noise": "nan",
            "fit": "none",
        },
        streams=[
            pb.StreamRate(stream="a", records_per_second=1234567.0),
            pb.StreamRate(stream="b", records_per_second=nan),
            pb.StreamRate(stream="c", records_per_second=-inf),
            pb.StreamRate(
                stream="d",
                records_per_second=500,
                share_reason="busy",
                busy=True,
                taken_per_second=nan,
                min_rate=10,
                max_rate=inf,
            ),
        ],
        nodes=[pb.NodeRate(node_id=1, target="n1:1", up=True, records_per_second=inf, taken_per_second=inf)],
        last_batch=pb.BatchMetrics(
            batch_id=3,
            records=10,
            processing_delay_seconds=nan,
            scheduling_delay_seconds=0.25,
            batch_interval_seconds=1,
        ),
    )
    assert _show_rate(status) == 0
    out = capsys.readouterr().out
    assert re.search(r"\b(inf|nan|Infinity|NaN)\b", out, re.IGNORECASE) is None, out
    assert "e+06" not in out, out
    lines = out.splitlines()
    assert lines[0] == "rate: unlimited records/s (model)", out
    assert lines[1] == "bounds: 100 .. unlimited records/s", out
    assert "stream a: 1234567 records/s" in lines, out
    assert "stream b: unknown records/s" in lines and "stream c: unknown records/s" in lines, out
    assert "stream d: 500 records/s (busy, takes unknown records/s; its bounds 10 .. unlimited)" in lines, out
    node = next(line for line in lines if line.strip().startswith("1 "))
    assert node.split()[:5] == ["1", "n1:1", "up", "unlimited", "unlimited"], out
    state = (
        "estimator state: capacity_rps=unknown, fit=none, max_rate=unlimited, noise=unknown, rate=unlimited"
    )
    assert state in lines, out
    assert "processing unknown, scheduling delay 0.250 s, interval 1 s" in out, out


def test_config_set_and_reset_wait_as_long_as_a_restart_may_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """`config set` and `config reset` waited 300 s, while the restart a new trigger interval makes is
    bounded on the server as a swap is (the boundary, the first batch, three stops: 360 s, and the
    queries' starts; `pipeline swap` waits 420 s): a restart that was rolled back ended the command
    with "no answer" first. They wait a swap's deadline for the default first-batch timeout now."""
    import ingest.cli as cli
    from ingest.pipeline_control import BOUNDARY_TIMEOUT, DEFAULT_FIRST_BATCH_TIMEOUT, STOP_TIMEOUT
    from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

    server_bound = BOUNDARY_TIMEOUT + DEFAULT_FIRST_BATCH_TIMEOUT + cli.SWAP_STOPS * STOP_TIMEOUT
    assert cli.config_change_deadline() == cli.swap_deadline(DEFAULT_FIRST_BATCH_TIMEOUT)
    assert cli.config_change_deadline() > server_bound
    assert cli.config_change_deadline() == 420  # as the defaults stand: 60 + 120 + 3 x 60 + 60

    waits: list[tuple[str, float, str]] = []

    def unary(
        args: object, what: str, call: object, *, timeout: float = 10.0, late: str = "", dropped: str = ""
    ) -> object:
        waits.append((what, timeout, late))
        assert "`sluice config get --target 127.0.0.1:50051` shows what is in force" in dropped
        return pb.ConfigView()

    monkeypatch.setattr(cli, "_unary", unary)
    parser = cli._parser()
    for argv in (["config", "set", "trigger-interval=2"], ["config", "reset", "trigger-interval"]):
        args = parser.parse_args([*argv, "--target", "127.0.0.1:50051"])
        assert args.run(args) == 0
    assert [(what, timeout) for what, timeout, _ in waits] == [
        ("config set", cli.config_change_deadline()),
        ("config reset", cli.config_change_deadline()),
    ]
    assert all("the change goes on on the server" in late for _, _, late in waits), waits


def test_config_set_refuses_a_setting_named_twice(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside tester: `config set block-interval=0.5 block-interval=0.3` sent the last value (the
    request's map keeps one a key) and it was saved, also with --validate-only. Refused before sending."""
    import ingest.cli as cli

    sent: list[str] = []
    monkeypatch.setattr(cli, "_unary", lambda *a, **k: sent.append("sent"))
    for extra in ([], ["--validate-only"]):
        argv = ["config", "set", "block-interval=0.5", "max-rate=10", "block-interval=0.3", *extra]
        assert cli.main([*argv, "--target", "127.0.0.1:1"]) == cli.EXIT_USAGE
        assert "names setting 'block-interval' twice" in capsys.readouterr().err
    assert sent == []


def test_serve_refuses_a_file_size_limit_below_the_segment_size(tmp_path: Path) -> None:
    """An outside tester: under `ulimit -f 2048` (2 MiB) the server started, and writing block 0 failed
    with EFBIG every 0.2 s for good. `serve` checks RLIMIT_FSIZE against --segment-bytes at start."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048 * 1024, hard))

    serve = [*SLUICE, "serve", "--no-spark", "--port", "0", "--data-dir", str(tmp_path / "d")]
    done = subprocess.run(
        [*serve, "--segment-bytes", "4MiB"],
        check=False,
        preexec_fn=limited,  # only setrlimit, before exec
        capture_output=True,
        text=True,
        timeout=120,
        env=_no_tls_env(),
    )
    assert done.returncode == 1, done.stderr
    said = done.stderr
    assert "cannot start the server: the file size limit (RLIMIT_FSIZE, `ulimit -f`: 2,097,152 bytes)" in said
    assert "below the block log's segment size (4,194,304 bytes, --segment-bytes)" in said, said
    assert "Traceback" not in said, said


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("::1", "an IPv6 host goes in brackets, [::1]:PORT\n"),
        ("fe80::1:50051", "an IPv6 host goes in brackets, [fe80::1]:50051\n"),
        ("[::1", "invalid target '[::1': the IPv6 host's '[' has no ']'\n"),
        ("[::1]x:5", "invalid target '[::1]x:5': use '[ipv6]:port'\n"),
    ],
)
def test_an_ipv6_target_without_brackets_gets_a_hint_that_is_one(
    target: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An outside tester's `--target ::1`: split at its last colon into host ":" and port 1, it was told
    "an IPv6 host goes in brackets, [:]" (and `[::1`, "[[:]"). The hint is the address bracketed now,
    and a bracket left open or text after it is named as such."""
    import ingest.cli as cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["rate", "get", "--target", target])
    assert exited.value.code == cli.EXIT_USAGE
    assert said in capsys.readouterr().err
