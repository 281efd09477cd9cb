"""A task's concurrency limit: how many of its Runs may hold a slot at once.

A deploy, a schema migration, a job that writes one shared resource must not run twice at
once, and nothing outside the control plane can hold that: only it knows which Runs are
queued, running, or lost with an executor that may still be stopping. A revision's plan
may carry ``max_concurrent_runs``, and the task's newest revision's is the task's limit,
whatever revision a Run pins (``qinglong.task_max_concurrent_runs``, migration 0046): an
older revision triggered again is held to it too, and a revised limit applies to the
Runs still waiting. A Run of a task with a limit is created ``created`` and waits there,
invisible to every pull, until it is *admitted*: queued, which makes it one of the Runs
that hold a slot. So placement, claims and the Worker commands need not know about
limits at all.

What holds a slot is counted in the database (``qinglong.task_slots_held``, 0046): a Run
queued, dispatching, running, waiting for a retry or lost, and a Run that ended while its
last started Attempt's Worker may still be stopping the executor (within the Workers'
stop bound after its lease ran out). Admission decides here, from that count, the limit
and the task's waiting Runs in queue order (a higher priority first, the oldest first
among equals).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from qinglong_control.domain.states import RunState


@dataclass(frozen=True)
class WaitingRun:
    """A Run waiting ``created`` for a slot of its task."""

    run_id: uuid.UUID
    event_sequence: int


def state_when_triggered(task_limit: int | None) -> RunState:
    """A Run of a task with a limit waits for admission (even when a slot is free:
    admission, in the same transaction, decides in queue order); one without is queued at
    once."""
    return RunState.QUEUED if task_limit is None else RunState.CREATED


def runs_to_admit(
    task_limit: int | None, slots_held: int, waiting: Sequence[WaitingRun]
) -> list[WaitingRun]:
    """Which of ``waiting`` (in queue order) are queued now: as many as the free slots
    allow, the first ones. Without a limit (it was revised away) every waiting Run is."""
    if task_limit is None:
        return list(waiting)
    return list(waiting[: max(0, task_limit - slots_held)])
