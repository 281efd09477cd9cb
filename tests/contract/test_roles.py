"""SPEC R-ROLE-1 and docs/decisions/0002: four roles, proven on a real PostgreSQL by
executing as each of them."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import errors, sql

from tests.support.postgres import MigratedDatabase

RUNTIME_OWNED_TABLES = (
    "runs",
    "attempts",
    "run_leases",
    "run_events",
    "worker_sessions",
    "offers",
    "attempt_output",
    "attempt_output_chunks",
)
#: What only an administrator writes (the admin role; the migration role owns them).
IDENTITY_TABLES = (
    "projects",
    "principals",
    "operator_credentials",
    "role_bindings",
    "worker_identities",
    "worker_join_tokens",
    "cluster_admins",
)
#: Everything else the admin role must not write: the runtime's tables, the audit,
#: definitions.
NOT_ADMINS = (*RUNTIME_OWNED_TABLES, "security_audit", "tasks", "task_revisions")

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
        "approval_requests": {"SELECT", "INSERT", "UPDATE"},
        # Run output (migration 0010): retention deletes chunks, the one DELETE it has.
        "attempt_output": {"SELECT", "INSERT", "UPDATE"},
        "attempt_output_chunks": {"SELECT", "INSERT", "DELETE"},
        # Locked FOR KEY SHARE by a command that wrote nothing (migration 0028); a row
        # lock needs UPDATE of a column: below.
        "commit_barrier": {"SELECT"},
    },
    "qinglong_ingress": {
        # security_audit: INSERT on every column but its time (migration 0015), a column
        # grant, which this table-level matrix does not show: test_audit_retention.py.
        "projects": {"SELECT"},
        "principals": {"SELECT"},
        "role_bindings": {"SELECT"},
        "operator_credentials": {"SELECT"},
        "worker_identities": {"SELECT"},
        "cluster_admins": {"SELECT"},
    },
    "qinglong_admin": {
        # UPDATE only of the columns administration changes (migration 0026): below.
        **{table: {"SELECT", "INSERT"} for table in IDENTITY_TABLES},
        "worker_sessions": {"SELECT"},
        "attempts": {"SELECT"},
        "security_audit": {"SELECT"},
        "commit_barrier": {"SELECT"},
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
        "attempt_output": "end_offset",
        "attempt_output_chunks": "data",
        "security_audit": "outcome",
        "tasks": "display_name",
        "task_revisions": "timeout_ms",
        "projects": "display_name",
        "principals": "name",
        "operator_credentials": "status",
        "role_bindings": "role",
        "worker_identities": "status",
        "worker_join_tokens": "used_at_ms",
        "cluster_admins": "granted_at_ms",
    }[table]


@pytest.mark.parametrize("table", RUNTIME_OWNED_TABLES)
def test_ingress_role_cannot_mutate_runtime_tables(database: MigratedDatabase, table: str) -> None:
    with psycopg.connect(database.urls.ingress, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("qinglong_ingress",)
        for statement in _mutations(table):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)


@pytest.mark.parametrize("table", IDENTITY_TABLES)
def test_ingress_role_cannot_write_identity(database: MigratedDatabase, table: str) -> None:
    """Ingress reads who exists; it can never change it (the new tables included)."""
    with psycopg.connect(database.urls.ingress, autocommit=True) as conn:
        for statement in _mutations(table):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)


@pytest.mark.parametrize("table", NOT_ADMINS)
def test_admin_role_cannot_write_outside_identity(database: MigratedDatabase, table: str) -> None:
    """A compromised admin handler cannot touch a Run, a lease, an Event, a session, an
    offer, a definition or the audit (docs/decisions/0002)."""
    with psycopg.connect(database.urls.admin, autocommit=True) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("qinglong_admin",)
        for statement in _mutations(table):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)


@pytest.mark.parametrize("table", IDENTITY_TABLES)
def test_admin_role_never_deletes_identity(database: MigratedDatabase, table: str) -> None:
    """Identity is disabled or revoked, never erased: the record stays for the audit."""
    _insert, _update, delete, truncate = _mutations(table)
    with psycopg.connect(database.urls.admin, autocommit=True) as conn:
        for statement in (delete, truncate):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement)


def test_admin_role_writes_every_identity_table(database: MigratedDatabase) -> None:
    """The grants are enough for administration: one real row in each table, changed."""
    principal, worker_principal = uuid.uuid4(), uuid.uuid4()
    token = uuid.uuid4()
    statements: list[tuple[str, tuple[object, ...]]] = [
        ("INSERT INTO qinglong.projects (project_id, display_name) VALUES ('p-1', 'P')", ()),
        ("UPDATE qinglong.projects SET status = 'archived' WHERE project_id = 'p-1'", ()),
        (
            "INSERT INTO qinglong.principals (principal_id, kind, name) VALUES (%s, 'user', 'u')",
            (principal,),
        ),
        (
            "UPDATE qinglong.principals SET status = 'disabled' WHERE principal_id = %s",
            (principal,),
        ),
        ("INSERT INTO qinglong.cluster_admins (principal_id) VALUES (%s)", (principal,)),
        (
            "INSERT INTO qinglong.operator_credentials (credential_id, principal_id, kind,"
            " token_digest) VALUES (%s, %s, 'bearer_token', repeat('a', 64))",
            (token, principal),
        ),
        (
            "UPDATE qinglong.operator_credentials SET status = 'revoked' WHERE credential_id = %s",
            (token,),
        ),
        (
            "INSERT INTO qinglong.role_bindings (project_id, principal_id, role)"
            " VALUES ('p-1', %s, 'viewer')",
            (principal,),
        ),
        (
            "UPDATE qinglong.role_bindings SET status = 'revoked' WHERE principal_id = %s",
            (principal,),
        ),
        (
            "INSERT INTO qinglong.principals (principal_id, kind, name) VALUES (%s, 'worker', 'w')",
            (worker_principal,),
        ),
        (
            "INSERT INTO qinglong.worker_identities (worker_id, principal_id, certificate_uri)"
            " VALUES ('w', %s, 'spiffe://qinglong.local/worker/w')",
            (worker_principal,),
        ),
        ("UPDATE qinglong.worker_identities SET status = 'disabled' WHERE worker_id = 'w'", ()),
        (
            "INSERT INTO qinglong.worker_join_tokens (token_digest, worker_id, expires_at_ms)"
            " VALUES (repeat('b', 64), 'w', qinglong.db_now_ms() + 60000)",
            (),
        ),
        (
            "UPDATE qinglong.worker_join_tokens SET used_at_ms = qinglong.db_now_ms()"
            " WHERE worker_id = 'w'",
            (),
        ),
    ]
    with psycopg.connect(database.urls.admin, autocommit=True) as conn:
        for statement, params in statements:
            assert conn.execute(statement.encode(), params).rowcount == 1, statement
        # And it reads what the fleet and audit views need.
        for table in ("worker_sessions", "attempts", "security_audit"):
            conn.execute(sql.SQL("SELECT * FROM {}").format(sql.Identifier("qinglong", table)))
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM qinglong.runs")


def test_a_join_token_is_used_once(database: MigratedDatabase) -> None:
    """Single use is the database's rule, whoever writes."""
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO qinglong.principals (principal_id, kind, name)"
            " VALUES (gen_random_uuid(), 'worker', 'w')"
        )
        conn.execute(
            "INSERT INTO qinglong.worker_identities (worker_id, principal_id, certificate_uri)"
            " SELECT 'w', principal_id, 'spiffe://x/worker/w' FROM qinglong.principals"
        )
        conn.execute(
            "INSERT INTO qinglong.worker_join_tokens (token_digest, worker_id, expires_at_ms)"
            " VALUES (repeat('c', 64), 'w', qinglong.db_now_ms() + 60000)"
        )
        used = "UPDATE qinglong.worker_join_tokens SET used_at_ms = qinglong.db_now_ms()"
        conn.execute(used)
        for again in (used, "UPDATE qinglong.worker_join_tokens SET expires_at_ms = 1"):
            with pytest.raises(errors.CheckViolation) as refused:
                conn.execute(again.encode())
            assert refused.value.diag.constraint_name == "worker_join_tokens_single_use"


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
        # Nor may it date a row (migration 0015): retention goes by a row's time, so a row
        # dated in the future would never be removed, one in the past removed too soon.
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(
                "INSERT INTO qinglong.security_audit (audit_id, occurred_at_ms, operation,"
                " outcome) VALUES (%s, 1, 'test.backdated', 'admitted')",
                (uuid.uuid4(),),
            )
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
            # Retention deletes output chunks; a stream row (its end) stays for good.
            "DELETE FROM qinglong.attempt_output",
            "UPDATE qinglong.attempt_output_chunks SET data = 'x'",
            "INSERT INTO qinglong.security_audit (audit_id, operation, outcome)"
            " VALUES (gen_random_uuid(), 'x', 'admitted')",
            "UPDATE qinglong.role_bindings SET role = 'owner'",
        ):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(statement.encode())


#: Grants of single columns, where the role lacks the table-wide privilege (which the
#: matrix above cannot show): anything not listed is denied.
EXPECTED_COLUMN_ONLY_GRANTS: dict[tuple[str, str, str], str] = {
    # Authentication reads who holds a session, nothing else of it (migration 0001).
    ("qinglong_ingress", "worker_sessions", "SELECT"): "session_id worker_id generation status",
    # Every audit column but its time, which is DB time (migration 0015); the token a
    # call was authenticated by (0022).
    ("qinglong_ingress", "security_audit", "INSERT"): (
        "audit_id principal_kind principal_id operation outcome reason project_id run_id"
        " worker_id session_id request_id peer credential_id"
    ),
    # The admin role changes only what administration decides (migration 0026).
    ("qinglong_admin", "projects", "UPDATE"): "status version",
    ("qinglong_admin", "principals", "UPDATE"): "status",
    ("qinglong_admin", "operator_credentials", "UPDATE"): "status expires_at_ms",
    ("qinglong_admin", "role_bindings", "UPDATE"): "role status version updated_at_ms",
    ("qinglong_admin", "worker_identities", "UPDATE"): "status project_ids cordoned",
    # A token is spent for a key, by an audited call (0029).
    ("qinglong_admin", "worker_join_tokens", "UPDATE"): (
        "used_at_ms used_key_sha256 used_by_audit_id"
    ),
    # What a FOR KEY SHARE lock of the barrier row needs (migration 0028): its one text.
    ("qinglong_runtime", "commit_barrier", "UPDATE"): "purpose",
    ("qinglong_admin", "commit_barrier", "UPDATE"): "purpose",
}


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("worker_identities", "certificate_uri"),
        ("worker_identities", "principal_id"),
        ("principals", "kind"),
        ("principals", "name"),
        ("operator_credentials", "token_digest"),
        ("operator_credentials", "principal_id"),
        ("cluster_admins", "principal_id"),
        ("worker_join_tokens", "expires_at_ms"),
        ("projects", "display_name"),
    ],
)
def test_admin_role_cannot_rewrite_what_administration_never_changes(
    database: MigratedDatabase, table: str, column: str
) -> None:
    """A Worker's certificate name, who a principal is, a token's digest, who is a
    cluster admin: the admin role's credentials cannot rewrite them (0026)."""
    name, target = sql.Identifier("qinglong", table), sql.Identifier(column)
    with (
        psycopg.connect(database.urls.admin, autocommit=True) as conn,
        pytest.raises(errors.InsufficientPrivilege),
    ):
        conn.execute(sql.SQL("UPDATE {} SET {} = {}").format(name, target, target))


def test_column_grants_match_catalog(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.migration) as conn:
        rows = conn.execute(
            "SELECT grantee, table_name, privilege_type, column_name"
            "  FROM information_schema.column_privileges"
            " WHERE table_schema = 'qinglong' AND grantee LIKE 'qinglong\\_%%'"
            "   AND NOT has_table_privilege(grantee, 'qinglong.' || table_name, privilege_type)"
        ).fetchall()
    granted: dict[tuple[str, str, str], set[str]] = {}
    for grantee, table, privilege, column in rows:
        granted.setdefault((grantee, table, privilege), set()).add(column)
    assert granted == {
        key: set(columns.split()) for key, columns in EXPECTED_COLUMN_ONLY_GRANTS.items()
    }


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
    assert [r[0] for r in roles] == [
        "qinglong_admin",
        "qinglong_ingress",
        "qinglong_migration",
        "qinglong_runtime",
    ]
    assert all(r[1:] == (False, False, False, False) for r in roles)


#: Who may call each function of the schema besides its owner (the migration role). As with
#: tables, anything not listed is denied — PUBLIC included — and the test compares the
#: catalog against this: EXECUTE on a SECURITY DEFINER function would reach past every
#: table privilege above.
EXPECTED_FUNCTION_CALLERS: dict[str, set[str]] = {
    "db_now_ms": {"qinglong_runtime", "qinglong_ingress", "qinglong_admin"},
    "lock_authority": {"qinglong_runtime"},
    "prune_security_audit": {"qinglong_runtime"},
    "schema_version": {"qinglong_runtime", "qinglong_ingress"},
    "task_max_concurrent_runs": {"qinglong_runtime"},
    "task_slots_held": {"qinglong_runtime"},
}
#: The functions that run with their owner's rights; each is closed to all but its callers.
SECURITY_DEFINER_FUNCTIONS = {"prune_security_audit", "schema_version"}
CALLERS = ("qinglong_runtime", "qinglong_ingress", "qinglong_admin", "public")


def _callers(conn: psycopg.Connection[tuple[object, ...]], function: int) -> set[str]:
    return {
        role
        for role in CALLERS
        if conn.execute(
            "SELECT has_function_privilege(%s, %s::oid, 'EXECUTE')", (role, function)
        ).fetchone()
        == (True,)
    }


def test_function_callers_match_catalog(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.migration) as conn:
        functions = conn.execute(
            "SELECT p.oid, p.proname, p.prosecdef FROM pg_proc p"
            "  JOIN pg_namespace n ON n.oid = p.pronamespace"
            " WHERE n.nspname = 'qinglong' ORDER BY p.proname"
        ).fetchall()
        assert {"db_now_ms", "lock_authority", "enforce_run_transition"} <= {
            name for _, name, _ in functions
        }
        for oid, name, _ in functions:
            assert _callers(conn, oid) == EXPECTED_FUNCTION_CALLERS.get(name, set()), name
    assert {name for _, name, definer in functions if definer} == SECURITY_DEFINER_FUNCTIONS


def test_a_function_a_later_migration_makes_starts_closed(database: MigratedDatabase) -> None:
    with psycopg.connect(database.urls.migration) as conn:
        made = conn.execute(
            "CREATE FUNCTION qinglong.added_later() RETURNS int"
            " LANGUAGE sql SECURITY DEFINER AS 'SELECT 1'"
        )
        assert made.statusmessage == "CREATE FUNCTION"
        oid = conn.execute("SELECT 'qinglong.added_later()'::regprocedure::oid").fetchone()
        assert oid is not None
        assert _callers(conn, oid[0]) == set()
        conn.rollback()


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


def test_only_the_services_that_serialize_with_them_take_advisory_locks(
    database: MigratedDatabase,
) -> None:
    """Control serializes its commands with advisory locks; the ingress role (which faces
    the Internet) could hold one and freeze an Attempt, a Worker or a migration without
    changing a row. It may take none; the runtime, admin and migration roles may."""
    taking = (
        "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.attempt:x', 0))",
        "SELECT pg_advisory_lock(1)",
        "SELECT pg_try_advisory_lock_shared(1)",
        "SELECT pg_advisory_unlock_all()",
    )
    with psycopg.connect(database.urls.ingress, autocommit=True) as ingress:
        for statement in taking:
            with pytest.raises(errors.InsufficientPrivilege):
                ingress.execute(statement.encode())
    both = "SELECT pg_try_advisory_lock(1), pg_advisory_unlock(1)"
    for url in (database.urls.runtime, database.urls.admin, database.urls.migration):
        with psycopg.connect(url, autocommit=True) as conn:
            assert conn.execute(both).fetchone() == (True, True)
