"""Control's connection pools, opened explicitly (never in a constructor): the runtime
role's for every runtime command, and a small one of the admin role's for AdminService.
How they find a broken connection without a check per checkout: qinglong_protocol.pooling."""

from __future__ import annotations

from qinglong_protocol.pooling import PoolSizing, RecoveringPool, open_pool
from qinglong_protocol.storage import StorageBounds

#: AdminService and Worker join are rare: two connections hold them, and a runtime surge
#: cannot take them (nor they the runtime's).
ADMIN_POOL_MAX_SIZE = 2


async def open_runtime_pool(
    url: str, *, sizing: PoolSizing | None = None, bounds: StorageBounds | None = None
) -> RecoveringPool:
    return await open_pool(
        url,
        name="qinglong-runtime",
        application_name="qinglong-control",
        sizing=sizing,
        bounds=bounds,
    )


async def open_admin_pool(
    url: str, *, sizing: PoolSizing | None = None, bounds: StorageBounds | None = None
) -> RecoveringPool:
    return await open_pool(
        url,
        name="qinglong-admin",
        application_name="qinglong-control",
        sizing=(sizing or PoolSizing()).smaller(ADMIN_POOL_MAX_SIZE),
        bounds=bounds,
    )
