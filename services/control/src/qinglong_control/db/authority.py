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
from qinglong_control.domain.fence import (
    AttemptRow,
    Authority,
    Fence,
    LeaseRow,
    RunRow,
)
from qinglong_control.domain.sessions import SessionRow
from qinglong_control.domain.states import AttemptState, RunState

_ADVISORY_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.attempt:' || %s, 0))"

_LOCK_SESSION = """
SELECT session_id, worker_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions
 WHERE session_id = %s
   FOR SHARE
"""

_LOCK_RUN = """
SELECT r.run_id, r.project_id, r.revision_id, r.state, r.owner, r.version, r.event_sequence,
       r.cancel_reason, r.cancel_requested_at_ms, tr.timeout_ms, r.deadline_at_ms, r.error_code,
       tr.retry_max_attempts, tr.retry_initial_backoff_ms, tr.retry_max_backoff_ms,
       tr.retry_multiplier_percent, tr.retry_on,
       (SELECT count(*) FROM qinglong.attempts sa
         WHERE sa.run_id = r.run_id AND sa.starting_at_ms IS NOT NULL) AS started_attempts
  FROM qinglong.runs r
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
 WHERE r.run_id = %s
   FOR UPDATE OF r
"""

_LOCK_ATTEMPT = """
SELECT attempt_id, run_id, state, executor_type, worker_id, session_id, worker_generation,
       offer_id, lease_generation, lease_version, lease_token_digest, attempt_number,
       starting_at_ms,
       started_at_ms, deadline_at_ms, executor_handle, log_artifact_id, callback_sequence,
       callback_token_digest, error_code, exit_code, finished_at_ms
  FROM qinglong.attempts
 WHERE attempt_id = %s
   FOR UPDATE
"""

_LOCK_LEASE = """
SELECT attempt_id, run_id, worker_id, session_id, worker_generation, offer_id,
       lease_generation, token_digest, version, status, expires_at_ms
  FROM qinglong.run_leases
 WHERE attempt_id = %s
   FOR UPDATE
"""

_DB_NOW = "SELECT qinglong.db_now_ms() AS now_ms"


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
