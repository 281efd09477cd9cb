"""Convergence (SPEC R-CONV-*) and lease expiry (B-EXP): the control plane's own authority.

Convergence terminates Runs that carry a durable cancel intent but have no live
executor: queued, waiting, retrying or lost Runs, and a `claimed` Attempt whose lease is
no longer active. A `starting` or `running` Attempt, or a claimed one whose lease is
still active, is `blocked`: only the Worker's completion (or expiry) may end it, never a
forged terminal state.

Expiry turns an Attempt whose lease passed its expiry into `lost` (never a success), and
its Run into `lost`, from which retry or convergence proceed.

Both derive their Event ids from what they converge (R-CONV-3), so a retried cycle after
a lost commit can never append a second Event.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from enum import StrEnum

from qinglong_control.domain.ending_codes import EXECUTION_CANCELLED, EXECUTION_TIMED_OUT
from qinglong_control.domain.states import AttemptState, RunState

CONVERGENT_RUN_STATES = frozenset(
    {
        RunState.CREATED,
        RunState.QUEUED,
        RunState.WAITING_APPROVAL,
        RunState.RETRY_WAIT,
        RunState.LOST,
    }
)


class Convergence(StrEnum):
    CONVERGED = "converged"
    BLOCKED = "blocked"
    SKIPPED = "skipped"
    """No longer a candidate when locked (terminal, or the intent is gone)."""


@dataclass(frozen=True)
class NewestAttempt:
    attempt_id: uuid.UUID
    state: AttemptState
    lease_status: str
    lease_expires_at_ms: int


@dataclass(frozen=True)
class ConvergencePlan:
    outcome: Convergence
    run_state: RunState | None = None
    attempt_state: AttemptState | None = None
    attempt_id: uuid.UUID | None = None
    error_code: str | None = None


def derived_event_id(domain: str, subject: uuid.UUID, at_ms: int) -> uuid.UUID:
    """Domain-separated SHA-256 of (domain, subject, time), truncated to 128 bits."""
    material = b"\x00".join((domain.encode(), str(subject).encode(), str(at_ms).encode()))
    return uuid.UUID(bytes=hashlib.sha256(material).digest()[:16])


def plan_convergence(
    run_state: RunState,
    cancel_reason: str | None,
    newest: NewestAttempt | None,
    now_ms: int,
) -> ConvergencePlan:
    if cancel_reason is None or run_state not in CONVERGENT_RUN_STATES:
        return ConvergencePlan(Convergence.SKIPPED)
    timed_out = cancel_reason == "timeout"
    run_target = RunState.TIMED_OUT if timed_out else RunState.CANCELLED
    error_code = EXECUTION_TIMED_OUT if timed_out else EXECUTION_CANCELLED
    if newest is None or newest.state.is_terminal:
        return ConvergencePlan(Convergence.CONVERGED, run_target, error_code=error_code)
    lease_active = newest.lease_status == "leased" and newest.lease_expires_at_ms > now_ms
    if newest.state is not AttemptState.CLAIMED or lease_active:
        return ConvergencePlan(Convergence.BLOCKED)
    return ConvergencePlan(
        Convergence.CONVERGED,
        run_target,
        AttemptState.TIMED_OUT if timed_out else AttemptState.CANCELLED,
        newest.attempt_id,
        error_code,
    )


@dataclass(frozen=True)
class ExpiryPlan:
    attempt_lost: bool
    """The Attempt ends `lost`; False leaves a `claimed` Attempt for convergence."""
    run_state: RunState | None
    """Where the Run goes; None when it already moved on (only the Attempt's fact is new)."""


def plan_expiry(
    run_state: RunState, attempt_state: AttemptState, cancel_reason: str | None
) -> ExpiryPlan:
    """What an expired lease changes (B-EXP, R-RETRY-1).

    A `claimed` Attempt never started an executor: its Run goes back to `queued`. Without
    a cancel intent the Attempt ends `lost`; with one it stays `claimed` without an active
    lease, and convergence ends Attempt and Run with their own Events (R-CONV-2). A
    `starting`/`running` Attempt may have an executor: it is `lost`, and so is its Run.
    """
    live_run = run_state in (RunState.DISPATCHING, RunState.RUNNING)
    if attempt_state is AttemptState.CLAIMED:
        return ExpiryPlan(
            attempt_lost=cancel_reason is None,
            run_state=RunState.QUEUED if run_state is RunState.DISPATCHING else None,
        )
    return ExpiryPlan(attempt_lost=True, run_state=RunState.LOST if live_run else None)
