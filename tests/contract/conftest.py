"""Fixtures of the contract suite (each test runs on PostgreSQL 16 and 18)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

from tests.support.postgres import MigratedDatabase
from tests.support.world import OTHER_PROJECT, World, enroll


@pytest.fixture
async def world(database: MigratedDatabase) -> AsyncIterator[World]:
    """Enrolled workers `worker-a` and `worker-b`, and one runtime-role connection."""
    enroll(database, "worker-a", "worker-b")
    conn = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    try:
        yield World(conn)
    finally:
        await conn.close()


@pytest.fixture
async def admin_conn(database: MigratedDatabase) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """An admin-role connection (AdminService's repository), with a second active
    project, `proj-b`, to scope Workers to."""
    enroll(database, project=OTHER_PROJECT)
    connection = await psycopg.AsyncConnection.connect(database.urls.admin, autocommit=True)
    try:
        yield connection
    finally:
        await connection.close()
