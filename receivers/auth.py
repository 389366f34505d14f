"""Authentication and authorization of gRPC calls: the auth file, token hashes, and who may call what.

The auth file (TOML, `sluice serve --auth-file`) names principals, their roles, streams, limits and the
SHA-256 hashes of their bearer tokens; a token itself is never stored on the server (`sluice token` makes
one and prints its hash):

    [defaults]                       # limits of every principal that does not set its own
    max_sessions = 64
    max_message_bytes = "4MiB"
    idle_timeout_seconds = 300

    [principals.clicks-app]
    roles = ["producer"]
    streams = ["clicks"]             # "*": every stream
    token_sha256 = ["<64 hex digits>"]

    [principals."ops.example.com"]   # no token: a client certificate with this CN or SAN
    roles = ["operator", "reader"]

A call is authenticated by the bearer token in its `authorization` metadata ("Bearer <token>") if it
has one, else by its client certificate (mutual TLS, and only then: a server that does not verify client
certificates ignores the names in one): the certificate's subject CN, then its DNS and URI SANs, are
looked up as principal names. The server's own tokens (`Authenticator.issue_token`: the Spark source's
"sluice-pipeline" token) are held apart from the auth file and outlive its reloads.

Without an auth file, every caller is ANONYMOUS (every role) on
a plain server, and on a mutual-TLS server every verified certificate is a principal with every role
(the client CA vouches for it). With an auth file, a call without credentials or with an unknown token
is UNAUTHENTICATED; a certificate that names no principal, or a principal without the role or stream
the call needs, is PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
import tomllib
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import Message

from receivers.errors import PermissionDenied, ReceiverError, Unauthenticated, cut
from receivers.names import InvalidStreamNameError, check_stream_name
from receivers.principal import ALL_ROLES, ALL_STREAMS, ANONYMOUS, Limits, Principal, Role
from receivers.sizes import parse_size
from sluice_client.settings_file import read_settings_file

if TYPE_CHECKING:
    from receivers.receiver import Receiver

MAX_TOKEN_CHARS = 4096
"""A longer authorization value is refused before it is hashed."""
MAX_NAME_BYTES = 256
"""Longest principal name (UTF-8), as a producer id: a principal's producer keys hold both."""
PERMISSION_DENIED = 7
"""gRPC status code of a session whose principal an auth reload removed or narrowed."""
UNAUTHENTICATED = 16
"""gRPC status code of a session whose bearer token an auth reload removed (receivers never import
grpc's enum for a session's code)."""
PIPELINE = Principal("sluice-pipeline", frozenset({Role.OPERATOR, Role.READER, Role.CONSUMER}), frozenset())
"""The principal of a server's own Spark source (RateControl: GetRate, StartBatch), whose token the
server issues itself (Authenticator.issue_token) for each run."""
_RESERVED = frozenset({PIPELINE.name, ANONYMOUS.name})

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
T = TypeVar("T")

METHOD_ROLES: Mapping[str, frozenset[Role]] = {
    "/ingest.v1.Ingest/Publish": frozenset({Role.PRODUCER}),
    "/ingest.v1.RateControl/GetRate": frozenset({Role.READER, Role.OPERATOR}),
    "/ingest.v1.RateControl/UpdateRate": frozenset({Role.OPERATOR}),
    "/ingest.v1.RateControl/SetBounds": frozenset({Role.OPERATOR}),
    "/ingest.v1.RateControl/SetEstimator": frozenset({Role.OPERATOR}),
    "/ingest.v1.RateControl/StartBatch": frozenset({Role.OPERATOR}),
    "/ingest.v1.Sessions/ListSessions": frozenset({Role.READER, Role.OPERATOR}),
    "/ingest.v1.Sessions/CancelSession": frozenset({Role.OPERATOR}),
    # peers: a restarted node asks where copies of its partitions end (ReceiverNode.continue_logs)
    "/ingest.v1.Blocks/ListPartitions": frozenset({Role.READER, Role.OPERATOR, Role.CONSUMER, Role.PEER}),
    "/ingest.v1.Blocks/ReadBlocks": frozenset({Role.CONSUMER}),
    "/ingest.v1.Blocks/ReleaseBlocks": frozenset({Role.OPERATOR}),
    "/ingest.v1.Replication/Replicate": frozenset({Role.PEER}),
    "/ingest.v1.Replication/ProducerMarks": frozenset({Role.PEER}),
    "/ingest.v1.Admin/GetConfig": frozenset({Role.READER, Role.OPERATOR}),
    "/ingest.v1.Admin/SetConfig": frozenset({Role.OPERATOR}),
    "/ingest.v1.Admin/ListStreams": frozenset({Role.READER, Role.OPERATOR}),
    "/ingest.v1.Admin/AddStream": frozenset({Role.OPERATOR}),
    "/ingest.v1.Admin/RemoveStream": frozenset({Role.OPERATOR}),
    "/ingest.v1.Admin/GetPipeline": frozenset({Role.READER, Role.OPERATOR}),
    "/ingest.v1.Admin/SwapPipeline": frozenset({Role.OPERATOR}),
}
"""gRPC method -> the roles of which a caller needs one. A method not listed is refused to everyone."""

FIELD_ROLES: Mapping[str, Mapping[str, frozenset[Role]]] = {
    # sealing cuts every receiver's open block early and fsyncs it: a planning reader's (the Sluice
    # source's) request, not a scraper's; a reader's status calls that set it made the blocks small
    "/ingest.v1.RateControl/GetRate": {"seal_blocks": frozenset({Role.CONSUMER, Role.OPERATOR})},
    "/ingest.v1.Blocks/ListPartitions": {"seal_blocks": frozenset({Role.CONSUMER, Role.OPERATOR})},
}
"""gRPC method -> request field -> the roles of which a caller that sets the field needs one (beyond
the method's own, METHOD_ROLES)."""

_NAMES_A_DRIVER = "sluice-driver-id"  # receivers.cluster.DRIVER_HEADER
HEADER_ROLES: Mapping[str, Mapping[str, frozenset[Role]]] = {
    # a call naming a driver takes, renews or gives back the node's driver lease (one driver per
    # cluster: receivers.blocks_service); a reader's (a dashboard's) took it and locked the cluster's
    # driver out ("another driver holds the receiver nodes"), renewed each second for good
    "/ingest.v1.Blocks/ListPartitions": {_NAMES_A_DRIVER: frozenset({Role.OPERATOR})},
    # a node notes where the driver that names itself serves RateControl, and sends operators there in
    # its refusals ("change the cluster's rate on the driver at HOST:PORT ... --target HOST:PORT"): a
    # reader's forged one sent them, their operator token with them, to an address of its choosing
    "/ingest.v1.RateControl/GetRate": {_NAMES_A_DRIVER: frozenset({Role.OPERATOR})},
}
"""gRPC method -> call metadata key -> the roles of which a caller whose call carries it needs one
(beyond the method's own): what a cluster's driver alone may say (it has consumer and operator)."""

PUBLISH = "/ingest.v1.Ingest/Publish"

_LIMIT_KEYS = {
    "max_sessions": "max_sessions",
    "max_streams": "max_streams",
    "max_message_bytes": "max_message_bytes",
    "max_record_bytes": "max_record_bytes",
    "idle_timeout_seconds": "idle_timeout",
}


@dataclass(frozen=True)
class Credential:
    """Who a call is, and by which bearer token: what a long-lived call (a Publish session, Replicate,
    ReadBlocks) is checked against again when the auth file is reloaded."""

    principal: Principal
    token_sha256: str | None = None
    """The SHA-256 of the bearer token the call came with (as the auth file holds it; the token itself
    is never kept); None: a client certificate, or no credentials."""


class AuthFileError(ValueError):
    """The auth file cannot be read or says something invalid; the message names the file and key."""


def new_token() -> str:
    """A random bearer token: 256 bits, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """The hex SHA-256 of a bearer token: what the auth file stores. Tokens are random (`sluice token`:
    256 bits), so an unsalted hash is as strong as the token; a password would need a slow hash."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class AuthTable:
    """The principals of an auth file, by name and by token hash."""

    principals: Mapping[str, Principal]
    tokens: Mapping[str, str]
    """Token SHA-256 (hex) -> principal name."""

    def by_token(self, token: str) -> Principal | None:
        # looked up by hash: a timing difference could only tell something of the hash, not the token
        name = self.tokens.get(token_hash(token))
        return None if name is None else self.principals[name]

    @classmethod
    def load(cls, path: Path, *, base: Limits | None = None, client_ca: bool | None = None) -> AuthTable:
        """The auth file at `path`; limits it does not set (in [defaults] or a principal) are `base`'s:
        the server's flags (`--max-sessions-per-principal`, ...), else Limits(). `client_ca`: whether
        the server verifies client certificates (None: not known here, not checked); without, a file
        of no token at all is refused."""
        try:
            data = tomllib.loads(read_settings_file(path).decode("utf-8"))
        except OSError as exc:
            why = exc.strerror or exc
            raise AuthFileError(f"cannot read the auth file (--auth-file) {path}: {why}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise AuthFileError(f"auth file {path} is not valid TOML: {exc}") from exc
        return cls.parse(data, source=str(path), base=base, client_ca=client_ca)

    @classmethod
    def parse(
        cls,
        data: Mapping[str, Any],
        *,
        source: str = "auth file",
        base: Limits | None = None,
        client_ca: bool | None = None,
    ) -> AuthTable:
        unknown = set(data) - {"defaults", "principals"}
        if unknown:
            raise AuthFileError(f"{source}: unknown section(s) {', '.join(sorted(unknown))}")
        defaults = _limits(data.get("defaults", {}), base or Limits(), f"{source} [defaults]")
        entries = data.get("principals", {})
        if not isinstance(entries, Mapping):
            raise AuthFileError(f"{source}: [principals] must be a table of principals")
        principals: dict[str, Principal] = {}
        tokens: dict[str, str] = {}
        for name, entry in entries.items():
            where = f"{source} [principals.{name}]"
            _check_name(name, where)
            if not isinstance(entry, Mapping):
                raise AuthFileError(f"{where}: must be a table")
            allowed = {"roles", "streams", "token_sha256", *_LIMIT_KEYS}
            extra = set(entry) - allowed
            if extra:
                raise AuthFileError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
            roles = frozenset(_role(r, where) for r in _strings(entry.get("roles", []), f"{where} roles"))
            if not roles:
                raise AuthFileError(f"{where}: roles is empty (give some of {', '.join(ALL_ROLES)})")
            streams = frozenset(_streams(entry.get("streams", []), f"{where} streams"))
            if Role.PRODUCER in roles and not streams:
                raise AuthFileError(f'{where}: a producer needs streams (names, or "*" for every stream)')
            for digest in _strings(entry.get("token_sha256", []), f"{where} token_sha256"):
                if not _HEX64.match(digest):
                    raise AuthFileError(
                        f"{where}: token_sha256 holds hashes (64 lowercase hex digits, `sluice token`), "
                        f"not tokens: {cut(digest)[:12]!r}..."
                    )
                if digest in tokens:
                    raise AuthFileError(f"{where}: a token hash is also given to {tokens[digest]!r}")
                tokens[digest] = name
            limits = _limits(entry, defaults, where)
            principals[name] = Principal(name, roles, streams or frozenset(), limits)
        if not principals:
            # a truncated file would lock every caller out and, on a reload, revoke every session
            raise AuthFileError(f"{source}: no principals (give at least one [principals.NAME] table)")
        if client_ca is False and not tokens:
            # a hash line that never reached the file (`$(cat ops.hash)` of an empty file): the server
            # started and answered every call "unknown bearer token"
            raise AuthFileError(
                f"{source}: no principal has a token_sha256, and without a client CA (--client-ca) no "
                "certificate can name one: every call would be refused (`sluice token` makes a token "
                "and its token_sha256 line)"
            )
        return cls(principals, tokens)


class Authenticator:
    """Resolves the principal of a call and checks its role; `reload` swaps the auth table in place
    (calls in progress keep the principal they started with)."""

    def __init__(
        self,
        table: AuthTable | None = None,
        *,
        client_certificates: bool = False,
        default_limits: Limits | None = None,
    ) -> None:
        self._table = table
        self._client_certificates = client_certificates
        self._default_limits = default_limits or Limits()
        self._anonymous = Principal(ANONYMOUS.name, limits=self._default_limits, authenticated=False)
        self._internal: dict[str, Principal] = {}  # token hash -> principal; kept across reloads
        self._internal_only = False
        self._live: dict[_LiveCall, None] = {}  # streaming calls (revocable) in progress, in order

    @property
    def table(self) -> AuthTable | None:
        return self._table

    @property
    def enabled(self) -> bool:
        """Whether calls must authenticate (an auth file or mutual TLS)."""
        return self._table is not None or self._client_certificates or self._internal_only

    def internal_calls(self) -> Authenticator:
        """For a port only this server's own processes call (its Spark source's plaintext loopback port
        under TLS): the tokens this one issues and nothing else, or anyone when this one lets anyone in.
        Neither the auth file's tokens nor certificates count there: a token stolen from a principal
        of the auth file must not get around mutual TLS."""
        other = Authenticator(default_limits=self._default_limits)
        other._internal = self._internal  # shared: a token issued later counts there too
        other._internal_only = self.enabled
        return other

    def reload(self, table: AuthTable | None) -> None:
        """Swap the auth table; then `revoke` ends the sessions it no longer allows."""
        self._table = table

    def issue_token(self, principal: Principal) -> str:
        """A new random token for `principal`, one of the server's own (not in the auth file, kept
        across reloads, accepted with or without one); only its hash is kept."""
        token = new_token()
        self._internal[token_hash(token)] = principal
        return token

    def revocation(
        self, credential: Credential, method: str, stream: str | None = None
    ) -> ReceiverError | None:
        """Why a live call of `credential` to `method` (publishing to `stream`) may no longer go on under
        the present auth table, as the error it ends with; None while it may. A call opened with a bearer
        token the table no longer gives its principal is Unauthenticated (the token was revoked, as a new
        call with it would be), whatever else holds; then a principal gone or narrowed is
        PermissionDenied. A certificate's principal is looked up again by name."""
        principal = credential.principal
        digest = credential.token_sha256
        if digest is not None and digest not in self._internal:  # the server's own tokens outlive reloads
            table = self._table
            if table is None or table.tokens.get(digest) != principal.name:
                return Unauthenticated(
                    f"the bearer token this call of principal {cut(principal.name)!r} was opened with was "
                    "revoked (it is no longer in the auth file)"
                )
        now = self.current(principal)
        if now is None:
            return PermissionDenied(f"principal {principal.name!r} no longer exists")
        needed = METHOD_ROLES.get(method, frozenset())
        if not now.has_any(needed):
            return PermissionDenied(f"principal {principal.name!r} may no longer call {method}")
        if stream is not None and not now.may_publish(stream):
            return PermissionDenied(
                f"principal {principal.name!r} may no longer publish to stream {stream!r}"
            )
        return None

    async def revocable(
        self,
        credential: Credential,
        method: str,
        context: grpc.aio.ServicerContext[Any, Any],
        responses: AsyncIterator[T],
    ) -> AsyncIterator[T]:
        """`responses` (a streaming handler's), until `revoke` finds `credential` may no longer call
        `method`: then the handler is stopped where it waits and the call ends with the status of
        `revocation` (UNAUTHENTICATED for a revoked token, PERMISSION_DENIED for a principal gone or
        narrowed). A message being written when that happens is sent first, and a handler that shields
        work from the cancellation (a Replicate copy being stored) ends once that work is done."""
        live = _LiveCall(credential, method, asyncio.get_running_loop().create_future())
        self._live[live] = None
        step: asyncio.Future[T] | None = None
        try:
            while not live.ended.done():
                step = asyncio.ensure_future(anext(responses))
                await asyncio.wait((step, live.ended), return_when=asyncio.FIRST_COMPLETED)
                if not step.done():
                    break
                try:
                    response = step.result()
                except StopAsyncIteration:
                    return
                finally:
                    step = None
                yield response
        finally:
            del self._live[live]
            if step is not None:  # revoked, or the call itself ended (cancelled) while it waited
                step.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):  # what it ended with is moot
                    await step
            aclose = getattr(responses, "aclose", None)
            if aclose is not None:
                await aclose()
        error = live.ended.result()
        await context.abort(getattr(grpc.StatusCode, error.status), str(error))

    def revoke_calls(self) -> int:
        """End every live streaming call (`revocable`) the present auth table no longer allows; return
        how many."""
        ended = 0
        for live in list(self._live):
            error = self.revocation(live.credential, live.method)
            if error is not None and not live.ended.done():
                live.ended.set_result(error)
                ended += 1
        return ended

    def current(self, principal: Principal) -> Principal | None:
        """`principal` as the present auth table knows it (looked up again by name after a reload);
        None when it no longer exists."""
        if not principal.authenticated:
            return None if self.enabled else self._anonymous
        if principal in self._internal.values():
            return principal
        table = self._table
        if table is None:  # mutual TLS without an auth file: every verified certificate is a principal
            certified = self._client_certificates
            return Principal(principal.name, limits=self._default_limits) if certified else None
        return table.principals.get(principal.name)

    def authenticate(
        self, metadata: Iterable[tuple[str, str | bytes]], auth_context: Mapping[str, Iterable[bytes]]
    ) -> Principal:
        """The caller, from its `authorization` metadata or its verified certificate (grpc's
        ServicerContext.auth_context()); raise Unauthenticated or PermissionDenied."""
        return self.identify(metadata, auth_context).principal

    def identify(
        self, metadata: Iterable[tuple[str, str | bytes]], auth_context: Mapping[str, Iterable[bytes]]
    ) -> Credential:
        """As `authenticate`, with the hash of the bearer token the principal was found by."""
        token = bearer_token(metadata)
        table = self._table
        # only a server that verified the certificate against its client CA may believe its names
        names = certificate_names(auth_context) if self._client_certificates else []
        if token is not None:
            digest = token_hash(token)
            internal = self._internal.get(digest)
            if internal is not None:
                return Credential(internal, digest)
            if self._internal_only:
                raise Unauthenticated("this port takes only the server's own tokens")
            if table is None:
                raise Unauthenticated("this server takes no bearer tokens (it has no --auth-file)")
            name = table.tokens.get(digest)  # by hash: a timing difference tells nothing of the token
            if name is None:
                raise Unauthenticated("unknown bearer token")
            return Credential(table.principals[name], digest)
        if names:
            if table is None:
                return Credential(Principal(names[0], limits=self._default_limits))
            for name in names:
                if name in table.principals:
                    return Credential(table.principals[name])
            raise PermissionDenied(f"the client certificate ({cut(names[0])}) names no principal here")
        if not self.enabled:
            return Credential(self._anonymous)
        raise Unauthenticated(
            "no credentials: send a bearer token (authorization: Bearer <token>) or a client certificate"
        )

    def caller(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> Principal:
        """The principal of a gRPC call, checked for a role `method` needs; raise Unauthenticated or
        PermissionDenied (ReceiverErrors: the service ends the call with their status)."""
        return self.credential(context, method).principal

    def credential(self, context: grpc.aio.ServicerContext[Any, Any], method: str) -> Credential:
        """As `caller`, with the hash of the bearer token it came by (a long-lived call keeps it, so that
        a reload that removes the token ends the call)."""
        credential = self.identify(context.invocation_metadata() or (), context.auth_context())
        self.authorize(credential.principal, method)
        return credential

    @staticmethod
    def authorize(principal: Principal, method: str) -> None:
        """Raise PermissionDenied unless `principal` has a role `method` needs."""
        needed = METHOD_ROLES.get(method)
        if needed is None or not principal.has_any(needed):
            roles = " or ".join(sorted(needed or ())) or "a role no principal has"
            raise PermissionDenied(f"principal {principal.name!r} may not call {method}: it needs {roles}")


def authorize_fields(principal: Principal, method: str, request: Message) -> None:
    """Raise PermissionDenied if `request` sets a field of `method` (FIELD_ROLES) that `principal` has
    no role for."""
    for field, needed in FIELD_ROLES.get(method, {}).items():
        if getattr(request, field) and not principal.has_any(needed):
            roles = " or ".join(sorted(needed))
            raise PermissionDenied(
                f"principal {principal.name!r} may call {method} but not with {field} set: it needs {roles}"
            )


def authorize_headers(principal: Principal, method: str, metadata: Iterable[tuple[str, str | bytes]]) -> None:
    """Raise PermissionDenied if the call's `metadata` carries a key of `method` (HEADER_ROLES) that
    `principal` has no role for."""
    keys = {key.lower() for key, _ in metadata}
    for key, needed in HEADER_ROLES.get(method, {}).items():
        if key in keys and not principal.has_any(needed):
            roles = " or ".join(sorted(needed))
            raise PermissionDenied(
                f"principal {principal.name!r} may call {method} but not naming a driver ({key}): it needs "
                f"{roles}, as a cluster's driver has"
            )


def bearer_token(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The token of the call's `authorization: Bearer <token>` metadata; None if it has none."""
    values = [v for k, v in metadata if k.lower() == "authorization"]
    if not values:
        return None
    if len(values) > 1:
        raise Unauthenticated("more than one authorization header")
    value = values[0].decode("utf-8", "replace") if isinstance(values[0], bytes) else values[0]
    if len(value) > MAX_TOKEN_CHARS:
        raise Unauthenticated(f"authorization header over {MAX_TOKEN_CHARS} characters")
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthenticated("authorization must be 'Bearer <token>'")
    return token.strip()


def certificate_names(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """The client certificate's subject CN, then its DNS SANs, then its URI SANs, as grpc's
    auth_context() holds them (grpcio 1.85: x509_common_name, peer_dns, peer_uri; its
    x509_subject_alternative_name mixes in email and IP SANs, which name no principal here); empty
    without a certificate. Names that cannot be principal names (over 256 bytes, NUL) are skipped."""
    names: list[str] = []
    for key in ("x509_common_name", "peer_dns", "peer_uri"):
        for value in auth_context.get(key, ()):
            name = value.decode("utf-8", "replace")
            if _valid_name(name) and name not in names:
                names.append(name)
    return names


def revoke(receivers: Iterable[Receiver], authenticator: Authenticator) -> int:
    """End every live call the (reloaded) auth table no longer allows; return how many. A Publish session
    opened with a bearer token the table no longer holds is cancelled UNAUTHENTICATED, one whose
    principal is gone or may no longer publish to its stream PERMISSION_DENIED (Authenticator.revocation);
    what they sent before is still acked (Cancel's accepted_up_to), and the producers fail, they do not
    reconnect. The other streaming calls (Replicate, ReadBlocks) end likewise (Authenticator.revocable).
    Sessions of the principal's other tokens, or of its certificate, go on."""
    revoked = 0
    for receiver in receivers:
        for session in receiver.sessions:
            credential = Credential(session.principal, session.token_sha256)
            error = authenticator.revocation(credential, PUBLISH, session.stream)
            if error is None:
                continue
            code = UNAUTHENTICATED if isinstance(error, Unauthenticated) else PERMISSION_DENIED
            if receiver.cancel(session, code, str(error)):
                revoked += 1
    return revoked + authenticator.revoke_calls()


@dataclass(eq=False)
class _LiveCall:
    credential: Credential
    method: str
    ended: asyncio.Future[ReceiverError]
    """Set by Authenticator.revoke_calls: the error the call ends with."""


def _check_name(name: str, where: str) -> None:
    if not _valid_name(name):
        # no NUL: a principal's producer keys are "\0<principal>\0<producer id>" (producer_key)
        raise AuthFileError(f"{where}: a principal name is 1-256 bytes of UTF-8, without NUL")
    if name in _RESERVED:
        # the server's own names: an audit line or a metric naming one must mean the server
        raise AuthFileError(f"{where}: {name!r} is the server's own principal name; choose another")


def _valid_name(name: str) -> bool:
    return 0 < len(name.encode("utf-8", "surrogatepass")) <= MAX_NAME_BYTES and "\0" not in name


def _strings(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise AuthFileError(f"{where} must be a string or a list of strings")
    if "" in value:  # `streams = ""` would pass as a producer's streams while granting none
        raise AuthFileError(f"{where} holds an empty string")
    return list(value)


def _streams(value: object, where: str) -> list[str]:
    """A principal's stream grants: stream names as --stream takes them, or "*". A grant no stream can
    have ("../x", "clicks " with a space) let the principal publish nowhere, without a word."""
    streams = _strings(value, where)
    for stream in streams:
        if stream != ALL_STREAMS:
            try:
                check_stream_name(stream)
            except InvalidStreamNameError as exc:
                raise AuthFileError(f"{where}: {exc}") from None
    return streams


def _role(name: str, where: str) -> Role:
    try:
        return Role(name)
    except ValueError:
        raise AuthFileError(f"{where}: unknown role {name!r} (roles: {', '.join(ALL_ROLES)})") from None


def _seconds(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ValueError(f"seconds, got {raw!r}")  # noqa: TRY004 - reported as the key's ValueError
    return float(raw)


def _limits(entry: Mapping[str, Any], base: Limits, where: str) -> Limits:
    if not isinstance(entry, Mapping):
        raise AuthFileError(f"{where} must be a table")
    if where.endswith("[defaults]"):
        extra = set(entry) - set(_LIMIT_KEYS)
        if extra:
            raise AuthFileError(f"{where}: unknown key(s) {', '.join(sorted(extra))}")
    values: dict[str, Any] = {f.name: getattr(base, f.name) for f in fields(Limits)}
    for key, attr in _LIMIT_KEYS.items():
        if key not in entry:
            continue
        raw = entry[key]
        try:
            if raw in ("none", "unlimited"):
                values[attr] = None
            elif attr == "idle_timeout":
                values[attr] = _seconds(raw)
            elif attr.endswith("_bytes") and isinstance(raw, str):
                values[attr] = parse_size(raw)
            else:
                values[attr] = raw
        except ValueError as exc:
            raise AuthFileError(f"{where} {key}: {exc}") from None
    try:
        return Limits(**values)
    except ValueError as exc:
        message = str(exc)
        for key, attr in _LIMIT_KEYS.items():  # Limits names its fields: say the file's keys
            message = re.sub(rf"\b{attr}\b", key, message)
        raise AuthFileError(f"{where}: {message}") from None
