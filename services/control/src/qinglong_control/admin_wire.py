"""AdminService on the wire ⇄ administration's rows: conversion only.

Requests arrive within the contract's field rules (contract_bounds.py), so parsing only
converts: UUID text to UUIDs, enums to the database's names, optional fields to None. A
page token this server never issued is refused here (paging.py). Answers carry DB-time
timestamps; a secret appears only in the one response that created it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import Message
from qinglong.admin.v1 import admin_pb2, admin_service_pb2
from qinglong.runtime.v1 import caller_pb2

from qinglong_control import paging, wire
from qinglong_control.db.admin import Page
from qinglong_control.domain.administration import (
    ACTIVE,
    AuditFilter,
    AuditRow,
    BindingRow,
    PrincipalRow,
    ProjectRow,
    TokenRow,
    WorkerRow,
)

KINDS = {
    admin_pb2.PRINCIPAL_KIND_USER: "user",
    admin_pb2.PRINCIPAL_KIND_AGENT: "agent",
    admin_pb2.PRINCIPAL_KIND_WORKER: "worker",
}
KIND_VALUES = {name: value for value, name in KINDS.items()}
ROLES = {
    admin_pb2.PROJECT_ROLE_OWNER: "owner",
    admin_pb2.PROJECT_ROLE_ADMIN: "admin",
    admin_pb2.PROJECT_ROLE_OPERATOR: "operator",
    admin_pb2.PROJECT_ROLE_VIEWER: "viewer",
}
ROLE_VALUES = {name: value for value, name in ROLES.items()}

Row = TypeVar("Row")


def admin_of(caller: caller_pb2.Caller) -> uuid.UUID:
    """The caller's principal id, unless the envelope is not an operator principal's with
    one (ingress admitted it as a cluster admin; control checks that again, in the
    database)."""
    wire.operator_of(caller)
    return wire.caller_principal_id(caller)


# --- requests ----------------------------------------------------------------------------


def optional(message: Message, field: str) -> Any:
    """An ``optional`` field's value, or None when the caller left it out."""
    return getattr(message, field) if message.HasField(field) else None


def principal_kinds(kind: admin_pb2.PrincipalKind.ValueType) -> tuple[str, ...]:
    """ListPrincipals' filter: one kind, or (UNSPECIFIED) every kind the wire knows."""
    return (KINDS[kind],) if kind in KINDS else tuple(KINDS.values())


_OUTCOME_PREFIX = "AUDIT_OUTCOME_"


def _outcome_name(outcome: admin_pb2.AuditOutcome.ValueType) -> str | None:
    """The audit table's spelling of an outcome (``permission_denied``); None: no filter."""
    if outcome == admin_pb2.AUDIT_OUTCOME_UNSPECIFIED:
        return None
    return admin_pb2.AuditOutcome.Name(outcome).removeprefix(_OUTCOME_PREFIX).lower()


def audit_filter(request: admin_service_pb2.ListAuditRecordsRequest) -> AuditFilter:
    return AuditFilter(
        principal_id=request.principal_id or None,
        operation=request.operation or None,
        outcome=_outcome_name(request.outcome),
        start_ms=request.start_time.ToMilliseconds() if request.HasField("start_time") else None,
        end_ms=request.end_time.ToMilliseconds() if request.HasField("end_time") else None,
    )


def next_page_token(page: Page[Row], key: Callable[[Row], Sequence[object]]) -> str:
    """The token of the page after ``page`` ("" on the last page): its last row's key."""
    return paging.page_token(key(page.rows[-1]) if page.more and page.rows else None)


def project_key(row: ProjectRow) -> tuple[int, str]:
    return row.created_at_ms, row.project_id


def principal_key(row: PrincipalRow) -> tuple[int, uuid.UUID]:
    return row.created_at_ms, row.principal_id


def worker_key(row: WorkerRow) -> tuple[str]:
    return (row.worker_id,)


def audit_key(row: AuditRow) -> tuple[int, uuid.UUID]:
    return row.occurred_at_ms, row.audit_id


# --- answers -----------------------------------------------------------------------------


def state(status: str) -> admin_pb2.ResourceState.ValueType:
    """Every identity table's ``active`` is ACTIVE; archived, disabled, revoked are DISABLED."""
    return (
        admin_pb2.RESOURCE_STATE_ACTIVE if status == ACTIVE else admin_pb2.RESOURCE_STATE_DISABLED
    )


def project(row: ProjectRow) -> admin_pb2.Project:
    return admin_pb2.Project(
        project_id=row.project_id,
        display_name=row.display_name,
        state=state(row.status),
        version=row.version,
        created_at=wire.timestamp(row.created_at_ms),
    )


def principal(row: PrincipalRow) -> admin_pb2.Principal:
    return admin_pb2.Principal(
        principal_id=str(row.principal_id),
        kind=KIND_VALUES.get(row.kind, admin_pb2.PRINCIPAL_KIND_UNSPECIFIED),
        name=row.name,
        state=state(row.status),
        cluster_admin=row.cluster_admin,
        created_at=wire.timestamp(row.created_at_ms),
    )


def token(row: TokenRow) -> admin_pb2.OperatorToken:
    message = admin_pb2.OperatorToken(
        token_id=str(row.token_id),
        principal_id=str(row.principal_id),
        prefix=row.prefix or "",
        state=state(row.status),
        created_at=wire.timestamp(row.created_at_ms),
    )
    if row.expires_at_ms is not None:
        message.expire_time.CopyFrom(wire.timestamp(row.expires_at_ms))
    if row.last_used_at_ms is not None:
        message.last_used_time.CopyFrom(wire.timestamp(row.last_used_at_ms))
    return message


def binding(row: BindingRow) -> admin_pb2.RoleBinding:
    return admin_pb2.RoleBinding(
        project_id=row.project_id,
        principal_id=str(row.principal_id),
        role=ROLE_VALUES[row.role],
        state=state(row.status),
        version=row.version,
        update_time=wire.timestamp(row.updated_at_ms),
        principal_name=row.principal_name,
    )


def worker(row: WorkerRow) -> admin_pb2.Worker:
    message = admin_pb2.Worker(
        worker_id=row.worker_id,
        principal_id=str(row.principal_id),
        state=state(row.status),
        created_at=wire.timestamp(row.created_at_ms),
        live_attempts=row.live_attempts,
        session_count=row.session_count,
        project_ids=row.project_ids or (),
        cordoned=row.cordoned,
    )
    session = row.session
    if session is not None:
        message.session.CopyFrom(
            admin_pb2.WorkerSession(
                session_id=str(session.session_id),
                state=session.state,
                generation=session.generation,
                renew_time=wire.timestamp(session.renewed_at_ms),
                remaining=wire.duration(session.remaining_ms),
                agent_version=session.agent_version,
                executor_types=[wire.EXECUTOR_TYPE_VALUES[t] for t in session.executor_types],
                max_concurrent_attempts=session.max_concurrency,
                passes_run_parameters=session.passes_run_parameters,
                labels=session.labels,
            )
        )
    return message


def audit_record(row: AuditRow) -> admin_pb2.AuditRecord:
    return admin_pb2.AuditRecord(
        audit_id=str(row.audit_id),
        occur_time=wire.timestamp(row.occurred_at_ms),
        principal_kind=row.principal_kind or "",
        principal_id=row.principal_id or "",
        operation=row.operation,
        outcome=admin_pb2.AuditOutcome.Value(_OUTCOME_PREFIX + row.outcome.upper()),
        reason=row.reason or "",
        project_id=row.project_id or "",
        run_id="" if row.run_id is None else str(row.run_id),
        worker_id=row.worker_id or "",
        peer=row.peer or "",
        principal_name=row.principal_name or "",
    )
