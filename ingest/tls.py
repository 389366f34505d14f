"""TLS for the gRPC server and /metrics: PEM files checked before anything starts, swapped in on reload.

gRPC's dynamic server credentials ask a fetcher for a new certificate configuration before each new
handshake. A reload (SIGHUP) checks the files' new contents and hands them to the fetcher once: live
connections, and the Publish sessions on them, keep going on the certificate they started with, and new
connections get the new one. /metrics wraps each accepted connection in the current ssl.SSLContext,
which a reload replaces alike. A reload that finds a bad file raises and changes nothing.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import ssl
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from ingest.config import TlsConfig
from sluice_client.settings_file import read_settings_file

EXPIRY_WARNING = dt.timedelta(days=7)
"""A certificate expiring sooner than this is warned about at start and at every reload."""


class TlsFileError(ValueError):
    """A certificate or key file cannot be read or is not what it should be; the message names the file
    and its flag (`sluice serve` prints it and exits 2)."""


@dataclass(frozen=True)
class TlsMaterial:
    """The checked contents of the TLS files: what the server serves until the next reload."""

    cert_pem: bytes
    key_pem: bytes
    client_ca_pem: bytes | None
    subject: str
    """The server certificate's subject, for the log."""
    not_before: dt.datetime
    not_after: dt.datetime
    fingerprint: str
    """SHA-256 of the server certificate (DER), hex: tells a reload that changed nothing."""
    key_readable_by_others: bool

    def warnings(self, now: dt.datetime | None = None) -> list[str]:
        """What an operator should fix soon: an expired, expiring or not yet valid certificate, a key
        file others can read."""
        now = now or dt.datetime.now(dt.UTC)
        found = []
        if self.not_after <= now:
            found.append(
                f"the server certificate ({self.subject}) expired on {self.not_after:%Y-%m-%d %H:%M} UTC: "
                "clients will refuse it; replace it and send SIGHUP"
            )
        elif self.not_after - now < EXPIRY_WARNING:
            found.append(
                f"the server certificate ({self.subject}) expires on {self.not_after:%Y-%m-%d %H:%M} UTC, "
                f"in {_days(self.not_after - now)}; replace it and send SIGHUP"
            )
        if self.not_before > now:
            found.append(
                f"the server certificate ({self.subject}) is not valid before "
                f"{self.not_before:%Y-%m-%d %H:%M} UTC: clients will refuse it until then"
            )
        if self.key_readable_by_others:
            found.append("the TLS key file can be read by other users: chmod 600 it")
        return found

    def describe(self) -> str:
        until = f"{self.not_after:%Y-%m-%d %H:%M} UTC"
        return f"{self.subject}, valid until {until}, sha256 {self.fingerprint[:16]}"


def _days(delta: dt.timedelta) -> str:
    hours = delta.total_seconds() / 3600
    return f"{hours:.0f} hours" if hours < 48 else f"{hours / 24:.0f} days"


def _read(path: Path, what: str) -> bytes:
    try:
        return read_settings_file(path)
    except OSError as exc:
        raise TlsFileError(f"cannot read the {what} {path}: {exc.strerror or exc}") from None


def _certificates(data: bytes, path: Path, what: str) -> list[x509.Certificate]:
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        certs = []
    if not certs:
        raise TlsFileError(f"the {what} {path} holds no PEM certificate (-----BEGIN CERTIFICATE-----)")
    return certs


def _private_key(data: bytes, path: Path) -> PrivateKeyTypes:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except TypeError:  # cryptography's way of saying that the key needs a password
        raise TlsFileError(
            f"the TLS key {path} (--tls-key) is encrypted: give an unencrypted PEM key (readable by this "
            "user only)"
        ) from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise TlsFileError(f"the TLS key {path} (--tls-key) is not a PEM private key: {exc}") from None


def _public_der(key: object) -> bytes:
    public_bytes = getattr(key, "public_bytes", None)
    if public_bytes is None:
        return b""
    der: bytes = public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return der


def load_tls(config: TlsConfig) -> TlsMaterial:
    """Read and check the TLS files: each readable PEM, the key the certificate's, the client CA's
    certificates parseable; raise TlsFileError naming the file and what is wrong."""
    cert_pem = _read(config.cert_file, "TLS certificate (--tls-cert)")
    key_pem = _read(config.key_file, "TLS key (--tls-key)")
    chain = _certificates(cert_pem, config.cert_file, "TLS certificate (--tls-cert)")
    leaf = chain[0]
    key = _private_key(key_pem, config.key_file)
    if _public_der(key.public_key()) != _public_der(leaf.public_key()):
        raise TlsFileError(
            f"the TLS key {config.key_file} (--tls-key) is not the key of the certificate "
            f"{config.cert_file} (--tls-cert, {leaf.subject.rfc4514_string()}): the first certificate in "
            "the file must be the server's own"
        )
    client_ca_pem = None
    if config.client_ca_file is not None:
        client_ca_pem = _read(config.client_ca_file, "client CA (--client-ca)")
        _certificates(client_ca_pem, config.client_ca_file, "client CA (--client-ca)")
    try:
        mode = config.key_file.stat().st_mode
    except OSError:
        mode = 0
    return TlsMaterial(
        cert_pem=cert_pem,
        key_pem=key_pem,
        client_ca_pem=client_ca_pem,
        subject=leaf.subject.rfc4514_string() or "no subject",
        not_before=leaf.not_valid_before_utc,
        not_after=leaf.not_valid_after_utc,
        fingerprint=hashlib.sha256(leaf.public_bytes(serialization.Encoding.DER)).hexdigest(),
        key_readable_by_others=bool(mode & (stat.S_IRGRP | stat.S_IROTH)),
    )


def token_file_exposed(path: Path | None) -> str | None:
    """The WARNING a start says when its --peer-token-file can be read by other users (its group, or
    everyone), as it says of a TLS key: a node's token lets its holder replicate into the nodes and ask
    their producers' marks, a driver's reads every record and releases blocks. None: not so (or no file,
    or it cannot be looked at: its read, already done, said why)."""
    if path is None:
        return None
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    if not mode & (stat.S_IRGRP | stat.S_IROTH):
        return None
    return (
        f"the peer token file {path} (--peer-token-file) can be read by other users (mode "
        f"{stat.S_IMODE(mode):04o}): whoever reads it calls the cluster with this process's roles; "
        "chmod 600 it"
    )


def _grpc_configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key_pem, material.cert_pem)], root_certificates=material.client_ca_pem
    )


class ServerTls:
    """The server's TLS files, loaded and checked (TlsFileError otherwise); `reload()` re-reads them.

    Thread-safe: gRPC calls the fetcher on its own threads, /metrics asks for its context on its own.
    """

    def __init__(self, config: TlsConfig) -> None:
        self.config = config
        self._material = load_tls(config)
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._contexts: dict[ssl.VerifyMode, ssl.SSLContext] = {}
        self._lock = threading.Lock()

    @property
    def material(self) -> TlsMaterial:
        return self._material

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate signed by the client CA."""
        return self.config.client_ca_file is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Credentials for one gRPC server port; a reload reaches the connections made after it."""
        return grpc.dynamic_ssl_server_credentials(
            _grpc_configuration(self._material),
            self._fetch,  # type: ignore[arg-type]  # grpc-stubs: the fetcher may return None (no change)
            require_client_authentication=self.mutual,
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # called before every new handshake: None keeps the configuration gRPC has
        with self._lock:
            pending, self._pending = self._pending, None
        return pending

    def ssl_context(self, verify_mode: ssl.VerifyMode) -> ssl.SSLContext:
        """An SSLContext with the current certificate (for /metrics); with a client CA, client
        certificates are verified against it (`verify_mode` CERT_REQUIRED or CERT_OPTIONAL)."""
        with self._lock:
            context = self._contexts.get(verify_mode)
            material = self._material
        if context is None:
            context = _ssl_context(material, verify_mode)
            with self._lock:
                if self._material is material:
                    self._contexts[verify_mode] = context
        return context

    def reload(self) -> str | None:
        """Re-read the files: a description of the new certificate, None if nothing changed; raise
        TlsFileError (and keep serving the old one) if a file is bad."""
        material = load_tls(self.config)
        _ssl_context(material, ssl.CERT_NONE)  # what OpenSSL refuses is refused before anything swaps
        if material == self._material:
            return None
        with self._lock:
            self._material = material
            self._pending = _grpc_configuration(material)
            self._contexts = {}
        return material.describe()


def _ssl_context(material: TlsMaterial, verify_mode: ssl.VerifyMode) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain takes paths only: the checked bytes go through a private temporary directory, so a
    # file replaced meanwhile cannot pair one version's certificate with another's key
    with tempfile.TemporaryDirectory(prefix="sluice-tls-") as folder:
        cert_file, key_file = os.path.join(folder, "cert.pem"), os.path.join(folder, "key.pem")
        with open(cert_file, "wb") as out:
            out.write(material.cert_pem)
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(material.key_pem)
        try:
            context.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as exc:
            raise TlsFileError(f"OpenSSL refuses the TLS certificate and key: {exc}") from None
    if material.client_ca_pem is not None and verify_mode != ssl.CERT_NONE:
        context.load_verify_locations(cadata=material.client_ca_pem.decode("ascii", "replace"))
        context.verify_mode = verify_mode
    return context
