"""Control's connection pools, opened explicitly (never in a constructor): the runtime
role's for every runtime command, one connection of the same role for the reconciler, and
a small one of the admin role's for AdminService. How they find a broken connection
without a check per checkout: qinglong_protocol.pooling."""

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


#: The reconcile cycle borrows one connection at a time (its output step after the rest).
RECONCILER_POOL_MAX_SIZE = 1

#: The reconciler's statements end in `LIMIT %(limit)s` over partial indexes of tables
#: that grow with the backlog. PostgreSQL costs a prepared statement's generic plan with an
#: unknown limit as if it read a tenth of the table, so with a large backlog it keeps
#: planning each execution anew instead (bench_scale: the idle cycle 1.35x slower at
#: 100,000 pending than at 10; 1.00x with generic plans). The generic plans are the index
#: scans a custom plan picks too; the commands' plans are not affected (their pool).
RECONCILER_SETTINGS = {"plan_cache_mode": "force_generic_plan"}


async def open_reconciler_pool(
    url: str, *, sizing: PoolSizing | None = None, bounds: StorageBounds | None = None
) -> RecoveringPool:
    """The reconciler's own connection: no cycle waits behind a surge of commands for
    one, nor takes one from them."""
    return await open_pool(
        url,
        name="qinglong-reconciler",
        application_name="qinglong-control-reconciler",
        sizing=(sizing or PoolSizing()).smaller(RECONCILER_POOL_MAX_SIZE),
        bounds=bounds,
        settings=RECONCILER_SETTINGS,
    )
