"""The convergence coordinator: one bounded cycle of lease expiry, convergence, retries,
the expiry of approval requests nobody decided in time (R-OPS-2) and of old Run output
(its retention age, R-OPS-1).

It owns no timer, connection or queue (SPEC R-CONV-1): the service's single cadence calls
`cycle()`, which borrows one pooled connection for its duration. Overlapping calls are
coalesced: a caller that arrives while a cycle runs waits for that cycle's report.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool

from qinglong_control import metrics as prometheus
from qinglong_control.db.approvals import expire_page as expire_approvals
from qinglong_control.db.convergence import converge_page, expire_leases
from qinglong_control.db.output import OutputStore, TableOutputStore
from qinglong_control.db.retries import retry_page
from qinglong_control.domain.output import OutputRetention
from qinglong_control.domain.timings import Timings


@dataclass(frozen=True)
class ReconcilerLimits:
    page_size: int = 128
    max_pages: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= 128 or not 1 <= self.max_pages <= 64:
            raise ValueError("page_size must be 1..128 and max_pages 1..64")


@dataclass(frozen=True)
class CycleReport:
    expired: int
    converged: int
    blocked: int
    pages: int
    retries_scheduled: int = 0
    retries_exhausted: int = 0
    requeued: int = 0
    approvals_expired: int = 0
    outputs_expired: int = 0


class Reconciler:
    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        limits: ReconcilerLimits,
        timings: Timings | None = None,
        output_retention: OutputRetention | None = None,
        output_store: OutputStore | None = None,
    ) -> None:
        self._pool = pool
        self._limits = limits
        self._timings = timings or Timings()
        self._output_retention = output_retention or OutputRetention()
        self._output = output_store or TableOutputStore(pool)
        self._running: asyncio.Task[CycleReport] | None = None

    async def cycle(self) -> CycleReport:
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._cycle())
        return await asyncio.shield(self._running)

    async def _cycle(self) -> CycleReport:
        started = time.perf_counter()
        try:
            report = await self._work()
        except Exception:
            prometheus.RECONCILE_CYCLE_DURATION.labels("error").observe(
                time.perf_counter() - started
            )
            raise
        prometheus.RECONCILE_CYCLE_DURATION.labels("ok").observe(time.perf_counter() - started)
        for kind, count in asdict(report).items():
            prometheus.RECONCILE_WORK.labels(kind).observe(count)
        return report

    async def _work(self) -> CycleReport:
        limits = self._limits
        expired = converged = blocked = pages = 0
        async with self._pool.connection() as conn:
            for _ in range(limits.max_pages):
                count = await expire_leases(conn, limits.page_size)
                expired += count
                if count < limits.page_size:
                    break
            for _ in range(limits.max_pages):
                page = await converge_page(conn, limits.page_size)
                pages += 1
                converged += page.converged
                blocked += page.blocked
                if page.candidates < limits.page_size:
                    break
            scheduled = exhausted = requeued = 0
            for _ in range(limits.max_pages):
                retry = await retry_page(conn, limits.page_size, self._timings)
                scheduled += retry.scheduled
                exhausted += retry.exhausted
                requeued += retry.requeued
                if retry.candidates < limits.page_size:
                    break
            approvals_expired = 0
            for _ in range(limits.max_pages):
                count = await expire_approvals(conn, limits.page_size)
                approvals_expired += count
                if count < limits.page_size:
                    break
        outputs_expired = 0
        for _ in range(limits.max_pages):
            count = await self._output.expire(self._output_retention.max_age_ms, limits.page_size)
            outputs_expired += count
            if count < limits.page_size:
                break
        return CycleReport(
            expired,
            converged,
            blocked,
            pages,
            scheduled,
            exhausted,
            requeued,
            approvals_expired,
            outputs_expired,
        )
