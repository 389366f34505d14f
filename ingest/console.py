"""The `sluice` console script's entry point: it takes the signals before the CLI's imports.

Importing ingest.cli (gRPC, numpy, the SDK) takes a few tenths of a second, and until main() runs no
handler of the CLI's is in place: a Ctrl-C there printed a KeyboardInterrupt traceback, and SIGTERM or
SIGHUP took their default actions (`sluice serve` ignores SIGHUP and stops cleanly on SIGTERM while it
starts). So this module, which imports only a few light modules of the standard library, holds
SIGINT, SIGTERM and SIGHUP first: a signal that comes meanwhile is noted, not acted on. The CLI takes
each over where it would handle it anyway (release()), once the command and its log format are known,
and acts then on one that came: the same outcome as if it had come a moment later. Before this module
runs (the interpreter's own start, some 20 ms) the signals are Python's: nothing can be done there.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

HELD = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_held: set[int] | None = None
"""The signals still held for the CLI (None: this process was not started by the console script, as in
a test calling ingest.cli.main: nothing is held)."""
_came: set[int] = set()


def _note(signum: int, frame: FrameType | None) -> None:
    _came.add(signum)


def release(signum: int, handler: Handler) -> bool:
    """Put `handler` in place of the hold on `signum`, and say whether that signal came while held. A
    signal not held (taken over already, or never held): False, and nothing is changed."""
    if _held is None or signum not in _held:
        return False
    signal.signal(signum, handler)
    _held.discard(signum)
    came = signum in _came
    _came.discard(signum)
    return came


def open_standard_fds() -> frozenset[int]:
    """Open /dev/null on those of file descriptors 0, 1 and 2 that are closed (`sluice serve >&- 2>&-`,
    a parent that closed them), and give their numbers. Left closed, the next files opened took them:
    the data dir's lock file became fd 1 and gRPC's epoll fd 2, so what writes on stdout or stderr
    below Python (gRPC's C core, a fatal error's report, Spark's JVM and every child, which inherit
    them) wrote into those files. A closed stderr's lines are lost (sys.stderr is /dev/null); a
    closed stdout stays sys.stdout = None, which the CLI refuses to write its output to."""
    closed = set()
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.add(fd)
    for fd in sorted(closed):  # the lowest free number each time: 0, 1, 2 in order
        null = os.open(os.devnull, os.O_RDWR)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
    if 2 in closed:
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")  # noqa: SIM115
    return frozenset(closed)


def main() -> int:
    global _held  # noqa: PLW0603 - one process, one console script
    open_standard_fds()
    _held = set()
    for signum in HELD:
        signal.signal(signum, _note)
        _held.add(signum)
    from ingest.cli import main as cli_main  # noqa: PLC0415 - the point: after the signals are held

    # a command that ends before it takes a signal over (a usage error) ends as it would have anyway
    return cli_main(whole_process=True)


if __name__ == "__main__":
    sys.exit(main())
