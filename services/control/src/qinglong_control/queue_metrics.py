"""The queue's gauges, sampled on a cadence of their own (docs/observability.md).

Not a step of the reconcile cycle, whose cost must not grow with the backlog (bench_scale
holds it to that); but on the reconciler's own connection, so that it never competes with
the commands for theirs, and only where the reconcile cadence runs. Every replica samples
the same database, so each reports the same values.
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
_GAUGES: Final = (metrics.QUEUED_RUNS, metrics.OLDEST_QUEUED_RUN_AGE)


async def record_queue(conn: AsyncConnection[Any]) -> None:
    """Read the queue once and set the gauges (the oldest age is 0 when none waits)."""
    for part in await queue_parts(conn):
        metrics.QUEUED_RUNS.labels(part.part).set(part.runs)
        metrics.OLDEST_QUEUED_RUN_AGE.labels(part.part).set((part.oldest_age_ms or 0) / 1000)


def forget_queue() -> None:
    """No values rather than stale ones: an alert on a growing wait could not fire on a
    value frozen by failing samples, an alert on an absent series can."""
    for gauge in _GAUGES:
        gauge.clear()


async def sample_queue(
    pool: AsyncConnectionPool[AsyncConnection[Any]], interval_seconds: float
) -> None:
    """Until cancelled: :func:`record_queue` now and every ``interval_seconds``; after a
    failed sample (the database away) the gauges are absent until one succeeds."""
    failing = False
    while True:
        try:
            async with pool.connection() as conn:
                await record_queue(conn)
        except Exception as error:
            forget_queue()
            if not failing:  # once an outage, not every tick
                _log.warning("sampling the queue failed: %s", error)
            failing = True
        else:
            failing = False
        await asyncio.sleep(interval_seconds)
