"""The Run and Attempt states (docs/protocol.md "States").

Which transitions are legal is written once, in the database's transition triggers
(migrations 0001 and 0002): every write, whoever makes it, is checked there.
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    CREATED = "created"
    QUEUED = "queued"
    WAITING_APPROVAL = "waiting_approval"
    DISPATCHING = "dispatching"
    RUNNING = "running"
    RETRY_WAIT = "retry_wait"
    LOST = "lost"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_RUN_STATES


class AttemptState(StrEnum):
    CLAIMED = "claimed"
    STARTING = "starting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    LOST = "lost"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL_ATTEMPT_STATES


_TERMINAL_RUN_STATES = frozenset(
    {RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED, RunState.TIMED_OUT}
)
_TERMINAL_ATTEMPT_STATES = frozenset(
    {
        AttemptState.SUCCEEDED,
        AttemptState.FAILED,
        AttemptState.CANCELLED,
        AttemptState.TIMED_OUT,
        AttemptState.LOST,
    }
)
