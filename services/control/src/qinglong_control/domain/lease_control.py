"""Lease control (SPEC R-LC-1…7): renew, ask to stop, or report the terminal projection.

The answer is exactly one of three. A live authority (claimed|starting|running, lease
held, version exact, unexpired) is always renewed first — also when it must stop, so the
Worker has lease time to stop and report. A deadline that passed without a cancel intent
becomes a durable `timeout` intent in the same transaction (R-LC-6).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from qinglong_control.domain.fence import Fence, Present, check_live_lease
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.states import AttemptState, RunState


class LeaseAnswer(StrEnum):
    RENEWED = "renewed"
    STOP_REQUESTED = "stop_requested"
    TERMINAL = "terminal"


@dataclass(frozen=True)
class LeaseDecision:
    answer: LeaseAnswer
    new_lease_version: int | None
    """The renewed version (expected + 1); None for a terminal answer."""
    cancel_reason: str | None
    writes_timeout_intent: bool
    deadline_at_ms: int | None
    now_ms: int
    cancel_requested_at_ms: int | None = None
    terminal: tuple[RunState, AttemptState, str | None] | None = None
    """Run state, Attempt state and error code, for a terminal answer."""


def decide_lease_control(fence: Fence, present: Present) -> LeaseDecision:
    run, attempt, lease = present.run, present.attempt, present.lease
    if run.state.is_terminal:
        # The exact terminal projection, to the holder of the lease at its last version
        # or the one before it (a completion whose answer was lost). Anything older is
        # an old authority and is refused like any other.
        if lease.status == "leased" or fence.expected_lease_version not in (
            lease.version,
            lease.version - 1,
        ):
            raise Refused(Reason.LEASE_VERSION_FENCED, "expected lease version is not current")
        return LeaseDecision(
            LeaseAnswer.TERMINAL,
            None,
            run.cancel_reason,
            False,
            None,
            present.now_ms,
            terminal=(run.state, attempt.state, attempt.error_code),
        )
    check_live_lease(fence, present)
    if attempt.state not in (AttemptState.CLAIMED, AttemptState.STARTING, AttemptState.RUNNING):
        raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}")
    new_version = fence.expected_lease_version + 1
    if run.cancel_reason is not None:
        return LeaseDecision(
            LeaseAnswer.STOP_REQUESTED,
            new_version,
            run.cancel_reason,
            False,
            attempt.deadline_at_ms,
            present.now_ms,
            cancel_requested_at_ms=run.cancel_requested_at_ms,
        )
    if attempt.deadline_at_ms is not None and attempt.deadline_at_ms <= present.now_ms:
        return LeaseDecision(
            LeaseAnswer.STOP_REQUESTED,
            new_version,
            "timeout",
            True,
            attempt.deadline_at_ms,
            present.now_ms,
            cancel_requested_at_ms=present.now_ms,
        )
    return LeaseDecision(
        LeaseAnswer.RENEWED, new_version, None, False, attempt.deadline_at_ms, present.now_ms
    )
