"""Why a command was refused: one low-cardinality reason, never a secret.

Reason names equal the wire's `ErrorReason` values without their `ERROR_REASON_` prefix,
so the servicer maps them by name (a test pins that every one exists on the wire).
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # Fencing: the caller's authority is not the present one (gRPC ABORTED).
    SESSION_FENCED = "SESSION_FENCED"
    SESSION_EXPIRED = "SESSION_EXPIRED"
    FENCE_MISMATCH = "FENCE_MISMATCH"
    LEASE_TOKEN_MISMATCH = "LEASE_TOKEN_MISMATCH"  # noqa: S105 - a reason name, not a secret
    LEASE_VERSION_FENCED = "LEASE_VERSION_FENCED"
    LEASE_EXPIRED = "LEASE_EXPIRED"
    LEASE_NOT_LEASED = "LEASE_NOT_LEASED"
    EXECUTOR_TYPE_MISMATCH = "EXECUTOR_TYPE_MISMATCH"
    STATE_CONFLICT = "STATE_CONFLICT"
    STARTING_REQUIRED = "STARTING_REQUIRED"
    REPLAY_MISMATCH = "REPLAY_MISMATCH"
    CALLBACK_SEQUENCE_FENCED = "CALLBACK_SEQUENCE_FENCED"
    OUTPUT_OFFSET_GAP = "OUTPUT_OFFSET_GAP"
    OFFER_EXPIRED = "OFFER_EXPIRED"
    OFFER_CLAIMED_BY_OTHER_CAPABILITY = "OFFER_CLAIMED_BY_OTHER_CAPABILITY"
    ROLE_BINDING_FENCED = "ROLE_BINDING_FENCED"
    # Not found (gRPC NOT_FOUND).
    SESSION_NOT_FOUND = "SESSION_NOT_FOUND"
    OFFER_NOT_FOUND = "OFFER_NOT_FOUND"
    RUN_NOT_FOUND = "RUN_NOT_FOUND"
    TASK_NOT_FOUND = "TASK_NOT_FOUND"
    REVISION_NOT_FOUND = "REVISION_NOT_FOUND"
    PROJECT_NOT_FOUND = "PROJECT_NOT_FOUND"
    PRINCIPAL_NOT_FOUND = "PRINCIPAL_NOT_FOUND"
    TOKEN_NOT_FOUND = "TOKEN_NOT_FOUND"  # noqa: S105 - a reason name, not a secret
    WORKER_NOT_FOUND = "WORKER_NOT_FOUND"
    ROLE_BINDING_NOT_FOUND = "ROLE_BINDING_NOT_FOUND"
    APPROVAL_NOT_FOUND = "APPROVAL_NOT_FOUND"
    ATTEMPT_NOT_FOUND = "ATTEMPT_NOT_FOUND"
    # Validation (gRPC INVALID_ARGUMENT).
    CAPABILITY_MALFORMED = "CAPABILITY_MALFORMED"
    CAPABILITY_WEAK = "CAPABILITY_WEAK"
    FIELD_INVALID = "FIELD_INVALID"
    # A create collided with a resource another request made (gRPC ALREADY_EXISTS).
    ALREADY_EXISTS = "ALREADY_EXISTS"
    # A decided or expired approval request (gRPC FAILED_PRECONDITION); a held method
    # this control version cannot execute later.
    APPROVAL_NOT_PENDING = "APPROVAL_NOT_PENDING"
    APPROVAL_UNSUPPORTED = "APPROVAL_UNSUPPORTED"
    # Administration that would leave nobody able to administer (the last active user
    # cluster admin), or that needs an active Worker (gRPC FAILED_PRECONDITION).
    LAST_CLUSTER_ADMIN = "LAST_CLUSTER_ADMIN"
    WORKER_DISABLED = "WORKER_DISABLED"
    # What only control can refuse about who asks (gRPC PERMISSION_DENIED).
    PERMISSION_DENIED = "PERMISSION_DENIED"
    # Too many of the caller's requests wait already (gRPC RESOURCE_EXHAUSTED).
    RATE_LIMITED = "RATE_LIMITED"
    # Authentication that only control can decide (a Worker's join token).
    UNAUTHENTICATED_PRINCIPAL = "UNAUTHENTICATED_PRINCIPAL"
    # This replica cannot reach the storage a command needs (gRPC UNAVAILABLE).
    STORAGE_UNAVAILABLE = "STORAGE_UNAVAILABLE"


class Refused(Exception):
    """A command that changed nothing, and why. Its text is safe to show a caller.

    ``field`` is the path of the request field at fault (``fence.session_id``,
    ``plan.retry_policy.max_backoff_ms``) when one is: the wire answer then carries a
    ``google.rpc.BadRequest`` naming it (SPEC R-ERR-1). Like ``detail``, it never holds
    the offending value. ``metadata`` is what the caller needs to act on the refusal
    (the ``expectedOffset`` of a gap in output), sent as ErrorInfo metadata: never a
    secret either.
    """

    def __init__(
        self,
        reason: Reason,
        detail: str = "",
        *,
        field: str | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail
        self.field = field
        self.metadata = metadata

    def at(self, field: str) -> Refused:
        """The same refusal, about ``field``: for checks that do not know where their
        value came from (a capability is one shape wherever a request carries it)."""
        return Refused(self.reason, self.detail, field=field, metadata=self.metadata)
