"""The wire contracts: buf rules, generated-code drift, documented bounds, error helpers.

These tests run offline. buf comes from the ``buf-bin`` dev dependency in the
venv; its absence is a failure, never a skip, because a contract check that
silently does not run proves nothing.
"""

from __future__ import annotations

import asyncio
import base64
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path

import grpc
import pytest
from buf.validate import validate_pb2
from google.protobuf import descriptor_pb2
from google.protobuf.message import Message
from qinglong.control.v1 import run_service_pb2 as rs
from qinglong.control.v1 import task_service_pb2 as ts
from qinglong.rpc.v1 import error_reason_pb2, execution_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_service_pb2, worker_service_pb2_grpc
from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds, errors
from qinglong_protocol.contract_rules import field_rules
from qinglong_protocol.request_bounds import request_violations

from tests.support.contract_fields import pattern_width

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
GENERATOR = REPO_ROOT / "scripts" / "generate_protos.py"
BASELINE = REPO_ROOT / "buf" / "baseline.binpb"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

FDP = descriptor_pb2.FieldDescriptorProto
TEXT_TYPES = {FDP.TYPE_STRING, FDP.TYPE_BYTES}
INTEGER_TYPES = {
    FDP.TYPE_INT32,
    FDP.TYPE_INT64,
    FDP.TYPE_UINT32,
    FDP.TYPE_UINT64,
    FDP.TYPE_SINT32,
    FDP.TYPE_SINT64,
    FDP.TYPE_FIXED32,
    FDP.TYPE_FIXED64,
    FDP.TYPE_SFIXED32,
    FDP.TYPE_SFIXED64,
}
# SourceCodeInfo path components (descriptor.proto field numbers).
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM = 2, 3, 4
ENUM_VALUE, SERVICE_METHOD = 2, 2

REQUIRED_REASONS = [
    "LEASE_VERSION_FENCED",
    "LEASE_TOKEN_MISMATCH",
    "LEASE_EXPIRED",
    "LEASE_NOT_LEASED",
    "SESSION_FENCED",
    "SESSION_EXPIRED",
    "SESSION_NOT_FOUND",
    "OFFER_NOT_FOUND",
    "OFFER_EXPIRED",
    "OFFER_CLAIMED_BY_OTHER_CAPABILITY",
    "FENCE_MISMATCH",
    "STATE_CONFLICT",
    "STARTING_REQUIRED",
    "REPLAY_MISMATCH",
    "EXECUTOR_TYPE_MISMATCH",
    "RUN_NOT_FOUND",
    "TASK_NOT_FOUND",
    "REVISION_NOT_FOUND",
    "PROJECT_NOT_FOUND",
    "ALREADY_EXISTS",
    "CAPABILITY_MALFORMED",
    "CAPABILITY_WEAK",
    "FIELD_INVALID",
    "REQUEST_TOO_LARGE",
    "UNKNOWN_FIELD",
    "PRINCIPAL_MISMATCH",
    "UNAUTHENTICATED_PRINCIPAL",
    "TLS_VERSION_REJECTED",
    "PERMISSION_DENIED",
    "APPROVAL_REQUIRED",
    "ROLE_BINDING_FENCED",
    "CALLER_NOT_INGRESS",
    "AUDIT_UNAVAILABLE",
    "STORAGE_UNAVAILABLE",
    "INTERNAL",
    "CALLBACK_SEQUENCE_FENCED",
    "RUNTIME_UNAVAILABLE",
    "RATE_LIMITED",
    "PRINCIPAL_NOT_FOUND",
    "TOKEN_NOT_FOUND",
    "WORKER_NOT_FOUND",
    "ROLE_BINDING_NOT_FOUND",
]


# --- buf ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def buf() -> str:
    candidate = Path(sys.executable).parent / "buf"
    found = str(candidate) if candidate.is_file() else shutil.which("buf")
    if found is None:
        pytest.fail("buf is not installed (dev dependency buf-bin); run `make bootstrap`")
    return found


def run_buf(buf: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [buf, *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=120
    )


def test_buf_lint(buf: str) -> None:
    result = run_buf(buf, "lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format(buf: str) -> None:
    result = run_buf(buf, "format", "--diff", "--exit-code")
    assert result.returncode == 0, "run `buf format -w`:\n" + result.stdout + result.stderr


def test_buf_breaking_against_baseline(buf: str) -> None:
    assert BASELINE.is_file(), f"missing breaking baseline {BASELINE}"
    result = run_buf(buf, "breaking", "--against", str(BASELINE.relative_to(REPO_ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture(scope="module")
def descriptor_set(
    buf: str, tmp_path_factory: pytest.TempPathFactory
) -> descriptor_pb2.FileDescriptorSet:
    """Every qinglong .proto, with SourceCodeInfo (comments) included."""
    out = tmp_path_factory.mktemp("buf") / "contracts.binpb"
    result = run_buf(buf, "build", "--as-file-descriptor-set", "--exclude-imports", "-o", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert fds.file, "buf built no files"
    assert all(f.HasField("source_code_info") for f in fds.file), "source info missing"
    return fds


# --- generated code -------------------------------------------------------------


def _generated_files(root: Path) -> dict[str, bytes]:
    """Generator-owned files under root/qinglong (not the hand-written root __init__) and
    root/buf (the vendored protovalidate rules, all generated)."""
    files: dict[str, bytes] = {}
    for package in ("qinglong", "buf"):
        for path in sorted((root / package).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            relative = path.relative_to(root)
            is_init = path.name == "__init__.py" and relative.as_posix() != "qinglong/__init__.py"
            if is_init or path.name.endswith(GENERATED_SUFFIXES):
                files[relative.as_posix()] = path.read_bytes()
    return files


def test_generated_code_matches_sources(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(GENERATOR), "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    everything = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    fresh = _generated_files(tmp_path)
    assert everything == set(fresh), f"generator wrote unexpected files: {everything - set(fresh)}"
    committed = _generated_files(PROTO_ROOT)
    assert sorted(set(fresh) - set(committed)) == [], "missing: run `make generate`"
    assert sorted(set(committed) - set(fresh)) == [], "stale: run `make generate`"
    drifted = sorted(name for name in fresh if fresh[name] != committed[name])
    assert drifted == [], f"generated code drifted from the .proto files: {drifted}"
    # Every source has its four generated companions beside it.
    for source in sorted((PROTO_ROOT / "qinglong").rglob("*.proto")):
        stem = source.relative_to(PROTO_ROOT).with_suffix("").as_posix()
        for suffix in GENERATED_SUFFIXES:
            assert stem + suffix in committed, f"{stem}{suffix} not generated"


# --- documented bounds ------------------------------------------------------------


def _comments(
    locations: dict[tuple[int, ...], descriptor_pb2.SourceCodeInfo.Location], path: tuple[int, ...]
) -> str:
    location = locations.get(path)
    if location is None:
        return ""
    return location.leading_comments + location.trailing_comments


def _walk_messages(
    messages: Iterable[descriptor_pb2.DescriptorProto],
    prefix: tuple[int, ...],
    scope: str,
) -> Iterator[tuple[str, tuple[int, ...], descriptor_pb2.DescriptorProto]]:
    """Every message (nested ones too) with its full name and SourceCodeInfo path."""
    for index, message in enumerate(messages):
        path = (*prefix, index)
        name = f"{scope}.{message.name}"
        yield name, path, message
        yield from _walk_messages(message.nested_type, (*path, MESSAGE_NESTED), name)


def _file_problems(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    locations = {tuple(loc.path): loc for loc in file.source_code_info.location}
    problems: list[str] = []

    def need(path: tuple[int, ...], what: str, marker: str = "") -> None:
        text = _comments(locations, path)
        if not text.strip():
            problems.append(f"{file.name}: {what} has no comment")
        elif marker and marker not in text:
            problems.append(f"{file.name}: {what} has no '{marker}' line")

    messages = list(_walk_messages(file.message_type, (FILE_MESSAGE,), "." + file.package))
    map_entries = {name for name, _, message in messages if message.options.map_entry}
    for name, path, message in messages:
        if message.options.map_entry:
            continue  # synthetic; its bound lives on the map field
        need(path, f"message {name}")
        for index, field in enumerate(message.field):
            field_path = (*path, MESSAGE_FIELD, index)
            what = f"field {name}.{field.name}"
            if field.options.HasExtension(validate_pb2.field):
                need(field_path, what)  # the buf.validate rule is its bound
            elif (
                field.type in TEXT_TYPES
                or field.type_name in map_entries
                or field.label == FDP.LABEL_REPEATED
            ):
                need(field_path, what, "Bound:")
            elif field.type in INTEGER_TYPES:
                need(field_path, what, "Range:")
            else:
                need(field_path, what)
        for index, enum in enumerate(message.enum_type):
            need((*path, MESSAGE_ENUM, index), f"enum {name}.{enum.name}")
    for index, enum in enumerate(file.enum_type):
        need((FILE_ENUM, index), f"enum {enum.name}")
        for value_index, value in enumerate(enum.value):
            need((FILE_ENUM, index, ENUM_VALUE, value_index), f"enum value {value.name}")
    for index, service in enumerate(file.service):
        need((FILE_SERVICE, index), f"service {service.name}")
        for method_index, method in enumerate(service.method):
            need(
                (FILE_SERVICE, index, SERVICE_METHOD, method_index),
                f"rpc {service.name}.{method.name}",
            )
    return problems


def _contract_problems(fds: descriptor_pb2.FileDescriptorSet) -> list[str]:
    """Every message, field, enum, value, service and rpc is commented; every
    string/bytes/map/repeated field without a ``buf.validate`` rule has a `Bound:` line
    and every such integer a `Range:` line (a rule states the bound itself)."""
    return [
        problem
        for file in fds.file
        if file.package.startswith("qinglong.")
        for problem in _file_problems(file)
    ]


def test_every_field_documents_its_bound(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    files = {f.name for f in descriptor_set.file}
    for api in ("rpc", "worker", "control", "runtime"):
        assert any(name.startswith(f"qinglong/{api}/v1/") for name in files), api
    assert _contract_problems(descriptor_set) == []


def test_bound_check_catches_a_missing_bound(
    descriptor_set: descriptor_pb2.FileDescriptorSet,
) -> None:
    """The checker itself must fail when a Bound: line disappears."""
    broken = descriptor_pb2.FileDescriptorSet()
    broken.CopyFrom(descriptor_set)
    # A response message: its fields carry no rule, so their comments are the bound.
    run_file = next(f for f in broken.file if f.name == "qinglong/control/v1/run.proto")
    for location in run_file.source_code_info.location:
        if "Bound:" in location.leading_comments:
            location.leading_comments = location.leading_comments.replace("Bound:", "Limit:")
            break
    assert any("'Bound:'" in problem for problem in _contract_problems(broken))


def _responses(fds: descriptor_pb2.FileDescriptorSet) -> dict[str, descriptor_pb2.DescriptorProto]:
    messages: dict[str, descriptor_pb2.DescriptorProto] = {}
    for file in fds.file:
        for name, _, message in _walk_messages(
            file.message_type, (FILE_MESSAGE,), "." + file.package
        ):
            messages[name] = message
    return messages


#: The only secrets a response may carry: a credential AdminService issues, shown in the
#: answer that created it and never again (R-ADM-1, R-ADM-2).
ONE_TIME_SECRETS = frozenset(
    {
        ".qinglong.admin.v1.IssueTokenResponse.token",
        ".qinglong.admin.v1.RotateTokenResponse.token",
        ".qinglong.admin.v1.CreateWorkerResponse.join_token",
        ".qinglong.admin.v1.IssueJoinTokenResponse.join_token",
    }
)


def test_responses_never_carry_secrets(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    """R-SEC-1: no response (transitively) has a token, digest or capability field, but
    for the credentials AdminService issues once."""
    messages = _responses(descriptor_set)
    outputs = [
        method.output_type
        for file in descriptor_set.file
        for service in file.service
        for method in service.method
    ]
    forbidden = re.compile(r"(token|digest|capability|secret|credential)")
    # Names that say something about a token without carrying one.
    allowed = re.compile(r"(next_page_token|token_id|tokens|\w*_expire_time)")
    seen: set[str] = set()
    pending = list(outputs)
    offenders: list[str] = []
    while pending:
        type_name = pending.pop()
        if type_name in seen or type_name not in messages:
            continue  # well-known types (Duration, Timestamp) are not ours
        seen.add(type_name)
        for field in messages[type_name].field:
            name = f"{type_name}.{field.name}"
            if forbidden.search(field.name) and not allowed.fullmatch(field.name):
                offenders.append(name)
            if field.type == FDP.TYPE_MESSAGE:
                pending.append(field.type_name)
    assert len(seen) > 20
    assert sorted(set(offenders) - ONE_TIME_SECRETS) == []
    assert set(offenders) >= ONE_TIME_SECRETS  # the check can see them


# --- error reasons ------------------------------------------------------------------


def test_error_reasons_are_aip193_names(descriptor_set: descriptor_pb2.FileDescriptorSet) -> None:
    values = error_reason_pb2.ErrorReason.DESCRIPTOR.values
    names = []
    for descriptor in values:
        assert descriptor.name.startswith(errors.REASON_PREFIX), descriptor.name
        stripped = descriptor.name.removeprefix(errors.REASON_PREFIX)
        assert re.fullmatch(r"[A-Z][A-Z0-9]*(_[A-Z0-9]+)*", stripped), stripped
        assert len(stripped) <= errors.REASON_MAX_LENGTH, stripped
        names.append(stripped)
    assert values[0].number == 0
    assert values[0].name == "ERROR_REASON_UNSPECIFIED"
    assert sorted(set(REQUIRED_REASONS) - set(names)) == []
    # The code named in each value's comment is the code errors.py sends.
    file = next(f for f in descriptor_set.file if f.name == "qinglong/rpc/v1/error_reason.proto")
    locations = {tuple(loc.path): loc for loc in file.source_code_info.location}
    enum_index = [e.name for e in file.enum_type].index("ErrorReason")
    for index, value in enumerate(file.enum_type[enum_index].value):
        if value.number == 0:
            continue
        comment = _comments(locations, (FILE_ENUM, enum_index, ENUM_VALUE, index))
        match = re.search(r"gRPC code: ([A-Z_]+)\.", comment)
        assert match, f"{value.name} does not name its gRPC code"
        assert errors.code_for(ErrorReason.Value(value.name)).name == match.group(1), value.name


def test_reason_names_round_trip() -> None:
    reason = ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED
    assert errors.reason_name(reason) == "LEASE_VERSION_FENCED"
    assert errors.reason_from_name("LEASE_VERSION_FENCED") == reason
    assert errors.reason_from_name("NOT_A_REASON") is None
    assert errors.reason_from_name("UNSPECIFIED") is None
    with pytest.raises(ValueError, match="never sent"):
        errors.reason_name(ErrorReason.ERROR_REASON_UNSPECIFIED)
    assert set(errors.REASON_CODES) == {
        v.number for v in ErrorReason.DESCRIPTOR.values if v.number != 0
    }


def test_status_for_packs_error_info() -> None:
    status = errors.status_for(
        ErrorReason.ERROR_REASON_FIELD_INVALID,
        "invalid request",
        field_violations=[("fence.lease_token", "malformed")],
    )
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT
    assert status.details == "invalid request"
    keys = [key for key, _ in status.trailing_metadata]
    assert keys == ["grpc-status-details-bin"]


class _AbortingWorkerService(worker_service_pb2_grpc.WorkerServiceServicer):
    """Answers RenewSession with the error whose reason name is the request's session_id."""

    async def RenewSession(
        self,
        request: worker_service_pb2.RenewSessionRequest,
        context: grpc.aio.ServicerContext[
            worker_service_pb2.RenewSessionRequest, worker_service_pb2.RenewSessionResponse
        ],
    ) -> worker_service_pb2.RenewSessionResponse:
        reason = errors.reason_from_name(request.session_id)
        if reason is None:
            return worker_service_pb2.RenewSessionResponse()
        violations = [("worker_id", "not a slug")] if request.worker_id == "bad" else []
        await context.abort_with_status(
            errors.status_for(reason, "generic message", field_violations=violations)
        )


@pytest.fixture
async def worker_server() -> AsyncIterator[str]:
    server = grpc.aio.server()
    # Only RenewSession is served; the other (abstract) methods are never called.
    servicer = _AbortingWorkerService()  # type: ignore[abstract]
    worker_service_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (ErrorReason.ERROR_REASON_LEASE_VERSION_FENCED, grpc.StatusCode.ABORTED),
        (ErrorReason.ERROR_REASON_RUN_NOT_FOUND, grpc.StatusCode.NOT_FOUND),
        (ErrorReason.ERROR_REASON_PRINCIPAL_MISMATCH, grpc.StatusCode.PERMISSION_DENIED),
        (ErrorReason.ERROR_REASON_STORAGE_UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_error_round_trip_over_grpc_aio(
    worker_server: str, reason: ErrorReason.ValueType, code: grpc.StatusCode
) -> None:
    name = errors.reason_name(reason)
    async with grpc.aio.insecure_channel(worker_server) as channel:
        stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
        ok = await stub.RenewSession(worker_service_pb2.RenewSessionRequest(), timeout=5)
        assert isinstance(ok, worker_service_pb2.RenewSessionResponse)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RenewSession(
                worker_service_pb2.RenewSessionRequest(worker_id="bad", session_id=name),
                timeout=5,
            )
    error = caught.value
    assert error.code() == code
    assert error.details() == "generic message"
    assert errors.error_reason_of(error) == name
    info = errors.error_info_of(error)
    assert info is not None
    assert info.domain == errors.ERROR_DOMAIN
    assert errors.field_violations_of(error) == [("worker_id", "not a slug")]


async def test_error_round_trip_over_sync_channel(worker_server: str) -> None:
    name = errors.reason_name(ErrorReason.ERROR_REASON_SESSION_FENCED)

    def call() -> grpc.RpcError:
        with grpc.insecure_channel(worker_server) as channel:
            stub = worker_service_pb2_grpc.WorkerServiceStub(channel)
            try:
                stub.RenewSession(
                    worker_service_pb2.RenewSessionRequest(session_id=name), timeout=5
                )
            except grpc.RpcError as error:
                return error
        raise AssertionError("the call did not fail")

    error = await asyncio.to_thread(call)
    assert errors.error_reason_of(error) == name
    assert errors.field_violations_of(error) == []


async def test_plain_status_has_no_reason(worker_server: str) -> None:
    async with grpc.aio.insecure_channel(worker_server) as channel:
        method: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
            "/qinglong.worker.v1.WorkerService/NoSuchMethod"
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await method(b"", timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert errors.error_reason_of(caught.value) is None


# --- bounds -------------------------------------------------------------------------


def capability(raw: bytes) -> str:
    return "qlc1_" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


GOOD_SECRET = bytes.fromhex("8f3a1c5e7b2d9f4061a8c3e5b7d9f1a3c5e7092b4d6f8a1c3e5b7d9f0a2c4e68")


def _has_capability_shape(value: str) -> bool:
    return bounds.decode_lease_capability(value) is not None


def test_lease_capability_shape() -> None:
    good = capability(GOOD_SECRET)
    assert len(good) == bounds.LEASE_CAPABILITY_LENGTH == 48
    assert _has_capability_shape(good)
    assert bounds.is_acceptable_lease_capability(good)
    assert bounds.decode_lease_capability(good) == GOOD_SECRET
    assert bounds.encode_lease_capability(GOOD_SECRET) == good
    rejected = [
        GOOD_SECRET.hex(),  # 64 hex chars, not the fixed encoding
        capability(GOOD_SECRET[:31]),  # 31 bytes
        capability(GOOD_SECRET + b"\x01"),  # 33 bytes
        good + "=",  # padding
        "qlc1_" + base64.urlsafe_b64encode(GOOD_SECRET).decode("ascii"),  # padded
        "qlc2_" + good[5:],  # wrong version prefix
        "qlc1_" + base64.b64encode(b"\xfb" * 32).rstrip(b"=").decode("ascii"),  # + and /
        good[:-1] + "B",  # non-canonical last char (unused low bits set)
        good + "\n",
        "",
    ]
    for value in rejected:
        assert not _has_capability_shape(value), value
    # Right shape, weak secret.
    for weak in (b"\x00" * 32, bytes(range(32)), b"ab" * 16, bytes(range(0, 256, 8))):
        value = capability(weak)
        assert _has_capability_shape(value)
        assert not bounds.is_acceptable_lease_capability(value), weak
    with pytest.raises(ValueError, match="exactly 32"):
        bounds.encode_lease_capability(b"\x01" * 31)


def test_identifier_validators() -> None:
    assert bounds.is_uuid("0f8fad5b-d9cb-469f-a165-70867728950e")
    assert not bounds.is_uuid("0F8FAD5B-D9CB-469F-A165-70867728950E")
    assert not bounds.is_uuid("0f8fad5bd9cb469fa16570867728950e")
    assert not bounds.is_uuid("0f8fad5b-d9cb-469f-a165-70867728950e\n")
    assert _accepts(rs.ListRunsRequest(project_id="p", task_id=""), "task_id")
    assert bounds.is_slug("edge-01")
    assert bounds.is_slug("a")
    assert bounds.is_slug("0" * 63)
    for bad_slug in ("", "-edge", "Edge", "edge_01", "a" * 64, "edge.01"):
        assert not bounds.is_slug(bad_slug), bad_slug
    assert bounds.is_sha256_hex("ab" * 32)
    assert not bounds.is_sha256_hex("AB" * 32)
    assert not bounds.is_sha256_hex("ab" * 31)
    assert bounds.is_request_id("req-1:a.b_c")
    assert bounds.is_request_id("x" * 64)
    for bad_id in ("", "x" * 65, "has space", "ünicode"):
        assert not bounds.is_request_id(bad_id), bad_id
    assert bounds.is_error_code("EXECUTOR_START_FAILED")
    assert not bounds.is_error_code("executor_start_failed")
    assert bounds.is_event_type("attempt.running")
    assert bounds.is_event_type("run.cancel_requested")
    assert not bounds.is_event_type("running")
    assert not bounds.is_event_type("Run.Running")
    assert _accepts(rs.ListRunsRequest(project_id="p", page_token=""), "page_token")
    assert not _accepts(rs.ListRunsRequest(project_id="p", page_token="a+b"), "page_token")


def test_tasks_page_exactly_like_runs() -> None:
    """ListTasks pages with ListRuns' very rules: one project, one page size range, one
    kind of page token."""
    for field in ("project_id", "page_size", "page_token"):
        assert field_rules(ts.ListTasksRequest, field) == field_rules(rs.ListRunsRequest, field)
    assert [f.name for f in ts.ListTasksRequest.DESCRIPTOR.fields] == [
        "project_id",
        "page_size",
        "page_token",
    ]
    assert [f.name for f in ts.ListTasksResponse.DESCRIPTOR.fields] == ["tasks", "next_page_token"]


def _accepts(request: Message, field: str) -> bool:
    """Whether the contract's rules (as ingress and control enforce them) accept the
    request's ``field``; other fields of the request may be out of bounds."""
    return all(violation.field != field for violation in request_violations(request))


def _handle_ok(value: str) -> bool:
    return _accepts(ws.AcknowledgeRunningRequest(executor_handle=value), "executor_handle")


def _artifact_ok(value: str) -> bool:
    return _accepts(ws.AcknowledgeRunningRequest(log_artifact_id=value), "log_artifact_id")


def _summary_ok(value: str) -> bool:
    return _accepts(ws.ReportStartFailureRequest(error_summary=value), "error_summary")


def _labels_ok(pairs: list[tuple[str, str]]) -> bool:
    return _accepts(ts.CreateTaskRequest(labels=dict(pairs)), "labels")


def _offers_ok(value: int) -> bool:
    return _accepts(ws.PullOffersRequest(max_offers=value), "max_offers")


def _page_size_ok(value: int) -> bool:
    return _accepts(rs.ListRunsRequest(page_size=value), "page_size")


def test_text_and_number_validators() -> None:
    assert _handle_ok("pid:4242;start:1735689600123")
    assert _handle_ok("h" * 512)
    assert not _handle_ok("h" * 513)
    assert not _handle_ok("é" * 257)  # 514 bytes
    assert not _handle_ok("")
    assert not _handle_ok("pid\n42")
    assert _artifact_ok("a" * 256)
    assert not _artifact_ok("a" * 257)
    assert _summary_ok("界" * 256)  # code points, not bytes
    assert not _summary_ok("x" * 257)
    assert not _summary_ok("")
    assert _accepts(ws.CompleteAttemptRequest(summary=""), "summary")  # may be empty there
    assert not _summary_ok("line\x1b[31m")
    assert bounds.is_command_argv(["/bin/echo", "hello"])
    assert not bounds.is_command_argv([])
    assert not bounds.is_command_argv(["x"] * 65)
    assert not bounds.is_command_argv(["x" * 4097])
    assert not bounds.is_command_argv(["a\x00b"])
    assert not bounds.is_command_argv(["x" * 4096] * 17)  # > 64 KiB in total
    assert _labels_ok([("team", "infra"), ("tier", "")])
    assert not _labels_ok([("Team", "infra")])
    assert not _labels_ok([(f"k{i}", "v") for i in range(17)])
    assert bounds.is_timeout_ms(1)
    assert bounds.is_timeout_ms(604_800_000)
    assert not bounds.is_timeout_ms(0)
    assert not bounds.is_timeout_ms(604_800_001)
    assert _offers_ok(64)
    assert not _offers_ok(0)
    assert not _offers_ok(65)
    assert _page_size_ok(0)
    assert _page_size_ok(500)
    assert not _page_size_ok(501)
    assert bounds.is_safe_positive(2**53 - 1)
    assert not bounds.is_safe_positive(2**53)
    assert not bounds.is_safe_positive(0)
    assert bounds.is_safe_non_negative(0)


@pytest.mark.parametrize(
    ("pattern", "width"),
    [
        (bounds.SLUG_PATTERN, (1, bounds.SLUG_MAX_LENGTH)),
        (bounds.UUID_PATTERN, (bounds.UUID_LENGTH, bounds.UUID_LENGTH)),
        (bounds.REQUEST_ID_PATTERN, (1, bounds.REQUEST_ID_MAX_LENGTH)),
        (bounds.PAGE_TOKEN_PATTERN, (0, bounds.PAGE_TOKEN_MAX_LENGTH)),
        (bounds.SHA256_HEX_PATTERN, (bounds.SHA256_HEX_LENGTH, bounds.SHA256_HEX_LENGTH)),
        (
            bounds.LEASE_CAPABILITY_PATTERN,
            (bounds.LEASE_CAPABILITY_LENGTH, bounds.LEASE_CAPABILITY_LENGTH),
        ),
        (bounds.RUN_PARAMETER_NAME_PATTERN, (1, bounds.RUN_PARAMETER_NAME_MAX_LENGTH)),
        (bounds.LABEL_KEY_PATTERN, (1, bounds.LABEL_KEY_MAX_LENGTH)),
    ],
)
def test_length_constants_are_what_the_contract_patterns_match(
    pattern: re.Pattern[str], width: tuple[int, int]
) -> None:
    """The lengths bounds.py names for messages and CLI help are the widths of the
    contract's own patterns, so the two cannot drift apart."""
    assert pattern_width(pattern) == width


def test_the_largest_trigger_the_contract_allows_fits_its_byte_cap() -> None:
    """Every parameter at its longest name and value (three-byte characters, the most
    bytes a value's limit holds) and every other field at its longest: the request is
    valid by the contract's rules and within TriggerRun's byte cap, so no valid trigger is
    refused as too large."""
    value = "\u6625" * (bounds.RUN_PARAMETER_VALUE_MAX_BYTES // 3)
    names = [
        f"P{index:02d}".ljust(bounds.RUN_PARAMETER_NAME_MAX_LENGTH, "X")
        for index in range(bounds.RUN_PARAMETERS_MAX)
    ]
    request = rs.TriggerRunRequest(
        project_id="p" * bounds.SLUG_MAX_LENGTH,
        task_id=str(uuid.uuid4()),
        revision_number=bounds.MAX_SAFE_INTEGER,
        request_id="r" * bounds.REQUEST_ID_MAX_LENGTH,
        parameters=dict.fromkeys(names, value),
    )
    assert request_violations(request) == []
    assert request.ByteSize() <= bounds.TRIGGER_RUN_REQUEST_MAX_BYTES
    one_more = rs.TriggerRunRequest()
    one_more.CopyFrom(request)
    one_more.parameters["Z"] = "z"
    assert [v.field for v in request_violations(one_more)] == ["parameters"]


def test_a_selector_asks_for_exactly_what_a_worker_may_declare() -> None:
    """A worker_selector a Worker's labels could never satisfy would leave its Runs
    queued for ever: the selector's declaration and the labels' are the same, and the
    Worker's own check of its labels agrees with the contract's."""
    labels = field_rules(ws.OpenSessionRequest, "labels").map
    for owner in (ws.RenewSessionRequest, execution_pb2.ExecutionPlan):
        field = "worker_selector" if owner is execution_pb2.ExecutionPlan else "labels"
        assert field_rules(owner, field).map == labels, owner
    longest_key = "k" * bounds.LABEL_KEY_MAX_LENGTH
    longest_value = "\u6625" * (bounds.WORKER_LABEL_VALUE_MAX_BYTES // 3)
    cases = [
        (longest_key, longest_value),
        ("gpu", ""),
        ("k" * (bounds.LABEL_KEY_MAX_LENGTH + 1), "v"),
        ("Gpu", "v"),
        ("1gpu", "v"),
        ("gpu", "v" * (bounds.WORKER_LABEL_VALUE_MAX_BYTES + 1)),
        ("gpu", "a\x85"),
        ("gpu", "line\n"),
    ]
    for key, value in cases:
        request = ws.OpenSessionRequest(labels={key: value})
        contract_refuses = any(v.field.startswith("labels") for v in request_violations(request))
        assert (bounds.worker_label_problem(key, value) is not None) == contract_refuses, key
    assert bounds.worker_label_problem(longest_key, longest_value) is None
    most = {f"k{n:02d}": "v" for n in range(bounds.WORKER_LABELS_MAX + 1)}
    refused = request_violations(ws.OpenSessionRequest(labels=most))
    assert [v.field for v in refused if v.field.startswith("labels")] == ["labels"]
