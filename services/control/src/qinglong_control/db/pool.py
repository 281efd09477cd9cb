"""The runtime role's connection pool, opened explicitly (never in a constructor)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool


async def open_runtime_pool(
    url: str, *, min_size: int = 2, max_size: int = 10, timeout_s: float = 5.0
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """Open a pool of autocommit connections; each command opens its own transaction.

    `check` validates a connection before it is handed out, so a connection killed by a
    failover is replaced instead of failing a Worker's command.
    """
    pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout_s,
        kwargs={"autocommit": True, "application_name": "qinglong-control"},
        check=AsyncConnectionPool.check_connection,
        open=False,
        name="qinglong-runtime",
    )
    await pool.open(wait=True, timeout=timeout_s)
    return pool
