"""A receiver node started into a cluster it cannot work with says so and stops, rather than serve.

At its start a node asks each follower where its copies of the node's partitions end (a lost data dir
goes on past the furthest copy: docs/cluster.md). A follower that refused this node's credentials (its
peer token is not one the follower's auth file grants the peer role), and an address where another
node than the list names answers (two nodes' addresses swapped in one node's list), were taken for a
follower down: the node started, logged "node 1 ... did not answer", and replication to that follower
failed at every try (acks with fewer copies, or none at all under --min-insync). A node whose data dir
was lost started its partitions at offset 0 again although that follower, up and holding where they
ended, was right there. Each now stops the start: `sluice serve` exits 1 naming the node, its address
and what to fix. And a peer token file other users can read is warned of, as a TLS key is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from ingest.config import SecurityConfig
from receivers.auth import new_token, token_hash
from receivers.cluster import Cluster, Node
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import free_ports, running_server, wait_until

PEER_TOKEN = new_token()
SERVED = b"(serving: not refused)"


def _env() -> dict[str, str]:
    """This environment without its SLUICE_ settings (which would set the CLI's flags)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
    """`sluice ARGS` in a subprocess, until it exits, without the environment's SLUICE_ settings."""
    command = [sys.executable, "-m", "ingest.cli", *args]
    return subprocess.run(command, env=_env(), capture_output=True, timeout=timeout, check=False)


def _node(
    nodes: Path, node_id: int, port: int, data_dir: Path, *flags: str
) -> subprocess.CompletedProcess[bytes]:
    """`sluice serve --role receiver` for `node_id`, until it exits; one that starts serving (not
    refused) is stopped then, and its stderr holds SERVED."""
    command = [
        *(sys.executable, "-m", "ingest.cli", "serve", "--role", "receiver", "--metrics-port", "-1"),
        *("--nodes", str(nodes), "--node-id", str(node_id), "--port", str(port)),
        *("--data-dir", str(data_dir), "--stream", "s", *flags),
    ]
    proc = subprocess.Popen(command, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    watchdog = threading.Timer(60, proc.kill)  # a hung start fails the test, never hangs it
    watchdog.start()
    lines = []
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(b"sluice: serving streams"):
                proc.terminate()
                lines.append(SERVED)
    finally:
        proc.wait()
        watchdog.cancel()
        if proc.stderr is not None:
            proc.stderr.close()
    return subprocess.CompletedProcess(command, proc.returncode, b"", b"".join(lines))


async def test_a_node_whose_peer_token_its_follower_refuses_stops_at_start(tmp_path: Path) -> None:
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[principals.node]\nroles = ["peer"]\ntoken_sha256 = ["{token_hash(PEER_TOKEN)}"]\n')
    good, wrong = tmp_path / "good.token", tmp_path / "wrong.token"
    good.write_text(PEER_TOKEN + "\n")
    wrong.write_text(new_token() + "\n")  # made for another cluster, or a token rotated out
    for token in (good, wrong):
        token.chmod(0o600)
    ports = free_ports(2)
    nodes = tuple(Node(i, f"127.0.0.1:{port}") for i, port in enumerate(ports))
    nodes_file = tmp_path / "nodes.txt"
    nodes_file.write_text("".join(f"{n.id} {n.target}\n" for n in nodes))
    security = SecurityConfig(auth_file=auth)
    async with running_server(
        tmp_path / "d1",
        "s",
        cluster=Cluster(nodes, 1, 2),
        port=ports[1],
        security=security,
        peer_token_file=good,
    ):

        async def start(token: Path) -> subprocess.CompletedProcess[bytes]:
            args = ("--replication", "2", "--auth-file", str(auth), "--peer-token-file", str(token))
            return await asyncio.to_thread(_node, nodes_file, 0, ports[0], tmp_path / "d0", *args)

        done = await start(wrong)
        assert done.returncode == 1, done.stderr
        words = done.stderr.decode()
        assert f"cannot start the server: node 1 ({nodes[1].target}) refuses this node's credentials" in words
        assert "UNAUTHENTICATED" in words and "--peer-token-file" in words and "peer role" in words, words
        assert "did not answer" not in words, words
        # no token at all (the auth file forgotten on this node's side): refused the same way
        done = await asyncio.to_thread(_node, nodes_file, 0, ports[0], tmp_path / "d0", "--replication", "2")
        assert (
            done.returncode == 1
            and "refuses this node's credentials (UNAUTHENTICATED" in done.stderr.decode()
        )
        # the right token: it starts (and is stopped by the test)
        done = await start(good)
        assert SERVED in done.stderr, done.stderr


async def test_a_node_whose_follower_is_listed_at_another_nodes_address_stops_at_start(
    tmp_path: Path,
) -> None:
    ports = free_ports(3)
    right = tuple(Node(i, f"127.0.0.1:{port}") for i, port in enumerate(ports))
    # node 0's copy of the list has node 1 and node 2's addresses swapped
    swapped = tmp_path / "swapped.txt"
    swapped.write_text(f"0 {right[0].target}\n1 {right[2].target}\n2 {right[1].target}\n")
    async with contextlib.AsyncExitStack() as stack:
        for i in (1, 2):
            cluster = Cluster(right, i, 2)
            await stack.enter_async_context(
                running_server(tmp_path / f"d{i}", "s", cluster=cluster, port=ports[i])
            )
        done = await asyncio.to_thread(_node, swapped, 0, ports[0], tmp_path / "d0", "--replication", "2")
    assert done.returncode == 1, done.stderr
    words = done.stderr.decode()
    assert f"node 1 is listed at {right[2].target} (--nodes), but the node there answers as node 2" in words
    assert "did not answer" not in words, words


async def test_a_peer_token_file_other_users_can_read_is_warned_of_at_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A TLS key other users can read is warned of at start; the peer token file, which lets its reader
    call every node as a peer (or, the driver's, read every record and release blocks), was taken
    without a word. A node and a driver say it now, naming the file, its mode and the fix; a 0600
    file is not warned of."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    auth = tmp_path / "auth.toml"
    auth.write_text(f'[principals.node]\nroles = ["peer"]\ntoken_sha256 = ["{token_hash(PEER_TOKEN)}"]\n')
    token = tmp_path / "peer.token"
    token.write_text(PEER_TOKEN + "\n")
    warning = f"the peer token file {token} (--peer-token-file) can be read by other users"
    cluster = Cluster((Node(0, f"127.0.0.1:{free_ports(1)[0]}"),), 0)
    port = int(cluster.me.target.rsplit(":", 1)[1])
    caplog.set_level(logging.WARNING)
    for mode, warned in ((0o644, True), (0o640, True), (0o600, False)):
        token.chmod(mode)
        caplog.clear()
        security = SecurityConfig(auth_file=auth)
        async with running_server(
            tmp_path / "node", "s", cluster=cluster, port=port, security=security, peer_token_file=token
        ):
            pass
        config = DriverConfig(
            nodes={0: cluster.me.target}, streams=("s",), data_dir=tmp_path / "driver", token_file=token
        )
        driver = ClusterDriver(config)
        await driver.serve_rate()
        driver.blocks.fenced = "not claimed"  # nothing to give back: this driver never claimed nodes
        await driver.stop()
        said = [r for r in caplog.records if warning in r.getMessage()]
        assert len(said) == (2 if warned else 0), (oct(mode), caplog.text)
        assert {r.name for r in said} <= {"ingest.server", "ingest.cluster_driver"}
        if warned:
            assert f"(mode {mode:04o})" in said[0].getMessage() and "chmod 600 it" in said[0].getMessage()


async def test_a_node_listed_twice_under_two_names_is_told_its_replication_reached_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A node list that names one node's address twice (127.0.0.1:P as node 0, localhost:P as node 1)
    passes the list's checks (two targets, two ids), and node 0 replicates to itself. Its refusal said
    "node 0 is not a follower of node 0 in its node list", which points nowhere; it now says that is
    its own id and what that means. So does a forged hello naming the follower's id."""
    port = free_ports(1)[0]
    nodes = (Node(0, f"127.0.0.1:{port}"), Node(1, f"localhost:{port}"))
    caplog.set_level(logging.WARNING, logger="receivers.replication")
    words = (
        f"node 0 (127.0.0.1:{port}) is not a follower of node 0, its own id: the hello came from this node "
        "itself (the node list, --nodes, names its address under a follower's id too)"
    )
    async with running_server(tmp_path / "d0", "s", cluster=Cluster(nodes, 0, 2), port=port) as server:
        await wait_until(lambda: words in caplog.text, timeout=15)
        said = [r.getMessage() for r in caplog.records if words in r.getMessage()]
        assert said[0].startswith(f"follower 1 (localhost:{port}) refuses replication: FAILED_PRECONDITION: ")
        assert "another process run as node 0 (one --node-id given twice)" in said[0]
        async with grpc.aio.insecure_channel(server.target) as channel:
            call = pb_grpc.ReplicationStub(channel).Replicate()  # type: ignore[call-arg]
            await call.write(pb.ReplicateRequest(hello=pb.ReplicaHello(owner=0, nodes=2, replication=2)))
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in call:
                    pass
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert words in (refused.value.details() or "")


def test_a_node_listed_at_a_network_address_but_serving_on_loopback_is_refused(tmp_path: Path) -> None:
    """The node list names where the other nodes, the driver and Spark's executors reach a node; one
    listed at an address of the network that serves on the default --host 127.0.0.1 is reachable there
    by nobody (that address on its own machine neither). It started and served, and its peers found it
    down ("did not answer") without a word at the node. `sluice serve` and `sluice config check` now
    stop with exit 2 naming both; the same node on that address or on every address starts."""
    port = free_ports(1)[0]
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"0 192.0.2.10:{port}\n1 192.0.2.11:{port}\n")  # TEST-NET-1: never this machine's
    node = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--port", str(port)]
    node += ["--metrics-port", "-1", "--data-dir", str(tmp_path / "d0")]
    for command in ("serve", "config check"):
        done = _cli(*command.split(), *node, timeout=30)
        assert done.returncode == 2, (command, done.stderr)
        assert (
            f"node 0 is listed at 192.0.2.10:{port} in {nodes}, but serves on 127.0.0.1 (--host)".encode()
            in done.stderr
        ), done.stderr
        assert b"give --host 192.0.2.10 (or 0.0.0.0" in done.stderr
    assert not (tmp_path / "d0").exists()  # refused before anything was written
    for host in ("0.0.0.0", "192.0.2.10"):
        done = _cli("config", "check", *node, "--host", host, "--insecure", timeout=30)
        assert done.returncode == 0, (host, done.stderr)


@pytest.mark.parametrize(
    ("listed", "words"),
    [
        ("0 127.0.0.1:{a}\n0 127.0.0.1:{b}\n", b"the node list repeats node id 0"),
        ("0 127.0.0.1:{a}\n1 127.0.0.1:{a}\n", b"the node list repeats target 127.0.0.1:{a}"),
    ],
)
def test_the_driver_refuses_a_node_list_every_node_refuses(tmp_path: Path, listed: str, words: bytes) -> None:
    """A node refuses a node list that repeats an id or an address; the driver took it, as a mapping of
    id to address: the last entry of a repeated id won and the other node was never read, without a
    word (`sluice config check --role driver` said the settings were valid). It stops now, exit 2, in
    the node's words, before Spark starts."""
    a, b = free_ports(2)
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(listed.format(a=a, b=b))
    driver = ["--role", "driver", "--nodes", str(nodes), "--data-dir", str(tmp_path / "driver")]
    driver += ["--port", "0", "--metrics-port", "-1"]
    for command in ("config check", "serve"):
        done = _cli(*command.split(), *driver, timeout=120)
        assert done.returncode == 2, (command, done.stderr)
        assert words.replace(b"{a}", str(a).encode()) in done.stderr, done.stderr
