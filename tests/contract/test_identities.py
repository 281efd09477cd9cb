"""Administrative enrollment: idempotent, and a role change advances the binding version."""

from __future__ import annotations

import psycopg
from qinglong_control.db.identities import (
    bind_role,
    enroll_operator_token,
    enroll_worker,
    ensure_project,
)

from tests.support.postgres import MigratedDatabase
from tests.support.seed import digest


def test_enrollment_is_idempotent_and_binding_versions_advance(
    database: MigratedDatabase,
) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as conn:
        ensure_project(conn, "proj-a", "Project A")
        ensure_project(conn, "proj-a", "Project A")
        worker = enroll_worker(conn, "worker-1", "spiffe://qinglong.local/worker/worker-1")
        assert enroll_worker(conn, "worker-1", "spiffe://qinglong.local/worker/worker-1") == worker
        alice = enroll_operator_token(conn, "alice", "user", digest("qlo1_secret"))
        assert enroll_operator_token(conn, "alice", "user", digest("qlo1_secret")) == alice

        bind_role(conn, "proj-a", alice, "operator")
        bind_role(conn, "proj-a", alice, "operator")
        first = conn.execute(
            "SELECT role, version FROM qinglong.role_bindings WHERE principal_id = %s", (alice,)
        ).fetchone()
        bind_role(conn, "proj-a", alice, "viewer")
        second = conn.execute(
            "SELECT role, version FROM qinglong.role_bindings WHERE principal_id = %s", (alice,)
        ).fetchone()
        counts = conn.execute(
            "SELECT (SELECT count(*) FROM qinglong.principals),"
            " (SELECT count(*) FROM qinglong.operator_credentials),"
            " (SELECT count(*) FROM qinglong.worker_identities)"
        ).fetchone()
    assert first == ("operator", 1)
    assert second == ("viewer", 2)
    assert counts == (2, 1, 1)
