"""The Admin service: change the running system (docs/runtime.md).

GetConfig and SetConfig read and change the settings of ingest.runtime_config (validated whole, applied
all or none, logged, counted, kept across restarts; a new trigger interval restarts the query at a batch
boundary first). ListStreams, AddStream and RemoveStream change the streams served (ingest.streams);
GetPipeline and SwapPipeline the Spark query (ingest.pipeline_manager).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc

from ingest.config import ServeConfig
from ingest.pipeline_control import (
    InvalidPipeline,
    PipelineControl,
    PipelineUnavailable,
    SwapInProgress,
    SwapRolledBack,
)
from ingest.rate_service import driver_settings_refusal, refuse_unsaved
from ingest.runtime_config import (
    THE_SETTINGS,
    RuntimeConfig,
    SettingError,
    SettingRow,
    UnknownSettingError,
    VersionConflictError,
)
from ingest.streams import REMOVED, SERVING
from receivers.auth import Authenticator
from receivers.errors import ReceiverError, cut, printable, shown
from receivers.publish_service import PUBLISH, status_code
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from ingest.server import SluiceServer

log = logging.getLogger(__name__)

STATES = "the stream states"
"""What a stream change that fails to write streams.json could not save (refuse_unsaved)."""


def _change_words(request: pb.SetConfigRequest) -> str:
    """A SetConfig as one short escaped line: its keys set and reset (the values left out: any length)."""
    words = [printable(cut(key)) for key in request.set]
    words += [f"--reset {printable(cut(key))}" for key in dict.fromkeys(request.reset)]
    return cut(" ".join(words))


Context = grpc.aio.ServicerContext[object, object]
NO_QUERY = "no Spark query runs on this node (started with --no-spark, or a cluster's receiver node)"
MAX_SPEC = 1000
MAX_FIRST_BATCH_TIMEOUT = 3600.0


class AdminService(pb_grpc.AdminServicer):
    def __init__(
        self,
        runtime: RuntimeConfig,
        server: SluiceServer,
        apply: Callable[[ServeConfig, ServeConfig], None],
        *,
        driver_target: Callable[[], str | None] | None = None,
    ) -> None:
        """`driver_target` (a cluster's receiver node): where the driver serves its RateControl, None
        until one has called (RateControlService.driver_target); a change of a setting the driver runs
        by (DRIVER_ONLY_SETTINGS) is refused FAILED_PRECONDITION, naming it. None: a single server."""
        self._runtime = runtime
        self._driver_target = driver_target
        self._server = server
        self._apply = apply
        self._changing = asyncio.Lock()
        """Held by a SetConfig from its validation to its save, restart included."""
        self._restarting = False
        """A SetConfig holding the lock restarts the query (seconds): another one is refused meanwhile."""
        self._alone: set[asyncio.Task[None]] = set()
        """Stream changes whose caller went away, held to their end: the loop keeps only weak references."""

    @property
    def _pipeline(self) -> PipelineControl | None:
        return self._server.pipeline_control

    def _view(self, keys: list[str] | None = None, rows: list[SettingRow] | None = None) -> pb.ConfigView:
        settings = [
            pb.ConfigSetting(key=r.key, value=r.value, source=r.source, help=r.help, effective=r.effective)
            for r in (self._runtime.view(keys or ()) if rows is None else rows)
        ]
        return pb.ConfigView(settings=settings, version=self._runtime.version)

    async def GetConfig(self, request: pb.GetConfigRequest, context: Context) -> pb.ConfigView:
        try:
            return self._view(list(request.keys))
        except UnknownSettingError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise

    async def SetConfig(self, request: pb.SetConfigRequest, context: Context) -> pb.ConfigView:
        if not request.set and not request.reset:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "nothing to set or reset")
        changes = dict(request.set)
        await self._refuse_drivers(request, context)
        version = self._runtime.version
        not_set = self._runtime.not_set(request.reset)  # nothing to reset there
        reset = [key for key in dict.fromkeys(request.reset) if key not in not_set]
        try:
            if request.validate_only:  # what the settings would become (the version they would not)
                self._change(request, validate_only=True)
                return self._view(rows=self._runtime.preview(dict(request.set), list(request.reset)))
            await self._change_shielded(request, context.peer())
        except OSError as exc:  # the settings file (disk full, read-only): nothing changed
            await refuse_unsaved(
                context, f"sluice config set {_change_words(request)}", THE_SETTINGS, exc, log
            )
            raise
        except UnknownSettingError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise
        except VersionConflictError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise
        except SettingError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"nothing changed: {exc}")
            raise
        except SwapInProgress as exc:
            await context.abort(grpc.StatusCode.ABORTED, f"nothing changed: {exc}")
            raise
        except (SwapRolledBack, PipelineUnavailable) as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"nothing changed: {exc}")
            raise
        # one line of known keys (an unknown one was refused), each value cut: 100,000 resets of one
        # key logged a line of 900 KB; and escaped: a value the setting takes may still hold a newline
        # ("0.5\n" is a float), which wrote a line of its own
        done = [", ".join(f"{k}={printable(cut(v))}" for k, v in changes.items())] if changes else []
        if reset:
            done.append(f"reset {', '.join(reset)}")
        if not_set:
            done.append(f"nothing to reset for {', '.join(not_set)} (not set at run time)")
        if self._runtime.version == version:
            log.info("settings unchanged (version %d) by %s: %s", version, context.peer(), "; ".join(done))
        else:
            log.info("settings version %d by %s: %s", self._runtime.version, context.peer(), "; ".join(done))
        view = self._view()
        view.not_set.extend(not_set)
        return view

    async def _refuse_drivers(self, request: pb.SetConfigRequest, context: Context) -> None:
        """On a receiver node, abort a change of a setting the driver runs by (FAILED_PRECONDITION),
        counting each key of the request "invalid" as any other refused change is (RuntimeConfig.change:
        the whole request is refused, nothing changed): these refusals were missing from
        sluice_config_changes_total."""
        if self._driver_target is None:
            return
        refusal = driver_settings_refusal(dict(request.set), self._driver_target())
        if refusal is not None:
            # each reset once, as change() takes them
            self._runtime.count_refused([*request.set, *dict.fromkeys(request.reset)])
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)

    async def _change_shielded(self, request: pb.SetConfigRequest, peer: str) -> None:
        """Validate, restart the query for a new trigger interval, save and apply: as a task that runs to
        its end whatever becomes of the call, holding the change lock. A client that went away (Ctrl-C,
        its deadline) mid-restart cancelled the call there: the query ran on the new interval while the
        settings (and the next start) kept the old one."""
        if self._restarting:
            raise SwapInProgress(
                "a trigger-interval change is restarting the query: try again when it is done"
            )
        await self._changing.acquire()  # released by the task when it ends; another change saves at once
        task = asyncio.create_task(self._change_held(request))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                log.warning("the caller of a settings change went away: the change goes on to its end")
                task.add_done_callback(lambda done: _said_when_alone(done, self._runtime, peer))
            raise

    async def _change_held(self, request: pb.SetConfigRequest) -> None:
        """_change_shielded's task, the lock held: released when it ends."""
        try:
            old, new = self._change(request, validate_only=True)
            restarted = None
            if new.trigger_interval != old.trigger_interval and self._pipeline is not None:
                # Spark fixes a query's trigger when it starts: restart it at a batch boundary first;
                # a restart that fails rolls back, and no setting of this request changes
                self._restarting = True
                await self._pipeline.restart(trigger_interval=new.trigger_interval)
                restarted = old.trigger_interval
            try:
                # the version was checked above; the rate API's changes meanwhile do not void this one
                old, new = self._runtime.change(dict(request.set), list(request.reset))
            except (OSError, SettingError):  # nothing changed: the query goes back to the old interval
                if restarted is not None:
                    await self._restart_back(restarted)
                raise
            self._apply(old, new)
        finally:
            self._restarting = False
            self._changing.release()

    async def _restart_back(self, trigger_interval: float) -> None:
        """Put the query back on the trigger interval the settings still say, after a restart for a
        change that could not be saved."""
        assert self._pipeline is not None
        try:
            await self._pipeline.restart(trigger_interval=trigger_interval)
        except (SwapInProgress, SwapRolledBack, PipelineUnavailable):
            log.exception("the query could not go back to its trigger interval of %g s", trigger_interval)

    def _change(
        self, request: pb.SetConfigRequest, *, validate_only: bool
    ) -> tuple[ServeConfig, ServeConfig]:
        return self._runtime.change(
            dict(request.set),
            list(request.reset),
            validate_only=validate_only,
            expected_version=request.expected_version if request.HasField("expected_version") else None,
        )

    def _streams_view(self) -> pb.StreamsView:
        server = self._server
        views = []
        for name, state in server.streams.states.items():
            if state == REMOVED:
                continue
            receiver = server.receivers.get(name)
            views.append(
                pb.StreamView(
                    stream=name,
                    state=state,
                    backlog=server.stream_backlog(name),
                    sessions=receiver.active_sessions if receiver is not None and state == SERVING else 0,
                )
            )
        return pb.StreamsView(streams=views)

    async def ListStreams(self, request: pb.ListStreamsRequest, context: Context) -> pb.StreamsView:
        return self._streams_view()

    async def AddStream(self, request: pb.AddStreamRequest, context: Context) -> pb.StreamsView:
        from ingest.server import StreamChangeRefused, StreamExistsError  # noqa: PLC0415 - it imports this

        try:
            await self._to_its_end(
                self._server.add_stream(request.stream), "add", request.stream, context.peer()
            )
        except StreamExistsError as exc:
            await self._refuse(context, "add", grpc.StatusCode.ALREADY_EXISTS, str(exc))
        except StreamChangeRefused as exc:
            await self._refuse(context, "add", grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:  # the name
            await self._refuse(context, "add", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            self._count("add", "refused")
            await refuse_unsaved(
                context, f"sluice streams add {printable(cut(request.stream))}", STATES, exc, log
            )
        self._count("add", "applied")
        log.info("stream %s added by %s", printable(request.stream), context.peer())  # a checked name
        return self._streams_view()

    async def RemoveStream(self, request: pb.RemoveStreamRequest, context: Context) -> pb.StreamsView:
        from ingest.server import StreamChangeRefused, UnknownStreamError  # noqa: PLC0415 - it imports this

        if request.backlog not in (pb.RemoveStreamRequest.DRAIN, pb.RemoveStreamRequest.KEEP):
            await self._refuse(
                context,
                "remove",
                grpc.StatusCode.INVALID_ARGUMENT,
                "backlog must be DRAIN (process what was acked, then remove) or KEEP (stop reading now, "
                "keep the unprocessed blocks for when the stream is added again)",
            )
        try:
            remove = self._server.remove_stream(
                request.stream,
                drain=request.backlog == pb.RemoveStreamRequest.DRAIN,
                reason=cut(request.reason),
            )
            await self._to_its_end(remove, "remove", request.stream, context.peer())
        except UnknownStreamError as exc:
            await self._refuse(context, "remove", grpc.StatusCode.NOT_FOUND, str(exc))
        except StreamChangeRefused as exc:
            await self._refuse(context, "remove", grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except OSError as exc:
            self._count("remove", "refused")
            change = f"sluice streams remove {printable(cut(request.stream))}"
            await refuse_unsaved(context, change, STATES, exc, log)
        self._count("remove", "applied")
        backlog = "drain" if request.backlog == pb.RemoveStreamRequest.DRAIN else "keep"
        peer, reason = context.peer(), shown(request.reason)  # escaped: one log line whatever it holds
        log.info("stream %s removed (%s) by %s: %s", printable(request.stream), backlog, peer, reason)
        return self._streams_view()

    async def _to_its_end(
        self, change: Coroutine[Any, Any, None], action: str, stream: str, peer: str
    ) -> None:
        """Run a stream change as a task that runs to its end whatever becomes of the call. A client that
        went away (its deadline, Ctrl-C) cancelled it between saving streams.json and starting or
        stopping the receiver: the stream was then listed serving without a receiver, and could be
        neither added (ALREADY_EXISTS) nor removed (NOT_FOUND) until a restart."""
        task = asyncio.create_task(change)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                what = f"stream {action} of {printable(cut(stream))} by {peer}"  # the client's name: escaped
                log.warning("the caller of a %s went away: the change goes on to its end", what)
                self._alone.add(task)  # the loop keeps only a weak reference to a task
                task.add_done_callback(self._alone.discard)
                task.add_done_callback(lambda done: self._stream_change_alone(done, action, what))
            raise

    def _stream_change_alone(self, task: asyncio.Task[None], action: str, what: str) -> None:
        """Count and log how a stream change (`what`) whose caller went away ended."""
        from ingest.server import StreamChangeRefused, UnknownStreamError  # noqa: PLC0415 - it imports this

        if task.cancelled():
            self._count(action, "refused")
            log.warning("a %s, who went away, was cancelled", what)
            return
        exc = task.exception()
        self._count(action, "refused" if exc is not None else "applied")
        if exc is None:
            log.info("a %s (who went away): done", what)
        elif isinstance(exc, (ValueError, UnknownStreamError, StreamChangeRefused, OSError)):  # refusals
            log.warning("a %s, who went away, changed nothing: %s", what, exc)
        else:
            log.error("a %s, who went away, failed", what, exc_info=exc)

    def _count(self, action: str, result: str) -> None:
        changes = self._server.stream_changes
        changes[(action, result)] = changes.get((action, result), 0) + 1

    async def _refuse(self, context: Context, action: str, code: grpc.StatusCode, message: str) -> None:
        self._count(action, "refused")
        await context.abort(code, message)

    async def GetPipeline(self, request: pb.GetPipelineRequest, context: Context) -> pb.PipelineView:
        return await get_pipeline(self._pipeline, context)

    async def SwapPipeline(self, request: pb.SwapPipelineRequest, context: Context) -> pb.PipelineView:
        return await swap_pipeline(self._pipeline, request, context)


async def get_pipeline(control: PipelineControl | None, context: Context) -> pb.PipelineView:
    """Admin.GetPipeline on a node (`control` None: no query runs there)."""
    if control is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_QUERY)
        raise AssertionError
    return control.view()


async def swap_pipeline(
    control: PipelineControl | None, request: pb.SwapPipelineRequest, context: Context
) -> pb.PipelineView:
    """Admin.SwapPipeline on a node (`control` None: no query runs there)."""
    timeout = request.first_batch_timeout_seconds
    if not (math.isfinite(timeout) and 0 <= timeout <= MAX_FIRST_BATCH_TIMEOUT):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"first_batch_timeout_seconds must be 0 (the default) to {MAX_FIRST_BATCH_TIMEOUT:g}, "
            f"got {timeout}",
        )
    if len(request.pipeline) > MAX_SPEC:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"the pipeline spec is over {MAX_SPEC} characters"
        )
    if control is None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, NO_QUERY)
        raise AssertionError
    # quoted and escaped (the spec is the client's, not checked yet): a newline in it forged a log line
    spec = shown(request.pipeline) if request.pipeline else "the built-in sink"
    log.info("pipeline swap to %s asked by %s", spec, context.peer())
    try:
        return await control.swap(
            request.pipeline, keep_state=request.keep_state, first_batch_timeout=timeout
        )
    except InvalidPipeline as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"nothing was stopped: {exc}")
    except SwapInProgress as exc:
        await context.abort(grpc.StatusCode.ABORTED, str(exc))
    except (SwapRolledBack, PipelineUnavailable) as exc:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    raise AssertionError


def _said_when_alone(task: asyncio.Task[None], runtime: RuntimeConfig, peer: str) -> None:
    """Log how a settings change whose caller (`peer`) went away ended."""
    if task.cancelled():
        log.warning("a settings change by %s, who went away, was cancelled", peer)
        return
    exc = task.exception()
    if exc is None:
        log.info("settings version %d by %s (who went away): saved", runtime.version, peer)
    elif isinstance(exc, (SettingError, OSError, SwapInProgress, SwapRolledBack, PipelineUnavailable)):
        log.error("a settings change by %s, who went away, changed nothing: %s", peer, exc)
    else:
        log.error("a settings change by %s, who went away, failed", peer, exc_info=exc)


ON_THE_NODES = (
    "a cluster's driver has no settings or streams of its own to change: they are each receiver node's "
    "(sluice config set / sluice streams ... --target NODE); here: the pipeline (sluice pipeline) and "
    "the cluster's rate, its bounds and estimator (sluice rate set|bounds|estimator)"
)


class DriverAdminService(pb_grpc.AdminServicer):
    """Admin on a cluster's driver (ingest.cluster_driver): GetPipeline and SwapPipeline; the settings
    and streams calls are refused with where to make them (FAILED_PRECONDITION)."""

    def __init__(self, pipeline: Callable[[], PipelineControl | None]) -> None:
        self._pipeline = pipeline

    async def GetPipeline(self, request: pb.GetPipelineRequest, context: Context) -> pb.PipelineView:
        return await get_pipeline(self._pipeline(), context)

    async def SwapPipeline(self, request: pb.SwapPipelineRequest, context: Context) -> pb.PipelineView:
        return await swap_pipeline(self._pipeline(), request, context)

    async def _elsewhere(self, context: Context) -> None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, ON_THE_NODES)

    async def GetConfig(self, request: pb.GetConfigRequest, context: Context) -> pb.ConfigView:
        await self._elsewhere(context)
        raise AssertionError

    async def SetConfig(self, request: pb.SetConfigRequest, context: Context) -> pb.ConfigView:
        await self._elsewhere(context)
        raise AssertionError

    async def ListStreams(self, request: pb.ListStreamsRequest, context: Context) -> pb.StreamsView:
        await self._elsewhere(context)
        raise AssertionError

    async def AddStream(self, request: pb.AddStreamRequest, context: Context) -> pb.StreamsView:
        await self._elsewhere(context)
        raise AssertionError

    async def RemoveStream(self, request: pb.RemoveStreamRequest, context: Context) -> pb.StreamsView:
        await self._elsewhere(context)
        raise AssertionError


NO_RECORDS_HERE = (
    "this is a Sluice cluster's driver (its rate and admin port): it takes no records and holds no "
    "sessions; publish to the receiver nodes (the targets of its --nodes list: sluice push --target "
    "NODE,NODE ..., sluice sessions --target NODE)"
)


class DriverIngestService(pb_grpc.IngestServicer):
    """Ingest on a cluster's driver: Publish refused with where to publish (a push aimed at the driver
    by mistake said only UNIMPLEMENTED "Method not found!"). The caller is authenticated first, so an
    outsider learns nothing but that it may not publish."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._authenticator = authenticator

    async def Publish(  # type: ignore[override] # the messages are bytes: add_parsed_servicer
        self, request_iterator: AsyncIterator[bytes], context: Context
    ) -> AsyncIterator[pb.PublishResponse]:
        try:
            self._authenticator.caller(context, PUBLISH)
        except ReceiverError as error:
            await context.abort(status_code(error), str(error))
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_RECORDS_HERE)
        yield pb.PublishResponse()  # pragma: no cover - abort raises; this makes it a generator


class DriverSessionsService(pb_grpc.SessionsServicer):
    """Sessions on a cluster's driver: refused with where the sessions are (add_parsed_servicer
    authenticates the caller first)."""

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: Context
    ) -> pb.ListSessionsResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_RECORDS_HERE)
        raise AssertionError

    async def CancelSession(
        self, request: pb.CancelSessionRequest, context: Context
    ) -> pb.CancelSessionResponse:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NO_RECORDS_HERE)
        raise AssertionError
