"""Removing security audit rows past their retention age, a bounded step at a time."""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import scalar_row

from qinglong_control.db.sql import SQL

_PRUNE = SQL["audit_retention.prune"]


async def prune_audit(conn: AsyncConnection[Any], max_age_ms: int, limit: int) -> int:
    """Remove at most ``limit`` audit rows older than ``max_age_ms`` of DB time (one
    statement, its own transaction); how many were removed (``limit``: maybe more)."""
    cursor = conn.cursor(row_factory=scalar_row)
    await cursor.execute(_PRUNE, {"max_age_ms": max_age_ms, "limit": limit})
    removed: int | None = await cursor.fetchone()
    if removed is None:
        raise AssertionError("qinglong.prune_security_audit answered no row")
    return removed
