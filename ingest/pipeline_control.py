"""What the Admin service asks of the running Spark query: its view, a swap, a restart.

The Admin service (ingest.admin_service) is served by the gRPC server, which starts before Spark and
also runs without it (`--no-spark`, a cluster's receiver nodes): it holds a PipelineControl only once
a driver attaches one (SluiceServer.pipeline_control). The implementation lives with the driver
(ingest.pipeline_manager).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

DEFAULT_FIRST_BATCH_TIMEOUT = 120.0
"""Seconds a new query has to complete its first batch before a swap rolls back."""

BOUNDARY_TIMEOUT = 60.0
"""Seconds the old query's batch in flight has to finish once held; past that it is stopped anyway and
its batch is redone by the next query (a sink that is not idempotent may then see it twice)."""

STOP_TIMEOUT = 60.0
"""Seconds a query's stop waits for its running batch (spark.sql.streaming.stopTimeout, which the service
sets to this unless it is configured: ingest.spark.session): a rollback from a first batch that hangs
waits that long for it."""


class PipelineError(Exception):
    """Base of what a pipeline change refuses; the message is told to the operator."""


class InvalidPipeline(PipelineError, ValueError):
    """The new pipeline cannot even be tried (a malformed spec, a module that does not import): nothing
    was stopped. INVALID_ARGUMENT."""


class SwapInProgress(PipelineError):
    """Another swap or restart is under way. ABORTED."""


class SwapRolledBack(PipelineError):
    """The new query failed to start or failed its first batch; the old pipeline runs again.
    FAILED_PRECONDITION, with the new query's error."""

    def __init__(self, message: str, view: pb.PipelineView) -> None:
        super().__init__(message)
        self.view = view


class PipelineUnavailable(PipelineError):
    """No query runs here (no Spark on this node, or it stopped). FAILED_PRECONDITION."""


class PipelineControl(Protocol):
    """The running query's lifecycle, as the Admin service sees it."""

    @property
    def changes(self) -> Mapping[tuple[str, str], int]:
        """(kind: "swap" | "restart", outcome: "done" | "rolled_back") -> count, for metrics."""
        ...

    @property
    def generation(self) -> int:
        """The running pipeline's generation (0, then +1 per swap kept)."""
        ...

    def view(self) -> pb.PipelineView:
        """The pipeline that runs now and how the last swap went."""
        ...

    async def swap(self, spec: str, *, keep_state: bool, first_batch_timeout: float) -> pb.PipelineView:
        """Replace the query by `spec` ("" for the built-in Parquet sink) at a batch boundary; return
        once its first batch completed. Raises InvalidPipeline, SwapInProgress, SwapRolledBack,
        PipelineUnavailable."""
        ...

    async def restart(self, *, trigger_interval: float) -> None:
        """Restart the same query on its own checkpoint (state kept) with a new trigger interval.
        Raises SwapInProgress, SwapRolledBack (the old interval runs again), PipelineUnavailable."""
        ...
