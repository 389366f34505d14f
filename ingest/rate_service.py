"""The RateControl RPCs: operators read and steer the ingest rate through the same controller the
estimator uses. Invalid values get INVALID_ARGUMENT with the reason and change nothing."""

from __future__ import annotations

import asyncio
import errno
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import grpc

from ingest.config import DRIVER_ONLY_SETTINGS, RateConfig, ServeConfig
from ingest.rate_controller import RateController
from ingest.runtime_config import THE_SETTINGS, RuntimeConfig
from ratecontrol import InvalidRateError, RateBounds, check_estimator
from receivers.cluster import DRIVER_HEADER, DRIVER_RATE_HEADER, NOT_SAVED, REFUSAL_HEADER
from receivers.receiver import Receiver
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[object, object]

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A write refused for want of space (a full disk, a quota): RESOURCE_EXHAUSTED, not a server bug."""


async def refuse_unsaved(
    context: Context, change: str, what: str, exc: OSError, logger: logging.Logger
) -> None:
    """Abort a change whose state file (`what`: "the settings", "the stream states") could not be
    written: nothing changed. RESOURCE_EXHAUSTED for a full disk or quota (space freed, the same change
    goes through), INTERNAL for any other OSError (a read-only or broken data dir: the server's side
    to fix). One WARNING line naming the change and why, on `logger`: the logger of the module that
    makes the change (admin_service's for `config set` and `streams add|remove`, this one's for the
    rate's changes); the caller's status says the same."""
    full = exc.errno in DISK_FULL
    code = grpc.StatusCode.RESOURCE_EXHAUSTED if full else grpc.StatusCode.INTERNAL
    why = f"nothing changed: {what} could not be saved in the data dir: {exc}"
    if full:
        why += " (free space in the data dir, then make the change again)"
    logger.warning("%s from %s refused: %s", change, context.peer(), why)
    context.set_trailing_metadata(((REFUSAL_HEADER, NOT_SAVED),))  # the CLI: no dropped connection
    await context.abort(code, why)


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


def apply_rate_settings(
    controller: RateController, runtime: RuntimeConfig, old: RateConfig, new: RateConfig
) -> None:
    """Put the rate settings changed at run time (`runtime.change`: min-rate, max-rate, estimator,
    estimator-params; kept already) in force on `controller`: new bounds clamp the rate, a new estimator
    starts from it and unpins it, and so ends the pin kept in `runtime` (a single server's and a
    cluster's driver's alike)."""
    if (new.min_rate, new.max_rate) != (old.min_rate, old.max_rate):
        controller.set_bounds(new.min_rate, new.max_rate)
    if (new.estimator, new.estimator_params) != (old.estimator, old.estimator_params):
        controller.set_estimator(new.estimator, new.estimator_params)  # unpins
        if runtime.pinned_rate is not None:
            try:
                runtime.pin(None)
            except OSError:
                log.exception(
                    "the new estimator unpinned the rate, but %s still pins it: the next start pins "
                    "it again unless `sluice rate set` (without --pin) is kept first",
                    runtime.path,
                )


def estimator_change(
    base: RateConfig, values: Mapping[str, str], reset: Sequence[str]
) -> tuple[Mapping[str, str], Sequence[str]]:
    """The settings change (`values`, `reset`) the rate API's SetEstimator asks, made right for the
    start's estimator parameters (`base`: the command line's, the environment's or the config file's
    rate): to another estimator than the start's, its reset of estimator-params would leave the start's
    in force, which are not the new estimator's (spark-pid's gains refused by model: the switch was
    refused); it runs with its own defaults instead (kept as estimator-params = ""). Back to the
    start's estimator (a reset), they are in force again. A single server's and a cluster driver's."""
    other = values.get("estimator", base.estimator) != base.estimator
    if "estimator-params" in reset and other and base.estimator_params:
        reset = [key for key in reset if key != "estimator-params"]
        values = {**values, "estimator-params": ""}
    return values, reset


def pin_again(controller: RateController, runtime: RuntimeConfig) -> None:
    """Pin the rate an operator pinned before the restart (`sluice rate set RATE --pin`, kept in
    runtime-config.json: RuntimeConfig.pinned_rate) again, and say so: it was lost without a word. A
    single server's start and a cluster driver's."""
    pinned = runtime.pinned_rate
    if pinned is None:
        return
    controller.update(pinned, pin=True)
    log.info(
        "rate pinned at %g records/s (`sluice rate set --pin` before the restart, kept in %s): the "
        "estimator is ignored until `sluice rate set` without --pin or `sluice rate estimator`",
        controller.rate,
        runtime.path,
    )


SEAL_TIMEOUT = 1.0
"""Longest wait, in seconds, for the receivers to seal what they hold when GetRate asks so."""


_TARGET = re.compile(r"^(\[[0-9A-Fa-f:.]{2,45}\]|[A-Za-z0-9.-]{1,253})?:\d{1,5}$", re.ASCII)
_PEER_HOST = re.compile(r"^ipv4:([0-9.]+):\d+$|^ipv6:(\[[0-9A-Fa-f:.]+\]):\d+$", re.ASCII)


def driver_rate_target(advertised: str, peer: str) -> str | None:
    """Where a driver that called (`peer`, gRPC's "ipv4:10.0.0.5:43122") serves its RateControl, from
    what it says (DRIVER_RATE_HEADER: HOST:PORT, or ":PORT" when it listens on every address: then the
    caller's host); None when that is not a target."""
    if not _TARGET.match(advertised):
        return None
    if not advertised.startswith(":"):
        return advertised
    host = _PEER_HOST.match(peer)
    return f"{host.group(1) or host.group(2)}{advertised}" if host is not None else None


def _word(name: str, placeholder: str = "NAME") -> str:
    """An estimator's name as a command may show it (`placeholder` when it is not one: a caller's bytes)."""
    return name if re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name, re.ASCII) else placeholder


def _on_the_driver(target: str | None) -> tuple[str, str]:
    """(where, its --target) of the driver's RateControl as a refusal names it: "at HOST:PORT", or,
    until a driver has called, that none has and the placeholder DRIVER_HOST:PORT."""
    if target is not None:
        return f"at {target}", target
    return "(no driver has called this node since it started)", "DRIVER_HOST:PORT"


def driver_settings_refusal(values: Mapping[str, str], target: str | None) -> str | None:
    """Why a receiver node refuses `sluice config set` of `values` (key -> value as given), naming the
    driver's RateControl (`target`: RateControlService.driver_target; None: no driver has called yet)
    and the commands to give it; None when no key of `values` is one of DRIVER_ONLY_SETTINGS."""
    keys = [key for key in DRIVER_ONLY_SETTINGS if key in values]
    if not keys:
        return None
    where, there = _on_the_driver(target)
    commands = []
    if "min-rate" in values or "max-rate" in values:
        low = _word(values.get("min-rate", "").strip(), "MIN")
        high = _word(values.get("max-rate", "").strip(), "MAX")
        commands.append(f"sluice rate bounds {low} {high} --target {there}")
    if "estimator" in values:
        commands.append(f"sluice rate estimator {_word(values['estimator'].strip())} --target {there}")
    elif "estimator-params" in values:
        commands.append(
            "--estimator NAME --estimator-params ... at the driver's start (sluice serve --role driver)"
        )
    if "trigger-interval" in values:
        commands.append("--trigger-interval at the driver's start (sluice serve --role driver)")
    return (
        f"a cluster's receiver node takes {', '.join(keys)} from the driver, which runs the rate control "
        "and the query and sets each node's share of the cluster's rate: nothing changed (the node's "
        f"other settings change here); change {'them' if len(keys) > 1 else 'it'} on the driver {where}: "
        + "; ".join(commands)
    )


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
        driver_sets_rate: bool = False,
        mismatches: Callable[[], Mapping[int, str]] | None = None,
    ) -> None:
        """`pin`: keep the pinned rate (None: none) across restarts (RuntimeConfig.pin; OSError: not
        kept, nothing changed); None where a pin is not kept (a cluster's receiver nodes, whose share
        the driver pins). `driver_sets_rate` (a cluster's receiver node): the rate, its bounds and
        estimator change only by the driver's calls (they name it: DRIVER_HEADER); an operator's are
        refused FAILED_PRECONDITION naming the driver's RateControl (the driver pinned this node's
        share back over them within a quarter of a second). `mismatches` (a cluster's receiver node):
        its peers configured otherwise (ConfigMismatches.peers), shown in the status."""
        self._controller = controller
        self._driver_sets_rate = driver_sets_rate
        self.driver_target: str | None = None
        """Where the driver that last called serves its RateControl (DRIVER_RATE_HEADER); None: unknown."""
        self._pin = pin
        # on a node with run-time settings: bounds and estimator are settings (min-rate, max-rate,
        # estimator), changed through them; else (a cluster's driver) on the controller alone
        self._settings = settings
        self._receivers = receivers or {}
        self._nodes = nodes  # on a cluster's driver: the rate's split among receiver nodes (NodeRates)
        self._pipeline = pipeline
        """The streams the query reads now and whether batches are held back (a swap stops the query)."""
        self._mismatches = mismatches

    def _status(self) -> pb.RateStatus:
        status = rate_status(self._controller, self._nodes() if self._nodes is not None else ())
        if self._pipeline is not None:
            streams, hold = self._pipeline()
            status.pipeline_streams.extend(streams)
            status.hold_batches = hold
        # full intake from the first record, but no batch larger than the receivers' memory bound
        # until the estimator has measured one (an operator's "fixed" inf is unbounded on purpose)
        status.unmeasured_batch_records = self._controller.unmeasured_batch_records()
        if self._mismatches is not None:
            status.config_mismatches.extend(words for _, words in sorted(self._mismatches().items()))
        return status

    def _note_driver(self, context: Context) -> bool:
        """Whether the call names a driver (DRIVER_HEADER); if so, note where it serves RateControl."""
        metadata = dict(context.invocation_metadata() or ())
        driver = metadata.get(DRIVER_HEADER)
        if not (isinstance(driver, str) and driver):
            return False
        advertised = metadata.get(DRIVER_RATE_HEADER)
        if isinstance(advertised, str):
            target = driver_rate_target(advertised, context.peer() or "")
            self.driver_target = target or self.driver_target
        return True

    async def _from_the_driver(self, context: Context, command: str) -> str:
        """Who changes the rate, for the log: the driver, or the caller (`context.peer()`). On a node
        whose rate the driver sets, a call that does not name a driver is aborted FAILED_PRECONDITION,
        saying to send `command` (`sluice rate set RATE`) to the driver."""
        if not self._driver_sets_rate:
            return context.peer()
        if self._note_driver(context):
            return f"the driver ({context.peer()})"
        where, there = _on_the_driver(self.driver_target)
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "a cluster's receiver node takes its rate from the driver, which sets each node's share of the "
            "cluster's rate and would set it back at once: nothing changed; change the cluster's rate on "
            f"the driver {where}: {command} --target {there}",
        )
        raise AssertionError  # abort raises

    async def GetRate(self, request: pb.GetRateRequest, context: Context) -> pb.RateStatus:
        if self._driver_sets_rate:  # the driver asks every quarter of a second: where it is, for refusals
            self._note_driver(context)
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
        pin = " --pin" if request.pin else ""
        caller = await self._from_the_driver(context, f"sluice rate set {request.records_per_second:g}{pin}")
        was = self._controller.rate
        try:
            rate = self._controller.clamped(request.records_per_second)
            if self._pin is not None and (request.pin or self._controller.pinned):
                self._pin(rate if request.pin else None)  # kept first, as the settings are
            self._controller.update(request.records_per_second, pin=request.pin)
        except InvalidRateError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            change = f"sluice rate set {request.records_per_second:g}{pin}"
            await refuse_unsaved(context, change, THE_SETTINGS, exc, log)
        log.info(
            "rate %g -> %g records/s%s, set by %s",
            was,
            self._controller.rate,
            " (pinned)" if request.pin else "",
            caller,
        )
        return self._status()

    async def SetBounds(self, request: pb.SetBoundsRequest, context: Context) -> pb.RateStatus:
        bounds = f"{request.min_rate:g} {request.max_rate:g}"
        caller = await self._from_the_driver(context, f"sluice rate bounds {bounds}")
        try:
            RateBounds(request.min_rate, request.max_rate)  # checked in the rate API's own words first
            if self._settings is not None:
                self._settings({"min-rate": repr(request.min_rate), "max-rate": repr(request.max_rate)}, ())
            else:
                self._controller.set_bounds(request.min_rate, request.max_rate)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            await refuse_unsaved(context, f"sluice rate bounds {bounds}", THE_SETTINGS, exc, log)
        log.info(
            "rate bounds %g .. %g records/s (rate %g), set by %s",
            request.min_rate,
            request.max_rate,
            self._controller.rate,
            caller,
        )
        return self._status()

    async def SetEstimator(self, request: pb.SetEstimatorRequest, context: Context) -> pb.RateStatus:
        caller = await self._from_the_driver(context, f"sluice rate estimator {_word(request.estimator)}")
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
            await refuse_unsaved(context, f"sluice rate estimator {_word(name)}", THE_SETTINGS, exc, log)
        log.info("rate estimator %s, set by %s", request.estimator, caller)
        return self._status()

    async def StartBatch(self, request: pb.StartBatchRequest, context: Context) -> pb.StartBatchResponse:
        try:
            self._controller.batch_started(request.records, request.backlog)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.StartBatchResponse()
