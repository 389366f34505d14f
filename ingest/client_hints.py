"""What the client commands add to a gRPC failure: whether it is final (exit 3), and a hint where gRPC
reports a TLS mistake as an unreachable server."""

from __future__ import annotations

import grpc

from sluice_client.errors import RPCError
from sluice_client.producer import tls_refused

DENIED = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})
PLAINTEXT_TO_TLS = " (if the server serves TLS, give its CA: --ca-file or SLUICE_CA_FILE)"
TLS_TO_PLAINTEXT = (
    " (the server answered in plaintext: it does not serve TLS on this port; leave out --ca-file, "
    "--cert-file and --key-file, or SLUICE_CA_FILE, SLUICE_CERT_FILE and SLUICE_KEY_FILE)"
)
GRPC_NO_METHOD = "Method not found!"
"""What gRPC itself answers a call of a method its server does not register."""
NOT_SLUICE = (
    " (the server there has no such method: is the target a Sluice server's gRPC port, not another gRPC "
    "service's, and one of this version?)"
)
CERTIFICATE_REFUSED = (
    " (if the server is up, it may have refused this client's TLS certificate: a server with a client "
    "CA needs a certificate it signed, unexpired: --cert-file and --key-file)"
)


def refused(status: grpc.StatusCode, details: str) -> bool:
    """The server refused the credentials, or the TLS handshake failed on certificates: the same
    command fails the same way (exit 3, no retry)."""
    return status in DENIED or tls_refused(RPCError(status, details))


def connect_hint(status: grpc.StatusCode, details: str, *, secure: bool, connected: bool = False) -> str:
    """A server that closes the socket unread looks like no server at all: plaintext to a TLS port,
    or (over TLS) a client certificate missing or refused. A hint naming either, else "". `connected`:
    the connection was up (gRPC's channel was READY) before the failure, so it was no handshake that
    failed but a server that went away (it died mid-call, say): no hint then."""
    if status is grpc.StatusCode.UNIMPLEMENTED and details == GRPC_NO_METHOD:
        return NOT_SLUICE
    if secure and not connected:
        hint = tls_to_plaintext_hint(details)
        if hint:
            return hint
    if connected or status is not grpc.StatusCode.UNAVAILABLE or "Socket closed" not in details:
        return ""
    return CERTIFICATE_REFUSED if secure else PLAINTEXT_TO_TLS


def tls_to_plaintext_hint(details: str) -> str:
    """TLS to a plaintext port: the server's first bytes are no TLS record, which BoringSSL calls
    WRONG_VERSION_NUMBER (and gRPC an "Invalid certificate verification context"): a hint saying so,
    else ""."""
    return TLS_TO_PLAINTEXT if "WRONG_VERSION_NUMBER" in details else ""
