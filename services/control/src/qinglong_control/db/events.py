"""Appending Run Events: server-generated ids, the next gapless sequence, no secrets."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from psycopg.types.json import Jsonb

from qinglong_control.db.command_tx import CommandTx

_APPEND_EVENT = """
INSERT INTO qinglong.run_events
       (event_id, run_id, sequence, event_type, attempt_id, actor_kind, actor_id,
        occurred_at_ms, payload, dedupe_key)
VALUES (%(event_id)s, %(run_id)s, %(sequence)s, %(event_type)s, %(attempt_id)s,
        %(actor_kind)s, %(actor_id)s, %(occurred_at_ms)s, %(payload)s, %(dedupe_key)s)
"""


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
    """Queue `events` with sequences after_sequence+1, +2, … (the Run row was advanced)."""
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
