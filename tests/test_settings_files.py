"""Settings and credential files an operator names (the config file, the auth file, token files, TLS
files, the node list) are read only when they are regular files of at most 16 MiB
(sluice_client.settings_file): a FIFO there hung the start, or, on SIGHUP, froze the whole server until
something wrote to it; /dev/zero or a huge file took memory without bound. Real `sluice` processes."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from pki import CertificateAuthority
from test_tls import SLUICE, start_serve, stop, wait_for

from receivers.auth import new_token, token_hash
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc
from sluice_client.settings_file import MAX_SETTINGS_FILE_BYTES

FIFO = "a FIFO (named pipe), not a regular file"
TOO_LARGE = "16,777,217 bytes: over the 16 MiB a settings file may have"


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`sluice ARGS`, with no SLUICE_* variable of the test's environment; a hang is a TimeoutExpired."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return subprocess.run(
        [*SLUICE, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )


@pytest.fixture
def bad_files(tmp_path: Path) -> Iterator[dict[str, tuple[Path, str]]]:
    """A FIFO, a symlink to one (followed), and a sparse file one byte over the bound (regular, large,
    no disk used): each with what the refusal says."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link-to-fifo"
    link.symlink_to(fifo)
    large = tmp_path / "large"
    with large.open("wb") as out:
        out.truncate(MAX_SETTINGS_FILE_BYTES + 1)
    yield {"fifo": (fifo, FIFO), "symlink": (link, FIFO), "large": (large, TOO_LARGE)}


def test_a_settings_file_that_is_a_fifo_or_too_large_is_refused_at_start(
    tmp_path: Path, bad_files: dict[str, tuple[Path, str]]
) -> None:
    """`--config FIFO` and `--token-file FIFO` hung; a FIFO at --auth-file or --tls-cert hung the start;
    a huge file was read whole. Each is now one line naming the setting and the path, exit 2, at once."""
    ca = CertificateAuthority(tmp_path / "pki")
    server = ca.issue("localhost", server=True, file_stem="server")
    data = str(tmp_path / "data")
    serve = ["--no-spark", "--data-dir", data, "--port", "0", "--metrics-port", "-1"]
    tls = ["--tls-cert", str(server.cert_file), "--tls-key", str(server.key_file)]
    node = ["--role", "receiver", "--node-id", "0", "--port", "51101", "--data-dir", data]
    for path, says in bad_files.values():
        cases: list[tuple[list[str], str]] = [
            (
                ["config", "check", *serve, "--config", str(path)],
                f"config file {path}: cannot read it: {says}",
            ),
            (
                ["config", "check", *serve, "--auth-file", str(path)],
                f"cannot read the auth file (--auth-file) {path}: {says}",
            ),
            (
                ["serve", *serve, "--auth-file", str(path)],
                f"cannot read the auth file (--auth-file) {path}: {says}",
            ),
            (
                ["serve", *serve, "--tls-cert", str(path), "--tls-key", str(server.key_file)],
                f"cannot read the TLS certificate (--tls-cert) {path}: {says}",
            ),
            (
                ["config", "check", *serve, *tls, "--client-ca", str(path)],
                f"cannot read the client CA (--client-ca) {path}: {says}",
            ),
            (
                ["config", "check", *serve, "--peer-token-file", str(path)],
                f"--peer-token-file: cannot read token file {path}: {says}",
            ),
            (
                ["config", "check", *node, "--nodes", str(path)],
                f"cannot read the node list (--nodes) {path}: {says}",
            ),
            (
                ["rate", "get", "--target", "127.0.0.1:1", "--token-file", str(path)],
                f"cannot read token file {path}: {says}",
            ),
            (
                ["status", "--once", "--target", "127.0.0.1:1", "--ca-file", str(path)],
                f"cannot read CA file {path}: {says}",
            ),
        ]
        for args, message in cases:
            started = time.monotonic()
            result = run(*args)
            assert result.returncode == 2, (args, result.stderr)
            assert message in result.stderr, (args, result.stderr)
            assert len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert time.monotonic() - started < 30, args  # an interpreter start, no read of the file


def write_auth(path: Path, ops_token: str, *more: str) -> None:
    path.write_text(
        f'[principals.ops]\nroles = ["operator", "reader"]\ntoken_sha256 = "{token_hash(ops_token)}"\n'
        + "".join(more)
    )


def get_rate(target: str, token: str, ca: CertificateAuthority | None = None, timeout: float = 20) -> None:
    """One GetRate with `token` (over TLS trusting `ca`) on a new connection: it must answer."""
    if ca is None:
        channel = grpc.insecure_channel(target)
    else:
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(ca.cert_pem))
    with channel:
        ask(channel, token, timeout)


def ask(channel: grpc.Channel, token: str, timeout: float) -> None:
    stub = pb_grpc.RateControlStub(channel)
    stub.GetRate(pb.GetRateRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=timeout)


def lines_with(log: Path, *parts: str) -> int:
    """How many lines of the log hold every one of `parts`."""
    return sum(all(part in line for part in parts) for line in log.read_text(errors="replace").splitlines())


def wait_until(proc: subprocess.Popen[bytes], condition: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, "the server exited"
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.1)


def token_works(target: str, token: str, ca: CertificateAuthority) -> bool:
    try:
        get_rate(target, token, ca, timeout=10)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAUTHENTICATED:  # type: ignore[attr-defined]  # a call's error
            raise
        return False
    return True


def test_a_reload_refuses_a_fifo_or_an_oversized_file_and_the_server_answers(
    tmp_path: Path, bad_files: dict[str, tuple[Path, str]]
) -> None:
    """SIGHUP with a FIFO at the auth file's path froze the server (no answer to anyone) until something
    wrote to it. Now each bad file (a FIFO, a symlink to one, an oversized file) at --auth-file or
    --tls-cert is an ERROR line, the old settings stay (the old token and certificate still work), and
    the server answers throughout; with the good files back, a reload takes them."""
    ca = CertificateAuthority(tmp_path / "pki")
    server = ca.issue("localhost", server=True, file_stem="server")
    cert = tmp_path / "server.crt"
    cert.write_bytes(server.cert_pem)
    auth = tmp_path / "auth.toml"
    ops = new_token()
    write_auth(auth, ops)
    proc, log = start_serve(
        tmp_path, "--metrics-port", "-1", "--tls-cert", str(cert), "--tls-key", str(server.key_file),
        "--auth-file", str(auth),
    )  # fmt: skip
    try:
        target = wait_for(proc, log, r"serving streams default on (127\.0\.0\.1:\d+)").group(1)
        get_rate(target, ops, ca)
        for setting, path, says in (
            (auth, *bad_files["fifo"]),
            (auth, *bad_files["symlink"]),
            (auth, *bad_files["large"]),
            (cert, *bad_files["fifo"]),
            (cert, *bad_files["large"]),
        ):
            what = "auth file" if setting == auth else "TLS certificate (--tls-cert)"
            kept = "the old one" if setting == auth else "the old certificate"
            line = f"not reloaded, {kept} stays: cannot read the {what}"
            before = lines_with(log, "ERROR", line, says)
            good = setting.read_bytes()
            setting.unlink()
            setting.symlink_to(path)
            proc.send_signal(signal.SIGHUP)
            wait_until(proc, lambda: lines_with(log, "ERROR", line, says) > before)  # noqa: B023
            get_rate(target, ops, ca, timeout=10)  # the old token, over the old certificate
            setting.unlink()
            setting.write_bytes(good)
        other = new_token()
        write_auth(auth, other)  # the good files back, with another token: taken
        proc.send_signal(signal.SIGHUP)
        wait_until(proc, lambda: token_works(target, other, ca))
        assert proc.poll() is None
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()


def test_a_reload_reads_a_large_auth_file_while_the_server_answers(tmp_path: Path) -> None:
    """A large (valid) auth file takes seconds to read and parse. SIGHUP did that on the server's event
    loop: no call was answered meanwhile. It reads it in a thread now: calls made during the reload are
    answered in far less time than the reload takes."""
    auth = tmp_path / "auth.toml"
    ops = new_token()
    principals = (
        f'[principals.p{i}]\nroles = ["reader"]\ntoken_sha256 = "{token_hash(str(i))}"\n'
        for i in range(50_000)
    )
    write_auth(auth, ops, *principals)
    assert auth.stat().st_size < MAX_SETTINGS_FILE_BYTES
    proc, log = start_serve(tmp_path, "--metrics-port", "-1", "--auth-file", str(auth))
    try:
        target = wait_for(proc, log, r"serving streams default on (127\.0\.0\.1:\d+)").group(1)
        get_rate(target, ops)
        latencies: list[float] = []
        done = threading.Event()

        def asking() -> None:
            with grpc.insecure_channel(target) as channel:
                ask(channel, ops, 20)  # connected before the reload
                ready.set()
                while not done.is_set():
                    started = time.monotonic()
                    ask(channel, ops, 60)
                    latencies.append(time.monotonic() - started)
                    time.sleep(0.02)

        ready = threading.Event()
        asker = threading.Thread(target=asking)
        asker.start()
        assert ready.wait(30)
        started = time.monotonic()
        proc.send_signal(signal.SIGHUP)
        try:
            wait_for(proc, log, r"reload: auth file: 50001 principals", timeout=120)
        finally:
            reload_seconds = time.monotonic() - started
            done.set()
            asker.join(60)
        assert reload_seconds > 1.0, reload_seconds  # long enough for calls to come in meanwhile
        assert latencies and max(latencies) < reload_seconds / 2, (reload_seconds, latencies)
    finally:
        stop(proc)
