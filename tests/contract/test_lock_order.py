"""The fixed lock order of every fenced command (SPEC R-ACK-3), as `qinglong.lock_authority`
(migration 0012) takes it, seen from outside on PostgreSQL 16 and 18.

Another transaction holds one row of the order; the command blocks on it. At that moment
every lock before it must already be the command's (a third connection cannot take it
without waiting), and none after it may be: that pins the whole order — the Attempt's
advisory lock, the Session, the Run, the Attempt, the Lease — and DB time is read only
once the last lock is granted."""

from __future__ import annotations

import asyncio
from typing import Any, Final, LiteralString

import psycopg
import pytest
from psycopg import errors
from psycopg.rows import scalar_row
from qinglong_control.db.authority import lock_authority
from qinglong_control.db.command_tx import command_transaction
from qinglong_control.db.sql import SQL

from tests.support.locks import until_waiting
from tests.support.postgres import MigratedDatabase
from tests.support.world import World

ORDER: Final = ("session", "run", "attempt", "lease")
#: Each row of the order, locked by another transaction so strongly that the command's
#: own lock on it (FOR SHARE on the Session, FOR UPDATE on the others) must wait.
ROW_LOCKS: Final[dict[str, LiteralString]] = {
    "session": "SELECT 1 FROM qinglong.worker_sessions WHERE session_id = %s FOR UPDATE",
    "run": "SELECT 1 FROM qinglong.runs WHERE run_id = %s FOR UPDATE",
    "attempt": "SELECT 1 FROM qinglong.attempts WHERE attempt_id = %s FOR UPDATE",
    "lease": "SELECT 1 FROM qinglong.run_leases WHERE attempt_id = %s FOR UPDATE",
}
NOWAIT: Final = " NOWAIT"
#: The same key convergence tries for an Attempt it would expire (convergence.sql).
TRY_ADVISORY: Final = SQL["convergence.try_advisory"]


async def connect(database: MigratedDatabase) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)


async def free_now(probe: psycopg.AsyncConnection[Any], part: str, key: Any) -> bool:
    """Whether another transaction can lock ``part``'s row right now (released at once)."""
    try:
        await probe.execute(ROW_LOCKS[part] + NOWAIT, (key,))
    except errors.LockNotAvailable:
        return False
    return True


@pytest.mark.parametrize("blocked_at", ORDER)
async def test_each_lock_is_taken_after_the_ones_before_it_and_time_after_all(
    world: World, database: MigratedDatabase, blocked_at: str
) -> None:
    fence = (await world.claimed()).fence
    keys = {
        "session": fence.session_id,
        "run": fence.run_id,
        "attempt": fence.attempt_id,
        "lease": fence.attempt_id,
    }
    holder, command_conn, probe = [await connect(database) for _ in range(3)]
    try:
        await holder.execute("BEGIN")
        await holder.execute(ROW_LOCKS[blocked_at], (keys[blocked_at],))

        async def command() -> int:
            async with command_transaction(command_conn) as tx:
                return (await lock_authority(tx, fence)).now_ms

        locking = asyncio.create_task(command())
        await until_waiting(probe, 1)

        advisory = await (
            await probe.cursor(row_factory=scalar_row).execute(
                TRY_ADVISORY, (str(fence.attempt_id),)
            )
        ).fetchone()
        assert advisory is False, "the Attempt's advisory lock comes first"
        others = [part for part in ORDER if part != blocked_at]
        already_held = [part for part in others if not await free_now(probe, part, keys[part])]
        # Exactly the locks before the one it waits for are the command's.
        assert already_held == list(ORDER[: ORDER.index(blocked_at)])
        assert not locking.done()

        released_at = await (
            await holder.cursor(row_factory=scalar_row).execute("SELECT qinglong.db_now_ms()")
        ).fetchone()
        await holder.execute("ROLLBACK")
        now_ms = await asyncio.wait_for(locking, 30)
        assert released_at is not None
        assert now_ms >= released_at, "DB time is read after the last lock was granted"
    finally:
        for conn in (holder, command_conn, probe):
            await conn.close()
