"""Administration of who exists: projects, principals, credentials and role bindings.

These rows are written by an administrator (here: the migration role, which owns the
schema), never by the runtime or ingress roles. The dev stack and the tests use these
functions to enroll a development Worker and operator.
"""

from __future__ import annotations

import uuid
from typing import Literal

import psycopg

OperatorKind = Literal["user", "agent"]

PROJECT_LOCK = "qinglong.project:"
"""Advisory-lock namespace of a project: binding changes take it exclusively, cancellation
shared, so a cancel decides under a binding that cannot change until it commits."""
ProjectRole = Literal["owner", "admin", "operator", "viewer"]


def ensure_project(conn: psycopg.Connection, project_id: str, display_name: str) -> None:
    conn.execute(
        "INSERT INTO qinglong.projects (project_id, display_name) VALUES (%s, %s)"
        " ON CONFLICT (project_id) DO NOTHING",
        (project_id, display_name),
    )


def ensure_principal(conn: psycopg.Connection, kind: str, name: str) -> uuid.UUID:
    row = conn.execute(
        "INSERT INTO qinglong.principals (principal_id, kind, name) VALUES (%s, %s, %s)"
        " ON CONFLICT (kind, name) DO UPDATE SET kind = EXCLUDED.kind"
        " RETURNING principal_id",
        (uuid.uuid4(), kind, name),
    ).fetchone()
    assert row is not None
    principal_id: uuid.UUID = row[0]
    return principal_id


def enroll_worker(conn: psycopg.Connection, worker_id: str, certificate_uri: str) -> uuid.UUID:
    """Make `worker_id` a known Worker whose client certificate carries `certificate_uri`."""
    principal_id = ensure_principal(conn, "worker", worker_id)
    conn.execute(
        "INSERT INTO qinglong.worker_identities (worker_id, principal_id, certificate_uri)"
        " VALUES (%s, %s, %s)"
        " ON CONFLICT (worker_id) DO UPDATE SET certificate_uri = EXCLUDED.certificate_uri",
        (worker_id, principal_id, certificate_uri),
    )
    return principal_id


def enroll_operator_token(
    conn: psycopg.Connection, name: str, kind: OperatorKind, token_digest: str
) -> uuid.UUID:
    """Register a bearer token for an operator principal. Only the digest is given here."""
    principal_id = ensure_principal(conn, kind, name)
    conn.execute(
        "INSERT INTO qinglong.operator_credentials"
        " (credential_id, principal_id, kind, token_digest)"
        " VALUES (%s, %s, 'bearer_token', %s) ON CONFLICT (token_digest) DO NOTHING",
        (uuid.uuid4(), principal_id, token_digest),
    )
    return principal_id


def enroll_operator_certificate(
    conn: psycopg.Connection, name: str, kind: OperatorKind, certificate_uri: str
) -> uuid.UUID:
    """Register a client-certificate identity (its SAN URI) for an operator principal."""
    principal_id = ensure_principal(conn, kind, name)
    conn.execute(
        "INSERT INTO qinglong.operator_credentials"
        " (credential_id, principal_id, kind, certificate_uri)"
        " VALUES (%s, %s, 'client_certificate', %s) ON CONFLICT (certificate_uri) DO NOTHING",
        (uuid.uuid4(), principal_id, certificate_uri),
    )
    return principal_id


def bind_role(
    conn: psycopg.Connection, project_id: str, principal_id: uuid.UUID, role: ProjectRole
) -> None:
    """Grant `role` in `project_id`; a change advances the binding's version (SPEC R-CAN-3)."""
    with conn.transaction():
        _lock_project(conn, project_id)
        conn.execute(
            "INSERT INTO qinglong.role_bindings (project_id, principal_id, role)"
            " VALUES (%s, %s, %s)"
            " ON CONFLICT (project_id, principal_id) DO UPDATE"
            " SET role = EXCLUDED.role, status = 'active',"
            "     version = qinglong.role_bindings.version + 1,"
            "     updated_at_ms = qinglong.db_now_ms()"
            " WHERE (qinglong.role_bindings.role, qinglong.role_bindings.status)"
            "       IS DISTINCT FROM (EXCLUDED.role, 'active')",
            (project_id, principal_id, role),
        )


def revoke_role(conn: psycopg.Connection, project_id: str, principal_id: uuid.UUID) -> None:
    """Revoke a binding; its version advances, so mutations admitted under it are fenced."""
    with conn.transaction():
        _lock_project(conn, project_id)
        conn.execute(
            "UPDATE qinglong.role_bindings"
            " SET status = 'revoked', version = version + 1, updated_at_ms = qinglong.db_now_ms()"
            " WHERE project_id = %s AND principal_id = %s AND status = 'active'",
            (project_id, principal_id),
        )


def _lock_project(conn: psycopg.Connection, project_id: str) -> None:
    conn.execute(
        "SELECT pg_advisory_xact_lock(hashtextextended(%s || %s, 0))", (PROJECT_LOCK, project_id)
    )
