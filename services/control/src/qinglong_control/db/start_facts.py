"""The three start facts as transactions: `starting`, `running`, `start-failure`.

Each is one function and one transaction: lock the present in the fixed order (round
trip 1), let the domain decide, then write every row and Event and COMMIT (round trip 2).
A replay writes nothing. A refusal writes nothing.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, TypeVar

from psycopg import AsyncConnection, AsyncCursor

from qinglong_control.db.authority import lock_authority
from qinglong_control.db.command_tx import CommandTx, FaultPlan, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.completion import CompletionDecision
from qinglong_control.domain.fence import Fence, Present, check_identity
from qinglong_control.domain.start_facts import (
    RunningDecision,
    RunningReport,
    StartFailureDecision,
    StartingDecision,
    decide_running,
    decide_start_failure,
    decide_starting,
)
from qinglong_control.domain.states import RunState

_ATTEMPT_STARTING = SQL["start_facts.attempt_starting"]

_RUN_STARTING = SQL["start_facts.run_starting"]

_ATTEMPT_RUNNING = SQL["start_facts.attempt_running"]

_RUN_RUNNING = SQL["start_facts.run_running"]

_ATTEMPT_START_FAILED = SQL["start_facts.attempt_start_failed"]

RUN_AFTER_ATTEMPT = SQL["start_facts.run_after_attempt"]


def run_after_attempt(
    run_state: RunState, run_error_code: str | None, retry_at_ms: int | None, now_ms: int
) -> dict[str, object]:
    """The Run's part of RUN_AFTER_ATTEMPT's parameters."""
    return {
        "run_state": run_state.value,
        "finished": now_ms if run_state.is_terminal else None,
        "run_error_code": run_error_code,
        "retry_at": retry_at_ms,
    }


def run_changed_event(
    attempt_id: uuid.UUID,
    from_state: RunState,
    to_state: RunState,
    error_code: str | None,
    retry_at_ms: int | None,
    attempt_number: int,
) -> NewEvent:
    """`run.<state>` after an Attempt ended; a wait for a retry says until when."""
    payload: dict[str, object] = {
        "from_state": from_state.value,
        "to_state": to_state.value,
        "error_code": error_code,
        "attempt_number": attempt_number,
    }
    if retry_at_ms is not None:
        payload["retry_at_ms"] = retry_at_ms
    return NewEvent(f"run.{to_state.value}", attempt_id, payload)


COMPLETE_LEASE = SQL["start_facts.complete_lease"]

_ENDING_OF_ATTEMPT = SQL["start_facts.ending_of_attempt"]

Ending = TypeVar("Ending", StartFailureDecision, CompletionDecision)


async def queue_ending_read(tx: CommandTx, fence: Fence) -> AsyncCursor[tuple[Any, ...]]:
    """Queue the read of what the fenced Attempt's ending made of its Run, for a replay's
    answer (R-FAIL-2, R-W-6: the same answer as the first call). It travels with COMMIT:
    read it with :func:`as_first_answered` after the transaction."""
    return await tx.execute(
        "run.ending_of_attempt",
        _ENDING_OF_ATTEMPT,
        {"run_id": fence.run_id, "attempt_id": fence.attempt_id},
    )


async def as_first_answered(replay: Ending, ending: AsyncCursor[tuple[Any, ...]]) -> Ending:
    """The replay's decision with the Run's state and code its ending gave it, not the
    Run's present ones (which a retry or a cancel may have changed since)."""
    row = await ending.fetchone()
    if row is None:  # an ending always appends its Event; nothing better to answer
        return replay
    run_state, run_error_code = row
    return dataclasses.replace(replay, run_state=RunState(run_state), run_error_code=run_error_code)


def _worker(fence: Fence) -> Actor:
    return Actor("worker", fence.worker_id)


async def acknowledge_starting(
    conn: AsyncConnection[Any], fence: Fence, fault: FaultPlan | None = None
) -> StartingDecision:
    async with command_transaction(conn, fault, durable_answer=False) as tx:
        present = check_identity(fence, await lock_authority(tx, fence))
        decision = decide_starting(fence, present)
        if not decision.writes:
            return decision
        values = {
            "now": present.now_ms,
            "deadline": decision.deadline_at_ms,
            "attempt_id": fence.attempt_id,
            "run_id": fence.run_id,
        }
        await tx.execute("attempt.starting", _ATTEMPT_STARTING, values)
        await append_events(
            tx,
            fence.run_id,
            present.run.event_sequence,
            _worker(fence),
            present.now_ms,
            [
                NewEvent(
                    "attempt.starting",
                    fence.attempt_id,
                    {"timeout_ms": decision.timeout_ms, "deadline_at_ms": decision.deadline_at_ms},
                )
            ],
        )
        await tx.execute("run.starting", _RUN_STARTING, values)
        return decision


async def acknowledge_running(
    conn: AsyncConnection[Any],
    fence: Fence,
    report: RunningReport,
    fault: FaultPlan | None = None,
) -> RunningDecision:
    async with command_transaction(conn, fault, durable_answer=False) as tx:
        present = check_identity(fence, await lock_authority(tx, fence))
        decision = decide_running(fence, present, report)
        if not decision.writes:
            return decision
        values = {
            "now": present.now_ms,
            "handle": report.executor_handle,
            "log_artifact_id": report.log_artifact_id,
            "callback_sequence": report.callback_sequence,
            "callback_token_digest": report.callback_token_digest.hex,
            "attempt_id": fence.attempt_id,
            "run_id": fence.run_id,
        }
        await tx.execute("attempt.running", _ATTEMPT_RUNNING, values)
        await append_events(
            tx,
            fence.run_id,
            present.run.event_sequence,
            _worker(fence),
            present.now_ms,
            [
                NewEvent(
                    "attempt.running",
                    fence.attempt_id,
                    {"started_at_ms": present.now_ms, "log_artifact_id": report.log_artifact_id},
                ),
                NewEvent(
                    "run.running",
                    fence.attempt_id,
                    {"from_state": RunState.DISPATCHING.value, "to_state": RunState.RUNNING.value},
                ),
            ],
        )
        await tx.execute("run.running", _RUN_RUNNING, values)
        return decision


async def report_start_failure(
    conn: AsyncConnection[Any],
    fence: Fence,
    error_summary: str,
    fault: FaultPlan | None = None,
) -> StartFailureDecision:
    async with command_transaction(conn, fault, durable_answer=False) as tx:
        present = check_identity(fence, await lock_authority(tx, fence))
        decision = decide_start_failure(fence, present)
        if decision.writes:
            await _write_start_failure(tx, fence, present, decision, error_summary)
            return decision
        ending = await queue_ending_read(tx, fence)
    return await as_first_answered(decision, ending)


async def _write_start_failure(
    tx: CommandTx,
    fence: Fence,
    present: Present,
    decision: StartFailureDecision,
    error_summary: str,
) -> None:
    attempt_values = {
        "now": present.now_ms,
        "state": decision.attempt_state.value,
        "error_code": decision.error_code,
        "summary": error_summary,
        "lease_version": decision.completed_lease_version,
        "attempt_id": fence.attempt_id,
        "run_id": fence.run_id,
    }
    lease_values = {
        "now": present.now_ms,
        "version": decision.completed_lease_version,
        "attempt_id": fence.attempt_id,
    }
    events = [
        NewEvent(
            f"attempt.{decision.attempt_state.value}",
            fence.attempt_id,
            {
                "state": decision.attempt_state.value,
                "error_code": decision.error_code,
                "summary": error_summary,
            },
        ),
        run_changed_event(
            fence.attempt_id,
            RunState.DISPATCHING,
            decision.run_state,
            decision.run_error_code,
            decision.retry_at_ms,
            present.attempt.attempt_number,
        ),
    ]
    run_values = {
        **attempt_values,
        **run_after_attempt(
            decision.run_state, decision.run_error_code, decision.retry_at_ms, present.now_ms
        ),
    }
    await tx.execute("attempt.start_failed", _ATTEMPT_START_FAILED, attempt_values)
    await append_events(
        tx, fence.run_id, present.run.event_sequence, _worker(fence), present.now_ms, events
    )
    await tx.execute("run.start_failed", RUN_AFTER_ATTEMPT, run_values)
    await tx.execute("lease.complete", COMPLETE_LEASE, lease_values)
