"""Rich gRPC errors for every QingLong API (AIP-193), built and parsed in one place.

A failed call ends with a gRPC status whose ``grpc-status-details-bin`` trailer
holds a ``google.rpc.Status`` with:

* a ``google.rpc.ErrorInfo`` whose ``domain`` is :data:`ERROR_DOMAIN` and whose
  ``reason`` is a :class:`qinglong.rpc.v1.error_reason_pb2.ErrorReason` value
  name without its ``ERROR_REASON_`` prefix (e.g. ``"LEASE_VERSION_FENCED"``);
* optionally a ``google.rpc.BadRequest`` listing field violations.

The gRPC code of each reason is fixed by :data:`REASON_CODES` (the same code is
named in the enum's comment in ``error_reason.proto``). Clients branch on
:func:`error_reason_of`, never on the message text; messages are short, generic
and must not carry secrets (lease tokens, digests) or internals.

Servers (grpc.aio)::

    status = status_for(ErrorReason.ERROR_REASON_LEASE_EXPIRED, "lease expired")
    await abort_with(context, status)

A server that decides an answer before it sends it (control's error interceptor, ingress's
refusals) holds it as a :class:`TypedStatus`.

This module depends on grpc and the generated contracts only (no database).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, NoReturn

import grpc
from google.protobuf import any_pb2

# googleapis-common-protos ships .pyi files but no py.typed marker.
from google.rpc import (
    code_pb2,
    error_details_pb2,
    status_pb2,
)
from grpc_status import rpc_status
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason

#: ErrorInfo.domain of every QingLong error; fixed forever (AIP-193).
ERROR_DOMAIN: Final = "qinglong.remote-run"
#: buf STANDARD requires the enum prefix; the wire reason string drops it.
REASON_PREFIX: Final = "ERROR_REASON_"
#: AIP-193 limit on ErrorInfo.reason.
REASON_MAX_LENGTH: Final = 63
#: The ErrorInfo metadata key of OUTPUT_OFFSET_GAP: where the next output chunk must
#: start (error_reason.proto names it; control sets it, the Worker resumes from it).
EXPECTED_OFFSET: Final = "expectedOffset"
#: ErrorInfo.metadata key of APPROVAL_REQUIRED: the approval request that holds the call.
APPROVAL_ID: Final = "approvalId"

_E = ErrorReason
_C = grpc.StatusCode

#: The gRPC code that carries each reason. Fencing and state conflicts are
#: ABORTED (the seed's 409), validation INVALID_ARGUMENT, missing resources
#: NOT_FOUND, identity UNAUTHENTICATED/PERMISSION_DENIED, outages UNAVAILABLE.
REASON_CODES: Final[Mapping[ErrorReason.ValueType, grpc.StatusCode]] = {
    _E.ERROR_REASON_LEASE_VERSION_FENCED: _C.ABORTED,
    _E.ERROR_REASON_LEASE_TOKEN_MISMATCH: _C.ABORTED,
    _E.ERROR_REASON_LEASE_EXPIRED: _C.ABORTED,
    _E.ERROR_REASON_LEASE_NOT_LEASED: _C.ABORTED,
    _E.ERROR_REASON_SESSION_FENCED: _C.ABORTED,
    _E.ERROR_REASON_SESSION_EXPIRED: _C.ABORTED,
    _E.ERROR_REASON_SESSION_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_OFFER_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_OFFER_EXPIRED: _C.ABORTED,
    _E.ERROR_REASON_OFFER_CLAIMED_BY_OTHER_CAPABILITY: _C.ABORTED,
    _E.ERROR_REASON_FENCE_MISMATCH: _C.ABORTED,
    _E.ERROR_REASON_STATE_CONFLICT: _C.ABORTED,
    _E.ERROR_REASON_STARTING_REQUIRED: _C.ABORTED,
    _E.ERROR_REASON_REPLAY_MISMATCH: _C.ABORTED,
    _E.ERROR_REASON_EXECUTOR_TYPE_MISMATCH: _C.ABORTED,
    _E.ERROR_REASON_RUN_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_TASK_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_REVISION_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_PROJECT_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_ALREADY_EXISTS: _C.ALREADY_EXISTS,
    _E.ERROR_REASON_CAPABILITY_MALFORMED: _C.INVALID_ARGUMENT,
    _E.ERROR_REASON_CAPABILITY_WEAK: _C.INVALID_ARGUMENT,
    _E.ERROR_REASON_FIELD_INVALID: _C.INVALID_ARGUMENT,
    _E.ERROR_REASON_REQUEST_TOO_LARGE: _C.INVALID_ARGUMENT,
    _E.ERROR_REASON_UNKNOWN_FIELD: _C.INVALID_ARGUMENT,
    _E.ERROR_REASON_PRINCIPAL_MISMATCH: _C.PERMISSION_DENIED,
    _E.ERROR_REASON_UNAUTHENTICATED_PRINCIPAL: _C.UNAUTHENTICATED,
    _E.ERROR_REASON_TLS_VERSION_REJECTED: _C.UNAUTHENTICATED,
    _E.ERROR_REASON_PERMISSION_DENIED: _C.PERMISSION_DENIED,
    _E.ERROR_REASON_APPROVAL_REQUIRED: _C.PERMISSION_DENIED,
    _E.ERROR_REASON_ROLE_BINDING_FENCED: _C.ABORTED,
    _E.ERROR_REASON_CALLER_NOT_INGRESS: _C.PERMISSION_DENIED,
    _E.ERROR_REASON_AUDIT_UNAVAILABLE: _C.UNAVAILABLE,
    _E.ERROR_REASON_STORAGE_UNAVAILABLE: _C.UNAVAILABLE,
    _E.ERROR_REASON_INTERNAL: _C.INTERNAL,
    _E.ERROR_REASON_CALLBACK_SEQUENCE_FENCED: _C.ABORTED,
    _E.ERROR_REASON_RUNTIME_UNAVAILABLE: _C.UNAVAILABLE,
    _E.ERROR_REASON_RATE_LIMITED: _C.RESOURCE_EXHAUSTED,
    _E.ERROR_REASON_PRINCIPAL_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_TOKEN_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_WORKER_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_ROLE_BINDING_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_APPROVAL_NOT_FOUND: _C.NOT_FOUND,
    _E.ERROR_REASON_APPROVAL_NOT_PENDING: _C.FAILED_PRECONDITION,
    _E.ERROR_REASON_APPROVAL_UNSUPPORTED: _C.FAILED_PRECONDITION,
    _E.ERROR_REASON_LAST_CLUSTER_ADMIN: _C.FAILED_PRECONDITION,
    _E.ERROR_REASON_WORKER_DISABLED: _C.FAILED_PRECONDITION,
    _E.ERROR_REASON_OUTPUT_OFFSET_GAP: _C.ABORTED,
    _E.ERROR_REASON_ATTEMPT_NOT_FOUND: _C.NOT_FOUND,
}


def reason_name(reason: ErrorReason.ValueType) -> str:
    """The wire reason string: the enum value name without ``ERROR_REASON_``."""
    if reason == ErrorReason.ERROR_REASON_UNSPECIFIED:
        raise ValueError("ERROR_REASON_UNSPECIFIED is never sent")
    return ErrorReason.Name(reason).removeprefix(REASON_PREFIX)


def reason_from_name(name: str) -> ErrorReason.ValueType | None:
    """The enum value for a wire reason string, or ``None`` if unknown here
    (a newer server may send reasons this client does not know yet)."""
    if not name or name == "UNSPECIFIED":
        return None
    try:
        return ErrorReason.Value(REASON_PREFIX + name)
    except ValueError:
        return None


def code_for(reason: ErrorReason.ValueType) -> grpc.StatusCode:
    """The fixed gRPC code that carries ``reason``."""
    try:
        return REASON_CODES[reason]
    except KeyError:
        raise ValueError(f"no status code for error reason {reason!r}") from None


def rich_status(
    reason: ErrorReason.ValueType,
    message: str,
    *,
    metadata: Mapping[str, str] | None = None,
    field_violations: Iterable[tuple[str, str]] = (),
) -> status_pb2.Status:
    """The ``google.rpc.Status`` for ``reason``.

    ``metadata`` goes into ErrorInfo.metadata (stable lowerCamelCase keys, no
    secrets); ``field_violations`` are ``(field path, description)`` pairs put
    into a ``google.rpc.BadRequest``.
    """
    code = code_for(reason)
    info = error_details_pb2.ErrorInfo(
        reason=reason_name(reason), domain=ERROR_DOMAIN, metadata=dict(metadata or {})
    )
    packed_info = any_pb2.Any()
    packed_info.Pack(info)
    details = [packed_info]
    violations = [
        error_details_pb2.BadRequest.FieldViolation(field=field, description=description)
        for field, description in field_violations
    ]
    if violations:
        packed_bad_request = any_pb2.Any()
        packed_bad_request.Pack(error_details_pb2.BadRequest(field_violations=violations))
        details.append(packed_bad_request)
    return status_pb2.Status(code=_proto_code(code), message=message, details=details)


def status_for(
    reason: ErrorReason.ValueType,
    message: str,
    *,
    metadata: Mapping[str, str] | None = None,
    field_violations: Iterable[tuple[str, str]] = (),
) -> grpc.Status:
    """A ``grpc.Status`` to end a call with (:func:`abort_with`)."""
    status: grpc.Status = rpc_status.to_status(
        rich_status(reason, message, metadata=metadata, field_violations=field_violations)
    )
    return status


async def abort_with(context: grpc.aio.ServicerContext[Any, Any], status: grpc.Status) -> NoReturn:
    """End the call with ``status`` (its code, message and the rich details trailer).

    Through ``abort``, not ``abort_with_status``: the OpenTelemetry instrumentation sees
    only the former, and a call ended by the latter left its server span without the
    status — every refusal looked like a success in the tracing backend."""
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("abort always raises")


@dataclass(frozen=True)
class TypedStatus:
    """A failed call's answer, decided but not yet sent: its reason (which fixes the
    code), a short message safe for any caller, the fields at fault, if any, and the
    ErrorInfo metadata a caller acts on (``expectedOffset`` of OUTPUT_OFFSET_GAP)."""

    reason: ErrorReason.ValueType
    message: str
    field_violations: tuple[tuple[str, str], ...] = ()
    metadata: tuple[tuple[str, str], ...] = ()

    @property
    def code(self) -> grpc.StatusCode:
        return code_for(self.reason)

    def status(self) -> grpc.Status:
        """The ``grpc.Status`` to end the call with (:func:`abort_with`)."""
        return status_for(
            self.reason,
            self.message,
            metadata=dict(self.metadata),
            field_violations=self.field_violations,
        )


def rich_status_of(rpc_error: grpc.RpcError) -> status_pb2.Status | None:
    """The ``google.rpc.Status`` a failed call carried, if it is well formed.

    Works for sync (``grpc.Call``) and aio (``grpc.aio.AioRpcError``) errors.
    Returns ``None`` when the trailer is missing or disagrees with the call's
    code/message (e.g. a proxy rewrote the status).
    """
    try:
        status: Any = rpc_status.from_call(rpc_error)
    except (AttributeError, TypeError, ValueError):
        return None
    if isinstance(status, status_pb2.Status):
        return status
    return None


def error_info_of(rpc_error: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    """The QingLong ``ErrorInfo`` of a failed call; ``None`` for other domains."""
    status = rich_status_of(rpc_error)
    if status is None:
        return None
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        # Unpack answers False for a detail of another type.
        if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return info
    return None


def error_reason_of(rpc_error: grpc.RpcError) -> str | None:
    """The wire reason string (e.g. ``"LEASE_VERSION_FENCED"``) of a failed call."""
    info = error_info_of(rpc_error)
    if info is None or not info.reason:
        return None
    return str(info.reason)


def field_violations_of(rpc_error: grpc.RpcError) -> list[tuple[str, str]]:
    """``(field, description)`` pairs of a ``google.rpc.BadRequest`` detail, if any."""
    status = rich_status_of(rpc_error)
    if status is None:
        return []
    violations: list[tuple[str, str]] = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            violations.extend((v.field, v.description) for v in bad_request.field_violations)
    return violations


def _proto_code(code: grpc.StatusCode) -> int:
    """grpc.StatusCode -> google.rpc.Code number (they share the numbering)."""
    number = code.value[0]
    if not isinstance(number, int) or number not in code_pb2.Code.values():
        raise ValueError(f"unexpected status code {code!r}")
    return number
