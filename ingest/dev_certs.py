"""`sluice dev-certs`: a throwaway CA, a server certificate and client certificates for trials.

For trying TLS and mutual TLS on one machine or a test cluster, not for production: the CA's key is not
kept (nothing more can be issued under it; run again for a new set), and every certificate is valid
for DAYS days. Production certificates come from the organisation's CA (or cert-manager, Vault, ...).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ingest.config import check_host

DAYS = 90
"""How long the certificates are valid."""
SERVER_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Names every server certificate holds as SANs, besides --host names."""
CLIENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A --client name: its files are DIR/NAME.crt and DIR/NAME.key, so no path separator, no `..`, no
leading dot (a hidden file, or `.`/`..`), nothing but letters, digits, `.`, `_` and `-`."""
CN_MAX = 64
"""Characters a certificate's common name may have (RFC 5280's ub-common-name)."""
RESERVED = {"ca": "the CA's certificate", "server": "the server's certificate and key"}
"""Stems of the CA's and the server's files, which a client's must not take (in any case: one file on a
case-insensitive file system)."""


@dataclass(frozen=True)
class DevCerts:
    """What `write_dev_certs` wrote."""

    ca_file: Path
    server_cert: Path
    server_key: Path
    clients: dict[str, tuple[Path, Path]]
    """Client name -> (certificate, key)."""


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return x509.DNSName(host)


def check_names(hosts: Sequence[str], clients: Sequence[str]) -> None:
    """Raise ValueError for a name a certificate cannot hold, or a client name whose files would not be
    DIR/NAME.crt and DIR/NAME.key of their own (checked before anything is written)."""
    for host in hosts:
        # as `serve --host` takes it (a wildcard "*.example.com" too): cryptography refused some names
        # only once ca.crt was written, with its own words
        if not host.strip():
            raise ValueError("--host is empty (an unset variable?): give a DNS name or an IP address")
        try:
            check_host(host.removeprefix("*."), "--host")
        except ValueError:
            raise ValueError(
                f"--host {host!r} is neither an IP address nor a DNS name (labels of letters, digits, "
                "'-' and '_', up to 63 characters each, 253 in all)"
            ) from None
    for client in clients:
        if not CLIENT_NAME.fullmatch(client):
            raise ValueError(
                f"--client {client!r}: a name of 1-64 letters, digits, '.', '_' or '-' that starts with a "
                "letter or digit (it names the files NAME.crt and NAME.key in DIR, and is the "
                "certificate's CN)"
            )
        if client.lower() in RESERVED:
            raise ValueError(
                f"--client {client!r} would overwrite {RESERVED[client.lower()]}: choose another name"
            )
    if len({c.lower() for c in clients}) != len(clients):
        raise ValueError(
            "a --client name repeats (names that differ only in case share files on some file systems)"
        )


def write_dev_certs(
    directory: Path,
    hosts: Sequence[str] = (),
    clients: Sequence[str] = (),
    *,
    overwrite: bool = False,
    now: dt.datetime | None = None,
) -> DevCerts:
    """Write ca.crt, server.crt + server.key and NAME.crt + NAME.key per client under `directory`
    (keys 0600). FileExistsError when a file is there already, unless `overwrite`."""
    check_names(hosts, clients)
    for folder in (directory, *directory.parents):
        if folder.exists():  # mkdir said "[Errno 17] File exists" of a file named as DIR
            if not folder.is_dir():
                raise ValueError(
                    f"{folder} is a file, not a directory: give DIR as a folder for the certificates"
                )
            break
    now = now or dt.datetime.now(dt.UTC)
    stems = ["ca", "server", *clients]
    targets = [directory / f"{stem}.crt" for stem in stems] + [directory / f"{s}.key" for s in stems[1:]]
    if not overwrite:
        for path in targets:
            if path.exists():
                raise FileExistsError(f"{path} exists (--force replaces it)")
    directory.mkdir(parents=True, exist_ok=True)
    before, after = now - dt.timedelta(minutes=5), now + dt.timedelta(days=DAYS)
    ca_key = _key()
    ca_name = _name("sluice dev CA (trials only)")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(before)
        .not_valid_after(after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
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
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = directory / "ca.crt"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(
        stem: str, common_name: str, usage: Sequence[x509.ObjectIdentifier], sans: Sequence[str]
    ) -> tuple[Path, Path]:
        key = _key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(before)
            .not_valid_after(after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
        )
        if sans:
            names = x509.SubjectAlternativeName([_san(h) for h in sans])
            builder = builder.add_extension(names, critical=False)
        cert_file, key_file = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert_file.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
        pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        key_file.unlink(missing_ok=True)  # created anew: an existing file's looser mode is not kept
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as out:
            out.write(pem)
        return cert_file, key_file

    server_hosts = list(dict.fromkeys([*hosts, *SERVER_HOSTS]))
    # clientAuth too: a cluster's node presents its server certificate to its peers (mutual TLS)
    both = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
    # a CN holds at most 64 characters, a DNS name up to 253: a longer name is in the SANs only (what
    # TLS clients match), and the CN says what the certificate is
    common_name = server_hosts[0] if len(server_hosts[0]) <= CN_MAX else "sluice server"
    server_cert, server_key = issue("server", common_name, both, server_hosts)
    issued = {name: issue(name, name, (ExtendedKeyUsageOID.CLIENT_AUTH,), ()) for name in clients}
    return DevCerts(ca_file, server_cert, server_key, issued)
