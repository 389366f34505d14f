"""The configuration of `sluice serve --role driver` (DriverConfig) and the files a driver reads as it
starts (check_files, read_runtime_config): kept apart from ingest.cluster_driver, which starts Spark, so
that `sluice config check --role driver` and a driver refused on a bad file do not import pyspark."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ingest.config import (
    DEFAULT_CONNECTION_IDLE,
    DRIVER_ONLY_SETTINGS,
    ConnectionBounds,
    RateConfig,
    SecurityConfig,
    ServeConfig,
    TlsConfig,
    check_exposure,
)
from ingest.runtime_config import RuntimeConfig, SettingError
from ingest.tls import load_tls
from receivers.auth import AuthTable
from sluice_client.credentials import Credentials

QUERY_FIELDS = (
    *("data_dir", "streams", "master", "pipeline", "reset_pipeline", "trigger_interval"),
    *("fail_on_data_loss", "rate"),
)
"""DriverConfig's fields that its serve_config() hands to the query's ServeConfig, as they are. The other
fields the two share by name are the driver's own servers' (its metrics and health ports), which the
driver serves itself (SparkDriver serves none)."""


@dataclass(frozen=True)
class DriverConfig(ConnectionBounds):
    """What `sluice serve --role driver` runs."""

    nodes: Mapping[int, str]
    """The receiver nodes: node id -> host:port (receivers.cluster's list)."""
    streams: tuple[str, ...]
    data_dir: Path = Path("sluice-driver")
    """The query's checkpoint, and the default Parquet sink (data_dir/sink)."""
    master: str = "local[*]"
    pipeline: str | None = None
    reset_pipeline: bool = False
    """Start `pipeline` as a new generation where the pipeline swapped in at run time (pipeline.json)
    committed, instead of that one (the way back from a swapped-in pipeline that fails at every start)."""
    trigger_interval: float = 1.0
    fail_on_data_loss: bool = True
    """The source option failOnDataLoss of the query (and of those a pipeline swap starts): a node's log
    lost under the checkpoint stops the query (DataLossError); False: a WARNING, and the new log is read
    from its start (`--no-fail-on-data-loss`)."""
    rate: RateConfig = field(default_factory=RateConfig)
    recall_capacity: bool = True
    """Start the rate at the capacity this pipeline showed in an earlier run (DATA_DIR/rate-memory.json,
    ingest.rate_memory) instead of `rate.initial_rate`; False when the operator gave an initial rate. Not
    under the fixed estimator (its rate is the operator's)."""
    max_records_per_batch: int | None = None
    rate_host: str = "127.0.0.1"
    """Where this driver's RateControl server listens (the source, in Spark's driver-side Python
    worker, asks it; operators' `sluice rate` too)."""
    rate_port: int = 0
    ca_file: Path | None = None
    """TLS to the nodes (and to the rate server): the CA their certificates chain to."""
    cert_file: Path | None = None
    key_file: Path | None = None
    token_file: Path | None = None
    """A principal with the consumer and operator roles."""
    auth_file: Path | None = None
    """The rate server's auth file (the cluster's); None: it takes any caller (bind it to loopback)."""
    tls: TlsConfig | None = None
    """The rate server's TLS; None: plaintext."""
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    """Prometheus /metrics (the global rate, each node's share, up and backlog, batches); None: off.
    With `auth_file` a reader's or operator's token is needed, with `metrics_tls` it is HTTPS."""
    metrics_tls: bool = False
    health_port: int | None = None
    """Also serve grpc.health.v1 alone, in plaintext, on this port (Kubernetes' probes); the rate
    server serves it in any case. SERVING while the query runs."""
    insecure: bool = False
    """Allow the rate server or /metrics in plaintext on an address that is not a loopback one
    (`--insecure`), as a receiver node allows its own: refused otherwise."""
    handshake_timeout: float = SecurityConfig.handshake_timeout
    connection_idle_timeout: float = DEFAULT_CONNECTION_IDLE
    max_connections: int | None = None
    """What the rate server's and the health port's connections may hold, as a node's
    (SecurityConfig: --handshake-timeout, --connection-idle-timeout, --max-connections)."""

    def __post_init__(self) -> None:
        self.check_connection_bounds()
        if self.metrics_tls and self.tls is None:
            raise ValueError("metrics TLS needs the driver's certificate and key (--tls-cert, --tls-key)")
        # the rate server takes Admin's pipeline swaps and the rate, /metrics tells the cluster's state
        check_exposure(
            self.rate_host,
            tls=self.tls is not None,
            metrics_host=self.metrics_host if self.metrics_port is not None else None,
            metrics_tls=self.metrics_tls,
            insecure=self.insecure,
        )
        for what, port in (("metrics port", self.metrics_port), ("health port", self.health_port)):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{what} must be 0-65535, got {port}")
        if not self.nodes:
            raise ValueError("a driver needs the receiver nodes (none given)")
        if not self.streams:
            raise ValueError("a driver needs the streams to read (none given)")
        self.serve_config()  # the query's settings, checked as a single server checks them (trigger...)

    @property
    def verifies_clients(self) -> bool:
        """Whether a client certificate can name a principal (mutual TLS: a client CA)."""
        return self.tls is not None and self.tls.client_ca_file is not None

    def credentials(self) -> Credentials:
        return Credentials.from_files(
            ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file, token_file=self.token_file
        )

    def serve_config(self) -> ServeConfig:
        """The single-node config SparkDriver and the PipelineManager read: streams, checkpoint and sink,
        trigger, pipeline, --reset-pipeline. Every field this config shares with ServeConfig by name is
        carried (QUERY_FIELDS; tests/test_cluster_swap.py checks it): --reset-pipeline was once left out,
        and the driver ran the swapped-in pipeline it was meant to replace, failing at every start."""
        return ServeConfig(**{name: getattr(self, name) for name in QUERY_FIELDS}, metrics_port=None)

    def source_options(self) -> dict[str, str]:
        from ingest.spark.source import (  # noqa: PLC0415 - pyspark: only a driver that starts needs them
            OPTION_FAIL_ON_DATA_LOSS,
            OPTION_MAX_RECORDS,
            OPTION_RATE_CA_FILE,
            OPTION_RATE_CERT_FILE,
            OPTION_RATE_KEY_FILE,
            OPTION_RATE_TOKEN_FILE,
            OPTION_RECEIVERS,
        )

        options = {
            OPTION_RECEIVERS: ",".join(f"{n}={t}" for n, t in sorted(self.nodes.items())),
            OPTION_FAIL_ON_DATA_LOSS: "true" if self.fail_on_data_loss else "false",
        }
        for name, path in (
            (OPTION_RATE_CA_FILE, self.ca_file),
            (OPTION_RATE_CERT_FILE, self.cert_file),
            (OPTION_RATE_KEY_FILE, self.key_file),
            (OPTION_RATE_TOKEN_FILE, self.token_file),
        ):
            if path is not None:
                options[name] = str(path)
        if self.max_records_per_batch is not None:
            options[OPTION_MAX_RECORDS] = str(self.max_records_per_batch)
        return options


def check_files(config: DriverConfig) -> None:
    """Read and check the files a driver reads as it starts, as it reads them: its TLS files (the rate
    server's), the auth file, and its credentials to the nodes (the same certificate and key, the
    client CA as the nodes' CA, the peer token file). A ValueError naming the file (TlsFileError,
    AuthFileError, CredentialsError). `sluice config check --role driver` runs it, and `sluice serve
    --role driver` before anything starts, as a single server's check_security."""
    if config.tls is not None:
        load_tls(config.tls)
    if config.auth_file is not None:
        AuthTable.load(config.auth_file, client_ca=config.verifies_clients)
    config.credentials()


DRIVER_RUNTIME_SETTINGS = tuple(key for key in DRIVER_ONLY_SETTINGS if key != "trigger-interval")
"""The run-time settings a driver keeps in its DATA_DIR/runtime-config.json: the rate's bounds and
estimator (with its parameters: a new estimator drops those of the old one), as `sluice rate
bounds|estimator --target DRIVER` change them (RateControlService with
ClusterDriver.change_settings), beside a pinned rate. Those of DRIVER_ONLY_SETTINGS (what a receiver
node leaves to the driver) that change at run time: all but the trigger interval, a flag of the
driver's start."""


def read_runtime_config(config: DriverConfig, *, announce: bool = False) -> RuntimeConfig:
    """DATA_DIR/runtime-config.json as the driver reads it at its start (read, never written): the rate's
    bounds and estimator an operator changed (DRIVER_RUNTIME_SETTINGS) and the rate they pinned. A bad
    file (not JSON, a pinned_rate that is no rate, a value its setting refuses, another setting: a
    receiver node's, which the driver would run without): SettingError (a ValueError) naming it.
    ClusterDriver reads it so (`announce`: each setting logged), and `sluice config check --role driver`
    (which said "valid" where `serve --role driver` then stopped on it, exit 2)."""
    runtime = RuntimeConfig(config.serve_config(), announce=announce)
    others = [key for key in runtime.overrides if key not in DRIVER_RUNTIME_SETTINGS]
    if others:
        raise SettingError(
            f"{runtime.path}: {', '.join(others)} {'are' if len(others) > 1 else 'is'} not a driver's "
            f"setting (it keeps only {', '.join(DRIVER_RUNTIME_SETTINGS)} there, and a pinned rate): remove "
            f"{'them' if len(others) > 1 else 'it'} from the file"
        )
    return runtime
