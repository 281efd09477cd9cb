"""Bounds before work: ingress byte caps, field bounds, unknown fields (R-ING-2, R-LC-1).

Pure and fast: no server, no database. The coverage tests walk the contracts' descriptors,
so a field added to a public request without a ``buf.validate`` rule fails this suite.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import FrozenInstanceError, dataclass
from typing import Any, Final

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FileDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from qinglong.admin.v1 import admin_pb2, admin_service_pb2
from qinglong.control.v1 import (
    approval_pb2,
    run_service_pb2,
    task_service_pb2,
)
from qinglong.control.v1 import approval_service_pb2 as aps
from qinglong.enrollment.v1 import enrollment_service_pb2
from qinglong.rpc.v1 import execution_pb2, fence_pb2, lifecycle_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_pb2, worker_service_pb2
from qinglong_ingress import validation
from qinglong_ingress.validation import (
    MAX_RECEIVE_MESSAGE_BYTES,
    MAX_REPORTED_VIOLATIONS,
    REQUEST_BYTE_CAPS,
    WHOLE_REQUEST,
    FieldViolation,
    primary_reason,
    request_size_violation,
    unknown_field_paths,
    validate_request,
)
from qinglong_protocol import bounds
from qinglong_protocol.contract_rules import unruled_fields
from qinglong_protocol.request_bounds import require_rules

W = "/qinglong.worker.v1.WorkerService/"
T = "/qinglong.control.v1.TaskService/"
R = "/qinglong.control.v1.RunService/"
A = "/qinglong.admin.v1.AdminService/"
E = "/qinglong.enrollment.v1.EnrollmentService/"
AP = "/qinglong.control.v1.ApprovalService/"
APPROVAL = "7d3c2b1a-0f9e-4d8c-8b7a-6a5b4c3d2e1f"

WORKER = "edge-01"
PROJECT = "proj-a"
SESSION = "0f8fad5b-d9cb-469f-a165-70867728950e"
RUN = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
ATTEMPT = "16fd2706-8baf-433b-82eb-8c7fada847da"
OFFER = "886313e1-3b8a-5372-9b90-0c9aee199e5d"
TASK = "a8098c1a-f86e-11da-bd1a-00112444be1e"
TOKEN = bounds.encode_lease_capability(hashlib.sha256(b"ingress validation test").digest())
WEAK_TOKEN = bounds.encode_lease_capability(bytes(32))
DIGEST = hashlib.sha256(b"callback token").hexdigest()

EXECUTOR = execution_pb2.ExecutorType.EXECUTOR_TYPE_REMOTE_WORKER
ALL_RUN_STATES = [state for state in lifecycle_pb2.RunState.values() if state != 0]
INVALID = ErrorReason.ERROR_REASON_FIELD_INVALID
MALFORMED = ErrorReason.ERROR_REASON_CAPABILITY_MALFORMED
WEAK = ErrorReason.ERROR_REASON_CAPABILITY_WEAK
UNKNOWN = ErrorReason.ERROR_REASON_UNKNOWN_FIELD
TOO_LARGE = ErrorReason.ERROR_REASON_REQUEST_TOO_LARGE

ws = worker_service_pb2
ts = task_service_pb2
rs = run_service_pb2
ad = admin_service_pb2
en = enrollment_service_pb2
#: The shape a PEM CSR has (the contract bounds its length and prefix; control parses it).
CSR = "-----BEGIN CERTIFICATE REQUEST-----\n" + "A" * 64 + "\n-----END CERTIFICATE REQUEST-----\n"


def fence() -> fence_pb2.Fence:
    return fence_pb2.Fence(
        worker_id=WORKER,
        session_id=SESSION,
        worker_generation=3,
        project_id=PROJECT,
        run_id=RUN,
        attempt_id=ATTEMPT,
        offer_id=OFFER,
        lease_generation=1,
        lease_token=TOKEN,
        expected_lease_version=1,
    )


def plan() -> execution_pb2.ExecutionPlan:
    return execution_pb2.ExecutionPlan(
        executor_type=EXECUTOR, command=["/bin/echo", "hello"], timeout_ms=60_000
    )


def valid_requests() -> dict[str, Message]:
    """One valid request per public method."""
    return {
        W + "OpenSession": ws.OpenSessionRequest(
            request_id="open-1",
            worker_id=WORKER,
            agent_version="qinglong-worker 0.1.0",
            executor_types=[EXECUTOR],
            max_concurrent_attempts=4,
        ),
        W + "RenewSession": ws.RenewSessionRequest(
            worker_id=WORKER, session_id=SESSION, worker_generation=3
        ),
        W + "DrainSession": ws.DrainSessionRequest(
            worker_id=WORKER, session_id=SESSION, worker_generation=3
        ),
        W + "PullOffers": ws.PullOffersRequest(
            worker_id=WORKER, session_id=SESSION, worker_generation=3, max_offers=8
        ),
        W + "ClaimOffer": ws.ClaimOfferRequest(
            worker_id=WORKER,
            session_id=SESSION,
            worker_generation=3,
            offer_id=OFFER,
            project_id=PROJECT,
            run_id=RUN,
            lease_token=TOKEN,
        ),
        W + "AcknowledgeStarting": ws.AcknowledgeStartingRequest(fence=fence()),
        W + "AcknowledgeRunning": ws.AcknowledgeRunningRequest(
            fence=fence(),
            executor_handle="pid:4242;start:1735689600123",
            callback_sequence=0,
            callback_token_digest=DIGEST,
        ),
        W + "ReportStartFailure": ws.ReportStartFailureRequest(
            fence=fence(), error_summary="executable not found"
        ),
        W + "ControlLease": ws.ControlLeaseRequest(fence=fence()),
        W + "CompleteAttempt": ws.CompleteAttemptRequest(
            fence=fence(),
            callback_sequence=0,
            outcome=worker_pb2.AttemptOutcome.ATTEMPT_OUTCOME_SUCCEEDED,
            exit_code=0,
        ),
        W + "RenewCertificate": ws.RenewCertificateRequest(
            worker_id=WORKER, certificate_signing_request_pem=CSR
        ),
        W + "AppendOutput": ws.AppendOutputRequest(
            fence=fence(), offset=65536, data=b"\x00\xff binary is fine\n"
        ),
        T + "CreateTask": ts.CreateTaskRequest(
            project_id=PROJECT,
            request_id="task-1",
            display_name="Nightly build",
            labels={"team": "infra", "tier": ""},
        ),
        T + "GetTask": ts.GetTaskRequest(project_id=PROJECT, task_id=TASK),
        T + "ListTasks": ts.ListTasksRequest(project_id=PROJECT),
        T + "CreateTaskRevision": ts.CreateTaskRevisionRequest(
            project_id=PROJECT, task_id=TASK, request_id="rev-1", plan=plan()
        ),
        T + "GetTaskRevision": ts.GetTaskRevisionRequest(
            project_id=PROJECT, task_id=TASK, revision_number=1
        ),
        R + "TriggerRun": rs.TriggerRunRequest(
            project_id=PROJECT, task_id=TASK, request_id="trigger-1"
        ),
        R + "GetRun": rs.GetRunRequest(project_id=PROJECT, run_id=RUN),
        R + "ListRuns": rs.ListRunsRequest(project_id=PROJECT),
        R + "ListRunEvents": rs.ListRunEventsRequest(project_id=PROJECT, run_id=RUN),
        R + "WatchRunEvents": rs.WatchRunEventsRequest(
            project_id=PROJECT, run_id=RUN, after_sequence=12
        ),
        R + "CancelRun": rs.CancelRunRequest(project_id=PROJECT, run_id=RUN, mutation_id="stop-1"),
        R + "ReadRunOutput": rs.ReadRunOutputRequest(
            project_id=PROJECT, run_id=RUN, attempt_number=2, offset=4096
        ),
        AP + "ListApprovals": aps.ListApprovalsRequest(
            project_id=PROJECT, states=[approval_pb2.APPROVAL_STATE_PENDING]
        ),
        AP + "GetApproval": aps.GetApprovalRequest(project_id=PROJECT, approval_id=APPROVAL),
        AP + "Approve": aps.ApproveRequest(project_id=PROJECT, approval_id=APPROVAL),
        AP + "Deny": aps.DenyRequest(
            project_id=PROJECT, approval_id=APPROVAL, note="not during the release"
        ),
        A + "CreateProject": ad.CreateProjectRequest(
            request_id="project-1", project_id=PROJECT, display_name="Project A"
        ),
        A + "ListProjects": ad.ListProjectsRequest(page_size=10),
        A + "GetProject": ad.GetProjectRequest(project_id=PROJECT),
        A + "DisableProject": ad.DisableProjectRequest(project_id=PROJECT),
        A + "CreatePrincipal": ad.CreatePrincipalRequest(
            request_id="alice-1", kind=admin_pb2.PRINCIPAL_KIND_USER, name="alice"
        ),
        A + "ListPrincipals": ad.ListPrincipalsRequest(kind=admin_pb2.PRINCIPAL_KIND_AGENT),
        A + "GetPrincipal": ad.GetPrincipalRequest(principal_id=TASK),
        A + "DisablePrincipal": ad.DisablePrincipalRequest(principal_id=TASK),
        A + "IssueToken": ad.IssueTokenRequest(
            request_id="token-1", principal_id=TASK, ttl_seconds=3600
        ),
        A + "ListTokens": ad.ListTokensRequest(principal_id=TASK),
        A + "RevokeToken": ad.RevokeTokenRequest(token_id=RUN),
        A + "RotateToken": ad.RotateTokenRequest(
            request_id="rotate-1", token_id=RUN, overlap_seconds=600
        ),
        A + "GrantRole": ad.GrantRoleRequest(
            project_id=PROJECT, principal_id=TASK, role=admin_pb2.PROJECT_ROLE_OPERATOR
        ),
        A + "RevokeRole": ad.RevokeRoleRequest(project_id=PROJECT, principal_id=TASK),
        A + "ListRoleBindings": ad.ListRoleBindingsRequest(project_id=PROJECT),
        A + "CreateWorker": ad.CreateWorkerRequest(request_id="worker-1", worker_id=WORKER),
        A + "IssueJoinToken": ad.IssueJoinTokenRequest(
            request_id="join-2", worker_id=WORKER, ttl_seconds=600
        ),
        A + "ListWorkers": ad.ListWorkersRequest(),
        A + "DisableWorker": ad.DisableWorkerRequest(worker_id=WORKER),
        A + "SetWorkerProjects": ad.SetWorkerProjectsRequest(
            worker_id=WORKER, project_ids=[PROJECT, "other-proj"]
        ),
        A + "SetWorkerCordoned": ad.SetWorkerCordonedRequest(worker_id=WORKER, cordoned=True),
        E + "JoinWorker": en.JoinWorkerRequest(
            join_token="qlj1_" + TOKEN.removeprefix("qlc1_"), certificate_signing_request_pem=CSR
        ),
        A + "ListAuditRecords": ad.ListAuditRecordsRequest(
            principal_id=TASK,
            operation="RunService/CancelRun",
            outcome=admin_pb2.AUDIT_OUTCOME_PERMISSION_DENIED,
        ),
    }


def valid(method: str) -> Any:
    return valid_requests()[method]


def public_services() -> list[ServiceDescriptor]:
    """The public services, taken from the generated modules (not from validation.py)."""
    return [
        worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"],
        task_service_pb2.DESCRIPTOR.services_by_name["TaskService"],
        run_service_pb2.DESCRIPTOR.services_by_name["RunService"],
        aps.DESCRIPTOR.services_by_name["ApprovalService"],
        admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"],
        enrollment_service_pb2.DESCRIPTOR.services_by_name["EnrollmentService"],
    ]


def all_methods() -> dict[str, Descriptor]:
    return {
        f"/{service.full_name}/{method.name}": method.input_type
        for service in public_services()
        for method in service.methods
    }


def _strings(message: Message) -> Iterator[str]:
    """Every string value in a message, recursively (map keys and values too)."""
    for field, value in message.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            for key, item in value.items():
                yield from (key, item)
        elif field.message_type is not None:
            items = value if field.is_repeated else [value]
            for item in items:
                yield from _strings(item)
        elif isinstance(value, str):
            yield value
        elif field.is_repeated:
            yield from (item for item in value if isinstance(item, str))


def assert_no_echo(request: Message, violations: Iterable[FieldViolation], *leaks: str) -> None:
    """No description repeats a value of the request (R-SEC-1: the value may be a secret)."""
    values = [value for value in (*_strings(request), *leaks) if len(value) >= 6]
    for violation in violations:
        for value in values:
            assert value not in violation.description, (violation.field, "echoes a value")
        assert TOKEN not in violation.description
        assert DIGEST not in violation.description


# --- valid requests ------------------------------------------------------------------


def test_there_is_a_valid_request_for_every_method() -> None:
    requests = valid_requests()
    assert set(requests) == set(all_methods()) == set(REQUEST_BYTE_CAPS)
    for method, input_type in all_methods().items():
        assert requests[method].DESCRIPTOR.full_name == input_type.full_name, method


@pytest.mark.parametrize("method", sorted(valid_requests()))
def test_valid_request_passes(method: str) -> None:
    request = valid(method)
    assert validate_request(request) == []
    assert validate_request(request, serialized_size=request.ByteSize()) == []
    assert unknown_field_paths(request) == []
    assert request_size_violation(method, request.ByteSize()) is None


def test_optional_fields_may_be_absent_or_present() -> None:
    running = valid(W + "AcknowledgeRunning")
    running.log_artifact_id = "logs/run-1/attempt-1"
    assert validate_request(running) == []
    complete = valid(W + "CompleteAttempt")
    complete.ClearField("exit_code")
    complete.summary = ""
    assert validate_request(complete) == []
    complete.exit_code = -(2**31)
    assert validate_request(complete) == []
    revision = valid(T + "CreateTaskRevision")
    revision.plan.ClearField("timeout_ms")
    assert validate_request(revision) == []
    trigger = valid(R + "TriggerRun")
    trigger.revision_number = bounds.MAX_SAFE_INTEGER
    assert validate_request(trigger) == []
    runs = valid(R + "ListRuns")
    runs.task_id = TASK
    runs.page_size = bounds.PAGE_SIZE_MAX
    runs.page_token = "AbC_-1"
    runs.states[:] = ALL_RUN_STATES
    assert validate_request(runs) == []
    tasks = valid(T + "ListTasks")
    tasks.page_size = bounds.PAGE_SIZE_MAX
    tasks.page_token = "AbC_-1"
    assert validate_request(tasks) == []


def _maximal_requests() -> dict[str, Message]:
    """Requests with every field at its upper bound: the byte caps must admit them."""
    big_fence = fence_pb2.Fence(
        worker_id="w" * 63,
        session_id=SESSION,
        worker_generation=bounds.MAX_SAFE_INTEGER,
        project_id="p" * 63,
        run_id=RUN,
        attempt_id=ATTEMPT,
        offer_id=OFFER,
        lease_generation=bounds.MAX_SAFE_INTEGER,
        lease_token=TOKEN,
        expected_lease_version=bounds.MAX_SAFE_INTEGER,
    )
    four_byte = "\U0001d11e"  # 4 bytes in UTF-8, one code point
    return {
        W + "AcknowledgeRunning": ws.AcknowledgeRunningRequest(
            fence=big_fence,
            executor_handle="h" * 512,
            log_artifact_id="a" * 256,
            callback_sequence=bounds.MAX_SAFE_INTEGER,
            callback_token_digest=DIGEST,
        ),
        W + "ReportStartFailure": ws.ReportStartFailureRequest(
            fence=big_fence, error_summary=four_byte * 256
        ),
        W + "CompleteAttempt": ws.CompleteAttemptRequest(
            fence=big_fence,
            callback_sequence=bounds.MAX_SAFE_INTEGER,
            outcome=worker_pb2.AttemptOutcome.ATTEMPT_OUTCOME_FAILED,
            exit_code=-(2**31),
            summary=four_byte * 256,
        ),
        W + "OpenSession": ws.OpenSessionRequest(
            request_id="r" * 64,
            worker_id="w" * 63,
            agent_version="v" * 64,
            executor_types=[EXECUTOR],
            max_concurrent_attempts=64,
        ),
        T + "CreateTask": ts.CreateTaskRequest(
            project_id="p" * 63,
            request_id="r" * 64,
            display_name=four_byte * 200,
            labels={f"k{i:02d}" + "x" * 60: "v" * 256 for i in range(16)},
        ),
        T + "CreateTaskRevision": ts.CreateTaskRevisionRequest(
            project_id="p" * 63,
            task_id=TASK,
            request_id="r" * 64,
            plan=execution_pb2.ExecutionPlan(
                executor_type=EXECUTOR, command=["c" * 4096] * 16, timeout_ms=604_800_000
            ),
        ),
        T + "ListTasks": ts.ListTasksRequest(
            project_id="p" * 63, page_size=500, page_token="t" * 512
        ),
        R + "ListRuns": rs.ListRunsRequest(
            project_id="p" * 63,
            page_size=500,
            page_token="t" * 512,
            task_id=TASK,
            states=ALL_RUN_STATES,
        ),
    }


@pytest.mark.parametrize("method", sorted(_maximal_requests()))
def test_maximal_valid_request_fits_its_cap(method: str) -> None:
    request = _maximal_requests()[method]
    assert validate_request(request) == []
    assert request.ByteSize() <= REQUEST_BYTE_CAPS[method]


def test_maximal_command_of_many_small_items() -> None:
    request = valid(T + "CreateTaskRevision")
    request.plan.command[:] = ["c" * 1024] * 64  # 64 items, 65536 bytes in total
    assert validate_request(request) == []


# --- invalid requests ----------------------------------------------------------------


OPEN, RENEW, DRAIN, PULL = (
    W + "OpenSession",
    W + "RenewSession",
    W + "DrainSession",
    W + "PullOffers",
)
CLAIM, ACK_STARTING = W + "ClaimOffer", W + "AcknowledgeStarting"
ACK_RUNNING, START_FAILURE = W + "AcknowledgeRunning", W + "ReportStartFailure"
CONTROL, COMPLETE = W + "ControlLease", W + "CompleteAttempt"
CREATE_TASK, GET_TASK, LIST_TASKS = T + "CreateTask", T + "GetTask", T + "ListTasks"
CREATE_REVISION, GET_REVISION = T + "CreateTaskRevision", T + "GetTaskRevision"
TRIGGER, GET_RUN, LIST_RUNS = R + "TriggerRun", R + "GetRun", R + "ListRuns"
LIST_EVENTS, WATCH, CANCEL = R + "ListRunEvents", R + "WatchRunEvents", R + "CancelRun"

CLEAR: Final = object()  # marker: clear the field instead of setting it


@dataclass(frozen=True)
class Case:
    id: str
    method: str
    field: str  # dotted path of the field to change
    value: Any  # the new value; a list replaces a repeated/map field; CLEAR clears it
    paths: list[str]  # the violations expected, in order
    reason: ErrorReason.ValueType

    def request(self) -> Any:
        request = valid(self.method)
        *parents, name = self.field.split(".")
        target = request
        for parent in parents:
            target = getattr(target, parent)
        if self.value is CLEAR:
            target.ClearField(name)
        elif isinstance(self.value, dict):
            getattr(target, name).clear()
            getattr(target, name).update(self.value)
        elif isinstance(self.value, list):
            getattr(target, name)[:] = self.value
        else:
            setattr(target, name, self.value)
        return request


def bad(
    case_id: str,
    method: str,
    field: str,
    value: Any,
    *,
    paths: list[str] | None = None,
    reason: ErrorReason.ValueType = INVALID,
) -> Case:
    return Case(case_id, method, field, value, [field] if paths is None else paths, reason)


CASES = [
    # executor handle, log artifact
    bad("handle-513", ACK_RUNNING, "executor_handle", "h" * 513),
    bad("handle-514-bytes", ACK_RUNNING, "executor_handle", "é" * 257),
    bad("handle-empty", ACK_RUNNING, "executor_handle", ""),
    bad("handle-newline", ACK_RUNNING, "executor_handle", "pid:1\nFAKE LOG LINE"),
    bad("log-artifact-empty", ACK_RUNNING, "log_artifact_id", ""),
    bad("log-artifact-257", ACK_RUNNING, "log_artifact_id", "a" * 257),
    # callback digest and sequence
    bad("digest-uppercase", ACK_RUNNING, "callback_token_digest", DIGEST.upper()),
    bad("digest-63", ACK_RUNNING, "callback_token_digest", DIGEST[:63]),
    bad("digest-missing", ACK_RUNNING, "callback_token_digest", ""),
    bad("callback-sequence-negative", ACK_RUNNING, "callback_sequence", -1),
    bad("callback-sequence-unsafe", COMPLETE, "callback_sequence", 2**53),
    # enums: unknown numbers stay ints in proto3, UNSPECIFIED is never a value
    bad("executor-types-unknown", OPEN, "executor_types", [99], paths=["executor_types[0]"]),
    bad("executor-types-zero", OPEN, "executor_types", [EXECUTOR, 0], paths=["executor_types[1]"]),
    # "unique" is a rule of the list, so its violation names the list.
    bad("executor-types-dup", OPEN, "executor_types", [EXECUTOR] * 2),
    bad("executor-types-empty", OPEN, "executor_types", []),
    # Nine of eight known values: too many and, necessarily, a repeat.
    bad(
        "executor-types-too-many",
        OPEN,
        "executor_types",
        [EXECUTOR] * 9,
        paths=["executor_types", "executor_types"],
    ),
    bad("outcome-unspecified", COMPLETE, "outcome", 0),
    bad("outcome-unknown", COMPLETE, "outcome", 42),
    bad("plan-executor-unspecified", CREATE_REVISION, "plan.executor_type", 0),
    bad("plan-executor-unknown", CREATE_REVISION, "plan.executor_type", 7),
    bad("states-unspecified", LIST_RUNS, "states", [0], paths=["states[0]"]),
    bad("states-unknown", LIST_RUNS, "states", [2, 12], paths=["states[1]"]),
    bad("states-duplicate", LIST_RUNS, "states", [2, 3, 2]),
    bad("states-too-many", LIST_RUNS, "states", [*ALL_RUN_STATES, 1], paths=["states", "states"]),
    # UUIDs
    bad("uuid-uppercase", GET_RUN, "run_id", RUN.upper()),
    bad("uuid-no-dashes", CONTROL, "fence.session_id", SESSION.replace("-", "")),
    bad("uuid-trailing-newline", GET_TASK, "task_id", TASK + "\n"),
    bad("uuid-missing", CLAIM, "offer_id", ""),
    bad("uuid-or-empty-bad", LIST_RUNS, "task_id", "not-a-uuid"),
    # lease capability: shape, then strength
    bad("token-is-hex", CLAIM, "lease_token", DIGEST, reason=MALFORMED),
    bad("fence-token-is-hex", CONTROL, "fence.lease_token", DIGEST, reason=MALFORMED),
    bad("token-padded", CLAIM, "lease_token", TOKEN + "=", reason=MALFORMED),
    bad("token-std-alphabet", COMPLETE, "fence.lease_token", TOKEN[:-1] + "+", reason=MALFORMED),
    bad("token-missing", ACK_STARTING, "fence.lease_token", "", reason=MALFORMED),
    bad("token-weak", CLAIM, "lease_token", WEAK_TOKEN, reason=WEAK),
    bad("fence-token-weak", CONTROL, "fence.lease_token", WEAK_TOKEN, reason=WEAK),
    # request ids and mutation ids
    bad("request-id-missing-open", OPEN, "request_id", ""),
    bad("request-id-missing-task", CREATE_TASK, "request_id", ""),
    bad("request-id-missing-revision", CREATE_REVISION, "request_id", ""),
    bad("request-id-missing-trigger", TRIGGER, "request_id", ""),
    bad("request-id-65", TRIGGER, "request_id", "r" * 65),
    bad("request-id-space", OPEN, "request_id", "open 1"),
    bad("mutation-id-missing", CANCEL, "mutation_id", ""),
    # slugs
    bad("slug-uppercase", OPEN, "worker_id", "Edge-01"),
    bad("slug-leading-dash", PULL, "worker_id", "-edge"),
    bad("slug-64", GET_RUN, "project_id", "p" * 64),
    bad("slug-missing", CONTROL, "fence.project_id", ""),
    # integers
    bad("max-offers-0", PULL, "max_offers", 0),
    bad("max-offers-65", PULL, "max_offers", 65),
    bad("max-concurrent-0", OPEN, "max_concurrent_attempts", 0),
    bad("max-concurrent-65", OPEN, "max_concurrent_attempts", 65),
    bad("page-size-501", LIST_RUNS, "page_size", 501),
    bad("page-size-negative", LIST_RUNS, "page_size", -1),
    bad("tasks-page-size-501", LIST_TASKS, "page_size", 501),
    bad("tasks-page-size-negative", LIST_TASKS, "page_size", -1),
    bad("events-page-size-501", LIST_EVENTS, "page_size", 501),
    bad("generation-0", RENEW, "worker_generation", 0),
    bad("generation-unsafe", DRAIN, "worker_generation", 2**53),
    bad("fence-expected-version-0", CONTROL, "fence.expected_lease_version", 0),
    bad("fence-lease-generation-negative", CONTROL, "fence.lease_generation", -5),
    bad("revision-number-0", GET_REVISION, "revision_number", 0),
    bad("optional-revision-number-0", TRIGGER, "revision_number", 0),
    bad("after-sequence-negative", LIST_EVENTS, "after_sequence", -1),
    bad("watch-after-sequence-unsafe", WATCH, "after_sequence", 2**53),
    bad("timeout-0", CREATE_REVISION, "plan.timeout_ms", 0),
    bad("timeout-over-7-days", CREATE_REVISION, "plan.timeout_ms", 604_800_001),
    # command argv
    bad("argv-65-items", CREATE_REVISION, "plan.command", ["x"] * 65),
    bad("argv-empty", CREATE_REVISION, "plan.command", []),
    bad(
        "argv-nul-item",
        CREATE_REVISION,
        "plan.command",
        ["/bin/sh", "-c", "true", "a\x00b"],
        paths=["plan.command[3]"],
    ),
    bad(
        "argv-empty-item",
        CREATE_REVISION,
        "plan.command",
        ["/bin/echo", ""],
        paths=["plan.command[1]"],
    ),
    bad(
        "argv-item-4097",
        CREATE_REVISION,
        "plan.command",
        ["/bin/echo", "x" * 4097],
        paths=["plan.command[1]"],
    ),
    bad("argv-total-over-64k", CREATE_REVISION, "plan.command", ["x" * 4096] * 17),
    # free text
    bad("error-summary-empty", START_FAILURE, "error_summary", ""),
    bad("error-summary-escape", START_FAILURE, "error_summary", "boom\x1b[31m"),
    bad("summary-257", COMPLETE, "summary", "s" * 257),
    bad("agent-version-65", OPEN, "agent_version", "v" * 65),
    bad("display-name-empty", CREATE_TASK, "display_name", ""),
    bad("display-name-201", CREATE_TASK, "display_name", "n" * 201),
    bad("page-token-alphabet", LIST_RUNS, "page_token", "abc+def/=="),
    bad("tasks-page-token-alphabet", LIST_TASKS, "page_token", "abc+def/=="),
    bad("tasks-page-token-513", LIST_TASKS, "page_token", "t" * 513),
    # labels (the path is the map: a key is caller data and is not echoed)
    bad("labels-17", CREATE_TASK, "labels", {f"k{i}": "v" for i in range(17)}),
    bad("labels-bad-key", CREATE_TASK, "labels", {"Team": "infra"}),
    bad("labels-bad-value", CREATE_TASK, "labels", {"team": "in\nfra-secret"}),
    bad("labels-long-value", CREATE_TASK, "labels", {"team": "v" * 257}),
    # required messages
    bad("fence-missing", CONTROL, "fence", CLEAR),
    bad("fence-missing-complete", COMPLETE, "fence", CLEAR),
    bad("plan-missing", CREATE_REVISION, "plan", CLEAR),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_invalid_request_names_exactly_the_bad_fields(case: Case) -> None:
    request = case.request()
    violations = validate_request(request)
    assert [v.field for v in violations] == case.paths
    assert {v.reason for v in violations} == {case.reason}
    assert primary_reason(violations) == case.reason
    assert all(v.description for v in violations)
    assert_no_echo(request, violations)


def test_several_violations_are_reported_in_field_order() -> None:
    request = ws.OpenSessionRequest(agent_version="ok")
    paths = [v.field for v in validate_request(request)]
    assert paths == ["request_id", "worker_id", "executor_types", "max_concurrent_attempts"]


#: Listings whose every filter is optional: their empty request is the whole first page.
ALL_OPTIONAL: Final = frozenset(
    {A + "ListProjects", A + "ListPrincipals", A + "ListWorkers", A + "ListAuditRecords"}
)


def test_every_method_refuses_its_empty_request_unless_all_optional() -> None:
    """Every other public request names something: its default instance has a violation."""
    for method, request in valid_requests().items():
        empty = type(request)()
        assert bool(validate_request(empty)) is (method not in ALL_OPTIONAL), method


def test_violations_are_frozen_and_hide_the_token() -> None:
    request = valid(W + "ClaimOffer")
    request.lease_token = TOKEN + "x"
    (violation,) = validate_request(request)
    with pytest.raises(FrozenInstanceError):
        violation.field = "other"  # type: ignore[misc]
    assert TOKEN not in repr(violation)


# --- unknown fields ------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3 | 0) + _varint(value)


def bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def parsed(request: Message, extra: bytes) -> Any:
    """``request`` as a server would parse it with ``extra`` appended on the wire."""
    result = type(request)()
    result.ParseFromString(request.SerializeToString() + extra)
    return result


def test_unknown_top_level_field_is_refused() -> None:
    request = parsed(valid(W + "ControlLease"), varint_field(99, 1))
    assert unknown_field_paths(request) == ["99"]
    violations = validate_request(request)
    assert [(v.field, v.reason) for v in violations] == [("99", UNKNOWN)]
    assert primary_reason(violations) == UNKNOWN


def test_unknown_nested_field_is_refused_without_echo() -> None:
    base = valid(W + "ControlLease")
    fence_bytes = base.fence.SerializeToString() + bytes_field(12, TOKEN.encode())
    request = ws.ControlLeaseRequest()
    request.ParseFromString(bytes_field(1, fence_bytes))
    assert request.fence.ListFields() == base.fence.ListFields()  # known fields as usual
    assert unknown_field_paths(request) == ["fence.12"]
    violations = validate_request(request)
    assert [v.field for v in violations] == ["fence.12"]
    assert_no_echo(request, violations)


def test_unknown_fields_are_listed_once_each_and_with_other_violations() -> None:
    base = valid(T + "CreateTaskRevision")
    base.request_id = ""
    # A number the plan does not declare (yet): one past its highest.
    unknown = max(field.number for field in base.plan.DESCRIPTOR.fields) + 1
    plan_bytes = base.plan.SerializeToString() + varint_field(unknown, 1)
    extra = varint_field(50, 1) + varint_field(50, 2) + bytes_field(4, plan_bytes)
    request = parsed(base, extra)
    assert unknown_field_paths(request) == ["50", f"plan.{unknown}"]
    violations = validate_request(request)
    assert [v.field for v in violations] == ["50", f"plan.{unknown}", "request_id"]
    assert primary_reason(violations) == UNKNOWN


def test_number_of_reported_violations_is_bounded() -> None:
    extra = b"".join(varint_field(number, 1) for number in range(100, 200))
    request = parsed(valid(W + "RenewSession"), extra)
    assert len(unknown_field_paths(request)) == 100
    assert len(validate_request(request)) == MAX_REPORTED_VIOLATIONS


# --- byte caps -----------------------------------------------------------------------


def test_byte_caps_per_method() -> None:
    kib = 1024
    assert dict(REQUEST_BYTE_CAPS) == {
        W + "OpenSession": 8 * kib,
        W + "RenewSession": 8 * kib,
        W + "DrainSession": 8 * kib,
        W + "PullOffers": 8 * kib,
        W + "ClaimOffer": 8 * kib,
        W + "AcknowledgeStarting": 8 * kib,
        W + "AcknowledgeRunning": 8 * kib,
        W + "ReportStartFailure": 8 * kib,
        W + "ControlLease": 8 * kib,  # R-LC-1
        W + "CompleteAttempt": 8 * kib,
        W + "RenewCertificate": 8 * kib,
        # A chunk of output (at most 64 KiB) on top of what any Worker request carries.
        W + "AppendOutput": 64 * kib + 8 * kib,
        T + "CreateTask": 128 * kib,
        T + "GetTask": 128 * kib,
        T + "ListTasks": 128 * kib,
        T + "CreateTaskRevision": 128 * kib,
        T + "GetTaskRevision": 128 * kib,
        R + "TriggerRun": 8 * kib + 32 * (64 + 1024 + 9),  # and its parameters at most
        R + "GetRun": 8 * kib,
        R + "ListRuns": 8 * kib,
        R + "ListRunEvents": 8 * kib,
        R + "WatchRunEvents": 8 * kib,
        R + "CancelRun": 8 * kib,
        R + "ReadRunOutput": 8 * kib,
        **{AP + name: 8 * kib for name in ("ListApprovals", "GetApproval", "Approve", "Deny")},
        **{
            A + method.name: 8 * kib
            for service in public_services()
            if service.name == "AdminService"
            for method in service.methods
        },
        E + "JoinWorker": 8 * kib,
    }
    assert REQUEST_BYTE_CAPS[W + "ControlLease"] == bounds.LEASE_CONTROL_REQUEST_MAX_BYTES
    assert MAX_RECEIVE_MESSAGE_BYTES == max(REQUEST_BYTE_CAPS.values()) == 128 * kib


def test_request_size_violation_on_raw_size() -> None:
    method = W + "ControlLease"
    assert request_size_violation(method, 8192) is None
    violation = request_size_violation(method, 8193)
    assert violation is not None
    assert violation.field == WHOLE_REQUEST
    assert violation.reason == TOO_LARGE
    assert "8192" in violation.description
    assert request_size_violation(T + "CreateTaskRevision", 128 * 1024) is None
    assert request_size_violation(T + "CreateTaskRevision", 128 * 1024 + 1) is not None
    # Health and reflection are not public contracts: the transport limit applies to them.
    assert request_size_violation("/grpc.health.v1.Health/Check", 10**6) is None


def test_request_over_its_cap_gets_only_the_size_violation() -> None:
    request = valid(W + "AcknowledgeRunning")
    request.executor_handle = "h" * 9000  # also over its own bound: not even looked at
    assert request.ByteSize() > 8192
    violations = validate_request(request)
    assert [(v.field, v.reason) for v in violations] == [(WHOLE_REQUEST, TOO_LARGE)]
    assert primary_reason(violations) == TOO_LARGE
    assert_no_echo(request, violations)


def test_raw_size_counts_even_when_the_parsed_message_is_small() -> None:
    """Repeating a scalar on the wire parses to one value; the raw size still counts."""
    base = valid(W + "ControlLease")
    wire = base.SerializeToString() + bytes_field(1, base.fence.SerializeToString()) * 40
    request = ws.ControlLeaseRequest()
    request.ParseFromString(wire)
    assert request.ByteSize() <= 8192 < len(wire)
    assert validate_request(request) == []  # the parsed message alone looks fine
    violations = validate_request(request, serialized_size=len(wire))
    assert [v.reason for v in violations] == [TOO_LARGE]


def test_transport_limit_admits_every_cap() -> None:
    oversized = valid(T + "CreateTaskRevision")
    oversized.plan.command[:] = ["x" * 4096] * 40
    assert oversized.ByteSize() > MAX_RECEIVE_MESSAGE_BYTES
    assert [v.reason for v in validate_request(oversized)] == [TOO_LARGE]


def test_primary_reason_precedence() -> None:
    def violation(reason: ErrorReason.ValueType) -> FieldViolation:
        return FieldViolation("f", "rule", reason)

    assert primary_reason([violation(INVALID), violation(MALFORMED)]) == MALFORMED
    assert primary_reason([violation(WEAK), violation(MALFORMED), violation(UNKNOWN)]) == UNKNOWN
    assert primary_reason([violation(INVALID), violation(WEAK)]) == WEAK
    with pytest.raises(ValueError, match="no violations"):
        primary_reason([])


# --- coverage: every reachable request field has a rule ------------------------------


def _reachable_messages(services: Iterable[ServiceDescriptor]) -> dict[str, Descriptor]:
    found: dict[str, Descriptor] = {}

    def visit(message: Descriptor) -> None:
        if message.full_name in found:
            return
        found[message.full_name] = message
        for field in message.fields:
            nested = field.message_type
            if nested is not None and not nested.GetOptions().map_entry:
                visit(nested)

    for service in services:
        for method in service.methods:
            visit(method.input_type)
    return found


def _coverage_problems(services: Iterable[ServiceDescriptor]) -> list[str]:
    return sorted(
        {
            f"{name}: no rule"
            for service in services
            for method in service.methods
            for name in unruled_fields(method.input_type)
        }
    )


def test_every_field_of_every_public_request_has_a_fitting_rule() -> None:
    reachable = _reachable_messages(public_services())
    assert "qinglong.rpc.v1.Fence" in reachable
    assert "qinglong.rpc.v1.ExecutionPlan" in reachable
    assert "qinglong.rpc.v1.RetryPolicy" in reachable
    # Every request + Fence + ExecutionPlan + RetryPolicy + Timestamp (audit time filters)
    assert len(reachable) == len(all_methods()) + 4
    assert _coverage_problems(public_services()) == []


def _pool_with_extra_field(message_name: str, field_name: str, number: int) -> Any:
    """A copy of the contracts in a fresh pool, with one string field added to a message."""
    pool = descriptor_pool.DescriptorPool()
    added: set[str] = set()
    short_name = message_name.rpartition(".")[2]
    target = descriptor_pool.Default().FindMessageTypeByName(message_name).file

    def add(file: FileDescriptor) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        if file.name == target.name:
            message = next(m for m in proto.message_type if m.name == short_name)
            message.field.add(
                name=field_name,
                number=number,
                type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING,
                label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL,
            )
        pool.Add(proto)
        added.add(file.name)

    add(target)
    for module in (worker_service_pb2, task_service_pb2, run_service_pb2):
        add(module.DESCRIPTOR)
    return pool


def test_coverage_check_catches_a_field_without_a_rule() -> None:
    """Adding a field to a public request without a rule breaks this suite."""
    pool = _pool_with_extra_field("qinglong.rpc.v1.Fence", "extra", 11)
    services = [pool.FindServiceByName("qinglong.worker.v1.WorkerService")]
    problems = _coverage_problems(services)
    assert "qinglong.rpc.v1.Fence.extra: no rule" in problems


def test_a_field_without_a_rule_fails_closed_at_start() -> None:
    """A contract whose request gained a field without a rule refuses to load at all."""
    pool = _pool_with_extra_field("qinglong.worker.v1.ControlLeaseRequest", "extra", 2)
    request = pool.FindMessageTypeByName("qinglong.worker.v1.ControlLeaseRequest")
    with pytest.raises(RuntimeError, match=r"ControlLeaseRequest\.extra"):
        require_rules([request])
    require_rules([worker_service_pb2.ControlLeaseRequest.DESCRIPTOR])  # the real one loads


def test_a_message_type_without_rules_fails_closed() -> None:
    with pytest.raises(RuntimeError, match="RenewSessionResponse"):
        require_rules([worker_service_pb2.RenewSessionResponse.DESCRIPTOR])


def test_rules_module_exports_what_ingress_uses() -> None:
    assert set(validation.__all__) >= {
        "REQUEST_BYTE_CAPS",
        "MAX_RECEIVE_MESSAGE_BYTES",
        "FieldViolation",
        "validate_request",
        "unknown_field_paths",
    }
