"""Translation between the wire (generated protobuf) and the runtime's domain values.

Requests arrive here already within the contract's field rules (contract_bounds.py runs
them before any servicer), so parsing only converts: UUID text to UUIDs, the lease
capability to its digest at once, enums to domain names. What no field rule can know is
refused here with a `Refused`: a page token this server never issued, a weak capability.
Answers are rendered back with DB-time timestamps and remaining durations.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, Final

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from qinglong.control.v1 import run_pb2, run_service_pb2, task_pb2
from qinglong.rpc.v1 import execution_pb2, fence_pb2, lifecycle_pb2
from qinglong.runtime.v1 import caller_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2
from qinglong_protocol import bounds

from qinglong_control import paging
from qinglong_control.db.definitions import RevisionPlan, RevisionView, TaskView
from qinglong_control.db.events import Actor
from qinglong_control.db.placement import Offers, PlacedOffer, Plan
from qinglong_control.db.runs import EventView, RunView
from qinglong_control.domain.approvals import APPROVAL_EVENT_PREFIX
from qinglong_control.domain.cancellation import BindingSnapshot, CancelOutcome
from qinglong_control.domain.capability import TokenDigest, digest_of_capability, parse_digest
from qinglong_control.domain.fence import Fence
from qinglong_control.domain.lease_control import LeaseAnswer, LeaseDecision
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.retry import NO_RETRY, Ending, RetryPolicy
from qinglong_control.domain.timings import Timings

EXECUTOR_TYPES = {execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER: "remote_worker"}
EXECUTOR_TYPE_VALUES = {name: value for value, name in EXECUTOR_TYPES.items()}
RETRYABLE_ENDINGS = {
    execution_pb2.RETRYABLE_OUTCOME_FAILED: Ending.FAILED,
    execution_pb2.RETRYABLE_OUTCOME_START_FAILED: Ending.START_FAILED,
}
RETRYABLE_OUTCOMES = {ending: value for value, ending in RETRYABLE_ENDINGS.items()}


def operator_of(caller: caller_pb2.Caller) -> Actor:
    """The user or agent ingress vouched for; anything else is not an operator call."""
    kinds = {caller_pb2.PRINCIPAL_KIND_USER: "user", caller_pb2.PRINCIPAL_KIND_AGENT: "agent"}
    kind = kinds.get(caller.principal_kind)
    if kind is None or not caller.principal_id:
        raise Refused(Reason.FIELD_INVALID, "caller is not an operator principal")
    return Actor(kind, caller.principal_id)


#: CancelRun's answers, by the domain's outcome.
CANCEL_OUTCOMES: Final[Mapping[CancelOutcome, run_service_pb2.CancelRunOutcome.ValueType]] = {
    CancelOutcome.ACCEPTED: run_service_pb2.CANCEL_RUN_OUTCOME_ACCEPTED,
    CancelOutcome.ALREADY_REQUESTED: run_service_pb2.CANCEL_RUN_OUTCOME_ALREADY_REQUESTED,
    CancelOutcome.ALREADY_TERMINAL: run_service_pb2.CANCEL_RUN_OUTCOME_ALREADY_TERMINAL,
}


def binding_snapshot(caller: caller_pb2.Caller, project_id: str) -> BindingSnapshot:
    """The role binding ingress admitted the caller under, for ``project_id``; a mutation
    re-reads it in its transaction and refuses any drift (R-CAN-3)."""
    binding = caller.role_binding
    if not caller.HasField("role_binding") or binding.project_id != project_id:
        raise Refused(Reason.ROLE_BINDING_FENCED, "no role binding was admitted for this")
    return BindingSnapshot(
        project_version=binding.project_version,
        binding_version=binding.role_binding_version,
        role=caller_pb2.ProjectRole.Name(binding.role).removeprefix("PROJECT_ROLE_").lower(),
    )


def page_size(value: int) -> int:
    """A list's page size: 0 means the contract's default (the list requests' comments)."""
    return value or bounds.PAGE_SIZE_DEFAULT


def worker_of(caller: caller_pb2.Caller, worker_id: str) -> str:
    """Defence in depth: ingress already bound the certificate to the named worker."""
    if caller.principal_kind != caller_pb2.PRINCIPAL_KIND_WORKER or caller.worker_id != worker_id:
        raise Refused(Reason.FENCE_MISMATCH, "caller is not the named worker")
    return worker_id


def caller_principal_id(caller: caller_pb2.Caller) -> uuid.UUID:
    """The operator principal ingress vouched for. The caller envelope is ingress's own
    (no public rule covers it), so its shape is checked here."""
    if not bounds.is_uuid(caller.principal_id):
        raise Refused(
            Reason.FIELD_INVALID, "caller.principal_id must be a UUID", field="caller.principal_id"
        )
    return uuid.UUID(caller.principal_id)


def audit_id_of(value: str) -> uuid.UUID:
    """The audit row id is ingress's own envelope field: checked here, not by a rule."""
    try:
        return uuid.UUID(value)
    except ValueError:
        raise Refused(Reason.FIELD_INVALID, "audit_id must be a UUID", field="audit_id") from None


def parse_capability(value: str, field: str) -> TokenDigest:
    """A lease capability's digest; its refusal names the field it came in."""
    try:
        return digest_of_capability(value)
    except Refused as refused:
        raise refused.at(field) from None


def parse_wire_digest(value: str, field: str) -> TokenDigest:
    try:
        return parse_digest(value)
    except Refused as refused:
        raise refused.at(field) from None


def parse_fence(fence: fence_pb2.Fence, prefix: str = "fence.") -> Fence:
    """The wire fence as a domain Fence; the raw token becomes a digest right here."""
    return Fence(
        worker_id=fence.worker_id,
        session_id=uuid.UUID(fence.session_id),
        worker_generation=fence.worker_generation,
        project_id=fence.project_id,
        run_id=uuid.UUID(fence.run_id),
        attempt_id=uuid.UUID(fence.attempt_id),
        offer_id=uuid.UUID(fence.offer_id),
        lease_generation=fence.lease_generation,
        token_digest=parse_capability(fence.lease_token, prefix + "lease_token"),
        expected_lease_version=fence.expected_lease_version,
    )


def page_token(cursor: tuple[int, uuid.UUID] | None) -> str:
    """A ListRuns or ListTasks cursor, `(created_at_ms, run_id or task_id)`, as an opaque
    token (paging.py)."""
    return paging.page_token(cursor)


def parse_page_token(token: str, field: str = "page_token") -> tuple[int, uuid.UUID] | None:
    """The ListRuns or ListTasks cursor of a token this server issued; anything else is
    FIELD_INVALID."""
    return paging.time_and_id(token, field)


def timestamp(epoch_ms: int) -> Timestamp:
    stamp = Timestamp()
    stamp.FromMilliseconds(epoch_ms)
    return stamp


def duration(milliseconds: int) -> Duration:
    span = Duration()
    span.FromMilliseconds(max(0, milliseconds))
    return span


def enum_value(enum: Any, prefix: str, name: str | None) -> int:
    """`running` -> RUN_STATE_RUNNING's number; None or unknown -> UNSPECIFIED (0)."""
    if name is None:
        return 0
    value: int = enum.Value(f"{prefix}{name.upper()}")
    return value


def run_state(name: str | None) -> lifecycle_pb2.RunState.ValueType:
    return lifecycle_pb2.RunState.ValueType(enum_value(lifecycle_pb2.RunState, "RUN_STATE_", name))


def attempt_state(name: str | None) -> lifecycle_pb2.AttemptState.ValueType:
    return lifecycle_pb2.AttemptState.ValueType(
        enum_value(lifecycle_pb2.AttemptState, "ATTEMPT_STATE_", name)
    )


def cancel_reason(name: str | None) -> lifecycle_pb2.CancelReason.ValueType:
    return lifecycle_pb2.CancelReason.ValueType(
        enum_value(lifecycle_pb2.CancelReason, "CANCEL_REASON_", name)
    )


def parse_plan(plan: execution_pb2.ExecutionPlan) -> RevisionPlan:
    """A revision's plan (CreateTaskRevision's, or CreateTask's first)."""
    return RevisionPlan(
        EXECUTOR_TYPES[plan.executor_type],
        list(plan.command),
        plan.timeout_ms if plan.HasField("timeout_ms") else None,
        parse_retry_policy(plan),
        dict(plan.worker_selector),
        plan.queue_timeout_ms if plan.HasField("queue_timeout_ms") else None,
        plan.max_concurrent_runs if plan.HasField("max_concurrent_runs") else None,
    )


def parse_retry_policy(plan: execution_pb2.ExecutionPlan) -> RetryPolicy:
    """The plan's retry policy; absent means one Attempt (R-RETRY-2)."""
    if not plan.HasField("retry_policy"):
        return NO_RETRY
    wire_policy = plan.retry_policy
    endings = [RETRYABLE_ENDINGS[value] for value in wire_policy.retry_on]
    return RetryPolicy(
        max_attempts=wire_policy.max_attempts,
        initial_backoff_ms=wire_policy.initial_backoff_ms,
        max_backoff_ms=wire_policy.max_backoff_ms,
        multiplier_percent=wire_policy.backoff_multiplier_percent,
        retry_on=frozenset(endings),
    )


def execution_plan(
    executor_type: str,
    command: list[str],
    timeout_ms: int | None,
    retry: RetryPolicy | None = None,
    worker_selector: dict[str, str] | None = None,
    queue_timeout_ms: int | None = None,
    max_concurrent_runs: int | None = None,
) -> Any:
    plan = execution_pb2.ExecutionPlan(
        executor_type=EXECUTOR_TYPE_VALUES[executor_type],
        command=command,
        worker_selector=worker_selector,
    )
    if timeout_ms is not None:
        plan.timeout_ms = timeout_ms
    if queue_timeout_ms is not None:
        plan.queue_timeout_ms = queue_timeout_ms
    if max_concurrent_runs is not None:
        plan.max_concurrent_runs = max_concurrent_runs
    if retry is not None and retry != NO_RETRY:
        plan.retry_policy.CopyFrom(
            execution_pb2.RetryPolicy(
                max_attempts=retry.max_attempts,
                initial_backoff_ms=retry.initial_backoff_ms,
                max_backoff_ms=retry.max_backoff_ms,
                backoff_multiplier_percent=retry.multiplier_percent,
                retry_on=sorted(RETRYABLE_OUTCOMES[ending] for ending in retry.retry_on),
            )
        )
    return plan


def execution_spec(plan: Plan | PlacedOffer) -> worker_pb2.ExecutionSpec:
    """What a Worker executes: the pinned revision's plan and the Run's parameters."""
    return worker_pb2.ExecutionSpec(
        task_id=str(plan.task_id),
        task_revision_id=str(plan.revision_id),
        revision_number=plan.revision_number,
        plan=execution_plan(plan.executor_type, plan.command, plan.timeout_ms),
        parameters=plan.parameters,
    )


def pull_offers_response(placed: Offers) -> worker_service_pb2.PullOffersResponse:
    """The session's open offers, in placement's order, as many as a Worker takes in one
    answer (:func:`qinglong_protocol.bounds.offers_that_fit`). Those left out stay open, and the
    next pull answers them first."""
    messages = [offer(placed_offer, placed.now_ms) for placed_offer in placed.offers]
    fit = bounds.offers_that_fit([message.ByteSize() for message in messages])
    return worker_service_pb2.PullOffersResponse(offers=messages[:fit])


def offer(placed: PlacedOffer, now_ms: int) -> worker_pb2.Offer:
    return worker_pb2.Offer(
        offer_id=str(placed.offer_id),
        project_id=placed.project_id,
        run_id=str(placed.run_id),
        spec=execution_spec(placed),
        offer_remaining=duration(placed.expires_at_ms - now_ms),
    )


def task(view: TaskView) -> task_pb2.Task:
    return task_pb2.Task(
        task_id=str(view.task_id),
        project_id=view.project_id,
        display_name=view.display_name,
        labels=view.labels,
        latest_revision_number=view.latest_revision_number,
        created_at=timestamp(view.created_at_ms),
    )


def revision(view: RevisionView) -> task_pb2.TaskRevision:
    return task_pb2.TaskRevision(
        task_revision_id=str(view.revision_id),
        task_id=str(view.task_id),
        project_id=view.project_id,
        revision_number=view.revision_number,
        plan=execution_plan(
            view.executor_type,
            view.command,
            view.timeout_ms,
            view.retry_policy,
            view.worker_selector,
            view.queue_timeout_ms,
            view.max_concurrent_runs,
        ),
        created_at=timestamp(view.created_at_ms),
    )


def run(view: RunView) -> run_pb2.Run:
    message = run_pb2.Run(
        run_id=str(view.run_id),
        project_id=view.project_id,
        task_id=str(view.task_id),
        task_revision_id=str(view.revision_id),
        revision_number=view.revision_number,
        state=run_state(view.state),
        attempt_count=view.attempt_count,
        latest_attempt_id="" if view.latest_attempt_id is None else str(view.latest_attempt_id),
        latest_attempt_state=attempt_state(view.latest_attempt_state),
        version=view.version,
        event_sequence=view.event_sequence,
        created_at=timestamp(view.created_at_ms),
        error_code=view.error_code or "",
        max_attempts=view.max_attempts,
        parameters=view.parameters,
        priority=view.priority,
    )
    if view.cancel_reason is not None and view.cancel_requested_at_ms is not None:
        message.cancel_intent.reason = cancel_reason(view.cancel_reason)
        message.cancel_intent.requested_at.CopyFrom(timestamp(view.cancel_requested_at_ms))
    for field, value in (
        ("deadline", view.deadline_at_ms),
        ("started_at", view.started_at_ms),
        ("finished_at", view.finished_at_ms),
        ("retry_at", view.retry_at_ms),
    ):
        if value is not None:
            getattr(message, field).CopyFrom(timestamp(value))
    return message


_ACTOR_KINDS = {"worker", "user", "agent", "reconciler", "system"}


def actor_kind(name: str | None) -> lifecycle_pb2.ActorKind.ValueType:
    actor = name if name in _ACTOR_KINDS else None
    return lifecycle_pb2.ActorKind.ValueType(
        enum_value(lifecycle_pb2.ActorKind, "ACTOR_KIND_", actor)
    )


def event(view: EventView) -> run_pb2.RunEvent:
    """Render an Event; its typed payload is chosen by the event type."""
    message = run_pb2.RunEvent(
        event_id=str(view.event_id),
        run_id=str(view.run_id),
        project_id=view.project_id,
        sequence=view.sequence,
        type=view.event_type,
        attempt_id="" if view.attempt_id is None else str(view.attempt_id),
        actor_kind=actor_kind(view.actor_kind),
        actor_id=view.actor_id,
        actor_name=view.actor_name or "",
        occurred_at=timestamp(view.occurred_at_ms),
    )
    _fill_payload(message, view.event_type, view.payload)
    return message


def _fill_payload(message: run_pb2.RunEvent, event_type: str, payload: Mapping[str, Any]) -> None:
    if event_type == "run.cancel_requested":
        message.cancel_requested.reason = cancel_reason(payload.get("reason"))
        if payload.get("requested_at_ms") is not None:
            message.cancel_requested.requested_at.CopyFrom(timestamp(payload["requested_at_ms"]))
        message.cancel_requested.approval_id = payload.get("approval_id", "")
    elif event_type.startswith(APPROVAL_EVENT_PREFIX):
        approval = message.approval_changed
        approval.approval_id = payload.get("approval_id", "")
        approval.method = payload.get("method", "")
        approval.note = payload.get("note", "")
    elif event_type.startswith("run."):
        changed = message.run_state_changed
        changed.from_state = run_state(payload.get("from_state"))
        changed.to_state = run_state(payload.get("to_state"))
        changed.error_code = payload.get("error_code") or ""
        changed.attempt_number = payload.get("attempt_number") or 0
        if payload.get("retry_at_ms") is not None:
            changed.retry_at.CopyFrom(timestamp(payload["retry_at_ms"]))
    elif event_type == "attempt.claimed":
        claimed = message.attempt_claimed
        claimed.worker_id = payload.get("worker_id", "")
        claimed.session_id = payload.get("session_id", "")
        claimed.offer_id = payload.get("offer_id", "")
        claimed.lease_generation = payload.get("lease_generation", 0)
        claimed.attempt_number = payload.get("attempt_number", 0)
    elif event_type == "attempt.starting":
        starting = message.attempt_starting
        if payload.get("timeout_ms") is not None:
            starting.timeout_ms = payload["timeout_ms"]
        if payload.get("deadline_at_ms") is not None:
            starting.deadline.CopyFrom(timestamp(payload["deadline_at_ms"]))
    elif event_type == "attempt.running":
        running = message.attempt_running
        if payload.get("log_artifact_id") is not None:
            running.log_artifact_id = payload["log_artifact_id"]
        if payload.get("started_at_ms") is not None:
            running.started_at.CopyFrom(timestamp(payload["started_at_ms"]))
    elif event_type.startswith("attempt."):
        finished = message.attempt_finished
        finished.state = attempt_state(payload.get("state"))
        finished.error_code = payload.get("error_code") or ""
        finished.summary = payload.get("summary") or ""
        if payload.get("exit_code") is not None:
            finished.exit_code = payload["exit_code"]


def lease_answer(
    decision: LeaseDecision, timings: Timings
) -> worker_service_pb2.ControlLeaseResponse:
    """Exactly one of renewed / stop_requested / terminal (R-LC-2); no token, no digest."""
    response = worker_service_pb2.ControlLeaseResponse()
    if decision.terminal is not None:
        final_run, final_attempt, error_code = decision.terminal
        response.terminal.CopyFrom(
            worker_pb2.LeaseTerminal(
                run_state=run_state(final_run.value),
                attempt_state=attempt_state(final_attempt.value),
                error_code=error_code or "",
            )
        )
        return response
    target = response.renewed if decision.answer is LeaseAnswer.RENEWED else response.stop_requested
    assert decision.new_lease_version is not None
    target.lease_version = decision.new_lease_version
    remaining = (
        timings.lease_ttl_ms
        if decision.lease_expires_at_ms is None
        else decision.lease_expires_at_ms - decision.now_ms
    )
    target.lease_remaining.CopyFrom(duration(remaining))
    if decision.deadline_at_ms is not None:
        target.deadline_remaining.CopyFrom(duration(decision.deadline_at_ms - decision.now_ms))
    if decision.answer is LeaseAnswer.STOP_REQUESTED:
        response.stop_requested.cancel_reason = cancel_reason(decision.cancel_reason)
        if decision.cancel_requested_at_ms is not None:
            response.stop_requested.cancel_requested_at.CopyFrom(
                timestamp(decision.cancel_requested_at_ms)
            )
    return response
