"""Calls tests make through ingress: awaiting one that must fail (to assert on its
status), the operator steps that put a Run in the queue, and a Worker's session."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable
from typing import Any

import grpc
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc


async def failure(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    """The error a unary call ends with; the test fails if the call succeeds."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded")


async def stream_failure(stream: Any) -> grpc.aio.AioRpcError:
    """The error a server stream ends with; the test fails if the stream ends cleanly."""
    try:
        async for _ in stream:
            pass
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the stream ended without an error")


async def queued_run(
    channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], project_id: str
) -> str:
    """A Task with one revision (`echo hi`, 60 s timeout) and one Run of it, created
    through ingress by the operator whose credentials `metadata` carries; the Run's id."""
    tasks = task_service_pb2_grpc.TaskServiceStub(channel)
    task = await tasks.CreateTask(
        task_service_pb2.CreateTaskRequest(
            project_id=project_id, request_id=uuid.uuid4().hex, display_name="sample"
        ),
        metadata=metadata,
    )
    await tasks.CreateTaskRevision(
        task_service_pb2.CreateTaskRevisionRequest(
            project_id=project_id,
            task_id=task.task.task_id,
            request_id="rev-1",
            plan=execution_pb2.ExecutionPlan(
                executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
                command=["echo", "hi"],
                timeout_ms=60_000,
            ),
        ),
        metadata=metadata,
    )
    run = await run_service_pb2_grpc.RunServiceStub(channel).TriggerRun(
        run_service_pb2.TriggerRunRequest(
            project_id=project_id, task_id=task.task.task_id, request_id=uuid.uuid4().hex
        ),
        metadata=metadata,
    )
    return run.run.run_id


async def opened_session(
    worker: worker_service_pb2_grpc.WorkerServiceStub, worker_id: str
) -> worker_service_pb2.OpenSessionResponse:
    """A fresh session of ``worker_id`` (one Attempt at a time, remote executor)."""
    response: worker_service_pb2.OpenSessionResponse = await worker.OpenSession(
        worker_service_pb2.OpenSessionRequest(
            request_id=uuid.uuid4().hex,
            worker_id=worker_id,
            executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
            max_concurrent_attempts=1,
        )
    )
    return response


def renewal(
    worker_id: str, session: worker_service_pb2.OpenSessionResponse
) -> worker_service_pb2.RenewSessionRequest:
    """The RenewSession request of ``session``."""
    return worker_service_pb2.RenewSessionRequest(
        worker_id=worker_id,
        session_id=session.session_id,
        worker_generation=session.worker_generation,
    )
