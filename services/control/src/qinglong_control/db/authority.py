"""The fixed lock order of every fenced Worker command (SPEC R-ACK-3, R-LC-3).

The order is written once, in the function `qinglong.lock_authority` (migration 0012):

1. the Attempt's advisory lock (serialises every command on one Attempt, even before its
   rows are found);
2. the Worker Session, FOR SHARE (a session replacement must wait for in-flight ACKs,
   and an ACK must wait for a replacement in flight: never both);
3. the Run, then the Attempt, FOR UPDATE;
4. the Run Lease, FOR UPDATE;
5. DB time, read only after every lock is held.

One statement, not six (five locks and the clock): each statement cost the client and the
server protocol work of its own on every command. It still travels with BEGIN in the
command's first round trip.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from psycopg.rows import RowMaker

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

_LOCK_AUTHORITY = SQL["authority.lock_authority"]


async def lock_authority(tx: CommandTx, fence: Fence) -> Authority:
    """Take the locks in the fixed order and read the present (round trip 1)."""
    locked = await tx.execute(
        "lock.authority",
        _LOCK_AUTHORITY,
        (fence.attempt_id, fence.session_id, fence.run_id),
        _authority_row,
    )
    authority = await locked.fetchone()
    assert authority is not None  # the function answers one row, whatever it found
    return authority


def _run_row(**columns: Any) -> RunRow:
    policy = retry_policy_of(columns)
    return RunRow(**{**columns, "state": RunState(columns["state"]), "retry_policy": policy})


def _attempt_row(**columns: Any) -> AttemptRow:
    return AttemptRow(**{**columns, "state": AttemptState(columns["state"])})


#: Each part of `qinglong.lock_authority`'s row (columns `<part>__<column>`), the column
#: that is NULL exactly when its row does not exist, and how its columns become a row.
_PARTS: dict[str, tuple[str, Callable[..., Any]]] = {
    "session": ("session_id", SessionRow),
    "run": ("run_id", _run_row),
    "attempt": ("attempt_id", _attempt_row),
    "lease": ("attempt_id", LeaseRow),
}


def _authority_row(cursor: Any) -> RowMaker[Authority]:
    """Splits the function's one row into the Authority's rows (migration 0012)."""
    names: Sequence[str] = [column.name for column in cursor.description or ()]

    def authority(values: Sequence[Any]) -> Authority:
        parts: dict[str, dict[str, Any]] = {part: {} for part in _PARTS}
        now_ms = None
        for name, value in zip(names, values, strict=True):
            part, _, column = name.partition("__")
            if column:
                parts[part][column] = value
            else:
                now_ms = value
        if now_ms is None:
            raise AssertionError("qinglong.lock_authority answered no DB time")
        rows = {
            part: None if columns[key] is None else make(**columns)
            for part, columns in parts.items()
            for key, make in (_PARTS[part],)
        }
        return Authority(**rows, now_ms=now_ms)

    return authority
