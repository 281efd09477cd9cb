"""Administration's transactions, as the admin role (docs/decisions/0002).

Each command is one transaction of at most two round trips, like every runtime command:
locks and reads first (a create serialises on its kind's lock, a binding change on the
project's lock, a token change on the token's row, a new join token on its Worker's row),
then the decision
(domain/administration.py), then writes and COMMIT. Secrets are made here only when a
row is really created; the database receives their digests, never the plaintext.

The admin role cannot touch a session: fencing a disabled Worker's sessions is the
runtime role's, in its own transaction (sessions.fence_sessions).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from psycopg import AsyncConnection, AsyncCursor
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.sql import SQL
from qinglong_control.domain.administration import (
    ROLE_BINDINGS_LISTED_MAX,
    TOKENS_LISTED_MAX,
    AuditFilter,
    AuditRow,
    BindingRow,
    NewSecret,
    PrincipalRow,
    ProjectRow,
    SessionSummary,
    TokenRow,
    WorkerRow,
    check_disable_principal,
    check_join_token_holder,
    check_new_principal,
    check_not_last_cluster_admin,
    check_operator,
    check_projects_exist,
    check_rotation,
    check_token_holder,
    expiry,
    join_token_expiry,
    new_join_token,
    new_operator_token,
    not_found,
    overlap_expiry,
    replay_or_new,
    session_state,
    successor_expiry,
)
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.paging import read_limit

PROJECT_LOCK = "qinglong.project:"
"""Advisory-lock namespace of a project: binding and project changes take it exclusively,
cancellation shared, so a cancel decides under a binding that cannot change until it
commits."""

#: Shared with the migration role's enrollment (identities.py): one text per statement.
LOCK_PROJECT = SQL["admin.lock_project"]
UPSERT_BINDING = SQL["admin.upsert_binding"]
REVOKE_BINDING = SQL["admin.revoke_binding"]

_LOCK_CREATES = SQL["admin.lock_creates"]
_PROJECT = SQL["admin.project"]
_PROJECT_BY_REQUEST = SQL["admin.project_by_request"]
_INSERT_PROJECT = SQL["admin.insert_project"]
_LIST_PROJECTS = SQL["admin.list_projects"]
_ARCHIVE_PROJECT = SQL["admin.archive_project"]
_PRINCIPAL = SQL["admin.principal"]
_PRINCIPAL_OF_KINDS = SQL["admin.principal_of_kinds"]
_PRINCIPAL_BY_REQUEST = SQL["admin.principal_by_request"]
_PRINCIPAL_BY_NAME = SQL["admin.principal_by_name"]
_LOCK_PRINCIPAL = SQL["admin.lock_principal"]
_INSERT_PRINCIPAL = SQL["admin.insert_principal"]
_INSERT_CLUSTER_ADMIN = SQL["admin.insert_cluster_admin"]
_ACTIVE_CLUSTER_ADMIN = SQL["admin.active_cluster_admin"]
_OTHER_ACTIVE_CLUSTER_ADMIN = SQL["admin.other_active_cluster_admin"]
_CALLER_IS_CLUSTER_ADMIN = SQL["admin.caller_is_cluster_admin"]
_LIST_PRINCIPALS = SQL["admin.list_principals"]
_DISABLE_PRINCIPAL = SQL["admin.disable_principal"]
_TOKEN = SQL["admin.token"]
_LOCK_TOKEN = SQL["admin.lock_token"]
_TOKEN_HOLDER = SQL["admin.token_holder"]
_TOKEN_BY_ISSUE_REQUEST = SQL["admin.token_by_issue_request"]
_SUCCESSOR = SQL["admin.successor"]
_INSERT_TOKEN = SQL["admin.insert_token"]
_LIST_TOKENS = SQL["admin.list_tokens"]
_REVOKE_TOKEN = SQL["admin.revoke_token"]
_END_TOKEN = SQL["admin.end_token"]
_BINDING = SQL["admin.binding"]
_LIST_BINDINGS = SQL["admin.list_bindings"]
_WORKER_BY_REQUEST = SQL["admin.worker_by_request"]
_WORKER_TAKEN = SQL["admin.worker_taken"]
_INSERT_WORKER = SQL["admin.insert_worker"]
_INSERT_JOIN_TOKEN = SQL["admin.insert_join_token"]
_FIRST_JOIN_TOKEN_EXPIRY = SQL["admin.first_join_token_expiry"]
_LOCK_WORKER = SQL["admin.lock_worker"]
_JOIN_REQUEST = SQL["admin.join_request"]
_SUPERSEDE_JOIN_TOKENS = SQL["admin.supersede_join_tokens"]
_DISABLE_WORKER = SQL["admin.disable_worker"]
_FLEET = SQL["admin.fleet"]
_INACTIVE_PROJECTS = SQL["admin.inactive_projects"]
_SET_WORKER_PROJECTS = SQL["admin.set_worker_projects"]
_SET_WORKER_CORDONED = SQL["admin.set_worker_cordoned"]
_WORKER_EXISTS = SQL["admin.worker_exists"]
_LIST_AUDIT = SQL["admin.list_audit"]
_DB_NOW = SQL["clock.db_now"]

Row = TypeVar("Row")


@dataclass(frozen=True)
class Page(Generic[Row]):
    rows: list[Row]
    more: bool  # a next page exists; its cursor is the last row's key


@dataclass(frozen=True)
class Issued:
    """A token as stored, and its plaintext for this one answer ("" on a replay)."""

    token: TokenRow
    secret: str = field(repr=False)


@dataclass(frozen=True)
class Rotated:
    issued: Issued
    replaced: TokenRow


@dataclass(frozen=True)
class EnrolledWorker:
    worker: WorkerRow
    join_expires_at_ms: int
    join_token: str = field(repr=False)  # "" on a replay


# --- projects --------------------------------------------------------------------------


async def create_project(
    conn: AsyncConnection[Any], request_id: str, project_id: str, display_name: str
) -> ProjectRow:
    async with command_transaction(conn) as tx:
        await tx.execute("lock.creates", _LOCK_CREATES, ("project",))
        by_request = await tx.execute(
            "project.by_request", _PROJECT_BY_REQUEST, (request_id,), kwargs_row(ProjectRow)
        )
        by_id = await tx.execute("project.by_id", _PROJECT, (project_id,), kwargs_row(ProjectRow))
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        earlier = replay_or_new(
            await by_request.fetchone(), await by_id.fetchone(), "a project with this id"
        )
        if earlier is not None:
            return earlier
        values = {
            "project_id": project_id,
            "display_name": display_name,
            "request_id": request_id,
            "now": await _one(now),
        }
        created = await tx.execute(
            "project.insert", _INSERT_PROJECT, values, kwargs_row(ProjectRow)
        )
    return await _one(created)


async def list_projects(
    conn: AsyncConnection[Any], *, limit: int, after: tuple[int, str] | None
) -> Page[ProjectRow]:
    values = {
        "after_created": None if after is None else after[0],
        "after_id": None if after is None else after[1],
        "limit": read_limit(limit),
    }
    cursor = conn.cursor(row_factory=kwargs_row(ProjectRow))
    await cursor.execute(_LIST_PROJECTS, values)
    return _page(await cursor.fetchall(), limit)


async def get_project(conn: AsyncConnection[Any], project_id: str) -> ProjectRow:
    """The project, active or archived; PROJECT_NOT_FOUND naming ``project_id``."""
    cursor = conn.cursor(row_factory=kwargs_row(ProjectRow))
    await cursor.execute(_PROJECT, (project_id,))
    project = await cursor.fetchone()
    if project is None:
        raise not_found("project", "project_id")
    return project


async def disable_project(conn: AsyncConnection[Any], project_id: str) -> ProjectRow:
    """Archive the project; its version advances, fencing what was admitted under it."""
    async with command_transaction(conn) as tx:
        await tx.execute("lock.project", LOCK_PROJECT, (PROJECT_LOCK, project_id))
        await tx.execute("project.archive", _ARCHIVE_PROJECT, (project_id,))
        project = await tx.execute("project", _PROJECT, (project_id,), kwargs_row(ProjectRow))
        return await _found(project)


# --- principals ------------------------------------------------------------------------


async def check_cluster_admin(conn: AsyncConnection[Any], principal_id: uuid.UUID) -> None:
    """Refuse a caller that is no longer an active user cluster admin: disabled, or its
    grant gone, since ingress admitted the call (ingress is not taken on trust)."""
    found = await conn.execute(_CALLER_IS_CLUSTER_ADMIN, (principal_id,))
    row = await found.fetchone()
    if row is None or not row[0]:
        raise Refused(Reason.PERMISSION_DENIED, "the caller is not an active cluster admin")


async def create_principal(
    conn: AsyncConnection[Any], request_id: str, kind: str, name: str, *, cluster_admin: bool
) -> PrincipalRow:
    check_new_principal(kind, cluster_admin)
    async with command_transaction(conn) as tx:
        await tx.execute("lock.creates", _LOCK_CREATES, ("principal",))
        by_request = await tx.execute(
            "principal.by_request", _PRINCIPAL_BY_REQUEST, (request_id,), kwargs_row(PrincipalRow)
        )
        by_name = await tx.execute(
            "principal.by_name", _PRINCIPAL_BY_NAME, (kind, name), kwargs_row(PrincipalRow)
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        earlier = replay_or_new(
            await by_request.fetchone(), await by_name.fetchone(), f"a {kind} with this name"
        )
        if earlier is not None:
            return earlier
        values = _new_principal(kind, name, request_id, await _one(now))
        await tx.execute("principal.insert", _INSERT_PRINCIPAL, values)
        if cluster_admin:
            await tx.execute("cluster_admin.insert", _INSERT_CLUSTER_ADMIN, values)
        created = await tx.execute(
            "principal", _PRINCIPAL, (values["principal_id"],), kwargs_row(PrincipalRow)
        )
    return await _one(created)


async def list_principals(
    conn: AsyncConnection[Any],
    *,
    kinds: tuple[str, ...],
    limit: int,
    after: tuple[int, uuid.UUID] | None,
) -> Page[PrincipalRow]:
    values = {
        "kinds": list(kinds),
        "after_created": None if after is None else after[0],
        "after_id": None if after is None else after[1],
        "limit": read_limit(limit),
    }
    cursor = conn.cursor(row_factory=kwargs_row(PrincipalRow))
    await cursor.execute(_LIST_PRINCIPALS, values)
    return _page(await cursor.fetchall(), limit)


async def get_principal(
    conn: AsyncConnection[Any], principal_id: uuid.UUID, kinds: tuple[str, ...]
) -> PrincipalRow:
    """The principal if it is of one of ``kinds`` (those the wire shows), active or
    disabled; PRINCIPAL_NOT_FOUND naming ``principal_id`` otherwise."""
    cursor = conn.cursor(row_factory=kwargs_row(PrincipalRow))
    await cursor.execute(_PRINCIPAL_OF_KINDS, (principal_id, list(kinds)))
    principal = await cursor.fetchone()
    if principal is None:
        raise not_found("principal", "principal_id")
    return principal


async def disable_principal(conn: AsyncConnection[Any], principal_id: uuid.UUID) -> PrincipalRow:
    """Disable a user or agent; never the last active user cluster admin (LAST_CLUSTER_ADMIN).

    The principal-create lock (CreatePrincipal's and bootstrap-admin's) comes first, then
    the principal's row: every change of who is an active cluster admin holds that lock, so
    the count of the others is settled until COMMIT and two admins disabling each other at
    once cannot both succeed.
    """
    async with command_transaction(conn) as tx:
        await tx.execute("lock.creates", _LOCK_CREATES, ("principal",))
        await tx.execute("lock.principal", _LOCK_PRINCIPAL, (principal_id,))
        found = await tx.execute("principal", _PRINCIPAL, (principal_id,), kwargs_row(PrincipalRow))
        others = await tx.execute(
            "cluster_admin.others", _OTHER_ACTIVE_CLUSTER_ADMIN, (principal_id,), scalar_row
        )
        principal = check_disable_principal(await found.fetchone())
        check_not_last_cluster_admin(principal, bool(await _one(others)))
        await tx.execute("principal.disable", _DISABLE_PRINCIPAL, (principal_id,))
        disabled = await tx.execute(
            "principal", _PRINCIPAL, (principal_id,), kwargs_row(PrincipalRow)
        )
    return await _one(disabled)


async def bootstrap_admin(
    conn: AsyncConnection[Any], name: str, given: NewSecret | None = None
) -> Issued | None:
    """The first cluster admin, a user named ``name``, and one token for it (``given``, or
    a new one); None (and nothing written) when an active cluster admin already exists."""
    async with command_transaction(conn) as tx:
        await tx.execute("lock.creates", _LOCK_CREATES, ("principal",))
        exists = await tx.execute("cluster_admin.active", _ACTIVE_CLUSTER_ADMIN, (), scalar_row)
        by_name = await tx.execute(
            "principal.by_name", _PRINCIPAL_BY_NAME, ("user", name), kwargs_row(PrincipalRow)
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        if await exists.fetchone():
            return None
        replay_or_new(None, await by_name.fetchone(), "a user with this name")
        now_ms = await _one(now)
        values = _new_principal("user", name, None, now_ms)
        await tx.execute("principal.insert", _INSERT_PRINCIPAL, values)
        await tx.execute("cluster_admin.insert", _INSERT_CLUSTER_ADMIN, values)
        return await _insert_token(
            tx, values["principal_id"], None, None, now_ms, None, secret=given
        )


# --- operator tokens -------------------------------------------------------------------


async def issue_token(
    conn: AsyncConnection[Any], principal_id: uuid.UUID, request_id: str, ttl_seconds: int | None
) -> Issued:
    async with command_transaction(conn) as tx:
        await tx.execute("lock.principal", _LOCK_PRINCIPAL, (principal_id,))
        holder = await tx.execute(
            "principal", _PRINCIPAL, (principal_id,), kwargs_row(PrincipalRow)
        )
        by_request = await tx.execute(
            "token.by_request",
            _TOKEN_BY_ISSUE_REQUEST,
            (principal_id, request_id),
            kwargs_row(TokenRow),
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        earlier = await by_request.fetchone()
        if earlier is not None:
            return Issued(earlier, "")
        check_token_holder(await holder.fetchone())
        now_ms = await _one(now)
        return await _insert_token(
            tx, principal_id, request_id, None, now_ms, expiry(now_ms, ttl_seconds)
        )


async def list_tokens(conn: AsyncConnection[Any], principal_id: uuid.UUID) -> list[TokenRow]:
    async with command_transaction(conn, durable_answer=False) as tx:
        holder = await tx.execute(
            "principal", _PRINCIPAL, (principal_id,), kwargs_row(PrincipalRow)
        )
        tokens = await tx.execute(
            "tokens", _LIST_TOKENS, (principal_id, TOKENS_LISTED_MAX), kwargs_row(TokenRow)
        )
        if await holder.fetchone() is None:
            raise not_found("principal", "principal_id")
        return list(await tokens.fetchall())


async def revoke_token(conn: AsyncConnection[Any], token_id: uuid.UUID) -> TokenRow:
    async with command_transaction(conn) as tx:
        locked = await tx.execute("lock.token", _LOCK_TOKEN, (token_id,), kwargs_row(TokenRow))
        if await locked.fetchone() is None:
            raise not_found("token", "token_id")
        await tx.execute("token.revoke", _REVOKE_TOKEN, (token_id,))
        revoked = await tx.execute("token", _TOKEN, (token_id,), kwargs_row(TokenRow))
    return await _one(revoked)


@dataclass(frozen=True)
class _Successor:
    token: TokenRow
    request_id: str | None


def _successor(*, issue_request_id: str | None, **columns: Any) -> _Successor:
    return _Successor(TokenRow(**columns), issue_request_id)


async def rotate_token(
    conn: AsyncConnection[Any], token_id: uuid.UUID, request_id: str, overlap_seconds: int
) -> Rotated:
    """Issue a successor and end the old token after the overlap, in one transaction.

    A token is replaced once: the same request id answers with its successor (and an
    empty secret), any other is STATE_CONFLICT (rotate the successor instead).
    """
    async with command_transaction(conn) as tx:
        locked = await tx.execute("lock.token", _LOCK_TOKEN, (token_id,), kwargs_row(TokenRow))
        holder = await tx.execute(
            "token.holder", _TOKEN_HOLDER, (token_id,), kwargs_row(PrincipalRow)
        )
        successor = await tx.execute(
            "token.successor", _SUCCESSOR, (token_id,), kwargs_row(_successor)
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        old, earlier = await locked.fetchone(), await successor.fetchone()
        if old is not None and earlier is not None:
            if earlier.request_id != request_id:
                raise Refused(Reason.STATE_CONFLICT, "the token was already rotated")
            return Rotated(Issued(earlier.token, ""), old)
        old = check_rotation(old, await holder.fetchone())
        now_ms = await _one(now)
        issued = await _insert_token(
            tx, old.principal_id, request_id, old.token_id, now_ms, successor_expiry(old, now_ms)
        )
        ends = {"token_id": token_id, "expires": overlap_expiry(old, now_ms, overlap_seconds)}
        await tx.execute("token.end", _END_TOKEN, ends)
        replaced = await tx.execute("token", _TOKEN, (token_id,), kwargs_row(TokenRow))
    return Rotated(issued, await _one(replaced))


async def _insert_token(
    tx: CommandTx,
    principal_id: uuid.UUID,
    request_id: str | None,
    replaces: uuid.UUID | None,
    now_ms: int,
    expires_at_ms: int | None,
    *,
    secret: NewSecret | None = None,
) -> Issued:
    secret = secret or new_operator_token()
    values = {
        "token_id": uuid.uuid4(),
        "principal_id": principal_id,
        "digest": secret.digest,
        "prefix": secret.shown_prefix,
        "request_id": request_id,
        "replaces": replaces,
        "now": now_ms,
        "expires": expires_at_ms,
    }
    inserted = await tx.execute("token.insert", _INSERT_TOKEN, values, kwargs_row(TokenRow))
    return Issued(await _one(inserted), secret.plaintext)


# --- role bindings ---------------------------------------------------------------------


async def grant_role(
    conn: AsyncConnection[Any], project_id: str, principal_id: uuid.UUID, role: str
) -> BindingRow:
    """Grant or change a role; the binding's version advances unless it already said
    exactly this (SPEC R-CAN-3)."""
    async with command_transaction(conn) as tx:
        project = await _lock_project(tx, project_id)
        principal = await tx.execute(
            "principal", _PRINCIPAL, (principal_id,), kwargs_row(PrincipalRow)
        )
        await _found(project)
        check_operator(await principal.fetchone())
        values = {"project_id": project_id, "principal_id": principal_id, "role": role}
        await tx.execute("binding.upsert", UPSERT_BINDING, values)
        binding = await tx.execute(
            "binding", _BINDING, (project_id, principal_id), kwargs_row(BindingRow)
        )
    return await _one(binding)


async def revoke_role(
    conn: AsyncConnection[Any], project_id: str, principal_id: uuid.UUID
) -> BindingRow:
    """Revoke a binding; its version advances, so mutations admitted under it are fenced."""
    async with command_transaction(conn) as tx:
        project = await _lock_project(tx, project_id)
        before = await tx.execute(
            "binding", _BINDING, (project_id, principal_id), kwargs_row(BindingRow)
        )
        await _found(project)
        if await before.fetchone() is None:
            raise not_found("role binding", "principal_id")
        values = {"project_id": project_id, "principal_id": principal_id}
        await tx.execute("binding.revoke", REVOKE_BINDING, values)
        binding = await tx.execute(
            "binding", _BINDING, (project_id, principal_id), kwargs_row(BindingRow)
        )
    return await _one(binding)


async def list_role_bindings(conn: AsyncConnection[Any], project_id: str) -> list[BindingRow]:
    async with command_transaction(conn, durable_answer=False) as tx:
        project = await tx.execute("project", _PROJECT, (project_id,), kwargs_row(ProjectRow))
        bindings = await tx.execute(
            "bindings",
            _LIST_BINDINGS,
            (project_id, ROLE_BINDINGS_LISTED_MAX),
            kwargs_row(BindingRow),
        )
        await _found(project)
        return list(await bindings.fetchall())


async def _lock_project(tx: CommandTx, project_id: str) -> AsyncCursor[ProjectRow]:
    await tx.execute("lock.project", LOCK_PROJECT, (PROJECT_LOCK, project_id))
    return await tx.execute("project", _PROJECT, (project_id,), kwargs_row(ProjectRow))


async def _found(project: AsyncCursor[ProjectRow]) -> ProjectRow:
    row = await project.fetchone()
    if row is None:
        raise Refused(Reason.PROJECT_NOT_FOUND, "no such project")
    return row


# --- Workers ---------------------------------------------------------------------------


async def create_worker(
    conn: AsyncConnection[Any],
    request_id: str,
    worker_id: str,
    certificate_uri: str,
    join_token_ttl_seconds: int | None,
    projects: tuple[str, ...] | None = None,
) -> EnrolledWorker:
    """The Worker's principal, its identity and a one-time join token, together; it is
    offered the Runs of ``projects`` only (None: every project)."""
    async with command_transaction(conn) as tx:
        await tx.execute("lock.creates", _LOCK_CREATES, ("worker",))
        by_request = await tx.execute(
            "worker.by_request", _WORKER_BY_REQUEST, (request_id,), scalar_row
        )
        taken = await tx.execute(
            "worker.taken", _WORKER_TAKEN, {"worker_id": worker_id}, scalar_row
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        earlier: str | None = replay_or_new(
            await by_request.fetchone(),
            worker_id if await taken.fetchone() else None,
            "a Worker with this id",
        )
        if earlier is not None:
            fleet = await tx.execute(
                "fleet", _FLEET, _fleet_values(worker_id=earlier), kwargs_row(_worker)
            )
            first_join = await tx.execute(
                "join_token.first", _FIRST_JOIN_TOKEN_EXPIRY, (earlier,), scalar_row
            )
            return EnrolledWorker(await _one(fleet), await _one(first_join), "")
        await _check_projects_active(tx, projects)
        now_ms: int = await _one(now)
        # The request id is the identity's; the principal is made with it, not by it.
        principal = _new_principal("worker", worker_id, None, now_ms)
        identity = {
            **principal,
            "worker_id": worker_id,
            "certificate_uri": certificate_uri,
            "request_id": request_id,
            "project_ids": _stored(projects),
        }
        secret = new_join_token()
        expires_at_ms = join_token_expiry(now_ms, join_token_ttl_seconds)
        join = {"digest": secret.digest, "worker_id": worker_id, "now": now_ms}
        await tx.execute("principal.insert", _INSERT_PRINCIPAL, principal)
        await tx.execute("worker.insert", _INSERT_WORKER, identity)
        await tx.execute(
            "join_token.insert",
            _INSERT_JOIN_TOKEN,
            {**join, "expires": expires_at_ms, "issue_request_id": None},
        )
    worker = WorkerRow(worker_id, principal["principal_id"], "active", now_ms, None, 0, 0, projects)
    return EnrolledWorker(worker, expires_at_ms, secret.plaintext)


async def issue_join_token(
    conn: AsyncConnection[Any], worker_id: str, request_id: str, ttl_seconds: int | None
) -> EnrolledWorker:
    """A new one-time join token for an enrolled, active Worker; every earlier one it
    could still use stops working (one live join token per Worker). The request id is
    scoped to the Worker: a retry answers with the first call's expiry and no token."""
    async with command_transaction(conn) as tx:
        locked = await tx.execute("lock.worker", _LOCK_WORKER, (worker_id,), scalar_row)
        earlier = await tx.execute(
            "join_request", _JOIN_REQUEST, (worker_id, request_id), scalar_row
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        status, replayed = await locked.fetchone(), await earlier.fetchone()
        if replayed is not None:
            fleet = await tx.execute(
                "fleet", _FLEET, _fleet_values(worker_id=worker_id), kwargs_row(_worker)
            )
            return EnrolledWorker(await _one(fleet), replayed, "")
        check_join_token_holder(status)
        now_ms = await _one(now)
        secret = new_join_token()
        expires_at_ms = join_token_expiry(now_ms, ttl_seconds)
        values = {"worker_id": worker_id, "now": now_ms, "expires": expires_at_ms}
        await tx.execute("join_token.supersede", _SUPERSEDE_JOIN_TOKENS, values)
        await tx.execute(
            "join_token.insert",
            _INSERT_JOIN_TOKEN,
            {**values, "digest": secret.digest, "issue_request_id": request_id},
        )
        fleet = await tx.execute(
            "fleet", _FLEET, _fleet_values(worker_id=worker_id), kwargs_row(_worker)
        )
    return EnrolledWorker(await _one(fleet), expires_at_ms, secret.plaintext)


async def list_workers(
    conn: AsyncConnection[Any], *, limit: int, after: str | None
) -> Page[WorkerRow]:
    cursor = conn.cursor(row_factory=kwargs_row(_worker))
    await cursor.execute(_FLEET, _fleet_values(after=after, limit=read_limit(limit)))
    return _page(await cursor.fetchall(), limit)


async def get_worker(conn: AsyncConnection[Any], worker_id: str) -> WorkerRow:
    cursor = conn.cursor(row_factory=kwargs_row(_worker))
    await cursor.execute(_FLEET, _fleet_values(worker_id=worker_id))
    worker = await cursor.fetchone()
    if worker is None:
        raise not_found("Worker", "worker_id")
    return worker


async def set_worker_projects(
    conn: AsyncConnection[Any], worker_id: str, projects: tuple[str, ...] | None
) -> WorkerRow:
    """From now on the Worker is offered, and may claim, the Runs of ``projects`` only
    (None: every project). Attempts it claimed already run on."""
    async with command_transaction(conn) as tx:
        found = await tx.execute("worker.exists", _WORKER_EXISTS, (worker_id,), scalar_row)
        if not await _one(found):
            raise not_found("Worker", "worker_id")
        await _check_projects_active(tx, projects)
        values = {"worker_id": worker_id, "project_ids": _stored(projects)}
        await tx.execute("worker.set_projects", _SET_WORKER_PROJECTS, values)
        changed = await tx.execute(
            "fleet", _FLEET, _fleet_values(worker_id=worker_id), kwargs_row(_worker)
        )
    return await _one(changed)


async def set_worker_cordoned(
    conn: AsyncConnection[Any], worker_id: str, cordoned: bool
) -> WorkerRow:
    """Cordon the Worker (it is offered no new Run and may claim none; the Attempts it
    runs go on) or uncordon it. Idempotent: setting what is already set changes nothing
    but answers the Worker as it is."""
    async with command_transaction(conn) as tx:
        values = {"worker_id": worker_id, "cordoned": cordoned}
        updated = await tx.execute("worker.set_cordoned", _SET_WORKER_CORDONED, values)
        changed = await tx.execute(
            "fleet", _FLEET, _fleet_values(worker_id=worker_id), kwargs_row(_worker)
        )
        if await updated.fetchone() is None:
            raise not_found("Worker", "worker_id")
    return await _one(changed)


async def disable_worker(conn: AsyncConnection[Any], worker_id: str) -> None:
    """Mark the Worker and its principal disabled (idempotent). Its sessions are fenced
    next, by the runtime role (sessions.fence_sessions)."""
    async with command_transaction(conn) as tx:
        await tx.execute("worker.disable", _DISABLE_WORKER, {"worker_id": worker_id})
        found = await tx.execute(
            "fleet", _FLEET, _fleet_values(worker_id=worker_id), kwargs_row(_worker)
        )
        if await found.fetchone() is None:
            raise not_found("Worker", "worker_id")


def _fleet_values(
    *, worker_id: str | None = None, after: str | None = None, limit: int = 1
) -> dict[str, object]:
    return {"worker_id": worker_id, "after": after, "limit": limit}


def _worker(
    *,
    session_id: uuid.UUID | None,
    session_status: str | None,
    generation: int | None,
    renewed_at_ms: int | None,
    remaining_ms: int | None,
    agent_version: str | None,
    executor_types: list[str] | None,
    max_concurrency: int | None,
    passes_run_parameters: bool | None,
    labels: dict[str, str] | None,
    project_ids: list[str] | None,
    **worker: Any,
) -> WorkerRow:
    """A fleet row: the session's columns are all NULL before the Worker's first session."""
    session = None
    if session_id is not None:
        state, remaining = session_state(session_status or "", remaining_ms or 0)
        session = SessionSummary(
            session_id=session_id,
            state=state,
            generation=generation or 0,
            renewed_at_ms=renewed_at_ms or 0,
            remaining_ms=remaining,
            agent_version=agent_version or "",
            executor_types=tuple(executor_types or ()),
            max_concurrency=max_concurrency or 0,
            passes_run_parameters=bool(passes_run_parameters),
            labels=labels or {},
        )
    projects = None if project_ids is None else tuple(project_ids)
    return WorkerRow(session=session, project_ids=projects, **worker)


async def _check_projects_active(tx: CommandTx, projects: tuple[str, ...] | None) -> None:
    """Refuse a project list naming a project that is not active (nothing to read for
    every project)."""
    if projects is not None:
        inactive = await tx.execute(
            "projects.inactive", _INACTIVE_PROJECTS, (list(projects),), scalar_row
        )
        check_projects_exist(projects, await _one(inactive))


def _stored(projects: tuple[str, ...] | None) -> list[str] | None:
    """A Worker's projects as the column holds them (an array; NULL: every project)."""
    return None if projects is None else list(projects)


# --- the security audit ----------------------------------------------------------------


async def list_audit(
    conn: AsyncConnection[Any],
    where: AuditFilter,
    *,
    limit: int,
    before: tuple[int, uuid.UUID] | None,
) -> Page[AuditRow]:
    values = {
        "principal_id": where.principal_id,
        "operation": where.operation,
        "outcome": where.outcome,
        "start_ms": where.start_ms,
        "end_ms": where.end_ms,
        "before_at": None if before is None else before[0],
        "before_id": None if before is None else before[1],
        "limit": read_limit(limit),
    }
    cursor = conn.cursor(row_factory=kwargs_row(AuditRow))
    # Planned with its values (as runs.list_runs): a filter by principal then reads
    # migration 0020's index instead of the whole audit, newest first.
    await cursor.execute(_LIST_AUDIT, values, prepare=False)
    return _page(await cursor.fetchall(), limit)


# --- helpers ---------------------------------------------------------------------------


def _new_principal(kind: str, name: str, request_id: str | None, now_ms: int) -> dict[str, Any]:
    return {
        "principal_id": uuid.uuid4(),
        "kind": kind,
        "name": name,
        "request_id": request_id,
        "now": now_ms,
    }


def _page(rows: list[Row], limit: int) -> Page[Row]:
    """Rows read with paging.read_limit: whether the extra one came says whether a next
    page does."""
    return Page(rows[:limit], len(rows) > limit)


async def _one(cursor: AsyncCursor[Row]) -> Row:
    value = await cursor.fetchone()
    if value is None:
        raise RuntimeError("expected one row")
    return value
