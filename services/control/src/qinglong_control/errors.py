"""One place that turns what went wrong in a RuntimeService call into a typed status.

`ErrorInterceptor` wraps every RuntimeService method, unary and streaming, so a method
cannot forget it: whatever a method raises leaves as a gRPC status with an ErrorInfo
reason, and the call's latency is recorded once, by method and outcome.

Refusals keep their low-cardinality reason, and a refusal of a field carries a
``google.rpc.BadRequest`` naming it (SPEC R-ERR-1). A storage failure is answered by the
rule ingress shares (`qinglong_protocol.storage_errors`: transient SQLSTATE classes are
UNAVAILABLE, data exceptions FIELD_INVALID, anything unknown INTERNAL); what only control
knows is its schema, so a constraint is answered here by its name: a bound the request
broke is INVALID_ARGUMENT naming the field, a state guard that fired is a conflict, a
taken name is ALREADY_EXISTS, a missing parent is NOT_FOUND. Anything else is a generic
INTERNAL with no detail, logged with its traceback so operators can see it and callers
cannot. No driver message ever reaches a caller: it can carry SQL, values, hosts and
role names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, Final

import grpc
import psycopg
from google.protobuf.message import Message
from opentelemetry import metrics
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.budget import settle_within
from qinglong_protocol.errors import TypedStatus, abort_with, code_for, reason_name
from qinglong_protocol.storage_errors import StorageFailure, Verdict, storage_answer

from qinglong_control import metrics as prometheus
from qinglong_control.contract_bounds import PUBLIC_REQUEST_FIELD
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.wrapping import (
    Behaviour,
    WrappingInterceptor,
    resolved,
    responses,
    rewrapped,
)

_log = logging.getLogger(__name__)

COMMAND_DURATION = metrics.get_meter("qinglong.control").create_histogram(
    "qinglong.control.command.duration",
    unit="ms",
    description="Runtime command latency (one short transaction each), by method and outcome",
)

#: Constraints of the schema, by name, and the refusal each one means. A bound the
#: contract declares is checked before the database sees the value (by ingress, and again
#: by contract_bounds.py), so these fire only if a check was missed; the caller still
#: gets a typed answer about the right field, and the log says which check is missing.
_FIELD_CONSTRAINTS: Final[Mapping[str, str]] = {
    "tasks_display_name_check": "display_name",
    "tasks_labels_check": "labels",
    "tasks_create_request_id_check": "request_id",
    "task_revisions_command_check": "plan.command",
    "task_revisions_timeout_ms_check": "plan.timeout_ms",
    "task_revisions_queue_timeout_ms_positive": "plan.queue_timeout_ms",
    "task_revisions_max_concurrent_runs_positive": "plan.max_concurrent_runs",
    "task_revisions_create_request_id_check": "request_id",
    "task_revisions_retry_max_attempts_check": "plan.retry_policy.max_attempts",
    "task_revisions_retry_initial_backoff_ms_check": "plan.retry_policy.initial_backoff_ms",
    "task_revisions_retry_max_backoff_ms_check": "plan.retry_policy.max_backoff_ms",
    "task_revisions_retry_backoff_ordered": "plan.retry_policy.max_backoff_ms",
    "task_revisions_retry_multiplier_percent_check": "plan.retry_policy.backoff_multiplier_percent",
    "task_revisions_retry_on_check": "plan.retry_policy.retry_on",
    "runs_trigger_request_id_check": "request_id",
    "worker_sessions_open_request_id_check": "request_id",
    "worker_sessions_agent_version_check": "agent_version",
    "worker_sessions_max_concurrency_check": "max_concurrent_attempts",
    "worker_sessions_executor_types_check": "executor_types",
    "attempts_executor_handle_check": "executor_handle",
    "attempts_log_artifact_id_check": "log_artifact_id",
    "attempts_callback_sequence_check": "callback_sequence",
    "attempt_output_chunks_data_check": "data",
    "attempt_output_end_offset_check": "offset",
    "projects_display_name_check": "display_name",
    "projects_create_request_id_check": "request_id",
    "principals_create_request_id_check": "request_id",
    "worker_identities_create_request_id_check": "request_id",
    "operator_credentials_issue_request_id_check": "request_id",
}

#: The database's own guards of the state machines and of idempotency keys: when one
#: fires, a concurrent command changed the row first (the caller may read and retry).
_CONFLICT_CONSTRAINTS: Final = frozenset(
    {
        "runs_legal_transition",
        "runs_terminal_immutable",
        "runs_cancel_intent_final",
        "attempts_legal_transition",
        "attempts_terminal_immutable",
        "attempts_authority_fixed",
        "run_leases_final",
        "run_leases_forward_only",
        "run_events_gapless",
        "run_events_run_id_sequence_key",
        "run_events_dedupe_key_key",
        "tasks_project_id_create_request_id_key",
        "task_revisions_task_id_create_request_id_key",
        "task_revisions_task_id_revision_number_key",
        "runs_project_id_trigger_request_id_key",
        "worker_sessions_worker_id_open_request_id_key",
        "worker_sessions_worker_id_generation_key",
        "attempts_offer_id_key",
        "attempts_run_id_attempt_number_key",
        "run_leases_offer_id_key",
        # Two first chunks of one Attempt's output (the stream lock makes it unlikely).
        "attempt_output_pkey",
        "attempt_output_chunks_pkey",
        # Administration: a create with the same request id, a second rotation of one
        # token, a join token used twice.
        "projects_create_request_id_key",
        "principals_create_request_id_key",
        "worker_identities_create_request_id_key",
        "operator_credentials_issue_request",
        "operator_credentials_replaces_credential_id_key",
        "worker_join_tokens_single_use",
    }
)

#: Administration's names and ids, when another request took one first: the creates
#: check under a lock before they write, so these fire only if that check was missed.
_TAKEN_CONSTRAINTS: Final = frozenset(
    {
        "projects_pkey",
        "principals_kind_name_key",
        "worker_identities_pkey",
        "worker_identities_certificate_uri_key",
    }
)

#: A Worker identity whose certificate URI does not name it (migration 0025's CHECK).
MISNAMED_WORKER: Final = "worker_identities_uri_names_the_worker"

#: A parent row that is not there (any more).
_MISSING_PARENT: Final[Mapping[str, Reason]] = {
    "tasks_project_id_fkey": Reason.PROJECT_NOT_FOUND,
    "task_revisions_project_id_task_id_fkey": Reason.TASK_NOT_FOUND,
    "runs_project_id_task_id_revision_id_fkey": Reason.REVISION_NOT_FOUND,
    "worker_sessions_worker_id_fkey": Reason.SESSION_NOT_FOUND,
    "offers_session_id_worker_id_worker_generation_fkey": Reason.SESSION_NOT_FOUND,
    "attempts_session_id_worker_id_worker_generation_fkey": Reason.SESSION_NOT_FOUND,
    "run_leases_session_id_worker_id_worker_generation_fkey": Reason.SESSION_NOT_FOUND,
    "offers_run_id_fkey": Reason.RUN_NOT_FOUND,
    "attempts_run_id_fkey": Reason.RUN_NOT_FOUND,
    "attempts_offer_id_run_id_fkey": Reason.OFFER_NOT_FOUND,
    "role_bindings_project_id_fkey": Reason.PROJECT_NOT_FOUND,
}


def wire_reason(refused: Refused) -> ErrorReason.ValueType:
    return ErrorReason.Value(f"ERROR_REASON_{refused.reason.value}")


def _public_message_name(request: object) -> str:
    """The full name of the public request inside a runtime request (its ``request``
    field), which is what the caller sent and what a violation without a field names."""
    if not isinstance(request, Message):
        return ""
    if PUBLIC_REQUEST_FIELD in request.DESCRIPTOR.fields_by_name:
        inner: Message = getattr(request, PUBLIC_REQUEST_FIELD)
        return str(inner.DESCRIPTOR.full_name)
    return str(request.DESCRIPTOR.full_name)


def _refusal_status(refused: Refused, request: object) -> TypedStatus:
    reason = wire_reason(refused)
    message = refused.detail or refused.reason.value
    violations: tuple[tuple[str, str], ...] = ()
    if refused.field is not None:
        violations = ((refused.field, message),)
    elif code_for(reason) == grpc.StatusCode.INVALID_ARGUMENT:
        # An invalid request without a known field still names what was invalid: the
        # request message itself (R-ERR-1: every INVALID_ARGUMENT carries a BadRequest).
        violations = ((_public_message_name(request) or "request", message),)
    return TypedStatus(reason, message, violations, refused.metadata)


def _constraint_refusal(constraint: str) -> Refused | None:
    """The typed refusal a named constraint stands for, if this module knows it."""
    field = _FIELD_CONSTRAINTS.get(constraint)
    if field is not None:
        # A documented bound reached the database unchecked: answer it, and say so.
        _log.error("constraint %s refused a value that validation let through", constraint)
        return Refused(Reason.FIELD_INVALID, f"{field} is out of bounds", field=field)
    if constraint in _CONFLICT_CONSTRAINTS:
        _log.info("constraint %s refused a concurrent change", constraint)
        return Refused(Reason.STATE_CONFLICT, "a concurrent change came first")
    if constraint in _TAKEN_CONSTRAINTS:
        _log.info("constraint %s refused a name another request took", constraint)
        return Refused(Reason.ALREADY_EXISTS, "it already exists")
    missing = _MISSING_PARENT.get(constraint)
    if missing is not None:
        return Refused(missing, "a row this request refers to does not exist")
    if constraint == MISNAMED_WORKER:
        # A row written before migration 0025 that names another identity: never by
        # QingLong (CreateWorker computes the name). It changes no more until an operator
        # corrects or removes it with the migration role.
        _log.error("a Worker identity's certificate URI does not name it; fix it first")
        return Refused(
            Reason.STATE_CONFLICT,
            "the Worker's enrolled certificate name is not its own; an operator must fix it",
        )
    return None


def answer_for(error: BaseException, request: object = None) -> TypedStatus:
    """The typed answer to ``error``. ``request`` (the runtime request) lets a refusal
    that names no field name the public message instead."""
    if isinstance(error, Refused):
        return _refusal_status(error, request)
    if isinstance(error, psycopg.Error):
        failure = StorageFailure(
            error.sqlstate,
            error.diag.constraint_name,
            operational=isinstance(error, psycopg.OperationalError),
            error_type=type(error).__name__,
        )
        if failure.verdict is Verdict.CONSTRAINT and failure.constraint:
            refused = _constraint_refusal(failure.constraint)
            if refused is not None:
                return _refusal_status(refused, request)
        return storage_answer(failure, request_name=_public_message_name(request), error=error)
    # The traceback is for operators; the caller gets nothing of it (SQL, values, hosts).
    _log.error("internal error: %s", type(error).__name__, exc_info=error)
    return TypedStatus(ErrorReason.ERROR_REASON_INTERNAL, "internal error")


# --- the interceptor --------------------------------------------------------------------

Context = grpc.aio.ServicerContext[Any, Any]


class ErrorInterceptor(WrappingInterceptor):
    """Answer every failure of ``service``'s methods with a typed status and record each
    call's latency (``qinglong.control.command.duration``) by method and outcome.

    It sits inside OpenTelemetry's server interceptor, so the call's span sees the typed
    status, and after the caller check, so only calls from ingress are measured.
    """

    def __init__(self, service: str, budget_of: Callable[[str], float | None]) -> None:
        self._prefix = f"/{service}/"
        self._budget_of = budget_of

    def covers(self, method: str) -> bool:
        return method.startswith(self._prefix)

    def wrap(
        self, handler: grpc.RpcMethodHandler[Any, Any], method: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        name = method.removeprefix(self._prefix)
        return _answering(handler, name, self._budget_of(name))


class _Call:
    """One call's outcome and latency, recorded when it ends."""

    def __init__(self, method: str) -> None:
        self._method = method
        self._started = time.perf_counter()
        self.outcome = "ok"

    async def fail(self, error: Exception, request: object, context: Context) -> None:
        """Abort with the typed answer to ``error``; always raises."""
        chosen = context.code()
        if chosen is not None and chosen is not grpc.StatusCode.OK:
            # The behaviour chose its status before raising (the generated base
            # servicer's UNIMPLEMENTED for a method this servicer lacks): it stands.
            self.outcome = chosen.name
            raise error
        answer = answer_for(error, request)
        self.outcome = reason_name(answer.reason)
        if answer.code is grpc.StatusCode.ABORTED:  # a fence (or assumed state) refused it
            prometheus.FENCE_REJECTIONS.labels(self._method, self.outcome).inc()
        await abort_with(context, answer.status())

    def ended(self) -> None:
        # Low-cardinality attributes only: run and attempt ids belong on spans.
        seconds = time.perf_counter() - self._started
        COMMAND_DURATION.record(
            seconds * 1000.0, {"rpc.method": self._method, "outcome": self.outcome}
        )
        prometheus.CALL_DURATION.labels(self._method, self.outcome).observe(seconds)


def _answering(
    handler: grpc.RpcMethodHandler[Any, Any], method: str, budget_seconds: float | None
) -> grpc.RpcMethodHandler[Any, Any]:
    """The same handler, its behaviour wrapped: every failure typed, every call timed,
    and a unary call answered within ``budget_seconds`` (`answer_budget`; None: no
    bound of its own) whatever PostgreSQL does (R-ERR-2): a command waiting longer is
    answered STORAGE_UNAVAILABLE — an outcome its caller cannot know, which the
    command's replay rule covers — and left to unwind on its own (`settle_within`). A
    stream is bounded by its own reads."""

    async def unary(behaviour: Behaviour, request: Any, context: Context) -> Any:
        call = _Call(method)
        try:
            try:
                answer = resolved(behaviour(request, context))
                if budget_seconds is None:
                    return await answer
                return await settle_within(budget_seconds, answer)
            except TimeoutError:
                raise Refused(
                    Reason.STORAGE_UNAVAILABLE, "storage unavailable: no answer within the bound"
                ) from None
        except grpc.aio.AbortError:
            call.outcome = "aborted"
            raise
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        except Exception as error:  # every failure leaves as a typed status
            await call.fail(error, request, context)
            raise
        finally:
            call.ended()

    async def stream(behaviour: Behaviour, request: Any, context: Context) -> AsyncIterator[Any]:
        call = _Call(method)
        try:
            async for response in responses(behaviour(request, context)):
                yield response
        except grpc.aio.AbortError:
            call.outcome = "aborted"
            raise
        except asyncio.CancelledError:
            call.outcome = "cancelled"
            raise
        except Exception as error:  # every failure leaves as a typed status
            await call.fail(error, request, context)
            raise
        finally:
            call.ended()

    return rewrapped(handler, unary, stream)
