"""The Publish RPC: one bidirectional gRPC stream per publisher session, the Flow contract on the wire.

Client messages are read by a task that feeds the stream's receiver; server messages (Request, Ack,
Cancel) are taken from the session's outbox and written in order by the handler. A protocol violation
ends only the offending session, with a precise status; other sessions go on. Client messages arrive as
bytes and are parsed here (`add_to_server`), so an undecodable one is a status like any other bad input.
Once the server has sent Cancel, nothing the client sends changes how the call ends.

Per-principal limits are checked here, where every receiver's sessions are seen: max_sessions and
max_streams at Open (receivers.limits), max_message_bytes on each raw message before it is parsed,
max_record_bytes on each decoded batch; the idle timeout is the receiver's (it knows the credit).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc

from receivers.auth import Authenticator, Credential
from receivers.errors import (
    InvalidMessage,
    LimitExceeded,
    PermissionDenied,
    ProtocolViolation,
    ReceiverError,
    UnknownStream,
    cut,
    shown,
)
from receivers.limits import SessionLedger, limit_key
from receivers.parsed_service import add_parsed_servicer
from receivers.principal import Principal, producer_key
from receivers.receiver import Receiver
from receivers.session import Session
from receivers.wire import (
    WireBatch,
    check_open_flags,
    check_producer_id,
    check_record_bytes,
    decode_batch,
    decode_request,
)
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.producer import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)


PUBLISH = "/ingest.v1.Ingest/Publish"

_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_code(error: ReceiverError) -> grpc.StatusCode:
    """The gRPC status a receiver error ends its session with."""
    if error.code is not None and error.code in _BY_NUMBER and error.code != 0:
        return _BY_NUMBER[error.code]
    return getattr(grpc.StatusCode, error.status, grpc.StatusCode.INTERNAL)


class PublishService(pb_grpc.IngestServicer):
    """Serves Publish for a set of receivers, one per stream."""

    def __init__(
        self,
        receivers: Mapping[str, Receiver],
        *,
        open_timeout: float = 10.0,
        authenticator: Authenticator | None = None,
        producer_marks: Callable[[str, str], Awaitable[int | None]] | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        """`max_message_bytes`: the server's message size limit (gRPC's, which it enforces), told to
        every session on its Requests (with its principal's limit if lower)."""
        self._receivers = receivers
        self._max_message_bytes = max_message_bytes
        # in a cluster: (stream, producer key) -> how far the other nodes hold the producer's records
        self._producer_marks = producer_marks
        self._open_timeout = open_timeout
        self._authenticator = authenticator or Authenticator()
        self.ledger = SessionLedger()
        """Sessions open per principal on every stream: max_sessions and max_streams."""

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve Publish on `server`, its client messages handed over as bytes: gRPC's own deserializer
        (what add_IngestServicer_to_server registers) fails an undecodable message before this code sees
        it, and the call ends UNKNOWN; parsed here, it ends INVALID_ARGUMENT like any other bad input."""
        add_parsed_servicer(server, self, "Ingest")

    async def Publish(
        self,
        request_iterator: AsyncIterator[pb.PublishRequest | bytes],
        context: grpc.aio.ServicerContext[pb.PublishRequest | bytes, pb.PublishResponse],
    ) -> AsyncIterator[pb.PublishResponse]:
        requests = None
        try:
            # before anything is read: an unauthenticated caller is never granted credit
            credential = self._authenticator.credential(context, PUBLISH)
            principal = credential.principal
            # only now: a request iterator made and never read warns ("never awaited") when collected
            requests = aiter(request_iterator)
            key = limit_key(principal, context.peer() or "")
            receiver, session = await self._open(requests, credential, key)
        except ReceiverError as error:
            _end_call(context, error)
            if requests is not None:
                await _close(requests)
            return
        self.ledger.add(key, session)  # no await since _open checked the limits
        reader = asyncio.create_task(self._read(requests, receiver, session))
        own = principal.limits.max_message_bytes
        limit = self._max_message_bytes if own is None else min(own, self._max_message_bytes)
        try:
            while True:
                messages, ended, end_error = await session.outbox.take()
                for message in messages:
                    if message.HasField("request"):  # what the client may send: it cuts its batches so
                        message.request.max_message_bytes = limit
                    yield message
                if ended:
                    if end_error is not None:
                        _end_call(context, end_error)
                    break
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            receiver.close_session(session)
            self.ledger.remove(key, session)
            await _close(requests)

    async def _open(
        self, requests: AsyncIterator[pb.PublishRequest | bytes], credential: Credential, key: str
    ) -> tuple[Receiver, Session]:
        principal = credential.principal
        try:
            message = await asyncio.wait_for(anext(requests), self._open_timeout)
            first = _parse(_within_limit(message, principal))
        except StopAsyncIteration:
            raise ProtocolViolation("the stream ended before Open") from None
        except TimeoutError:
            raise ProtocolViolation(f"no Open within {self._open_timeout:g} s") from None
        kind = _kind(first)
        if kind != "open":
            raise ProtocolViolation(
                f"the first message must be Open (rules 1.9, 2.12), got {kind or 'nothing'}"
            )
        assert isinstance(first, pb.PublishRequest)
        stream = first.open.stream
        if not principal.may_publish(stream):  # before the lookup: no stream names leak to outsiders
            raise PermissionDenied(f"principal {principal.name!r} may not publish to stream {shown(stream)}")
        receiver = self._receivers.get(stream)
        if receiver is None:
            # only the streams this principal may publish to: another's stream names are not its to learn
            mine = sorted(s for s in self._receivers if principal.may_publish(s))
            known = ", ".join(mine) or "none of yours"
            raise UnknownStream(f"no stream named {shown(stream)} on this server (streams: {known})")
        producer_id = first.open.producer_id
        # cheap checks first: before the lookup among the peers, which may take seconds
        check_open_flags(fresh=first.open.fresh, resume=first.open.resume)
        if producer_id and self._producer_marks is not None:
            check_producer_id(producer_id)
            mark_key = producer_key(principal, producer_id)  # not `key`: the ledger's key of this call
            mark = await self._producer_marks(stream, mark_key)
            if mark is not None:
                receiver.learn_producer_mark(mark_key, mark)
        state = receiver.producer(producer_id, principal) if producer_id else None
        self.ledger.admit(principal, key, stream, fenced=state.sessions if state is not None else ())
        # revocation is checked from here on: had a reload dropped the token while this waited for Open
        # or the producer's marks, the session would have missed it
        error = self._authenticator.revocation(credential, PUBLISH, stream)
        if error is not None:
            raise error
        opened = receiver.open_session(
            producer_id,
            first.open.resume_from_seq,
            principal,
            resume=first.open.resume,
            fresh=first.open.fresh,
            token_sha256=credential.token_sha256,
        )
        return receiver, opened

    async def _read(
        self, requests: AsyncIterator[pb.PublishRequest | bytes], receiver: Receiver, session: Session
    ) -> None:
        try:
            async for message in requests:
                try:
                    self._handle(_parse(_within_limit(message, session.principal)), receiver, session)
                except ReceiverError:
                    if not session.cancelled:
                        raise
                    # the Cancel promised its code and an ack up to accepted_up_to: messages the client
                    # sent after it (in flight, or broken) must not change that; batches are counted
                if receiver.over_memory_budget:  # the next message waits unread for room (flow control)
                    await receiver.room_to_read(session)
            # the client half-closed: like Complete, end the call once what it sent is acked (a
            # cancelled session ends so anyway)
            if not session.completed and not session.cancelled:
                receiver.complete(session)
        except ReceiverError as error:
            receiver.fail(session, error)
        except grpc.aio.AioRpcError:
            receiver.close_session(session)  # the client went away
        except Exception as exc:
            if session.ended or session.cancelled:
                return  # the call was already ended (abort, cancel): reading fails as it should
            log.exception("session %d on stream %r failed", session.id, receiver.stream)
            receiver.fail(session, ReceiverError(f"internal error: {exc!r}"))

    @staticmethod
    def _handle(request: pb.PublishRequest | WireBatch, receiver: Receiver, session: Session) -> None:
        """Feed one client message to the receiver; raise a ReceiverError to end the session."""
        kind = _kind(request)
        if session.completed and kind in ("batch", "complete", "error"):
            raise ProtocolViolation(f"{kind.capitalize()} after the publisher's Complete or Error (rule 1.7)")
        if kind == "batch":
            batch = request if isinstance(request, WireBatch) else request.batch
            receiver.check_credit(session, batch.count)  # before its arrays are built
            records = decode_batch(batch, time.time_ns() // 1000)
            limit = session.principal.limits.max_record_bytes
            if limit is not None:
                whose = f"principal {cut(session.principal.name)!r}"
                check_record_bytes(records, limit, batch.first_seq, whose)
            receiver.accept(session, batch.first_seq, records)
            return
        assert isinstance(request, pb.PublishRequest)
        if kind == "complete":
            receiver.complete(session)
        elif kind == "error":
            log.warning(
                "publisher %r on stream %r failed: %s (code %d)",
                session.producer_id,
                receiver.stream,
                shown(request.error.message),  # quoted and escaped: a newline in it forged a log line
                request.error.code,
            )
            receiver.complete(session)
        elif kind == "open":
            raise ProtocolViolation("Open sent twice: exactly one Open per session (rule 2.12)")
        else:
            raise InvalidMessage("empty PublishRequest: set one of open, batch, complete, error")


def _end_call(context: grpc.aio.ServicerContext[Any, Any], error: ReceiverError) -> None:
    """End the call with `error`'s status, set rather than raised (context.abort): abort's exception
    would keep the handler's frame alive in a reference cycle through gRPC's call state, and with it the
    request iterator holding the last message read (up to the message size limit), until a full garbage
    collection: 100 sessions failing on a 4 MB batch held 400 MB."""
    context.set_code(status_code(error))
    context.set_details(str(error))
    if error.trailers:
        context.set_trailing_metadata(error.trailers)


async def _close(requests: AsyncIterator[object]) -> None:
    """Close gRPC's request iterator: it sits in a reference cycle of gRPC's own, holding the last
    message it gave, until a full garbage collection (a session that failed on a 4 MB batch kept it)."""
    aclose = getattr(requests, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):  # the call is over: nothing it raises matters now
            await aclose()


def _within_limit(message: pb.PublishRequest | bytes, principal: Principal) -> pb.PublishRequest | bytes:
    """`message`, unless it is over the principal's max_message_bytes (LimitExceeded: checked on the raw
    bytes, before parsing)."""
    limit = principal.limits.max_message_bytes
    if limit is not None:
        size = len(message) if isinstance(message, bytes) else message.ByteSize()
        if size > limit:
            raise LimitExceeded(
                f"a Publish message of {size} bytes: over max_message_bytes {limit} of principal "
                f"{cut(principal.name)!r}; send smaller batches"
            )
    return message


def _parse(message: pb.PublishRequest | bytes) -> pb.PublishRequest | WireBatch:
    return decode_request(message) if isinstance(message, bytes) else message


def _kind(request: pb.PublishRequest | WireBatch) -> str | None:
    """Which of open, batch, complete, error the message is (None: none is set)."""
    return "batch" if isinstance(request, WireBatch) else request.WhichOneof("kind")
