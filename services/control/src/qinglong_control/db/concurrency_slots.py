"""Admission to a task's slots as transactions (see domain/concurrency_limit.py).

A Run of a task with a concurrency limit is created ``created``. It is admitted (queued)
under its task's advisory lock, after counting the slots the task's Runs hold in a
statement that starts once the lock is held — so two admissions of one task, on any
replicas, count one after the other and never queue more than the limit together:

* by its trigger, in the trigger's transaction: a Run whose task has a free slot (and no
  Run waiting before it) is queued at once, one that has none waits;
* by the reconcile cadence's ``admit`` step, which reads the tasks with waiting Runs a
  page at a time, resuming where its last page ended, and admits, in a transaction per
  task, what each one's free slots allow (a slot freed: a Run ended, its lost executor's
  stop bound passed, or the limit was raised).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.concurrency_limit import WaitingRun, runs_to_admit
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings

#: Who queues a Run that waited for a slot of its task. A Run its own trigger queues at
#: once has the trigger's actor.
ADMISSION = Actor("reconciler", "concurrency-limit")

_LOCK_TASK_SLOTS = SQL["concurrency_slots.lock_task_slots"]

_SLOTS_HELD = SQL["concurrency_slots.slots_held"]

_LOCK_WAITING = SQL["concurrency_slots.lock_waiting"]

_ADMIT = SQL["concurrency_slots.admit"]

_WAITING_TASKS = SQL["concurrency_slots.waiting_tasks"]

_DB_NOW = SQL["clock.db_now"]

#: At most this many Runs of one task are admitted by one transaction; a task with more
#: free slots admits the rest at its next visit (the next cycle's).
_ADMIT_AT_MOST: Final = 128

#: Before the first task id (task ids are random UUIDs; none is the nil UUID).
_FIRST_TASK: Final = uuid.UUID(int=0)


@dataclass(frozen=True)
class _SlotsNow:
    slots_held: int
    task_limit: int | None


async def admit_waiting_runs(
    tx: CommandTx,
    task_id: uuid.UUID,
    timings: Timings,
    triggered: tuple[uuid.UUID, Actor] | None = None,
) -> list[uuid.UUID]:
    """Inside ``tx``: queue the task's waiting Runs its free slots allow, in queue order,
    each with one ``run.queued`` Event (by ``triggered``'s actor for its Run, by
    :data:`ADMISSION` for the others). Returns the Runs queued. DB time is read once the
    task's lock is held (a wait for it must not date the admission earlier)."""
    values = {
        "task_id": task_id,
        "lost_executor_stop_ms": timings.lost_executor_stop_ms,
        "limit": _ADMIT_AT_MOST,
    }
    await tx.execute("lock.task_slots", _LOCK_TASK_SLOTS, values)
    counted = await tx.execute("task.slots_held", _SLOTS_HELD, values, kwargs_row(_SlotsNow))
    locked = await tx.execute("runs.lock_waiting", _LOCK_WAITING, values, kwargs_row(WaitingRun))
    now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
    slots = await counted.fetchone()
    assert slots is not None
    now_ms: int = await now.fetchone() or 0
    admitted = runs_to_admit(slots.task_limit, slots.slots_held, await locked.fetchall())
    for held, run in enumerate(admitted, start=slots.slots_held):
        actor = triggered[1] if triggered and triggered[0] == run.run_id else ADMISSION
        payload = {
            "from_state": RunState.CREATED.value,
            "to_state": RunState.QUEUED.value,
            "slots_held": held,
            "limit": slots.task_limit,
        }
        event = NewEvent("run.queued", None, payload)
        await append_events(tx, run.run_id, run.event_sequence, actor, now_ms, [event])
    if admitted:
        await tx.execute(
            "runs.admit", _ADMIT, {"run_ids": [run.run_id for run in admitted], "now": now_ms}
        )
    return [run.run_id for run in admitted]


@dataclass(frozen=True)
class AdmissionPage:
    listed: int
    """Tasks with waiting Runs the page read: a full page means there may be more."""
    admitted: int


@dataclass
class AdmissionCursor:
    """Where the admit step's next page starts: after the last task its last page read,
    across cycles, back at the first task once a page found no more. A cycle reads at most
    its page limit of tasks, and a task the first pages hold full every cycle cannot keep
    the step from the tasks after it."""

    after: uuid.UUID = field(default=_FIRST_TASK)


@dataclass(frozen=True)
class _WaitingTask:
    task_id: uuid.UUID
    slots_held: int
    task_limit: int | None
    run_id: uuid.UUID | None
    event_sequence: int | None

    def may_admit(self) -> bool:
        """Whether its next waiting Run (none: only cancelled ones wait) would be admitted
        with the slots held when the page read them; the task's own transaction decides."""
        if self.run_id is None or self.event_sequence is None:
            return False
        head = WaitingRun(self.run_id, self.event_sequence)
        return bool(runs_to_admit(self.task_limit, self.slots_held, [head]))


def admission_pages(
    conn: AsyncConnection[Any],
    limit: int,
    timings: Timings,
    cursor: AdmissionCursor | None = None,
) -> Callable[[], Awaitable[AdmissionPage]]:
    """The reconcile step's page: the next ``limit`` (1..128) tasks with waiting Runs after
    ``cursor``, by task id, each admitting what its free slots allow in a transaction of
    its own when the page's read says it may admit one."""
    if not 1 <= limit <= 128:
        raise ValueError("an admission page holds 1..128 tasks")
    position = cursor or AdmissionCursor()

    async def page() -> AdmissionPage:
        read = conn.cursor(row_factory=kwargs_row(_WaitingTask))
        await read.execute(
            _WAITING_TASKS,
            {
                "after": position.after,
                "limit": limit,
                "lost_executor_stop_ms": timings.lost_executor_stop_ms,
            },
        )
        tasks = await read.fetchall()
        admitted = 0
        for task in tasks:
            # Past it before its transaction: a task whose admission fails is retried at
            # the next round, and does not hold back the tasks after it.
            position.after = task.task_id
            if task.may_admit():
                admitted += len(await _admit_task(conn, task.task_id, timings))
        if len(tasks) < limit:
            position.after = _FIRST_TASK
        return AdmissionPage(len(tasks), admitted)

    return page


async def _admit_task(
    conn: AsyncConnection[Any], task_id: uuid.UUID, timings: Timings
) -> list[uuid.UUID]:
    async with command_transaction(conn, durable_answer=False) as tx:
        return await admit_waiting_runs(tx, task_id, timings)
