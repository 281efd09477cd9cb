"""The queue as operators watch it: how many Runs wait, and for how long."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row

from qinglong_control.db.sql import SQL

_QUEUE_PARTS = SQL["queue.queue_parts"]


@dataclass(frozen=True)
class QueuePart:
    part: str
    """``any_worker`` (Runs without a worker selector), ``with_selector``, or
    ``waiting_for_slot`` (Runs waiting ``created`` for a slot of their task)."""
    runs: int
    oldest_age_ms: int | None
    """How long the oldest of them has waited (DB time); None when none waits."""


async def queue_parts(conn: AsyncConnection[Any]) -> list[QueuePart]:
    cursor = conn.cursor(row_factory=kwargs_row(QueuePart))
    await cursor.execute(_QUEUE_PARTS)
    return await cursor.fetchall()
