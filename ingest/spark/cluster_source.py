"""The "sluice" source in cluster mode: a cluster's partitions, read over the network.

Usage (instead of the ``path`` option, never with it)::

    df = (spark.readStream.format("sluice")
          .option("receivers", "0=node0:50051,1=node1:50051,2=node2:50051")  # node id = target
          .option("streams", "clicks,orders")
          .option("rateTarget", "driver:50052")        # optional: the driver's RateControl server
          .option("rateCaFile", "/etc/sluice/ca.crt")  # the rate* credentials serve every call, to
          .option("rateTokenFile", "/etc/sluice/pipeline.token")  # the nodes too
          .load())

Each receiver node writes what it takes into its own log per stream, the partition (stream, owner),
with offsets of its own (receivers.cluster). Offsets are therefore nested, as the Kafka source's are per
topic partition: ``{stream: {"<owner>": next record offset}}``, keys sorted (Spark compares offsets by
their JSON text). Planning asks every node's Blocks.ListPartitions in parallel: a partition's available
end is the highest readable end among its holders (the owner and its followers), and a node that does
not answer is skipped, its partitions read from their copies. Tasks read with Blocks.ReadBlocks from the
first holder that has the whole range (owner first), going on to the next on an outage or a missing
range; no task opens a local path. Records a holder's log lacks in its middle (lost under --fsync
off) are read from another holder; gone from all of them, they are data loss as in the single-node
source (failOnDataLoss: read_range), and planning counts them as no records against a batch's cap
(PartitionInfo.gone: the read limit or live cap goes to records past them; while a node does not
answer, it may hold them, and they count). Committed batches are
released on every node (ReleaseBlocks); `sluice serve --role driver` (ingest.cluster_driver) releases
them as each batch completes.

Each partition's log has an identity, its incarnation (PartitionInfo.incarnation: a random id made with
the owner's log, kept by its copies). Offsets carry the incarnation of each partition they are of, under
the key INCARNATIONS (``{"_incarnations": {"stream/owner": id}}``, no stream's name), so that a
checkpoint knows which log its offsets are of. A partition whose incarnation changed under a checkpointed
offset > 0, or whose owner's log now ends below it, lost its log (its node restarted on an empty data
dir while every follower was down, and numbered new records from 0 again): planning raises
DataLossError naming it, as Spark's Kafka source fails on data loss; with the option failOnDataLoss=false
it warns and reads the new log from its start instead. Reads and releases name the incarnation, so
that a holder of another one serves and releases nothing. An offset without incarnations (a checkpoint
from before them) takes the partitions' current ones.

Every call carries the rate* options' credentials: the token's principal needs the consumer role
(ListPartitions, ReadBlocks) and the operator role (ReleaseBlocks, and the rate). The files are read
where they are used, the planning worker and each task: they must be there on the executors' hosts too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from ingest.spark.source import (
    INCARNATIONS,
    OPTION_DRIVER_ID,
    OPTION_RECEIVERS,
    OPTION_STARTING_OFFSETS,
    LiveCapPlanning,
    SliceTuple,
    _balanced,
    _required,
    _weight,
    incarnations_of,
    json_option,
    parse_fail_on_data_loss,
    positioned,
)
from receivers.block import countable
from receivers.cluster import (
    DRIVER_HEADER,
    DRIVER_LEASE_HELD,
    DRIVER_LEAVING_HEADER,
    REFUSAL_HEADER,
    ClusterConfigError,
    parse_nodes,
)
from receivers.names import check_stream_name
from sluice_client.credentials import Credentials, CredentialsError
from sluice_client.keepalive import node_channel_options
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

ClusterOffset = dict[str, dict[str, Any]]
"""{stream: {"<owner node id>": next record offset}}: JSON keys are strings; and under INCARNATIONS,
{"stream/owner": incarnation}."""
FlatOffset = dict[str, int]
"""{"stream/owner": next record offset}: the same, one level (stream names have no '/')."""
Incarnations = dict[str, str]
"""{"stream/owner": the incarnation of the partition's log} (PartitionInfo.incarnation)."""

LIST_TIMEOUT = 3.0
"""Seconds a node has to answer ListPartitions: it may seal first (up to 1 s) and wait as long for the
copies; a node slower than that is skipped for this batch."""
READ_TIMEOUT = 300.0
"""Seconds one ReadBlocks call may take (a task's whole range from one holder)."""
RELEASE_TIMEOUT = 5.0

_RETRY_ELSEWHERE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.FAILED_PRECONDITION,  # this holder lacks the range: released, or not copied yet
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
    }
)
"""Codes after which the next holder is tried. The others (a refused token, a bad request) would get
the same answer anywhere: the task fails at once with it."""

CONNECT_TIMEOUT = 5.0
"""Seconds a task gives a holder to connect (TCP and TLS handshake, HTTP/2 settings): gRPC's own bound
is 20 s, which a task paid for a node that accepts no connection or answers none (hung, cut off)."""
UNREACHABLE_SECONDS = 5.0
"""After a holder could not be reached, the tasks of this process try it last for this long: one
failure costs one connect timeout, not one per task of the batch. Never skipped: when every other
holder fails it is tried still, and after this long it has its place again (a node that came back)."""

_READ_CHANNEL = (
    # a chunk is a whole block (its rows in range): a block of more than gRPC's default 4 MiB is common
    # (100-byte records at 50k records/s and a 1 s block interval: 5 MB), and the node is trusted
    ("grpc.max_receive_message_length", -1),
    # gRPC's connect deadline is the larger of the reconnect backoff and this minimum (default 20 s)
    ("grpc.min_reconnect_backoff_ms", round(CONNECT_TIMEOUT * 1000)),
    # a holder that stops answering on an open connection (its host down, the network cut, a flow a NAT
    # dropped) fails the read UNAVAILABLE within the peers' keepalive and its timeout (20 s), and the task
    # goes on from the next holder: before, it waited out READ_TIMEOUT (300 s)
    *node_channel_options(),
)

_UNREACHABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_unreachable: dict[str, float] = {}
"""target -> time.monotonic() until which this process's tasks try it last (UNREACHABLE_SECONDS)."""
_unreachable_lock = threading.Lock()


def _note_unreachable(target: str) -> None:
    with _unreachable_lock:
        _unreachable[target] = time.monotonic() + UNREACHABLE_SECONDS


def _reached(target: str) -> None:
    with _unreachable_lock:
        _unreachable.pop(target, None)


def _in_reach_first(targets: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """`targets` in their order, but those found unreachable in the last UNREACHABLE_SECONDS last."""
    now = time.monotonic()
    with _unreachable_lock:
        for target, until in list(_unreachable.items()):
            if until <= now:
                del _unreachable[target]
        late = {target for _, target in targets if target in _unreachable}
    return [t for t in targets if t[1] not in late] + [t for t in targets if t[1] in late]


class PartitionUnreadableError(RuntimeError):
    """No holder of a partition could serve a task's range of it."""


class DataLossError(RuntimeError):
    """A partition's log was lost under the query's checkpoint: its incarnation changed under an offset
    the query read, or its owner's log ends below it; or records a task reads are gone from every
    holder's log (read_range). The option failOnDataLoss, default true."""


class ClusterRefusedError(RuntimeError):
    """Every receiver node that answered refused the source's credentials: no batch can ever read."""

    refusals: list[str]
    """Each node's refusal, "node N (target): CODE: details"."""


class NodeListError(RuntimeError):
    """A target of the receivers list answered as another node than the list names it, or serves no
    Blocks (not a receiver node): the list disagrees with the nodes (each node's --node-id)."""


_REFUSED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


class DriverFencedError(RuntimeError):
    """A receiver node is held by another driver (receivers.blocks_service: one driver per cluster)."""


def _lease_held(exc: grpc.RpcError) -> bool:
    """The call was refused because another driver holds the node (not an outage)."""
    if not isinstance(exc, grpc.Call):
        return False
    return (REFUSAL_HEADER, DRIVER_LEASE_HELD) in tuple(exc.trailing_metadata() or ())


def partition_key(stream: str, owner: int) -> str:
    return f"{stream}/{owner}"


def split_key(key: str) -> tuple[str, int]:
    stream, _, owner = key.rpartition("/")
    return stream, int(owner)


def flatten(offset: Mapping[str, Mapping[str, Any]]) -> FlatOffset:
    """{stream: {owner: n}} -> {"stream/owner": n} (the incarnations left out: incarnations_of)."""
    return {
        partition_key(s, int(o)): n
        for s, owners in offset.items()
        if s != INCARNATIONS
        for o, n in owners.items()
    }


def nest(flat: Mapping[str, int], incarnations: Mapping[str, str] | None = None) -> ClusterOffset:
    """{"stream/owner": n} -> {stream: {"owner": n}}, sorted (streams by name, owners by number), and
    the incarnations of those partitions (the known ones) under INCARNATIONS, last, sorted the same."""
    nested: dict[str, dict[int, int]] = {}
    for key, n in flat.items():
        stream, owner = split_key(key)
        nested.setdefault(stream, {})[owner] = n
    offset: ClusterOffset = {s: {str(o): nested[s][o] for o in sorted(nested[s])} for s in sorted(nested)}
    known = {k: i for k, i in (incarnations or {}).items() if k in flat and i}
    if known:
        offset[INCARNATIONS] = {k: known[k] for k in sorted(known, key=split_key)}
    return offset


def is_cluster_offset(offset: object, streams: Sequence[str]) -> bool:
    """Whether `offset` is this source's nested offset over some of `streams`."""
    if not isinstance(offset, dict):
        return False
    parts = {k: v for k, v in offset.items() if k != INCARNATIONS}
    return (
        bool(parts)
        and set(parts) <= set(streams)
        and isinstance(offset.get(INCARNATIONS, {}), dict)
        and all(
            isinstance(owners, dict)
            and all(isinstance(o, str) and o.isdigit() and type(n) is int for o, n in owners.items())
            for owners in parts.values()
        )
    )


def parse_starting_offsets(value: str | None) -> FlatOffset:
    """The startingOffsets option in cluster mode: JSON, nested as the source's offsets ({stream:
    {"owner": record offset}}) or flat as the listener reports them ({"stream/owner": record offset});
    {} when absent. A ValueError naming the option otherwise."""
    if not value:
        return {}
    parsed = json_option(value)
    flat: dict[str, int] = {}
    if isinstance(parsed, dict):
        for key, n in parsed.items():
            if key == INCARNATIONS:
                continue  # starting_incarnations
            if isinstance(n, dict):
                flat.update({f"{key}/{o}": v for o, v in n.items()})
            else:
                flat[key] = n
    valid = isinstance(parsed, dict)
    for key, n in flat.items():
        stream, sep, owner = key.rpartition("/")
        if not (sep and stream and owner.isascii() and owner.isdigit() and type(n) is int and n >= 0):
            valid = False
            break
        try:
            check_stream_name(stream)
        except ValueError:
            valid = False
            break
    if not valid:
        raise ValueError(
            f"sluice source: option {OPTION_STARTING_OFFSETS!r} must be a JSON object of stream -> "
            f'{{"owner": record offset >= 0}} (or "stream/owner" -> record offset), got {value!r}'
        )
    return {partition_key(*split_key(k)): n for k, n in flat.items()}


def starting_incarnations(value: str | None) -> Incarnations:
    """The incarnations the startingOffsets option names (an offset of this source carries them)."""
    if not value:
        return {}
    return incarnations_of(json_option(value))


def parse_receivers(value: str) -> dict[int, str]:
    """The `receivers` option, "ID=HOST:PORT,...", as node id -> target (in the given order)."""
    try:
        nodes = parse_nodes(value.split(","), source=f"sluice source: option {OPTION_RECEIVERS!r}")
    except ClusterConfigError as exc:
        raise ValueError(str(exc)) from None
    ids, targets = [n.id for n in nodes], [n.target for n in nodes]
    if len(set(ids)) != len(ids) or len(set(targets)) != len(targets):
        raise ValueError(f"sluice source: option {OPTION_RECEIVERS!r} repeats a node id or target: {value!r}")
    return {n.id: n.target for n in nodes}


def credentials_from(files: Sequence[str | None]) -> Credentials:
    """Credentials from the rate* options' files (ca, cert, key, token), as a clear ValueError."""
    ca_file, cert_file, key_file, token_file = files
    try:
        return Credentials.from_files(
            ca_file=ca_file, cert_file=cert_file, key_file=key_file, token_file=token_file
        )
    except CredentialsError as exc:
        raise ValueError(f"sluice source: the receiver nodes' credentials: {exc}") from None


@dataclass(frozen=True)
class Holding:
    """What one node said it holds of one partition."""

    node_id: int
    start: int
    end: int
    leader: bool
    released: int | None = None
    """Where the holder's releases end (PartitionInfo.released_offset; None: it did not say)."""
    incarnation: str = ""
    """The incarnation of the log it holds ("": it did not say)."""
    log_end: int = 0
    """Where its log ends, every block counted (PartitionInfo.next_offset)."""
    gone: tuple[tuple[int, int], ...] = ()
    """Records [a, b) of [start, end) gone from its log, which it never serves (PartitionInfo.gone)."""


class ClusterView:
    """The partitions of a cluster's streams as its nodes reported them (ListPartitions answers)."""

    def __init__(self, order: Sequence[int]) -> None:
        self._order = {node_id: i for i, node_id in enumerate(order)}
        self.holdings: dict[str, list[Holding]] = {}
        """partition key -> what each answering node holds of it (once settled: of its incarnation)."""
        self.answered: set[int] = set()
        self.incarnations: Incarnations = {}
        """partition key -> the incarnation of its log that the view reads (settle)."""
        self.others: dict[str, list[Holding]] = {}
        """partition key -> holdings of another incarnation than that (settle): left out."""

    def add(self, response: pb.ListPartitionsResponse, streams: Sequence[str]) -> None:
        self.answered.add(response.node_id)
        for p in response.partitions:
            if p.stream in streams:
                released = p.released_offset if p.HasField("released_offset") else None
                holding = Holding(
                    response.node_id,
                    p.start_offset,
                    p.end_offset,
                    p.leader,
                    released,
                    p.incarnation,
                    p.next_offset,
                    tuple((r.first_offset, r.end_offset) for r in p.gone),
                )
                self.holdings.setdefault(partition_key(p.stream, p.owner), []).append(holding)

    def settle(self, known: Mapping[str, str]) -> ClusterView:
        """Pick each partition's incarnation and keep only its holders (and those that did not say
        theirs): the owner's log's, when the owner answered; else `known` (the query's offset's) if a
        holder has it; else the first holder's (node list order). A copy of another one is a copy of a
        log the owner's replaced (not set aside yet): its offsets are not this log's."""
        for key, holdings in self.holdings.items():
            named = sorted(
                (h for h in holdings if h.incarnation), key=lambda h: self._order.get(h.node_id, 0)
            )
            leaders = [h.incarnation for h in named if h.leader]
            if leaders:
                chosen = leaders[0]
            elif known.get(key) in {h.incarnation for h in named}:
                chosen = known[key]
            else:
                chosen = named[0].incarnation if named else ""
            if not chosen:
                continue
            self.incarnations[key] = chosen
            self.holdings[key] = [h for h in holdings if h.incarnation in {"", chosen}]
            others = [h for h in holdings if h.incarnation not in {"", chosen}]
            if others:
                self.others[key] = others
        return self

    def incarnation(self, key: str) -> str:
        """The incarnation of the partition's log the view reads ("": unknown)."""
        return self.incarnations.get(key, "")

    def owner_log_end(self, key: str) -> int | None:
        """Where the owner's log of the partition ends, every block counted (released ones too), when
        the owner answered; None otherwise."""
        ends = [max(h.end, h.log_end) for h in self.holdings.get(key, ()) if h.leader]
        return max(ends) if ends else None

    def end(self, key: str) -> int:
        """What a batch may read up to: the highest readable end among the partition's holders."""
        return max((h.end for h in self.holdings.get(key, ())), default=0)

    def readable(self, key: str) -> list[tuple[int, int]]:
        """The records of the partition some holder serves, as sorted disjoint ranges [a, b): each
        holder's [start, end) but what is gone from its log. Records every holder lacks (gone from the
        owner's log, with no copy of them; or released everywhere) are in none."""
        spans = sorted(span for h in self.holdings.get(key, ()) for span in _without(h.start, h.end, h.gone))
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        return merged

    def gaps(self, key: str, lo: int, hi: int) -> list[tuple[int, int]]:
        """The offsets of [lo, hi) that no node serves, as far as this view can tell, as sorted disjoint
        ranges: those no holder that answered serves (readable: gone from every holder's log,
        PartitionInfo.gone), when every node of the list answered. While one did not, none: it may
        hold any of them (the owner's log, or a copy; the view knows no placement), and serve them to
        the batch's tasks once it answers, so they count as records. Counted as gaps, such a batch read
        past its cap by the gap's size."""
        if hi <= lo or not set(self._order) <= self.answered:
            return []
        return _without(lo, hi, self.readable(key))

    def floor(self, key: str) -> int:
        """Where a partition the query has not seen yet starts: its first record any holder still has
        (a new node's partition: 0). The lowest start among holders that hold something, so that no
        record is skipped (a follower slow to release gives a few committed records again, at most);
        and no later than where the owner's releases end: an owner whose log was lost went on past
        records only its copies hold, which it never released (PartitionInfo.released_offset below
        its start). With those copies down, the query starts there and its tasks say no holder serves
        those records, rather than start past them: acked records were skipped silently.

        Never below where a holder's releases end, though (Spark read what is below): a follower back
        after releases it missed keeps what it held before the gap it goes on after (it cannot tell a
        release from a lost log), and a query starting at those records failed at the gap, at every
        start (no commit ever released them there)."""
        holdings = self.holdings.get(key, ())
        held = [h.start for h in holdings if h.end > h.start]
        held += [h.released for h in holdings if h.leader and h.released is not None and h.released < h.start]
        start = min(held) if held else max((h.end for h in holdings), default=0)
        return max([start, *(h.released for h in holdings if h.released is not None)])

    def holders(self, key: str, lo: int, hi: int) -> list[int]:
        """Nodes to read [lo, hi) from, owner first then followers (node list order): those that
        reported holding the range, then those that reported the partition at all, and when none of
        those holds it whole, the nodes that did not answer (one of them may: its task tries it, and
        names it when it is down); none reported it: every node, the owner first (the node list knows
        no placement here, and a node that does not hold it says so at once)."""
        _, owner = split_key(key)

        def rank(node_id: int) -> tuple[bool, int]:
            return node_id != owner, self._order.get(node_id, len(self._order))

        reported = self.holdings.get(key, [])
        covering = sorted((h.node_id for h in reported if h.start <= lo and h.end >= hi), key=rank)
        others = sorted((h.node_id for h in reported if h.node_id not in covering), key=rank)
        found = covering + others
        if found and not covering:  # no node that answered serves it: maybe one that did not
            found += sorted((n for n in self._order if n not in self.answered and n not in found), key=rank)
        return found or sorted(self._order, key=rank)


def _without(start: int, end: int, gone: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """[start, end) less the ranges of `gone`, as sorted disjoint ranges."""
    left: list[tuple[int, int]] = []
    at = start
    for a, b in sorted(gone):
        if a > at:
            left.append((at, min(a, end)))
        at = max(at, b)
        if at >= end:
            break
    if at < end:
        left.append((at, end))
    return [(a, b) for a, b in left if b > a]


@dataclass(frozen=True)
class RangeSpec:
    """Records [lo, hi) of partition (stream, owner), and where to read them (targets, in order)."""

    stream: str
    owner: int
    lo: int
    hi: int
    targets: tuple[tuple[int, str], ...]
    """(node id, host:port) of the holders to try, in order."""
    incarnation: str = ""
    """The incarnation of the partition's log the range is of ("": any)."""
    fail_on_data_loss: bool = True
    """Records gone from every holder's log (read_range): DataLossError, or False: a WARNING and the
    records after them (the source option failOnDataLoss)."""


class ClusterPartition(InputPartition):
    """One range of one partition, read by one Spark task over gRPC."""

    def __init__(self, spec: RangeSpec, credential_files: tuple[str | None, ...]) -> None:
        super().__init__(None)
        self.spec = spec
        self.credential_files = credential_files  # paths: no token travels in a pickled task

    @property
    def records(self) -> int:
        return self.spec.hi - self.spec.lo


class ClusterStreamReader(LiveCapPlanning, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches over a cluster's partitions and reads them from their holders.

    As the single-node reader: one instance lives in the planning worker, copies are pickled into the
    tasks; channels are opened lazily and never pickled."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.nodes = parse_receivers(_required(options, OPTION_RECEIVERS))
        # a cluster driver's id: the source's planning and releases are the driver's, held to its lease
        self.driver_id = options.get(OPTION_DRIVER_ID) or None
        self._read_planning_options(options)
        self.starting_incarnations = starting_incarnations(options.get(OPTION_STARTING_OFFSETS))
        self.fail_on_data_loss = parse_fail_on_data_loss(options)
        self._available_now_target: FlatOffset | None = None
        self._weights_for: Sequence[str] = ()  # the partition keys _stream_weights shares weights over
        self._latest: FlatOffset | None = None  # available ends at the last plan, for reportLatestOffset
        self._client: BlocksClient | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_rate_client"] = None
        state["_client"] = None
        return state

    @property
    def client(self) -> BlocksClient:
        if self._client is None:
            self._client = BlocksClient(self.nodes, credentials_from(self.rate_files), self.driver_id)
        return self._client

    # ---- offsets (driver-side worker) ---------------------------------------------------------

    @staticmethod
    def _parse_starting_offsets(value: str | None) -> FlatOffset:
        return parse_starting_offsets(value)

    def initialOffset(self) -> ClusterOffset:
        # startingOffsets (a swap's new query: where the old one's commits end), else each
        # partition's first record still held
        view = self.client.view(self.streams, seal=False).settle(self.starting_incarnations)
        start = {k: n for k, n in self.starting_offsets.items() if split_key(k)[0] in self.streams}
        offset = {**{key: view.floor(key) for key in view.holdings}, **start}
        # the starting offsets' own incarnations: the first plan checks them against the logs'
        return nest(offset, {**view.incarnations, **self.starting_incarnations})

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_records_per_batch is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_records_per_batch)

    def latestOffset(self, start: ClusterOffset, limit: ReadLimit) -> ClusterOffset:
        phase = time.time() % self.trigger_seconds if self.trigger_seconds > 0 else 0.0
        live = self._live_cap()  # first: it may wait for the last batch's metrics
        if self._held():
            return start  # no new data: the batch that runs now is the query's last (a swap)
        known = incarnations_of(start)
        view = self.client.view(self.streams, seal=True).settle(known)
        offered = flatten(start)
        begun = self._check_lost(view, offered, known)
        # a partition new to the query (a node's first blocks, or a node seen for the first time), or
        # whose log was replaced (failOnDataLoss=false), starts at its first record still held
        at = {key: begun.get(key, view.floor(key)) for key in {*offered, *view.holdings}}
        available = {key: max(at[key], view.end(key)) for key in at}
        target = self._available_now_target
        if target is not None:
            available = {k: min(v, max(at[k], target.get(k, at[k]))) for k, v in available.items()}
        self._latest = {k: v for k, v in available.items() if k in view.holdings}
        # records no node serves (gone from every holder's log: PartitionInfo.gone; known only when
        # every node answered) are no records for the read limit or the live cap: a batch's budget goes
        # to records past them
        gaps = {k: view.gaps(k, at[k], available[k]) for k in available}
        self._weights_for = [k for k in available if countable(at[k], available[k], gaps[k]) > 0]
        end = self._plan(at, available, limit, live, phase, gaps=gaps)
        # no offset for a partition that has nothing for this batch and that Spark has not seen: its
        # end would differ from the start's JSON and make an empty batch
        ends = {k: n for k, n in end.items() if k in offered or n > at[k]}
        return nest(ends, {**known, **view.incarnations})

    def _check_lost(self, view: ClusterView, begun: FlatOffset, known: Mapping[str, str]) -> FlatOffset:
        """`begun` less the partitions whose log was lost under it: DataLossError naming them, or with
        failOnDataLoss=false a warning (they start again at the new log's first record). Lost: its
        incarnation is another than the offset's (read past 0), or its owner's log ends below it."""
        lost: dict[str, str] = {}
        for key, offset in sorted(begun.items()):
            stream, owner = split_key(key)
            old, new = known.get(key, ""), view.incarnation(key)
            log_end = view.owner_log_end(key)
            if old and new and old != new:
                if offset == 0:
                    continue  # nothing read of the old log: the new one is read from its start
                end = f"it ends at offset {log_end}" if log_end is not None else "its owner did not answer"
                why = (
                    f"node {owner}'s log of stream {stream!r} (partition {key}) is now incarnation {new} "
                    f"({end}), and the checkpoint read incarnation {old} up to offset {offset}"
                )
            elif log_end is not None and log_end < offset:
                why = (
                    f"node {owner}'s log of stream {stream!r} (partition {key}, incarnation "
                    f"{new or 'unknown'}) ends at offset {log_end}, and the checkpoint read it up to "
                    f"offset {offset} (incarnation {old or 'unknown'})"
                )
            else:
                continue
            holders = ", ".join(f"node {h.node_id}" for h in view.holdings.get(key, ()))
            lost[key] = f"{why}; holders of the new log: {holders or 'none answered'}"
        if not lost:
            return dict(begun)
        what = "; ".join(lost.values())
        if self.fail_on_data_loss:
            raise DataLossError(
                f"sluice source: data loss: {what}. That log was lost and started afresh (its node "
                "restarted on an empty data dir while its followers were down): records of the old log "
                "the query had not read are not in it (its followers set their copies of it aside: see "
                "docs/cluster.md), and offsets the query read are given again to other records. Set the "
                "source option failOnDataLoss=false (a cluster's driver: `sluice serve --role driver "
                "--no-fail-on-data-loss`) to read the new log from its start instead"
            )
        log.warning(
            "sluice source: data loss: %s. failOnDataLoss=false: the query reads the new log from its "
            "start (records of the old log it had not read are not in it: see docs/cluster.md)",
            what,
        )
        return {k: n for k, n in begun.items() if k not in lost}

    def reportLatestOffset(self) -> ClusterOffset:
        # the progress's latestOffset (Spark does nothing else with it): positions, each partition's
        # end, gaps inside; the driver counts what a batch left behind less the gaps it knows
        # (ClusterDriver._records)
        if self._latest is None:
            view = self.client.view(self.streams, seal=False).settle({})
            self._latest = {key: view.end(key) for key in view.holdings}
        return nest(self._latest)

    def prepareForTriggerAvailableNow(self) -> None:
        view = self.client.view(self.streams, seal=True).settle({})
        self._available_now_target = {key: view.end(key) for key in view.holdings}

    def partitions(self, start: ClusterOffset, end: ClusterOffset) -> Sequence[ClusterPartition]:
        begun, ends = flatten(start), flatten(end)
        was, now = incarnations_of(start), incarnations_of(end)
        # asked again: a restarted query plans its unfinished batch without latestOffset
        view = self.client.view(self.streams, seal=False).settle(now)
        slices: list[SliceTuple] = []
        for key in sorted(ends, key=split_key):
            stream, owner = split_key(key)
            # a log replaced under the start (failOnDataLoss=false) is read from its start
            replaced = bool(was.get(key)) and bool(now.get(key)) and was[key] != now[key]
            if key in begun and not replaced and ends[key] >= begun[key]:
                lo = begun[key]
            else:
                lo = min(view.floor(key), ends[key])
            if ends[key] > lo:
                slices.append((stream, 0, 0, 0, owner, lo, ends[key]))
        # balanced as the single-node source balances slices of blocks; a task reads one range
        specs = []
        for run in _balanced(slices, self.min_partitions, self.min_partition_records):
            for stream, _, _, _, owner, lo, hi in run:
                holders = view.holders(partition_key(stream, owner), lo, hi)
                targets = tuple((n, self.nodes[n]) for n in holders if n in self.nodes)
                incarnation = now.get(partition_key(stream, owner), "")
                specs.append(RangeSpec(stream, owner, lo, hi, targets, incarnation, self.fail_on_data_loss))
        return [ClusterPartition(spec, self.rate_files) for spec in specs]

    def commit(self, end: ClusterOffset) -> None:
        # Spark has durably recorded every batch up to `end` (the driver has usually released already)
        self.client.release(end)

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self._rate_client is not None:
            self._rate_client.close()

    # ---- reading (executor-side worker) -------------------------------------------------------

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ClusterPartition)
        yield from read_range(partition.spec, credentials_from(partition.credential_files))

    # ---- helpers ------------------------------------------------------------------------------

    def _stream_weights(self) -> Mapping[str, float] | None:
        # the live rate weighs streams; a stream's weight is shared by its partitions that have records
        weights = self._rate_client.weights if self._rate_client is not None else None
        streams = [split_key(k)[0] for k in self._weights_for]
        pairs = zip(self._weights_for, streams, strict=True)
        return {k: _weight(weights, s) / streams.count(s) for k, s in pairs}


class BlocksClient:
    """Blocks calls to every node of a cluster (node id -> target), blocking, with `credentials`."""

    def __init__(
        self, nodes: Mapping[int, str], credentials: Credentials, driver_id: str | None = None
    ) -> None:
        self.nodes = dict(nodes)
        self._metadata = credentials.metadata
        self.driver_id = driver_id
        """The driver's id, sent with ListPartitions and ReleaseBlocks: the nodes hold them to one driver."""
        self.fenced: str | None = None
        """Why a node refused this driver (another holds it): the driver stops."""
        # kept from batch to batch: a connection gone without a FIN is closed by keepalive and the next
        # call connects anew (before, each call timed out on it, the node's partitions read from copies)
        self._channels = {
            n: credentials.sync_channel(t, node_channel_options()) for n, t in self.nodes.items()
        }
        self._stubs = {n: pb_grpc.BlocksStub(c) for n, c in self._channels.items()}
        self._pool = ThreadPoolExecutor(min(32, len(self.nodes)), thread_name_prefix="sluice-blocks")
        self._failing: set[int] = set()  # nodes whose last ListPartitions failed: logged once per outage

    def view(self, streams: Sequence[str], *, seal: bool, timeout: float = LIST_TIMEOUT) -> ClusterView:
        """Every node's ListPartitions, asked in parallel; the nodes that do not answer are left out."""
        request = pb.ListPartitionsRequest(streams=list(streams), seal_blocks=seal)
        view = ClusterView(list(self.nodes))
        calls = {n: self._pool.submit(self._list, n, request, timeout) for n in self.nodes}
        refused: list[str] = []
        held: list[str] = []
        misnamed: list[str] = []
        for node_id, call in calls.items():
            try:
                response = call.result()
            except grpc.RpcError as exc:
                if _lease_held(exc):
                    held.append(describe(exc))
                    continue
                if isinstance(exc, grpc.Call) and exc.code() in _REFUSED:
                    refused.append(f"node {node_id} ({self.nodes[node_id]}): {describe(exc)}")
                if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    # no outage that passes: the query read nothing of it, for ever, under a WARNING
                    misnamed.append(
                        f"{self.nodes[node_id]}, listed as node {node_id}, serves no Blocks: not a "
                        "receiver node (a single `sluice serve`, a driver, another service?)"
                    )
                    continue
                if node_id not in self._failing:
                    log.warning(
                        "receiver node %d (%s) did not list its partitions (%s): its partitions are read "
                        "from their copies until it answers",
                        node_id,
                        self.nodes[node_id],
                        describe(exc),
                    )
                self._failing.add(node_id)
                continue
            if response.node_id != node_id:
                # taken as it came, a node listed twice hid another node's partitions (never read, not a
                # word), and a swapped pair sent every read to a node that does not hold the records
                misnamed.append(
                    f"{self.nodes[node_id]}, listed as node {node_id}, is node {response.node_id}"
                )
                continue
            if unlisted := sorted(set(response.nodes) - set(self.nodes)):
                # their partitions were never read (their copies' holders, if any listed, read them)
                misnamed.append(
                    f"node {node_id} ({self.nodes[node_id]}) has node(s) {', '.join(map(str, unlisted))} "
                    "in its own node list, and this list does not"
                )
            if node_id in self._failing:
                log.info("receiver node %d (%s) answers again", node_id, self.nodes[node_id])
                self._failing.discard(node_id)
            view.add(response, streams)
        if misnamed:
            self.give_back()
            raise NodeListError(
                "sluice source: the receivers list disagrees with the receiver nodes (their own "
                f"--node-id): {'; '.join(misnamed)}. Correct the list (the driver's --nodes file, or the "
                "receivers option)"
            )
        if held:
            self.fenced = "; ".join(held)
            self.give_back()  # the nodes that took this driver would lock the one running out
            raise DriverFencedError(self.fenced)
        if refused and not view.answered:
            # not an outage that passes: a query that went on would read nothing, silently, for ever
            error = ClusterRefusedError(
                "sluice source: the receiver nodes refused the source's credentials (the rateTokenFile "
                "option's principal needs the consumer and operator roles): " + "; ".join(refused)
            )
            error.refusals = refused
            raise error
        return view

    def _list(
        self, node_id: int, request: pb.ListPartitionsRequest, timeout: float
    ) -> pb.ListPartitionsResponse:
        response: pb.ListPartitionsResponse = self._stubs[node_id].ListPartitions(
            request, timeout=timeout, metadata=self._driver_metadata()
        )
        return response

    def give_back(self, timeout: float = 2.0) -> None:
        """Give this driver's lease back on every node that answers (best effort): it stops, or it was
        refused by some node and must not hold the others."""
        if not self.driver_id:
            return
        leaving = (*self._driver_metadata(), (DRIVER_LEAVING_HEADER, "1"))
        request = pb.ListPartitionsRequest()

        def give(node_id: int) -> None:
            self._stubs[node_id].ListPartitions(request, timeout=timeout, metadata=leaving)

        for call in [self._pool.submit(give, n) for n in self.nodes]:
            with contextlib.suppress(grpc.RpcError):  # down: its lease lapses on its own
                call.result()

    def _driver_metadata(self) -> tuple[tuple[str, str], ...]:
        """The credentials' metadata, and the driver's id if this client is a driver's."""
        named = ((DRIVER_HEADER, self.driver_id),) if self.driver_id else ()
        return (*(self._metadata or ()), *named)

    def release(self, end: Mapping[str, Mapping[str, Any]], timeout: float = RELEASE_TIMEOUT) -> int:
        """Release every partition below `end` ({stream: {owner: offset}}, with its incarnations) on
        every node (each drops what it holds of it, if its log is of that incarnation). Errors are
        logged, not raised: release is idempotent and the next commit retries it. Returns the blocks
        released."""
        incarnations = incarnations_of(end)
        calls = [
            (
                node_id,
                key,
                self._pool.submit(
                    self._release, node_id, *split_key(key), before, timeout, incarnations.get(key, "")
                ),
            )
            for key, before in flatten(end).items()
            for node_id in self.nodes
        ]
        released = 0
        for node_id, key, call in calls:
            try:
                released += call.result()
            except grpc.RpcError as exc:
                if _lease_held(exc):
                    if self.fenced is None:
                        log.error("cannot release on node %d: %s", node_id, describe(exc))  # noqa: TRY400
                    self.fenced = describe(exc)
                    continue
                # a node planning already found down was warned about once: not again at every commit
                log.log(
                    logging.DEBUG if node_id in self._failing else logging.WARNING,
                    "cannot release partition %s below %s on node %d (%s): retried at the next commit",
                    key,
                    flatten(end)[key],
                    node_id,
                    describe(exc),
                )
        return released

    def _release(  # noqa: PLR0917 - one call per partition and node
        self, node_id: int, stream: str, owner: int, before: int, timeout: float, incarnation: str = ""
    ) -> int:
        request = pb.ReleaseBlocksRequest(
            stream=stream, owner=owner, before_offset=before, incarnation=incarnation
        )
        response = self._stubs[node_id].ReleaseBlocks(
            request, timeout=timeout, metadata=self._driver_metadata()
        )
        return int(response.blocks_released)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for channel in self._channels.values():
            channel.close()


def read_range(
    spec: RangeSpec, credentials: Credentials, timeout: float = READ_TIMEOUT
) -> Iterator[pa.RecordBatch]:
    """Records [lo, hi) of the partition as ARROW_SCHEMA batches, from the first holder that serves
    them; a holder that fails part way is left for the next one from the first record not yet given.

    Records a holder says are gone from its log (ReadBlocksRequest.report_gone: blocks a start under
    --fsync off went on without) are asked of the other holders, and read from one that has them.
    Gone from every holder that said it holds them, while every other holder said it does not (none
    down, none failing otherwise): data loss, as the single-node source's gap in a log: DataLossError
    naming the partition, the records and the nodes, or with spec.fail_on_data_loss false a WARNING and
    the records after them. Before, such a range was unreadable whatever failOnDataLoss said, and the
    query stopped at it at every start."""
    at = spec.lo
    failures: list[str] = []
    tried: dict[int, int] = {}  # node id -> the record it last could not serve: not asked again for it
    lacking: dict[int, int] = {}  # node id -> the record it said it does not hold (gone, or not held)
    gone: dict[int, tuple[int, int]] = {}  # node id -> records [a, b) it said are gone from its log
    while at < spec.hi:
        pending = [t for t in _in_reach_first(spec.targets) if tried.get(t[0]) != at]
        if not pending:  # every holder was asked for `at`: none served it
            at = _past_gone(spec, at, gone, lacking, failures)
            continue
        for node_id, target in pending:
            # records some holder said are gone are asked of the others alone: one that holds them may
            # not hold the records after them yet (a copy not that far)
            to = min((b for a, b in gone.values() if a == at), default=spec.hi)
            read = _Progress(at)
            try:
                yield from _read_holder(spec, target, credentials, timeout, read, to)
            except grpc.RpcError as exc:
                at = read.at
                failures.append(f"node {node_id} ({target}): {describe(exc)}")
                code = _failed(exc, target)
                if code in _NOT_HELD:
                    lacking[node_id] = at
                if code is not None and code not in _RETRY_ELSEWHERE:
                    raise _unreadable(spec, at, failures) from None
            except (_BadChunk, pa.ArrowInvalid) as exc:
                at = read.at
                failures.append(f"node {node_id} ({target}): a bad chunk: {exc}")
            else:
                at = read.at
                _reached(target)
                if at >= spec.hi:
                    return
                if at >= to:
                    break  # records another holder lacked: the rest from the first holder again
                if read.gone is not None:
                    gone[node_id] = (at, read.gone)
                    lacking[node_id] = at
                    failures.append(
                        f"node {node_id} ({target}): records {at}..{read.gone - 1} are gone from its log"
                    )
                else:
                    failures.append(f"node {node_id} ({target}): ended at record {at}")
            tried[node_id] = at
            log.info("reading %s/%d at %d: %s; next holder", spec.stream, spec.owner, at, failures[-1])


def _failed(exc: grpc.RpcError, target: str) -> grpc.StatusCode | None:
    """Note what a holder's failed read says of its reach; its status code (None: no status)."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    if code in _UNREACHABLE_CODES:
        _note_unreachable(target)  # the next tasks go to its copies first
    elif code is not None:
        _reached(target)  # it answered (a missing range, a refusal): it is up
    return code


@dataclass
class _Progress:
    """How far one holder's ReadBlocks call got (it may fail part way)."""

    at: int
    """The next record due."""
    gone: int | None = None
    """The holder said records [at, gone) are gone from its log (and the call was left there)."""


def _read_holder(  # noqa: PLR0917 - one holder's call of read_range
    spec: RangeSpec, target: str, credentials: Credentials, timeout: float, read: _Progress, to: int
) -> Iterator[pa.RecordBatch]:
    """Records [read.at, to) from one holder, as far as it serves them, `read` kept up to date."""
    with credentials.sync_channel(target, _READ_CHANNEL) as channel:
        request = pb.ReadBlocksRequest(
            stream=spec.stream,
            owner=spec.owner,
            from_offset=read.at,
            to_offset=to,
            incarnation=spec.incarnation,
            report_gone=True,
        )
        chunks = pb_grpc.BlocksStub(channel).ReadBlocks(
            request, timeout=timeout, metadata=credentials.metadata
        )
        for chunk in chunks:
            if chunk.gone:
                if chunk.first_offset != read.at or chunk.count <= 0 or read.at + chunk.count > to:
                    raise _BadChunk(f"records {chunk.first_offset}+{chunk.count} said gone at {read.at}")
                read.gone = read.at + chunk.count
                return  # the channel's close ends the call: the records after them may be another's
            # whole chunks only: a holder failing part way leaves no half chunk given
            batches = _chunk_batches(chunk, spec, read.at, to)
            yield from batches
            read.at += chunk.count


_NOT_HELD = frozenset({grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND})
"""Codes by which a holder says it does not hold a range (released, not copied, another log): it was up
and answered, so records it lacks and another holder says are gone are not merely out of reach."""


def _unreadable(spec: RangeSpec, at: int, failures: Sequence[str]) -> PartitionUnreadableError:
    return PartitionUnreadableError(
        f"sluice source: no holder of partition {spec.stream!r}/{spec.owner} served records "
        f"{at}..{spec.hi - 1} (of {spec.lo}..{spec.hi - 1}): " + "; ".join(failures or ["no holder known"])
    )


def _past_gone(
    spec: RangeSpec,
    at: int,
    gone: Mapping[int, tuple[int, int]],
    lacking: Mapping[int, int],
    failures: Sequence[str],
) -> int:
    """No holder served record `at`. Records from there that some holder said are gone from its log,
    while every other holder said it does not hold them: DataLossError, or with failOnDataLoss=false a
    WARNING and where the read goes on. Else (a holder down or failing: it may hold them)
    PartitionUnreadableError."""
    said = {n: b for n, (a, b) in gone.items() if a == at}
    if not said or any(lacking.get(n) != at for n, _ in spec.targets):
        raise _unreadable(spec, at, failures)
    end = min(said.values())
    nodes = " and ".join(f"node {n}" for n in sorted(said))
    others = [f"node {n}" for n, _ in spec.targets if n not in said]
    what = (
        f"records {at}..{end - 1} of node {spec.owner}'s log of stream {spec.stream!r} (partition "
        f"{partition_key(spec.stream, spec.owner)}) are gone from the log of {nodes}, and "
        + (f"{', '.join(others)} said it does not hold them" if others else "no other node holds them")
        + ": blocks a start went on without, under --fsync off or past damage --accept-wal-damage let "
        "by (that start said so in an ERROR, counted them in sluice_wal_lost_blocks_total and, for "
        "damage, recorded them in the stream's lost.json)"
    )
    if spec.fail_on_data_loss:
        raise DataLossError(
            f"sluice source: data loss: {what}. Set the source option failOnDataLoss=false (a cluster's "
            "driver: `sluice serve --role driver --no-fail-on-data-loss`) to read the records there and "
            "skip the missing ones"
        )
    log.warning(
        "sluice source: data loss: %s. failOnDataLoss=false: the task reads the records after them", what
    )
    return end


class _BadChunk(Exception):
    pass


def _chunk_batches(chunk: pb.BlockChunk, spec: RangeSpec, at: int, to: int) -> list[pa.RecordBatch]:
    """A chunk's rows as ARROW_SCHEMA batches, if it is the one due at `at` (of a read up to `to`) and
    says what it holds."""
    if chunk.first_offset != at or chunk.count <= 0 or at + chunk.count > to:
        raise _BadChunk(f"records {chunk.first_offset}+{chunk.count} where {at} was next")
    batches = []
    got = at
    for batch in pa.ipc.open_stream(chunk.arrow_ipc):
        batches.append(positioned(batch, spec.stream, spec.owner, got))
        got += batch.num_rows
    if got != at + chunk.count:
        raise _BadChunk(f"the chunk at {at} says {chunk.count} records and holds {got - at}")
    return batches


def describe(exc: grpc.RpcError) -> str:
    """A gRPC error as 'CODE: details' (its str() is a multi-line dump)."""
    if isinstance(exc, grpc.Call):
        code = exc.code()
        return f"{code.name if code else 'UNKNOWN'}: {exc.details()}"
    return repr(exc)
