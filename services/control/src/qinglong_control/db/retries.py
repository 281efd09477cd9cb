"""The retry step of the reconcile cadence (SPEC R-RETRY-2), one page per transaction.

Two kinds of candidates, both without a cancel intent (an intent always wins; those Runs
are convergence's) and locked with FOR UPDATE SKIP LOCKED, so any number of control
replicas share them with no claim table:

* `lost` Runs: their newest Attempt's lease expired. With budget left they wait in
  `retry_wait` until the policy's backoff, and never less than one lease lifetime after
  that lease expired; otherwise they end `failed` / ATTEMPTS_EXHAUSTED.
* `retry_wait` Runs whose `retry_at` passed (DB time): back to `queued`, where placement
  offers them again and the next claim creates Attempt n+1 with lease generation n+1.

Every step appends its `run.<state>` Event in the same transaction. The Run's row lock
and the state re-checked under it are what keep a step from happening twice.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.retry_policy import retry_policy_of
from qinglong_control.db.sql import SQL
from qinglong_control.domain.retry import Ending, RetryPolicy, decide_retry
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings

RETRY = Actor("reconciler", "retry")

_DB_NOW = SQL["clock.db_now"]

_LOCK_LOST = SQL["retries.lock_lost"]

_LOCK_DUE = SQL["retries.lock_due"]

_RUN_WAITS = SQL["retries.run_waits"]

_RUN_EXHAUSTED = SQL["retries.run_exhausted"]

_RUN_REQUEUED = SQL["retries.run_requeued"]


@dataclass(frozen=True)
class _Lost:
    run_id: uuid.UUID
    state: str
    event_sequence: int
    attempt_id: uuid.UUID | None
    attempt_number: int | None
    lease_expired_at_ms: int | None
    started_attempts: int
    retry_policy: RetryPolicy


def _lost_row(**columns: Any) -> _Lost:
    policy = retry_policy_of(columns)  # pops the policy columns first
    return _Lost(**columns, retry_policy=policy)


@dataclass(frozen=True)
class _Due:
    run_id: uuid.UUID
    event_sequence: int
    attempt_count: int
    retry_at_ms: int


@dataclass(frozen=True)
class RetryPage:
    candidates: int
    scheduled: int
    exhausted: int
    requeued: int


async def retry_page(conn: AsyncConnection[Any], limit: int, timings: Timings) -> RetryPage:
    """Move at most `limit` lost Runs and `limit` due Runs on; one transaction."""
    if not 1 <= limit <= 128:
        raise ValueError("a retry page holds 1..128 Runs")
    async with command_transaction(conn, durable_answer=False) as tx:
        lost_cursor = await tx.execute(
            "lock.lost", _LOCK_LOST, {"limit": limit}, kwargs_row(_lost_row)
        )
        due_cursor = await tx.execute("lock.due", _LOCK_DUE, {"limit": limit}, kwargs_row(_Due))
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        lost = list(await lost_cursor.fetchall())
        due = list(await due_cursor.fetchall())
        now_ms: int = await now.fetchone() or 0
        scheduled = exhausted = 0
        for run in lost:
            if await _after_lost(tx, run, now_ms, timings):
                scheduled += 1
            else:
                exhausted += 1
        for waiting in due:
            await _requeue(tx, waiting, now_ms)
    return RetryPage(max(len(lost), len(due)), scheduled, exhausted, len(due))


async def _after_lost(tx: CommandTx, run: _Lost, now_ms: int, timings: Timings) -> bool:
    """Schedule the retry of a lost Run (True) or end it exhausted (False)."""
    decision = decide_retry(
        run.retry_policy,
        Ending.LOST,
        run.started_attempts,
        now_ms,
        lease_expired_at_ms=run.lease_expired_at_ms,
        lost_executor_stop_ms=timings.lost_executor_stop_ms,
    )
    values = {
        "run_id": run.run_id,
        "now": now_ms,
        "retry_at": decision.retry_at_ms,
        "error_code": decision.error_code,
    }
    to_state = RunState.RETRY_WAIT if decision.retries else RunState.FAILED
    payload: dict[str, object] = {
        "from_state": RunState.LOST.value,
        "to_state": to_state.value,
        "error_code": decision.error_code,
        "attempt_number": run.attempt_number or 0,
    }
    if decision.retries:
        payload["retry_at_ms"] = decision.retry_at_ms
    event = NewEvent(f"run.{to_state.value}", run.attempt_id, payload)
    await append_events(tx, run.run_id, run.event_sequence, RETRY, now_ms, [event])
    if decision.retries:
        await tx.execute("run.retry_wait", _RUN_WAITS, values)
    else:
        await tx.execute("run.exhausted", _RUN_EXHAUSTED, values)
    return decision.retries


async def _requeue(tx: CommandTx, run: _Due, now_ms: int) -> None:
    event = NewEvent(
        "run.queued",
        None,
        {
            "from_state": RunState.RETRY_WAIT.value,
            "to_state": RunState.QUEUED.value,
            "attempt_number": run.attempt_count + 1,
        },
    )
    await append_events(tx, run.run_id, run.event_sequence, RETRY, now_ms, [event])
    await tx.execute("run.requeue", _RUN_REQUEUED, {"run_id": run.run_id, "now": now_ms})
