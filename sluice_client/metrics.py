"""Client-side Prometheus metrics, in the process's default registry (where a client app exports its own)."""

from __future__ import annotations

from prometheus_client import Counter

RECORDS_DROPPED = Counter(
    "sluice_client_records_dropped",
    "Records dropped by a bounded buffer in front of a producer, by overflow strategy.",
    ["overflow"],
)
