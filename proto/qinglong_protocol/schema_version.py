"""Whether the database has every migration a service needs (each service's start-up).

Control ships the migrations; ingress writes to what some of them created. Each names
the newest migration it needs: control its newest, ingress the one its statements
need (`qinglong_ingress.schema.REQUIRED_SCHEMA`). Migrations only add (a landed one is
never edited), so a database newer than that is served — a rolling upgrade's old
replica —, and one older is refused before any call: the service would fail, call after
call, wherever it uses what a missing migration creates.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from psycopg import AsyncConnection, errors
from psycopg.rows import scalar_row

from qinglong_protocol.pooling import Pool, read_retrying
from qinglong_protocol.sql import SQL

_APPLIED = SQL["schema_version.applied"]
_log = logging.getLogger(__name__)


class SchemaBehind(Exception):
    """The database lacks a migration the service needs."""

    def __init__(self, service: str, applied: int | None, required: int, readable_since: int):
        have = (
            f"has migrations up to {applied:04d}"
            if applied is not None
            else f"cannot say its version to {service}: it predates migration"
            f" {readable_since:04d}, or the connection is not {service}'s role"
        )
        super().__init__(
            f"the database {have}; this {service} needs {required:04d}:"
            " run `qinglong-control migrate` (the migration role) first"
        )
        self.applied = applied
        self.required = required


async def applied_version(conn: AsyncConnection[Any]) -> int | None:
    """The highest migration applied; None when the connection cannot read it (a database
    from before the role could, or never migrated, or another role's connection)."""
    cursor = conn.cursor(row_factory=scalar_row)
    try:
        await cursor.execute(_APPLIED)
    except (errors.InsufficientPrivilege, errors.UndefinedFunction, errors.InvalidSchemaName):
        return None
    version: int | None = await cursor.fetchone()
    return version


async def require_schema(
    conn: AsyncConnection[Any], *, service: str, required: int, readable_since: int
) -> int:
    """The applied version, if it is at least `required`; raise SchemaBehind otherwise.
    `readable_since` is the migration from which `service`'s role may read it."""
    applied = await applied_version(conn)
    if applied is None or applied < required:
        raise SchemaBehind(service, applied, required, readable_since)
    return applied


async def schema_or_exit(
    pool: Pool, check: Callable[[AsyncConnection[Any]], Awaitable[int]], program: str
) -> int:
    """A service's start-up: ``check`` (its `require_schema`) on a pooled connection; a
    database behind it ends the process with the command to run, not a traceback."""
    try:
        applied = await read_retrying(pool, check)
    except SchemaBehind as behind:
        raise SystemExit(f"{program}: {behind}") from None
    _log.info("database schema at migration %04d", applied)
    return applied
