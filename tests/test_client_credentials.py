"""Client credentials: Credentials from files and the environment, the Producer, the SyncProducer and the
CLI's client commands against a real server with an auth file (plaintext and TLS), and `sluice token`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import grpc
import pytest
from pki import CertificateAuthority
from support import running_server

from ingest.config import SecurityConfig, TlsConfig
from ingest.server import SluiceServer
from receivers.auth import new_token, token_hash
from sluice_client import Producer, SyncProducer
from sluice_client.credentials import Credentials, CredentialsError
from sluice_client.errors import RPCError

SLUICE = [str(Path(sys.executable).parent / "sluice")]
PRODUCER, OPERATOR, TINY = new_token(), new_token(), new_token()


def auth_file(path: Path) -> Path:
    path.write_text(
        f"""
[principals.app]
roles = ["producer"]
streams = ["s"]
token_sha256 = "{token_hash(PRODUCER)}"

[principals.ops]
roles = ["operator", "reader"]
token_sha256 = "{token_hash(OPERATOR)}"

[principals.tiny]
roles = ["producer"]
streams = ["s"]
max_sessions = 1
token_sha256 = "{token_hash(TINY)}"
"""
    )
    return path


def token_file(path: Path, token: str) -> Path:
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


@contextlib.asynccontextmanager
async def server_with(tmp_path: Path, tls: TlsConfig | None = None) -> AsyncIterator[SluiceServer]:
    security = SecurityConfig(auth_file=auth_file(tmp_path / "auth.toml"), tls=tls)
    async with running_server(tmp_path / "data", "s", "t", security=security) as server:
        yield server


async def cli(*args: str | Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    environment.update(env or {})
    return await asyncio.to_thread(
        subprocess.run,
        [*SLUICE, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=environment,
    )


# ---- Credentials ---------------------------------------------------------------------------------


def test_credentials_from_files_and_the_environment(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    client = ca.issue("app")
    tokens = token_file(tmp_path / "token", PRODUCER)
    env = {
        "SLUICE_CA_FILE": str(ca.cert_file),
        "SLUICE_CERT_FILE": str(client.cert_file),
        "SLUICE_KEY_FILE": str(client.key_file),
        "SLUICE_TOKEN_FILE": str(tokens),
    }
    found = Credentials.from_env(env)
    assert found.root_certificates == ca.cert_pem and found.private_key == client.key_pem
    assert found.secure and found.metadata == (("authorization", f"Bearer {PRODUCER}"),)
    assert PRODUCER not in repr(found) and client.key_pem.decode() not in repr(found)
    # SLUICE_TOKEN when no token file is given; a flag's file wins over its variable
    assert Credentials.from_env({"SLUICE_TOKEN": f" {OPERATOR}\n"}).token == OPERATOR
    assert not Credentials.from_env({"SLUICE_TOKEN": OPERATOR}).secure
    both = {"SLUICE_TOKEN": OPERATOR, "SLUICE_TOKEN_FILE": str(tokens)}
    assert Credentials.from_env(both).token == PRODUCER
    other = token_file(tmp_path / "other", OPERATOR)
    assert Credentials.from_env(env, token_file=other).token == OPERATOR
    assert Credentials.from_env({}) == Credentials()
    for bad, message in (
        ({"SLUICE_TOKEN_FILE": str(tmp_path / "missing")}, "cannot read token file"),
        ({"SLUICE_CERT_FILE": str(client.cert_file)}, "needs its private key"),
        ({"SLUICE_TOKEN": "two words"}, "SLUICE_TOKEN holds characters"),
        ({"SLUICE_TOKEN_FILE": str(token_file(tmp_path / "empty", ""))}, "is empty"),
        # not PEM: gRPC's C core logged about it and every call failed UNAVAILABLE, blaming the server
        ({"SLUICE_CA_FILE": str(tokens)}, r"CA file .* holds no PEM block \(-----BEGIN CERTIFICATE-----\)"),
        (
            {"SLUICE_CERT_FILE": str(client.cert_file), "SLUICE_KEY_FILE": str(ca.cert_file)},
            r"key file .* holds no PEM block \(-----BEGIN PRIVATE KEY-----\)",
        ),
        (
            {"SLUICE_CERT_FILE": str(client.cert_file), "SLUICE_KEY_FILE": str(ca.issue("b").key_file)},
            r"key file .* is not the private key of the certificate file",
        ),
    ):
        with pytest.raises(CredentialsError, match=message):
            Credentials.from_env(bad)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"root_certificates": "/etc/ca.pem"},
            r"^root_certificates must be PEM bytes or None, not str \(a file's path",
        ),
        (
            {"certificate_chain": Path("c.pem"), "private_key": b"k"},
            r"^certificate_chain must be PEM bytes .*PosixPath",
        ),
        ({"token": b"abc"}, r"^token must be a str or None, not bytes$"),
        ({"token": 123}, r"^token must be a str or None, not int$"),
        ({"tls": "no"}, r"^tls must be a bool or None, not str \('no'\)$"),
        ({"server_name": 5}, r"^server_name must be a str or None, not int \(5\)$"),
    ],
)
def test_credentials_of_the_wrong_type_are_refused_at_construction(
    fields: dict[str, object], message: str
) -> None:
    """A CA file's path given as root_certificates failed only at start() ("expected certificate to be
    bytes"), a bytes token said "'<=' not supported between instances of 'str' and 'int'", and tls="no"
    was taken as True: a plaintext server then refused every handshake as if it were at fault."""
    with pytest.raises(TypeError, match=message):
        Credentials(**fields)  # type: ignore[arg-type]


async def test_a_producer_refuses_credentials_that_are_not_credentials(tmp_path: Path) -> None:
    """`credentials="token"` failed start() with AttributeError ('str' object has no attribute 'channel')."""
    with pytest.raises(
        TypeError, match=r"^credentials must be a sluice_client.Credentials or None, not str$"
    ):
        Producer("127.0.0.1:1", "s", credentials="secret")  # type: ignore[arg-type]
    async with running_server(tmp_path) as server:
        async with Producer(server.target, "s", credentials=Credentials(), linger=0) as producer:
            await producer.send(b"x")
            await producer.flush(10)
        assert producer.acked == 1


async def test_the_producer_and_the_sync_producer_send_their_token(tmp_path: Path) -> None:
    async with server_with(tmp_path) as server:
        async with Producer(server.target, "s", credentials=Credentials(token=PRODUCER), linger=0) as p:
            await p.send_many([b"a"] * 10)
            await p.flush(10)
        credentials = Credentials.from_env({"SLUICE_TOKEN": PRODUCER})

        def sync_push() -> int:
            with SyncProducer(server.target, "s", credentials=credentials, linger=0) as producer:
                producer.send_many([b"b"] * 5)
                producer.flush(10)
                return producer.acked

        assert await asyncio.to_thread(sync_push) == 5
        assert server.receivers["s"].stats.records_received == 15


async def test_a_per_principal_limit_ends_the_producer_without_spinning(tmp_path: Path) -> None:
    async with server_with(tmp_path) as server:
        credentials = Credentials(token=TINY)
        async with Producer(server.target, "s", credentials=credentials, linger=0) as first:
            await first.send_many([b"x"])
            await first.flush(10)
            second = Producer(server.target, "s", credentials=credentials, start_timeout=30)
            with pytest.raises(RPCError) as info:
                await second.start()  # it waits for the server's answer to its first session
            assert await second.abort() == []
            assert info.value.status is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert second.reconnects == 0  # a terminal error, not a reconnect loop
            await first.send_many([b"z"])
            await first.flush(10)


# ---- the CLI -------------------------------------------------------------------------------------


async def test_cli_client_commands_take_credentials_and_exit_3_when_refused(tmp_path: Path) -> None:
    ops = token_file(tmp_path / "ops.token", OPERATOR)
    app = token_file(tmp_path / "app.token", PRODUCER)
    records = tmp_path / "records.txt"
    records.write_text("".join(f"r{i}\n" for i in range(100)))
    async with server_with(tmp_path) as server:
        target = ["--target", server.target]
        denied = await cli("rate", "get", *target)
        assert denied.returncode == 3, denied.stderr
        assert denied.stderr.count("\n") == 1 and "UNAUTHENTICATED" in denied.stderr
        assert (await cli("rate", "get", *target, "--token-file", str(ops))).returncode == 0
        by_env = await cli("rate", "set", "500", *target, env={"SLUICE_TOKEN_FILE": str(ops)})
        assert by_env.returncode == 0, by_env.stderr
        assert server.rate.rate == 500
        wrong_role = await cli("rate", "set", "700", *target, "--token-file", str(app))
        assert wrong_role.returncode == 3 and "PERMISSION_DENIED" in wrong_role.stderr
        assert server.rate.rate == 500

        push = ["push", str(records), *target, "--no-progress", "--stream"]
        pushed = await cli(*push, "s", env={"SLUICE_TOKEN": PRODUCER})
        assert pushed.returncode == 0, pushed.stderr
        refused = await cli(*push, "t", "--token-file", str(app))
        assert refused.returncode == 3, refused.stderr
        assert refused.stderr.count("\n") == 1 and "PERMISSION_DENIED" in refused.stderr
        assert "--resume-from" not in refused.stderr
        assert server.receivers["t"].stats.sessions_opened == 0

        listing = await cli("sessions", "list", *target, "--token-file", str(ops))
        assert listing.returncode == 0 and listing.stdout.splitlines()[0].split("\t")[2] == "principal"
        missing = await cli("sessions", "list", *target, "--token-file", str(tmp_path / "nope"))
        assert missing.returncode == 2 and "cannot read token file" in missing.stderr
    assert PRODUCER not in pushed.stderr + refused.stderr


def push_args(records: Path, target: list[str]) -> list[str]:
    return ["push", str(records), "--stream", "s", "--no-progress", "--timeout", "30", *target]


async def test_cli_over_tls_with_a_ca_file_and_a_token(tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path / "pki")
    issued = ca.issue("server", server=True)
    ops = token_file(tmp_path / "ops.token", OPERATOR)
    async with server_with(tmp_path, TlsConfig(issued.cert_file, issued.key_file)) as server:
        target = ["--target", f"localhost:{server.port}"]
        ok = await cli("rate", "get", *target, "--ca-file", str(ca.cert_file), "--token-file", str(ops))
        assert ok.returncode == 0, ok.stderr
        env = {"SLUICE_CA_FILE": str(ca.cert_file), "SLUICE_TOKEN": OPERATOR}
        assert (await cli("sessions", "list", *target, env=env)).returncode == 0
        # a server certificate the client cannot trust: final, one line, exit 3 (it was exit 1, and a
        # push added a resume line)
        untrusted = CertificateAuthority(tmp_path / "other", "other-ca")
        distrust = ["--ca-file", str(untrusted.cert_file), "--token-file", str(ops)]
        records = tmp_path / "records.txt"
        records.write_text("r\n")
        for command in (
            ["rate", "get", *target, *distrust],
            ["status", "--once", *target, *distrust],
            [*push_args(records, target), *distrust],
        ):
            failed = await cli(*command)
            assert failed.returncode == 3, (command, failed.stderr)
            assert failed.stderr.count("\n") == 1 and "handshake failed" in failed.stderr, failed.stderr
        # plaintext to the TLS port looks like no server: push and status say what else it may be
        hint = "(if the server serves TLS, give its CA: --ca-file or SLUICE_CA_FILE)"
        ipv4 = ["--target", f"127.0.0.1:{server.port}"]  # localhost's ::1 would be refused: no server
        for command in (
            ["status", "--once", *ipv4, "--token-file", str(ops)],
            ["push", str(records), "--stream", "s", "--no-progress", "--timeout", "1", *ipv4],
        ):
            failed = await cli(*command)
            assert failed.returncode == 1 and hint in failed.stderr, (command, failed.stderr)
        # a client key that is not its certificate's: said before any connection (it was retried until
        # the timeout, ending "Failed to create security handshaker")
        client, other = ca.issue("app"), ca.issue("other")
        wrong_key = ["--cert-file", str(client.cert_file), "--key-file", str(other.key_file)]
        failed = await cli(*push_args(records, target), "--ca-file", str(ca.cert_file), *wrong_key)
        assert failed.returncode == 2, failed.stderr
        assert failed.stderr == (
            f"sluice: the key file {other.key_file} is not the private key of the certificate file "
            f"{client.cert_file}\n"
        )


async def test_sluice_token_writes_a_private_file_and_prints_its_hash(tmp_path: Path) -> None:
    out = tmp_path / "app.token"
    made = await cli("token", "--out", str(out))
    assert made.returncode == 0, made.stderr
    token = out.read_text().strip()
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert len(token) == 43
    assert made.stdout.strip() == f'token_sha256 = "{token_hash(token)}"'
    again = await cli("token", "--out", str(out))
    assert again.returncode == 1 and "exists" in again.stderr
    assert out.read_text().strip() == token  # never overwritten
    to_stdout = await cli("token")
    printed = to_stdout.stdout.strip()
    assert len(printed) == 43 and f'token_sha256 = "{token_hash(printed)}"' in to_stdout.stderr
    assert printed != token
