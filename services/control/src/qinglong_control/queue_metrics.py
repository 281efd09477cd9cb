"""The queue's gauges, sampled on a cadence of their own (docs/observability.md).

Not a step of the reconcile cycle: the cycle's cost must not grow with the backlog
(bench_scale holds it to that), and counting the queue does, a little. Every replica
samples the same database, so each reports the same values.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from qinglong_control import metrics
from qinglong_control.db.queue import queue_parts

#: Often enough for an alert on a queue that stopped moving, rare enough to cost nothing.
QUEUE_SAMPLE_SECONDS: Final = 15.0

_log = logging.getLogger(__name__)


async def record_queue(conn: AsyncConnection[Any]) -> None:
    """Read the queue once and set the gauges (the oldest age is 0 when none waits)."""
    for part in await queue_parts(conn):
        metrics.QUEUED_RUNS.labels(part.part).set(part.runs)
        metrics.OLDEST_QUEUED_RUN_AGE.labels(part.part).set((part.oldest_age_ms or 0) / 1000)


async def sample_queue(
    pool: AsyncConnectionPool[AsyncConnection[Any]], interval_seconds: float
) -> None:
    """Until cancelled: :func:`record_queue` now and every ``interval_seconds``. A failed
    sample (the database away) leaves the last values and is tried at the next tick."""
    while True:
        try:
            async with pool.connection() as conn:
                await record_queue(conn)
        except Exception:
            _log.warning("sampling the queue failed", exc_info=True)
        await asyncio.sleep(interval_seconds)
