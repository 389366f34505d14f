"""Issue 14, item 5: the driver divides the global rate among receiver nodes by demand and backlog
(ratecontrol.nodes), and keeps each node's rate at its share over gRPC (ingest.node_rates.NodeRates);
a node that stops answering is down and its share goes to the others. Real receiver servers on
loopback; `sluice rate get` and /metrics show the nodes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import loopback_cluster, running_server, wait_until

from ingest.config import RateConfig
from ingest.metrics import SluiceCollector
from ingest.node_rates import NodeRates
from ingest.rate_service import RateControlService
from ingest.server import SluiceServer
from ratecontrol.nodes import (
    DOWN,
    IDLE_FLOOR,
    NodeLoad,
    NodeShare,
    SimCluster,
    SimNode,
    simulate_nodes,
    split_by_lag,
    split_equal,
    split_nodes,
)
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

INF = math.inf
SLUICE = [str(Path(sys.executable).parent / "sluice")]


def rates(shares: dict[int, NodeShare]) -> dict[int, float]:
    return {node: share.rate for node, share in shares.items()}


# ---- the split (pure) ----------------------------------------------------------------------------


def test_a_skewed_cluster_the_busy_node_takes_what_others_leave_a_backlog_brakes_a_down_node_none() -> None:
    loads = {
        1: NodeLoad(up=True, taken=3_000, busy=True),
        2: NodeLoad(up=True, taken=1_000),
        3: NodeLoad(up=True, taken=1_000, backlog=20_000),
        4: NodeLoad(up=False, taken=5_000, busy=True),  # what it did before it went down does not count
    }
    shares = split_nodes(6_000, loads)
    assert sum(rates(shares).values()) == pytest.approx(6_000)
    assert shares[4] == NodeShare(0.0, DOWN)
    assert shares[2].rate == pytest.approx(1_500)  # 1.5 x what it took: room to grow
    assert shares[2].reason == "light: takes 1,000 records/s, room to grow"
    # node 3 would get 1,500 by demand; 18,500 records over one interval's intake wait there: braked
    # to a quarter of that, and the busy node gets what it leaves
    assert shares[3].rate == pytest.approx(375)
    assert "intake braked" in shares[3].reason
    assert shares[1].rate == pytest.approx(6_000 - 1_500 - 375)
    assert shares[1].reason == "busy"
    # the baselines: the equal split gives the light nodes what they cannot use; by lag, all of it goes
    # to the node whose records already wait
    assert rates(split_equal(6_000, loads)) == {1: 2_000, 2: 2_000, 3: 2_000, 4: 0}
    assert rates(split_by_lag(6_000, loads)) == {1: 0, 2: 0, 3: 6_000, 4: 0}


def test_idle_nodes_split_equally_and_an_idle_node_keeps_a_floor_beside_a_busy_one() -> None:
    idle = {n: NodeLoad(up=True) for n in (1, 2, 3)}
    assert rates(split_nodes(3_000, idle)) == pytest.approx({1: 1_000, 2: 1_000, 3: 1_000})
    busy = {1: NodeLoad(up=True, taken=900, busy=True), 2: NodeLoad(up=True), 3: NodeLoad(up=True)}
    shares = split_nodes(3_000, busy)
    floor = IDLE_FLOOR * 1_000
    assert rates(shares) == pytest.approx({1: 3_000 - 2 * floor, 2: floor, 3: floor})
    assert shares[2].reason == "idle: keeps a floor to ramp from"


def test_down_nodes_get_nothing_unlimited_stays_unlimited_and_one_node_gets_all() -> None:
    down = {1: NodeLoad(up=False), 2: NodeLoad(up=False)}
    assert rates(split_nodes(5_000, down)) == {1: 0, 2: 0}
    mixed = {1: NodeLoad(up=True), 2: NodeLoad(up=False), 3: NodeLoad(up=True, busy=True)}
    assert rates(split_nodes(INF, mixed)) == {1: INF, 2: 0, 3: INF}
    assert split_nodes(INF, mixed)[1].reason == "unlimited"
    alone = split_nodes(5_000, {1: NodeLoad(up=True, backlog=10**9), 2: NodeLoad(up=False)})
    assert rates(alone) == {1: 5_000, 2: 0}  # braked or not, the only node takes the rate
    assert split_nodes(5_000, {}) == {}


def test_a_cluster_behind_on_every_node_keeps_the_brakes_in_order() -> None:
    # Spark is behind everywhere: the shares still sum to R, the most backlogged node gets the least
    backlogs = {1: 3_000, 2: 6_000, 3: 30_000}
    loads = {n: NodeLoad(up=True, taken=2_000, busy=True, backlog=b) for n, b in backlogs.items()}
    shares = rates(split_nodes(6_000, loads))
    assert sum(shares.values()) == pytest.approx(6_000)
    assert shares[1] > shares[2] > shares[3] > 0


@pytest.mark.parametrize(
    ("total", "fields"),
    [(0.0, {}), (-1.0, {}), (math.nan, {}), (1.0, {"interval": 0.0}), (1.0, {"headroom": 0.5}),
     (1.0, {"idle_floor": 0.0}), (1.0, {"brake_floor": 2.0}), (1.0, {"drain_seconds": -1.0})],
)  # fmt: skip
def test_impossible_rates_and_gains_are_refused(total: float, fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"rate to split|must be"):
        split_nodes(total, {1: NodeLoad(up=True)}, **fields)


@pytest.mark.parametrize("fields", [{"taken": -1.0}, {"taken": math.nan}, {"taken": INF}, {"backlog": -1}])
def test_impossible_loads_are_refused(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        NodeLoad(up=True, **fields)  # type: ignore[arg-type]


load_st = st.builds(
    NodeLoad,
    up=st.booleans(),
    taken=st.floats(0, 1e6, allow_nan=False),
    busy=st.booleans(),
    backlog=st.integers(0, 10**7),
)


@settings(max_examples=500, deadline=None)
@given(
    total=st.floats(1, 1e7, allow_nan=False),
    loads=st.dictionaries(st.integers(0, 50), load_st, min_size=1, max_size=8),
)
def test_shares_sum_to_the_rate_keep_a_floor_and_give_down_nodes_nothing(
    total: float, loads: dict[int, NodeLoad]
) -> None:
    shares = rates(split_nodes(total, loads))
    assert list(shares) == list(loads)
    up = [n for n, load in loads.items() if load.up]
    for node, rate in shares.items():
        assert math.isfinite(rate)
        if node in up:
            assert rate >= IDLE_FLOOR * total / len(up) * (1 - 1e-9)
        else:
            assert rate == 0
    if up:
        assert sum(shares.values()) == pytest.approx(total, rel=1e-9)


# ---- the comparison: a skewed cluster, the split against its baselines ---------------------------

SKEWED = SimCluster(
    {
        1: SimNode(wants=4_000),  # publishers that want 4x the others'
        2: SimNode(wants=1_000),
        3: SimNode(wants=1_000, backlog=20_000),  # Spark fell behind on it
        4: SimNode(wants=1_000, up=False),
    },
    rate=6_000,
    capacity=7_000,
    node_read=3_000,
)


def test_on_a_skewed_cluster_the_split_serves_demand_better_than_equal_and_by_lag() -> None:
    ours = simulate_nodes(split_nodes, SKEWED)
    equal = simulate_nodes(split_equal, SKEWED)  # told which node is down: generous to it
    by_lag = simulate_nodes(split_by_lag, SKEWED)
    # records taken of those wanted: 0.81 against 0.67 (equal) and 0.72 (by lag); 5/6 is what the
    # nodes can be read at for long (node 1 at most 3,000/s)
    assert ours.served > 1.1 * equal.served
    assert ours.served > 1.1 * by_lag.served
    # and no record waits longer than under either baseline
    assert ours.worst <= min(equal.worst, by_lag.worst)
    # the brake keeps every node's backlog near one interval's intake: without it, the hot node's
    # backlog grows for as long as its publishers want more than it can be read at
    unbraked = simulate_nodes(functools.partial(split_nodes, drain_seconds=1e12), SKEWED)
    assert max(ours.backlog_end.values()) < 3_000
    assert unbraked.backlog_end[1] > 2 * max(ours.backlog_end.values())


# ---- NodeRates against real receiver nodes -------------------------------------------------------


def node_rate(server: SluiceServer) -> float:
    return server.rate.rate if server.rate.pinned else math.nan


async def test_shares_arrive_as_node_rates_and_a_stopped_node_is_down_its_share_to_the_others(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="ingest.node_rates")
    servers: list[SluiceServer] = []
    async with contextlib.AsyncExitStack() as stack:
        for i in range(3):
            servers.append(await stack.enter_async_context(running_server(tmp_path / f"node{i}")))
        # the third node in its own stack: it stops mid-test
        third = contextlib.AsyncExitStack()
        stack.push_async_callback(third.aclose)
        servers.append(await third.enter_async_context(running_server(tmp_path / "node3")))
        nodes = {i: server.target for i, server in enumerate(servers)}
        async with NodeRates(nodes, lambda: 8_000.0, interval=0.1) as node_rates:
            # idle nodes: an equal split, pinned on each node
            await wait_until(lambda: all(node_rate(s) == pytest.approx(2_000) for s in servers), timeout=10)
            assert all(node.up for node in node_rates.snapshot())
            await third.aclose()
            stopped = asyncio.get_running_loop().time()
            await wait_until(lambda: not node_rates.snapshot()[3].up, timeout=5)
            assert asyncio.get_running_loop().time() - stopped < 2.5  # 3 failed calls, ~0.3 s here
            await wait_until(lambda: all(node_rate(s) == pytest.approx(8_000 / 3) for s in servers[:3]))
            down = node_rates.snapshot()[3]
            assert (down.records_per_second, down.reason) == (0.0, DOWN)
            assert sum(n.records_per_second for n in node_rates.snapshot()) == pytest.approx(8_000)
            await asyncio.sleep(0.5)  # more failed calls: still one WARNING
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1
            assert f"receiver node 3 at {nodes[3]} is down" in warnings[0].getMessage()
            # back on the same port (and data dir): up at its first answer, with its share again
            back = await stack.enter_async_context(running_server(tmp_path / "node3", port=servers[3].port))
            await wait_until(lambda: node_rates.snapshot()[3].up, timeout=5)
            await wait_until(lambda: all(node_rate(s) == pytest.approx(2_000) for s in [*servers[:3], back]))
            assert f"receiver node 3 at {nodes[3]} answers: up" in caplog.text


async def test_a_busy_node_gets_the_rate_idle_nodes_leave_and_sluice_rate_get_shows_the_nodes(
    tmp_path: Path,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(running_server(tmp_path / f"node{i}")) for i in range(3)]
        # the driver: its controller holds the global rate, its RateControl shows the split
        driver = await stack.enter_async_context(running_server(tmp_path / "driver"))
        driver.rate.update(3_000, pin=True)
        node_rates = NodeRates({i + 1: s.target for i, s in enumerate(servers)}, driver.rate, interval=0.1)
        await stack.enter_async_context(node_rates)
        rpc = grpc.aio.server()
        service = RateControlService(driver.rate, nodes=node_rates.snapshot)
        pb_grpc.add_RateControlServicer_to_server(service, rpc)
        port = rpc.add_insecure_port("127.0.0.1:0")
        await rpc.start()
        stack.push_async_callback(rpc.stop, None)
        await wait_until(lambda: all(node_rate(s) == pytest.approx(1_000) for s in servers))
        # publishers flood node 1: it runs out of credit, is busy, and gets what the idle ones leave
        producer = Producer(servers[0].target, "s", linger=0, max_buffered=5_000)
        await producer.start()
        stack.push_async_callback(producer.abort)  # a flood's tail need not be acked

        async def flood() -> None:
            while True:
                await producer.send_many([b"x" * 50] * 500)

        flooding = asyncio.create_task(flood())
        try:
            await wait_until(lambda: node_rates.snapshot()[0].busy, timeout=10)
            # the idle ones keep a floor (5% of their 1,000, clamped up to the nodes' min rate, 100)
            await wait_until(lambda: node_rate(servers[0]) == pytest.approx(3_000 - 2 * 50), timeout=10)
            busy = node_rates.snapshot()[0]
            assert busy.reason == "busy"
            assert busy.taken_per_second > 0
            shown = await asyncio.to_thread(
                subprocess.run,
                [*SLUICE, "rate", "get", "--target", f"127.0.0.1:{port}"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env={k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")},
            )
        finally:
            flooding.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flooding
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert "receiver nodes: 3 of 3 up" in lines
    header = next(line for line in lines if line.split()[:2] == ["node", "target"])
    assert header.split() == ["node", "target", "state", "share/s", "taken/s", "busy", "backlog", "why"]
    row = next(line for line in lines if line.split()[:2] == ["1", servers[0].target])
    assert row.split()[2:4] == ["up", "2,900"]
    assert row.split()[5] == "yes"
    assert row.endswith("busy")
    idle = next(line for line in lines if line.split()[:2] == ["2", servers[1].target])
    assert idle.endswith("idle: keeps a floor to ramp from")


async def test_metrics_show_each_node_and_a_node_that_never_answers_is_down(tmp_path: Path) -> None:
    async with running_server(tmp_path / "node") as server:
        # a port nothing listens on: a node that was never up
        gone = grpc.aio.server()
        port = gone.add_insecure_port("127.0.0.1:0")
        await gone.stop(None)
        node_rates = NodeRates({7: server.target, 8: f"127.0.0.1:{port}"}, lambda: 4_000.0, interval=0.1)
        async with node_rates:
            await wait_until(lambda: node_rate(server) == pytest.approx(4_000))
            registry = CollectorRegistry()
            registry.register(SluiceCollector({}, lambda: 0, nodes=node_rates.snapshot))
            text = generate_latest(registry).decode()
    samples = {
        (sample.name, sample.labels.get("node")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert samples[("sluice_node_rate_records_per_second", "7")] == 4_000
    assert samples[("sluice_node_rate_records_per_second", "8")] == 0
    assert samples[("sluice_node_up", "7")] == 1
    assert samples[("sluice_node_up", "8")] == 0
    assert samples[("sluice_node_backlog_records", "7")] == 0


class HangingRateControl(RateControlService):
    """A receiver node's RateControl that stops answering (a hung process, a black-holed network)
    once `hang` is set: calls wait until their deadline."""

    hang = False

    async def GetRate(self, request: pb.GetRateRequest, context: Any) -> pb.RateStatus:
        if self.hang:
            await asyncio.Event().wait()
        return await super().GetRate(request, context)


async def test_a_node_that_hangs_is_down_after_a_timed_out_call_and_delays_no_other(tmp_path: Path) -> None:
    async with running_server(tmp_path / "a") as a, running_server(tmp_path / "b") as b:
        service = HangingRateControl(b.rate)
        rpc = grpc.aio.server()
        pb_grpc.add_RateControlServicer_to_server(service, rpc)
        port = rpc.add_insecure_port("127.0.0.1:0")
        await rpc.start()
        try:
            targets = {1: a.target, 2: f"127.0.0.1:{port}"}
            async with NodeRates(targets, lambda: 6_000.0, interval=0.1, timeout=0.5) as node_rates:
                await wait_until(lambda: [node_rate(a), node_rate(b)] == pytest.approx([3_000, 3_000]))
                service.hang = True
                hung = time.monotonic()
                await wait_until(lambda: not node_rates.snapshot()[1].up, timeout=5)
                # a call that ran into its 0.5 s deadline after 1 s without an answer (DOWN_SECONDS): down,
                # long before the 5 s the wait allows (bounds for a 2-core machine running a Spark test)
                assert time.monotonic() - hung < 3.0
                # meanwhile node a is asked every 0.1 s: it has the whole rate at once
                await wait_until(lambda: node_rate(a) == pytest.approx(6_000), timeout=3)
        finally:
            await rpc.stop(None)


async def test_a_driver_listed_as_a_node_gets_no_share_and_is_not_pinned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A --nodes file naming the driver itself: the driver's own rate was pinned to a share of itself,
    halving it at every round, and every receiver was throttled down to the nodes' minimum."""
    async with contextlib.AsyncExitStack() as stack:
        receiver = await stack.enter_async_context(running_server(tmp_path / "node"))
        driver = await stack.enter_async_context(running_server(tmp_path / "driver"))
        driver.rate.update(3_000)
        rpc = grpc.aio.server()  # the driver's rate server: its RateControl shows a split
        node_rates = NodeRates({0: receiver.target}, driver.rate, interval=0.1)
        listed = NodeRates({0: receiver.target, 1: "127.0.0.1:0"}, driver.rate, interval=0.1)
        pb_grpc.add_RateControlServicer_to_server(
            RateControlService(driver.rate, nodes=node_rates.snapshot), rpc
        )
        port = rpc.add_insecure_port("127.0.0.1:0")
        await rpc.start()
        stack.push_async_callback(rpc.stop, None)
        listed = NodeRates({0: receiver.target, 1: f"127.0.0.1:{port}"}, driver.rate, interval=0.1)
        await stack.enter_async_context(listed)
        await wait_until(lambda: node_rate(receiver) == pytest.approx(3_000), timeout=10)
        await asyncio.sleep(0.5)
        assert driver.rate.rate == pytest.approx(3_000) and not driver.rate.pinned
        assert f"node 1 at 127.0.0.1:{port} is a cluster's driver, not a receiver node" in caplog.text
        assert [n.up for n in listed.snapshot()] == [True, False]


async def test_a_cluster_drivers_pinned_rate_is_kept_across_its_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`sluice rate set R --pin --target DRIVER` was lost when the driver restarted: it came back at
    its initial (or recalled) rate under the estimator, while a single node pins its rate again. The
    driver keeps the pin in DATA_DIR/runtime-config.json too (and its end: `rate estimator` unpins),
    pins it again at its start (over a recalled capacity) and says so. Its real RateControl server on
    loopback, steered by the `sluice rate` CLI."""
    from ingest.driver_config import DriverConfig

    config = DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), data_dir=tmp_path / "driver")
    config.data_dir.mkdir()

    def serving() -> Any:
        caplog.clear()
        return _driver_serving_rate(config)

    def rate(*args: str) -> str:
        done = subprocess.run(
            [*SLUICE, "rate", *args], capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    caplog.set_level("INFO", logger="ingest.rate_service")  # pin_again's, a single server's too
    async with serving() as (driver, target):
        assert not driver.rate.pinned
        await asyncio.to_thread(rate, "set", "5000", "--pin", "--target", target)
        assert driver.rate.pinned
    async with serving() as (driver, target):
        assert (driver.rate.pinned, driver.rate.rate) == (True, 5000)
        assert "rate pinned at 5000 records/s" in caplog.text and "runtime-config.json" in caplog.text
        driver.rate_memory.remember("builtin", 40_000.0)  # a capacity remembered does not unpin it
        assert driver.recall("builtin") is None and driver.rate.rate == 5000
        got = await asyncio.to_thread(rate, "get", "--target", target)
        assert "5000 records/s" in got and "pinned" in got, got
        await asyncio.to_thread(rate, "estimator", "spark-pid", "--target", target)  # unpins
        assert not driver.rate.pinned
    async with serving() as (driver, target):
        assert not driver.rate.pinned and driver.rate.rate == 10_000  # the initial rate
        assert "rate pinned" not in caplog.text
        await asyncio.to_thread(rate, "set", "7000", "--pin", "--target", target)
        await asyncio.to_thread(rate, "set", "6000", "--target", target)  # without --pin: unpinned
    async with serving() as (driver, target):
        assert not driver.rate.pinned and driver.rate.rate == 10_000


async def test_a_receiver_node_refuses_an_operators_rate_change_and_takes_the_drivers(tmp_path: Path) -> None:
    """`sluice rate set 5000 --pin --target NODE` on a cluster's receiver node said "rate: 5000 records/s
    (fixed, pinned)", and 0.13 s later the driver pinned the node's share back over it. The node now
    refuses an operator's rate, bounds and estimator (FAILED_PRECONDITION, exit 1, naming the driver's
    RateControl to send them to), while the driver's calls, which name it, still set its share. Reads
    stay allowed. A real receiver node and the driver's real rate server on loopback, the `sluice` CLI."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}

    def rate(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*SLUICE, "rate", *args], capture_output=True, text=True, timeout=60, check=False, env=env
        )

    (cluster,) = loopback_cluster(1)
    port = int(cluster.me.target.rsplit(":", 1)[1])
    async with contextlib.AsyncExitStack() as stack:
        node = await stack.enter_async_context(running_server(tmp_path / "node", cluster=cluster, port=port))
        target = node.target
        was = node.rate.rate
        # no driver has called yet: refused all the same, saying where to go
        refused = await asyncio.to_thread(rate, "set", "5000", "--pin", "--target", target)
        assert refused.returncode == 1, refused
        assert "FAILED_PRECONDITION" in refused.stderr, refused.stderr
        assert "no driver has called this node since it started" in refused.stderr, refused.stderr
        assert "sluice rate set 5000 --pin --target DRIVER_HOST:PORT" in refused.stderr, refused.stderr
        assert (node.rate.rate, node.rate.pinned) == (was, False)
        # the driver: its rate server, and its node rates naming it, as ClusterDriver.start runs them
        config = DriverConfig(
            nodes={0: target},
            streams=("s",),
            data_dir=tmp_path / "driver",
            rate=RateConfig(estimator="fixed", initial_rate=3_000.0),
        )
        driver = ClusterDriver(config)
        await driver.serve_rate()
        stack.push_async_callback(driver.stop)
        driver.node_rates.name_driver("d" * 32, driver.advertised_rate_target())
        driver.node_rates.start()
        await wait_until(lambda: node_rate(node) == pytest.approx(3_000), timeout=10)
        for args, command in (
            (["set", "5000", "--pin"], "sluice rate set 5000 --pin"),
            (["set", "5000"], "sluice rate set 5000"),
            (["bounds", "10", "100000"], "sluice rate bounds 10 100000"),
            (["estimator", "model"], "sluice rate estimator model"),
        ):
            refused = await asyncio.to_thread(rate, *args, "--target", target)
            assert refused.returncode == 1, (args, refused)
            said = refused.stderr
            assert "FAILED_PRECONDITION" in said and "takes its rate from the driver" in said, said
            there = driver.rate_target
            assert f"the driver at {there}: {command} --target {there}" in said, said
            assert "Traceback" not in said
        await asyncio.sleep(0.3)  # nothing an operator sent moved it
        assert node_rate(node) == pytest.approx(3_000)
        assert (node.rate.bounds.min_rate, node.rate.estimator.name) == (100.0, "fixed")
        shown = await asyncio.to_thread(rate, "get", "--target", target)  # reads stay allowed
        assert shown.returncode == 0 and "rate: 3000 records/s (fixed, pinned)" in shown.stdout, shown
        # where it was sent: the driver, whose share for the node follows
        moved = await asyncio.to_thread(rate, "set", "5000", "--pin", "--target", driver.rate_target or "")
        assert moved.returncode == 0, moved
        await wait_until(lambda: node_rate(node) == pytest.approx(5_000), timeout=10)


def test_a_driver_advertised_on_every_address_is_named_by_the_address_it_calls_from() -> None:
    from ingest.rate_service import driver_rate_target

    assert driver_rate_target("10.0.0.9:51109", "ipv4:10.0.0.5:4000") == "10.0.0.9:51109"
    assert driver_rate_target(":51109", "ipv4:10.0.0.5:4000") == "10.0.0.5:51109"
    assert driver_rate_target(":51109", "ipv6:[fd00::5]:4000") == "[fd00::5]:51109"
    assert driver_rate_target("[::1]:51109", "ipv6:[::1]:4000") == "[::1]:51109"
    assert driver_rate_target(":51109", "unix:/x") is None
    assert driver_rate_target("a b:1", "ipv4:10.0.0.5:4000") is None
    assert driver_rate_target("\x1b[2J:1", "ipv4:10.0.0.5:4000") is None


async def test_a_receiver_node_refuses_a_config_set_of_the_drivers_rate_settings(tmp_path: Path) -> None:
    """`sluice config set min-rate=10 --target NODE` (and max-rate, estimator, estimator-params,
    trigger-interval) on a cluster's receiver node was taken and kept, and changed nothing the cluster
    runs by: the driver pins the node's share, runs the estimator and the query. The node now refuses
    them as it refuses `sluice rate bounds` there (FAILED_PRECONDITION, exit 1, nothing changed, the
    whole request), naming the driver and the command to give it; the node's own settings still change.
    A real receiver node and the driver's real rate server on loopback, the `sluice` CLI."""
    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}

    def config(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*SLUICE, "config", *args], capture_output=True, text=True, timeout=60, check=False, env=env
        )

    (cluster,) = loopback_cluster(1)
    port = int(cluster.me.target.rsplit(":", 1)[1])
    async with contextlib.AsyncExitStack() as stack:
        node = await stack.enter_async_context(running_server(tmp_path / "node", cluster=cluster, port=port))
        target = node.target
        # no driver has called yet: refused all the same, saying what to run where
        refused = await asyncio.to_thread(config, "set", "min-rate=10", "--target", target)
        assert refused.returncode == 1, refused
        said = refused.stderr
        assert "FAILED_PRECONDITION" in said and "min-rate" in said, said
        assert "no driver has called this node since it started" in said, said
        assert "sluice rate bounds 10 MAX --target DRIVER_HOST:PORT" in said, said
        assert "Traceback" not in said
        assert node.rate.bounds.min_rate == 100.0 and not node.runtime.overrides
        assert not (tmp_path / "node" / "runtime-config.json").exists()
        # the driver calls the node: its target is named
        driver = ClusterDriver(
            DriverConfig(
                nodes={0: target},
                streams=("s",),
                data_dir=tmp_path / "driver",
                rate=RateConfig(estimator="fixed", initial_rate=3_000.0),
            )
        )
        await driver.serve_rate()
        stack.push_async_callback(driver.stop)
        driver.node_rates.name_driver("d" * 32, driver.advertised_rate_target())
        driver.node_rates.start()
        await wait_until(lambda: node_rate(node) == pytest.approx(3_000), timeout=10)
        there = driver.rate_target
        for args, says in (
            (["min-rate=10", "max-rate=100000"], f"sluice rate bounds 10 100000 --target {there}"),
            (["max-rate=5000"], f"sluice rate bounds MIN 5000 --target {there}"),
            (["estimator=model"], f"sluice rate estimator model --target {there}"),
            (["estimator-params=horizon=3"], "--estimator-params ... at the driver's start"),
            (["trigger-interval=2"], "--trigger-interval"),
            # refused whole: the node's own setting beside it does not change either
            (["block-interval=0.5", "estimator=spark-pid"], f"rate estimator spark-pid --target {there}"),
            (["--validate-only", "max-rate=5000"], f"sluice rate bounds MIN 5000 --target {there}"),
        ):
            refused = await asyncio.to_thread(config, "set", *args, "--target", target)
            assert refused.returncode == 1, (args, refused)
            said = refused.stderr
            assert "FAILED_PRECONDITION" in said and f"the driver at {there}" in said, said
            assert says in said, said
            assert "Traceback" not in said
        await asyncio.sleep(0.3)  # nothing of it reached the node
        assert node_rate(node) == pytest.approx(3_000)
        assert (node.rate.bounds.min_rate, node.rate.bounds.max_rate) == (100.0, INF)
        assert node.rate.estimator.name == "fixed" and node.config.trigger_interval == 1.0
        assert node.config.receiver.block_interval == 0.02 and not node.runtime.overrides
        # the node's own settings change as before; a reset of a rate setting is no change to refuse
        done = await asyncio.to_thread(config, "set", "block-interval=0.05", "--target", target)
        assert done.returncode == 0, done
        assert node.config.receiver.block_interval == 0.05
        reset = await asyncio.to_thread(config, "reset", "min-rate", "--target", target)
        assert reset.returncode == 0, reset
        shown = await asyncio.to_thread(config, "get", "min-rate", "--target", target)  # reads allowed
        assert shown.returncode == 0 and "min-rate" in shown.stdout, shown


async def test_a_receiver_nodes_refusal_of_the_drivers_settings_is_counted_invalid(tmp_path: Path) -> None:
    """A receiver node refused `sluice config set max-rate=...` (a setting the driver runs by) without
    counting it: sluice_config_changes_total showed every other refused change (result="invalid", each
    key of the request) but not these. Each key of such a request is now counted as they are, the
    node's own setting beside them too (the whole request is refused); nothing is counted "applied".
    A real receiver node on loopback, its Admin service over gRPC, its /metrics registry."""
    (cluster,) = loopback_cluster(1)
    port = int(cluster.me.target.rsplit(":", 1)[1])
    async with (
        running_server(tmp_path / "node", cluster=cluster, port=port) as node,
        grpc.aio.insecure_channel(node.target) as channel,
    ):
        stub = pb_grpc.AdminStub(channel)
        for request in (
            pb.SetConfigRequest(set={"max-rate": "5000"}),
            pb.SetConfigRequest(set={"estimator": "model", "block-interval": "0.5"}),
            pb.SetConfigRequest(set={"trigger-interval": "2"}, validate_only=True),
            pb.SetConfigRequest(
                set={"estimator-params": "horizon=3", "min-rate": "10"}, reset=["prefetch", "prefetch"]
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.SetConfig(request)
            assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION, caught.value.details()
        # an invalid value of the node's own setting, counted as before
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SetConfig(pb.SetConfigRequest(set={"block-interval": "-1"}))
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert node.runtime.changes == {
            ("max-rate", "invalid"): 1,
            ("estimator", "invalid"): 1,
            ("block-interval", "invalid"): 2,
            ("trigger-interval", "invalid"): 1,
            ("estimator-params", "invalid"): 1,
            ("min-rate", "invalid"): 1,
            ("prefetch", "invalid"): 1,
        }
        page = generate_latest(node.registry).decode()
        for key in ("max-rate", "estimator", "trigger-interval", "estimator-params", "min-rate"):
            assert f'sluice_config_changes_total{{key="{key}",result="invalid"}} 1.0' in page, page
        assert 'sluice_config_changes_total{key="block-interval",result="invalid"} 2.0' in page, page
        assert 'result="applied"' not in page and "sluice_config_version 0.0" in page, page


async def test_a_receiver_node_ignores_the_drivers_settings_an_earlier_version_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A receiver node's DATA_DIR/runtime-config.json may hold max-rate, min-rate, estimator (...) from
    an earlier version, which took `sluice config set` of them on a node: they were applied at its
    start without a word, and a kept max-rate clamped the share the driver pins it. The start now
    ignores them, takes them out of the file with one WARNING naming each, and keeps the node's own
    settings; `sluice config check` says so. A real node and the driver's real rate server on loopback."""
    import json

    from ingest.cluster_driver import ClusterDriver
    from ingest.driver_config import DriverConfig

    (cluster,) = loopback_cluster(1)
    port = int(cluster.me.target.rsplit(":", 1)[1])
    data = tmp_path / "node"
    data.mkdir()
    kept = {"max-rate": "1000", "min-rate": "500", "estimator": "model", "estimator-params": "horizon=3"}
    runtime = data / "runtime-config.json"
    runtime.write_text(json.dumps({"version": 3, "overrides": {**kept, "block-interval": "0.05"}}))
    nodes = tmp_path / "nodes.txt"
    nodes.write_text(f"0 {cluster.me.target}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    node_args = ["--role", "receiver", "--nodes", str(nodes), "--node-id", "0", "--port", str(port)]
    check = await asyncio.to_thread(
        subprocess.run,
        [*SLUICE, "config", "check", *node_args, "--data-dir", str(data)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert check.returncode == 0, check.stderr
    said = f"{runtime} holds max-rate, min-rate, estimator, estimator-params, kept by an earlier version"
    assert said in check.stderr, check.stderr
    caplog.set_level(logging.WARNING, logger="ingest.runtime_config")
    async with contextlib.AsyncExitStack() as stack:
        node = await stack.enter_async_context(running_server(data, cluster=cluster, port=port))
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, warnings
        for key, value in kept.items():
            assert f"{key} = {value}" in warnings[0], warnings
        assert "ignored, and removed from the file" in warnings[0], warnings
        assert "sluice rate bounds|estimator --target DRIVER_HOST:PORT" in warnings[0], warnings
        # the node's own setting stays in force and in the file; the driver's are gone from both
        assert json.loads(runtime.read_text())["overrides"] == {"block-interval": "0.05"}
        assert node.config.receiver.block_interval == 0.05 and node.runtime.overrides == {
            "block-interval": "0.05"
        }
        assert (node.rate.bounds.min_rate, node.rate.bounds.max_rate) == (100.0, INF)
        assert node.rate.estimator.name == "fixed"
        # the share the driver pins is not clamped to the kept max-rate
        driver = ClusterDriver(
            DriverConfig(
                nodes={0: node.target},
                streams=("s",),
                data_dir=tmp_path / "driver",
                rate=RateConfig(estimator="fixed", initial_rate=3_000.0),
            )
        )
        await driver.serve_rate()
        stack.push_async_callback(driver.stop)
        driver.node_rates.name_driver("d" * 32, driver.advertised_rate_target())
        driver.node_rates.start()
        await wait_until(lambda: node_rate(node) == pytest.approx(3_000), timeout=10)


async def test_a_cluster_drivers_rate_bounds_and_estimator_are_kept_across_its_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`sluice rate bounds` and `sluice rate estimator` on the driver changed its running controller
    only: a restart silently went back to the command line's bounds and estimator, while a single node
    keeps them (settings min-rate, max-rate, estimator in runtime-config.json) and the driver kept a
    pinned rate there already. The driver keeps them in DATA_DIR/runtime-config.json too, starts with
    them (a kept pin clamped into the kept bounds; a kept `fixed` estimator not replaced by a recalled
    capacity) and says so. Its real RateControl server on loopback, steered by the `sluice` CLI."""
    from ingest.driver_config import DriverConfig

    config = DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), data_dir=tmp_path / "driver")
    config.data_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}

    def serving() -> Any:
        caplog.clear()
        return _driver_serving_rate(config)

    def rate(*args: str) -> str:
        done = subprocess.run(
            [*SLUICE, "rate", *args], capture_output=True, text=True, timeout=60, check=False, env=env
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    caplog.set_level("INFO", logger="ingest")
    async with serving() as (driver, target):
        assert (driver.rate.bounds.min_rate, driver.rate.bounds.max_rate) == (100.0, INF)
        await asyncio.to_thread(rate, "bounds", "200", "8000", "--target", target)
        await asyncio.to_thread(rate, "estimator", "spark-pid", "--target", target)
        await asyncio.to_thread(rate, "set", "9000", "--pin", "--target", target)  # clamped to 8000
        assert (driver.rate.rate, driver.rate.pinned) == (8000, True)
    async with serving() as (driver, target):
        assert (driver.rate.bounds.min_rate, driver.rate.bounds.max_rate) == (200, 8000)
        assert driver.rate.estimator.name == "spark-pid"
        assert (driver.rate.rate, driver.rate.pinned) == (8000, True)
        assert "max-rate = 8000.0 (dynamic" in caplog.text and "estimator = spark-pid (dynamic" in caplog.text
        got = await asyncio.to_thread(rate, "get", "--target", target)
        assert "200" in got and "8000" in got and "spark-pid" in got, got
        await asyncio.to_thread(rate, "estimator", "fixed", "--target", target)  # unpins, kept so
        await asyncio.to_thread(rate, "set", "3000", "--target", target)
    async with serving() as (driver, target):
        assert driver.rate.estimator.name == "fixed" and not driver.rate.pinned
        driver.rate_memory.remember("builtin", 7_000.0)  # the operator's fixed estimator is not replaced
        assert driver.recall("builtin") is None
        assert driver.rate.rate == 8000  # the initial rate, clamped into the kept bounds
        await asyncio.to_thread(rate, "bounds", "100", "inf", "--target", target)
        await asyncio.to_thread(rate, "estimator", "model", "--target", target)
    async with serving() as (driver, target):
        assert (driver.rate.bounds.min_rate, driver.rate.bounds.max_rate) == (100.0, INF)
        assert driver.rate.estimator.name == "model" and driver.rate.rate == 10_000


async def test_a_cluster_driver_switches_away_from_the_estimator_its_start_gave_parameters(
    tmp_path: Path,
) -> None:
    """The driver's `sluice rate estimator` to another estimator than --estimator runs it with its own
    defaults, not --estimator-params (which it would refuse); back to --estimator they are in force
    again (rate_service.estimator_change, shared with a single server). Its real RateControl server."""
    from ingest.driver_config import DriverConfig

    start = RateConfig(estimator="spark-pid", estimator_params={"proportional": 0.5})
    config = DriverConfig(nodes={0: "127.0.0.1:1"}, streams=("s",), data_dir=tmp_path / "driver", rate=start)
    config.data_dir.mkdir()
    async with (
        _driver_serving_rate(config) as (driver, target),
        grpc.aio.insecure_channel(target) as channel,
    ):
        rate = pb_grpc.RateControlStub(channel)
        for name in ("model", "fixed"):
            await rate.SetEstimator(pb.SetEstimatorRequest(estimator=name))
            assert driver.rate.estimator.name == name
            assert driver.runtime.overrides["estimator-params"] == ""
        await rate.SetEstimator(pb.SetEstimatorRequest(estimator="spark-pid"))
        assert driver.rate.estimator.state()["proportional"] == 0.5
        assert "estimator-params" not in driver.runtime.overrides


@contextlib.asynccontextmanager
async def _driver_serving_rate(config: Any) -> AsyncIterator[tuple[Any, str]]:
    """A ClusterDriver on `config` (a restart: a new driver on the same data dir) with its real
    RateControl server on a loopback port: (driver, target)."""
    from ingest.cluster_driver import ClusterDriver

    driver = ClusterDriver(config)
    rpc = grpc.aio.server()
    pb_grpc.add_RateControlServicer_to_server(driver.rate_service(), rpc)
    port = rpc.add_insecure_port("127.0.0.1:0")
    await rpc.start()
    try:
        yield driver, f"127.0.0.1:{port}"
    finally:
        await rpc.stop(None)
        await driver.node_rates.close()
        driver.blocks.close()
