"""Bounds before work (SPEC R-ING-2, R-LC-1): byte caps and field bounds of every public request.

Pure functions over parsed protobuf messages; no grpc server code. The ingress interceptor
checks, in this order and before identity binding, audit or forwarding does anything else
with the body:

1. the raw request size against :data:`REQUEST_BYTE_CAPS` (:func:`request_size_violation`,
   on the bytes as received: a parsed message can be smaller than its wire form, e.g. when
   a scalar field is repeated on the wire and the last value wins). The server also sets
   ``grpc.max_receive_message_length`` to :data:`MAX_RECEIVE_MESSAGE_BYTES`, so anything
   larger than every cap is refused by the transport itself;
2. :func:`validate_request` on the parsed message: unknown fields (R-LC-1) and every
   ``Bound:``/``Range:`` of the contracts, recursively into nested messages.

Every rule lives in one declarative table, :data:`REQUEST_RULES`: message full name ->
field name -> rule. The constants, patterns and predicates come from
:mod:`qinglong_protocol.bounds`, the single Python source of bounds. A field without a rule
fails closed at run time, and the unit tests fail when any field of any message reachable
from the three public services' inputs has no rule.

A :class:`FieldViolation` describes the rule only, never the value: a lease capability or
an operator token may be the offending value, and violations end up in responses and logs
(R-SEC-1).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, Final, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from qinglong.control.v1 import run_service_pb2, task_service_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_service_pb2
from qinglong_protocol import bounds

__all__ = [
    "MAX_RECEIVE_MESSAGE_BYTES",
    "MAX_REPORTED_VIOLATIONS",
    "PUBLIC_SERVICES",
    "REQUEST_BYTE_CAPS",
    "REQUEST_RULES",
    "WHOLE_REQUEST",
    "FieldViolation",
    "Rule",
    "primary_reason",
    "request_size_violation",
    "undecodable_violation",
    "unknown_field_paths",
    "validate_request",
]

_REASON = ErrorReason

#: The path of a violation about the request as a whole (its size, or its type).
WHOLE_REQUEST: Final = ""
#: At most this many violations are reported for one request, so a hostile request cannot
#: make the error response (or the work of building it) large.
MAX_REPORTED_VIOLATIONS: Final = 20


@dataclass(frozen=True)
class FieldViolation:
    """One broken rule: ``field`` is a path such as ``fence.lease_token`` or
    ``plan.command[3]`` (:data:`WHOLE_REQUEST` for the request itself); ``description``
    states the rule and never contains the offending value; ``reason`` is the ErrorInfo
    reason this violation calls for."""

    field: str
    description: str
    reason: ErrorReason.ValueType = _REASON.ERROR_REASON_FIELD_INVALID


#: When violations call for different reasons, the ErrorInfo carries the first of these.
_REASON_PRECEDENCE: Final = (
    _REASON.ERROR_REASON_REQUEST_TOO_LARGE,
    _REASON.ERROR_REASON_UNKNOWN_FIELD,
    _REASON.ERROR_REASON_CAPABILITY_MALFORMED,
    _REASON.ERROR_REASON_CAPABILITY_WEAK,
    _REASON.ERROR_REASON_FIELD_INVALID,
)


def primary_reason(violations: Iterable[FieldViolation]) -> ErrorReason.ValueType:
    """The one ErrorInfo reason for a rejected request (all of them are INVALID_ARGUMENT)."""
    present = {violation.reason for violation in violations}
    if not present:
        raise ValueError("a request with no violations has no rejection reason")
    for reason in _REASON_PRECEDENCE:
        if reason in present:
            return reason
    return _REASON.ERROR_REASON_FIELD_INVALID


# --- Byte caps -----------------------------------------------------------------------


#: The public services ingress serves, each with the cap its contract comment documents
#: for every serialized request.
PUBLIC_SERVICES: Final[Sequence[tuple[ServiceDescriptor, int]]] = (
    (
        worker_service_pb2.DESCRIPTOR.services_by_name["WorkerService"],
        bounds.WORKER_REQUEST_MAX_BYTES,
    ),
    (
        task_service_pb2.DESCRIPTOR.services_by_name["TaskService"],
        bounds.TASK_SERVICE_REQUEST_MAX_BYTES,
    ),
    (
        run_service_pb2.DESCRIPTOR.services_by_name["RunService"],
        bounds.RUN_SERVICE_REQUEST_MAX_BYTES,
    ),
)

#: Methods whose cap differs from (or is pinned separately from) their service's.
_METHOD_CAPS: Final[Mapping[str, int]] = {
    "/qinglong.worker.v1.WorkerService/ControlLease": bounds.LEASE_CONTROL_REQUEST_MAX_BYTES,
}


def _method_caps() -> dict[str, int]:
    caps: dict[str, int] = {}
    for service, service_cap in PUBLIC_SERVICES:
        for method in service.methods:
            name = f"/{service.full_name}/{method.name}"
            caps[name] = _METHOD_CAPS.get(name, service_cap)
    unknown = set(_METHOD_CAPS) - set(caps)
    if unknown:
        raise RuntimeError(f"byte caps name methods that do not exist: {sorted(unknown)}")
    return caps


#: Full gRPC method name -> maximum serialized request size in bytes.
REQUEST_BYTE_CAPS: Final[Mapping[str, int]] = MappingProxyType(_method_caps())

#: For the server's ``grpc.max_receive_message_length``: the largest per-method cap, so
#: larger messages are refused by the transport before any handler runs.
MAX_RECEIVE_MESSAGE_BYTES: Final[int] = max(REQUEST_BYTE_CAPS.values())


def _caps_by_request_type() -> dict[str, int]:
    caps: dict[str, int] = {}
    for service, _ in PUBLIC_SERVICES:
        for method in service.methods:
            cap = REQUEST_BYTE_CAPS[f"/{service.full_name}/{method.name}"]
            name = method.input_type.full_name
            caps[name] = min(cap, caps.get(name, cap))
    return caps


_CAP_BY_REQUEST_TYPE: Final[Mapping[str, int]] = MappingProxyType(_caps_by_request_type())


def _too_large(cap: int) -> FieldViolation:
    return FieldViolation(
        WHOLE_REQUEST,
        f"the serialized request must be at most {cap} bytes",
        _REASON.ERROR_REASON_REQUEST_TOO_LARGE,
    )


def request_size_violation(method: str, serialized_size: int) -> FieldViolation | None:
    """The violation for a raw request of ``serialized_size`` bytes to ``method`` (a full
    gRPC method name), or ``None`` if it is within the cap. Methods outside the public
    services (health, reflection) have no cap here: the transport limit applies."""
    cap = REQUEST_BYTE_CAPS.get(method)
    if cap is None or serialized_size <= cap:
        return None
    return _too_large(cap)


# --- Rules ---------------------------------------------------------------------------


def _is_integer(field: FieldDescriptor) -> bool:
    return field.cpp_type in {
        FieldDescriptor.CPPTYPE_INT32,
        FieldDescriptor.CPPTYPE_INT64,
        FieldDescriptor.CPPTYPE_UINT32,
        FieldDescriptor.CPPTYPE_UINT64,
    }


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


class Rule(ABC):
    """The bound of one field. ``check`` gets the value of a present field and yields
    violations whose paths start with ``path``; a field with explicit presence (a message or
    an ``optional`` scalar) that is absent gets ``absent`` instead, which by default accepts:
    absence of an optional value is always within bounds."""

    @abstractmethod
    def accepts(self, field: FieldDescriptor) -> bool:
        """Whether this rule fits the field's type and cardinality."""

    @abstractmethod
    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        """Violations of this rule by ``value``."""

    def absent(self, path: str) -> Iterator[FieldViolation]:
        """Violations of an absent field with explicit presence."""
        return iter(())


@dataclass(frozen=True)
class Text(Rule):
    """A singular string accepted by ``predicate``; ``rule`` is what the violation says."""

    predicate: Callable[[str], bool]
    rule: str

    def accepts(self, field: FieldDescriptor) -> bool:
        return field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        if not self.predicate(value):
            prefix = "is required and " if value == "" else ""
            yield FieldViolation(path, prefix + self.rule)


@dataclass(frozen=True)
class LeaseCapability(Rule):
    """The raw lease capability: its shape (CAPABILITY_MALFORMED), then its strength
    (CAPABILITY_WEAK). Control repeats both checks; checking strength here too is a cheap
    pure function and keeps a weak capability from ever reaching the runtime."""

    def accepts(self, field: FieldDescriptor) -> bool:
        return field.type == FieldDescriptor.TYPE_STRING and not field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        raw = bounds.decode_lease_capability(value)
        if raw is None:
            yield FieldViolation(
                path,
                f"must be exactly {bounds.LEASE_CAPABILITY_LENGTH} ASCII characters: "
                f"'{bounds.LEASE_CAPABILITY_PREFIX}' followed by the canonical unpadded "
                f"base64url encoding of exactly {bounds.LEASE_CAPABILITY_SECRET_BYTES} "
                "random bytes",
                _REASON.ERROR_REASON_CAPABILITY_MALFORMED,
            )
        elif bounds.is_weak_lease_secret(raw):
            yield FieldViolation(
                path,
                "the lease capability's secret has too little entropy",
                _REASON.ERROR_REASON_CAPABILITY_WEAK,
            )


@dataclass(frozen=True)
class Int(Rule):
    """A singular integer in ``low..high``."""

    low: int
    high: int

    def accepts(self, field: FieldDescriptor) -> bool:
        return _is_integer(field) and not field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        if not self.low <= value <= self.high:
            yield FieldViolation(path, f"must be an integer in {self.low}..{self.high}")


def _enum_problem(field: FieldDescriptor, number: int, *, allow_unspecified: bool) -> str | None:
    enum = field.enum_type
    assert enum is not None
    if number not in enum.values_by_number:
        # proto3 enums are open: a number this server does not know parses as a plain int.
        return f"must be one of the known {enum.name} values"
    if number == 0 and not allow_unspecified:
        return f"must not be {enum.values_by_number[0].name}"
    return None


@dataclass(frozen=True)
class Enum(Rule):
    """A singular enum: a known value, and not the zero value when ``required``."""

    required: bool = True

    def accepts(self, field: FieldDescriptor) -> bool:
        return field.enum_type is not None and not field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        problem = _enum_problem(field, value, allow_unspecified=not self.required)
        if problem is not None:
            yield FieldViolation(path, ("is required and " if value == 0 else "") + problem)


@dataclass(frozen=True)
class EnumSet(Rule):
    """A repeated enum: ``min_items..max_items`` known values, none UNSPECIFIED, no duplicates."""

    min_items: int
    max_items: int

    def accepts(self, field: FieldDescriptor) -> bool:
        return field.enum_type is not None and field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        if not self.min_items <= len(value) <= self.max_items:
            yield FieldViolation(path, f"must have {self.min_items}..{self.max_items} items")
            return  # the items of an oversized list are not worth inspecting
        seen: set[int] = set()
        for index, number in enumerate(value):
            problem = _enum_problem(field, number, allow_unspecified=False)
            if problem is None and number in seen:
                problem = "must not repeat an earlier item"
            if problem is not None:
                yield FieldViolation(f"{path}[{index}]", problem)
            seen.add(number)


@dataclass(frozen=True)
class CommandArgv(Rule):
    """``ExecutionPlan.command``; ``bounds.is_command_argv`` decides, this only locates."""

    def accepts(self, field: FieldDescriptor) -> bool:
        return field.type == FieldDescriptor.TYPE_STRING and field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        if bounds.is_command_argv(value):
            return
        if not 1 <= len(value) <= bounds.COMMAND_ARGV_MAX_ITEMS:
            yield FieldViolation(path, f"must have 1..{bounds.COMMAND_ARGV_MAX_ITEMS} items")
            return
        found = False
        for index, item in enumerate(value):
            if not 1 <= bounds.utf8_length(item) <= bounds.COMMAND_ARG_MAX_BYTES or "\x00" in item:
                found = True
                yield FieldViolation(
                    f"{path}[{index}]",
                    f"each item must be 1..{bounds.COMMAND_ARG_MAX_BYTES} bytes (UTF-8) "
                    "with no NUL character",
                )
        if not found:
            yield FieldViolation(
                path,
                f"all items together must be at most {bounds.COMMAND_ARGV_MAX_TOTAL_BYTES} "
                "bytes (UTF-8)",
            )


@dataclass(frozen=True)
class Labels(Rule):
    """``map<string, string>`` labels; ``bounds.is_labels`` decides, this only explains.
    The path stays ``labels``: a map key is caller data and is not echoed."""

    def accepts(self, field: FieldDescriptor) -> bool:
        if not _is_map(field):
            return False
        entry = field.message_type
        assert entry is not None
        return all(f.type == FieldDescriptor.TYPE_STRING for f in entry.fields)

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        if bounds.is_labels(value.items()):
            return
        if len(value) > bounds.LABELS_MAX_ENTRIES:
            yield FieldViolation(path, f"must have at most {bounds.LABELS_MAX_ENTRIES} entries")
            return
        keys_ok = all(bounds.LABEL_KEY_PATTERN.match(key) is not None for key in value)
        values_ok = all(
            bounds.is_bounded_text(text, max_bytes=bounds.LABEL_VALUE_MAX_BYTES, min_bytes=0)
            for text in value.values()
        )
        if not keys_ok:
            yield FieldViolation(path, _LABEL_KEY_RULE)
        if not values_ok or keys_ok:  # keys_ok here means only a value can be at fault
            yield FieldViolation(path, _LABEL_VALUE_RULE)


_LABEL_KEY_RULE: Final = (
    "every key must be 1..63 characters of a-z, 0-9, '_', '.', '-', starting with a letter"
)
_LABEL_VALUE_RULE: Final = (
    f"every value must be 0..{bounds.LABEL_VALUE_MAX_BYTES} bytes (UTF-8) "
    "with no control characters"
)


@dataclass(frozen=True)
class Nested(Rule):
    """A singular message field, validated by its own entry in :data:`REQUEST_RULES`."""

    required: bool = True

    def accepts(self, field: FieldDescriptor) -> bool:
        return field.message_type is not None and not field.is_repeated

    def check(self, field: FieldDescriptor, value: Any, path: str) -> Iterator[FieldViolation]:
        yield from _message_violations(value, path + ".")

    def absent(self, path: str) -> Iterator[FieldViolation]:
        if self.required:
            yield FieldViolation(path, "is required")


# --- The table -----------------------------------------------------------------------

SLUG: Final = Text(
    bounds.is_slug,
    f"must be a slug: 1..{bounds.SLUG_MAX_LENGTH} characters of a-z, 0-9 and '-', "
    "not starting with '-'",
)
UUID: Final = Text(
    bounds.is_uuid, f"must be a UUID in canonical lowercase form ({bounds.UUID_LENGTH} characters)"
)
UUID_OR_EMPTY: Final = Text(
    bounds.is_optional_uuid,
    f"must be empty or a UUID in canonical lowercase form ({bounds.UUID_LENGTH} characters)",
)
REQUEST_ID: Final = Text(
    bounds.is_request_id,
    f"must be 1..{bounds.REQUEST_ID_MAX_LENGTH} characters of A-Z, a-z, 0-9, '.', '_', ':', '-'",
)
SHA256_HEX: Final = Text(
    bounds.is_sha256_hex,
    f"must be exactly {bounds.SHA256_HEX_LENGTH} lowercase hexadecimal characters",
)
PAGE_TOKEN: Final = Text(
    bounds.is_page_token,
    f"must be a token from a previous response: 0..{bounds.PAGE_TOKEN_MAX_LENGTH} "
    "characters of A-Z, a-z, 0-9, '_', '-'",
)
EXECUTOR_HANDLE: Final = Text(
    bounds.is_executor_handle,
    f"must be 1..{bounds.EXECUTOR_HANDLE_MAX_BYTES} bytes (UTF-8) with no control characters",
)
LOG_ARTIFACT_ID: Final = Text(
    bounds.is_log_artifact_id,
    f"when present, must be 1..{bounds.LOG_ARTIFACT_ID_MAX_BYTES} bytes (UTF-8) "
    "with no control characters",
)
AGENT_VERSION: Final = Text(
    partial(bounds.is_bounded_text, max_bytes=bounds.AGENT_VERSION_MAX_BYTES, min_bytes=0),
    f"must be 0..{bounds.AGENT_VERSION_MAX_BYTES} bytes (UTF-8) with no control characters",
)
ERROR_SUMMARY: Final = Text(
    bounds.is_error_summary,
    f"must be 1..{bounds.ERROR_SUMMARY_MAX_CHARS} characters with no control characters",
)
SUMMARY: Final = Text(
    partial(bounds.is_error_summary, allow_empty=True),
    f"must be 0..{bounds.ERROR_SUMMARY_MAX_CHARS} characters with no control characters",
)
DISPLAY_NAME: Final = Text(
    bounds.is_display_name,
    f"must be 1..{bounds.DISPLAY_NAME_MAX_CHARS} characters with no control characters",
)
LEASE_CAPABILITY: Final = LeaseCapability()

SAFE_POSITIVE: Final = Int(1, bounds.MAX_SAFE_INTEGER)
SAFE_NON_NEGATIVE: Final = Int(0, bounds.MAX_SAFE_INTEGER)
ANY_INT32: Final = Int(bounds.INT32_MIN, bounds.INT32_MAX)
TIMEOUT_MS: Final = Int(bounds.TIMEOUT_MS_MIN, bounds.TIMEOUT_MS_MAX)
MAX_OFFERS: Final = Int(bounds.MAX_OFFERS_MIN, bounds.MAX_OFFERS_MAX)
MAX_CONCURRENT_ATTEMPTS: Final = Int(
    bounds.MAX_CONCURRENT_ATTEMPTS_MIN, bounds.MAX_CONCURRENT_ATTEMPTS_MAX
)
PAGE_SIZE: Final = Int(0, bounds.PAGE_SIZE_MAX)

REQUIRED_ENUM: Final = Enum(required=True)
EXECUTOR_TYPES: Final = EnumSet(1, bounds.EXECUTOR_TYPES_MAX_ITEMS)
RUN_STATES: Final = EnumSet(0, bounds.RUN_STATE_FILTER_MAX_ITEMS)
COMMAND_ARGV: Final = CommandArgv()
LABELS: Final = Labels()
REQUIRED_MESSAGE: Final = Nested(required=True)
OPTIONAL_MESSAGE: Final = Nested(required=False)
OPTIONAL_ENUM: Final = Enum(required=False)
RETRY_BACKOFF_MS: Final = Int(bounds.RETRY_BACKOFF_MS_MIN, bounds.RETRY_BACKOFF_MS_MAX)

#: Message full name -> field name -> rule, for every message reachable from the inputs of
#: WorkerService, TaskService and RunService. Mirrors the ``Bound:``/``Range:`` comments
#: of the .proto files. Fields with explicit presence (``optional`` scalars) are checked
#: only when present; every other field is always checked, so an empty required string
#: or a zero required integer is a violation.
REQUEST_RULES: Final[Mapping[str, Mapping[str, Rule]]] = {
    # --- shared messages (qinglong.rpc.v1) ---
    "qinglong.rpc.v1.Fence": {
        "worker_id": SLUG,
        "session_id": UUID,
        "worker_generation": SAFE_POSITIVE,
        "project_id": SLUG,
        "run_id": UUID,
        "attempt_id": UUID,
        "offer_id": UUID,
        "lease_generation": SAFE_POSITIVE,
        "lease_token": LEASE_CAPABILITY,
        "expected_lease_version": SAFE_POSITIVE,
    },
    "qinglong.rpc.v1.ExecutionPlan": {
        "executor_type": REQUIRED_ENUM,
        "command": COMMAND_ARGV,
        "timeout_ms": TIMEOUT_MS,  # optional: absent means no deadline
        "retry_policy": OPTIONAL_MESSAGE,  # absent: one Attempt
    },
    "qinglong.rpc.v1.RetryPolicy": {
        "max_attempts": Int(bounds.RETRY_MAX_ATTEMPTS_MIN, bounds.RETRY_MAX_ATTEMPTS_MAX),
        "initial_backoff_ms": RETRY_BACKOFF_MS,
        "max_backoff_ms": RETRY_BACKOFF_MS,
        "backoff_multiplier_percent": Int(
            bounds.RETRY_MULTIPLIER_PERCENT_MIN, bounds.RETRY_MULTIPLIER_PERCENT_MAX
        ),
        "retry_on": EnumSet(0, bounds.RETRY_ON_MAX_ITEMS),
    },
    # --- WorkerService ---
    "qinglong.worker.v1.OpenSessionRequest": {
        "request_id": REQUEST_ID,
        "worker_id": SLUG,
        "agent_version": AGENT_VERSION,
        "executor_types": EXECUTOR_TYPES,
        "max_concurrent_attempts": MAX_CONCURRENT_ATTEMPTS,
    },
    "qinglong.worker.v1.RenewSessionRequest": {
        "worker_id": SLUG,
        "session_id": UUID,
        "worker_generation": SAFE_POSITIVE,
    },
    "qinglong.worker.v1.DrainSessionRequest": {
        "worker_id": SLUG,
        "session_id": UUID,
        "worker_generation": SAFE_POSITIVE,
    },
    "qinglong.worker.v1.PullOffersRequest": {
        "worker_id": SLUG,
        "session_id": UUID,
        "worker_generation": SAFE_POSITIVE,
        "max_offers": MAX_OFFERS,
    },
    "qinglong.worker.v1.ClaimOfferRequest": {
        "worker_id": SLUG,
        "session_id": UUID,
        "worker_generation": SAFE_POSITIVE,
        "offer_id": UUID,
        "project_id": SLUG,
        "run_id": UUID,
        "lease_token": LEASE_CAPABILITY,
    },
    "qinglong.worker.v1.AcknowledgeStartingRequest": {
        "fence": REQUIRED_MESSAGE,
    },
    "qinglong.worker.v1.AcknowledgeRunningRequest": {
        "fence": REQUIRED_MESSAGE,
        "executor_handle": EXECUTOR_HANDLE,
        "log_artifact_id": LOG_ARTIFACT_ID,  # optional
        "callback_sequence": SAFE_NON_NEGATIVE,
        "callback_token_digest": SHA256_HEX,
    },
    "qinglong.worker.v1.ReportStartFailureRequest": {
        "fence": REQUIRED_MESSAGE,
        "error_summary": ERROR_SUMMARY,
    },
    "qinglong.worker.v1.ControlLeaseRequest": {
        "fence": REQUIRED_MESSAGE,
    },
    "qinglong.worker.v1.CompleteAttemptRequest": {
        "fence": REQUIRED_MESSAGE,
        "callback_sequence": SAFE_NON_NEGATIVE,
        "outcome": REQUIRED_ENUM,
        "exit_code": ANY_INT32,  # optional: absent after a signal
        "summary": SUMMARY,
        "stop_reason": OPTIONAL_ENUM,  # SHUTDOWN with CANCELLED; control decides the rest
    },
    # --- TaskService ---
    "qinglong.control.v1.CreateTaskRequest": {
        "project_id": SLUG,
        "request_id": REQUEST_ID,
        "display_name": DISPLAY_NAME,
        "labels": LABELS,
    },
    "qinglong.control.v1.GetTaskRequest": {
        "project_id": SLUG,
        "task_id": UUID,
    },
    "qinglong.control.v1.CreateTaskRevisionRequest": {
        "project_id": SLUG,
        "task_id": UUID,
        "request_id": REQUEST_ID,
        "plan": REQUIRED_MESSAGE,
    },
    "qinglong.control.v1.GetTaskRevisionRequest": {
        "project_id": SLUG,
        "task_id": UUID,
        "revision_number": SAFE_POSITIVE,
    },
    # --- RunService ---
    "qinglong.control.v1.TriggerRunRequest": {
        "project_id": SLUG,
        "task_id": UUID,
        "revision_number": SAFE_POSITIVE,  # optional: absent pins the newest revision
        "request_id": REQUEST_ID,
    },
    "qinglong.control.v1.GetRunRequest": {
        "project_id": SLUG,
        "run_id": UUID,
    },
    "qinglong.control.v1.ListRunsRequest": {
        "project_id": SLUG,
        "page_size": PAGE_SIZE,
        "page_token": PAGE_TOKEN,
        "task_id": UUID_OR_EMPTY,
        "states": RUN_STATES,
    },
    "qinglong.control.v1.ListRunEventsRequest": {
        "project_id": SLUG,
        "run_id": UUID,
        "after_sequence": SAFE_NON_NEGATIVE,
        "page_size": PAGE_SIZE,
    },
    "qinglong.control.v1.WatchRunEventsRequest": {
        "project_id": SLUG,
        "run_id": UUID,
        "after_sequence": SAFE_NON_NEGATIVE,
    },
    "qinglong.control.v1.CancelRunRequest": {
        "project_id": SLUG,
        "run_id": UUID,
        "mutation_id": REQUEST_ID,
    },
}

# --- Validation ----------------------------------------------------------------------


def _descriptor(message: Message) -> Descriptor:
    # The stubs type DESCRIPTOR as the pure-Python or the upb class; both have this API.
    return cast(Descriptor, message.DESCRIPTOR)


def _message_violations(message: Message, prefix: str) -> Iterator[FieldViolation]:
    descriptor = _descriptor(message)
    rules = REQUEST_RULES.get(descriptor.full_name)
    if rules is None:
        # Fail closed: a message type nobody wrote rules for is never waved through.
        yield FieldViolation(
            prefix.removesuffix(".") or WHOLE_REQUEST, "this message type has no validation rules"
        )
        return
    for field in descriptor.fields:
        path = prefix + field.name
        rule = rules.get(field.name)
        present = message.HasField(field.name) if field.has_presence else True
        if rule is None:
            # Fail closed: a field added to the contract without a rule is refused when set.
            if present and _is_populated(field, getattr(message, field.name)):
                yield FieldViolation(path, "this field has no validation rule on this server")
        elif present:
            yield from rule.check(field, getattr(message, field.name), path)
        else:
            yield from rule.absent(path)


def _is_populated(field: FieldDescriptor, value: Any) -> bool:
    if field.is_repeated:
        return len(value) > 0
    return field.has_presence or bool(value != field.default_value)


def _unknown_paths(message: Message, prefix: str) -> Iterator[str]:
    seen: set[int] = set()
    unknown_fields = UnknownFieldSet(message)
    for index in range(len(unknown_fields)):  # the stubs declare no __iter__
        number: int = unknown_fields[index].field_number
        if number not in seen:
            seen.add(number)
            yield f"{prefix}{number}"
    for field, value in message.ListFields():
        if field.message_type is None or _is_map(field):
            continue  # map entries are not reachable as messages (and requests have none)
        if field.is_repeated:
            for index, item in enumerate(value):
                yield from _unknown_paths(item, f"{prefix}{field.name}[{index}].")
        else:
            yield from _unknown_paths(value, f"{prefix}{field.name}.")


def unknown_field_paths(request: Message) -> list[str]:
    """Paths of fields this server does not know, recursively: ``"99"`` for field number 99
    of the request, ``"fence.12"`` for field number 12 of its fence. R-LC-1 rejects unknown
    fields, so a newer client's extra fields are refused instead of silently ignored."""
    return list(_unknown_paths(request, ""))


def _all_violations(request: Message) -> Iterator[FieldViolation]:
    for path in _unknown_paths(request, ""):
        yield FieldViolation(
            path,
            "field number unknown to this contract version; unknown fields are rejected",
            _REASON.ERROR_REASON_UNKNOWN_FIELD,
        )
    yield from _message_violations(request, "")


# --- Bytes that do not decode ----------------------------------------------------------

#: Wire types (protobuf encoding).
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5
#: Requests nest a few levels (request -> plan -> retry_policy); deeper is not worth a walk.
_SCAN_MAX_DEPTH: Final = 8


class _Unreadable(Exception):
    """The wire structure itself is broken at this point (or is a group): stop looking."""


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if position >= len(data):
            raise _Unreadable
        byte = data[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
    raise _Unreadable


def _invalid_utf8_path(descriptor: Descriptor, data: bytes, prefix: str, depth: int) -> str | None:
    """The path of the first string field whose bytes are not UTF-8, walking the wire as a
    parser would; ``None`` when there is none before the structure breaks."""
    seen: dict[int, int] = {}
    position = 0
    while position < len(data):
        key, position = _read_varint(data, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, position = _read_varint(data, position)
            continue
        if wire_type in (_FIXED64, _FIXED32):
            position += 8 if wire_type == _FIXED64 else 4
            continue
        if wire_type != _LENGTH_DELIMITED:
            raise _Unreadable  # groups and the unused wire types 6 and 7
        length, position = _read_varint(data, position)
        chunk = data[position : position + length]
        if len(chunk) != length:
            raise _Unreadable
        position += length
        field = descriptor.fields_by_number.get(number)
        if field is None:
            continue
        index = seen.get(number, 0)
        seen[number] = index + 1
        path = prefix + field.name
        if _is_map(field):
            # A map key is caller data and never part of a path (see Labels).
            entry = field.message_type
            assert entry is not None
            if depth < _SCAN_MAX_DEPTH and _invalid_utf8_path(entry, chunk, "", depth + 1):
                return path
            continue
        if field.is_repeated:
            path += f"[{index}]"
        if field.type == FieldDescriptor.TYPE_STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return path
        elif field.message_type is not None and depth < _SCAN_MAX_DEPTH:
            found = _invalid_utf8_path(field.message_type, chunk, path + ".", depth + 1)
            if found is not None:
                return found
    return None


def undecodable_violation(descriptor: Descriptor, raw: bytes) -> FieldViolation:
    """The violation for request bytes that did not parse as ``descriptor`` (SPEC R-ERR-1).

    The parser rejects invalid UTF-8 in a string field and a broken wire structure alike;
    the first names the field (``fence.lease_token``, ``plan.command[2]``), the second can
    only name the message, by its full name. Never raises: it runs inside the transport's
    deserializer, where an exception would become an INTERNAL status.
    """
    try:
        path = _invalid_utf8_path(descriptor, raw, "", 0)
    except Exception:  # _Unreadable, or anything else a hostile body provokes
        path = None
    if path is not None:
        return FieldViolation(path, "must be valid UTF-8")
    return FieldViolation(
        descriptor.full_name, "the request bytes are not a well-formed message of this type"
    )


def validate_request(
    request: Message, *, serialized_size: int | None = None
) -> list[FieldViolation]:
    """Every violation of the request's byte cap, unknown fields and field bounds; empty
    when the request may proceed. At most :data:`MAX_REPORTED_VIOLATIONS` are returned.

    ``serialized_size`` is the size of the request as received, when known; the cap is
    checked against it and against the parsed message's own size. An oversized request is
    answered with that one violation and nothing else is inspected.
    """
    cap = _CAP_BY_REQUEST_TYPE.get(request.DESCRIPTOR.full_name)
    if cap is not None and max(request.ByteSize(), serialized_size or 0) > cap:
        return [_too_large(cap)]
    return list(itertools.islice(_all_violations(request), MAX_REPORTED_VIOLATIONS))
