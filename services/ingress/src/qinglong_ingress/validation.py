"""Bounds before work (SPEC R-ING-2, R-LC-1): byte caps and field bounds of every public request.

Pure functions over parsed protobuf messages; no grpc server code. The ingress pipeline
checks, in this order and before identity binding, audit or forwarding does anything else
with the body:

1. the raw request size against :data:`REQUEST_BYTE_CAPS` (:func:`request_size_violation`,
   on the bytes as received: a parsed message can be smaller than its wire form, e.g. when
   a scalar field is repeated on the wire and the last value wins). The server also sets
   ``grpc.max_receive_message_length`` to :data:`MAX_RECEIVE_MESSAGE_BYTES`, so anything
   larger than every cap is refused by the transport itself;
2. :func:`validate_request` on the parsed message: unknown fields (R-LC-1), then the
   contract's own field rules (the ``buf.validate`` annotations of the ``.proto`` files,
   enforced by :mod:`qinglong_protocol.request_bounds`; this module holds no bound).

Importing this module fails when any field reachable from a public request declares no
rule, so a field added to the contract without its bound never reaches a handler.

A :class:`FieldViolation` describes the rule only, never the value: a lease capability or
an operator token may be the offending value, and violations end up in responses and logs
(R-SEC-1).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from qinglong.admin.v1 import admin_service_pb2
from qinglong.control.v1 import approval_service_pb2, run_service_pb2, task_service_pb2
from qinglong.enrollment.v1 import enrollment_service_pb2
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason
from qinglong.worker.v1 import worker_service_pb2
from qinglong_protocol import bounds
from qinglong_protocol.request_bounds import (
    MAX_REPORTED_VIOLATIONS,
    WHOLE_REQUEST,
    FieldViolation,
    primary_reason,
    request_violations,
    require_rules,
)

__all__ = [
    "MAX_RECEIVE_MESSAGE_BYTES",
    "MAX_REPORTED_VIOLATIONS",
    "PUBLIC_SERVICES",
    "REQUEST_BYTE_CAPS",
    "WHOLE_REQUEST",
    "FieldViolation",
    "primary_reason",
    "request_size_violation",
    "undecodable_violation",
    "unknown_field_paths",
    "validate_request",
]

_REASON = ErrorReason


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
    (
        approval_service_pb2.DESCRIPTOR.services_by_name["ApprovalService"],
        bounds.APPROVAL_SERVICE_REQUEST_MAX_BYTES,
    ),
    (
        admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"],
        bounds.ADMIN_SERVICE_REQUEST_MAX_BYTES,
    ),
    (
        enrollment_service_pb2.DESCRIPTOR.services_by_name["EnrollmentService"],
        bounds.ENROLLMENT_REQUEST_MAX_BYTES,
    ),
)

#: Methods whose cap differs from (or is pinned separately from) their service's.
_METHOD_CAPS: Final[Mapping[str, int]] = {
    "/qinglong.worker.v1.WorkerService/ControlLease": bounds.LEASE_CONTROL_REQUEST_MAX_BYTES,
    "/qinglong.control.v1.RunService/TriggerRun": bounds.TRIGGER_RUN_REQUEST_MAX_BYTES,
    "/qinglong.worker.v1.WorkerService/AppendOutput": bounds.APPEND_OUTPUT_REQUEST_MAX_BYTES,
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

require_rules(method.input_type for service, _ in PUBLIC_SERVICES for method in service.methods)

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


# --- Validation ----------------------------------------------------------------------


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


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
    yield from request_violations(request)


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
