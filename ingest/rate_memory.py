"""The pipeline's capacity remembered across restarts: DATA_DIR/rate-memory.json.

A fresh start knows nothing of the pipeline, so its first batches are bounded by the receivers' memory
alone (RateController.unmeasured_batch_records): 500,000 records, which a pipeline of 10,000 records/s
takes 50 s over, a batch at a time, until the estimator has measured one. A restart of the same
pipeline need not guess: the capacity the estimator last measured is kept here (a few times a minute
at most) and, when the query that starts runs the same pipeline spec, bounds those first batches to
RECALLED_INTERVALS x it x the trigger interval (never more than memory allows). A fast pipeline's bound
stays the memory's; another pipeline, or no file, starts as a fresh data dir does. A cluster's driver
(ingest.cluster_driver), which runs no receivers, starts its rate at the recalled capacity instead.

A hint, not state: the file is written without fsync, and one that cannot be read is logged and
ignored (the start goes on unbounded by it), unlike pipeline.json or runtime-config.json.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from ratecontrol import MAX_RATE
from receivers.files import read_json, replace_json

log = logging.getLogger(__name__)

FILE = "rate-memory.json"
SAVE_EVERY = 10.0
"""Seconds between writes of a capacity that keeps changing (the first one is written at once)."""


class RateMemory:
    """Reads and writes DATA_DIR/rate-memory.json: {"pipeline": spec, "capacity": records/s, ...}."""

    def __init__(self, data_dir: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = data_dir / FILE
        self._clock = clock
        self._saved: tuple[str, float] | None = None
        self._saved_at = -math.inf
        self._failed = False

    def recall(self, pipeline: str) -> float | None:
        """The capacity remembered for `pipeline` (its spec; "" for the built-in sink), or None."""
        try:
            data = read_json(self.path, "the remembered capacity", ValueError)
        except ValueError as exc:
            log.warning("%s; ignored: the start goes on as a fresh one", exc)
            return None
        if data is None:
            return None
        capacity = data.get("capacity") if isinstance(data, dict) else None
        if not isinstance(capacity, int | float) or not 0 < capacity <= MAX_RATE:
            # past MAX_RATE (edited, or another version's): no rate may be that, and a driver starts at it
            log.warning("%s: no capacity in it; ignored: the start goes on as a fresh one", self.path)
            return None
        if data.get("pipeline") != pipeline:
            return None  # measured on another pipeline: says nothing about this one
        self._saved = (pipeline, float(capacity))  # the first measured capacity is written at once
        return float(capacity)

    def remember(self, pipeline: str, capacity: float) -> None:
        """Keep `capacity` (records/s, as the estimator measured it) for `pipeline`: at once when the
        pipeline changed, else at most every SAVE_EVERY seconds and only when it moved."""
        if not 0 < capacity < math.inf:
            return
        capacity = min(capacity, MAX_RATE)  # as recall() takes it back
        now = self._clock()
        same = self._saved is not None and self._saved[0] == pipeline
        if same and (self._saved == (pipeline, capacity) or now - self._saved_at < SAVE_EVERY):
            return
        data = {"pipeline": pipeline, "capacity": capacity, "saved_at": time.time()}
        try:
            replace_json(self.path, data, sync=False)  # a hint: a torn or lost one is ignored
        except OSError as exc:
            if not self._failed:
                log.warning("cannot keep the measured capacity in %s: %s", self.path, exc)
            self._failed = True
            return
        self._failed = False
        self._saved, self._saved_at = (pipeline, capacity), now
