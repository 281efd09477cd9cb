"""Worker sessions: open (replacing the previous generation), renew, drain, fence."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row
from psycopg.types.json import Jsonb

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.sql import SQL
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import (
    OpenedBefore,
    SessionClaim,
    SessionRequest,
    SessionRow,
    check_open_replay,
    check_session,
)
from qinglong_control.domain.timings import Timings

_LOCK_WORKER = SQL["sessions.lock_worker"]

_KNOWN_WORKER = SQL["sessions.known_worker"]

_SESSION_BY_REQUEST = SQL["sessions.session_by_request"]

_LOCK_LIVE_SESSION = SQL["sessions.lock_live_session"]

_LAST_GENERATION = SQL["sessions.last_generation"]

_DB_NOW = SQL["clock.db_now"]

_REPLACE_LIVE_SESSION = SQL["sessions.replace_live_session"]

_WITHDRAW_OPEN_OFFERS = SQL["sessions.withdraw_open_offers"]

_LOCK_WORKER_PULLS = SQL["sessions.lock_worker_pulls"]

_INSERT_SESSION = SQL["sessions.insert_session"]

_LOCK_SESSION = SQL["sessions.lock_session"]

_RENEW_SESSION = SQL["sessions.renew_session"]

_WITHDRAW_OFFERS_FOR_OTHER_LABELS = SQL["sessions.withdraw_offers_for_other_labels"]

_WITHDRAW_OFFERS_BEYOND_CAPACITY = SQL["sessions.withdraw_offers_beyond_capacity"]

_DRAIN_SESSION = SQL["sessions.drain_session"]


@dataclass(frozen=True)
class OpenSession:
    worker_id: str
    request_id: str
    executor_types: tuple[str, ...]
    max_concurrency: int
    agent_version: str
    passes_run_parameters: bool = False
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def terms(self) -> SessionRequest:
        return SessionRequest(
            self.executor_types,
            self.max_concurrency,
            self.agent_version,
            self.passes_run_parameters,
            self.labels,
        )


@dataclass(frozen=True)
class SessionView:
    session_id: uuid.UUID
    worker_generation: int
    status: str
    remaining_ms: int


async def open_session(
    conn: AsyncConnection[Any], command: OpenSession, timings: Timings
) -> SessionView:
    """A new generation replaces (fences) the Worker's live session; retries are exact."""
    async with command_transaction(conn) as tx:
        await tx.execute("lock.worker", _LOCK_WORKER, (command.worker_id,))
        known = await tx.execute("worker.known", _KNOWN_WORKER, (command.worker_id,), scalar_row)
        earlier = await tx.execute(
            "session.by_request",
            _SESSION_BY_REQUEST,
            (command.worker_id, command.request_id),
            kwargs_row(_opened_before),
        )
        await tx.execute("lock.live_session", _LOCK_LIVE_SESSION, (command.worker_id,))
        last = await tx.execute(
            "session.last_generation", _LAST_GENERATION, (command.worker_id,), scalar_row
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        now_ms: int = await _one(now)
        if await known.fetchone() != "active":
            raise Refused(Reason.SESSION_FENCED, "worker is not enrolled or is disabled")
        existing = await earlier.fetchone()
        if existing is not None:
            check_open_replay(existing, command.terms, now_ms)
            return SessionView(
                existing.session_id,
                existing.generation,
                existing.status,
                existing.expires_at_ms - now_ms,
            )
        generation = await _one(last) + 1
        session_id = uuid.uuid4()
        values = {
            "session_id": session_id,
            "worker_id": command.worker_id,
            "generation": generation,
            "executor_types": list(command.executor_types),
            "max_concurrency": command.max_concurrency,
            "agent_version": command.agent_version,
            "passes_run_parameters": command.passes_run_parameters,
            "labels": Jsonb(command.labels),
            "request_id": command.request_id,
            "now": now_ms,
            "expires": now_ms + timings.session_ttl_ms,
        }
        await tx.execute("session.replace", _REPLACE_LIVE_SESSION, values)
        await tx.execute("offers.withdraw", _WITHDRAW_OPEN_OFFERS, values)
        await tx.execute("session.insert", _INSERT_SESSION, values)
        return SessionView(session_id, generation, "online", timings.session_ttl_ms)


async def renew_session(
    conn: AsyncConnection[Any],
    claim: SessionClaim,
    timings: Timings,
    *,
    passes_run_parameters: bool = False,
    labels: dict[str, str] | None = None,
    max_concurrency: int | None = None,
) -> SessionView:
    """Extend the session; ``passes_run_parameters``, ``labels`` and ``max_concurrency``
    are what the renewing Worker says now (a Worker of an earlier version says nothing:
    False, no labels, its capacity unchanged). Open offers its new labels no longer
    qualify for, and those beyond its new capacity, are withdrawn."""
    async with command_transaction(conn) as tx:
        row, now_ms = await _lock_session(tx, claim)
        values = {
            "now": now_ms,
            "expires": now_ms + timings.session_ttl_ms,
            "session_id": row.session_id,
            "passes_run_parameters": passes_run_parameters,
            "labels": Jsonb(labels or {}),
            "max_concurrency": max_concurrency,
        }
        await tx.execute("offers.withdraw_for_labels", _WITHDRAW_OFFERS_FOR_OTHER_LABELS, values)
        await tx.execute("offers.withdraw_beyond", _WITHDRAW_OFFERS_BEYOND_CAPACITY, values)
        await tx.execute("session.renew", _RENEW_SESSION, values)
        return SessionView(row.session_id, row.generation, row.status, timings.session_ttl_ms)


async def drain_session(
    conn: AsyncConnection[Any], claim: SessionClaim, timings: Timings
) -> SessionView:
    """No new offers from now on; work already claimed may finish."""
    async with command_transaction(conn) as tx:
        row, now_ms = await _lock_session(tx, claim)
        values = {
            "now": now_ms,
            "expires": now_ms + timings.session_ttl_ms,
            "session_id": row.session_id,
            "worker_id": row.worker_id,
        }
        await tx.execute("session.drain", _DRAIN_SESSION, values)
        await tx.execute("offers.withdraw", _WITHDRAW_OPEN_OFFERS, values)
        return SessionView(row.session_id, row.generation, "draining", timings.session_ttl_ms)


async def fence_sessions(conn: AsyncConnection[Any], worker_id: str) -> None:
    """Fence the Worker's live session, as a new generation would (a disabled Worker,
    docs/decisions/0002): its next fenced command fails SESSION_FENCED, which stops its
    executions, and its open offers go back to the pool. Serialised with OpenSession by
    the Worker's lock, so no session opened before the Worker was disabled survives."""
    async with command_transaction(conn) as tx:
        await tx.execute("lock.worker", _LOCK_WORKER, (worker_id,))
        await tx.execute("lock.live_session", _LOCK_LIVE_SESSION, (worker_id,))
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        values = {"worker_id": worker_id, "now": await _one(now)}
        await tx.execute("session.replace", _REPLACE_LIVE_SESSION, values)
        await tx.execute("offers.withdraw", _WITHDRAW_OPEN_OFFERS, values)


async def withdraw_worker_offers(conn: AsyncConnection[Any], worker_id: str) -> None:
    """The Worker's open offers go back to the pool (it was cordoned: it may claim none,
    and they would hold their Runs from every other Worker until they expire). A pull of
    it that began before the cordon committed is waited for first, so the offers it
    places are withdrawn too; a pull that begins after it places none."""
    values = {"worker_id": worker_id}
    async with command_transaction(conn) as tx:
        await tx.execute("lock.worker_pulls", _LOCK_WORKER_PULLS, values)
        await tx.execute("offers.withdraw", _WITHDRAW_OPEN_OFFERS, values)


def _opened_before(
    *,
    session_id: uuid.UUID,
    generation: int,
    status: str,
    expires_at_ms: int,
    executor_types: list[str],
    max_concurrency: int,
    agent_version: str,
    passes_run_parameters: bool,
    labels: dict[str, str],
) -> OpenedBefore:
    """A row of `session_by_request` as the domain compares it."""
    terms = SessionRequest(
        tuple(executor_types), max_concurrency, agent_version, passes_run_parameters, labels
    )
    return OpenedBefore(session_id, generation, status, expires_at_ms, terms)


async def _lock_session(tx: CommandTx, claim: SessionClaim) -> tuple[SessionRow, int]:
    locked = await tx.execute(
        "lock.session", _LOCK_SESSION, (claim.session_id,), kwargs_row(SessionRow)
    )
    now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
    now_ms: int = await _one(now)
    return check_session(claim, await locked.fetchone(), now_ms), now_ms


async def _one(cursor: Any) -> Any:
    value = await cursor.fetchone()
    if value is None:
        raise RuntimeError("expected one row")
    return value
