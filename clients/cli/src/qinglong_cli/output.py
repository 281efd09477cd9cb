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
from typing import Any, Protocol, TextIO, TypeVar, cast

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
_V = TypeVar("_V", bound=int)
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


_RESOURCE_STATE = "RESOURCE_STATE_"

#: Columns of a table: header and how to read the cell from the JSON document.
Columns = Sequence[tuple[str, Callable[[dict[str, Any]], object]]]


def _get(*path: str, absent: object = "") -> Callable[[dict[str, Any]], object]:
    # Protobuf JSON leaves out zero values: `absent` is what a missing one shows as.
    def read(document: dict[str, Any]) -> object:
        value: Any = document
        for key in path:
            value = value.get(key, absent) if isinstance(value, dict) else absent
        return value

    return read


def _state(*path: str, prefix: str) -> Callable[[dict[str, Any]], object]:
    read = _get(*path)
    return lambda document: _enum_name(str(read(document)), prefix)


def _enum_name(name: str, prefix: str) -> str:
    return name.removeprefix(prefix).lower()


class _Enum(Protocol[_V]):
    """A generated protobuf enum (its class's metaclass has `items`)."""

    def items(self) -> list[tuple[str, _V]]: ...


def enum_names(enum: _Enum[_V], prefix: str) -> dict[str, _V]:
    """An enum's values by the names the CLI takes and shows (`RUN_STATE_QUEUED` is
    `queued`), without the UNSPECIFIED zero value."""
    return {
        _enum_name(name, prefix): value
        for name, value in enum.items()
        if not name.endswith("_UNSPECIFIED")
    }


def _yes(key: str) -> Callable[[dict[str, Any]], object]:
    return lambda document: "yes" if document.get(key) else ""


def _executors(document: dict[str, Any]) -> object:
    types = document.get("session", {}).get("executorTypes", [])
    return ",".join(_enum_name(name, "EXECUTOR_TYPE_") for name in types)


def _actor(document: dict[str, Any]) -> object:
    # A person or agent by name (`user:alice`); a worker, the reconciler or the system by id.
    kind = _enum_name(str(document.get("actorKind", "")), "ACTOR_KIND_")
    return f"{kind}:{document.get('actorName') or document.get('actorId', '')}"


def _caller(document: dict[str, Any]) -> object:
    # As an Event's actor: a person or agent by name, a Worker by its id (its name).
    who = document.get("principalName") or document.get("principalId", "")
    return f"{document.get('principalKind', '')}:{who}"


def _labels(labels: dict[str, str]) -> object:
    # A Worker's labels, or those a revision needs: sorted, so a table is stable.
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items())) or "-"


def _load(document: dict[str, Any]) -> object:
    capacity = document.get("session", {}).get("maxConcurrentAttempts", "-")
    return f"{document.get('liveAttempts', 0)}/{capacity}"


#: Tables by message type; other messages print as `key: value` lines.
TABLES: dict[str, Columns] = {
    "qinglong.control.v1.Run": (
        ("RUN", _get("runId")),
        ("STATE", _state("state", prefix="RUN_STATE_")),
        ("ATTEMPTS", lambda d: f"{d.get('attemptCount', 0)}/{d.get('maxAttempts', 1)}"),
        ("PRIORITY", _get("priority", absent=0)),
        ("CREATED", _get("createdAt")),
        ("ERROR", _get("errorCode")),
    ),
    "qinglong.control.v1.RunEvent": (
        ("SEQ", _get("sequence")),
        ("TYPE", _get("type")),
        ("ACTOR", _actor),
        ("AT", _get("occurredAt")),
    ),
    "qinglong.control.v1.Approval": (
        ("APPROVAL", _get("approvalId")),
        ("STATE", _state("state", prefix="APPROVAL_STATE_")),
        ("METHOD", lambda d: str(d.get("method", "")).rsplit("/", 1)[-1]),
        ("RUN", _get("runId", absent="-")),
        ("REQUESTED_BY", _get("requestedByName")),
        ("EXPIRES", _get("expiresAt")),
        ("DECIDED_BY", _get("decidedByName", absent="-")),
        ("RESULT", _get("result", absent="-")),
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
        ("TIMEOUT_MS", _get("plan", "timeoutMs", absent="-")),
        ("QUEUE_TIMEOUT_MS", _get("plan", "queueTimeoutMs", absent="-")),
        ("MAX_CONCURRENT", _get("plan", "maxConcurrentRuns", absent="-")),
        ("ATTEMPTS", _get("plan", "retryPolicy", "maxAttempts", absent=1)),
        ("NEEDS_LABELS", lambda d: _labels(d.get("plan", {}).get("workerSelector", {}))),
    ),
    "qinglong.admin.v1.Project": (
        ("PROJECT", _get("projectId")),
        ("NAME", _get("displayName")),
        ("STATE", _state("state", prefix=_RESOURCE_STATE)),
        ("VERSION", _get("version")),
        ("CREATED", _get("createdAt")),
    ),
    "qinglong.admin.v1.Principal": (
        ("PRINCIPAL", _get("principalId")),
        ("KIND", _state("kind", prefix="PRINCIPAL_KIND_")),
        ("NAME", _get("name")),
        ("STATE", _state("state", prefix=_RESOURCE_STATE)),
        ("CLUSTER_ADMIN", _yes("clusterAdmin")),
        ("CREATED", _get("createdAt")),
    ),
    "qinglong.admin.v1.OperatorToken": (
        ("TOKEN_ID", _get("tokenId")),
        ("PRINCIPAL", _get("principalId")),
        ("PREFIX", _get("prefix")),
        ("STATE", _state("state", prefix=_RESOURCE_STATE)),
        ("CREATED", _get("createdAt")),
        ("EXPIRES", _get("expireTime", absent="never")),
        # Absent: never used, or not since the audit's retention (90 days by default).
        ("LAST_USED", _get("lastUsedTime", absent="-")),
    ),
    "qinglong.admin.v1.RoleBinding": (
        ("PROJECT", _get("projectId")),
        ("PRINCIPAL", _get("principalName")),
        ("ROLE", _state("role", prefix="PROJECT_ROLE_")),
        ("STATE", _state("state", prefix=_RESOURCE_STATE)),
        ("VERSION", _get("version")),
        ("UPDATED", _get("updateTime")),
    ),
    "qinglong.admin.v1.Worker": (
        ("WORKER", _get("workerId")),
        ("STATE", _state("state", prefix=_RESOURCE_STATE)),
        ("SESSION", _get("session", "state", absent="-")),
        ("GENERATION", _get("session", "generation")),
        ("RENEWED", _get("session", "renewTime")),
        ("REMAINING", _get("session", "remaining")),
        ("LOAD", _load),
        # Cordoned: offered nothing new; its LOAD reaching 0 means it may be stopped.
        ("CORDONED", lambda d: "yes" if d.get("cordoned") else "-"),
        ("EXECUTORS", _executors),
        ("PROJECTS", lambda d: ",".join(d.get("projectIds", [])) or "*"),
        ("LABELS", lambda d: _labels(d.get("session", {}).get("labels", {}))),
        ("VERSION", _get("session", "agentVersion")),
        # Growing fast: two machines share one identity (R-ADM-3).
        ("SESSIONS", _get("sessionCount", absent=0)),
    ),
    "qinglong.admin.v1.AuditRecord": (
        ("TIME", _get("occurTime")),
        ("OUTCOME", _state("outcome", prefix="AUDIT_OUTCOME_")),
        ("REASON", _get("reason")),
        ("OPERATION", _get("operation")),
        ("CALLER", _caller),
        ("PROJECT", _get("projectId")),
    ),
    # The answers that carry a secret: one row, the secret in the last column (empty on
    # a replayed create, which cannot show it again).
    "qinglong.admin.v1.IssueTokenResponse": (
        ("TOKEN_ID", _get("issued", "tokenId")),
        ("PRINCIPAL", _get("issued", "principalId")),
        ("EXPIRES", _get("issued", "expireTime", absent="never")),
        ("TOKEN", _get("token")),
    ),
    "qinglong.admin.v1.RotateTokenResponse": (
        ("TOKEN_ID", _get("issued", "tokenId")),
        ("REPLACES", _get("replaced", "tokenId")),
        ("OLD_EXPIRES", _get("replaced", "expireTime")),
        ("TOKEN", _get("token")),
    ),
    "qinglong.admin.v1.CreateWorkerResponse": (
        ("WORKER", _get("worker", "workerId")),
        ("PRINCIPAL", _get("worker", "principalId")),
        ("JOIN_TOKEN_EXPIRES", _get("joinTokenExpireTime")),
        ("JOIN_TOKEN", _get("joinToken")),
    ),
}


#: Tables printed a row at a time as their items arrive (`run events --follow`): the width
#: of each column but the last, since the rows to come cannot be measured. A longer value
#: still prints whole; only its own row leaves the columns.
STREAMED_WIDTHS: dict[str, tuple[int, ...]] = {
    # ACTOR: kind and name; `reconciler:approval-expiry` is 26 (a Worker's id may be longer).
    "qinglong.control.v1.RunEvent": (5, 24, 28),
}


class Printer:
    """Prints items in one format. Tables and `json` are written when `close` is called
    (they need every row); `jsonl` streams, so `run watch` shows Events as they come."""

    def __init__(self, out: TextIO, output: OutputFormat) -> None:
        self._out = out
        self._output = output
        self._items: list[tuple[str, dict[str, Any]]] = []
        self._streamed_header = False
        self._raw = False

    def raw_out(self) -> TextIO:
        """Where answers go, for what is printed as it is, not as items (`run logs`):
        `close` then adds nothing of its own (no `[]` after a Run's output)."""
        self._raw = True
        return self._out

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
        return message.DESCRIPTOR.full_name in STREAMED_WIDTHS

    def _print_row(self, type_name: str, document: dict[str, Any]) -> None:
        columns, widths = TABLES[type_name], STREAMED_WIDTHS[type_name]
        if not self._streamed_header:
            self._print_aligned([header for header, _ in columns], widths)
            self._streamed_header = True
        self._print_aligned([str(read(document)) for _, read in columns], widths)

    def _print_aligned(self, cells: list[str], widths: tuple[int, ...]) -> None:
        padded = [cell.ljust(width) for cell, width in zip(cells[:-1], widths, strict=True)]
        print("  ".join([*padded, cells[-1]]).rstrip(), file=self._out, flush=True)

    @property
    def holds_items(self) -> bool:
        """Items `close` has yet to print (a table's rows, `json`'s documents)."""
        return bool(self._items)

    def close(self) -> None:
        if self._raw:
            return
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
