"""What ingress may read and write with the worker-ingress role, and nothing more.

Reads: identities, credentials, role bindings, and which worker a session belongs to.
Write: one security-audit row per call. This module cannot change a Run: the role it
connects as has no privilege to (SPEC R-ROLE-1, proven in tests/contract/test_roles.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row
from psycopg_pool import AsyncConnectionPool

from qinglong_ingress.audit import AuditOutcome
from qinglong_ingress.sql import SQL

_WORKER_BY_URI = SQL["directory.worker_by_uri"]

_OPERATOR_BY_URI = SQL["directory.operator_by_uri"]

_OPERATOR_BY_CREDENTIAL_DIGEST = SQL["directory.operator_by_credential_digest"]

_IS_CLUSTER_ADMIN = SQL["directory.is_cluster_admin"]

_SESSION_OWNER = SQL["directory.session_owner"]

_ROLE_BINDING = SQL["directory.role_binding"]

_WRITE_AUDIT = SQL["directory.write_audit"]


@dataclass(frozen=True)
class OperatorRow:
    principal_id: uuid.UUID
    kind: str
    name: str


@dataclass(frozen=True)
class RoleBinding:
    project_version: int
    role: str
    binding_version: int


@dataclass(frozen=True)
class AuditRecord:
    principal_kind: str
    principal_id: str | None
    operation: str
    outcome: AuditOutcome
    reason: str | None
    project_id: str | None = None
    run_id: uuid.UUID | None = None
    worker_id: str | None = None
    session_id: uuid.UUID | None = None
    request_id: str | None = None
    peer: str | None = None


class Directory:
    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        self._pool = pool

    async def worker_by_certificate(self, uri: str) -> str | None:
        async with self._pool.connection() as conn:
            row = await (await conn.execute(_WORKER_BY_URI, (uri,))).fetchone()
        return None if row is None else str(row[0])

    async def operator_by_certificate(self, uri: str) -> OperatorRow | None:
        return await self._operator(_OPERATOR_BY_URI, uri)

    async def operator_by_token_digest(self, digest: str) -> OperatorRow | None:
        return await self._operator(_OPERATOR_BY_CREDENTIAL_DIGEST, digest)

    async def is_cluster_admin(self, principal_id: uuid.UUID) -> bool:
        """Whether the (already authenticated, active) principal may administer the cluster."""
        async with self._pool.connection() as conn:
            row = await (await conn.execute(_IS_CLUSTER_ADMIN, (principal_id,))).fetchone()
        return bool(row is not None and row[0])

    async def session_owner(self, session_id: uuid.UUID) -> str | None:
        async with self._pool.connection() as conn:
            row = await (await conn.execute(_SESSION_OWNER, (session_id,))).fetchone()
        return None if row is None else str(row[0])

    async def role_binding(self, project_id: str, principal_id: uuid.UUID) -> RoleBinding | None:
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=kwargs_row(RoleBinding))
            await cursor.execute(_ROLE_BINDING, (project_id, principal_id))
            return await cursor.fetchone()

    async def write_audit(self, record: AuditRecord) -> uuid.UUID:
        """Commit one audit row (autocommit: durable when this returns)."""
        audit_id = uuid.uuid4()
        async with self._pool.connection() as conn:
            await conn.execute(
                _WRITE_AUDIT,
                {"audit_id": audit_id, **record.__dict__, "outcome": record.outcome.value},
            )
        return audit_id

    async def _operator(self, query: Any, key: str) -> OperatorRow | None:
        async with self._pool.connection() as conn:
            cursor = conn.cursor(row_factory=kwargs_row(OperatorRow))
            await cursor.execute(query, (key,))
            return await cursor.fetchone()
