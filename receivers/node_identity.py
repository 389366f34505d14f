"""Whose data dir this is: DATA_DIR/node.json, written at its first start (Kafka's meta.properties).

A cluster's receiver node numbers the records of its partitions in its own log: started on another node's
data dir (two nodes' --data-dir swapped by mistake), it went on numbering that node's partition under its
own id, at offsets the cluster had used for other records, and the driver later failed on the partition
or skipped acked records as read. So the data dir records the node id it was first started with (None:
a single `sluice serve`, no cluster) and the node list it saw, and a start with another node id (or
another role) is refused, naming both ids and the dir. A data dir from before the file is adopted: the
file is written, unless its log's blocks were sealed by another node id or it holds copies of this
node's own partitions (then it is another node's, and refused the same way). A changed node list (a
node added, an address moved) is only logged: the node's own partitions stay its own.

To re-home a data dir to another node on purpose, write {"node_id": ID} to the file (null: a single server).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from receivers.cluster import Cluster, Node
from receivers.files import DataDirStateError, read_json, replace_json
from receivers.wal import WalBlockStore

log = logging.getLogger(__name__)

NODE_FILE = "node.json"
REPLICAS_DIR = "replicas"
"""Where a node keeps its copies of other nodes' partitions, a folder per owner (as ingest.receiver_node)."""


class DataDirOwnerError(ValueError):
    """The data dir was first started as another node (or another role): using it would mix two logs."""


class NodeFileError(DataDirOwnerError, DataDirStateError):
    """node.json cannot be read or is not a node identity (damage, not a start as another node)."""


class DataDirNestedError(ValueError):
    """The data dir lies inside another server's data dir."""


_RESTORE = 'restore it, or write {"node_id": ID} to it (null: a single server)'


_OWN_FOLDERS = frozenset({"blocks", REPLICAS_DIR, "checkpoints", "sink"})
"""What a data dir's server writes below it, beside a swap's sinks (`sink-g1`, `sink-g1-try2`)."""


def check_not_nested(data_dir: Path) -> None:
    """Refuse a data dir inside another's own folders (a folder above it holds node.json and blocks/,
    and the data dir lies in its blocks/, replicas/, checkpoints/, sink/ or a swap's sink-g*/): `--data-dir
    DATA/blocks/events` of a running server started a second one there, which wrote its node.json, lock
    and log among that stream's segments, and a disk budget of the outer one counted its blocks. A
    folder of its own beside them (DATA/other) is the operator's to use: nothing of the server's is
    there."""
    resolved = data_dir.resolve()
    for parent in resolved.parents:
        try:
            outer = (parent / NODE_FILE).is_file() and (parent / "blocks").is_dir()
        except OSError:  # a folder above that cannot be looked into: not a data dir of ours to find
            continue
        first = resolved.relative_to(parent).parts[0]
        if outer and (first in _OWN_FOLDERS or first.startswith("sink-g")):
            raise DataDirNestedError(
                f"data dir {data_dir} is inside the data dir {parent} (its {NODE_FILE}), in its {first}/: "
                "each server needs a data dir of its own, apart from every other's; give one outside it"
            )


def _who(node_id: int | None) -> str:
    return "a single server (no --nodes)" if node_id is None else f"node {node_id}"


def _nodes_map(nodes: Sequence[Node] | None) -> dict[str, str] | None:
    return None if nodes is None else {str(n.id): n.target for n in nodes}


def check_data_dir(data_dir: Path, cluster: Cluster | None) -> dict[str, object] | None:
    """What claim_data_dir checks, writing nothing (`sluice config check`): node.json as read and found
    sound, None when there is none yet; NodeFileError when it is damaged, DataDirOwnerError when the data
    dir is another node's (by the file, or for a data dir from before it, by its log), DataDirNestedError
    when it lies inside another data dir."""
    check_not_nested(data_dir)
    node_id = None if cluster is None else cluster.me.id
    path = data_dir / NODE_FILE
    data = read_json(path, "which node this data dir belongs to", NodeFileError, _RESTORE)
    if data is None:
        if node_id is not None:
            _check_old_log(data_dir, node_id, path)
        return None
    if not isinstance(data, dict) or "node_id" not in data:
        raise NodeFileError(f"{path}: not a node identity (a map with node_id): {_RESTORE}")
    recorded = data["node_id"]
    if recorded is not None and (isinstance(recorded, bool) or not isinstance(recorded, int)):
        raise NodeFileError(f"{path}: node_id must be a node id or null, got {recorded!r}: {_RESTORE}")
    if recorded != node_id:
        fix = (
            f"start {_who(node_id)} with its own data dir (--data-dir)"
            if node_id is not None
            else "start it with --role receiver and its --node-id, or give this server its own data dir"
        )
        raise DataDirOwnerError(
            f"data dir {data_dir} belongs to {_who(recorded)} ({path}, written at its first start), not to "
            f"{_who(node_id)}: its log holds {_who(recorded)}'s records, and taking more under another "
            f"id would give them offsets the cluster already used. {fix[0].upper()}{fix[1:]}; to re-home "
            f'this data dir to {_who(node_id)} on purpose, write {{"node_id": {json.dumps(node_id)}}} '
            f"to {path}"
        )
    return data


def claim_data_dir(data_dir: Path, cluster: Cluster | None) -> None:
    """Record that `data_dir` is this node's (`cluster.me`; a single server's when `cluster` is None) at
    its first start; refuse (DataDirOwnerError) a start as another node (check_data_dir). The node list
    is kept to log a change."""
    node_id = None if cluster is None else cluster.me.id
    nodes = None if cluster is None else cluster.nodes
    path = data_dir / NODE_FILE
    data = check_data_dir(data_dir, cluster)
    listed = _nodes_map(nodes)
    if data is None:
        # a log written before node.json existed (serve's preflight makes the empty folders of a new one)
        if any(p.is_file() for p in (data_dir / "blocks").rglob("*")):
            log.info(
                "data dir %s holds a log but no %s yet: marked as belonging to %s",
                data_dir,
                NODE_FILE,
                _who(node_id),
            )
        replace_json(path, {"node_id": node_id, "nodes": listed})
        return
    if listed is not None and "nodes" not in data:  # written by hand to re-home the dir: noted
        replace_json(path, {**data, "node_id": node_id, "nodes": listed})
    elif listed is not None and data["nodes"] != listed:
        before = data["nodes"]
        log.warning(
            "the node list differs from the one %s last started with (%s): was %s, now %s; if this data "
            "dir comes from another cluster, stop and give this node its own",
            _who(node_id),
            path,
            before,
            listed,
        )
        replace_json(path, {**data, "node_id": node_id, "nodes": listed})


def last_replication(data_dir: Path) -> int | None:
    """The replication this data dir's node last started with (record_replication), None when unknown:
    not recorded since the file was written, or by a version from before it."""
    data = read_json(data_dir / NODE_FILE, "which node this data dir belongs to", NodeFileError, _RESTORE)
    value = data.get("replication") if isinstance(data, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def record_replication(data_dir: Path, replication: int) -> None:
    """Note the replication this node started with, once its start dealt with the last run's
    (ingest.receiver_node: what a replication 1 start may cut depends on it)."""
    path = data_dir / NODE_FILE
    data = read_json(path, "which node this data dir belongs to", NodeFileError, _RESTORE)
    data = data if isinstance(data, dict) else {}
    if data.get("replication") != replication:
        replace_json(path, {**data, "replication": replication})


def _check_old_log(data_dir: Path, node_id: int, path: Path) -> None:
    """A data dir from before the file, taken by node `node_id`: refuse it when what it holds shows it is
    another node's: blocks in its own log sealed by another node (a node's blocks carry its id), or copies
    of `node_id`'s own partitions (a node holds copies of other nodes' only)."""
    store = WalBlockStore(data_dir / "blocks")
    writers: set[int] = set()
    for stream in store.stream_names():
        writers |= {block.receiver for block in store.blocks(stream)[-1:]}
    copies = data_dir / REPLICAS_DIR / str(node_id)
    if writers - {node_id} or copies.is_dir():
        if writers - {node_id}:
            shows = (
                f"its log's blocks were sealed by node {', '.join(map(str, sorted(writers)))}"
                # a single server's receiver is 0 too: its partition is node 0's in a cluster
                + (" (or by a single server, whose partition is node 0's)" if 0 in writers else "")
            )
        else:
            shows = f"it holds copies of node {node_id}'s partitions, which only other nodes hold"
        raise DataDirOwnerError(
            f"data dir {data_dir} is not node {node_id}'s: {shows} (it has no {NODE_FILE} yet, from an "
            f"older version). Start node {node_id} with its own data dir (--data-dir); to take this one "
            f'as node {node_id}\'s on purpose, write {{"node_id": {node_id}}} to {path}'
        )
