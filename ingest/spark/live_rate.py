"""The live ingest rate as a cap on each micro-batch, asked of the Sluice server before every batch.

The source reader runs in a Python worker process of its own, not in the server's process, so it asks
over gRPC (RateControl.GetRate), synchronously: latestOffset is a plain call. If the server does not
answer, the last cap it gave holds (none before the first answer), so a hiccup neither stalls Spark nor
lets a backlog through uncapped.

On a secured server the calls carry credentials (sluice_client.credentials): `sluice serve` hands its
own source a per-run token (principal "sluice-pipeline": operator and reader) and a plaintext port on
127.0.0.1 when gRPC is TLS; a separate Spark job gives the source's rateCaFile, rateCertFile,
rateKeyFile and rateTokenFile options. A refusal (UNAUTHENTICATED, PERMISSION_DENIED) warns once, like
any outage: the batches go on under the last cap.

A server that is not listening (UNAVAILABLE) is expected: `sluice serve` stops its gRPC server before it
lets Spark drain what was sealed, so a clean stop is logged at INFO, once; other failures warn, once
per outage, in one line.
"""

from __future__ import annotations

import logging
import math

import grpc

from sluice_client.credentials import Credentials
from sluice_client.keepalive import node_channel_options
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

BATCH_WAIT = 0.5
"""Longest wait, in seconds, for the last batch's metrics to reach the server before a cap is read.
The listener's event takes 3-90 ms here (more under load); a server that gets none stops waiting."""


class LiveRateCap:
    def __init__(self, target: str, *, timeout: float = 2.0, credentials: Credentials | None = None) -> None:
        self._target = target
        self._failing = False  # the last call had no answer: report the outage once, not every batch
        credentials = credentials or Credentials()
        self._metadata = credentials.metadata
        # keepalive: a server gone without a FIN (or a flow a NAT dropped) is noticed and the channel
        # connects anew, rather than every batch's call timing out on the dead connection
        self._channel = credentials.sync_channel(target, node_channel_options())
        self._stub = pb_grpc.RateControlStub(self._channel)
        self._timeout = timeout
        self._last: int | None = None
        self._start_batch_unsupported = False
        self.answered = False
        """Whether the last records_per_batch had the server's answer (not the last cap kept)."""
        self.weights: dict[str, float] = {}
        """Stream -> its weight in the server's split of the rate, as of the last answer: a batch's
        cap is shared out the same way."""
        self.streams: list[str] | None = None
        """The streams the server wants read now (RateStatus.pipeline_streams, as of the last answer);
        None when it names none (an older server, or a cluster's driver): the query's option holds."""
        self.hold = False
        """The server is stopping the query at a batch boundary: plan no new batch (as of the last
        answer; a server that does not answer holds nothing back)."""

    def records_per_batch(self, trigger_seconds: float) -> int | None:
        """max(rate, estimated capacity) x trigger interval, at least 1 (or the server's drain allowance,
        RateStatus.drain_batch_records, when larger); None while unlimited or unknown.

        Not the rate alone: a batch that takes only what arrives per interval never drains a backlog.
        The server first waits (up to BATCH_WAIT) for the metrics of the batch that just ended, if it
        has not had them yet: Spark plans a batch that follows an overrun at once. Then its receivers
        seal what they hold, so the batch takes every record taken by now.
        """
        try:
            request = pb.GetRateRequest(wait_for_batch_seconds=BATCH_WAIT, seal_blocks=True)
            status = self._stub.GetRate(request, timeout=self._timeout + BATCH_WAIT, metadata=self._metadata)
            rate = max(status.records_per_second, status.capacity)
            self.weights = {s.stream: s.weight for s in status.streams if s.weight > 0}
            self.streams = list(status.pipeline_streams) or None
            self.hold = status.hold_batches
        except grpc.RpcError as exc:
            self._no_answer(exc)
            self.answered = False
            self.hold = False  # a server that is gone swaps nothing: `sluice serve` drains Spark then
            return self._last
        if self._failing:
            log.info("the server at %s answers again: the live rate caps batches", self._target)
            self._failing = False
        self.answered = True
        if math.isinf(rate):
            # unlimited: no cap, unless the server bounds the batches it has not measured yet
            self._last = status.unmeasured_batch_records or None
        else:
            # more while the estimator drains a pile-up behind an overrun, in one batch
            self._last = max(1, int(rate * max(trigger_seconds, 0.001)), status.drain_batch_records)
        return self._last

    def _no_answer(self, exc: grpc.RpcError) -> None:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        # a grpc error's str() is a multi-line dump that reads like a stack trace: code and details only
        detail = f"{code.name}: {exc.details()}" if isinstance(exc, grpc.Call) and code else repr(exc)
        if self._failing:
            level = logging.DEBUG
        elif code is grpc.StatusCode.UNAVAILABLE:
            level = logging.INFO  # stopped to let Spark drain, or restarting: no operator action needed
        else:
            level = logging.WARNING
        log.log(
            level,
            "no live rate from the server at %s (%s); keeping the last cap %s until it answers",
            self._target,
            detail,
            self._last,
        )
        self._failing = True

    def start_batch(self, records: int, backlog: int) -> None:
        """Tell the server a batch of `records` runs now, `backlog` records behind it (its watchdog
        acts while the batch overruns).

        Best effort: a server that cannot be reached or predates the call costs the watchdog only.
        """
        if self._start_batch_unsupported:
            return
        try:
            request = pb.StartBatchRequest(records=records, backlog=backlog)
            self._stub.StartBatch(request, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._start_batch_unsupported = True
            log.debug("cannot report a started batch (%s)", exc)

    def close(self) -> None:
        self._channel.close()
