"""The ingress pipeline every public call goes through, in this order:

1-5. admission: the stages of stages.py — transport (TLS 1.3), size (the method's byte
   cap), authentication, bounds, authorisation — each passes the call on, refuses it,
   or holds it for an approval;
6. audit: one durable row, committed with the ingress role, whatever admission decided —
   before anything else happens to the call (the one exception: a refusal marked
   ``audited=False``, the enrollment rate limit's repeats, is counted instead).
   Concurrent calls' rows share a statement and a commit (group_commit.py); for a
   Worker's call that statement also checks its identity and binding, so the call costs
   one database round trip (R-PERF-1);
7. forwarding: over the single internal channel, with the caller and audit id attached
   and the incoming deadline passed on. Control's status and ErrorInfo come back as
   they are; a control that cannot be reached is UNAVAILABLE/RUNTIME_UNAVAILABLE.

A refusal is answered with its typed status once its audit row is committed; a call held
for approval is, once audited, handed to control as a pending approval request
(RuntimeService.HoldForApproval, R-OPS-2) and answered as its route says (CancelRun's
REQUIRE_APPROVAL outcome with the request's id, or the status APPROVAL_REQUIRED); nothing
refused or unaudited reaches control, and nothing held runs until a person approves it.
All of a call's database work (identity, binding, audit — also the audit of a refusal)
shares one storage budget, so an outage is answered within the storage bound (R-ERR-2);
a storage failure is answered by the rule control uses too (qinglong_protocol
.storage_errors), and any other fault in a stage is an audited INTERNAL. Secrets (lease
tokens, operator tokens) never reach a log line, an audit row or an error message.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
import psycopg
from google.protobuf.message import Message
from grpc_status import rpc_status
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2
from qinglong_protocol.budget import settle_within
from qinglong_protocol.errors import (
    APPROVAL_ID,
    TypedStatus,
    abort_with,
    reason_name,
    rich_status_of,
    status_for,
)
from qinglong_protocol.storage import StorageBounds
from qinglong_protocol.storage_errors import StorageFailure, storage_answer
from qinglong_protocol.telemetry import (
    current_trace_context,
    trace_context_of,
    tracing_enabled,
)

from qinglong_ingress.audit import AuditOutcome
from qinglong_ingress.directory import Audited, AuditEntry, AuditRecord, Directory, RoleBinding
from qinglong_ingress.metrics import REFUSALS_NOT_AUDITED
from qinglong_ingress.principals import CredentialKind, Principal, PrincipalKind
from qinglong_ingress.routes import Route
from qinglong_ingress.stages import (
    Call,
    Context,
    Received,
    Refusal,
    Settles,
    Stage,
    Verdict,
    admission_stages,
    claim_refused,
)
from qinglong_ingress.targets import targets_of

_log = logging.getLogger(__name__)

# Without a deadline from the caller, a forwarded call still may not wait forever.
DEFAULT_FORWARD_TIMEOUT_SECONDS = 30.0
#: The longest a forwarded unary call may last, whatever the caller asks.
MAX_FORWARD_SECONDS = DEFAULT_FORWARD_TIMEOUT_SECONDS * 10
#: How long a stream (a watch) lasts at most, whatever the caller asks: it then ends
#: DEADLINE_EXCEEDED and the caller resumes after the last Event it got (`qinglong run
#: watch` does). Admission runs again at each resume, so a revoked token, role or
#: principal ends an open watch within this bound, as it refuses any other call at once.
STREAM_LIFETIME_SECONDS = DEFAULT_FORWARD_TIMEOUT_SECONDS

_PRINCIPAL_KINDS = {
    PrincipalKind.WORKER: caller_pb2.PRINCIPAL_KIND_WORKER,
    PrincipalKind.USER: caller_pb2.PRINCIPAL_KIND_USER,
    PrincipalKind.AGENT: caller_pb2.PRINCIPAL_KIND_AGENT,
    PrincipalKind.ANONYMOUS: caller_pb2.PRINCIPAL_KIND_ANONYMOUS,
}
_CREDENTIAL_KINDS = {
    CredentialKind.CERTIFICATE: caller_pb2.CREDENTIAL_KIND_MTLS_CERTIFICATE,
    CredentialKind.BEARER_TOKEN: caller_pb2.CREDENTIAL_KIND_BEARER_TOKEN,
    CredentialKind.JOIN_TOKEN: caller_pb2.CREDENTIAL_KIND_JOIN_TOKEN,
}
_PROJECT_ROLES = {
    "owner": caller_pb2.PROJECT_ROLE_OWNER,
    "admin": caller_pb2.PROJECT_ROLE_ADMIN,
    "operator": caller_pb2.PROJECT_ROLE_OPERATOR,
    "viewer": caller_pb2.PROJECT_ROLE_VIEWER,
}
_HOLD_METHOD = "/{}/HoldForApproval".format(
    runtime_service_pb2.DESCRIPTOR.services_by_name["RuntimeService"].full_name
)
_APPROVAL_REQUIRED = TypedStatus(
    ErrorReason.ERROR_REASON_APPROVAL_REQUIRED, "this needs an approval; nothing was done"
)


@dataclass(frozen=True)
class Admitted:
    principal: Principal
    binding: RoleBinding | None
    audit_id: str
    tls_version: str
    held: bool = False
    """Admitted only as needing an approval (R-OPS-2): control holds it, runs nothing."""


class Gateway:
    def __init__(
        self,
        directory: Directory,
        runtime: grpc.aio.Channel,
        trust_domain: str,
        storage: StorageBounds | None = None,
        stages: Sequence[Stage] | None = None,
    ) -> None:
        """``stages``: the admission rules in order; by default `admission_stages`."""
        self._directory = directory
        self._runtime = runtime
        self._stages = tuple(
            admission_stages(directory, trust_domain) if stages is None else stages
        )
        self._settling = tuple(stage for stage in self._stages if isinstance(stage, Settles))
        # All of a call's database work (identity, binding, audit — also the audit of a
        # refusal) shares one budget, so an outage answers within the storage bound
        # (R-ERR-2) rather than once per pool checkout.
        # Ingress's forward is no span of its own: its server span covers the call, and
        # control's server span (a child of it) the forward. Recording spans, ingress
        # passes its server span's context on; recording none (no instrumentation), the
        # caller's, so a Worker's trace still reaches control either way.
        self._records_spans = tracing_enabled()
        self._admission_budget_s = (storage or StorageBounds()).timeout_seconds * 0.9

    def use_runtime(self, channel: grpc.aio.Channel) -> None:
        """Forward the next calls over ``channel`` (a renewed client certificate's); the
        calls in flight finish on the one they started on."""
        self._runtime = channel

    # --- the two call shapes ----------------------------------------------------------

    async def unary(self, route: Route, received: Received, context: Context) -> Message:
        request, admitted = await self._admit(route, received, context)
        if admitted.held:  # audited; control keeps it for a decision, nothing else is done
            held = await self._hold(route, request, admitted, context)
            if held.HasField("answer"):  # nothing to approve: control answered the call
                moot: Message = route.response_type()
                if not held.answer.Unpack(moot):
                    raise AssertionError("control answered a held call with another type")
                return moot
            approval_id: str = held.approval.approval_id
            answer = route.approval_response(approval_id)
            if answer is None:
                await abort_with(context, _approval_required(approval_id))
            return answer
        call = self._runtime.unary_unary(
            route.runtime_method,
            request_serializer=_serialize,
            response_deserializer=route.runtime_response_type.FromString,
        )
        try:
            wrapped = await call(
                self._runtime_request(route, request, admitted),
                timeout=_forward_timeout(context),
                metadata=self._passed_on(context),
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
        if admitted.held:  # a stream is no mutation to execute later: nothing is held
            await abort_with(context, _APPROVAL_REQUIRED.status())
        call = self._runtime.unary_stream(
            route.runtime_method,
            request_serializer=_serialize,
            response_deserializer=route.runtime_response_type.FromString,
        )
        stream = call(
            self._runtime_request(route, request, admitted),
            timeout=min(_forward_timeout(context), STREAM_LIFETIME_SECONDS),
            metadata=self._passed_on(context),
        )
        try:
            async for wrapped in stream:
                yield getattr(wrapped, "response")  # noqa: B009 - protobuf field
        except grpc.aio.AioRpcError as error:
            await _relay(context, error)
            raise

    def _passed_on(self, context: Context) -> tuple[tuple[str, str], ...] | None:
        if self._records_spans:
            return current_trace_context() or None
        return trace_context_of(context.invocation_metadata()) or None

    # --- admission --------------------------------------------------------------------

    async def _admit(
        self, route: Route, received: Received, context: Context
    ) -> tuple[Message, Admitted]:
        """Run the stages and audit what they decided, within one storage budget. Returns
        the request and how it was admitted (perhaps only to be held for approval); a
        refusal, and an audit that could not be written, end the call here."""
        call = Call.arrived(route, received, context)
        audit_id = ""
        try:
            audit_id, decision = await settle_within(
                self._admission_budget_s, self._decide_and_audit(call)
            )
        except TimeoutError:
            # The budget is spent: no time is left to audit this answer either.
            _log.warning("storage unavailable during admission: no answer within the bound")
            decision = Refusal(ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE, "storage unavailable")
        except Refusal as unaudited:  # the audit itself failed
            decision = unaudited
        if isinstance(decision, Refusal):
            await abort_with(context, decision.answer.status())
        held = decision is Verdict.REQUIRE_APPROVAL
        return call.request, Admitted(call.caller, call.binding, audit_id, call.tls_version, held)

    async def _decide_and_audit(self, call: Call) -> tuple[str, Verdict | Refusal]:
        decision = await self._decide(call)
        if isinstance(decision, Refusal) and not decision.audited:
            REFUSALS_NOT_AUDITED.labels(reason_name(decision.answer.reason)).inc()
            return "", decision
        audit_id, settled = await self._audit(call, decision)
        for stage in self._settling:
            stage.settled(call, settled)
        return audit_id, settled

    async def _decide(self, call: Call) -> Verdict | Refusal:
        """The first refusal or approval of the stages, in order; else PASS."""
        for stage in self._stages:
            try:
                verdict = await stage.check(call)
            except Refusal as refusal:
                return refusal
            except psycopg.Error as error:
                return _storage_refusal(error, call.route)
            except Exception as error:  # a fault of ingress: audited, answered generically
                _log.error("internal error in admission (%s)", type(stage).__name__, exc_info=error)
                return Refusal(ErrorReason.ERROR_REASON_INTERNAL, "internal error")
            if verdict is not Verdict.PASS:
                return verdict
        return Verdict.PASS

    async def _audit(
        self, call: Call, decision: Verdict | Refusal
    ) -> tuple[str, Verdict | Refusal]:
        """Commit the call's audit row; return its id and the decision it records (the
        audit statement may refuse a Worker's claim). Raise Refusal (never audited, for
        want of an audit) if it cannot be written: nothing unaudited goes through."""
        try:
            audited = await self._write(AuditEntry(_record(call, decision), call.claim))
        except psycopg.Error as error:
            if call.claim is None:
                raise _audit_refusal(error, call.route) from None
            # The statement also read the Worker's identity and session, and the failure
            # may be theirs (as when a lookup ran first): audit that refusal on its own.
            refused = _storage_refusal(error, call.route)
            try:
                audit_id = await self._directory.write_audit_alone(_record(call, refused))
            except psycopg.Error as audit_error:
                raise _audit_refusal(audit_error, call.route) from None
            return str(audit_id), refused
        if audited.refusal is not None:
            decision = claim_refused(audited.refusal)
        elif call.claim is not None and decision is Verdict.PASS:
            # The statement found the certificate's Worker to be the one the call names.
            worker_id = audited.worker_id
            if worker_id is None:
                raise AssertionError("an admitted Worker's call has an enrolled Worker")
            call.principal = Principal(
                PrincipalKind.WORKER,
                worker_id,
                worker_id,
                CredentialKind.CERTIFICATE,
                call.claim.certificate_uri,
            )
        return str(audited.audit_id), decision

    async def _write(self, entry: AuditEntry) -> Audited:
        try:
            return await self._directory.write_audit(entry)
        except psycopg.Error:
            raise
        except Exception as error:  # a fault of ingress: still nothing unaudited goes on
            _log.error("security audit failed", exc_info=error)
            raise Refusal(ErrorReason.ERROR_REASON_INTERNAL, "internal error") from None

    async def _hold(
        self, route: Route, request: Message, admitted: Admitted, context: Context
    ) -> runtime_service_pb2.HoldForApprovalResponse:
        """Have control keep the call as a pending approval request (or answer it, when
        it would change nothing)."""
        held = runtime_service_pb2.HoldForApprovalRequest(
            caller=_caller(request, admitted), audit_id=admitted.audit_id, method=route.full_method
        )
        held.request.Pack(request)
        call = self._runtime.unary_unary(
            _HOLD_METHOD,
            request_serializer=_serialize,
            response_deserializer=runtime_service_pb2.HoldForApprovalResponse.FromString,
        )
        try:
            answer: runtime_service_pb2.HoldForApprovalResponse = await call(
                held, timeout=_forward_timeout(context), metadata=self._passed_on(context)
            )
        except grpc.aio.AioRpcError as error:
            await _relay(context, error)
            raise
        return answer

    def _runtime_request(self, route: Route, request: Message, admitted: Admitted) -> Message:
        wrapped = route.runtime_request_type(
            caller=_caller(request, admitted), audit_id=admitted.audit_id
        )
        getattr(wrapped, "request").CopyFrom(request)  # noqa: B009 - protobuf field
        return wrapped


def _caller(request: Message, admitted: Admitted) -> caller_pb2.Caller:
    """Who ingress authenticated, and the role binding it admitted them under."""
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
    return caller


def _approval_required(approval_id: str) -> grpc.Status:
    """The answer of a held method whose response cannot say so: the typed status, with
    the request that holds the call."""
    return status_for(
        _APPROVAL_REQUIRED.reason,
        "this needs an approval; it is held as a pending request, nothing was done yet",
        metadata={APPROVAL_ID: approval_id},
    )


def _record(call: Call, decision: Verdict | Refusal) -> AuditRecord:
    """The audit row of ``call`` as admission decided it."""
    if isinstance(decision, Refusal):
        outcome, reason = decision.outcome, reason_name(decision.answer.reason)
    elif decision is Verdict.REQUIRE_APPROVAL:
        outcome, reason = AuditOutcome.REQUIRE_APPROVAL, None
    else:
        outcome, reason = AuditOutcome.ADMITTED, None
    principal, targets = call.principal, call.targets
    return AuditRecord(
        principal_kind="anonymous" if principal is None else principal.kind.value,
        principal_id=None if principal is None else principal.id,
        operation=call.route.operation,
        outcome=outcome,
        reason=reason,
        project_id=targets.project_id,
        run_id=targets.run_id,
        worker_id=targets.worker_id,
        session_id=targets.session_id,
        request_id=targets.request_id,
        peer=call.context.peer()[:256],
        credential_id=None if principal is None else principal.token_id,
    )


def _audit_refusal(error: psycopg.Error, route: Route) -> Refusal:
    """The answer when no audit row could be written: the call is not audited."""
    return _storage_refusal(error, route, unavailable=ErrorReason.ERROR_REASON_AUDIT_UNAVAILABLE)


def _storage_refusal(
    error: psycopg.Error,
    route: Route,
    *,
    unavailable: ErrorReason.ValueType = ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE,
) -> Refusal:
    """The shared storage rule's answer, as ingress's refusal. Ingress maps no constraint
    of its own (it writes only audit rows), so a constraint is INTERNAL by that rule."""
    answer = storage_answer(
        StorageFailure(
            error.sqlstate,
            error.diag.constraint_name,
            operational=isinstance(error, psycopg.OperationalError),
            error_type=type(error).__name__,
        ),
        request_name=route.request_type.DESCRIPTOR.full_name,
        unavailable=unavailable,
        error=error,
    )
    return Refusal(answer.reason, answer.message, answer.field_violations)


def _forward_timeout(context: Context) -> float:
    """grpcio does not propagate deadlines by itself: pass on what the caller has left."""
    # The stubs say float; grpc.aio answers None when the caller set no deadline.
    remaining: float | None = context.time_remaining()
    if remaining is None:
        return DEFAULT_FORWARD_TIMEOUT_SECONDS
    return max(0.0, min(remaining, MAX_FORWARD_SECONDS))


async def _relay(context: Context, error: grpc.aio.AioRpcError) -> None:
    """Control's answer reaches the caller unchanged; an unreachable control is
    UNAVAILABLE with a reason the caller can act on (retry)."""
    rich = rich_status_of(error)
    if rich is not None:
        await abort_with(context, rpc_status.to_status(rich))
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        code = error.code()
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            await context.abort(code, "deadline exceeded")
        await abort_with(
            context, status_for(ErrorReason.ERROR_REASON_RUNTIME_UNAVAILABLE, "runtime unavailable")
        )
    # A status without details (e.g. UNIMPLEMENTED from a base servicer): same code,
    # a generic message (details of an internal hop are not the caller's business).
    await context.abort(error.code(), error.code().name.lower().replace("_", " "))


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()
