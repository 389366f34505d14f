"""A Spark start (the JVM's, the query's) that a stop signal ends promptly.

Spark's start is a blocking call of minutes on a slow machine (build_session), and a query's start and
warm-up a few more (attach_spark, ClusterDriver.start): an asyncio event set by SIGINT or SIGTERM was
not looked at until they returned, so a Ctrl-C or a systemd stop waited them out, and the server came
up only to stop. Here the start races the event; when the event wins, what Spark started is stopped
within a bound (STOP_BOUND), and what does not stop by then is left to a daemon thread: the JVM ends
with this process anyway (pyspark holds a pipe on its stdin).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ingest.logs import say

if TYPE_CHECKING:
    from ingest.preflight import DataDirLock

T = TypeVar("T")

log = logging.getLogger(__name__)

EXIT_INTERRUPTED = 130
"""Ctrl-C, as ingest.cli.EXIT_INTERRUPTED."""

STOP_BOUND = 20.0
"""How long a start stopped by a signal may take to stop what it started (Spark's session, its query)
before it is left behind."""


async def in_daemon_thread(call: Callable[[], T]) -> T:
    """call() in a daemon thread of its own: unlike asyncio.to_thread's executor, which asyncio.run
    and the interpreter's exit wait for, one left running (a JVM start) does not hold the exit up."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            outcome: tuple[T | None, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name="sluice-spark-start", daemon=True).start()
    return await done


async def stopped_first(task: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Wait until `task` ends or `stop` is set; whether `stop` is set (`task` then maybe still running)."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    return stop.is_set()


async def start_session(build: Callable[[], T], stop: asyncio.Event) -> T | None:
    """build() (build_session) in a daemon thread; its session, what it raised, or None once `stop` is
    set first. Then the JVM is told to end (the start fails at its next call into it), and a session
    build returns within STOP_BOUND all the same is stopped; past that, the thread is left behind."""
    started = asyncio.ensure_future(in_daemon_thread(build))
    if not await stopped_first(started, stop):
        return await started
    if not started.done():
        _end_jvm()
    try:
        spark = await asyncio.wait_for(asyncio.shield(started), STOP_BOUND)
    except TimeoutError:
        log.warning(
            "Spark's start did not end within %g s of the stop; leaving it (its JVM ends with this process)",
            STOP_BOUND,
        )
        return None
    except Exception:  # the start failed as the JVM ended: what was wanted
        log.debug("Spark's start ended with an error once stopped", exc_info=True)
        return None
    await stop_spark(spark)
    return None


async def stop_spark(spark: Any) -> bool:
    """Stop a session that may be starting a query or warming up (blocking calls in other threads):
    cancel its jobs, stop its streaming queries, stop it; False when that took more than STOP_BOUND
    (then it is left to a daemon thread)."""

    def stop() -> None:
        with contextlib.suppress(Exception):
            spark.sparkContext.cancelAllJobs()
        with contextlib.suppress(Exception):
            for query in spark.streams.active:
                query.stop()
        spark.stop()

    try:
        await asyncio.wait_for(in_daemon_thread(stop), STOP_BOUND)
    except TimeoutError:
        log.warning("Spark did not stop within %g s; leaving it (the JVM ends with this process)", STOP_BOUND)
        return False
    except Exception:  # a JVM that ended already, as stopping it would have
        log.debug("stopping Spark failed", exc_info=True)
    return True


def _end_jvm() -> None:
    """Terminate the JVM this process launched: the gateway's, or while pyspark still waits for it to
    say its port, any java child of this process. A start blocked on it (the JVM's own start, then
    SparkContext's creation: a minute each on a slow machine) fails at once rather than finish first."""
    with contextlib.suppress(Exception):
        from pyspark import SparkContext  # noqa: PLC0415 - loaded already by the start

        proc = getattr(SparkContext._gateway, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            return
    for child in _java_children():
        with contextlib.suppress(OSError):
            os.kill(child, signal.SIGTERM)


def _java_children() -> list[int]:
    """The pids of this process's children (of any of its threads) that run java (Linux: /proc)."""
    found = []
    with contextlib.suppress(OSError):
        for task in Path("/proc/self/task").iterdir():
            with contextlib.suppress(OSError, ValueError):
                for pid in (task / "children").read_text().split():
                    with contextlib.suppress(OSError):
                        if b"java" in Path(f"/proc/{pid}/cmdline").read_bytes():
                            found.append(int(pid))
    return found


ECHO_SECONDS = 1.0
"""A SIGTERM this soon after the first is the same stop sent twice, not a second stop: GNU `timeout`
(itself sent SIGTERM, or a `-s TERM` of its own), like other supervisors, signals its child and then
the child's whole process group, so `sluice serve` got two SIGTERMs microseconds apart and took the
second for an impatient operator's: exit 143 at once, without the drain. Ctrl-C is not filtered: a
terminal sends one per key press, and a second press is meant."""


def is_echo(first: int, first_at: float, signum: int) -> bool:
    """Whether stop signal `signum`, after `first` came at monotonic time `first_at`, is an echo of
    it (ECHO_SECONDS) rather than a second stop signal."""
    return signum == first == signal.SIGTERM and time.monotonic() - first_at < ECHO_SECONDS


def exit_now(signum: int, lock: DataDirLock | None, what: str = "the server") -> None:
    """A second stop signal: end the process now, without waiting for Spark or a drain (exit 130 on
    Ctrl-C, 143 on SIGTERM). Acked records lose nothing: each was in the block log before its ack."""
    say(
        f"second {signal.Signals(signum).name}: exiting now, without waiting for {what} to stop; the "
        "records acked so far are in the block log and are processed at the next start",
        level=logging.WARNING,
        event="stopped",
    )
    exit_quietly(128 + signum, lock)


def exit_quietly(code: int, lock: DataDirLock | None) -> None:
    """End the process now with `code`, the data dir's lock released, threads left running or not."""
    _let_stderr_through()
    # released last: threads of this process (a start left behind) may run until os._exit, and a second
    # instance must not take the data dir while they can
    if lock is not None:
        with contextlib.suppress(Exception):
            lock.release()
    os._exit(code)


def _let_stderr_through() -> None:
    """While Spark's JVM starts (or a start left behind never ended), fd 2 is a pipe a daemon thread
    copies onward (ingest.spark.session): a moment for it to pass the last lines on before the exit."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    time.sleep(0.2)


def stopped_starting(signals: Sequence[int], when: str, *, spark_stopped: bool = True) -> int:
    """The start of `sluice serve` (or a driver) ended by a stop signal: Ctrl-C exit 130, SIGTERM (or a
    stop not by a signal) 0, as one that comes before Spark starts."""
    left = "" if spark_stopped else " (Spark did not stop in time: left to end with this process)"
    acked = "; records acked so far are in the block log for the next start" if "query" in when else ""
    if signals and signals[0] == signal.SIGINT:
        say(f"interrupted {when}{acked}{left}", level=logging.WARNING, event="stopped")
        _let_stderr_through()
        return EXIT_INTERRUPTED
    by = " (SIGTERM)" if signals else ""  # a stop not by a signal: a test's, an embedding's
    say(f"stopped{by} {when}{acked}{left}", event="stopped")
    _let_stderr_through()
    return 0
