"""The RateControl RPCs: operators read and steer the ingest rate through the same controller the
estimator uses. Invalid values get INVALID_ARGUMENT with the reason and change nothing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import grpc

from ingest.config import ServeConfig
from ingest.rate_controller import RateController
from ingest.runtime_config import NOT_SAVED
from ratecontrol import InvalidRateError, RateBounds, check_estimator
from receivers.receiver import Receiver
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[object, object]


def rate_status(controller: RateController, nodes: Sequence[pb.NodeRate] = ()) -> pb.RateStatus:
    paused = controller.credit_paused()
    shares = controller.stream_shares()
    status = pb.RateStatus(
        records_per_second=controller.rate,
        min_rate=controller.bounds.min_rate,
        max_rate=controller.bounds.max_rate,
        estimator=controller.estimator.name,
        pinned=controller.pinned,
        estimator_state={k: str(v) for k, v in controller.estimator.state().items()},
        streams=[
            pb.StreamRate(
                stream=stream,
                records_per_second=share.rate,
                credit_paused=paused.get(stream, []),
                weight=policy.weight,
                min_rate=policy.min_rate,
                max_rate=policy.max_rate,
                share_reason=share.reason,
                busy=demand.busy,
                taken_per_second=demand.taken,
            )
            for stream, (share, demand, policy) in shares.items()
        ],
        capacity=controller.estimator.capacity or 0.0,
        nodes=nodes,
    )
    drain = controller.drain_batch_records()
    if drain:
        status.drain_batch_records = drain
    batch = controller.last_batch
    if batch is not None:
        status.last_batch.CopyFrom(
            pb.BatchMetrics(
                batch_id=batch.batch_id,
                records=batch.records,
                processing_delay_seconds=batch.processing_delay,
                scheduling_delay_seconds=batch.scheduling_delay,
                batch_interval_seconds=batch.batch_interval,
                backlog=batch.backlog,
                waiting=batch.waiting,
            )
        )
    return status


class ChangeSettings(Protocol):
    """Change run-time settings (SluiceServer.change_settings): (old, new) configs; SettingError or
    OSError and nothing changed."""

    def __call__(
        self, values: Mapping[str, str], reset: Sequence[str], /
    ) -> tuple[ServeConfig, ServeConfig]: ...


SEAL_TIMEOUT = 1.0
"""Longest wait, in seconds, for the receivers to seal what they hold when GetRate asks so."""


class RateControlService(pb_grpc.RateControlServicer):
    def __init__(
        self,
        controller: RateController,
        receivers: Mapping[str, Receiver] | None = None,
        *,
        nodes: Callable[[], Sequence[pb.NodeRate]] | None = None,
        pipeline: Callable[[], tuple[Sequence[str], bool]] | None = None,
        settings: ChangeSettings | None = None,
        pin: Callable[[float | None], None] | None = None,
    ) -> None:
        """`pin`: keep the pinned rate (None: none) across restarts (RuntimeConfig.pin; OSError: not
        kept, nothing changed); None where a pin is not kept (a cluster's receiver nodes, whose share
        the driver pins)."""
        self._controller = controller
        self._pin = pin
        # on a node with run-time settings: bounds and estimator are settings (min-rate, max-rate,
        # estimator), changed through them; else (a cluster's driver) on the controller alone
        self._settings = settings
        self._receivers = receivers or {}
        self._nodes = nodes  # on a cluster's driver: the rate's split among receiver nodes (NodeRates)
        self._pipeline = pipeline
        """The streams the query reads now and whether batches are held back (a swap stops the query)."""

    def _status(self) -> pb.RateStatus:
        status = rate_status(self._controller, self._nodes() if self._nodes is not None else ())
        if self._pipeline is not None:
            streams, hold = self._pipeline()
            status.pipeline_streams.extend(streams)
            status.hold_batches = hold
        # full intake from the first record, but no batch larger than the receivers' memory bound
        # until the estimator has measured one (an operator's "fixed" inf is unbounded on purpose)
        status.unmeasured_batch_records = self._controller.unmeasured_batch_records()
        return status

    async def GetRate(self, request: pb.GetRateRequest, context: Context) -> pb.RateStatus:
        if request.wait_for_batch_seconds:
            try:
                await self._controller.wait_for_batch(request.wait_for_batch_seconds)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"wait_for_batch_seconds: {exc}")
        if request.seal_blocks and self._receivers:
            # after the wait: as close to the source's look at the store as this call gets
            # tasks, not a gather under wait_for: a caller's deadline cancels this handler, and a
            # cancelled gather logged "_GatheringFuture exception was never retrieved" every time
            sealing = [asyncio.ensure_future(r.seal_now()) for r in self._receivers.values()]
            try:
                _, late = await asyncio.wait(sealing, timeout=SEAL_TIMEOUT)
            finally:
                for task in sealing:
                    task.cancel()  # a no-op once done
            for task in sealing:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    log.error("sealing for GetRate failed", exc_info=task.exception())
            if late:
                log.warning(
                    "receivers did not seal within %.1f s; the next batch takes what is sealed", SEAL_TIMEOUT
                )
        return self._status()

    async def UpdateRate(self, request: pb.UpdateRateRequest, context: Context) -> pb.RateStatus:
        was = self._controller.rate
        try:
            rate = self._controller.clamped(request.records_per_second)
            if self._pin is not None and (request.pin or self._controller.pinned):
                self._pin(rate if request.pin else None)  # kept first, as the settings are
            self._controller.update(request.records_per_second, pin=request.pin)
        except InvalidRateError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"{NOT_SAVED}: {exc}")
        log.info(
            "rate %g -> %g records/s%s, set by %s",
            was,
            self._controller.rate,
            " (pinned)" if request.pin else "",
            context.peer(),
        )
        return self._status()

    async def SetBounds(self, request: pb.SetBoundsRequest, context: Context) -> pb.RateStatus:
        try:
            RateBounds(request.min_rate, request.max_rate)  # checked in the rate API's own words first
            if self._settings is not None:
                self._settings({"min-rate": repr(request.min_rate), "max-rate": repr(request.max_rate)}, ())
            else:
                self._controller.set_bounds(request.min_rate, request.max_rate)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"{NOT_SAVED}: {exc}")
        log.info(
            "rate bounds %g .. %g records/s (rate %g), set by %s",
            request.min_rate,
            request.max_rate,
            self._controller.rate,
            context.peer(),
        )
        return self._status()

    async def SetEstimator(self, request: pb.SetEstimatorRequest, context: Context) -> pb.RateStatus:
        name = request.estimator
        try:
            if self._settings is None:
                check_estimator(name)  # refused before the kept pin is dropped
                if self._pin is not None:
                    self._pin(None)  # a new estimator unpins the rate: kept first, as a pin is
                self._controller.set_estimator(name)
            else:
                check_estimator(name)  # in the rate API's words, before the settings' own check
                # parameters set for another estimator are not this one's: they go with it
                reset = ["estimator-params"] if name != self._controller.estimator.name else []
                old, new = self._settings({"estimator": name}, reset)
                unchanged = new.rate.estimator_params == old.rate.estimator_params
                if new.rate.estimator == old.rate.estimator and unchanged:
                    # the same estimator set again starts afresh from the rate and unpins it, as ever
                    if self._pin is not None:
                        self._pin(None)
                    self._controller.set_estimator(name, new.rate.estimator_params)
        except ValueError as exc:  # an unknown estimator, a setting refused
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, f"{NOT_SAVED}: {exc}")
        log.info("rate estimator %s, set by %s", request.estimator, context.peer())
        return self._status()

    async def StartBatch(self, request: pb.StartBatchRequest, context: Context) -> pb.StartBatchResponse:
        try:
            self._controller.batch_started(request.records, request.backlog)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.StartBatchResponse()
