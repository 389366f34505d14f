"""One completed micro-batch, as the rate estimators see it: the only input of the control loop."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchMetrics:
    """What a completed micro-batch tells the controller. All times in seconds."""

    batch_id: int
    completed_at: float
    """When processing ended (any monotonic origin, >= 0); Spark's processingEndTime."""
    records: int
    """Input records of the batch."""
    processing_delay: float
    """Seconds the batch took to process."""
    scheduling_delay: float
    """Seconds the batch's oldest record waited before the batch started. About one batch_interval
    while the pipeline keeps up: a record taken just after the previous batch started waits for the
    next one. What exceeds the interval is `lateness`."""
    batch_interval: float
    """The trigger interval in force for this batch (> 0)."""
    backlog: int | None = None
    """Records that were ready when this batch started but were left for later batches (what a cap on
    the batch size held back); None when unknown, in which case estimators that need it estimate it
    from lateness and the rate."""
    waiting: int | None = None
    """Records there for later batches when this one completed: those it left behind plus those taken
    while it ran. None when unknown (estimators then estimate it from the backlog, the overrun and the
    rate). Unlike a rate x time estimate it sees a rate that changed while the batch ran."""

    @property
    def lateness(self) -> float:
        """How long after it was due the batch started: scheduling_delay beyond one interval, 0 while the
        pipeline keeps up. This is Spark Streaming's schedulingDelay (processing start - batch time),
        which does not count the interval in which a batch's records are collected."""
        return max(0.0, self.scheduling_delay - self.batch_interval)

    def __post_init__(self) -> None:
        if self.batch_id < 0:
            raise ValueError(f"batch_id must be >= 0, got {self.batch_id}")
        if self.records < 0:
            raise ValueError(f"records must be >= 0, got {self.records}")
        for count in ("backlog", "waiting"):
            value = getattr(self, count)
            if value is not None and value < 0:
                raise ValueError(f"{count} must be >= 0 records or None, got {value}")
        for field in ("completed_at", "processing_delay", "scheduling_delay"):
            value = getattr(self, field)
            # finite too: an infinite time would turn every rate derived from it into NaN
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{field} must be a finite number of seconds >= 0, got {value}")
        if not (math.isfinite(self.batch_interval) and self.batch_interval > 0):
            raise ValueError(
                f"batch_interval must be a finite number of seconds > 0, got {self.batch_interval}"
            )
