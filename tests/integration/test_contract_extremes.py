"""R-ERR-1: the database accepts everything the contract's declared rules allow.

Every value here is derived from the ``buf.validate`` rules of the ``.proto`` files (read
through ``tests.support.contract_fields``, which classifies them with
``qinglong_protocol.contract_rules``) at its extreme: the longest strings in the
characters that cost the most bytes (4-byte UTF-8) or that JSON must escape (`"`, `\\`),
the largest integers, the longest argv, the most labels, both ends of every retry-policy
range. They go end to end through the real stack — ingress, control, PostgreSQL — as a
task, its revisions, runs and a Worker's whole fenced sequence, and come back unchanged.

A test without the database checks the derivation itself: at every field's declared
extreme the validator accepts, one step past it the validator refuses, so the extremes
written below are the contract's own and not some smaller stand-in.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any, Final

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from google.protobuf.timestamp_pb2 import Timestamp
from qinglong.control.v1 import (
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.rpc.v1 import execution_pb2, fence_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2, worker_service_pb2_grpc
from qinglong_ingress.validation import PUBLIC_SERVICES, validate_request
from qinglong_protocol import bounds
from qinglong_protocol.contract_rules import reachable_messages
from qinglong_protocol.errors import error_reason_of

from tests.support.calls import failure
from tests.support.contract_fields import (
    FieldRule,
    Kind,
    argv_of_longest_items,
    argv_of_most_items,
    field_rule,
    fill,
    label_key_max_length,
    map_key,
)
from tests.support.jsonb import jsonb_text_bytes
from tests.support.stack import PROJECT, Stack

pytestmark = pytest.mark.postgres

ws = worker_service_pb2
ts = task_service_pb2
rs = run_service_pb2

#: 4 bytes in UTF-8: a byte bound filled with it holds a quarter as many characters, and a
#: character bound filled with it is four times as many bytes.
WIDE: Final = "\U0001f600"
#: Characters PostgreSQL's jsonb text doubles when it escapes them.
ESCAPED: Final = ('"', "\\")


def rule(message: type[Message], field: str, kind: Kind) -> FieldRule:
    """``message.field``'s declared rule, which must be of ``kind``."""
    found = field_rule(message, field)
    assert found.kind is kind, f"{message.DESCRIPTOR.full_name}.{field}: {found.kind}"
    return found


def lowest(message: type[Message], field: str) -> int:
    return rule(message, field, Kind.INT_RANGE).int_range[0]


def highest(message: type[Message], field: str) -> int:
    return rule(message, field, Kind.INT_RANGE).int_range[1]


def longest_bytes(message: type[Message], field: str) -> str:
    """The longest printable text of a byte-bounded field, in 4-byte characters."""
    return fill(WIDE, rule(message, field, Kind.BYTES_TEXT).lengths[1])


def longest_chars(message: type[Message], field: str, character: str = WIDE) -> str:
    """The longest printable text of a character-bounded field."""
    return character * rule(message, field, Kind.CHARS_TEXT).lengths[1]


def request_id(message: type[Message], prefix: str, field: str = "request_id") -> str:
    """An idempotency key of the maximum length."""
    declared = rule(message, field, Kind.REQUEST_ID)
    most = declared.lengths[1]
    value = (prefix + "-" + "9" * most)[:most]
    assert declared.regex.fullmatch(value), value
    return value


LABELS: Final = rule(ts.CreateTaskRequest, "labels", Kind.LABELS)


def max_labels(value: str, declared: FieldRule = LABELS) -> dict[str, str]:
    """The most entries of a map (labels by default), each key at its longest, each value
    ``value``."""
    key_length = label_key_max_length(declared)
    keys = [map_key(declared, i, key_length) for i in range(declared.items[1])]
    return dict.fromkeys(keys, value)


def longest_label_value(character: str) -> str:
    return fill(character, LABELS.lengths[1])


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


_RETRY = execution_pb2.RetryPolicy
_PLAN = execution_pb2.ExecutionPlan
_RETRY_ON: Final = rule(_RETRY, "retry_on", Kind.ENUM_SET)


def _declared(enum_field: FieldDescriptor) -> list[int]:
    assert enum_field.enum_type is not None
    return sorted(n for n in enum_field.enum_type.values_by_number if n)


#: Both ends of every retry-policy range (R-RETRY-2): the largest policy also retries on
#: as many outcomes as it may, the smallest on as few.
LARGEST_POLICY: Final = policy(
    highest(_RETRY, "max_attempts"),
    highest(_RETRY, "initial_backoff_ms"),
    highest(_RETRY, "max_backoff_ms"),
    highest(_RETRY, "backoff_multiplier_percent"),
    _declared(_RETRY.DESCRIPTOR.fields_by_name["retry_on"])[: _RETRY_ON.items[1]],
)
SMALLEST_POLICY: Final = policy(
    lowest(_RETRY, "max_attempts"),
    lowest(_RETRY, "initial_backoff_ms"),
    lowest(_RETRY, "max_backoff_ms"),
    lowest(_RETRY, "backoff_multiplier_percent"),
    _declared(_RETRY.DESCRIPTOR.fields_by_name["retry_on"])[: _RETRY_ON.items[0]],
)


def plans() -> list[execution_pb2.ExecutionPlan]:
    """Plans at every argv extreme: the most items, the longest items (in wide and in
    escaped characters), and the smallest and largest timeout and retry policy."""
    argv = rule(_PLAN, "command", Kind.ARGV)
    remote = execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER
    return [
        _PLAN(
            executor_type=remote,
            command=argv_of_most_items(argv),
            timeout_ms=highest(_PLAN, "timeout_ms"),
            retry_policy=LARGEST_POLICY,
        ),
        _PLAN(
            executor_type=remote,
            command=argv_of_longest_items(argv, WIDE),
            timeout_ms=lowest(_PLAN, "timeout_ms"),
            retry_policy=SMALLEST_POLICY,
        ),
        *(_PLAN(executor_type=remote, command=argv_of_longest_items(argv, c)) for c in ESCAPED),
    ]


# --- the extremes are the contract's: accepted at the bound, refused one step past it ----

#: A field left out (a message field, or an optional one).
ABSENT: Final = object()
INT32: Final = (-(2**31), 2**31 - 1)
INT64: Final = (-(2**63), 2**63 - 1)


def _uuid(digit: str) -> str:
    return "-".join(digit * n for n in (8, 4, 4, 4, 12))


def probes(f: FieldDescriptor, declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    """(what, value, whether the validator must accept it) at and past ``f``'s extremes."""
    kind = declared.kind
    if kind is Kind.REQUIRED_MESSAGE:
        yield "absent", ABSENT, False
    elif kind is Kind.OPTIONAL_MESSAGE:
        yield "absent", ABSENT, True
    elif kind is Kind.INT_RANGE:
        low, high = declared.int_range
        limits = INT32 if f.cpp_type == FieldDescriptor.CPPTYPE_INT32 else INT64
        yield from (("lowest", low, True), ("highest", high, True))
        if low > limits[0]:
            yield "below the lowest", low - 1, False
        if high < limits[1]:
            yield "above the highest", high + 1, False
    elif kind in (Kind.REQUIRED_ENUM, Kind.OPTIONAL_ENUM):
        values = _declared(f)
        allowed = declared.allowed or values
        yield from (("declared", n, n in allowed) for n in values)
        yield "unspecified", 0, kind is Kind.OPTIONAL_ENUM
        yield "undeclared", max(values) + 1, False
    elif kind is Kind.TIMESTAMP:
        earliest, latest = declared.int_range
        yield "absent", ABSENT, True
        yield "the earliest", Timestamp(seconds=earliest), True
        yield "the latest", Timestamp(seconds=latest), True
        yield "a second too early", Timestamp(seconds=earliest - 1), False
        yield "a second too late", Timestamp(seconds=latest + 1), False
    elif kind is Kind.BOOL:
        yield from (("true", True, True), ("false", False, True))
    elif kind is Kind.ENUM_SET:
        yield from _enum_set_probes(f, declared)
    elif kind is Kind.SLUG_SET:
        yield from _slug_set_probes(declared)
    elif kind is Kind.ARGV:
        yield from _argv_probes(declared)
    elif kind is Kind.LABELS:
        yield from _label_probes(declared)
    elif kind is Kind.OPAQUE_BYTES:
        yield from _bytes_probes(declared)
    else:
        yield from _text_probes(declared)


def _enum_set_probes(f: FieldDescriptor, declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    fewest, most = declared.items
    values = _declared(f)
    yield "as many distinct values as allowed", values[:most], True
    yield "as few as allowed", values[:fewest], True
    yield "a repeat", [values[0], values[0]], False
    yield "unspecified", [0], False
    yield "undeclared", [max(values) + 1], False
    if fewest > 0:
        yield "too few", values[: fewest - 1], False
    if len(values) > most:
        yield "too many", values[: most + 1], False


def _slug_set_probes(declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    fewest, most = declared.items
    longest = declared.lengths[1]
    distinct = [f"{index:x}".rjust(longest, "z") for index in range(most)]
    yield "as many distinct slugs as allowed, each the longest", distinct, True
    yield "as few as allowed", distinct[:fewest], True
    yield "one too many", [*distinct, "a"], False
    yield "a repeat", ["same", "same"], False
    yield "a slug one too long", ["z" * (longest + 1)], False
    yield "upper case", ["Proj"], False
    yield "empty", [""], False


def _argv_probes(declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    fewest, most = declared.items
    longest_item = declared.lengths[1]
    at_total = argv_of_longest_items(declared, "a")
    yield "the most items", argv_of_most_items(declared), True
    yield "the longest items in 4-byte characters", argv_of_longest_items(declared, WIDE), True
    for character in ESCAPED:
        yield (
            f"the longest items in {character!r}",
            argv_of_longest_items(declared, character),
            True,
        )
    yield "controls other than NUL", ["\t\n\x1b\x85"], True
    yield "one byte past the total", [*at_total, "a"], False
    yield "one item too many", ["a"] * (most + 1), False
    yield "an item one byte too long", ["a" * (longest_item + 1)], False
    yield "an empty item", [""], False
    yield "a NUL", ["a\x00b"], False
    if fewest > 0:
        yield "too few items", ["a"] * (fewest - 1), False


def _label_probes(declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    most, value_max = declared.items[1], declared.lengths[1]
    key_max = label_key_max_length(declared)
    key = map_key(declared)
    longest = max_labels(fill(WIDE, value_max), declared)
    yield "the most and longest, in 4-byte characters", longest, True
    yield "an empty value", {key: ""}, True
    yield "one entry too many", {map_key(declared, i): "v" for i in range(most + 1)}, False
    yield "a key one character too long", {key * (key_max + 1): "v"}, False
    yield "a mixed-case key", {"Key": "v"}, False
    yield "a value one byte too long", {key: "a" * (value_max + 1)}, False
    yield "a C1 control in a value", {key: "a\x85"}, False


def _bytes_probes(declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    shortest, most = declared.lengths
    yield "the longest, every byte value", bytes(range(256)) * (most // 256), True
    yield "not UTF-8, with NUL and controls", b"\xff\xfe\x00\x1b[31m\x85", True
    yield "one byte too long", b"a" * (most + 1), False
    yield "empty", b"", shortest == 0


def _text_probes(declared: FieldRule) -> Iterator[tuple[str, Any, bool]]:
    kind = declared.kind
    shortest, most = declared.lengths
    if kind is Kind.SLUG:
        yield "the longest", "z" * most, True
        yield "one too long", "z" * (most + 1), False
    elif kind is Kind.REQUEST_ID:
        yield "the longest", ":" * most, True
        yield "one too long", ":" * (most + 1), False
    elif kind in (Kind.UUID, Kind.UUID_OR_EMPTY):
        yield from (("the smallest", _uuid("0"), True), ("the largest", _uuid("f"), True))
        yield "upper case", _uuid("F"), False
        yield "a trailing newline", _uuid("0") + "\n", False
    elif kind is Kind.SHA256_HEX:
        yield "the largest", "f" * most, True
        yield "upper case", "F" * most, False
        yield "one too long", "f" * (most + 1), False
        yield "one too short", "f" * (most - 1), False
    elif kind is Kind.PAGE_TOKEN:
        yield "the longest", "-" * most, True
        yield "one too long", "A" * (most + 1), False
        yield "padding", "AA==", False
    elif kind is Kind.LEASE_CAPABILITY:
        good = bounds.encode_lease_capability(secrets.token_bytes(32))
        yield "a strong capability", good, True
        yield "a trailing newline", good + "\n", False
        yield "unused low bits set", good[:-1] + "B", False
        yield "weak", bounds.encode_lease_capability(bytes(32)), False
        yield "one too long", good + "A", False
    elif kind is Kind.JOIN_TOKEN:
        good = "qlj1_" + bounds.encode_lease_capability(secrets.token_bytes(32))[5:]
        yield "a token", good, True
        yield "a trailing newline", good + "\n", False
        yield "unused low bits set", good[:-1] + "B", False
        yield "a lease capability's prefix", "qlc1_" + good[5:], False
    elif kind is Kind.PEM:
        first = declared.prefix or ""
        yield "the shortest", first.ljust(shortest, "A"), True
        yield "the longest", first.ljust(most, "A"), True
        yield "one too long", first.ljust(most + 1, "A"), False
        yield "without its first line", "A" * most, False
    elif kind is Kind.BYTES_TEXT:
        yield "the longest in 4-byte characters", fill(WIDE, most), True
        yield "the longest in ASCII", "a" * most, True
        yield "one byte too long", "a" * (most + 1), False
        yield "a C1 control", "a\x85", False
    elif kind is Kind.CHARS_TEXT:
        yield "the longest in 4-byte characters", WIDE * most, True
        yield "one character too long", WIDE * (most + 1), False
        yield "a C1 control", "a\x9b", False
    else:
        raise AssertionError(f"no probes for {kind}")
    yield "a NUL", "a\x00", False
    yield "empty", "", shortest == 0


def _assign(message: Message, f: FieldDescriptor, value: Any) -> None:
    if value is ABSENT:
        return
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        getattr(message, f.name).update(value)
    elif f.is_repeated:
        getattr(message, f.name).extend(value)
    elif f.message_type is not None:
        getattr(message, f.name).CopyFrom(value)
    else:
        setattr(message, f.name, value)


def _messages() -> list[Descriptor]:
    found: dict[str, Descriptor] = {}
    for service, _ in PUBLIC_SERVICES:
        for method in service.methods:
            for message in reachable_messages(method.input_type):
                found.setdefault(message.full_name, message)
    return list(found.values())


def test_every_declared_extreme_is_accepted_and_one_step_past_it_refused() -> None:
    """The derivation behind the extremes above, checked against the validator for every
    field any public request reaches: the values classified as the largest valid ones
    are accepted, and the next ones are refused on that very field."""
    wrong = []
    checked: set[Kind] = set()
    for descriptor in _messages():
        make: Callable[[], Message] = GetMessageClass(descriptor)
        for f in descriptor.fields:
            declared = field_rule(descriptor, f.name)
            checked.add(declared.kind)
            for what, value, accepted in probes(f, declared):
                message = make()
                _assign(message, f, value)
                on_field = [
                    v.description
                    for v in validate_request(message)
                    if v.field == f.name or v.field.startswith((f.name + "[", f.name + "."))
                ]
                if accepted == bool(on_field):
                    verdict = "refused" if on_field else "accepted"
                    wrong.append(f"{f.full_name}: {what} {verdict} {on_field}")
    assert wrong == []
    assert checked == set(Kind), set(Kind) - checked


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
        display_name = longest_chars(ts.CreateTaskRequest, "display_name")
        labels = max_labels(longest_label_value(WIDE))
        created = await tasks.CreateTask(
            within_bounds(
                ts.CreateTaskRequest(
                    project_id=PROJECT,
                    request_id=request_id(ts.CreateTaskRequest, "task"),
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
        listed_tasks = await tasks.ListTasks(
            within_bounds(
                ts.ListTasksRequest(
                    project_id=PROJECT, page_size=highest(ts.ListTasksRequest, "page_size")
                )
            ),
            metadata=meta,
        )
        assert [t for t in listed_tasks.tasks if t.task_id == task_id] == [read]

        # Revisions: every argv extreme, both ends of the timeout and retry ranges.
        for number, plan in enumerate(plans(), start=1):
            revision = await tasks.CreateTaskRevision(
                within_bounds(
                    ts.CreateTaskRevisionRequest(
                        project_id=PROJECT,
                        task_id=task_id,
                        request_id=request_id(ts.CreateTaskRevisionRequest, f"rev{number}"),
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
                        request_id=request_id(rs.TriggerRunRequest, f"run{number}"),
                    )
                ),
                metadata=meta,
            )
            run_ids.append(run.run.run_id)
        assert run.run.max_attempts == SMALLEST_POLICY.max_attempts
        missing = await failure(
            tasks.GetTaskRevision(
                ts.GetTaskRevisionRequest(
                    project_id=PROJECT,
                    task_id=task_id,
                    revision_number=highest(ts.GetTaskRevisionRequest, "revision_number"),
                ),
                metadata=meta,
            )
        )
        assert error_reason_of(missing) == "REVISION_NOT_FOUND"
        listed = await runs.ListRuns(
            within_bounds(
                rs.ListRunsRequest(
                    project_id=PROJECT, page_size=highest(rs.ListRunsRequest, "page_size")
                )
            ),
            metadata=meta,
        )
        assert {r.run_id for r in listed.runs} == set(run_ids)
        beyond = await runs.ListRunEvents(
            within_bounds(
                rs.ListRunEventsRequest(
                    project_id=PROJECT,
                    run_id=run_ids[0],
                    after_sequence=highest(rs.ListRunEventsRequest, "after_sequence"),
                    page_size=highest(rs.ListRunEventsRequest, "page_size"),
                )
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
        assert by_type["attempt.failed"].attempt_finished.exit_code == EXIT_CODE
        # The largest retry policy keeps the first Run waiting a day for its second try.
        first = (
            await runs.GetRun(
                rs.GetRunRequest(project_id=PROJECT, run_id=run_ids[0]), metadata=meta
            )
        ).run
        assert first.max_attempts == LARGEST_POLICY.max_attempts
        cancel = within_bounds(
            rs.CancelRunRequest(
                project_id=PROJECT,
                run_id=run_ids[0],
                mutation_id=request_id(rs.CancelRunRequest, "cancel", "mutation_id"),
            )
        )
        accepted = await runs.CancelRun(cancel, metadata=meta)
        replayed = await runs.CancelRun(cancel, metadata=meta)
    assert accepted.outcome == rs.CANCEL_RUN_OUTCOME_ACCEPTED
    assert replayed.outcome == rs.CANCEL_RUN_OUTCOME_ALREADY_REQUESTED
    assert all(f.lease_token not in repr(stack.audit_rows()) for f in fences)


EXECUTOR_HANDLE: Final = longest_bytes(ws.AcknowledgeRunningRequest, "executor_handle")
LOG_ARTIFACT_ID: Final = longest_bytes(ws.AcknowledgeRunningRequest, "log_artifact_id")
CALLBACK_SEQUENCE: Final = highest(ws.AcknowledgeRunningRequest, "callback_sequence")
CALLBACK_TOKEN_DIGEST: Final = (
    "f" * rule(ws.AcknowledgeRunningRequest, "callback_token_digest", Kind.SHA256_HEX).lengths[1]
)
SUMMARY: Final = longest_chars(ws.CompleteAttemptRequest, "summary")
EXIT_CODE: Final = lowest(ws.CompleteAttemptRequest, "exit_code")
ERROR_SUMMARY: Final = longest_chars(ws.ReportStartFailureRequest, "error_summary", "\\")


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
                    request_id=request_id(ws.OpenSessionRequest, "session"),
                    worker_id="worker-a",
                    agent_version=longest_bytes(ws.OpenSessionRequest, "agent_version"),
                    executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                    max_concurrent_attempts=highest(
                        ws.OpenSessionRequest, "max_concurrent_attempts"
                    ),
                )
            )
        )
        pulled = await worker.PullOffers(
            within_bounds(
                ws.PullOffersRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    max_offers=highest(ws.PullOffersRequest, "max_offers"),
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
                    callback_sequence=CALLBACK_SEQUENCE,
                    callback_token_digest=CALLBACK_TOKEN_DIGEST,
                )
            )
        )
        renewed = await worker.ControlLease(ws.ControlLeaseRequest(fence=ran))
        ran.expected_lease_version = renewed.renewed.lease_version
        done = await worker.CompleteAttempt(
            within_bounds(
                ws.CompleteAttemptRequest(
                    fence=ran,
                    callback_sequence=highest(ws.CompleteAttemptRequest, "callback_sequence"),
                    outcome=worker_pb2.ATTEMPT_OUTCOME_FAILED,
                    exit_code=EXIT_CODE,
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


@pytest.mark.parametrize("character", ESCAPED, ids=["quote", "backslash"])
async def test_labels_at_their_maximum_in_escaped_characters_are_stored(
    stack: Stack, character: str
) -> None:
    labels = max_labels(longest_label_value(character))
    # Over what 0001 allowed (8192 bytes of jsonb text); migration 0004 made room.
    assert jsonb_text_bytes(labels) > 8192
    async with stack.channel(stack.operator_identity("ops")) as channel:
        created = await task_service_pb2_grpc.TaskServiceStub(channel).CreateTask(
            within_bounds(
                ts.CreateTaskRequest(
                    project_id=PROJECT,
                    request_id=request_id(ts.CreateTaskRequest, "escaped"),
                    display_name="escaped labels",
                    labels=labels,
                )
            ),
            metadata=bearer(stack),
        )
    assert dict(created.task.labels) == labels
