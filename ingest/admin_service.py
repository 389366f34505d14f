"""The Admin service: change the running system (docs/runtime.md).

GetConfig and SetConfig read and change the settings of ingest.runtime_config (validated whole, applied
all or none, logged, counted, kept across restarts); ListStreams lists the streams served. Adding and
removing streams and swapping the pipeline are not built yet: UNIMPLEMENTED, saying so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import grpc

from ingest.config import ServeConfig
from ingest.runtime_config import RuntimeConfig, SettingError, UnknownSettingError, VersionConflictError
from receivers.receiver import Receiver
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[object, object]
NOT_YET = "not built yet in this version (docs/runtime.md): {what} needs a restart with new flags"


class AdminService(pb_grpc.AdminServicer):
    def __init__(
        self,
        runtime: RuntimeConfig,
        receivers: Mapping[str, Receiver],
        apply: Callable[[ServeConfig, ServeConfig], None],
    ) -> None:
        self._runtime = runtime
        self._receivers = receivers
        self._apply = apply

    def _view(self, keys: list[str] | None = None) -> pb.ConfigView:
        settings = [
            pb.ConfigSetting(key=key, value=value, source=source, help=text)
            for key, value, source, text in self._runtime.view(keys or ())
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
        try:
            old, new = self._runtime.change(
                dict(request.set),
                list(request.reset),
                validate_only=request.validate_only,
                expected_version=request.expected_version,
            )
        except UnknownSettingError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise
        except VersionConflictError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise
        except SettingError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"nothing changed: {exc}")
            raise
        if request.validate_only:
            return self._view()
        self._apply(old, new)
        changed = ", ".join(f"{k}={v}" for k, v in request.set.items())
        reset = ", ".join(request.reset)
        log.info(
            "settings version %d by %s: %s%s",
            self._runtime.version,
            context.peer(),
            changed,
            f"; reset {reset}" if reset else "",
        )
        return self._view()

    async def ListStreams(self, request: pb.ListStreamsRequest, context: Context) -> pb.StreamsView:
        return pb.StreamsView(
            streams=[
                pb.StreamView(stream=name, state="serving", sessions=receiver.active_sessions)
                for name, receiver in self._receivers.items()
            ]
        )

    async def AddStream(self, request: pb.AddStreamRequest, context: Context) -> pb.StreamsView:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(what="adding a stream"))
        raise AssertionError

    async def RemoveStream(self, request: pb.RemoveStreamRequest, context: Context) -> pb.StreamsView:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(what="removing a stream"))
        raise AssertionError

    async def GetPipeline(self, request: pb.GetPipelineRequest, context: Context) -> pb.PipelineView:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(what="the pipeline view"))
        raise AssertionError

    async def SwapPipeline(self, request: pb.SwapPipelineRequest, context: Context) -> pb.PipelineView:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_YET.format(what="swapping the pipeline"))
        raise AssertionError
