"""The queue timeout as transactions (see domain/queue_timeout.py).

One bounded page per transaction: lock the queued Runs whose wait is over with ``FOR
UPDATE SKIP LOCKED`` (control replicas share the work with no claim table), read DB time,
and end each one ``timed_out`` / ``QUEUE_TIMED_OUT`` with one Event, withdrawing its open
offer. The claim locks a Run before its offer too, so the two cannot deadlock; a claim
that commits first takes the Run out of ``queued``, and this page no longer finds it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
from qinglong_control.domain.convergence import derived_event_id
from qinglong_control.domain.ending_codes import QUEUE_TIMED_OUT
from qinglong_control.domain.queue_timeout import QueuedRun, queue_wait_over
from qinglong_control.domain.states import RunState

QUEUE_TIMEOUT = Actor("reconciler", "queue-timeout")

_LOCK_OVERDUE = SQL["queue_timeouts.lock_overdue"]

_DB_NOW = SQL["clock.db_now"]

_END_RUN = SQL["convergence.end_run"]

_WITHDRAW_OFFERS = SQL["queue_timeouts.withdraw_offers"]


@dataclass(frozen=True)
class _Overdue:
    run_id: uuid.UUID
    state: str
    cancel_reason: str | None
    event_sequence: int
    queued_at_ms: int
    queue_timeout_ms: int | None

    def queued(self) -> QueuedRun:
        return QueuedRun(
            RunState(self.state), self.cancel_reason, self.queued_at_ms, self.queue_timeout_ms
        )


async def time_out_queued_runs(conn: AsyncConnection[Any], limit: int) -> int:
    """End at most ``limit`` (1..128) queued Runs whose queue timeout passed; one
    transaction. Returns how many it ended."""
    if not 1 <= limit <= 128:
        raise ValueError("a queue-timeout page holds 1..128 Runs")
    async with command_transaction(conn, durable_answer=False) as tx:
        locked = await tx.execute(
            "runs.queue_overdue", _LOCK_OVERDUE, {"limit": limit}, kwargs_row(_Overdue)
        )
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        overdue = list(await locked.fetchall())
        now_ms: int = await now.fetchone() or 0
        ended = [run for run in overdue if queue_wait_over(run.queued(), now_ms)]
        for run in ended:
            # The Event's id derives from the wait it ends: a cycle retried after a lost
            # commit finds the Run ended, and a second Event with this id could not be added.
            event_id = derived_event_id("qinglong.queue-timeout.run", run.run_id, run.queued_at_ms)
            event = NewEvent(
                f"run.{RunState.TIMED_OUT.value}",
                None,
                {
                    "from_state": run.state,
                    "to_state": RunState.TIMED_OUT.value,
                    "error_code": QUEUE_TIMED_OUT,
                },
                event_id=event_id,
            )
            await append_events(tx, run.run_id, run.event_sequence, QUEUE_TIMEOUT, now_ms, [event])
            await tx.execute(
                "run.queue_timed_out",
                _END_RUN,
                {
                    "run_id": run.run_id,
                    "run_state": RunState.TIMED_OUT.value,
                    "error_code": QUEUE_TIMED_OUT,
                    "now": now_ms,
                },
            )
        if ended:
            await tx.execute(
                "offers.withdraw", _WITHDRAW_OFFERS, {"run_ids": [run.run_id for run in ended]}
            )
    return len(ended)
