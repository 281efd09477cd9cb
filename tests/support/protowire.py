"""Protobuf wire format written by hand, for requests no generated class would produce.

A generated message cannot carry invalid UTF-8 in a string field, an int32 that does not
fit 32 bits, an enum number nobody declared, a field number the schema does not have or a
wire type that disagrees with the schema: its setters refuse, or its serializer fixes the
value up. The property tests need exactly those bytes to reach the server, so they build
them here and send them through a channel with identity serializers.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

from google.protobuf.descriptor import FieldDescriptor

VARINT: Final = 0
FIXED64: Final = 1
LENGTH_DELIMITED: Final = 2
START_GROUP: Final = 3
END_GROUP: Final = 4
FIXED32: Final = 5

#: The largest field number the format allows (2^29 - 1).
MAX_FIELD_NUMBER: Final = (1 << 29) - 1

_U64: Final = (1 << 64) - 1

_VARINT_TYPES: Final = frozenset(
    {
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT32,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_ENUM,
        FieldDescriptor.TYPE_BOOL,
    }
)
_ZIGZAG_TYPES: Final = frozenset({FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SINT64})
_FIXED32_TYPES: Final = frozenset(
    {FieldDescriptor.TYPE_FIXED32, FieldDescriptor.TYPE_SFIXED32, FieldDescriptor.TYPE_FLOAT}
)
_FIXED64_TYPES: Final = frozenset(
    {FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64, FieldDescriptor.TYPE_DOUBLE}
)


def varint(value: int) -> bytes:
    """Base-128 varint of ``value`` taken modulo 2^64, as protobuf writes a negative int64
    (ten bytes) and as a parser reads any value: the low 64 bits count."""
    value &= _U64
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def zigzag(value: int) -> int:
    return ((value << 1) ^ (value >> 63)) & _U64


def tag(number: int, wire_type: int) -> bytes:
    if not 1 <= number <= MAX_FIELD_NUMBER:
        raise ValueError(f"field number {number} is outside 1..2^29-1")
    return varint((number << 3) | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    return tag(number, LENGTH_DELIMITED) + varint(len(payload)) + payload


def wire_type_of(field: FieldDescriptor) -> int:
    """The wire type a parser expects for one (unpacked) value of ``field``."""
    if field.type in _VARINT_TYPES or field.type in _ZIGZAG_TYPES:
        return VARINT
    if field.type in _FIXED32_TYPES:
        return FIXED32
    if field.type in _FIXED64_TYPES:
        return FIXED64
    return LENGTH_DELIMITED


def scalar_payload(field: FieldDescriptor, value: int) -> bytes:
    """The bytes of one integer-like value of ``field`` without its tag; ``value`` may be
    anything: it is reduced the way the wire would carry it, never checked."""
    if field.type in _ZIGZAG_TYPES:
        return varint(zigzag(value))
    if field.type in _FIXED32_TYPES:
        return struct.pack("<I", value & 0xFFFFFFFF)
    if field.type in _FIXED64_TYPES:
        return struct.pack("<Q", value & _U64)
    return varint(value)


def scalar(field: FieldDescriptor, value: int) -> bytes:
    """One occurrence of an integer, enum or bool field."""
    return tag(field.number, wire_type_of(field)) + scalar_payload(field, value)


def packed(field: FieldDescriptor, values: Iterable[int]) -> bytes:
    """A repeated scalar field in the packed form (proto3's default)."""
    return length_delimited(field.number, b"".join(scalar_payload(field, v) for v in values))


def text(field: FieldDescriptor, raw: bytes) -> bytes:
    """One occurrence of a string or bytes field carrying ``raw`` as it is, valid UTF-8
    or not."""
    return length_delimited(field.number, raw)


def unknown(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    """A field the schema may not know: ``payload`` is the value's bytes for
    LENGTH_DELIMITED (the length is added), the varint's value bytes for VARINT, and
    exactly 4 or 8 bytes for FIXED32/FIXED64. Groups get a matching END_GROUP."""
    if wire_type == LENGTH_DELIMITED:
        return length_delimited(number, payload)
    if wire_type == START_GROUP:
        return tag(number, START_GROUP) + payload + tag(number, END_GROUP)
    if wire_type == VARINT:
        return tag(number, VARINT) + varint(int.from_bytes(payload[:8] or b"\0", "little"))
    if wire_type == FIXED32:
        return tag(number, FIXED32) + payload[:4].ljust(4, b"\0")
    if wire_type == FIXED64:
        return tag(number, FIXED64) + payload[:8].ljust(8, b"\0")
    return tag(number, wire_type) + payload
