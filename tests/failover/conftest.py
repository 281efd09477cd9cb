"""Fixtures of the failover suite (issue 10, SPEC §7 items 14-15, R-HA-1, R-HA-2).

Real processes only: embedded PostgreSQL (18; the per-command promotion evidence on every
version the embedded binaries ship, 16 too) with a synchronous streaming standby made by
`pg_basebackup`, `qinglong up --replicas/--standby`, real Workers. Every scenario prints
its tally; the terminal summary repeats them in one table.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from qinglong_cli.embedded_postgres import SUPPORTED_VERSIONS

from tests.support.standby_pair import Pair, standby_pair


@pytest.fixture
def scratch() -> Iterator[Path]:
    # Not under pytest's basetemp: another pytest session may prune it or tighten it to
    # 0700, and PostgreSQL runs as its own user here and must reach its directories.
    root = Path(tempfile.mkdtemp(prefix="qinglong-failover-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=sorted(SUPPORTED_VERSIONS, reverse=True), ids=lambda v: f"pg{v}")
def postgres_version(request: pytest.FixtureRequest) -> int:
    """Each PostgreSQL major version the embedded binaries ship (`up --postgres-version`)."""
    version: int = request.param
    return version


@pytest.fixture
def pair(scratch: Path) -> Iterator[Pair]:
    """A migrated primary (PostgreSQL 18) with a synchronous streaming standby."""
    with standby_pair(scratch) as made:
        yield made
