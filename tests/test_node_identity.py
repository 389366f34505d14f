"""A data dir records the node it was first started as (DATA_DIR/node.json, Kafka's meta.properties):
a start as another node (two nodes' --data-dir swapped) is refused, exit 2, naming both and the dir.
Before, both nodes started, numbered new records of each other's partitions at offsets the cluster had
used, and the driver later failed on them (PartitionUnreadableError) or skipped acked records."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from receivers.node_identity import NODE_FILE, DataDirNestedError, DataDirOwnerError, check_not_nested
from sluice_client import Producer
from tests.support import loopback_cluster, running_server
from tests.test_replication import values


def _serve(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "SLUICE_NODE_ID"}
    command = [sys.executable, "-m", "ingest.cli", "serve", "--metrics-port", "-1", *args]
    return subprocess.run(command, capture_output=True, env=env, timeout=120, check=False)


async def test_a_node_started_on_another_nodes_data_dir_is_refused(tmp_path: Path) -> None:
    clusters = loopback_cluster(2, replication=1)
    d0, d1 = tmp_path / "d0", tmp_path / "d1"
    for cluster, data_dir in ((clusters[0], d0), (clusters[1], d1)):
        port = int(cluster.me.target.rsplit(":", 1)[1])
        async with (
            running_server(data_dir, "s", cluster=cluster, port=port),
            Producer(cluster.me.target, "s", producer_id=f"p{cluster.me.id}", linger=0) as producer,
        ):
            await producer.send_many(values(20))
            await producer.flush(timeout=10)
    assert json.loads((d0 / NODE_FILE).read_text())["node_id"] == 0
    logs = {d: sorted((d / "blocks" / "s").iterdir()) for d in (d0, d1)}
    sizes = {d: [p.stat().st_size for p in files] for d, files in logs.items()}
    # swapped: each refused in process, before its log is touched
    for cluster, data_dir, owner in ((clusters[1], d0, 0), (clusters[0], d1, 1)):
        port = int(cluster.me.target.rsplit(":", 1)[1])
        with pytest.raises(DataDirOwnerError) as refused:
            async with running_server(data_dir, "s", cluster=cluster, port=port):
                pass
        words = str(refused.value)
        assert f"belongs to node {owner}" in words and f"not to node {cluster.me.id}" in words
        assert (
            str(data_dir) in words
            and "--data-dir" in words
            and f'write {{"node_id": {cluster.me.id}}} to {data_dir / NODE_FILE}' in words
        )
    assert {d: [p.stat().st_size for p in sorted((d / "blocks" / "s").iterdir())] for d in logs} == sizes
    # and by `sluice serve`: exit 2, before anything starts
    nodes = tmp_path / "nodes"
    nodes.write_text("".join(f"{n.id} {n.target}\n" for n in clusters[0].nodes))
    port1 = clusters[1].me.target.rsplit(":", 1)[1]
    node1 = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "1", "--port", port1]
    done = _serve(*node1, "--data-dir", str(d0))
    assert done.returncode == 2, done.stderr
    assert b"belongs to node 0" in done.stderr and b"not to node 1" in done.stderr, done.stderr
    assert str(d0).encode() in done.stderr
    single = _serve("--no-spark", "--port", "0", "--data-dir", str(d1))  # a single server, a node's dir
    assert single.returncode == 2 and b"belongs to node 1" in single.stderr, single.stderr
    assert b"not to a single server" in single.stderr
    # data dirs from before the file: the blocks' node ids tell, and an older node's own is adopted
    for data_dir in (d0, d1):
        (data_dir / NODE_FILE).unlink()
    with pytest.raises(DataDirOwnerError, match=r"not node 1's: its log's blocks were sealed by node 0"):
        async with running_server(d0, "s", cluster=clusters[1], port=int(port1)):
            pass
    assert not (d0 / NODE_FILE).exists()
    async with running_server(d0, "s", cluster=clusters[0], port=int(clusters[0].me.target.rsplit(":")[1])):
        pass
    assert json.loads((d0 / NODE_FILE).read_text())["node_id"] == 0
    # re-homed on purpose, as the refusal says: the dir is taken as node 1's
    (d0 / NODE_FILE).write_text('{"node_id": 1}')
    async with running_server(d0, "s", cluster=clusters[1], port=int(port1)):
        pass
    rehomed = json.loads((d0 / NODE_FILE).read_text())
    assert rehomed["node_id"] == 1 and rehomed["nodes"] == {str(n.id): n.target for n in clusters[1].nodes}


async def test_a_data_dir_from_before_the_file_is_adopted(tmp_path: Path) -> None:
    data_dir = tmp_path / "d"
    async with running_server(data_dir, "s") as server:
        producer = Producer(server.target, "s", producer_id="p", linger=0)
        await producer.start()
        await producer.send_many(values(10))
        await producer.flush(timeout=10)
        await producer.close()
    (data_dir / NODE_FILE).unlink()  # as an older version left it
    async with running_server(data_dir, "s") as again:
        assert sum(b.count for b in again.store.blocks("s")) == 10
    assert json.loads((data_dir / NODE_FILE).read_text()) == {"node_id": None, "nodes": None}
    async with running_server(data_dir, "s"):  # and again, with the file
        pass
    cluster = loopback_cluster(1)[0]
    with pytest.raises(DataDirOwnerError, match="belongs to a single server"):
        async with running_server(data_dir, "s", cluster=cluster):
            pass


async def test_a_changed_node_list_is_logged_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clusters = loopback_cluster(2)
    data_dir = tmp_path / "d"
    async with running_server(data_dir, "s", cluster=clusters[0]):
        pass
    caplog.set_level(logging.WARNING, "receivers.node_identity")
    grown = dataclasses.replace(clusters[0], nodes=loopback_cluster(3)[0].nodes)
    async with running_server(data_dir, "s", cluster=grown):
        pass
    assert "the node list differs" in caplog.text
    assert json.loads((data_dir / NODE_FILE).read_text())["nodes"] == {
        str(n.id): n.target for n in grown.nodes
    }


def test_only_a_data_dir_with_a_log_from_before_node_json_is_said_to_be_marked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every fresh `sluice serve` logged "data dir D has no node.json yet: taken as a single server (no
    --nodes)'s": its preflight makes the empty blocks folders first. Said only of a log that was there."""
    from receivers.node_identity import claim_data_dir

    fresh = tmp_path / "fresh"
    (fresh / "blocks" / "default").mkdir(parents=True)  # as serve's preflight leaves a new data dir
    old = tmp_path / "old"
    (old / "blocks" / "default").mkdir(parents=True)
    (old / "blocks" / "default" / "00000000000000000000.log").write_bytes(b"x")
    with caplog.at_level(logging.INFO, logger="receivers.node_identity"):
        claim_data_dir(fresh, None)
        assert not caplog.records
        claim_data_dir(old, None)
    assert [r.getMessage() for r in caplog.records] == [
        f"data dir {old} holds a log but no {NODE_FILE} yet: marked as belonging to a single server "
        "(no --nodes)"
    ]
    assert (fresh / NODE_FILE).exists() and (old / NODE_FILE).exists()


def _listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("inside", ["blocks/s", "blocks", "sink", "checkpoints/q", "sink-g1/x"])
async def test_a_data_dir_inside_another_servers_is_refused_before_anything_is_written(
    tmp_path: Path, inside: str
) -> None:
    """`--data-dir DATA/blocks/events` of a running server (a careless path) started a second server
    there: its node.json, lock and block log went among that stream's segments, uncalled for."""
    outer = tmp_path / "data"
    async with running_server(outer, "s") as server:
        await server.stop()
    assert (outer / NODE_FILE).is_file()
    before = _listing(outer)
    nested = outer / inside
    args = ["--no-spark", "--port", "0", "--data-dir", str(nested)]
    check = [sys.executable, "-m", "ingest.cli", "config", "check", *args]
    for done in (
        await asyncio.to_thread(_serve, *args),
        await asyncio.to_thread(subprocess.run, check, capture_output=True, timeout=60, check=False),
    ):
        said = done.stderr.decode()
        assert done.returncode == 2, said
        assert f"data dir {nested} is inside the data dir {outer} (its node.json)" in said
        assert f"in its {inside.split('/', maxsplit=1)[0]}/" in said
        assert "Traceback" not in said
    assert _listing(outer) == before


def test_a_folder_of_its_own_beside_a_data_dirs_folders_is_no_nesting(tmp_path: Path) -> None:
    """DATA/other holds nothing of DATA's server (its blocks/, replicas/, checkpoints/, sink/, sink-g*/
    are elsewhere): a second server's data dir may be there, as tests and operators put them."""
    outer = tmp_path / "data"
    (outer / "blocks").mkdir(parents=True)
    (outer / NODE_FILE).write_text('{"node_id": null}')
    for inside in ("other", "x/y", "fixed", "blocks-old"):
        check_not_nested(outer / inside)
    with pytest.raises(DataDirNestedError, match="in its replicas/"):
        check_not_nested(outer / "replicas" / "0")
