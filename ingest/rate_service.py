"""The RateControl RPCs: operators (and, later, the estimator) read and set each stream's ingest rate."""

from __future__ import annotations

from collections.abc import Mapping

import grpc

from ratecontrol import InvalidRateError, check_rate
from receivers.pb.ingest.v1 import ingest_pb2 as pb
from receivers.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from receivers.receiver import Receiver


class RateControlService(pb_grpc.RateControlServicer):
    def __init__(self, receivers: Mapping[str, Receiver]) -> None:
        self._receivers = receivers
        self._estimator = dict.fromkeys(receivers, "fixed")

    def _select(self, stream: str) -> list[Receiver]:
        if not stream:
            return list(self._receivers.values())
        receiver = self._receivers.get(stream)
        return [receiver] if receiver is not None else []

    def _state(self, receivers: list[Receiver]) -> pb.GetRateResponse:
        return pb.GetRateResponse(
            rates=[
                pb.StreamRate(stream=r.stream, records_per_second=r.rate, estimator=self._estimator[r.stream])
                for r in receivers
            ]
        )

    async def _unknown(self, stream: str, context: grpc.aio.ServicerContext[object, object]) -> None:
        known = ", ".join(sorted(self._receivers))
        await context.abort(grpc.StatusCode.NOT_FOUND, f"no stream named {stream!r} (streams: {known})")

    async def GetRate(
        self, request: pb.GetRateRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetRateResponse:
        receivers = self._select(request.stream)
        if not receivers:
            await self._unknown(request.stream, context)
        return self._state(receivers)

    async def UpdateRate(
        self, request: pb.UpdateRateRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> pb.GetRateResponse:
        receivers = self._select(request.stream)
        if not receivers:
            await self._unknown(request.stream, context)
        try:
            rate = check_rate(request.records_per_second)  # before any change: invalid changes nothing
        except InvalidRateError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        for receiver in receivers:
            receiver.set_rate(rate)
            self._estimator[receiver.stream] = "fixed"
        return self._state(receivers)
