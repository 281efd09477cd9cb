"""Worker sessions: open (replacing the previous generation), renew, drain."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import (
    LIVE_SESSION_STATES,
    SessionClaim,
    SessionRow,
    check_session,
)
from qinglong_control.domain.timings import Timings

# Serialises every open of one Worker; the runtime role cannot lock identity rows.
_LOCK_WORKER = "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.worker:' || %s, 0))"

_KNOWN_WORKER = """
SELECT status FROM qinglong.worker_identities WHERE worker_id = %s
"""

_SESSION_BY_REQUEST = """
SELECT session_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions
 WHERE worker_id = %s AND open_request_id = %s
"""

_LOCK_LIVE_SESSION = """
SELECT session_id FROM qinglong.worker_sessions
 WHERE worker_id = %s AND status IN ('online', 'draining')
   FOR UPDATE
"""

_LAST_GENERATION = """
SELECT coalesce(max(generation), 0) FROM qinglong.worker_sessions WHERE worker_id = %s
"""

_DB_NOW = "SELECT qinglong.db_now_ms()"

_REPLACE_LIVE_SESSION = """
UPDATE qinglong.worker_sessions
   SET status = 'replaced', closed_at_ms = %(now)s
 WHERE worker_id = %(worker_id)s AND status IN ('online', 'draining')
"""

# Offers of a replaced or draining session go back to the pool at once.
_WITHDRAW_OPEN_OFFERS = """
UPDATE qinglong.offers SET state = 'withdrawn'
 WHERE worker_id = %(worker_id)s AND state = 'open'
"""

_INSERT_SESSION = """
INSERT INTO qinglong.worker_sessions
       (session_id, worker_id, generation, status, executor_types, max_concurrency,
        agent_version, open_request_id, opened_at_ms, renewed_at_ms, expires_at_ms)
VALUES (%(session_id)s, %(worker_id)s, %(generation)s, 'online', %(executor_types)s,
        %(max_concurrency)s, %(agent_version)s, %(request_id)s, %(now)s, %(now)s, %(expires)s)
"""

_LOCK_SESSION = """
SELECT session_id, worker_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions WHERE session_id = %s FOR UPDATE
"""

_RENEW_SESSION = """
UPDATE qinglong.worker_sessions SET renewed_at_ms = %(now)s, expires_at_ms = %(expires)s
 WHERE session_id = %(session_id)s
"""

_DRAIN_SESSION = """
UPDATE qinglong.worker_sessions
   SET status = 'draining', renewed_at_ms = %(now)s, expires_at_ms = %(expires)s
 WHERE session_id = %(session_id)s
"""


@dataclass(frozen=True)
class OpenSession:
    worker_id: str
    request_id: str
    executor_types: tuple[str, ...]
    max_concurrency: int
    agent_version: str


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
            kwargs_row(_Existing),
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
            if existing.status not in LIVE_SESSION_STATES:
                raise Refused(Reason.SESSION_FENCED, "that session was replaced or closed")
            return SessionView(
                existing.session_id,
                existing.generation,
                existing.status,
                max(0, existing.expires_at_ms - now_ms),
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
            "request_id": command.request_id,
            "now": now_ms,
            "expires": now_ms + timings.session_ttl_ms,
        }
        await tx.execute("session.replace", _REPLACE_LIVE_SESSION, values)
        await tx.execute("offers.withdraw", _WITHDRAW_OPEN_OFFERS, values)
        await tx.execute("session.insert", _INSERT_SESSION, values)
        return SessionView(session_id, generation, "online", timings.session_ttl_ms)


async def renew_session(
    conn: AsyncConnection[Any], claim: SessionClaim, timings: Timings
) -> SessionView:
    async with command_transaction(conn) as tx:
        row, now_ms = await _lock_session(tx, claim)
        await tx.execute(
            "session.renew",
            _RENEW_SESSION,
            {
                "now": now_ms,
                "expires": now_ms + timings.session_ttl_ms,
                "session_id": row.session_id,
            },
        )
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


@dataclass(frozen=True)
class _Existing:
    session_id: uuid.UUID
    generation: int
    status: str
    expires_at_ms: int


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
