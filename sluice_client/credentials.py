"""Client credentials the usual gRPC way: TLS roots, a client certificate and key, a bearer token.

`Credentials.from_files(...)` reads PEM files and a token file; `Credentials.from_env()` reads the same
from SLUICE_CA_FILE, SLUICE_CERT_FILE, SLUICE_KEY_FILE and SLUICE_TOKEN or SLUICE_TOKEN_FILE. A token
is never taken from a command line (other users of the machine can read it there).

`channel(target)` (grpc.aio) and `sync_channel(target)` make a channel: TLS (grpc.ssl_channel_credentials)
when there is a CA or a client certificate, or `tls=True` (the system's roots), else plaintext. The token
travels as `authorization: Bearer <token>` metadata on every call (`metadata`), which the Producer, the
CLI and the Spark source add themselves: gRPC's call credentials refuse a plaintext channel, and a token
must also work over a server's --insecure port and the loopback port of its own Spark source.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from sluice_client.errors import SluiceError
from sluice_client.settings_file import read_settings_file

__all__ = ["Credentials", "CredentialsError"]

ENV_TOKEN = "SLUICE_TOKEN"  # noqa: S105 - the variable's name, not a token
ENV_TOKEN_FILE = "SLUICE_TOKEN_FILE"  # noqa: S105 - a variable's name
ENV_CA_FILE = "SLUICE_CA_FILE"
ENV_CERT_FILE = "SLUICE_CERT_FILE"
ENV_KEY_FILE = "SLUICE_KEY_FILE"

_MAX_TOKEN_CHARS = 4096  # the server's limit (receivers.auth.MAX_TOKEN_CHARS)

Options = Sequence[tuple[str, Any]]


class CredentialsError(SluiceError, ValueError):
    """Credentials that cannot be used: a file that cannot be read, a certificate without its key, a
    token that cannot travel as metadata. The message names the file or variable."""


@dataclass(frozen=True)
class Credentials:
    """What a client presents to a Sluice server. The default (no fields) is plaintext, no token."""

    root_certificates: bytes | None = None
    """PEM CA certificates the server's certificate must chain to; None: the system's roots (with TLS)."""
    certificate_chain: bytes | None = field(default=None, repr=False)
    """PEM client certificate (chain), for mutual TLS; needs private_key."""
    private_key: bytes | None = field(default=None, repr=False)
    """PEM private key of certificate_chain."""
    token: str | None = field(default=None, repr=False)
    """Bearer token (`sluice token` makes one), sent as `authorization: Bearer <token>` on every call."""
    tls: bool | None = None
    """Use TLS; None: whenever a CA or a client certificate is given."""
    server_name: str | None = None
    """The name the server's certificate must hold, when the target's host is not it (an IP address)."""

    def __post_init__(self) -> None:
        # unchecked, a path given for PEM bytes, a bytes token or tls="no" (truthy) failed or misbehaved
        # only when a channel was made, in gRPC's words or as a TLS handshake the server refused
        for name in ("root_certificates", "certificate_chain", "private_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bytes):
                hint = (
                    " (a file's path? use Credentials.from_files)" if isinstance(value, (str, Path)) else ""
                )
                raise TypeError(f"{name} must be PEM bytes or None, not {type(value).__name__}{hint}")
        if self.token is not None and not isinstance(self.token, str):
            raise TypeError(f"token must be a str or None, not {type(self.token).__name__}")
        if self.tls is not None and not isinstance(self.tls, bool):
            raise TypeError(f"tls must be a bool or None, not {type(self.tls).__name__} ({self.tls!r})")
        if self.server_name is not None and not isinstance(self.server_name, str):
            raise TypeError(
                f"server_name must be a str or None, not {type(self.server_name).__name__} "
                f"({self.server_name!r})"
            )
        if (self.certificate_chain is None) != (self.private_key is None):
            raise CredentialsError("a client certificate needs its private key, and a key its certificate")
        if self.token is not None:
            _check_token(self.token, "the token")
        if self.tls is False and (self.root_certificates or self.certificate_chain):
            raise CredentialsError("certificates are given but tls is False")

    @property
    def secure(self) -> bool:
        """Whether channels use TLS."""
        if self.tls is not None:
            return self.tls
        return self.root_certificates is not None or self.certificate_chain is not None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries: the bearer token, if there is one."""
        return () if self.token is None else (("authorization", f"Bearer {self.token}"),)

    @classmethod
    def from_files(
        cls,
        *,
        ca_file: str | Path | None = None,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        token_file: str | Path | None = None,
        tls: bool | None = None,
        server_name: str | None = None,
    ) -> Credentials:
        """Credentials read from PEM files and a token file (its first line, whitespace stripped)."""
        token = None
        if token_file is not None:
            token = _read(token_file, "token file").decode("utf-8", "replace").strip()
            _check_token(token, f"token file {token_file}")
        root_certificates = None if ca_file is None else _pem(ca_file, "CA file", _CERTIFICATE)
        certificate_chain = None if cert_file is None else _pem(cert_file, "certificate file", _CERTIFICATE)
        private_key = None if key_file is None else _pem(key_file, "key file", _PRIVATE_KEY)
        if cert_file is not None and key_file is not None:  # once both are known regular files of PEM
            _check_key_pair(cert_file, key_file)
        return cls(
            root_certificates=root_certificates,
            certificate_chain=certificate_chain,
            private_key=private_key,
            token=token,
            tls=tls,
            server_name=server_name,
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **files: str | Path | None) -> Credentials:
        """Credentials from SLUICE_CA_FILE, SLUICE_CERT_FILE, SLUICE_KEY_FILE, SLUICE_TOKEN_FILE or
        SLUICE_TOKEN; a file given in `files` (ca_file, cert_file, key_file, token_file, as from_files
        takes them: command-line flags) wins over its variable, and a token file over SLUICE_TOKEN."""
        env = os.environ if environ is None else environ
        unknown = set(files) - {"ca_file", "cert_file", "key_file", "token_file"}
        if unknown:
            raise TypeError(f"unknown credential file(s): {', '.join(sorted(unknown))}")

        def pick(name: str, variable: str) -> str | Path | None:
            given = files.get(name)
            return given if given is not None else env.get(variable) or None

        token_file = pick("token_file", ENV_TOKEN_FILE)
        found = cls.from_files(
            ca_file=pick("ca_file", ENV_CA_FILE),
            cert_file=pick("cert_file", ENV_CERT_FILE),
            key_file=pick("key_file", ENV_KEY_FILE),
            token_file=token_file,
        )
        if token_file is None and env.get(ENV_TOKEN):
            token = env[ENV_TOKEN].strip()
            _check_token(token, ENV_TOKEN)
            return dataclasses.replace(found, token=token)
        return found

    def _options(self, options: Options) -> list[tuple[str, Any]]:
        merged = list(options)
        if self.server_name is not None and self.secure:
            merged.append(("grpc.ssl_target_name_override", self.server_name))
        return merged

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)

    def channel(self, target: str, options: Options = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to `target`: TLS if `secure`, else plaintext (add `metadata` to calls)."""
        if self.secure:
            return grpc.aio.secure_channel(target, self._channel_credentials(), self._options(options))
        return grpc.aio.insecure_channel(target, self._options(options))

    def sync_channel(self, target: str, options: Options = ()) -> grpc.Channel:
        """A blocking grpc channel to `target`, as `channel` makes an aio one."""
        if self.secure:
            return grpc.secure_channel(target, self._channel_credentials(), self._options(options))
        return grpc.insecure_channel(target, self._options(options))


def _read(path: str | Path, what: str) -> bytes:
    try:
        return read_settings_file(path)
    except OSError as exc:
        raise CredentialsError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


_CERTIFICATE = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PRIVATE_KEY = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


def _pem(path: str | Path, what: str, marker: re.Pattern[bytes]) -> bytes:
    """The file's bytes, if it holds the PEM block it must: gRPC's C core logged four lines about a file
    that is not PEM and then failed every call with UNAVAILABLE (`sluice push` retried until its
    timeout and blamed the server)."""
    data = _read(path, what)
    if not marker.search(data):
        block = marker.pattern.decode().replace("(?:[A-Z]+ )?", "")
        raise CredentialsError(f"the {what} {path} holds no PEM block ({block})")
    return data


def _check_key_pair(cert_file: str | Path, key_file: str | Path) -> None:
    """Refuse a key that is not the certificate's: gRPC's C core only finds out when it connects, then
    fails every attempt alike ("Failed to create security handshaker"), and a client retried until its
    timeout and blamed the server."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)

    def no_password() -> str:  # an encrypted key: never prompt on the terminal (gRPC cannot use it)
        raise CredentialsError(f"the key file {key_file} is encrypted: gRPC needs an unencrypted PEM key")

    try:
        context.load_cert_chain(cert_file, key_file, password=no_password)
    except ssl.SSLError as exc:
        # only a mismatch is certain: other complaints of this OpenSSL (a key size its security level
        # refuses) may not be gRPC's, which decides on those itself
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise CredentialsError(
                f"the key file {key_file} is not the private key of the certificate file {cert_file}"
            ) from None
    except OSError as exc:
        raise CredentialsError(f"cannot read {cert_file} or {key_file}: {exc.strerror or exc}") from None


def _check_token(token: str, where: str) -> None:
    # gRPC metadata values are printable ASCII; a token with a space or newline would be cut or refused
    if not token:
        raise CredentialsError(f"{where} is empty")
    if len(token) > _MAX_TOKEN_CHARS:
        raise CredentialsError(f"{where} is over {_MAX_TOKEN_CHARS} characters")
    if not all("!" <= c <= "~" for c in token):
        raise CredentialsError(f"{where} holds characters a token cannot have (whitespace, non-ASCII)")
