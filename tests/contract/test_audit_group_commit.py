"""Group commit on PostgreSQL: a row that breaks a CHECK fails only its own caller, and
the rows that shared its batch are written exactly once (the failed statement wrote
nothing; each is written again alone). The batching mechanics: tests/unit/test_group_commit.py."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from qinglong_ingress.audit import AuditOutcome
from qinglong_ingress.directory import AuditEntry, AuditRecord, Directory
from qinglong_ingress.pool import open_ingress_pool
from qinglong_protocol.pooling import PoolSizing

from tests.support.polling import settled
from tests.support.postgres import MigratedDatabase


def _entry(principal_kind: str = "anonymous") -> AuditEntry:
    return AuditEntry(
        AuditRecord(principal_kind, None, "WorkerService/OpenSession", AuditOutcome.ADMITTED, None)
    )


async def test_one_bad_row_fails_only_its_caller_and_the_others_are_written_once(
    database: MigratedDatabase,
) -> None:
    pool = await open_ingress_pool(database.urls.ingress, sizing=PoolSizing(2, 2))
    directory = Directory(pool)
    try:
        async with await psycopg.AsyncConnection.connect(database.admin_url) as lock:
            # While the table is held, the two writers' first rows wait in their
            # statements and the next three queue up together: one batch, one bad row.
            await lock.execute("LOCK TABLE qinglong.security_audit IN ACCESS EXCLUSIVE MODE")
            first = []
            for _ in range(2):  # one row per writer, each taken before the next arrives
                first.append(asyncio.ensure_future(directory.write_audit(_entry())))
                await asyncio.sleep(0)
                assert await settled(lambda: directory.audits_waiting == 0, 60)
            shared = [
                asyncio.ensure_future(directory.write_audit(_entry(kind)))
                for kind in ("anonymous", "no-such-kind", "anonymous")
            ]
            assert await settled(lambda: directory.audits_waiting == 3, 60)
            await lock.rollback()
        written = [await each for each in first]
        good, bad, other = await asyncio.gather(*shared, return_exceptions=True)
    finally:
        await pool.close()
    assert isinstance(bad, psycopg.errors.CheckViolation)
    ids = {a.audit_id for a in [*written, good, other]}  # type: ignore[union-attr]
    with psycopg.connect(database.urls.migration) as conn:
        rows = conn.execute("SELECT audit_id FROM qinglong.security_audit").fetchall()
    assert sorted(r[0] for r in rows) == sorted(ids), "each good row once, the bad one never"
    assert len(rows) == 4


@pytest.fixture(autouse=True)
def _empty_audit(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute("DELETE FROM qinglong.security_audit")
