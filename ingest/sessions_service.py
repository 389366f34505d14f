"""The Sessions RPCs: operators list publisher sessions and cancel one."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import grpc

from receivers.errors import shown
from receivers.receiver import Receiver
from receivers.session import SESSION_IDS
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_CANCELLED = grpc.StatusCode.CANCELLED.value[0]
_VALID_CODES = {code.value[0] for code in grpc.StatusCode} - {grpc.StatusCode.OK.value[0]}
_STATUS_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class SessionsService(pb_grpc.SessionsServicer):
    def __init__(self, receivers: Mapping[str, Receiver]) -> None:
        self._receivers = receivers

    async def ListSessions(
        self, request: pb.ListSessionsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.ListSessionsResponse:
        if request.stream and request.stream not in self._receivers:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no stream named {request.stream!r}")
        receivers = [self._receivers[request.stream]] if request.stream else list(self._receivers.values())
        return pb.ListSessionsResponse(
            sessions=[
                pb.SessionInfo(
                    session_id=s.id,
                    stream=s.stream,
                    producer_id=s.producer_id,
                    credit=s.credit,
                    next_seq=s.next_seq,
                    durable_up_to=s.durable_up_to,
                    completed=s.completed,
                    cancelled=s.cancelled,
                    principal=s.principal.name,
                )
                for r in receivers
                for s in r.sessions
            ]
        )

    async def CancelSession(
        self, request: pb.CancelSessionRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.CancelSessionResponse:
        code = request.code or _CANCELLED
        if code not in _VALID_CODES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"code {code} is not a gRPC error status code (1-16)"
            )
        for receiver in self._receivers.values():
            for session in receiver.sessions:
                if session.id == request.session_id:
                    reason = request.reason or "cancelled by an operator"
                    cancelled = receiver.cancel(session, code, reason)
                    if cancelled:  # as a rate, a setting or a stream changed at run time: who and why
                        log.info(
                            "session %d on stream %s (producer %s, principal %s) cancelled %s by %s: %s",
                            session.id,
                            shown(session.stream),
                            shown(session.producer_id),
                            shown(session.principal.name),
                            _STATUS_NAMES[code],
                            context.peer(),
                            shown(reason),  # escaped: one log line whatever it holds
                        )
                    return pb.CancelSessionResponse(cancelled=cancelled)
        if SESSION_IDS.issued(request.session_id):
            return pb.CancelSessionResponse(cancelled=False)  # it already ended: cancel is idempotent
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no session with id {request.session_id}")
        raise AssertionError("unreachable")  # pragma: no cover - abort raises
