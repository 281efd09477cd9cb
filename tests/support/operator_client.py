"""The operator's side of a fault test: create a Task, trigger Runs, read and cancel them,
through ingress with the dev stack's operator certificate and bearer token."""

from __future__ import annotations

import uuid
from typing import Final

import grpc
from qinglong.control.v1 import (
    run_pb2,
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2
from qinglong_protocol.tls import mutual_tls_channel_credentials

from tests.support.devstack_process import DevStack

CALL_TIMEOUT_SECONDS: Final = 10.0


class OperatorClient:
    def __init__(self, stack: DevStack) -> None:
        self.project_id = stack.project_id
        self.metadata = (("authorization", f"Bearer {stack.operator_token}"),)
        self.channel = grpc.secure_channel(
            stack.ingress_address, mutual_tls_channel_credentials(stack.operator_tls)
        )
        self.tasks = task_service_pb2_grpc.TaskServiceStub(self.channel)
        self.runs = run_service_pb2_grpc.RunServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def trigger(
        self,
        command: list[str],
        *,
        name: str = "fault",
        retry: execution_pb2.RetryPolicy | None = None,
    ) -> str:
        """A new Task with one revision running `command` (no timeout; without `retry`,
        no retry policy: exactly one Attempt may start), and one Run of it. Returns the
        run id."""
        task = self.tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=self.project_id, request_id=uuid.uuid4().hex, display_name=name
            ),
            metadata=self.metadata,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        self.tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=self.project_id,
                task_id=task.task.task_id,
                request_id=uuid.uuid4().hex,
                plan=execution_pb2.ExecutionPlan(
                    executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
                    command=command,
                    retry_policy=retry,
                ),
            ),
            metadata=self.metadata,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        run = self.runs.TriggerRun(
            run_service_pb2.TriggerRunRequest(
                project_id=self.project_id, task_id=task.task.task_id, request_id=uuid.uuid4().hex
            ),
            metadata=self.metadata,
            timeout=CALL_TIMEOUT_SECONDS,
        )
        return str(run.run.run_id)

    def get_run(self, run_id: str, timeout: float = CALL_TIMEOUT_SECONDS) -> run_pb2.Run:
        return self.runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=self.project_id, run_id=run_id),
            metadata=self.metadata,
            timeout=timeout,
        ).run

    def cancel(self, run_id: str) -> None:
        self.runs.CancelRun(
            run_service_pb2.CancelRunRequest(
                project_id=self.project_id, run_id=run_id, mutation_id=uuid.uuid4().hex[:16]
            ),
            metadata=self.metadata,
            timeout=CALL_TIMEOUT_SECONDS,
        )
