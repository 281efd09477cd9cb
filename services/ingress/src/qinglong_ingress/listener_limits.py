"""What one caller may hold open on a listener: calls, streams per connection, connections.

gRPC reads a call's request message only after the call is accepted, and runs the
admission stages (rate limit, audit) only once the message has arrived. Without limits a
client could start calls and never send their messages: each one holds server memory for
ever, unaudited, unseen by any rate limit (about 18 KB a call, measured; thousands of
them push ingress out of memory, and with it every Worker's lease renewal). So each
listener caps:

* calls in progress (``maximum_concurrent_rpcs``): more are answered RESOURCE_EXHAUSTED
  at once;
* streams per connection (``grpc.max_concurrent_streams``);
* a connection's life (``grpc.max_connection_age_ms``, then the grace for its calls in
  flight): a call whose message never came ends with its connection — clients reconnect
  on their own, which also spreads them over replicas again;
* an idle connection (``grpc.max_connection_idle_ms``).

The enrollment listener, open to anyone, gets tight limits (a join is one short call);
the mutual-TLS listener room for a fleet (its streams live at most
``gateway.STREAM_LIFETIME_SECONDS``, shorter than its connections' grace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from qinglong_ingress.gateway import STREAM_LIFETIME_SECONDS


@dataclass(frozen=True)
class ListenerLimits:
    max_concurrent_rpcs: int
    max_concurrent_streams: int
    max_connection_age_ms: int
    max_connection_age_grace_ms: int
    max_connection_idle_ms: int

    def server_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.max_concurrent_streams", self.max_concurrent_streams),
            ("grpc.max_connection_age_ms", self.max_connection_age_ms),
            ("grpc.max_connection_age_grace_ms", self.max_connection_age_grace_ms),
            ("grpc.max_connection_idle_ms", self.max_connection_idle_ms),
        ]


#: The mutual-TLS listener: thousands of Workers' short calls and operators' watches; a
#: connection lives half an hour, and its calls in flight get more than a stream's life.
PUBLIC_LIMITS: Final = ListenerLimits(
    max_concurrent_rpcs=4096,
    max_concurrent_streams=128,
    max_connection_age_ms=30 * 60 * 1000,
    max_connection_age_grace_ms=int(STREAM_LIFETIME_SECONDS * 1000) + 5_000,
    max_connection_idle_ms=5 * 60 * 1000,
)
#: The enrollment listener: anyone may connect; a join is one call of a few ms.
ENROLLMENT_LIMITS: Final = ListenerLimits(
    max_concurrent_rpcs=64,
    max_concurrent_streams=4,
    max_connection_age_ms=60 * 1000,
    max_connection_age_grace_ms=10 * 1000,
    max_connection_idle_ms=30 * 1000,
)
