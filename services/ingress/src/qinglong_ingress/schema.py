"""The newest migration this build of ingress needs (checked at start-up).

Ingress ships no migrations (control does); it names the newest one its statements need
and refuses, before any call, a database without it (`qinglong_protocol.schema_version`).
"""

from __future__ import annotations

from typing import Any, Final

from psycopg import AsyncConnection
from qinglong_protocol.schema_version import require_schema

#: 0022 added security_audit.credential_id, which every audit row now names; 0024 lets
#: ingress read the version at all.
REQUIRED_SCHEMA: Final = 24
#: The migration that let the worker-ingress role read the version.
READABLE_SINCE: Final = 24


async def require_ingress_schema(conn: AsyncConnection[Any]) -> int:
    """The applied version, if the database has every migration ingress's statements need."""
    return await require_schema(
        conn, service="ingress", required=REQUIRED_SCHEMA, readable_since=READABLE_SINCE
    )
