"""A settings or stream change on a full disk (an outside tester): the server answered INTERNAL, to which
the CLI added "the connection dropped after the call went out: the change may have been applied" after
the server's own "nothing changed"; `streams add` said only "INTERNAL: the stream states: [Errno 28]";
an empty runtime-config.json.tmp / streams.json.tmp stayed in the data dir; the server logged nothing.

A full disk cannot be made without root, so the JSON writer of receivers.files runs out of space here:
it opens its temp file (created, empty, as on a full disk) and fails writing into it with ENOSPC."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from ingest import cli
from receivers import files
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from tests.support import running_server


class _FullDisk:
    """Stands in for receivers.files' json module: reads as ever, every write fails with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code

    loads = staticmethod(json.loads)

    def dump(self, data: object, file: Any, **_: Any) -> None:
        raise OSError(
            self.code, "No space left on device" if self.code == errno.ENOSPC else "Disk quota exceeded"
        )


@pytest.fixture
def full_disk(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    def fill(code: int = errno.ENOSPC) -> None:
        monkeypatch.setattr(files, "json", _FullDisk(code))

    return fill


async def _refused(call: Awaitable[object]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


@pytest.fixture
async def stubs(tmp_path: Path) -> AsyncIterator[tuple[Any, pb_grpc.AdminStub, pb_grpc.RateControlStub]]:
    async with (
        running_server(tmp_path / "d", "s", "t") as server,
        grpc.aio.insecure_channel(server.target) as channel,
    ):
        yield server, pb_grpc.AdminStub(channel), pb_grpc.RateControlStub(channel)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
async def test_every_change_on_a_full_disk_is_refused_resource_exhausted(
    tmp_path: Path,
    stubs: tuple[Any, pb_grpc.AdminStub, pb_grpc.RateControlStub],
    full_disk: Callable[[int], None],
    caplog: pytest.LogCaptureFixture,
    code: int,
) -> None:
    server, admin, rate = stubs
    data_dir = tmp_path / "d"
    await admin.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.05"}))  # one to reset
    full_disk(code)
    caplog.set_level(logging.WARNING)
    # each refusal is logged by the module that makes the change: streams add|remove and config set
    # were logged under ingest.rate_service, where the shared refusal lives
    admin_log, rate_log = "ingest.admin_service", "ingest.rate_service"
    loggers = {"config set": admin_log, "streams add": admin_log, "streams remove": admin_log}
    calls: list[tuple[str, Callable[[], Awaitable[object]], str]] = [
        (
            "config set",
            lambda: admin.SetConfig(pb.SetConfigRequest(set={"block-interval": "0.5"})),
            "settings",
        ),
        ("config set", lambda: admin.SetConfig(pb.SetConfigRequest(reset=["block-interval"])), "settings"),
        (
            "rate set",
            lambda: rate.UpdateRate(pb.UpdateRateRequest(records_per_second=50, pin=True)),
            "settings",
        ),
        ("rate bounds", lambda: rate.SetBounds(pb.SetBoundsRequest(min_rate=10, max_rate=100)), "settings"),
        ("rate estimator", lambda: rate.SetEstimator(pb.SetEstimatorRequest(estimator="model")), "settings"),
        ("streams add", lambda: admin.AddStream(pb.AddStreamRequest(stream="u")), "stream states"),
        (
            "streams remove",
            lambda: admin.RemoveStream(
                pb.RemoveStreamRequest(stream="t", backlog=pb.RemoveStreamRequest.KEEP)
            ),
            "stream states",
        ),
    ]
    for what, call, saved in calls:
        caplog.clear()
        error = await _refused(call())
        details = error.details() or ""
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (what, error.code(), details)
        assert details.startswith(
            f"nothing changed: the {saved} could not be saved in the data dir: [Errno {code}]"
        )
        assert "free space in the data dir" in details, details
        assert not list(data_dir.glob("*.tmp")), (what, list(data_dir.glob("*.tmp")))
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
        assert len(warnings) == 1, (what, [r.getMessage() for r in caplog.records])
        said = warnings[0].getMessage()
        assert f"sluice {what}" in said and f"[Errno {code}]" in said and "nothing changed" in said, said
        assert warnings[0].exc_info is None
        assert warnings[0].name == loggers.get(what, rate_log), (what, warnings[0].name)
    # nothing changed, indeed
    assert server.runtime.version == 1 and server.receivers["s"].config.block_interval == 0.05
    assert not server.rate.pinned and server.rate.estimator.name == "fixed"
    assert sorted(server.streams.read_by_query) == ["s", "t"]


async def test_another_os_error_is_internal_and_marked_answered(
    tmp_path: Path,
    stubs: tuple[Any, pb_grpc.AdminStub, pb_grpc.RateControlStub],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A read-only or broken data dir (here a folder where the temp file goes): INTERNAL, the server's
    to fix, still "nothing changed", still one WARNING; the folder in the way is left alone."""
    _, admin, _ = stubs
    in_the_way = tmp_path / "d" / "streams.json.tmp"
    in_the_way.mkdir()
    caplog.set_level(logging.WARNING)
    error = await _refused(admin.AddStream(pb.AddStreamRequest(stream="u")))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert (error.details() or "").startswith("nothing changed: the stream states could not be saved")
    assert ("sluice-refusal", "not-saved") in tuple(error.trailing_metadata() or ())
    assert in_the_way.is_dir()
    said = [r for r in caplog.records if "sluice streams add u" in r.getMessage()]
    assert len(said) == 1
    assert said[0].name == "ingest.admin_service", said[0].name  # the stream change's, not the rate's


async def test_the_cli_says_nothing_changed_and_no_dropped_connection(
    tmp_path: Path,
    full_disk: Callable[[int], None],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The CLI's "the connection dropped ... may have been applied" is for a connection that dropped,
    never for a status the server answered with, INTERNAL included."""
    async with running_server(tmp_path / "d", "s") as server:
        full_disk(errno.ENOSPC)
        for args in (
            ["config", "set", "block-interval=0.5"],
            ["streams", "add", "u"],
            ["rate", "set", "50", "--pin"],
        ):
            assert await asyncio.to_thread(cli.main, [*args, "--target", server.target]) == 1
            said = capsys.readouterr().err
            assert "RESOURCE_EXHAUSTED: nothing changed:" in said, said
            assert "dropped" not in said and "may have been applied" not in said, said
        full_disk(errno.EIO)
        assert await asyncio.to_thread(
            cli.main, ["config", "set", "block-interval=0.5", "--target", server.target]
        )
        said = capsys.readouterr().err
        assert "INTERNAL: nothing changed:" in said and "dropped" not in said, said


def test_replace_json_leaves_no_temp_file(tmp_path: Path, full_disk: Callable[[int], None]) -> None:
    path = tmp_path / "state.json"
    files.replace_json(path, {"a": 1})
    full_disk(errno.ENOSPC)
    with pytest.raises(OSError, match="No space"):
        files.replace_json(path, {"a": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert json.loads(path.read_text()) == {"a": 1}


async def test_a_push_the_server_stopped_acking_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A push into a server whose disk is full said only "N records not acked within 10 s": it asks the
    server's rate API why (briefly) and says the stream's intake is paused on disk_error."""
    async with running_server(tmp_path / "d", "s") as server:
        receiver = server.receivers["s"]

        def full(*args: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

        receiver.store.write = full  # type: ignore[method-assign]
        lines = tmp_path / "in.txt"
        lines.write_text("".join(f"{i}\n" for i in range(100)))
        args = [
            "push",
            str(lines),
            "--stream",
            "s",
            "--target",
            server.target,
            "--timeout",
            "1",
            "--no-progress",
        ]
        assert await asyncio.to_thread(cli.main, args) == 1
        said = capsys.readouterr().err
        assert "records not acked within 1 s; the server has paused intake on stream 's': " in said, said
        assert "disk_error" in said and f"`sluice status --target {server.target}` shows why" in said, said
