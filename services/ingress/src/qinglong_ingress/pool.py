"""The worker-ingress role's connection pool, opened explicitly.

Ingress cannot share control's pool code (it must not depend on qinglong-control), and
the protocol distribution must stay free of psycopg (Workers install it), so this small
opener lives here.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool


async def open_ingress_pool(
    url: str, *, min_size: int = 1, max_size: int = 10, timeout_s: float = 5.0
) -> AsyncConnectionPool[AsyncConnection[Any]]:
    """Autocommit connections: each audit row is durable as soon as its INSERT returns."""
    pool: AsyncConnectionPool[AsyncConnection[Any]] = AsyncConnectionPool(
        url,
        min_size=min_size,
        max_size=max_size,
        timeout=timeout_s,
        kwargs={"autocommit": True, "application_name": "qinglong-ingress"},
        check=AsyncConnectionPool.check_connection,
        open=False,
        name="qinglong-ingress",
    )
    await pool.open(wait=True, timeout=timeout_s)
    return pool
