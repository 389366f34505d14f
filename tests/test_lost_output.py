"""Output that cannot be written: a stderr whose reader went away (EPIPE: `2>&1 | head`, a log collector
that died) or a stdout or stderr on a full disk (ENOSPC, here /dev/full). What a command does must not
depend on it: a server serves on and stops cleanly, a push sends everything and exits with its own
outcome, and a command whose output is lost says so with exit 1, never a traceback or exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from support import running_server
from test_cli import SLUICE
from test_process_edge import Serve, free_port, no_spark, servers, stored_values

from ingest.spark.session import _copy_lines
from sluice_client import Producer

__all__ = ["servers"]  # the fixture, used by name

FULL = "/dev/full"
"""Every write fails with ENOSPC, as on a full disk."""


@contextlib.contextmanager
def unread_pipe() -> Iterator[int]:
    """The write end of a pipe whose read end is closed already: every write fails with EPIPE."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        yield write_fd
    finally:
        os.close(write_fd)


@contextlib.contextmanager
def lost_output(kind: str) -> Iterator[int]:
    if kind == "unread-pipe":
        with unread_pipe() as fd:
            yield fd
    else:
        fd = os.open(FULL, os.O_WRONLY)
        try:
            yield fd
        finally:
            os.close(fd)


def push_into(
    fd: int, path: Path, port: int, *flags: str, timeout: float
) -> subprocess.CompletedProcess[bytes]:
    """`sluice push PATH` to 127.0.0.1:`port` with its stdout and stderr on `fd`."""
    command = [*SLUICE, "push", str(path), "--target", f"127.0.0.1:{port}", *flags]
    return subprocess.run(command, stdout=fd, stderr=fd, timeout=timeout, check=False)


def stop(serve: subprocess.Popen[bytes]) -> int:
    """SIGTERM `serve` and give its exit code."""
    serve.send_signal(signal.SIGTERM)
    return serve.wait(timeout=60)


def kill(serve: subprocess.Popen[bytes]) -> None:
    """SIGKILL what is left of `serve`'s process group (a test that failed before stopping it)."""
    if serve.poll() is None:
        os.killpg(serve.pid, signal.SIGKILL)
        serve.wait(timeout=30)


def wait_for_port(proc: subprocess.Popen[bytes], port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"the server ended (exit {proc.returncode}) before it served"
            with contextlib.suppress(grpc.FutureTimeoutError):
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
    raise AssertionError(f"the server did not serve on port {port} within {timeout} s")


@pytest.mark.parametrize("kind", ["unread-pipe", "full-disk"])
def test_a_server_whose_stderr_cannot_be_written_serves_and_stops_cleanly(tmp_path: Path, kind: str) -> None:
    # stderr unread from the start: the "starting" line already fails. A BrokenPipeError there ended the
    # server with exit 0 before it served; at the "serving" line, without stopping the server it started
    port, data = free_port(), tmp_path / "data"
    (tmp_path / "in.txt").write_text("".join(f"{i}\n" for i in range(1000)))
    with lost_output(kind) as fd:
        serve = subprocess.Popen(
            [*SLUICE, "serve", *no_spark(port, data)],
            stdout=fd,
            stderr=fd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        wait_for_port(serve, port)
        push = subprocess.run(
            [*SLUICE, "push", str(tmp_path / "in.txt"), "--target", f"127.0.0.1:{port}", "--timeout", "30"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert push.returncode == 0, push.stderr
        time.sleep(0.5)  # lines logged meanwhile (a session's end) fail too
        assert serve.poll() is None
        assert stop(serve) == 0
    finally:
        kill(serve)
    assert sorted(stored_values(data)) == sorted(f"{i}".encode() for i in range(1000))


@pytest.mark.parametrize("kind", ["unread-pipe", "full-disk"])
def test_a_push_whose_stderr_cannot_be_written_sends_everything(
    tmp_path: Path, servers: list[Serve], kind: str
) -> None:
    # the progress line on a stderr no one read raised BrokenPipeError, which the CLI takes for a reader of
    # stdout gone away: a push of 1,000,000 lines ended with exit 0 after 504,096 of them. On a full disk
    # it ended with exit 1 and a traceback no one could read. Throttled, so that the push lasts some
    # seconds, and of lines long enough that the input is read in many chunks: progress lines are written
    # mid-way (at most one per chunk read), not only the last one
    port, data = free_port(), tmp_path / "data"
    throttled = ("--block-interval", "0.05", "--initial-rate", "100000")
    serve = Serve(tmp_path, "serve", *no_spark(port, data, *throttled))
    servers.append(serve)
    serve.wait_serving()
    lines = 200_000
    (tmp_path / "in.txt").write_text("".join(f"{i:064}\n" for i in range(lines)))
    with lost_output(kind) as fd:
        push = push_into(fd, tmp_path / "in.txt", port, "--producer-id", "p", timeout=300)
    assert push.returncode == 0
    stored = stored_values(data)
    assert len(stored) == lines
    assert max(stored.values()) == 1


def test_a_failed_push_whose_stderr_no_one_reads_exits_1_not_0(tmp_path: Path) -> None:
    # its error line met EPIPE, and the BrokenPipeError made the failed push's exit 0
    (tmp_path / "in.txt").write_text("a\n")
    with unread_pipe() as fd:
        push = push_into(fd, tmp_path / "in.txt", free_port(), "--timeout", "1", timeout=120)
    assert push.returncode == 1


@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.parametrize(
    "command",
    [["token"], ["config", "check", "--no-spark"], ["--version"]],
    ids=["token", "check", "version"],
)
def test_a_command_whose_stdout_is_a_full_disk_says_so(
    tmp_path: Path, command: list[str], buffered: bool
) -> None:
    # unbuffered: a traceback from the print that met ENOSPC; buffered: 'Exception ignored' at the exit,
    # exit 120, and `sluice token` had shown the hash of a token that never got out
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    args = [*command, "--data-dir", str(tmp_path / "data")] if command[0] == "config" else command
    with open(FULL, "wb") as full:
        done = subprocess.run(
            [*SLUICE, *args], stdout=full, stderr=subprocess.PIPE, env=env, timeout=120, check=False
        )
    said = done.stderr.decode()
    assert done.returncode == 1, said
    assert "No space left on device" in said
    assert "Traceback" not in said
    assert "Exception ignored" not in said
    assert "token_sha256" not in said


def test_the_copy_of_sparks_stderr_goes_on_reading_when_its_output_fails() -> None:
    # the copier thread ended at its first failed write and closed the pipe's read end with it: Spark's
    # JVM and its Python workers then wrote their stderr into a pipe no one read (EPIPE, or SIGPIPE)
    read_fd, write_fd = os.pipe()
    with unread_pipe() as out:
        copier = threading.Thread(target=_copy_lines, args=(read_fd, os.dup(out), False), daemon=True)
        copier.start()
        with os.fdopen(write_fd, "wb") as source:  # a JVM's stderr: far more than a pipe holds
            for i in range(20_000):
                source.write(f"a line of the JVM's stderr, number {i}\n".encode())
            source.flush()
        copier.join(timeout=30)
        assert not copier.is_alive()


def test_a_server_started_with_stdin_stdout_and_stderr_closed_keeps_them_off_its_files(
    tmp_path: Path,
) -> None:
    # left closed, the next files opened took their numbers: the data dir's lock file was fd 1 and gRPC's
    # epoll fd 2, and what wrote on them below Python (gRPC's C core, Spark's JVM and every child, which
    # inherit them) wrote into those
    port, data = free_port(), tmp_path / "data"
    (tmp_path / "in.txt").write_text("".join(f"{i}\n" for i in range(100)))
    command = shlex.join([*SLUICE, "serve", *no_spark(port, data)])
    serve = subprocess.Popen(["/bin/sh", "-c", f"exec {command} <&- >&- 2>&-"], start_new_session=True)
    try:
        wait_for_port(serve, port)
        assert [os.readlink(f"/proc/{serve.pid}/fd/{fd}") for fd in (0, 1, 2)] == [os.devnull] * 3
        push = subprocess.run(
            [*SLUICE, "push", str(tmp_path / "in.txt"), f"--target=127.0.0.1:{port}", "--timeout=30"],
            capture_output=True,
            timeout=120,
            check=False,
        )
        assert push.returncode == 0, push.stderr
        assert stop(serve) == 0
    finally:
        kill(serve)
    assert len(stored_values(data)) == 100
    assert (data / "sluice.lock").read_text().strip().isdigit()  # its pid, nothing written over it


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (["token"], "sluice: cannot write the output on stdout: it is closed"),
        (["--version"], "sluice: cannot write the version: stdout is closed"),
    ],
)
def test_a_command_whose_stdout_is_closed_says_so(command: list[str], says: str) -> None:
    # print() to the None that Python makes of a closed stdout does nothing: `sluice token >&-` exited 0
    # and showed the hash of a token that went nowhere
    done = subprocess.run(
        ["/bin/sh", "-c", f"exec {shlex.join([*SLUICE, *command])} >&-"],
        stderr=subprocess.PIPE,
        timeout=120,
        check=False,
    )
    said = done.stderr.decode()
    assert done.returncode == 1, said
    assert says in said
    assert "token_sha256" not in said
    assert "Traceback" not in said


@pytest.mark.parametrize("command", [["sessions", "list"], ["status", "--once"]], ids=["sessions", "status"])
async def test_a_name_the_outputs_encoding_lacks_is_escaped_not_a_traceback(
    tmp_path: Path, command: list[str]
) -> None:
    # a producer id is the client's to choose: with an output encoding without it (PYTHONIOENCODING=ascii,
    # a Latin-1 locale) `sluice sessions list` and `sluice status` ended in a UnicodeEncodeError traceback
    async with (
        running_server(tmp_path / "d", "s") as server,
        Producer(server.target, stream="s", producer_id="prödücer-☃") as producer,
    ):
        await producer.send(b"x")
        await producer.flush()
        env = {**os.environ, "PYTHONIOENCODING": "ascii"}
        shown = await asyncio.to_thread(
            subprocess.run,
            [*SLUICE, *command, "--target", server.target],
            capture_output=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert shown.returncode == 0, shown.stderr.decode()
    assert b"pr\\xf6d\\xfccer-\\u2603" in shown.stdout
    assert b"Traceback" not in shown.stderr


_FDS_AFTER_MAIN = (
    "import os, sys\n"
    "from ingest import cli\n"
    "before = set(os.listdir('/proc/self/fd'))\n"
    "try:\n"
    "    code = cli.main(sys.argv[1:], whole_process=True)\n"
    "except SystemExit as exit:\n"
    "    code = exit.code\n"
    "after = set(os.listdir('/proc/self/fd'))\n"
    "print('exit', code, 'opened', sorted(after - before), file=sys.stderr)\n"
)


@pytest.mark.parametrize("command", [["token"], ["--version"]], ids=["token", "version"])
def test_a_reader_gone_from_stdout_leaves_no_descriptor_open(command: list[str]) -> None:
    # main()'s and --version's BrokenPipe branches pointed stdout at /dev/null with
    # os.dup2(os.open(os.devnull, ...), 1), and the descriptor os.open gave stayed open: one leaked
    # per reader gone (logs.point_at_devnull opens, puts in place and closes)
    with unread_pipe() as fd:
        done = subprocess.run(
            [sys.executable, "-c", _FDS_AFTER_MAIN, *command],
            stdout=fd,
            stderr=subprocess.PIPE,
            timeout=120,
            check=False,
        )
    said = done.stderr.decode()
    assert said.splitlines()[-1] == "exit 0 opened []", said
    assert "Traceback" not in said
