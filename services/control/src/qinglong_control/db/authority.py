"""The fixed lock order of every fenced Worker command (SPEC R-ACK-3, R-LC-3), written once.

1. the Attempt's advisory lock (serialises every command on one Attempt, even before its
   rows are found);
2. the Worker Session, FOR SHARE (a session replacement must wait for in-flight ACKs,
   and an ACK must wait for a replacement in flight: never both);
3. the Run, then the Attempt, FOR UPDATE;
4. the Run Lease, FOR UPDATE;
5. DB time, read only after every lock is held.

All five statements travel in one round trip.
"""

from __future__ import annotations

from typing import Any

from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx
from qinglong_control.db.retry_policy import retry_policy_of
from qinglong_control.db.sql import SQL
from qinglong_control.domain.fence import (
    AttemptRow,
    Authority,
    Fence,
    LeaseRow,
    RunRow,
)
from qinglong_control.domain.sessions import SessionRow
from qinglong_control.domain.states import AttemptState, RunState

_ADVISORY_LOCK = SQL["authority.advisory_lock"]

_LOCK_SESSION = SQL["authority.lock_session"]

_LOCK_RUN = SQL["authority.lock_run"]

_LOCK_ATTEMPT = SQL["authority.lock_attempt"]

_LOCK_LEASE = SQL["authority.lock_lease"]

_DB_NOW = SQL["clock.db_now"]


async def lock_authority(tx: CommandTx, fence: Fence) -> Authority:
    """Take the locks in the fixed order and read the present (round trip 1)."""
    await tx.execute("lock.advisory", _ADVISORY_LOCK, (str(fence.attempt_id),))
    session = await tx.execute(
        "lock.session", _LOCK_SESSION, (fence.session_id,), kwargs_row(SessionRow)
    )
    run = await tx.execute("lock.run", _LOCK_RUN, (fence.run_id,), kwargs_row(_run_row))
    attempt = await tx.execute(
        "lock.attempt", _LOCK_ATTEMPT, (fence.attempt_id,), kwargs_row(_attempt_row)
    )
    lease = await tx.execute("lock.lease", _LOCK_LEASE, (fence.attempt_id,), kwargs_row(LeaseRow))
    now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
    now_ms = await now.fetchone()
    assert now_ms is not None
    return Authority(
        session=await session.fetchone(),
        run=await run.fetchone(),
        attempt=await attempt.fetchone(),
        lease=await lease.fetchone(),
        now_ms=now_ms,
    )


def _run_row(**columns: Any) -> RunRow:
    policy = retry_policy_of(columns)
    return RunRow(**{**columns, "state": RunState(columns["state"]), "retry_policy": policy})


def _attempt_row(**columns: Any) -> AttemptRow:
    return AttemptRow(**{**columns, "state": AttemptState(columns["state"])})
