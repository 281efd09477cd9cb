"""Project policy: which role may do what, decided before a request is forwarded.

A policy is data: which roles grant each permission, which permissions a kind of
principal may only *request* (the call is held for a second person's approval, SPEC
R-OPS-2), and which it may not exercise at all. SPEC R-CAN-2 is one line of it: `run.stop`
passes for owner, admin and operator; an Agent asking for it gets `require_approval`,
never a cancel. Requiring an approval for another method is another line here, plus the
method's execution in control (qinglong_control.held_mutations); the gateway holds any unary
such call the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum, auto

from qinglong_ingress.principals import Principal, PrincipalKind


class Permission(StrEnum):
    READ = "read"
    TASK_WRITE = "task.write"
    RUN_TRIGGER = "run.trigger"
    RUN_STOP = "run.stop"
    APPROVAL_DECIDE = "approval.decide"


class Decision(Enum):
    ADMIT = auto()
    REQUIRE_APPROVAL = auto()
    DENY = auto()


_WRITERS = frozenset({"owner", "admin", "operator"})


@dataclass(frozen=True)
class Policy:
    grants: Mapping[Permission, frozenset[str]]
    """The project roles that grant each permission."""
    held: Mapping[PrincipalKind, frozenset[Permission]] = field(default_factory=dict)
    """What a kind of principal may only request: the call is held for approval."""
    withheld: Mapping[PrincipalKind, frozenset[Permission]] = field(default_factory=dict)
    """What a kind of principal may not do whatever its role."""

    def decide(self, principal: Principal, role: str | None, permission: Permission) -> Decision:
        if role is None or role not in self.grants.get(permission, frozenset()):
            return Decision.DENY
        if permission in self.withheld.get(principal.kind, frozenset()):
            return Decision.DENY
        if permission in self.held.get(principal.kind, frozenset()):
            return Decision.REQUIRE_APPROVAL
        return Decision.ADMIT


DEFAULT_POLICY = Policy(
    grants={
        Permission.READ: _WRITERS | {"viewer"},
        Permission.TASK_WRITE: _WRITERS,
        Permission.RUN_TRIGGER: _WRITERS,
        Permission.RUN_STOP: _WRITERS,
        # Deciding an approval may run the held mutation: the same roles as run.stop.
        Permission.APPROVAL_DECIDE: _WRITERS,
    },
    held={PrincipalKind.AGENT: frozenset({Permission.RUN_STOP})},
    # An Agent's request waits for a person; an Agent approving would defeat that.
    withheld={PrincipalKind.AGENT: frozenset({Permission.APPROVAL_DECIDE})},
)


def decide(principal: Principal, role: str | None, permission: Permission) -> Decision:
    """The default policy's decision."""
    return DEFAULT_POLICY.decide(principal, role, permission)
