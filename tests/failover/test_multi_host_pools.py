"""SPEC R-HA-2 at the pool level: the services' own pool openers on libpq multi-host URLs.

Control and ingress hand their URL unchanged to psycopg's pool (`open_runtime_pool`,
`open_ingress_pool`), so a multi-host URL with ``target_session_attrs=read-write`` is
libpq's to resolve. These tests prove what the services rely on, with the real openers
and a real synchronous standby (PostgreSQL 18):

* the pool connects to the primary whatever the order of hosts, skipping a standby and a
  host where nothing listens;
* a pooled connection killed by the server (`pg_terminate_backend`) is replaced by the
  pool's `check`, so the next caller gets a working connection, not the dead one;
* while no primary is reachable, acquiring a connection fails within the storage bound
  (what the services answer as UNAVAILABLE, R-ERR-2); after `pg_ctl promote`, the same
  pool, unchanged, reaches the new primary and sees every committed row.
"""

from __future__ import annotations

import time
from typing import Any, Final

import psycopg
import pytest
from psycopg_pool import PoolTimeout
from qinglong_control.db.pool import open_runtime_pool
from qinglong_ingress.pool import open_ingress_pool
from qinglong_protocol.pooling import PoolSizing, read_retrying
from qinglong_protocol.storage import StorageBounds

from tests.support.postgres_control import PostgresControl
from tests.support.standby_pair import Pair

BOUNDS: Final = StorageBounds(2.0)
RECOVERY_SECONDS: Final = 30.0


async def _server_of(pool: object) -> tuple[str, bool]:
    async with pool.connection() as conn:  # type: ignore[attr-defined]
        row = await (await conn.execute("SELECT pg_is_in_recovery()")).fetchone()
        return str(conn.info.host), bool(row[0])


async def test_pools_find_the_primary_in_any_host_order(pair: Pair) -> None:
    nowhere = pair.primary.socket_dir.parent / "nothing-listens-here"
    nowhere.mkdir()
    primary, standby = pair.sockets
    orders = {
        "standby first": ((standby, primary), (pair.standby.port, pair.primary.port)),
        "dead host first": ((nowhere, standby, primary), (5432, pair.standby.port, 5432)),
    }
    for label, (sockets, ports) in orders.items():
        runtime = await open_runtime_pool(
            pair.multi_host(pair.urls.runtime, *sockets, ports=ports), bounds=BOUNDS
        )
        ingress = await open_ingress_pool(
            pair.multi_host(pair.urls.ingress, *sockets, ports=ports), bounds=BOUNDS
        )
        try:
            for pool in (runtime, ingress):
                host, in_recovery = await _server_of(pool)
                assert (host, in_recovery) == (str(primary), False), label
        finally:
            await runtime.close()
            await ingress.close()


async def _backend_pid(conn: psycopg.AsyncConnection[Any]) -> int:
    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    assert row is not None
    return int(row[0])


def _kill_control_connections(pair: Pair) -> int:
    with psycopg.connect(pair.primary.admin_url, autocommit=True) as admin:
        # In the select list, not in WHERE: there PostgreSQL may call it on any row
        # before the filter, this very session included.
        killed = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
            ("qinglong-control",),
        ).fetchall()
    return len(killed)


async def test_pool_replaces_connections_the_server_killed(pair: Pair) -> None:
    """No check per checkout (R-PERF-1): a killed connection is found where it fails.
    A read runs once more and succeeds; a write fails once (its caller answers
    UNAVAILABLE, the Worker retries) — and the caller that met the broken connection
    had the idle ones checked, so every later caller gets a live one at the first try."""
    url = pair.multi_host(pair.urls.runtime, *pair.sockets, ports=pair.ports)
    pool = await open_runtime_pool(url, sizing=PoolSizing(2, 4), bounds=BOUNDS)
    try:
        before = {await read_retrying(pool, _backend_pid) for _ in range(2)}
        assert _kill_control_connections(pair) >= 1
        read_after_kill = await read_retrying(pool, _backend_pid)
        assert read_after_kill not in before
        for _ in range(6):
            async with pool.connection() as conn:
                assert await _backend_pid(conn) not in before

        live = {await read_retrying(pool, _backend_pid) for _ in range(2)}
        assert _kill_control_connections(pair) >= 1
        failed_writes = 0
        for _ in range(6):
            try:
                async with pool.connection() as conn:
                    assert await _backend_pid(conn) not in live
            except psycopg.OperationalError:
                failed_writes += 1
        print(f"\ncalls after the kill that failed: {failed_writes} of 6 (a write is not retried)")
        assert failed_writes == 1
    finally:
        await pool.close()


async def test_pool_fails_fast_without_a_primary_and_follows_the_promotion(pair: Pair) -> None:
    runtime = await open_runtime_pool(
        pair.multi_host(pair.urls.migration, *pair.sockets, ports=pair.ports),
        sizing=PoolSizing(min_size=2),
        bounds=BOUNDS,
    )
    try:
        async with runtime.connection() as conn:
            await conn.execute("CREATE TABLE failover_probe (n int)")
            # With synchronous_commit=on this returns only once the standby has the row.
            await conn.execute("INSERT INTO failover_probe VALUES (42)")

        PostgresControl.attach(pair.primary.data_dir).stop()
        # No primary at all: the standby is read-only, so libpq refuses it too.
        began = time.monotonic()
        with pytest.raises((PoolTimeout, psycopg.OperationalError)):
            async with runtime.connection() as conn:
                await conn.execute("SELECT 1")
        waited = time.monotonic() - began
        assert waited <= BOUNDS.timeout_seconds + 1.0, f"held {waited:.1f} s without a primary"

        PostgresControl.attach(pair.standby.data_dir).promote()
        deadline = time.monotonic() + RECOVERY_SECONDS
        while True:
            try:
                async with runtime.connection() as conn:
                    row = await (
                        await conn.execute(
                            "SELECT pg_is_in_recovery(), (SELECT array_agg(n) FROM failover_probe)"
                        )
                    ).fetchone()
                break
            except (PoolTimeout, psycopg.OperationalError):
                assert time.monotonic() < deadline, "the pool never reached the new primary"
        assert row is not None
        found = row[1] or []
        print(
            f"\nno primary: refused after {waited:.1f} s; after the promotion the committed"
            f" row was found {found.count(42)} time(s) (lost {1 - min(1, found.count(42))},"
            f" duplicated {max(0, len(found) - 1)})"
        )
        assert row[0] is False
        assert row[1] == [42]
        assert conn.info.host == str(pair.standby.socket_dir)
    finally:
        await runtime.close()
