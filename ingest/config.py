"""Service configuration: one frozen dataclass, every runtime setting in one place."""

from __future__ import annotations

import argparse
import ipaddress
import itertools
import math
import re
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ratecontrol import (
    ESTIMATORS,
    RateBounds,
    StreamPolicy,
    UnknownEstimatorError,
    check_rate,
    make_estimator,
)
from receivers.cluster import Cluster
from receivers.config import DEFAULT_SEGMENT_BYTES, FsyncPolicy, ReceiverConfig
from receivers.errors import cut, shown
from receivers.names import check_stream_name
from receivers.principal import MIN_MESSAGE_BYTES, Limits

DEFAULT_PORT = 50051
DEFAULT_METRICS_PORT = 9464
MIN_SEGMENT_BYTES = 4096
MAX_SEGMENT_BYTES = 2**40
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1
"""gRPC's channel options are C ints: a larger max message length fails its server's creation."""
MAX_TRIGGER_INTERVAL = 86_400.0
MIN_TRIGGER_INTERVAL = 0.01
"""Seconds: the shortest trigger interval, as the shortest block interval (receivers.config). Spark's
trigger counts whole milliseconds (ingest.spark.pipeline starts the query with the interval rounded to
them): 1e-9 was taken and shown as "trigger 1e-09 s" while Spark ran batches back to back (0 ms)."""


DRIVER_ONLY_SETTINGS = ("min-rate", "max-rate", "estimator", "estimator-params", "trigger-interval")
"""The settings (`sluice serve` flags, and run-time settings of ingest.runtime_config, by the same keys) a
cluster's receiver node does not run by: the driver pins its rate (so its bounds and estimator), runs the
estimator and the query (its trigger interval). A node refuses them at its start (ingest.cli), ignores
them kept in its runtime-config.json by an earlier version (ingest.runtime_config), and refuses `sluice
config set` of one (ingest.rate_service.driver_settings_refusal); a node's own bounds would clamp the
share the driver pins it. The driver changes those of them it keeps at run time
(ingest.driver_config.DRIVER_RUNTIME_SETTINGS: all but the trigger interval)."""


@dataclass(frozen=True)
class RateConfig:
    """The rate a node starts with and how it moves."""

    estimator: str = "model"
    """"model" (the default: fixed + per-record cost, backlog drained over a horizon), "spark-pid"
    (Spark's PIDRateEstimator, exactly), or "fixed" (only operators change the rate)."""
    initial_rate: float = 10_000.0
    """Records/s before the first batch is measured: bounds the first batch too. inf: unlimited."""
    min_rate: float = 100.0
    """No estimator goes below this (Spark's spark.streaming.backpressure.pid.minRate)."""
    max_rate: float = math.inf
    """No estimator or operator goes above this."""
    stream_policies: Mapping[str, StreamPolicy] = field(default_factory=dict)
    """Stream -> its weight and bounds in the split of the rate among streams (others: weight 1, no
    bounds); `sluice serve --stream-weight/--stream-min-rate/--stream-max-rate`."""
    estimator_params: Mapping[str, float] = field(default_factory=dict)
    """The estimator's own parameters (e.g. spark-pid's proportional, integral, derivative; model's
    horizon, target_utilisation): `--estimator-params horizon=3,target_utilisation=0.9`."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise UnknownEstimatorError(
                f"unknown estimator {self.estimator!r}; known: {', '.join(ESTIMATORS)}"
            )
        check_rate(self.initial_rate)
        bounds = RateBounds(self.min_rate, self.max_rate)
        if self.estimator_params:  # the estimator checks its own: unknown names, values out of range
            make_estimator(
                self.estimator, bounds=bounds, initial_rate=self.initial_rate, **self.estimator_params
            )


def ascii_float(text: str) -> float:
    """float(text) of ASCII text only. float() and int() take the digits of every script (Arabic-Indic
    "\u0660.\u0665" is 0.5, full-width "\uff11\uff12" is 12); a setting takes ASCII digits alone, which
    is how it is shown back. So is "_": float() takes Python's digit separators ("1_0" is 10), which a
    size never took and no setting shows. A finite number too large for a float (1e400) is refused too,
    rather than read as inf, which to a rate or a bound means no limit at all. ValueError else."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"could not convert string to float: {text!r}")
    value = float(text)
    if math.isinf(value) and "inf" not in text.lower():
        largest = f"{sys.float_info.max:.3g}"
        raise OutOfRange(f"{text} is out of range (the largest number is {largest})")
    return value


class OutOfRange(argparse.ArgumentTypeError, ValueError):
    """A number too large for a float; argparse shows an ArgumentTypeError's own message."""


def ascii_int(text: str) -> int:
    """int(text) of ASCII digits only, no "_" (see ascii_float). OutOfRange for more digits than int()
    takes (4,300: its ValueError told an operator to call sys.set_int_max_str_digits()); ValueError
    else."""
    if not text.isascii() or "_" in text:
        raise ValueError(f"invalid literal for int() with base 10: {text!r}")
    try:
        return int(text)
    except ValueError:
        digits = text.strip().lstrip("+-")
        if digits.isdigit():
            raise OutOfRange(f"an integer of {len(digits):,} digits is out of range") from None
        raise


# as argparse names a flag's type in its message: "argument --port: invalid int value: '\u0665'"
ascii_float.__name__ = "float"
ascii_int.__name__ = "int"


def parse_estimator_params(text: str) -> dict[str, float]:
    """ "name=value,name=value" (numbers) -> {name: value}; "" -> {}. ValueError naming the problem, a
    name given twice too (the last one won, and 100,000 "horizon=" pairs were kept verbatim)."""
    params: dict[str, float] = {}
    twice: dict[str, None] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"estimator parameter {shown(part.strip())} is not name=value")
        try:
            number = ascii_float(value)
        except OutOfRange as exc:
            raise ValueError(f"estimator parameter {cut(name)}: {exc}") from None
        except ValueError:
            raise ValueError(
                f"estimator parameter {cut(name)}: {shown(value.strip())} is not a number"
            ) from None
        if not math.isfinite(number):
            raise ValueError(f"estimator parameter {cut(name)}: {shown(value.strip())} is not finite")
        integral = number.is_integer() and "." not in value and "e" not in value.lower()
        if name in params:
            twice[name] = None
        params[name] = int(number) if integral else number
    if twice:
        names = ", ".join(shown(name) for name in itertools.islice(twice, 5))
        more = f" ({len(twice)} names in all)" if len(twice) > 5 else ""
        raise ValueError(f"estimator parameters given more than once: {names}{more}; give each once")
    return params


def format_estimator_params(params: Mapping[str, float]) -> str:
    return ",".join(f"{k}={v:g}" for k, v in sorted(params.items()))


_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?", re.ASCII)


def check_host(host: str, what: str) -> None:
    """ValueError unless `host` is an address to bind: an IP address (IPv6 also in brackets) or a host
    name (labels of letters, digits, '-' and '_', up to 63 characters each, 253 in all)."""
    if not host.strip():  # bound every address: an unset variable must not expose the server
        raise ValueError(f"{what} is empty (an unset variable?): give 0.0.0.0 or :: for every address")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        address = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        if not bracketed and _HOST_NAME.fullmatch(host):
            return
    else:
        if address.version == 6 or not bracketed:
            return
    raise ValueError(f"{what} {host!r} is neither an IP address nor a host name")


def is_loopback(host: str) -> bool:
    """Whether `host` is only reachable from this machine (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve anywhere


def check_exposure(
    host: str, *, tls: bool, metrics_host: str | None, metrics_tls: bool, insecure: bool
) -> None:
    """Safe defaults: nothing leaves this machine in plaintext unless the operator says so. ValueError for
    a gRPC server on `host` without `tls`, or /metrics on `metrics_host` (None: off) without
    `metrics_tls`, on an address that is not a loopback one, unless `insecure` (`--insecure`): a receiver
    node's, a single server's and a cluster's driver's rule alike."""
    for what, bound, secure in (("gRPC", host, tls), ("metrics", metrics_host, metrics_tls)):
        if bound is not None and not secure and not insecure and not is_loopback(bound):
            raise ValueError(
                f"refusing to serve {what} in plaintext on {bound}, which is not a loopback address: "
                "give --tls-cert and --tls-key"
                + (" (and --metrics-tls)" if what == "metrics" else "")
                + ", or --insecure to accept that anyone on the network can read and send"
            )


@dataclass(frozen=True)
class TlsConfig:
    """TLS for the gRPC server (and /metrics with metrics_tls): PEM files, re-read on SIGHUP."""

    cert_file: Path
    """The server's certificate chain (PEM)."""
    key_file: Path
    """The server's private key (PEM)."""
    client_ca_file: Path | None = None
    """Mutual TLS: every client must present a certificate signed by a CA in this PEM file."""


DEFAULT_CONNECTION_IDLE = 30.0
"""Seconds a gRPC connection with no call in progress is kept (--connection-idle-timeout)."""
MAX_GRPC_MS = 2**31 - 1
"""gRPC's channel options are C ints: milliseconds over this fail the server's creation."""


def default_max_connections() -> int | None:
    """3/4 of the soft open-file limit (RLIMIT_NOFILE), so that connections alone cannot take the files
    the block log, Spark and /metrics need; None when there is no limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    return max(1, min(soft * 3 // 4, MAX_GRPC_MS))


def check_connection_limits(connection_idle_timeout: float, max_connections: int | None) -> None:
    """ValueError for a connection idle timeout or a connection cap gRPC cannot take."""
    if not 0 < connection_idle_timeout * 1000 <= MAX_GRPC_MS:
        raise ValueError(
            f"connection idle timeout must be > 0 s and at most {MAX_GRPC_MS // 1000} s, "
            f"got {connection_idle_timeout}"
        )
    if max_connections is not None and not 1 <= max_connections <= MAX_GRPC_MS:
        raise ValueError(f"max connections must be 1..{MAX_GRPC_MS}, got {max_connections}")


HEALTH_MAX_CONNECTIONS = 64
"""Connections the plaintext health port (--health-port, every interface, no credentials) holds at
once, or --max-connections if lower: probes open one per check. Each gRPC server has a cap of its own,
so at --max-connections the health port beside the service's port let anyone who reaches it take the
files the block log, Spark and the service's port need."""


def grpc_connection_options(
    handshake_timeout: float,
    connection_idle_timeout: float,
    max_connections: int | None,
    *,
    ceiling: int | None = None,
) -> list[tuple[str, int]]:
    """grpc.aio.server options that bound what connections hold, for every server this service binds:
    a client that sends nothing is dropped after `handshake_timeout` (gRPC's default: 120 s), one that
    handshakes and opens no call (or none for a while) after `connection_idle_timeout` (GOAWAY, then
    the close: gRPC's default keeps it forever), and past `max_connections` (None:
    default_max_connections()) a new connection is closed as it is accepted. gRPC has no cap per client
    address: that is the firewall's (docs/security.md). `ceiling`: a cap no connection limit raises
    (the health port's, HEALTH_MAX_CONNECTIONS)."""
    cap = default_max_connections() if max_connections is None else max_connections
    if ceiling is not None:
        cap = ceiling if cap is None else min(cap, ceiling)
    options = [
        ("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout * 1000))),
        ("grpc.max_connection_idle_ms", max(1, round(connection_idle_timeout * 1000))),
    ]
    if cap is not None:
        options.append(("grpc.max_allowed_incoming_connections", cap))
    return options


class ConnectionBounds:
    """What bounds the connections of a config's gRPC servers, by its fields handshake_timeout,
    connection_idle_timeout and max_connections: a node's (SecurityConfig) and a driver's, whose rate
    server and health port are bounded as a node's (ingest.driver_config.DriverConfig)."""

    handshake_timeout: float
    connection_idle_timeout: float
    max_connections: int | None

    def check_connection_bounds(self) -> None:
        """ValueError for a bound gRPC cannot take (from the config's __post_init__)."""
        if not 0 < self.handshake_timeout < math.inf:
            raise ValueError(f"handshake timeout must be > 0 s and finite, got {self.handshake_timeout}")
        check_connection_limits(self.connection_idle_timeout, self.max_connections)

    def grpc_options(self) -> list[tuple[str, int]]:
        """The gRPC server options that bound its connections (grpc_connection_options)."""
        return grpc_connection_options(
            self.handshake_timeout, self.connection_idle_timeout, self.max_connections
        )

    def health_grpc_options(self) -> list[tuple[str, int]]:
        """As grpc_options, for the plaintext health port: at most HEALTH_MAX_CONNECTIONS."""
        return grpc_connection_options(
            self.handshake_timeout,
            self.connection_idle_timeout,
            self.max_connections,
            ceiling=HEALTH_MAX_CONNECTIONS,
        )


@dataclass(frozen=True)
class SecurityConfig(ConnectionBounds):
    """Who may connect and what each principal may take (docs/security.md)."""

    tls: TlsConfig | None = None
    """None: plaintext, allowed on a loopback address only unless `insecure`."""
    auth_file: Path | None = None
    """Principals, roles, streams, limits and token hashes (receivers.auth); re-read on SIGHUP. None:
    no tokens; every caller is anonymous with every role (or, under mutual TLS, its certificate's CN)."""
    insecure: bool = False
    """Allow plaintext on a non-loopback address (`--insecure`): anyone on the network can then read
    the traffic, tokens included."""
    limits: Limits = field(default_factory=Limits)
    """Limits of principals the auth file gives none (the anonymous principal included)."""
    handshake_timeout: float = 10.0
    """Seconds a new connection has to finish its TLS and HTTP/2 handshake, and a Publish call to send
    its Open: a client that connects and sends nothing is dropped."""
    connection_idle_timeout: float = DEFAULT_CONNECTION_IDLE
    """Seconds a connection with no call in progress is kept: then GOAWAY and close. A client with a
    call open (a Producer's Publish stream, a long push) is not idle; a client between calls reconnects
    at its next one. What bounds a client that handshakes and opens no call."""
    max_connections: int | None = None
    """Connections the gRPC server holds at once (each one an open file); one over it is closed as it is
    accepted. None: 3/4 of the process's open-file limit (default_max_connections)."""
    metrics_tls: bool = False
    """Serve /metrics over HTTPS with the gRPC server's certificate (needs `tls`)."""
    metrics_auth: bool | None = None
    """Require a reader's bearer token on /metrics; None: whenever there is an auth file."""

    def __post_init__(self) -> None:
        self.check_connection_bounds()
        if self.metrics_tls and self.tls is None:
            raise ValueError("metrics TLS needs the server's certificate and key (--tls-cert, --tls-key)")
        if self.metrics_auth and self.auth_file is None:
            raise ValueError("a token on /metrics needs an auth file that names readers (--auth-file)")

    @property
    def verifies_clients(self) -> bool:
        """Whether a client certificate can name a principal (mutual TLS: a client CA)."""
        return self.tls is not None and self.tls.client_ca_file is not None

    @property
    def metrics_token_required(self) -> bool:
        """Whether /metrics needs a reader's or operator's credentials (401/403 otherwise)."""
        return self.auth_file is not None if self.metrics_auth is None else self.metrics_auth


@dataclass(frozen=True)
class ServeConfig:
    """What `sluice serve` runs."""

    host: str = "127.0.0.1"
    """Address the gRPC server binds; loopback by default, so nothing is exposed unasked."""
    port: int = DEFAULT_PORT
    """gRPC port; 0 picks a free one."""
    metrics_host: str = "127.0.0.1"
    """Address of the Prometheus /metrics endpoint."""
    metrics_port: int | None = DEFAULT_METRICS_PORT
    """Port of /metrics; 0 picks a free one, None turns it off."""
    data_dir: Path = Path("sluice-data")
    """Blocks, Spark checkpoints and the default sink live here."""
    streams: tuple[str, ...] = ("default",)
    """Streams this node receives; one receiver each."""
    receiver: ReceiverConfig = field(default_factory=ReceiverConfig)
    """Buffering, credit and block sealing."""
    rate: RateConfig = field(default_factory=RateConfig)
    """The ingest rate: estimator, initial rate, bounds."""
    fsync: FsyncPolicy = field(default_factory=FsyncPolicy.every_block)
    """When the block log is fsynced: every block before acking it (the default), every N ms in the
    background (acked blocks survive a process crash, not a power loss), or off (throwaway data only)."""
    accept_wal_damage: tuple[str, ...] = ()
    """Streams whose block log this start goes on past damage in (`--accept-wal-damage`): acked blocks
    never released that are damaged or missing (a bad frame with sound ones after it, an older
    segment's bad tail, a segment gone), which a start otherwise refuses (DamagedLogError), are recorded
    as lost (the stream's lost.json), named in an ERROR and counted in sluice_wal_lost_blocks_total, and
    the blocks after them are kept and served (receivers.wal.WalBlockStore's accept_damage)."""
    segment_bytes: int | None = None
    """Size at which the block log starts a new segment file. Spark's release deletes whole segments
    (never the newest), so under a disk budget segments should be well below it; None: 64 MiB, or a
    quarter of the disk budget when that is smaller (at least 4 KiB)."""
    max_message_bytes: int = 32 * 1024 * 1024
    """Largest gRPC message taken; a larger Batch ends its session with RESOURCE_EXHAUSTED."""
    master: str = "local[*]"
    """Spark master URL."""
    pipeline: str | None = None
    """`module:function` returning a DataStreamWriter for the source DataFrame; None: Parquet sink."""
    reset_pipeline: bool = False
    """Start `pipeline` as a new generation where the pipeline swapped in at run time (pipeline.json)
    committed, instead of that one (the way back from a swapped-in pipeline that fails at every start)."""
    trigger_interval: float = 1.0
    """Seconds between Spark micro-batches."""
    fail_on_data_loss: bool = True
    """The source option failOnDataLoss of the query (and of those a pipeline swap starts): a stream's
    log lost or replaced under the query's checkpoint (the data dir started afresh while a checkpoint
    elsewhere survived) stops the query (DataLossError); False: a WARNING, and the new log is read from
    its start (`--no-fail-on-data-loss`)."""
    spark: bool = True
    """Run the Spark query in this process; off for a receive-only node."""
    security: SecurityConfig = field(default_factory=SecurityConfig)
    """TLS, authentication, per-principal limits."""
    cluster: Cluster | None = None
    """The receiver nodes and this node's id among them (`--role receiver`); None: a single node."""
    peer_token_file: Path | None = None
    """Bearer token (of a principal with the peer role) this node sends to its peers; with mutual TLS
    its own certificate identifies it instead."""
    health_port: int | None = None
    """Also serve the gRPC health service alone, in plaintext, on this port of every address (for
    Kubernetes' grpc probes, which do not speak TLS); None: only on the main port."""

    def __post_init__(self) -> None:
        # first: a host that is no address was refused as plaintext off loopback (_check_exposure)
        check_host(self.host, "gRPC host")
        check_host(self.metrics_host, "metrics host")
        if not self.streams:
            raise ValueError("at least one stream is needed")
        for name in (*self.streams, *self.accept_wal_damage):
            check_stream_name(name)
        if len(set(self.streams)) != len(self.streams):
            raise ValueError(f"stream names repeat: {', '.join(self.streams)}")
        unknown = sorted(set(self.rate.stream_policies) - set(self.streams))
        if unknown:
            raise ValueError(
                f"a stream weight or rate bound names {', '.join(map(repr, unknown))}, which this node "
                f"does not serve (streams: {', '.join(self.streams)})"
            )
        ports = (("port", self.port), ("metrics port", self.metrics_port), ("health port", self.health_port))
        for what, port in ports:
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{what} must be 0-65535, got {port}")
        if self.port != 0 and self.port == self.metrics_port and self.host == self.metrics_host:
            raise ValueError(f"port and metrics port are both {self.port}: give them two")
        for what, port in ports[:2]:  # the health port binds every interface: it meets them on any host
            if self.health_port and port == self.health_port:
                raise ValueError(f"health port and {what} are both {port}: give them two")
        self._check_trigger()
        if self.spark and not (self.master == "yarn" or self.master.startswith(("spark", "k8s", "local"))):
            # Spark's own check, made before its JVM starts (and dies with a Java stack trace)
            raise ValueError(f"master {self.master!r}: Spark takes yarn, spark://..., k8s://... or local...")
        self._check_sizes()
        self._check_exposure()

    def _check_trigger(self) -> None:
        if not 0 < self.trigger_interval < math.inf:
            raise ValueError(f"trigger interval must be > 0 seconds and finite, got {self.trigger_interval}")
        if self.trigger_interval < MIN_TRIGGER_INTERVAL:
            raise ValueError(
                f"trigger interval must be at least {MIN_TRIGGER_INTERVAL:g} seconds (10 ms: Spark's trigger "
                f"counts whole milliseconds), got {self.trigger_interval:g}"
            )
        if self.trigger_interval > MAX_TRIGGER_INTERVAL:
            raise ValueError(
                f"trigger interval must be at most {MAX_TRIGGER_INTERVAL:g} seconds (a day), "
                f"got {self.trigger_interval:g}"
            )

    def _check_sizes(self) -> None:
        if self.segment_bytes is not None and self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ValueError(f"segment bytes must be >= {MIN_SEGMENT_BYTES}, got {self.segment_bytes}")
        if self.segment_bytes is not None and self.segment_bytes > MAX_SEGMENT_BYTES:
            # a segment is deleted whole: one that never fills is never deleted
            raise ValueError(
                f"segment bytes must be at most {MAX_SEGMENT_BYTES:,} (1 TiB), got {self.segment_bytes:,}"
            )
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_GRPC_MESSAGE_BYTES:
            raise ValueError(
                f"max message bytes must be {MIN_MESSAGE_BYTES}..{MAX_GRPC_MESSAGE_BYTES:,} (gRPC takes a "
                f"message's length as a 32-bit int), got {self.max_message_bytes:,}"
            )

    def _check_exposure(self) -> None:
        check_exposure(
            self.host,
            tls=self.security.tls is not None,
            metrics_host=self.metrics_host if self.metrics_port is not None else None,
            metrics_tls=self.security.metrics_tls,
            insecure=self.security.insecure,
        )

    @property
    def wal_segment_bytes(self) -> int:
        """The block log's segment size: segment_bytes, or its default (see there)."""
        if self.segment_bytes is not None:
            return self.segment_bytes
        budget = self.receiver.disk_budget_bytes
        if budget is None:
            return DEFAULT_SEGMENT_BYTES
        return max(MIN_SEGMENT_BYTES, min(DEFAULT_SEGMENT_BYTES, budget // 4))

    @property
    def blocks_dir(self) -> Path:
        return self.data_dir / "blocks"

    @property
    def sink_dir(self) -> Path:
        return self.data_dir / "sink"

    @property
    def checkpoint_dir(self) -> Path:
        return self.data_dir / "checkpoints"
