"""One place that turns what went wrong into a gRPC status with an ErrorInfo reason.

Refusals keep their low-cardinality reason, and a refusal of a field carries a
``google.rpc.BadRequest`` naming it (SPEC R-ERR-1); storage trouble is UNAVAILABLE (the
only code clients retry automatically, AIP-194). A constraint the database enforces is
answered by its name: a bound the request broke is INVALID_ARGUMENT naming the field, a
state guard that fired is a conflict, a missing parent is NOT_FOUND. Anything else is a
generic INTERNAL with no detail, logged here with its traceback so operators can see it
and callers cannot. No driver message ever reaches a caller: it can carry SQL, values,
hosts and role names.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final, TypeVar

import grpc
import psycopg
from google.protobuf.message import Message
from opentelemetry import metrics
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong_protocol.errors import code_for, status_for

from qinglong_control.domain.refusals import Reason, Refused

_log = logging.getLogger(__name__)

COMMAND_DURATION = metrics.get_meter("qinglong.control").create_histogram(
    "qinglong.control.command.duration",
    unit="ms",
    description="Runtime command latency (one short transaction each), by method and outcome",
)

Response = TypeVar("Response")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Response]]

#: Constraints of the schema, by name, and the refusal each one means. A bound the
#: contract documents is checked before the database sees the value (wire.py, servicer.py,
#: and ingress before them), so these fire only if a check was missed; the caller still
#: gets a typed answer about the right field, and the log says which check is missing.
_FIELD_CONSTRAINTS: Final[Mapping[str, str]] = {
    "tasks_display_name_check": "display_name",
    "tasks_labels_check": "labels",
    "tasks_create_request_id_check": "request_id",
    "task_revisions_command_check": "plan.command",
    "task_revisions_timeout_ms_check": "plan.timeout_ms",
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
    }
)

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
}


def wire_reason(refused: Refused) -> ErrorReason.ValueType:
    return ErrorReason.Value(f"ERROR_REASON_{refused.reason.value}")


def _public_message_name(request: Message | None) -> str:
    """The full name of the public request inside a runtime request (its ``request``
    field), which is what the caller sent and what a violation without a field names."""
    if request is None:
        return ""
    if "request" in request.DESCRIPTOR.fields_by_name:
        inner: Message = getattr(request, "request")  # noqa: B009 - protobuf field
        return str(inner.DESCRIPTOR.full_name)
    return str(request.DESCRIPTOR.full_name)


def _refusal_status(refused: Refused, request: Message | None) -> grpc.Status:
    reason = wire_reason(refused)
    message = refused.detail or refused.reason.value
    violations: list[tuple[str, str]] = []
    if refused.field is not None:
        violations.append((refused.field, message))
    elif code_for(reason) == grpc.StatusCode.INVALID_ARGUMENT:
        # An invalid request without a known field still names what was invalid: the
        # request message itself (R-ERR-1: every INVALID_ARGUMENT carries a BadRequest).
        violations.append((_public_message_name(request) or "request", message))
    return status_for(reason, message, field_violations=violations)


def _constraint_refusal(error: psycopg.IntegrityError) -> Refused | None:
    """The typed refusal a named constraint stands for, if this module knows it."""
    constraint = error.diag.constraint_name or ""
    field = _FIELD_CONSTRAINTS.get(constraint)
    if field is not None:
        # A documented bound reached the database unchecked: answer it, and say so.
        _log.error(
            "constraint %s refused a value that validation let through (SQLSTATE %s)",
            constraint,
            error.sqlstate,
        )
        return Refused(Reason.FIELD_INVALID, f"{field} is out of bounds", field=field)
    if constraint in _CONFLICT_CONSTRAINTS:
        _log.info("constraint %s refused a concurrent change", constraint)
        return Refused(Reason.STATE_CONFLICT, "a concurrent change came first")
    missing = _MISSING_PARENT.get(constraint)
    if missing is not None:
        return Refused(missing, "a row this request refers to does not exist")
    return None


async def abort_for(
    context: grpc.aio.ServicerContext[Any, Any],
    error: BaseException,
    request: Message | None = None,
) -> None:
    """Abort the call with the typed status for ``error``. ``request`` (the runtime
    request) lets a refusal that names no field name the public message instead."""
    if isinstance(error, psycopg.IntegrityError):
        refused = _constraint_refusal(error)
        if refused is not None:
            error = refused
    if isinstance(error, Refused):
        await context.abort_with_status(_refusal_status(error, request))
    if isinstance(error, psycopg.OperationalError):
        # Connection loss, pool timeouts (psycopg_pool's errors are OperationalErrors),
        # statement timeouts, serialization failures that outlived their retries: the
        # database could not do it now, and a retry may well succeed.
        _log.warning("storage unavailable: %s (SQLSTATE %s)", type(error).__name__, error.sqlstate)
        await context.abort_with_status(
            status_for(ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE, "storage unavailable")
        )
    if isinstance(error, psycopg.DataError):
        # A value the database cannot represent (out of range, NUL in text): the request
        # was invalid and validation missed it. The driver cannot say which field, so the
        # violation names the message; the log names the SQLSTATE for the missing check.
        _log.error(
            "storage refused a request value that validation let through: %s (SQLSTATE %s)",
            type(error).__name__,
            error.sqlstate,
        )
        name = _public_message_name(request) or "request"
        await context.abort_with_status(
            status_for(
                ErrorReason.ERROR_REASON_FIELD_INVALID,
                "a request value is out of range",
                field_violations=[(name, "a value is outside what this server can store")],
            )
        )
    # The traceback is for operators; the caller gets nothing of it (SQL, values, hosts).
    _log.error(
        "internal error: %s (SQLSTATE %s)",
        type(error).__name__,
        getattr(error, "sqlstate", None),
        exc_info=error,
    )
    await context.abort_with_status(status_for(ErrorReason.ERROR_REASON_INTERNAL, "internal error"))


def translated(handler: Handler[Response]) -> Handler[Response]:
    """Wrap one servicer method so every failure leaves as a typed status."""

    method = handler.__name__

    @functools.wraps(handler)
    async def wrapper(
        self: Any, request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> Response:
        started = time.perf_counter()
        outcome = "ok"
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            outcome = "aborted"
            raise
        except Exception as error:  # every failure leaves as a typed status
            outcome = error.reason.value if isinstance(error, Refused) else type(error).__name__
            await abort_for(context, error, request if isinstance(request, Message) else None)
            raise AssertionError("abort_for always aborts") from error
        finally:
            # Low-cardinality attributes only: run and attempt ids belong on spans.
            COMMAND_DURATION.record(
                (time.perf_counter() - started) * 1000.0,
                {"rpc.method": method, "outcome": outcome},
            )

    return wrapper
