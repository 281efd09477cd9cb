"""User cancellation (SPEC R-CAN-1…5): record the intent, once, under a fresh policy check.

The repository does not trust the admission ingress made: inside the transaction it reads
the project and the caller's role binding again, and any drift from the snapshot ingress
admitted under (project version, binding version, role) is a fence conflict before any
Run write. The mutation records intent only; a running Attempt learns it at its next
lease-control call (R-CAN-5).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.states import RunState

STOPPING_ROLES = frozenset({"owner", "admin", "operator"})

#: Why an intent was recorded (the schema's `cancel_reason`): a person's cancel is always
#: `user` — no caller can claim another (R-CAN-1) —, a stop the control plane decides on
#: its own (a disabled project's Runs) is `policy`.
USER_REASON = "user"
POLICY_REASON = "policy"


class CancelOutcome(StrEnum):
    ACCEPTED = "accepted"
    ALREADY_REQUESTED = "already_requested"
    ALREADY_TERMINAL = "already_terminal"


@dataclass(frozen=True)
class BindingSnapshot:
    """What ingress admitted the caller under."""

    project_version: int
    binding_version: int
    role: str


@dataclass(frozen=True)
class PolicyNow:
    project_status: str
    project_version: int
    binding_status: str | None
    binding_version: int | None
    role: str | None
    principal_status: str | None


@dataclass(frozen=True)
class CancelTarget:
    state: RunState
    cancel_reason: str | None


def check_policy(snapshot: BindingSnapshot, now: PolicyNow | None) -> None:
    """Project drift, a revoked binding or a changed role fences the mutation (R-CAN-4)."""
    if now is None or now.project_status != "active" or now.binding_status != "active":
        raise Refused(Reason.ROLE_BINDING_FENCED, "the project or the role binding is not active")
    if now.principal_status != "active":
        # Disabled between ingress's admission and this transaction.
        raise Refused(Reason.ROLE_BINDING_FENCED, "the caller is no longer active")
    if (now.project_version, now.binding_version, now.role) != (
        snapshot.project_version,
        snapshot.binding_version,
        snapshot.role,
    ):
        raise Refused(Reason.ROLE_BINDING_FENCED, "the role binding changed since admission")
    if now.role not in STOPPING_ROLES:
        raise Refused(Reason.ROLE_BINDING_FENCED, "the role does not allow run.stop")


def decide_cancel(target: CancelTarget | None) -> CancelOutcome:
    if target is None:
        # Another project's Run and a missing Run look the same (R-CAN-4).
        raise Refused(Reason.RUN_NOT_FOUND, "no such run")
    if target.state.is_terminal:
        return CancelOutcome.ALREADY_TERMINAL
    if target.cancel_reason is not None:
        return CancelOutcome.ALREADY_REQUESTED
    return CancelOutcome.ACCEPTED
