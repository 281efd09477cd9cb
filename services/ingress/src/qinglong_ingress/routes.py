"""Every public method ingress serves, derived from the contracts, with its policy.

Worker methods are authorised by binding the certificate's worker to the request;
operator methods by project policy (admission.py); AdminService methods only for a
cluster-admin principal (docs/decisions/0002). A method missing from `_OPERATOR`
policy or from the runtime API makes this module fail at import, so a new RPC cannot
be served without a decision about who may call it.

How a call held for approval is answered comes from the contract too: a unary method
whose response has an ``outcome`` enum with a ``…_REQUIRE_APPROVAL`` value answers with
that outcome and the ``approval_id`` of the request that holds it (CancelRun, R-CAN-2);
any other method answers the typed status ``APPROVAL_REQUIRED`` with the id in its
ErrorInfo metadata (``approvalId``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from qinglong.admin.v1 import admin_service_pb2
from qinglong.control.v1 import approval_service_pb2, run_service_pb2, task_service_pb2
from qinglong.enrollment.v1 import enrollment_service_pb2
from qinglong.runtime.v1 import runtime_service_pb2
from qinglong.worker.v1 import worker_service_pb2

from qinglong_ingress.admission import Permission

Audience = Literal["worker", "operator", "admin", "enrollment"]

_OPERATOR: dict[str, Permission] = {
    "CreateTask": Permission.TASK_WRITE,
    "GetTask": Permission.READ,
    "ListTasks": Permission.READ,
    "CreateTaskRevision": Permission.TASK_WRITE,
    "GetTaskRevision": Permission.READ,
    "TriggerRun": Permission.RUN_TRIGGER,
    "GetRun": Permission.READ,
    "ListRuns": Permission.READ,
    "ListRunEvents": Permission.READ,
    "WatchRunEvents": Permission.READ,
    "CancelRun": Permission.RUN_STOP,
    "ListApprovals": Permission.READ,
    "GetApproval": Permission.READ,
    "Approve": Permission.APPROVAL_DECIDE,
    "Deny": Permission.APPROVAL_DECIDE,
    "ReadRunOutput": Permission.READ,
}


@dataclass(frozen=True)
class Route:
    service: str
    name: str
    request_type: type[Message]
    response_type: type[Message]
    runtime_request_type: type[Message]
    runtime_response_type: type[Message]
    audience: Audience
    permission: Permission | None
    server_streaming: bool
    approval_outcome: tuple[str, int] | None = None
    """The response field and value that answer a call held for approval, if the
    contract has them; otherwise such a call is answered APPROVAL_REQUIRED."""

    def approval_response(self, approval_id: str) -> Message | None:
        """The answer to a call held for approval, naming the request that holds it where
        the response has an ``approval_id``; None: then it is a typed status."""
        if self.approval_outcome is None:
            return None
        field, value = self.approval_outcome
        answer = self.response_type(**{field: value})
        if _APPROVAL_ID_FIELD in answer.DESCRIPTOR.fields_by_name:
            setattr(answer, _APPROVAL_ID_FIELD, approval_id)
        return answer

    @property
    def full_method(self) -> str:
        return f"/{self.service}/{self.name}"

    @property
    def runtime_method(self) -> str:
        return f"/qinglong.runtime.v1.RuntimeService/{self.name}"

    @property
    def operation(self) -> str:
        """The audit's operation name: `WorkerService/ClaimOffer`."""
        return f"{self.service.rsplit('.', 1)[-1]}/{self.name}"


def _routes(services: tuple[tuple[Any, str, Audience], ...]) -> tuple[Route, ...]:
    runtime = runtime_service_pb2.DESCRIPTOR.services_by_name["RuntimeService"]
    found = []
    for module, service_name, audience in services:
        service = module.DESCRIPTOR.services_by_name[service_name]
        for method in service.methods:
            permission = _OPERATOR[method.name] if audience == "operator" else None
            found.append(
                Route(
                    service=service.full_name,
                    name=method.name,
                    request_type=GetMessageClass(method.input_type),
                    response_type=GetMessageClass(method.output_type),
                    runtime_request_type=GetMessageClass(
                        runtime.methods_by_name[method.name].input_type
                    ),
                    runtime_response_type=GetMessageClass(
                        runtime.methods_by_name[method.name].output_type
                    ),
                    audience=audience,
                    permission=permission,
                    server_streaming=method.server_streaming,
                    approval_outcome=_approval_outcome(method),
                )
            )
    return tuple(found)


_OUTCOME_FIELD = "outcome"
_APPROVAL_ID_FIELD = "approval_id"
_REQUIRE_APPROVAL_SUFFIX = "_REQUIRE_APPROVAL"


def _approval_outcome(method: MethodDescriptor) -> tuple[str, int] | None:
    """The response's ``outcome`` enum value that says "needs approval", if it has one."""
    if method.server_streaming:
        return None  # a stream has no single answer
    field = method.output_type.fields_by_name.get(_OUTCOME_FIELD)
    if field is None or field.enum_type is None:
        return None
    for value in field.enum_type.values:
        if value.name.endswith(_REQUIRE_APPROVAL_SUFFIX):
            return field.name, value.number
    return None


#: What the public (mutual TLS) listener serves.
ROUTES: tuple[Route, ...] = _routes(
    (
        (worker_service_pb2, "WorkerService", "worker"),
        (task_service_pb2, "TaskService", "operator"),
        (run_service_pb2, "RunService", "operator"),
        (approval_service_pb2, "ApprovalService", "operator"),
        (admin_service_pb2, "AdminService", "admin"),
    )
)
#: What the Worker enrollment listener serves, and nothing else (R-ADM-2).
ENROLLMENT_ROUTES: tuple[Route, ...] = _routes(
    ((enrollment_service_pb2, "EnrollmentService", "enrollment"),)
)
