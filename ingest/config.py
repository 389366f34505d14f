"""Service configuration: one frozen dataclass, every runtime setting in one place."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ratecontrol import ESTIMATORS, RateBounds, StreamPolicy, UnknownEstimatorError, check_rate
from receivers.block import check_stream_name
from receivers.receiver import ReceiverConfig
from receivers.wal import DEFAULT_SEGMENT_BYTES, FsyncPolicy

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
MIN_SEGMENT_BYTES = 4096

_SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """A byte count: plain bytes ("1048576") or with a unit: B, KB/MB/GB/TB (powers of 1000) or
    KiB/MiB/GiB/TiB (powers of 1024), case-insensitive ("512MiB", "2 GiB", "100MB"). ValueError if not."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {text!r}: use bytes or a number with B, KB, MB, GB, TB (x1000) or KiB, MiB, "
            "GiB, TiB (x1024), e.g. 512MiB"
        )
    return int(match.group(1)) * _UNITS[unit]


@dataclass(frozen=True)
class RateConfig:
    """The rate a node starts with and how it moves."""

    estimator: str = "model"
    """"model" (the default: fixed + per-record cost, backlog drained over a horizon), "spark-pid"
    (Spark's PIDRateEstimator, exactly), or "fixed" (only operators change the rate)."""
    initial_rate: float = 10_000.0
    """Records/s before the first batch is measured: bounds the first batch too. inf: unlimited."""
    min_rate: float = 100.0
    """No estimator goes below this (Spark's spark.streaming.backpressure.pid.minRate)."""
    max_rate: float = math.inf
    """No estimator or operator goes above this."""
    stream_policies: Mapping[str, StreamPolicy] = field(default_factory=dict)
    """Stream -> its weight and bounds in the split of the rate among streams (others: weight 1, no
    bounds); `sluice serve --stream-weight/--stream-min-rate/--stream-max-rate`."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise UnknownEstimatorError(
                f"unknown estimator {self.estimator!r}; known: {', '.join(ESTIMATORS)}"
            )
        check_rate(self.initial_rate)
        RateBounds(self.min_rate, self.max_rate)


@dataclass(frozen=True)
class ServeConfig:
    """What `sluice serve` runs."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds; loopback by default, so nothing is exposed unasked."""
    port: int = DEFAULT_PORT
    """gRPC port; 0 picks a free one."""
    metrics_host: str = "127.0.0.1"
    """Address of the Prometheus /metrics endpoint."""
    metrics_port: int | None = DEFAULT_METRICS_PORT
    """Port of /metrics; 0 picks a free one, None turns it off."""
    data_dir: Path = Path("sluice-data")
    """Blocks, Spark checkpoints and the default sink live here."""
    streams: tuple[str, ...] = ("default",)
    """Streams this node receives; one receiver each."""
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    """Buffering, credit and block sealing."""
    rate: RateConfig = field(default_factory=RateConfig)
    """The ingest rate: estimator, initial rate, bounds."""
    fsync: FsyncPolicy = field(default_factory=FsyncPolicy.every_block)
    """When the block log is fsynced: every block before acking it (the default), every N ms in the
    background (acked blocks survive a process crash, not a power loss), or off (throwaway data only)."""
    segment_bytes: int | None = None
    """Size at which the block log starts a new segment file. Spark's release deletes whole segments
    (never the newest), so under a disk budget segments should be well below it; None: 64 MiB, or a
    quarter of the disk budget when that is smaller (at least 4 KiB)."""
    max_message_bytes: int = 32 * 1024 * 1024
    """Largest gRPC message taken; a larger Batch ends its session with RESOURCE_EXHAUSTED."""
    master: str = "local[*]"
    """Spark master URL."""
    pipeline: str | None = None
    """`module:function` returning a DataStreamWriter for the source DataFrame; None: Parquet sink."""
    trigger_interval: float = 1.0
    """Seconds between Spark micro-batches."""
    spark: bool = True
    """Run the Spark query in this process; off for a receive-only node."""

    def __post_init__(self) -> None:
        if not self.streams:
            raise ValueError("at least one stream is needed")
        for name in self.streams:
            check_stream_name(name)
        if len(set(self.streams)) != len(self.streams):
            raise ValueError(f"stream names repeat: {', '.join(self.streams)}")
        unknown = sorted(set(self.rate.stream_policies) - set(self.streams))
        if unknown:
            raise ValueError(
                f"a stream weight or rate bound names {', '.join(map(repr, unknown))}, which this node "
                f"does not serve (streams: {', '.join(self.streams)})"
            )
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be 0-65535, got {self.metrics_port}")
        if self.port != 0 and self.port == self.metrics_port and self.host == self.metrics_host:
            raise ValueError(f"the gRPC port and the metrics port are both {self.port}: give them two")
        if not 0 < self.trigger_interval < math.inf:
            raise ValueError(f"trigger interval must be > 0 seconds and finite, got {self.trigger_interval}")
        if math.isinf(self.receiver.block_interval):  # nothing would be acked below block_records
            raise ValueError("block interval must be finite")
        if self.spark and not (self.master == "yarn" or self.master.startswith(("spark", "k8s", "local"))):
            # Spark's own check, made before its JVM starts (and dies with a Java stack trace)
            raise ValueError(f"master {self.master!r}: Spark takes yarn, spark://..., k8s://... or local...")
        if self.segment_bytes is not None and self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment bytes must be >= {MIN_SEGMENT_BYTES}, got {self.segment_bytes}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max message bytes must be >= 1024, got {self.max_message_bytes}")

    @property
    def wal_segment_bytes(self) -> int:
        """The block log's segment size: segment_bytes, or its default (see there)."""
        if self.segment_bytes is not None:
            return self.segment_bytes
        budget = self.receiver.disk_budget_bytes
        if budget is None:
            return DEFAULT_SEGMENT_BYTES
        return max(MIN_SEGMENT_BYTES, min(DEFAULT_SEGMENT_BYTES, budget // 4))

    @property
    def blocks_dir(self) -> Path:
        return self.data_dir / "blocks"

    @property
    def sink_dir(self) -> Path:
        return self.data_dir / "sink"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"
