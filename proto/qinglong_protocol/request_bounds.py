"""Enforcing the contract's field rules on a parsed request (SPEC R-ING-2, R-LC-1).

The rules are the ``buf.validate`` annotations of the ``.proto`` files; protovalidate's
native engine evaluates them on the ``google.protobuf`` message in place (about 5 µs for
a lease command, docs/decisions/0001). Ingress runs this before anything else touches a
request's fields, and control runs it again on what ingress forwards, so neither holds a
hand-written copy of any bound. What no rule can say is added here: a lease capability
whose secret is weak (the rule only sees its shape), a Timestamp whose nanos are out of
range (the rules compare instants), and violations that never repeat the offending
value, because that value may be a secret (R-SEC-1).

Needs the ``validation`` extra of qinglong-protocol (the services have it; Workers do
not need it).
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, cast

import protovalidate
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from qinglong.rpc.v1.error_reason_pb2 import ErrorReason

from qinglong_protocol import bounds
from qinglong_protocol.contract_rules import (
    CAPABILITY_RULE_ID,
    is_capability,
    reachable_messages,
    unruled_fields,
)

__all__ = [
    "MAX_REPORTED_VIOLATIONS",
    "WHOLE_REQUEST",
    "FieldViolation",
    "primary_reason",
    "request_violations",
    "require_rules",
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


#: Rule ids whose violation calls for a reason other than FIELD_INVALID.
_REASON_BY_RULE: Final = {CAPABILITY_RULE_ID: _REASON.ERROR_REASON_CAPABILITY_MALFORMED}

_VALIDATOR: Final = protovalidate.Validator()


def require_rules(roots: Iterable[Descriptor]) -> None:
    """Fail closed at start-up: every field reachable from ``roots`` declares a rule (a
    field added without one would otherwise pass unchecked), and every rule compiles
    in this runtime (buf lint compiles CEL with another engine)."""
    roots = list(roots)
    missing = [name for root in roots for name in unruled_fields(root)]
    if missing:
        raise RuntimeError(f"contract fields without a buf.validate rule: {sorted(missing)}")
    for root in roots:
        for message in reachable_messages(root):
            _VALIDATOR.collect_violations(message_factory.GetMessageClass(message)())


def request_violations(request: Message) -> list[FieldViolation]:
    """Every violation of the request's field rules (at most
    :data:`MAX_REPORTED_VIOLATIONS`); empty when it may proceed."""
    found = itertools.chain(_rule_violations(request), _unseen_violations(request))
    return list(itertools.islice(found, MAX_REPORTED_VIOLATIONS))


def _rule_violations(request: Message) -> Iterator[FieldViolation]:
    for violation in _VALIDATOR.collect_violations(request):
        proto = violation.proto
        yield FieldViolation(
            _path(proto.field.elements if proto.field is not None else ()),
            _without_controls(proto.message),
            _REASON_BY_RULE.get(proto.rule_id, _REASON.ERROR_REASON_FIELD_INVALID),
        )


def _path(elements: Sequence[Any]) -> str:
    """``fence.lease_token``, ``plan.command[3]``; a map key is caller data and never part
    of a path (``labels``)."""
    parts = []
    for element in elements:
        subscript = element.subscript
        if subscript is not None and subscript.field == "index":
            parts.append(f"{element.field_name}[{subscript.value}]")
        else:
            parts.append(element.field_name)
    return ".".join(parts)


_CONTROLS: Final = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _without_controls(text: str) -> str:
    # A rule's own text can hold a control character (not_contains NUL); descriptions
    # end up in terminals and log lines, so they are spelled as escapes.
    return _CONTROLS.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


# --- What no rule can see: a capability's strength, a timestamp's nanos ----------------


def _is_timestamp(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.full_name == _TIMESTAMP


_TIMESTAMP: Final = "google.protobuf.Timestamp"
#: A Timestamp's nanos must be 0..999,999,999; the validator's timestamp rules compare
#: instants and let any nanos through, and converting such a value fails.
_NANOS_MAX: Final = 999_999_999


@functools.cache
def _paths(message: Descriptor, kind: str) -> tuple[tuple[str, ...], ...]:
    """Field-name paths from ``message`` to every field of ``kind`` ("capability": marked
    as a lease capability; "timestamp": a Timestamp), through singular messages."""
    matches = is_capability if kind == "capability" else _is_timestamp
    paths: list[tuple[str, ...]] = []
    for field in message.fields:
        if matches(field):
            paths.append((field.name,))
        elif (
            field.message_type is not None
            and not field.message_type.GetOptions().map_entry
            and not _is_timestamp(field)
        ):
            nested = _paths(field.message_type, kind)
            if nested and field.is_repeated:
                raise RuntimeError(f"{field.full_name}: a {kind} inside a repeated field")
            paths.extend((field.name, *path) for path in nested)
    return tuple(paths)


def _present(request: Message, path: tuple[str, ...]) -> Any | None:
    """The value at ``path`` if every message on the way (and a message at its end) is
    set; None otherwise."""
    value: Any = request
    for name in path:
        field = value.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None and not value.HasField(name):
            return None
        value = getattr(value, name)
    return value


def _unseen_violations(request: Message) -> Iterator[FieldViolation]:
    descriptor = cast(Descriptor, request.DESCRIPTOR)
    for path in _paths(descriptor, "capability"):
        capability = _present(request, path)
        raw = None if capability is None else bounds.decode_lease_capability(capability)
        if raw is not None and bounds.is_weak_lease_secret(raw):
            yield FieldViolation(
                ".".join(path),
                "the lease capability's secret has too little entropy",
                _REASON.ERROR_REASON_CAPABILITY_WEAK,
            )
    for path in _paths(descriptor, "timestamp"):
        stamp = _present(request, path)
        if stamp is not None and not 0 <= stamp.nanos <= _NANOS_MAX:
            yield FieldViolation(".".join(path), f"nanos must be 0..{_NANOS_MAX}")
