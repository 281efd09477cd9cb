"""Ingress end to end (issue 4): identity, bounds, admission, audit, forwarding.

Real parts only: control and ingress gRPC servers with mutual TLS on loopback, each with
its own PostgreSQL role, clients holding real certificates and bearer tokens. "Control
never called" is asserted on control's side, by counting what reaches its runtime API.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable

import grpc
import pytest
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2, fence_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2, worker_service_pb2_grpc
from qinglong_ingress.stages import REFUSALS_PER_MINUTE
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.errors import error_reason_of, field_violations_of

from tests.support.calls import failure
from tests.support.polling import settled
from tests.support.stack import PROJECT, Stack, bearer
from tests.support.worker_steps import claimed_attempt, open_session, queued_run, running_attempt

ws = worker_service_pb2


async def test_worker_start_sequence_through_ingress_is_audited_and_forwarded(
    stack: Stack,
) -> None:
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        fence = await claimed_attempt(stack, worker)
        run_id, capability = fence.run_id, fence.lease_token
        starting = await worker.AcknowledgeStarting(ws.AcknowledgeStartingRequest(fence=fence))
        assert starting.outcome == worker_pb2.STARTING_OUTCOME_STARTING
        # A control refusal comes back unchanged: code and ErrorInfo reason.
        stale = fence_pb2.Fence()
        stale.CopyFrom(fence)
        stale.expected_lease_version = 7
        fenced = await failure(
            worker.AcknowledgeStarting(ws.AcknowledgeStartingRequest(fence=stale))
        )
        assert fenced.code() == grpc.StatusCode.ABORTED
        assert error_reason_of(fenced) == "LEASE_VERSION_FENCED"
        # Lease control answers exactly one of its three, with durations, never the token.
        renewed = await worker.ControlLease(ws.ControlLeaseRequest(fence=fence))
        assert renewed.WhichOneof("result") == "renewed"
        assert renewed.renewed.lease_version == 2
        assert renewed.renewed.lease_remaining.ToMilliseconds() > 0
        assert 0 < renewed.renewed.deadline_remaining.ToMilliseconds() <= 60_000
        assert capability not in str(renewed)

    rows = stack.audit_rows()
    worker_rows = [r for r in rows if r["principal_kind"] == "worker"]
    assert [r["operation"] for r in worker_rows] == [
        "WorkerService/OpenSession",
        "WorkerService/PullOffers",
        "WorkerService/ClaimOffer",
        "WorkerService/AcknowledgeStarting",
        "WorkerService/AcknowledgeStarting",
        "WorkerService/ControlLease",
    ]
    assert all(r["outcome"] == "admitted" and r["principal_id"] == "worker-a" for r in worker_rows)
    assert str(worker_rows[-1]["run_id"]) == run_id
    # One audit row per forwarded call, each before control saw the call.
    assert len(stack.control_calls.methods) == len(rows)
    assert capability not in repr(rows)


async def test_worker_cannot_act_on_another_workers_session(stack: Stack) -> None:
    async with stack.channel(stack.worker_identity("worker-b")) as b_channel:
        session_b = await open_session(
            worker_service_pb2_grpc.WorkerServiceStub(b_channel), "worker-b"
        )
    calls_before = list(stack.control_calls.methods)
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        # Naming worker-b in the body is refused: identity comes from the certificate.
        impersonated = await failure(
            worker.RenewSession(
                ws.RenewSessionRequest(
                    worker_id="worker-b",
                    session_id=session_b.session_id,
                    worker_generation=session_b.worker_generation,
                )
            )
        )
        # Naming itself but worker-b's session is refused too.
        borrowed = await failure(
            worker.RenewSession(
                ws.RenewSessionRequest(
                    worker_id="worker-a",
                    session_id=session_b.session_id,
                    worker_generation=session_b.worker_generation,
                )
            )
        )
    for refused in (impersonated, borrowed):
        assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_reason_of(refused) == "PRINCIPAL_MISMATCH"
    assert stack.control_calls.methods == calls_before
    denied = [r for r in stack.audit_rows() if r["outcome"] == "permission_denied"]
    assert [(r["principal_id"], r["reason"]) for r in denied] == [
        ("worker-a", "PRINCIPAL_MISMATCH"),
        ("worker-a", "PRINCIPAL_MISMATCH"),
    ]


async def test_an_unenrolled_certificate_is_unauthenticated_and_audited(stack: Stack) -> None:
    async with stack.channel(stack.worker_identity("worker-zzz")) as channel:
        refused = await failure(
            open_session(worker_service_pb2_grpc.WorkerServiceStub(channel), "worker-zzz")
        )
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    assert error_reason_of(refused) == "UNAUTHENTICATED_PRINCIPAL"
    assert stack.control_calls.methods == []
    [row] = stack.audit_rows()
    assert (row["principal_kind"], row["outcome"]) == ("anonymous", "unauthenticated")


async def test_a_certificate_refused_again_and_again_is_refused_before_any_audit_row(
    stack: Stack,
) -> None:
    """A certificate no Worker holds any more (disabled, never enrolled) calling in a
    loop: each refusal was an audit row, as fast as it sent. After its budget of refusals
    the calls are refused RATE_LIMITED with no database work (the first audited), and
    another caller is served as before."""
    calls = int(REFUSALS_PER_MINUTE) + 20
    async with stack.channel(stack.worker_identity("worker-zzz")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        refusals = [await failure(open_session(worker, "worker-zzz")) for _ in range(calls)]
    codes = [refused.code() for refused in refusals]
    unauthenticated = codes.count(grpc.StatusCode.UNAUTHENTICATED)
    limited = [r for r in refusals if r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    # The bucket refills at two a second while the loop runs: a few more pass.
    assert REFUSALS_PER_MINUTE <= unauthenticated < calls - 5, codes
    assert unauthenticated + len(limited) == calls
    assert {error_reason_of(r) for r in limited} == {"RATE_LIMITED"}
    outcomes = [row["outcome"] for row in stack.audit_rows()]
    assert (outcomes.count("unauthenticated"), outcomes.count("rate_limited")) == (
        unauthenticated,
        1,
    ), "one row per judged refusal, one for the limited ones"
    print(f"{calls} calls: {unauthenticated} refused and audited, {len(limited)} limited")
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        assert await open_session(worker_service_pb2_grpc.WorkerServiceStub(channel), "worker-a")
    assert stack.control_calls.methods == ["OpenSession"]


async def test_bad_input_is_refused_with_bad_request_and_not_forwarded(stack: Stack) -> None:
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await open_session(worker, "worker-a")
        forwarded = list(stack.control_calls.methods)
        fence = fence_pb2.Fence(
            worker_id="worker-a",
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            project_id=PROJECT,
            run_id=str(uuid.uuid4()),
            attempt_id=str(uuid.uuid4()),
            offer_id=str(uuid.uuid4()),
            lease_generation=1,
            lease_token=encode_lease_capability(secrets.token_bytes(32)),
            expected_lease_version=1,
        )
        too_long = await failure(
            worker.AcknowledgeRunning(
                ws.AcknowledgeRunningRequest(
                    fence=fence,
                    executor_handle="h" * 513,
                    callback_sequence=1,
                    callback_token_digest="ab" * 32,
                )
            )
        )
        bad_digest = await failure(
            worker.AcknowledgeRunning(
                ws.AcknowledgeRunningRequest(
                    fence=fence,
                    executor_handle="pid:1",
                    callback_sequence=1,
                    callback_token_digest="AB" * 32,
                )
            )
        )
        unknown_enum = await failure(
            worker.OpenSession(
                ws.OpenSessionRequest(
                    request_id="x-1",
                    worker_id="worker-a",
                    executor_types=[99],  # type: ignore[list-item]
                    max_concurrent_attempts=1,
                )
            )
        )
        oversized = fence_pb2.Fence()
        oversized.CopyFrom(fence)
        oversized.worker_id = "w" * 9_000
        too_large = await failure(worker.ControlLease(ws.ControlLeaseRequest(fence=oversized)))
    for refused in (too_long, bad_digest, unknown_enum):
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_violations_of(refused), "a BadRequest detail names the field"
    assert [f for f, _ in field_violations_of(too_long)] == ["executor_handle"]
    assert [f for f, _ in field_violations_of(bad_digest)] == ["callback_token_digest"]
    assert too_large.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason_of(too_large) == "REQUEST_TOO_LARGE"
    assert stack.control_calls.methods == forwarded
    assert fence.lease_token not in repr(stack.audit_rows())


async def test_operator_admission(stack: Stack) -> None:
    run_id = await queued_run(stack)
    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        get = run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=run_id)
        # A viewer reads; the same viewer may not trigger or stop.
        read = await runs.GetRun(get, metadata=bearer(stack, "vera"))
        assert read.run.run_id == run_id
        cannot_stop = await failure(
            runs.CancelRun(
                run_service_pb2.CancelRunRequest(
                    project_id=PROJECT, run_id=run_id, mutation_id="m-1"
                ),
                metadata=bearer(stack, "vera"),
            )
        )
        assert cannot_stop.code() == grpc.StatusCode.PERMISSION_DENIED
        # No role in the project at all: denied, and the project's existence is not revealed.
        outsider = await failure(runs.GetRun(get, metadata=bearer(stack, "mallory")))
        assert outsider.code() == grpc.StatusCode.PERMISSION_DENIED
        # An agent asking to stop a Run gets require_approval, never a cancel: control is
        # asked only to hold the call (R-OPS-2), and the Run is untouched.
        calls = list(stack.control_calls.methods)
        approval = await runs.CancelRun(
            run_service_pb2.CancelRunRequest(project_id=PROJECT, run_id=run_id, mutation_id="m-2"),
            metadata=bearer(stack, "bot"),
        )
        assert approval.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL
        assert uuid.UUID(approval.approval_id)
        assert stack.control_calls.methods == [*calls, "HoldForApproval"]
        after = await runs.GetRun(get, metadata=bearer(stack, "vera"))
        assert not after.run.HasField("cancel_intent")
        # A forged or malformed token is unauthenticated.
        forged = await failure(
            runs.GetRun(get, metadata=(("authorization", "Bearer qlo1_" + "x" * 43),))
        )
        assert forged.code() == grpc.StatusCode.UNAUTHENTICATED
    outcomes = [r["outcome"] for r in stack.audit_rows()]
    assert "require_approval" in outcomes
    assert outcomes.count("permission_denied") == 2
    assert all(token not in repr(stack.audit_rows()) for token in stack.tokens.values())


async def test_control_down_is_unavailable_and_still_audited(stack: Stack) -> None:
    await stack.control_server.stop(None)
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        refused = await failure(
            open_session(worker_service_pb2_grpc.WorkerServiceStub(channel), "worker-a")
        )
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason_of(refused) == "RUNTIME_UNAVAILABLE"
    [row] = stack.audit_rows()
    assert (row["operation"], row["outcome"]) == ("WorkerService/OpenSession", "admitted")


async def test_no_secret_reaches_logs_errors_or_responses(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    capability = encode_lease_capability(secrets.token_bytes(32))
    seen: list[str] = []
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await open_session(worker, "worker-a")
        claim = ws.ClaimOfferRequest(
            worker_id="worker-a",
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            offer_id=str(uuid.uuid4()),
            project_id=PROJECT,
            run_id=str(uuid.uuid4()),
            lease_token=capability,
        )
        refused = await failure(worker.ClaimOffer(claim))
        seen += [refused.details() or "", repr(refused.trailing_metadata())]
    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        forged = await failure(
            runs.GetRun(
                run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=str(uuid.uuid4())),
                metadata=(("authorization", "Bearer " + stack.tokens["alice"][:-1] + "Q"),),
            )
        )
        seen += [forged.details() or "", repr(forged.trailing_metadata())]
    key_material = stack.pki.ingress_server.key.read_text()
    haystack = "\n".join([*seen, caplog.text, repr(stack.audit_rows())])
    for secret in (capability, stack.tokens["alice"], stack.tokens["alice"][:-1] + "Q"):
        assert secret not in haystack
    assert key_material.strip().splitlines()[1] not in haystack


async def test_operator_by_client_certificate_and_deadline_propagation(stack: Stack) -> None:
    async with stack.channel(stack.operator_identity("carol")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        created = await tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=PROJECT, request_id="carol-1", display_name="by certificate"
            ),
            timeout=7.0,
        )
    assert created.task.display_name == "by certificate"
    [row] = [r for r in stack.audit_rows() if r["operation"] == "TaskService/CreateTask"]
    assert row["principal_kind"] == "user"
    # grpcio does not forward deadlines by itself; ingress passed on what was left of 7 s.
    [remaining] = stack.control_calls.time_remaining
    assert remaining is not None
    assert 0 < remaining <= 7.0


async def test_transport_refuses_messages_beyond_the_largest_cap(stack: Stack) -> None:
    async with stack.channel(stack.operator_identity("carol")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        refused = await failure(
            tasks.CreateTask(
                task_service_pb2.CreateTaskRequest(
                    project_id=PROJECT, request_id="big", display_name="x" * 200_000
                )
            )
        )
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stack.control_calls.methods == []


async def test_user_cancel_reaches_the_running_worker_at_its_next_lease_call(
    stack: Stack,
) -> None:
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        fence = await running_attempt(stack, worker)
        async with stack.channel(stack.operator_identity("ops")) as operator_channel:
            runs = run_service_pb2_grpc.RunServiceStub(operator_channel)
            cancel = run_service_pb2.CancelRunRequest(
                project_id=PROJECT, run_id=fence.run_id, mutation_id="stop-1"
            )
            accepted = await runs.CancelRun(cancel, metadata=bearer(stack, "alice"))
            replayed = await runs.CancelRun(cancel, metadata=bearer(stack, "alice"))
        assert accepted.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_ACCEPTED
        assert replayed.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_ALREADY_REQUESTED
        assert accepted.run.cancel_intent.reason != 0
        # The intent only records; the Worker learns it at its next lease-control call.
        answer = await worker.ControlLease(ws.ControlLeaseRequest(fence=fence))
        assert answer.WhichOneof("result") == "stop_requested"
        fence.expected_lease_version = answer.stop_requested.lease_version
        done = await worker.CompleteAttempt(
            ws.CompleteAttemptRequest(
                fence=fence,
                callback_sequence=1,
                outcome=worker_pb2.ATTEMPT_OUTCOME_CANCELLED,
                summary="stopped on request",
            )
        )
    assert done.outcome == worker_pb2.COMPLETION_OUTCOME_COMPLETED
    assert done.error_code == "EXECUTION_CANCELLED"


async def watched_to_its_end(
    stack: Stack, before_the_end: Callable[[list[str]], Awaitable[None]], after_sequence: int = 0
) -> list[str]:
    """An operator's watch of a running Run from ``after_sequence``; once
    ``before_the_end(seen so far)`` returns, the Run succeeds. The Event types the watch
    saw, after it ended by itself."""
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        fence = await running_attempt(stack, worker)
        async with stack.channel(stack.operator_identity("ops")) as operator_channel:
            runs = run_service_pb2_grpc.RunServiceStub(operator_channel)
            watch = runs.WatchRunEvents(
                run_service_pb2.WatchRunEventsRequest(
                    project_id=PROJECT, run_id=fence.run_id, after_sequence=after_sequence
                ),
                metadata=bearer(stack, "vera"),
                timeout=25,
            )
            seen: list[str] = []

            async def read_all() -> None:
                async for item in watch:
                    seen.append(item.event.type)

            reader = asyncio.ensure_future(read_all())
            await before_the_end(seen)
            await worker.CompleteAttempt(
                ws.CompleteAttemptRequest(
                    fence=fence,
                    callback_sequence=1,
                    outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
                    exit_code=0,
                )
            )
            await asyncio.wait_for(reader, timeout=10)  # ended, not cut at its deadline
    return seen


async def test_operator_watches_a_run_live_until_it_is_terminal(stack: Stack) -> None:
    async def history_read(seen: list[str]) -> None:
        # The watcher has read the history, so what follows reaches it live.
        assert await settled(lambda: len(seen) == 6, 10)

    assert await watched_to_its_end(stack, history_read) == [
        "run.queued",
        "attempt.claimed",
        "run.dispatching",
        "attempt.starting",
        "attempt.running",
        "run.running",
        "attempt.succeeded",
        "run.succeeded",
    ]


async def test_a_watch_after_an_event_not_yet_numbered_still_ends_with_the_run(
    stack: Stack,
) -> None:
    """Events are numbered 1, 2, …: a watch after a number the Run has not reached sees
    none, and so no Event of the Run's end either; it still ends when the Run does, not
    after the stream's lifetime (30 s)."""

    async def first_read(seen: list[str]) -> None:
        # The Run must end after the watch first read it (ending before, it would be
        # seen at once): the call reached control, whose first read follows at once.
        assert await settled(lambda: "WatchRunEvents" in stack.control_calls.methods, 10)
        await asyncio.sleep(0.5)

    assert await watched_to_its_end(stack, first_read, after_sequence=1_000) == []


async def _open_session_with(stack: Stack, *metadata: tuple[str, str]) -> None:
    """worker-a opens a session, sending ``metadata`` with the call."""
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        await worker_service_pb2_grpc.WorkerServiceStub(channel).OpenSession(
            worker_service_pb2.OpenSessionRequest(
                request_id=uuid.uuid4().hex,
                worker_id="worker-a",
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=1,
            ),
            metadata=metadata,
        )


async def test_a_workers_trace_continues_through_ingress_to_control(stack: Stack) -> None:
    """B-OBS: whether ingress records spans (its own span then parents control's) or not
    (it passes the caller's trace context on unchanged), control's call belongs to the
    Worker's trace."""
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    await _open_session_with(stack, ("traceparent", traceparent))
    [received] = stack.control_calls.traceparents
    assert received is not None, "the trace context must reach control"
    assert received.split("-")[1] == trace_id


async def test_a_malformed_trace_context_does_not_reach_control(stack: Stack) -> None:
    """A caller's metadata is untrusted: a traceparent that is not W3C's, and a tracestate
    over W3C's bounds, are not carried to control as the caller wrote them (ingress either
    drops them or, recording spans, sends its own span's context); the call is served."""
    bad_trace_id = secrets.token_hex(16)
    bad_parent = f"00-{bad_trace_id}-{secrets.token_hex(8)}-01-{'x' * 200}"
    hostile_state = "vendor=" + "v" * 200 + "," + ",".join(f"k{n}=1" for n in range(40))
    await _open_session_with(stack, ("traceparent", bad_parent), ("tracestate", hostile_state))
    assert stack.control_calls.methods == ["OpenSession"]
    [received_parent] = stack.control_calls.traceparents
    [received_state] = stack.control_calls.tracestates
    assert received_parent is None or bad_trace_id not in received_parent, received_parent
    assert received_state is None or "vendor=" not in received_state, received_state
