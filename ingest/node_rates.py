"""The driver's split of the global rate among receiver nodes, kept current over gRPC.

Every `interval` each receiver node is asked its rate (RateControl.GetRate: its streams' records taken
per second and whether their publishers are busy); the pure split (ratecontrol.nodes.split_nodes) then
gives each node a share of the driver's rate, by demand and braked by the node's backlog unread by
Spark, and a node whose share moved by more than CHANGE is told it (UpdateRate, pinned: the node's own
estimator must not move it). A node that fails DOWN_AFTER calls in a row, or answers nothing for
DOWN_SECONDS, is down: its share goes to the others until it answers again. A target that answers as
a driver (its RateStatus lists nodes) gets no share and is never told one: an ERROR says so.

One task per node, so a node that hangs until the call timeout delays nobody else's update.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Protocol

import grpc

from ratecontrol import capped
from ratecontrol.nodes import NodeLoad, NodeShare, split_nodes
from receivers.cluster import DRIVER_HEADER, DRIVER_RATE_HEADER
from sluice_client.credentials import Credentials
from sluice_client.keepalive import node_channel_options
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.tasks import reap

log = logging.getLogger(__name__)

INTERVAL = 0.25
"""Seconds between asks of one node."""
CALL_TIMEOUT = 1.0
"""Seconds a node has to answer one call."""
DOWN_AFTER = 3
"""Failed calls in a row after which a node is down."""
DOWN_SECONDS = 1.0
"""Seconds without an answer after which a node that fails a call is down."""
CHANGE = 0.02
"""A node is sent its share when it moved by more than this part of what the node has."""

_CHANNEL_OPTIONS = (
    # a restarted node is seen within a second, not after gRPC's default reconnect backoff (up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # a connection gone without a FIN (a node's host down, a flow a NAT dropped) is closed within the
    # peers' keepalive and its timeout and the channel connects anew: before, every call on it timed out
    # and the node stayed down for as long as the kernel kept the dead connection
    *node_channel_options(),
)


class RateSource(Protocol):
    """What holds the global rate: ingest.rate_controller.RateController on the driver."""

    @property
    def rate(self) -> float: ...


@dataclasses.dataclass
class _Node:
    node_id: int
    target: str
    channel: grpc.aio.Channel
    stub: pb_grpc.RateControlAsyncStub
    up: bool = False  # not before its first answer
    failures: int = 0  # calls failed in a row
    last_answer: float | None = None  # time.monotonic()
    warned: bool = False  # WARNING logged for this outage
    taken: float = 0.0
    busy: bool = False
    backlog: int = 0
    share: NodeShare = dataclasses.field(default_factory=lambda: NodeShare(0.0, "no answer yet"))
    sent: float | None = None  # the share last sent to it
    settled: float | None = None  # its rate after that UpdateRate (clamped into its own bounds)


class NodeRates:
    """Divides the driver's rate among receiver nodes `nodes` (node id -> host:port) and keeps each node's
    rate at its share. `rate`: the global rate (a RateController, or a callable); `backlog`: records per
    node not yet read by Spark (default: none known); `trigger_interval`: seconds between Spark's batches.
    `await run()` (until cancelled), or `start()` ... `await close()`, or `async with`."""

    def __init__(
        self,
        nodes: Mapping[int, str],
        rate: RateSource | Callable[[], float],
        *,
        credentials: Credentials | None = None,
        backlog: Callable[[], Mapping[int, int]] | None = None,
        interval: float = INTERVAL,
        timeout: float = CALL_TIMEOUT,
        down_after: int = DOWN_AFTER,
        down_seconds: float = DOWN_SECONDS,
        trigger_interval: float = 1.0,
    ) -> None:
        if not nodes:
            raise ValueError("no receiver nodes to divide the rate among")
        if not (min(interval, timeout, down_seconds, trigger_interval) > 0 and down_after >= 1):
            raise ValueError("interval, timeout, down_seconds, trigger_interval must be > 0; down_after >= 1")
        self._credentials = credentials or Credentials()
        self._rate: Callable[[], float] = rate if callable(rate) else lambda: rate.rate
        self._backlog = backlog or dict
        self._interval = interval
        self._timeout = timeout
        self._down_after = down_after
        self._down_seconds = down_seconds
        self._trigger_interval = trigger_interval
        self._nodes = {
            node_id: _Node(node_id, target, channel, pb_grpc.RateControlStub(channel))
            for node_id, target in sorted(nodes.items())
            for channel in [self._credentials.channel(target, _CHANNEL_OPTIONS)]
        }
        self._named: tuple[tuple[str, str], ...] = ()
        """Metadata naming the driver on its calls (name_driver): a node takes its rate from those only."""
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._split_at = -math.inf  # time.monotonic() of the last split

    def name_driver(self, driver_id: str, rate_target: str) -> None:
        """Name the driver on the calls to the nodes: its id (DRIVER_HEADER) and where it serves its
        RateControl (DRIVER_RATE_HEADER: HOST:PORT, or ":PORT" on every address). A receiver node takes
        its rate from such calls only: an operator's `sluice rate set` there is refused, pointing here."""
        self._named = ((DRIVER_HEADER, driver_id), (DRIVER_RATE_HEADER, rate_target))

    # ---- lifecycle ----

    async def run(self) -> None:
        """Poll every node until cancelled; an unexpected error in one poller ends all and is raised."""
        async with asyncio.TaskGroup() as group:
            for node in self._nodes.values():
                group.create_task(self._poll(node), name=f"sluice-node-rate-{node.node_id}")

    def start(self) -> None:
        """Run in the background; a poller that dies is logged as an ERROR (close() re-raises it)."""
        if self._closed or self._task is not None:
            raise RuntimeError("NodeRates runs once: it is running or closed")
        self._task = asyncio.create_task(self.run(), name="sluice-node-rates")
        self._task.add_done_callback(_log_death)

    async def close(self) -> None:
        """Stop polling and close the channels (idempotent); re-raise what ended the loop, if it died."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        try:
            if task is not None:
                await reap(task)
        finally:
            for node in self._nodes.values():
                await node.channel.close(None)

    async def __aenter__(self) -> NodeRates:
        self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.close()

    # ---- what it knows ----

    def snapshot(self) -> list[pb.NodeRate]:
        """Each node, by id: its share, whether it is up, its load, and why it has that share."""
        return [
            pb.NodeRate(
                node_id=node.node_id,
                target=node.target,
                records_per_second=node.share.rate,
                up=node.up,
                taken_per_second=node.taken,
                busy=node.busy,
                backlog=node.backlog,
                reason=node.share.reason,
            )
            for node in self._nodes.values()
        ]

    def split(self) -> None:
        """Divide the rate again by what the nodes reported last: after answers (at most every quarter
        interval: with hundreds of nodes a split after each would cost a core) and when a node goes up
        or down."""
        self._split_at = time.monotonic()
        try:
            backlog = self._backlog()
        except Exception:  # the backlog's source is the driver's wiring: rate control goes on without it
            log.exception("node backlog unknown; splitting the rate without it")
            backlog = {}
        for node in self._nodes.values():
            node.backlog = max(0, int(backlog.get(node.node_id, 0)))
        loads = {n.node_id: NodeLoad(n.up, n.taken, n.busy, n.backlog) for n in self._nodes.values()}
        rate = self._rate()
        try:
            shares = split_nodes(rate, loads, interval=self._trigger_interval)
        except ValueError:  # not a rate: the nodes keep their shares until the rate is one again
            log.exception("cannot split rate %r among receiver nodes", rate)
            return
        for node in self._nodes.values():
            node.share = shares[node.node_id]

    # ---- one node ----

    async def _poll(self, node: _Node) -> None:
        while True:
            started = time.monotonic()
            await self._visit(node)
            await asyncio.sleep(max(0.0, self._interval - (time.monotonic() - started)))

    async def _visit(self, node: _Node) -> None:
        metadata = (*self._credentials.metadata, *self._named)
        try:
            status = await node.stub.GetRate(pb.GetRateRequest(), timeout=self._timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            self._failed(node, exc)
            return
        if status.nodes:
            # a driver answers with its own split: listed as a receiver (a --nodes file naming the
            # driver itself), it was pinned to a share of its own rate, which throttled every node
            self._not_a_receiver(node)
            return
        if self._answered(node, status) or time.monotonic() - self._split_at >= self._interval / 4:
            self.split()
        share = capped(node.share.rate)  # a share of the most a rate may be can cross it by a rounding
        if share <= 0 or not self._moved(node, status, share):
            return
        request = pb.UpdateRateRequest(records_per_second=share, pin=True)
        try:
            settled = await node.stub.UpdateRate(request, timeout=self._timeout, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            self._failed(node, exc)
            return
        # the node clamps into its own bounds: compare later answers with where it settled, not the share
        node.sent, node.settled = share, settled.records_per_second
        log.debug("node %d (%s): rate %s records/s (%s)", node.node_id, node.target, share, node.share.reason)

    def _moved(self, node: _Node, status: pb.RateStatus, share: float) -> bool:
        """Whether the node should be told `share`: it never was, it is not pinned to what it was told
        (restarted, or an operator set it), or the share moved by more than CHANGE."""
        sent = node.sent
        if sent is None or not status.pinned or status.records_per_second != node.settled:
            return True
        if math.isinf(share) or math.isinf(sent):
            return share != sent
        return abs(share - sent) > CHANGE * sent

    def _answered(self, node: _Node, status: pb.RateStatus) -> bool:
        """Take a node's answer in; whether it was down (or never up) until now."""
        node.failures = 0
        node.last_answer = time.monotonic()
        node.warned = False
        # a node's figures are trusted only as far as they are numbers (a bad one must not stop the split)
        taken = sum(s.taken_per_second for s in status.streams)
        node.taken = taken if math.isfinite(taken) and taken > 0 else 0.0
        node.busy = any(s.busy for s in status.streams)
        if node.up:
            return False
        node.up = True
        log.info("receiver node %d at %s answers: up", node.node_id, node.target)
        return True

    def _not_a_receiver(self, node: _Node) -> None:
        was_up, node.up = node.up, False
        node.failures = max(node.failures, self._down_after)
        node.share = NodeShare(0.0, "a cluster driver, not a receiver node")
        if was_up:
            self.split()
        if not node.warned:
            node.warned = True
            log.error(
                "node %d at %s is a cluster's driver, not a receiver node (check the --nodes list): it "
                "gets no share of the rate",
                node.node_id,
                node.target,
            )

    def _failed(self, node: _Node, exc: grpc.aio.AioRpcError) -> None:
        node.failures += 1
        silent = node.last_answer is None or time.monotonic() - node.last_answer >= self._down_seconds
        if node.failures < self._down_after and not (node.up and silent):
            return
        if not node.warned:
            node.warned = True
            was = "is down" if node.up else "does not answer"
            log.warning(
                "receiver node %d at %s %s (%d calls failed, last: %s: %s); its share goes to the others",
                node.node_id,
                node.target,
                was,
                node.failures,
                exc.code().name,
                exc.details(),
            )
        if node.up:
            node.up = False
            node.sent = None  # it may come back with another rate: tell it its share again
            self.split()


def _log_death(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("node rate control died; receiver nodes keep their last rates", exc_info=task.exception())
