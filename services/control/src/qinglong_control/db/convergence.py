"""Convergence pages and lease expiry as transactions (see domain/convergence.py).

Convergence locks candidate Runs with FOR UPDATE SKIP LOCKED, so any number of control
replicas share the work with no claim table: a Run locked by one is skipped by the
others. Lock order is Run, then Attempt, then Lease — the relative order every fenced
command uses — and convergence never waits for an advisory lock, so it cannot deadlock
with an ACK. Expiry lists the oldest expired leases and locks each again on its own, one
Attempt per transaction: its advisory lock without waiting, then its Run, Attempt and
Lease with SKIP LOCKED (a command or another replica is deciding it; the next page or
cycle sees the outcome). It never waits, so it cannot break the lock order either.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.convergence import (
    Convergence,
    ConvergencePlan,
    NewestAttempt,
    derived_event_id,
    plan_convergence,
    plan_expiry,
)
from qinglong_control.domain.ending_codes import LEASE_EXPIRED
from qinglong_control.domain.states import AttemptState, RunState

RECONCILER = Actor("reconciler", "convergence")
EXPIRY = Actor("reconciler", "lease-expiry")

_LOCK_CANDIDATES = SQL["convergence.lock_candidates"]

_DB_NOW = SQL["clock.db_now"]

_LOCK_ATTEMPT = SQL["convergence.lock_attempt"]

_END_ATTEMPT = SQL["convergence.end_attempt"]

_EXPIRE_LEASE = SQL["convergence.expire_lease"]

_END_RUN = SQL["convergence.end_run"]


@dataclass(frozen=True)
class _Candidate:
    run_id: uuid.UUID
    state: str
    cancel_reason: str | None
    cancel_requested_at_ms: int | None
    event_sequence: int
    attempt_id: uuid.UUID | None
    attempt_state: str | None
    lease_status: str | None
    lease_expires_at_ms: int | None

    def newest(self) -> NewestAttempt | None:
        if self.attempt_id is None or self.attempt_state is None:
            return None
        return NewestAttempt(
            self.attempt_id,
            AttemptState(self.attempt_state),
            self.lease_status or "expired",
            self.lease_expires_at_ms or 0,
        )


@dataclass(frozen=True)
class PageReport:
    candidates: int
    converged: int
    blocked: int


async def converge_page(conn: AsyncConnection[Any], limit: int) -> PageReport:
    """Converge at most `limit` (1..128) Runs with a cancel intent; one transaction."""
    if not 1 <= limit <= 128:
        raise ValueError("a convergence page holds 1..128 Runs")
    async with command_transaction(conn, durable_answer=False) as tx:
        locked = await tx.execute(
            "lock.candidates", _LOCK_CANDIDATES, {"limit": limit}, kwargs_row(_Candidate)
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        candidates = list(await locked.fetchall())
        now_ms: int = await now.fetchone() or 0
        converged = blocked = 0
        for candidate in candidates:
            plan = plan_convergence(
                RunState(candidate.state), candidate.cancel_reason, candidate.newest(), now_ms
            )
            if plan.outcome is Convergence.BLOCKED:
                blocked += 1
            elif plan.outcome is Convergence.CONVERGED:
                await _converge(tx, candidate, plan, now_ms)
                converged += 1
    return PageReport(len(candidates), converged, blocked)


async def _converge(
    tx: CommandTx, candidate: _Candidate, plan: ConvergencePlan, now_ms: int
) -> None:
    assert plan.run_state is not None
    intent_at = candidate.cancel_requested_at_ms or 0
    events: list[NewEvent] = []
    values: dict[str, object] = {
        "run_id": candidate.run_id,
        "run_state": plan.run_state.value,
        "error_code": plan.error_code,
        "now": now_ms,
    }
    if plan.attempt_state is not None and plan.attempt_id is not None:
        values.update(attempt_id=plan.attempt_id, attempt_state=plan.attempt_state.value)
        await tx.execute("attempt.lock", _LOCK_ATTEMPT, (plan.attempt_id,))
        await tx.execute("attempt.converge", _END_ATTEMPT, values)
        await tx.execute("lease.expire", _EXPIRE_LEASE, values)
        events.append(
            NewEvent(
                f"attempt.{plan.attempt_state.value}",
                plan.attempt_id,
                {"state": plan.attempt_state.value, "error_code": plan.error_code},
                event_id=derived_event_id("qinglong.converge.attempt", plan.attempt_id, intent_at),
            )
        )
    events.append(
        NewEvent(
            f"run.{plan.run_state.value}",
            plan.attempt_id,
            {
                "from_state": candidate.state,
                "to_state": plan.run_state.value,
                "error_code": plan.error_code,
            },
            event_id=derived_event_id("qinglong.converge.run", candidate.run_id, intent_at),
        )
    )
    await append_events(tx, candidate.run_id, candidate.event_sequence, RECONCILER, now_ms, events)
    await tx.execute("run.converge", _END_RUN, values)


# --- lease expiry -------------------------------------------------------------------------

_EXPIRED_LEASES = SQL["convergence.expired_leases"]

_TRY_ADVISORY = SQL["convergence.try_advisory"]

_LOCK_FOR_EXPIRY = SQL["convergence.lock_for_expiry"]

_ATTEMPT_LOST = SQL["convergence.attempt_lost"]

_RUN_AFTER_EXPIRY = SQL["convergence.run_after_expiry"]


@dataclass(frozen=True)
class _Expiring:
    run_id: uuid.UUID
    run_state: str
    event_sequence: int
    cancel_reason: str | None
    attempt_state: str
    lease_status: str
    expires_at_ms: int


@dataclass(frozen=True)
class ExpiryPage:
    listed: int
    """Leases the page found past their expiry. A full page means there may be more,
    however many of these this replica expired itself: replicas list the same oldest
    leases, and each expires those the others have not taken yet."""
    expired: int


async def expire_leases(conn: AsyncConnection[Any], limit: int) -> ExpiryPage:
    """Expire at most `limit` leases past their expiry, one Attempt per transaction."""
    cursor = await conn.execute(_EXPIRED_LEASES, (limit,))
    listed = await cursor.fetchall()
    expired = 0
    for (attempt_id,) in listed:
        expired += await _expire_one(conn, attempt_id)
    return ExpiryPage(len(listed), expired)


async def _expire_one(conn: AsyncConnection[Any], attempt_id: uuid.UUID) -> int:
    async with command_transaction(conn, durable_answer=False) as tx:
        got = await tx.execute("lock.advisory", _TRY_ADVISORY, (str(attempt_id),), scalar_row)
        locked = await tx.execute(
            "lock.expiring", _LOCK_FOR_EXPIRY, (attempt_id,), kwargs_row(_Expiring)
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        if not await got.fetchone():
            return 0  # a command holds this Attempt right now; the next cycle decides
        row = await locked.fetchone()
        now_ms: int = await now.fetchone() or 0
        if row is None or row.lease_status != "leased" or row.expires_at_ms > now_ms:
            return 0  # renewed or ended since it was listed
        plan = plan_expiry(
            RunState(row.run_state), AttemptState(row.attempt_state), row.cancel_reason
        )
        values = {"attempt_id": attempt_id, "run_id": row.run_id, "now": now_ms}
        await tx.execute("lease.expire", _EXPIRE_LEASE, values)
        events: list[NewEvent] = []
        if plan.attempt_lost:
            await tx.execute("attempt.lost", _ATTEMPT_LOST, {**values, "error_code": LEASE_EXPIRED})
            events.append(
                NewEvent(
                    "attempt.lost",
                    attempt_id,
                    {"state": "lost", "error_code": LEASE_EXPIRED},
                    event_id=derived_event_id(
                        "qinglong.expiry.attempt", attempt_id, row.expires_at_ms
                    ),
                )
            )
        run_state = plan.run_state or RunState(row.run_state)
        if plan.run_state is not None:
            events.append(
                NewEvent(
                    f"run.{plan.run_state.value}",
                    attempt_id,
                    {"from_state": row.run_state, "to_state": plan.run_state.value},
                    event_id=derived_event_id("qinglong.expiry.run", attempt_id, row.expires_at_ms),
                )
            )
        if events or run_state.value != row.run_state:
            await append_events(tx, row.run_id, row.event_sequence, EXPIRY, now_ms, events)
            await tx.execute(
                "run.after_expiry",
                _RUN_AFTER_EXPIRY,
                {**values, "run_state": run_state.value},
            )
        return 1
