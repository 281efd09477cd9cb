"""The control service's RuntimeService end to end: real mTLS gRPC, real PostgreSQL.

Ingress is played by a client holding ingress's certificate, which is what control
trusts. Answers and typed errors (gRPC code + ErrorInfo reason) are checked, and the
rows behind them.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import psycopg
import pytest
from qinglong.control.v1 import run_service_pb2, task_service_pb2
from qinglong.rpc.v1 import execution_pb2, fence_pb2, lifecycle_pb2
from qinglong.runtime.v1 import caller_pb2, runtime_service_pb2, runtime_service_pb2_grpc
from qinglong.worker.v1 import worker_pb2, worker_service_pb2
from qinglong_cli.pki import ensure_dev_pki, ensure_worker_identity, service_uri
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.domain.timings import Timings
from qinglong_control.server import create_server
from qinglong_control.servicer import RuntimeServicer
from qinglong_control.settings import ControlSettings
from qinglong_protocol.bounds import encode_lease_capability
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.pooling import PoolSizing
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support import timelines
from tests.support.postgres import MigratedDatabase
from tests.support.world import enroll

rt = runtime_service_pb2
WORKER = "worker-a"
PROJECT = "proj-a"
WORKER_CALLER = caller_pb2.Caller(
    principal_kind=caller_pb2.PRINCIPAL_KIND_WORKER, principal_id=WORKER, worker_id=WORKER
)
OPERATOR_CALLER = caller_pb2.Caller(
    principal_kind=caller_pb2.PRINCIPAL_KIND_USER, principal_id="alice"
)


@dataclass(frozen=True)
class Control:
    stub: runtime_service_pb2_grpc.RuntimeServiceStub
    stranger: runtime_service_pb2_grpc.RuntimeServiceStub
    database: MigratedDatabase


@pytest.fixture
async def control(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Control]:
    enroll(database_pg18, WORKER)
    pki = ensure_dev_pki(tmp_path_factory.mktemp("pki"))
    pool = await open_runtime_pool(database_pg18.urls.runtime, sizing=PoolSizing(1, 4))
    server, port = await create_server(
        ControlSettings(
            listen_address="127.0.0.1:0",
            tls=pki.control_server,
            allowed_caller_uris=frozenset({service_uri(pki.trust_domain, "ingress")}),
        ),
        runtime_servicer=RuntimeServicer(pool, Timings()),
    )
    await server.start()
    address = f"127.0.0.1:{port}"
    as_ingress = grpc.aio.secure_channel(
        address, mutual_tls_channel_credentials(pki.ingress_client)
    )
    as_worker = grpc.aio.secure_channel(
        address, mutual_tls_channel_credentials(ensure_worker_identity(pki, WORKER))
    )
    try:
        yield Control(
            runtime_service_pb2_grpc.RuntimeServiceStub(as_ingress),
            runtime_service_pb2_grpc.RuntimeServiceStub(as_worker),
            database_pg18,
        )
    finally:
        await as_ingress.close()
        await as_worker.close()
        await server.stop(None)
        await pool.close()


async def _queued_run(stub: runtime_service_pb2_grpc.RuntimeServiceStub) -> str:
    task = await stub.CreateTask(
        rt.CreateTaskRequest(
            caller=OPERATOR_CALLER,
            request=task_service_pb2.CreateTaskRequest(
                project_id=PROJECT, request_id="t-1", display_name="sample"
            ),
        )
    )
    task_id = task.response.task.task_id
    await stub.CreateTaskRevision(
        rt.CreateTaskRevisionRequest(
            caller=OPERATOR_CALLER,
            request=task_service_pb2.CreateTaskRevisionRequest(
                project_id=PROJECT,
                task_id=task_id,
                request_id="r-1",
                plan=execution_pb2.ExecutionPlan(
                    executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
                    command=["echo", "hi"],
                    timeout_ms=120_000,
                ),
            ),
        )
    )
    triggered = await stub.TriggerRun(
        rt.TriggerRunRequest(
            caller=OPERATOR_CALLER,
            request=run_service_pb2.TriggerRunRequest(
                project_id=PROJECT, task_id=task_id, request_id="run-1"
            ),
        )
    )
    return triggered.response.run.run_id


async def test_worker_start_sequence_over_mtls(control: Control) -> None:
    stub = control.stub
    run_id = await _queued_run(stub)
    opened = await stub.OpenSession(
        rt.OpenSessionRequest(
            caller=WORKER_CALLER,
            request=worker_service_pb2.OpenSessionRequest(
                request_id="open-1",
                worker_id=WORKER,
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=2,
            ),
        )
    )
    session = opened.response
    assert session.session_state == worker_pb2.SESSION_STATE_ONLINE
    assert session.session_remaining.ToMilliseconds() > 0
    pulled = await stub.PullOffers(
        rt.PullOffersRequest(
            caller=WORKER_CALLER,
            request=worker_service_pb2.PullOffersRequest(
                worker_id=WORKER,
                session_id=session.session_id,
                worker_generation=session.worker_generation,
                max_offers=4,
            ),
        )
    )
    [offer] = pulled.response.offers
    assert offer.run_id == run_id
    assert offer.spec.plan.timeout_ms == 120_000
    capability = encode_lease_capability(secrets.token_bytes(32))
    claim = worker_service_pb2.ClaimOfferRequest(
        worker_id=WORKER,
        session_id=session.session_id,
        worker_generation=session.worker_generation,
        offer_id=offer.offer_id,
        project_id=PROJECT,
        run_id=run_id,
        lease_token=capability,
    )
    claimed = (
        await stub.ClaimOffer(rt.ClaimOfferRequest(caller=WORKER_CALLER, request=claim))
    ).response
    again = (
        await stub.ClaimOffer(rt.ClaimOfferRequest(caller=WORKER_CALLER, request=claim))
    ).response
    assert again.attempt_id == claimed.attempt_id
    assert claimed.lease_version == 1
    assert capability not in str(claimed)

    fence = fence_pb2.Fence(
        worker_id=WORKER,
        session_id=session.session_id,
        worker_generation=session.worker_generation,
        project_id=PROJECT,
        run_id=run_id,
        attempt_id=claimed.attempt_id,
        offer_id=offer.offer_id,
        lease_generation=claimed.lease_generation,
        lease_token=capability,
        expected_lease_version=claimed.lease_version,
    )
    running_request = rt.AcknowledgeRunningRequest(
        caller=WORKER_CALLER,
        request=worker_service_pb2.AcknowledgeRunningRequest(
            fence=fence,
            executor_handle="pid:77;start:123",
            callback_sequence=1,
            callback_token_digest="ab" * 32,
        ),
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.AcknowledgeRunning(running_request)
    assert refused.value.code() == grpc.StatusCode.ABORTED
    assert error_reason_of(refused.value) == "STARTING_REQUIRED"

    starting = (
        await stub.AcknowledgeStarting(
            rt.AcknowledgeStartingRequest(
                caller=WORKER_CALLER,
                request=worker_service_pb2.AcknowledgeStartingRequest(fence=fence),
            )
        )
    ).response
    assert starting.outcome == worker_pb2.STARTING_OUTCOME_STARTING
    assert starting.activation.timeout_ms == 120_000
    assert 0 < starting.activation.deadline_remaining.ToMilliseconds() <= 120_000
    running = (await stub.AcknowledgeRunning(running_request)).response
    assert running.outcome == worker_pb2.RUNNING_OUTCOME_RUNNING

    got = await stub.GetRun(
        rt.GetRunRequest(
            caller=OPERATOR_CALLER,
            request=run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=run_id),
        )
    )
    assert got.response.run.state == lifecycle_pb2.RUN_STATE_RUNNING
    assert (
        got.response.run.deadline.ToMilliseconds() == starting.activation.deadline.ToMilliseconds()
    )
    events = await stub.ListRunEvents(
        rt.ListRunEventsRequest(
            caller=OPERATOR_CALLER,
            request=run_service_pb2.ListRunEventsRequest(project_id=PROJECT, run_id=run_id),
        )
    )
    assert [e.type for e in events.response.events] == list(timelines.UNTIL_RUNNING)
    assert [e.sequence for e in events.response.events] == [1, 2, 3, 4, 5, 6]
    assert events.response.events[3].attempt_starting.timeout_ms == 120_000
    assert events.response.events[5].run_state_changed.to_state == lifecycle_pb2.RUN_STATE_RUNNING


async def test_bad_input_is_typed_and_changes_nothing(control: Control) -> None:
    with psycopg.connect(control.database.urls.migration) as conn:
        before = conn.execute("SELECT count(*) FROM qinglong.worker_sessions").fetchone()
    bad = worker_service_pb2.ClaimOfferRequest(
        worker_id=WORKER,
        session_id=str(uuid.uuid4()),
        worker_generation=1,
        offer_id=str(uuid.uuid4()),
        project_id=PROJECT,
        run_id=str(uuid.uuid4()),
        lease_token="qlc1_" + "A" * 43,  # well-shaped but weak: all zero bytes
    )
    with pytest.raises(grpc.aio.AioRpcError) as weak:
        await control.stub.ClaimOffer(rt.ClaimOfferRequest(caller=WORKER_CALLER, request=bad))
    assert weak.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason_of(weak.value) == "CAPABILITY_WEAK"
    assert "qlc1_" not in (weak.value.details() or "")

    bad.lease_token = encode_lease_capability(secrets.token_bytes(32))
    bad.session_id = "not-a-uuid"
    with pytest.raises(grpc.aio.AioRpcError) as malformed:
        await control.stub.ClaimOffer(rt.ClaimOfferRequest(caller=WORKER_CALLER, request=bad))
    assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_reason_of(malformed.value) == "FIELD_INVALID"

    missing = await _expect_error(
        control.stub.GetRun(
            rt.GetRunRequest(
                caller=OPERATOR_CALLER,
                request=run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=str(uuid.uuid4())),
            )
        )
    )
    assert (missing.code(), error_reason_of(missing)) == (
        grpc.StatusCode.NOT_FOUND,
        "RUN_NOT_FOUND",
    )

    # A worker caller may not speak for another worker (defence in depth behind ingress).
    impostor = await _expect_error(
        control.stub.OpenSession(
            rt.OpenSessionRequest(
                caller=WORKER_CALLER,
                request=worker_service_pb2.OpenSessionRequest(
                    request_id="x",
                    worker_id="worker-b",
                    executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                    max_concurrent_attempts=1,
                ),
            )
        )
    )
    assert impostor.code() == grpc.StatusCode.ABORTED
    with psycopg.connect(control.database.urls.migration) as conn:
        after = conn.execute("SELECT count(*) FROM qinglong.worker_sessions").fetchone()
    assert before == after


async def test_only_ingress_may_call_the_runtime_api(control: Control) -> None:
    denied = await _expect_error(
        control.stranger.GetRun(
            rt.GetRunRequest(
                caller=OPERATOR_CALLER,
                request=run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=str(uuid.uuid4())),
            )
        )
    )
    assert denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_reason_of(denied) == "CALLER_NOT_INGRESS"


async def _expect_error(call: Any) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded")
