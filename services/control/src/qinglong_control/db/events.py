"""Appending Run Events: server-generated ids, the next gapless sequence, no secrets.

This is the one place that advances a Run's `event_sequence`: by exactly the number of
Events it appends, in the same transaction, guarded by the sequence the caller read
under the Run's row lock. The database's trigger checks each Event against it, so a
caller can neither skip a number nor append beyond it. Commands queue their Events
before the Run's own UPDATE: a Run that becomes terminal accepts no later write.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from psycopg.types.json import Jsonb

from qinglong_control.db.command_tx import CommandTx
from qinglong_control.db.sql import SQL

_ADVANCE_SEQUENCE = SQL["events.advance_sequence"]

_APPEND_EVENT = SQL["events.append_event"]


@dataclass(frozen=True)
class Actor:
    kind: str
    id: str


@dataclass(frozen=True)
class NewEvent:
    event_type: str
    attempt_id: uuid.UUID | None
    payload: dict[str, object]
    dedupe_key: str | None = None
    event_id: uuid.UUID | None = None


async def append_events(
    tx: CommandTx,
    run_id: uuid.UUID,
    after_sequence: int,
    actor: Actor,
    occurred_at_ms: int,
    events: list[NewEvent],
) -> None:
    """Advance the Run's sequence by len(events) and queue the Events after_sequence+1, …"""
    if not events:
        return
    await tx.execute(
        "run.event_sequence",
        _ADVANCE_SEQUENCE,
        {"count": len(events), "run_id": run_id, "after": after_sequence},
    )
    for offset, event in enumerate(events, start=1):
        await tx.execute(
            f"event.{event.event_type}",
            _APPEND_EVENT,
            {
                "event_id": event.event_id or uuid.uuid4(),
                "run_id": run_id,
                "sequence": after_sequence + offset,
                "event_type": event.event_type,
                "attempt_id": event.attempt_id,
                "actor_kind": actor.kind,
                "actor_id": actor.id,
                "occurred_at_ms": occurred_at_ms,
                "payload": Jsonb(event.payload),
                "dedupe_key": event.dedupe_key,
            },
        )
