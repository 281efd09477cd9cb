"""The Run and Attempt state machines of SPEC §1 (the database enforces the same table)."""

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

    @property
    def is_live(self) -> bool:
        return not self.is_terminal


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

_CONVERGED = frozenset({RunState.CANCELLED, RunState.TIMED_OUT})

RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.CREATED: frozenset({RunState.QUEUED}) | _CONVERGED,
    RunState.QUEUED: frozenset({RunState.DISPATCHING}) | _CONVERGED,
    RunState.WAITING_APPROVAL: frozenset({RunState.QUEUED}) | _CONVERGED,
    # -> queued: the lease of a `claimed` Attempt expired (R-RETRY-1);
    # -> retry_wait: a start failure the policy retries (R-RETRY-2).
    RunState.DISPATCHING: frozenset(
        {RunState.QUEUED, RunState.RUNNING, RunState.RETRY_WAIT, RunState.FAILED, RunState.LOST}
    )
    | _CONVERGED,
    RunState.RUNNING: frozenset(
        {RunState.RETRY_WAIT, RunState.SUCCEEDED, RunState.FAILED, RunState.LOST}
    )
    | _CONVERGED,
    RunState.RETRY_WAIT: frozenset({RunState.QUEUED, RunState.FAILED}) | _CONVERGED,
    # `lost` is not terminal: the retry authority queues the Run again or, with the
    # policy exhausted, fails it.
    RunState.LOST: frozenset({RunState.RETRY_WAIT, RunState.QUEUED, RunState.FAILED}) | _CONVERGED,
    RunState.SUCCEEDED: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.CANCELLED: frozenset(),
    RunState.TIMED_OUT: frozenset(),
}

_ATTEMPT_ENDINGS = frozenset({AttemptState.CANCELLED, AttemptState.TIMED_OUT, AttemptState.LOST})

ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    AttemptState.CLAIMED: frozenset({AttemptState.STARTING}) | _ATTEMPT_ENDINGS,
    AttemptState.STARTING: frozenset({AttemptState.RUNNING, AttemptState.FAILED})
    | _ATTEMPT_ENDINGS,
    AttemptState.RUNNING: frozenset({AttemptState.SUCCEEDED, AttemptState.FAILED})
    | _ATTEMPT_ENDINGS,
    AttemptState.SUCCEEDED: frozenset(),
    AttemptState.FAILED: frozenset(),
    AttemptState.CANCELLED: frozenset(),
    AttemptState.TIMED_OUT: frozenset(),
    AttemptState.LOST: frozenset(),
}


def run_may_move(current: RunState, target: RunState) -> bool:
    return target in RUN_TRANSITIONS[current]


def attempt_may_move(current: AttemptState, target: AttemptState) -> bool:
    return target in ATTEMPT_TRANSITIONS[current]
