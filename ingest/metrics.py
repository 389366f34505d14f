"""Prometheus metrics: a collector that reads the receivers' counters at scrape time.

One registry per server (not the global one), so several servers can live in one process (tests).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from receivers.receiver import PAUSE_REASONS, Receiver
from receivers.wal import WalBlockStore


class SluiceCollector(Collector):
    """Exports receiver counters per stream, the block log's recovery counters and disk use, and the
    Spark side's completed batches."""

    def __init__(
        self,
        receivers: Mapping[str, Receiver],
        batches_completed: Callable[[], int],
        *,
        wal: WalBlockStore | None = None,
    ) -> None:
        self._receivers = receivers
        self._batches_completed = batches_completed
        self._wal = wal

    def collect(self) -> Iterator[Metric]:
        counters: dict[str, tuple[str, Callable[[Receiver], float]]] = {
            "records_received": (
                "Records taken from publishers (duplicates not counted).",
                lambda r: r.stats.records_received,
            ),
            "records_deduplicated": (
                "Records dropped as duplicates of records a producer had sent before (same producer id "
                "and sequence number).",
                lambda r: r.stats.records_deduplicated,
            ),
            "sessions_fenced": (
                "Publisher sessions cancelled (ABORTED) because a newer session of their producer opened.",
                lambda r: r.stats.sessions_fenced,
            ),
            "records_acked": ("Records acked to publishers as durable.", lambda r: r.stats.records_acked),
            "batches_received": ("Batch messages taken from publishers.", lambda r: r.stats.batches_received),
            "blocks_sealed": ("Blocks sealed and made durable.", lambda r: r.stats.blocks_sealed),
            "block_bytes": ("Bytes of sealed blocks written.", lambda r: r.stats.block_bytes),
            "block_write_errors": (
                "Block writes that failed and were retried.",
                lambda r: r.stats.block_write_errors,
            ),
            "credit_granted": ("Credit granted to publishers (records).", lambda r: r.stats.credit_granted),
            "sessions_opened": ("Publisher sessions opened.", lambda r: r.stats.sessions_opened),
            "sessions_failed": ("Publisher sessions ended by an error.", lambda r: r.stats.sessions_failed),
            "sessions_cancelled": (
                "Publisher sessions cancelled by the server (stop, operator).",
                lambda r: r.stats.sessions_cancelled,
            ),
            "records_not_accepted": (
                "Records that arrived after their session was cancelled (the client resends them).",
                lambda r: r.stats.records_not_accepted,
            ),
        }
        gauges: dict[str, tuple[str, Callable[[Receiver], float]]] = {
            "credit_outstanding": (
                "Credit granted and not yet used (records).",
                lambda r: r.credit_outstanding,
            ),
            "buffered_records": (
                "Records taken and not yet in a durable block.",
                lambda r: r.buffered_records,
            ),
            "buffered_bytes": (
                "Bytes of the records taken and not yet in a durable block.",
                lambda r: r.buffered_bytes,
            ),
            "buffer_committed_bytes": (
                "What the memory budget counts: bytes buffered plus outstanding credit at the estimated "
                "bytes per record.",
                lambda r: r.committed_bytes,
            ),
            "buffer_budget_bytes": (
                "The memory budget per stream (--buffer-bytes).",
                lambda r: r.config.buffer_bytes,
            ),
            "record_bytes_estimate": (
                "Bytes per record the memory budget assumes for outstanding credit.",
                lambda r: r.record_bytes_estimate,
            ),
            "sessions_active": ("Publisher sessions open now.", lambda r: r.active_sessions),
            "rate_limit": ("Ingest rate limit in records per second (+Inf: unlimited).", lambda r: r.rate),
            "rate_share": (
                "The stream's share of the rates of the node's streams (0..1; NaN while any is unlimited): "
                "busy streams share by weight, idle ones keep a floor.",
                self._rate_share,
            ),
        }
        for name, (doc, read) in counters.items():
            family = CounterMetricFamily(f"sluice_{name}", doc, labels=["stream"])
            for stream, receiver in self._receivers.items():
                family.add_metric([stream], read(receiver))
            yield family
        for name, (doc, read) in gauges.items():
            gauge = GaugeMetricFamily(f"sluice_{name}", doc, labels=["stream"])
            for stream, receiver in self._receivers.items():
                gauge.add_metric([stream], read(receiver))
            yield gauge
        yield from self._collect_pauses()
        if self._wal is not None:
            yield from self._collect_wal(self._wal)
        yield CounterMetricFamily(
            "sluice_batches_completed", "Spark micro-batches completed.", value=self._batches_completed()
        )

    def _rate_share(self, receiver: Receiver) -> float:
        total = sum(r.rate for r in self._receivers.values())
        return receiver.rate / total if math.isfinite(total) else math.nan

    def _collect_pauses(self) -> Iterator[Metric]:
        paused = GaugeMetricFamily(
            "sluice_credit_paused",
            "1 while new credit is withheld for this reason: memory_budget (--buffer-bytes reached), "
            "disk_budget (--disk-budget reached; resumes when Spark releases blocks), disk_error (block "
            "writes fail, e.g. disk full; retried).",
            labels=["stream", "reason"],
        )
        pauses = CounterMetricFamily(
            "sluice_credit_pauses", "Times credit was paused, by reason.", labels=["stream", "reason"]
        )
        seconds = CounterMetricFamily(
            "sluice_credit_paused_seconds",
            "Seconds credit was paused, by reason (the current pause included).",
            labels=["stream", "reason"],
        )
        for stream, receiver in self._receivers.items():
            now_paused = receiver.paused
            for reason in PAUSE_REASONS:
                paused.add_metric([stream, reason], 1.0 if reason in now_paused else 0.0)
                pauses.add_metric([stream, reason], receiver.stats.credit_pauses.get(reason, 0))
                seconds.add_metric([stream, reason], receiver.paused_seconds(reason))
        yield paused
        yield pauses
        yield seconds

    def _collect_wal(self, wal: WalBlockStore) -> Iterator[Metric]:
        truncations = CounterMetricFamily(
            "sluice_wal_truncations",
            "Block log segments cut at a bad or torn frame by recovery (each is also logged).",
            labels=["stream"],
        )
        truncated = CounterMetricFamily(
            "sluice_wal_truncated_bytes", "Bytes cut off the block log by recovery.", labels=["stream"]
        )
        disk = GaugeMetricFamily(
            "sluice_wal_disk_bytes", "Bytes of the block log on disk (unreleased blocks).", labels=["stream"]
        )
        for stream in self._receivers:
            stats = wal.stream_stats(stream)
            truncations.add_metric([stream], stats.corrupt_tails_truncated)
            truncated.add_metric([stream], stats.bytes_truncated)
            disk.add_metric([stream], wal.disk_bytes(stream))
        yield truncations
        yield truncated
        yield disk
        budgets = {r.config.disk_budget_bytes for r in self._receivers.values()} - {None}
        if budgets:
            yield GaugeMetricFamily(
                "sluice_wal_disk_budget_bytes",
                "Bytes the whole block log may take on disk before credit pauses (--disk-budget).",
                value=min(b for b in budgets if b is not None),
            )


class MetricsServer:
    """Serves /metrics over HTTP from a background thread."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            server, thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        self._server = server
        self._thread: threading.Thread = thread
        self.port: int = server.server_address[1]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
