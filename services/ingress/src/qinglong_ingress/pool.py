"""The worker-ingress role's connection pool, opened explicitly.

Ingress cannot share control's pool code (it must not depend on qinglong-control), and
the protocol distribution must stay free of psycopg (Workers install it), so this small
opener lives here.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong_protocol.storage import StorageBounds


async def open_ingress_pool(
    url: str, *, min_size: int = 1, max_size: int = 10, bounds: StorageBounds | None = None
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """Autocommit connections: each audit row is durable as soon as its INSERT returns."""
    bounds = bounds or StorageBounds()
    timeout_s = bounds.acquire_timeout_seconds
    pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout_s,
        kwargs=bounds.connection_kwargs("qinglong-ingress"),
        check=AsyncConnectionPool.check_connection,
        open=False,
        name="qinglong-ingress",
    )
    # Opening waits longer than one call would: a service starting next to its database
    # may see it come up a moment later.
    await pool.open(wait=True, timeout=max(timeout_s, 10.0))
    return pool
