"""What `sluice` writes on stderr: plain lines (the default) or JSON lines (`--log-format json`).

One line per lifecycle event (start, serving, the Spark query started, a pipeline swap, stop), per rate
or settings change and per failed session; nothing per record or per batch above DEBUG. Lifecycle lines
go through say(): "sluice: ..." in plain mode, as the CLI always printed them, or a JSON object with an
"event" field. Spark's JVM logs through log4j on the same stderr; ingest.spark.session gives it the same
format (docs/configuration.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
from collections.abc import Mapping

from ingest import native_stderr

PLAIN, JSON = "plain", "json"
FORMATS = (PLAIN, JSON)
LEVELS = ("debug", "info", "warning", "error")
SPARK_QUIET = "quiet"
SPARK_LOG_LEVELS = (SPARK_QUIET, "off", "fatal", "error", "warn", "info", "debug", "trace", "all")
"""`--spark-log-level`: "quiet" (the default) is WARN without the warnings of
ingest.spark.session.NOISY_LOGGERS; any other is log4j's level for all of Spark's loggers."""
PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_format = PLAIN


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, and event and
    exception when there are."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": native_stderr.iso_time(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, "event", None)
        if event:
            entry["event"] = event
        fields = getattr(record, "fields", None)
        if fields:  # say()'s figures, beside the message (never over its own keys)
            entry.update({k: v for k, v in fields.items() if k not in entry})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


_PY4J_FILES = f"{os.sep}py4j{os.sep}"


def _py4j_root_records(record: logging.LogRecord) -> bool:
    """py4j logs some lines through the root logger, not its own: a call it retries after the JVM's
    connection broke writes "Exception while sending command." and a traceback at INFO (a stop signal
    while Spark starts gave a traceback where one line was due). They are held to the "py4j" logger's
    level, as its own lines are; its ERROR lines still pass."""
    if record.name == "root" and _PY4J_FILES in record.pathname:
        return record.levelno >= logging.getLogger("py4j").getEffectiveLevel()
    return True


def setup(level: str = "info", log_format: str = PLAIN, *, whole_process: bool = False) -> None:
    """Log to stderr at `level` in `log_format`. Like logging.basicConfig, it leaves a root logger that
    already has handlers alone (a test harness's), but say() follows `log_format` either way.
    `whole_process`: the process is the `sluice` command's (not a test calling the CLI): in JSON mode
    what is written on fd 2 outside Python (gRPC's C core) is then relayed as JSON lines too
    (ingest.native_stderr)."""
    global _format  # noqa: PLW0603 - one process, one log format
    if log_format not in FORMATS:
        raise ValueError(f"log format {log_format!r}: one of {', '.join(FORMATS)}")
    if log_format == JSON and whole_process and _format != JSON:
        native_stderr.redirect()  # before the handler: it writes on sys.stderr, which moves
    _format = log_format
    root = logging.getLogger()
    if not root.handlers:
        handler = _StderrHandler(sys.stderr)
        handler.setFormatter(JsonFormatter() if log_format == JSON else logging.Formatter(PLAIN_FORMAT))
        handler.addFilter(_py4j_root_records)
        root.addHandler(handler)
        root.setLevel(getattr(logging, level.upper()))
        if log_format == JSON:
            logging.captureWarnings(True)  # a Python warning is a log line too, not a bare stderr line
    # py4j logs a line per call to the JVM
    logging.getLogger("py4j").setLevel(max(logging.WARNING, root.level))


def log_format() -> str:
    return _format


def say(
    message: str,
    *,
    event: str | None = None,
    level: int = logging.INFO,
    fields: Mapping[str, object] | None = None,
) -> None:
    """A line for the operator on stderr, whatever the log level: "sluice: message", or in JSON mode an
    object with the message, its lifecycle `event` (start, serving, query-started, stopped, ...) and
    `fields` (figures a log shipper reads without parsing the message; not in the plain line)."""
    if _format == JSON:
        record = logging.LogRecord("sluice", level, __file__, 0, message, None, None)
        record.event = event
        record.fields = fields
        line = JsonFormatter().format(record)
    else:
        line = f"sluice: {message}"
    write_stderr(line)


def write_stderr(text: str) -> None:
    """`text` and a newline on stderr, flushed. A stderr that cannot take it loses the line but stops
    nothing: one whose reader went away (EPIPE: a `2>&1 | head` that ended, a log collector restarted)
    is pointed at /dev/null for good (stderr_gone), one that fails otherwise (a full disk under a
    redirect: ENOSPC, EIO) drops this line alone. A BrokenPipeError here ended `sluice serve` with exit
    0, its server not stopped, as the CLI takes a reader gone from stdout; and a command that failed
    (`sluice push` to a server that is down, `2>&1 | true`) exited 0 as if it had not."""
    try:
        print(text, file=sys.stderr, flush=True)
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            stderr_gone()
    except ValueError:  # closed: nothing to write on
        pass


def stderr_gone() -> None:
    """No one reads stderr any more (EPIPE): point the file descriptor sys.stderr writes on at
    /dev/null, so that later lines (say()'s, the log handler's, gRPC's C core's when it is fd 2) go
    nowhere instead of failing each. What sys.stderr still holds is dropped with them."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        point_at_devnull(sys.stderr.fileno())


def point_at_devnull(fd: int) -> None:
    """Point file descriptor `fd` at /dev/null, for writes: what is written on it from now on (by Python
    or below it) goes nowhere, and what a file object still holds for it is dropped at its next flush
    rather than failing there. /dev/null is opened, put in `fd`'s place and closed again, so nothing is
    left open: the BrokenPipe branches of the CLI's main() and `--version` had each left a descriptor of
    /dev/null open. OSError when /dev/null cannot be opened (no descriptor free) or `fd` is not one."""
    null = os.open(os.devnull, os.O_WRONLY)
    if null == fd:  # `fd` was closed: /dev/null took its number, which is what was wanted
        return
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The log handler on stderr: a stderr whose reader went away (EPIPE) goes to /dev/null
    (stderr_gone) rather than failing, and printing logging's report of the failure, at every record."""

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
            stderr_gone()
            return
        super().handleError(record)
