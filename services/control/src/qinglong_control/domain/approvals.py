"""Approvals (SPEC R-OPS-2): a mutation held because policy wanted a second person.

A held call is kept exactly as it was sent. It is decided once: approved (the mutation
runs as the approver, re-checked as the approver's own call would be), denied (nothing
runs) or expired (nobody decided in time; nothing runs). Deciding again what one already
decided answers the same decision, so a retried approve is harmless; anything else about
a decided request is refused with its state.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from enum import Enum, StrEnum, auto
from typing import Protocol

from qinglong_control.domain.refusals import Reason, Refused

#: The Run's Events about a request: run.approval_requested, …_approved, …_denied,
#: …_expired.
APPROVAL_EVENT_PREFIX = "run.approval_"


def approval_event_type(what: str) -> str:
    return f"{APPROVAL_EVENT_PREFIX}{what}"


#: Requests one caller may have waiting for a decision in one project. A caller at the
#: limit is refused RATE_LIMITED until some are decided or expire, so a looping Agent
#: cannot bury a project's reviewers (or the table) under requests. It is counted before
#: each new request, so calls held at the same instant can pass it by as many as run at
#: once; a retry of a request already held is answered whatever the count.
PENDING_APPROVALS_PER_CALLER = 100


def check_room_for_another(pending: int) -> None:
    """Refuse a new request of a caller that has ``pending`` waiting already."""
    if pending >= PENDING_APPROVALS_PER_CALLER:
        raise Refused(
            Reason.RATE_LIMITED,
            f"{PENDING_APPROVALS_PER_CALLER} requests of this caller already await a decision"
            " in this project; more are taken once some are decided or expire",
        )


class ApprovalState(StrEnum):
    PENDING = "pending"
    APPROVED = "approved"
    DENIED = "denied"
    EXPIRED = "expired"


class Decision(StrEnum):
    APPROVE = "approved"
    DENY = "denied"


def request_digest(method: str, request: bytes) -> bytes:
    """What makes a retry of a held call the same request: its method and its bytes."""
    return hashlib.sha256(method.encode() + b"\0" + request).digest()


@dataclass(frozen=True)
class HeldCall:
    """A call ingress admitted only as needing an approval."""

    project_id: str
    method: str
    request_type: str
    request: bytes
    run_id: uuid.UUID | None
    requested_by: uuid.UUID
    requested_by_kind: str
    audit_id: uuid.UUID

    @property
    def digest(self) -> bytes:
        return request_digest(self.method, self.request)


@dataclass(frozen=True)
class ApprovalView:
    """A request as an operator sees it (``state`` already says expired when it is)."""

    approval_id: uuid.UUID
    project_id: str
    state: str
    method: str
    request_type: str
    request: bytes
    run_id: uuid.UUID | None
    requested_by: uuid.UUID
    requested_by_kind: str
    requested_by_name: str | None
    audit_id: uuid.UUID
    requested_at_ms: int
    expires_at_ms: int
    decided_by: uuid.UUID | None
    decided_by_name: str | None
    decided_at_ms: int | None
    note: str | None
    result: str | None


class Step(Enum):
    """What a decision does with the request it locked."""

    DECIDE = auto()
    """Pending and in time: record the decision (and for an approval, run the mutation)."""
    REPLAY = auto()
    """This decider already made this decision: answer it again, change nothing."""
    EXPIRE = auto()
    """Pending but past its expiry: record the expiry, then refuse the decision."""


class Decidable(Protocol):
    """What a decision reads of the request it locked."""

    @property
    def state(self) -> str: ...
    @property
    def requested_by(self) -> uuid.UUID: ...
    @property
    def decided_by(self) -> uuid.UUID | None: ...
    @property
    def expires_at_ms(self) -> int: ...


def next_step(view: Decidable, decision: Decision, decider: uuid.UUID, now_ms: int) -> Step:
    if view.requested_by == decider:
        raise Refused(Reason.PERMISSION_DENIED, "a principal cannot decide its own request")
    state = ApprovalState(view.state)
    if state is ApprovalState.PENDING:
        return Step.EXPIRE if now_ms >= view.expires_at_ms else Step.DECIDE
    if state.value == decision.value and view.decided_by == decider:
        return Step.REPLAY
    raise Refused(Reason.APPROVAL_NOT_PENDING, f"the approval request is {state.value}")


def expired_refusal() -> Refused:
    """The answer to a decision that came too late (its expiry is recorded by then)."""
    return Refused(Reason.APPROVAL_NOT_PENDING, "the approval request is expired")
