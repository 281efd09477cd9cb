"""The field rules the contracts declare, read from the generated descriptors.

Each request field's bound is written once, as a ``buf.validate`` rule in its ``.proto``
file (docs/decisions/0001). This module reads those declarations so Python code can use
the same numbers and patterns without restating them: :mod:`qinglong_protocol.bounds`
derives its constants here, the request validator enforces the rules, and the tests
derive edge values from them. It needs only ``google.protobuf`` (no validator runtime),
so a Worker can use it too.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final, cast

from buf.validate import validate_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from qinglong.rpc.v1 import rules_pb2

__all__ = [
    "CAPABILITY_RULE_ID",
    "field_rules",
    "has_rules",
    "int_range",
    "is_capability",
    "predefined_pattern",
    "predefined_range",
    "python_pattern",
    "reachable_messages",
    "string_rules",
    "unruled_fields",
]

_FIELD_EXTENSION = validate_pb2.field


def _predefined_rule(extension: FieldDescriptor) -> validate_pb2.Rule:
    """The one CEL rule a predefined rule of ``qinglong/rpc/v1/rules.proto`` declares."""
    (rule,) = extension.GetOptions().Extensions[validate_pb2.predefined].cel
    return rule


_MATCHES = re.compile(r"!rule \|\| this\.matches\('(\^[^']*\$)'\)")
_RANGE = re.compile(r"!rule \|\| \(this >= (\d+) && this <= (\d+)\)")


def predefined_pattern(extension: FieldDescriptor) -> re.Pattern[str]:
    """The pattern a predefined string rule matches, as a Python pattern."""
    found = _MATCHES.fullmatch(_predefined_rule(extension).expression)
    if found is None:
        raise LookupError(f"{extension.full_name} is not a pattern rule")
    # A CEL string literal escapes its backslashes; the pattern is the unescaped text.
    return python_pattern(found.group(1).replace("\\\\", "\\"))


def predefined_range(extension: FieldDescriptor) -> tuple[int, int]:
    """The inclusive range a predefined integer rule admits."""
    found = _RANGE.fullmatch(_predefined_rule(extension).expression)
    if found is None:
        raise LookupError(f"{extension.full_name} is not a range rule")
    return int(found.group(1)), int(found.group(2))


#: The id of the rule that marks a field as a lease capability (its shape). The validator
#: refuses a capability whose secret is weak by code, for every field marked so.
CAPABILITY_RULE_ID: Final = _predefined_rule(rules_pb2.lease_capability).id

#: The predefined integer rules a field may name instead of its own gte/lte.
_INT64_RANGES: Final = (rules_pb2.safe_positive, rules_pb2.safe_non_negative)


def _descriptor(message: Descriptor | type[Message]) -> Descriptor:
    if isinstance(message, Descriptor):
        return message
    return cast(Descriptor, message.DESCRIPTOR)


def field_rules(message: Descriptor | type[Message], field: str) -> validate_pb2.FieldRules:
    """The ``buf.validate.field`` rules of ``message.field``; fails if it declares none."""
    descriptor = _descriptor(message).fields_by_name[field]
    if not has_rules(descriptor):
        raise LookupError(f"{descriptor.full_name} declares no buf.validate rule")
    return descriptor.GetOptions().Extensions[_FIELD_EXTENSION]


def has_rules(field: FieldDescriptor) -> bool:
    return field.GetOptions().HasExtension(_FIELD_EXTENSION)


def int_range(message: Descriptor | type[Message], field: str) -> tuple[int, int]:
    """The range an integer field declares: its own ``gte``..``lte``, or a predefined
    range rule it names (``safe_positive``)."""
    rules = field_rules(message, field)
    kind = rules.WhichOneof("type")
    if kind not in ("int32", "int64"):
        raise LookupError(f"{message}.{field} declares {kind} rules, not an integer range")
    numeric = getattr(rules, kind)
    if kind == "int64":
        for extension in _INT64_RANGES:
            if numeric.Extensions[extension]:
                return predefined_range(extension)
    if not (numeric.HasField("gte") and numeric.HasField("lte")):
        raise LookupError(f"{message}.{field} does not declare both gte and lte")
    return int(numeric.gte), int(numeric.lte)


def string_rules(message: Descriptor | type[Message], field: str) -> validate_pb2.StringRules:
    """The string rules of a singular string field, or of a repeated one's items."""
    rules = field_rules(message, field)
    if rules.HasField("string"):
        return rules.string
    if rules.HasField("repeated") and rules.repeated.items.HasField("string"):
        return rules.repeated.items.string
    raise LookupError(f"{message}.{field} declares no string rules")


def is_capability(field: FieldDescriptor) -> bool:
    """Whether the field is a lease capability (it names the ``lease_capability`` rule)."""
    return (
        has_rules(field)
        and field.GetOptions()
        .Extensions[_FIELD_EXTENSION]
        .string.Extensions[rules_pb2.lease_capability]
    )


def python_pattern(pattern: str) -> re.Pattern[str]:
    """An RE2 pattern of the contract as a Python pattern with the same meaning: RE2's
    ``^`` and ``$`` (no multi-line flag) match only at the ends of the text, which is
    ``\\A`` and ``\\Z`` in Python (a Python ``$`` also matches before a final newline)."""
    if not (pattern.startswith("^") and pattern.endswith("$")):
        raise ValueError(f"contract patterns are anchored at both ends: {pattern!r}")
    return re.compile(r"\A" + pattern[1:-1] + r"\Z")


_WELL_KNOWN_PACKAGE: Final = "google.protobuf"


def _is_well_known(message: Descriptor) -> bool:
    return message.file.package == _WELL_KNOWN_PACKAGE


def reachable_messages(root: Descriptor) -> Iterator[Descriptor]:
    """``root`` and every message type its fields reach, once each. Map entries and
    well-known types (Timestamp, Duration) are not walked: the field that holds one
    declares its rule (``timestamp``, ``duration``)."""
    seen: set[str] = set()
    pending = [root]
    while pending:
        message = pending.pop()
        if message.full_name in seen or message.GetOptions().map_entry or _is_well_known(message):
            continue
        seen.add(message.full_name)
        yield message
        pending.extend(f.message_type for f in message.fields if f.message_type is not None)


def unruled_fields(root: Descriptor) -> list[str]:
    """Fields reachable from ``root`` that declare no rule. A singular field of one of our
    message types needs none (its own fields are validated wherever it appears); every
    other field must say what it accepts, even when any value of its type is fine."""
    return [
        field.full_name
        for message in reachable_messages(root)
        for field in message.fields
        if not has_rules(field) and not _validated_by_its_type(field)
    ]


def _validated_by_its_type(field: FieldDescriptor) -> bool:
    nested = field.message_type
    return (
        nested is not None
        and not field.is_repeated
        and not _is_map(field)
        and not _is_well_known(nested)
    )


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry
