"""Lease control and completion as transactions (same lock order, two round trips)."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection

from qinglong_control.db.authority import lock_authority
from qinglong_control.db.command_tx import CommandTx, FaultPlan, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.db.start_facts import (
    COMPLETE_LEASE,
    RUN_AFTER_ATTEMPT,
    as_first_answered,
    queue_ending_read,
    run_after_attempt,
    run_changed_event,
)
from qinglong_control.domain.completion import (
    CompletionDecision,
    CompletionReport,
    decide_completion,
)
from qinglong_control.domain.fence import Fence, Present, check_identity
from qinglong_control.domain.lease_control import LeaseDecision, decide_lease_control
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings

_RENEW_LEASE = SQL["lease_control.renew_lease"]

_PROJECT_LEASE_VERSION = SQL["lease_control.project_lease_version"]

_TIMEOUT_INTENT = SQL["lease_control.timeout_intent"]

_ATTEMPT_COMPLETED = SQL["lease_control.attempt_completed"]

_SHUTDOWN_INTENT = SQL["lease_control.shutdown_intent"]


async def control_lease(
    conn: AsyncConnection[Any], fence: Fence, timings: Timings, fault: FaultPlan | None = None
) -> LeaseDecision:
    async with command_transaction(conn, fault, durable_answer=False) as tx:
        present = check_identity(fence, await lock_authority(tx, fence))
        decision = decide_lease_control(fence, present)
        if not decision.writes:
            return decision
        values = {
            "version": decision.new_lease_version,
            "now": present.now_ms,
            "expires": present.now_ms + timings.lease_ttl_ms,
            "attempt_id": fence.attempt_id,
            "run_id": fence.run_id,
        }
        await tx.execute("lease.renew", _RENEW_LEASE, values)
        await tx.execute("attempt.lease_version", _PROJECT_LEASE_VERSION, values)
        if decision.writes_timeout_intent:
            await append_events(
                tx,
                fence.run_id,
                present.run.event_sequence,
                Actor("system", "deadline"),
                present.now_ms,
                [
                    NewEvent(
                        "run.cancel_requested",
                        fence.attempt_id,
                        {"reason": "timeout", "requested_at_ms": present.now_ms},
                    )
                ],
            )
            await tx.execute("run.timeout_intent", _TIMEOUT_INTENT, values)
        return decision


async def complete_attempt(
    conn: AsyncConnection[Any],
    fence: Fence,
    report: CompletionReport,
    fault: FaultPlan | None = None,
) -> CompletionDecision:
    async with command_transaction(conn, fault, durable_answer=False) as tx:
        present = check_identity(fence, await lock_authority(tx, fence))
        decision = decide_completion(fence, present, report)
        if decision.writes:
            await _write_completion(tx, fence, present, decision, report)
            return decision
        ending = await queue_ending_read(tx, fence)
    return await as_first_answered(decision, ending)


async def _write_completion(
    tx: CommandTx,
    fence: Fence,
    present: Present,
    decision: CompletionDecision,
    report: CompletionReport,
) -> None:
    values = {
        "attempt_state": decision.attempt_state.value,
        "error_code": decision.error_code,
        "exit_code": report.exit_code,
        "summary": report.summary or None,
        "output_bytes": report.output_bytes,
        "version": decision.completed_lease_version,
        "now": present.now_ms,
        "attempt_id": fence.attempt_id,
        "run_id": fence.run_id,
        "worker_id": fence.worker_id,
        **run_after_attempt(
            decision.run_state, decision.run_error_code, decision.retry_at_ms, present.now_ms
        ),
    }
    events = [
        NewEvent(
            f"attempt.{decision.attempt_state.value}",
            fence.attempt_id,
            {
                "state": decision.attempt_state.value,
                "error_code": decision.error_code,
                "summary": report.summary,
                "exit_code": report.exit_code,
            },
        ),
        run_changed_event(
            fence.attempt_id,
            RunState.RUNNING,
            decision.run_state,
            decision.run_error_code,
            decision.retry_at_ms,
            present.attempt.attempt_number,
        ),
    ]
    if decision.writes_shutdown_intent:
        await tx.execute("run.shutdown_intent", _SHUTDOWN_INTENT, values)
        events.insert(
            0,
            NewEvent(
                "run.cancel_requested",
                fence.attempt_id,
                {"reason": "shutdown", "requested_at_ms": present.now_ms},
            ),
        )
    await tx.execute("attempt.completed", _ATTEMPT_COMPLETED, values)
    await append_events(
        tx,
        fence.run_id,
        present.run.event_sequence,
        Actor("worker", fence.worker_id),
        present.now_ms,
        events,
    )
    await tx.execute("run.completed", RUN_AFTER_ATTEMPT, values)
    await tx.execute("lease.complete", COMPLETE_LEASE, values)
