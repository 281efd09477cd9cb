"""Tasks and their immutable execution revisions."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from psycopg import AsyncConnection, errors
from psycopg.rows import kwargs_row, scalar_row
from psycopg.types.json import Jsonb

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.retry_policy import retry_on_names, retry_policy_of
from qinglong_control.db.sql import SQL
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import NO_RETRY, RetryPolicy
from qinglong_control.paging import keyset_page, read_limit


@dataclass(frozen=True)
class TaskView:
    task_id: uuid.UUID
    project_id: str
    display_name: str
    labels: dict[str, str]
    latest_revision_number: int
    created_at_ms: int


@dataclass(frozen=True)
class TaskPage:
    tasks: list[TaskView]
    next_cursor: tuple[int, uuid.UUID] | None
    """`(created_at_ms, task_id)` of the page's last Task when the page is full."""


@dataclass(frozen=True)
class RevisionView:
    revision_id: uuid.UUID
    task_id: uuid.UUID
    project_id: str
    revision_number: int
    executor_type: str
    command: list[str]
    timeout_ms: int | None
    created_at_ms: int
    retry_policy: RetryPolicy = NO_RETRY
    worker_selector: dict[str, str] = field(default_factory=dict)
    queue_timeout_ms: int | None = None
    max_concurrent_runs: int | None = None

    @property
    def plan(self) -> RevisionPlan:
        return RevisionPlan(
            self.executor_type,
            self.command,
            self.timeout_ms,
            self.retry_policy,
            self.worker_selector,
            self.queue_timeout_ms,
            self.max_concurrent_runs,
        )


def _revision_view(**columns: Any) -> RevisionView:
    policy = retry_policy_of(columns)  # pops the policy columns first
    return RevisionView(**columns, retry_policy=policy)


_LOCK_CREATE_TASK = SQL["definitions.lock_create_task"]

_EXISTING_TASK = SQL["definitions.existing_task"]

_ACTIVE_PROJECT = SQL["definitions.active_project"]

_INSERT_TASK = SQL["definitions.insert_task"]

_GET_TASK = SQL["definitions.get_task"]

_LIST_TASKS = SQL["definitions.list_tasks"]

_LOCK_TASK = SQL["definitions.lock_task"]

_EXISTING_REVISION = SQL["definitions.existing_revision"]
_CREATED_THE_TASK = SQL["definitions.created_the_task"]

_INSERT_REVISION = SQL["definitions.insert_revision"]

_GET_REVISION = SQL["definitions.get_revision"]


@dataclass(frozen=True)
class RevisionPlan:
    """What a revision runs."""

    executor_type: str
    command: list[str]
    timeout_ms: int | None
    retry_policy: RetryPolicy = NO_RETRY
    #: Labels a Worker's session must have to be offered the revision's Runs.
    worker_selector: dict[str, str] = field(default_factory=dict)
    #: How long each of its Runs may wait queued before it ends QUEUE_TIMED_OUT.
    queue_timeout_ms: int | None = None
    #: At most how many Runs of the task may hold a slot when one of its Runs is queued.
    max_concurrent_runs: int | None = None

    @classmethod
    def of(cls, revision: NewRevision) -> RevisionPlan:
        return cls(
            revision.executor_type,
            revision.command,
            revision.timeout_ms,
            revision.retry_policy,
            revision.worker_selector,
            revision.queue_timeout_ms,
            revision.max_concurrent_runs,
        )


@dataclass(frozen=True)
class NewRevision:
    project_id: str
    task_id: uuid.UUID
    request_id: str
    executor_type: str
    command: list[str]
    timeout_ms: int | None
    retry_policy: RetryPolicy = NO_RETRY
    worker_selector: dict[str, str] = field(default_factory=dict)
    queue_timeout_ms: int | None = None
    max_concurrent_runs: int | None = None

    @classmethod
    def of(
        cls, project_id: str, task_id: uuid.UUID, request_id: str, plan: RevisionPlan
    ) -> NewRevision:
        return cls(
            project_id,
            task_id,
            request_id,
            plan.executor_type,
            plan.command,
            plan.timeout_ms,
            plan.retry_policy,
            plan.worker_selector,
            plan.queue_timeout_ms,
            plan.max_concurrent_runs,
        )


def _revision_values(revision: NewRevision, actor: str) -> dict[str, object]:
    policy = revision.retry_policy
    return {
        "revision_id": uuid.uuid4(),
        "project_id": revision.project_id,
        "task_id": revision.task_id,
        "request_id": revision.request_id,
        "executor_type": revision.executor_type,
        "command": Jsonb(revision.command),
        "timeout_ms": revision.timeout_ms,
        "retry_max_attempts": policy.max_attempts,
        "retry_initial_backoff_ms": policy.initial_backoff_ms,
        "retry_max_backoff_ms": policy.max_backoff_ms,
        "retry_multiplier_percent": policy.multiplier_percent,
        "retry_on": retry_on_names(policy),
        "worker_selector": Jsonb(revision.worker_selector),
        "queue_timeout_ms": revision.queue_timeout_ms,
        "max_concurrent_runs": revision.max_concurrent_runs,
        "actor": actor,
    }


async def create_task(
    conn: AsyncConnection[Any],
    project_id: str,
    display_name: str,
    labels: dict[str, str],
    request_id: str,
    actor: str,
    first_plan: RevisionPlan | None = None,
) -> TaskView:
    """Create a task, and with `first_plan` its revision 1 in the same transaction (a
    refused plan leaves no task behind). A retried request (same project and request id)
    returns the same task, whose revision 1 is the one the first call created; a retry
    that asks for anything else (another name, labels or first plan) is REPLAY_MISMATCH."""
    task_id = uuid.uuid4()
    values = {
        "task_id": task_id,
        "project_id": project_id,
        "display_name": display_name,
        "labels": Jsonb(labels),
        "request_id": request_id,
        "actor": actor,
    }
    try:
        async with command_transaction(conn) as tx:
            await tx.execute("lock.create_task", _LOCK_CREATE_TASK, values)
            existing = await tx.execute("task.existing", _EXISTING_TASK, values, scalar_row)
            project = await tx.execute("project.active", _ACTIVE_PROJECT, values)
            earlier = await existing.fetchone()
            if earlier is not None:
                task_id = earlier
                await _check_replayed_task(tx, project_id, task_id, values, first_plan)
            elif await project.fetchone() is None:
                raise Refused(Reason.PROJECT_NOT_FOUND, "no such active project")
            else:
                # Both inserts travel with COMMIT (two round trips in all); a CHECK that
                # refuses the revision rolls the task back with it.
                await tx.execute("task.insert", _INSERT_TASK, values)
                if first_plan is not None:
                    first = NewRevision.of(project_id, task_id, request_id, first_plan)
                    await tx.execute(
                        "revision.insert", _INSERT_REVISION, _revision_values(first, actor)
                    )
    except errors.CheckViolation:
        raise Refused(Reason.FIELD_INVALID, "the task or its plan is out of bounds") from None
    return await get_task(conn, project_id, task_id)


async def _check_replayed_task(
    tx: CommandTx,
    project_id: str,
    task_id: uuid.UUID,
    values: dict[str, Any],
    first_plan: RevisionPlan | None,
) -> None:
    """A retried CreateTask must ask for what the first call created: the same name and
    labels, and the same first plan (or none, as the first call had none)."""
    found = await tx.execute(
        "task.get", _GET_TASK, {"project_id": project_id, "task_id": task_id},
        kwargs_row(TaskView),
    )  # fmt: skip
    first = await tx.execute(
        "revision.existing",
        _EXISTING_REVISION,
        {"project_id": project_id, "task_id": task_id, "request_id": values["request_id"]},
        kwargs_row(_revision_view),
    )
    task = await found.fetchone()
    revision = await first.fetchone()
    assert task is not None  # found by its request id in this transaction
    same = (
        task.display_name == values["display_name"]
        and task.labels == values["labels"].obj
        and (None if revision is None else revision.plan) == first_plan
    )
    if not same:
        raise Refused(
            Reason.REPLAY_MISMATCH, "request_id was used for another task or first revision"
        )


async def get_task(conn: AsyncConnection[Any], project_id: str, task_id: uuid.UUID) -> TaskView:
    cursor = conn.cursor(row_factory=kwargs_row(TaskView))
    await cursor.execute(_GET_TASK, {"project_id": project_id, "task_id": task_id})
    task = await cursor.fetchone()
    if task is None:
        raise Refused(Reason.TASK_NOT_FOUND, "no such task")
    return task


async def list_tasks(
    conn: AsyncConnection[Any],
    project_id: str,
    *,
    limit: int,
    before: tuple[int, uuid.UUID] | None = None,
) -> TaskPage:
    """Newest first, keyset-paginated by (created_at, task_id)."""
    cursor = conn.cursor(row_factory=kwargs_row(TaskView))
    await cursor.execute(
        _LIST_TASKS,
        {
            "project_id": project_id,
            "before_created": None if before is None else before[0],
            "before_task": None if before is None else before[1],
            "limit": read_limit(limit),
        },
    )
    page, last = keyset_page(await cursor.fetchall(), limit, _task_key)
    return TaskPage(page, last)


def _task_key(task: TaskView) -> tuple[int, uuid.UUID]:
    return task.created_at_ms, task.task_id


async def create_revision(
    conn: AsyncConnection[Any], revision: NewRevision, actor: str
) -> RevisionView:
    """Append revision n+1. Revisions are immutable: nothing can update them later."""
    values = _revision_values(revision, actor)
    async with command_transaction(conn) as tx:
        await tx.execute("lock.task", _LOCK_TASK, (str(revision.task_id),))
        existing = await tx.execute(
            "revision.existing", _EXISTING_REVISION, values, kwargs_row(_revision_view)
        )
        task_made = await tx.execute("task.created_by_request", _CREATED_THE_TASK, values)
        if await task_made.fetchone() is not None:
            raise Refused(Reason.REPLAY_MISMATCH, "request_id was used to create the task")
        earlier = await existing.fetchone()
        if earlier is not None:
            if earlier.plan != RevisionPlan.of(revision):
                raise Refused(
                    Reason.REPLAY_MISMATCH, "request_id was used for a revision of another plan"
                )
            return earlier  # the replayed revision, as the first call made it
        try:
            inserted = await tx.execute("revision.insert", _INSERT_REVISION, values)
            row = await inserted.fetchone()
        except errors.CheckViolation:
            raise Refused(Reason.FIELD_INVALID, "plan is out of bounds") from None
        if row is None:
            raise Refused(Reason.TASK_NOT_FOUND, "no such task")
    return await get_revision(conn, revision.project_id, revision.task_id, revision_id=row[0])


async def get_revision(
    conn: AsyncConnection[Any],
    project_id: str,
    task_id: uuid.UUID,
    *,
    revision_number: int | None = None,
    revision_id: uuid.UUID | None = None,
) -> RevisionView:
    cursor = conn.cursor(row_factory=kwargs_row(_revision_view))
    await cursor.execute(
        _GET_REVISION,
        {
            "project_id": project_id,
            "task_id": task_id,
            "revision_number": revision_number,
            "revision_id": revision_id,
        },
    )
    found = await cursor.fetchone()
    if found is None:
        raise Refused(Reason.REVISION_NOT_FOUND, "no such revision")
    return found
