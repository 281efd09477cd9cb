"""Decisions of the three start facts: `starting`, `running` and `start-failure`.

Each function receives the fence and the locked present, and returns what the command
must write (or that it is an exact replay and writes nothing), or raises `Refused`.
They hold every rule of SPEC R-ACK-1…7, R-FAIL-1…2 and R-TO-1 in one place; the
repository only executes the answer inside the same transaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from qinglong_control.domain.capability import TokenDigest
from qinglong_control.domain.ending_codes import (
    EXECUTION_CANCELLED,
    EXECUTION_TIMED_OUT,
    EXECUTOR_START_FAILED,
)
from qinglong_control.domain.fence import Fence, Present, check_live_lease
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import Ending, decide_retry
from qinglong_control.domain.states import AttemptState, RunState


class StartingOutcome(StrEnum):
    STARTING = "starting"
    ALREADY_STARTING = "already_starting"
    ALREADY_RUNNING = "already_running"


class RunningOutcome(StrEnum):
    RUNNING = "running"
    ALREADY_RUNNING = "already_running"


@dataclass(frozen=True)
class StartingDecision:
    outcome: StartingOutcome
    timeout_ms: int | None
    deadline_at_ms: int | None
    lease_version: int
    observed_at_ms: int
    """DB time of this answer, so the Worker gets the deadline as a remaining duration."""

    @property
    def writes(self) -> bool:
        return self.outcome is StartingOutcome.STARTING


def decide_starting(fence: Fence, present: Present) -> StartingDecision:
    """claimed → starting, pinning the durable deadline from DB time (R-ACK-4, R-TO-1)."""
    check_live_lease(fence, present)
    attempt, run = present.attempt, present.run
    if attempt.state is AttemptState.CLAIMED:
        if run.state is not RunState.DISPATCHING:
            raise Refused(Reason.STATE_CONFLICT, f"run is {run.state}")
        deadline = None if run.timeout_ms is None else present.now_ms + run.timeout_ms
        return StartingDecision(
            StartingOutcome.STARTING,
            run.timeout_ms,
            deadline,
            fence.expected_lease_version,
            present.now_ms,
        )
    if attempt.state is AttemptState.STARTING:
        outcome = StartingOutcome.ALREADY_STARTING
    elif attempt.state is AttemptState.RUNNING:
        outcome = StartingOutcome.ALREADY_RUNNING
    else:
        raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}")
    return StartingDecision(
        outcome,
        run.timeout_ms,
        attempt.deadline_at_ms,
        fence.expected_lease_version,
        present.now_ms,
    )


@dataclass(frozen=True)
class RunningReport:
    executor_handle: str
    log_artifact_id: str | None
    callback_sequence: int
    callback_token_digest: TokenDigest


@dataclass(frozen=True)
class RunningDecision:
    outcome: RunningOutcome
    started_at_ms: int
    lease_version: int

    @property
    def writes(self) -> bool:
        return self.outcome is RunningOutcome.RUNNING


def decide_running(fence: Fence, present: Present, report: RunningReport) -> RunningDecision:
    """starting → running for Attempt and Run together (R-ACK-5); exact replay (R-ACK-6)."""
    check_live_lease(fence, present)
    attempt, run = present.attempt, present.run
    if attempt.state is AttemptState.CLAIMED:
        raise Refused(Reason.STARTING_REQUIRED, "running requires a committed starting")
    if attempt.state is AttemptState.STARTING:
        if run.state is not RunState.DISPATCHING:
            raise Refused(Reason.STATE_CONFLICT, f"run is {run.state}")
        return RunningDecision(RunningOutcome.RUNNING, present.now_ms, fence.expected_lease_version)
    if attempt.state is AttemptState.RUNNING:
        stored = (
            attempt.executor_handle,
            attempt.log_artifact_id,
            attempt.callback_sequence,
        )
        offered = (report.executor_handle, report.log_artifact_id, report.callback_sequence)
        same_digest = attempt.callback_token_digest is not None and (
            report.callback_token_digest.matches(attempt.callback_token_digest)
        )
        if stored != offered or not same_digest or attempt.started_at_ms is None:
            raise Refused(Reason.REPLAY_MISMATCH, "running was acknowledged with other facts")
        return RunningDecision(
            RunningOutcome.ALREADY_RUNNING, attempt.started_at_ms, fence.expected_lease_version
        )
    raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}")


@dataclass(frozen=True)
class StartFailureDecision:
    attempt_state: AttemptState
    run_state: RunState
    error_code: str
    """The Attempt's code."""
    completed_lease_version: int
    replayed: bool
    run_error_code: str | None = None
    retry_at_ms: int | None = None
    """Set when the Run waits for another Attempt (R-RETRY-2)."""

    @property
    def writes(self) -> bool:
        return not self.replayed


def terminal_mapping(cancel_reason: str | None) -> tuple[AttemptState, RunState, str]:
    """The cancellation fact outranks the failure (R-FAIL-1)."""
    if cancel_reason == "timeout":
        return AttemptState.TIMED_OUT, RunState.TIMED_OUT, EXECUTION_TIMED_OUT
    if cancel_reason is not None:
        return AttemptState.CANCELLED, RunState.CANCELLED, EXECUTION_CANCELLED
    return AttemptState.FAILED, RunState.FAILED, EXECUTOR_START_FAILED


def decide_start_failure(fence: Fence, present: Present) -> StartFailureDecision:
    """starting → terminal with the lease completed (R-FAIL-1), or its replay (R-FAIL-2)."""
    attempt, run, lease = present.attempt, present.run, present.lease
    if lease.status == "completed":
        # A retry after a lost answer presents the version it held before the commit. The
        # mapping it was given is the one of the intent that existed when it committed (a
        # Run waiting for a retry may have gained an intent since).
        finished, requested = attempt.finished_at_ms, run.cancel_requested_at_ms
        intents_then: set[str | None] = {None}
        if requested is not None and finished is not None and requested <= finished:
            # Recorded before the commit — or in the same millisecond, where DB time
            # cannot tell which came first (an intent waiting on the Run's lock gets the
            # lock, and the clock, right after the commit): either mapping was possible.
            intents_then = {run.cancel_reason} | ({None} if requested == finished else set())
        stored = next(
            (
                (attempt_state, error_code)
                for attempt_state, _, error_code in map(terminal_mapping, intents_then)
                if (attempt_state, error_code) == (attempt.state, attempt.error_code)
            ),
            None,
        )
        replay = lease.version == fence.expected_lease_version + 1 and attempt.started_at_ms is None
        if stored is None or not replay:
            raise Refused(Reason.REPLAY_MISMATCH, "lease was completed by another outcome")
        attempt_state, error_code = stored
        return StartFailureDecision(
            attempt_state, run.state, error_code, lease.version, True, run.error_code
        )
    attempt_state, run_state, error_code = terminal_mapping(run.cancel_reason)
    check_live_lease(fence, present)
    if attempt.state is not AttemptState.STARTING or run.state is not RunState.DISPATCHING:
        raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}, run is {run.state}")
    run_error_code: str | None = error_code
    retry_at_ms = None
    if run.cancel_reason is None:
        retry = decide_retry(
            run.retry_policy, Ending.START_FAILED, run.started_attempts, present.now_ms
        )
        if retry.retries:
            run_state, run_error_code, retry_at_ms = RunState.RETRY_WAIT, None, retry.retry_at_ms
        elif retry.error_code is not None:
            run_error_code = retry.error_code
    return StartFailureDecision(
        attempt_state,
        run_state,
        error_code,
        fence.expected_lease_version + 1,
        False,
        run_error_code,
        retry_at_ms,
    )
