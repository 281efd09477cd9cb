"""Enrollment tooling: idempotent "ensure" writes of projects, principals, credentials
and role bindings, run synchronously as the migration role (which owns the schema).

The dev stack and the tests use these to enroll a development Worker and operators. The
administration API (db/admin.py, the admin role) is the service's way to do the same;
role-binding changes here run its statements (admin.sql), under the same project lock.
"""

from __future__ import annotations

import uuid
from typing import Literal

import psycopg

from qinglong_control.db.admin import LOCK_PROJECT, PROJECT_LOCK, REVOKE_BINDING, UPSERT_BINDING
from qinglong_control.db.sql import SQL

OperatorKind = Literal["user", "agent"]
ProjectRole = Literal["owner", "admin", "operator", "viewer"]

_INSERT_BINDING_ONCE = SQL["admin.insert_binding_once"]


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


def grant_cluster_admin(conn: psycopg.Connection, principal_id: uuid.UUID) -> None:
    """Make an operator principal a cluster admin (it may call AdminService)."""
    conn.execute(
        "INSERT INTO qinglong.cluster_admins (principal_id) VALUES (%s)"
        " ON CONFLICT (principal_id) DO NOTHING",
        (principal_id,),
    )


def bind_role(
    conn: psycopg.Connection, project_id: str, principal_id: uuid.UUID, role: ProjectRole
) -> None:
    """Grant `role` in `project_id`; a change advances the binding's version (SPEC R-CAN-3)."""
    values = {"project_id": project_id, "principal_id": principal_id, "role": role}
    with conn.transaction():
        conn.execute(LOCK_PROJECT, (PROJECT_LOCK, project_id))
        conn.execute(UPSERT_BINDING, values)


def ensure_role(
    conn: psycopg.Connection, project_id: str, principal_id: uuid.UUID, role: ProjectRole
) -> None:
    """Grant `role` in `project_id` unless the principal has a binding there already, in
    any state: what an administrator revoked or changed since stays so."""
    values = {"project_id": project_id, "principal_id": principal_id, "role": role}
    with conn.transaction():
        conn.execute(LOCK_PROJECT, (PROJECT_LOCK, project_id))
        conn.execute(_INSERT_BINDING_ONCE, values)


def revoke_role(conn: psycopg.Connection, project_id: str, principal_id: uuid.UUID) -> None:
    """Revoke a binding; its version advances, so mutations admitted under it are fenced."""
    values = {"project_id": project_id, "principal_id": principal_id}
    with conn.transaction():
        conn.execute(LOCK_PROJECT, (PROJECT_LOCK, project_id))
        conn.execute(REVOKE_BINDING, values)
