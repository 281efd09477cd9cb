"""Finding a peer that died without closing its connections.

Ingress keeps one HTTP/2 connection to each control replica it reaches and sends every
forwarded call down it. A control pod whose node lost power, or whose process hangs,
closes nothing: without pings, ingress would go on sending calls into the dead connection
(each one ending at its deadline) for as long as the kernel keeps the connection — far
past every Worker's lease. With a ping every ``INTERNAL_KEEPALIVE_MS`` that must be
answered within ``INTERNAL_KEEPALIVE_TIMEOUT_MS``, the connection is declared dead within
their sum and the channel connects again (to a live replica, through the Service). gRPC
also sets TCP_USER_TIMEOUT to the ping timeout on such a channel, so unacknowledged data
ends a connection as fast. A Worker's channel to ingress pings the same way, less often.

A gRPC server answers a client that pings more often than it allows with GOAWAY
(``too_many_pings``), so control's server is told to accept ingress's pings; ingress's
public server keeps gRPC's default (one ping in five minutes), which the Worker respects.
"""

from __future__ import annotations

from typing import Final

#: How often ingress pings each control connection, busy or idle.
INTERNAL_KEEPALIVE_MS: Final = 10_000
#: How long a ping may go unanswered before the connection is closed.
INTERNAL_KEEPALIVE_TIMEOUT_MS: Final = 5_000


def keepalive_options(every_ms: int, timeout_ms: int) -> list[tuple[str, int]]:
    """A channel that pings every ``every_ms`` and closes a connection whose ping is not
    answered within ``timeout_ms``."""
    return [
        ("grpc.keepalive_time_ms", every_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # grpcio 1.85 waits for a ping's answer this long whatever the keepalive timeout
        # says (a minute by default): tests/integration/test_control_keepalive.py took 70 s
        # to leave a silent connection without it, 15 s with it.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


def internal_channel_options() -> list[tuple[str, int]]:
    """Ingress's channel to control."""
    return [
        *keepalive_options(INTERNAL_KEEPALIVE_MS, INTERNAL_KEEPALIVE_TIMEOUT_MS),
        # An idle connection is checked too: the next call should not be the one to find
        # it dead.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


def internal_server_options() -> list[tuple[str, int]]:
    """Control's server: accept ingress's pings (half its interval leaves room for
    timer jitter), with or without calls in flight."""
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", INTERNAL_KEEPALIVE_MS // 2),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
