"""The worker-ingress role's connection pool, opened explicitly; how it finds a broken
connection without a check per checkout: qinglong_protocol.pooling."""

from __future__ import annotations

from qinglong_protocol.pooling import PoolSizing, RecoveringPool, open_pool
from qinglong_protocol.storage import StorageBounds


async def open_ingress_pool(
    url: str, *, sizing: PoolSizing | None = None, bounds: StorageBounds | None = None
) -> RecoveringPool:
    """Autocommit connections: an audit batch is durable as soon as its INSERT returns."""
    return await open_pool(
        url,
        name="qinglong-ingress",
        application_name="qinglong-ingress",
        sizing=sizing,
        bounds=bounds,
    )
