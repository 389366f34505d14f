"""The client commands facing a hostile or broken "Sluice" endpoint: a real gRPC server on loopback (and
an HTTP one for `status --metrics`) that answers every operator call with strings holding terminal
escapes (clear screen, a window title by OSC, colours), carriage returns, newlines, bidi overrides and
rich markup. `sluice rate get`, `streams list`, `pipeline get`, `config get`, `sessions list` and
`status --once` printed them raw: now every server string is shown with its control characters escaped
(receivers.errors.printable), and nothing reaches the terminal that it would act on."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from support import serving_page

from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

SLUICE = str(Path(sys.executable).parent / "sluice")

HOSTILE = "\x1b[2J\x1b]0;pwned\x07\x1b[31mRED\r\nforged\t\u202e\x9b[/x]:smile:"
"""Clear the screen, set the window title (OSC ... BEL), red, a carriage return and a new line (a forged
row), a tab (a forged column), a right-to-left override, a C1 CSI, a closing rich tag, an emoji code."""
RAW = [b"\x1b", b"\x07", b"\r", "\u202e".encode(), "\x9b".encode()]
"""What must never reach the terminal."""
ESCAPED = r"\x1b[2J\x1b]0;pwned\x07\x1b[31mRED\r\nforged\t\u202e\x9b[/x]:smile:"
"""HOSTILE as shown: every control character escaped, the rest as it is."""


class Rate(pb_grpc.RateControlServicer):
    def GetRate(self, request: pb.GetRateRequest, context: Any) -> pb.RateStatus:
        stream = pb.StreamRate(
            stream="s" + HOSTILE,
            records_per_second=10,
            share_reason=HOSTILE,
            min_rate=1,
            max_rate=math.inf,
            credit_paused=[HOSTILE],
        )
        return pb.RateStatus(
            records_per_second=100,
            estimator=HOSTILE,
            estimator_state={HOSTILE: HOSTILE},
            streams=[stream],
            last_batch=pb.BatchMetrics(batch_id=1, records=10, processing_delay_seconds=0.5),
        )

    def SetEstimator(self, request: pb.SetEstimatorRequest, context: Any) -> pb.RateStatus:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, HOSTILE)
        raise AssertionError("unreachable")


class Admin(pb_grpc.AdminServicer):
    def ListStreams(self, request: pb.ListStreamsRequest, context: Any) -> pb.StreamsView:
        return pb.StreamsView(streams=[pb.StreamView(stream="s" + HOSTILE, state=HOSTILE, backlog=1)])

    def GetPipeline(self, request: pb.GetPipelineRequest, context: Any) -> pb.PipelineView:
        swap = pb.PipelineSwap(
            from_pipeline=HOSTILE,
            to_pipeline=HOSTILE,
            outcome=HOSTILE,
            error=HOSTILE,
            start_offsets={HOSTILE: 1},
        )
        return pb.PipelineView(
            pipeline=HOSTILE,
            generation=1,
            state=HOSTILE,
            trigger_interval_seconds=1,
            checkpoint=HOSTILE,
            query_id=HOSTILE,
            sink_dir=HOSTILE,
            last_swap=swap,
        )

    def GetConfig(self, request: pb.GetConfigRequest, context: Any) -> pb.ConfigView:
        setting = pb.ConfigSetting(key=HOSTILE, value=HOSTILE, source=HOSTILE)
        return pb.ConfigView(settings=[setting, pb.ConfigSetting(key="k", effective=HOSTILE)], version=1)


class Sessions(pb_grpc.SessionsServicer):
    def ListSessions(self, request: pb.ListSessionsRequest, context: Any) -> pb.ListSessionsResponse:
        session = pb.SessionInfo(session_id=1, stream=HOSTILE, producer_id=HOSTILE, principal=HOSTILE)
        return pb.ListSessionsResponse(sessions=[session])


@pytest.fixture(scope="module")
def hostile_target() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_RateControlServicer_to_server(Rate(), server)
    pb_grpc.add_AdminServicer_to_server(Admin(), server)
    pb_grpc.add_SessionsServicer_to_server(Sessions(), server)
    checks = health.HealthServicer()
    checks.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def sluice(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env["COLUMNS"] = "400"  # wide: rich folds nothing of what is checked
    return subprocess.run([SLUICE, *args], capture_output=True, env=env, timeout=60, check=False)


def assert_escaped(result: subprocess.CompletedProcess[bytes]) -> None:
    out = result.stdout + result.stderr
    for raw in RAW:
        assert raw not in out, (raw, out)
    assert b"Traceback" not in out, out


@pytest.mark.parametrize(
    ("command", "lines"),
    [
        pytest.param(["rate", "get"], 5, id="rate-get"),
        pytest.param(["streams", "list"], 2, id="streams-list"),
        pytest.param(["pipeline", "get"], 5, id="pipeline-get"),
        pytest.param(["config", "get"], 3, id="config-get"),
        pytest.param(["sessions", "list"], 2, id="sessions-list"),
    ],
)
def test_server_strings_are_printed_escaped(hostile_target: str, command: list[str], lines: int) -> None:
    """Each string the server sent is there, escaped, on the line it belongs to: no forged rows."""
    result = sluice(*command, "--target", hostile_target)
    assert result.returncode == 0, result.stderr
    assert_escaped(result)
    shown = result.stdout.decode()
    assert ESCAPED in shown, shown
    assert len(shown.splitlines()) == lines, shown


def test_the_servers_error_details_are_printed_escaped(hostile_target: str) -> None:
    result = sluice("rate", "estimator", "fixed", "--target", hostile_target)
    assert result.returncode == 1, result.stderr
    assert_escaped(result)
    assert f"INVALID_ARGUMENT: {ESCAPED}".encode() in result.stderr, result.stderr
    assert result.stderr.count(b"\n") == 1, result.stderr


def test_status_shows_server_strings_escaped_and_never_as_markup(hostile_target: str) -> None:
    """`status --once`'s stream column and pipeline line were raw; a closing tag ("[/x]") in a name
    ended in rich's MarkupError traceback."""
    result = sluice("status", "--once", "--target", hostile_target)
    assert result.returncode == 0, result.stderr
    assert_escaped(result)
    shown = result.stdout.decode()
    assert "[/x]:smile:" in shown and r"\x1b]0;pwned\x07" in shown, shown
    assert "\U0001f604" not in shown, shown  # ":smile:" stays text


def test_status_metrics_shows_status_json_strings_escaped() -> None:
    """The same for /status.json from a hostile metrics port."""
    stream = {"stream": HOSTILE, "state": HOSTILE, "share": HOSTILE, "credit_paused": [HOSTILE]}
    session = {
        "session_id": 1,
        "stream": HOSTILE,
        "principal": HOSTILE,
        "producer_id": HOSTILE,
        "credit": 0,
        "next_seq": 0,
        "durable_up_to": 0,
        "state": HOSTILE,
    }
    pipeline = {"pipeline": HOSTILE, "generation": 1, "state": HOSTILE, "trigger_interval": 1.0}
    page = {
        "health": HOSTILE,
        "rate": {"estimator": HOSTILE},
        "streams": [stream],
        "sessions": [session],
        "pipeline": pipeline,
    }
    body = json.dumps(page).encode()

    with serving_page(body) as url:
        result = sluice("status", "--once", "--metrics", url)
    assert result.returncode == 0, result.stderr
    assert_escaped(result)
    assert r"\x1b]0;pwned\x07" in result.stdout.decode()
