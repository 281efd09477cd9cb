"""Completion (SPEC R-W-6): the Worker reports how a running execution ended.

Under the full fence and the callback sequence that `running` stored, the Attempt and Run
terminate together, the lease completes at version + 1, and the two Events are appended.
An exact replay (the lost-response case) answers the same and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from qinglong_control.domain.fence import Fence, Present, check_live_lease
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.states import AttemptState, RunState

EXECUTION_FAILED = "EXECUTION_FAILED"
EXECUTION_CANCELLED = "EXECUTION_CANCELLED"
EXECUTION_TIMED_OUT = "EXECUTION_TIMED_OUT"

_ENDINGS: dict[str, tuple[AttemptState, RunState, str | None]] = {
    "succeeded": (AttemptState.SUCCEEDED, RunState.SUCCEEDED, None),
    "failed": (AttemptState.FAILED, RunState.FAILED, EXECUTION_FAILED),
    "cancelled": (AttemptState.CANCELLED, RunState.CANCELLED, EXECUTION_CANCELLED),
    "timed_out": (AttemptState.TIMED_OUT, RunState.TIMED_OUT, EXECUTION_TIMED_OUT),
}


@dataclass(frozen=True)
class CompletionReport:
    callback_sequence: int
    outcome: str
    """succeeded | failed | cancelled | timed_out"""
    exit_code: int | None
    summary: str


@dataclass(frozen=True)
class CompletionDecision:
    attempt_state: AttemptState
    run_state: RunState
    error_code: str | None
    completed_lease_version: int
    finished_at_ms: int
    replayed: bool

    @property
    def writes(self) -> bool:
        return not self.replayed


def decide_completion(
    fence: Fence, present: Present, report: CompletionReport
) -> CompletionDecision:
    if report.outcome not in _ENDINGS:
        raise Refused(Reason.FIELD_INVALID, "unknown completion outcome")
    attempt_state, run_state, error_code = _ENDINGS[report.outcome]
    run, attempt, lease = present.run, present.attempt, present.lease
    if lease.status == "completed":
        replay = (
            lease.version == fence.expected_lease_version + 1
            and attempt.state is attempt_state
            and run.state is run_state
            and attempt.error_code == error_code
            and attempt.exit_code == report.exit_code
            and attempt.callback_sequence == report.callback_sequence
            and attempt.finished_at_ms is not None
        )
        if not replay or attempt.finished_at_ms is None:
            raise Refused(Reason.REPLAY_MISMATCH, "the attempt was completed with other facts")
        return CompletionDecision(
            attempt_state, run_state, error_code, lease.version, attempt.finished_at_ms, True
        )
    check_live_lease(fence, present)
    if attempt.state is not AttemptState.RUNNING or run.state is not RunState.RUNNING:
        raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}, run is {run.state}")
    if attempt.callback_sequence != report.callback_sequence:
        raise Refused(Reason.CALLBACK_SEQUENCE_FENCED, "callback sequence is not current")
    # A stop ending must match the durable reason the Worker was given; success and
    # failure are facts of the process and stand whatever was asked.
    if report.outcome == "cancelled" and run.cancel_reason in (None, "timeout"):
        raise Refused(Reason.STATE_CONFLICT, "no cancel was requested")
    if report.outcome == "timed_out" and run.cancel_reason != "timeout":
        raise Refused(Reason.STATE_CONFLICT, "no timeout was reached")
    return CompletionDecision(
        attempt_state,
        run_state,
        error_code,
        fence.expected_lease_version + 1,
        present.now_ms,
        False,
    )
