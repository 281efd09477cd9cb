"""The newest migration this build of control needs: the newest it ships (start-up check,
`qinglong_protocol.schema_version`)."""

from __future__ import annotations

from typing import Any, Final

from psycopg import AsyncConnection
from qinglong_protocol.schema_version import require_schema

from qinglong_control.db.migrate import load_migrations

#: The migration that let the runtime role read the version (`qinglong.schema_version()`).
READABLE_SINCE: Final = 14


async def require_control_schema(conn: AsyncConnection[Any]) -> int:
    """The applied version, if the database has every migration this build ships."""
    newest = load_migrations()[-1].version
    return await require_schema(
        conn, service="control", required=newest, readable_since=READABLE_SINCE
    )
