"""TLS and mutual TLS on the gRPC server, with real certificates (tests/pki.py) over loopback: who gets
through, who does not (and that nothing is taken from them), the handshake timeout, reload on SIGHUP
with a live session on a real `sluice serve` process, and the CLI's checks of its TLS flags."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from pki import CertificateAuthority, Issued
from support import running_server

from ingest.config import SecurityConfig, TlsConfig
from ingest.dev_certs import write_dev_certs
from ingest.server import SluiceServer
from ingest.tls import TlsFileError, load_tls
from receivers.auth import token_hash
from sluice_client import Producer
from sluice_client.pb.ingest.v1 import ingest_pb2 as pb
from sluice_client.pb.ingest.v1 import ingest_pb2_grpc as pb_grpc

SLUICE = [str(Path(sys.executable).parent / "sluice")]


@contextlib.asynccontextmanager
async def tls_server(
    tmp_path: Path, security: SecurityConfig, *, metrics: bool = False
) -> AsyncIterator[SluiceServer]:
    """A SluiceServer without Spark on a free loopback port, with `security`."""
    async with running_server(tmp_path / "data", "s", metrics=metrics, security=security) as server:
        yield server


def channel(
    server: SluiceServer | str, ca: CertificateAuthority | None, client: Issued | None = None
) -> grpc.aio.Channel:
    """A client channel the plain gRPC way: TLS trusting `ca` (plaintext if None), `client`'s cert."""
    target = server if isinstance(server, str) else server.target
    if ca is None:
        return grpc.aio.insecure_channel(target)
    credentials = grpc.ssl_channel_credentials(
        ca.cert_pem,
        client.key_pem if client else None,
        client.cert_pem if client else None,
    )
    return grpc.aio.secure_channel(target, credentials)


async def get_rate(ch: grpc.aio.Channel) -> pb.RateStatus:
    return await pb_grpc.RateControlStub(ch).GetRate(pb.GetRateRequest(), timeout=10)


async def refused(server: SluiceServer, ch: grpc.aio.Channel) -> None:
    """Neither a unary call nor a Publish gets through `ch`: UNAVAILABLE (the handshake failed), and
    the server took nothing from it."""
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await get_rate(ch)
        assert unary.value.code() == grpc.StatusCode.UNAVAILABLE, unary.value
        call = pb_grpc.IngestStub(ch).Publish(timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as publish:
            await call.write(pb.PublishRequest(open=pb.Open(stream="s", producer_id="intruder")))
            await call.read()
        assert publish.value.code() == grpc.StatusCode.UNAVAILABLE, publish.value
    stats = server.receivers["s"].stats
    assert (stats.sessions_opened, stats.records_received, stats.credit_granted) == (0, 0, 0)


async def publish(ch: grpc.aio.Channel, target: str, values: list[bytes]) -> int:
    """Publish `values` over `ch` and return how many were acked."""
    async with Producer(target, "s", channel=ch, linger=0.001, start_timeout=10) as producer:
        await producer.send_many(values)
        await producer.flush(timeout=20)
        return producer.acked


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CertificateAuthority, Issued]:
    ca = CertificateAuthority(tmp_path / "pki")
    return ca, ca.issue("localhost", server=True, file_stem="server")


async def test_tls_publish_and_call(tmp_path: Path, pki: tuple[CertificateAuthority, Issued]) -> None:
    ca, server_cert = pki
    security = SecurityConfig(tls=TlsConfig(server_cert.cert_file, server_cert.key_file))
    async with tls_server(tmp_path, security) as server:
        assert server.transport == "TLS"
        async with channel(server, ca) as ch:
            assert await publish(ch, server.target, [b"a", b"b", b"c"]) == 3
            assert (await get_rate(ch)).estimator == "fixed"


async def test_plaintext_client_and_untrusted_server_refused(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    _, server_cert = pki
    security = SecurityConfig(tls=TlsConfig(server_cert.cert_file, server_cert.key_file))
    other = CertificateAuthority(tmp_path / "other", "other-ca")
    async with tls_server(tmp_path, security) as server:
        await refused(server, channel(server, None))  # plaintext to a TLS port
        await refused(server, channel(server, other))  # the server's certificate is not of a trusted CA
        # the CLI in plaintext: gRPC says only "Socket closed"; the CLI says what may be missing
        command = [sys.executable, "-m", "ingest.cli", "rate", "get", "--target", server.target]
        done = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=60, check=False
        )
        assert done.returncode == 1 and "Socket closed" in done.stderr, done.stderr
        assert "if the server serves TLS, give its CA: --ca-file" in done.stderr


async def test_a_client_speaking_tls_to_a_plaintext_port_is_told_so(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    """An outside tester: a client given a CA (--ca-file, SLUICE_CA_FILE) against a server that does not
    serve TLS got gRPC's "Tls handshake failed ... WRONG_VERSION_NUMBER: Invalid certificate
    verification context" and exit 3, as if a certificate were wrong, with no word of the cause (the
    reverse mistake has its hint). Each client command says the server answered in plaintext."""
    ca, _ = pki
    records = tmp_path / "records.txt"
    records.write_text("a\nb\n")
    async with tls_server(tmp_path, SecurityConfig()) as server:
        base = [sys.executable, "-m", "ingest.cli"]
        where = ["--target", server.target, "--ca-file", str(ca.cert_file)]
        for args in (
            ["rate", "get", *where],
            ["status", "--once", *where],
            ["push", str(records), "--stream", "s", "--no-progress", *where],
        ):
            done = await asyncio.to_thread(
                subprocess.run, base + args, capture_output=True, text=True, timeout=60, check=False
            )
            assert done.returncode == 3, (args, done.stderr)
            said = "the server answered in plaintext: it does not serve TLS"
            assert said in done.stderr, (args, done.stderr)
            assert "Traceback" not in done.stderr


async def test_mutual_tls(tmp_path: Path, pki: tuple[CertificateAuthority, Issued]) -> None:
    ca, server_cert = pki
    other = CertificateAuthority(tmp_path / "other", "other-ca")
    security = SecurityConfig(tls=TlsConfig(server_cert.cert_file, server_cert.key_file, ca.cert_file))
    async with tls_server(tmp_path, security) as server:
        assert server.transport == "mutual TLS"
        # refused first, so that the counters show that nothing was taken from them
        await refused(server, channel(server, ca))  # no client certificate
        await refused(server, channel(server, ca, ca.issue("old-app", expired=True)))
        await refused(server, channel(server, ca, other.issue("stranger")))  # another CA's
        async with channel(server, ca, ca.issue("app")) as ch:
            assert await publish(ch, server.target, [b"x"] * 10) == 10
        sessions = server.receivers["s"].stats.sessions_opened
        assert sessions == 1


async def test_handshake_timeout_drops_a_silent_client(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    """A client that connects and sends nothing (no TLS ClientHello, no HTTP/2 preface) is dropped
    after --handshake-timeout, on a plaintext port and on a TLS port (gRPC's default is 120 s)."""
    ca, server_cert = pki

    def silent(port: int) -> float:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            while sock.recv(4096):  # a plaintext server sends its SETTINGS, then GOAWAY and closes
                pass
        return time.monotonic() - started

    for tls in (None, TlsConfig(server_cert.cert_file, server_cert.key_file)):
        security = SecurityConfig(tls=tls, handshake_timeout=0.5)
        async with tls_server(tmp_path / str(tls is None), security) as server:
            took = await asyncio.to_thread(silent, server.port)
            assert 0.4 < took < 10, (tls, took)
            # the server still serves the others
            async with channel(server, ca if tls else None) as ch:
                await get_rate(ch)


async def test_reload_keeps_the_old_files_when_a_new_one_is_bad(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued], caplog: pytest.LogCaptureFixture
) -> None:
    ca, server_cert = pki
    auth_file = tmp_path / "auth.toml"
    token = f'token_sha256 = "{token_hash("app")}"\n'  # a file of no token is refused without mTLS
    auth_file.write_text('[principals.app]\nroles = ["producer", "reader"]\nstreams = ["*"]\n' + token)
    security = SecurityConfig(tls=TlsConfig(server_cert.cert_file, server_cert.key_file), auth_file=auth_file)
    async with tls_server(tmp_path, security) as server:
        assert server.auth.table is not None
        auth_file.write_text(auth_file.read_text() + '[principals.ops]\nroles = ["operator"]\n')
        assert server.reload_security() == ["TLS: unchanged", "auth file: 2 principals, 1 tokens"]
        table = server.auth.table
        assert set(table.principals) == {"app", "ops"}
        server_cert.cert_file.write_text("not a certificate\n")
        auth_file.write_text("[principals.app\n")
        with caplog.at_level(logging.INFO, logger="ingest.server"):
            assert server.reload_security() == []
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2, errors
        assert "TLS files not reloaded, the old certificate stays" in errors[0]
        assert str(server_cert.cert_file) in errors[0]
        assert "auth file not reloaded" in errors[1]
        assert server.auth.table is table
        # new connections still get the old certificate
        async with channel(server, ca) as ch:
            call = pb_grpc.RateControlStub(ch).GetRate(pb.GetRateRequest(), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await call
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED  # through TLS, then no token


def test_tls_files_checked(tmp_path: Path, pki: tuple[CertificateAuthority, Issued]) -> None:
    ca, server_cert = pki
    other_key = ca.issue("other", server=True).key_file
    missing = tmp_path / "missing.pem"
    for config, message in (
        (TlsConfig(missing, server_cert.key_file), "cannot read the TLS certificate (--tls-cert)"),
        (TlsConfig(server_cert.cert_file, missing), "cannot read the TLS key (--tls-key)"),
        (TlsConfig(server_cert.key_file, server_cert.key_file), "holds no PEM certificate"),
        (TlsConfig(server_cert.cert_file, server_cert.cert_file), "is not a PEM private key"),
        (TlsConfig(server_cert.cert_file, other_key), "is not the key of the certificate"),
        (TlsConfig(server_cert.cert_file, server_cert.key_file, missing), "cannot read the client CA"),
        (TlsConfig(server_cert.cert_file, server_cert.key_file, server_cert.key_file), "no PEM certificate"),
    ):
        with pytest.raises(TlsFileError, match=re.escape(message)):
            load_tls(config)
    material = load_tls(TlsConfig(server_cert.cert_file, server_cert.key_file, ca.cert_file))
    assert material.warnings() == []
    soon = material.not_after - dt.timedelta(days=3)
    assert any("expires on" in w and "in 3 days" in w for w in material.warnings(soon))
    expired = ca.issue("localhost", server=True, expired=True, file_stem="expired")
    assert any("expired on" in w for w in load_tls(TlsConfig(expired.cert_file, expired.key_file)).warnings())
    server_cert.key_file.chmod(0o644)
    loose = load_tls(TlsConfig(server_cert.cert_file, server_cert.key_file))
    assert any("chmod 600" in w for w in loose.warnings())


# ---- `sluice serve` as a process ------------------------------------------------------------------


def sluice(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([*SLUICE, *args], capture_output=True, timeout=120, check=False)


def start_serve(tmp_path: Path, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*SLUICE, "serve", "--no-spark", "--port", "0", "--data-dir", str(tmp_path / "data"), *args],
            stderr=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return proc, log


def wait_for(proc: subprocess.Popen[bytes], log: Path, pattern: str, timeout: float = 60) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        match = re.search(pattern, log.read_text(errors="replace"))
        if match:
            return match
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r}; the log says:\n{log.read_text(errors='replace')}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_serve_refuses_bad_tls_files_before_starting(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    _, server_cert = pki
    data = tmp_path / "data"
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    for args, message in (
        (["--tls-cert", str(server_cert.cert_file)], "TLS needs both --tls-cert and --tls-key"),
        (["--client-ca", str(server_cert.cert_file)], "--client-ca (mutual TLS) needs TLS"),
        (
            ["--tls-cert", str(server_cert.cert_file), "--tls-key", str(tmp_path / "nope.key")],
            f"cannot read the TLS key (--tls-key) {tmp_path / 'nope.key'}: No such file or directory",
        ),
        (
            ["--tls-cert", str(server_cert.key_file), "--tls-key", str(server_cert.key_file)],
            "holds no PEM certificate",
        ),
        (["--auth-file", str(server_cert.cert_file)], "is not valid TOML"),
        (["--auth-file", str(empty)], "no principals"),  # truncated: it would refuse every caller
        (["--metrics-tls"], "--metrics-tls needs the server's certificate and key"),  # the flag's name
    ):
        result = sluice("serve", "--no-spark", "--port", "0", "--data-dir", str(data), *args)
        assert result.returncode == 2, (args, result.stderr.decode())
        assert message in result.stderr.decode(), (args, result.stderr.decode())
        assert result.stderr.decode().count("\n") == 1  # one line, no stack trace
    assert not data.exists()  # nothing was started


def test_serve_refuses_plaintext_on_a_non_loopback_address(tmp_path: Path) -> None:
    for args, what in (
        (["--host", "0.0.0.0"], "gRPC"),
        (["--metrics-host", "0.0.0.0", "--metrics-port", "0"], "metrics"),
    ):
        result = sluice("serve", "--no-spark", "--port", "0", "--data-dir", str(tmp_path / "data"), *args)
        assert result.returncode == 2, result.stderr.decode()
        line = result.stderr.decode()
        assert line.count("\n") == 1, line
        assert f"refusing to serve {what} in plaintext on 0.0.0.0" in line
        assert "--insecure" in line
    proc, log = start_serve(tmp_path, "--host", "0.0.0.0", "--insecure", "--metrics-port", "-1")
    try:
        port = int(wait_for(proc, log, r"serving streams default on 0\.0\.0\.0:(\d+)").group(1))

        async def rate() -> pb.RateStatus:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                return await get_rate(ch)

        assert asyncio.run(rate()).estimator == "fixed"
    finally:
        stop(proc)


def test_sighup_reloads_the_certificate_and_keeps_sessions(tmp_path: Path) -> None:
    """Start with certificate A; a Publish session open; files swapped to B (another CA); SIGHUP. The
    session keeps publishing on its connection and gets acks; a new client trusting only B connects,
    one trusting only A does not. Then a bad file: an ERROR, and B stays."""
    ca_a = CertificateAuthority(tmp_path / "a", "ca-a")
    ca_b = CertificateAuthority(tmp_path / "b", "ca-b")
    a, b = ca_a.issue("localhost", server=True), ca_b.issue("localhost", server=True)
    cert, key = tmp_path / "server.crt", tmp_path / "server.key"
    cert.write_bytes(a.cert_pem)
    key.write_bytes(a.key_pem)
    key.chmod(0o600)
    proc, log = start_serve(tmp_path, "--tls-cert", str(cert), "--tls-key", str(key), "--metrics-port", "0")
    try:
        match = wait_for(proc, log, r"on (127\.0\.0\.1:\d+), metrics on 127\.0\.0\.1:(\d+)/metrics; TLS")
        target, metrics_port = match.group(1), int(match.group(2))

        def sessions_opened() -> str:
            url = f"http://127.0.0.1:{metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            found = re.search(r'^sluice_sessions_opened_total\{stream="default"\} (\S+)', text, re.M)
            assert found is not None
            return found.group(1)

        async def scenario() -> None:
            async with channel(target, ca_a) as ch:
                producer = Producer(target, "default", channel=ch, linger=0.001, start_timeout=10)
                async with producer:
                    await producer.send_many([b"before"] * 100)
                    await producer.flush(timeout=20)
                    cert.write_bytes(b.cert_pem)
                    key.write_bytes(b.key_pem)
                    proc.send_signal(signal.SIGHUP)
                    reloaded = r"reload: TLS: new connections get CN=localhost"
                    await asyncio.to_thread(wait_for, proc, log, reloaded)
                    await producer.send_many([b"after"] * 100)
                    await producer.flush(timeout=20)
                    assert producer.acked == 200
                assert await asyncio.to_thread(sessions_opened) == "1.0"  # the same session throughout
            async with channel(target, ca_b) as ch:
                await get_rate(ch)
            async with channel(target, ca_a) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await get_rate(ch)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            # a bad file: logged, B stays
            cert.write_text("garbage\n")
            proc.send_signal(signal.SIGHUP)
            kept = r"ERROR .*TLS files not reloaded, the old certificate stays"
            await asyncio.to_thread(wait_for, proc, log, kept)
            async with channel(target, ca_b) as ch:
                await get_rate(ch)

        asyncio.run(scenario())
        assert proc.poll() is None
    finally:
        stop(proc)
    assert proc.returncode == 0, log.read_text()


def test_security_and_limit_flags() -> None:
    from ingest.cli import _parser, _security
    from receivers.principal import Limits

    args = _parser().parse_args(
        [
            "serve",
            "--max-sessions-per-principal",
            "3",
            "--max-streams-per-principal",
            "2",
            "--max-message-bytes-per-principal",
            "1MiB",
            "--max-record-bytes",
            "64KiB",
            "--idle-timeout",
            "none",
            "--handshake-timeout",
            "2.5",
            "--no-metrics-auth",
        ]
    )
    security = _security(args)
    assert security.limits == Limits(3, 2, 1 << 20, 64 << 10, None)
    assert security.handshake_timeout == 2.5
    assert security.metrics_auth is False
    assert _security(_parser().parse_args(["serve"])) == SecurityConfig()
    for flag, value in (
        ("--max-sessions-per-principal", "0"),
        ("--max-record-bytes", "-1"),
        ("--idle-timeout", "inf"),
        ("--handshake-timeout", "0"),
        ("--handshake-timeout", "nan"),
    ):
        result = sluice("serve", "--no-spark", flag, value)
        assert result.returncode == 2, (flag, value)
        assert f"argument {flag}" in result.stderr.decode()


def test_dev_certs_refuse_a_client_name_that_is_not_a_file_name_of_its_own(tmp_path: Path) -> None:
    """An outside tester's finding: --client NAME was a path. `./ca` overwrote the CA certificate with a
    client's (CN=./ca, CA:FALSE) while the output still called it the CA, `../../outside` wrote outside
    DIR, and `x/y` failed with a raw Errno after ca.crt and server.* were written (a re-run then said
    they exist). Each is refused with exit 2 before anything is written."""
    out = tmp_path / "deep" / "certs"
    for name in ("./ca", "../../outside", "x/y"):  # the tester's, as a user runs them
        refused = sluice("dev-certs", str(out), "--client", "fine", "--client", name)
        assert refused.returncode == 2, (name, refused.stderr.decode())
        message = refused.stderr.decode()
        assert f"--client {name!r}" in message and "Traceback" not in message, message
        assert not out.exists(), name  # checked before anything was written
    for name in (".hidden", "..", ".", "a\\b", "CA", "Server", "a b", "", "x" * 65):
        with pytest.raises(ValueError, match="--client"):
            write_dev_certs(out, (), ("fine", name))
        assert not out.exists(), name
    assert not list(tmp_path.rglob("*.crt"))
    repeated = sluice("dev-certs", str(out), "--client", "alice", "--client", "Alice")
    assert repeated.returncode == 2 and "repeats" in repeated.stderr.decode()
    made = sluice(
        "dev-certs", str(out), "--client", "alice", "--client", "svc-1", "--client", "ingest.worker"
    )
    assert made.returncode == 0, made.stderr.decode()
    stems = {"ca", "server", "alice", "svc-1", "ingest.worker"}
    assert {p.name for p in out.iterdir()} == {f"{s}.crt" for s in stems} | {
        f"{s}.key" for s in stems - {"ca"}
    }
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_dev_certs_take_a_long_host_name_and_refuse_a_bad_one_before_writing(tmp_path: Path) -> None:
    """An outside tester: a valid DNS name of 79 characters failed with cryptography's "Attribute's
    length must be >= 1 and <= 64" (the CN) after ca.crt was written. It is in the SANs now, under a
    short CN; a --host no certificate can name is refused (exit 2, naming --host) before any write."""
    long_name = f"{'a' * 63}.{'b' * 11}.com"  # 79
    assert len(long_name) == 79
    out = tmp_path / "certs"
    made = sluice("dev-certs", str(out), "--host", long_name)
    assert made.returncode == 0, made.stderr.decode()
    cert = x509.load_pem_x509_certificate((out / "server.crt").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert long_name in sans.get_values_for_type(x509.DNSName)
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "sluice server"
    short = write_dev_certs(tmp_path / "short", ("*.example.com", "[::2]"))
    cert = x509.load_pem_x509_certificate(short.server_cert.read_bytes())
    assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == "*.example.com"
    bad_out = tmp_path / "bad"
    for host in ("a" * 64 + ".com", "x" * 254, "a b", "bad..name", "-x.com", "[foo]", "h\u00e9.com", ""):
        refused = sluice("dev-certs", str(bad_out), "--host", "ok.example.com", "--host", host)
        message = refused.stderr.decode()
        assert refused.returncode == 2, (host, message)
        assert "--host" in message and "Traceback" not in message and "Attribute" not in message, message
        assert not bad_out.exists(), host


def test_dev_certs_refuse_a_file_as_dir(tmp_path: Path) -> None:
    """An outside tester: `sluice dev-certs FILE` said "[Errno 17] File exists". It says FILE is a file
    (exit 2, as its other refusals), also for a folder under a file, and writes nothing."""
    file = tmp_path / "file"
    file.write_text("kept\n")
    for target, force in ((file, ()), (file, ("--force",)), (file / "sub", ())):
        refused = sluice("dev-certs", str(target), *force)
        message = refused.stderr.decode()
        assert refused.returncode == 2, message
        assert f"{file} is a file, not a directory" in message and "Errno" not in message, message
    assert file.read_text() == "kept\n"
    assert not list(tmp_path.rglob("*.crt"))


def test_dev_certs_make_a_working_mutual_tls_set(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    made = sluice("dev-certs", str(out), "--host", "sluice.example.com", "--client", "app")
    assert made.returncode == 0, made.stderr.decode()
    assert "for trials only" in made.stdout.decode()
    names = {"ca.crt", "server.crt", "server.key", "app.crt", "app.key"}
    assert {p.name for p in out.iterdir()} == names
    assert (out / "server.key").stat().st_mode & 0o777 == 0o600
    assert (out / "app.key").stat().st_mode & 0o777 == 0o600
    again = sluice("dev-certs", str(out))
    assert again.returncode == 1 and "exists (--force replaces it)" in again.stderr.decode()
    material = load_tls(TlsConfig(out / "server.crt", out / "server.key", out / "ca.crt"))
    assert material.warnings() == []

    async def connect() -> None:
        tls = TlsConfig(out / "server.crt", out / "server.key", out / "ca.crt")
        async with tls_server(tmp_path, SecurityConfig(tls=tls)) as server:
            ca_pem = (out / "ca.crt").read_bytes()
            credentials = grpc.ssl_channel_credentials(
                ca_pem, (out / "app.key").read_bytes(), (out / "app.crt").read_bytes()
            )
            async with grpc.aio.secure_channel(server.target, credentials) as ch:
                await get_rate(ch)
            async with grpc.aio.secure_channel(server.target, grpc.ssl_channel_credentials(ca_pem)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as exc:
                    await get_rate(ch)
                assert exc.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(connect())


async def test_a_producer_refused_its_certificate_is_told_it_may_be_that(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    """A server that refuses the client's certificate closes the socket in the handshake, which the
    client cannot tell from no server at all: the StartTimeoutError names the likelier cause."""
    from sluice_client import Credentials
    from sluice_client.errors import StartTimeoutError

    ca, server_cert = pki
    security = SecurityConfig(tls=TlsConfig(server_cert.cert_file, server_cert.key_file, ca.cert_file))
    async with tls_server(tmp_path, security) as server:
        no_cert = Credentials(root_certificates=ca.cert_pem)
        with pytest.raises(StartTimeoutError, match="refused this client's TLS certificate"):
            async with Producer(server.target, "s", credentials=no_cert, start_timeout=1) as producer:
                await producer.send(b"x")
                await producer.flush(timeout=10)


async def test_a_producer_whose_key_is_not_its_certificates_fails_at_once(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    """Credentials built from bytes skip from_files' check of the pair: gRPC then cannot make its
    handshaker ("Failed to create security handshaker"), at every attempt alike. That is final, not
    a server to wait for until start_timeout."""
    from sluice_client import Credentials
    from sluice_client.errors import RPCError, StartTimeoutError

    ca, server_cert = pki
    client, other = ca.issue("app"), ca.issue("other")
    security = SecurityConfig(tls=TlsConfig(server_cert.cert_file, server_cert.key_file, ca.cert_file))
    async with tls_server(tmp_path, security) as server:
        mismatched = Credentials(ca.cert_pem, certificate_chain=client.cert_pem, private_key=other.key_pem)
        producer = Producer(server.target, "s", credentials=mismatched, start_timeout=30)
        started = time.monotonic()
        with pytest.raises(RPCError, match="security handshaker") as info:
            await producer.start()
        assert not isinstance(info.value, StartTimeoutError)
        assert time.monotonic() - started < 10  # not 30 s of retries
