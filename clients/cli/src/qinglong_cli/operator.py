"""`qinglong task …` and `qinglong run …`: the operator's commands, through ingress.

Connection and identity come from a stack file (`qinglong up` writes one): the ingress
address, the CA, the operator's client certificate, and the file holding the operator's
bearer token. Answers go to stdout as a table on a terminal and as JSON lines otherwise
(`--output table|json|jsonl`, see output.py); errors go to stderr with their gRPC code,
ErrorInfo reason, message and field violations, and documented exit codes (cli_errors.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2, lifecycle_pb2
from qinglong_protocol.tls import TlsFiles, mutual_tls_channel_credentials

from qinglong_cli.cli_errors import (
    EXIT_OK,
    ConfigurationError,
    report_configuration_error,
    report_rpc_error,
)
from qinglong_cli.output import OutputFormat, Printer

#: `--retry-on` names: the endings a retry policy may opt into.
_RETRYABLE = {
    "failed": execution_pb2.RETRYABLE_OUTCOME_FAILED,
    "start-failed": execution_pb2.RETRYABLE_OUTCOME_START_FAILED,
}
#: `run list --state` names: the Run states (lower case, as `run get` shows them).
_RUN_STATES = {
    name.removeprefix("RUN_STATE_").lower(): value
    for name, value in lifecycle_pb2.RunState.items()
    if value != lifecycle_pb2.RUN_STATE_UNSPECIFIED
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
        """Read the stack file; any problem is a ConfigurationError naming the file."""
        try:
            stack = json.loads(path.read_text())
            operator = stack["operator"]
            context = cls(
                address=stack["ingress"]["address"],
                tls=TlsFiles(Path(stack["ca_cert"]), Path(operator["cert"]), Path(operator["key"])),
                token_file=Path(operator["token_file"]),
                project_id=project_id or stack["project_id"],
            )
        except FileNotFoundError:
            raise ConfigurationError(
                f"no stack file at {path}; start the stack with `qinglong up` or pass --stack"
            ) from None
        except (OSError, ValueError) as error:
            raise ConfigurationError(f"cannot read stack file {path}: {error}") from None
        except (KeyError, TypeError) as error:
            raise ConfigurationError(
                f"stack file {path} is not one `qinglong up` wrote (missing {error})"
            ) from None
        return context

    def metadata(self) -> tuple[tuple[str, str], ...]:
        # Read at call time and never printed.
        try:
            token = self.token_file.read_text().strip()
        except OSError as error:
            raise ConfigurationError(
                f"cannot read the operator token file {self.token_file}: {error.strerror}"
            ) from None
        return (("authorization", "Bearer " + token),)


def add_operator_commands(commands: Any, default_stack: Path) -> None:
    def common(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--stack", type=Path, default=default_stack)
        parser.add_argument("--project", help="project id (default: the stack's project)")
        parser.add_argument(
            "--output",
            type=OutputFormat,
            choices=list(OutputFormat),
            help="table (default on a terminal), json, or jsonl (default otherwise)",
        )

    def plan_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--timeout-ms", type=int, help="durable execution timeout")
        parser.add_argument(
            "--max-attempts",
            type=int,
            help="attempts in total, the first included (1..100; default 1: no retry)",
        )
        parser.add_argument(
            "--retry-backoff-ms",
            type=int,
            default=1_000,
            help="delay before the second attempt (default 1000)",
        )
        parser.add_argument(
            "--retry-max-backoff-ms",
            type=int,
            default=60_000,
            help="upper bound of the delay (default 60000)",
        )
        parser.add_argument(
            "--retry-multiplier-percent",
            type=int,
            default=200,
            help="growth of the delay per attempt in percent (default 200: doubles)",
        )
        parser.add_argument(
            "--retry-on",
            action="append",
            choices=sorted(_RETRYABLE),
            default=[],
            help="also retry these endings (lost attempts always retry); repeatable",
        )
        parser.add_argument("argv", nargs="+", help="the command, after --")

    task = commands.add_parser("task", help="create and read tasks").add_subparsers(
        dest="action", required=True
    )
    create = task.add_parser("create", help="create a task and its first revision")
    common(create)
    create.add_argument("--name", required=True, help="display name")
    plan_flags(create)
    revise = task.add_parser("revise", help="add a revision to a task (new runs pin it)")
    common(revise)
    revise.add_argument("task_id")
    plan_flags(revise)
    get_task = task.add_parser("get", help="show a task")
    common(get_task)
    get_task.add_argument("task_id")

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
    listing = run.add_parser("list", help="list runs, newest first")
    common(listing)
    listing.add_argument("--limit", type=int, default=20, help="runs per page (1..500)")
    listing.add_argument("--task", help="only runs of this task id")
    listing.add_argument(
        "--state", action="append", choices=sorted(_RUN_STATES), default=[], help="repeatable"
    )
    listing.add_argument("--page-token", default="", help="from a previous page's footer")


async def run_operator_command(
    args: argparse.Namespace, out: TextIO, err: TextIO | None = None
) -> int:
    """Run one operator command; the process exit code (see cli_errors)."""
    err = sys.stderr if err is None else err
    output = args.output or (OutputFormat.TABLE if out.isatty() else OutputFormat.JSONL)
    printer = Printer(out, output)
    try:
        context = OperatorContext.from_stack(args.stack, args.project)
        credentials = mutual_tls_channel_credentials(context.tls)
        async with grpc.aio.secure_channel(context.address, credentials) as channel:
            await _dispatch(args, context, channel, printer, err)
    except ConfigurationError as error:
        return report_configuration_error(error, err)
    except _Refused as refused:
        printer.close()
        code = report_rpc_error(refused.error, err)
        print(refused.note, file=err)
        return code
    except grpc.aio.AioRpcError as error:
        printer.close()
        return report_rpc_error(error, err)
    printer.close()
    return EXIT_OK


class _Refused(Exception):
    """A refused call that left something behind the user should know about."""

    def __init__(self, error: grpc.aio.AioRpcError, note: str) -> None:
        super().__init__(note)
        self.error = error
        self.note = note


def _plan(args: argparse.Namespace) -> execution_pb2.ExecutionPlan:
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
    return plan


async def _dispatch(
    args: argparse.Namespace,
    context: OperatorContext,
    channel: grpc.aio.Channel,
    printer: Printer,
    err: TextIO,
) -> None:
    tasks = task_service_pb2_grpc.TaskServiceStub(channel)
    runs = run_service_pb2_grpc.RunServiceStub(channel)
    meta = context.metadata()
    project = context.project_id
    call: dict[str, Any] = {"metadata": meta, "timeout": _TIMEOUT_SECONDS}
    if args.command == "task" and args.action == "create":
        created = await tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=project, request_id=uuid.uuid4().hex, display_name=args.name
            ),
            **call,
        )
        try:
            revision = await tasks.CreateTaskRevision(
                task_service_pb2.CreateTaskRevisionRequest(
                    project_id=project,
                    task_id=created.task.task_id,
                    request_id=uuid.uuid4().hex,
                    plan=_plan(args),
                ),
                **call,
            )
        except grpc.aio.AioRpcError as error:
            # The task exists without a revision: say which, so it can be revised.
            raise _Refused(
                error,
                f"task {created.task.task_id} was created, but its first revision was "
                f"refused; fix the plan and run `qinglong task revise {created.task.task_id}`",
            ) from None
        printer.item(revision.revision)
    elif args.command == "task" and args.action == "revise":
        revision = await tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=project,
                task_id=args.task_id,
                request_id=uuid.uuid4().hex,
                plan=_plan(args),
            ),
            **call,
        )
        printer.item(revision.revision)
    elif args.command == "task" and args.action == "get":
        got_task = await tasks.GetTask(
            task_service_pb2.GetTaskRequest(project_id=project, task_id=args.task_id), **call
        )
        printer.item(got_task.task)
    elif args.action == "trigger":
        triggered = await runs.TriggerRun(
            run_service_pb2.TriggerRunRequest(
                project_id=project, task_id=args.task, request_id=uuid.uuid4().hex
            ),
            **call,
        )
        printer.item(triggered.run)
    elif args.action == "get":
        got = await runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=project, run_id=args.run_id), **call
        )
        printer.item(got.run)
    elif args.action == "list":
        listed = await runs.ListRuns(
            run_service_pb2.ListRunsRequest(
                project_id=project,
                page_size=args.limit,
                page_token=args.page_token,
                task_id=args.task or "",
                states=[_RUN_STATES[name] for name in args.state],
            ),
            **call,
        )
        for listed_run in listed.runs:
            printer.item(listed_run)
        if listed.next_page_token:
            print(f"next page: --page-token {listed.next_page_token}", file=err)
    elif args.action == "events":
        page = await runs.ListRunEvents(
            run_service_pb2.ListRunEventsRequest(project_id=project, run_id=args.run_id), **call
        )
        for event in page.events:
            printer.item(event)
    elif args.action == "watch":
        stream = runs.WatchRunEvents(
            run_service_pb2.WatchRunEventsRequest(project_id=project, run_id=args.run_id),
            metadata=meta,
        )
        async for watched in stream:
            printer.item(watched.event)
    elif args.action == "cancel":
        cancelled = await runs.CancelRun(
            run_service_pb2.CancelRunRequest(
                project_id=project, run_id=args.run_id, mutation_id=uuid.uuid4().hex
            ),
            **call,
        )
        printer.item(cancelled)
