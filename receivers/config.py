"""The receiving side's settings: how a receiver buffers and seals (ReceiverConfig), how the block log
syncs (FsyncPolicy).

Plain data with no Arrow and no gRPC, so the configuration and the CLI's client commands load without the
server's libraries (the light `pip install sluice`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from receivers.errors import cut

MIB = 1024 * 1024
DEFAULT_SEGMENT_BYTES = 64 * MIB
"""Bytes a block log segment grows to before the next block starts a new one."""

MAX_RECORDS = 10**12
"""The most a count of records in the settings may be (buffer, prefetch, ...): beyond any machine's
memory, and sums of them stay exact in a double and within the int64 fields of the rate API."""
MAX_BYTES = 2**60
"""The most a byte budget may be (1 EiB)."""
MAX_SECONDS = 3600.0
"""The longest block interval or linger: an hour. A record waits that long for its ack at most; what
is longer is a typo (1e300 was taken, and nothing was ever acked)."""
MAX_FSYNC_INTERVAL_MS = round(MAX_SECONDS * 1000)
"""The longest `--fsync interval:MS`: an hour too, as acks wait for the fsync."""
MIN_BLOCK_INTERVAL = 0.01
"""Seconds: the shortest block interval (Spark's guide advises 50 ms at least for its own)."""


@dataclass(frozen=True)
class ReceiverConfig:
    """How a receiver buffers, grants credit and seals. Shared by every stream of a server."""

    block_interval: float = 0.2
    """Seconds between sealed blocks, at most (the longest a record waits for its block)."""
    block_linger: float | None = 0.01
    """Seal early once no batch has come for this many seconds, so a lull's records (a flush, a
    lone record) are durable and acked after about this long plus a write rather than up to a block
    interval; a steady stream never pauses that long, and its blocks are cut as before. Sets the
    most blocks a lull can make: 1 / (block_linger + a write) a second. None: off."""
    buffer_records: int = 500_000
    """Records buffered plus credit outstanding, at most: the memory bound of a stream."""
    prefetch: int | None = None
    """Credit a session is topped up to (the first grant too), as far as the buffer allows; None: half
    of buffer_records (at least 1), which follows a new buffer_records (fill_to)."""
    low_tide: int | None = None
    """A session is topped up when its unused credit falls to this; None: half of prefetch."""
    block_records: int | None = None
    """Seal early once this many records wait, so under load the buffer cycles faster than the
    interval (like Kafka's batch.size next to linger.ms); None: a quarter of buffer_records."""
    credit_tick: float = 0.05
    """Seconds between credit refills when the rate, not the buffer, limits credit."""
    receiver_id: int = 0
    """Id written with every block (the analogue of a Kafka partition)."""
    max_producers: int = 100_000
    """Producers remembered for deduplication per stream (least recently used evicted first)."""
    buffer_bytes: int = 256 * MIB
    """Per stream, bytes of records taken and not yet sealed plus the bytes outstanding credit may bring
    (estimated per record: see the module docstring): the memory budget."""
    memory_budget_bytes: int | None = None
    """Bytes of every stream together, counted as buffer_bytes counts one stream's: the server's memory
    budget (receivers.memory_pool); None: each stream's buffer_bytes alone bounds it."""
    disk_budget_bytes: int | None = None
    """Bytes the whole block store (every stream) may take on disk before credit pauses; None: no
    budget. A soft limit: what was already granted or taken is still sealed."""
    disk_poll_interval: float = 0.25
    """Seconds between polls of the store's disk use (when there is a disk budget or writes fail)."""
    reclaim_after: float = 1.0
    """Seconds a session may hold credit without sending while its owner holds more than its fair share
    and another owner waits for room: then it is cancelled (UNAVAILABLE), its credit back in the pool.
    Credit cannot be taken back otherwise, so this is what bounds a hoarder that came first."""

    def __post_init__(self) -> None:
        self._check_intervals()
        self._check_bounds()
        if self.buffer_records < 1:
            raise ValueError(f"buffer_records must be >= 1, got {self.buffer_records}")
        if self.prefetch is not None and self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {self.prefetch}")
        self._check_credit()
        if self.block_records is not None and self.block_records < 1:
            raise ValueError(f"block_records must be >= 1, got {self.block_records}")
        if not self.credit_tick > 0:
            raise ValueError(f"credit_tick must be > 0 seconds, got {self.credit_tick}")
        if self.max_producers < 1:
            raise ValueError(f"max_producers must be >= 1, got {self.max_producers}")
        if self.buffer_bytes < 1:
            raise ValueError(f"buffer_bytes must be >= 1, got {self.buffer_bytes}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise ValueError(
                f"memory_budget_bytes must be >= 1 (or none: no budget), got {self.memory_budget_bytes}"
            )
        if self.disk_budget_bytes is not None and self.disk_budget_bytes < 1:
            raise ValueError(
                f"disk_budget_bytes must be >= 1 (or none: no budget), got {self.disk_budget_bytes}"
            )
        if not self.disk_poll_interval > 0:
            raise ValueError(f"disk_poll_interval must be > 0 seconds, got {self.disk_poll_interval}")
        if not 0 < self.reclaim_after < math.inf:
            raise ValueError(f"reclaim_after must be > 0 seconds and finite, got {self.reclaim_after}")

    def _check_credit(self) -> None:
        """The prefetch within the buffer, the low tide below the prefetch: each message names both
        settings and their values (the rule's value when the prefetch is left to it). A prefetch past
        the buffer was taken silently, and a session never got more than the buffer's room anyway."""
        if self.prefetch is not None and self.prefetch > self.buffer_records:
            raise ValueError(
                f"prefetch {self.prefetch} must be at most buffer_records {self.buffer_records}: the "
                "credit of a session is room in its stream's buffer"
            )
        if self.low_tide is not None and self.low_tide < 0:
            raise ValueError(f"low_tide must be >= 0, got {self.low_tide}")
        if self.low_tide is not None and self.low_tide >= self.fill_to:
            prefetch = (
                f"prefetch {self.prefetch}"
                if self.prefetch is not None
                else f"prefetch, {self.fill_to} by default (half of buffer_records {self.buffer_records})"
            )
            raise ValueError(f"low_tide {self.low_tide} must be below {prefetch}")

    def _check_intervals(self) -> None:
        if not self.block_interval >= MIN_BLOCK_INTERVAL:  # NaN too
            # each interval wakes a receiver with a session open, sending or not: 1e-300 spun a core
            # with nothing to do (a stream with no session looks in once a second)
            raise ValueError(
                f"block_interval must be at least {MIN_BLOCK_INTERVAL:g} seconds, got {self.block_interval:g}"
            )
        if not self.block_interval <= MAX_SECONDS:  # nothing would be acked below block_records
            raise ValueError(
                f"block_interval must be finite, at most {MAX_SECONDS:g} seconds, got {self.block_interval:g}"
            )
        linger = self.block_linger
        if linger is not None and not 0 <= linger < math.inf:
            raise ValueError(f"block_linger must be >= 0 seconds and finite (or off), got {linger}")
        if linger is not None and linger > MAX_SECONDS:
            raise ValueError(f"block_linger must be at most {MAX_SECONDS:g} seconds (or off), got {linger:g}")

    def _check_bounds(self) -> None:
        """Upper bounds, so that an extreme value is refused here rather than overflowing a field of
        the rate API (buffer_records 1e23 ended `sluice rate get` with UNKNOWN) or stalling a stream."""
        counts = {
            "buffer_records": self.buffer_records,
            "prefetch": self.prefetch,
            "low_tide": self.low_tide,
            "block_records": self.block_records,
            "max_producers": self.max_producers,
        }
        for name, value in counts.items():
            if value is not None and value > MAX_RECORDS:
                raise ValueError(f"{name} must be at most {MAX_RECORDS:,}, got {value:,}")
        for name, value in (
            ("buffer_bytes", self.buffer_bytes),
            ("memory_budget_bytes", self.memory_budget_bytes),
            ("disk_budget_bytes", self.disk_budget_bytes),
        ):
            if value is not None and value > MAX_BYTES:
                raise ValueError(f"{name} must be at most {MAX_BYTES:,} (1 EiB), got {value:,}")

    @property
    def seal_at(self) -> int:
        return max(1, self.buffer_records // 4) if self.block_records is None else self.block_records

    @property
    def budget_bytes(self) -> int:
        """The most bytes a stream may hold: its budget, or the server's if that is smaller."""
        server = self.memory_budget_bytes
        return self.buffer_bytes if server is None else min(self.buffer_bytes, server)

    @property
    def seal_bytes(self) -> int:
        """Bytes of pending records that seal a block early, whatever their count: a quarter of the
        memory budget, the stream's or the server's (large records would otherwise fill blocks of up to
        the whole budget, and the log's frame buffers, kept at the largest block's size, with them; and
        with the server's budget full, a block would wait for the interval to make room)."""
        return max(1, self.budget_bytes // 4)

    @property
    def fill_to(self) -> int:
        """The prefetch in force: prefetch, or half of buffer_records (at least 1) while it is None."""
        return max(1, self.buffer_records // 2) if self.prefetch is None else self.prefetch

    @property
    def refill_at(self) -> int:
        return self.fill_to // 2 if self.low_tide is None else self.low_tide


@dataclass(frozen=True)
class FsyncPolicy:
    """When appended blocks are fsynced. Build with every_block(), interval(ms), off() or parse(text)."""

    mode: Literal["every-block", "interval", "off"] = "every-block"
    interval_ms: int = 0
    """Milliseconds between background fsyncs; only for mode "interval"."""

    def __post_init__(self) -> None:
        if self.mode not in ("every-block", "interval", "off"):
            raise ValueError(f"unknown fsync mode {self.mode!r}: every-block, interval or off")
        if self.mode == "interval" and self.interval_ms < 1:
            raise ValueError(f"fsync interval must be >= 1 ms, got {self.interval_ms}")
        if self.mode == "interval" and self.interval_ms > MAX_FSYNC_INTERVAL_MS:
            # acks wait for the fsync: what is longer is a typo (and past 2^1024 ms the flusher died)
            shown = str(self.interval_ms) if self.interval_ms < 10**30 else "a number that long"
            raise ValueError(
                f"fsync interval must be at most {MAX_FSYNC_INTERVAL_MS:,} ms (an hour), got {shown}"
            )
        if self.mode != "interval" and self.interval_ms != 0:
            raise ValueError(f"an interval only goes with mode 'interval', not {self.mode!r}")

    @classmethod
    def every_block(cls) -> FsyncPolicy:
        """fsync before every write returns (the default): acked blocks survive a power loss."""
        return cls("every-block")

    @classmethod
    def interval(cls, ms: int) -> FsyncPolicy:
        """Group commit: fsync in the background at least every `ms` milliseconds, and as soon as a
        stream has 8 MiB unsynced (receivers.wal.SYNC_BYTES); blocks are acked once an fsync covers
        them, so acked blocks survive a power loss as under every_block(), with fewer fsyncs when blocks
        are small and up to `ms` later acks."""
        return cls("interval", ms)

    @classmethod
    def off(cls) -> FsyncPolicy:
        """Never fsync: for benchmarks on throwaway data."""
        return cls("off")

    @classmethod
    def parse(cls, text: str) -> FsyncPolicy:
        """'every-block', 'interval:MS' (MS a positive integer) or 'off'; ValueError otherwise."""
        value = text.strip().lower()
        if value == "every-block":
            return cls.every_block()
        if value == "off":
            return cls.off()
        if value.startswith("interval:"):
            number = value.removeprefix("interval:")
            # (its length first: int() of a 5,000-digit number raises ValueError of its own)
            digits = number.isascii() and number.isdigit() and len(number) <= 12
            if digits and 1 <= int(number) <= MAX_FSYNC_INTERVAL_MS:
                return cls.interval(int(number))
        raise ValueError(
            f"invalid fsync policy {cut(text)!r}: use every-block, "
            f"interval:MS (MS 1..{MAX_FSYNC_INTERVAL_MS}) or off"
        )

    def __str__(self) -> str:
        return f"interval:{self.interval_ms}" if self.mode == "interval" else self.mode
