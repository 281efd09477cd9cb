"""One error model, seen by callers of the real stack (issue 8, part 3 and 4).

Real parts only: control and ingress over mutual TLS on loopback, each with its own
PostgreSQL role. Storage failures are real ones — a statement cancelled by the server
while it waits for a lock (SQLSTATE 57014, as a statement timeout would end it), a grant
the role lacks (42501) — and what the caller sees is a typed status, never driver text:

* ingress answers its storage failures by the shared rule and audits them;
* control's one interceptor answers every RuntimeService method, unary and streaming,
  including a method written without any error handling;
* a new admission rule is one stage in the list: an approval for another method is
  answered APPROVAL_REQUIRED, a stage's own fault an audited INTERNAL.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import psycopg
import pytest
from psycopg_pool import PoolTimeout
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2, runtime_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong_cli.pki import ensure_dev_pki, ensure_operator_identity, service_uri
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.domain.timings import Timings
from qinglong_control.server import create_server as create_control_server
from qinglong_control.servicer import RuntimeServicer
from qinglong_control.settings import ControlSettings
from qinglong_ingress.principals import PrincipalKind
from qinglong_ingress.stages import Call, Verdict
from qinglong_protocol.errors import error_reason_of, field_violations_of
from qinglong_protocol.pooling import PoolSizing
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.calls import failure, queued_run, stream_failure
from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, running_stack
from tests.support.worker_steps import session_request

ws = worker_service_pb2


def assert_no_driver_text(error: grpc.aio.AioRpcError) -> None:
    text = (error.details() or "") + repr(field_violations_of(error))
    for leak in ("qinglong", "permission denied", "canceling statement", "SELECT", "secret"):
        assert leak not in text, text


def bearer(tokens: dict[str, str], name: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {tokens[name]}"),)


async def cancelled_while_blocked(
    database: MigratedDatabase,
    table: str,
    call: Callable[[], Awaitable[Any]],
    *,
    application: str,
) -> grpc.aio.AioRpcError:
    """Make ``call`` while ``table`` is locked, and cancel the statement of ``application``
    (qinglong-ingress or qinglong-control) that waits for the lock: a real SQLSTATE 57014."""
    async with (
        await psycopg.AsyncConnection.connect(database.admin_url) as locker,
        await psycopg.AsyncConnection.connect(database.admin_url, autocommit=True) as admin,
    ):
        await locker.execute(f"LOCK TABLE qinglong.{table} IN ACCESS EXCLUSIVE MODE")
        answer = asyncio.ensure_future(failure(call()))
        while not answer.done():
            cursor = await admin.execute(
                "SELECT pg_cancel_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = %s"
                " AND wait_event_type = 'Lock'",
                (application,),
            )
            if await cursor.fetchall():
                break
            await asyncio.sleep(0.01)
        await locker.rollback()
        return await answer


# --- ingress: its storage failures, by the shared rule ---------------------------------------


async def test_an_outage_during_admission_is_unavailable_and_audited(stack: Stack) -> None:
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        refused = await cancelled_while_blocked(
            stack.database,
            "worker_identities",
            lambda: worker.OpenSession(session_request("worker-a")),
            application="qinglong-ingress",
        )
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason_of(refused) == "STORAGE_UNAVAILABLE"
    assert_no_driver_text(refused)
    assert stack.control_calls.methods == []
    [row] = stack.audit_rows()
    assert (row["outcome"], row["reason"]) == ("unavailable", "STORAGE_UNAVAILABLE")


async def test_a_storage_fault_during_admission_is_internal_and_audited(stack: Stack) -> None:
    """Not every storage error is an outage: a grant the role lacks is a fault of the
    deployment (42501), INTERNAL by the shared rule, and audited like every refusal."""
    with psycopg.connect(stack.database.urls.migration, autocommit=True) as admin:
        admin.execute("REVOKE SELECT ON qinglong.worker_identities FROM qinglong_ingress")
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        refused = await failure(worker.OpenSession(session_request("worker-a")))
    assert refused.code() == grpc.StatusCode.INTERNAL
    assert error_reason_of(refused) == "INTERNAL"
    assert_no_driver_text(refused)
    assert stack.control_calls.methods == []
    [row] = stack.audit_rows()
    assert (row["outcome"], row["reason"]) == ("internal", "INTERNAL")


async def test_no_audit_means_no_forwarding(stack: Stack) -> None:
    # An operator's call: its identity was read before, so only the audit row's INSERT
    # waits on the lock and is cancelled — UNAVAILABLE, with the audit's reason.
    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        cancelled = await cancelled_while_blocked(
            stack.database,
            "security_audit",
            lambda: runs.ListRuns(
                run_service_pb2.ListRunsRequest(project_id=PROJECT),
                metadata=bearer(stack.tokens, "vera"),
            ),
            application="qinglong-ingress",
        )
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        # The role may not write audit rows at all: a fault of the deployment. A Worker's
        # call meets it in its one statement, and again when its refusal is audited alone.
        with psycopg.connect(stack.database.urls.migration, autocommit=True) as admin:
            admin.execute("REVOKE INSERT ON qinglong.security_audit FROM qinglong_ingress")
        revoked = await failure(worker.OpenSession(session_request("worker-a")))
    assert cancelled.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason_of(cancelled) == "AUDIT_UNAVAILABLE"
    assert revoked.code() == grpc.StatusCode.INTERNAL
    assert error_reason_of(revoked) == "INTERNAL"
    for refused in (cancelled, revoked):
        assert_no_driver_text(refused)
    assert stack.control_calls.methods == []
    assert stack.audit_rows() == []


# --- control: one interceptor for every method ------------------------------------------------


async def test_a_storage_fault_in_control_reaches_the_caller_typed_unary_and_streaming(
    stack: Stack,
) -> None:
    operator = stack.operator_identity("ops")
    async with stack.channel(operator) as channel:
        run_id = await queued_run(channel, bearer(stack.tokens, "alice"), PROJECT)
        with psycopg.connect(stack.database.urls.migration, autocommit=True) as admin:
            admin.execute("REVOKE SELECT ON qinglong.run_events FROM qinglong_runtime")
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        meta = bearer(stack.tokens, "vera")
        listed = await failure(
            runs.ListRunEvents(
                run_service_pb2.ListRunEventsRequest(project_id=PROJECT, run_id=run_id),
                metadata=meta,
            )
        )
        watched = await stream_failure(
            runs.WatchRunEvents(
                run_service_pb2.WatchRunEventsRequest(project_id=PROJECT, run_id=run_id),
                metadata=meta,
                timeout=10,
            )
        )
    assert "ListRunEvents" in stack.control_calls.methods
    assert "WatchRunEvents" in stack.control_calls.methods
    for refused in (listed, watched):
        assert refused.code() == grpc.StatusCode.INTERNAL
        assert error_reason_of(refused) == "INTERNAL"
        assert_no_driver_text(refused)


async def test_an_outage_in_control_reaches_the_caller_as_unavailable(stack: Stack) -> None:
    async with stack.channel(stack.operator_identity("ops")) as channel:
        run_id = await queued_run(channel, bearer(stack.tokens, "alice"), PROJECT)
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        refused = await cancelled_while_blocked(
            stack.database,
            "runs",
            lambda: runs.GetRun(
                run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=run_id),
                metadata=bearer(stack.tokens, "vera"),
            ),
            application="qinglong-control",
        )
        watch_refused = await stream_failure(
            runs.WatchRunEvents(
                run_service_pb2.WatchRunEventsRequest(project_id=PROJECT, run_id=str(uuid.uuid4())),
                metadata=bearer(stack.tokens, "vera"),
                timeout=10,
            )
        )
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason_of(refused) == "STORAGE_UNAVAILABLE"
    assert_no_driver_text(refused)
    # A refusal inside the stream is typed the same way as a unary one.
    assert watch_refused.code() == grpc.StatusCode.NOT_FOUND
    assert error_reason_of(watch_refused) == "RUN_NOT_FOUND"


class Careless(RuntimeServicer):
    """Methods written as a new one might be, without a thought for errors."""

    async def GetTask(self, request: Any, context: Any) -> Any:
        raise psycopg.errors.ProgramLimitExceeded("statement too complex: SELECT secret")

    async def WatchRunEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if request.request.after_sequence:
            raise PoolTimeout("couldn't get a connection after 1.60 sec")
        yield runtime_service_pb2.WatchRunEventsResponse()
        raise KeyError("secret")


# Valid public requests: control enforces the contract's rules before a servicer runs.
_GET_TASK = task_service_pb2.GetTaskRequest(project_id="proj-a", task_id=str(uuid.uuid4()))
_WATCH = run_service_pb2.WatchRunEventsRequest(project_id="proj-a", run_id=str(uuid.uuid4()))


async def test_a_method_without_error_handling_still_answers_typed(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    pki = ensure_dev_pki(tmp_path_factory.mktemp("pki"))
    pool = await open_runtime_pool(database_pg18.urls.runtime, sizing=PoolSizing(1, 2))
    server, port = await create_control_server(
        ControlSettings(
            listen_address="127.0.0.1:0",
            tls=pki.control_server,
            allowed_caller_uris=frozenset({service_uri(pki.trust_domain, "ingress")}),
        ),
        runtime_servicer=Careless(pool, Timings()),
    )
    await server.start()
    caller = caller_pb2.Caller(principal_kind=caller_pb2.PRINCIPAL_KIND_USER, principal_id="a")
    try:
        async with grpc.aio.secure_channel(
            f"127.0.0.1:{port}", mutual_tls_channel_credentials(pki.ingress_client)
        ) as channel:
            stub = runtime_service_pb2_grpc.RuntimeServiceStub(channel)
            unary = await failure(
                stub.GetTask(
                    runtime_service_pb2.GetTaskRequest(caller=caller, request=_GET_TASK),
                    timeout=10,
                )
            )
            midway = await stream_failure(
                stub.WatchRunEvents(
                    runtime_service_pb2.WatchRunEventsRequest(caller=caller, request=_WATCH),
                    timeout=10,
                )
            )
            unavailable = await stream_failure(
                stub.WatchRunEvents(
                    runtime_service_pb2.WatchRunEventsRequest(
                        caller=caller,
                        request=run_service_pb2.WatchRunEventsRequest(
                            project_id=_WATCH.project_id, run_id=_WATCH.run_id, after_sequence=1
                        ),
                    ),
                    timeout=10,
                )
            )
    finally:
        await server.stop(None)
        await pool.close()
    for refused in (unary, midway):
        assert refused.code() == grpc.StatusCode.INTERNAL
        assert error_reason_of(refused) == "INTERNAL"
        assert_no_driver_text(refused)
    assert unavailable.code() == grpc.StatusCode.UNAVAILABLE
    assert error_reason_of(unavailable) == "STORAGE_UNAVAILABLE"


# --- admission: a new rule is one stage ------------------------------------------------------


class AgentsNeedApprovalToTrigger:
    """An approval for another method, as a new policy would add it."""

    async def check(self, call: Call) -> Verdict:
        if call.route.name == "TriggerRun" and call.caller.kind is PrincipalKind.AGENT:
            return Verdict.REQUIRE_APPROVAL
        return Verdict.PASS


class BrokenForGetTask:
    """A stage with a bug: its fault is answered INTERNAL and audited, never forwarded."""

    async def check(self, call: Call) -> Verdict:
        if call.route.name == "GetTask":
            raise RuntimeError("secret detail of a broken stage")
        return Verdict.PASS


def audit_outcomes(stack: Stack) -> list[tuple[Any, ...]]:
    return [
        (row["operation"], row["principal_kind"], row["outcome"], row["reason"])
        for row in stack.audit_rows()
    ]


async def test_a_new_rule_is_one_more_stage(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> None:
    extra = (AgentsNeedApprovalToTrigger(), BrokenForGetTask())
    pki_dir = tmp_path_factory.mktemp("pki")
    async with running_stack(database_pg18, pki_dir, extra_stages=extra) as composed:
        tls = ensure_operator_identity(composed.pki, "ops")
        async with grpc.aio.secure_channel(
            composed.ingress_address, mutual_tls_channel_credentials(tls)
        ) as channel:
            run_id = await queued_run(
                channel, bearer(composed.tokens, "alice"), PROJECT
            )  # a user: admitted
            task_id = (
                await run_service_pb2_grpc.RunServiceStub(channel).GetRun(
                    run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=run_id),
                    metadata=bearer(composed.tokens, "alice"),
                )
            ).run.task_id
            forwarded = list(composed.control_calls.methods)
            held = await failure(
                run_service_pb2_grpc.RunServiceStub(channel).TriggerRun(
                    run_service_pb2.TriggerRunRequest(
                        project_id=PROJECT, task_id=task_id, request_id="by-bot"
                    ),
                    metadata=bearer(composed.tokens, "bot"),
                )
            )
            broken = await failure(
                task_service_pb2_grpc.TaskServiceStub(channel).GetTask(
                    task_service_pb2.GetTaskRequest(project_id=PROJECT, task_id=task_id),
                    metadata=bearer(composed.tokens, "alice"),
                )
            )
            # CancelRun's own approval answer is unchanged by the extra stages.
            cancel = await run_service_pb2_grpc.RunServiceStub(channel).CancelRun(
                run_service_pb2.CancelRunRequest(
                    project_id=PROJECT, run_id=run_id, mutation_id="m-bot"
                ),
                metadata=bearer(composed.tokens, "bot"),
            )
        # Held calls go to control to be kept; nothing refused went on. Control holds
        # only what it can execute later: TriggerRun is not (yet) one of those.
        assert composed.control_calls.methods == [*forwarded, "HoldForApproval", "HoldForApproval"]
        rows = audit_outcomes(composed)
    assert held.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_reason_of(held) == "APPROVAL_UNSUPPORTED"
    assert broken.code() == grpc.StatusCode.INTERNAL
    assert error_reason_of(broken) == "INTERNAL"
    assert_no_driver_text(broken)
    assert cancel.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL
    assert not cancel.HasField("run")
    assert rows[-3:] == [
        ("RunService/TriggerRun", "agent", "require_approval", None),
        ("TaskService/GetTask", "user", "internal", "INTERNAL"),
        ("RunService/CancelRun", "agent", "require_approval", None),
    ]
