"""The security audit's retention (migration 0013), on PostgreSQL 16 and 18: rows past
the age go a bounded step at a time, nothing younger than the database's floor goes
whatever control asks, and no role but the function's owner deletes an audit row."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import errors
from qinglong_control.db.audit_retention import prune_audit
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.domain.audit_retention import (
    AUDIT_RETENTION_FLOOR_MS,
    DAY_MS,
    AuditRetention,
)
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_protocol.pooling import PoolSizing

from tests.support.postgres import MigratedDatabase

HOUR_MS = 3600 * 1000


def audit_rows_aged(database: MigratedDatabase, ages_ms: list[int]) -> list[uuid.UUID]:
    """Audit rows that occurred `age` ago by DB time, written as the schema's owner (the
    ingress role's rows take their time from the column's default)."""
    ids = [uuid.uuid4() for _ in ages_ms]
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        for audit_id, age in zip(ids, ages_ms, strict=True):
            conn.execute(
                "INSERT INTO qinglong.security_audit (audit_id, occurred_at_ms, operation,"
                " outcome) VALUES (%s, qinglong.db_now_ms() - %s, 'test.aged', 'admitted')",
                (audit_id, age),
            )
    return ids


def remaining(database: MigratedDatabase, ids: list[uuid.UUID]) -> set[uuid.UUID]:
    with psycopg.connect(database.urls.migration) as conn:
        rows = conn.execute(
            "SELECT audit_id FROM qinglong.security_audit WHERE audit_id = ANY(%s)", (ids,)
        ).fetchall()
    return {row[0] for row in rows}


async def prune(database: MigratedDatabase, max_age_ms: int, limit: int) -> int:
    async with await psycopg.AsyncConnection.connect(
        database.urls.runtime, autocommit=True
    ) as conn:
        return await prune_audit(conn, max_age_ms, limit)


async def test_rows_past_the_retention_go_the_oldest_first_a_bounded_step_at_a_time(
    database: MigratedDatabase,
) -> None:
    retention = AuditRetention(30 * DAY_MS)
    old = audit_rows_aged(database, [400 * DAY_MS, 200 * DAY_MS, 31 * DAY_MS])
    young = audit_rows_aged(database, [29 * DAY_MS, HOUR_MS, 0])

    assert await prune(database, retention.max_age_ms, 2) == 2
    # The two oldest went first; the third waits for the next step.
    assert remaining(database, old) == {old[2]}
    assert await prune(database, retention.max_age_ms, 2) == 1
    assert await prune(database, retention.max_age_ms, 2) == 0
    assert remaining(database, old) == set()
    assert remaining(database, young) == set(young)


async def test_nothing_younger_than_the_floor_goes_whatever_control_asks(
    database: MigratedDatabase,
) -> None:
    """The floor is the database's: asked for an age of 0 (as a control process that is
    not what it should be might ask), the function still keeps the last seven days."""
    past_floor, within_floor = audit_rows_aged(
        database, [AUDIT_RETENTION_FLOOR_MS + HOUR_MS, AUDIT_RETENTION_FLOOR_MS - HOUR_MS]
    )
    assert await prune(database, 0, 100) == 1
    assert remaining(database, [past_floor, within_floor]) == {within_floor}
    with pytest.raises(ValueError, match="at least 7 days"):
        AuditRetention(AUDIT_RETENTION_FLOOR_MS - 1)


@pytest.mark.parametrize("limit", [0, 10_001])
async def test_an_unbounded_step_is_refused(database: MigratedDatabase, limit: int) -> None:
    ids = audit_rows_aged(database, [400 * DAY_MS])
    with pytest.raises(errors.InvalidParameterValue):
        await prune(database, 30 * DAY_MS, limit)
    assert remaining(database, ids) == set(ids)


def test_only_the_function_deletes_audit_rows(database: MigratedDatabase) -> None:
    ids = audit_rows_aged(database, [400 * DAY_MS])
    for url in (database.urls.runtime, database.urls.ingress, database.urls.admin):
        with (
            psycopg.connect(url, autocommit=True) as conn,
            pytest.raises(errors.InsufficientPrivilege),
        ):
            conn.execute("DELETE FROM qinglong.security_audit")
    for url in (database.urls.ingress, database.urls.admin):
        with (
            psycopg.connect(url, autocommit=True) as conn,
            pytest.raises(errors.InsufficientPrivilege),
        ):
            conn.execute("SELECT qinglong.prune_security_audit(0, 1)")
    assert remaining(database, ids) == set(ids)


async def test_the_reconcile_cycle_removes_them_within_its_bound(
    database: MigratedDatabase,
) -> None:
    old = audit_rows_aged(database, [100 * DAY_MS] * 5)
    young = audit_rows_aged(database, [DAY_MS])
    pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(1, 2))
    try:
        reconciler = Reconciler(
            pool,
            ReconcilerLimits(page_size=2, max_pages=2),
            audit_retention=AuditRetention(90 * DAY_MS),
        )
        first = await reconciler.cycle()
        assert first.audit_rows_removed == 4  # two full pages: the cycle's bound
        assert len(remaining(database, old)) == 1
        assert (await reconciler.cycle()).audit_rows_removed == 1
    finally:
        await pool.close()
    assert remaining(database, old) == set()
    assert remaining(database, young) == set(young)
