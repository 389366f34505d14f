"""gRPC server reflection (grpc.reflection.v1alpha): lets grpcurl-style clients list a server's services
and fetch their schemas without the .proto files. It tells only the wire contract (public anyway, in
proto/), so like health it needs no credentials.

Both have a streaming call that lasts as long as the client likes (health's Watch, reflection's
ServerReflectionInfo), and a connection with a call open is never idle: without credentials, anyone who
reaches the port could hold connections past --connection-idle-timeout with one call each, up to
--max-connections, and lock honest clients out without reconnecting. Each server takes at most
MAX_OPEN_STREAMS of each at once (RESOURCE_EXHAUSTED past it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def service_name(name: str) -> str:
    """The full name of an ingest.v1 service: "RateControl" -> "ingest.v1.RateControl"."""
    return pb.DESCRIPTOR.services_by_name[name].full_name


MAX_OPEN_STREAMS = 64
"""Health Watch calls, and reflection calls, a server holds open at once (each kind)."""


class _Streams:
    """Counts a kind of open call; `enter` refuses one past MAX_OPEN_STREAMS."""

    def __init__(self, what: str) -> None:
        self._what = what
        self.open = 0

    async def enter(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self.open >= MAX_OPEN_STREAMS:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_OPEN_STREAMS} {self._what} calls are open on this server: try again later",
            )
        self.open += 1


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc,name-defined]  # stubs lack .aio
    """grpc.health.v1 with at most MAX_OPEN_STREAMS Watch calls open (Check is unbounded: it answers
    at once)."""

    def __init__(self) -> None:
        super().__init__()
        self._watches = _Streams("health Watch")

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        await self._watches.enter(context)
        try:
            await super().Watch(request, context)
        finally:
            self._watches.open -= 1


class _BoundedReflection(reflection.aio.ReflectionServicer):  # type: ignore[misc,name-defined]  # untyped
    def __init__(self, service_names: list[str]) -> None:
        super().__init__(service_names)
        self._streams = _Streams("reflection")

    async def ServerReflectionInfo(
        self,
        request_iterator: AsyncIterator[reflection_pb2.ServerReflectionRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[reflection_pb2.ServerReflectionResponse]:
        await self._streams.enter(context)
        try:
            async for response in super().ServerReflectionInfo(request_iterator, context):
                yield response
        finally:
            self._streams.open -= 1


def enable_reflection(server: grpc.aio.Server, services: Iterable[str]) -> None:
    """Serve reflection on `server` for the ingest.v1 `services` (short names), health and itself."""
    names = [service_name(s) for s in services]
    servicer = _BoundedReflection([*names, HEALTH, reflection.SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
