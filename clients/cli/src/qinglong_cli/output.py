"""How the operator CLI prints answers: a readable table, or JSON for scripts.

`--output table` (the default on a terminal) prints one aligned row per item;
`--output jsonl` (the default otherwise) one protobuf-JSON object per line; `--output json`
one JSON document (a single object, or a list). Protobuf's JSON mapping renders 64-bit
integers as strings (JavaScript cannot hold them); every QingLong integer is at most
2^53 - 1, so they are printed as numbers here, which is what scripts expect.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, TextIO, cast

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

_INT64_TYPES = frozenset(
    {
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_UINT64,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_FIXED64,
        FieldDescriptor.TYPE_SFIXED64,
    }
)
_WELL_KNOWN = ("google.protobuf.Timestamp", "google.protobuf.Duration")


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    JSONL = "jsonl"


def as_json(message: Message) -> dict[str, Any]:
    """Protobuf JSON (camelCase names, enum names, RFC 3339 times), 64-bit ints as numbers."""
    document = MessageToDict(message)
    _numbers(cast(Descriptor, message.DESCRIPTOR), document)
    return document


def _numbers(descriptor: Descriptor, document: dict[str, Any]) -> None:
    for field in descriptor.fields:
        key = field.json_name
        if key not in document:
            continue
        value = document[key]
        if field.type in _INT64_TYPES:
            document[key] = [int(v) for v in value] if isinstance(value, list) else int(value)
        elif field.message_type is not None and field.message_type.full_name not in _WELL_KNOWN:
            if field.message_type.GetOptions().map_entry:
                continue  # labels: string to string
            for item in value if isinstance(value, list) else [value]:
                _numbers(field.message_type, item)


#: Columns of a table: header and how to read the cell from the JSON document.
Columns = Sequence[tuple[str, Callable[[dict[str, Any]], object]]]


def _get(*path: str) -> Callable[[dict[str, Any]], object]:
    def read(document: dict[str, Any]) -> object:
        value: Any = document
        for key in path:
            value = value.get(key, "") if isinstance(value, dict) else ""
        return value

    return read


def _state(key: str, prefix: str) -> Callable[[dict[str, Any]], object]:
    return lambda document: str(document.get(key, "")).removeprefix(prefix).lower()


#: Tables by message type; other messages print as `key: value` lines.
TABLES: dict[str, Columns] = {
    "qinglong.control.v1.Run": (
        ("RUN", _get("runId")),
        ("STATE", _state("state", "RUN_STATE_")),
        ("ATTEMPTS", lambda d: f"{d.get('attemptCount', 0)}/{d.get('maxAttempts', 1)}"),
        ("CREATED", _get("createdAt")),
        ("ERROR", _get("errorCode")),
    ),
    "qinglong.control.v1.RunEvent": (
        ("SEQ", _get("sequence")),
        ("TYPE", _get("type")),
        ("ACTOR", lambda d: f"{_state('actorKind', 'ACTOR_KIND_')(d)}:{d.get('actorId', '')}"),
        ("AT", _get("occurredAt")),
    ),
    "qinglong.control.v1.Task": (
        ("TASK", _get("taskId")),
        ("NAME", _get("displayName")),
        ("REVISION", _get("latestRevisionNumber")),
        ("CREATED", _get("createdAt")),
    ),
    "qinglong.control.v1.TaskRevision": (
        ("TASK", _get("taskId")),
        ("REVISION", _get("revisionNumber")),
        ("COMMAND", lambda d: " ".join(d.get("plan", {}).get("command", []))),
        ("TIMEOUT_MS", _get("plan", "timeoutMs")),
    ),
}


class Printer:
    """Prints items in one format. Tables and `json` are written when `close` is called
    (they need every row); `jsonl` streams, so `run watch` shows Events as they come."""

    def __init__(self, out: TextIO, output: OutputFormat) -> None:
        self._out = out
        self._output = output
        self._items: list[tuple[str, dict[str, Any]]] = []
        self._streamed_header = False

    def item(self, message: Message) -> None:
        document = as_json(message)
        if self._output is OutputFormat.JSONL:
            print(json.dumps(document, sort_keys=True), file=self._out, flush=True)
        elif self._output is OutputFormat.TABLE and self._streaming_table(message):
            self._print_row(message.DESCRIPTOR.full_name, document)
        else:
            self._items.append((message.DESCRIPTOR.full_name, document))

    def _streaming_table(self, message: Message) -> bool:
        # Events are watched live: their columns are known, so rows need not wait.
        return message.DESCRIPTOR.full_name == "qinglong.control.v1.RunEvent"

    def _print_row(self, type_name: str, document: dict[str, Any]) -> None:
        columns = TABLES[type_name]
        if not self._streamed_header:
            print("  ".join(header for header, _ in columns), file=self._out)
            self._streamed_header = True
        print("  ".join(str(read(document)) for _, read in columns), file=self._out, flush=True)

    def close(self) -> None:
        if self._output is OutputFormat.JSON:
            documents = [document for _, document in self._items]
            body: object = documents[0] if len(documents) == 1 else documents
            print(json.dumps(body, sort_keys=True, indent=2), file=self._out)
        elif self._output is OutputFormat.TABLE:
            self._print_tables()

    def _print_tables(self) -> None:
        for type_name, document in self._items:
            columns = TABLES.get(type_name)
            if columns is None:
                for key, value in sorted(document.items()):
                    print(f"{key}: {json.dumps(value)}", file=self._out)
                continue
        rows = [(t, d) for t, d in self._items if t in TABLES]
        if not rows:
            return
        columns = TABLES[rows[0][0]]
        cells = [[header for header, _ in columns]] + [
            [str(read(document)) for _, read in columns] for _, document in rows
        ]
        widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
        for row in cells:
            print(
                "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(),
                file=self._out,
            )
