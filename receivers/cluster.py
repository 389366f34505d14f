"""The cluster: a static list of receiver nodes, and where each node's blocks are replicated.

Each node writes what it takes into its own log per stream, the partition (stream, owner), with offsets
of its own (a Kafka topic partition). With replication R its blocks are copied to the next R - 1 nodes of
the list, its followers (a ring: placement needs no coordinator and every node computes the same one),
and acked only once durable on enough copies (receivers.replication). The owner and its followers are
the partition's holders: any of them serves reads of it.

The node list is a file, one node per line: ``ID HOST:PORT`` (``#`` starts a comment), or the same
entries given as ``ID=HOST:PORT`` on the command line.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sluice_client.keepalive import PEER_KEEPALIVE_SECONDS, PEER_KEEPALIVE_TIMEOUT_SECONDS, channel_options
from sluice_client.settings_file import read_settings_file

log = logging.getLogger(__name__)

_ENTRY = re.compile(r"^(\d{1,9})\s*[=\s]\s*(\S+:\d{1,5})$", re.ASCII)  # ASCII digits only

DRIVER_HEADER = "sluice-driver-id"
"""Call metadata of a driver's ListPartitions and ReleaseBlocks: its id (kept in its data dir). One driver
consumes a cluster: receivers.blocks_service refuses a second while the first holds its lease."""
DRIVER_RATE_HEADER = "sluice-driver-rate"
"""Call metadata of a driver's RateControl calls to a node (with DRIVER_HEADER): where the driver serves
its own RateControl, HOST:PORT (":PORT" when it listens on every address: the caller's address then).
A receiver node takes its rate from the driver's calls only, and tells an operator to go there."""
REFUSAL_HEADER = "sluice-refusal"
"""Trailing metadata of a refusal that is no outage: DRIVER_LEASE_HELD when another driver holds the node,
NOT_SAVED when a change's state file could not be written (the status is the server's own answer: no
dropped connection, whatever its code)."""
DRIVER_LEASE_HELD = "driver-lease"
NOT_SAVED = "not-saved"
CONFIG_HEADER = "sluice-node-config"
"""Trailing metadata of a Replicate hello refused for another configuration: the refusing node's
"NODES REPLICATION", so that the owner can say what each side has."""
MISMATCH_MEMORY = 30.0
"""Seconds a peer counts as configured otherwise after its last refused hello (an owner retries every 2 s
at most while refused; one fixed to replication 1 says no hello any more)."""
DRIVER_LEAVING_HEADER = "sluice-driver-leaving"
"""Call metadata ("1") of a driver's ListPartitions that gives its lease back: it stops, or another
driver holds other nodes (a node a refused driver took would lock the running one out)."""
MAX_KEEPALIVE_SECONDS = 3600.0
"""The longest peer keepalive (or its timeout): gRPC takes them in int milliseconds."""


class ClusterConfigError(ValueError):
    """The node list, this node's id, or the replication settings do not fit together."""


@dataclass(frozen=True)
class Node:
    id: int
    target: str
    """host:port of its gRPC server."""


@dataclass(frozen=True)
class Cluster:
    """The receiver nodes, this node's place among them (None on the driver), and replication."""

    nodes: tuple[Node, ...]
    node_id: int | None = None
    replication: int = 1
    """Copies of each block, on distinct nodes, the owner's included."""
    min_insync: int = 1
    """Copies a block needs before it is acked (Kafka's min.insync.replicas): with fewer followers in
    sync, intake pauses rather than ack with fewer copies."""
    keepalive: float = PEER_KEEPALIVE_SECONDS
    """Seconds without a frame from a peer after which a node pings it (on its channels to its peers, and
    as their server: sluice_client.keepalive) ..."""
    keepalive_timeout: float = PEER_KEEPALIVE_TIMEOUT_SECONDS
    """... and closes the connection when the ping goes unanswered this long: a Replicate stream to or
    from a peer gone without a FIN (its host down, the network cut) ends within keepalive +
    keepalive_timeout, on both sides, rather than never."""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ClusterConfigError("the node list names no node")
        ids = [n.id for n in self.nodes]
        targets = [n.target for n in self.nodes]
        for what, values in (("node id", [str(i) for i in ids]), ("target", targets)):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ClusterConfigError(f"the node list repeats {what} {', '.join(repeated)}")
        if self.node_id is not None and self.node_id not in ids:
            raise ClusterConfigError(
                f"this node's id {self.node_id} is not in the node list (ids: {', '.join(map(str, ids))})"
            )
        if not 1 <= self.replication <= len(self.nodes):
            raise ClusterConfigError(
                f"replication must be 1..{len(self.nodes)} (the number of nodes), got {self.replication}"
            )
        for what, seconds in (("keepalive", self.keepalive), ("keepalive timeout", self.keepalive_timeout)):
            if not 0.001 <= seconds <= MAX_KEEPALIVE_SECONDS:
                raise ClusterConfigError(
                    f"peer {what} must be 0.001..{MAX_KEEPALIVE_SECONDS:g} s, got {seconds}"
                )
        if not 1 <= self.min_insync <= self.replication:
            raise ClusterConfigError(
                f"min-insync must be 1..{self.replication} (the replication), got {self.min_insync}"
            )

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC options of a channel to a peer: keepalive (sluice_client.keepalive), while no call is
        open too (a channel kept for later calls is watched as well)."""
        return channel_options(self.keepalive, self.keepalive_timeout, without_calls=True)

    def node(self, node_id: int) -> Node:
        for node in self.nodes:
            if node.id == node_id:
                return node
        raise KeyError(node_id)

    @property
    def me(self) -> Node:
        if self.node_id is None:
            raise ClusterConfigError("this process is not a receiver node")
        return self.node(self.node_id)

    @property
    def peers(self) -> tuple[Node, ...]:
        """Every node but this one."""
        return tuple(n for n in self.nodes if n.id != self.node_id)

    def followers(self, owner: int) -> tuple[Node, ...]:
        """The nodes holding copies of `owner`'s partitions: the next replication - 1 in list order."""
        at = [n.id for n in self.nodes].index(owner)
        return tuple(self.nodes[(at + k) % len(self.nodes)] for k in range(1, self.replication))

    def holders(self, owner: int) -> tuple[Node, ...]:
        """The owner, then its followers: where `owner`'s partitions can be read."""
        return (self.node(owner), *self.followers(owner))

    def followed(self, node_id: int) -> tuple[Node, ...]:
        """The owners whose partitions `node_id` holds copies of."""
        return tuple(
            n for n in self.nodes if n.id != node_id and node_id in {f.id for f in self.followers(n.id)}
        )


def parse_nodes(entries: Iterable[str], *, source: str = "the node list") -> tuple[Node, ...]:
    """Nodes from `ID HOST:PORT` / `ID=HOST:PORT` entries; blank lines and # comments skipped."""
    nodes = []
    for number, line in enumerate(entries, start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        match = _ENTRY.match(text)
        if match is None:
            raise ClusterConfigError(f"{source}, line {number}: expected 'ID HOST:PORT', got {text!r}")
        port = int(match.group(2).rsplit(":", 1)[1])
        if not 0 < port <= 65535:
            raise ClusterConfigError(f"{source}, line {number}: port {port} is not 1-65535")
        nodes.append(Node(int(match.group(1)), match.group(2)))
    if not nodes:
        raise ClusterConfigError(f"{source} names no node")
    return tuple(nodes)


def load_nodes(path: Path) -> tuple[Node, ...]:
    """The node list file (see the module docstring)."""
    try:
        text = read_settings_file(path).decode("utf-8")
    except OSError as exc:
        why = exc.strerror or exc
        raise ClusterConfigError(f"cannot read the node list (--nodes) {path}: {why}") from None
    except UnicodeDecodeError as exc:
        raise ClusterConfigError(
            f"the node list (--nodes) {path} is not UTF-8 text (byte {exc.start})"
        ) from None
    return parse_nodes(text.splitlines(), source=str(path))


def config_mismatch(one: tuple[int, int, int], other: tuple[int, int, int], me: int | None) -> str:
    """What two nodes' (id, nodes, replication) are, `me` marked "(this node)"."""

    def has(node_id: int, nodes: int, replication: int) -> str:
        this = " (this node)" if node_id == me else ""
        return f"node {node_id}{this} has {nodes} nodes and replication {replication}"

    return f"{has(*one)}; {has(*other)}: give every node the same node list (--nodes) and --replication"


class ConfigMismatches:
    """Peers whose node list (its length) or replication differs from this node's, as the Replicate hellos
    it refused or that were refused showed: logged at ERROR once per peer and configuration (not at each
    retry), and counted for operators (`sluice_cluster_config_mismatch_peers`). Neither side can tell
    which is wrong, so both say it."""

    def __init__(self, cluster: Cluster, memory: float = MISMATCH_MEMORY) -> None:
        self._cluster = cluster
        self._memory = memory
        self._seen: dict[int, tuple[float, str]] = {}  # peer -> (when last seen, the words)
        self._logged: set[tuple[int, int, int]] = set()

    def seen(self, peer: int, nodes: int, replication: int, *, refused_by_peer: bool) -> str:
        """A hello between this node and `peer` failed on their configurations; return the words (the
        ERROR is logged the first time for this peer and configuration)."""
        me = self._cluster.node_id
        mine = (me if me is not None else -1, len(self._cluster.nodes), self._cluster.replication)
        theirs = (peer, nodes, replication)
        owner, follower = (mine, theirs) if refused_by_peer else (theirs, mine)  # the hello's sender first
        words = config_mismatch(owner, follower, me)
        self._seen[peer] = (time.monotonic(), words)
        if theirs not in self._logged:
            self._logged.add(theirs)
            known = {n.id: n.target for n in self._cluster.nodes}
            where = f" ({known[peer]})" if peer in known else ""
            if refused_by_peer:
                log.error("follower %d%s refuses replication: %s", peer, where, words)
            else:
                log.error("refused the replication of node %d%s: %s", peer, where, words)
        return words

    def agreed(self, peer: int) -> None:
        """A hello between this node and `peer` passed: they agree (again)."""
        self._seen.pop(peer, None)
        self._logged = {key for key in self._logged if key[0] != peer}

    def peers(self) -> dict[int, str]:
        """Peer -> what differs, for the peers seen configured otherwise lately."""
        now = time.monotonic()
        return {p: words for p, (at, words) in self._seen.items() if now - at <= self._memory}
