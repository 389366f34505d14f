"""A cluster's driver (`sluice serve --role driver`): the Spark query over the receiver nodes, and the
rate they take.

The receiver nodes (`--role receiver`) take and replicate records; the driver runs no receiver. It runs
the streaming query with the "sluice" source in cluster mode (ingest.spark.cluster_source), which reads
every node's partitions over the Blocks service, and closes the rate loop as a single node does: each
completed batch's metrics go to a RateController, served by this process's own RateControl server (the
source's rateTarget, so each batch is capped at the live rate); NodeRates (ingest.node_rates) divides
that rate among the nodes, braked by each node's backlog (`backlog()`: records of its partitions some
holder serves that Spark has not committed, from ListPartitions every BACKLOG_INTERVAL; records gone
from every holder's log are none). Each batch in Spark's commit log
is released on every node (ReleaseBlocks) from its progress event, by SparkDriver.

The query's lifecycle is a PipelineManager's, as on a single node (this driver is its QueryHost): the
rate server also serves Admin's GetPipeline and SwapPipeline (`sluice pipeline swap --target DRIVER`),
holding batches through RateStatus.hold_batches while the old query stops between batches.

Credentials: one set for every call (the nodes and this driver's rate server): the token's principal
needs the consumer and operator roles. With `auth_file` the rate server authenticates with it (the
cluster's auth file); with `tls` it serves TLS (the source's rateCaFile must trust it, as it trusts the
nodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ingest.admin_service import DriverAdminService, DriverIngestService, DriverSessionsService
from ingest.config import (
    ServeConfig,
    is_loopback,
)
from ingest.driver import SparkDriver, batch_metrics
from ingest.driver_config import DRIVER_RUNTIME_SETTINGS, DriverConfig, read_runtime_config
from ingest.logs import JSON, SPARK_QUIET, log_format, say
from ingest.metrics import MetricsServer, SluiceCollector
from ingest.node_rates import NodeRates
from ingest.pipeline_manager import PipelineManager
from ingest.pipeline_state import PipelineStateError
from ingest.preflight import DataDirLock, bind_address, check_ports, lock_checked
from ingest.rate_controller import RateController
from ingest.rate_memory import RateMemory
from ingest.rate_service import RateControlService, apply_rate_settings, estimator_change, pin_again
from ingest.reflection import HealthServicer, enable_reflection
from ingest.runtime_config import SettingError
from ingest.server import ping_options
from ingest.spark.cluster_source import (
    BlocksClient,
    ClusterRefusedError,
    DriverFencedError,
    NodeListError,
    nest,
    split_key,
)
from ingest.spark.listener import BatchCompleted
from ingest.spark.source import (
    OPTION_DRIVER_ID,
)
from ingest.spark.starting import (
    exit_now,
    exit_quietly,
    is_echo,
    start_session,
    stop_spark,
    stopped_first,
    stopped_starting,
)
from ingest.tls import ServerTls, token_file_exposed
from receivers.auth import Authenticator, AuthTable
from receivers.block import countable
from receivers.files import DataDirStateError
from receivers.parsed_service import add_parsed_servicer

log = logging.getLogger(__name__)

QUERY_NAME = "sluice-cluster"
BACKLOG_INTERVAL = 1.0
"""Seconds between two looks at every node's partitions for the backlog NodeRates brakes with."""
SWAP_SETTLE_SECONDS = 120.0
"""At stop, how long a pipeline swap under way may take to end before the query is stopped anyway."""


class ClusterDriver:
    """The driver's parts: rate server, rate controller, node rates, backlog, Spark query.

    `await start(spark)` ... `await stop()`, on one event loop."""

    def __init__(self, config: DriverConfig) -> None:
        self.config = config
        # a bad file fails here, before Spark starts (CredentialsError, AuthFileError: ValueErrors)
        self.credentials = config.credentials()
        # under mutual TLS (--client-ca) a verified certificate names its principal, as on a node: it
        # was ignored here, and an operator the auth file knew by certificate alone was UNAUTHENTICATED
        self.auth = Authenticator(
            AuthTable.load(config.auth_file, client_ca=config.verifies_clients)
            if config.auth_file is not None
            else None,
            client_certificates=config.verifies_clients,
        )
        self.runtime = read_runtime_config(config, announce=True)
        """DATA_DIR/runtime-config.json: the rate's bounds and estimator an operator changed (`sluice rate
        bounds|estimator --target DRIVER`), which override the command line's, and the rate they pinned
        (`sluice rate set RATE --pin`), pinned again; at the next start as a single node's are. A bad
        file: SettingError (a ValueError), before anything starts."""
        self.rate = RateController({}, self.runtime.current.rate, batch_interval=config.trigger_interval)
        self._pin_again()
        self.rate_memory = RateMemory(config.data_dir)
        self.recalled: float | None = None
        """The capacity the running pipeline showed in an earlier run, which the rate started at."""
        self.hold_batches = False
        """While True the source plans no new batch (a pipeline swap stops the query between batches)."""
        self.manager: PipelineManager | None = None
        self.blocks = BlocksClient(config.nodes, self.credentials)
        self.node_list_error: str | None = None
        """Why this driver stops: the nodes' own list disagrees with --nodes (a node answers as another
        id, or lists a node id --nodes lacks), seen while it runs (see _watch_backlog)."""
        self.node_rates = NodeRates(
            config.nodes,
            self.rate,
            credentials=self.credentials,
            backlog=self.backlog,
            trigger_interval=config.trigger_interval,
        )
        self.spark_driver: SparkDriver | None = None
        self.rate_target: str | None = None
        self._rate_port = 0
        self._server: grpc.aio.Server | None = None
        self._committed: dict[str, int] = {}  # {"stream/owner": offset} of the last completed batch
        # {"stream/owner": the records some holder serves, [a, b) ranges} at the last look
        self._readable: dict[str, list[tuple[int, int]]] = {}
        # {"stream/owner": offsets no node serves (ClusterView.gaps), [a, b) ranges} at the last look
        self._gaps: dict[str, list[tuple[int, int]]] = {}
        self._lock = threading.Lock()
        self._poller: asyncio.Task[None] | None = None
        self.health = HealthServicer()
        """grpc.health.v1 on the rate server (and health_port): SERVING while the query runs."""
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        self.registry = CollectorRegistry()
        self.registry.register(SluiceCollector({}, self._batches_completed, nodes=self.node_rates.snapshot))
        self.registry.register(_RateCollector(self.rate))
        self._metrics: MetricsServer | None = None

    @property
    def metrics_port(self) -> int | None:
        return self._metrics.port if self._metrics is not None else None

    def _batches_completed(self) -> int:
        return self.spark_driver.batches_completed if self.spark_driver is not None else 0

    # ---- the node backlog (NodeRates' hook) ----

    def backlog(self) -> dict[int, int]:
        """Records of each node's partitions that Spark has not committed yet and some holder serves,
        as of the last look at the nodes (a partition no holder of which answered: as last seen).
        Records gone from the log of every holder that answered (a start with --accept-wal-damage went
        on without them, recorded in the owner's lost.json; or one under --fsync off) are none: they
        can never be read, and counted, they braked the node's intake until Spark's commits passed
        them. Nor, before the first batch, are records released everywhere already."""
        with self._lock:
            per_node: dict[int, int] = dict.fromkeys(self.config.nodes, 0)
            for key, spans in self._readable.items():
                owner = split_key(key)[1]
                committed = self._committed.get(key, 0)
                unread = sum(max(0, b - max(a, committed)) for a, b in spans)
                per_node[owner] = per_node.get(owner, 0) + unread
            return per_node

    def _records(self, key: str, lo: int, hi: int) -> int:
        """The records of [lo, hi) of partition `key` (what a batch left behind): its offsets but the
        gaps no node serves, as of the last look at the nodes. Offsets past what that look saw, or of
        a partition any node did not answer for, count as records (batch_metrics)."""
        with self._lock:
            return countable(lo, hi, self._gaps.get(key, ()))

    async def _watch_backlog(self) -> None:
        while True:
            try:
                # also renews this driver's lease on every node (receivers.blocks_service)
                view = await asyncio.to_thread(self.blocks.view, self.config.streams, seal=False)
                view.settle({})  # a copy of a log its owner's replaced is no backlog
            except DriverFencedError as exc:  # another driver took the nodes over: error() says so
                log.error("another driver holds the receiver nodes: %s", exc)  # noqa: TRY400 - said in one line
                return
            except NodeListError as exc:
                # no passing failure, and carrying on with the known nodes is worse than stopping: the
                # partitions of a node --nodes lacks are never read (under replication 1: acked records
                # never delivered, not a word), its copies never released (its disk fills, then its
                # producers stall), and it never gets its share of the rate. Its address is not in the
                # nodes' answers (only its id), so the driver cannot take it in itself, as Spark's Kafka
                # source takes in a new partition: the operator corrects --nodes and starts it again.
                # Stopped here, in one line, at once; the query's next plan would stop on it too, with
                # the error inside Spark's traceback.
                self.node_list_error = str(exc)
                log.error("%s", exc)  # noqa: TRY400 - said in one line
                return
            except Exception:  # the brake is advisory: rates go on without it
                log.exception("cannot look at the nodes' partitions for their backlog")
            else:
                with self._lock:
                    self._readable.update({key: view.readable(key) for key in view.holdings})
                    # replaced whole: a gap is known only while every node answers
                    self._gaps = {key: view.gaps(key, 0, view.end(key)) for key in view.holdings}
            await asyncio.sleep(BACKLOG_INTERVAL)

    def _on_batch(self, batch: BatchCompleted, loop: asyncio.AbstractEventLoop) -> None:
        """On a py4j thread: note what is committed, hand the metrics to the loop's controller."""
        end = batch.end_offset or {}
        if all("/" in key for key in end):
            with self._lock:
                self._committed.update(end)
        if loop.is_closed():
            return
        metrics = batch_metrics(
            batch, self.config.trigger_interval, lambda stream, offset: None, self._records
        )
        loop.call_soon_threadsafe(self.rate.on_batch, metrics)

    # ---- lifecycle ----

    async def start(self, spark: Any) -> None:
        """Serve RateControl, start node rates and the backlog watch, then the Spark query (seconds).
        DriverFencedError, before anything starts, if another driver holds a receiver node."""
        config = self.config
        # one driver per cluster: a second (another data dir, by mistake) would release what this one
        # has not read, and each sink would miss records. Claimed on every node that answers.
        named = self.blocks.driver_id = self.blocks.driver_id or driver_id(config.data_dir)
        await asyncio.to_thread(self.blocks.view, config.streams, seal=False)
        if config.metrics_port is not None:
            tls = ServerTls(config.tls) if config.metrics_tls and config.tls is not None else None
            self._metrics = MetricsServer(
                self.registry,
                config.metrics_host,
                config.metrics_port,
                tls=tls,
                authenticator=self.auth if config.auth_file is not None else None,
            )
        await self.serve_rate()
        # the nodes take their share from calls that name this driver, and send operators here
        self.node_rates.name_driver(named, self.advertised_rate_target())
        self.node_rates.start()
        self._poller = asyncio.create_task(self._watch_backlog(), name="sluice-node-backlog")
        loop = asyncio.get_running_loop()
        driver = SparkDriver(
            spark,
            config.serve_config(),
            query_name=QUERY_NAME,
            rate_target=self.rate_target,
            release=self.release,
            source_options={**config.source_options(), OPTION_DRIVER_ID: self.blocks.driver_id or ""},
        )
        driver.on_batch(lambda batch: self._on_batch(batch, loop))
        self.spark_driver = driver
        # the pipeline in force: the config's, or the one a swap put in (DATA_DIR/pipeline.json)
        manager = PipelineManager(driver, self, loop)
        self.manager = manager
        self.recall(manager.current.spec)
        self.rate.on_capacity = lambda capacity: self.rate_memory.remember(manager.current.spec, capacity)
        if config.health_port is not None:
            await self._start_health_port(config.health_port)
        await manager.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)

    async def serve_rate(self) -> None:
        """Serve RateControl (and Admin's pipeline calls, health, reflection) on config.rate_host and
        rate_port; warn first of what its security settings let through, as a node does."""
        config = self.config
        self._warn_of_exposure()
        server = grpc.aio.server(
            # a taken port fails; the query's LiveRateCap pings it (keepalive.node_channel_options)
            options=[("grpc.so_reuseport", 0), *self.config.grpc_options(), *ping_options(None)]
        )
        add_parsed_servicer(server, self.rate_service(), "RateControl", authenticator=self.auth)
        add_parsed_servicer(
            server, DriverAdminService(lambda: self.manager), "Admin", authenticator=self.auth
        )
        # a push or a sessions call aimed here by mistake is told where to go
        add_parsed_servicer(server, DriverIngestService(self.auth), "Ingest")
        add_parsed_servicer(server, DriverSessionsService(), "Sessions", authenticator=self.auth)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection(server, ["RateControl", "Admin"])
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        address = f"{config.rate_host}:{config.rate_port}"
        if config.tls is not None:
            port = server.add_secure_port(address, ServerTls(config.tls).grpc_credentials())
        else:
            port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        host = "127.0.0.1" if config.rate_host in ("0.0.0.0", "::", "") else config.rate_host  # noqa: S104
        self.rate_target = f"{host}:{port}"
        self._rate_port = port

    def advertised_rate_target(self) -> str:
        """Where the nodes' operators find this driver's RateControl: HOST:PORT, or ":PORT" when it
        listens on every address (a node takes the host its calls come from then)."""
        host = self.config.rate_host
        if host in ("0.0.0.0", "::", ""):  # noqa: S104 - a comparison
            return f":{self._rate_port}"
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self._rate_port}"

    def _warn_of_exposure(self) -> None:
        """What a start should say of its security settings (a WARNING each), as a node's start does."""
        if self.config.tls is not None:
            for warning in ServerTls(self.config.tls).material.warnings():
                log.warning("%s", warning)
        if (exposed := token_file_exposed(self.config.token_file)) is not None:
            log.warning("%s", exposed)
        if not self.auth.enabled and not is_loopback(self.config.rate_host):
            # TLS keeps the wire private, it does not say who calls: without an auth file or a client
            # CA every caller is the anonymous principal, operator included
            log.warning(
                "serving on %s without --auth-file or --client-ca: every client that reaches it may "
                "operate the driver (the cluster's rate, pipeline swaps) and read its status",
                self.config.rate_host,
            )

    def rate_service(self) -> RateControlService:
        """The driver's RateControl: the global rate, its split among the nodes, the query's streams
        and hold; a pin is kept in DATA_DIR/runtime-config.json."""
        return RateControlService(
            self.rate,
            {},
            nodes=self.node_rates.snapshot,
            pipeline=lambda: (self.config.streams, self.hold_batches),
            settings=self.change_settings,
            pin=self.runtime.pin,
        )

    def change_settings(
        self, values: Mapping[str, str], reset: Sequence[str] = ()
    ) -> tuple[ServeConfig, ServeConfig]:
        """Change the rate's settings (DRIVER_RUNTIME_SETTINGS) as the rate API's SetBounds and
        SetEstimator ask: kept in DATA_DIR/runtime-config.json first, then put in force, as on a single
        node (a restart once went back to the command line's bounds and estimator without a word):
        (old, new).
        SettingError, OSError: nothing changed."""
        others = [key for key in values if key not in DRIVER_RUNTIME_SETTINGS]
        if others:  # the rate API sets none of them; kept, they would stop the next start
            raise SettingError(f"not a driver's setting: {', '.join(others)}")
        # another estimator than --estimator's runs with its own defaults, not --estimator-params
        values, reset = estimator_change(self.runtime.base.rate, values, reset)
        old, new = self.runtime.change(values, reset)
        apply_rate_settings(self.rate, self.runtime, old.rate, new.rate)
        return old, new

    def _pin_again(self) -> None:
        """The rate an operator pinned before the restart is pinned again, and said so (it was lost
        without a word: the driver came back at its initial or recalled rate, under the estimator)."""
        pin_again(self.rate, self.runtime)

    def recall(self, pipeline: str) -> float | None:
        """Start the rate at the capacity `pipeline` showed in an earlier run (ingest.rate_memory), as
        config.recall_capacity allows (never over a pinned rate); what it started at, or None."""
        fixed = self.runtime.current.rate.estimator == "fixed"  # the command line's, or kept since
        if not self.config.recall_capacity or fixed or self.rate.pinned:
            return None
        recalled = self.rate_memory.recall(pipeline)
        if recalled is not None:
            self.rate.update(recalled)  # clamped to the bounds; the estimator starts there
            self.recalled = self.rate.rate
        return self.recalled

    # ---- the query's host (ingest.pipeline_manager.QueryHost) ----

    def query_streams(self) -> tuple[str, ...]:
        return self.config.streams

    def known_streams(self) -> Sequence[str]:
        return self.config.streams

    def unread(self, start: Mapping[str, int]) -> bool:
        """Whether any node holds records of a partition past `start` ({"stream/owner": offset}; a
        partition not in it: past its first record still held; a node that does not answer: as its
        copies say). Blocking; True when no node answers (a new query is then proven by a batch)."""
        try:
            view = self.blocks.view(self.config.streams, seal=False)
        except Exception:  # noqa: BLE001 - any failure to look means: do not assume nothing waits
            return True
        if not view.answered:
            return True
        return any(view.end(key) > start.get(key, view.floor(key)) for key in view.holdings)

    async def _start_health_port(self, port: int) -> None:
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), *self.config.health_grpc_options()]
        )  # a taken port fails
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            bound = server.add_insecure_port(f"0.0.0.0:{port}")  # every address: probes come from the kubelet
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(f"cannot bind the health port {port}")
        await server.start()
        self._health_server, self.health_port = server, bound

    async def query_failed(self) -> None:
        """Probes see NOT_SERVING: the query failed (the process exits next)."""
        await self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)

    def release(self, end: Mapping[str, int], incarnations: Mapping[str, str] | None = None) -> None:
        """Release a committed end offset ({"stream/owner": offset}) on every node (blocking), of the
        logs of those incarnations ({"stream/owner": id}; a node whose log is another releases none)."""
        self.blocks.release(nest({k: v for k, v in end.items() if "/" in k}, incarnations))

    def error(self) -> str | None:
        """Why the query failed for good (a swap stops and starts queries: not a failure meanwhile), or
        why this driver must stop (another holds the receiver nodes)."""
        if self.blocks.fenced is not None:
            return f"another driver holds the receiver nodes: {self.blocks.fenced}"
        if self.node_list_error is not None:
            return self.node_list_error
        if self.manager is not None:
            return self.manager.failure()
        return self.spark_driver.error() if self.spark_driver is not None else None

    async def stop(self) -> None:
        """Stop the query (releasing its last commit), then the rate parts (idempotent)."""
        await self.health.enter_graceful_shutdown()
        if self.manager is not None:  # a swap goes on when its call ends: not under the stop
            await self.manager.settled(SWAP_SETTLE_SECONDS)
        if self.spark_driver is not None:
            try:
                await asyncio.to_thread(self.spark_driver.stop)
            except Exception as exc:  # noqa: BLE001 - e.g. Spark stopped under a start a signal ended
                # the rest must still go: the rate port, the nodes' lease (a replacement waits it out)
                log.warning(
                    "stopping the Spark query failed: %s", str(exc).splitlines()[0] if str(exc) else exc
                )
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        await self.node_rates.close()
        if self._server is not None:
            await self._server.stop(1)
            self._server = None
        if self._health_server is not None:
            await self._health_server.stop(None)
            self._health_server = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self.blocks.fenced is None:  # a replacement need not wait out the lease
            await asyncio.to_thread(self.blocks.give_back)
        self.blocks.close()


class _RateCollector(Collector):
    """The driver's global rate and capacity estimate (the receivers' own /metrics show their share)."""

    def __init__(self, rate: RateController) -> None:
        self._rate = rate

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "sluice_cluster_rate_records_per_second",
            "The rate over every receiver node, records per second (+Inf: unlimited), split by node in "
            "sluice_node_rate_records_per_second.",
            value=self._rate.rate,
        )


async def run_driver(
    config: DriverConfig, *, stop: asyncio.Event | None = None, spark_log_level: str = SPARK_QUIET
) -> int:
    """Run a cluster's driver until SIGINT/SIGTERM (or `stop`); 0, or 1 when the query failed."""
    from ingest.spark.java import java_problem  # noqa: PLC0415
    from ingest.spark.session import build_session  # noqa: PLC0415 - Spark is slow to import

    def session() -> Any:
        return build_session(config.master, log_level=spark_log_level, log_json=log_format() == JSON)

    problem = java_problem()
    if problem is not None:
        say(problem, level=logging.ERROR)
        return 2
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals: list[int] = []  # the stop signals that came, in order
    held: list[DataDirLock] = []

    first_at = [0.0]

    def on_signal(signum: int) -> None:
        if signals:  # a second one while the first's stop is under way: now
            if is_echo(signals[0], first_at[0], signum):
                return  # the same SIGTERM to the process and to its group (GNU timeout)
            exit_now(signum, held[0] if held else None, "the driver")
        signals.append(signum)
        first_at[0] = time.monotonic()
        stop.set()

    with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: `stop` only
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal, sig)
        # `sluice serve` ignores SIGHUP while it starts; a receiver reloads its files on it, the driver
        # does not: said, rather than ignored without a word
        loop.add_signal_handler(
            signal.SIGHUP,
            lambda: log.warning("SIGHUP: the driver does not re-read its files; restart it to take new ones"),
        )
    try:
        driver = ClusterDriver(config)
    except DataDirStateError as exc:  # runtime-config.json damaged: a failure, as on a node
        say(str(exc), level=logging.ERROR)
        return 1
    except ValueError as exc:  # a credentials file, the auth file
        say(str(exc), level=logging.ERROR)
        return 2
    try:
        lock = prepare_driver(config)
    except OSError as exc:
        driver.blocks.close()
        say(f"cannot start the driver: {exc}", level=logging.ERROR)
        return 1
    try:
        driver.blocks.driver_id = driver_id(config.data_dir)  # before Spark starts, as the lock
    except OSError as exc:
        lock.release()
        driver.blocks.close()
        say(f"cannot start the driver: {exc}", level=logging.ERROR)
        return 1
    held.append(lock)
    try:
        return await _run(driver, stop, session, signals)
    finally:
        lock.release()


DRIVER_ID_FILE = "driver-id"


def driver_id(data_dir: Path) -> str:
    """This driver's id (receivers.blocks_service's lease), kept in DATA_DIR/driver-id: a restarted
    driver is the same driver to the nodes; one with another data dir is another."""
    path = data_dir / DRIVER_ID_FILE
    with contextlib.suppress(FileNotFoundError, UnicodeDecodeError):
        known = path.read_text().strip()
        if re.fullmatch(r"[0-9a-f]{32}", known):
            return known
    made = uuid.uuid4().hex
    data_dir.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{DRIVER_ID_FILE}.part")
    part.write_text(made + "\n")
    part.replace(path)
    return made


def prepare_driver(config: DriverConfig) -> DataDirLock:
    """What can fail before Spark's JVM starts (seconds): the data dir, locked for this process (two
    drivers on one checkpoint fail each other's batches), and the ports (gRPC's SO_REUSEPORT would let a
    second driver share the rate port, its callers split between the two). An OSError, nothing held."""
    return lock_checked(
        config.data_dir,
        lambda: check_ports(
            (config.rate_host, config.rate_port, "cannot serve the rate on"),
            (config.metrics_host, config.metrics_port),
            config.health_port,
        ),
    )


async def _run(  # noqa: PLR0911 - one return per way the start ends
    driver: ClusterDriver, stop: asyncio.Event, session: Callable[[], Any], signals: Sequence[int] = ()
) -> int:
    """run_driver's lifecycle, once the data dir is locked: Spark (`session()`), the driver, the wait.
    A stop (a signal: `signals`) while Spark or the query starts ends the start (stopped_starting)."""
    config = driver.config
    # Spark's JVM first: a fork while gRPC's threads run can break both (see ingest.cli); a minute or
    # two on a slow machine, which a stop signal ends
    spark = await start_session(session, stop)
    if spark is None:
        driver.blocks.close()
        return stopped_starting(signals, "before the driver was up")
    spark_stopped = False
    try:
        starting = asyncio.ensure_future(driver.start(spark))
        if await stopped_first(starting, stop):  # the query's start: seconds, more on a slow machine
            starting.cancel()
            spark_stopped = True
            if not await stop_spark(spark):
                # driver.stop and asyncio.run would wait for the query's start threads: not past the bound
                exit_quietly(stopped_starting(signals, "before the driver was up", spark_stopped=False), None)
            return stopped_starting(signals, "before the driver was up")
        try:
            starting.result()
        except PipelineStateError as exc:  # pipeline.json, or the pipeline in force does not load
            say(f"cannot start the Spark query: {exc}", level=logging.ERROR)
            return 1
        except (DriverFencedError, NodeListError) as exc:  # NodeListError: the --nodes file is wrong
            held = "another driver holds the receiver nodes: " if isinstance(exc, DriverFencedError) else ""
            say(f"cannot start the driver: {held}{exc}", level=logging.ERROR)
            return 1
        except ClusterRefusedError as exc:  # every node that answered refused its credentials
            say(
                "cannot start the driver: the receiver nodes refused its credentials (--peer-token-file's "
                f"principal needs the consumer and operator roles): {'; '.join(exc.refusals)}",
                level=logging.ERROR,
            )
            return 1
        if driver.recalled is not None:
            say(
                f"this pipeline showed {driver.recalled:.0f} records/s before ({driver.rate_memory.path}): "
                "the rate starts there"
            )
        metrics = ""
        if driver.metrics_port is not None:
            metrics = f", metrics on {bind_address(config.metrics_host, driver.metrics_port)}/metrics"
        health_port = "" if driver.health_port is None else f", health on 0.0.0.0:{driver.health_port}"
        say(
            f"driver of {len(config.nodes)} receiver nodes, streams {', '.join(config.streams)}; "
            f"rate on {driver.rate_target}{metrics}{health_port}",
            event="serving",
        )
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            if driver.error() is not None:
                await driver.query_failed()
                stopping = driver.blocks.fenced is not None or driver.node_list_error is not None
                failed = "stopping" if stopping else "the Spark query failed"
                say(f"{failed}: {driver.error()}", level=logging.ERROR)
                return 1
        return 0
    finally:
        await driver.stop()
        if not spark_stopped:
            await asyncio.to_thread(spark.stop)
