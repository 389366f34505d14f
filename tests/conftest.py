"""Shared test fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

# The shared Spark session forks its JVM from this process after gRPC tests have run; gRPC's fork
# handlers, run while its threads are busy, can break the child ("Java gateway process exited") or the
# poller. The child only execs java, so it needs none of them. Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (2 cores) for the whole test run, with the "sluice" source registered."""
    # imported here so that tests which do not need Spark do not pay for importing it
    from ingest.spark.session import build_session, java_problem

    problem = java_problem()
    if problem is not None:
        pytest.fail(problem)
    session = build_session("local[2]", app_name="sluice-tests")
    yield session
    session.stop()
