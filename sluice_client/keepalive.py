"""gRPC keepalive, in one place: the pings a channel sends to tell a peer that is gone without a FIN (its
host powered off, a cable pulled, a NAT or firewall that dropped the flow) from a quiet one, and the
policy a server takes them by.

A connection whose far end vanished without closing it looks open for ever to the side that waits: a
stream on it neither ends nor errs. A keepalive ping unanswered within its timeout closes the transport,
and every call on it ends UNAVAILABLE. A gRPC server, by default, takes more than one ping every 5 minutes
on a connection without data as abuse (GOAWAY ENHANCE_YOUR_CALM, "too_many_pings"), and a ping on a
connection with no call as abuse within 2 hours: server_options() says how often the pings of this
service's clients come, so that they are answered and never count against the client.
"""

from __future__ import annotations

KEEPALIVE_SECONDS = 10
"""A producer's session pings its server after this long without a frame from it ..."""
KEEPALIVE_TIMEOUT_SECONDS = 10
"""... and takes the server for lost (UNAVAILABLE: reconnect, fail over) when no answer comes in this
long."""
PEER_KEEPALIVE_SECONDS = 10.0
"""A cluster node pings a peer it has a connection to (Replicate streams, producer marks) after this long
without a frame from it, and a receiver node pings its own clients (an owner's Replicate stream to it)
as often ..."""
PEER_KEEPALIVE_TIMEOUT_SECONDS = 10.0
"""... and closes the connection when no answer comes in this long: a peer gone without a FIN ends its
streams within PEER_KEEPALIVE_SECONDS + PEER_KEEPALIVE_TIMEOUT_SECONDS."""
MAX_PING_STRIKES = 2
"""Pings a server takes more often than its policy allows (without data in between) before it sends
GOAWAY: gRPC's default, said here so that the policy is what this module says."""


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def channel_options(every: float, timeout: float, *, without_calls: bool = False) -> list[tuple[str, int]]:
    """Options of a channel that pings its server `every` seconds without a frame from it and closes the
    connection when a ping goes unanswered `timeout` seconds; `without_calls`: also while no call is open
    (a channel kept for later calls)."""
    return [
        ("grpc.keepalive_time_ms", _ms(every)),
        ("grpc.keepalive_timeout_ms", _ms(timeout)),
        ("grpc.keepalive_permit_without_calls", int(without_calls)),
        # by default a channel stops pinging after 2 pings without data: an idle stream would go unwatched
        ("grpc.http2.max_pings_without_data", 0),
        # any ping's answer, not only keepalive's: a flow-control (BDP) ping in flight holds keepalive
        # back, and waited 60 s by default
        ("grpc.http2.ping_timeout_ms", _ms(timeout)),
    ]


def node_channel_options() -> list[tuple[str, int]]:
    """Options of a channel that the Spark side keeps or opens to a receiver node or a Sluice server: the
    cluster driver's (node rates, planning, releases), its query's planning worker and Spark's executors
    (ReadBlocks), the live rate's (LiveRateCap). They ping as peers ping each other (PEER_KEEPALIVE_SECONDS,
    PEER_KEEPALIVE_TIMEOUT_SECONDS), while no call is open too: a node gone without a FIN, or a flow a NAT
    dropped, fails the calls on it UNAVAILABLE within their sum and the channel connects anew, rather than
    an executor's read waiting out its deadline (300 s) and a kept channel timing out every call for as
    long as the kernel keeps the dead connection (about 15 minutes of retransmits; for ever when a
    middlebox still acknowledges its packets). Every server of this service takes
    such pings (server_options with clients_every at most PEER_KEEPALIVE_SECONDS)."""
    return channel_options(PEER_KEEPALIVE_SECONDS, PEER_KEEPALIVE_TIMEOUT_SECONDS, without_calls=True)


def server_options(
    clients_every: float, *, ping_every: float | None = None, timeout: float = PEER_KEEPALIVE_TIMEOUT_SECONDS
) -> list[tuple[str, int]]:
    """Options of a server whose clients ping at most every `clients_every` seconds (the shortest
    keepalive among them): it answers pings half as far apart, on a connection with no call too; more
    often than that, without data in between, is abuse (GOAWAY after MAX_PING_STRIKES). `ping_every`: the
    server pings its clients this often itself and closes a connection whose ping goes unanswered
    `timeout` seconds (None: it does not)."""
    options = [
        ("grpc.http2.min_ping_interval_without_data_ms", _ms(clients_every / 2)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
    ]
    if ping_every is not None:
        options += [
            ("grpc.keepalive_time_ms", _ms(ping_every)),
            ("grpc.keepalive_timeout_ms", _ms(timeout)),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.ping_timeout_ms", _ms(timeout)),
        ]
    return options
