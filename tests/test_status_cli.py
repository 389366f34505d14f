"""`sluice status` as a user runs it (a subprocess) against a real server with TLS and tokens: over
gRPC, and from the metrics port's /status.json."""

from __future__ import annotations

import asyncio
import http.server
import itertools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from pki import CertificateAuthority
from support import Proxy, running_server, serving_page
from test_metrics_security import TOKENS, auth_file

from ingest.config import SecurityConfig, TlsConfig
from ingest.status_cli import MAX_PAGE_BYTES, StatusReadError, read_http
from sluice_client import Credentials, Producer

SLUICE = str(Path(sys.executable).parent / "sluice")


async def status(
    *args: str, token: str | None, environ: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["COLUMNS"] = "160"  # a wide "terminal": rich wraps nothing
    env.update(environ or {})
    if token is not None:
        env["SLUICE_TOKEN"] = token
    return await asyncio.to_thread(
        subprocess.run,
        [SLUICE, "status", "--once", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


async def test_status_once_over_grpc_and_status_json(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    cert = ca.issue("localhost", server=True, file_stem="server")
    tls_config = TlsConfig(cert.cert_file, cert.key_file)
    security = SecurityConfig(tls=tls_config, metrics_tls=True, auth_file=auth_file(tmp_path / "a.toml"))
    data = tmp_path / "data"
    async with running_server(data, "orders", "clicks", metrics=True, security=security) as server:
        server.rate.update(50_000)
        credentials = Credentials(root_certificates=ca.cert_file.read_bytes(), token=TOKENS["producer"])
        target = f"localhost:{server.port}"
        producer = Producer(target, "orders", producer_id="producer-seen-by-status", credentials=credentials)
        async with producer as p:
            await p.send_many([b"x" * 50] * 3_000)
            await p.flush(timeout=30)
            tls = ["--target", target, "--ca-file", str(ca.cert_file)]
            shown = await status(*tls, token=TOKENS["reader"])
            assert shown.returncode == 0, shown.stderr
            out = shown.stdout
            assert "(gRPC" in out and "SERVING" in out
            assert "50,000 rec/s" in out  # the rate limit
            assert "orders" in out and "clicks" in out and "serving" in out
            assert "producer-seen-by-status" in out  # its session is open
            assert "no Spark query on this node" in out

            metrics = f"https://localhost:{server.metrics_port}"
            shown = await status(*tls, "--metrics", metrics, token=TOKENS["reader"])
            assert shown.returncode == 0, shown.stderr
            assert "(status.json" in shown.stdout and "records received" in shown.stdout
            assert "3,000" in shown.stdout  # received and acked
            assert "producer-seen-by-status" in shown.stdout

            for extra in ([], ["--metrics", metrics]):
                refused = await status(*tls, *extra, token=None)
                assert refused.returncode == 3, refused.stderr  # no token: refused, said so
                assert "status of" in refused.stderr
            bad = await status(*tls, "--metrics", "file:///etc/passwd", token=TOKENS["reader"])
            assert bad.returncode == 2 and "http:// or https://" in bad.stderr


def test_extreme_numbers_are_shown_short() -> None:
    """An operator may set a rate of 1e300 or 1e-6 records/s: the status shows it in a few characters."""
    from ingest.status_cli import _measured, _num, _rate

    assert _rate(1e300) == "1e+300" and _rate(None) == "unlimited"
    assert _num(1e-6) == "1e-06" and _num(0) == "0" and _num(0.5) == "0.5"
    assert _num(2_500_000) == "2.50M" and _num(12_345) == "12,345"
    # a measured rate decaying while idle is 0, not 7.25e-49
    assert _measured(7.25e-49) == "0" and _measured(None) == "-" and _measured(12.5) == "12.5"


def _column(text: str, widths: list[int], index: int) -> str:
    """What column `index` of a drawn table holds, its pieces joined (a folded cell's lines too)."""
    body = text.split("─\n", 1)[1]  # below the header's rule
    start = sum(widths[:index]) + 2 * index
    return "".join(line[start : start + widths[index]].strip() for line in body.splitlines())


@pytest.mark.parametrize("width", [80, 120])
def test_names_are_shown_whole_and_no_column_is_pushed_off_the_screen(width: int) -> None:
    """On an 80-column terminal the driver's node table cut every target to "127.0.0.1:51…", and a
    session's UUID producer id pushed the session's credit, seqs and state off the screen. A node's
    target stays whole on its line (the share's reason wraps instead); a name that cannot fit beside
    the rest folds onto more lines; nothing is cut."""
    from rich.console import Console

    from ingest.status_cli import _nodes, _sessions, _streams

    share = "idle: keeps a floor to ramp from"
    targets = [f"receiver-{i}.example.internal:51101" for i in (0, 1)]
    nodes = [
        {
            "node": i,
            "target": target,
            "up": True,
            "input_rate": 33084.0,
            "rate_limit": 91015.0,
            "backlog": 18369,
            "share": share,
        }
        for i, target in enumerate(targets)
    ]
    streams = [
        {
            "stream": "clickstream-eu-west-production",
            "state": "serving",
            "input_rate": 1.0,
            "rate_limit": 5.0,
            "share": share,
            "backlog": 0,
            "sessions_active": 1,
            "credit_paused": [],
        }
    ]
    producers = ["3f2a9c0e5b7d4e1f8a6b2c3d4e5f6a7b", "producer-of-the-billing-pipeline-7"]
    sessions = [
        {
            "session_id": 12345 + i,
            "stream": "clickstream-eu-west",
            "principal": "anonymous",
            "producer_id": producer,
            "credit": 250000,
            "next_seq": 123456789,
            "durable_up_to": 123450000,
            "state": "open",
        }
        for i, producer in enumerate(producers)
    ]
    for table, names, index, words in (
        (_nodes({"nodes": nodes}), targets, 1, ["33,084", "91,015", "18,369", "share"]),
        (_streams({"streams": streams}), ["clickstream-eu-west-production"], 0, ["serving", "paused"]),
        (_sessions({"sessions": sessions}), producers, 3, ["250,000", "123.46M", "123.45M", "open"]),
    ):
        console = Console(width=width, record=True)
        console.print(table)
        text = console.export_text()
        assert "…" not in text, text
        for word in words:
            assert word in text, text
        assert _column(text, table.widths(width), index) == "".join(names), text
    nodes_text = Console(width=80, record=True)
    nodes_text.print(_nodes({"nodes": nodes}))
    drawn = nodes_text.export_text()
    for target in targets:
        assert target in drawn, drawn


def test_the_streams_figures_and_headers_are_shown_whole_in_80_columns() -> None:
    """With two streams of every default on an 80-column terminal the streams table showed "unlimi…"
    for the rate limit and the share, "sessio…" and "credi"/"pause" for headers: a figure is never cut,
    a header wraps between its words."""
    from rich.console import Console

    from ingest.status_cli import _streams

    streams = [
        {
            "stream": name,
            "state": "serving",
            "input_rate": 146894.0,
            "rate_limit": None,
            "share": "unlimited",
            "backlog": 100000,
            "sessions_active": 12,
            "credit_paused": [],
        }
        for name in ("a", "b")
    ]
    console = Console(width=80, record=True)
    console.print(_streams({"streams": streams}))
    text = console.export_text()
    assert "…" not in text, text
    for word in ("unlimited", "146,894", "100,000", "sessions", "credit", "paused", "backlog"):
        assert word in text, text


async def test_status_once_piped_keeps_headers_and_reasons_whole(tmp_path: Path) -> None:
    """`sluice status --once` in a script: rich laid it out for 80 columns, headers split ("stre" /
    "am") and a share's reason folded a fragment a line, 21 lines a stream. Piped and without COLUMNS,
    it lays the tables out as wide as they want now (up to 200 columns)."""
    async with running_server(tmp_path / "d", "a", "b", "c", metrics=True) as server:
        server.rate.update(50)  # a rate that holds every stream: its share's reason is long text
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        shown = await asyncio.to_thread(
            subprocess.run,
            [SLUICE, "status", "--once", "--target", server.target],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    header = next(line.split() for line in lines if line.split()[:1] == ["stream"])
    assert "credit" in header, shown.stdout
    assert len(lines) < 40, shown.stdout
    assert max(len(line) for line in lines) <= 200


def _first_line_then_gone(args: list[str]) -> int:
    """`sluice status ARGS | head -1`: read its first line, close the pipe, its exit code."""
    proc = subprocess.Popen([SLUICE, "status", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    assert proc.stdout.readline()
    proc.stdout.close()
    return proc.wait(timeout=60)


@pytest.mark.parametrize("once", [False, True], ids=["live", "once"])
async def test_status_piped_into_a_reader_that_goes_away_exits_0(tmp_path: Path, once: bool) -> None:
    """`sluice status | head -5`: rich's Console ends a broken pipe with SystemExit(1), where every other
    command takes a reader of stdout gone away for no failure (exit 0); the documented exit 1 is for a
    status that cannot be read."""
    async with running_server(tmp_path / "d", "a", metrics=True) as server:
        args = ["--target", server.target, *(["--once"] if once else [])]
        assert await asyncio.to_thread(_first_line_then_gone, args) == 0


async def test_status_metrics_does_not_follow_a_redirect_with_the_token(tmp_path: Path) -> None:
    """urllib followed a 302 with every header of the request: the operator's bearer token went to
    whatever host the redirect named. The redirect is refused now, naming where it pointed."""
    received: list[str | None] = []

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            received.append(self.headers.get("Authorization"))
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    elsewhere = f"http://127.0.0.1:{other.server_address[1]}/x"

    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(302)
            self.send_header("Location", elsewhere)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    redirect = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    servers = [other, redirect]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        url = f"http://127.0.0.1:{redirect.server_address[1]}"
        shown = await status("--metrics", url, token=TOKENS["reader"])
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert received == []  # the other host heard nothing, token or not
    assert shown.returncode == 1, shown.stderr
    assert shown.stderr.count("\n") == 1, shown.stderr
    assert f"redirects to {elsewhere}" in shown.stderr and "not followed" in shown.stderr


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"<html>not json</html>", "not a Sluice status page: not JSON"),
        (b"[1, 2, 3]", "not a Sluice status page: a JSON list, not an object"),
        (b'{"a":' * 100_000, "not a Sluice status page: not JSON (RecursionError"),
        (b'{"streams": "nope", "rate": null, "history": 5}', "not in the shape this sluice reads"),
    ],
    ids=["html", "list", "deep", "shape"],
)
async def test_status_metrics_of_something_else_is_one_line(body: bytes, says: str) -> None:
    """A /status.json of another version, or another server on that port, printed a traceback (a
    TypeError, AttributeError or RecursionError): one line now, exit 1."""

    with serving_page(body) as url:
        shown = await status("--metrics", url, token=None)
    assert shown.returncode == 1, shown.stderr
    assert shown.stderr.count("\n") == 1 and "Traceback" not in shown.stderr, shown.stderr
    assert says in shown.stderr, shown.stderr


async def test_status_metrics_of_a_broken_url_is_one_line() -> None:
    shown = await status("--metrics", "http://[::1", token=None)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert "not a URL: Invalid IPv6 URL" in shown.stderr, shown.stderr


@pytest.mark.parametrize("url", ["http://ops:s3cret@127.0.0.1:9464", "ftp://ops:s3cret@host/x"])
async def test_a_refused_metrics_url_does_not_print_its_password(url: str) -> None:
    shown = await status("--metrics", url, token=None)
    assert shown.returncode == 2 and "Traceback" not in shown.stderr, shown.stderr
    assert "s3cret" not in shown.stderr and "ops:***@" in shown.stderr, shown.stderr


@pytest.mark.parametrize("tail", ["", "#frag", "?x=1"])
async def test_status_metrics_port_past_65535_sends_no_token_elsewhere(tail: str) -> None:
    """An outside tester's `--metrics http://127.0.0.1:99999`: urllib took the port modulo 2^16 and sent
    the bearer token to port 34463, whatever listened there. A port past 65535, a user in the URL (read
    as part of the host), a query or a fragment (which swallowed the /status.json added after it) are
    usage errors now, exit 2, and nothing is sent."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        for url in (f"http://127.0.0.1:{port + 65536}{tail}", f"http://u:p@127.0.0.1:{port}{tail}"):
            shown = await status("--metrics", url, token="a-secret-token")
            assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


@pytest.mark.parametrize("content_length", [True, False], ids=["content-length", "until-close"])
async def test_status_metrics_reads_no_more_than_a_status_page_may_have(content_length: bool) -> None:
    """`status --metrics` read the page whole, however large: an endpoint sending gigabytes had them all
    held in memory (then parsed). It stops past MAX_PAGE_BYTES (at once when the Content-Length says
    so), one line, exit 1."""
    body = b" " * (MAX_PAGE_BYTES + 1)
    with serving_page(body, content_length=content_length) as url:
        shown = await status("--metrics", url, token=None)
    assert shown.returncode == 1, shown.stderr
    assert shown.stderr.count("\n") == 1 and "Traceback" not in shown.stderr, shown.stderr
    said = "the page is 16,777,217 bytes" if content_length else "the page goes on past the 16,777,216 bytes"
    assert said in shown.stderr and "a status page may have" in shown.stderr, shown.stderr
    with serving_page(b" " * (MAX_PAGE_BYTES - 2) + b"{}", content_length=content_length) as url:
        assert read_http(f"{url}/status.json", Credentials()) == {"source": "status.json"}  # at the bound


async def test_status_metrics_gives_up_on_a_page_sent_a_byte_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each read had CALL_TIMEOUT, the whole page none: one that came a byte every second held `status
    --metrics` for as long as it went on. The whole read has CALL_TIMEOUT now."""
    import ingest.status_cli

    monkeypatch.setattr(ingest.status_cli, "CALL_TIMEOUT", 1.0)
    with serving_page(b"{" + b" " * 100 + b"}", drip=0.1) as url:
        started = time.monotonic()
        with pytest.raises(
            StatusReadError, match=r"the page did not come whole within 1 s \(\d+ bytes came\)"
        ):
            await asyncio.to_thread(read_http, f"{url}/status.json", Credentials())
        took = time.monotonic() - started
    assert took < 5, took


async def test_live_status_to_a_pipe_prints_a_frame_every_second(tmp_path: Path) -> None:
    """`sluice status` (live) piped into a file or a pipe printed nothing while it ran and one frame
    at Ctrl-C (rich's Live redraws on a terminal only; after a SIGTERM, nothing at all). Not on a
    terminal it prints a whole frame every second now, flushed at once, without cursor control."""
    import signal

    async with running_server(tmp_path / "d", "s") as server:
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        proc = await asyncio.create_subprocess_exec(
            SLUICE,
            "status",
            "--target",
            server.target,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None and proc.stderr is not None
        seen: list[tuple[float, bytes]] = []

        async def take() -> None:
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                seen.append((time.monotonic(), line))

        reader = asyncio.create_task(take())
        try:
            # the first frame within the start (generous: a shared machine), then one a second
            deadline = time.monotonic() + 60
            while not any(b"sluice status" in line for _, line in seen) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(4.5)
            titles = [at for at, line in seen if line.startswith(b"sluice status")]
        finally:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 30)
            await asyncio.wait_for(reader, 30)
    text = b"".join(line for _, line in seen)
    assert b"\x1b" not in text, text  # no cursor control, no colours
    assert len(titles) >= 3, text.decode()  # about 5 frames in 4.5 s; at least 3 on a slow machine
    assert max(b - a for a, b in itertools.pairwise(titles)) < 3.0, titles
    assert text.count(b"\nstream ") >= len(titles), text.decode()  # each frame whole, its streams table


async def test_status_shows_a_cluster_nodes_config_mismatch_with_its_peers(tmp_path: Path) -> None:
    """A receiver node configured otherwise than its peers (another replication, node list) refuses or
    is refused replication: it logged an ERROR and counted sluice_cluster_config_mismatch_peers, but
    `sluice status` showed the node as fine. It now says it first, naming both configurations, over
    gRPC and from /status.json; and nothing of it while the nodes agree."""
    import dataclasses

    from rich.console import Console
    from support import loopback_cluster, wait_until
    from test_replication import nodes

    from ingest.status_cli import render

    agreed = loopback_cluster(2, replication=2)
    async with nodes(tmp_path / "agreed", agreed) as servers:
        await wait_until(lambda: servers[0].node is not None and bool(servers[0].node.replicator.status()))
        shown = await status("--target", agreed[0].me.target, token=None)
        assert shown.returncode == 0, shown.stderr
        assert "SERVING" in shown.stdout and "mismatch" not in shown.stdout, shown.stdout
        assert servers[0].status.snapshot()["config_mismatches"] == []

    clusters = loopback_cluster(2, replication=2)
    clusters[1] = dataclasses.replace(clusters[1], replication=1)
    async with nodes(tmp_path / "mismatched", clusters) as servers:
        node0, node1 = servers[0].node, servers[1].node
        assert node0 is not None and node1 is not None
        await wait_until(lambda: bool(node0.mismatches.peers() and node1.mismatches.peers()), timeout=20)
        for me, server in servers.items():
            shown = await status("--target", clusters[me].me.target, token=None)
            assert shown.returncode == 0, shown.stderr
            lines = shown.stdout.splitlines()
            assert "config mismatch with 1 peer (replication refused):" in lines[1], shown.stdout
            words = (
                "node 0 has 2 nodes and replication 2" if me == 1 else "node 1 has 2 nodes and replication 1"
            )
            assert words in shown.stdout, shown.stdout
            assert "give every node the same node list (--nodes) and --replication" in shown.stdout
            page = server.status.snapshot()  # /status.json
            assert len(page["config_mismatches"]) == 1 and words in page["config_mismatches"][0]
            console = Console(width=200, record=True)
            console.print(render(page, "node"))
            assert "config mismatch with 1 peer" in console.export_text()


async def test_status_metrics_sends_nothing_in_plaintext_that_was_meant_for_tls(tmp_path: Path) -> None:
    """An outside tester's `sluice status --ca-file ca.pem --metrics http://...`: the CA was ignored and
    the bearer token went in cleartext (the user meant TLS). A certificate flag with an http:// URL is
    a usage error now, whatever the host, and so is a token over http:// to a host that is not a
    loopback one (unless --insecure): exit 2, one line, and nothing reaches the port."""
    ca = CertificateAuthority(tmp_path / "pki")
    client = ca.issue("status-reader", file_stem="client")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        for flags, words in (
            (["--ca-file", str(ca.cert_file)], "but --ca-file is for TLS"),
            (
                ["--cert-file", str(client.cert_file), "--key-file", str(client.key_file)],
                "but --cert-file and --key-file are for TLS",
            ),
        ):
            for token in ("a-secret-token", None):
                shown = await status(*flags, "--metrics", url, token=token)
                assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
                assert f"--metrics {url} is plain http://, {words}" in shown.stderr, shown.stderr
                assert "give an https:// URL" in shown.stderr and "nothing was sent" in shown.stderr
                assert ("the token too" in shown.stderr) == (token is not None), shown.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    # a token over http:// off loopback: refused before the name is even looked up
    far = "http://metrics.example.invalid:9464"
    shown = await status("--metrics", far, token="a-secret-token")
    assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
    assert "refusing to send the bearer token in cleartext over http:// to metrics.example.invalid" in (
        shown.stderr
    )
    # without a token there is nothing to protect; with --insecure the operator accepts it: both try
    for args, token in (([], None), (["--insecure"], "a-secret-token")):
        shown = await status(*args, "--metrics", far, token=token)
        assert shown.returncode == 1 and "refusing" not in shown.stderr, shown.stderr
        assert f"status of {far}: " in shown.stderr
    shown = await status("--insecure", token=None)  # over gRPC the credentials say TLS or not
    assert shown.returncode == 2 and "--insecure goes with --metrics http://" in shown.stderr


async def test_status_metrics_over_loopback_http_still_sends_the_token(tmp_path: Path) -> None:
    """The documented `sluice status --metrics http://127.0.0.1:9464` (a TLS gRPC port's CA in
    SLUICE_CA_FILE beside it) still reads a plaintext metrics port on loopback, with the token."""
    received: list[str | None] = []

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            received.append(self.headers.get("Authorization"))
            body = b'{"rate": {}, "streams": []}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    page = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=page.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{page.server_address[1]}"
        ca = CertificateAuthority(tmp_path / "pki")
        environ = {"SLUICE_CA_FILE": str(ca.cert_file)}
        shown = await status("--metrics", url, token="a-secret-token", environ=environ)
    finally:
        page.shutdown()
        page.server_close()
    assert shown.returncode == 0, shown.stderr
    assert received == ["Bearer a-secret-token"]


async def test_status_and_rate_against_another_grpc_service_say_it_is_not_sluice() -> None:
    """A gRPC server without Sluice's services (another service on the port, a wrong --target) answered
    `sluice status` and `sluice rate get` with gRPC's own "UNIMPLEMENTED: Method not found!" alone."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    other = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), other)
    port = other.add_insecure_port("127.0.0.1:0")
    await other.start()
    try:
        target = f"127.0.0.1:{port}"
        shown = await status("--target", target, token=None)
        rate = await asyncio.to_thread(
            subprocess.run,
            [SLUICE, "rate", "get", "--target", target],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        await other.stop(None)
    for run in (shown, rate):
        assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr
        assert "UNIMPLEMENTED" in run.stderr and "a Sluice server's gRPC port" in run.stderr, run.stderr


async def test_live_status_gets_past_a_connection_cut_without_a_fin(tmp_path: Path) -> None:
    """`sluice status` (live) kept its gRPC channel without keepalive: once the connection was cut
    without a FIN or RST (a host powered off, a NAT that dropped the flow), every read timed out and it
    said "retrying" for as long as the kernel kept the connection, never seeing the server again. With
    the Spark side's keepalive (keepalive.node_channel_options) the dead connection is closed within
    some 20 s, the channel connects anew, and the frames show the server again; meanwhile they say it
    is unreachable. Ctrl-C ends it, exit 0."""
    import signal

    async with running_server(tmp_path / "d", "s") as server:
        proxy = Proxy(server.target)
        target = await proxy.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
        proc = await asyncio.create_subprocess_exec(
            SLUICE,
            "status",
            "--target",
            target,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None and proc.stderr is not None
        frames: list[tuple[float, str]] = []  # (when its title came, the frame)

        async def take() -> None:
            assert proc.stdout is not None
            while line := await proc.stdout.readline():
                text = line.decode()
                if text.startswith("sluice status"):
                    frames.append((time.monotonic(), text))
                elif frames:
                    frames[-1] = (frames[-1][0], frames[-1][1] + text)

        def read(frame: str) -> bool:
            return "cannot read the status" not in frame and "\nstream " in frame

        reader = asyncio.create_task(take())
        try:
            deadline = time.monotonic() + 60
            while not any(read(f) for _, f in frames[:-1]):  # a whole frame, read
                assert time.monotonic() < deadline, frames
                await asyncio.sleep(0.1)
            proxy.cut()
            cut = time.monotonic()
            deadline = cut + 60
            while not any(at > cut and not read(f) for at, f in frames[:-1]):
                assert time.monotonic() < deadline, frames
                await asyncio.sleep(0.1)
            failed = next(f for at, f in frames[:-1] if at > cut and not read(f))
            assert "the server is unreachable" in failed and "(retrying)" in failed, failed
            while not any(at > cut + 5 and read(f) for at, f in frames[:-1]):  # back, on a new connection
                assert time.monotonic() < deadline, [f for at, f in frames if at > cut]
                await asyncio.sleep(0.1)
            back = next(at for at, f in frames[:-1] if at > cut + 5 and read(f))
            assert back - cut < 45, back - cut
        finally:
            proc.send_signal(signal.SIGINT)
            await asyncio.wait_for(proc.wait(), 30)
            await asyncio.wait_for(reader, 30)
            await proxy.close()
        said = (await proc.stderr.read()).decode()
        assert proc.returncode == 0, said
        assert "Traceback" not in said, said
