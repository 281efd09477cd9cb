"""R-ERR-1 by property: no public request, however malformed, is answered INTERNAL or UNKNOWN.

Requests are built as *bytes* for every method of WorkerService, TaskService and RunService
(enumerated from the service descriptors) from the message descriptors: extreme and random
integers, enum numbers nobody declared, invalid UTF-8 in string fields, very long strings,
field numbers the schema lacks, wire types that disagree with it, forged lease
capabilities, page tokens and UUIDs, nested messages with all of the above, truncated
requests and plain random bytes. Each goes through ingress on the real in-process stack
(mutual TLS, PostgreSQL) with a valid identity: worker-a's certificate for WorkerService,
an operator's bearer token for the others.

Two generators feed the same properties:

* Hypothesis (derandomized: CI sees the same examples on every run) builds requests mostly
  from a real world — a live fence, a task, a terminal run, an issued page token — with
  one field (sometimes two) made hostile, so most get past ingress's identity binding and
  reach control's parsing and the database, where the interesting failures live; the rest
  are chaos: every field anything, duplicated, unknown fields, any order.
* A sweep sets every leaf field of every request (nested ones included) to every edge of
  its type, one at a time, in an otherwise real request: random generation rarely lands
  on one exact extreme in one exact field, and that is where the INTERNALs were.

Properties of every answer:

* never INTERNAL or UNKNOWN;
* a QingLong error carries an ErrorInfo;
* INVALID_ARGUMENT carries a BadRequest whose violations name a field path of the request;
  only bytes that do not decode may be refused as the whole message (by its full name);
* a request the contract documents as valid is never refused as INVALID_ARGUMENT, by
  control or by a database constraint;
* no error text, violation or ErrorInfo metadata contains a string value the request
  carried (a lease capability, a page token, a forged id);
* afterwards both servers still answer.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from qinglong.admin.v1 import admin_pb2, admin_service_pb2
from qinglong.control.v1 import (
    approval_service_pb2,
    run_service_pb2,
    run_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
)
from qinglong.enrollment.v1 import enrollment_service_pb2
from qinglong.rpc.v1 import execution_pb2, fence_pb2, lifecycle_pb2
from qinglong.worker.v1 import worker_pb2, worker_service_pb2, worker_service_pb2_grpc
from qinglong_control.domain.refusals import Refused
from qinglong_control.issuing import IssuingAuthority
from qinglong_ingress import validation
from qinglong_protocol import bounds
from qinglong_protocol.errors import (
    REASON_CODES,
    error_info_of,
    field_violations_of,
    reason_name,
)
from qinglong_worker.join import new_private_key, signing_request

from tests.support import protowire
from tests.support.contract_fields import (
    TEXT_KINDS,
    FieldRule,
    Kind,
    argv_of_longest_items,
    argv_of_most_items,
    field_rule,
    label_key_max_length,
    map_key,
    ruled_fields,
)
from tests.support.postgres import Clusters
from tests.support.stack import PROJECT, Stack, running_stack

pytestmark = pytest.mark.postgres

ws = worker_service_pb2

# --- what is under test --------------------------------------------------------------


@dataclass(frozen=True)
class PublicMethod:
    service: str
    descriptor: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.descriptor.name}"

    @property
    def audience(self) -> str:
        if self.service.startswith("qinglong.worker."):
            return "worker"
        if self.service.startswith("qinglong.enrollment."):
            return "enrollment"
        return "admin" if self.service.startswith("qinglong.admin.") else "operator"


def _public_methods() -> list[PublicMethod]:
    """Every method of the public services, straight from their descriptors."""
    found = []
    for module in (
        worker_service_pb2,
        task_service_pb2,
        run_service_pb2,
        approval_service_pb2,
        admin_service_pb2,
        enrollment_service_pb2,
    ):
        for service in module.DESCRIPTOR.services_by_name.values():
            found.extend(PublicMethod(service.full_name, m) for m in service.methods)
    return found


METHODS: Final = _public_methods()

#: Codes a refusal may never have (R-ERR-1).
FORBIDDEN: Final = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: Codes that come from the transport or the call's own deadline, without an ErrorInfo.
TRANSPORT_CODES: Final = frozenset(
    {
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # over grpc.max_receive_message_length
        grpc.StatusCode.DEADLINE_EXCEEDED,  # a live watch the test stops waiting for
        grpc.StatusCode.CANCELLED,
    }
)
INVALID_ARGUMENT_REASONS: Final = frozenset(
    reason_name(reason)
    for reason, code in REASON_CODES.items()
    if code == grpc.StatusCode.INVALID_ARGUMENT
)
#: Sent string values at least this long must not come back in any error; shorter ones
#: (``a``, ``-1``) could appear in a rule's own wording by chance.
ECHO_MIN_LENGTH: Final = 12
#: A watch of a Run that is not terminal streams until its deadline; this bounds the wait.
STREAM_TIMEOUT_SECONDS: Final = 2.0

# --- the real world the requests are built from -------------------------------------


@dataclass
class Known:
    """Real values of one audience, by field name: requests built from them get past
    ingress's identity binding and reach control's parsing and the database."""

    texts: dict[str, list[str]] = field(default_factory=dict)
    ints: dict[str, list[int]] = field(default_factory=dict)
    messages: dict[str, list[bytes]] = field(default_factory=dict)


class World:
    def __init__(
        self,
        stack: Stack,
        worker: Known,
        operator: Known,
        sanity_run_id: str,
        page_tokens: dict[str, list[str]],
    ) -> None:
        self.stack = stack
        self.worker = worker
        self.operator = operator
        self.sanity_run_id = sanity_run_id
        self.page_tokens = page_tokens
        """Tokens each operator listing issued, by method name (ListRuns, ListTasks)."""
        self._channels: dict[str, grpc.aio.Channel] = {}

    def __repr__(self) -> str:
        # Hypothesis prints its arguments on failure; the stack's tokens stay out of it.
        return "World(<the in-process stack>)"

    def known(self, method: PublicMethod) -> Known:
        if method.audience == "worker":
            return self.worker
        if method.audience == "enrollment":
            return Known()  # a joining machine knows nothing of this world
        if method.audience == "admin":
            # The page tokens known are ListRuns' and ListTasks'; an admin listing issues
            # its own kind. The world's project stays out: DisableProject on it would lock
            # everyone out of the world every other example relies on.
            return Known(
                texts={k: v for k, v in self.operator.texts.items() if k != "project_id"},
                ints=self.operator.ints,
                messages=self.operator.messages,
            )
        # An operator listing knows the tokens it issued itself, and no other kind.
        return Known(
            texts={**self.operator.texts, "page_token": self.issued_page_tokens(method)},
            ints=self.operator.ints,
            messages=self.operator.messages,
        )

    def issued_page_tokens(self, method: PublicMethod) -> list[str]:
        """Tokens a previous response of this very method issued (only ListRuns and
        ListTasks have any here): a token of another listing is not "a token from a
        previous response"."""
        return self.page_tokens.get(method.descriptor.name, [])

    def channel(self, method: PublicMethod) -> grpc.aio.Channel:
        """One long-lived channel per audience: examples pay for a call, not a handshake."""
        if method.audience == "enrollment" and method.audience not in self._channels:
            # The enrollment listener: server-authenticated TLS, no client certificate.
            trust = grpc.ssl_channel_credentials(self.stack.pki.ca_cert.read_bytes())
            self._channels[method.audience] = grpc.aio.secure_channel(
                self.stack.enrollment_address, trust
            )
        if method.audience not in self._channels:
            identity = (
                self.stack.worker_identity("worker-a")
                if method.audience == "worker"
                else self.stack.operator_identity("ops")
            )
            self._channels[method.audience] = self.stack.channel(identity)
        return self._channels[method.audience]

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    def metadata(self, method: PublicMethod) -> tuple[tuple[str, str], ...]:
        if method.audience == "admin":
            # root: a cluster admin, so hostile requests reach control's admin handlers.
            return (("authorization", f"Bearer {self.stack.tokens['root']}"),)
        return () if method.audience in ("worker", "enrollment") else self.operator_metadata

    @property
    def operator_metadata(self) -> tuple[tuple[str, str], ...]:
        """alice: an operator of the project (her bearer token)."""
        return (("authorization", f"Bearer {self.stack.tokens['alice']}"),)


def capability() -> str:
    return bounds.encode_lease_capability(secrets.token_bytes(32))


async def build_world(stack: Stack) -> World:
    """A task with a revision, one Run taken to `succeeded` (terminal: a watch of it ends)
    and one Run whose Attempt is `starting` (a live fence), all through ingress."""
    meta = (("authorization", f"Bearer {stack.tokens['alice']}"),)
    async with stack.channel(stack.operator_identity("ops")) as channel:
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        task = (
            await tasks.CreateTask(
                task_service_pb2.CreateTaskRequest(
                    project_id=PROJECT,
                    request_id="prop-task",
                    display_name="property",
                    labels={"team": "core"},
                ),
                metadata=meta,
            )
        ).task
        plan = execution_pb2.ExecutionPlan(
            executor_type=execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER,
            command=["echo", "hi"],
            timeout_ms=60_000,
            retry_policy=execution_pb2.RetryPolicy(
                max_attempts=2,
                initial_backoff_ms=1000,
                max_backoff_ms=2000,
                backoff_multiplier_percent=200,
                retry_on=[execution_pb2.RETRYABLE_OUTCOME_FAILED],
            ),
        )
        await tasks.CreateTaskRevision(
            task_service_pb2.CreateTaskRevisionRequest(
                project_id=PROJECT, task_id=task.task_id, request_id="prop-rev-1", plan=plan
            ),
            metadata=meta,
        )
        run_ids = [
            (
                await runs.TriggerRun(
                    run_service_pb2.TriggerRunRequest(
                        project_id=PROJECT, task_id=task.task_id, request_id=f"prop-run-{n}"
                    ),
                    metadata=meta,
                )
            ).run.run_id
            for n in (1, 2)
        ]
    async with stack.channel(stack.worker_identity("worker-a")) as channel:
        worker = worker_service_pb2_grpc.WorkerServiceStub(channel)
        session = await worker.OpenSession(
            ws.OpenSessionRequest(
                request_id="prop-session",
                worker_id="worker-a",
                agent_version="property/1",
                executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                max_concurrent_attempts=4,
            )
        )
        offers = (
            await worker.PullOffers(
                ws.PullOffersRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    max_offers=4,
                )
            )
        ).offers
        fences: dict[str, fence_pb2.Fence] = {}
        for offer in offers:
            token = capability()
            claimed = await worker.ClaimOffer(
                ws.ClaimOfferRequest(
                    worker_id="worker-a",
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    offer_id=offer.offer_id,
                    project_id=PROJECT,
                    run_id=offer.run_id,
                    lease_token=token,
                )
            )
            fences[offer.run_id] = fence_pb2.Fence(
                worker_id="worker-a",
                session_id=session.session_id,
                worker_generation=session.worker_generation,
                project_id=PROJECT,
                run_id=offer.run_id,
                attempt_id=claimed.attempt_id,
                offer_id=offer.offer_id,
                lease_generation=claimed.lease_generation,
                lease_token=token,
                expected_lease_version=claimed.lease_version,
            )
            await worker.AcknowledgeStarting(
                ws.AcknowledgeStartingRequest(fence=fences[offer.run_id])
            )
        done, live = fences[run_ids[0]], fences[run_ids[1]]
        await worker.AcknowledgeRunning(
            ws.AcknowledgeRunningRequest(
                fence=done,
                executor_handle="pid:1;start:1",
                callback_sequence=1,
                callback_token_digest="cd" * 32,
            )
        )
        await worker.CompleteAttempt(
            ws.CompleteAttemptRequest(
                fence=done,
                callback_sequence=1,
                outcome=worker_pb2.ATTEMPT_OUTCOME_SUCCEEDED,
                exit_code=0,
            )
        )
    async with stack.channel(stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        page = await runs.ListRuns(
            run_service_pb2.ListRunsRequest(project_id=PROJECT, page_size=1), metadata=meta
        )
        tasks = task_service_pb2_grpc.TaskServiceStub(channel)
        await tasks.CreateTask(
            task_service_pb2.CreateTaskRequest(
                project_id=PROJECT, request_id="prop-task-2", display_name="property 2"
            ),
            metadata=meta,
        )
        task_page = await tasks.ListTasks(
            task_service_pb2.ListTasksRequest(project_id=PROJECT, page_size=1), metadata=meta
        )
    assert page.next_page_token, "two runs and a page of one: there is a next page"
    assert task_page.next_page_token, "two tasks and a page of one: there is a next page"

    fence_texts = ("session_id", "run_id", "attempt_id", "offer_id", "lease_token")
    worker_known = Known(
        texts={
            "worker_id": ["worker-a"],
            "project_id": [PROJECT],
            "request_id": ["prop-session"],
            "agent_version": ["property/1"],
            "executor_handle": ["pid:1;start:1"],
            "callback_token_digest": ["cd" * 32],
            "error_summary": ["exec: not found"],
            "summary": ["done"],
            **{name: [getattr(f, name) for f in (live, done)] for name in fence_texts},
        },
        ints={
            "worker_generation": [session.worker_generation],
            "lease_generation": [live.lease_generation],
            "expected_lease_version": [live.expected_lease_version, 2, 3],
            "callback_sequence": [1, 2],
            "max_offers": [4],
            "max_concurrent_attempts": [4],
            "exit_code": [0, 1],
        },
        messages={"fence": [live.SerializeToString(), done.SerializeToString()]},
    )
    operator_known = Known(
        texts={
            "project_id": [PROJECT],
            "task_id": [task.task_id],
            "run_id": [run_ids[0]],  # terminal only: a watch of it ends by itself
            "request_id": ["prop-task", "prop-rev-1", "prop-run-1"],
            "mutation_id": ["prop-cancel"],
            "display_name": ["property"],
        },
        ints={"revision_number": [1], "page_size": [0, 1], "after_sequence": [0, 3]},
        messages={"plan": [plan.SerializeToString()]},
    )
    return World(
        stack,
        worker_known,
        operator_known,
        sanity_run_id=run_ids[0],
        page_tokens={
            "ListRuns": [page.next_page_token],
            "ListTasks": [task_page.next_page_token],
        },
    )


@pytest.fixture(scope="module")
async def world(
    postgres_clusters: Clusters, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[World]:
    """One stack and one database for the whole module: each example is one call."""
    with postgres_clusters.get(18).database() as database:
        async with running_stack(database, tmp_path_factory.mktemp("pki")) as stack:
            built = await build_world(stack)
            try:
                yield built
            finally:
                await built.close()


# --- strategies: values ----------------------------------------------------------------

#: Integers at every edge a 32- or 64-bit field, JavaScript or PostgreSQL cares about.
INT_EXTREMES: Final = (
    0,
    1,
    -1,
    2,
    bounds.INT32_MAX,
    bounds.INT32_MIN,
    bounds.INT32_MAX + 1,
    2**32 - 1,
    2**32,
    bounds.MAX_SAFE_INTEGER,
    bounds.MAX_SAFE_INTEGER + 1,
    2**63 - 1,
    -(2**63),
    2**64 - 1,
)

#: Classic malformed UTF-8: a lone continuation byte, a truncated sequence, an overlong
#: encoding, an encoded surrogate, a code point beyond U+10FFFF, bytes never used.
INVALID_UTF8: Final = (
    b"\x80",
    b"\xc3",
    b"\xc3\x28",
    b"\xc0\xaf",
    b"\xe0\x80\xaf",
    b"\xed\xa0\x80",
    b"\xf4\x90\x80\x80",
    b"\xff",
    b"\xfe\xff",
)

#: Text that passes no rule: controls, NUL, a valid id plus a newline, other spellings.
FORGED_TEXTS: Final = (
    "",
    "\x00",
    "worker-a\n",
    "proj-a\x00",
    "WORKER-A",
    "-leading",
    "../../etc/passwd",
    "'; DROP TABLE qinglong.runs; --",
    "%s%s%n",
    "\u202eevil",
    "\x1b[31mred",
    "\x9b31mred",
    "line\x85break",
    "FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF",
    "{6f1c8d3a-2b4e-4f5a-9c7d-8e9f0a1b2c3d}",
    "6f1c8d3a2b4e4f5a9c7d8e9f0a1b2c3d",
    "urn:uuid:6f1c8d3a-2b4e-4f5a-9c7d-8e9f0a1b2c3d",
    "qlc1_" + "A" * 42 + "=",
    "qlc1_" + "+/" * 21 + "A",
    "Bearer qlo1_" + "x" * 43,
)


def _page_token_of(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode("ascii").rstrip("=")


def longest(rule: FieldRule, character: str) -> str:
    """``character`` repeated to the longest length the rule's pattern allows; fails if
    the rule does not accept it (so a test never believes it sends the maximum when it
    sends something ingress refuses)."""
    value = character * rule.lengths[1]
    assert rule.regex.fullmatch(value), (rule.kind, character)
    assert not rule.regex.fullmatch(value + character), (rule.kind, character)
    return value


def uuid_of(digit: str) -> str:
    """The UUID whose every hex digit is ``digit`` (the smallest and the largest)."""
    return str(uuid.UUID(digit * 32))


#: Cursors no server issues: outside bigint, outside the epoch, around 2^53.
CURSOR_EXTREMES: Final = (*INT_EXTREMES, 2**63, -(2**63) - 1, 10**30, -(10**30))


#: The page token's declared rule (every list request has the same one).
PAGE_TOKEN: Final = field_rule(run_service_pb2.ListRunsRequest, "page_token")
assert PAGE_TOKEN.kind is Kind.PAGE_TOKEN


def forged_page_tokens() -> st.SearchStrategy[str]:
    """Tokens in the page-token alphabet that this server never issued, mostly shaped like
    its own (``<ms>:<run id>``, base64url) so they pass ingress and reach control: cursors
    outside bigint or the epoch, other spellings of the number or the run id."""
    cursor = st.one_of(st.sampled_from(CURSOR_EXTREMES), st.integers()).map(str)
    respelled = st.sampled_from(["", "x", "1e3", " 7", "+5", "1_000", "٣", "0x10", "-0"])
    run = st.one_of(
        st.uuids().map(str),
        st.uuids().map(str),
        st.uuids().map(lambda u: u.hex),
        st.uuids().map(lambda u: "{" + str(u) + "}"),
        st.just(""),
    )
    own_shape = st.tuples(cursor, st.uuids().map(str))
    other_shape = st.tuples(st.one_of(cursor, respelled), run)
    raw = st.binary(max_size=64).map(lambda b: base64.urlsafe_b64encode(b).decode().rstrip("="))
    return st.one_of(
        own_shape.map(lambda pair: _page_token_of(f"{pair[0]}:{pair[1]}")),
        own_shape.map(lambda pair: _page_token_of(f"{pair[0]}:{pair[1]}")),
        other_shape.map(lambda pair: _page_token_of(f"{pair[0]}:{pair[1]}")),
        raw,
        st.from_regex(PAGE_TOKEN.regex, fullmatch=True),
        st.just(longest(PAGE_TOKEN, "A")),
    )


def _utf8_prefix(text: str, max_bytes: int) -> str:
    return text.encode()[:max_bytes].decode("utf-8", errors="ignore")


#: Printable text: no C0/C1 controls (Cc) and no surrogates (Cs).
PRINTABLE: Final = st.characters(exclude_categories=("Cc", "Cs"))
#: Characters that cost the most bytes: 4-byte UTF-8, and JSON's escaped characters.
HEAVY_CHARACTERS: Final = ("x", "é", "€", "\U0001f600", '"', "\\")


def bounded_bytes_text(max_bytes: int, min_bytes: int = 1) -> st.SearchStrategy[str]:
    """Printable text within a byte bound, often at its exact maximum in characters of
    1-4 bytes and in characters JSON must escape."""
    fill = [c * (max_bytes // len(c.encode())) for c in HEAVY_CHARACTERS]
    drawn = st.text(PRINTABLE, min_size=min_bytes, max_size=min(max_bytes, 80)).map(
        lambda t: _utf8_prefix(t, max_bytes)
    )
    return st.one_of(drawn.filter(lambda t: len(t.encode()) >= min_bytes), st.sampled_from(fill))


def bounded_chars_text(max_chars: int, min_chars: int = 1) -> st.SearchStrategy[str]:
    fill = [c * max_chars for c in HEAVY_CHARACTERS]
    drawn = st.text(PRINTABLE, min_size=min_chars, max_size=min(max_chars, 80))
    return st.one_of(drawn, st.sampled_from(fill))


def valid_text(rule: FieldRule) -> st.SearchStrategy[str]:
    """Values a text field's declared rule accepts: they pass ingress, so a request made
    of them reaches control and the database. Often at the rule's own maximum."""
    return _VALID_TEXT[rule]


def _valid_text(rule: FieldRule) -> st.SearchStrategy[str]:
    shortest, most = rule.lengths
    if rule.kind is Kind.SLUG:
        return st.one_of(st.from_regex(rule.regex, fullmatch=True), st.just(longest(rule, "z")))
    if rule.kind is Kind.UUID:
        return st.one_of(
            st.uuids().map(str),
            st.sampled_from([uuid_of("0"), uuid_of("f")]),
        )
    if rule.kind is Kind.UUID_OR_EMPTY:
        return st.one_of(st.just(""), st.uuids().map(str))
    if rule.kind is Kind.REQUEST_ID:
        return st.one_of(st.from_regex(rule.regex, fullmatch=True), st.just(longest(rule, ":")))
    if rule.kind is Kind.SHA256_HEX:
        return st.from_regex(rule.regex, fullmatch=True)
    if rule.kind is Kind.PAGE_TOKEN:
        return forged_page_tokens()
    if rule.kind is Kind.BYTES_TEXT:
        return bounded_bytes_text(most, shortest)
    if rule.kind is Kind.CHARS_TEXT:
        return bounded_chars_text(most, shortest)
    if rule.kind is Kind.LEASE_CAPABILITY:
        secret = bounds.LEASE_CAPABILITY_SECRET_BYTES
        return st.binary(min_size=secret, max_size=secret).map(bounds.encode_lease_capability)
    if rule.kind is Kind.JOIN_TOKEN:
        secret = bounds.LEASE_CAPABILITY_SECRET_BYTES
        return st.binary(min_size=secret, max_size=secret).map(join_token_of)
    if rule.kind is Kind.PEM:
        return st.sampled_from(SIGNING_REQUESTS)
    raise AssertionError(f"{rule.kind} is not a text kind")


def valid_bytes(rule: FieldRule) -> st.SearchStrategy[bytes]:
    """Any bytes within the bounds, often at the maximum (executor output: any value)."""
    shortest, most = rule.lengths
    return st.one_of(
        st.binary(min_size=shortest, max_size=min(most, 80)),
        st.sampled_from([b"\x00" * most, b"\xff" * most, bytes(range(256)) * (most // 256)]),
    )


def hostile_bytes(rule: FieldRule) -> st.SearchStrategy[bytes]:
    """Empty, or one byte past the bound."""
    shortest, most = rule.lengths
    return st.sampled_from([b"" if shortest else b"\x00", b"a" * (most + 1)])


def join_token_of(secret: bytes) -> str:
    """A join token's spelling of 32 bytes (what AdminService.CreateWorker issues)."""
    return "qlj1_" + bounds.encode_lease_capability(secret).removeprefix("qlc1_")


#: Real CSRs of fresh keys: what a joining Worker sends (made once; keys are slow).
SIGNING_REQUESTS: Final = tuple(signing_request(new_private_key()) for _ in range(3))


def forged_valid_text(rule: FieldRule) -> st.SearchStrategy[str]:
    """Well-formed values that are forged: they pass ingress and must be refused by control."""
    if rule.kind is not Kind.LEASE_CAPABILITY:
        return valid_text(rule)
    return st.one_of(
        valid_text(rule),
        st.sampled_from(
            [
                bounds.encode_lease_capability(bytes(32)),  # well shaped but weak
                bounds.encode_lease_capability(bytes(range(32))),  # a progression
                "qlc1_" + "A" * 43,
            ]
        ),
    )


#: Every rule of every field reachable from a public request, by the field's full name.
#: Building it classifies them all: a field whose rule is of a kind these generators do
#: not know fails the module at import instead of being generated as something else.
RULES: Final = {
    f.full_name: rule
    for method in METHODS
    for _, f, rule in ruled_fields(method.descriptor.input_type)
}
_VALID_TEXT: Final = {
    rule: _valid_text(rule) for rule in set(RULES.values()) if rule.kind in TEXT_KINDS
}


def rule_of(message: Descriptor, name: str) -> FieldRule:
    return RULES[message.fields_by_name[name].full_name]


#: Lengths one past every length bound the contract declares, and around the byte caps.
LONG_LENGTHS: Final = tuple(
    sorted(
        {rule.max_length + 1 for rule in RULES.values() if rule.max_length is not None}
        | {bounds.WORKER_REQUEST_MAX_BYTES - 64, bounds.WORKER_REQUEST_MAX_BYTES + 1}
    )
)

#: Text no rule accepts, or bytes that are not text at all.
HOSTILE_TEXT: Final = st.one_of(
    st.sampled_from(FORGED_TEXTS).map(str.encode),
    st.text(max_size=40).map(str.encode),
    st.tuples(st.text(max_size=8), st.sampled_from(INVALID_UTF8), st.text(max_size=8)).map(
        lambda parts: parts[0].encode() + parts[1] + parts[2].encode()
    ),
    st.binary(max_size=40),
    st.tuples(st.sampled_from(LONG_LENGTHS), st.sampled_from([b"a", b"\xc3\xa9", b"\x00"])).map(
        lambda pair: pair[1] * (pair[0] // len(pair[1]))
    ),
    forged_page_tokens().map(str.encode),
)


def hostile_int(rule: FieldRule) -> st.SearchStrategy[int]:
    """Edges of the field's own range (both sides), extremes, and anything in 64 bits."""
    options = [
        st.sampled_from(INT_EXTREMES),
        st.integers(min_value=-(2**63), max_value=2**64 - 1),
    ]
    if rule.kind is Kind.INT_RANGE:
        low, high = rule.int_range
        edges = [low - 1, low, high, high + 1]
        options = [st.sampled_from(edges), st.sampled_from(edges), *options]
    return st.one_of(options)


def hostile_enum(field_descriptor: FieldDescriptor) -> st.SearchStrategy[int]:
    enum = field_descriptor.enum_type
    assert enum is not None
    declared = sorted(enum.values_by_number)
    undeclared = [max(declared) + 1, -1, 99, bounds.INT32_MAX, bounds.INT32_MIN, 2**32, 2**63]
    return st.one_of(st.sampled_from(declared), st.sampled_from(undeclared))


# --- strategies: messages --------------------------------------------------------------


@dataclass
class Built:
    """A request as bytes and every text it carries (to check nothing is echoed)."""

    body: bytes
    texts: list[str]


Draw = Callable[[st.SearchStrategy[Any]], Any]

#: How the fields of one message are chosen (repeats weigh the draw): all from the real
#: world and the rules ("faithful"); all of that but one field (sometimes two) made
#: hostile or left out ("one_off"), so the rest gets the request past ingress; or each
#: field independently, with duplicates, unknown fields and any order ("chaos").
MODES: Final = ("faithful", "faithful", "one_off", "one_off", "one_off", "one_off", "chaos")


#: Fields whose value decides whose request it is (ingress binds them to the caller).
SCOPING_FIELDS: Final = frozenset({"project_id", "worker_id", "session_id"})


class Builder:
    def __init__(self, draw: Draw, known: Known) -> None:
        self.draw = draw
        self.known = known
        self.texts: list[str] = []

    def remember(self, raw: bytes) -> None:
        """Note a sent text, to check that no answer echoes it. Invalid UTF-8 never
        decodes on the server either: there is nothing of it to echo."""
        with contextlib.suppress(UnicodeDecodeError):
            self.texts.append(raw.decode())

    # one value --------------------------------------------------------------------

    def text(self, message: Descriptor, name: str, hostile: bool) -> bytes:
        rule = rule_of(message, name)
        if rule.kind is Kind.OPAQUE_BYTES:
            # Data, not an identifier or a secret: nothing to remember for the echo check.
            return bytes(self.draw(hostile_bytes(rule) if hostile else valid_bytes(rule)))
        known = self.known.texts.get(name, [])
        if hostile:
            options = [HOSTILE_TEXT]
            if rule.kind in TEXT_KINDS:  # not argv's items: they have no forged kind
                options.append(forged_valid_text(rule).map(str.encode))
            raw: bytes = self.draw(st.one_of(options))
        else:
            valid = valid_text(rule)
            # An identity another principal owns only earns PERMISSION_DENIED: stay real.
            weight = 3 if name in SCOPING_FIELDS else 1
            options = [st.sampled_from(known)] * weight + [valid] if known else [valid]
            raw = self.draw(st.one_of(options))
            raw = raw.encode() if isinstance(raw, str) else raw
        self.remember(raw)
        return raw

    def integer(self, message: Descriptor, field_descriptor: FieldDescriptor, hostile: bool) -> int:
        rule = rule_of(message, field_descriptor.name)
        known = self.known.ints.get(field_descriptor.name, [])
        strategy: st.SearchStrategy[int]
        if field_descriptor.enum_type is not None:
            declared = list(rule.allowed or ()) or [
                n for n in field_descriptor.enum_type.values_by_number if n != 0
            ]
            strategy = hostile_enum(field_descriptor) if hostile else st.sampled_from(declared)
        elif rule.kind is Kind.BOOL:
            # Any varint is a bool on the wire; a valid one is 0 or 1.
            strategy = st.sampled_from(INT_EXTREMES) if hostile else st.sampled_from([0, 1])
        elif hostile:
            strategy = hostile_int(rule)
        else:
            low, high = rule.int_range
            in_range = st.one_of(st.sampled_from([low, high]), st.integers(low, high))
            strategy = st.one_of(st.sampled_from(known), in_range) if known else in_range
        value: int = self.draw(strategy)
        return value

    # one field --------------------------------------------------------------------

    def field(
        self, message: Descriptor, field_descriptor: FieldDescriptor, hostile: bool, depth: int
    ) -> bytes:
        f = field_descriptor
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            return self.map_field(f, hostile)
        if f.is_repeated:
            return self.repeated(message, f, hostile, depth)
        if f.message_type is not None:
            if rule_of(message, f.name).kind is Kind.TIMESTAMP:
                return protowire.length_delimited(f.number, self.timestamp(message, f, hostile))
            return protowire.length_delimited(f.number, self.nested(f, hostile, depth))
        if f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            return protowire.text(f, self.text(message, f.name, hostile))
        return protowire.scalar(f, self.integer(message, f, hostile))

    def timestamp(self, message: Descriptor, f: FieldDescriptor, hostile: bool) -> bytes:
        """A time filter: within the declared window, or any seconds and nanos at all."""
        earliest, latest = rule_of(message, f.name).int_range
        if hostile:
            int64 = [n for n in INT_EXTREMES if -(2**63) <= n < 2**63]  # a Timestamp's seconds
            seconds = self.draw(st.sampled_from(int64) | st.integers(-(2**63), 2**63 - 1))
            nanos = self.draw(st.integers(-(2**31), 2**31 - 1))
        else:
            seconds = self.draw(st.integers(earliest, latest))
            nanos = self.draw(st.integers(0, 999_999_999))
        return Timestamp(seconds=seconds, nanos=nanos).SerializeToString()

    def nested(self, f: FieldDescriptor, hostile: bool, depth: int) -> bytes:
        """A nested message: a real one, one built like any other, or, when it is the
        hostile field, one with a hostile field of its own, random bytes or nothing."""
        assert f.message_type is not None
        if hostile:
            choice = self.draw(st.sampled_from(["one_off", "one_off", "chaos", "bytes", "empty"]))
            if choice == "bytes":
                raw: bytes = self.draw(st.binary(max_size=64))
                return raw
            if choice == "empty":
                return b""
            return self.message(f.message_type, depth + 1, mode=choice)
        known = self.known.messages.get(f.name, [])
        if known and self.draw(st.booleans()):
            real: bytes = self.draw(st.sampled_from(known))
            return real
        return self.message(f.message_type, depth + 1, mode="faithful")

    def repeated(self, message: Descriptor, f: FieldDescriptor, hostile: bool, depth: int) -> bytes:
        if f.type == FieldDescriptor.TYPE_STRING and rule_of(message, f.name).kind is Kind.SLUG_SET:
            return self.slug_set(message, f, hostile)
        if f.type == FieldDescriptor.TYPE_STRING:
            return self.command(message, f, hostile)
        if f.message_type is not None:
            count = self.draw(st.integers(0, 3))
            return b"".join(
                protowire.length_delimited(f.number, self.nested(f, hostile, depth))
                for _ in range(count)
            )
        count = self.draw(st.integers(0, 12 if hostile else 3))
        values = [self.integer(message, f, hostile) for _ in range(count)]
        if hostile and self.draw(st.booleans()):
            return b"".join(protowire.scalar(f, v) for v in values)  # the unpacked form
        return protowire.packed(f, values) if values else b""

    def slug_set(self, message: Descriptor, f: FieldDescriptor, hostile: bool) -> bytes:
        """Distinct slugs (the world's project among them, or made up), up to the maximum;
        or hostile items, repeats and one too many."""
        rule = rule_of(message, f.name)
        most = rule.items[1]
        slug = FieldRule(Kind.SLUG, min_length=rule.min_length, max_length=rule.max_length,
                         pattern=rule.pattern)  # fmt: skip
        if hostile:
            count = self.draw(st.sampled_from([1, 2, most + 1]))
            shape = self.draw(st.sampled_from(["hostile", "repeat", "many"]))
            if shape == "hostile":
                items = [self.draw(HOSTILE_TEXT) for _ in range(min(count, 3))]
            elif shape == "repeat":
                items = [b"dup-slug"] * 2
            else:
                items = [f"p-{index}".encode() for index in range(most + 1)]
        else:
            known = self.known.texts.get("project_id", [PROJECT])
            drawn = self.draw(st.lists(valid_text(slug), max_size=3, unique=True))
            items = list(dict.fromkeys([*known[:1], *drawn]))[: self.draw(st.integers(0, 3))]
            items = [item.encode() if isinstance(item, str) else item for item in items]
        for item in items:
            self.remember(item)
        return b"".join(protowire.text(f, item) for item in items)

    def command(self, message: Descriptor, f: FieldDescriptor, hostile: bool) -> bytes:
        """argv: valid lists up to the declared maxima, or hostile items and counts."""
        rule = rule_of(message, f.name)
        assert rule.kind is Kind.ARGV, (f.full_name, rule.kind)
        if not hostile:
            shape = self.draw(st.sampled_from(["small", "small", "max_items", "max_bytes"]))
            if shape == "max_items":
                items = argv_of_most_items(rule)
            elif shape == "max_bytes":
                items = argv_of_longest_items(rule, '"')
            else:
                items = self.draw(
                    st.lists(st.text(PRINTABLE, min_size=1, max_size=12), min_size=1, max_size=4)
                )
            return b"".join(protowire.text(f, item.encode()) for item in items)
        most = rule.items[1]
        count = self.draw(st.sampled_from([0, 1, 2, most, most + 1]))
        hostile_items = [self.text(message, f.name, hostile=True) for _ in range(min(count, 3))]
        items_raw = hostile_items + [b"x"] * (count - len(hostile_items))
        return b"".join(protowire.text(f, item) for item in items_raw)

    def map_field(self, f: FieldDescriptor, hostile: bool) -> bytes:
        """labels: keys and values by the label rules, at their maxima, or hostile ones."""
        entry = f.message_type
        assert entry is not None
        key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
        rule = RULES[f.full_name]
        most = rule.items[1]
        count = self.draw(st.sampled_from([0, 1, 2, most, most + 1] if hostile else [0, 1, most]))
        key_ok = st.from_regex(rule.regex, fullmatch=True)
        key_max = label_key_max_length(rule)
        value_ok = bounded_bytes_text(rule.lengths[1], 0)
        out = []
        for index in range(count):
            bad = hostile and index < 2 and self.draw(st.booleans())
            # A distinct prefix per entry: a map keeps one value per key.
            key = (
                self.draw(HOSTILE_TEXT)
                if bad
                else (map_key(rule, index) + self.draw(key_ok))[:key_max]
            )
            value = self.draw(HOSTILE_TEXT) if bad else self.draw(value_ok)
            raw_key = key if isinstance(key, bytes) else key.encode()
            raw_value = value if isinstance(value, bytes) else value.encode()
            self.remember(raw_key)
            self.remember(raw_value)
            out.append(
                protowire.length_delimited(
                    f.number,
                    protowire.text(key_field, raw_key) + protowire.text(value_field, raw_value),
                )
            )
        return b"".join(out)

    # one message ------------------------------------------------------------------

    def message(self, descriptor: Descriptor, depth: int = 0, mode: str | None = None) -> bytes:
        fields = list(descriptor.fields)
        names = [f.name for f in fields]
        if mode is None:
            mode = self.draw(st.sampled_from(MODES))
        if depth >= 3 or not names:
            mode = "faithful"
        hostile: set[str] = set()
        absent: set[str] = set()
        if mode == "one_off":
            hostile = {self.draw(st.sampled_from(names))}
            extra = self.draw(st.sampled_from(["none", "none", "none", "hostile", "absent"]))
            if extra == "hostile":
                hostile.add(self.draw(st.sampled_from(names)))
            elif extra == "absent":
                absent = {self.draw(st.sampled_from(names))} - hostile
        elif mode == "chaos":
            for name in names:
                choice = self.draw(st.sampled_from(["valid", "hostile", "absent"]))
                if choice == "hostile":
                    hostile.add(name)
                elif choice == "absent":
                    absent.add(name)
        parts = []
        for f in fields:
            if f.name in absent:
                continue
            occurrences = 2 if mode == "chaos" and self.draw(st.booleans()) else 1
            parts.extend(
                self.field(descriptor, f, f.name in hostile, depth) for _ in range(occurrences)
            )
        if mode == "chaos":
            parts.extend(self.unknown_fields(descriptor))
            parts = self.draw(st.permutations(parts))
        return b"".join(parts)

    def unknown_fields(self, descriptor: Descriptor) -> list[bytes]:
        """Field numbers the schema lacks, and known numbers with the wrong wire type."""
        top = max((f.number for f in descriptor.fields), default=0)
        numbers = st.one_of(
            st.sampled_from([top + 1, 15, 16, 100, 19_000, protowire.MAX_FIELD_NUMBER]),
            st.integers(1, protowire.MAX_FIELD_NUMBER),
        )
        wire_types = st.sampled_from(
            [
                protowire.VARINT,
                protowire.FIXED64,
                protowire.LENGTH_DELIMITED,
                protowire.START_GROUP,
                protowire.FIXED32,
            ]
        )
        count = self.draw(st.integers(0, 2))
        payloads = st.binary(max_size=12)
        return [
            protowire.unknown(self.draw(numbers), self.draw(wire_types), self.draw(payloads))
            for _ in range(count)
        ]


@st.composite
def requests(draw: Draw, method: PublicMethod, known: Known) -> Built:
    """Mostly structured requests; sometimes random bytes or a truncated request."""
    builder = Builder(draw, known)
    shape = draw(st.sampled_from(["message"] * 8 + ["random", "truncated"]))
    if shape == "random":
        return Built(draw(st.binary(max_size=256)), [])
    body = builder.message(method.descriptor.input_type)
    if shape == "truncated" and body:
        body = body[: draw(st.integers(0, len(body) - 1))]
    return Built(body, builder.texts)


# --- the call and the properties --------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    code: grpc.StatusCode
    error: grpc.aio.AioRpcError | None


async def call(world: World, method: PublicMethod, body: bytes) -> Answer:
    """Send ``body`` as it is: identity serializers, so the server parses what we built."""
    channel = world.channel(method)
    metadata = world.metadata(method)
    try:
        if method.descriptor.server_streaming:
            stream = channel.unary_stream(method.path)(
                body, metadata=metadata, timeout=STREAM_TIMEOUT_SECONDS
            )
            async for _ in stream:
                break  # the request was accepted; its errors would have come first
            stream.cancel()
        else:
            await channel.unary_unary(method.path)(body, metadata=metadata, timeout=20)
    except grpc.aio.AioRpcError as error:
        return Answer(error.code(), error)
    return Answer(grpc.StatusCode.OK, None)


_INDEX = re.compile(r"\[\d+\]$")


def names_a_field(descriptor: Descriptor, path: str) -> bool:
    """Whether ``path`` (``fence.lease_token``, ``plan.command[3]``, ``fence.12``,
    ``labels``) walks the request's fields; a number is an unknown field's path."""
    current: Descriptor | None = descriptor
    segments = path.split(".")
    for position, segment in enumerate(segments):
        if current is None:
            return False
        name = _INDEX.sub("", segment)
        if name.isdigit():
            return position == len(segments) - 1
        found = current.fields_by_name.get(name)
        if found is None:
            return False
        current = found.message_type
    return True


def contract_allows(method: PublicMethod, body: bytes, issued_tokens: Collection[str]) -> bool:
    """Whether the contract documents ``body`` as a valid request: it decodes, it keeps
    every ``buf.validate`` rule it declares (field and message rules alike, such as a retry
    policy's backoff order) as ingress enforces them, and the few rules the contract
    states only in words hold. Such a request may be refused for what it asks (a fence,
    a missing run) but never as INVALID_ARGUMENT: not by control, not by the database."""
    try:
        request = GetMessageClass(method.descriptor.input_type).FromString(body)
    except DecodeError:
        return False
    if validation.validate_request(request, serialized_size=len(body)):
        return False
    if method.descriptor.name == "CompleteAttempt" and request.stop_reason not in (
        0,
        lifecycle_pb2.CANCEL_REASON_SHUTDOWN,
    ):
        return False  # "only SHUTDOWN ... and only with outcome CANCELLED"
    if (
        method.descriptor.name == "CompleteAttempt"
        and request.stop_reason
        and request.outcome != worker_pb2.ATTEMPT_OUTCOME_CANCELLED
    ):
        return False
    if (
        method.descriptor.name == "CreatePrincipal"
        and request.cluster_admin
        and request.kind != admin_pb2.PRINCIPAL_KIND_USER
    ):
        return False  # "only a user may (an agent is refused INVALID_ARGUMENT)"
    if method.descriptor.name == "SetWorkerProjects" and (
        bool(request.project_ids) == request.all_projects
    ):
        return False  # "Exactly one of project_ids (non-empty) and all_projects is given"
    if "certificate_signing_request_pem" in method.descriptor.input_type.fields_by_name:
        # "a PKCS#10 certificate signing request ... signed with the Worker's new key"
        try:
            IssuingAuthority.requested_key(request.certificate_signing_request_pem)
        except Refused:
            return False
    # "a token from a previous response": any other token may be refused.
    return getattr(request, "page_token", "") in ("", *issued_tokens)


def check_answer(
    method: PublicMethod, built: Built, answer: Answer, issued_tokens: Collection[str] = ()
) -> None:
    assert answer.code not in FORBIDDEN, f"{method.path} answered {answer.code.name}"
    error = answer.error
    if error is None or answer.code in TRANSPORT_CODES:
        return
    info = error_info_of(error)
    assert info is not None, f"{method.path}: {answer.code.name} without an ErrorInfo"
    violations = field_violations_of(error)
    echoed = [error.details() or "", *info.metadata.values()]
    echoed += [part for violation in violations for part in violation]
    for sent in built.texts:
        if len(sent) >= ECHO_MIN_LENGTH:
            assert not any(sent in text for text in echoed), f"{method.path} echoed a value"
    if answer.code != grpc.StatusCode.INVALID_ARGUMENT:
        return
    assert not contract_allows(method, built.body, issued_tokens), (
        f"{method.path}: the contract allows this request, yet it was refused as invalid: "
        f"{violations}"
    )
    assert info.reason in INVALID_ARGUMENT_REASONS, info.reason
    assert violations, f"{method.path}: INVALID_ARGUMENT ({info.reason}) without a BadRequest"
    request = method.descriptor.input_type
    # Only bytes that do not decode may be refused as a whole message; a request that
    # decodes is refused field by field (the whole-request path is for its size).
    whole = {validation.WHOLE_REQUEST} | (
        {request.full_name} if undecodable(request, built) else set()
    )
    for path, description in violations:
        assert description, "every violation says which rule it broke"
        assert path in whole or names_a_field(request, path), (
            f"{method.path}: violation {path!r} names no field of {request.full_name}"
        )


def undecodable(request: Descriptor, built: Built) -> bool:
    try:
        GetMessageClass(request).FromString(built.body)
    except DecodeError:
        return True
    return False


async def still_serving(world: World) -> None:
    """Both servers answer a sane call: nothing the examples sent took them down."""
    async with world.stack.channel(world.stack.operator_identity("ops")) as channel:
        runs = run_service_pb2_grpc.RunServiceStub(channel)
        got = await runs.GetRun(
            run_service_pb2.GetRunRequest(project_id=PROJECT, run_id=world.sanity_run_id),
            metadata=world.operator_metadata,
            timeout=10,
        )
    assert got.run.run_id == world.sanity_run_id


# --- the sweep: every field at every edge ------------------------------------------------
#
# Random generation finds combinations; it rarely lands on one specific extreme value in
# one specific field of an otherwise real request. The sweep does exactly that, for every
# leaf field of every method's request (nested ones included) and every edge of its type.

#: 4 bytes in UTF-8: a byte bound filled with it holds a quarter as many characters, and a
#: character bound filled with it is four times as many bytes.
WIDE: Final = "\U0001f600"


def valid_default(rule: FieldRule) -> str:
    """A valid stand-in for a text field the real world has no value for."""
    shortest, most = rule.lengths
    if rule.kind is Kind.SLUG:
        # Not the world's project: an admin method could disable it for every other test.
        value = "sweep-a"
    elif rule.kind is Kind.UUID:
        value = "6f1c8d3a-2b4e-4f5a-9c7d-8e9f0a1b2c3d"
    elif rule.kind in (Kind.UUID_OR_EMPTY, Kind.PAGE_TOKEN):
        value = ""
    elif rule.kind is Kind.REQUEST_ID:
        value = "sweep-1"
    elif rule.kind is Kind.SHA256_HEX:
        value = "cd" * 32
    elif rule.kind in (Kind.BYTES_TEXT, Kind.CHARS_TEXT):
        value = "sweep/1"[:most].ljust(shortest, "s")
    elif rule.kind is Kind.LEASE_CAPABILITY:
        value = bounds.encode_lease_capability(hashlib.sha256(b"sweep").digest())
    elif rule.kind is Kind.JOIN_TOKEN:
        value = join_token_of(hashlib.sha256(b"sweep").digest())
    elif rule.kind is Kind.PEM:
        value = SIGNING_REQUESTS[0]
    else:
        raise AssertionError(f"{rule.kind} is not a text kind")
    assert rule.pattern is None or rule.pattern.fullmatch(value), (rule.kind, value)
    return value


def base_request(descriptor: Descriptor, known: Known) -> Message:
    """A request every field of which is real or valid: what the sweep varies one field of."""
    message: Message = GetMessageClass(descriptor)()
    for f in descriptor.fields:
        rule = RULES[f.full_name]
        if rule.kind is Kind.LABELS:
            getattr(message, f.name).update({map_key(rule, 0, 4): "core"})
        elif rule.kind is Kind.TIMESTAMP:
            continue  # a time filter is optional; absent is within bounds
        elif f.message_type is not None:
            real = known.messages.get(f.name)
            sub = (
                GetMessageClass(f.message_type).FromString(real[0])
                if real
                else base_request(f.message_type, known)
            )
            getattr(message, f.name).CopyFrom(sub)
        elif rule.kind is Kind.ARGV:
            getattr(message, f.name).extend(["echo", "hi"])
        elif rule.kind is Kind.ENUM_SET:
            getattr(message, f.name).extend(declared_values(f)[: rule.items[0]])
        elif rule.kind is Kind.SLUG_SET:
            # The world's project: a Worker the sweep scopes keeps serving it.
            getattr(message, f.name).extend(known.texts.get("project_id", [PROJECT])[:1])
        elif rule.presence:
            continue  # optional scalars: absent is always within bounds
        elif rule.kind is Kind.OPAQUE_BYTES:
            setattr(message, f.name, b"sweep output\n")
        elif rule.kind in TEXT_KINDS:
            real_texts = known.texts.get(f.name)
            setattr(message, f.name, real_texts[0] if real_texts else valid_default(rule))
        elif rule.kind is Kind.BOOL:
            continue  # false, the default, is as valid as true
        elif rule.kind in (Kind.REQUIRED_ENUM, Kind.OPTIONAL_ENUM):
            first = (rule.allowed or (1,))[0]
            setattr(message, f.name, first if rule.kind is Kind.REQUIRED_ENUM else 0)
        else:
            real_ints = known.ints.get(f.name)
            setattr(message, f.name, real_ints[0] if real_ints else max(rule.int_range[0], 1))
    return message


def text_edges(rule: FieldRule) -> list[bytes]:
    """Every string edge: forged texts, invalid UTF-8, lengths past every declared bound
    and the caps, the rule's own maximum and one past it, and well-formed forgeries of
    the rule's own kind (they pass ingress)."""
    most = rule.lengths[1]
    edges = [text.encode() for text in FORGED_TEXTS]
    edges += [b"ok" + INVALID_UTF8[0], INVALID_UTF8[3], b"qlc1_" + INVALID_UTF8[5] * 10]
    edges += [b"a" * length for length in LONG_LENGTHS]
    if rule.kind is Kind.PAGE_TOKEN:
        run = "6f1c8d3a-2b4e-4f5a-9c7d-8e9f0a1b2c3d"
        cursors = (*CURSOR_EXTREMES, "", "x", "+5", " 7", "1_000", "-0")
        edges += [_page_token_of(f"{c}:{run}").encode() for c in cursors]
        edges += [_page_token_of(f"5:{run.replace('-', '')}").encode()]
        edges += [_page_token_of("5").encode(), longest(rule, "A").encode()]
        edges += [b"A" * (most + 1)]
    elif rule.kind is Kind.LEASE_CAPABILITY:
        edges += [
            bounds.encode_lease_capability(bytes(32)).encode(),
            bounds.encode_lease_capability(bytes(range(32))).encode(),
            capability().encode(),
        ]
    elif rule.kind in (Kind.UUID, Kind.UUID_OR_EMPTY):
        edges += [uuid_of("0").encode(), uuid_of("f").encode()]
    elif rule.kind in (Kind.SLUG, Kind.REQUEST_ID):
        edges += [longest(rule, "z").encode(), b"a" * (most + 1)]
    elif rule.kind is Kind.BYTES_TEXT:
        widest = WIDE * (most // len(WIDE.encode()))
        edges += [widest.encode(), (widest + "a").encode(), b"a" * most, b"a" * (most + 1)]
    elif rule.kind is Kind.CHARS_TEXT:
        edges += [(WIDE * most).encode(), (WIDE * (most + 1)).encode(), b"\\" * most]
    elif rule.kind is Kind.JOIN_TOKEN:
        edges += [join_token_of(bytes(32)).encode(), ("qlj1_" + "A" * 44).encode()]
    elif rule.kind is Kind.PEM:
        first = rule.prefix or ""
        edges += [csr.encode() for csr in SIGNING_REQUESTS[:1]]
        edges += [first.ljust(most, "A").encode(), first.ljust(most + 1, "A").encode()]
    return edges


def declared_values(f: FieldDescriptor) -> list[int]:
    """The numbers of an enum field's declared values, UNSPECIFIED (0) left out."""
    assert f.enum_type is not None
    return sorted(n for n in f.enum_type.values_by_number if n)


def timestamp_edges(rule: FieldRule) -> list[bytes]:
    """At and past the window's ends, the extremes of seconds, and nanos out of range."""
    earliest, latest = rule.int_range
    seconds = [*INT_EXTREMES, earliest - 1, earliest, latest, latest + 1]
    stamps = [Timestamp(seconds=s) for s in sorted(set(seconds)) if -(2**63) <= s < 2**63]
    stamps += [Timestamp(seconds=earliest, nanos=n) for n in (-1, 999_999_999, 2**31 - 1)]
    return [stamp.SerializeToString() for stamp in stamps]


def int_edges(f: FieldDescriptor, rule: FieldRule) -> list[int]:
    if rule.kind is Kind.BOOL:
        return [0, 1, 2, 2**64 - 1]  # any varint is a bool on the wire
    if f.enum_type is not None:
        declared = sorted(f.enum_type.values_by_number)
        return [*declared, max(declared) + 1, -1, bounds.INT32_MAX, bounds.INT32_MIN]
    low, high = rule.int_range
    edges = [*INT_EXTREMES, low - 1, low, high, high + 1]
    return sorted(set(edges))


def repeated_edges(f: FieldDescriptor, rule: FieldRule) -> list[bytes]:
    """Whole lists: empty, at and past the item bounds, bad items."""
    most = rule.items[1]
    if rule.kind is Kind.ARGV:
        at_total = [item.encode() for item in argv_of_longest_items(rule, '"')]
        lists: list[list[bytes]] = [
            [],
            [b""],
            [b"a\x00b"],
            [b"ok", INVALID_UTF8[2]],
            [b"a" * (rule.lengths[1] + 1)],
            [b"a"] * (most + 1),
            at_total,
            [*at_total, b"a"],
            [item.encode() for item in argv_of_most_items(rule)],
        ]
        return [b"".join(protowire.text(f, item) for item in items) for items in lists]
    if rule.kind is Kind.SLUG_SET:
        slug_lists: list[list[bytes]] = [
            [],
            [b""],
            [b"Not-A-Slug"],
            [b"a\x00b"],
            [INVALID_UTF8[2]],
            [b"a" * (rule.lengths[1] + 1)],
            [b"same", b"same"],
            [f"p-{index}".encode() for index in range(most)],
            [f"p-{index}".encode() for index in range(most + 1)],
        ]
        return [b"".join(protowire.text(f, item) for item in items) for items in slug_lists]
    declared = declared_values(f)
    full = declared[:most]
    lists_of_ints = [
        [],
        [0],
        [99],
        [-1],
        [declared[0]] * 2,
        declared * 6,
        [2**31 - 1] * 20,
        full,  # as many distinct values as allowed
        [*full, *declared[most : most + 1], declared[0]],  # one more, or a repeat
    ]
    return [protowire.packed(f, values) if values else b"" for values in lists_of_ints]


def map_edges(f: FieldDescriptor, rule: FieldRule) -> list[bytes]:
    """labels: at the entry bound with the heaviest values, past it, bad keys and values."""
    entry = f.message_type
    assert entry is not None
    most, value_max = rule.items[1], rule.lengths[1]
    key_field, value_field = entry.fields_by_name["key"], entry.fields_by_name["value"]
    key_max = label_key_max_length(rule)

    def entries(pairs: list[tuple[bytes, bytes]]) -> bytes:
        return b"".join(
            protowire.length_delimited(
                f.number, protowire.text(key_field, k) + protowire.text(value_field, v)
            )
            for k, v in pairs
        )

    longest_keys = [map_key(rule, i, key_max) for i in range(most)]
    key = map_key(rule).encode()
    heavy = [
        entries(
            [(key.encode(), (c * (value_max // len(c.encode()))).encode()) for key in longest_keys]
        )
        for c in HEAVY_CHARACTERS
    ]
    return [
        *heavy,
        entries([(map_key(rule, i).encode(), b"v") for i in range(most + 1)]),
        entries([(b"Bad Key", b"v")]),
        entries([(b"", b"v")]),
        entries([(key * (key_max + 1), b"v")]),
        entries([(key, b"\x00")]),
        entries([(key, b"a" * (value_max + 1))]),
        entries([(key + INVALID_UTF8[0], b"v")]),
        entries([(key, INVALID_UTF8[4])]),
    ]


@dataclass(frozen=True)
class Variant:
    path: str
    body: bytes
    texts: list[str]


def _texts_of(raw: bytes) -> list[str]:
    with contextlib.suppress(UnicodeDecodeError):
        return [raw.decode()]
    return []


def sweep(descriptor: Descriptor, base: Message, prefix: str = "") -> list[Variant]:
    """The base request with one field set to each of its edges. A singular field is
    overridden by appending it (the last occurrence wins, nested messages merge); a
    repeated one is replaced (the base's items are cleared first)."""
    variants: list[Variant] = []
    for f in descriptor.fields:
        rule = RULES[f.full_name]
        path = prefix + f.name

        def appended(leaf: bytes, f: FieldDescriptor = f) -> bytes:
            return base.SerializeToString() + leaf

        def replaced(leaf: bytes, f: FieldDescriptor = f) -> bytes:
            copy = type(base)()
            copy.CopyFrom(base)
            copy.ClearField(f.name)
            return copy.SerializeToString() + leaf

        if rule.kind is Kind.LABELS:
            variants += [Variant(path, replaced(edge), []) for edge in map_edges(f, rule)]
        elif f.is_repeated:
            variants += [Variant(path, replaced(edge), []) for edge in repeated_edges(f, rule)]
        elif rule.kind is Kind.TIMESTAMP:
            variants += [
                Variant(path, replaced(protowire.length_delimited(f.number, edge)), [])
                for edge in timestamp_edges(rule)
            ]
        elif f.message_type is not None:
            for edge in (b"", b"\xff\xff\xff", protowire.unknown(99, protowire.VARINT, b"\x01")):
                variants.append(
                    Variant(path, appended(protowire.length_delimited(f.number, edge)), [])
                )
            inner = getattr(base, f.name)
            for variant in sweep(f.message_type, inner, path + "."):
                # The varied nested message replaces the base's value of this field.
                wrapped = replaced(protowire.length_delimited(f.number, variant.body))
                variants.append(Variant(variant.path, wrapped, variant.texts))
        elif rule.kind is Kind.OPAQUE_BYTES:
            most = rule.lengths[1]
            edges = [b"", b"\x00", INVALID_UTF8[0], b"\xff" * most, b"a" * (most + 1)]
            variants += [Variant(path, appended(protowire.text(f, edge)), []) for edge in edges]
        elif f.type == FieldDescriptor.TYPE_STRING:
            variants += [
                Variant(path, appended(protowire.text(f, edge)), _texts_of(edge))
                for edge in text_edges(rule)
            ]
        else:
            variants += [
                Variant(path, appended(protowire.scalar(f, edge)), [])
                for edge in int_edges(f, rule)
            ]
    return variants


def fresh(variant: Variant, keys: list[FieldDescriptor], number: int) -> bytes:
    """The variant with a new idempotency key (the last occurrence wins), unless the key is
    what it varies: a replayed key would answer from the first write and never reach the
    database with the varied value."""
    body = variant.body
    for key in keys:
        if variant.path != key.name:
            body += protowire.text(key, f"sweep-{uuid.uuid4().hex[:8]}-{number}".encode())
    return body


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.descriptor.name)
async def test_every_field_at_every_edge_is_answered_typed(
    world: World, method: PublicMethod
) -> None:
    descriptor = method.descriptor.input_type
    base = base_request(descriptor, world.known(method))
    issued = world.issued_page_tokens(method)
    # A base the contract allows: so each variant differs from a valid request in one field.
    assert contract_allows(method, base.SerializeToString(), issued)
    variants = sweep(descriptor, base)
    idempotency_keys = [f for f in descriptor.fields if f.name in ("request_id", "mutation_id")]
    for number, variant in enumerate(variants):
        answer = await call(world, method, fresh(variant, idempotency_keys, number))
        try:
            check_answer(method, Built(variant.body, variant.texts), answer, issued)
        except AssertionError as failure:
            raise AssertionError(f"{variant.path}: {failure}") from None


# --- the tests ------------------------------------------------------------------------------

# Each method gets its own example budget; with ~20 methods the module stays well under a
# minute on two cores. Derandomized: the same examples on every run, in CI and locally.
EXAMPLES_PER_METHOD: Final = 150
PROPERTY: Final = settings(
    max_examples=EXAMPLES_PER_METHOD,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def test_every_public_method_is_covered() -> None:
    assert {m.service for m in METHODS} == {
        "qinglong.worker.v1.WorkerService",
        "qinglong.control.v1.TaskService",
        "qinglong.control.v1.RunService",
        "qinglong.control.v1.ApprovalService",
        "qinglong.admin.v1.AdminService",
        "qinglong.enrollment.v1.EnrollmentService",
    }
    assert {m.path for m in METHODS} == set(validation.REQUEST_BYTE_CAPS)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.descriptor.name)
@PROPERTY
@given(data=st.data())
async def test_no_request_is_answered_internal_or_unknown(
    world: World, method: PublicMethod, data: st.DataObject
) -> None:
    built = data.draw(requests(method, world.known(method)), label="request")
    answer = await call(world, method, built.body)
    reason = None if answer.error is None else error_info_of(answer.error)
    event(f"{answer.code.name} {'' if reason is None else reason.reason}")  # the statistics
    check_answer(method, built, answer, world.issued_page_tokens(method))


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.descriptor.name)
async def test_undecodable_bytes_name_the_message(world: World, method: PublicMethod) -> None:
    """A length that runs past the end: no parser can read this as any message."""
    answer = await call(world, method, b"\x0a\x7f" + b"x" * 8)
    assert answer.code == grpc.StatusCode.INVALID_ARGUMENT
    assert answer.error is not None
    violations = field_violations_of(answer.error)
    assert [path for path, _ in violations] == [method.descriptor.input_type.full_name]


async def test_the_servers_survived(world: World) -> None:
    await still_serving(world)
