"""What ingress may read and write with the worker-ingress role, and nothing more.

Reads: identities, credentials, role bindings, and which worker a session belongs to.
Write: one security-audit row per call. This module cannot change a Run: the role it
connects as has no privilege to (SPEC R-ROLE-1, proven in tests/contract/test_roles.py).

A Worker's call costs one round trip (R-PERF-1): its audit row goes with the other calls'
of the moment in one statement and one commit (group_commit.py), and that statement also
checks the Worker's certificate identity and session binding (a :class:`WorkerClaim`).
Nothing is cached: a disabled Worker is refused by the next statement.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Final

import psycopg
from psycopg import AsyncConnection
from psycopg.rows import kwargs_row
from psycopg_pool import AsyncConnectionPool
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.errors import reason_name
from qinglong_protocol.pooling import read_retrying

from qinglong_ingress.audit import AuditOutcome, refused_outcome
from qinglong_ingress.group_commit import GroupCommit
from qinglong_ingress.metrics import AUDIT_BATCH_ROWS, timed_audit_write
from qinglong_ingress.sql import SQL

_OPERATOR_BY_URI = SQL["directory.operator_by_uri"]

_OPERATOR_BY_CREDENTIAL_DIGEST = SQL["directory.operator_by_credential_digest"]

_IS_CLUSTER_ADMIN = SQL["directory.is_cluster_admin"]

_ROLE_BINDING = SQL["directory.role_binding"]

_WRITE_AUDITS = SQL["directory.write_audits"]

_WRITE_AUDIT = SQL["directory.write_audit"]


class ClaimRefusal(IntEnum):
    """Why the audit statement refused a Worker's claim (the statement's numbers)."""

    UNENROLLED = 1
    """The certificate names no enrolled, active Worker."""
    OTHER_WORKER = 2
    """The request names another Worker than the certificate."""
    OTHER_SESSION = 3
    """The request names a session of another Worker (or none that exists)."""


#: The reason each claim refusal is answered and audited with.
CLAIM_REFUSAL_REASONS: Final[Mapping[ClaimRefusal, ErrorReason.ValueType]] = {
    ClaimRefusal.UNENROLLED: ErrorReason.ERROR_REASON_UNAUTHENTICATED_PRINCIPAL,
    ClaimRefusal.OTHER_WORKER: ErrorReason.ERROR_REASON_PRINCIPAL_MISMATCH,
    ClaimRefusal.OTHER_SESSION: ErrorReason.ERROR_REASON_PRINCIPAL_MISMATCH,
}


_ORDERED_REFUSALS = sorted(ClaimRefusal)
# The statement indexes the arrays below by refusal number (PostgreSQL arrays count from 1).
if [r.value for r in _ORDERED_REFUSALS] != list(range(1, len(_ORDERED_REFUSALS) + 1)):
    raise ValueError("ClaimRefusal must number its members 1..n")
_REFUSED_OUTCOME: Final = [
    refused_outcome(CLAIM_REFUSAL_REASONS[r]).value for r in _ORDERED_REFUSALS
]
_REFUSED_REASON: Final = [reason_name(CLAIM_REFUSAL_REASONS[r]) for r in _ORDERED_REFUSALS]


@dataclass(frozen=True)
class OperatorRow:
    principal_id: uuid.UUID
    kind: str
    name: str
    credential_id: uuid.UUID
    """The credential that matched (a bearer token's id, or an operator certificate's)."""


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
    credential_id: uuid.UUID | None = None
    """The bearer token that authenticated the call (its id, never the token); None for
    any other caller. A token's last use (ListTokens) is read from these rows."""


@dataclass(frozen=True)
class WorkerClaim:
    """A Worker's call, to be checked by the statement that audits it: the certificate's
    SAN URI must name an enrolled, active Worker, and the record's worker_id and
    session_id must be that Worker's."""

    certificate_uri: str


@dataclass(frozen=True)
class AuditEntry:
    record: AuditRecord
    claim: WorkerClaim | None = None


@dataclass(frozen=True)
class Audited:
    """A durable audit row, and whether the statement refused the call's claim."""

    audit_id: uuid.UUID
    refusal: ClaimRefusal | None
    worker_id: str | None = None
    """For a Worker's call: the Worker its certificate names (None if unenrolled)."""


class Directory:
    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        write_timeout_seconds: float | None = None,
    ) -> None:
        """``write_timeout_seconds`` bounds a batch of audit rows: a server that stopped
        answering (a hung backend, its kernel still acknowledging) would otherwise hold
        the batch's writer, one of two, for ever. The caller of each row gives up sooner,
        at its own storage bound; this frees the writer and its connection."""
        self._pool = pool
        self._write_timeout = write_timeout_seconds
        self._audits = GroupCommit[AuditEntry, Audited](
            self._write_audits, isolate=_one_row_may_cause
        )

    async def operator_by_certificate(self, uri: str) -> OperatorRow | None:
        return await self._operator(_OPERATOR_BY_URI, uri)

    async def operator_by_token_digest(self, digest: str) -> OperatorRow | None:
        return await self._operator(_OPERATOR_BY_CREDENTIAL_DIGEST, digest)

    async def is_cluster_admin(self, principal_id: uuid.UUID) -> bool:
        """Whether the (already authenticated, active) principal may administer the cluster."""

        async def read(conn: AsyncConnection[Any]) -> bool:
            row = await (await conn.execute(_IS_CLUSTER_ADMIN, (principal_id,))).fetchone()
            return bool(row is not None and row[0])

        return await read_retrying(self._pool, read)

    async def role_binding(self, project_id: str, principal_id: uuid.UUID) -> RoleBinding | None:
        async def read(conn: AsyncConnection[Any]) -> RoleBinding | None:
            cursor = conn.cursor(row_factory=kwargs_row(RoleBinding))
            await cursor.execute(_ROLE_BINDING, (project_id, principal_id))
            return await cursor.fetchone()

        return await read_retrying(self._pool, read)

    @property
    def audits_waiting(self) -> int:
        """Audit rows waiting for a free writer."""
        return self._audits.waiting

    @property
    def audits_unwritten(self) -> int:
        """Audit rows handed to the group commit and not yet written."""
        return self._audits.unwritten

    async def write_audit(self, entry: AuditEntry) -> Audited:
        """The entry's row, durable when this returns (it shares its statement and commit
        with the concurrent calls' rows). Raises what the batch's statement raised."""
        return await self._audits.submit(entry)

    @timed_audit_write  # metrics: audit write latency
    async def write_audit_alone(self, record: AuditRecord) -> uuid.UUID:
        """One row in its own statement that reads nothing: for when the batched
        statement failed and the failure may be one of its reads."""
        audit_id = uuid.uuid4()
        async with self._pool.connection() as conn:
            await conn.execute(
                _WRITE_AUDIT,
                {"audit_id": audit_id, **record.__dict__, "outcome": record.outcome.value},
            )
        return audit_id

    @timed_audit_write  # metrics: audit write latency
    async def _write_audits(self, entries: Sequence[AuditEntry]) -> list[Audited]:
        AUDIT_BATCH_ROWS.observe(len(entries))  # metrics: rows per group commit
        ids = [uuid.uuid4() for _ in entries]
        calls = json.dumps([_audit_row(i, entry) for i, entry in zip(ids, entries, strict=True)])
        values = {
            "calls": calls,
            "refused_outcome": _REFUSED_OUTCOME,
            "refused_reason": _REFUSED_REASON,
        }
        try:
            async with asyncio.timeout(self._write_timeout):
                async with self._pool.connection() as conn:
                    rows = await (await conn.execute(_WRITE_AUDITS, values)).fetchall()
        except TimeoutError:
            # psycopg cancelled the statement or closed the connection: it is not reused.
            raise psycopg.OperationalError("the audit write outlasted the storage bound") from None
        found = {row[0]: (_claim_refusal(row[1]), row[2]) for row in rows}
        return [Audited(audit_id, *found[audit_id]) for audit_id in ids]

    async def _operator(self, query: Any, key: str) -> OperatorRow | None:
        async def read(conn: AsyncConnection[Any]) -> OperatorRow | None:
            cursor = conn.cursor(row_factory=kwargs_row(OperatorRow))
            await cursor.execute(query, (key,))
            return await cursor.fetchone()

        return await read_retrying(self._pool, read)


def _claim_refusal(number: int | None) -> ClaimRefusal | None:
    return None if number is None else ClaimRefusal(number)


def _audit_row(audit_id: uuid.UUID, entry: AuditEntry) -> dict[str, str | None]:
    """One element of the audit statement's JSON array."""
    record = entry.record
    return {
        "audit_id": str(audit_id),
        "principal_kind": record.principal_kind,
        "principal_id": record.principal_id,
        "operation": record.operation,
        "outcome": record.outcome.value,
        "reason": record.reason,
        "project_id": record.project_id,
        "run_id": None if record.run_id is None else str(record.run_id),
        "worker_id": record.worker_id,
        "session_id": None if record.session_id is None else str(record.session_id),
        "request_id": record.request_id,
        "peer": record.peer,
        "certificate_uri": None if entry.claim is None else entry.claim.certificate_uri,
        "credential_id": None if record.credential_id is None else str(record.credential_id),
    }


def _one_row_may_cause(error: BaseException) -> bool:
    """A batch that failed for something a row can cause (a CHECK, a duplicate key) is
    written row by row; a connection or server failure fails the batch's calls."""
    return isinstance(error, psycopg.Error) and not isinstance(error, psycopg.OperationalError)
