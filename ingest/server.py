"""The receiving node: gRPC (Publish, RateControl), one receiver per stream, block store, /metrics.

The Spark side (ingest.driver) is attached separately, so a node can run without Spark in tests or as a
receive-only node, and Spark can be shared by several servers in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from ingest.admin_service import AdminService
from ingest.config import ServeConfig, is_loopback
from ingest.metrics import (
    MetricsServer,
    NodeCollector,
    RuntimeChangesCollector,
    SettingsCollector,
    SluiceCollector,
)
from ingest.pipeline_control import PipelineControl
from ingest.preflight import DataDirLock, bind_address, make_dirs
from ingest.rate_controller import WATCHDOG_TICK, RateController
from ingest.rate_service import RateControlService, apply_rate_settings, estimator_change, pin_again
from ingest.receiver_node import ReceiverNode
from ingest.reflection import HealthServicer, enable_reflection
from ingest.runtime_config import RuntimeConfig
from ingest.sessions_service import SessionsService
from ingest.status import StatusBoard
from ingest.streams import DRAINING, KEPT, REMOVED, SERVING, StreamRegistry, clash_message
from ingest.tls import ServerTls, TlsFileError, token_file_exposed
from receivers.auth import PIPELINE, Authenticator, AuthFileError, AuthTable, revoke
from receivers.block_store import BlockStore
from receivers.cluster import Cluster
from receivers.errors import shown
from receivers.files import NOT_REGULAR, BrokenLinkError, DataDirStateError, NotARegularFileError
from receivers.memory_pool import MemoryPool
from receivers.names import check_stream_name, same_but_case
from receivers.node_identity import claim_data_dir
from receivers.parsed_service import add_parsed_servicer
from receivers.principal import Role
from receivers.publish_service import PublishService
from receivers.receiver import Receiver
from receivers.wal import WalBlockStore
from sluice_client.allocator import tune_malloc
from sluice_client.keepalive import KEEPALIVE_SECONDS, PEER_KEEPALIVE_SECONDS, server_options

log = logging.getLogger(__name__)


def ping_options(cluster: Cluster | None) -> list[tuple[str, int]]:
    """The server's keepalive policy (sluice_client.keepalive): producers ping every KEEPALIVE_SECONDS to
    tell a frozen server from a quiet one, the Spark side (the cluster driver, its query's planning,
    executors' reads, the live rate: keepalive.node_channel_options) every PEER_KEEPALIVE_SECONDS, a
    receiver node's peers every Cluster.keepalive, and gRPC's default took pings more often than every 5
    minutes, on a call without data, as abuse (GOAWAY). A receiver node pings its own clients as often
    as its peers do: an owner's Replicate stream to it, from a host gone without a FIN, ends rather than
    hold its handler (and what it assembled) for ever. Before, the option said
    "min_recv_ping_interval_without_data_ms", a name gRPC does not have: only max_ping_strikes 0 (never
    GOAWAY, whatever a client sent) kept the producers' pings from a GOAWAY. The cluster driver's
    RateControl server and a TLS server's loopback port for its own query take it too (None)."""
    every = min(KEEPALIVE_SECONDS, PEER_KEEPALIVE_SECONDS)
    if cluster is None:
        return server_options(every)
    every = min(every, cluster.keepalive)
    return server_options(every, ping_every=cluster.keepalive, timeout=cluster.keepalive_timeout)


class BlockLogStateError(OSError, DataDirStateError):
    """A file or folder of the block log (DATA_DIR/blocks) is not what the log left there (a segment
    replaced by a folder, a stream's folder by a file) or cannot be read: the start stops naming it."""


def _unreadable_log(exc: OSError, blocks_dir: Path) -> BlockLogStateError | None:
    """`exc` (from opening the block log) as one sentence naming the file and what to do; None when it
    is not about a file of the log (a message of its own already, or another file)."""
    if exc.filename is None:
        return None
    path = Path(os.fsdecode(exc.filename))
    try:
        parts = path.relative_to(blocks_dir).parts
    except ValueError:
        return None
    if not parts:
        return None
    folder = blocks_dir / parts[0]
    what = f"the block log of stream {parts[0]!r}"
    if exc.errno == errno.ENOTDIR:
        # the first thing on the way that is not a folder: the stream's folder itself, as a rule
        on_the_way = [p for p in (*reversed(path.parents), path) if p.is_relative_to(folder)]
        path = next((p for p in on_the_way if p.exists() and not p.is_dir()), folder)
        found = f"{path} is a file where {what} has a folder"
    elif exc.errno == errno.EISDIR:
        found = f"{path} is a folder where {what} has a file"
    elif isinstance(exc, NotARegularFileError):
        found = f"{path} is {NOT_REGULAR} where {what} has a file"
    elif isinstance(exc, BrokenLinkError):
        found = f"{path} is {exc.strerror}, where {what} has a file"
    else:
        return BlockLogStateError(
            f"{path}: cannot read {what}: {exc.strerror}; make it readable by this user, or move {folder} "
            "aside to start that stream's log afresh (the records it holds are then lost)"
        )
    return BlockLogStateError(
        f"{found}: put back what was there, or move {folder} aside to start that stream's log afresh "
        "(the records it holds are then lost)"
    )


class SluiceServer:
    """Receivers behind a grpc.aio server. `await start()`, then `await stop()` (idempotent).

    One server per data dir: the constructor locks it (ingest.preflight.DataDirLock: DataDirInUseError,
    an OSError, when another process holds it) before the receivers recover the block log, unless given
    `data_dir_lock`, which its caller then holds and releases (`sluice serve` keeps it until Spark has
    drained); stop() releases a lock the server took.
    """

    def __init__(  # noqa: PLR0915 - one constructor wires the node
        self,
        config: ServeConfig,
        *,
        batches_completed: Callable[[], int] = lambda: 0,
        data_dir_lock: DataDirLock | None = None,
        defaults: ServeConfig | None = None,
        origins: Mapping[str, str] | None = None,
    ) -> None:
        """`origins`: setting key -> "file PATH" or "env VAR", for the values `sluice serve` took from a
        config file or the environment (config get shows where each value came from)."""
        self.runtime = RuntimeConfig(config, defaults=defaults, origins=origins)
        """Settings changed at run time (Admin, `sluice config`), kept under the data dir; they override
        `config`'s (SettingError, a ValueError, when that file is unreadable)."""
        config = self.runtime.current
        self.config = config
        security = config.security
        # the files before the lock: a bad one fails here with nothing held (the CLI checked them already)
        self.tls = ServerTls(security.tls) if security.tls is not None else None
        """The TLS certificate, key and client CA; `reload_security` re-reads them (SIGHUP)."""
        auth_file = security.auth_file
        table = (
            AuthTable.load(auth_file, base=security.limits, client_ca=security.verifies_clients)
            if auth_file is not None
            else None
        )
        self.committed: dict[str, int] = {}
        """Stream -> the end offset of the last batch Spark committed (on_committed), this run."""
        # first: recovery cuts what looks like a torn tail, which in a live server's log is its next block
        self._own_lock = data_dir_lock is None
        self._lock = data_dir_lock if data_dir_lock is not None else DataDirLock(config.data_dir)
        try:
            # before anything reads or cuts the log: another node's data dir is refused (DataDirOwnerError)
            claim_data_dir(config.data_dir, config.cluster)
            # a receiver node: the driver's settings an earlier version kept in runtime-config.json go
            self.runtime.clear_ignored()
            make_dirs(config.blocks_dir)
            self.store = WalBlockStore(
                config.blocks_dir,
                fsync=config.fsync,
                segment_bytes=config.wal_segment_bytes,
                accept_damage=config.accept_wal_damage,
            )
            folders = self.store.stream_names()
            # a new stream whose name differs from another's only in case: StreamNameClashError
            self.streams = StreamRegistry(config.data_dir, config.streams, folders)
            """The streams served, draining and kept (Admin.AddStream/RemoveStream; streams.json)."""
            _warn_of_case_pairs([*self.streams.states, *folders])
            self._find_unnamed_streams()
            self._check_accept_wal_damage()
            for stream in [*self.streams.of(DRAINING), *self.streams.of(KEPT)]:
                self.store.recover(stream)  # no receiver writes it, but its tail must be whole to read
            # a stream left draining whose log holds nothing any more is drained: removed now, rather
            # than listed as draining (backlog 0) until a batch commits, which an idle query never does
            self._check_drained()
            self._say_overridden()
            self.node: ReceiverNode | None = None
            """A cluster's receiver node: replication, copies, block reads (None: a single node)."""
            writes: BlockStore = self.store
            receiver_config = config.receiver
            if config.cluster is not None:
                self.node = ReceiverNode(config, config.cluster, self.store)
                writes = self.node.store
                receiver_config = replace(receiver_config, receiver_id=config.cluster.me.id)
            self._writes = writes
            self.memory = MemoryPool()
            """The memory every stream's receiver shares (memory_budget_bytes)."""
            self.receivers = {
                s: Receiver(s, writes, receiver_config, pool=self.memory) for s in self.streams.serving
            }
        except OSError as exc:
            self._release_lock()
            unreadable = _unreadable_log(exc, config.blocks_dir)
            if unreadable is None:
                raise
            raise unreadable from exc
        except BaseException:
            self._release_lock()
            raise
        self.auth = Authenticator(
            table,
            client_certificates=security.tls is not None and security.tls.client_ca_file is not None,
            default_limits=security.limits,
        )
        """Who may call what; `reload_security` re-reads the auth file (SIGHUP)."""
        self._pipeline_token = self.auth.issue_token(PIPELINE)
        self.pipeline_token_file = config.data_dir / PIPELINE_TOKEN_FILE
        """This run's token for its own Spark source (principal sluice-pipeline: operator and reader),
        written 0600 at start, left at stop (`sluice serve` drains Spark after it; only this process
        ever knew the token); the source asks the rate at `rate_target` with it."""
        self._loopback_port: int | None = None
        self._loopback: grpc.aio.Server | None = None
        self._rate_service: RateControlService | None = None
        self.hold_batches = False
        """Set by the pipeline manager while it stops the query at a batch boundary (a swap): the
        source, asking the rate before each batch, plans no new one (RateStatus.hold_batches)."""
        self._stream_lock = asyncio.Lock()  # one stream change at a time
        self._reloading = asyncio.Lock()  # one SIGHUP reload at a time (reload_security_async)
        self._reloads: set[asyncio.Task[list[str]]] = set()  # reload_security_soon's, until done
        self.pipeline_control: PipelineControl | None = None
        """The Spark query's lifecycle, once a driver attaches one (Admin.GetPipeline, SwapPipeline)."""
        self.rate = RateController(self.receivers, config.rate, batch_interval=config.trigger_interval)
        """The ingest rate: fed by batch metrics (on_batch) and by operators (RateControl)."""
        self._pin_again()
        self.registry = CollectorRegistry()
        collector = SluiceCollector(self.receivers, self._batches_completed, wal=self.store)
        self.registry.register(collector)
        if self.node is not None:
            self.registry.register(NodeCollector(self.node.mismatches.peers))
        self.status = StatusBoard(
            collector,
            self.rate,
            self.receivers,
            stream_states=lambda: self.streams.states,
            stream_backlog=self.stream_backlog,
            pipeline=lambda: self.pipeline_control.view() if self.pipeline_control is not None else None,
            health=self._health_text,
            about=lambda: {
                "target": self.target,
                "transport": self.transport,
                "batches_completed": self._batches_completed(),
                # a cluster's receiver node: its peers configured otherwise ([] when none)
                "config_mismatches": (
                    [w for _, w in sorted(self.node.mismatches.peers().items())]
                    if self.node is not None
                    else []
                ),
            },
        )
        """The status page's numbers and their history (/status, /status.json beside /metrics)."""
        runtime = self.runtime
        self.registry.register(SettingsCollector(lambda: dict(runtime.changes), lambda: runtime.version))
        self.stream_changes: dict[tuple[str, str], int] = {}
        """(action: "add" | "remove", result: "applied" | "refused") -> count (the Admin service counts)."""
        self.registry.register(
            RuntimeChangesCollector(
                lambda: dict(self.stream_changes),
                lambda: dict(self.streams.states),
                lambda: dict(self.pipeline_control.changes) if self.pipeline_control is not None else {},
                lambda: self.pipeline_control.generation if self.pipeline_control is not None else None,
            )
        )
        self.batches_completed = batches_completed
        self._grpc: grpc.aio.Server | None = None
        self._metrics: MetricsServer | None = None
        self.port: int = 0
        """The bound gRPC port, once started."""
        self._stopped = asyncio.Event()
        self._stop_done = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        self._health_watch: asyncio.Task[None] | None = None
        self.failure: str | None = None
        """Why this server stopped itself (its data dir was removed), for `sluice serve`'s exit."""
        self._self_stop: asyncio.Task[None] | None = None
        self.health = HealthServicer()
        """grpc.health.v1: ingest.v1.Ingest is SERVING while the server takes records (its block log is
        open); "" while it takes records and, where Spark runs (config.spark), its query runs."""
        self._query_failure: Callable[[], str | None] | None = None
        self._serving: bool | None = None  # what "" was last set to
        self._health_server: grpc.aio.Server | None = None
        self.health_port: int | None = None
        """The bound plaintext health port (config.health_port), once started."""

    def _check_accept_wal_damage(self) -> None:
        """ValueError when --accept-wal-damage names a stream this node holds no log of (a typo would
        leave the stream meant refused as before, and the flag doing nothing)."""
        unknown = [s for s in self.config.accept_wal_damage if s not in self.streams.states]
        if unknown:
            raise ValueError(
                f"--accept-wal-damage names {', '.join(map(repr, unknown))}, which this node does not hold "
                f"(its streams: {', '.join(sorted(self.streams.states))})"
            )

    def _say_overridden(self) -> None:
        """An INFO line per stream the command line names that is not served, since it was removed at
        run time (streams.json): in the state it is in now, and how to serve it again."""
        for stream, was in self.streams.overridden.items():
            state = self.streams.states.get(stream, was)
            if state == DRAINING:
                records = self.stream_backlog(stream)
                why = (
                    f"is draining, not served, though it is among the streams to serve: it was removed "
                    f"with --drain at run time ({self.streams.path}); the query reads its {records:,} "
                    "acked records left, then it is removed"
                )
            elif state == KEPT:
                why = (
                    f"is kept, not served, though it is among the streams to serve: it was removed with "
                    f"--keep at run time ({self.streams.path}); its {self.stream_backlog(stream):,} "
                    "acked records left wait in the block log"
                )
            else:
                why = (
                    f"is removed, not served, though it is among the streams to serve: it was removed at "
                    f"run time ({self.streams.path})"
                )
            log.info("stream %s %s; `sluice streams add %s` serves it again", stream, why, stream)

    def _find_unnamed_streams(self) -> None:
        """Name loudly every stream of the block log that neither the flags nor streams.json name and
        whose acked records no query released (dropped from the --stream flags: nothing would read them,
        unseen), and list it as kept for this run (StreamRegistry.find)."""
        for stream in self.store.stream_names():
            if stream in self.streams.states:
                continue
            blocks = self.store.blocks(stream)
            if not blocks:
                continue  # every block released (processed), or none written: nothing waits
            records = blocks[-1].end_offset - blocks[0].first_offset
            self.streams.find(stream)
            back = (
                "name it in this node's --stream flags again to serve it (a cluster's streams are its "
                "nodes' flags)"
                if self.config.cluster is not None
                else f"`sluice streams add {stream}` serves it again and the query reads them from where it "
                f"stopped; to be done with them, add it and then `sluice streams remove {stream} --drain` "
                "(the query processes them, then the stream is removed)"
            )
            log.warning(
                "stream %s is not served (neither the --stream flags nor %s name it), but %s holds %s "
                "acked records in %s that no query has released: they wait there, listed as kept "
                "(sluice streams list); %s",
                stream,
                self.streams.path,
                self.config.blocks_dir / stream,
                f"{records:,}",
                f"{len(blocks):,} block" + ("s" if len(blocks) > 1 else ""),
                back,
            )

    async def attach_query(self, failure: Callable[[], str | None]) -> None:
        """The Spark query runs now; `failure()` says why it failed (None while it runs or a swap is
        under way): health's "" follows it, SERVING while it runs, NOT_SERVING once it failed."""
        self._query_failure = failure
        if self._grpc is not None:
            await self._update_health()

    # ---- the query's host (ingest.pipeline_manager.QueryHost) ----

    def query_streams(self) -> tuple[str, ...]:
        return tuple(self.streams.read_by_query)

    def known_streams(self) -> Sequence[str]:
        return self.streams.known()

    def unread(self, start: Mapping[str, int]) -> bool:
        for stream in self.streams.read_by_query:
            extent = self.store.extent(stream)
            if extent is not None and extent[1] > start.get(stream, 0):
                return True
        return False

    def query_failure(self) -> str | None:
        """Why the attached query failed; "not started" where Spark runs and none is attached yet."""
        if self._query_failure is None:
            return "not started" if self.config.spark else None
        return self._query_failure()

    def _health_text(self) -> str:
        """What health's "" says now, for the status page."""
        if self._stopped.is_set():
            return "NOT_SERVING (stopping)"
        failure = self.query_failure()
        return "SERVING" if failure is None else f"NOT_SERVING (query {failure})"

    async def _update_health(self) -> None:
        serving = self.query_failure() is None
        if serving != self._serving and not self._stopped.is_set():
            self._serving = serving
            status = health_pb2.HealthCheckResponse
            await self.health.set("", status.SERVING if serving else status.NOT_SERVING)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_TICK)
            try:
                if self._data_dir_lost():
                    return
                await self._update_health()
            except Exception:  # a failure() that raises must not end the probe's updates
                log.exception("health update failed")

    def _data_dir_lost(self) -> bool:
        """Stop the server if its data dir was removed while it ran (`rm -rf`): the log refuses to make
        its folders again, so nothing could be acked, and without the lock file a second server could
        start on the same path. Kafka takes a broker whose only log dir failed offline the same way."""
        lost = self._lock.lost()
        if lost is not None:
            lost += (
                " while this server ran: stopping, since nothing could be made durable there any more and "
                "a second server could start on it"
            )
        elif deleted := self.store.deleted_folders(self.receivers):
            folders = ", ".join(str(f) for f in deleted)
            lost = (
                f"the block log's folder {folders} was deleted or replaced while this server ran: stopping, "
                "since nothing more of its stream could be made durable"
            )
        else:
            return False
        self.failure = f"{lost}; the records acked before are gone with it"
        log.error("%s", self.failure)
        self._self_stop = asyncio.create_task(self.stop(), name="sluice-stop")
        return True

    def _batches_completed(self) -> int:
        return self.batches_completed()  # looked up at scrape time: the Spark side may attach later

    def received_at(self, stream: str, offset: int) -> float | None:
        """When the record at `offset` of `stream` was taken (epoch s), if this node sealed it lately."""
        receiver = self.receivers.get(stream)
        return receiver.received_at(offset) if receiver is not None else None

    @property
    def target(self) -> str:
        """host:port a client connects to."""
        return bind_address(self.config.host, self.port)

    @property
    def rate_target(self) -> str:
        """Where this server's own Spark source asks the live rate: with TLS, a plaintext port on
        127.0.0.1 (the server's certificate need not name it, and the source needs no CA); calls there
        still need a token (pipeline_token_file) whenever the server authenticates."""
        return self.target if self._loopback_port is None else f"127.0.0.1:{self._loopback_port}"

    @property
    def metrics_port(self) -> int | None:
        return self._metrics.port if self._metrics is not None else None

    def _release_lock(self) -> None:
        if self._own_lock:
            self._lock.release()

    def _warn_of_exposure(self) -> None:
        """What a start should say of its security settings (a WARNING each)."""
        for warning in self.tls.material.warnings() if self.tls is not None else ():
            log.warning("%s", warning)
        if (exposed := token_file_exposed(self.config.peer_token_file)) is not None:
            log.warning("%s", exposed)
        table = self.auth.table
        for principal in table.principals.values() if table is not None and self.node is not None else ():
            if {Role.READER, Role.OPERATOR} <= principal.roles and Role.CONSUMER not in principal.roles:
                # the role a cluster's driver and executors had before reading records needed its own
                log.warning(
                    "principal %r has the reader and operator roles but not consumer: a cluster's driver "
                    "and its executors need consumer to read blocks (Blocks.ReadBlocks), which reader no "
                    "longer grants",
                    principal.name,
                )
        if not self.auth.enabled and not is_loopback(self.config.host):
            # TLS keeps the wire private, it does not say who calls: without an auth file or a client
            # CA every caller is the anonymous principal, operator included
            log.warning(
                "serving on %s without --auth-file or --client-ca: every client that reaches it may "
                "publish to every stream and operate the server (rate, settings, streams, pipeline)",
                self.config.host,
            )

    async def start(self) -> None:
        """Bind and serve; raise OSError (and leave nothing running) when a port cannot be bound."""
        tune_malloc()  # messages and blocks are large buffers: keep them off mmap (sluice_client.allocator)
        security = self.config.security
        self._warn_of_exposure()
        if self.config.metrics_port is not None:
            self._metrics = self._metrics_server()
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", self.config.max_message_bytes),
                ("grpc.max_send_message_length", self.config.max_message_bytes),
                # gRPC binds with SO_REUSEPORT by default: a second server on this port would start
                # and take half the sessions, whose producers' dedup state lives in the other one
                ("grpc.so_reuseport", 0),
                # a client that sends nothing, or handshakes and opens no call, is dropped; past
                # --max-connections a new connection is closed at once
                *security.grpc_options(),
                *ping_options(self.config.cluster),
            ]
        )
        self._add_services(server)
        address = bind_address(self.config.host, self.config.port)
        detail = ""
        try:
            if self.tls is not None:
                self.port = server.add_secure_port(address, self.tls.grpc_credentials())
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError as exc:  # grpc reports a failed bind this way
            self.port = 0
            detail = f": {exc}"
        if self.port == 0:
            if self._metrics is not None:
                self._metrics.close()
                self._metrics = None
            await server.stop(None)
            raise OSError(f"cannot bind gRPC to {address} (in use, or not an address of this host){detail}")
        try:
            # every port with a conflict to lose is bound before the receivers write to the data dir:
            # a start that fails there leaves a new data dir for `sluice serve` to take back
            self._bind_health_port()
            await self._start_receivers()
            await server.start()
            await self._start_loopback_port()
            if self._health_server is not None:
                await self._health_server.start()
        except BaseException:  # e.g. the block log cannot be read: leave nothing bound
            await self._unbind(server)
            raise
        self._grpc = server
        await self.health.set(INGEST_HEALTH, health_pb2.HealthCheckResponse.SERVING)  # the block log is open
        await self._update_health()
        _write_private(self.pipeline_token_file, self._pipeline_token + "\n")
        self._watchdog = asyncio.create_task(self._watch_batches(), name="sluice-batch-watchdog")
        self._health_watch = asyncio.create_task(self._watch_health(), name="sluice-health")
        self.status.start()
        log.debug(  # `sluice serve` says it, once (ingest.logs)
            "serving streams %s on %s (%s), metrics on %s",
            ", ".join(self.receivers),
            self.target,
            self.transport,
            self.metrics_port,
        )

    async def _unbind(self, server: grpc.aio.Server) -> None:
        """A failed start's: stop what it bound or started of its ports."""
        await server.stop(None)
        if self._health_server is not None:
            await self._health_server.stop(None)
            self._health_server = None
        if self._loopback is not None:
            await self._loopback.stop(None)
            self._loopback = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def _add_services(self, server: grpc.aio.Server) -> None:
        PublishService(
            self.receivers,
            open_timeout=self.config.security.handshake_timeout,
            authenticator=self.auth,
            producer_marks=self.node.peer_marks.mark if self.node is not None else None,
            max_message_bytes=self.config.max_message_bytes,
        ).add_to_server(server)  # parses client messages itself, authenticates each call
        # requests parsed in the handler: an undecodable one is INVALID_ARGUMENT, not gRPC's UNKNOWN
        rate = RateControlService(
            self.rate,
            self.receivers,
            pipeline=lambda: (self.streams.read_by_query, self.hold_batches),
            settings=self.change_settings,
            # a cluster's driver pins each node's share all the time: a node keeps no pin of its own
            pin=self.runtime.pin if self.node is None else None,
            # and sets it: an operator's change would be set back within a quarter of a second
            driver_sets_rate=self.node is not None,
            mismatches=self.node.mismatches.peers if self.node is not None else None,
        )
        add_parsed_servicer(server, rate, "RateControl", authenticator=self.auth)
        self._rate_service = rate
        add_parsed_servicer(server, SessionsService(self.receivers), "Sessions", authenticator=self.auth)
        # a receiver node: the rate's settings are the driver's, which the refusals name
        driver_target = (lambda: rate.driver_target) if self.node is not None else None
        admin = AdminService(self.runtime, self, self.apply_settings, driver_target=driver_target)
        add_parsed_servicer(server, admin, "Admin", authenticator=self.auth)
        services = ["Ingest", "RateControl", "Sessions", "Admin"]
        if self.node is not None:
            self.node.add_services(server, self.receivers, self.auth)
            services += ["Blocks", "Replication"]
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        enable_reflection(server, services)

    def change_settings(
        self, values: Mapping[str, str], reset: Sequence[str] = ()
    ) -> tuple[ServeConfig, ServeConfig]:
        """Change run-time settings as `sluice config set` does (validated whole, kept in the data dir,
        applied): (old, new). The rate API's bounds and estimator are such settings, so that `sluice
        config get` shows what is in force and a restart keeps it. SettingError, OSError: nothing
        changed. Another estimator than the start's runs with its own parameters, not the start's
        --estimator-params (which it refused, and the switch with it): estimator_change."""
        values, reset = estimator_change(self.runtime.base.rate, values, reset)
        old, new = self.runtime.change(values, reset)
        self.apply_settings(old, new)
        return old, new

    def _pin_again(self) -> None:
        """The rate an operator pinned before the restart (`sluice rate set RATE --pin`, kept in
        runtime-config.json) is pinned again, and said so: it was lost without a word."""
        if self.node is None:  # a cluster's driver pins a node's share: not an operator's to keep
            pin_again(self.rate, self.runtime)

    def apply_settings(self, old: ServeConfig, new: ServeConfig) -> None:
        """Apply settings changed at run time (already validated and kept by self.runtime)."""
        if new.receiver != old.receiver:
            for receiver in self.receivers.values():
                receiver.reconfigure(new.receiver)
        apply_rate_settings(self.rate, self.runtime, old.rate, new.rate)
        if new.trigger_interval != old.trigger_interval:
            self.rate.set_batch_interval(new.trigger_interval)
        self.config = new

    # ---- streams at run time (Admin.AddStream / RemoveStream) -------------------------------------

    async def add_stream(self, stream: str) -> None:
        """Serve `stream` from now on (ValueError: a bad name; StreamExistsError: served already; a
        cluster's streams are static: StreamChangeRefused). A kept or removed stream comes back where
        its log ends; the query reads it from its next batch, from its frozen offset if it had one."""
        try:
            stream = check_stream_name(stream)
        except ValueError:
            raise ValueError(
                f"invalid stream name {shown(stream)}: 1-128 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            ) from None
        async with self._stream_lock:
            if self.node is not None:
                raise StreamChangeRefused("a cluster's streams are fixed by its nodes' --stream flags")
            state = self.streams.states.get(stream)
            if state == SERVING:
                raise StreamExistsError(f"stream {stream!r} is served already")
            other = self.streams.case_clash(stream, await asyncio.to_thread(self.store.stream_names))
            if other is not None:
                where = self.streams.states.get(other, "its folder is in the block log")
                raise StreamExistsError(clash_message(stream, other, where))
            config = self.config.receiver
            receiver = Receiver(stream, self._writes, config, pool=self.memory)
            try:
                await asyncio.to_thread(self.store.ensure_incarnation, stream)  # as _start_receivers
                await receiver.start()
                await asyncio.to_thread(self.streams.set, [(stream, SERVING)])
            except BaseException:
                await receiver.stop()  # and out of the memory pool
                raise
            if self.config.receiver != config:
                # settings applied meanwhile (apply_settings) went to the receivers already served, not
                # to this one: it kept the old ones (a lowered budget, say) until the next change
                receiver.reconfigure(self.config.receiver)
            self.receivers[stream] = receiver
            self.rate.streams_changed()
        # the Admin service logs the change once, with its caller
        log.debug("stream %s added%s", stream, f" (it was {state})" if state else "")

    async def remove_stream(self, stream: str, *, drain: bool, reason: str) -> None:
        """Stop serving `stream`: its publishers get Cancel (NOT_FOUND, with `reason`) after what they
        sent is sealed and acked. drain: the query still reads what was acked, then the stream is
        removed; else it is kept: the query stops reading it now and its blocks wait in the log.
        UnknownStreamError when it is not served."""
        async with self._stream_lock:
            if self.node is not None:
                raise StreamChangeRefused("a cluster's streams are fixed by its nodes' --stream flags")
            receiver = self.receivers.get(stream)
            if receiver is None:
                state = self.streams.states.get(stream)
                served = ", ".join(self.streams.serving) or "none"
                detail = f"it is {state}" if state else f"streams: {served}"
                raise UnknownStreamError(f"stream {shown(stream)} is not served ({detail})")
            if self.streams.read_by_query == [stream]:
                # a query must read some stream; and an empty set reads, to an older source, as "none
                # named": it would fall back to its option's streams, kept ones included
                raise StreamChangeRefused(
                    f"stream {stream!r} is the last one the query reads: add another first"
                )
            state = DRAINING if drain else KEPT
            await asyncio.to_thread(self.streams.set, [(stream, state)])
            del self.receivers[stream]  # first: a publisher opening now is told the stream is unknown
            self.rate.streams_changed()
            why = f"stream {stream!r} was removed" + (f": {reason}" if reason else "")
            await receiver.stop(code=grpc.StatusCode.NOT_FOUND.value[0], reason=why)
        log.debug("stream %s removed (%s)%s", stream, state, f": {shown(reason)}" if reason else "")
        self._check_drained()

    def on_committed(self, end: dict[str, int]) -> None:
        """Spark committed a batch ending at `end` ({stream: offset}; on the loop): draining streams
        whose whole log it covers are removed."""
        for stream, offset in end.items():
            self.committed[stream] = max(offset, self.committed.get(stream, 0))
            receiver = self.receivers.get(stream)
            if receiver is not None:
                receiver.committed(offset)
        self._check_drained()

    def _check_drained(self) -> None:
        done = []
        for stream in self.streams.of(DRAINING):
            extent = self.store.extent(stream)
            if extent is None or self.committed.get(stream, -1) >= extent[1]:
                done.append(stream)
        if done:
            try:
                self.streams.set([(s, REMOVED) for s in done])
            except OSError:  # the next commit tries again
                log.exception("cannot record streams %s as drained", done)
                return
            for stream in done:
                log.info("stream %s drained: every acked record was processed; removed", stream)

    def stream_backlog(self, stream: str) -> int:
        """Records of `stream` in the log past what Spark committed (as far as this run knows): those
        its blocks hold, not the offsets in its gaps (receivers.block.gaps, as the source skips them:
        blocks a start with --accept-wal-damage went on without, or a start under --fsync off found
        missing). Those can never be read; counted, the backlog stayed up by them until Spark passed
        the gap."""
        return self.readable_records(stream, self.committed.get(stream, 0))

    def readable_records(self, stream: str, lo: int, hi: int | None = None) -> int:
        """How many records of [lo, hi) of `stream` (hi None: up to the log's end) its log's blocks
        hold, released ones none: what a batch reading them reads. From the log's span (its ends and
        gaps; what receivers.block.records_between counts on its blocks), at the cost of a stat a
        segment and its gaps, none a block: this runs on the loop for every completed batch, status
        page and `sluice streams list`."""
        span = self.store.span(stream)
        return 0 if span is None else span.records(lo, hi)

    @property
    def transport(self) -> str:
        """How clients connect: "plaintext", "TLS" or "mutual TLS"."""
        if self.tls is None:
            return "plaintext"
        return "mutual TLS" if self.tls.mutual else "TLS"

    def _metrics_server(self) -> MetricsServer:
        security = self.config.security
        port = self.config.metrics_port
        assert port is not None
        tls = self.tls if security.metrics_tls else None
        token = security.metrics_token_required
        # with a client CA: a token alone may do when one is required, else the CA vouches, as on gRPC
        verify = ssl.CERT_NONE
        if tls is not None and tls.mutual:
            verify = ssl.CERT_OPTIONAL if token else ssl.CERT_REQUIRED
        return MetricsServer(
            self.registry,
            self.config.metrics_host,
            port,
            tls=tls,
            client_certificates=verify,
            authenticator=self.auth if token else None,
            handshake_timeout=security.handshake_timeout,
            status=self.status.snapshot_threadsafe,
        )

    def reload_security(self) -> list[str]:
        """Re-read the TLS files and the auth file (SIGHUP); return what changed, as logged. A bad file
        (a FIFO, a device, over 16 MiB, or invalid: sluice_client.settings_file) is logged as an ERROR
        and changes nothing of its kind (the other kind still reloads). Live connections keep their
        certificate; sessions a new auth table no longer allows are cancelled with PERMISSION_DENIED.
        The files are read here, on the caller's thread: SIGHUP takes reload_security_soon."""
        changes, table = self._reread_security()
        return self._reloaded(changes, table)

    def reload_security_soon(self) -> None:
        """SIGHUP's handler: reload_security in a task of the running loop, the files read and parsed
        in a thread (a large auth file parses for seconds) while the loop goes on serving. Reloads run
        one at a time, in the order asked."""
        task = asyncio.get_running_loop().create_task(self.reload_security_async(), name="sluice-reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def reload_security_async(self) -> list[str]:
        """reload_security, its files read in a thread; the new auth table is put in force on the loop."""
        async with self._reloading:
            changes, table = await asyncio.to_thread(self._reread_security)
            return self._reloaded(changes, table)

    def _reread_security(self) -> tuple[list[str], AuthTable | None]:
        """The TLS files re-read and swapped in (ServerTls is thread-safe), and the auth file read; a bad
        file logged. Thread-safe: what changed, and the new auth table (None: none, or a bad file)."""
        changes: list[str] = []
        security = self.config.security
        if self.tls is not None:
            try:
                described = self.tls.reload()
            except TlsFileError as exc:
                log.error("reload: TLS files not reloaded, the old certificate stays: %s", exc)  # noqa: TRY400
            else:
                changes.append(
                    "TLS: unchanged" if described is None else f"TLS: new connections get {described}"
                )
                for warning in self.tls.material.warnings():
                    log.warning("%s", warning)
        table = None
        if security.auth_file is not None:
            try:
                table = AuthTable.load(
                    security.auth_file, base=security.limits, client_ca=security.verifies_clients
                )
            except AuthFileError as exc:
                log.error("reload: auth file not reloaded, the old one stays: %s", exc)  # noqa: TRY400
        return changes, table

    def _reloaded(self, changes: list[str], table: AuthTable | None) -> list[str]:
        """Put a re-read auth table in force (on the loop: it cancels sessions); log what changed."""
        if table is not None:
            self.auth.reload(table)
            revoked = revoke(self.receivers.values(), self.auth)
            changes.append(
                f"auth file: {len(table.principals)} principals, {len(table.tokens)} tokens"
                + (f"; {revoked} live calls revoked" if revoked else "")
            )
        for change in changes:
            log.info("reload: %s", change)
        return changes

    async def stop(self, grace: float = 5.0) -> None:
        """Seal and ack what was received, end every session, then stop serving. A second call waits
        for the first to end (the server stopping itself, then `sluice serve`)."""
        if self._stopped.is_set():
            await self._stop_done.wait()
            return
        self._stopped.set()
        try:
            await self._stop(grace)
        finally:
            self._stop_done.set()

    async def _stop(self, grace: float) -> None:
        for task in (self._watchdog, self._health_watch, *self._reloads):
            if task is not None:
                task.cancel()
        self.status.stop()
        await self.health.enter_graceful_shutdown()  # probes see NOT_SERVING from now on
        if self.node is not None:
            await self.node.drain()
        for receiver in self.receivers.values():
            await receiver.stop()
        if self.node is not None:
            await self.node.stop()
        if self._grpc is not None:
            await self._grpc.stop(grace)
        if self._loopback is not None:
            await self._loopback.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(None)
        if self._metrics is not None:
            self._metrics.close()
        self.store.close()
        # the token file stays: `sluice serve` drains Spark after this, and the source may first read
        # it then; the token dies with this process (only its hash was ever kept), the next run rewrites it
        self._release_lock()

    async def _start_receivers(self) -> None:
        if self.node is not None:  # before a record is taken: no offset the cluster used is given again
            await self.node.continue_logs(self.receivers)
        else:
            # a single server's logs have incarnations too (a cluster node's: continue_logs): a log lost
            # and started afresh (the data dir wiped, the stream's folder deleted) gets another one, and
            # a query whose checkpoint survived elsewhere tells it from the one it read (DataLossError)
            # rather than skip the new log's records up to its old offset
            for stream in self.receivers:
                await asyncio.to_thread(self.store.ensure_incarnation, stream)
        for receiver in self.receivers.values():
            await receiver.start()
        if self.node is not None:
            await self.node.start()

    async def _start_loopback_port(self) -> None:
        """Under TLS, a plaintext port on 127.0.0.1 for this server's own Spark source (`rate_target`),
        serving RateControl only and, when calls must authenticate, only to this run's own tokens: a
        token of the auth file (or none) must not get around TLS or mutual TLS there."""
        if self.tls is None or self._rate_service is None:
            return
        loopback = grpc.aio.server(
            # the source's LiveRateCap pings it (keepalive.node_channel_options)
            options=[("grpc.so_reuseport", 0), *self.config.security.grpc_options(), *ping_options(None)]
        )
        add_parsed_servicer(
            loopback, self._rate_service, "RateControl", authenticator=self.auth.internal_calls()
        )
        port = loopback.add_insecure_port("127.0.0.1:0")
        if not port:
            raise OSError("cannot bind a loopback port for the Spark source on 127.0.0.1")
        await loopback.start()
        self._loopback, self._loopback_port = loopback, port

    def _bind_health_port(self) -> None:
        """Bind the health port (config.health_port) to `_health_server`, which start() starts last."""
        port = self.config.health_port
        if port is None:
            return
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0), *self.config.security.health_grpc_options()]
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        try:
            self.health_port = server.add_insecure_port(bind_address("0.0.0.0", port)) or None  # noqa: S104 - probes come from the kubelet
        except RuntimeError:
            self.health_port = None
        if self.health_port is None:
            raise OSError(f"cannot bind the health port {port}")
        self._health_server = server

    async def _watch_batches(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_TICK)
            try:
                self.rate.check_overrun()
                self.rate.resplit()  # the rate goes where the demand is, a tick after it moves
            except Exception:  # the watchdog must outlive a bad proposal; the next batch corrects it
                log.exception("batch watchdog failed")

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


class StreamExistsError(ValueError):
    """AddStream of a stream served already, or of a new one whose name differs from a stream's of this
    data dir only in letter case: ALREADY_EXISTS."""


def _warn_of_case_pairs(streams: Iterable[str]) -> None:
    """Name each pair of this data dir's streams whose names differ only in letter case (made by an
    earlier version, which took them, on a case-sensitive file system): served as before, but the data
    dir cannot move to a case-insensitive one, and no new such pair is taken."""
    names = sorted(set(streams))
    for i, stream in enumerate(names):
        other = same_but_case(stream, names[i + 1 :])
        if other is not None:
            log.warning(
                "streams %s and %s differ only in letter case (an earlier version took them): they are "
                "served as before, but on a case-insensitive file system (macOS, Windows) their folders "
                "would be one: keep this data dir on a case-sensitive one",
                stream,
                other,
            )


class UnknownStreamError(KeyError):
    """RemoveStream of a stream not served: NOT_FOUND."""

    def __str__(self) -> str:
        return str(self.args[0])


class StreamChangeRefused(RuntimeError):
    """Streams cannot change on this node (a cluster's): FAILED_PRECONDITION."""


INGEST_HEALTH = "ingest.v1.Ingest"
"""The health service name of intake alone (a readiness probe for taking records, Spark or not)."""
HEALTH_TICK = 0.5
"""Seconds between looks at the query's health."""

PIPELINE_TOKEN_FILE = "pipeline.token"  # noqa: S105 - a file name
"""Under the data dir: the token of the server's own Spark source, for this run only."""


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by this user only (0600 from the start, never a moment more):
    a new file renamed over whatever was there. Opened in place, a FIFO at `path` held the start for
    ever (an open to write waits for a reader, deaf to SIGTERM)."""
    temp = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()
    descriptor = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(descriptor, "w") as out:
            out.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
