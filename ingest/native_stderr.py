"""With `--log-format json`, what is written on file descriptor 2 outside Python's own sys.stderr (gRPC's
C core, the interpreter's fatal errors) becomes JSON lines too.

gRPC's C core logs through absl straight to fd 2, in absl's format (`E1127 16:51:05.826388   12345
file.cc:123] message`), past Python's logging. redirect() points fd 2 at a pipe read by a small process
of its own (this file, run as a script with the standard library only), which writes each line onto
the real stderr as a JSON object: an absl line with logger "grpc", its level from its first letter (I,
W, E, F: INFO, WARNING, ERROR, CRITICAL) and its source file in "source"; a line that is a JSON object
already (a child's that logs so) as it is; any other line (the interpreter's "Fatal Python error" and
the stack it dumps, a C library's message) with logger "stderr" at ERROR. Python's sys.stderr moves to
the real stderr: the log handler and every line the CLI prints go there directly, as before, and so do
an uncaught exception's traceback and Spark's JVM's lines (ingest.spark.session copies them there).

A process, not a thread of this one: a crash that kills this process (gRPC's fatal checks call abort())
leaves what it wrote in the pipe, and the relay still writes it out once the pipe ends. It ignores
SIGINT, SIGTERM and SIGHUP (a Ctrl-C in a terminal, or a `kill` of the process group, reaches it too)
and ends with the pipe: once this process and every child that inherited fd 2 are gone. At a normal
exit fd 2 is given back to the real stderr and the relay is waited for (RELAY_EXIT_WAIT at most), so
that its lines come before the process ends (a container's init then kills what is left).

Should the relay end while this process runs (a `kill -9` of it, the OOM killer), the pipe has no
reader: a write on fd 2 fails with EPIPE (gRPC's lines, a fatal error's report, lost) and a child
started then with SIGPIPE at its default (subprocess resets it) dies of SIGPIPE at its first line on
stderr. A thread waits for the relay, and if it ends before the exit gives fd 2 back, it points fd 2 at
the real stderr and logs a WARNING: raw lines go there as they are from then on.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from typing import BinaryIO

ABSL_LINE = re.compile(
    r"(?P<level>[IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ (?P<source>[^\s\]]+)\] ?(?P<message>.*)"
)
"""absl's log prefix, which gRPC's C core writes: level letter, MMDD, time, thread id, file:line]."""
ABSL_LEVELS = {"I": "INFO", "W": "WARNING", "E": "ERROR", "F": "CRITICAL"}
GRPC_LOGGER = "grpc"
OTHER_LOGGER = "stderr"
"""The logger of a line in no known format: at ERROR, since what writes raw on stderr is mostly trouble."""
RELAY_EXIT_WAIT = 2.0
"""Seconds the exit waits for the relay to write what is left in the pipe."""
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def iso_time(seconds: float) -> str:
    """The "time" of a JSON log line: UTC, ISO 8601, milliseconds."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds")


def json_line(line: bytes, now: float) -> bytes:
    """One line of fd 2 as one JSON line (see the module's doc); b"" for a blank one."""
    text = line.decode("utf-8", "replace").rstrip("\r\n")
    if not text.strip():
        return b""
    if text.startswith("{"):
        with contextlib.suppress(ValueError):
            if isinstance(json.loads(text), dict):
                return text.encode() + b"\n"
    entry: dict[str, str] = {"time": iso_time(now)}
    match = ABSL_LINE.fullmatch(text)
    if match:
        entry |= {"level": ABSL_LEVELS[match["level"]], "logger": GRPC_LOGGER, "message": match["message"]}
        entry["source"] = match["source"]
    else:
        entry |= {"level": "ERROR", "logger": OTHER_LOGGER, "message": text}
    return json.dumps(entry, ensure_ascii=False).encode() + b"\n"


def relay(source: BinaryIO, out: BinaryIO) -> None:
    """Copy `source`'s lines onto `out` as JSON lines until `source` ends. If `out` fails (its reader went
    away) it goes on reading and drops them: a writer to a full pipe would hang."""
    writing = True
    for line in source:
        data = json_line(line, time.time())
        if not (data and writing):
            continue
        try:
            out.write(data)
            out.flush()
        except OSError:
            writing = False


def redirect() -> bool:
    """Point fd 2 at a pipe to a relay process (started here), and sys.stderr at the real stderr. True
    once done; False (and nothing changed) when the relay cannot start."""
    sys.stderr.flush()
    try:
        real = os.dup(2)
    except OSError:  # no stderr at all (closed): nothing to relay to
        return False
    read_fd, write_fd = os.pipe()
    # blocked from the start in the relay (a mask is inherited): a signal to the group during its first
    # milliseconds, before it ignores them, would end it
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, IGNORED)
    try:
        process = subprocess.Popen(  # noqa: S603 - this interpreter and this file
            [sys.executable, "-I", "-S", os.path.abspath(__file__)],
            stdin=read_fd,
            stdout=real,
            stderr=real,
        )
    except OSError:
        for fd in (real, read_fd, write_fd):
            os.close(fd)
        return False
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    os.close(read_fd)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    sys.stderr = io.TextIOWrapper(
        open(real, "wb", buffering=0),  # noqa: SIM115 - sys.stderr's file, for the process's life
        encoding=sys.stderr.encoding,
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
    exiting = threading.Event()
    atexit.register(_give_back, process, real, exiting)
    threading.Thread(
        target=_watch, args=(process, real, exiting), name="sluice-stderr-relay-watch", daemon=True
    ).start()
    return True


def _watch(process: subprocess.Popen[bytes], real: int, exiting: threading.Event) -> None:
    """Wait for the relay; if it ends before the exit (`exiting`), point fd 2 at the real stderr again
    and say so. What was written on fd 2 between its end and the dup2 is lost (EPIPE): unavoidable, no
    one reads that pipe any more."""
    status = process.wait()
    if exiting.is_set():  # set before the exit gives fd 2 back, which is what ends the relay then
        return
    os.dup2(real, 2)
    how = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
    logging.getLogger(__name__).warning(
        "the stderr relay (pid %d) ended (%s): raw lines on fd 2 (gRPC's C core, a fatal error's "
        "report) go to stderr as they are, not as JSON lines, from now on",
        process.pid,
        how,
    )


def _give_back(process: subprocess.Popen[bytes], real: int, exiting: threading.Event) -> None:
    """At exit: fd 2 back to the real stderr (the pipe's last writer here goes), then let the relay
    write out what the pipe holds."""
    exiting.set()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    os.dup2(real, 2)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(RELAY_EXIT_WAIT)  # a child still holding fd 2 keeps the pipe: the relay ends with it


def _main() -> None:
    for signum in IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, IGNORED)  # ignored now: nothing pending is delivered
    relay(sys.stdin.buffer, sys.stdout.buffer)


if __name__ == "__main__":
    _main()
