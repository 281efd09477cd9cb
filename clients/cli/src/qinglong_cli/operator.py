"""`qinglong task …` and `qinglong run …`: the operator's commands, through ingress.

Connection and identity come from a stack file (`qinglong up` writes one): the ingress
address, the CA, the operator's client certificate, and the file holding the operator's
bearer token. Every answer is printed as one JSON object per line (protobuf JSON), so
scripts can read it; errors print their gRPC code and ErrorInfo reason and exit 1.
"""

from __future__ import annotations

import argparse
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2
from qinglong_protocol.errors import error_reason_of
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

#: `--retry-on` names: the endings a retry policy may opt into.
_RETRYABLE = {
    "failed": execution_pb2.RETRYABLE_OUTCOME_FAILED,
    "start-failed": execution_pb2.RETRYABLE_OUTCOME_START_FAILED,
}
_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class OperatorContext:
    address: str
    tls: TlsFiles
    token_file: Path
    project_id: str

    @classmethod
    def from_stack(cls, path: Path, project_id: str | None) -> OperatorContext:
        stack = json.loads(path.read_text())
        operator = stack["operator"]
        return cls(
            address=stack["ingress"]["address"],
            tls=TlsFiles(Path(stack["ca_cert"]), Path(operator["cert"]), Path(operator["key"])),
            token_file=Path(operator["token_file"]),
            project_id=project_id or stack["project_id"],
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Read at call time and never printed.
        return (("authorization", "Bearer " + self.token_file.read_text().strip()),)


def add_operator_commands(commands: Any, default_stack: Path) -> None:
    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--stack", type=Path, default=default_stack)
        parser.add_argument("--project", help="project id (default: the stack's project)")

    task = commands.add_parser("task", help="create and read tasks").add_subparsers(
        dest="action", required=True
    )
    create = task.add_parser("create", help="create a task and its first revision")
    common(create)
    create.add_argument("--name", required=True, help="display name")
    create.add_argument("--timeout-ms", type=int, help="durable execution timeout")
    create.add_argument(
        "--max-attempts",
        type=int,
        help="attempts in total, the first included (1..100; default 1: no retry)",
    )
    create.add_argument(
        "--retry-backoff-ms",
        type=int,
        default=1_000,
        help="delay before the second attempt (default 1000)",
    )
    create.add_argument(
        "--retry-max-backoff-ms",
        type=int,
        default=60_000,
        help="upper bound of the delay (default 60000)",
    )
    create.add_argument(
        "--retry-multiplier-percent",
        type=int,
        default=200,
        help="growth of the delay per attempt in percent (default 200: doubles)",
    )
    create.add_argument(
        "--retry-on",
        action="append",
        choices=sorted(_RETRYABLE),
        default=[],
        help="also retry these endings (lost attempts always retry); repeatable",
    )
    create.add_argument("argv", nargs="+", help="the command, after --")

    run = commands.add_parser("run", help="trigger, read, watch and cancel runs").add_subparsers(
        dest="action", required=True
    )
    trigger = run.add_parser("trigger", help="queue a run of a task's latest revision")
    common(trigger)
    trigger.add_argument("--task", required=True, help="task id")
    for name, help_text in (
        ("get", "show a run"),
        ("events", "list a run's events"),
        ("watch", "stream a run's events until it is terminal"),
        ("cancel", "ask a run to stop"),
    ):
        action = run.add_parser(name, help=help_text)
        common(action)
        action.add_argument("run_id")
    listing = run.add_parser("list", help="list the newest runs")
    common(listing)
    listing.add_argument("--limit", type=int, default=20)


async def run_operator_command(args: argparse.Namespace, out: TextIO) -> int:
    context = OperatorContext.from_stack(args.stack, args.project)
    credentials = mutual_tls_channel_credentials(context.tls)
    async with grpc.aio.secure_channel(context.address, credentials) as channel:
        try:
            await _dispatch(args, context, channel, out)
        except grpc.aio.AioRpcError as error:
            reason = error_reason_of(error) or "-"
            print(json.dumps({"error": error.code().name, "reason": reason}), file=out)
            return 1
    return 0


async def _dispatch(
    args: argparse.Namespace, context: OperatorContext, channel: grpc.aio.Channel, out: TextIO
) -> None:
    tasks = task_service_pb2_grpc.TaskServiceStub(channel)
    runs = run_service_pb2_grpc.RunServiceStub(channel)
    meta = context.metadata()
    project = context.project_id
    if args.command == "task":
        created = await tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=project, request_id=uuid.uuid4().hex, display_name=args.name
            ),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        plan = execution_pb2.ExecutionPlan(
            executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER, command=args.argv
        )
        if args.timeout_ms is not None:
            plan.timeout_ms = args.timeout_ms
        if args.max_attempts is not None:
            plan.retry_policy.CopyFrom(
                execution_pb2.RetryPolicy(
                    max_attempts=args.max_attempts,
                    initial_backoff_ms=args.retry_backoff_ms,
                    max_backoff_ms=max(args.retry_max_backoff_ms, args.retry_backoff_ms),
                    backoff_multiplier_percent=args.retry_multiplier_percent,
                    retry_on=sorted({_RETRYABLE[name] for name in args.retry_on}),
                )
            )
        revision = await tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=project,
                task_id=created.task.task_id,
                request_id=uuid.uuid4().hex,
                plan=plan,
            ),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        _print(out, revision.revision)
    elif args.action == "trigger":
        triggered = await runs.TriggerRun(
            run_service_pb2.TriggerRunRequest(
                project_id=project, task_id=args.task, request_id=uuid.uuid4().hex
            ),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        _print(out, triggered.run)
    elif args.action == "get":
        got = await runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=project, run_id=args.run_id),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        _print(out, got.run)
    elif args.action == "list":
        listed = await runs.ListRuns(
            run_service_pb2.ListRunsRequest(project_id=project, page_size=args.limit),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        for listed_run in listed.runs:
            _print(out, listed_run)
    elif args.action == "events":
        page = await runs.ListRunEvents(
            run_service_pb2.ListRunEventsRequest(project_id=project, run_id=args.run_id),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        for event in page.events:
            _print(out, event)
    elif args.action == "watch":
        stream = runs.WatchRunEvents(
            run_service_pb2.WatchRunEventsRequest(project_id=project, run_id=args.run_id),
            metadata=meta,
        )
        async for watched in stream:
            _print(out, watched.event)
    elif args.action == "cancel":
        cancelled = await runs.CancelRun(
            run_service_pb2.CancelRunRequest(
                project_id=project, run_id=args.run_id, mutation_id=uuid.uuid4().hex
            ),
            metadata=meta,
            timeout=_TIMEOUT_SECONDS,
        )
        _print(out, cancelled)


def _print(out: TextIO, message: Message) -> None:
    print(json.dumps(MessageToDict(message), sort_keys=True), file=out, flush=True)
