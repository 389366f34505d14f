"""The live status page's numbers (/status.json) and their short history, served beside /metrics.

The numbers come from the same place as the Prometheus text: the server's SluiceCollector (per-stream
counters and gauges, the block log on disk), plus the rate controller (rate, bounds, the last batches),
the streams' states, the publisher sessions and the pipeline's view. They are read on the server's
event loop, where the receivers live (the HTTP threads ask it and wait), and a history of the last
HISTORY points is kept: one sample a second, and every completed batch (RateController.recent_batches).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from ingest.metrics import SluiceCollector
from ingest.rate_controller import RateController
from receivers.receiver import Receiver
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

log = logging.getLogger(__name__)

_SAMPLED = ("records_received", "buffered_records", "buffered_bytes", "wal_disk_bytes")
"""The families a history point is made of."""

HISTORY = 300
"""Points of history kept: seconds of once-a-second samples, and completed batches."""
SAMPLE_EVERY = 1.0
FAILURE_SAID_EVERY = 60.0
"""A sample that keeps failing (out of file descriptors: EMFILE every second) is logged at most this
often, seconds: it logged a traceback every second."""
"""Seconds between history samples."""
ANSWER_TIMEOUT = 5.0
"""Seconds an HTTP thread waits for the event loop's snapshot before it answers 503."""

SESSIONS_SHOWN = 200
"""Most sessions listed (the page is for people; `sluice sessions list` has them all)."""

Json = dict[str, Any]

# per-stream families of SluiceCollector the page shows, by their sample names in /metrics
STREAM_SAMPLES = (
    "records_received_total",
    "records_acked_total",
    "records_deduplicated_total",
    "blocks_sealed_total",
    "block_bytes_total",
    "credit_outstanding",
    "buffered_records",
    "buffered_bytes",
    "sessions_active",
    "rate_limit",
    "wal_disk_bytes",
)
TOTALS = (
    "records_received_total",
    "records_acked_total",
    "buffered_records",
    "buffered_bytes",
    "wal_disk_bytes",
    "sessions_active",
    "credit_outstanding",
)


def finite(value: float | None) -> float | None:
    """JSON has no infinity or NaN: null stands for them (an unlimited rate, an unknown share)."""
    return value if value is not None and math.isfinite(value) else None


@dataclasses.dataclass
class _Sample:
    at: float  # epoch seconds
    received: dict[str, float]  # stream -> records received by then


class StatusBoard:
    """Keeps the history and answers /status.json: start() on the server's loop, stop() at its end."""

    def __init__(
        self,
        collector: SluiceCollector,
        rate: RateController,
        receivers: Mapping[str, Receiver],
        *,
        stream_states: Callable[[], Mapping[str, str]],
        stream_backlog: Callable[[str], int],
        pipeline: Callable[[], pb.PipelineView | None],
        health: Callable[[], str],
        about: Callable[[], Json],
    ) -> None:
        self._collector = collector
        self._rate = rate
        self._receivers = receivers
        self._stream_states = stream_states
        self._stream_backlog = stream_backlog
        self._pipeline = pipeline
        self._health = health
        self._about = about
        self.started = time.time()
        self._history: collections.deque[Json] = collections.deque(maxlen=HISTORY)
        self._last: _Sample | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._failing_since: float | None = None
        """Monotonic time of the first of the failed samples in a row, None while they succeed."""
        self._failure_said = 0.0
        self._failures = 0
        """Failed samples in a row."""

    # ---- on the loop -------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.sample()
        self._task = self._loop.create_task(self._sample_forever(), name="sluice-status-history")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._loop = None  # from now on the page answers 503

    async def _sample_forever(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY)
            self.sample_logged(time.monotonic())

    def sample_logged(self, now: float) -> None:
        """sample(), its failure logged (`now`: time.monotonic()): the page must outlive a bad reading,
        and the next second tries again. An OSError (EMFILE, EIO reading the block log's size) is one
        WARNING line without a traceback, anything else an ERROR with one; either said again at most
        every FAILURE_SAID_EVERY seconds while the failures last, and their end said once."""
        try:
            self.sample()
        except Exception as exc:
            self._failures += 1
            if self._failing_since is None:
                self._failing_since = now
            elif now - self._failure_said < FAILURE_SAID_EVERY:
                return
            self._failure_said = now
            again = f" ({self._failures} failed in a row)" if self._failures > 1 else ""
            later = f"; said again in {FAILURE_SAID_EVERY:g} s while it lasts"
            if isinstance(exc, OSError):
                log.warning("status sample failed%s: %s%s", again, exc, later)
            else:
                log.exception("status sample failed%s%s", again, later)
            return
        if self._failing_since is not None:
            log.warning(
                "status samples again after %d failed in a row (%.0f s)",
                self._failures,
                now - self._failing_since,
            )
            self._failing_since, self._failures = None, 0

    def _stream_values(self, only: Collection[str] | None = None) -> dict[str, dict[str, float]]:
        """Sample name (without sluice_) -> stream -> value, as /metrics shows them now; `only`: of
        these families (SluiceCollector.collect)."""
        values: dict[str, dict[str, float]] = {}
        for family in self._collector.collect(only):
            for sample in family.samples:
                stream = sample.labels.get("stream")
                if stream is None or len(sample.labels) != 1:
                    continue
                values.setdefault(sample.name.removeprefix("sluice_"), {})[stream] = sample.value
        return values

    def sample(self, now: float | None = None) -> None:
        """Add a history point: input rates since the last sample, the rate, buffers, the block log."""
        now = time.time() if now is None else now
        values = self._stream_values(_SAMPLED)
        received = dict(values.get("records_received_total", {}))
        last, self._last = self._last, _Sample(now, received)
        rates: dict[str, float | None] = {}
        for stream, count in received.items():
            before = last.received.get(stream) if last is not None else None
            took = now - last.at if last is not None else 0.0
            rates[stream] = (count - before) / took if before is not None and took > 0 else None
        known = [r for r in rates.values() if r is not None]
        self._history.append(
            {
                "t": now,
                "input_rate": sum(known) if known else None,
                "rate_limit": finite(self._rate.rate),
                "buffered_records": sum(values.get("buffered_records", {}).values()),
                "buffered_bytes": sum(values.get("buffered_bytes", {}).values()),
                "wal_disk_bytes": sum(values.get("wal_disk_bytes", {}).values()),
                "streams": rates,
            }
        )

    def snapshot(self) -> Json:
        """Everything /status.json shows, read now (on the loop)."""
        values = self._stream_values()
        history = list(self._history)
        latest = history[-1] if history else {}
        states = dict(self._stream_states())
        streams = []
        for name in sorted(set(states) | set(self._receivers)):
            state = states.get(name, "serving")
            if state == "removed":
                continue
            row: Json = {"stream": name, "state": state, "backlog": self._stream_backlog(name)}
            for key in STREAM_SAMPLES:
                value = values.get(key, {}).get(name)
                row[key] = finite(value) if value is not None else None
            row["input_rate"] = latest.get("streams", {}).get(name)
            receiver = self._receivers.get(name)
            row["credit_paused"] = sorted(receiver.paused) if receiver is not None else []
            streams.append(row)
        shares = self._rate.stream_shares()
        for row in streams:
            share = shares.get(row["stream"])
            row["share"] = share[0].reason if share is not None else None
        totals = {key: sum(values.get(key, {}).values()) for key in TOTALS}
        bounds = self._rate.bounds
        batches = list(self._rate.recent_batches)
        pipeline = self._pipeline()
        return {
            "version": 1,
            "time": time.time(),
            "started": self.started,
            **self._about(),
            "health": self._health(),
            "totals": totals,
            "rate": {
                "limit": finite(self._rate.rate),
                "min": finite(bounds.min_rate),
                "max": finite(bounds.max_rate),
                "estimator": self._rate.estimator.name,
                "pinned": self._rate.pinned,
                "capacity": finite(self._rate.estimator.capacity),
                "input": latest.get("input_rate"),
            },
            "last_batch": _batch(*batches[-1]) if batches else None,
            "streams": streams,
            "sessions": _sessions(self._receivers.values()),
            "pipeline": _pipeline(pipeline) if pipeline is not None else None,
            "history": {
                key: [point[key] for point in history]
                for key in (
                    "t",
                    "input_rate",
                    "rate_limit",
                    "buffered_records",
                    "buffered_bytes",
                    "wal_disk_bytes",
                )
            }
            | {"streams": {s: [p["streams"].get(s) for p in history] for s in self._receivers}},
            "batches": {
                key: [_batch(at, batch)[key] for at, batch in batches]
                for key in (
                    "t",
                    "batch_id",
                    "records",
                    "processing_rate",
                    "scheduling_delay",
                    "batch_duration",
                )
            },
        }

    # ---- from the HTTP threads ---------------------------------------------------------------------

    def snapshot_threadsafe(self) -> Json | None:
        """snapshot(), asked of the loop from another thread; None when the server is not running."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return None

        async def read() -> Json:
            return self.snapshot()

        try:
            return asyncio.run_coroutine_threadsafe(read(), loop).result(ANSWER_TIMEOUT)
        except (TimeoutError, RuntimeError):  # a busy or closing loop
            return None


def _batch(at: float, batch: Any) -> Json:
    delay = batch.processing_delay
    return {
        "t": at,
        "batch_id": batch.batch_id,
        "records": batch.records,
        "processing_rate": batch.records / delay if batch.records > 0 and delay > 0 else None,
        "scheduling_delay": batch.scheduling_delay,
        "batch_duration": delay,
        "batch_interval": batch.batch_interval,
    }


def _sessions(receivers: Iterable[Receiver]) -> list[Json]:
    rows = [
        {
            "session_id": s.id,
            "stream": s.stream,
            "producer_id": s.producer_id,
            "principal": s.principal.name,
            "credit": s.credit,
            "next_seq": s.next_seq,
            "durable_up_to": s.durable_up_to,
            "state": "cancelled" if s.cancelled else "completed" if s.completed else "open",
        }
        for r in receivers
        for s in r.sessions
    ]
    return rows[:SESSIONS_SHOWN]


def _pipeline(view: pb.PipelineView) -> Json:
    data: Json = {
        "pipeline": view.pipeline or "built-in Parquet sink",
        "generation": view.generation,
        "state": view.state,
        "trigger_interval": view.trigger_interval_seconds,
        "query_id": view.query_id,
        "last_swap": None,
    }
    if view.HasField("last_swap"):
        swap = view.last_swap
        data["last_swap"] = {
            "from": swap.from_pipeline or "built-in",
            "to": swap.to_pipeline or "built-in",
            "outcome": swap.outcome,
            "error": swap.error,
            "requested_at": swap.requested_at,
            "duration": swap.duration_seconds,
            "processing_gap": swap.processing_gap_seconds,
        }
    return data
