"""Swapping a cluster's pipeline under load, on real parts: two receiver nodes replicating to each other
(grpc.aio servers on loopback), a ClusterDriver running a real Spark query over them, a producer on each
node that keeps pushing. The sinks are compared with what was acked: every record exactly once."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from live_service import SWAP_ACK_PAUSE, Load
from test_cluster_source import nodes

from ingest import cli
from ingest.cluster_driver import ClusterDriver
from ingest.config import RateConfig
from ingest.driver_config import DriverConfig
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import loopback_cluster


def values_in(spark: Any, *sinks: Path) -> dict[bytes, list[str]]:
    """value -> the pipeline tags that wrote it, over the sinks' committed files."""
    from pyspark.errors import AnalysisException

    seen: dict[bytes, list[str]] = {}
    for sink in sinks:
        try:
            rows = spark.read.parquet(str(sink)).select("value", "pipeline").collect()
        except AnalysisException:  # nothing committed there
            continue
        for row in rows:
            seen.setdefault(bytes(row["value"]), []).append(row["pipeline"])
    return seen


@pytest.mark.spark
async def test_a_cluster_driver_swaps_its_pipeline_under_load_and_rolls_a_failed_one_back(
    spark: Any, tmp_path: Path
) -> None:
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters, "events") as servers:
        config = DriverConfig(
            nodes={n.id: n.target for n in clusters[0].nodes},
            streams=("events",),
            data_dir=tmp_path / "driver",
            trigger_interval=0.5,
            pipeline="swap_pipelines:tag_a",
            rate=RateConfig(estimator="fixed", initial_rate=100_000.0),
        )
        driver = ClusterDriver(config)
        await driver.start(spark)
        try:
            sent: list[bytes] = []

            def on_node(node: int) -> Any:
                def make(first: int, n: int) -> tuple[list[bytes], None]:
                    values = [b"n%d-%d" % (node, first + i) for i in range(n)]
                    sent.extend(values)
                    return values, None

                return make

            loads = [Load(servers[i].target, "events", per_tick=100, make=on_node(i)) for i in (0, 1)]
            pushing = [asyncio.create_task(load.run()) for load in loads]
            # the old query commits records of both nodes first (on a slow machine its first batches
            # may hold one node's only): each partition's start offset checked below is then > 0
            deadline = time.monotonic() + 120
            while True:
                committed = await asyncio.to_thread(values_in, spark, config.data_dir / "sink")
                if all(any(v.startswith(b"n%d-" % i) for v in committed) for i in (0, 1)):
                    break
                assert time.monotonic() < deadline, "the old query committed no record of a node"
                assert driver.error() is None, driver.error()
                await asyncio.sleep(0.5)
            stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(driver.rate_target or ""))
            before = await stub.GetPipeline(pb.GetPipelineRequest())
            assert (before.pipeline, before.generation, before.state) == (
                "swap_pipelines:tag_a",
                0,
                "running",
            )
            # a pipeline that fails its first batch: rolled back, the old query goes on
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.SwapPipeline(
                    pb.SwapPipelineRequest(
                        pipeline="swap_pipelines:fails_first_batch", first_batch_timeout_seconds=60
                    )
                )
            assert failed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "refuses batch" in (failed.value.details() or ""), failed.value.details()
            assert driver.error() is None  # a swap's stopped queries are no failure of the driver
            await asyncio.sleep(1)
            asked = time.monotonic()
            view = await stub.SwapPipeline(pb.SwapPipelineRequest(pipeline="swap_pipelines:tag_b"))
            swapped = time.monotonic()
            assert (view.pipeline, view.generation, view.state) == ("swap_pipelines:tag_b", 1, "running")
            assert view.last_swap.outcome == "done", view.last_swap
            # the new query started at the old one's committed end of each node's partition
            assert set(view.last_swap.start_offsets) == {"events/0", "events/1"}, view.last_swap
            assert all(n > 0 for n in view.last_swap.start_offsets.values()), view.last_swap
            await asyncio.sleep(2)
            for load in loads:
                load.stop()
            await asyncio.gather(*pushing)
            for load in loads:
                # the nodes never waited for Spark
                assert load.longest_ack_pause(asked, swapped) < SWAP_ACK_PAUSE
            sinks = (config.data_dir / "sink", Path(view.sink_dir))  # sink-g1-try2: after the failed try
            deadline = time.monotonic() + 120
            seen = await asyncio.to_thread(values_in, spark, *sinks)
            while len(seen) < len(sent) and time.monotonic() < deadline:
                assert driver.error() is None, driver.error()
                await asyncio.sleep(0.5)
                seen = await asyncio.to_thread(values_in, spark, *sinks)
            assert sorted(seen) == sorted(sent)  # every acked record, on both nodes
            assert all(len(tags) == 1 for tags in seen.values())  # each once, across both sinks
            old = values_in(spark, sinks[0])
            new = values_in(spark, sinks[1])
            assert old and new and {t for tags in old.values() for t in tags} == {"a"}
            assert {t for tags in new.values() for t in tags} == {"b"}
            # the driver's Admin serves the pipeline only; settings are the nodes'
            with pytest.raises(grpc.aio.AioRpcError) as elsewhere:
                await stub.GetConfig(pb.GetConfigRequest())
            assert elsewhere.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "each receiver node" in (elsewhere.value.details() or "")
        finally:
            await driver.stop()


@pytest.mark.spark
async def test_a_driver_started_with_reset_pipeline_runs_the_flags_pipeline(
    spark: Any, tmp_path: Path
) -> None:
    """An outside tester's crash loop: a driver swapped to a pipeline that fails at its second batch
    exits; started again with `--pipeline X --reset-pipeline`, it logged that the swapped-in pipeline
    runs, not X, and failed the same way, for good: DriverConfig.serve_config() left reset_pipeline
    out of the query's config, where the PipelineManager reads it. Now X runs as a new generation
    (sink-g2), from where the failing one's committed batch ended."""
    clusters = loopback_cluster(2, replication=2, min_insync=2)
    async with nodes(tmp_path, clusters, "events") as servers:
        config = DriverConfig(
            nodes={n.id: n.target for n in clusters[0].nodes},
            streams=("events",),
            data_dir=tmp_path / "driver",
            trigger_interval=0.5,
            pipeline="swap_pipelines:tag_a",
            rate=RateConfig(estimator="fixed", initial_rate=100_000.0),
        )
        load = Load(servers[0].target, "events", per_tick=50)
        pushing = asyncio.create_task(load.run())
        try:
            driver = ClusterDriver(config)
            await driver.start(spark)
            try:
                await asyncio.sleep(2)
                stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(driver.rate_target or ""))
                view = await stub.SwapPipeline(
                    pb.SwapPipelineRequest(pipeline="swap_pipelines:fails_after_first_batch")
                )
                assert (view.generation, view.last_swap.outcome) == (1, "done"), view
                deadline = time.monotonic() + 60
                while driver.error() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                assert "boom at batch" in (driver.error() or ""), driver.error()
            finally:
                await driver.stop()
            # the way back: the flag's pipeline, reset
            reset = ClusterDriver(dataclasses.replace(config, reset_pipeline=True))
            await reset.start(spark)
            try:
                stub = pb_grpc.AdminStub(grpc.aio.insecure_channel(reset.rate_target or ""))
                view = await stub.GetPipeline(pb.GetPipelineRequest())
                assert (view.pipeline, view.generation) == ("swap_pipelines:tag_a", 2), view
                assert Path(view.sink_dir).name == "sink-g2", view.sink_dir
                deadline = time.monotonic() + 60
                seen: dict[bytes, list[str]] = {}
                while not seen and time.monotonic() < deadline:
                    assert reset.error() is None, reset.error()
                    await asyncio.sleep(0.5)
                    seen = await asyncio.to_thread(values_in, spark, Path(view.sink_dir))
                assert seen and {t for tags in seen.values() for t in tags} == {"a"}
                assert reset.error() is None, reset.error()
            finally:
                await reset.stop()
        finally:
            load.stop()
            await pushing


DRIVER_FLAGS: dict[str, tuple[list[str], Callable[[DriverConfig], object], object]] = {
    # key: (flags, where the driver reads it, the value it must read); the query's settings are read
    # from serve_config(), the ServeConfig the query (SparkDriver, PipelineManager) runs with
    "data-dir": (["--data-dir", "elsewhere"], lambda c: c.serve_config().data_dir, Path("elsewhere")),
    "stream": (["--stream", "s1", "--stream", "s2"], lambda c: c.serve_config().streams, ("s1", "s2")),
    "master": (["--master", "local[2]"], lambda c: c.serve_config().master, "local[2]"),
    "pipeline": (
        ["--pipeline", "swap_pipelines:tag_a"],
        lambda c: c.serve_config().pipeline,
        "swap_pipelines:tag_a",
    ),
    "reset-pipeline": (["--reset-pipeline"], lambda c: c.serve_config().reset_pipeline, True),
    "fail-on-data-loss": (["--no-fail-on-data-loss"], lambda c: c.fail_on_data_loss, False),
    "trigger-interval": (["--trigger-interval", "3"], lambda c: c.serve_config().trigger_interval, 3.0),
    "estimator": (["--estimator", "fixed"], lambda c: c.serve_config().rate.estimator, "fixed"),
    "estimator-params": (
        ["--estimator-params", "horizon=3"],
        lambda c: dict(c.serve_config().rate.estimator_params),
        {"horizon": 3},
    ),
    "initial-rate": (["--initial-rate", "500"], lambda c: c.serve_config().rate.initial_rate, 500.0),
    "min-rate": (["--min-rate", "7"], lambda c: c.serve_config().rate.min_rate, 7.0),
    "max-rate": (["--max-rate", "70000"], lambda c: c.serve_config().rate.max_rate, 70_000.0),
    "host": (["--host", "127.0.0.2"], lambda c: c.rate_host, "127.0.0.2"),
    "port": (["--port", "51999"], lambda c: c.rate_port, 51999),
    "metrics-host": (["--metrics-host", "127.0.0.3"], lambda c: c.metrics_host, "127.0.0.3"),
    "metrics-port": (["--metrics-port", "-1"], lambda c: c.metrics_port, None),
    "health-port": (["--health-port", "51998"], lambda c: c.health_port, 51998),
    "insecure": (["--insecure"], lambda c: c.insecure, True),
    "nodes": ([], lambda c: dict(c.nodes), {0: "127.0.0.1:51101"}),  # given in every case
}
"""Every key of DRIVER_KEYS but the TLS and token files (test_a_driver_takes_its_files_flags) and
the process's own (role; log-level, log-format and spark-log-level, which main and run_driver take)."""


def test_the_driver_hands_its_query_every_setting_it_shares_with_a_server() -> None:
    """serve_config() carries each field DriverConfig shares with ServeConfig by name but the driver's
    own servers' (--reset-pipeline was left out, and the PipelineManager never saw it)."""
    from ingest.config import ServeConfig
    from ingest.driver_config import QUERY_FIELDS

    shared = {f.name for f in dataclasses.fields(DriverConfig)} & {
        f.name for f in dataclasses.fields(ServeConfig)
    }
    assert shared - {"metrics_host", "metrics_port", "health_port"} == set(QUERY_FIELDS)


def test_each_flag_a_driver_takes_changes_what_the_driver_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every setting a driver is documented to take reaches the config it runs with (the query's too),
    and `sluice config check --role driver` shows the value the driver runs with, read back from that
    config: --reset-pipeline reached neither the query, nor the check's listing from it."""
    from test_config_sources import rows

    nodes_file = tmp_path / "nodes.txt"
    nodes_file.write_text("0 127.0.0.1:51101\n")
    base = ["--role", "driver", "--nodes", str(nodes_file)]
    files = {"tls-cert", "tls-key", "client-ca", "auth-file", "peer-token-file", "metrics-tls"}
    own = {"role", "log-level", "log-format", "spark-log-level"}
    assert set(DRIVER_FLAGS) | files | own == cli.DRIVER_KEYS
    default = cli._driver_config(_parsed(base))
    for key, (flags, read, value) in DRIVER_FLAGS.items():
        config = cli._driver_config(_parsed([*base, *flags]))
        assert read(config) == value, (key, read(config))
        if flags:
            assert read(default) != value, key
            capsys.readouterr()
            assert cli.main(["config", "check", *base, *flags]) == 0
            shown = rows(capsys.readouterr().out)[key]
            expected = (
                "-1" if value is None else cli._shown(list(value) if isinstance(value, tuple) else value)
            )
            assert shown == (expected, "flag"), key
    # the settings a driver does not use are not listed as if it did (they are refused when given)
    capsys.readouterr()
    assert cli.main(["config", "check", *base]) == 0
    listed = set(rows(capsys.readouterr().out))
    assert listed <= cli.DRIVER_KEYS and "reset-pipeline" in listed and "replication" not in listed


def test_a_driver_takes_its_files_flags(tmp_path: Path) -> None:
    """The TLS and token files of DRIVER_KEYS reach the driver's config (its rate server's TLS, its
    credentials to the nodes)."""
    from pki import CertificateAuthority

    nodes_file = tmp_path / "nodes.txt"
    nodes_file.write_text("0 127.0.0.1:51101\n")
    ca = CertificateAuthority(tmp_path / "pki")
    cert = ca.issue("localhost", server=True, file_stem="server")
    token = tmp_path / "peer.token"
    token.write_text("a-peer-token\n")
    from test_metrics_security import auth_file

    auth = auth_file(tmp_path / "auth.toml")
    flags = [
        "--tls-cert",
        str(cert.cert_file),
        "--tls-key",
        str(cert.key_file),
        "--client-ca",
        str(ca.cert_file),
    ]
    flags += ["--peer-token-file", str(token), "--auth-file", str(auth), "--metrics-tls"]
    config = cli._driver_config(_parsed(["--role", "driver", "--nodes", str(nodes_file), *flags]))
    assert (config.cert_file, config.key_file, config.ca_file) == (
        cert.cert_file,
        cert.key_file,
        ca.cert_file,
    )
    assert (config.token_file, config.auth_file, config.metrics_tls) == (token, auth, True)
    assert config.tls is not None


def _parsed(argv: list[str]) -> Any:
    args = cli._parser().parse_args(["serve", *argv])
    args.origins = {}
    return args
