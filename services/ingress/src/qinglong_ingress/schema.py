"""Whether the database has every migration this build of ingress writes to (start-up).

Ingress ships no migrations (control does); it names the newest one its statements need.
A database newer than that is served — a rolling upgrade's old replica —; one older is
refused, before any call: its audit rows would fail, one call after another.
"""

from __future__ import annotations

from typing import Any, Final

from psycopg import AsyncConnection, errors
from psycopg.rows import scalar_row

from qinglong_ingress.sql import SQL

#: 0022 added security_audit.credential_id, which every audit row now names; 0024 lets
#: ingress read the version at all.
REQUIRED_SCHEMA: Final = 24

_VERSION = SQL["schema.version"]


class SchemaBehind(Exception):
    """The database lacks a migration this build of ingress needs."""

    def __init__(self, applied: int | None) -> None:
        if applied is None:
            super().__init__(
                "cannot read the database's schema version: a database from before"
                f" migration {REQUIRED_SCHEMA:04d} (run `qinglong-control migrate`, the"
                " migration role, first), or a connection that is not the qinglong_ingress"
                " role's"
            )
        else:
            super().__init__(
                f"the database has migrations up to {applied:04d}; this ingress needs"
                f" {REQUIRED_SCHEMA:04d}: run `qinglong-control migrate` (the migration role)"
                " first"
            )
        self.applied = applied


async def require_schema(conn: AsyncConnection[Any]) -> int:
    """The applied version, if it is at least :data:`REQUIRED_SCHEMA`; raise
    :class:`SchemaBehind` otherwise (a database from before 0024 cannot even say)."""
    cursor = conn.cursor(row_factory=scalar_row)
    try:
        await cursor.execute(_VERSION)
    except (errors.InsufficientPrivilege, errors.UndefinedFunction, errors.InvalidSchemaName):
        raise SchemaBehind(None) from None
    applied: int | None = await cursor.fetchone()
    if applied is None or applied < REQUIRED_SCHEMA:
        raise SchemaBehind(applied)
    return applied
