"""Enforcing the contract's field rules on a parsed request (SPEC R-ING-2, R-LC-1).

The rules are the ``buf.validate`` annotations of the ``.proto`` files; protovalidate's
native engine evaluates them on the ``google.protobuf`` message in place (about 5 µs for
a lease command, docs/decisions/0001). Ingress runs this before anything else touches a
request's fields, and control runs it again on what ingress forwards, so neither holds a
hand-written copy of any bound. Two things no rule can say are added here: a lease
capability whose secret is weak (the rule only sees its shape), and violations that
never repeat the offending value, because that value may be a secret (R-SEC-1).

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
from google.protobuf.descriptor import Descriptor
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
    found = itertools.chain(_rule_violations(request), _weak_capabilities(request))
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


# --- The capability's strength: what no rule can decode --------------------------------


@functools.cache
def _capability_paths(message: Descriptor) -> tuple[tuple[str, ...], ...]:
    """Field-name paths from ``message`` to every field marked as a lease capability."""
    paths: list[tuple[str, ...]] = []
    for field in message.fields:
        if is_capability(field):
            paths.append((field.name,))
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            nested = _capability_paths(field.message_type)
            if nested and field.is_repeated:
                raise RuntimeError(f"{field.full_name}: capabilities inside a repeated field")
            paths.extend((field.name, *path) for path in nested)
    return tuple(paths)


def _weak_capabilities(request: Message) -> Iterator[FieldViolation]:
    for path in _capability_paths(cast(Descriptor, request.DESCRIPTOR)):
        value: Any = request
        for name in path[:-1]:
            if not value.HasField(name):
                break
            value = getattr(value, name)
        else:
            raw = bounds.decode_lease_capability(getattr(value, path[-1]))
            if raw is not None and bounds.is_weak_lease_secret(raw):
                yield FieldViolation(
                    ".".join(path),
                    "the lease capability's secret has too little entropy",
                    _REASON.ERROR_REASON_CAPABILITY_WEAK,
                )
