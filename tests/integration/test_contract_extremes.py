"""R-ERR-1: the database accepts everything the contract's documented bounds allow.

Every value here is derived from `qinglong_protocol.bounds` (the Python mirror of the
`Bound:`/`Range:` comments) at its extreme: the longest strings in the characters that
cost the most bytes (4-byte UTF-8) or that JSON must escape (`"`, `\\`), the largest
integers, the longest argv, the most labels, both ends of every retry-policy range. They
go end to end through the real stack — ingress, control, PostgreSQL — as a task, its
revisions, runs and a Worker's whole fenced sequence, and come back unchanged.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any, Final

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
from qinglong_ingress.validation import validate_request
from qinglong_protocol import bounds
from qinglong_protocol.errors import error_reason_of

from tests.support.jsonb import jsonb_text_bytes
from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, running_stack

pytestmark = pytest.mark.postgres

ws = worker_service_pb2
ts = task_service_pb2
rs = run_service_pb2

#: 4 bytes in UTF-8: a byte bound filled with it holds a quarter as many characters, and a
#: character bound filled with it is four times as many bytes.
WIDE: Final = "\U0001f600"
#: Characters PostgreSQL's jsonb text doubles when it escapes them.
ESCAPED: Final = ('"', "\\")


def fill(character: str, max_bytes: int) -> str:
    """The longest run of ``character`` within ``max_bytes`` UTF-8 bytes."""
    return character * (max_bytes // len(character.encode()))


def request_id(prefix: str) -> str:
    """A request id of the maximum length."""
    return (prefix + "-" + "9" * bounds.REQUEST_ID_MAX_LENGTH)[: bounds.REQUEST_ID_MAX_LENGTH]


def max_labels(value: str) -> dict[str, str]:
    """The most labels, each key at its longest, each value ``value``."""
    assert bounds.is_bounded_text(value, max_bytes=bounds.LABEL_VALUE_MAX_BYTES, min_bytes=0)
    keys = [f"{chr(ord('a') + i)}{'z' * 62}" for i in range(bounds.LABELS_MAX_ENTRIES)]
    return dict.fromkeys(keys, value)


def policy(
    max_attempts: int, initial: int, maximum: int, percent: int, retry_on: list[int]
) -> execution_pb2.RetryPolicy:
    return execution_pb2.RetryPolicy(
        max_attempts=max_attempts,
        initial_backoff_ms=initial,
        max_backoff_ms=maximum,
        backoff_multiplier_percent=percent,
        retry_on=retry_on,  # type: ignore[arg-type]
    )


ALL_RETRYABLE: Final = [
    execution_pb2.RETRYABLE_OUTCOME_FAILED,
    execution_pb2.RETRYABLE_OUTCOME_START_FAILED,
]
#: Both ends of every retry-policy range (R-RETRY-2).
LARGEST_POLICY: Final = policy(
    bounds.RETRY_MAX_ATTEMPTS_MAX,
    bounds.RETRY_BACKOFF_MS_MAX,
    bounds.RETRY_BACKOFF_MS_MAX,
    bounds.RETRY_MULTIPLIER_PERCENT_MAX,
    ALL_RETRYABLE,
)
SMALLEST_POLICY: Final = policy(
    bounds.RETRY_MAX_ATTEMPTS_MIN,
    bounds.RETRY_BACKOFF_MS_MIN,
    bounds.RETRY_BACKOFF_MS_MIN,
    bounds.RETRY_MULTIPLIER_PERCENT_MIN,
    [],
)


def plans() -> list[execution_pb2.ExecutionPlan]:
    """Plans at every argv extreme: the most items, the longest items (in wide and in
    escaped characters), and the smallest and largest timeout and retry policy."""
    item_count_max = ["a" * (bounds.COMMAND_ARGV_MAX_TOTAL_BYTES // bounds.COMMAND_ARGV_MAX_ITEMS)]
    longest = bounds.COMMAND_ARGV_MAX_TOTAL_BYTES // bounds.COMMAND_ARG_MAX_BYTES
    remote = execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER
    found = [
        execution_pb2.ExecutionPlan(
            executor_type=remote,
            command=item_count_max * bounds.COMMAND_ARGV_MAX_ITEMS,
            timeout_ms=bounds.TIMEOUT_MS_MAX,
            retry_policy=LARGEST_POLICY,
        ),
        execution_pb2.ExecutionPlan(
            executor_type=remote,
            command=[fill(WIDE, bounds.COMMAND_ARG_MAX_BYTES)] * longest,
            timeout_ms=bounds.TIMEOUT_MS_MIN,
            retry_policy=SMALLEST_POLICY,
        ),
        *(
            execution_pb2.ExecutionPlan(
                executor_type=remote, command=[fill(c, bounds.COMMAND_ARG_MAX_BYTES)] * longest
            )
            for c in ESCAPED
        ),
    ]
    for plan in found:
        assert bounds.is_command_argv(plan.command)
    return found


@pytest.fixture
async def stack(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    async with running_stack(database_pg18, tmp_path_factory.mktemp("pki")) as running:
        yield running


def bearer(stack: Stack) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {stack.tokens['alice']}"),)


def within_bounds(request: Any) -> Any:
    """Guard against the test itself drifting past a bound: ingress would refuse it and
    the database would never see the extreme."""
    assert validate_request(request) == [], validate_request(request)
    return request


async def test_the_database_stores_everything_the_contract_allows(stack: Stack) -> None:
    meta = bearer(stack)
    async with stack.channel(stack.operator_identity("ops")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        # Task: the longest display name in 4-byte characters, the most and longest labels.
        display_name = WIDE * bounds.DISPLAY_NAME_MAX_CHARS
        labels = max_labels(fill(WIDE, bounds.LABEL_VALUE_MAX_BYTES))
        created = await tasks.CreateTask(
            within_bounds(
                ts.CreateTaskRequest(
                    project_id=PROJECT,
                    request_id=request_id("task"),
                    display_name=display_name,
                    labels=labels,
                )
            ),
            metadata=meta,
        )
        task_id = created.task.task_id
        read = (
            await tasks.GetTask(
                ts.GetTaskRequest(project_id=PROJECT, task_id=task_id), metadata=meta
            )
        ).task
        assert (read.display_name, dict(read.labels)) == (display_name, labels)

        # Revisions: every argv extreme, both ends of the timeout and retry ranges.
        for number, plan in enumerate(plans(), start=1):
            revision = await tasks.CreateTaskRevision(
                within_bounds(
                    ts.CreateTaskRevisionRequest(
                        project_id=PROJECT,
                        task_id=task_id,
                        request_id=request_id(f"rev{number}"),
                        plan=plan,
                    )
                ),
                metadata=meta,
            )
            assert revision.revision.revision_number == number
            again = await tasks.GetTaskRevision(
                ts.GetTaskRevisionRequest(
                    project_id=PROJECT, task_id=task_id, revision_number=number
                ),
                metadata=meta,
            )
            assert again.revision.plan == plan

        # Runs pinned to the largest plans; the integer ranges' far ends are typed answers.
        run_ids = []
        for number in (1, 2):
            run = await runs.TriggerRun(
                within_bounds(
                    rs.TriggerRunRequest(
                        project_id=PROJECT,
                        task_id=task_id,
                        revision_number=number,
                        request_id=request_id(f"run{number}"),
                    )
                ),
                metadata=meta,
            )
            run_ids.append(run.run.run_id)
        assert run.run.max_attempts == bounds.RETRY_MAX_ATTEMPTS_MIN
        missing = await failure(
            tasks.GetTaskRevision(
                ts.GetTaskRevisionRequest(
                    project_id=PROJECT, task_id=task_id, revision_number=bounds.MAX_SAFE_INTEGER
                ),
                metadata=meta,
            )
        )
        assert error_reason_of(missing) == "REVISION_NOT_FOUND"
        listed = await runs.ListRuns(
            rs.ListRunsRequest(project_id=PROJECT, page_size=bounds.PAGE_SIZE_MAX), metadata=meta
        )
        assert {r.run_id for r in listed.runs} == set(run_ids)
        beyond = await runs.ListRunEvents(
            rs.ListRunEventsRequest(
                project_id=PROJECT,
                run_id=run_ids[0],
                after_sequence=bounds.MAX_SAFE_INTEGER,
                page_size=bounds.PAGE_SIZE_MAX,
            ),
            metadata=meta,
        )
        assert list(beyond.events) == []

    fences = await worker_sequence_at_the_extremes(stack, run_ids)

    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        events = (
            await runs.ListRunEvents(
                rs.ListRunEventsRequest(project_id=PROJECT, run_id=run_ids[0]), metadata=meta
            )
        ).events
        by_type = {e.type: e for e in events}
        assert by_type["attempt.running"].attempt_running.log_artifact_id == LOG_ARTIFACT_ID
        assert by_type["attempt.failed"].attempt_finished.summary == SUMMARY
        assert by_type["attempt.failed"].attempt_finished.exit_code == bounds.INT32_MIN
        # The largest retry policy keeps the first Run waiting a day for its second try.
        first = (
            await runs.GetRun(
                rs.GetRunRequest(project_id=PROJECT, run_id=run_ids[0]), metadata=meta
            )
        ).run
        assert first.max_attempts == bounds.RETRY_MAX_ATTEMPTS_MAX
        cancel = within_bounds(
            rs.CancelRunRequest(
                project_id=PROJECT, run_id=run_ids[0], mutation_id=request_id("cancel")
            )
        )
        accepted = await runs.CancelRun(cancel, metadata=meta)
        replayed = await runs.CancelRun(cancel, metadata=meta)
    assert accepted.outcome == rs.CANCEL_RUN_OUTCOME_ACCEPTED
    assert replayed.outcome == rs.CANCEL_RUN_OUTCOME_ALREADY_REQUESTED
    assert all(f.lease_token not in repr(stack.audit_rows()) for f in fences)


EXECUTOR_HANDLE: Final = fill(WIDE, bounds.EXECUTOR_HANDLE_MAX_BYTES)
LOG_ARTIFACT_ID: Final = fill(WIDE, bounds.LOG_ARTIFACT_ID_MAX_BYTES)
SUMMARY: Final = WIDE * bounds.ERROR_SUMMARY_MAX_CHARS
ERROR_SUMMARY: Final = "\\" * bounds.ERROR_SUMMARY_MAX_CHARS


async def worker_sequence_at_the_extremes(
    stack: Stack, run_ids: list[str]
) -> list[fence_pb2.Fence]:
    """Open, pull, claim, start, run, renew, complete (and a start failure), every value
    the Worker chooses at its extreme."""
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await worker.OpenSession(
            within_bounds(
                ws.OpenSessionRequest(
                    request_id=request_id("session"),
                    worker_id="worker-a",
                    agent_version=fill(WIDE, bounds.AGENT_VERSION_MAX_BYTES),
                    executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                    max_concurrent_attempts=bounds.MAX_CONCURRENT_ATTEMPTS_MAX,
                )
            )
        )
        pulled = await worker.PullOffers(
            within_bounds(
                ws.PullOffersRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    max_offers=bounds.MAX_OFFERS_MAX,
                )
            )
        )
        offers = {offer.run_id: offer for offer in pulled.offers}
        assert set(offers) == set(run_ids)
        fences = []
        for run_id in run_ids:
            token = bounds.encode_lease_capability(secrets.token_bytes(32))
            claimed = await worker.ClaimOffer(
                ws.ClaimOfferRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    offer_id=offers[run_id].offer_id,
                    project_id=PROJECT,
                    run_id=run_id,
                    lease_token=token,
                )
            )
            fence = fence_pb2.Fence(
                worker_id="worker-a",
                session_id=session.session_id,
                worker_generation=session.worker_generation,
                project_id=PROJECT,
                run_id=run_id,
                attempt_id=claimed.attempt_id,
                offer_id=offers[run_id].offer_id,
                lease_generation=claimed.lease_generation,
                lease_token=token,
                expected_lease_version=claimed.lease_version,
            )
            await worker.AcknowledgeStarting(ws.AcknowledgeStartingRequest(fence=fence))
            fences.append(fence)
        ran, failed_to_start = fences
        await worker.AcknowledgeRunning(
            within_bounds(
                ws.AcknowledgeRunningRequest(
                    fence=ran,
                    executor_handle=EXECUTOR_HANDLE,
                    log_artifact_id=LOG_ARTIFACT_ID,
                    callback_sequence=bounds.MAX_SAFE_INTEGER,
                    callback_token_digest="f" * bounds.SHA256_HEX_LENGTH,
                )
            )
        )
        renewed = await worker.ControlLease(ws.ControlLeaseRequest(fence=ran))
        ran.expected_lease_version = renewed.renewed.lease_version
        done = await worker.CompleteAttempt(
            within_bounds(
                ws.CompleteAttemptRequest(
                    fence=ran,
                    callback_sequence=bounds.MAX_SAFE_INTEGER,
                    outcome=worker_pb2.ATTEMPT_OUTCOME_FAILED,
                    exit_code=bounds.INT32_MIN,
                    summary=SUMMARY,
                )
            )
        )
        assert done.outcome == worker_pb2.COMPLETION_OUTCOME_COMPLETED
        start_failure = await worker.ReportStartFailure(
            within_bounds(
                ws.ReportStartFailureRequest(fence=failed_to_start, error_summary=ERROR_SUMMARY)
            )
        )
        assert start_failure.completed_lease_version == failed_to_start.expected_lease_version + 1
        await worker.DrainSession(
            ws.DrainSessionRequest(
                worker_id="worker-a",
                session_id=session.session_id,
                worker_generation=session.worker_generation,
            )
        )
    return fences


async def failure(call: Any) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error
    raise AssertionError("the call succeeded")


@pytest.mark.parametrize("character", ESCAPED, ids=["quote", "backslash"])
async def test_labels_at_their_maximum_in_escaped_characters_are_stored(
    stack: Stack, character: str
) -> None:
    labels = max_labels(fill(character, bounds.LABEL_VALUE_MAX_BYTES))
    # Over what 0001 allowed (8192 bytes of jsonb text); migration 0004 made room.
    assert jsonb_text_bytes(labels) > 8192
    async with stack.channel(stack.operator_identity("ops")) as channel:
        created = await task_service_pb2_grpc.TaskServiceStub(channel).CreateTask(
            within_bounds(
                ts.CreateTaskRequest(
                    project_id=PROJECT,
                    request_id=request_id("escaped"),
                    display_name="escaped labels",
                    labels=labels,
                )
            ),
            metadata=bearer(stack),
        )
    assert dict(created.task.labels) == labels
