"""Project policy: which role may do what, decided before a request is forwarded.

SPEC R-CAN-2: `run.stop` passes for owner, admin and operator; an agent asking for it
gets an explicit `require_approval` answer, never a cancel.
"""

from __future__ import annotations

from enum import Enum, StrEnum, auto

from qinglong_ingress.principals import Principal, PrincipalKind


class Permission(StrEnum):
    READ = "read"
    TASK_WRITE = "task.write"
    RUN_TRIGGER = "run.trigger"
    RUN_STOP = "run.stop"


class Decision(Enum):
    ADMIT = auto()
    REQUIRE_APPROVAL = auto()
    DENY = auto()


_WRITERS = frozenset({"owner", "admin", "operator"})
_GRANTS: dict[Permission, frozenset[str]] = {
    Permission.READ: _WRITERS | {"viewer"},
    Permission.TASK_WRITE: _WRITERS,
    Permission.RUN_TRIGGER: _WRITERS,
    Permission.RUN_STOP: _WRITERS,
}


def decide(principal: Principal, role: str | None, permission: Permission) -> Decision:
    if role is None or role not in _GRANTS[permission]:
        return Decision.DENY
    if permission is Permission.RUN_STOP and principal.kind is PrincipalKind.AGENT:
        return Decision.REQUIRE_APPROVAL
    return Decision.ADMIT
