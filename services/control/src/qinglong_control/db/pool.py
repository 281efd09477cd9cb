"""Control's connection pools, opened explicitly (never in a constructor): the runtime
role's for every runtime command, and a small one of the admin role's for AdminService."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong_protocol.storage import StorageBounds


async def open_runtime_pool(
    url: str, *, min_size: int = 2, max_size: int = 10, bounds: StorageBounds | None = None
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    return await _open_pool(url, "qinglong-runtime", min_size, max_size, bounds)


async def open_admin_pool(
    url: str, *, min_size: int = 1, max_size: int = 2, bounds: StorageBounds | None = None
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """Administration is rare: two connections hold it, and a runtime surge cannot take
    them (nor it the runtime's)."""
    return await _open_pool(url, "qinglong-admin", min_size, max_size, bounds)


async def _open_pool(
    url: str, name: str, min_size: int, max_size: int, bounds: StorageBounds | None
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
        name=name,
    )
    # Opening waits longer than one call would: a service starting next to its database
    # may see it come up a moment later.
    await pool.open(wait=True, timeout=max(timeout_s, 10.0))
    return pool
