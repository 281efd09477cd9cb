"""The full fence of a Worker command and its comparison with the locked present.

A command names every identity field of its authority (SPEC §0 "fence"). The repository
locks the rows in the fixed order and hands them here as `Authority`; `check_fence`
says, with one low-cardinality reason, whether the caller is still the present owner.
The raw lease token never reaches this module: the boundary turns it into a digest.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from qinglong_control.domain.capability import TokenDigest
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import NO_RETRY, RetryPolicy
from qinglong_control.domain.sessions import SessionClaim, SessionRow, check_session
from qinglong_control.domain.states import AttemptState, RunState

REMOTE_WORKER = "remote_worker"


@dataclass(frozen=True)
class Fence:
    worker_id: str
    session_id: uuid.UUID
    worker_generation: int
    project_id: str
    run_id: uuid.UUID
    attempt_id: uuid.UUID
    offer_id: uuid.UUID
    lease_generation: int
    token_digest: TokenDigest
    expected_lease_version: int


@dataclass(frozen=True)
class RunRow:
    run_id: uuid.UUID
    project_id: str
    revision_id: uuid.UUID
    state: RunState
    owner: str
    version: int
    event_sequence: int
    cancel_reason: str | None
    cancel_requested_at_ms: int | None
    timeout_ms: int | None
    deadline_at_ms: int | None
    retry_policy: RetryPolicy = NO_RETRY
    started_attempts: int = 0
    """Attempts of this Run that reached `starting` (the retry budget counts these)."""
    error_code: str | None = None


@dataclass(frozen=True)
class AttemptRow:
    attempt_id: uuid.UUID
    run_id: uuid.UUID
    state: AttemptState
    executor_type: str
    worker_id: str
    session_id: uuid.UUID
    worker_generation: int
    offer_id: uuid.UUID
    lease_generation: int
    lease_version: int
    lease_token_digest: str
    attempt_number: int
    starting_at_ms: int | None
    started_at_ms: int | None
    deadline_at_ms: int | None
    executor_handle: str | None
    log_artifact_id: str | None
    callback_sequence: int | None
    callback_token_digest: str | None
    error_code: str | None
    exit_code: int | None
    finished_at_ms: int | None


@dataclass(frozen=True)
class LeaseRow:
    attempt_id: uuid.UUID
    run_id: uuid.UUID
    worker_id: str
    session_id: uuid.UUID
    worker_generation: int
    offer_id: uuid.UUID
    lease_generation: int
    token_digest: str
    version: int
    status: str
    expires_at_ms: int


@dataclass(frozen=True)
class Authority:
    """The rows a fenced command locked, and DB time read after the locks."""

    session: SessionRow | None
    run: RunRow | None
    attempt: AttemptRow | None
    lease: LeaseRow | None
    now_ms: int


@dataclass(frozen=True)
class Present:
    """An Authority whose rows all exist."""

    session: SessionRow
    run: RunRow
    attempt: AttemptRow
    lease: LeaseRow
    now_ms: int


def check_identity(fence: Fence, authority: Authority) -> Present:
    """Everything but the lease's liveness and version (SPEC R-ACK-2).

    Session first (a replaced or expired session is fenced whatever else it says), then
    the Run/Attempt, then the lease and its projection on the Attempt, which must name
    exactly the caller's worker, session, generation, offer, lease generation and token.
    """
    session, run, attempt, lease = (
        authority.session,
        authority.run,
        authority.attempt,
        authority.lease,
    )
    if session is None:
        raise Refused(Reason.SESSION_FENCED, "session is not the worker's present session")
    check_session(
        SessionClaim(fence.worker_id, fence.session_id, fence.worker_generation),
        session,
        authority.now_ms,
    )
    if run is None or attempt is None or lease is None:
        raise Refused(Reason.FENCE_MISMATCH, "run, attempt or lease does not exist")
    if run.project_id != fence.project_id or attempt.run_id != run.run_id:
        raise Refused(Reason.FENCE_MISMATCH, "attempt is not of this project's run")
    if run.owner != "runtime":
        raise Refused(Reason.STATE_CONFLICT, "run is not owned by the runtime")
    if attempt.executor_type != REMOTE_WORKER:
        raise Refused(Reason.EXECUTOR_TYPE_MISMATCH, "attempt is not a remote worker attempt")
    holder = (fence.worker_id, fence.session_id, fence.worker_generation, fence.offer_id)
    lease_generation = fence.lease_generation
    for row in (lease, attempt):
        if (row.worker_id, row.session_id, row.worker_generation, row.offer_id) != holder:
            raise Refused(Reason.FENCE_MISMATCH, "lease is held by another authority")
        if row.lease_generation != lease_generation:
            raise Refused(Reason.FENCE_MISMATCH, "lease generation differs")
    if lease.run_id != run.run_id or lease.attempt_id != attempt.attempt_id:
        raise Refused(Reason.FENCE_MISMATCH, "lease is of another attempt")
    if not (
        fence.token_digest.matches(lease.token_digest)
        and fence.token_digest.matches(attempt.lease_token_digest)
    ):
        raise Refused(Reason.LEASE_TOKEN_MISMATCH, "lease capability does not match")
    if attempt.lease_version != lease.version:
        # The projection is written in the same transactions as the lease; a difference
        # means drift, and drift fails closed.
        raise Refused(Reason.STATE_CONFLICT, "lease projection drifted")
    return Present(session, run, attempt, lease, authority.now_ms)


def check_live_lease(fence: Fence, present: Present) -> None:
    """A non-terminal command needs the lease held, unexpired, at exactly this version."""
    lease = present.lease
    if lease.status != "leased":
        raise Refused(Reason.LEASE_NOT_LEASED, f"lease is {lease.status}")
    if lease.version != fence.expected_lease_version:
        raise Refused(Reason.LEASE_VERSION_FENCED, "expected lease version is not current")
    if lease.expires_at_ms <= present.now_ms:
        raise Refused(Reason.LEASE_EXPIRED, "lease expired")
