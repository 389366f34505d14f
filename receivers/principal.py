"""Who a call comes from: a principal, its roles, the streams it may publish to, and its limits.

A principal is named by a bearer token (looked up by its SHA-256 hash) or by a client certificate (its
subject CN or a DNS/URI SAN), see receivers.auth. Roles, as Kafka's ACLs split operations:

- producer: Publish, only to the streams granted ("*": every stream);
- operator: RateControl and Sessions, reads and changes;
- reader: status (RateControl.GetRate, Sessions.ListSessions) and /metrics, never a record;
- consumer: reads records (Blocks.ListPartitions, Blocks.ReadBlocks: a cluster's Spark executors).

Limits bound what one principal can take of a shared server (every value > 0; None: no limit), each
ending the offending call with a documented status (see docs/security.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class Role(StrEnum):
    PRODUCER = "producer"
    OPERATOR = "operator"
    READER = "reader"
    CONSUMER = "consumer"
    """Reads the records themselves (Blocks): a scraper's reader role must not."""
    PEER = "peer"
    """Another node of the cluster: replicates blocks to this one, asks its producers' marks."""


ALL_ROLES = frozenset(Role)
ALL_STREAMS = "*"
MIN_MESSAGE_BYTES = 1024
"""The smallest message limit a principal may have (`sluice serve --max-message-bytes` too)."""
MIN_IDLE_TIMEOUT = 0.1
MAX_IDLE_TIMEOUT = 10 * 365 * 86400.0
"""The idle timeouts a principal may have, from the auth file as from `--idle-timeout`: 0.1 s to 10
years. Below, every session of the principal was cut as idle before its first batch could come
("idle for 1e-300 s"): a producer never got a record acked."""


@dataclass(frozen=True)
class Limits:
    """What one principal may hold at once, per server. Defaults are generous but finite."""

    max_sessions: int | None = 256
    """Publish sessions open at once (every stream): RESOURCE_EXHAUSTED at Open beyond it."""
    max_streams: int | None = None
    """Distinct streams with a session open at once: RESOURCE_EXHAUSTED at Open beyond it."""
    max_message_bytes: int | None = None
    """Largest Publish message (bytes on the wire): RESOURCE_EXHAUSTED; None: the server's limit."""
    max_record_bytes: int | None = None
    """Largest record (key + value + headers): INVALID_ARGUMENT naming the record; None: no limit."""
    idle_timeout: float | None = 600.0
    """Seconds a session may hold credit and send nothing: then it ends UNAVAILABLE (reconnect when
    there is something to send)."""

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_streams", "max_message_bytes", "max_record_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (or unset: no limit), got {value!r}")
        if self.max_message_bytes is not None and self.max_message_bytes < MIN_MESSAGE_BYTES:
            # as `sluice serve --max-message-bytes`: below, a message carries no record of any use
            # (the SDK refused every one, "over the -54-byte limit of a record")
            raise ValueError(
                f"max_message_bytes must be >= {MIN_MESSAGE_BYTES} (or unset: the server's limit), got "
                f"{self.max_message_bytes!r}"
            )
        if self.idle_timeout is not None and not (MIN_IDLE_TIMEOUT <= self.idle_timeout <= MAX_IDLE_TIMEOUT):
            raise ValueError(
                f"idle_timeout must be {MIN_IDLE_TIMEOUT:g} to {MAX_IDLE_TIMEOUT:,.0f} seconds (10 years), "
                f"or unset: no limit; got {self.idle_timeout!r}"
            )


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    name: str
    roles: frozenset[Role] = ALL_ROLES
    streams: frozenset[str] = frozenset({ALL_STREAMS})
    """Streams the producer role covers; "*": every stream."""
    limits: Limits = field(default_factory=Limits)
    authenticated: bool = True
    """False for the anonymous principal of a server without authentication."""

    def may_publish(self, stream: str) -> bool:
        return Role.PRODUCER in self.roles and (ALL_STREAMS in self.streams or stream in self.streams)

    def has_any(self, roles: frozenset[Role]) -> bool:
        return not self.roles.isdisjoint(roles)


ANONYMOUS = Principal("anonymous", authenticated=False)
"""Every caller of a server without authentication: every role, every stream, the default limits."""


def producer_key(principal: Principal, producer_id: str) -> str:
    """The key of `producer_id` in a receiver's producer table (and in the block log's marks).

    A producer id belongs to the principal that uses it: were the table keyed by the id alone, another
    principal could fence a producer (ABORTED) or send its sequence numbers first so that its records are
    dropped as duplicates. So an authenticated principal's ids are keyed "\\0<principal>\\0<id>" (a
    principal name holds no NUL, receivers.auth, so no two principals' keys meet); an anonymous server's
    are the id itself, as before. At most 1 + 256 + 1 + 256 bytes: well within the log's 65535.
    """
    if not producer_id or not principal.authenticated:
        return producer_id
    return f"\0{principal.name}\0{producer_id}"
