"""What a service's pooled connection carries (SPEC R-ERR-2): the statement bound reaches
the server, and the dead-peer bounds reach libpq — keepalives for an idle connection,
``tcp_user_timeout`` for one whose bytes go unacknowledged (a primary whose node died)."""

from __future__ import annotations

import psycopg
from psycopg import sql
from qinglong_control.db.pool import (
    RECONCILER_POOL_MAX_SIZE,
    open_reconciler_pool,
    open_runtime_pool,
)
from qinglong_protocol.pooling import PoolSizing, open_pool
from qinglong_protocol.storage import StorageBounds

from tests.support.postgres import MigratedDatabase


async def test_a_pooled_connection_carries_every_storage_bound(
    database: MigratedDatabase,
) -> None:
    bounds = StorageBounds(3.0)
    pool = await open_pool(
        database.urls.runtime,
        name="bounds",
        application_name="qinglong-test",
        sizing=PoolSizing(1, 1),
        bounds=bounds,
    )
    try:
        async with pool.connection() as conn:
            cursor = await conn.execute("SHOW statement_timeout")
            assert await cursor.fetchone() == ("15s",)
            libpq = {
                option.keyword.decode(): (option.val or b"").decode() for option in conn.pgconn.info
            }
    finally:
        await pool.close()
    assert libpq["tcp_user_timeout"] == "15000"
    assert (libpq["keepalives"], libpq["keepalives_idle"]) == ("1", "10")
    assert libpq["connect_timeout"] == "3"


async def test_a_role_or_database_setting_cannot_turn_off_the_standby_wait(
    database: MigratedDatabase,
) -> None:
    """A service's credentials may ALTER their own role (and the owner its database): the
    session pins synchronous_commit, which outranks both."""
    name = sql.Identifier(database.name)
    weakened = (
        sql.SQL("ALTER ROLE qinglong_runtime IN DATABASE {} SET synchronous_commit = off"),
        sql.SQL("ALTER DATABASE {} SET synchronous_commit = local"),
    )
    undone = (
        sql.SQL("ALTER ROLE qinglong_runtime IN DATABASE {} RESET synchronous_commit"),
        sql.SQL("ALTER DATABASE {} RESET synchronous_commit"),
    )
    with psycopg.connect(database.admin_url, autocommit=True) as admin:
        for statement in weakened:
            admin.execute(statement.format(name))
    try:
        with psycopg.connect(database.urls.runtime) as plain:
            assert plain.execute("SHOW synchronous_commit").fetchone() == ("off",)
        pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(1, 1))
        try:
            async with pool.connection() as conn:
                cursor = await conn.execute("SHOW synchronous_commit")
                assert await cursor.fetchone() == ("on",)
        finally:
            await pool.close()
    finally:
        with psycopg.connect(database.admin_url, autocommit=True) as admin:
            for statement in undone:
                admin.execute(statement.format(name))


async def test_the_reconcilers_connection_plans_generically_and_the_commands_do_not(
    database: MigratedDatabase,
) -> None:
    """The reconciler's statements would otherwise be planned anew at every cycle once
    the backlog is large (db/pool.py); the commands keep PostgreSQL's own choice. Both
    keep the statement bound."""
    bounds = StorageBounds(3.0)
    reconciler = await open_reconciler_pool(database.urls.runtime, bounds=bounds)
    runtime = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(1, 1), bounds=bounds)
    try:
        shown = {}
        for name, pool in (("reconciler", reconciler), ("runtime", runtime)):
            async with pool.connection() as conn:
                cursor = await conn.execute(
                    "SELECT current_setting('plan_cache_mode'),"
                    " current_setting('statement_timeout')"
                )
                shown[name] = await cursor.fetchone()
        assert reconciler.max_size == RECONCILER_POOL_MAX_SIZE
    finally:
        await reconciler.close()
        await runtime.close()
    assert shown == {
        "reconciler": ("force_generic_plan", "15s"),
        "runtime": ("auto", "15s"),
    }
