"""The audit outcome is one enum for ingress's code and the database's CHECK.

The values are read back from a migrated database (every supported version), so a
migration that changes the CHECK without the enum, or the enum without a migration,
fails here rather than as a refused audit row (AUDIT_UNAVAILABLE) in production.
"""

from __future__ import annotations

import re
import uuid

import psycopg
import pytest
from qinglong.admin.v1 import admin_pb2
from qinglong_ingress.audit import AuditOutcome
from qinglong_ingress.directory import AuditEntry, AuditRecord, Directory
from qinglong_ingress.pool import open_ingress_pool
from qinglong_protocol.pooling import PoolSizing

from tests.support.postgres import MigratedDatabase


def _check_values(database: MigratedDatabase) -> set[str]:
    with psycopg.connect(database.urls.migration) as conn:
        row = conn.execute(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
            " WHERE conrelid = 'qinglong.security_audit'::regclass"
            " AND conname = 'security_audit_outcome_check'"
        ).fetchone()
    assert row is not None, "security_audit has no outcome CHECK"
    definition = str(row[0])
    # CHECK ((outcome = ANY (ARRAY['admitted'::text, ...]))): nothing but that list.
    assert re.fullmatch(r"CHECK \(\(outcome = ANY \(ARRAY\[[^\]]*\]\)\)\)", definition), definition
    return set(re.findall(r"'([^']*)'::text", definition))


def test_the_check_allows_exactly_the_enum(database: MigratedDatabase) -> None:
    assert _check_values(database) == {outcome.value for outcome in AuditOutcome}


@pytest.mark.parametrize("outcome", list(AuditOutcome), ids=str)
async def test_every_outcome_is_written_by_the_ingress_role(
    database: MigratedDatabase, outcome: AuditOutcome
) -> None:
    pool = await open_ingress_pool(database.urls.ingress, sizing=PoolSizing(1, 1))
    try:
        audited = await Directory(pool).write_audit(
            AuditEntry(AuditRecord("anonymous", None, "WorkerService/OpenSession", outcome, None))
        )
        audit_id = audited.audit_id
    finally:
        await pool.close()
    with psycopg.connect(database.urls.migration) as conn:
        row = conn.execute(
            "SELECT outcome FROM qinglong.security_audit WHERE audit_id = %s", (audit_id,)
        ).fetchone()
    assert row == (outcome.value,)
    assert isinstance(audit_id, uuid.UUID)


def test_the_admin_api_names_exactly_the_enum() -> None:
    """AdminService's AuditOutcome (the filter and the record) spells the same values."""
    named = {
        name.removeprefix("AUDIT_OUTCOME_").lower()
        for name in admin_pb2.AuditOutcome.keys()  # noqa: SIM118 - an enum wrapper, not a dict
        if name != "AUDIT_OUTCOME_UNSPECIFIED"
    }
    assert named == {outcome.value for outcome in AuditOutcome}
