"""Consuming a Worker's join token and re-reading a renewing Worker (R-ADM-2), as the
admin role.

One transaction: the token is marked used (one statement) only if it is unused,
unexpired and its Worker active, so a token works once, and a replayed, expired or
foreign token changes nothing. The caller signs a certificate only after this committed:
a certificate never exists for a token that is still usable. The key the token was spent
for is recorded with it: the same token and key again, while the token is unexpired,
are the retry of a join whose answer was lost, and are answered again (migration 0029).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row

from qinglong_control.db.sql import SQL

_CONSUME_JOIN_TOKEN = SQL["enrollment.consume_join_token"]
_REPLAYED_JOIN = SQL["enrollment.replayed_join"]
_ACTIVE_WORKER_IDENTITY = SQL["enrollment.active_worker_identity"]


@dataclass(frozen=True)
class Enrollment:
    worker_id: str
    certificate_uri: str
    now_ms: int


async def consume_join_token(
    conn: AsyncConnection[Any],
    token_digest: str,
    key_digest: str,
    audit_id: uuid.UUID | None = None,
) -> Enrollment | None:
    """The Worker a valid join token enrolls, with the token now used for the key of
    ``key_digest`` by the call audited as ``audit_id`` — or used for that very key already
    (a retry); None otherwise (wrong, used for another key, expired, or its Worker
    disabled: deliberately indistinguishable)."""
    values = {"token_digest": token_digest, "key_digest": key_digest, "audit_id": audit_id}
    async with conn.transaction():
        cursor = conn.cursor(row_factory=kwargs_row(Enrollment))
        await cursor.execute(_CONSUME_JOIN_TOKEN, values)
        enrolled = await cursor.fetchone()
        if enrolled is None:
            await cursor.execute(_REPLAYED_JOIN, values)
            enrolled = await cursor.fetchone()
        return enrolled


async def active_worker(conn: AsyncConnection[Any], worker_id: str) -> Enrollment | None:
    """The Worker's identity if it is still active (a renewal); None if disabled."""
    cursor = conn.cursor(row_factory=kwargs_row(Enrollment))
    await cursor.execute(_ACTIVE_WORKER_IDENTITY, (worker_id,))
    return await cursor.fetchone()
