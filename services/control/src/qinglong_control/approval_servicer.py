"""RuntimeService's approval methods (SPEC R-OPS-2): hold a call ingress admitted only
as needing an approval, list and read requests, approve or deny one.

Who may do what was decided by ingress from the caller's binding (reading needs a
role; deciding a role that may perform the held mutation, and no Agent); control
re-reads the decider's binding inside the decision's transaction (R-CAN-3).
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong.control.v1 import approval_pb2, approval_service_pb2
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2, runtime_service_pb2_grpc

from qinglong_control import wire
from qinglong_control.db import approvals, runs
from qinglong_control.domain.approvals import ApprovalView, Decision, HeldCall, expired_refusal
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.timings import Timings
from qinglong_control.held_mutations import HELD_MUTATIONS

Context = grpc.aio.ServicerContext[Any, Any]
rt = runtime_service_pb2
api = approval_service_pb2

_STATE_PREFIX = "APPROVAL_STATE_"


class ApprovalMethods(runtime_service_pb2_grpc.RuntimeServiceServicer):
    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[Any]], timings: Timings) -> None:
        self._approval_pool = pool
        self._approval_ttl_ms = timings.approval_ttl_ms

    async def HoldForApproval(self, request: rt.HoldForApprovalRequest, context: Context) -> Any:
        actor = wire.operator_of(request.caller)
        mutation = HELD_MUTATIONS.get(request.method)
        if mutation is None:
            raise Refused(Reason.APPROVAL_UNSUPPORTED, "this method cannot be held for approval")
        held_request = mutation.request_type()
        if not request.request.Unpack(held_request):
            raise Refused(
                Reason.FIELD_INVALID, "the held request is not the method's", field="request"
            )
        subject = mutation.subject(held_request)
        # Held only under a binding ingress admitted for this very project (the snapshot
        # itself is re-read when someone decides, as the decider's).
        wire.binding_snapshot(request.caller, subject.project_id)
        held = HeldCall(
            project_id=subject.project_id,
            method=request.method,
            request_type=held_request.DESCRIPTOR.full_name,
            request=request.request.value,
            run_id=subject.run_id,
            requested_by=wire.caller_principal_id(request.caller),
            requested_by_kind=actor.kind,
            audit_id=wire.audit_id_of(request.audit_id),
        )
        async with self._approval_pool.connection() as conn:
            outcome = await approvals.hold(conn, held, self._approval_ttl_ms, actor, mutation)
            if outcome.approval_id is None:
                # Only a mutation about a Run can be moot (HeldMutation.moot reads the Run).
                assert outcome.moot is not None
                assert subject.run_id is not None
                run = await runs.get_run(conn, subject.project_id, subject.run_id)
                answer = rt.HoldForApprovalResponse()
                answer.answer.Pack(mutation.answer(outcome.moot, run))
                return answer
            view = await approvals.get_approval(conn, held.project_id, outcome.approval_id)
        return rt.HoldForApprovalResponse(approval=approval(view))

    async def ListApprovals(self, request: rt.ListApprovalsRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        limit = wire.page_size(public.page_size)
        async with self._approval_pool.connection() as conn:
            page = await approvals.list_approvals(
                conn,
                public.project_id,
                limit=limit,
                states=tuple(
                    approval_pb2.ApprovalState.Name(s).removeprefix(_STATE_PREFIX).lower()
                    for s in public.states
                ),
                before=wire.parse_page_token(public.page_token),
            )
        return rt.ListApprovalsResponse(
            response=api.ListApprovalsResponse(
                approvals=[approval(view) for view in page.approvals],
                next_page_token=wire.page_token(page.next_cursor),
            )
        )

    async def GetApproval(self, request: rt.GetApprovalRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        async with self._approval_pool.connection() as conn:
            view = await approvals.get_approval(
                conn, public.project_id, uuid.UUID(public.approval_id)
            )
        return rt.GetApprovalResponse(response=api.GetApprovalResponse(approval=approval(view)))

    async def Approve(self, request: rt.ApproveRequest, context: Context) -> Any:
        view = await self._decide(request.caller, request.request, Decision.APPROVE)
        return rt.ApproveResponse(response=api.ApproveResponse(approval=approval(view)))

    async def Deny(self, request: rt.DenyRequest, context: Context) -> Any:
        view = await self._decide(request.caller, request.request, Decision.DENY)
        return rt.DenyResponse(response=api.DenyResponse(approval=approval(view)))

    async def _decide(
        self,
        caller: caller_pb2.Caller,
        public: api.ApproveRequest | api.DenyRequest,
        decision: Decision,
    ) -> ApprovalView:
        actor = wire.operator_of(caller)
        if actor.kind != "user":
            # Ingress refuses an Agent first; this is the same rule where it is enforced.
            raise Refused(Reason.PERMISSION_DENIED, "only a user may decide an approval")
        command = approvals.DecideApproval(
            project_id=public.project_id,
            approval_id=uuid.UUID(public.approval_id),
            decision=decision,
            decider=actor,
            decider_id=wire.caller_principal_id(caller),
            snapshot=wire.binding_snapshot(caller, public.project_id),
            note=public.note or None,
        )
        # A connection per try: none is held while a serialization retry waits.
        decided = await approvals.decide(self._approval_pool, command, HELD_MUTATIONS)
        if decided.expired:
            raise expired_refusal()
        async with self._approval_pool.connection() as conn:
            return await approvals.get_approval(conn, command.project_id, command.approval_id)


def approval(view: ApprovalView) -> approval_pb2.Approval:
    message = approval_pb2.Approval(
        approval_id=str(view.approval_id),
        project_id=view.project_id,
        state=approval_pb2.ApprovalState.ValueType(
            wire.enum_value(approval_pb2.ApprovalState, _STATE_PREFIX, view.state)
        ),
        method=view.method,
        run_id="" if view.run_id is None else str(view.run_id),
        requested_by=str(view.requested_by),
        requested_by_kind=wire.actor_kind(view.requested_by_kind),
        requested_by_name=view.requested_by_name or "",
        audit_id=str(view.audit_id),
        requested_at=wire.timestamp(view.requested_at_ms),
        expires_at=wire.timestamp(view.expires_at_ms),
        decided_by="" if view.decided_by is None else str(view.decided_by),
        decided_by_name=view.decided_by_name or "",
        note=view.note or "",
        result=view.result or "",
    )
    message.request.type_url = f"type.googleapis.com/{view.request_type}"
    message.request.value = view.request
    if view.decided_at_ms is not None:
        message.decided_at.CopyFrom(wire.timestamp(view.decided_at_ms))
    return message
