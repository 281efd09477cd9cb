"""Waiting, in a test, until other transactions are really blocked on a lock — so a race
is proven to have raced, not merely started (no sleep stands in for it)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

_WAITING = "SELECT count(*) FROM pg_locks WHERE NOT granted"


async def until_waiting(
    observer: psycopg.AsyncConnection[Any], count: int, timeout_seconds: float = 30
) -> None:
    """Return once at least ``count`` lock requests in the database wait; fail loudly if
    they never do (the transactions under test did not reach the lock)."""
    async with asyncio.timeout(timeout_seconds):
        while True:
            row = await (await observer.execute(_WAITING)).fetchone()
            if row is not None and row[0] >= count:
                return
            await asyncio.sleep(0.01)
