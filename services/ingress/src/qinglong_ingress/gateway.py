"""The ingress pipeline every public call goes through, in this order:

1. transport: the negotiated TLS version must be 1.3;
2. size: the serialized request must fit the method's byte cap;
3. authentication: a worker by its certificate's SAN URI, an operator by bearer token
   or certificate — each must be enrolled and active;
4. bounds: every field within the contract's bounds, no unknown fields or enum values;
5. authorisation: a worker may speak only for itself and its own sessions; an operator
   needs a project role for the method's permission (an agent asking to stop a Run is
   answered `require_approval`);
6. audit: one durable row, committed with the ingress role, before anything else;
7. forwarding: over the single internal channel, with the caller and audit id attached
   and the incoming deadline passed on. Control's status and ErrorInfo come back as
   they are; a control that cannot be reached is UNAVAILABLE/RUNTIME_UNAVAILABLE.

Every refusal is audited too, and nothing refused reaches control. Secrets (lease
tokens, operator tokens) never reach a log line, an audit row or an error message.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import psycopg
import psycopg_pool
from google.protobuf.message import Message
from grpc_status import rpc_status
from qinglong.control.v1 import run_service_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.runtime.v1 import caller_pb2
from qinglong_protocol.errors import rich_status_of, status_for
from qinglong_protocol.storage import StorageBounds
from qinglong_protocol.tls import peer_tls

from qinglong_ingress.admission import Decision, decide
from qinglong_ingress.directory import AuditRecord, Directory, RoleBinding
from qinglong_ingress.principals import (
    CredentialKind,
    Principal,
    PrincipalKind,
    bearer_token_digest,
    operator_uri_prefix,
    worker_uri_prefix,
)
from qinglong_ingress.routes import Route
from qinglong_ingress.targets import Targets, targets_of
from qinglong_ingress.transport_security import is_acceptable_transport
from qinglong_ingress.validation import (
    FieldViolation,
    primary_reason,
    request_size_violation,
    validate_request,
)

_log = logging.getLogger(__name__)

Context = grpc.aio.ServicerContext[Any, Any]

# Without a deadline from the caller, a forwarded call still may not wait forever.
DEFAULT_FORWARD_TIMEOUT_SECONDS = 30.0

_PRINCIPAL_KINDS = {
    PrincipalKind.WORKER: caller_pb2.PRINCIPAL_KIND_WORKER,
    PrincipalKind.USER: caller_pb2.PRINCIPAL_KIND_USER,
    PrincipalKind.AGENT: caller_pb2.PRINCIPAL_KIND_AGENT,
}
_CREDENTIAL_KINDS = {
    CredentialKind.CERTIFICATE: caller_pb2.CREDENTIAL_KIND_MTLS_CERTIFICATE,
    CredentialKind.BEARER_TOKEN: caller_pb2.CREDENTIAL_KIND_BEARER_TOKEN,
}
_PROJECT_ROLES = {
    "owner": caller_pb2.PROJECT_ROLE_OWNER,
    "admin": caller_pb2.PROJECT_ROLE_ADMIN,
    "operator": caller_pb2.PROJECT_ROLE_OPERATOR,
    "viewer": caller_pb2.PROJECT_ROLE_VIEWER,
}


class Refusal(Exception):
    """A call ingress answers itself, with an audited outcome and a typed status."""

    def __init__(
        self,
        outcome: str,
        reason: ErrorReason.ValueType,
        message: str,
        violations: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.reason = reason
        self.message = message
        self.violations = tuple(violations)
        self.principal: Principal | None = None
        """Who was refused, once authentication got that far (for the audit row)."""


@dataclass(frozen=True)
class Received:
    """A request as it arrived: the parsed message (None if it did not parse), its size,
    and for bytes that did not parse, the violation that says where (R-ERR-1)."""

    message: Message | None
    size: int
    undecodable: FieldViolation | None = None


@dataclass(frozen=True)
class Authorised:
    binding: RoleBinding | None
    require_approval: bool = False


@dataclass(frozen=True)
class Admitted:
    principal: Principal
    binding: RoleBinding | None
    audit_id: str
    tls_version: str


class Gateway:
    def __init__(
        self,
        directory: Directory,
        runtime: grpc.aio.Channel,
        trust_domain: str,
        storage: StorageBounds | None = None,
    ) -> None:
        self._directory = directory
        self._runtime = runtime
        self._trust_domain = trust_domain
        # All of a call's database work (identity, binding, audit — also the audit of a
        # refusal) shares one budget, so an outage answers within the storage bound
        # (R-ERR-2) rather than once per pool checkout.
        self._admission_budget_s = (storage or StorageBounds()).timeout_seconds * 0.9

    # --- the two call shapes ----------------------------------------------------------

    async def unary(self, route: Route, received: Received, context: Context) -> Message:
        request, admitted = await self._admit(route, received, context)
        if admitted is None:  # answered without forwarding (require_approval)
            return run_service_pb2.CancelRunResponse(
                outcome=run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL
            )
        call = self._runtime.unary_unary(
            route.runtime_method,
            request_serializer=_serialize,
            response_deserializer=route.runtime_response_type.FromString,
        )
        try:
            wrapped = await call(
                self._runtime_request(route, request, admitted),
                timeout=_forward_timeout(context),
            )
        except grpc.aio.AioRpcError as error:
            await _relay(context, error)
            raise
        response: Message = getattr(wrapped, "response")  # noqa: B009 - protobuf field
        return response

    async def server_stream(
        self, route: Route, received: Received, context: Context
    ) -> AsyncIterator[Message]:
        request, admitted = await self._admit(route, received, context)
        assert admitted is not None
        call = self._runtime.unary_stream(
            route.runtime_method,
            request_serializer=_serialize,
            response_deserializer=route.runtime_response_type.FromString,
        )
        stream = call(
            self._runtime_request(route, request, admitted), timeout=_forward_timeout(context)
        )
        try:
            async for wrapped in stream:
                yield getattr(wrapped, "response")  # noqa: B009 - protobuf field
        except grpc.aio.AioRpcError as error:
            await _relay(context, error)
            raise

    # --- admission --------------------------------------------------------------------

    async def _admit(
        self, route: Route, received: Received, context: Context
    ) -> tuple[Message, Admitted | None]:
        try:
            async with asyncio.timeout(self._admission_budget_s):
                return await self._admit_unbounded(route, received, context)
        except TimeoutError:
            _log.warning("storage unavailable during admission: no answer within the bound")
            await context.abort_with_status(
                status_for(ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE, "storage unavailable")
            )
            raise AssertionError("abort_with_status always raises") from None

    async def _admit_unbounded(
        self, route: Route, received: Received, context: Context
    ) -> tuple[Message, Admitted | None]:
        request = received.message or route.request_type()
        targets = targets_of(request)
        draft = AuditRecord(
            principal_kind="anonymous",
            principal_id=None,
            operation=route.operation,
            outcome="admitted",
            reason=None,
            project_id=targets.project_id,
            run_id=targets.run_id,
            worker_id=targets.worker_id,
            session_id=targets.session_id,
            request_id=targets.request_id,
            peer=context.peer()[:256],
        )
        try:
            principal, authorised, tls_version = await self._check(
                route, received, request, context, targets
            )
        except (Refusal, psycopg.Error, psycopg_pool.PoolTimeout) as error:
            refusal = error if isinstance(error, Refusal) else _storage_unavailable(error)
            if refusal.principal is not None:
                draft = _attributed(draft, refusal.principal)
            await self._audit(
                replace(draft, outcome=refusal.outcome, reason=_reason_text(refusal.reason)),
                context,
            )
            await context.abort_with_status(
                status_for(refusal.reason, refusal.message, field_violations=refusal.violations)
            )
            raise AssertionError("abort_with_status always raises") from refusal
        draft = _attributed(draft, principal)
        if authorised.require_approval:
            await self._audit(replace(draft, outcome="require_approval"), context)
            return request, None
        audit_id = await self._audit(draft, context)
        return request, Admitted(principal, authorised.binding, audit_id, tls_version)

    async def _check(
        self,
        route: Route,
        received: Received,
        request: Message,
        context: Context,
        targets: Targets,
    ) -> tuple[Principal, Authorised, str]:
        peer = peer_tls(context.auth_context())
        if not is_acceptable_transport(context.auth_context()):
            raise Refusal(
                "unauthenticated",
                ErrorReason.ERROR_REASON_TLS_VERSION_REJECTED,
                "TLS 1.3 is required",
            )
        too_large = request_size_violation(route.full_method, received.size)
        if too_large is not None:
            raise _invalid([too_large])
        principal = await self._authenticate(route, peer.uris, context)
        try:
            if received.message is None:
                raise _invalid(
                    [
                        received.undecodable
                        or FieldViolation(
                            request.DESCRIPTOR.full_name,
                            "the request bytes are not a well-formed message of this type",
                        )
                    ],
                    "the request is not a well-formed message",
                )
            violations = validate_request(request, serialized_size=received.size)
            if violations:
                raise _invalid(violations)
            authorised = await self._authorise(route, principal, targets)
        except Refusal as refusal:
            refusal.principal = principal
            raise
        return principal, authorised, peer.tls_version or ""

    async def _authenticate(self, route: Route, uris: Sequence[str], context: Context) -> Principal:
        if route.audience == "worker":
            prefix = worker_uri_prefix(self._trust_domain)
            for uri in uris:
                if uri.startswith(prefix):
                    worker_id = await self._directory.worker_by_certificate(uri)
                    if worker_id is not None:
                        return Principal(
                            PrincipalKind.WORKER,
                            worker_id,
                            worker_id,
                            CredentialKind.CERTIFICATE,
                            uri,
                        )
            raise _unauthenticated("no enrolled worker identity on the certificate")
        authorization = _metadata(context, "authorization")
        if authorization is not None:
            digest = bearer_token_digest(authorization)
            row = None if digest is None else await self._directory.operator_by_token_digest(digest)
            if row is None:
                raise _unauthenticated("the bearer token is not valid")
            return Principal(
                PrincipalKind(row.kind),
                str(row.principal_id),
                row.name,
                CredentialKind.BEARER_TOKEN,
                "bearer",
            )
        prefix = operator_uri_prefix(self._trust_domain)
        for uri in uris:
            if uri.startswith(prefix):
                row = await self._directory.operator_by_certificate(uri)
                if row is not None:
                    return Principal(
                        PrincipalKind(row.kind),
                        str(row.principal_id),
                        row.name,
                        CredentialKind.CERTIFICATE,
                        uri,
                    )
        raise _unauthenticated("no enrolled operator credential")

    async def _authorise(self, route: Route, principal: Principal, targets: Targets) -> Authorised:
        if route.audience == "worker":
            # SPEC R-ING-1: the body cannot speak for another worker or its sessions.
            if targets.worker_id != principal.id:
                raise _mismatch("the request names another worker")
            if targets.session_id is not None:
                owner = await self._directory.session_owner(targets.session_id)
                if owner != principal.id:
                    raise _mismatch("the session belongs to another worker")
            return Authorised(binding=None)
        # Every operator request names its project (the validator refused it otherwise).
        assert route.permission is not None
        assert targets.project_id is not None
        binding = await self._directory.role_binding(targets.project_id, uuid.UUID(principal.id))
        decision = decide(principal, None if binding is None else binding.role, route.permission)
        if decision is Decision.DENY:
            raise Refusal(
                "permission_denied",
                ErrorReason.ERROR_REASON_PERMISSION_DENIED,
                "no project role allows this",
            )
        return Authorised(binding, require_approval=decision is Decision.REQUIRE_APPROVAL)

    async def _audit(self, record: AuditRecord, context: Context) -> str:
        try:
            return str(await self._directory.write_audit(record))
        except Exception as error:  # any storage failure: nothing unaudited goes through
            _log.warning("security audit unavailable: %s", type(error).__name__)
            await context.abort_with_status(
                status_for(ErrorReason.ERROR_REASON_AUDIT_UNAVAILABLE, "audit unavailable")
            )
            raise AssertionError("abort_with_status always raises") from error

    def _runtime_request(self, route: Route, request: Message, admitted: Admitted) -> Message:
        principal = admitted.principal
        caller = caller_pb2.Caller(
            principal_kind=_PRINCIPAL_KINDS[principal.kind],
            principal_id=principal.id,
            worker_id=principal.worker_id or "",
            credential=caller_pb2.CredentialBinding(
                kind=_CREDENTIAL_KINDS[principal.credential],
                subject=principal.subject,
                tls_version=admitted.tls_version,
            ),
        )
        if admitted.binding is not None:
            caller.role_binding.CopyFrom(
                caller_pb2.RoleBindingSnapshot(
                    project_id=targets_of(request).project_id or "",
                    project_version=admitted.binding.project_version,
                    role_binding_id=principal.id,
                    role_binding_version=admitted.binding.binding_version,
                    role=_PROJECT_ROLES[admitted.binding.role],
                )
            )
        wrapped = route.runtime_request_type(caller=caller, audit_id=admitted.audit_id)
        getattr(wrapped, "request").CopyFrom(request)  # noqa: B009 - protobuf field
        return wrapped


def _invalid(
    violations: Sequence[FieldViolation], message: str = "request is out of bounds"
) -> Refusal:
    return Refusal(
        "invalid_argument",
        primary_reason(violations),
        message,
        [(v.field, v.description) for v in violations],
    )


def _attributed(draft: AuditRecord, principal: Principal) -> AuditRecord:
    return replace(draft, principal_kind=principal.kind.value, principal_id=principal.id)


def _storage_unavailable(error: BaseException) -> Refusal:
    # The class name only: driver messages can name hosts and roles.
    _log.warning("storage unavailable during admission: %s", type(error).__name__)
    return Refusal(
        "unavailable", ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE, "storage unavailable"
    )


def _unauthenticated(message: str) -> Refusal:
    return Refusal("unauthenticated", ErrorReason.ERROR_REASON_UNAUTHENTICATED_PRINCIPAL, message)


def _mismatch(message: str) -> Refusal:
    return Refusal("permission_denied", ErrorReason.ERROR_REASON_PRINCIPAL_MISMATCH, message)


def _reason_text(reason: ErrorReason.ValueType) -> str:
    return ErrorReason.Name(reason).removeprefix("ERROR_REASON_")


def _metadata(context: Context, key: str) -> str | None:
    for name, value in context.invocation_metadata() or ():
        if name == key:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return None


def _forward_timeout(context: Context) -> float:
    """grpcio does not propagate deadlines by itself: pass on what the caller has left."""
    # The stubs say float; grpc.aio answers None when the caller set no deadline.
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return DEFAULT_FORWARD_TIMEOUT_SECONDS
    return max(0.0, min(remaining, DEFAULT_FORWARD_TIMEOUT_SECONDS * 10))


async def _relay(context: Context, error: grpc.aio.AioRpcError) -> None:
    """Control's answer reaches the caller unchanged; an unreachable control is
    UNAVAILABLE with a reason the caller can act on (retry)."""
    rich = rich_status_of(error)
    if rich is not None:
        await context.abort_with_status(rpc_status.to_status(rich))
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        code = error.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            await context.abort(code, "deadline exceeded")
        await context.abort_with_status(
            status_for(ErrorReason.ERROR_REASON_RUNTIME_UNAVAILABLE, "runtime unavailable")
        )
    # A status without details (e.g. UNIMPLEMENTED from a base servicer): same code,
    # a generic message (details of an internal hop are not the caller's business).
    await context.abort(error.code(), error.code().name.lower().replace("_", " "))


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()
