"""Prometheus metrics: a collector that reads the receivers' counters at scrape time, and the /metrics
endpoint (HTTP or HTTPS, optionally behind a reader's token or a client certificate), which also serves
the live status page (/status, /status.json: ingest.status) under the same rules.

One registry per server (not the global one), so several servers can live in one process (tests).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ingest.status_page import PAGE
from ingest.tls import ServerTls
from receivers.auth import Authenticator
from receivers.errors import PermissionDenied, Unauthenticated
from receivers.principal import Role
from receivers.receiver import PAUSE_REASONS, Receiver
from receivers.wal import WalBlockStore
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

log = logging.getLogger(__name__)

METRICS_ROLES = frozenset({Role.READER, Role.OPERATOR})
"""A principal with one of these may scrape /metrics when a token is required."""

MAX_CONNECTIONS = 64
"""Connections the metrics port holds at once (each has a thread and a file); one over it is closed as
soon as it is accepted. Scrapers and status pages make one short request per connection (HTTP/1.0)."""

DEADLINE = 30.0
"""Seconds a connection to the metrics port gets in all (TLS handshake, request, answer): one that
trickles its request a byte at a time is closed then, as a silent one is."""


class NodeCollector(Collector):
    """A cluster's receiver node: its peers seen configured otherwise (receivers.cluster.ConfigMismatches)."""

    def __init__(self, mismatches: Callable[[], Mapping[int, str]]) -> None:
        self._mismatches = mismatches

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "sluice_cluster_config_mismatch_peers",
            "Peers whose node list (its length) or replication differs from this node's, as Replicate "
            "hellos refused by or to this node showed in the last 30 s: 0 unless a node is misconfigured.",
        )
        gauge.add_metric([], float(len(self._mismatches())))
        yield gauge


_PAUSE_FAMILIES = ("credit_paused", "credit_pauses", "credit_paused_seconds")
_WAL_FAMILIES = ("wal_truncations", "wal_truncated_bytes", "wal_lost_blocks", "wal_disk_bytes")
_NODE_FAMILIES = ("node_rate_records_per_second", "node_up", "node_backlog_records")


class SluiceCollector(Collector):
    """Exports receiver counters per stream, the block log's recovery counters and disk use, the
    Spark side's completed batches, and on a cluster's driver each receiver node's share (`nodes`)."""

    def __init__(
        self,
        receivers: Mapping[str, Receiver],
        batches_completed: Callable[[], int],
        *,
        wal: WalBlockStore | None = None,
        nodes: Callable[[], Sequence[pb.NodeRate]] | None = None,
    ) -> None:
        self._receivers = receivers
        self._batches_completed = batches_completed
        self._wal = wal
        self._nodes = nodes

    def collect(self, only: Collection[str] | None = None) -> Iterator[Metric]:
        """Every family; `only`: those of these names (without sluice_), for the status page's sampler,
        which at 1,000 streams built 30,000 samples a second to read four families of them."""
        # the node's rate once per scrape: summed for each stream's share it made a scrape (and the
        # status page's sampler, every second on the event loop) quadratic in the streams
        total_rate = sum(r.rate for r in self._receivers.values())
        counters: dict[str, tuple[str, Callable[[Receiver], float]]] = {
            "records_received": (
                "Records taken from publishers (duplicates not counted).",
                lambda r: r.stats.records_received,
            ),
            "records_deduplicated": (
                "Records dropped as duplicates of records a producer had sent before (same producer id "
                "and sequence number).",
                lambda r: r.stats.records_deduplicated,
            ),
            "sessions_fenced": (
                "Publisher sessions cancelled (ABORTED) because a newer session of their producer opened.",
                lambda r: r.stats.sessions_fenced,
            ),
            "sessions_idle": (
                "Publisher sessions ended (UNAVAILABLE) after holding credit unused for their principal's "
                "idle_timeout.",
                lambda r: r.stats.sessions_idle,
            ),
            "sessions_reclaimed": (
                "Publisher sessions ended (UNAVAILABLE) to take back credit their owner held unused over "
                "its fair share while another owner waited for room.",
                lambda r: r.stats.sessions_reclaimed,
            ),
            "records_acked": ("Records acked to publishers as durable.", lambda r: r.stats.records_acked),
            "batches_received": ("Batch messages taken from publishers.", lambda r: r.stats.batches_received),
            "blocks_sealed": ("Blocks sealed and made durable.", lambda r: r.stats.blocks_sealed),
            "block_bytes": ("Bytes of sealed blocks written.", lambda r: r.stats.block_bytes),
            "block_write_errors": (
                "Block writes that failed and were retried.",
                lambda r: r.stats.block_write_errors,
            ),
            "credit_granted": ("Credit granted to publishers (records).", lambda r: r.stats.credit_granted),
            "sessions_opened": ("Publisher sessions opened.", lambda r: r.stats.sessions_opened),
            "sessions_failed": ("Publisher sessions ended by an error.", lambda r: r.stats.sessions_failed),
            "sessions_cancelled": (
                "Publisher sessions cancelled by the server (stop, operator).",
                lambda r: r.stats.sessions_cancelled,
            ),
            "records_not_accepted": (
                "Records that arrived after their session was cancelled (the client resends them).",
                lambda r: r.stats.records_not_accepted,
            ),
        }
        gauges: dict[str, tuple[str, Callable[[Receiver], float]]] = {
            "credit_outstanding": (
                "Credit granted and not yet used (records).",
                lambda r: r.credit_outstanding,
            ),
            "buffered_records": (
                "Records taken and not yet in a durable block.",
                lambda r: r.buffered_records,
            ),
            "buffered_bytes": (
                "Bytes of the records taken and not yet in a durable block.",
                lambda r: r.buffered_bytes,
            ),
            "buffer_committed_bytes": (
                "What the memory budget counts: bytes buffered plus outstanding credit at the estimated "
                "bytes per record.",
                lambda r: r.committed_bytes,
            ),
            "buffer_budget_bytes": (
                "The memory budget per stream (--buffer-bytes).",
                lambda r: r.config.buffer_bytes,
            ),
            "record_bytes_estimate": (
                "Bytes per record the memory budget assumes for outstanding credit.",
                lambda r: r.record_bytes_estimate,
            ),
            "sessions_active": ("Publisher sessions open now.", lambda r: r.active_sessions),
            "rate_limit": ("Ingest rate limit in records per second (+Inf: unlimited).", lambda r: r.rate),
            "rate_share": (
                "The stream's share of the rates of the node's streams (0..1; NaN while any is unlimited): "
                "busy streams share by weight, idle ones keep a floor.",
                lambda r: self._rate_share(r, total_rate),
            ),
        }
        wanted = (lambda _: True) if only is None else only.__contains__
        for name, (doc, read) in counters.items():
            if not wanted(name):
                continue
            family = CounterMetricFamily(f"sluice_{name}", doc, labels=["stream"])
            for stream, receiver in self._receivers.items():
                family.add_metric([stream], read(receiver))
            yield family
        for name, (doc, read) in gauges.items():
            if not wanted(name):
                continue
            gauge = GaugeMetricFamily(f"sluice_{name}", doc, labels=["stream"])
            for stream, receiver in self._receivers.items():
                gauge.add_metric([stream], read(receiver))
            yield gauge
        grouped: list[Iterator[Metric]] = []  # families made together, per stream
        if any(map(wanted, _PAUSE_FAMILIES)):
            grouped.append(self._collect_pauses())
        if self._wal is not None and any(map(wanted, _WAL_FAMILIES)):
            grouped.append(self._collect_wal(self._wal))
        for families in grouped:
            yield from (family for family in families if wanted(family.name.removeprefix("sluice_")))
        if wanted("batches_completed"):
            yield CounterMetricFamily(
                "sluice_batches_completed", "Spark micro-batches completed.", value=self._batches_completed()
            )
        if self._nodes is not None and any(map(wanted, _NODE_FAMILIES)):
            nodes = self._collect_nodes(self._nodes())
            yield from (family for family in nodes if wanted(family.name.removeprefix("sluice_")))

    @staticmethod
    def _collect_nodes(nodes: Sequence[pb.NodeRate]) -> Iterator[Metric]:
        gauges: dict[str, tuple[str, Callable[[pb.NodeRate], float]]] = {
            "node_rate_records_per_second": (
                "The receiver node's share of the rate, records per second (0 while down; +Inf: unlimited).",
                lambda n: n.records_per_second,
            ),
            "node_up": ("1 while the receiver node answers the driver, else 0.", lambda n: float(n.up)),
            "node_backlog_records": (
                "Records on the receiver node not yet read by Spark.",
                lambda n: n.backlog,
            ),
        }
        for name, (doc, read) in gauges.items():
            gauge = GaugeMetricFamily(f"sluice_{name}", doc, labels=["node"])
            for node in nodes:
                gauge.add_metric([str(node.node_id)], read(node))
            yield gauge

    @staticmethod
    def _rate_share(receiver: Receiver, total: float) -> float:
        """The stream's part of `total`, the rates of the node's streams summed; NaN while any is
        unlimited."""
        return receiver.rate / total if math.isfinite(total) else math.nan

    def _collect_pauses(self) -> Iterator[Metric]:
        paused = GaugeMetricFamily(
            "sluice_credit_paused",
            "1 while new credit is withheld for this reason: memory_budget (--buffer-bytes reached), "
            "server_memory_budget (--memory-budget reached by every stream together), disk_budget "
            "(--disk-budget reached; resumes when Spark releases blocks), disk_error (block "
            "writes fail, e.g. disk full; retried).",
            labels=["stream", "reason"],
        )
        pauses = CounterMetricFamily(
            "sluice_credit_pauses", "Times credit was paused, by reason.", labels=["stream", "reason"]
        )
        seconds = CounterMetricFamily(
            "sluice_credit_paused_seconds",
            "Seconds credit was paused, by reason (the current pause included).",
            labels=["stream", "reason"],
        )
        for stream, receiver in self._receivers.items():
            now_paused = receiver.paused
            for reason in PAUSE_REASONS:
                paused.add_metric([stream, reason], 1.0 if reason in now_paused else 0.0)
                pauses.add_metric([stream, reason], receiver.stats.credit_pauses.get(reason, 0))
                seconds.add_metric([stream, reason], receiver.paused_seconds(reason))
        yield paused
        yield pauses
        yield seconds

    def _collect_wal(self, wal: WalBlockStore) -> Iterator[Metric]:
        truncations = CounterMetricFamily(
            "sluice_wal_truncations",
            "Block log segments cut at a bad or torn frame by recovery (each is also logged).",
            labels=["stream"],
        )
        truncated = CounterMetricFamily(
            "sluice_wal_truncated_bytes", "Bytes cut off the block log by recovery.", labels=["stream"]
        )
        lost = CounterMetricFamily(
            "sluice_wal_lost_blocks",
            "Blocks never released that recovery went on without: under --fsync off (a segment or an older "
            "segment's tail a power loss took), or damaged or missing blocks a start with "
            "--accept-wal-damage recorded as lost (each is also logged).",
            labels=["stream"],
        )
        disk = GaugeMetricFamily(
            "sluice_wal_disk_bytes", "Bytes of the block log on disk (unreleased blocks).", labels=["stream"]
        )
        for stream in self._receivers:
            stats = wal.stream_stats(stream)
            truncations.add_metric([stream], stats.corrupt_tails_truncated)
            truncated.add_metric([stream], stats.bytes_truncated)
            lost.add_metric([stream], stats.blocks_lost)
            disk.add_metric([stream], wal.disk_bytes(stream))
        yield truncations
        yield truncated
        yield lost
        yield disk
        budgets = {r.config.disk_budget_bytes for r in self._receivers.values()} - {None}
        if budgets:
            yield GaugeMetricFamily(
                "sluice_wal_disk_budget_bytes",
                "Bytes the whole block log may take on disk before credit pauses (--disk-budget).",
                value=min(b for b in budgets if b is not None),
            )


_PEER_NAMES = "sluice.peer_names"
"""WSGI environ key: the verified client certificate's names, as grpc's auth_context holds them."""


class _Handler(WSGIRequestHandler):
    timeout = 30.0
    """Seconds a read or write may wait: a silent client does not hold a thread (DEADLINE bounds the
    whole connection)."""

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        connection = self.connection
        if isinstance(connection, ssl.SSLSocket):
            environ[_PEER_NAMES] = _peer_names(connection.getpeercert())
        return environ

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("metrics %s: " + format, self.address_string(), *args)


def _peer_names(cert: Mapping[str, Any] | None) -> dict[str, list[bytes]]:
    """A verified peer certificate (ssl's getpeercert() dict) under the keys of grpc's auth_context
    that receivers.auth.certificate_names reads: the subject CN, the DNS SANs, the URI SANs."""
    if not cert:
        return {}
    common = [value.encode() for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]
    sans: dict[str, list[bytes]] = {"DNS": [], "URI": []}
    for kind, value in cert.get("subjectAltName", ()):
        if kind in sans:
            sans[kind].append(value.encode())
    return {"x509_common_name": common, "peer_dns": sans["DNS"], "peer_uri": sans["URI"]}


class _HttpServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds up close()
    request_queue_size = 128  # socketserver listens with a backlog of 5: a burst of scrapers was refused

    def __init__(
        self,
        address: tuple[str, int],
        family: socket.AddressFamily,
        context: Callable[[], ssl.SSLContext] | None,
        handshake_timeout: float,
    ) -> None:
        self.address_family = family
        self._context = context
        self._handshake_timeout = handshake_timeout
        self._open: dict[Any, float] = {}  # connection -> its deadline (time.monotonic())
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def verify_request(self, request: Any, client_address: Any) -> bool:
        # before a thread is started for it: over the cap, the connection is closed at once
        with self._open_lock:
            if len(self._open) >= MAX_CONNECTIONS:
                log.debug("metrics: %s refused: %d connections open", client_address, len(self._open))
                return False
            self._open[request] = time.monotonic() + DEADLINE
        return True

    def process_request(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)  # no thread started: the caller closes it
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: Any) -> None:
        with self._open_lock:
            self._open.pop(request, None)

    def service_actions(self) -> None:
        # serve_forever's loop, every poll (0.5 s): a connection past its deadline is shut down, which
        # ends its thread's read or write with an error (socket.socket's shutdown: an SSLSocket's own
        # would drop its TLS state under the thread using it)
        now = time.monotonic()
        with self._open_lock:
            late = [request for request, deadline in self._open.items() if deadline <= now]
        for request in late:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(request, socket.SHUT_RDWR)

    def get_request(self) -> tuple[Any, Any]:
        conn, address = super().get_request()
        if self._context is None:
            return conn, address
        # the handshake runs in the connection's own thread (finish_request): a client that connects
        # and sends nothing must not stop this accept loop; the current context, so a reload applies
        conn.settimeout(self._handshake_timeout)
        return self._context().wrap_socket(conn, server_side=True, do_handshake_on_connect=False), address

    def finish_request(self, request: Any, client_address: Any) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.do_handshake()
            except OSError as exc:  # ssl.SSLError, a timeout, a reset: this client only
                log.debug("metrics: TLS handshake with %s failed: %s", client_address, exc)
                return
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: request from %s failed", client_address, exc_info=True)


def _guarded(
    app: Callable[..., Iterable[bytes]], authenticator: Authenticator
) -> Callable[..., Iterable[bytes]]:
    """`app` behind a bearer token or client certificate of a reader or operator: 401 (with
    WWW-Authenticate: Bearer) without valid credentials, 403 for another principal."""

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION")
        metadata = [] if header is None else [("authorization", str(header))]
        try:
            principal = authenticator.authenticate(metadata, environ.get(_PEER_NAMES, {}))
        except Unauthenticated as exc:
            challenge = ("WWW-Authenticate", 'Bearer realm="sluice"')
            return _refuse(start_response, "401 Unauthorized", str(exc), [challenge])
        except PermissionDenied as exc:
            return _refuse(start_response, "403 Forbidden", str(exc), [])
        if not principal.has_any(METRICS_ROLES):
            why = f"principal {principal.name!r} may not read /metrics: it needs reader or operator"
            return _refuse(start_response, "403 Forbidden", why, [])
        return app(environ, start_response)

    return guarded


def _refuse(
    start_response: Callable[..., Any], status: str, message: str, headers: list[tuple[str, str]]
) -> list[bytes]:
    body = (message + "\n").encode()
    length = ("Content-Length", str(len(body)))
    start_response(status, [("Content-Type", "text/plain; charset=utf-8"), length, *headers])
    return [body]


STATUS_HEADERS = [
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    # the page is self-contained: nothing loads from elsewhere, it talks to its own origin only
    (
        "Content-Security-Policy",
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    ),
]

StatusSource = Callable[[], dict[str, Any] | None]
"""The numbers of /status.json now, or None while the server cannot answer (starting, stopping)."""


def _head_as_get(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """prometheus_client's app answers HEAD 405 (GET and OPTIONS only), while the status paths take it:
    a HEAD (a load balancer's probe) is the GET's status and headers, without the body."""

    def head(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        answer: list[Any] = []
        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, lambda *args: answer.extend(args)))
        status, headers = answer[0], list(answer[1])
        if not any(name.lower() == "content-length" for name, _ in headers):
            headers.append(("Content-Length", str(len(body))))
        start_response(status, headers)
        return [b""]

    return head


METRICS_PATH = "/metrics"
STATUS_PATHS = ("/status", "/status/", "/status.json")


def _only_metrics(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """`app` (prometheus_client's, which answers the metrics on every path) on /metrics only; 404 on
    any other path: `/nope` and `/../../etc/passwd` answered 200 with the metrics, which told a
    scanner (or a mistyped scrape config) it had found something."""

    def only(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != METRICS_PATH:
            return _refuse(
                start_response, "404 Not Found", f"not found (the metrics are at {METRICS_PATH})", []
            )
        return app(environ, start_response)

    return only


def _with_status(app: Callable[..., Iterable[bytes]], status: StatusSource) -> Callable[..., Iterable[bytes]]:
    """`app` (/metrics, and 404 on any other path), plus GET /status (the page) and /status.json."""

    def dispatch(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in STATUS_PATHS:
            return app(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            return _refuse(start_response, "405 Method Not Allowed", "use GET", [("Allow", "GET, HEAD")])
        if path == "/status/":  # the page's relative status.json must resolve to /status.json
            start_response("308 Permanent Redirect", [("Location", "/status"), ("Content-Length", "0")])
            return [b""]
        if path == "/status":
            body, kind = PAGE.encode(), "text/html; charset=utf-8"
        else:
            numbers = status()
            if numbers is None:
                return _refuse(start_response, "503 Service Unavailable", "the server is not running", [])
            body, kind = json.dumps(numbers, allow_nan=False).encode(), "application/json"
        headers = [("Content-Type", kind), ("Content-Length", str(len(body))), *STATUS_HEADERS]
        start_response("200 OK", headers)
        return [body] if environ.get("REQUEST_METHOD") == "GET" else [b""]

    return dispatch


class MetricsServer:
    """Serves /metrics (and, given `status`, the status page) from background threads: HTTP, or HTTPS
    with the server's certificate (`tls`, reloaded with it); `authenticator` given: only a reader or
    operator, by token or client certificate, on every path. `client_certificates`: with a client CA,
    "required" (any certificate it signed gets in), "optional" (verified when sent: the token or the
    certificate names the principal)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        tls: ServerTls | None = None,
        client_certificates: ssl.VerifyMode = ssl.CERT_NONE,
        authenticator: Authenticator | None = None,
        handshake_timeout: float = 10.0,
        status: StatusSource | None = None,
    ) -> None:
        app = _only_metrics(_head_as_get(make_wsgi_app(registry)))
        if status is not None:
            app = _with_status(app, status)
        if authenticator is not None:
            app = _guarded(app, authenticator)
        context = None if tls is None else lambda: tls.ssl_context(client_certificates)
        try:
            family, address = _best_family(host, port)
            server = _HttpServer(address, family, context, handshake_timeout)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from exc
        server.set_app(app)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="sluice-metrics", daemon=True)
        self._thread.start()
        self.port: int = server.server_address[1]
        self.scheme = "http" if tls is None else "https"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _best_family(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    # HTTPServer binds AF_INET; an IPv6 address needs its own family (as prometheus_client does)
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    return family, (str(sockaddr[0]), port)


class SettingsCollector(Collector):
    """Changes of the settings at run time (ingest.runtime_config), by key and result."""

    def __init__(
        self, changes: Callable[[], Mapping[tuple[str, str], int]], version: Callable[[], int]
    ) -> None:
        self._changes = changes
        self._version = version

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "sluice_config_changes",
            "Settings changed at run time (Admin.SetConfig, `sluice config`), by key and result: applied, "
            "or invalid (refused, nothing changed).",
            labels=["key", "result"],
        )
        for (key, result), count in sorted(self._changes().items()):
            family.add_metric([key, result], count)
        yield family
        yield GaugeMetricFamily(
            "sluice_config_version", "The settings' version: +1 per applied change.", value=self._version()
        )


class RuntimeChangesCollector(Collector):
    """Streams and the pipeline changed at run time (Admin: AddStream, RemoveStream, SwapPipeline, a new
    trigger interval)."""

    def __init__(
        self,
        stream_changes: Callable[[], Mapping[tuple[str, str], int]],
        stream_states: Callable[[], Mapping[str, str]],
        swaps: Callable[[], Mapping[tuple[str, str], int]],
        generation: Callable[[], int | None],
    ) -> None:
        self._stream_changes = stream_changes
        self._stream_states = stream_states
        self._swaps = swaps
        self._generation = generation

    def collect(self) -> Iterator[Metric]:
        changes = CounterMetricFamily(
            "sluice_stream_changes",
            "Streams added or removed at run time, by action (add, remove) and result (applied, refused).",
            labels=["action", "result"],
        )
        for (action, result), count in sorted(self._stream_changes().items()):
            changes.add_metric([action, result], count)
        yield changes
        states = GaugeMetricFamily(
            "sluice_streams",
            "Streams by state: serving, draining, kept (removed ones are not counted).",
            labels=["state"],
        )
        counts: dict[str, int] = {"serving": 0, "draining": 0, "kept": 0}
        for state in self._stream_states().values():
            if state in counts:
                counts[state] += 1
        for state, count in counts.items():
            states.add_metric([state], count)
        yield states
        swaps = CounterMetricFamily(
            "sluice_pipeline_changes",
            "Spark query replacements at a batch boundary, by kind (swap, restart: a new trigger interval) "
            "and outcome (done, rolled_back).",
            labels=["kind", "outcome"],
        )
        for (kind, outcome), count in sorted(self._swaps().items()):
            swaps.add_metric([kind, outcome], count)
        yield swaps
        generation = self._generation()
        if generation is not None:
            yield GaugeMetricFamily(
                "sluice_pipeline_generation",
                "The running pipeline's generation: +1 per swap kept.",
                value=generation,
            )
