"""A session's outbox stays a handful of messages however slowly the client reads."""

from __future__ import annotations

from receivers.errors import ProtocolViolation
from receivers.session import Outbox
from sluice_client.flow import MAX_DEMAND
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb


async def test_credit_and_acks_coalesce_and_cancel_goes_out_once() -> None:
    box = Outbox()
    for _ in range(10_000):
        box.grant(3)
    for i in range(10_000):
        box.ack(i)
    messages, ended, _ = await box.take()
    assert [m.WhichOneof("kind") for m in messages] == ["request", "ack"]
    assert messages[0].request.n == 30_000 and messages[1].ack.durable_up_to == 9_999
    box.cancel(pb.Cancel(code=14, reason="bye", accepted_up_to=9_999))
    box.cancel(pb.Cancel(code=1, reason="again"))
    box.grant(5)  # no credit after a cancel
    box.ack(10_000)
    messages, ended, _ = await box.take()
    assert [m.WhichOneof("kind") for m in messages] == ["ack", "cancel"]
    assert messages[1].cancel.reason == "bye" and not ended
    box.ack(10_001)
    box.finish(ProtocolViolation("x"))
    box.finish(None)  # the first finish wins
    messages, ended, error = await box.take()
    assert [m.WhichOneof("kind") for m in messages] == ["ack"]
    assert ended and isinstance(error, ProtocolViolation)


async def test_credit_saturates() -> None:
    box = Outbox()
    box.grant(MAX_DEMAND)
    box.grant(MAX_DEMAND)
    messages, _, _ = await box.take()
    assert messages[0].request.n == MAX_DEMAND
