"""Serving a gRPC service whose requests are parsed by Sluice, not by gRPC.

gRPC's generated `add_XServicer_to_server` deserializes a request before the servicer sees it, and a
request that does not parse (garbage bytes, a string field that is not UTF-8) then ends the call
UNKNOWN ("Unexpected DecodeError"), outside the documented statuses. Registered through
`add_parsed_servicer`, every unary method receives the parsed request as before, and an undecodable
one ends INVALID_ARGUMENT naming the message type. A bidirectional stream's method gets the messages
as bytes and parses them itself (Publish: receivers.publish_service), so that it ends the call as its
protocol says.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from receivers.auth import Authenticator, Credential, authorize_fields, authorize_headers
from receivers.errors import ReceiverError
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb

Handler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]
StreamHandler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Message]]


def add_parsed_servicer(
    server: grpc.aio.Server, servicer: object, service: str, *, authenticator: Authenticator | None = None
) -> None:
    """Serve `service` (a name in ingest.v1, e.g. "RateControl") from `servicer`: unary requests parsed
    in the handler, a bidirectional stream's messages handed over as bytes. With `authenticator`, a
    unary call is authenticated and authorized (receivers.auth) before its request is even parsed; a
    stream's servicer does that itself (Publish needs the stream from its first message)."""
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        implementation = getattr(servicer, method.name)
        serialize = GetMessageClass(method.output_type).SerializeToString
        if method.client_streaming and method.server_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                implementation, request_deserializer=None, response_serializer=serialize
            )
        # unary requests are taken as a stream of one: gRPC would read a unary request whole (up to the
        # server's 32 MiB limit) before the handler runs, so an unauthenticated caller's body filled
        # memory; as a stream, the call is refused before its message is read
        elif not (method.client_streaming or method.server_streaming):
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                _parsing(
                    implementation,
                    GetMessageClass(method.input_type),
                    f"/{descriptor.full_name}/{method.name}",
                    authenticator,
                ),
                request_deserializer=None,
                response_serializer=serialize,
            )
        elif method.server_streaming:  # a request, a stream of responses (Blocks.ReadBlocks)
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _parsing_stream(
                    implementation,
                    GetMessageClass(method.input_type),
                    f"/{descriptor.full_name}/{method.name}",
                    authenticator,
                ),
                request_deserializer=None,
                response_serializer=serialize,
            )
        else:  # pragma: no cover - ingest.v1 has none
            raise TypeError(f"{descriptor.full_name}.{method.name}: a client stream is not served here")
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    # as the generated code does (grpcio >= 1.65; not in its type stubs yet): served without a lookup
    server.add_registered_method_handlers(descriptor.full_name, handlers)  # type: ignore[attr-defined]


async def _authorized_request(
    requests: AsyncIterator[bytes],
    context: grpc.aio.ServicerContext[Any, Any],
    request_type: type[Message],
    method: str,
    authenticator: Authenticator | None,
) -> tuple[Message, Credential | None]:
    """The call authenticated and authorized first, then its request read and parsed; aborts the call
    if not. With the caller's credential (None without an authenticator)."""
    credential = None
    if authenticator is not None:
        try:
            credential = authenticator.credential(context, method)
            authorize_headers(credential.principal, method, context.invocation_metadata() or ())
        except ReceiverError as error:
            await context.abort(getattr(grpc.StatusCode, error.status), str(error))
    raw = await anext(aiter(requests), None)
    if raw is None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"no {request_type.DESCRIPTOR.name} was sent")
    try:
        request = request_type.FromString(raw)
    except DecodeError as exc:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"undecodable {request_type.DESCRIPTOR.name} of {len(raw)} bytes: {exc}",
        )
    if credential is not None:
        try:
            authorize_fields(credential.principal, method, request)
        except ReceiverError as error:
            await context.abort(getattr(grpc.StatusCode, error.status), str(error))
    return request, credential


MAX_DETAILS = 2000
"""Characters of a status message at most: the message travels in a header, and one over gRPC's
metadata limit (16 KiB) reached the client as RESOURCE_EXHAUSTED "received metadata size exceeds
hard limit" instead of the error (a 100,000-character estimator name, echoed back)."""


class _CappedContext:
    """A servicer context whose abort() cuts its message to MAX_DETAILS characters, saying so."""

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", *args: Any) -> NoReturn:
        if len(details) > MAX_DETAILS:
            details = f"{details[:MAX_DETAILS]}... ({len(details):,} characters)"
        await self._context.abort(code, details, *args)
        raise AssertionError  # pragma: no cover - abort raises


def _parsing(
    handler: Handler, request_type: type[Message], method: str, authenticator: Authenticator | None
) -> Handler:
    async def parse_then_handle(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Message:
        request, _ = await _authorized_request(requests, context, request_type, method, authenticator)
        return await handler(request, _CappedContext(context))  # type: ignore[arg-type]

    return parse_then_handle


def _parsing_stream(
    handler: StreamHandler, request_type: type[Message], method: str, authenticator: Authenticator | None
) -> StreamHandler:
    async def parse_then_stream(
        requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Message]:
        request, credential = await _authorized_request(
            requests, context, request_type, method, authenticator
        )
        responses = handler(request, _CappedContext(context))  # type: ignore[arg-type]
        if authenticator is not None and credential is not None:
            # a reload of the auth file that drops the caller's token (or role) ends the stream
            responses = authenticator.revocable(credential, method, context, responses)
        async for response in responses:
            yield response

    return parse_then_stream
