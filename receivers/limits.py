"""Per-principal limits counted across a server's receivers: Publish sessions and streams open at once.

Sessions are counted per principal on the whole server (PublishService sees every receiver). The
anonymous principal (a server without authentication) is counted per peer host instead: one count for
every anonymous client would let a single one lock all others out with max_sessions sessions, and a
producer id bounds nothing since the client picks it freely; the peer's address is the only identity an
unauthenticated call has. Behind one NAT or proxy, clients share it.
"""

from __future__ import annotations

from collections.abc import Iterable

from receivers.errors import LimitExceeded, cut, shown
from receivers.principal import Principal
from receivers.session import Session


def peer_host(peer: str) -> str:
    """The host of a gRPC peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:/path")."""
    kind, _, address = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, _, port = address.rpartition(":")
        if host and port.isdigit():
            return host.strip("[]")
    return peer or "unknown peer"


def limit_key(principal: Principal, peer: str) -> str:
    """Whom sessions are counted for: the principal, or for the anonymous one its peer host."""
    if principal.authenticated:
        return principal.name
    return f"{principal.name}@{peer_host(peer)}"


class SessionLedger:
    """Publish sessions open per principal (limit_key); `admit` checks max_sessions and max_streams,
    `add` counts a session that opened, `remove` forgets it when its call ends."""

    def __init__(self) -> None:
        self._open: dict[str, set[Session]] = {}

    def sessions(self, key: str) -> int:
        return len(self._open.get(key, ()))

    def streams(self, key: str) -> list[str]:
        return sorted({s.stream for s in self._open.get(key, ())})

    def admit(self, principal: Principal, key: str, stream: str, *, fenced: Iterable[Session] = ()) -> None:
        """Raise LimitExceeded (RESOURCE_EXHAUSTED) if one more session of `principal` on `stream` is over
        its limits. `fenced`: sessions the new one supersedes (its producer's), which are ending and do
        not count, so that a producer reconnecting before its old session ended is not refused."""
        limits = principal.limits
        who = f"principal {cut(principal.name)!r}"
        if not principal.authenticated:
            who += f" (peer {key.partition('@')[2]})"
        mine = self._open.get(key, set())
        open_now = len(mine - set(fenced))
        if limits.max_sessions is not None and open_now >= limits.max_sessions:
            raise LimitExceeded(
                f"{who} has {open_now} Publish sessions open (every stream): max_sessions is "
                f"{limits.max_sessions}; close one first"
            )
        streams = self.streams(key)
        if limits.max_streams is not None and stream not in streams and len(streams) >= limits.max_streams:
            raise LimitExceeded(
                f"{who} publishes to {len(streams)} streams at once ({cut(', '.join(streams))}): "
                f"max_streams is {limits.max_streams}; stream {shown(stream)} would be one more"
            )

    def add(self, key: str, session: Session) -> None:
        self._open.setdefault(key, set()).add(session)

    def remove(self, key: str, session: Session) -> None:
        mine = self._open.get(key)
        if mine is not None:
            mine.discard(session)
            if not mine:
                del self._open[key]
