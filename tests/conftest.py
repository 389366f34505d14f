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


# Tests that start Spark, here (the `spark` fixture) or in a `sluice serve` subprocess, run one at a
# time: under `pytest -n 2 --dist loadgroup` they share one worker ("spark") while the other worker
# takes the rest. Two Spark tests at once on 2 cores starve each other past their deadlines.
SPARK_GROUP = "spark"
_SPARK_MARKS = ("spark", "cluster")


def starts_spark(item: pytest.Item) -> bool:
    """Whether the test starts Spark: it uses the shared session or carries a mark that says so."""
    return "spark" in getattr(item, "fixturenames", ()) or any(
        item.get_closest_marker(mark) for mark in _SPARK_MARKS
    )


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Spark tests go to one xdist group; where they will run, every Spark JVM they start (here and in
    subprocesses, which inherit the environment) starts with fast_jvm's options; TESTS_DEFAULT_JVM=1
    keeps Java's defaults."""
    spark_items = [item for item in items if starts_spark(item)]
    for item in spark_items:
        item.add_marker(pytest.mark.xdist_group(SPARK_GROUP))
        if "spark" in getattr(item, "fixturenames", ()) and item.get_closest_marker("spark") is None:
            item.add_marker(pytest.mark.spark)  # so `-m spark` selects every test on the shared session
    if os.environ.get("TESTS_DEFAULT_JVM") == "1" or config.option.collectonly or not spark_items:
        return
    from tests import fast_jvm

    cache = getattr(config, "cache", None)
    folder = Path(tempfile.gettempdir()) / "sluice-test-cds" if cache is None else cache.mkdir("spark-cds")
    os.environ["SPARK_SUBMIT_OPTS"] = fast_jvm.submit_options(Path(folder))


class _GroupCheck:
    """Under `--dist loadgroup`, after xdist has added "@spark" to the Spark tests' node ids: a pytest
    on which that takes no effect (9.2: pytest-xdist#1386) ran the Spark tests on both workers at once,
    silently, and they starved each other and fought over the default ports."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        ungrouped = [item.nodeid for item in items if starts_spark(item) and "@" not in item.nodeid]
        if ungrouped:
            raise pytest.UsageError(
                f"--dist loadgroup does not group the Spark tests with pytest {pytest.__version__} "
                f"(pytest-xdist#1386), e.g. {ungrouped[0]}: install pytest<9.2, or run with -n 0"
            )


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_GroupCheck(), "sluice-group-check")


@pytest.fixture(scope="session")
def _java_that_starts_no_jvm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A JAVA_HOME whose java answers `-version` (so preflights pass) and refuses to start a JVM."""
    home = tmp_path_factory.mktemp("no-jvm-java")
    java = home / "bin" / "java"
    java.parent.mkdir()
    java.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -version ]; then echo \'openjdk version "17.0.0" (no JVM)\' >&2; exit 0; fi\n'
        "echo 'this test starts Spark but is not marked so (tests/conftest.py: mark it spark)' >&2\n"
        "exit 1\n"
    )
    java.chmod(0o755)
    return home


@pytest.fixture(autouse=True)
def _no_jvm_outside_the_spark_group(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked as starting Spark gets a java that starts no JVM, so one that starts Spark
    unmarked fails at once, in every run, instead of racing a Spark test on the other worker now and
    then. Java's checks (`java -version`) still pass."""
    if not starts_spark(request.node):
        monkeypatch.setenv("JAVA_HOME", str(request.getfixturevalue("_java_that_starts_no_jvm")))


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
