"""The in-process stack most integration tests run against: control and ingress on
loopback with real TLS, on a fresh PostgreSQL 18 database of the test's own."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.support.postgres import MigratedDatabase
from tests.support.stack import Stack, running_stack


@pytest.fixture
async def stack(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    async with running_stack(database_pg18, tmp_path_factory.mktemp("pki")) as running:
        yield running
