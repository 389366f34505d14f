"""Splitting the global ingest rate among a cluster's receiver nodes: by demand, braked by backlog.

The driver's estimator sets one rate R for the pipeline; each receiver node then splits its share among
its streams (ratecontrol.share). Splitting R equally wastes what light nodes cannot use while a hot
node's publishers wait; splitting it by lag, as Spark's Kafka source divides maxOffsetsPerTrigger over
partitions, hands intake to the node whose records already wait longest. Here (`split_nodes`):

- Demand, as share.py splits among streams: a busy node (its publishers run out of credit the rate
  withholds) may use any rate, a light one what it took x `headroom`, an idle one keeps a floor
  (`idle_floor` x R / up nodes) so its publishers get credit at once; water-filled to sum to R.
- Backlog brake: Spark reads a node about once per `interval`, so one interval's intake unread is
  normal. A node holding more than that gets its intake cut by the excess / `drain_seconds` (what waits
  there is read first; new records would only wait behind it), never below `brake_floor` of its demand
  share nor the idle floor. The rate freed goes to the other nodes by demand.
- A down node gets 0; its share goes to the up ones. Shares sum to R whenever a node is up; R = inf
  leaves every up node unlimited.

`simulate_nodes` runs a split (or the baselines `split_equal`, `split_by_lag`) on a small deterministic
cluster, for tests and benchmarks to compare. Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

IDLE_FLOOR = 0.05
"""Part of its equal share of R an idle node keeps: credit its publishers can start with."""
HEADROOM = 1.5
"""A light node may use this multiple of what it took before it counts as busy."""
DRAIN_SECONDS = 4.0
"""Seconds over which a node's backlog beyond one interval's intake should drain, by braking intake."""
BRAKE_FLOOR = 0.25
"""Part of its demand share a braked node keeps: its publishers slow down, they do not stop."""


@dataclass(frozen=True)
class NodeLoad:
    """What the driver knows of one receiver node lately."""

    up: bool
    """It answered lately; a down node gets no share."""
    taken: float = 0.0
    """Records per second its receivers took lately (>= 0, finite)."""
    busy: bool = False
    """Its publishers ran out of credit the rate withheld: it would take more than its share."""
    backlog: int = 0
    """Records on it not yet read by Spark (>= 0)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.taken) and self.taken >= 0):
            raise ValueError(f"records taken per second must be a finite number >= 0, got {self.taken}")
        if self.backlog < 0:
            raise ValueError(f"a node's backlog must be >= 0 records, got {self.backlog}")


@dataclass(frozen=True)
class NodeShare:
    """One node's part of the rate, and why."""

    rate: float
    """Records per second (0 for a down node; inf when unlimited)."""
    reason: str
    """For operators: "busy", "light: takes 1,000 records/s, room to grow", "down: ...", ..."""


DOWN = "down: no answer lately; its share went to the others"


def split_nodes(
    total: float,
    loads: Mapping[int, NodeLoad],
    *,
    interval: float = 1.0,
    drain_seconds: float = DRAIN_SECONDS,
    idle_floor: float = IDLE_FLOOR,
    headroom: float = HEADROOM,
    brake_floor: float = BRAKE_FLOOR,
) -> dict[int, NodeShare]:
    """Each node's share of `total` records/s (> 0, inf for unlimited) by its load (module docstring).
    `interval`: seconds between Spark's reads of a node (the trigger interval). ValueError for a total
    that is not a rate or parameters out of range."""
    if math.isnan(total) or total <= 0:
        raise ValueError(f"the rate to split must be > 0 records/s (or inf), got {total}")
    if not (interval > 0 and drain_seconds > 0 and 0 < idle_floor <= 1 and headroom >= 1):
        raise ValueError("interval and drain_seconds must be > 0, idle_floor in (0, 1], headroom >= 1")
    if not 0 <= brake_floor <= 1:
        raise ValueError(f"brake_floor must be in [0, 1], got {brake_floor}")
    shares = {node: NodeShare(0.0, DOWN) for node, load in loads.items() if not load.up}
    up = [node for node, load in loads.items() if load.up]
    if not up:
        return shares
    if math.isinf(total):
        return {**shares, **{node: NodeShare(math.inf, "unlimited") for node in up}}
    load = [loads[node] for node in up]
    floor = idle_floor * total / len(up)
    floors = [floor] * len(up)
    caps = [math.inf if n.busy else max(floor, n.taken * headroom) for n in load]
    demand = _fill(total, floors, caps) if sum(caps) >= total else _fill(total, caps, [math.inf] * len(up))
    # a node whose unread records exceed one interval's intake: cut its intake by the excess to drain
    excess = [n.backlog - d * interval for n, d in zip(load, demand, strict=True)]
    brakes = [
        max(floor, brake_floor * d, d - x / drain_seconds) if x > 0 else math.inf
        for d, x in zip(demand, excess, strict=True)
    ]
    braked = [min(c, b) for c, b in zip(caps, brakes, strict=True)]
    if sum(braked) >= total:
        rates = _fill(total, floors, braked)
    elif any(math.isinf(b) for b in brakes):
        # what no node can use goes to the unbraked ones as headroom: a braked one would pile it up
        free = [math.inf if math.isinf(b) else h for b, h in zip(brakes, braked, strict=True)]
        rates = _fill(total, braked, free)
    else:
        # Spark is behind on every node (lowering R is the estimator's part): R goes in proportion to
        # the braked shares, so the brakes keep their order
        rates = [h * total / sum(braked) for h in braked]
    for node, n, rate, cap, brake, x in zip(up, load, rates, caps, brakes, excess, strict=True):
        shares[node] = NodeShare(rate, _reason(n, rate, floor, cap, brake=brake, excess=x))
    return {node: shares[node] for node in loads}


def _fill(total: float, lows: Sequence[float], highs: Sequence[float]) -> list[float]:
    """clamp(level, low_i, high_i) at the level where they sum to `total`; needs sum(lows) <= total and,
    for an exact sum, total <= sum(highs) (highs may be inf)."""

    def at(level: float) -> list[float]:
        return [min(max(level, lo), hi) for lo, hi in zip(lows, highs, strict=True)]

    # the sum is piecewise linear in the level, bending where a node leaves its low or meets its high:
    # find the segment holding `total`, then solve on it
    # (bisected over the bends: a driver splits among up to hundreds of nodes several times a second)
    bends = sorted({x for pair in zip(lows, highs, strict=True) for x in pair if math.isfinite(x)})
    first = bisect.bisect_left(bends, True, key=lambda bend: sum(at(bend)) >= total)
    below = bends[first - 1] if first > 0 else 0.0
    above = bends[first] if first < len(bends) else math.inf
    inside = (below + above) / 2 if math.isfinite(above) else 2 * below + 1
    rising = sum(1 for lo, hi in zip(lows, highs, strict=True) if lo < inside < hi)
    level = below + (total - sum(at(below))) / rising if rising else below
    return at(min(level, above))


def _reason(load: NodeLoad, rate: float, floor: float, cap: float, *, brake: float, excess: float) -> str:
    near = 1e-9 * max(rate, 1.0)
    if math.isfinite(brake) and rate <= brake + near:
        return f"backlog {load.backlog:,} unread, {excess:,.0f} over one interval's intake: intake braked"
    if load.busy:
        return "busy"
    kind, took = ("light", f"takes {load.taken:,.0f} records/s") if load.taken else ("idle", "takes nothing")
    if rate <= floor + near:
        return f"{kind}: keeps a floor to ramp from" if not load.taken else f"{kind}: {took}, keeps a floor"
    if rate > cap + near:
        return f"{kind}: {took}; spare rate no busy node wants"
    return f"{kind}: {took}, room to grow"


# ---- baselines and a small cluster to compare splits on --------------------------------------------

Split = Callable[[float, Mapping[int, NodeLoad]], Mapping[int, NodeShare]]


def split_equal(total: float, loads: Mapping[int, NodeLoad]) -> dict[int, NodeShare]:
    """Baseline: R / up nodes (it is told which are down, which a plain R / nodes is not)."""
    up = [node for node, load in loads.items() if load.up]
    return {node: NodeShare(total / len(up) if node in up else 0.0, "equal") for node in loads}


def split_by_lag(total: float, loads: Mapping[int, NodeLoad]) -> dict[int, NodeShare]:
    """Baseline: as Spark's Kafka source prorates maxOffsetsPerTrigger over partitions by their lag
    (KafkaMicroBatchStream.rateLimit): R in proportion to each up node's backlog; equal without any."""
    lags = {node: load.backlog for node, load in loads.items() if load.up}
    lag = sum(lags.values())
    if lag == 0:
        return split_equal(total, loads)
    return {node: NodeShare(total * lags.get(node, 0) / lag, "by lag") for node in loads}


@dataclass(frozen=True)
class SimNode:
    """One receiver node of a simulated cluster."""

    wants: float
    """Records/s its publishers would send (they are busy while their share is less)."""
    backlog: int = 0
    """Records on it unread by Spark at the start."""
    up: bool = True


@dataclass(frozen=True)
class SimCluster:
    """A driver splitting `rate` every `tick` s; Spark reads every `interval` s up to `capacity`
    records/s over all nodes, divided by lag (as its Kafka source), and at most `node_read` records/s
    from any one node (what a node's block service and one task per node can move)."""

    nodes: Mapping[int, SimNode]
    rate: float = 6_000.0
    capacity: float = 7_000.0
    node_read: float = 3_000.0
    interval: float = 1.0
    tick: float = 0.25
    seconds: float = 60.0


@dataclass
class SimResult:
    """What a split achieved on a SimCluster."""

    wanted: float = 0.0
    """Records the up nodes' publishers wanted to send."""
    taken: float = 0.0
    """Records the up nodes took."""
    latency: float = 0.0
    """Mean seconds from a record's intake to Spark's read of it, over records taken and read."""
    worst: float = 0.0
    """Longest such wait, seconds."""
    backlog_end: dict[int, float] = field(default_factory=dict)
    """Records unread per node at the end."""

    @property
    def served(self) -> float:
        """Records taken / wanted (0..1)."""
        return self.taken / self.wanted if self.wanted else 1.0


def simulate_nodes(split: Split, cluster: SimCluster) -> SimResult:
    """Run `split` on `cluster`: deterministic, milliseconds."""
    result = SimResult()
    # per node: (intake time, records) oldest first; backlog at start counts as taken at time 0
    queues = {node: deque([(0.0, float(n.backlog))]) for node, n in cluster.nodes.items()}
    taken_rate = dict.fromkeys(cluster.nodes, 0.0)
    busy = dict.fromkeys(cluster.nodes, False)
    read = waited = 0.0
    steps = round(cluster.seconds / cluster.tick)
    per_read = round(cluster.interval / cluster.tick)
    for step in range(steps):
        now = step * cluster.tick
        loads = {
            node: NodeLoad(n.up, taken_rate[node], busy[node], round(sum(c for _, c in queues[node])))
            for node, n in cluster.nodes.items()
        }
        shares = split(cluster.rate, loads)
        for node, n in cluster.nodes.items():
            if not n.up:
                continue
            share = shares[node].rate
            intake = min(n.wants, share)
            busy[node] = share < n.wants
            taken_rate[node] = intake
            result.wanted += n.wants * cluster.tick
            result.taken += intake * cluster.tick
            queues[node].append((now, intake * cluster.tick))
        if (step + 1) % per_read == 0:  # a batch reads at the end of the interval
            end = now + cluster.tick
            lags = {node: sum(c for _, c in q) for node, q in queues.items() if cluster.nodes[node].up}
            lag = sum(lags.values())
            budget, most = cluster.capacity * cluster.interval, cluster.node_read * cluster.interval
            for node, node_lag in lags.items():
                want = min(node_lag, budget * node_lag / lag if lag else 0.0, most)
                queue = queues[node]
                while want > 1e-9 and queue:
                    when, count = queue[0]
                    took = min(count, want)
                    if when > 0:  # the backlog at the start was not taken under this split
                        read += took
                        waited += took * (end - when)
                        result.worst = max(result.worst, end - when)
                    want -= took
                    if took >= count:
                        queue.popleft()
                    else:
                        queue[0] = (when, count - took)
    result.latency = waited / read if read else 0.0
    result.backlog_end = {node: sum(c for _, c in q) for node, q in queues.items()}
    return result
