"""Real X.509 certificates for tests, made with `cryptography`: a CA, server and client certificates
(expired or from another CA on request), written as PEM files."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_NOW = dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class Issued:
    cert_file: Path
    key_file: Path

    @property
    def cert_pem(self) -> bytes:
        return self.cert_file.read_bytes()

    @property
    def key_pem(self) -> bytes:
        return self.key_file.read_bytes()


class CertificateAuthority:
    """A self-signed CA that writes what it issues under `directory`."""

    def __init__(self, directory: Path, name: str = "sluice-test-ca") -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_NOW - dt.timedelta(days=1))
            .not_valid_after(_NOW + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_file = directory / f"{name}.pem"
        self.cert_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    @property
    def cert_pem(self) -> bytes:
        return self.cert_file.read_bytes()

    def issue(
        self,
        common_name: str,
        *,
        server: bool = False,
        hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
        expired: bool = False,
        file_stem: str | None = None,
    ) -> Issued:
        """A leaf certificate: a server's (SANs `hosts`) or a client's (CN `common_name`)."""
        key = ec.generate_private_key(ec.SECP256R1())
        if expired:
            before, after = _NOW - dt.timedelta(days=10), _NOW - dt.timedelta(days=1)
        else:
            before, after = _NOW - dt.timedelta(days=1), _NOW + dt.timedelta(days=10)
        sans: list[x509.GeneralName] = []
        for host in hosts if server else ():
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self._cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(before)
            .not_valid_after(after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        stem = file_stem or common_name
        cert_file = self.directory / f"{stem}.crt"
        key_file = self.directory / f"{stem}.key"
        cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_file.chmod(0o600)
        return Issued(cert_file, key_file)
