"""A task's concurrency limit: how many of its Runs may hold a slot at once.

A deploy, a schema migration, a job that writes one shared resource must not run twice at
once, and nothing outside the control plane can hold that: only it knows which Runs are
queued, running, or lost with an executor that may still be stopping. A revision's plan
may carry ``max_concurrent_runs``; each Run copies it when triggered. Such a Run is
created ``created`` and waits there, invisible to every pull, until it is *admitted*:
queued, which makes it one of the Runs that hold a slot. So placement, claims and the
Worker commands need not know about limits at all: at most the limit's number of the
task's Runs are ever queued or further along at once.

What holds a slot is counted in the database (``qinglong.task_slots_held``, migration
0047): a Run queued, dispatching, running, waiting for a retry or lost, and a Run that
ended while its last started Attempt's Worker may still be stopping the executor (within
the Workers' stop bound after its lease ran out). Admission decides here, from that count
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
    max_concurrent_runs: int | None
    """Its own limit (None: a Run queued by a replica that knew no limits)."""
    event_sequence: int


def state_when_triggered(max_concurrent_runs: int | None) -> RunState:
    """A Run with a limit waits for admission (even when a slot is free: admission, in
    the same transaction, decides in queue order); one without is queued at once."""
    return RunState.QUEUED if max_concurrent_runs is None else RunState.CREATED


def runs_to_admit(slots_held: int, waiting: Sequence[WaitingRun]) -> list[WaitingRun]:
    """Which of ``waiting`` (in queue order) are queued now, given how many of the task's
    Runs hold a slot. Strictly in order: a Run is admitted only while fewer Runs than its
    own limit hold one, and the first that must wait stops the rest — a Run of a revision
    with a higher limit does not overtake one that waits longer."""
    admitted: list[WaitingRun] = []
    held = slots_held
    for run in waiting:
        if run.max_concurrent_runs is not None and held >= run.max_concurrent_runs:
            break
        admitted.append(run)
        held += 1
    return admitted
