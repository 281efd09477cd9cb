"""Lease control (SPEC R-LC-1…7): renew, ask to stop, or report the terminal projection.

The answer is exactly one of three. A live authority (claimed|starting|running, lease
held, version exact, unexpired) is always renewed first — also when it must stop, so the
Worker has lease time to stop and report. A deadline that passed without a cancel intent
becomes a durable `timeout` intent in the same transaction (R-LC-6).

A retried call whose earlier answer was lost (R-LC-8) finds the lease one version ahead
of what it expects. If that step was a renewal under the very same authority (the lease
is still `leased`: ACKs never advance it and a terminal change completes it) and the
lease is still live, the answer is the present projection at that version, with no
write and no Event. Anything else stays fenced.
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
    replayed: bool = False
    """The renewal had committed already (R-LC-8): answer it again, write nothing."""
    lease_expires_at_ms: int | None = None
    """The lease's expiry when replayed (a fresh renewal sets it from DB time)."""

    @property
    def writes(self) -> bool:
        return self.answer is not LeaseAnswer.TERMINAL and not self.replayed


def decide_lease_control(fence: Fence, present: Present) -> LeaseDecision:
    run, attempt, lease = present.run, present.attempt, present.lease
    # A completed lease ends this Attempt even when the Run goes on to a retry.
    if run.state.is_terminal or lease.status == "completed":
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
    replayed = _is_renewal_replay(fence, present)
    if not replayed:
        check_live_lease(fence, present)
    if attempt.state not in (AttemptState.CLAIMED, AttemptState.STARTING, AttemptState.RUNNING):
        raise Refused(Reason.STATE_CONFLICT, f"attempt is {attempt.state}")
    new_version = fence.expected_lease_version + 1
    if replayed:
        return _replayed_answer(present, new_version)
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


def _is_renewal_replay(fence: Fence, present: Present) -> bool:
    """The lease is exactly one renewal ahead of the caller, and still live (R-LC-8).

    `check_identity` already proved the whole authority identical (session, generation,
    offer, lease generation, token digest); `leased` proves the step was a renewal.
    """
    lease = present.lease
    return (
        lease.status == "leased"
        and lease.version == fence.expected_lease_version + 1
        and lease.expires_at_ms > present.now_ms
    )


def _replayed_answer(present: Present, version: int) -> LeaseDecision:
    """The present projection at `version`: a stop if an intent exists now (the renewal
    may have written the timeout intent itself), otherwise renewed."""
    run, attempt = present.run, present.attempt
    stopping = run.cancel_reason is not None
    return LeaseDecision(
        LeaseAnswer.STOP_REQUESTED if stopping else LeaseAnswer.RENEWED,
        version,
        run.cancel_reason,
        False,
        attempt.deadline_at_ms,
        present.now_ms,
        cancel_requested_at_ms=run.cancel_requested_at_ms,
        replayed=True,
        lease_expires_at_ms=present.lease.expires_at_ms,
    )
