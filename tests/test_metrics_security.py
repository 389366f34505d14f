"""/metrics over HTTPS (the server's certificate, reloaded with it) and behind a reader's token or
client certificate: 200 for a reader or operator, 401 (WWW-Authenticate: Bearer) without credentials
or with an unknown token, 403 for another role; a silent client does not hold up other scrapes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pki import CertificateAuthority, Issued
from support import running_server

from ingest import metrics
from ingest.config import SecurityConfig, TlsConfig
from ingest.server import SluiceServer
from receivers.auth import token_hash

TOKENS = {"reader": "r" * 43, "operator": "o" * 43, "producer": "p" * 43}


@contextlib.asynccontextmanager
async def metrics_server(tmp_path: Path, security: SecurityConfig) -> AsyncIterator[SluiceServer]:
    async with running_server(tmp_path / "data", "s", metrics=True, security=security) as server:
        yield server


def auth_file(path: Path) -> Path:
    """Three principals by token (a reader, an operator, a producer) and one by certificate."""
    lines = []
    for role, token in TOKENS.items():
        streams = 'streams = ["*"]\n' if role == "producer" else ""
        digest = token_hash(token)
        lines.append(f'[principals.{role}-app]\nroles = ["{role}"]\n{streams}token_sha256 = ["{digest}"]\n')
    lines.append('[principals.prometheus]\nroles = ["reader"]\n')
    path.write_text("\n".join(lines))
    return path


def scrape(
    server: SluiceServer,
    *,
    ca: CertificateAuthority | None = None,
    token: str | None = None,
    client: Issued | None = None,
    path: str = "/metrics",
) -> tuple[int, dict[str, str], str]:
    """GET `path` (/metrics): status, headers, body."""
    assert server.metrics_port is not None
    context = None
    if ca is not None:
        context = ssl.create_default_context(cafile=str(ca.cert_file))
        if client is not None:
            context.load_cert_chain(client.cert_file, client.key_file)
    scheme = "https" if ca is not None else "http"
    request = urllib.request.Request(f"{scheme}://localhost:{server.metrics_port}{path}")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(exc.headers), exc.read().decode()


@pytest.fixture
def pki(tmp_path: Path) -> tuple[CertificateAuthority, Issued]:
    ca = CertificateAuthority(tmp_path / "pki")
    return ca, ca.issue("localhost", server=True, file_stem="server")


async def test_metrics_https_with_the_server_certificate_reloaded(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    ca, server_cert = pki
    tls = TlsConfig(server_cert.cert_file, server_cert.key_file)
    async with metrics_server(tmp_path, SecurityConfig(tls=tls, metrics_tls=True)) as server:
        status, _, body = await asyncio.to_thread(scrape, server, ca=ca)
        assert status == 200 and "sluice_records_received_total" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the HTTPS port
            await asyncio.to_thread(scrape, server)
        # a silent client (no ClientHello) does not hold up the next scrape
        with socket.create_connection(("127.0.0.1", server.metrics_port or 0)):
            status, _, _ = await asyncio.to_thread(scrape, server, ca=ca)
            assert status == 200
        other = CertificateAuthority(tmp_path / "other", "other-ca")
        renewed = other.issue("localhost", server=True)
        server_cert.cert_file.write_bytes(renewed.cert_pem)
        server_cert.key_file.write_bytes(renewed.key_pem)
        assert server.reload_security()[0].startswith("TLS: new connections get CN=localhost")
        status, _, _ = await asyncio.to_thread(scrape, server, ca=other)
        assert status == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            await asyncio.to_thread(scrape, server, ca=ca)


async def test_metrics_token(tmp_path: Path) -> None:
    security = SecurityConfig(auth_file=auth_file(tmp_path / "auth.toml"))
    assert security.metrics_token_required
    async with metrics_server(tmp_path, security) as server:
        for token in (None, "unknown-token"):
            status, headers, body = await asyncio.to_thread(scrape, server, token=token)
            assert status == 401, body
            assert headers["WWW-Authenticate"].startswith("Bearer")
            assert "sluice_" not in body
        status, headers, body = await asyncio.to_thread(scrape, server, token=TOKENS["producer"])
        assert status == 403, body
        assert "'producer-app' may not read /metrics" in body
        for role in ("reader", "operator"):
            status, _, body = await asyncio.to_thread(scrape, server, token=TOKENS[role])
            assert status == 200 and "sluice_records_received_total" in body
    # --no-metrics-auth: the auth file guards gRPC only
    security = SecurityConfig(auth_file=auth_file(tmp_path / "auth.toml"), metrics_auth=False)
    async with metrics_server(tmp_path / "2", security) as server:
        status, _, _ = await asyncio.to_thread(scrape, server)
        assert status == 200


@pytest.mark.parametrize("path", ["/status", "/status.json"])
async def test_status_page_under_the_same_rules(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued], path: str
) -> None:
    """The status page and its numbers: a reader's or operator's token, over the metrics port's TLS."""
    ca, server_cert = pki
    tls = TlsConfig(server_cert.cert_file, server_cert.key_file)
    security = SecurityConfig(tls=tls, metrics_tls=True, auth_file=auth_file(tmp_path / "auth.toml"))
    async with metrics_server(tmp_path, security) as server:
        status, headers, body = await asyncio.to_thread(scrape, server, ca=ca, path=path)
        assert status == 401, body
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert "Sluice" not in body and "records_received" not in body
        status, _, body = await asyncio.to_thread(scrape, server, ca=ca, token=TOKENS["producer"], path=path)
        assert status == 403, body
        expected = "<title>Sluice status</title>" if path == "/status" else '"records_received_total"'
        for role in ("reader", "operator"):
            token = TOKENS[role]
            status, headers, body = await asyncio.to_thread(scrape, server, ca=ca, token=token, path=path)
            assert status == 200, body
            assert expected in body
            assert "default-src 'none'" in headers["Content-Security-Policy"]
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP to the HTTPS port
            await asyncio.to_thread(scrape, server, token=TOKENS["reader"], path=path)


async def test_metrics_mutual_tls(tmp_path: Path, pki: tuple[CertificateAuthority, Issued]) -> None:
    """With a client CA: Prometheus may present a certificate instead of a token; a certificate of no
    reader is 403. Without an auth file every certificate of the CA gets in, and one is required."""
    ca, server_cert = pki
    tls = TlsConfig(server_cert.cert_file, server_cert.key_file, ca.cert_file)
    security = SecurityConfig(tls=tls, metrics_tls=True, auth_file=auth_file(tmp_path / "auth.toml"))
    async with metrics_server(tmp_path, security) as server:
        status, _, _ = await asyncio.to_thread(scrape, server, ca=ca, client=ca.issue("prometheus"))
        assert status == 200
        status, _, _ = await asyncio.to_thread(scrape, server, ca=ca, token=TOKENS["reader"])
        assert status == 200
        status, _, _ = await asyncio.to_thread(scrape, server, ca=ca, client=ca.issue("producer-app"))
        assert status == 403
        status, _, _ = await asyncio.to_thread(scrape, server, ca=ca, client=ca.issue("nobody"))
        assert status == 403
        status, _, _ = await asyncio.to_thread(scrape, server, ca=ca)
        assert status == 401
    security = SecurityConfig(tls=tls, metrics_tls=True)
    async with metrics_server(tmp_path / "2", security) as server:
        status, _, _ = await asyncio.to_thread(scrape, server, ca=ca, client=ca.issue("anyone"))
        assert status == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            await asyncio.to_thread(scrape, server, ca=ca)


def _raw_get(port: int, path: str, method: str = "GET") -> tuple[int, str]:
    """`method` `path` as given (http.client sends the path unnormalised, `..` included)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


async def test_only_the_documented_paths_answer(tmp_path: Path) -> None:
    """An outside tester: any path on the metrics port answered 200 with the metrics (`/nope`,
    `/../../etc/passwd`): prometheus_client's app serves every path. /metrics, /status and
    /status.json answer; any other path is 404, without the metrics."""
    async with metrics_server(tmp_path, SecurityConfig()) as server:
        port = server.metrics_port or 0
        status, body = await asyncio.to_thread(_raw_get, port, "/metrics")
        assert status == 200 and "sluice_records_received_total" in body
        assert (await asyncio.to_thread(_raw_get, port, "/metrics", "HEAD"))[0] == 200
        assert (await asyncio.to_thread(_raw_get, port, "/status"))[0] == 200
        status, body = await asyncio.to_thread(_raw_get, port, "/status.json")
        assert status == 200 and body.startswith("{")
        for path in (
            "/nope",
            "/../../etc/passwd",
            "/",
            "/metrics/x",
            "/metricsx",
            "/favicon.ico",
        ):  # (not "//metrics": http.server takes it for /metrics, as it collapses a leading "//")
            status, body = await asyncio.to_thread(_raw_get, port, path)
            assert status == 404, (path, status)
            assert "sluice_" not in body and "metrics are at /metrics" in body, (path, body)


def _trickle(port: int) -> socket.socket:
    """A connection to the metrics port that has sent the start of a request and no more."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /metrics HTTP/1.1\r\n")
    return sock


def _closed_by_server(sock: socket.socket, within: float) -> bool:
    """True once the server has closed `sock` (EOF or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def test_slow_or_silent_clients_cannot_take_the_metrics_ports_threads_and_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside tester: every connection to the metrics port (before any token check) held a thread
    and a file for as long as it sent a byte every 29 s, however many: 3,000 such connections made
    3,000 threads, and enough of them would take the process's open files from the block log and the
    gRPC port. The port holds at most MAX_CONNECTIONS (one over it is closed at once), and a connection
    gets DEADLINE seconds in all for its request and answer, however it trickles."""
    monkeypatch.setattr(metrics, "MAX_CONNECTIONS", 8, raising=False)
    monkeypatch.setattr(metrics, "DEADLINE", 1.5, raising=False)
    async with metrics_server(tmp_path, SecurityConfig()) as server:
        port = server.metrics_port or 0
        held = [await asyncio.to_thread(_trickle, port) for _ in range(8)]
        try:
            # the ninth is closed at once, without a thread of its own
            extra = await asyncio.to_thread(_trickle, port)
            with extra:
                assert await asyncio.to_thread(_closed_by_server, extra, 1.0)
            # a trickler that keeps sending is closed at the deadline all the same
            for _ in range(3):
                for sock in held:
                    with contextlib.suppress(OSError):
                        sock.sendall(b"X")
                await asyncio.sleep(0.4)
            assert all([await asyncio.to_thread(_closed_by_server, sock, 2.0) for sock in held])
        finally:
            for sock in held:
                sock.close()
        # and then an honest scrape gets in again
        status, _, body = await asyncio.to_thread(scrape, server)
        assert status == 200 and "sluice_records_received_total" in body


async def test_status_says_when_the_metrics_url_has_the_wrong_scheme(
    tmp_path: Path, pki: tuple[CertificateAuthority, Issued]
) -> None:
    """An outside tester: `sluice status --metrics http://...` against an HTTPS metrics port said only
    "Remote end closed connection without response", and https:// against a plaintext one "[SSL:
    WRONG_VERSION_NUMBER] wrong version number". Each now says which scheme the port may want."""
    from ingest.status_cli import StatusReadError, read_http
    from sluice_client import Credentials

    ca, server_cert = pki
    tls = TlsConfig(server_cert.cert_file, server_cert.key_file)
    async with metrics_server(tmp_path / "tls", SecurityConfig(tls=tls, metrics_tls=True)) as server:
        url = f"http://localhost:{server.metrics_port}/status.json"
        with pytest.raises(StatusReadError, match=r"--metrics-tls\), use an https:// URL"):
            await asyncio.to_thread(read_http, url, Credentials())
    async with metrics_server(tmp_path / "plain", SecurityConfig()) as server:
        url = f"https://localhost:{server.metrics_port}/status.json"
        credentials = Credentials.from_files(ca_file=ca.cert_file)
        with pytest.raises(StatusReadError, match=r"answered in plaintext: use an http:// URL"):
            await asyncio.to_thread(read_http, url, credentials)
