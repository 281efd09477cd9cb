"""SPEC R-ROLE-1: three roles, proven on a real PostgreSQL by executing as each of them."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import errors, sql

from tests.support.postgres import MigratedDatabase

RUNTIME_OWNED_TABLES = ("runs", "attempts", "run_leases", "run_events", "worker_sessions", "offers")

# The whole privilege matrix. Anything not listed is denied; the test compares the catalog
# against this, so a grant added by a later migration must be added here on purpose.
EXPECTED_TABLE_PRIVILEGES: dict[str, dict[str, set[str]]] = {
    "qinglong_runtime": {
        "projects": {"SELECT"},
        "principals": {"SELECT"},
        "role_bindings": {"SELECT"},
        "worker_identities": {"SELECT"},
        "tasks": {"SELECT", "INSERT"},
        "task_revisions": {"SELECT", "INSERT"},
        "run_events": {"SELECT", "INSERT"},
        "runs": {"SELECT", "INSERT", "UPDATE"},
        "attempts": {"SELECT", "INSERT", "UPDATE"},
        "run_leases": {"SELECT", "INSERT", "UPDATE"},
        "worker_sessions": {"SELECT", "INSERT", "UPDATE"},
        "offers": {"SELECT", "INSERT", "UPDATE"},
    },
    "qinglong_ingress": {
        "security_audit": {"INSERT"},
        "projects": {"SELECT"},
        "principals": {"SELECT"},
        "role_bindings": {"SELECT"},
        "operator_credentials": {"SELECT"},
        "worker_identities": {"SELECT"},
    },
}
TABLE_PRIVILEGES = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER")


def _mutations(table: str) -> list[sql.Composed]:
    # Each statement is one the role would need to change the table; the privilege check
    # happens before any row or constraint is looked at, so no valid row is needed.
    name = sql.Identifier("qinglong", table)
    column = sql.Identifier(_any_column(table))
    return [
        sql.SQL("INSERT INTO {} DEFAULT VALUES").format(name),
        sql.SQL("UPDATE {} SET {} = {}").format(name, column, column),
        sql.SQL("DELETE FROM {}").format(name),
        sql.SQL("TRUNCATE {}").format(name),
    ]


def _any_column(table: str) -> str:
    return {
        "runs": "state",
        "attempts": "state",
        "run_leases": "status",
        "run_events": "payload",
        "worker_sessions": "status",
        "offers": "state",
    }[table]


@pytest.mark.parametrize("table", RUNTIME_OWNED_TABLES)
def test_ingress_role_cannot_mutate_runtime_tables(database: MigratedDatabase, table: str) -> None:
    with psycopg.connect(database.urls.ingress, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("qinglong_ingress",)
        for statement in _mutations(table):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)


def test_ingress_role_cannot_read_runs_or_events(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.ingress, autocommit=True) as conn:
        for table in ("runs", "attempts", "run_leases", "run_events", "offers"):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier("qinglong", table)))
        # Session binding needs four columns of worker_sessions and nothing else.
        conn.execute(
            "SELECT session_id, worker_id, generation, status FROM qinglong.worker_sessions"
        )
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT expires_at_ms FROM qinglong.worker_sessions")


def test_ingress_role_writes_audit_with_database_time(database: MigratedDatabase) -> None:
    audit_id = uuid.uuid4()
    with psycopg.connect(database.urls.ingress, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO qinglong.security_audit (audit_id, principal_kind, principal_id,"
            " operation, outcome) VALUES (%s, 'worker', 'w-1', 'AcknowledgeStarting', 'admitted')",
            (audit_id,),
        )
        # INSERT only: the audit is write-once even for the role that writes it.
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM qinglong.security_audit")
    with psycopg.connect(database.urls.migration) as conn:
        row = conn.execute(
            "SELECT occurred_at_ms, qinglong.db_now_ms() FROM qinglong.security_audit"
            " WHERE audit_id = %s",
            (audit_id,),
        ).fetchone()
    assert row is not None
    occurred_at_ms, now_ms = row
    assert 0 <= now_ms - occurred_at_ms < 60_000


def test_runtime_role_cannot_alter_the_schema(database: MigratedDatabase) -> None:
    ddl = [
        "CREATE TABLE qinglong.smuggled (id int)",
        "CREATE TABLE public.smuggled (id int)",
        "ALTER TABLE qinglong.runs ADD COLUMN smuggled int",
        "ALTER TABLE qinglong.runs DISABLE TRIGGER runs_enforce_transition",
        "DROP TABLE qinglong.run_events",
        "CREATE INDEX smuggled ON qinglong.runs (state)",
        "CREATE FUNCTION qinglong.smuggled() RETURNS int LANGUAGE sql AS 'SELECT 1'",
    ]
    with psycopg.connect(database.urls.runtime, autocommit=True) as conn:
        for statement in ddl:
            with pytest.raises((errors.InsufficientPrivilege, errors.WrongObjectType)):
                conn.execute(statement.encode())
        # A GRANT without grant option is only a warning in PostgreSQL; what matters is
        # that it grants nothing.
        conn.execute("GRANT SELECT ON qinglong.runs TO qinglong_ingress")
        assert conn.execute(
            "SELECT has_table_privilege('qinglong_ingress', 'qinglong.runs', 'SELECT')"
        ).fetchone() == (False,)


def test_runtime_role_cannot_rewrite_history_or_definitions(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.runtime, autocommit=True) as conn:
        for statement in (
            "UPDATE qinglong.run_events SET payload = '{}'",
            "DELETE FROM qinglong.run_events",
            "UPDATE qinglong.task_revisions SET timeout_ms = NULL",
            "DELETE FROM qinglong.runs",
            "INSERT INTO qinglong.security_audit (audit_id, operation, outcome)"
            " VALUES (gen_random_uuid(), 'x', 'admitted')",
            "UPDATE qinglong.role_bindings SET role = 'owner'",
        ):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement.encode())


def test_privilege_matrix_matches_catalog(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.migration) as conn:
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'qinglong' ORDER BY 1"
            )
        ]
        assert {"runs", "attempts", "run_leases", "run_events", "security_audit"} <= set(tables)
        for role, expected in EXPECTED_TABLE_PRIVILEGES.items():
            for table in tables:
                granted = {
                    privilege
                    for privilege in TABLE_PRIVILEGES
                    if conn.execute(
                        "SELECT has_table_privilege(%s, %s, %s)",
                        (role, f"qinglong.{table}", privilege),
                    ).fetchone()
                    == (True,)
                }
                assert granted == expected.get(table, set()), (role, table)
        roles = conn.execute(
            "SELECT rolname, rolsuper, rolcreaterole, rolcreatedb, rolbypassrls FROM pg_roles"
            " WHERE rolname LIKE 'qinglong\\_%%' ORDER BY 1"
        ).fetchall()
    assert [r[0] for r in roles] == ["qinglong_ingress", "qinglong_migration", "qinglong_runtime"]
    assert all(r[1:] == (False, False, False, False) for r in roles)


def test_public_has_no_access(database: MigratedDatabase) -> None:
    stranger = f"stranger_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database.admin_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {stranger} LOGIN".encode())
        try:
            url = psycopg.conninfo.make_conninfo(database.admin_url, user=stranger)
            with pytest.raises(psycopg.OperationalError, match="permission denied"):
                psycopg.connect(url).close()
        finally:
            admin.execute(f"DROP ROLE {stranger}".encode())
