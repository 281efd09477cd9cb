"""Typed refusals (SPEC R-ERR-1), piece by piece and without a server.

* ingress names the field of a request whose bytes do not decode, or the message;
* control's page tokens: only what this server issued, never a cursor the database
  cannot hold;
* control's error mapping: a refusal of a field carries a BadRequest naming it; database
  constraints, data errors and outages become typed statuses, never driver text;
* the hand-written wire encoder the property tests use agrees with protobuf.
"""

from __future__ import annotations

import base64
import hashlib
import re
import uuid
from pathlib import Path
from typing import Any, Final

import grpc
import psycopg
import pytest
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from google.rpc import error_details_pb2, status_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from qinglong.control.v1 import run_service_pb2, task_service_pb2
from qinglong.rpc.v1 import execution_pb2, fence_pb2
from qinglong.runtime.v1 import runtime_service_pb2
from qinglong.worker.v1 import worker_service_pb2
from qinglong_control import errors, wire
from qinglong_control.contract_bounds import check_public_request
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_ingress.validation import FieldViolation, undecodable_violation
from qinglong_protocol import bounds

from tests.support import protowire

CONTROL_LEASE: Final = worker_service_pb2.ControlLeaseRequest.DESCRIPTOR
REVISION: Final = task_service_pb2.CreateTaskRevisionRequest.DESCRIPTOR
CREATE_TASK: Final = task_service_pb2.CreateTaskRequest.DESCRIPTOR
FENCE: Final = fence_pb2.Fence.DESCRIPTOR
PLAN: Final = execution_pb2.ExecutionPlan.DESCRIPTOR
RUN_ID: Final = "6f1c8d3a-2b4e-4f5a-9c7d-8e9f0a1b2c3d"

# --- ingress: bytes that do not decode ------------------------------------------------


def _fence_with(token: bytes) -> bytes:
    fence = fence_pb2.Fence(worker_id="worker-a", project_id="proj-a").SerializeToString()
    return fence + protowire.text(FENCE.fields_by_name["lease_token"], token)


@pytest.mark.parametrize(
    ("descriptor", "body", "path"),
    [
        (
            CONTROL_LEASE,
            protowire.length_delimited(1, _fence_with(b"qlc1_\xff")),
            "fence.lease_token",
        ),
        (
            REVISION,
            task_service_pb2.CreateTaskRevisionRequest(project_id="proj-a").SerializeToString()
            + protowire.length_delimited(
                4,
                protowire.text(PLAN.fields_by_name["command"], b"echo")
                + protowire.text(PLAN.fields_by_name["command"], b"\xc0\xaf"),
            ),
            "plan.command[1]",
        ),
        (
            CREATE_TASK,
            protowire.length_delimited(
                4,
                protowire.text(
                    CREATE_TASK.fields_by_name["labels"].message_type.fields_by_name["key"],
                    b"k\x80",
                ),
            ),
            "labels",
        ),
    ],
    ids=["nested", "repeated", "map key"],
)
def test_invalid_utf8_names_its_field(descriptor: Any, body: bytes, path: str) -> None:
    with pytest.raises(DecodeError):  # protobuf refuses these bytes as a whole
        GetMessageClass(descriptor).FromString(body)
    assert undecodable_violation(descriptor, body) == FieldViolation(path, "must be valid UTF-8")


@pytest.mark.parametrize(
    "body",
    [
        b"\x0a\x7f" + b"x" * 8,  # a length past the end
        b"\x0f",  # wire type 7
        b"\x08",  # a varint that never comes
        b"\x0b\x0a\x02hi",  # a group that never ends
        b"\x00\x00",  # field number 0
    ],
)
def test_broken_structure_names_the_message(body: bytes) -> None:
    violation = undecodable_violation(CONTROL_LEASE, body)
    assert violation.field == CONTROL_LEASE.full_name


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(body=st.binary(max_size=200))
def test_the_scanner_never_raises(body: bytes) -> None:
    """It runs inside the transport's deserializer: an exception there is INTERNAL."""
    violation = undecodable_violation(REVISION, body)
    assert violation.field
    assert violation.description


# --- control: page tokens -------------------------------------------------------------


def _token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def test_an_issued_page_token_round_trips() -> None:
    cursor = (1_796_065_556_590, uuid.UUID(RUN_ID))
    assert wire.parse_page_token(wire.page_token(cursor)) == cursor
    assert wire.parse_page_token("") is None


@pytest.mark.parametrize(
    "token",
    [
        _token(f"{2**63}:{RUN_ID}"),  # overflowed bigint in the query: was INTERNAL
        _token(f"{2**64 - 1}:{RUN_ID}"),
        _token(f"{-(2**63) - 1}:{RUN_ID}"),
        _token(f"{10**30}:{RUN_ID}"),
        _token(f"-1:{RUN_ID}"),  # before the epoch: never issued
        _token(f"{bounds.MAX_SAFE_INTEGER + 1}:{RUN_ID}"),
        _token(f"+5:{RUN_ID}"),  # other spellings of an issued cursor
        _token(f" 5:{RUN_ID}"),
        _token(f"1_000:{RUN_ID}"),
        _token(f"05:{RUN_ID}"),
        _token(f"5:{RUN_ID.replace('-', '')}"),
        _token(f"5:{RUN_ID.upper()}"),
        _token(f"5:{{{RUN_ID}}}"),
        _token("5"),
        _token(f"5:{RUN_ID}") + "A",  # not a base64 length
        "A" * bounds.PAGE_TOKEN_MAX_LENGTH,
        "a+b/",
        base64.urlsafe_b64encode(b"\xff\xfe:").decode(),
    ],
)
def test_a_page_token_this_server_never_issued_is_refused_by_field(token: str) -> None:
    with pytest.raises(Refused) as refused:
        wire.parse_page_token(token)
    assert refused.value.reason is Reason.FIELD_INVALID
    assert refused.value.field == "page_token"
    assert token not in str(refused.value)


def test_largest_cursor_is_still_accepted() -> None:
    cursor = (bounds.MAX_SAFE_INTEGER, uuid.UUID(RUN_ID))
    assert wire.parse_page_token(wire.page_token(cursor)) == cursor


def test_parsed_fields_name_themselves() -> None:
    fence = fence_pb2.Fence(
        worker_id="worker-a",
        session_id=RUN_ID,
        worker_generation=1,
        project_id="proj-a",
        run_id=RUN_ID,
        attempt_id=RUN_ID,
        offer_id=RUN_ID,
        lease_generation=1,
        lease_token=bounds.encode_lease_capability(bytes(32)),
        expected_lease_version=1,
    )
    with pytest.raises(Refused) as weak:
        wire.parse_fence(fence)
    assert (weak.value.reason, weak.value.field) == (Reason.CAPABILITY_WEAK, "fence.lease_token")
    fence.expected_lease_version = bounds.MAX_SAFE_INTEGER + 1
    fence.lease_token = bounds.encode_lease_capability(hashlib.sha256(b"sweep").digest())
    # Out of its contract range: control's contract check names the field first.
    forwarded = runtime_service_pb2.ControlLeaseRequest(
        request=worker_service_pb2.ControlLeaseRequest(fence=fence)
    )
    with pytest.raises(Refused) as too_big:
        check_public_request(forwarded)
    assert (too_big.value.reason, too_big.value.field) == (
        Reason.FIELD_INVALID,
        "fence.expected_lease_version",
    )


# --- control: the error mapping -----------------------------------------------------------


class _Diag:
    def __init__(self, constraint: str | None) -> None:
        self.constraint_name = constraint


def database_error(kind: type[psycopg.Error], constraint: str | None = None) -> psycopg.Error:
    """A driver error as psycopg raises it (its class carries the SQLSTATE), naming
    ``constraint`` in its diagnostics and carrying a message full of values that must
    never reach a caller."""

    class Raised(kind):  # type: ignore[misc, valid-type]
        @property
        def diag(self) -> Any:
            return _Diag(constraint)

    return Raised("new row violates check constraint: Failing row contains (secret-value)")


def runtime_request() -> runtime_service_pb2.CreateTaskRequest:
    return runtime_service_pb2.CreateTaskRequest(
        request=task_service_pb2.CreateTaskRequest(project_id="proj-a")
    )


def mapped(error: BaseException) -> status_pb2.Status:
    status = errors.answer_for(error, runtime_request()).status()
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    parsed = status_pb2.Status.FromString(details)
    assert "secret-value" not in status.details
    assert "secret-value" not in str(parsed)
    return parsed


def violations_of(status: status_pb2.Status) -> list[str]:
    found = []
    for detail in status.details:
        bad_request = error_details_pb2.BadRequest()
        if detail.Unpack(bad_request):
            found += [v.field for v in bad_request.field_violations]
    return found


def reason_of(status: status_pb2.Status) -> str:
    for detail in status.details:
        info = error_details_pb2.ErrorInfo()
        if detail.Unpack(info):
            return str(info.reason)
    raise AssertionError("no ErrorInfo")


def test_a_refused_field_is_named_in_a_bad_request() -> None:
    status = mapped(Refused(Reason.FIELD_INVALID, "page_token is bad", field="page_token"))
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert violations_of(status) == ["page_token"]


def test_an_invalid_request_without_a_field_names_its_message() -> None:
    status = mapped(Refused(Reason.CAPABILITY_MALFORMED, "wrong shape"))
    assert violations_of(status) == ["qinglong.control.v1.CreateTaskRequest"]
    not_found = mapped(Refused(Reason.RUN_NOT_FOUND, "no such run"))
    assert violations_of(not_found) == []  # not a refusal of a field


@pytest.mark.parametrize(
    ("error", "code", "reason", "fields"),
    [
        (
            database_error(psycopg.errors.CheckViolation, "tasks_labels_check"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_INVALID",
            ["labels"],
        ),
        (
            database_error(psycopg.errors.CheckViolation, "runs_legal_transition"),
            grpc.StatusCode.ABORTED,
            "STATE_CONFLICT",
            [],
        ),
        (
            database_error(
                psycopg.errors.UniqueViolation, "tasks_project_id_create_request_id_key"
            ),
            grpc.StatusCode.ABORTED,
            "STATE_CONFLICT",
            [],
        ),
        (
            # A Worker identity written before migration 0025 that does not name its
            # Worker: it changes no more, and says why, not INTERNAL.
            database_error(psycopg.errors.CheckViolation, "worker_identities_uri_names_the_worker"),
            grpc.StatusCode.ABORTED,
            "STATE_CONFLICT",
            [],
        ),
        (
            database_error(psycopg.errors.ForeignKeyViolation, "tasks_project_id_fkey"),
            grpc.StatusCode.NOT_FOUND,
            "PROJECT_NOT_FOUND",
            [],
        ),
        (
            database_error(psycopg.errors.NumericValueOutOfRange),
            grpc.StatusCode.INVALID_ARGUMENT,
            "FIELD_INVALID",
            ["qinglong.control.v1.CreateTaskRequest"],
        ),
        (
            database_error(psycopg.errors.AdminShutdown),
            grpc.StatusCode.UNAVAILABLE,
            "STORAGE_UNAVAILABLE",
            [],
        ),
        (
            database_error(psycopg.errors.SerializationFailure),
            grpc.StatusCode.UNAVAILABLE,
            "STORAGE_UNAVAILABLE",
            [],
        ),
        (
            database_error(psycopg.errors.CheckViolation, "a_constraint_nobody_mapped"),
            grpc.StatusCode.INTERNAL,
            "INTERNAL",
            [],
        ),
        (
            database_error(psycopg.errors.UndefinedColumn),
            grpc.StatusCode.INTERNAL,
            "INTERNAL",
            [],
        ),
    ],
    ids=[
        "bound",
        "state guard",
        "idempotency key",
        "misnamed worker",
        "missing parent",
        "data error",
        "outage",
        "serialization",
        "unknown constraint",
        "server bug",
    ],
)
def test_database_errors_become_typed_statuses_without_driver_text(
    error: psycopg.Error, code: grpc.StatusCode, reason: str, fields: list[str]
) -> None:
    status = mapped(error)
    assert status.code == code.value[0]
    assert reason_of(status) == reason
    assert violations_of(status) == fields


def test_every_mapped_constraint_exists_in_the_schema() -> None:
    """A renamed constraint would silently fall back to INTERNAL: keep the names honest."""
    schema = (Path(__file__).resolve().parents[2] / "docs" / "schema.sql").read_text()
    names = (
        set(errors._FIELD_CONSTRAINTS)
        | set(errors._CONFLICT_CONSTRAINTS)
        | set(errors._TAKEN_CONSTRAINTS)
        | set(errors._MISSING_PARENT)
        | {errors.MISNAMED_WORKER}
    )
    # A whole name: one that is only the start of another (runs_x of runs_x_check) is not
    # in the schema.
    missing = sorted(name for name in names if not re.search(rf"\b{re.escape(name)}\b", schema))
    assert missing == []


# --- the test encoder ----------------------------------------------------------------------


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(
    number=st.integers(-(2**63), 2**63 - 1),
    text=st.text(max_size=20),
    items=st.lists(st.integers(0, 3), max_size=5),
)
def test_protowire_agrees_with_protobuf(number: int, text: str, items: list[int]) -> None:
    request = run_service_pb2.ListRunEventsRequest
    fields = request.DESCRIPTOR.fields_by_name
    body = (
        protowire.text(fields["project_id"], text.encode())
        + protowire.scalar(fields["after_sequence"], number)
        + protowire.scalar(fields["page_size"], number)  # an int32 keeps its low 32 bits
    )
    parsed = request.FromString(body)
    low32 = (number + 2**31) % 2**32 - 2**31
    assert (parsed.project_id, parsed.after_sequence, parsed.page_size) == (text, number, low32)
    states = run_service_pb2.ListRunsRequest.DESCRIPTOR.fields_by_name["states"]
    packed = run_service_pb2.ListRunsRequest.FromString(protowire.packed(states, items))
    unpacked = run_service_pb2.ListRunsRequest.FromString(
        b"".join(protowire.scalar(states, item) for item in items)
    )
    assert list(packed.states) == list(unpacked.states) == items
