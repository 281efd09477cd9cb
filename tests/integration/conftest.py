"""The in-process stack most integration tests run against: control and ingress on
loopback with real TLS, on a fresh PostgreSQL 18 database of the test's own."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.postgres import MigratedDatabase
from tests.support.stack import PROJECT, Stack, running_stack


@pytest.fixture
async def stack(
    database_pg18: MigratedDatabase, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    async with running_stack(database_pg18, tmp_path_factory.mktemp("pki")) as running:
        yield running


@pytest.fixture
def stack_file(stack: Stack, tmp_path: Path) -> Path:
    """A stack file like the one `qinglong up` writes, for operator alice."""
    token_file = tmp_path / "alice.token"
    token_file.write_text(stack.tokens["alice"])
    token_file.chmod(0o600)
    identity = stack.operator_identity("carol")
    path = tmp_path / "stack.json"
    path.write_text(
        json.dumps(
            {
                "ingress": {"address": stack.ingress_address},
                "ca_cert": str(identity.ca_cert),
                "project_id": PROJECT,
                "operator": {
                    "cert": str(identity.cert),
                    "key": str(identity.key),
                    "token_file": str(token_file),
                },
            }
        )
    )
    return path
