"""`sluice status`: the status page's numbers in a terminal, redrawn every second (rich).

By default it asks the server over gRPC, with the client's credentials like every other command:
RateControl.GetRate (the rate, each stream's share and intake, the last batch), Admin.ListStreams,
Sessions.ListSessions and Admin.GetPipeline. gRPC does not carry the byte counts (buffered, the block
log on disk) nor the record counters: given --metrics URL it reads the page's own /status.json instead
(the token as a bearer header, the CA and client certificate for HTTPS), which has them all.
"""

from __future__ import annotations

import asyncio
import email.message
import http.client
import json
import math
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich import box
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ingest.client_hints import connect_hint, refused
from ingest.config import is_loopback
from receivers.errors import printable
from sluice_client.credentials import Credentials
from sluice_client.keepalive import node_channel_options
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

Json = dict[str, Any]
REFRESH = 1.0
"""Seconds between frames."""
CALL_TIMEOUT = 5.0
"""Seconds for a gRPC call, and for the whole read of /status.json (connect, headers and body)."""
MAX_PAGE_BYTES = 16 * 1024 * 1024
"""The most of /status.json read (a server's of 1,000 streams and sessions is some hundreds of KB):
past it the read stops, an error, rather than hold whatever an endpoint sends."""
MAX_ERROR_BYTES = 4096
"""The most of an HTTP error's body read, to say why (cut there)."""
_CHUNK = 64 * 1024


class StatusReadError(Exception):
    """The numbers could not be read; `denied` when the server refused the credentials."""

    def __init__(self, message: str, *, denied: bool = False) -> None:
        super().__init__(message)
        self.denied = denied


def _unreachable(code: grpc.StatusCode) -> str:
    """What a failed read says before gRPC's status: whether the server could not be reached at all."""
    if code is grpc.StatusCode.UNAVAILABLE:
        return "the server is unreachable: "
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the server is unreachable or stalled, no answer within {CALL_TIMEOUT:g} s: "
    return ""


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


async def read_grpc(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], *, secure: bool = False
) -> Json:
    """The numbers over gRPC, shaped as /status.json (what gRPC does not carry is left out); `secure`:
    the channel is TLS (what a failure's hint says)."""
    rate_stub, admin = pb_grpc.RateControlStub(channel), pb_grpc.AdminStub(channel)
    try:
        rate = await rate_stub.GetRate(pb.GetRateRequest(), metadata=metadata, timeout=CALL_TIMEOUT)
        if rate.nodes:  # a cluster's driver: no streams or sessions of its own, the nodes' rates
            streams, sessions = pb.StreamsView(), pb.ListSessionsResponse()
        else:
            streams, sessions = await asyncio.gather(
                admin.ListStreams(pb.ListStreamsRequest(), metadata=metadata, timeout=CALL_TIMEOUT),
                pb_grpc.SessionsStub(channel).ListSessions(
                    pb.ListSessionsRequest(), metadata=metadata, timeout=CALL_TIMEOUT
                ),
            )
    except grpc.aio.AioRpcError as exc:
        details = exc.details() or ""
        hint = connect_hint(exc.code(), details, secure=secure)
        denied = refused(exc.code(), details)
        raise StatusReadError(
            _unreachable(exc.code()) + f"{exc.code().name}: {details}{hint}", denied=denied
        ) from None
    try:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT
        )
        serving = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
    except grpc.aio.AioRpcError as exc:
        serving = f"health unknown ({exc.code().name})"
    pipeline: Json | None = None
    try:
        view = await admin.GetPipeline(pb.GetPipelineRequest(), metadata=metadata, timeout=CALL_TIMEOUT)
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:  # that one: no Spark query on this node
            raise StatusReadError(f"{_unreachable(exc.code())}{exc.code().name}: {exc.details()}") from None
    else:
        pipeline = {
            "pipeline": view.pipeline or "built-in Parquet sink",
            "generation": view.generation,
            "state": view.state,
            "trigger_interval": view.trigger_interval_seconds,
            "last_swap": (
                {
                    "from": view.last_swap.from_pipeline or "built-in",
                    "to": view.last_swap.to_pipeline or "built-in",
                    "outcome": view.last_swap.outcome,
                    "duration": view.last_swap.duration_seconds,
                    "error": view.last_swap.error,
                }
                if view.HasField("last_swap")
                else None
            ),
        }
    shares = {s.stream: s for s in rate.streams}
    rows = []
    for view_ in streams.streams:
        share = shares.get(view_.stream)
        rows.append(
            {
                "stream": view_.stream,
                "state": view_.state,
                "backlog": view_.backlog,
                "sessions_active": view_.sessions,
                "rate_limit": _finite(share.records_per_second) if share is not None else None,
                "input_rate": share.taken_per_second if share is not None else None,
                "share": share.share_reason if share is not None else None,
                "credit_paused": list(share.credit_paused) if share is not None else [],
            }
        )
    last = None
    if rate.HasField("last_batch"):
        b = rate.last_batch
        delay = b.processing_delay_seconds
        last = {
            "batch_id": b.batch_id,
            "records": b.records,
            "processing_rate": b.records / delay if b.records > 0 and delay > 0 else None,
            "scheduling_delay": b.scheduling_delay_seconds,
            "batch_duration": delay,
        }
    return {
        "source": "gRPC",
        "health": serving,
        "rate": {
            "limit": _finite(rate.records_per_second),
            "min": _finite(rate.min_rate),
            "max": _finite(rate.max_rate),
            "estimator": rate.estimator,
            "pinned": rate.pinned,
            # a driver takes nothing itself: its input is the nodes'
            "input": sum(s.taken_per_second for s in (rate.nodes or rate.streams)),
        },
        "last_batch": last,
        "streams": rows,
        "sessions": [
            {
                "session_id": s.session_id,
                "stream": s.stream,
                "principal": s.principal,
                "producer_id": s.producer_id,
                "credit": s.credit,
                "next_seq": s.next_seq,
                "durable_up_to": s.durable_up_to,
                "state": "cancelled" if s.cancelled else "completed" if s.completed else "open",
            }
            for s in sessions.sessions
        ],
        "pipeline": pipeline,
        "config_mismatches": list(rate.config_mismatches),
        "nodes": [
            {
                "node": n.node_id,
                "target": n.target,
                "up": n.up,
                "rate_limit": _finite(n.records_per_second),
                "input_rate": n.taken_per_second,
                "busy": n.busy,
                "backlog": n.backlog,
                "share": n.reason,
            }
            for n in rate.nodes
        ],
    }


def _masked(url: str) -> str:
    """`url` with the password of its user info starred: an error message must not print it."""
    return re.sub(r"(//[^/@]*?):[^/@]*@", r"\1:***@", url)


def status_json_url(url: str) -> str:
    """--metrics: the metrics port's base URL (http://host:9464), or /status.json itself (ValueError
    for a URL that is not http or https, or not HOST:PORT and a path)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--metrics takes an http:// or https:// URL, got {_masked(url)!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        # read: a port past 65535 was taken modulo 2^16, so the token went to another port
        port = parts.port
    except ValueError as exc:  # "http://[::1", a port that is not one
        raise ValueError(f"--metrics: not a URL: {exc}") from None
    if not parts.hostname or port == 0 or parts.username is not None or parts.query or parts.fragment:
        # a user, a query or a fragment: the host was misread ("u:p@host") or /status.json lost
        raise ValueError(f"--metrics takes http(s)://HOST:PORT, a path at most, got {_masked(url)!r}")
    url = url.rstrip("/")
    for tail in ("/status.json", "/status", "/metrics"):
        url = url.removesuffix(tail)
    return url + "/status.json"


def check_metrics_transport(url: str, *, token: bool, tls_flags: list[str], insecure: bool = False) -> None:
    """ValueError where `sluice status --metrics URL` would send what the user meant for TLS in
    plaintext, checked before anything is sent (`url` as given, already valid: status_json_url):
    `tls_flags` (the certificate flags given on the command line, --ca-file, ...) with an http:// URL,
    whatever its host: they are for https:// only, and the read would go unencrypted, the bearer token
    in the clear; or, unless `insecure`, a `token` over http:// to a host that is not a loopback one,
    where anyone on the way reads it (curl would send it; but RFC 6750 requires TLS for a bearer token,
    and the server itself serves plaintext /metrics off loopback only under its own --insecure)."""
    if not url.startswith("http://"):
        return
    host = urllib.parse.urlsplit(url).hostname or ""
    if tls_flags:
        given = " and ".join(tls_flags)
        raise ValueError(
            f"--metrics {url} is plain http://, but {given} {'is' if len(tls_flags) == 1 else 'are'} for "
            f"TLS: nothing was sent (it would have gone unencrypted{', the token too' if token else ''}); "
            "give an https:// URL (the metrics port serves HTTPS with --metrics-tls), or leave "
            f"{given} out for a plaintext port"
        )
    if token and not insecure and not is_loopback(host):
        raise ValueError(
            f"--metrics {url}: refusing to send the bearer token in cleartext over http:// to {host}, "
            "which is not a loopback address: nothing was sent; give an https:// URL (the metrics port "
            "serves HTTPS with --metrics-tls), or --insecure to accept that anyone on the network can "
            "read the token"
        )


def _scheme_hint(url: str, reason: object) -> str:
    """A hint where the URL's scheme is not the metrics port's: plain HTTP to an HTTPS port, which
    closes the connection unanswered, or HTTPS to a plaintext one (no TLS record comes back)."""
    if url.startswith("https:") and "WRONG_VERSION_NUMBER" in str(reason):
        return " (the metrics port answered in plaintext: use an http:// URL)"
    if url.startswith("http:") and isinstance(reason, http.client.RemoteDisconnected):
        return " (if the metrics port serves HTTPS (--metrics-tls), use an https:// URL)"
    return ""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows a redirect with the request's headers, the bearer token included, to whatever
    host it names: a redirect ends the read instead (as an HTTPError with its Location)."""

    def redirect_request(  # noqa: PLR0917 - urllib's signature
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: email.message.Message,
        newurl: str,
    ) -> urllib.request.Request | None:
        return None


def read_http(
    url: str, credentials: Credentials, cert_file: Path | None = None, key_file: Path | None = None
) -> Json:
    """/status.json from the metrics port (blocking): the token as a bearer header; for HTTPS the CA
    and the client certificate (files) of the credentials."""
    token = credentials.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        request = urllib.request.Request(url, headers=headers)  # noqa: S310 - http(s) only: status_json_url
    except ValueError as exc:  # a URL urllib cannot take apart ("http://[::1")
        raise StatusReadError(f"not a URL: {exc}") from None
    context = None
    if url.startswith("https:"):
        roots = credentials.root_certificates
        context = ssl.create_default_context(cadata=roots.decode() if roots is not None else None)
        if cert_file is not None:
            context.load_cert_chain(cert_file, key_file)
    handlers: list[urllib.request.BaseHandler] = [_RefuseRedirects()]
    if context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=context))
    opener = urllib.request.build_opener(*handlers)
    deadline = time.monotonic() + CALL_TIMEOUT
    try:
        with opener.open(request, timeout=CALL_TIMEOUT) as response:
            body = _read_page(response, deadline)
    except urllib.error.HTTPError as exc:
        with exc:
            why = exc.read(MAX_ERROR_BYTES).decode(errors="replace").strip()
        if 300 <= exc.code < 400:
            where = printable(exc.headers.get("Location") or "nowhere")
            raise StatusReadError(
                f"HTTP {exc.code} redirects to {where}: not followed (it would take the token along); "
                "give --metrics the URL that serves /status.json"
            ) from None
        raise StatusReadError(f"HTTP {exc.code}: {why}", denied=exc.code in (401, 403)) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusReadError(f"{reason}{_scheme_hint(url, reason)}") from None
    except http.client.HTTPException as exc:  # not an HTTP server there (a gRPC port: BadStatusLine)
        raise StatusReadError(f"no HTTP server answers there (a gRPC port?): {type(exc).__name__}") from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # not JSON, or nested past what Python parses
        raise StatusReadError(f"not a Sluice status page: not JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise StatusReadError(f"not a Sluice status page: a JSON {type(data).__name__}, not an object")
    data["source"] = "status.json"
    return data


def _read_page(response: http.client.HTTPResponse, deadline: float) -> bytes:
    """The body of `response`, at most MAX_PAGE_BYTES of it, read by `deadline` (time.monotonic()):
    StatusReadError past either (a Content-Length over the bound fails before any of it is read). Each
    read waits at most CALL_TIMEOUT (the socket's timeout), so a page sent a byte at a time ends at
    most that long after the deadline."""
    length = response.headers.get("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_PAGE_BYTES:
        raise StatusReadError(
            f"not read: the page is {int(length):,} bytes, over the {MAX_PAGE_BYTES:,} a status page may "
            "have (is --metrics the metrics port of a Sluice server?)"
        )
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read1(_CHUNK):
        size += len(chunk)
        if size > MAX_PAGE_BYTES:
            raise StatusReadError(
                f"read stopped: the page goes on past the {MAX_PAGE_BYTES:,} bytes a status page may have "
                "(is --metrics the metrics port of a Sluice server?)"
            )
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise StatusReadError(
                f"read stopped: the page did not come whole within {CALL_TIMEOUT:g} s ({size:,} bytes came)"
            )
    return b"".join(chunks)


def render_checked(data: Json, where: str, *, error: str | None = None) -> RenderableType:
    """render(), or StatusReadError when the page's data is not in the shape this version reads (a
    /status.json of another version, or of something else): one line, not a traceback."""
    try:
        return render(data, where, error=error)
    except (TypeError, AttributeError, KeyError, ValueError, IndexError, RecursionError) as exc:
        raise StatusReadError(
            f"the status page is not in the shape this sluice reads (another version?): {exc!r}"
        ) from None


# ---- rendering ---------------------------------------------------------------------------------------


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1e12 or 0 < abs(value) < 0.05:  # an operator's extreme rate: 1e+300, 1e-06
        return f"{value:.3g}"
    if abs(value) >= 1e6:
        return f"{value / 1e6:,.2f}M"
    return f"{value:,.0f}" if abs(value) >= 100 or float(value).is_integer() else f"{value:,.1f}"


def _measured(value: float | None) -> str:
    """A measured rate: one that decays toward 0 while idle shows 0, not 7.25e-49 (an operator's
    extreme setting keeps its exponent: _num)."""
    return _num(0.0 if value is not None and abs(value) < 0.05 else value)


def _rate(value: float | None) -> str:
    return "unlimited" if value is None else _num(value)


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _seconds(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def _summary(data: Json) -> Table:
    rate, last, totals = data.get("rate", {}), data.get("last_batch"), data.get("totals")
    summary = Table.grid(padding=(0, 3))
    for style, justify in (("dim", "left"), ("bold", "right"), ("dim", "left"), ("bold", "right")):
        summary.add_column(style=style, justify=justify)  # type: ignore[arg-type]  # a JustifyMethod

    def add_row(*cells: str) -> None:
        summary.add_row(*map(Text, cells))  # as they are: never markup

    estimator = f"{rate.get('estimator', '-')}{', pinned' if rate.get('pinned') else ''}"
    limit = f"{_rate(rate.get('limit'))} rec/s ({estimator})"
    add_row("input rate", f"{_measured(rate.get('input'))} rec/s", "rate limit", limit)
    if last is None:
        add_row("processing rate", "-", "last batch", "none yet")
    else:
        batch = f"#{last['batch_id']}, {_num(last['records'])} records"
        add_row("processing rate", f"{_num(last['processing_rate'])} rec/s", "last batch", batch)
        add_row(
            "scheduling delay",
            _seconds(last["scheduling_delay"]),
            "batch duration",
            _seconds(last["batch_duration"]),
        )
    if totals is not None:
        buffered = f"{_num(totals['buffered_records'])} rec, {_bytes(totals['buffered_bytes'])}"
        add_row("buffered", buffered, "block log on disk", _bytes(totals["wal_disk_bytes"]))
        add_row(
            "records received",
            _num(totals["records_received_total"]),
            "records acked",
            _num(totals["records_acked_total"]),
        )
    return summary


_NAME_COLUMNS = frozenset({"node", "target", "stream", "principal", "producer"})
_MAX_NAME_WIDTH = 40
_MAX_TEXT_WIDTH = 12
"""A long text (a share's reason) or a name folded for room keeps this width at least, while it can."""
_LONG_TEXT_COLUMNS = frozenset({"share", "credit paused"})
_TEXT_COLUMNS = frozenset(
    {"stream", "state", "share", "credit paused", "id", "principal", "producer", "target"}
)


class _FittedTable:
    """A table laid out for the width it is drawn in: each column as wide as its widest cell and its
    header on one line. Where that is too wide, first the long texts (a share's reason) wrap down to
    _MAX_TEXT_WIDTH and the headers between their words, then the long texts down to their header's
    longest word, and only then the names of rows (a node's target, a stream, a producer) fold onto
    more lines. A figure, a state or an id is never cut, and no column is pushed off the screen."""

    def __init__(self, title: str, names: list[str], cells: list[list[str]]) -> None:
        self.title, self.names, self.cells = title, names, cells

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.laid_out(options.max_width)

    def widths(self, width: int) -> list[int]:
        names = self.names
        n = len(names)
        words = [max(cell_len(word) for word in name.split()) for name in names]
        widest = [max((cell_len(row[i]) for row in self.cells), default=0) for i in range(n)]
        kind = [
            "name" if m in _NAME_COLUMNS else "text" if m in _LONG_TEXT_COLUMNS else "short" for m in names
        ]
        want = [max(min(widest[i], _MAX_NAME_WIDTH), cell_len(names[i])) for i in range(n)]
        folded = [max(words[i], min(widest[i], _MAX_TEXT_WIDTH)) for i in range(n)]
        short = [max(widest[i], words[i]) for i in range(n)]  # a figure, a state or an id: whole
        gaps = 2 * (n - 1)  # a space either side of each border between columns

        def shrink(levels: dict[str, list[int]]) -> None:
            """Take the excess from the columns of these kinds, down to their level, the most room first."""
            floor = [min(want[i], levels[kind[i]][i]) if kind[i] in levels else want[i] for i in range(n)]
            excess = sum(want) + gaps - width
            for i in sorted(range(n), key=lambda i: floor[i] - want[i]):
                take = max(0, min(excess, want[i] - floor[i]))
                want[i] -= take
                excess -= take

        shrink({"text": folded, "short": short})
        # long texts go down to their header's word before a name folds only if that makes it fit:
        # when a name must fold anyway it folds first, and the texts keep their room
        fits = sum(min(want[i], words[i]) if kind[i] == "text" else want[i] for i in range(n)) + gaps <= width
        if fits:
            shrink({"text": words})
        shrink({"name": folded})
        shrink({"text": words})
        shrink({"name": words})
        return want

    def laid_out(self, width: int) -> Table:
        table = Table(
            box=box.SIMPLE_HEAD,
            title=self.title,
            title_justify="left",
            title_style="bold",
            show_edge=False,
            pad_edge=False,
            collapse_padding=True,
        )
        for name, column_width in zip(self.names, self.widths(width), strict=True):
            text = name in _TEXT_COLUMNS
            table.add_column(
                name,
                justify="left" if text else "right",
                width=column_width,
                overflow="fold" if text else "ellipsis",
            )
        for row in self.cells:
            table.add_row(*map(Text, row))  # as they are: a "[red]" or ":smile:" in a name is not markup
        return table


def _table(title: str, columns: list[tuple[str, Callable[[Json], str]]], rows: list[Json]) -> _FittedTable:
    return _FittedTable(
        title, [name for name, _ in columns], [[show(row) for _, show in columns] for row in rows]
    )


def _streams(data: Json) -> _FittedTable:
    columns: list[tuple[str, Callable[[Json], str]]] = [
        ("stream", lambda s: s["stream"]),
        ("state", lambda s: s["state"]),
        ("input/s", lambda s: _measured(s.get("input_rate"))),
        ("rate limit", lambda s: _rate(s.get("rate_limit")) if s["state"] == "serving" else "-"),
        ("share", lambda s: s.get("share") or ""),
    ]
    if data.get("totals") is not None:  # from /status.json
        columns += [
            ("received", lambda s: _num(s.get("records_received_total"))),
            ("acked", lambda s: _num(s.get("records_acked_total"))),
            ("buffered", lambda s: _num(s.get("buffered_records"))),
            ("on disk", lambda s: _bytes(s.get("wal_disk_bytes"))),
        ]
    columns += [
        ("backlog", lambda s: _num(s.get("backlog"))),
        ("sessions", lambda s: _num(s.get("sessions_active"))),
        ("credit paused", lambda s: ", ".join(s.get("credit_paused", []))),
    ]
    return _table("streams", columns, data.get("streams", []))


def _sessions(data: Json) -> _FittedTable:
    columns: list[tuple[str, Callable[[Json], str]]] = [
        ("id", lambda s: str(s["session_id"])),
        ("stream", lambda s: s["stream"]),
        ("principal", lambda s: s["principal"]),
        ("producer", lambda s: s["producer_id"]),
        ("credit", lambda s: _num(s["credit"])),
        ("next seq", lambda s: _num(s["next_seq"])),
        ("durable up to", lambda s: _num(s["durable_up_to"])),
        ("state", lambda s: s["state"]),
    ]
    return _table("sessions", columns, data.get("sessions", []))


def _nodes(data: Json) -> _FittedTable:
    columns: list[tuple[str, Callable[[Json], str]]] = [
        ("node", lambda n: str(n["node"])),
        ("target", lambda n: n["target"]),
        ("state", lambda n: "up" if n["up"] else "down"),
        ("input/s", lambda n: _measured(n.get("input_rate"))),
        ("rate limit", lambda n: _rate(n.get("rate_limit"))),
        ("backlog", lambda n: _num(n.get("backlog"))),
        ("share", lambda n: n.get("share") or ""),
    ]
    return _table("receiver nodes", columns, data.get("nodes", []))


_PIPELINE_STATE_STYLE = {"running": "green", "starting": "yellow", "swapping": "yellow"}
"""The pipeline's states on their way to running; the others (stopped, failed) in bold red."""


def _pipeline(data: Json) -> Text:
    pipeline = data.get("pipeline")
    if pipeline is None:
        return Text("pipeline: no Spark query on this node", style="dim")
    text = Text.assemble(
        ("pipeline: ", "dim"),
        (pipeline["pipeline"], "bold"),
        f" (generation {pipeline['generation']}, ",
        (pipeline["state"], _PIPELINE_STATE_STYLE.get(pipeline["state"], "bold red")),
        f", trigger {pipeline['trigger_interval']:g} s)",
    )
    swap = pipeline.get("last_swap")
    if swap:
        error = f" ({swap['error']})" if swap.get("error") else ""
        text.append(
            f"; last swap {swap['from']} -> {swap['to']}: {swap['outcome']} in {_seconds(swap['duration'])}"
            + error
        )
    return text


def _printable(value: Any) -> Any:
    """`value` (the status read, as JSON) with every string in it, keys too, through printable()."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {_printable(k): _printable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable(v) for v in value]
    return value


def render(data: Json, target: str, *, error: str | None = None) -> RenderableType:
    """One frame: the summary, the pipeline, the streams, the sessions. Every string the server sent
    (names, states, reasons, errors) is shown with its control characters escaped (printable): a
    hostile or broken endpoint cannot clear, retitle or recolour the terminal, nor forge a row."""
    data = _printable(data)
    error = None if error is None else printable(error)
    title = Text.assemble(("sluice status ", "bold"), (f"{target} ", "cyan"))
    title.append(f"({data.get('source', '-')}, {time.strftime('%H:%M:%S')})", "dim")
    health = data.get("health")
    if health:
        title.append(f"  {health}", "green" if health == "SERVING" else "bold red")
    parts: list[RenderableType] = [title]
    # a cluster's receiver node configured otherwise than its peers: first, plainly (none: nothing)
    mismatches = data.get("config_mismatches") or []
    if mismatches:
        peers = f"{len(mismatches)} peer{'s' if len(mismatches) > 1 else ''}"
        parts.append(Text(f"config mismatch with {peers} (replication refused):", style="bold red"))
        parts.extend(Text(f"  {words}", style="red") for words in mismatches)
    parts += [_summary(data), _pipeline(data)]
    if data.get("nodes"):  # a cluster's driver: its streams and sessions are the nodes' (their status)
        parts.append(_nodes(data))
    else:
        parts.append(_streams(data))
        parts.append(_sessions(data) if data.get("sessions") else Text("no open sessions", style="dim"))
    if error is not None:
        parts.append(Text(f"cannot read the status: {error} (retrying)", style="bold red"))
    return Group(*parts)


_PIPED_WIDTH = 200
"""Columns `sluice status` lays out for when its output is not a terminal (and COLUMNS is unset)."""


class _Console(Console):
    """rich's Console, but a reader of stdout gone away (`sluice status | head -5`) ends the command as
    every other command's does (ingest.cli.main: exit 0), not with rich's SystemExit(1): the exit codes
    say 1 for a status that cannot be read."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


async def run_status(
    target: str,
    credentials: Credentials,
    *,
    once: bool,
    metrics_url: str | None = None,
    cert_file: Path | None = None,
    key_file: Path | None = None,
    console: Console | None = None,
) -> None:
    """Show the status once (StatusReadError when it cannot be read), or live until cancelled (a
    failed read is shown in the frame and retried)."""
    if console is None:
        # piped (a script, `watch`): rich lays out for 80 columns and folds headers and reasons onto a
        # line per fragment; a pipe has no width, so lines as long as the tables want, up to a bound
        piped = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        console = _Console(width=_PIPED_WIDTH) if piped else _Console()
    # keepalive, as the Spark side's channels to a server ping: a connection whose far end went away
    # without a FIN (a host powered off, a NAT that dropped the flow) is closed within
    # PEER_KEEPALIVE_SECONDS + PEER_KEEPALIVE_TIMEOUT_SECONDS and the channel connects anew. Without it
    # the live view kept the dead connection: every read timed out, "retrying" for as long as the kernel
    # kept it (for ever while a middlebox still acknowledged its packets), and a server back at the same
    # address was never seen again
    async with credentials.channel(target, node_channel_options()) as channel:

        async def read() -> Json:
            if metrics_url is not None:
                url = status_json_url(metrics_url)
                return await asyncio.to_thread(read_http, url, credentials, cert_file, key_file)
            return await read_grpc(channel, credentials.metadata, secure=credentials.secure)

        where = metrics_url or target
        if once:
            console.print(render_checked(await read(), where))
            return
        data: Json = {}
        if not console.is_terminal:
            # piped or to a file: rich's Live redraws on a terminal only, and anywhere else printed one
            # frame, at the end (none on a SIGTERM); a whole frame per interval instead, one after another
            await _print_frames(console, read, where)
            return
        with Live(console=console, auto_refresh=False, transient=False) as live:
            while True:
                try:
                    read_now = await read()
                    live.update(render_checked(read_now, where), refresh=True)
                    data = read_now  # the last that could be shown: kept beside a later error
                except StatusReadError as exc:
                    if exc.denied:
                        raise
                    live.update(render(data, where, error=str(exc)), refresh=True)
                await asyncio.sleep(REFRESH)


async def _print_frames(console: Console, read: Callable[[], Awaitable[Json]], where: str) -> None:
    """`sluice status` without --once where the output is not a terminal: a frame every REFRESH seconds,
    each followed by a blank line and flushed (a reader of the pipe sees it at once), no cursor control;
    a failed read is shown beside the last figures read, as the live view shows it."""
    data: Json = {}
    while True:
        try:
            read_now = await read()
            frame = render_checked(read_now, where)
            data = read_now
        except StatusReadError as exc:
            if exc.denied:
                raise
            frame = render(data, where, error=str(exc))
        console.print(frame)
        console.print()
        console.file.flush()
        await asyncio.sleep(REFRESH)
