"""Whose data dir this is: DATA_DIR/node.json, written at its first start (Kafka's meta.properties).

A cluster's receiver node numbers the records of its partitions in its own log: started on another node's
data dir (two nodes' --data-dir swapped by mistake), it went on numbering that node's partition under its
own id, at offsets the cluster had used for other records, and the driver later failed on the partition
or skipped acked records as read. So the data dir records the node id it was first started with (None:
a single `sluice serve`, no cluster) and the node list it saw, and a start with another node id (or
another role) is refused, naming both ids and the dir. A data dir from before the file is adopted: the
file is written. A changed node list (a node added, an address moved) is only logged: the node's own
partitions stay its own.

To re-home a data dir to another node on purpose, remove the file.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from receivers.cluster import Cluster, Node
from receivers.files import read_json, replace_json

log = logging.getLogger(__name__)

NODE_FILE = "node.json"


class DataDirOwnerError(ValueError):
    """The data dir was first started as another node (or another role): using it would mix two logs."""


def _who(node_id: int | None) -> str:
    return "a single server (no --nodes)" if node_id is None else f"node {node_id}"


def _nodes_map(nodes: Sequence[Node] | None) -> dict[str, str] | None:
    return None if nodes is None else {str(n.id): n.target for n in nodes}


def claim_data_dir(data_dir: Path, cluster: Cluster | None) -> None:
    """Record that `data_dir` is this node's (`cluster.me`; a single server's when `cluster` is None) at
    its first start; refuse (DataDirOwnerError) a start as another node. The node list is kept to log a
    change."""
    node_id = None if cluster is None else cluster.me.id
    nodes = None if cluster is None else cluster.nodes
    path = data_dir / NODE_FILE
    data = read_json(path, "which node this data dir belongs to", DataDirOwnerError)
    listed = _nodes_map(nodes)
    if data is None:
        if (data_dir / "blocks").exists():
            log.info("data dir %s has no %s yet: taken as %s's", data_dir, NODE_FILE, _who(node_id))
        replace_json(path, {"node_id": node_id, "nodes": listed})
        return
    if not isinstance(data, dict) or "node_id" not in data:
        raise DataDirOwnerError(
            f"{path}: not a node identity (a map with node_id): restore it, or remove it to adopt the "
            "data dir as this node's"
        )
    recorded = data["node_id"]
    if recorded is not None and (isinstance(recorded, bool) or not isinstance(recorded, int)):
        raise DataDirOwnerError(f"{path}: node_id must be a node id or null, got {recorded!r}")
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
            f"this data dir to {_who(node_id)} on purpose, remove {path}"
        )
    if listed is not None and data.get("nodes") != listed:
        before = data.get("nodes")
        log.warning(
            "the node list differs from the one %s last started with (%s): was %s, now %s; if this data "
            "dir comes from another cluster, stop and give this node its own",
            _who(node_id),
            path,
            before,
            listed,
        )
        replace_json(path, {"node_id": node_id, "nodes": listed})
