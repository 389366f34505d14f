"""Shared test fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


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
