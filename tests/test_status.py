"""Operations: gRPC reflection and health on a real server, /status.json against /metrics, and the
/status page rendered by a real headless Chromium while records flow (no Spark: completed batches are
fed to the rate controller, which is what the page reads them from)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import time
import urllib.request
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families
from support import running_server, wait_until

from ingest.config import RateConfig, ServeConfig
from ingest.server import SluiceServer
from ratecontrol import BatchMetrics
from sluice_client import Producer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def reflected(target: str) -> tuple[list[str], list[str]]:
    """Over server reflection (a blocking client, as grpcurl is): the services, and RateControl's methods."""
    with grpc.insecure_channel(target) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = sorted(database.get_services())
        pool = DescriptorPool(database)
        rate = pool.FindServiceByName("ingest.v1.RateControl")
        return services, sorted(method.name for method in rate.methods)


async def health_of(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return response.status


async def test_reflection_lists_the_services(tmp_path: Path) -> None:
    async with running_server(tmp_path, "s") as server:
        services, methods = await asyncio.to_thread(reflected, server.target)
    assert services == [
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "ingest.v1.Admin",
        "ingest.v1.Ingest",
        "ingest.v1.RateControl",
        "ingest.v1.Sessions",
    ]
    assert {"GetRate", "UpdateRate", "SetBounds"} <= set(methods)


async def test_health_follows_the_query(tmp_path: Path) -> None:
    """ "" is SERVING while records are taken and, once a query is attached, while it runs; the intake's
    own service stays SERVING through a query's failure (records are still taken and acked)."""
    async with running_server(tmp_path, "s") as server:
        assert await health_of(server.target, "") == SERVING  # no Spark here: the block log is enough
        failure: list[str] = []
        await server.attach_query(lambda: failure[0] if failure else None)
        assert await health_of(server.target, "") == SERVING
        failure.append("boom: the sink's disk is full")
        deadline = time.monotonic() + 10
        while await health_of(server.target, "") != NOT_SERVING:
            assert time.monotonic() < deadline, "health did not follow the query's failure"
            await asyncio.sleep(0.1)
        assert await health_of(server.target, "ingest.v1.Ingest") == SERVING
        assert server.status.snapshot()["health"] == "NOT_SERVING (query boom: the sink's disk is full)"
        failure.clear()  # e.g. a swap's rollback restarted a query
        deadline = time.monotonic() + 10
        while await health_of(server.target, "") != SERVING:
            assert time.monotonic() < deadline, "health did not come back"
            await asyncio.sleep(0.1)
        target = server.target
    with pytest.raises(grpc.aio.AioRpcError):  # stopped: nothing answers
        await health_of(target, "")


async def test_health_waits_for_the_query_where_spark_runs(tmp_path: Path) -> None:
    config = ServeConfig(
        port=0,
        metrics_port=None,  # not the default 9464: another service on the machine may hold it
        data_dir=tmp_path,
        streams=("s",),
        rate=RateConfig(estimator="fixed"),
        spark=True,
    )
    server = SluiceServer(config)
    await server.start()
    try:
        assert await health_of(server.target, "") == NOT_SERVING  # the query does not run yet
        assert await health_of(server.target, "ingest.v1.Ingest") == SERVING
        await server.attach_query(lambda: None)
        assert await health_of(server.target, "") == SERVING
    finally:
        await server.stop(grace=1)


# ---- the status page -------------------------------------------------------------------------------


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def scrape(port: int) -> dict[tuple[str, str], float]:
    """/metrics: (sample name without sluice_, stream label or "") -> value."""
    text = get(f"http://127.0.0.1:{port}/metrics")
    return {
        (sample.name.removeprefix("sluice_"), sample.labels.get("stream", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if set(sample.labels) <= {"stream"}
    }


@pytest.fixture
async def busy_server(tmp_path: Path) -> AsyncIterator[SluiceServer]:
    """A server (metrics on) taking records on two streams at a limited rate, with a completed batch
    fed every half second as Spark's listener would."""
    async with running_server(tmp_path, "orders", "clicks", metrics=True) as server:
        server.rate.update(20_000)

        async def push(stream: str) -> None:
            async with Producer(server.target, stream) as producer:
                while True:
                    await producer.send_many([b"r" * 80] * 200)

        async def batches() -> None:
            for i in range(10**6):
                await asyncio.sleep(0.5)
                delay = 0.5 + i % 3 / 10
                server.rate.on_batch(BatchMetrics(i, time.monotonic(), 10_000 + i, 0.25, delay, 0.5))

        tasks = [asyncio.create_task(f) for f in (push("orders"), push("clicks"), batches())]
        try:
            yield server
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_status_json_agrees_with_metrics(busy_server: SluiceServer) -> None:
    server = busy_server
    port = server.metrics_port
    assert port is not None
    await wait_until(lambda: len(server.status.snapshot()["history"]["t"]) >= 3, timeout=20)
    before = await asyncio.to_thread(scrape, port)
    numbers = json.loads(await asyncio.to_thread(get, f"http://127.0.0.1:{port}/status.json"))
    after = await asyncio.to_thread(scrape, port)
    totals = numbers["totals"]
    for name in ("records_received_total", "records_acked_total"):
        low = sum(before[(name, s)] for s in ("orders", "clicks"))
        high = sum(after[(name, s)] for s in ("orders", "clicks"))
        assert low <= totals[name] <= high, (name, low, totals[name], high)
        for row in numbers["streams"]:
            assert before[(name, row["stream"])] <= row[name] <= after[(name, row["stream"])]
    assert totals["records_received_total"] > 0
    limits = sum(after[("rate_limit", s)] for s in ("orders", "clicks"))
    assert numbers["rate"]["limit"] == 20_000 == limits
    # the input rate follows the limit (a generous band: one-second samples of a metered flow)
    assert 5_000 < numbers["rate"]["input"] < 40_000, numbers["rate"]
    last = numbers["last_batch"]
    assert last["processing_rate"] == pytest.approx(last["records"] / 0.25)
    assert len(numbers["batches"]["t"]) == len(numbers["batches"]["scheduling_delay"]) >= 2
    # HEAD (a load balancer's probe) is answered on every path, /metrics too (prometheus_client's app
    # said 405 there), with the GET's headers and no body
    for path in ("/metrics", "/status.json", "/status"):
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="HEAD")
        with await asyncio.to_thread(urllib.request.urlopen, request, timeout=10) as response:
            assert response.status == 200 and response.read() == b"", path
            assert int(response.headers["Content-Length"]) > 0, path
    assert {s["state"] for s in numbers["sessions"]} == {"open"} and len(numbers["sessions"]) == 2
    assert numbers["pipeline"] is None and numbers["health"] == "SERVING"


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


class _Values(HTMLParser):
    """data-value attributes of the rendered DOM: by element id, and by (stream, data-field)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.by_stream: dict[tuple[str, str], str] = {}
        self.body: dict[str, str] = {}
        self._stream: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "body":
            self.body = a
        if tag == "tr" and "data-stream" in a:
            self._stream = a["data-stream"]
        if "data-value" in a:
            if "id" in a:
                self.by_id[a["id"]] = a["data-value"]
            if self._stream is not None and "data-field" in a:
                self.by_stream[(self._stream, a["data-field"])] = a["data-value"]

    def handle_endtag(self, tag: str) -> None:
        if tag == "tr":
            self._stream = None


async def run_chromium(*args: str) -> tuple[str, list[str]]:
    """Run headless Chromium; its stdout, and the console lines it logged (any is a failure here)."""
    binary = chromium()
    assert binary is not None
    proc = await asyncio.create_subprocess_exec(
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-extensions",
        "--enable-logging=stderr",
        "--v=0",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 120)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    console = [line for line in err.decode(errors="replace").splitlines() if ":CONSOLE" in line]
    return out.decode(errors="replace"), console


@pytest.mark.skipif(chromium() is None, reason="no chromium binary (Debian: apt-get install chromium)")
async def test_status_page_in_chromium(busy_server: SluiceServer, tmp_path: Path) -> None:
    server = busy_server
    port = server.metrics_port
    assert port is not None
    await wait_until(lambda: len(server.status.snapshot()["batches"]["t"]) >= 4, timeout=20)
    url = f"http://127.0.0.1:{port}/status"
    before = await asyncio.to_thread(scrape, port)
    # virtual time: the page's 1 s poll runs a few times, each fetch answered by the live server
    dom, console = await run_chromium("--virtual-time-budget=3000", "--dump-dom", url)
    after = await asyncio.to_thread(scrape, port)
    assert console == [], console
    page = _Values()
    page.feed(dom)
    assert "data-errors" not in page.body, page.body
    assert int(page.body["data-updates"]) >= 1, "the page never rendered /status.json"

    def number(value: str) -> float:
        return float(value) if value else math.nan

    def bracket(name: str, shown: float, streams: tuple[str, ...] = ("orders", "clicks")) -> None:
        low = sum(before[(name, s)] for s in streams)
        high = sum(after[(name, s)] for s in streams)
        assert low <= shown <= high, (name, streams, low, shown, high)

    ids = page.by_id
    bracket("records_received_total", number(ids["v-records-received"]))
    bracket("records_acked_total", number(ids["v-records-acked"]))
    for stream in ("orders", "clicks"):
        shown = number(page.by_stream[(stream, "records_received_total")])
        bracket("records_received_total", shown, (stream,))
        assert number(page.by_stream[(stream, "rate_limit")]) == after[("rate_limit", stream)]
        assert page.by_stream[(stream, "state")] == "serving"
    assert number(ids["v-rate-limit"]) == 20_000
    assert 5_000 < number(ids["v-input-rate"]) < 40_000
    # the disk only grows here (nothing releases blocks without Spark); buffers are small and bounded
    bracket("wal_disk_bytes", number(ids["v-wal-disk-bytes"]))
    assert 0 <= number(ids["v-buffered-records"]) <= 50_000
    assert 10_000 / 0.25 <= number(ids["v-processing-rate"]) <= 11_000 / 0.25
    assert number(ids["v-batch-duration"]) == 0.25
    assert 0.5 <= number(ids["v-scheduling-delay"]) <= 0.7
    assert int(ids["v-sessions-active"]) == 2
    assert ids["pipeline-state"] == ""  # no Spark query on this node
    assert re.search(r'id="health"[^>]*>SERVING<', dom)

    shot = tmp_path / "status.png"
    _, console = await run_chromium(
        "--virtual-time-budget=3000",
        "--window-size=1400,1800",
        "--hide-scrollbars",
        f"--screenshot={shot}",
        url,
    )
    assert console == [], console
    assert shot.stat().st_size > 20_000  # a drawn page, not a blank one (pytest --basetemp to look at it)


def test_chromium_console_is_read(tmp_path: Path) -> None:
    """The console check above can fail: a page that logs an error is seen."""
    if chromium() is None:
        pytest.skip("no chromium binary (Debian: apt-get install chromium)")
    page = tmp_path / "bad.html"
    page.write_text("<script>undefinedFunction()</script>")
    _, console = asyncio.run(run_chromium("--virtual-time-budget=500", "--dump-dom", page.as_uri()))
    assert any("undefinedFunction" in line for line in console), console


async def test_a_sample_that_keeps_failing_is_logged_once_a_minute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An outside tester, out of file descriptors: `ERROR ingest.status: status sample failed` with a
    full traceback every second (the block log's size, EMFILE). An OSError is one WARNING line without
    a traceback, said again at most once a minute while it lasts, and its end said; anything else keeps
    its traceback, as rarely."""
    import logging

    from ingest import status

    async with running_server(tmp_path / "d", "s") as server:
        board = server.status
        failure: list[Exception] = [OSError(24, "Too many open files")]

        def failing(now: float | None = None) -> None:
            if failure:
                raise failure[0]

        monkeypatch.setattr(board, "sample", failing)
        caplog.set_level(logging.INFO, logger="ingest.status")
        for second in range(150):  # 2.5 minutes, one sample a second
            board.sample_logged(1000.0 + second)
        said = [r for r in caplog.records if r.name == "ingest.status"]
        assert len(said) == 3, [r.getMessage() for r in said]  # at 0, 60 and 120 s
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in said)
        assert "status sample failed: [Errno 24] Too many open files" in said[0].getMessage()
        assert "(61 failed in a row)" in said[1].getMessage(), said[1].getMessage()
        caplog.clear()
        failure.clear()
        board.sample_logged(1150.0)
        board.sample_logged(1151.0)
        assert [r.getMessage() for r in caplog.records] == [
            "status samples again after 150 failed in a row (150 s)"
        ]
        caplog.clear()
        failure.append(KeyError("stream"))
        for second in range(70):
            board.sample_logged(2000.0 + second)
        assert [r.levelno for r in caplog.records] == [logging.ERROR, logging.ERROR]
        assert all(r.exc_info is not None for r in caplog.records)
        assert status.FAILURE_SAID_EVERY == 60.0


async def test_the_samplers_families_are_the_scrapes(busy_server: SluiceServer) -> None:
    """The status page's once-a-second sample asks the collector for four families only (at 1,000
    streams the whole set was 30,000 samples a second on the event loop): each family asked for is the
    scrape's, and only those come."""
    collector = busy_server.status._collector
    every = {family.name: family for family in collector.collect()}
    for only in (("records_received", "buffered_records", "wal_disk_bytes"), ("credit_paused",), ()):
        some = {family.name: family for family in collector.collect(only)}
        assert set(some) == {f"sluice_{name}" for name in only}, only
        for name, family in some.items():
            labels = [(s.name, s.labels) for s in family.samples]
            assert labels == [(s.name, s.labels) for s in every[name].samples], name
