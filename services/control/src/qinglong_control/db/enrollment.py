"""Consuming a Worker's join token and re-reading a renewing Worker (R-ADM-2), as the
admin role.

One statement in one transaction: the token is marked used only if it is unused,
unexpired and its Worker active, so a token works once, and a replayed, expired or
foreign token changes nothing. The caller signs a certificate only after this committed:
a certificate never exists for a token that is still usable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row

from qinglong_control.db.sql import SQL

_CONSUME_JOIN_TOKEN = SQL["enrollment.consume_join_token"]
_ACTIVE_WORKER_IDENTITY = SQL["enrollment.active_worker_identity"]


@dataclass(frozen=True)
class Enrollment:
    worker_id: str
    certificate_uri: str
    now_ms: int


async def consume_join_token(conn: AsyncConnection[Any], token_digest: str) -> Enrollment | None:
    """The Worker a valid join token enrolls, with the token now used; None otherwise
    (wrong, used, expired, or its Worker disabled: deliberately indistinguishable)."""
    async with conn.transaction():
        cursor = conn.cursor(row_factory=kwargs_row(Enrollment))
        await cursor.execute(_CONSUME_JOIN_TOKEN, (token_digest,))
        return await cursor.fetchone()


async def active_worker(conn: AsyncConnection[Any], worker_id: str) -> Enrollment | None:
    """The Worker's identity if it is still active (a renewal); None if disabled."""
    cursor = conn.cursor(row_factory=kwargs_row(Enrollment))
    await cursor.execute(_ACTIVE_WORKER_IDENTITY, (worker_id,))
    return await cursor.fetchone()
