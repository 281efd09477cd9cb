"""Fixtures of the contract suite (each test runs on PostgreSQL 16 and 18)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import psycopg
import pytest

from tests.support.postgres import MigratedDatabase
from tests.support.world import World, enroll


@pytest.fixture
async def world(database: MigratedDatabase) -> AsyncIterator[World]:
    """Enrolled workers `worker-a` and `worker-b`, and one runtime-role connection."""
    enroll(database, "worker-a", "worker-b")
    conn = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    try:
        yield World(conn)
    finally:
        await conn.close()
