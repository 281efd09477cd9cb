"""One fenced command = one short transaction in at most two database round trips.

The command queues its lock statements and reads them back (round trip 1: BEGIN, locks
in the fixed order, DB time), lets the domain decide, then queues its writes and COMMIT
(round trip 2). psycopg's pipeline mode sends each batch in one network exchange, so the
transaction holds its locks for about two round trips however many statements it has.

`FaultPlan` is the test seam of SPEC R-TX-1: it replaces the statement at one labelled
boundary with a statement that fails inside PostgreSQL, so the statements before it
have really executed when the transaction must roll back.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, LiteralString, TypeVar, overload

import psycopg
from opentelemetry import trace
from psycopg import AsyncConnection, AsyncCursor, pq
from psycopg.rows import AsyncRowFactory
from psycopg_pool import AsyncConnectionPool

Row = TypeVar("Row")

_tracer = trace.get_tracer("qinglong.control.db")


class InjectedFault(Exception):
    """Raised when a FaultPlan fired: the transaction was rolled back by PostgreSQL."""


@dataclass(frozen=True)
class FaultPlan:
    """Fail the command just before the statement labelled `before`."""

    before: str


class CommandTx:
    def __init__(self, conn: AsyncConnection[Any], fault: FaultPlan | None) -> None:
        self._conn = conn
        self._fault = fault
        self.labels: list[str] = []

    @overload
    async def execute(
        self,
        label: str,
        query: LiteralString,
        params: Sequence[object] | Mapping[str, object] = (),
    ) -> AsyncCursor[tuple[Any, ...]]: ...

    @overload
    async def execute(
        self,
        label: str,
        query: LiteralString,
        params: Sequence[object] | Mapping[str, object],
        row_factory: AsyncRowFactory[Row],
    ) -> AsyncCursor[Row]: ...

    async def execute(
        self,
        label: str,
        query: LiteralString,
        params: Sequence[object] | Mapping[str, object] = (),
        row_factory: AsyncRowFactory[Any] | None = None,
    ) -> AsyncCursor[Any]:
        """Queue one statement; its results are read when a fetch needs them."""
        self.labels.append(label)
        cursor: AsyncCursor[Any] = (
            self._conn.cursor()
            if row_factory is None
            else self._conn.cursor(row_factory=row_factory)
        )
        if self._fault is not None and self._fault.before == label:
            await cursor.execute("SELECT 1 / 0 AS injected_fault", prepare=False)
        # Prepared after a few uses (psycopg's threshold), which saves PostgreSQL the
        # parse and plan of every command. A failed batch may skip a PREPARE psycopg
        # already counts as done; command_transaction forgets them all then (below).
        await cursor.execute(query, params)
        return cursor


# Locks the barrier row (migration 0028) only in a transaction that has written nothing:
# one that wrote already has WAL of its own for the COMMIT to wait on. "Has a transaction
# id" stands for "wrote WAL" here: every statement of these commands that takes an id
# also writes (a row, a row lock). The exception PostgreSQL has — an UPDATE or DELETE
# that takes an id and then finds its row deleted by another transaction, writing
# nothing — cannot occur while no command deletes a row another answers from (the only
# DELETE, of output chunks, is behind its stream's FOR UPDATE lock).
_COMMIT_BARRIER = """SELECT 1 FROM qinglong.commit_barrier
 WHERE barrier = 1 AND pg_current_xact_id_if_assigned() IS NULL
   FOR KEY SHARE"""


@asynccontextmanager
async def command_transaction(
    conn: AsyncConnection[Any],
    fault: FaultPlan | None = None,
    *,
    serializable: bool = False,
    durable_answer: bool = True,
) -> AsyncIterator[CommandTx]:
    """BEGIN … COMMIT inside one pipeline; any exception rolls every write back.

    BEGIN and COMMIT are queued as plain statements: psycopg's `transaction()` inside a
    pipeline would add a sync (a round trip) at each edge. So BEGIN travels with the
    first batch, and COMMIT with the last; a cursor's rows may be read after the block.

    ``durable_answer``: the COMMIT of a transaction that wrote nothing still waits for the
    synchronous standby (migration 0028 says why): its answer may confirm what an earlier
    transaction wrote — a retry answered from the first call's rows, a change already
    made — and that write may be on the primary alone. False only where the answer
    confirms nothing of the kind or the transaction always writes WAL: a read, the
    reconciler's steps (nobody is answered), PullOffers (it locks its session FOR SHARE
    first) and the fenced Worker commands (the row locks of `lock_authority`).
    """
    # A child of the calling RPC's span, only inside a recorded one: a transaction of no
    # traced call (a poll's, the reconciler's) would otherwise start a trace of its own.
    # It ends when the transaction does.
    traced = trace.get_current_span().is_recording()
    span = (
        _tracer.start_span(
            "qinglong.db.transaction",
            kind=trace.SpanKind.CLIENT,
            attributes={"db.system": "postgresql"},
        )
        if traced
        else trace.INVALID_SPAN
    )
    tx = CommandTx(conn, fault)
    try:
        async with conn.pipeline() as pipeline:
            begin = "BEGIN ISOLATION LEVEL SERIALIZABLE" if serializable else "BEGIN"
            await conn.execute(begin, prepare=False)
            try:
                yield tx
            except psycopg.Error:
                # The pipeline is aborted up to the next sync; the first error is the one
                # that matters, whatever the sync reports about the statements it skipped.
                with suppress(psycopg.Error):
                    await pipeline.sync()
                raise
            except BaseException:
                await conn.execute("ROLLBACK", prepare=False)
                raise
            if durable_answer:
                await conn.execute(_COMMIT_BARRIER)
            await conn.execute("COMMIT", prepare=False)
    except psycopg.errors.DivisionByZero as error:
        if fault is not None:
            raise InjectedFault(fault.before) from error
        raise
    finally:
        # A failed statement leaves the explicit transaction aborted; end it here so the
        # connection goes back to its pool idle. `rollback()` (not a ROLLBACK statement)
        # also makes psycopg forget its prepared statements and DEALLOCATE ALL: when a
        # pipelined statement fails, PostgreSQL skips the rest of the batch, including a
        # PREPARE psycopg already counts as done, and every later use of that statement
        # on this connection would fail for good (test_start_fact_faults.py).
        if conn.info.transaction_status == pq.TransactionStatus.INERROR:
            await conn.rollback()
        if traced:
            # Statement labels only (e.g. "lock.run"): never parameters, never SQL values.
            span.set_attribute("qinglong.db.statements", ",".join(tx.labels))
            span.end()


#: Attempts of one serializable command when concurrent ones collide (SQLSTATE 40001/40P01).
#: Not only commands on one Run collide: PostgreSQL tracks what a serializable
#: transaction read by index page, so cancels of different Runs whose Events share a page
#: count as conflicts too — with 64 at once, some met one eight times running.
SERIALIZATION_ATTEMPTS = 32
#: The first retry waits up to this long, each next one up to twice as long as the last,
#: at most SERIALIZATION_BACKOFF_CAP_SECONDS: colliding transactions spread out instead
#: of meeting again (about 3 s of waiting in all, within an operator command's budget).
SERIALIZATION_BACKOFF_SECONDS = 0.005
SERIALIZATION_BACKOFF_CAP_SECONDS = 0.1

Result = TypeVar("Result")


#: Where a retried command gets its connection: a pool (one connection per try, given back
#: before a retry waits, so a storm of colliding commands does not hold the pool while it
#: sleeps), or one connection for every try.
ConnectionSource = AsyncConnection[Any] | AsyncConnectionPool[AsyncConnection[Any]]


@asynccontextmanager
async def _connection_of(source: ConnectionSource) -> AsyncIterator[AsyncConnection[Any]]:
    if isinstance(source, AsyncConnection):
        yield source
        return
    async with source.connection() as conn:
        yield conn


async def retrying_serialization(
    source: ConnectionSource, once: Callable[[AsyncConnection[Any]], Awaitable[Result]]
) -> Result:
    """Run a serializable command, retrying a serialization conflict or deadlock a bounded
    number of times (R-CAN-6): each retry re-reads everything, so it answers as what the
    world then is."""
    for attempt in range(1, SERIALIZATION_ATTEMPTS + 1):
        try:
            async with _connection_of(source) as conn:
                return await once(conn)
        except (psycopg.errors.SerializationFailure, psycopg.errors.DeadlockDetected):
            if attempt == SERIALIZATION_ATTEMPTS:
                raise
            ceiling = min(
                SERIALIZATION_BACKOFF_CAP_SECONDS,
                SERIALIZATION_BACKOFF_SECONDS * 2 ** (attempt - 1),
            )
            await asyncio.sleep(random.uniform(0, ceiling))  # noqa: S311 - jitter
    raise AssertionError("unreachable")
