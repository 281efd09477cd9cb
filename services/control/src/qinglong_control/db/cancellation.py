"""User cancellation as one short serializable transaction (SPEC R-CAN-3).

Order: the project's advisory lock (shared; an administrator changing bindings takes it
exclusively, see admin.grant_role), the project and the caller's current binding,
the Run FOR UPDATE, DB time — then the intent, the Run's version and event sequence and
one actor-bound `run.cancel_requested` Event. The runtime role may not lock identity
rows, hence the advisory lock; SERIALIZABLE makes the reads and the write one decision.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.admin import PROJECT_LOCK
from qinglong_control.db.command_tx import (
    CommandTx,
    ConnectionSource,
    command_transaction,
    retrying_serialization,
)
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.cancellation import (
    POLICY_REASON,
    USER_REASON,
    BindingSnapshot,
    CancelOutcome,
    CancelTarget,
    PolicyNow,
    check_policy,
    decide_cancel,
)
from qinglong_control.domain.states import RunState

_LOCK_PROJECT_SHARED = SQL["cancellation.lock_project_shared"]

_POLICY_NOW = SQL["cancellation.policy_now"]

_LOCK_RUN = SQL["cancellation.lock_run"]

_DB_NOW = SQL["clock.db_now"]

_WRITE_INTENT = SQL["cancellation.write_intent"]
_RUNS_OF_DISABLED_PROJECTS = SQL["cancellation.runs_of_disabled_projects"]

#: Who stops the Runs of a project an administrator disabled.
PROJECT_DISABLED = Actor("reconciler", "project-disabled")


@dataclass(frozen=True)
class LockedRun:
    """A Run as a cancellation (or an approval executing one) locked it."""

    state: str
    cancel_reason: str | None
    event_sequence: int

    @property
    def takes_events(self) -> bool:
        """A terminal Run accepts no later write, not even an Event."""
        return not RunState(self.state).is_terminal

    @property
    def target(self) -> CancelTarget:
        return CancelTarget(RunState(self.state), self.cancel_reason)


@dataclass(frozen=True)
class CancelRequest:
    project_id: str
    run_id: uuid.UUID
    mutation_id: str
    actor: Actor
    principal_id: uuid.UUID
    snapshot: BindingSnapshot


async def cancel_run(source: ConnectionSource, request: CancelRequest) -> CancelOutcome:
    """Record the intent, retrying a serialization conflict a bounded number of times
    (R-CAN-6): the first commit answers `accepted`, every other `already_requested`."""
    return await retrying_serialization(source, lambda conn: _cancel_once(conn, request))


async def _cancel_once(conn: AsyncConnection[Any], request: CancelRequest) -> CancelOutcome:
    values = {
        "project_id": request.project_id,
        "run_id": request.run_id,
        "principal_id": request.principal_id,
        "actor_id": request.actor.id,
    }
    async with command_transaction(conn, serializable=True) as tx:
        await tx.execute("lock.project", _LOCK_PROJECT_SHARED, (PROJECT_LOCK, request.project_id))
        policy = await tx.execute("policy.now", _POLICY_NOW, values, kwargs_row(PolicyNow))
        locked = await tx.execute("lock.run", _LOCK_RUN, values, kwargs_row(LockedRun))
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        check_policy(request.snapshot, await policy.fetchone())
        run = await locked.fetchone()
        target = None if run is None else run.target
        now_ms: int = await now.fetchone() or 0
        outcome, events = await record_intent(
            tx, request.run_id, target, request.actor, now_ms, request.mutation_id
        )
        if events:
            assert run is not None
            await append_events(
                tx, request.run_id, run.event_sequence, request.actor, now_ms, events
            )
        return outcome


async def record_intent(
    tx: CommandTx,
    run_id: uuid.UUID,
    target: CancelTarget | None,
    actor: Actor,
    now_ms: int,
    mutation_id: str,
    approval_id: uuid.UUID | None = None,
    reason: str = USER_REASON,
) -> tuple[CancelOutcome, list[NewEvent]]:
    """Decide and write the intent on the locked Run ``target``; return the outcome and
    the Event the caller appends (with any of its own, in one sequence). An approved
    cancellation names the approval it executes. ``reason`` is ``user`` for a person's
    (or an approved Agent's) cancel — callers can claim no other (R-CAN-1) —, ``policy``
    for a stop the control plane decides."""
    outcome = decide_cancel(target)
    if outcome is not CancelOutcome.ACCEPTED:
        return outcome, []
    values = {"run_id": run_id, "actor_id": actor.id, "now": now_ms, "reason": reason}
    await tx.execute("run.cancel_intent", _WRITE_INTENT, values)
    payload: dict[str, object] = {"reason": reason, "requested_at_ms": now_ms}
    if approval_id is not None:
        payload["approval_id"] = str(approval_id)
    # One intent per mutation id: a retried mutation can never add an Event.
    event = NewEvent(
        "run.cancel_requested", None, payload, dedupe_key=f"cancel:{run_id}:{mutation_id}"
    )
    return outcome, [event]


async def stop_runs_of_disabled_projects(conn: AsyncConnection[Any], limit: int) -> int:
    """One bounded step: a stop intent on each Run still going in a disabled project (at
    most ``limit``), as a user's cancel would write it but for its reason (``policy``:
    nobody asked), by ``PROJECT_DISABLED``. Nothing
    of a disabled project may go on running, and none of its people can cancel any more
    (every cancel path needs an active project). Convergence then ends queued and waiting
    Runs; a running Attempt's Worker is told to stop at its next lease control. Returns
    how many Runs got an intent."""
    async with command_transaction(conn, durable_answer=False) as tx:
        page = await tx.execute(
            "runs.of_disabled_projects", _RUNS_OF_DISABLED_PROJECTS, {"limit": limit}
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        found = await page.fetchall()
        now_ms: int = await now.fetchone() or 0
        for run_id, state, cancel_reason, event_sequence in found:
            run = LockedRun(state, cancel_reason, event_sequence)
            _, events = await record_intent(
                tx,
                run_id,
                run.target,
                PROJECT_DISABLED,
                now_ms,
                "project-disabled",
                reason=POLICY_REASON,
            )
            await append_events(tx, run_id, run.event_sequence, PROJECT_DISABLED, now_ms, events)
    return len(found)
