"""The runtime role's connection pool, opened explicitly (never in a constructor)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong_protocol.storage import StorageBounds


async def open_runtime_pool(
    url: str, *, min_size: int = 2, max_size: int = 10, bounds: StorageBounds | None = None
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """Open a pool of autocommit connections; each command opens its own transaction.

    `check` validates a connection before it is handed out, so a connection killed by a
    failover is replaced instead of failing a Worker's command.
    """
    bounds = bounds or StorageBounds()
    timeout_s = bounds.acquire_timeout_seconds
    pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout_s,
        kwargs=bounds.connection_kwargs("qinglong-control"),
        check=AsyncConnectionPool.check_connection,
        open=False,
        name="qinglong-runtime",
    )
    # Opening waits longer than one call would: a service starting next to its database
    # may see it come up a moment later.
    await pool.open(wait=True, timeout=max(timeout_s, 10.0))
    return pool
