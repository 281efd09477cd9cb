"""Admission to a task's slots as transactions (see domain/concurrency_limit.py).

A Run of a revision with ``max_concurrent_runs`` is created ``created``. It is admitted
(queued) under its task's advisory lock, after counting the slots the task's Runs hold
in a statement that starts once the lock is held — so two admissions of one task, on any
replicas, count one after the other and never queue more than the limit together:

* by its trigger, in the trigger's transaction: a Run whose task has a free slot is
  queued at once, one that has none waits;
* by the reconcile cadence's ``admit`` step, which finds the tasks whose next waiting
  Run may now be queued (a slot freed: a Run ended, or its lost executor's stop bound
  passed) and admits each in a transaction of its own. A slot that frees is so taken
  within one reconcile interval.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.concurrency_limit import WaitingRun, runs_to_admit
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings

#: Who queues a Run that waited for a slot of its task (a trigger's own admission is the
#: trigger's actor).
ADMISSION = Actor("reconciler", "concurrency-limit")

_LOCK_TASK_SLOTS = SQL["concurrency_slots.lock_task_slots"]

_SLOTS_HELD = SQL["concurrency_slots.slots_held"]

_LOCK_WAITING = SQL["concurrency_slots.lock_waiting"]

_ADMIT = SQL["concurrency_slots.admit"]

_WAITING_TASKS = SQL["concurrency_slots.waiting_tasks"]

_DB_NOW = SQL["clock.db_now"]

#: At most this many Runs of one task are admitted by one transaction; a task with more
#: free slots is visited again (the step's next page, or the next cycle).
_ADMIT_AT_MOST: Final = 128

#: Before the first task id (task ids are random UUIDs; none is the nil UUID).
_FIRST_TASK: Final = uuid.UUID(int=0)


async def admit_waiting_runs(
    tx: CommandTx, task_id: uuid.UUID, timings: Timings, actor: Actor
) -> list[uuid.UUID]:
    """Inside ``tx``: queue the task's waiting Runs its free slots allow, in queue order,
    each with one ``run.queued`` Event. Returns the Runs queued. DB time is read once the
    task's lock is held (a wait for it must not date the admission earlier)."""
    values = {
        "task_id": task_id,
        "lost_executor_stop_ms": timings.lost_executor_stop_ms,
        "limit": _ADMIT_AT_MOST,
    }
    await tx.execute("lock.task_slots", _LOCK_TASK_SLOTS, values)
    held = await tx.execute("task.slots_held", _SLOTS_HELD, values, scalar_row)
    locked = await tx.execute("runs.lock_waiting", _LOCK_WAITING, values, kwargs_row(WaitingRun))
    now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
    slots_held: int = await held.fetchone() or 0
    now_ms: int = await now.fetchone() or 0
    admitted = runs_to_admit(slots_held, await locked.fetchall())
    for run in admitted:
        await append_events(
            tx,
            run.run_id,
            run.event_sequence,
            actor,
            now_ms,
            [
                NewEvent(
                    "run.queued",
                    None,
                    {
                        "from_state": RunState.CREATED.value,
                        "to_state": RunState.QUEUED.value,
                        "slots_held": slots_held + admitted.index(run),
                    },
                )
            ],
        )
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


@dataclass(frozen=True)
class _WaitingTask:
    task_id: uuid.UUID
    slots_held: int
    run_id: uuid.UUID | None
    max_concurrent_runs: int | None
    event_sequence: int | None

    def may_admit(self) -> bool:
        """Whether its next waiting Run (none: only cancelled ones wait) would be admitted
        with the slots held when the page read them; the task's own transaction decides."""
        if self.run_id is None or self.event_sequence is None:
            return False
        head = WaitingRun(self.run_id, self.max_concurrent_runs, self.event_sequence)
        return bool(runs_to_admit(self.slots_held, [head]))


def admission_pages(
    conn: AsyncConnection[Any], limit: int, timings: Timings
) -> Callable[[], Awaitable[AdmissionPage]]:
    """The reconcile step's pages over one cycle: each reads the next ``limit`` (1..128)
    tasks with waiting Runs, by task id, and admits what each one's free slots allow, one
    transaction per task that may admit one."""
    if not 1 <= limit <= 128:
        raise ValueError("an admission page holds 1..128 tasks")
    after = _FIRST_TASK

    async def page() -> AdmissionPage:
        nonlocal after
        cursor = conn.cursor(row_factory=kwargs_row(_WaitingTask))
        await cursor.execute(
            _WAITING_TASKS,
            {
                "after": after,
                "limit": limit,
                "lost_executor_stop_ms": timings.lost_executor_stop_ms,
            },
        )
        tasks = await cursor.fetchall()
        if tasks:
            after = tasks[-1].task_id
        admitted = 0
        for task in tasks:
            if task.may_admit():
                admitted += len(await _admit_task(conn, task.task_id, timings))
        return AdmissionPage(len(tasks), admitted)

    return page


async def _admit_task(
    conn: AsyncConnection[Any], task_id: uuid.UUID, timings: Timings
) -> list[uuid.UUID]:
    async with command_transaction(conn, durable_answer=False) as tx:
        return await admit_waiting_runs(tx, task_id, timings, ADMISSION)
