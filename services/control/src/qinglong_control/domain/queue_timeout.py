"""The queue timeout: how long a Run may wait queued for a Worker to claim it.

A revision's plan may bound the wait (``queue_timeout_ms``), as a CI job's queue time or a
task's schedule-to-start timeout is bounded elsewhere: a Run whose selector no Worker
matches, or whose Workers are all gone, would otherwise wait for ever. The wait counts
from each time the Run is queued (triggered, queued again for a retry, or returned by a
claim whose lease ran out), so a retried Run gets the whole wait again. A Run that waited
longer ends ``timed_out`` with its own error code, so that its owner can tell "nobody
took it" from "it ran too long" (``EXECUTION_TIMED_OUT``).
"""

from __future__ import annotations

from dataclasses import dataclass

from qinglong_control.domain.states import RunState


@dataclass(frozen=True)
class QueuedRun:
    state: RunState
    cancel_reason: str | None
    queued_at_ms: int
    """When the Run was last queued (DB time)."""
    queue_timeout_ms: int | None


def queue_wait_over(run: QueuedRun, now_ms: int) -> bool:
    """Whether the reconciler ends ``run`` ``timed_out`` / ``QUEUE_TIMED_OUT`` now: it
    is still queued, its plan bounds the wait, and the wait is over. A Run with a cancel
    intent is convergence's (the intent's reason decides its ending)."""
    return (
        run.state is RunState.QUEUED
        and run.cancel_reason is None
        and run.queue_timeout_ms is not None
        and run.queued_at_ms + run.queue_timeout_ms <= now_ms
    )
