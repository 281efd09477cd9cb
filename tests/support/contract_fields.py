"""What each request field accepts, classified from the contract's own declarations.

Every bound is declared once, as a ``buf.validate`` rule in the ``.proto`` files. Tests
that generate values (the property test's strategies and edge sweep, the extreme values
written end to end) need to know a field's *kind* — a slug, a UUID, printable text
bounded in bytes — and its numbers. :func:`field_rule` reads both from the descriptors
through :mod:`qinglong_protocol.contract_rules`; nothing here restates a bound:

* a string has one pattern: its own ``pattern``, or that of the predefined rule it
  names (``(qinglong.rpc.v1.slug) = true``, declared in ``qinglong/rpc/v1/rules.proto``);
* an identifier or token is recognised by comparing that pattern with the patterns
  :mod:`qinglong_protocol.bounds` reads from the contract (a field that declares a
  pattern of its own is not silently taken for another kind); its lengths are the
  pattern's own narrowest and widest match;
* a lease capability names the predefined rule whose CEL rule id is
  :data:`~qinglong_protocol.contract_rules.CAPABILITY_RULE_ID`;
* free text is a string whose pattern admits exactly the characters that are not
  controls (checked by behaviour, not by spelling); ``min_bytes``/``max_bytes`` make it
  byte-bounded, ``min_len``/``max_len`` character-bounded;
* opaque bytes (executor output) by their ``min_len``/``max_len``;
* integers (their own ``gte``/``lte`` or a predefined range, via
  :func:`~qinglong_protocol.contract_rules.int_range`), enums, repeated fields, maps
  and messages by their rule type.

A field whose rules fit none of these fails with :class:`LookupError`: a new kind of
rule must be taught to the tests, not generated as if it were something else.
"""

from __future__ import annotations

import enum
import functools
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final, cast

from buf.validate import validate_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from qinglong_protocol import bounds
from qinglong_protocol.contract_rules import (
    CAPABILITY_RULE_ID,
    field_rules,
    has_rules,
    int_range,
    predefined_pattern,
    python_pattern,
    reachable_messages,
)

__all__ = [
    "PATTERN_KINDS",
    "TEXT_KINDS",
    "FieldRule",
    "Kind",
    "argv_of_longest_items",
    "argv_of_most_items",
    "field_rule",
    "fill",
    "is_printable_pattern",
    "label_key_max_length",
    "map_key",
    "pattern_width",
    "ruled_fields",
]


class Kind(enum.Enum):
    SLUG = "slug"
    UUID = "uuid"
    UUID_OR_EMPTY = "uuid or empty"
    REQUEST_ID = "request id"
    SHA256_HEX = "sha256 hex"
    PAGE_TOKEN = "page token"
    LEASE_CAPABILITY = "lease capability"
    JOIN_TOKEN = "join token"
    PEM = "PEM text with a fixed first line"
    BYTES_TEXT = "printable text bounded in UTF-8 bytes"
    CHARS_TEXT = "printable text bounded in characters"
    OPAQUE_BYTES = "bytes of any value, bounded in length"
    INT_RANGE = "integer range"
    REQUIRED_ENUM = "required enum"
    OPTIONAL_ENUM = "optional enum"
    ENUM_SET = "enum set"
    SLUG_SET = "set of slugs"
    ARGV = "argv"
    LABELS = "labels"
    BOOL = "boolean"
    TIMESTAMP = "timestamp in a range of seconds"
    REQUIRED_MESSAGE = "required message"
    OPTIONAL_MESSAGE = "optional message"


#: Kinds whose value is a string with one pattern (identifiers, tokens, the capability).
PATTERN_KINDS: Final = frozenset(
    {
        Kind.SLUG,
        Kind.UUID,
        Kind.UUID_OR_EMPTY,
        Kind.REQUEST_ID,
        Kind.SHA256_HEX,
        Kind.PAGE_TOKEN,
        Kind.LEASE_CAPABILITY,
        Kind.JOIN_TOKEN,
    }
)
#: Kinds of a singular string field.
TEXT_KINDS: Final = PATTERN_KINDS | {Kind.BYTES_TEXT, Kind.CHARS_TEXT, Kind.PEM}


@dataclass(frozen=True)
class FieldRule:
    """One field's declared rule. Only the numbers of its kind are set:

    * ``low``/``high``: an integer range (``gte``..``lte``);
    * ``min_length``/``max_length``: a string's length: in UTF-8 bytes for byte-bounded
      text, in code points for character-bounded text, in characters for the pattern
      kinds (the narrowest and widest match of the pattern); for argv, each item's bytes;
      for labels, each value's bytes;
    * ``min_items``/``max_items``: a list's items or a map's entries;
    * ``max_total_bytes``: argv's items together (its CEL rule);
    * ``pattern``: a pattern kind's pattern (as Python spells it), or a label key's;
    * ``prefix``: what a PEM text must begin with;
    * ``allowed``: a required enum's permitted values when it names them (``in``);
      otherwise every declared value but UNSPECIFIED;
    * ``presence``: the field has explicit presence, so leaving it out is within bounds.
    """

    kind: Kind
    presence: bool = False
    low: int | None = None
    high: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    max_total_bytes: int | None = None
    pattern: re.Pattern[str] | None = None
    allowed: tuple[int, ...] | None = None
    prefix: str | None = None

    def __post_init__(self) -> None:
        if self.kind in TEXT_KINDS and (self.min_length is None or self.max_length is None):
            raise ValueError(f"{self.kind} needs both length bounds")
        if self.kind in (Kind.INT_RANGE, Kind.TIMESTAMP) and None in (self.low, self.high):
            raise ValueError("an integer range needs both ends")

    # The numbers of the rule's kind, for callers that need them (an error otherwise).

    @property
    def int_range(self) -> tuple[int, int]:
        return self._pair("low", "high")

    @property
    def lengths(self) -> tuple[int, int]:
        return self._pair("min_length", "max_length")

    @property
    def items(self) -> tuple[int, int]:
        return self._pair("min_items", "max_items")

    @property
    def total_bytes(self) -> int:
        if self.max_total_bytes is None:
            raise TypeError(f"a {self.kind.value} rule has no total")
        return self.max_total_bytes

    @property
    def regex(self) -> re.Pattern[str]:
        if self.pattern is None:
            raise TypeError(f"a {self.kind.value} rule has no pattern")
        return self.pattern

    def _pair(self, low: str, high: str) -> tuple[int, int]:
        pair = getattr(self, low), getattr(self, high)
        if None in pair:
            raise TypeError(f"a {self.kind.value} rule has no {low}..{high}")
        return cast(tuple[int, int], pair)


# --- patterns ---------------------------------------------------------------------------

# ``re._parser`` is how ``re`` itself measures a pattern's width; importing it by name
# keeps the private module out of static imports.
_PARSER: Any = importlib.import_module("re._parser")


def pattern_width(pattern: re.Pattern[str]) -> tuple[int, int | None]:
    """The fewest and most characters ``pattern`` matches (``None``: no most)."""
    low, high = _PARSER.parse(pattern.pattern).getwidth()
    return int(low), (None if high >= _PARSER.MAXREPEAT else int(high))


#: Code points a control-free text must refuse (C0, DEL, C1) and a sample it must accept:
#: every other Latin-1 character, and characters of 2, 3 and 4 UTF-8 bytes.
_CONTROLS: Final = frozenset([*range(0x20), *range(0x7F, 0xA0)])
_PROBES: Final = (*map(chr, range(0x100)), "\u0394", "\u202e", "\u20ac", "\ufffd", "\U0001f600")


def is_printable_pattern(pattern: re.Pattern[str]) -> bool:
    """Whether ``pattern`` is "any number of characters that are not controls"."""
    if pattern.fullmatch("") is None or pattern.fullmatch("a" * 1000) is None:
        return False
    return all((pattern.fullmatch(probe) is None) == (ord(probe) in _CONTROLS) for probe in _PROBES)


def _optional_group(pattern: re.Pattern[str]) -> str:
    r"""``\A(inner)?\Z`` for a pattern ``\Ainner\Z``: the same value, or nothing."""
    inner = pattern.pattern.removeprefix(r"\A").removesuffix(r"\Z")
    return r"\A(" + inner + r")?\Z"


#: Patterns the bounds module reads from the contract, by the kind they make.
_KNOWN_PATTERNS: Final = {
    bounds.SLUG_PATTERN.pattern: Kind.SLUG,
    bounds.JOIN_TOKEN_PATTERN.pattern: Kind.JOIN_TOKEN,
    bounds.UUID_PATTERN.pattern: Kind.UUID,
    _optional_group(bounds.UUID_PATTERN): Kind.UUID_OR_EMPTY,
    bounds.REQUEST_ID_PATTERN.pattern: Kind.REQUEST_ID,
    bounds.SHA256_HEX_PATTERN.pattern: Kind.SHA256_HEX,
    bounds.PAGE_TOKEN_PATTERN.pattern: Kind.PAGE_TOKEN,
}

_ARGV_TOTAL_EXPRESSION: Final = re.compile(r"bytes\(this\.join\(''\)\)\.size\(\) <= (\d+)")


def _set_fields(message: Message) -> set[str]:
    """The rule fields ``message`` sets itself (predefined rules it names excluded)."""
    return {f.name for f, _ in message.ListFields() if not f.is_extension}


def _named_rules(rules: Message) -> list[FieldDescriptor]:
    """The predefined rules (``qinglong/rpc/v1/rules.proto``) that ``rules`` names."""
    named = []
    for extension, value in rules.ListFields():
        if extension.is_extension:
            if value is not True:
                raise LookupError(f"{extension.full_name} is named with {value!r}, not true")
            named.append(extension)
    return named


def _rule_ids(extension: FieldDescriptor) -> set[str]:
    return {rule.id for rule in extension.GetOptions().Extensions[validate_pb2.predefined].cel}


def _string_pattern(where: str, rules: validate_pb2.StringRules) -> tuple[re.Pattern[str], bool]:
    """The one pattern a string's rules declare, its own or a predefined rule's, and
    whether that predefined rule is the lease capability's."""
    named = _named_rules(rules)
    patterns = [predefined_pattern(extension) for extension in named]
    if rules.HasField("pattern"):
        patterns.append(python_pattern(rules.pattern))
    if len(patterns) != 1:
        raise LookupError(f"{where}: a string needs exactly one pattern: {rules}")
    capability = any(CAPABILITY_RULE_ID in _rule_ids(extension) for extension in named)
    return patterns[0], capability


# --- classification ---------------------------------------------------------------------


def field_rule(message: Descriptor | type[Message], field: str) -> FieldRule:
    """The declared rule of ``message.field``, classified (see the module's docstring)."""
    descriptor = message if isinstance(message, Descriptor) else message.DESCRIPTOR
    return _classify(cast(Descriptor, descriptor).fields_by_name[field])


def ruled_fields(root: Descriptor) -> Iterator[tuple[Descriptor, FieldDescriptor, FieldRule]]:
    """Every field reachable from ``root`` (nested messages included) with its rule."""
    for message in reachable_messages(root):
        for field in message.fields:
            yield message, field, _classify(field)


@functools.cache
def _classify(field: FieldDescriptor) -> FieldRule:
    where = field.full_name
    owner = field.containing_type
    if owner is None:
        raise LookupError(f"{where} is an extension, not a request field")
    is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
    if field.message_type is not None and not field.is_repeated and not is_map:
        # A singular message needs no rule of its own; ``required`` is the only one it has.
        if not has_rules(field):
            return FieldRule(Kind.OPTIONAL_MESSAGE)
        declared = field_rules(owner, field.name)
        if _set_fields(declared) == {"timestamp"} and _set_fields(declared.timestamp) == {
            "gte",
            "lte",
        }:
            window = declared.timestamp
            return FieldRule(Kind.TIMESTAMP, True, low=window.gte.seconds, high=window.lte.seconds)
        if _set_fields(declared) != {"required"}:
            raise LookupError(f"{where}: message rules no test kind knows: {declared}")
        return FieldRule(Kind.REQUIRED_MESSAGE if declared.required else Kind.OPTIONAL_MESSAGE)
    rules = field_rules(owner, field.name)
    presence = field.has_presence
    kind = rules.WhichOneof("type")
    if rules.cel and kind != "repeated":
        raise LookupError(f"{where}: field-level CEL no test kind knows: {rules}")
    if kind == "string":
        return _string(where, rules.string, presence)
    if kind == "bytes":
        if _set_fields(rules.bytes) != {"min_len", "max_len"} or _named_rules(rules.bytes):
            raise LookupError(f"{where}: bytes rules no test kind knows: {rules}")
        return FieldRule(
            Kind.OPAQUE_BYTES,
            presence,
            min_length=rules.bytes.min_len,
            max_length=rules.bytes.max_len,
        )
    if kind in ("int32", "int64"):
        numeric = getattr(rules, kind)
        if not _set_fields(numeric) <= {"gte", "lte"} or len(_named_rules(numeric)) > 1:
            raise LookupError(f"{where}: integer rules no test kind knows: {rules}")
        low, high = int_range(owner, field.name)
        return FieldRule(Kind.INT_RANGE, presence, low=low, high=high)
    if kind == "enum":
        return _enum(where, rules.enum, presence)
    if kind == "bool" and not _set_fields(rules.bool):
        return FieldRule(Kind.BOOL, presence)  # both values are fine, and it says so
    if kind == "repeated":
        return _repeated(where, rules)
    if kind == "map":
        return _map(where, rules.map)
    raise LookupError(f"{where}: no test kind for {kind} rules: {rules}")


def _string(where: str, rules: validate_pb2.StringRules, presence: bool) -> FieldRule:
    if _set_fields(rules) == {"min_len", "max_len", "prefix"} and not _named_rules(rules):
        # PEM (a CSR): lines, so no printable rule; its first line is declared.
        return FieldRule(
            Kind.PEM,
            presence,
            min_length=rules.min_len,
            max_length=rules.max_len,
            prefix=rules.prefix,
        )
    pattern, capability = _string_pattern(where, rules)
    lengths = _set_fields(rules) - {"pattern"}
    known = Kind.LEASE_CAPABILITY if capability else _KNOWN_PATTERNS.get(pattern.pattern)
    if known is not None:
        if lengths:
            raise LookupError(f"{where}: {known.value} pattern with more rules: {lengths}")
        low, high = pattern_width(pattern)
        if high is None:
            raise LookupError(f"{where}: a {known.value} of unbounded length")
        return FieldRule(known, presence, min_length=low, max_length=high, pattern=pattern)
    if not is_printable_pattern(pattern):
        raise LookupError(f"{where}: a pattern no test kind knows: {pattern.pattern!r}")
    if lengths <= {"min_bytes", "max_bytes"} and "max_bytes" in lengths:
        return FieldRule(
            Kind.BYTES_TEXT, presence, min_length=rules.min_bytes, max_length=rules.max_bytes
        )
    if lengths <= {"min_len", "max_len"} and "max_len" in lengths:
        return FieldRule(
            Kind.CHARS_TEXT, presence, min_length=rules.min_len, max_length=rules.max_len
        )
    raise LookupError(f"{where}: free text needs bytes or characters bounds, not {lengths}")


def _enum(where: str, rules: validate_pb2.EnumRules, presence: bool) -> FieldRule:
    declared = _set_fields(rules)
    named = list(getattr(rules, "in"))  # `in` is a Python keyword
    if declared == {"in"} and 0 not in named:
        # A subset of the declared values, named (CreatePrincipal: USER or AGENT).
        return FieldRule(Kind.REQUIRED_ENUM, presence, allowed=tuple(sorted(named)))
    if not rules.defined_only or not declared <= {"defined_only", "not_in"}:
        raise LookupError(f"{where}: enum rules no test kind knows: {rules}")
    if list(rules.not_in) == [0]:
        return FieldRule(Kind.REQUIRED_ENUM, presence)
    if not rules.not_in:
        return FieldRule(Kind.OPTIONAL_ENUM, presence)
    raise LookupError(f"{where}: enum rules no test kind knows: {rules}")


def _repeated(where: str, rules: validate_pb2.FieldRules) -> FieldRule:
    repeated = rules.repeated
    items = repeated.items
    if items.HasField("enum"):
        item = _enum(where + "[]", items.enum, False)
        if item.kind is not Kind.REQUIRED_ENUM or not repeated.unique or rules.cel:
            raise LookupError(f"{where}: an enum list no test kind knows: {rules}")
        if not repeated.HasField("max_items"):
            raise LookupError(f"{where}: an enum set without max_items")
        return FieldRule(Kind.ENUM_SET, min_items=repeated.min_items, max_items=repeated.max_items)
    if items.HasField("string") and _named_rules(items.string):
        item = _string(where + "[]", items.string, False)
        if item.kind is not Kind.SLUG or not repeated.unique or rules.cel:
            raise LookupError(f"{where}: a list of {item.kind.value} no test kind knows")
        if not repeated.HasField("max_items"):
            raise LookupError(f"{where}: a slug set without max_items")
        return FieldRule(
            Kind.SLUG_SET,
            min_length=item.min_length,
            max_length=item.max_length,
            pattern=item.pattern,
            min_items=repeated.min_items,
            max_items=repeated.max_items,
        )
    if items.HasField("string"):
        text = items.string
        if (
            _set_fields(text) != {"min_bytes", "max_bytes", "not_contains"}
            or _named_rules(text)
            or text.not_contains != "\x00"
        ):
            raise LookupError(f"{where}: a string list no test kind knows: {rules}")
        totals = [_ARGV_TOTAL_EXPRESSION.fullmatch(rule.expression) for rule in rules.cel]
        if len(totals) != 1 or totals[0] is None:
            raise LookupError(f"{where}: argv needs exactly its total-bytes rule: {rules}")
        return FieldRule(
            Kind.ARGV,
            min_length=text.min_bytes,
            max_length=text.max_bytes,
            min_items=repeated.min_items,
            max_items=repeated.max_items,
            max_total_bytes=int(totals[0].group(1)),
        )
    raise LookupError(f"{where}: repeated rules no test kind knows: {rules}")


def _map(where: str, rules: validate_pb2.MapRules) -> FieldRule:
    if _set_fields(rules) != {"max_pairs", "keys", "values"} or _named_rules(rules):
        raise LookupError(f"{where}: map rules no test kind knows: {rules}")
    keys = rules.keys.string
    if not _set_fields(keys) <= {"pattern"}:
        raise LookupError(f"{where}: map keys no test kind knows: {keys}")
    key_pattern, _ = _string_pattern(where + "[key]", keys)  # its own, or a named rule's
    values = _string(where + "[value]", rules.values.string, False)
    if values.kind is not Kind.BYTES_TEXT:
        raise LookupError(f"{where}: map values of kind {values.kind.value}")
    return FieldRule(
        Kind.LABELS,
        min_items=0,
        max_items=rules.max_pairs,
        min_length=values.min_length,
        max_length=values.max_length,
        pattern=key_pattern,
    )


# --- extreme values ---------------------------------------------------------------------


def fill(character: str, max_bytes: int) -> str:
    """The longest run of ``character`` within ``max_bytes`` UTF-8 bytes."""
    return character * (max_bytes // len(character.encode()))


def argv_of_most_items(rule: FieldRule) -> list[str]:
    """The most argv items, together as long as argv may be."""
    _, most = rule.items
    per_item = min(rule.total_bytes // most, rule.lengths[1])
    return ["a" * per_item] * most


def argv_of_longest_items(rule: FieldRule, character: str) -> list[str]:
    """As many of the longest items (runs of ``character``) as argv's total allows."""
    item = fill(character, rule.lengths[1])
    return [item] * min(rule.total_bytes // len(item.encode()), rule.items[1])


def label_key_max_length(rule: FieldRule) -> int:
    """The longest label key the key pattern accepts."""
    if rule.kind is not Kind.LABELS:
        raise TypeError(f"a {rule.kind.value} rule has no label keys")
    longest = pattern_width(rule.regex)[1]
    if longest is None:
        raise LookupError("a label key of unbounded length")
    return longest


def map_key(rule: FieldRule, index: int | None = None, length: int = 0) -> str:
    """A key the map's key pattern accepts: one letter (in the case the pattern takes:
    lower for labels, upper for Run parameters), then ``index`` in two digits (distinct
    keys), padded to ``length``."""
    letter = "k" if rule.regex.fullmatch("k") else "K"
    key = letter if index is None else f"{letter}{index:02d}"
    key = key.ljust(length, "z" if letter == "k" else "Z")
    if not rule.regex.fullmatch(key):
        raise LookupError(f"no key of this shape fits {rule.regex.pattern!r}: {key!r}")
    return key
