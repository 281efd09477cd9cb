"""RuntimeService: the internal API ingress forwards to. Translation only.

The Worker, Task and Run methods are here; the AdminService ones are in admin_servicer.py
(their own database role and pool), which this servicer extends.

Each method checks the caller ingress vouched for, parses the public request into domain
values (wire.py), runs one repository command on a pooled connection and renders the
answer. Fencing, state and time are decided in the repository's transaction. A method
only raises: the server's error interceptor (errors.py) answers every failure with a
typed status and times every call, so no method handles errors itself.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong.control.v1 import run_service_pb2, task_service_pb2
from qinglong.rpc.v1 import lifecycle_pb2
from qinglong.runtime.v1 import runtime_service_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2
from qinglong_protocol import bounds
from qinglong_protocol.identities import DEFAULT_TRUST_DOMAIN

from qinglong_control import metrics as prometheus
from qinglong_control import wire
from qinglong_control.admin_servicer import AdminMethods
from qinglong_control.approval_servicer import ApprovalMethods
from qinglong_control.db import (
    cancellation,
    definitions,
    lease_control,
    placement,
    runs,
    sessions,
    start_facts,
)
from qinglong_control.db.output import OutputStore, TableOutputStore
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.completion import CompletionReport
from qinglong_control.domain.output import OutputRetention
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionClaim
from qinglong_control.domain.start_facts import RunningReport
from qinglong_control.domain.timings import Timings
from qinglong_control.enrollment_servicer import EnrollmentMethods
from qinglong_control.issuing import IssuingAuthority
from qinglong_control.output_servicer import OutputMethods
from qinglong_control.wire import worker_of

Context = grpc.aio.ServicerContext[Any, Any]
rt = runtime_service_pb2

_SESSION_STATES = {
    "online": worker_pb2.SESSION_STATE_ONLINE,
    "draining": worker_pb2.SESSION_STATE_DRAINING,
}
_STARTING = {
    "starting": worker_pb2.STARTING_OUTCOME_STARTING,
    "already_starting": worker_pb2.STARTING_OUTCOME_ALREADY_STARTING,
    "already_running": worker_pb2.STARTING_OUTCOME_ALREADY_RUNNING,
}
_RUNNING = {
    "running": worker_pb2.RUNNING_OUTCOME_RUNNING,
    "already_running": worker_pb2.RUNNING_OUTCOME_ALREADY_RUNNING,
}
# A watcher sees a new Event within this long; each poll is one short query.
_WATCH_POLL_SECONDS = 0.2
# What a Worker may say about why it stopped an execution itself (CompleteAttempt);
# UNSPECIFIED is None ("the control plane asked"), anything unlisted is refused.
_STOP_REASONS: dict[int, str | None] = {
    lifecycle_pb2.CANCEL_REASON_UNSPECIFIED: None,
    lifecycle_pb2.CANCEL_REASON_SHUTDOWN: "shutdown",
}
_OUTCOMES = {
    worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED: "succeeded",
    worker_pb2.ATTEMPT_OUTCOME_FAILED: "failed",
    worker_pb2.ATTEMPT_OUTCOME_CANCELLED: "cancelled",
    worker_pb2.ATTEMPT_OUTCOME_TIMED_OUT: "timed_out",
}


def session_claim(request: Any) -> SessionClaim:
    return SessionClaim(
        request.worker_id,
        uuid.UUID(request.session_id),
        request.worker_generation,
    )


def session_response(view: sessions.SessionView, renew_interval_ms: int) -> Any:
    return {
        "session_state": _SESSION_STATES.get(view.status, worker_pb2.SESSION_STATE_UNSPECIFIED),
        "session_remaining": wire.duration(view.remaining_ms),
        "renew_interval": wire.duration(renew_interval_ms),
    }


def _run_states(numbers: Any) -> tuple[str, ...]:
    """The filter's state names (the contract's rule admits only known, distinct states)."""
    return tuple(
        lifecycle_pb2.RunState.Name(number).removeprefix("RUN_STATE_").lower() for number in numbers
    )


class RuntimeServicer(AdminMethods, EnrollmentMethods, ApprovalMethods, OutputMethods):
    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        timings: Timings,
        *,
        admin_pool: AsyncConnectionPool[AsyncConnection[Any]] | None = None,
        trust_domain: str = DEFAULT_TRUST_DOMAIN,
        issuing: IssuingAuthority | None = None,
        output_store: OutputStore | None = None,
        output_retention: OutputRetention | None = None,
    ) -> None:
        """``pool`` is the runtime role's; ``admin_pool`` the admin role's, for the
        AdminService and enrollment methods only (without it they answer UNAVAILABLE);
        ``issuing`` the CA that signs joining Workers' certificates; ``output_store``
        where Run output is kept (default: the runtime role's tables)."""
        AdminMethods.__init__(self, pool, admin_pool, trust_domain)
        EnrollmentMethods.__init__(self, admin_pool, issuing, trust_domain)
        ApprovalMethods.__init__(self, pool, timings)
        OutputMethods.__init__(
            self, output_store or TableOutputStore(pool), output_retention or OutputRetention()
        )
        self._pool = pool
        self._timings = timings

    # --- sessions ---------------------------------------------------------------------

    async def OpenSession(self, request: rt.OpenSessionRequest, context: Context) -> Any:
        public = request.request
        worker_id = worker_of(request.caller, public.worker_id)
        types = tuple(wire.EXECUTOR_TYPES[t] for t in public.executor_types)
        command = sessions.OpenSession(
            worker_id,
            public.request_id,
            types,
            public.max_concurrent_attempts,
            public.agent_version,
            public.passes_run_parameters,
            dict(public.labels),
        )
        async with self._pool.connection() as conn:
            view = await sessions.open_session(conn, command, self._timings)
        state = session_response(view, self._timings.session_ttl_ms // 3)
        return rt.OpenSessionResponse(
            response=worker_service_pb2.OpenSessionResponse(
                session_id=str(view.session_id), worker_generation=view.worker_generation, **state
            )
        )

    async def RenewSession(self, request: rt.RenewSessionRequest, context: Context) -> Any:
        public = request.request
        worker_of(request.caller, public.worker_id)
        async with self._pool.connection() as conn:
            view = await sessions.renew_session(
                conn,
                session_claim(public),
                self._timings,
                passes_run_parameters=public.passes_run_parameters,
                labels=dict(public.labels),
                # 0: a Worker of an earlier version, which does not say (unchanged).
                max_concurrency=public.max_concurrent_attempts or None,
            )
        state = session_response(view, 0)
        del state["renew_interval"]
        return rt.RenewSessionResponse(response=worker_service_pb2.RenewSessionResponse(**state))

    async def DrainSession(self, request: rt.DrainSessionRequest, context: Context) -> Any:
        worker_of(request.caller, request.request.worker_id)
        async with self._pool.connection() as conn:
            view = await sessions.drain_session(conn, session_claim(request.request), self._timings)
        state = session_response(view, 0)
        del state["renew_interval"]
        return rt.DrainSessionResponse(response=worker_service_pb2.DrainSessionResponse(**state))

    # --- placement and claim ----------------------------------------------------------

    async def PullOffers(self, request: rt.PullOffersRequest, context: Context) -> Any:
        public = request.request
        worker_of(request.caller, public.worker_id)
        async with self._pool.connection() as conn:
            placed = await placement.pull_offers(
                conn, session_claim(public), public.max_offers, self._timings
            )
        return rt.PullOffersResponse(response=wire.pull_offers_response(placed))

    async def ClaimOffer(self, request: rt.ClaimOfferRequest, context: Context) -> Any:
        public = request.request
        worker_id = worker_of(request.caller, public.worker_id)
        claim = ClaimRequest(
            worker_id=worker_id,
            session_id=uuid.UUID(public.session_id),
            worker_generation=public.worker_generation,
            offer_id=uuid.UUID(public.offer_id),
            project_id=public.project_id,
            run_id=uuid.UUID(public.run_id),
            token_digest=wire.parse_capability(public.lease_token, "lease_token"),
        )
        async with self._pool.connection() as conn:
            claimed = await placement.claim_offer(conn, claim, self._timings)
        return rt.ClaimOfferResponse(
            response=worker_service_pb2.ClaimOfferResponse(
                attempt_id=str(claimed.attempt_id),
                lease_generation=claimed.lease_generation,
                lease_version=claimed.lease_version,
                lease_remaining=wire.duration(claimed.lease_remaining_ms),
                spec=wire.execution_spec(claimed.plan),
            )
        )

    # --- the three start facts --------------------------------------------------------

    async def AcknowledgeStarting(
        self, request: rt.AcknowledgeStartingRequest, context: Context
    ) -> Any:
        fence = wire.parse_fence(request.request.fence)
        worker_of(request.caller, fence.worker_id)
        async with self._pool.connection() as conn:
            decision = await start_facts.acknowledge_starting(conn, fence)
        activation = worker_pb2.ActivationSnapshot(lease_version=decision.lease_version)
        if decision.timeout_ms is not None and decision.deadline_at_ms is not None:
            activation.timeout_ms = decision.timeout_ms
            activation.deadline.CopyFrom(wire.timestamp(decision.deadline_at_ms))
            activation.deadline_remaining.CopyFrom(
                wire.duration(decision.deadline_at_ms - decision.observed_at_ms)
            )
        return rt.AcknowledgeStartingResponse(
            response=worker_service_pb2.AcknowledgeStartingResponse(
                outcome=_STARTING[decision.outcome.value], activation=activation
            )
        )

    async def AcknowledgeRunning(
        self, request: rt.AcknowledgeRunningRequest, context: Context
    ) -> Any:
        public = request.request
        fence = wire.parse_fence(public.fence)
        worker_of(request.caller, fence.worker_id)
        log_artifact = public.log_artifact_id if public.HasField("log_artifact_id") else None
        report = RunningReport(
            public.executor_handle,
            log_artifact,
            public.callback_sequence,
            wire.parse_wire_digest(public.callback_token_digest, "callback_token_digest"),
        )
        async with self._pool.connection() as conn:
            decision = await start_facts.acknowledge_running(conn, fence, report)
        return rt.AcknowledgeRunningResponse(
            response=worker_service_pb2.AcknowledgeRunningResponse(
                outcome=_RUNNING[decision.outcome.value],
                started_at=wire.timestamp(decision.started_at_ms),
                lease_version=decision.lease_version,
            )
        )

    async def ReportStartFailure(
        self, request: rt.ReportStartFailureRequest, context: Context
    ) -> Any:
        public = request.request
        fence = wire.parse_fence(public.fence)
        worker_of(request.caller, fence.worker_id)
        async with self._pool.connection() as conn:
            decision = await start_facts.report_start_failure(conn, fence, public.error_summary)
        return rt.ReportStartFailureResponse(
            response=worker_service_pb2.ReportStartFailureResponse(
                attempt_state=wire.attempt_state(decision.attempt_state.value),
                run_state=wire.run_state(decision.run_state.value),
                error_code=decision.error_code,
                completed_lease_version=decision.completed_lease_version,
                replayed=decision.replayed,
            )
        )

    # --- lease control and completion -------------------------------------------------

    async def ControlLease(self, request: rt.ControlLeaseRequest, context: Context) -> Any:
        fence = wire.parse_fence(request.request.fence)
        worker_of(request.caller, fence.worker_id)
        async with self._pool.connection() as conn:
            decision = await lease_control.control_lease(conn, fence, self._timings)
        return rt.ControlLeaseResponse(response=wire.lease_answer(decision, self._timings))

    async def CompleteAttempt(self, request: rt.CompleteAttemptRequest, context: Context) -> Any:
        public = request.request
        fence = wire.parse_fence(public.fence)
        worker_of(request.caller, fence.worker_id)
        outcome = _OUTCOMES[public.outcome]
        stop_reason = _STOP_REASONS.get(public.stop_reason, "")
        if stop_reason == "" or (stop_reason and outcome != "cancelled"):
            raise Refused(
                Reason.FIELD_INVALID,
                "stop_reason may only be SHUTDOWN, with outcome CANCELLED",
                field="stop_reason",
            )
        report = CompletionReport(
            callback_sequence=public.callback_sequence,
            outcome=outcome,
            exit_code=public.exit_code if public.HasField("exit_code") else None,
            summary=public.summary,
            stop_reason=stop_reason,
            output_bytes=public.output_bytes if public.HasField("output_bytes") else None,
        )
        async with self._pool.connection() as conn:
            decision = await lease_control.complete_attempt(conn, fence, report)
        if not decision.replayed:
            prometheus.ATTEMPTS_COMPLETED.labels(decision.attempt_state.value).inc()
        return rt.CompleteAttemptResponse(
            response=worker_service_pb2.CompleteAttemptResponse(
                outcome=worker_pb2.COMPLETION_OUTCOME_ALREADY_COMPLETED
                if decision.replayed
                else worker_pb2.COMPLETION_OUTCOME_COMPLETED,
                attempt_state=wire.attempt_state(decision.attempt_state.value),
                run_state=wire.run_state(decision.run_state.value),
                error_code=decision.error_code or "",
                completed_lease_version=decision.completed_lease_version,
                finished_at=wire.timestamp(decision.finished_at_ms),
            )
        )

    # --- operator: tasks and runs -----------------------------------------------------

    async def CreateTask(self, request: rt.CreateTaskRequest, context: Context) -> Any:
        public = request.request
        actor = wire.operator_of(request.caller)
        first_plan = (
            wire.parse_plan(public.first_revision_plan)
            if public.HasField("first_revision_plan")
            else None
        )
        async with self._pool.connection() as conn:
            task = await definitions.create_task(
                conn,
                public.project_id,
                public.display_name,
                dict(public.labels),
                public.request_id,
                actor.id,
                first_plan,
            )
            first = (
                None
                if first_plan is None
                else await definitions.get_revision(
                    conn, public.project_id, task.task_id, revision_number=1
                )
            )
        response = task_service_pb2.CreateTaskResponse(task=wire.task(task))
        if first is not None:
            response.first_revision.CopyFrom(wire.revision(first))
        return rt.CreateTaskResponse(response=response)

    async def GetTask(self, request: rt.GetTaskRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        async with self._pool.connection() as conn:
            view = await definitions.get_task(
                conn,
                public.project_id,
                uuid.UUID(public.task_id),
            )
        return rt.GetTaskResponse(response=task_service_pb2.GetTaskResponse(task=wire.task(view)))

    async def ListTasks(self, request: rt.ListTasksRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        limit = wire.page_size(public.page_size)
        before = wire.parse_page_token(public.page_token)
        async with self._pool.connection() as conn:
            page = await definitions.list_tasks(conn, public.project_id, limit=limit, before=before)
        return rt.ListTasksResponse(
            response=task_service_pb2.ListTasksResponse(
                tasks=[wire.task(t) for t in page.tasks],
                next_page_token=wire.page_token(page.next_cursor),
            )
        )

    async def CreateTaskRevision(
        self, request: rt.CreateTaskRevisionRequest, context: Context
    ) -> Any:
        public = request.request
        actor = wire.operator_of(request.caller)
        revision = definitions.NewRevision.of(
            public.project_id,
            uuid.UUID(public.task_id),
            public.request_id,
            wire.parse_plan(public.plan),
        )
        async with self._pool.connection() as conn:
            view = await definitions.create_revision(conn, revision, actor.id)
        return rt.CreateTaskRevisionResponse(
            response=task_service_pb2.CreateTaskRevisionResponse(revision=wire.revision(view))
        )

    async def GetTaskRevision(self, request: rt.GetTaskRevisionRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        async with self._pool.connection() as conn:
            view = await definitions.get_revision(
                conn,
                public.project_id,
                uuid.UUID(public.task_id),
                revision_number=public.revision_number,
            )
        return rt.GetTaskRevisionResponse(
            response=task_service_pb2.GetTaskRevisionResponse(revision=wire.revision(view))
        )

    async def TriggerRun(self, request: rt.TriggerRunRequest, context: Context) -> Any:
        public = request.request
        actor = wire.operator_of(request.caller)
        revision_number = public.revision_number if public.HasField("revision_number") else None
        command = runs.TriggerRun(
            public.project_id,
            uuid.UUID(public.task_id),
            revision_number,
            public.request_id,
            dict(public.parameters),
            public.priority,
        )
        async with self._pool.connection() as conn:
            view = await runs.trigger_run(conn, command, actor, self._timings)
        return rt.TriggerRunResponse(
            response=run_service_pb2.TriggerRunResponse(run=wire.run(view))
        )

    async def GetRun(self, request: rt.GetRunRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        async with self._pool.connection() as conn:
            view = await runs.get_run(
                conn,
                public.project_id,
                uuid.UUID(public.run_id),
            )
        return rt.GetRunResponse(response=run_service_pb2.GetRunResponse(run=wire.run(view)))

    async def CancelRun(self, request: rt.CancelRunRequest, context: Context) -> Any:
        public = request.request
        actor = wire.operator_of(request.caller)
        project_id = public.project_id
        cancel = cancellation.CancelRequest(
            project_id=project_id,
            run_id=uuid.UUID(public.run_id),
            mutation_id=public.mutation_id,
            actor=actor,
            principal_id=wire.caller_principal_id(request.caller),
            snapshot=wire.binding_snapshot(request.caller, project_id),
        )
        # A connection per try: none is held while a serialization retry waits.
        outcome = await cancellation.cancel_run(self._pool, cancel)
        async with self._pool.connection() as conn:
            view = await runs.get_run(conn, project_id, cancel.run_id)
        return rt.CancelRunResponse(
            response=run_service_pb2.CancelRunResponse(
                outcome=wire.CANCEL_OUTCOMES[outcome], run=wire.run(view)
            )
        )

    async def ListRuns(self, request: rt.ListRunsRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        limit = wire.page_size(public.page_size)
        before = wire.parse_page_token(public.page_token)
        task_id = uuid.UUID(public.task_id) if public.task_id else None
        states = _run_states(public.states)
        async with self._pool.connection() as conn:
            page = await runs.list_runs(
                conn,
                public.project_id,
                limit=limit,
                task_id=task_id,
                states=states,
                before=before,
            )
        return rt.ListRunsResponse(
            response=run_service_pb2.ListRunsResponse(
                runs=[wire.run(r) for r in page.runs],
                next_page_token=wire.page_token(page.next_cursor),
            )
        )

    async def WatchRunEvents(
        self, request: rt.WatchRunEventsRequest, context: Context
    ) -> AsyncIterator[rt.WatchRunEventsResponse]:
        """Stream a Run's Events from `after_sequence`, live, until the Run is terminal.

        Polls with a short pause instead of holding a connection or a LISTEN per watcher:
        each poll borrows a pooled connection for one query. Operators only (ingress
        refuses Workers), so this stream is not a Worker mailbox (R-ING-4).
        """
        public = request.request
        wire.operator_of(request.caller)
        project_id = public.project_id
        run_id = uuid.UUID(public.run_id)
        after = public.after_sequence
        run: runs.RunView | None = None
        while True:
            async with self._pool.connection() as conn:
                if run is None:
                    events, run = await runs.list_events(
                        conn, project_id, run_id, after_sequence=after, limit=bounds.PAGE_SIZE_MAX
                    )
                else:
                    # A Run ends with an Event: with none new, it has not ended since the
                    # last read, so an idle poll is one statement — unless the caller asked
                    # for Events after a number the Run had not reached, whose end brings
                    # no Event it will see.
                    events = await runs.events_after(
                        conn, project_id, run_id, after_sequence=after, limit=bounds.PAGE_SIZE_MAX
                    )
                    if events or after > run.event_sequence:
                        run = await runs.get_run(conn, project_id, run_id)
            for event in events:
                yield rt.WatchRunEventsResponse(
                    response=run_service_pb2.WatchRunEventsResponse(event=wire.event(event))
                )
                after = event.sequence
            if run.finished_at_ms is not None and after >= run.event_sequence:
                return
            if not events:
                await asyncio.sleep(_WATCH_POLL_SECONDS)

    async def ListRunEvents(self, request: rt.ListRunEventsRequest, context: Context) -> Any:
        public = request.request
        wire.operator_of(request.caller)
        limit = wire.page_size(public.page_size)
        project_id = public.project_id
        run_id = uuid.UUID(public.run_id)
        async with self._pool.connection() as conn:
            events, run = await runs.list_events(
                conn, project_id, run_id, after_sequence=public.after_sequence, limit=limit
            )
        last = events[-1].sequence if events else public.after_sequence
        return rt.ListRunEventsResponse(
            response=run_service_pb2.ListRunEventsResponse(
                events=[wire.event(e) for e in events],
                next_after_sequence=last,
                run_event_sequence=run.event_sequence,
            )
        )
