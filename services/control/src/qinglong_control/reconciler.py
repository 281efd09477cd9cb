"""The convergence coordinator: one bounded cycle of lease expiry, convergence, queue
timeouts, retries, admission to tasks' concurrency slots, the expiry of approval requests
nobody decided in time (R-OPS-2), of old Run output (its retention age, R-OPS-1) and of
security audit rows past theirs.

It owns no timer, connection or queue (SPEC R-CONV-1): the service's single cadence calls
`cycle()`, which borrows one pooled connection for its duration. Overlapping calls are
coalesced: a caller that arrives while a cycle runs waits for that cycle's report.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any, Final, Generic, TypeVar

import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool
from qinglong_protocol.storage_errors import Verdict, classify

from qinglong_control import metrics as prometheus
from qinglong_control.db.approvals import expire_page as expire_approvals
from qinglong_control.db.audit_retention import prune_audit
from qinglong_control.db.cancellation import stop_runs_of_disabled_projects
from qinglong_control.db.concurrency_slots import (
    AdmissionCursor,
    AdmissionPage,
    admission_pages,
)
from qinglong_control.db.convergence import ExpiryPage, converge_page, expire_leases
from qinglong_control.db.output import OutputStore, TableOutputStore
from qinglong_control.db.queue_timeouts import time_out_queued_runs
from qinglong_control.db.retries import retry_page
from qinglong_control.domain.audit_retention import AuditRetention
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
    audit_rows_removed: int = 0
    disabled_projects_runs_stopped: int = 0
    queue_timeouts: int = 0
    runs_admitted: int = 0


Page = TypeVar("Page")


@dataclass(frozen=True)
class Step(Generic[Page]):
    """One kind of the cycle's work: ``page`` does one bounded page of it, ``found`` says
    how many items that page held (the page size means there may be more)."""

    name: str
    page: Callable[[], Awaitable[Page]]
    found: Callable[[Page], int]


def _candidates(page: Any) -> int:
    return int(page.candidates)


def _tasks_listed(page: AdmissionPage) -> int:
    return page.listed


def _listed(page: ExpiryPage) -> int:
    # What the page listed, not what this replica expired: with replicas expiring the
    # same oldest leases side by side, each expires part of every page, and counting only
    # its own part ended every replica's cycle after one page (R-HA-1).
    return page.listed


_log = logging.getLogger(__name__)

#: A page of work may hold many short transactions one after another (lease expiry: one
#: per lease), so it may take this many statement bounds before it counts as hung.
PAGE_TIMEOUT_STATEMENTS = 6


#: How long a cycle cancelled at shutdown may take to unwind before the pools close.
_CANCEL_WAIT_SECONDS: Final = 1.0


class ReconcilerStopped(RuntimeError):
    """The reconciler was stopped (the service is shutting down)."""


class Reconciler:
    def __init__(
        self,
        pool: AsyncConnectionPool[AsyncConnection[Any]],
        limits: ReconcilerLimits,
        timings: Timings | None = None,
        output_retention: OutputRetention | None = None,
        output_store: OutputStore | None = None,
        audit_retention: AuditRetention | None = None,
        page_timeout_seconds: float | None = None,
    ) -> None:
        """``page_timeout_seconds`` bounds each page of work: a server that stopped
        answering (a hung backend, its kernel still acknowledging) would otherwise hold the
        cycle, and so every later one of this replica, for ever; the page is cancelled,
        its connection closed, and the next cycle starts on another. The service gives
        :data:`PAGE_TIMEOUT_STATEMENTS` statement bounds."""
        self._pool = pool
        self._page_timeout = page_timeout_seconds
        self._limits = limits
        self._timings = timings or Timings()
        self._output_retention = output_retention or OutputRetention()
        self._output = output_store or TableOutputStore(pool)
        self._audit_retention = audit_retention or AuditRetention()
        self._admission = AdmissionCursor()
        self._running: asyncio.Task[CycleReport] | None = None
        self._stopped = False

    async def cycle(self) -> CycleReport:
        """One cycle; a caller that comes while one runs waits for that one (coalesced).
        Cancelling a caller does not cancel the cycle (other callers may wait for it):
        :meth:`stop` ends the reconciler."""
        if self._stopped:
            raise ReconcilerStopped
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._cycle())
        return await asyncio.shield(self._running)

    async def stop(self, timeout_seconds: float) -> bool:
        """No cycle starts any more; the one in flight may finish within
        ``timeout_seconds``, else it is cancelled (its pages are short transactions:
        what it committed stays, the next replica's cycle does the rest) and given
        :data:`_CANCEL_WAIT_SECONDS` to unwind. True if it finished (or none ran). Called
        before the service closes the pools the cycle works on."""
        self._stopped = True
        running = self._running
        if running is None or running.done():
            return True
        done, _ = await asyncio.wait({running}, timeout=timeout_seconds)
        if not done:
            running.cancel()
            await asyncio.wait({running}, timeout=_CANCEL_WAIT_SECONDS)
        if running.done() and not running.cancelled():
            running.exception()  # retrieved: a failed last cycle was logged by its caller
        return bool(done)

    async def _cycle(self) -> CycleReport:
        started = time.perf_counter()
        try:
            report, failed = await self._work()
        except Exception:
            prometheus.RECONCILE_CYCLE_DURATION.labels("error").observe(
                time.perf_counter() - started
            )
            raise
        outcome = "error" if failed else "ok"
        prometheus.RECONCILE_CYCLE_DURATION.labels(outcome).observe(time.perf_counter() - started)
        for kind, count in asdict(report).items():
            prometheus.RECONCILE_WORK.labels(kind).observe(count)
        return report

    def steps(self, conn: AsyncConnection[Any]) -> list[Step[Any]]:
        """The cycle's work on its connection, in the order a cycle does it (the benchmark
        times each one from this list too)."""
        size = self._limits.page_size
        return [
            Step("expire_leases", lambda: expire_leases(conn, size), _listed),
            # Before convergence, so that it ends the queued ones in the same cycle.
            Step("stop_disabled", lambda: stop_runs_of_disabled_projects(conn, size), int),
            Step("converge", lambda: converge_page(conn, size), _candidates),
            Step("queue_timeout", lambda: time_out_queued_runs(conn, size), int),
            Step("retry", lambda: retry_page(conn, size, self._timings), _candidates),
            # After every step that ends Runs or requeues them, so the slots they free are
            # taken in the same cycle.
            Step(
                "admit",
                admission_pages(conn, size, self._timings, self._admission),
                _tasks_listed,
            ),
            Step("expire_approvals", lambda: expire_approvals(conn, size), int),
            Step(
                "prune_audit",
                lambda: prune_audit(conn, self._audit_retention.max_age_ms, size),
                int,
            ),
        ]

    def output_step(self) -> Step[int]:
        """Run output's expiry, after the others: the store borrows a connection of its own
        (a blob store would need none), so the cycle's is given back first."""
        size, max_age_ms = self._limits.page_size, self._output_retention.max_age_ms
        return Step("expire_output", lambda: self._output.expire(max_age_ms, size), int)

    async def _pages(self, step: Step[Page]) -> list[Page]:
        """``step``'s page again while it came back full, at most ``max_pages`` times: the
        cycle stays bounded, and whatever is left waits for the next one."""
        pages = []
        for _ in range(self._limits.max_pages):
            async with asyncio.timeout(self._page_timeout):
                page = await step.page()
            pages.append(page)
            if step.found(page) < self._limits.page_size:
                break
        return pages

    async def _step(self, step: Step[Page], failed: list[str]) -> list[Page]:
        """``step``'s pages. A step that fails for a reason of its own (a row it cannot
        handle, a privilege gone, a bug) is logged and counted, and the cycle's other
        steps still run: one stuck step must not stop expiry, convergence or retention
        on every replica for good. An unreachable or hung database ends the cycle (the
        next one tries every step again) — and so does a step whose page outlives its
        bound or hits the statement timeout, which look the same from here. A failed
        step's report counts none of its pages, committed ones included."""
        try:
            return await self._pages(step)
        except Exception as error:
            if _database_unreachable(error):
                raise
            _log.error("reconcile step %s failed; the cycle goes on", step.name, exc_info=error)
            prometheus.RECONCILE_STEP_FAILURES.labels(step.name).inc()
            failed.append(step.name)
            return []

    async def _work(self) -> tuple[CycleReport, list[str]]:
        failed: list[str] = []
        async with self._pool.connection() as conn:
            done = {step.name: await self._step(step, failed) for step in self.steps(conn)}
        output = self.output_step()
        done[output.name] = await self._step(output, failed)
        converged, retried = done["converge"], done["retry"]
        report = CycleReport(
            expired=sum(page.expired for page in done["expire_leases"]),
            converged=sum(page.converged for page in converged),
            blocked=sum(page.blocked for page in converged),
            pages=len(converged),
            retries_scheduled=sum(page.scheduled for page in retried),
            retries_exhausted=sum(page.exhausted for page in retried),
            requeued=sum(page.requeued for page in retried),
            approvals_expired=sum(done["expire_approvals"]),
            outputs_expired=sum(done["expire_output"]),
            audit_rows_removed=sum(done["prune_audit"]),
            disabled_projects_runs_stopped=sum(done["stop_disabled"]),
            queue_timeouts=sum(done["queue_timeout"]),
            runs_admitted=sum(page.admitted for page in done["admit"]),
        )
        return report, failed


def _database_unreachable(error: Exception) -> bool:
    """A page that outlived its bound (a hung server), or a failure the storage rule
    calls transient (a lost connection, a pool timeout, a server shutting down)."""
    if isinstance(error, TimeoutError):
        return True
    if not isinstance(error, psycopg.Error):
        return False
    verdict = classify(error.sqlstate, operational=isinstance(error, psycopg.OperationalError))
    return verdict is Verdict.UNAVAILABLE
