"""Whether the database has every migration this build of control ships (start-up check).

Migrations only add (a landed one is never edited), so a database newer than the build
is served — that is a rolling upgrade's old replica — and one older is refused: the
build would fail, call by call, wherever it uses what a missing migration creates.
"""

from __future__ import annotations

from typing import Any

from psycopg import AsyncConnection, errors
from psycopg.rows import scalar_row

from qinglong_control.db.migrate import load_migrations
from qinglong_control.db.sql import SQL

_APPLIED = SQL["schema_version.applied"]
#: The migration that made the version readable; a database without it is older still.
READABLE_SINCE = 14


class SchemaBehind(Exception):
    """The database lacks migrations this build ships."""

    def __init__(self, applied: int | None, required: int) -> None:
        have = (
            f"has migrations up to {applied:04d}"
            if applied is not None
            else f"predates migration {READABLE_SINCE:04d}"
        )
        super().__init__(
            f"the database {have}; this build needs {required:04d}:"
            " run `qinglong-control migrate` (the migration role) first"
        )
        self.applied = applied
        self.required = required


async def applied_version(conn: AsyncConnection[Any]) -> int | None:
    """The highest migration applied; None for a database from before it was readable."""
    cursor = conn.cursor(row_factory=scalar_row)
    try:
        await cursor.execute(_APPLIED)
    except (errors.UndefinedFunction, errors.InvalidSchemaName):  # before 0014; never migrated
        return None
    version: int | None = await cursor.fetchone()
    return version


async def require_schema(conn: AsyncConnection[Any]) -> int:
    """The applied version, if it is at least the newest migration this build ships;
    raise SchemaBehind otherwise."""
    needed = load_migrations()[-1].version
    applied = await applied_version(conn)
    if applied is None or applied < needed:
        raise SchemaBehind(applied, needed)
    return applied
