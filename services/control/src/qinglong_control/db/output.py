"""Run output (R-OPS-1) in PostgreSQL: append a chunk, read a page, expire old output.

This is the embedded store behind :class:`OutputStore` (the table of migration 0010). An
append is one short transaction in two round trips, like a fenced command: the stream's
lock, the Attempt's authority, the stream row and the kept chunks it overlaps, DB time;
then the write and COMMIT. A read is one statement (one snapshot): the Attempt, where its
stream stands and the page's chunks, so what an answer says of the stream's end and of
the Attempt's ending is true of the bytes it carries.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Final, Protocol

from psycopg import AsyncConnection
from psycopg.rows import dict_row, kwargs_row, scalar_row
from psycopg_pool import AsyncConnectionPool
from qinglong_protocol import bounds

from qinglong_control.db.command_tx import FaultPlan, command_transaction
from qinglong_control.db.sql import SQL
from qinglong_control.domain.fence import Fence
from qinglong_control.domain.output import (
    AppendDecision,
    OutputOwner,
    OutputRetention,
    StoredChunk,
    Stream,
    check_output_owner,
    decide_append,
    page_of,
)
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.states import RunState

_LOCK_STREAM = SQL["output.lock_stream"]
_OWNER = SQL["output.owner"]
_STREAM = SQL["output.stream"]
_OVERLAPPING = SQL["output.overlapping"]
_APPEND = SQL["output.append"]
_READ_PAGE = SQL["output.read_page"]
_EXPIRE = SQL["output.expire"]
_DB_NOW = SQL["clock.db_now"]

#: Chunks one page reads at most: a page of tiny chunks holds fewer bytes than asked
#: (the reader goes on from next_offset), never an unbounded number of rows.
PAGE_CHUNKS_MAX: Final = 1024


@dataclass(frozen=True)
class OutputPage:
    run_terminal: bool
    attempt_id: uuid.UUID | None = None
    attempt_number: int = 0
    log_artifact_id: str | None = None
    complete: bool = False
    end_offset: int = 0
    first_offset: int = 0
    offset: int = 0
    data: bytes = b""
    output_bytes: int | None = None
    """The size of the output when the Attempt ended, as its Worker reported it."""


class OutputStore(Protocol):
    """Where Run output is kept. The PostgreSQL tables (:class:`TableOutputStore`) are
    the embedded default; a blob store would implement the same three operations."""

    async def append(
        self, fence: Fence, offset: int, data: bytes, retention: OutputRetention
    ) -> AppendDecision: ...

    async def read(
        self,
        project_id: str,
        run_id: uuid.UUID,
        attempt_number: int | None,
        offset: int,
        max_bytes: int,
    ) -> OutputPage: ...

    async def expire(self, max_age_ms: int, limit: int) -> int:
        """Remove at most ``limit`` chunks of output older than ``max_age_ms``; how many
        were removed (``limit`` means there may be more)."""
        ...


class TableOutputStore:
    """:class:`OutputStore` in the runtime role's tables; each operation borrows one
    pooled connection for its one transaction or query."""

    def __init__(self, pool: AsyncConnectionPool[AsyncConnection[Any]]) -> None:
        self._pool = pool

    async def append(
        self, fence: Fence, offset: int, data: bytes, retention: OutputRetention
    ) -> AppendDecision:
        async with self._pool.connection() as conn:
            return await append_output(conn, fence, offset, data, retention)

    async def read(
        self,
        project_id: str,
        run_id: uuid.UUID,
        attempt_number: int | None,
        offset: int,
        max_bytes: int,
    ) -> OutputPage:
        async with self._pool.connection() as conn:
            return await read_output(conn, project_id, run_id, attempt_number, offset, max_bytes)

    async def expire(self, max_age_ms: int, limit: int) -> int:
        async with self._pool.connection() as conn:
            return await expire_output(conn, max_age_ms, limit)


async def append_output(
    conn: AsyncConnection[Any],
    fence: Fence,
    offset: int,
    data: bytes,
    retention: OutputRetention,
    fault: FaultPlan | None = None,
) -> AppendDecision:
    attempt_id = fence.attempt_id
    async with command_transaction(conn, fault) as tx:
        await tx.execute("lock.output", _LOCK_STREAM, (str(attempt_id),))
        owner = await tx.execute("output.owner", _OWNER, (attempt_id,), kwargs_row(_owner))
        stream = await tx.execute("output.stream", _STREAM, (attempt_id,), kwargs_row(Stream))
        overlapping = await tx.execute(
            "output.overlapping",
            _OVERLAPPING,
            {
                "attempt_id": attempt_id,
                "earliest_start": offset - bounds.OUTPUT_CHUNK_MAX_BYTES,
                "from": offset,
                "until": offset + len(data),
            },
            kwargs_row(StoredChunk),
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        check_output_owner(fence, await owner.fetchone())
        decision = decide_append(
            offset,
            data,
            await stream.fetchone() or Stream(),
            await overlapping.fetchall(),
            retention,
        )
        now_ms = await now.fetchone()
        if decision.replayed:
            return decision
        await tx.execute(
            "output.append",
            _APPEND,
            {
                "attempt_id": attempt_id,
                "write_offset": decision.write_offset,
                "end_offset": decision.end_offset,
                "data": decision.write_data,
                "keep_from": decision.keep_from,
                "now": now_ms,
            },
        )
        return decision


async def read_output(
    conn: AsyncConnection[Any],
    project_id: str,
    run_id: uuid.UUID,
    attempt_number: int | None,
    offset: int,
    max_bytes: int,
) -> OutputPage:
    """A page of the Attempt's output; another project's Run is not found, like a
    missing one."""
    cursor = conn.cursor(row_factory=dict_row)
    await cursor.execute(
        _READ_PAGE,
        {
            "project_id": project_id,
            "run_id": run_id,
            "attempt_number": attempt_number,
            "earliest_start": offset - bounds.OUTPUT_CHUNK_MAX_BYTES,
            "from": offset,
            "max_bytes": max_bytes,
            "limit": PAGE_CHUNKS_MAX,
        },
    )
    rows = await cursor.fetchall()
    if not rows:
        raise Refused(Reason.RUN_NOT_FOUND, "no such run")
    located = rows[0]  # the Run's and the Attempt's columns, the same on every row
    run_terminal = RunState(located["run_state"]).is_terminal
    if located["attempt_id"] is None:
        if attempt_number is not None:
            raise Refused(Reason.ATTEMPT_NOT_FOUND, "the run has no attempt of that number")
        return OutputPage(run_terminal)  # nothing claimed yet
    chunks = [
        StoredChunk(row["start_offset"], row["data"])
        for row in rows
        if row["start_offset"] is not None
    ]
    start, data = page_of(chunks, max(offset, located["first_offset"]), max_bytes)
    return OutputPage(
        run_terminal,
        located["attempt_id"],
        located["attempt_number"],
        located["log_artifact_id"],
        located["complete"],
        located["end_offset"],
        located["first_offset"],
        start,
        data,
        located["output_bytes"],
    )


async def expire_output(conn: AsyncConnection[Any], max_age_ms: int, limit: int) -> int:
    """One bounded step of the age sweep: remove at most ``limit`` chunks of the streams
    not written to for ``max_age_ms`` of DB time, oldest first; how many were removed
    (``limit``: there may be more). A stream larger than one step is emptied over several
    steps, each going on where the last stopped, so every step makes progress."""
    async with conn.transaction():
        cursor = await conn.execute(_EXPIRE, {"max_age_ms": max_age_ms, "limit": limit})
        row = await cursor.fetchone()
    return 0 if row is None else int(row[0])


def _owner(**columns: Any) -> OutputOwner:
    return OutputOwner(**columns)
