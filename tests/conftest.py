"""Shared test fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The shared Spark session forks its JVM from this process after gRPC tests have run; gRPC's fork
# handlers, run while its threads are busy, can break the child ("Java gateway process exited") or the
# poller. The child only execs java, so it needs none of them. Set before anything imports grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where Spark tests will run, every Spark JVM they start (here and in subprocesses, which inherit
    the environment) starts with fast_jvm's options; TESTS_DEFAULT_JVM=1 keeps Java's defaults."""
    if os.environ.get("TESTS_DEFAULT_JVM") == "1" or config.option.collectonly:
        return
    if not any(item.get_closest_marker("spark") or item.get_closest_marker("cluster") for item in items):
        return
    from tests import fast_jvm

    cache = getattr(config, "cache", None)
    folder = Path(tempfile.gettempdir()) / "sluice-test-cds" if cache is None else cache.mkdir("spark-cds")
    os.environ["SPARK_SUBMIT_OPTS"] = fast_jvm.submit_options(Path(folder))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local Spark session (2 cores) for the whole test run, with the "sluice" source registered."""
    # imported here so that tests which do not need Spark do not pay for importing it
    from ingest.spark.java import java_problem
    from ingest.spark.session import build_session

    problem = java_problem()
    if problem is not None:
        pytest.fail(problem)
    session = build_session("local[2]", app_name="sluice-tests")
    yield session
    session.stop()
