"""Triggering Runs and reading them back with their Event timeline."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Final

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row
from psycopg.types.json import Jsonb

from qinglong_control.db.command_tx import command_transaction
from qinglong_control.db.concurrency_slots import admit_waiting_runs
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.concurrency_limit import state_when_triggered
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings
from qinglong_control.paging import keyset_page, read_limit


@dataclass(frozen=True)
class RunView:
    run_id: uuid.UUID
    project_id: str
    task_id: uuid.UUID
    revision_id: uuid.UUID
    revision_number: int
    state: str
    attempt_count: int
    latest_attempt_id: uuid.UUID | None
    latest_attempt_state: str | None
    version: int
    event_sequence: int
    cancel_reason: str | None
    cancel_requested_at_ms: int | None
    deadline_at_ms: int | None
    created_at_ms: int
    started_at_ms: int | None
    finished_at_ms: int | None
    error_code: str | None
    retry_at_ms: int | None
    max_attempts: int
    priority: int = 0
    parameters: dict[str, str] = field(default_factory=dict)
    """Read by get_run only (empty in a listing)."""


@dataclass(frozen=True)
class EventView:
    event_id: uuid.UUID
    run_id: uuid.UUID
    project_id: str
    sequence: int
    event_type: str
    attempt_id: uuid.UUID | None
    actor_kind: str
    actor_id: str
    occurred_at_ms: int
    payload: dict[str, Any]
    actor_name: str | None = None  # a user's or agent's principal name


_GET_RUN = SQL["runs.get_run"]

_LIST_RUNS = SQL["runs.list_runs"]

_LOCK_TRIGGER = SQL["runs.lock_trigger"]

_EXISTING_TRIGGER = SQL["runs.existing_trigger"]

_LOCK_TASK_SHARED = SQL["runs.lock_task_shared"]

_PICK_REVISION = SQL["runs.pick_revision"]

_ACTIVE_PROJECT = SQL["definitions.active_project"]

_DB_NOW = SQL["clock.db_now"]

_INSERT_RUN = SQL["runs.insert_run"]

_LIST_EVENTS = SQL["runs.list_events"]

DEFAULT_TIMINGS: Final = Timings()


@dataclass(frozen=True)
class TriggerRun:
    project_id: str
    task_id: uuid.UUID
    revision_number: int | None
    request_id: str
    parameters: dict[str, str] = field(default_factory=dict)
    priority: int = 0


async def trigger_run(
    conn: AsyncConnection[Any],
    command: TriggerRun,
    actor: Actor,
    timings: Timings = DEFAULT_TIMINGS,
) -> RunView:
    """Queue a Run of a pinned revision in an active project; a retried request returns
    the same Run, and one that names another task, or another revision than the Run
    pinned, or other parameters or priority, is REPLAY_MISMATCH (a retry without a revision number
    matches whichever the first call pinned). A task with a concurrency limit has the Run
    created ``created`` and admits what its free slots allow in the same transaction: the
    Run is queued at once if a slot is free and no Run waits before it (``timings`` gives
    the Workers' stop bound the slot count needs)."""
    values: dict[str, object] = {
        "run_id": uuid.uuid4(),
        "project_id": command.project_id,
        "task_id": command.task_id,
        "revision_number": command.revision_number,
        "request_id": command.request_id,
        "actor_id": actor.id,
        "parameters": Jsonb(command.parameters),
        "priority": command.priority,
        "task_key": str(command.task_id),
    }
    async with command_transaction(conn) as tx:
        await tx.execute("lock.trigger", _LOCK_TRIGGER, values)
        existing = await tx.execute("run.existing", _EXISTING_TRIGGER, values)
        await tx.execute("lock.task_shared", _LOCK_TASK_SHARED, values)
        revision = await tx.execute("revision.pick", _PICK_REVISION, values)
        project = await tx.execute("project.active", _ACTIVE_PROJECT, values)
        now = await tx.execute("db_now", _DB_NOW)
        earlier = await existing.fetchone()
        picked = await revision.fetchone()
        active = await project.fetchone() is not None
        now_row = await now.fetchone()
        assert now_row is not None
        if earlier is not None:
            run_id, task_id, pinned, parameters, priority = earlier
            if task_id != command.task_id or command.revision_number not in (None, pinned):
                raise Refused(
                    Reason.REPLAY_MISMATCH, "request_id triggered a Run of another task or revision"
                )
            if parameters != command.parameters:
                raise Refused(
                    Reason.REPLAY_MISMATCH, "request_id triggered a Run with other parameters"
                )
            if priority != command.priority:
                raise Refused(
                    Reason.REPLAY_MISMATCH, "request_id triggered a Run of another priority"
                )
            values["run_id"] = run_id
        else:
            if not active:
                # Disabled (its Runs are being stopped): it starts no new one. A retry of
                # an earlier trigger still answers that Run, above.
                raise Refused(Reason.PROJECT_NOT_FOUND, "no such active project")
            if picked is None:
                raise Refused(Reason.TASK_NOT_FOUND, "no such task")
            if picked[0] is None:
                raise Refused(Reason.REVISION_NOT_FOUND, "no such task revision")
            task_limit = picked[2]
            state = state_when_triggered(task_limit)
            values.update(
                revision_id=picked[0], executor_type=picked[1], now=now_row[0], state=state.value
            )
            await tx.execute("run.insert", _INSERT_RUN, values)
            first = (
                NewEvent("run.queued", None, {"from_state": "created", "to_state": "queued"})
                if state is RunState.QUEUED
                else NewEvent("run.created", None, {"to_state": "created", "limit": task_limit})
            )
            await append_events(
                tx,
                values["run_id"],  # type: ignore[arg-type]
                0,
                actor,
                now_row[0],
                [first],
            )
            if state is RunState.CREATED:
                await admit_waiting_runs(
                    tx,
                    command.task_id,
                    timings,
                    (values["run_id"], actor),  # type: ignore[arg-type]
                )
    return await get_run(conn, command.project_id, values["run_id"])  # type: ignore[arg-type]


async def get_run(conn: AsyncConnection[Any], project_id: str, run_id: uuid.UUID) -> RunView:
    """Another project's Run and a missing Run look the same: not found."""
    cursor = conn.cursor(row_factory=kwargs_row(RunView))
    await cursor.execute(_GET_RUN, {"project_id": project_id, "run_id": run_id})
    run = await cursor.fetchone()
    if run is None:
        raise Refused(Reason.RUN_NOT_FOUND, "no such run")
    return run


@dataclass(frozen=True)
class RunPage:
    runs: list[RunView]
    next_cursor: tuple[int, uuid.UUID] | None


async def list_runs(
    conn: AsyncConnection[Any],
    project_id: str,
    *,
    limit: int,
    task_id: uuid.UUID | None = None,
    states: tuple[str, ...] = (),
    before: tuple[int, uuid.UUID] | None = None,
) -> RunPage:
    """Newest first, keyset-paginated by (created_at, run_id)."""
    cursor = conn.cursor(row_factory=kwargs_row(RunView))
    await cursor.execute(
        _LIST_RUNS,
        {
            "project_id": project_id,
            "task_id": task_id,
            "states": list(states),
            "before_created": None if before is None else before[0],
            "before_run": None if before is None else before[1],
            "limit": read_limit(limit),
        },
        # Planned with its values each time, never as a prepared generic plan: only then
        # can the planner drop the filters not given and read the index of the one that
        # is (migration 0020) instead of the whole project's history.
        prepare=False,
    )
    page, last = keyset_page(await cursor.fetchall(), limit, _run_key)
    return RunPage(page, last)


def _run_key(run: RunView) -> tuple[int, uuid.UUID]:
    return run.created_at_ms, run.run_id


async def list_events(
    conn: AsyncConnection[Any],
    project_id: str,
    run_id: uuid.UUID,
    *,
    after_sequence: int,
    limit: int,
) -> tuple[list[EventView], RunView]:
    """A page of the Run's Events after ``after_sequence``, then the Run as it is now
    (RUN_NOT_FOUND for another project's or a missing one). The Run is read second: when
    it reads as ended, its last Event is among these or after them, never skipped."""
    events = await events_after(
        conn, project_id, run_id, after_sequence=after_sequence, limit=limit
    )
    return events, await get_run(conn, project_id, run_id)


async def events_after(
    conn: AsyncConnection[Any],
    project_id: str,
    run_id: uuid.UUID,
    *,
    after_sequence: int,
    limit: int,
) -> list[EventView]:
    """The Events alone (none for another project's Run): one statement."""
    cursor = conn.cursor(row_factory=kwargs_row(EventView))
    await cursor.execute(
        _LIST_EVENTS,
        {
            "project_id": project_id,
            "run_id": run_id,
            "after_sequence": after_sequence,
            "limit": limit,
        },
    )
    return list(await cursor.fetchall())
