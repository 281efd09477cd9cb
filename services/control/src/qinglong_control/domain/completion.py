"""Completion (SPEC R-W-6): the Worker reports how a running execution ended.

Under the full fence and the callback sequence that `running` stored, the Attempt and Run
terminate together, the lease completes at version + 1, and the two Events are appended.
An exact replay (the lost-response case) answers the same and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from qinglong_control.domain.ending_codes import (
    EXECUTION_CANCELLED,
    EXECUTION_FAILED,
    EXECUTION_TIMED_OUT,
)
from qinglong_control.domain.fence import Fence, Present, check_live_lease
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import Ending, decide_retry
from qinglong_control.domain.states import AttemptState, RunState

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
    stop_reason: str | None = None
    """`shutdown` when a draining Worker stopped the execution itself (with `cancelled`)."""
    output_bytes: int | None = None
    """The size of the execution's output when it ended (the Worker may still be shipping
    some of it); None when the Worker did not say. Not part of an exact replay's identity:
    the first report stands."""


@dataclass(frozen=True)
class CompletionDecision:
    attempt_state: AttemptState
    run_state: RunState
    error_code: str | None
    """The Attempt's code."""
    completed_lease_version: int
    finished_at_ms: int
    replayed: bool
    run_error_code: str | None = None
    retry_at_ms: int | None = None
    """Set when the Run waits for another Attempt (R-RETRY-2)."""
    writes_shutdown_intent: bool = False
    """No intent existed: the Worker's shutdown becomes the Run's durable intent."""

    @property
    def writes(self) -> bool:
        return not self.replayed


def decide_completion(
    fence: Fence, present: Present, report: CompletionReport
) -> CompletionDecision:
    if report.outcome not in _ENDINGS:
        raise Refused(Reason.FIELD_INVALID, "unknown completion outcome")
    run, attempt, lease = present.run, present.attempt, present.lease
    attempt_state, run_state, error_code = _ENDINGS[_ending_name(report, run.cancel_reason)]
    if lease.status == "completed":
        return _replay(fence, present, report, attempt_state)
    check_live_lease(fence, present)
    if attempt.state is not AttemptState.RUNNING or run.state is not RunState.RUNNING:
        raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}, run is {run.state}")
    if attempt.callback_sequence != report.callback_sequence:
        raise Refused(Reason.CALLBACK_SEQUENCE_FENCED, "callback sequence is not current")
    shutdown_intent = report.stop_reason == "shutdown" and run.cancel_reason is None
    # A stop ending must match the durable reason the Worker was given (or its own
    # shutdown); success and failure are facts of the process and stand whatever was asked.
    if report.outcome == "cancelled" and run.cancel_reason is None and not shutdown_intent:
        raise Refused(Reason.STATE_CONFLICT, "no cancel was requested")
    if (
        report.outcome == "cancelled"
        and run.cancel_reason == "timeout"
        and report.stop_reason != "shutdown"
    ):
        raise Refused(Reason.STATE_CONFLICT, "the stop was a timeout")
    if report.outcome == "timed_out" and run.cancel_reason != "timeout":
        raise Refused(Reason.STATE_CONFLICT, "no timeout was reached")
    run_error_code = error_code
    retry_at_ms = None
    if attempt_state is AttemptState.FAILED and run.cancel_reason is None:
        retry = decide_retry(run.retry_policy, Ending.FAILED, run.started_attempts, present.now_ms)
        if retry.retries:
            run_state, run_error_code, retry_at_ms = RunState.RETRY_WAIT, None, retry.retry_at_ms
        elif retry.error_code is not None:
            run_error_code = retry.error_code
    return CompletionDecision(
        attempt_state,
        run_state,
        error_code,
        fence.expected_lease_version + 1,
        present.now_ms,
        False,
        run_error_code=run_error_code,
        retry_at_ms=retry_at_ms,
        writes_shutdown_intent=shutdown_intent,
    )


def _ending_name(report: CompletionReport, cancel_reason: str | None) -> str:
    """A Worker's own shutdown stop ends as the Run's durable intent says, if it has one:
    a deadline that passed meanwhile still makes it a timeout."""
    if report.stop_reason == "shutdown" and cancel_reason == "timeout":
        return "timed_out"
    return report.outcome


def _replay(
    fence: Fence, present: Present, report: CompletionReport, attempt_state: AttemptState
) -> CompletionDecision:
    """The lost-answer retry of a completion (R-W-6), or a late receipt (R-FAIL-3).

    An Attempt that never ran (it ended by a start failure) had its completion receipt
    closed; so had one whose callback sequence moved on. Neither is answered as a
    completion. Otherwise the facts must be the ones stored, at exactly expected + 1.
    """
    run, attempt, lease = present.run, present.attempt, present.lease
    if attempt.started_at_ms is None or attempt.callback_sequence != report.callback_sequence:
        raise Refused(Reason.CALLBACK_SEQUENCE_FENCED, "the completion receipt was closed")
    replay = (
        lease.version == fence.expected_lease_version + 1
        and attempt.state is attempt_state
        and attempt.exit_code == report.exit_code
        and attempt.finished_at_ms is not None
    )
    if not replay or attempt.finished_at_ms is None:
        raise Refused(Reason.REPLAY_MISMATCH, "the attempt was completed with other facts")
    return CompletionDecision(
        attempt_state,
        run.state,
        attempt.error_code,
        lease.version,
        attempt.finished_at_ms,
        True,
        run_error_code=run.error_code,
    )
