"""`qinglong task …` and `qinglong run …`: the operator's commands, through ingress.

Connection and identity come from explicit settings (`--address`, `--ca-cert`, `--cert`,
`--key`, `--project`, or their `QINGLONG_*` variables) or else a stack file (`qinglong up`
writes one), and the operator's bearer token (ingress_client.py). Answers go to stdout as
a table on a terminal and as JSON lines otherwise (`--output table|json|jsonl`, see
output.py); errors go to stderr with their gRPC code, ErrorInfo reason, message and field
violations, and documented exit codes (cli_errors.py).
"""

from __future__ import annotations

import argparse
import functools
import uuid
from pathlib import Path
from typing import Any, TextIO

from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2, lifecycle_pb2
from qinglong_protocol.bounds import (
    MAX_CONCURRENT_RUNS_MAX,
    MAX_CONCURRENT_RUNS_MIN,
    PRIORITY_MAX,
    PRIORITY_MIN,
    QUEUE_TIMEOUT_MS_MAX,
    QUEUE_TIMEOUT_MS_MIN,
)

from qinglong_cli.cli_errors import (
    EXIT_RUN_NOT_SUCCEEDED,
    ConfigurationError,
    PendingApproval,
    RunNotSucceeded,
    sent_once,
)
from qinglong_cli.ingress_client import (
    OPERATOR_TOKEN,
    Session,
    add_operator_flags,
    add_request_id_flag,
    print_pages,
    request_id_of,
    run_through_ingress,
)
from qinglong_cli.output import enum_names
from qinglong_cli.run_events import SUCCEEDED_EVENT, every_run_event, watched_run_events
from qinglong_cli.run_output import print_run_output

#: `--retry-on` names: the endings a retry policy may opt into.
_RETRYABLE = {
    "failed": execution_pb2.RETRYABLE_OUTCOME_FAILED,
    "start-failed": execution_pb2.RETRYABLE_OUTCOME_START_FAILED,
}
#: A retry policy's delays when `--max-attempts` is given without them.
_DEFAULT_BACKOFF_MS = 1_000
_DEFAULT_MAX_BACKOFF_MS = 60_000
_DEFAULT_MULTIPLIER_PERCENT = 200
#: `run list --state` names: the Run states (lower case, as `run get` shows them).
_RUN_STATES = enum_names(lifecycle_pb2.RunState, "RUN_STATE_")


def add_operator_commands(commands: Any, default_stack: Path) -> None:
    def common(parser: argparse.ArgumentParser) -> None:
        add_operator_flags(parser, default_stack)

    def plan_flags(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--timeout-ms", type=int, help="durable execution timeout")
        parser.add_argument(
            "--queue-timeout-ms",
            type=int,
            help="end a Run TIMED_OUT (QUEUE_TIMED_OUT) when no Worker claimed it this long"
            f" after it was queued ({QUEUE_TIMEOUT_MS_MIN}..{QUEUE_TIMEOUT_MS_MAX};"
            " default: it waits)",
        )
        parser.add_argument(
            "--max-concurrent-runs",
            type=int,
            help="at most this many Runs of the task at once (the newest revision's limit is"
            " the task's): a Run waits CREATED while that many of the task's Runs are queued,"
            " running, waiting for a retry, or lost and maybe still stopping"
            f" ({MAX_CONCURRENT_RUNS_MIN}..{MAX_CONCURRENT_RUNS_MAX}; default: no limit)",
        )
        parser.add_argument(
            "--max-attempts",
            type=int,
            help="attempts in total, the first included (1..100; default 1: no retry)",
        )
        parser.add_argument(
            "--retry-backoff-ms",
            type=int,
            help=f"delay before the second attempt (default {_DEFAULT_BACKOFF_MS})",
        )
        parser.add_argument(
            "--retry-max-backoff-ms",
            type=int,
            help=f"upper bound of the delay (default {_DEFAULT_MAX_BACKOFF_MS})",
        )
        parser.add_argument(
            "--retry-multiplier-percent",
            type=int,
            help="growth of the delay per attempt in percent"
            f" (default {_DEFAULT_MULTIPLIER_PERCENT}: doubles)",
        )
        parser.add_argument(
            "--retry-on",
            action="append",
            choices=sorted(_RETRYABLE),
            default=[],
            help="also retry these endings (lost attempts always retry); repeatable",
        )
        parser.add_argument(
            "--require-label",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="run only on Workers that declare this label (qinglong-worker --label);"
            " repeatable: all of them. A revision is a whole plan: `task revise` keeps none"
            " of the previous revision's, so give them again",
        )
        parser.add_argument("argv", nargs="+", help="the command, after --")
        add_request_id_flag(parser)

    task = commands.add_parser("task", help="create, read and list tasks").add_subparsers(
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
    get_revision = task.add_parser(
        "revision", help="show a revision's plan (its command, timeouts, retries, selector)"
    )
    common(get_revision)
    get_revision.add_argument("task_id")
    get_revision.add_argument(
        "--number", type=int, metavar="N", help="the revision number (default: the newest)"
    )
    list_tasks = task.add_parser("list", help="list tasks, newest first")
    common(list_tasks)
    list_tasks.add_argument("--limit", type=int, default=20, help="tasks per page (1..500)")
    list_tasks.add_argument("--page-token", default="", help="from a previous page's footer")

    run = commands.add_parser("run", help="trigger, read, watch and cancel runs").add_subparsers(
        dest="action", required=True
    )
    trigger = run.add_parser("trigger", help="queue a run of a task's revision")
    common(trigger)
    trigger.add_argument("--task", required=True, help="task id")
    trigger.add_argument(
        "--revision",
        type=int,
        metavar="N",
        help="the revision number to pin (default: the newest at trigger time), e.g. to run"
        " an earlier one again",
    )
    trigger.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a parameter of the run; its executor reads it as $QINGLONG_PARAM_NAME"
        " (NAME: upper-case letters, digits and _, starting with a letter); repeatable",
    )
    trigger.add_argument(
        "--priority",
        type=int,
        default=0,
        help="queued runs of a higher priority are offered first, the oldest first among"
        f" equals ({PRIORITY_MIN}..{PRIORITY_MAX}; default 0)",
    )
    add_request_id_flag(trigger)
    rerun = run.add_parser(
        "rerun",
        help="queue a new run like an earlier one: its task, revision, parameters, priority",
    )
    common(rerun)
    rerun.add_argument("run_id", help="the earlier run (any state)")
    rerun.add_argument(
        "--newest",
        action="store_true",
        help="pin the task's newest revision instead of the earlier run's",
    )
    add_request_id_flag(rerun)
    for name, help_text in (
        ("get", "show a run"),
        ("events", "list a run's events"),
        ("watch", "stream a run's events until it is terminal"),
        ("cancel", "ask a run to stop (exit 5: held for a person's approval, not done yet)"),
    ):
        action = run.add_parser(name, help=help_text)
        common(action)
        action.add_argument("run_id")
        if name == "watch":
            action.add_argument(
                "--exit-status",
                action="store_true",
                help=f"exit {EXIT_RUN_NOT_SUCCEEDED} if the run ends other than succeeded",
            )
    logs = run.add_parser(
        "logs", help="print a run's output (stdout and stderr, as the executor wrote them)"
    )
    common(logs)
    logs.add_argument("run_id")
    logs.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing new output; ends when the run is terminal and all is printed",
    )
    logs.add_argument("--attempt", type=int, help="attempt number (default: the latest)")
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
    return await run_through_ingress(args, OPERATOR_TOKEN, _dispatch, out, err, needs_project=True)


def _plan(args: argparse.Namespace) -> execution_pb2.ExecutionPlan:
    plan = execution_pb2.ExecutionPlan(
        executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
        command=args.argv,
        worker_selector=_assignments("--require-label", "KEY=VALUE", args.require_label),
    )
    if args.timeout_ms is not None:
        plan.timeout_ms = args.timeout_ms
    if args.queue_timeout_ms is not None:
        plan.queue_timeout_ms = args.queue_timeout_ms
    if args.max_concurrent_runs is not None:
        plan.max_concurrent_runs = args.max_concurrent_runs
    retry_flags = [
        flag
        for flag, value in (
            ("--retry-backoff-ms", args.retry_backoff_ms),
            ("--retry-max-backoff-ms", args.retry_max_backoff_ms),
            ("--retry-multiplier-percent", args.retry_multiplier_percent),
            ("--retry-on", args.retry_on or None),
        )
        if value is not None
    ]
    if args.max_attempts is None:
        if retry_flags:  # a policy the user described must not be dropped unseen
            verb = "needs" if len(retry_flags) == 1 else "need"
            raise ConfigurationError(f"{', '.join(retry_flags)} {verb} --max-attempts")
        return plan
    backoff = _or_default(args.retry_backoff_ms, _DEFAULT_BACKOFF_MS)
    max_backoff = _or_default(args.retry_max_backoff_ms, _DEFAULT_MAX_BACKOFF_MS)
    plan.retry_policy.CopyFrom(
        execution_pb2.RetryPolicy(
            max_attempts=args.max_attempts,
            initial_backoff_ms=backoff,
            max_backoff_ms=max(max_backoff, backoff),
            backoff_multiplier_percent=_or_default(
                args.retry_multiplier_percent, _DEFAULT_MULTIPLIER_PERCENT
            ),
            retry_on=sorted({_RETRYABLE[name] for name in args.retry_on}),
        )
    )
    return plan


async def _trigger(
    runs: Any,
    session: Session,
    args: argparse.Namespace,
    task_id: str,
    revision_number: int | None,
    parameters: dict[str, str],
    priority: int,
) -> Any:
    """TriggerRun on ``runs`` (the session's RunService stub) under the command's request
    id (``--request-id`` or a fresh one, named if the answer is lost); the Run it queued."""
    request_id = request_id_of(args)
    triggered = await sent_once(
        runs.TriggerRun(
            run_service_pb2.TriggerRunRequest(
                project_id=session.project_id,
                task_id=task_id,
                revision_number=revision_number,
                request_id=request_id,
                parameters=parameters,
                priority=priority,
            ),
            **session.call_options(),
        ),
        request_id,
    )
    return triggered.run


def _assignments(flag: str, shape: str, given: list[str]) -> dict[str, str]:
    """Repeated ``flag NAME=VALUE`` as a map (``--param``, ``--require-label``); the
    server judges names and values against the contract, this only splits them (at the
    first ``=``)."""
    assigned: dict[str, str] = {}
    for item in given:
        name, equals, value = item.partition("=")
        if not equals:
            # Not echoed: what was typed may be a value, and values may be secrets.
            raise ConfigurationError(f"{flag} needs {shape} (one has no '=')")
        if name in assigned:
            raise ConfigurationError(f"{flag} {name} is given twice")
        assigned[name] = value
    return assigned


def _or_default(value: int | None, default: int) -> int:
    return default if value is None else value


async def _dispatch(args: argparse.Namespace, session: Session) -> None:
    tasks = task_service_pb2_grpc.TaskServiceStub(session.channel)
    runs = run_service_pb2_grpc.RunServiceStub(session.channel)
    printer, err = session.printer, session.err
    call = session.call_options()
    meta = call["metadata"]
    project = session.project_id
    if args.command == "task" and args.action == "create":
        # One call: the task and its first revision commit together or not at all.
        request_id = request_id_of(args)
        created = await sent_once(
            tasks.CreateTask(
                task_service_pb2.CreateTaskRequest(
                    project_id=project,
                    request_id=request_id,
                    display_name=args.name,
                    first_revision_plan=_plan(args),
                ),
                **call,
            ),
            request_id,
        )
        printer.item(created.first_revision)
    elif args.command == "task" and args.action == "revise":
        request_id = request_id_of(args)
        revision = await sent_once(
            tasks.CreateTaskRevision(
                task_service_pb2.CreateTaskRevisionRequest(
                    project_id=project,
                    task_id=args.task_id,
                    request_id=request_id,
                    plan=_plan(args),
                ),
                **call,
            ),
            request_id,
        )
        printer.item(revision.revision)
    elif args.command == "task" and args.action == "get":
        got_task = await tasks.GetTask(
            task_service_pb2.GetTaskRequest(project_id=project, task_id=args.task_id), **call
        )
        printer.item(got_task.task)
    elif args.command == "task" and args.action == "revision":
        number = args.number
        if number is None:
            newest = await tasks.GetTask(
                task_service_pb2.GetTaskRequest(project_id=project, task_id=args.task_id), **call
            )
            number = newest.task.latest_revision_number
            if number == 0:
                raise ConfigurationError(f"task {args.task_id} has no revision yet")
        got_revision = await tasks.GetTaskRevision(
            task_service_pb2.GetTaskRevisionRequest(
                project_id=project, task_id=args.task_id, revision_number=number
            ),
            **call,
        )
        printer.item(got_revision.revision)
    elif args.command == "task" and args.action == "list":
        await print_pages(
            functools.partial(tasks.ListTasks, **call),
            task_service_pb2.ListTasksRequest(
                project_id=project, page_size=args.limit, page_token=args.page_token
            ),
            lambda page: page.tasks,
            printer,
            err,
            follow=False,
        )
    elif args.action == "trigger":
        parameters = _assignments("--param", "NAME=VALUE", args.param)
        printer.item(
            await _trigger(runs, session, args, args.task, args.revision, parameters, args.priority)
        )
    elif args.action == "rerun":
        # A new Run, not the old one again: a terminal Run never changes, and its Events
        # and output stay its own. A retried rerun (same --request-id) reads the same
        # earlier Run, so it asks for exactly what the first one did.
        earlier = await runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=project, run_id=args.run_id), **call
        )
        pinned = None if args.newest else earlier.run.revision_number
        printer.item(
            await _trigger(
                runs,
                session,
                args,
                earlier.run.task_id,
                pinned,
                dict(earlier.run.parameters),
                earlier.run.priority,
            )
        )
    elif args.action == "get":
        got = await runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=project, run_id=args.run_id), **call
        )
        printer.item(got.run)
    elif args.action == "list":
        await print_pages(
            functools.partial(runs.ListRuns, **call),
            run_service_pb2.ListRunsRequest(
                project_id=project,
                page_size=args.limit,
                page_token=args.page_token,
                task_id=args.task or "",
                states=[_RUN_STATES[name] for name in args.state],
            ),
            lambda page: page.runs,
            printer,
            err,
            follow=False,
        )
    elif args.action == "events":
        async for event in every_run_event(runs.ListRunEvents, project, args.run_id, **call):
            printer.item(event)
    elif args.action == "watch":
        watched = watched_run_events(
            runs.WatchRunEvents, project, args.run_id, err=err, metadata=meta
        )
        last = ""
        async for event in watched:
            printer.item(event)
            last = event.type
        if args.exit_status and last != SUCCEEDED_EVENT:
            raise RunNotSucceeded(last.removeprefix("run."))
    elif args.action == "logs":
        await print_run_output(
            runs,
            session.call_options,
            project,
            args.run_id,
            attempt=args.attempt,
            follow=args.follow,
            out=session.printer.raw_out(),
            err=err,
        )
    elif args.action == "cancel":
        cancelled = await runs.CancelRun(
            run_service_pb2.CancelRunRequest(
                project_id=project, run_id=args.run_id, mutation_id=uuid.uuid4().hex
            ),
            **call,
        )
        printer.item(cancelled)
        if cancelled.outcome == run_service_pb2.CANCEL_RUN_OUTCOME_REQUIRE_APPROVAL:
            raise PendingApproval(cancelled.approval_id)
