"""The headless lifecycle (SPEC R-W-4): one loop, one tick interval, nothing per run.

Each tick:

1. keeps the session (renew when due, reopen when fenced);
2. supervises at most ``supervise_limit`` (1..64) open inbox records, taken in a stable
   round-robin order by a cursor over the inbox's admission sequence. A record is
   reconciled when it needs it: anything not yet running (recovery: claim, start,
   completion), a process that exited, a lease whose local estimate ran out, or a
   lease due for control (every ``lease_control_seconds``, and always before a third
   of its remaining time is used up);
3. only then decides whether to Pull: not when this tick lost a lease, met a
   control-plane terminal or could not confirm a stop; not while a durable recovery
   fact is open (a record other than ``running_acknowledged`` still needs work, or a
   quarantined process that could not be verified stopped is still alive); not
   without an online session; and never beyond ``max_concurrency`` open records.

Open records are the inbox states that still need work: ``claiming`` … ``exited``
(the start facts and the completion are recovered by the same supervision as
``launching|started|running_acknowledged``).

No timer, watcher, queue or connection exists per run; shutdown cancels the tick,
aborts the reconciles in flight (their RPCs end CANCELLED) and only then returns, so
the caller can close the channel and the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds

from qinglong_worker.client import CallFailed, WorkerClient
from qinglong_worker.inbox import (
    OPEN_STATES,
    Inbox,
    InboxRecord,
    QuarantineReason,
    RecordState,
)
from qinglong_worker.process import ProcessController
from qinglong_worker.reconcile import Outcome, Reconciler, identity_of, wall_clock_ms
from qinglong_worker.session import ActiveSession, SessionKeeper

log = logging.getLogger(__name__)

SUPERVISE_LIMIT_MAX: Final = 64
_NEEDS_RECOVERY: Final = tuple(s for s in OPEN_STATES if s is not RecordState.RUNNING_ACKNOWLEDGED)


@dataclass(frozen=True)
class LifecycleSettings:
    tick_seconds: float = 0.5
    max_concurrency: int = 4
    """Open records (and the session's max_concurrent_attempts): 1..64."""
    supervise_limit: int = 0
    """Records supervised per tick, 1..64; 0 means ``max_concurrency``."""
    lease_control_seconds: float = 2.0
    """How often a running Attempt's lease is controlled (renewal, stop, terminal)."""

    def __post_init__(self) -> None:
        if not self.tick_seconds > 0:
            raise ValueError("tick_seconds must be positive")
        if (
            not bounds.MAX_CONCURRENT_ATTEMPTS_MIN
            <= self.max_concurrency
            <= (bounds.MAX_CONCURRENT_ATTEMPTS_MAX)
        ):
            raise ValueError("max_concurrency must be 1..64")
        if not 0 <= self.supervise_limit <= SUPERVISE_LIMIT_MAX:
            raise ValueError("supervise_limit must be 1..64 (or 0 for max_concurrency)")
        if not self.lease_control_seconds > 0:
            raise ValueError("lease_control_seconds must be positive")

    @property
    def effective_supervise_limit(self) -> int:
        return self.supervise_limit or self.max_concurrency


@dataclass(frozen=True)
class TickReport:
    supervised: tuple[tuple[str, Outcome | None], ...]
    """(offer id, outcome) per reconciled record; None when the reconcile raised."""
    pull: str
    """Why the tick did or did not pull."""
    admitted: tuple[tuple[str, Outcome | None], ...] = ()


class Lifecycle:
    def __init__(
        self,
        *,
        settings: LifecycleSettings,
        inbox: Inbox,
        client: WorkerClient,
        reconciler: Reconciler,
        processes: ProcessController,
        session: SessionKeeper,
        clock: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self._settings = settings
        self._inbox = inbox
        self._client = client
        self._reconciler = reconciler
        self._processes = processes
        self._session = session
        self._clock = clock
        self._cursor = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until ``stop`` is set; then abort what is in flight and return."""
        stopping = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                tick = asyncio.create_task(self.tick())
                await asyncio.wait({tick, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not tick.done():
                    tick.cancel()
                    await self._reconciler.abort()
                    with contextlib.suppress(asyncio.CancelledError):
                        await tick
                    break
                if tick.exception() is not None:
                    log.error("tick failed: %s", type(tick.exception()).__name__)
                await asyncio.wait({stopping}, timeout=self._settings.tick_seconds)
        finally:
            stopping.cancel()
            await self._reconciler.abort()

    async def tick(self) -> TickReport:
        session = await self._session.ensure()
        supervised = await self._supervise()
        decision = self._pull_decision(supervised, session)
        if decision or session is None:
            return TickReport(supervised, decision or "no session")
        admitted = await self._pull(session)
        if isinstance(admitted, str):
            return TickReport(supervised, admitted)
        return TickReport(supervised, f"pulled {len(admitted)}", admitted)

    # --- supervision ------------------------------------------------------------------------

    async def _supervise(self) -> tuple[tuple[str, Outcome | None], ...]:
        limit = self._settings.effective_supervise_limit
        batch = self._inbox.open_records(after_seq=self._cursor, limit=limit)
        if not batch and self._cursor:
            batch = self._inbox.open_records(after_seq=0, limit=limit)
        # A short batch reached the end: the next tick starts from the beginning again.
        self._cursor = batch[-1][0] if len(batch) == limit else 0
        now = self._clock()
        due = [record.offer_id for _, record in batch if self._due(record, now)]
        return await self._reconcile_all(due)

    def _due(self, record: InboxRecord, now: int) -> bool:
        if record.state is not RecordState.RUNNING_ACKNOWLEDGED:
            return True
        identity = identity_of(record)
        if identity is None or self._processes.poll(identity) is not None:
            return True
        if record.lease_observed_unix_ms is None or record.lease_remaining_ms is None:
            return True
        elapsed = now - record.lease_observed_unix_ms
        control_every = min(
            int(self._settings.lease_control_seconds * 1000), record.lease_remaining_ms // 3
        )
        return elapsed >= control_every or record.lease_lost_locally(now)

    async def _reconcile_all(self, offer_ids: list[str]) -> tuple[tuple[str, Outcome | None], ...]:
        results = await asyncio.gather(
            *(self._reconciler.reconcile(offer_id) for offer_id in offer_ids),
            return_exceptions=True,
        )
        outcomes: list[tuple[str, Outcome | None]] = []
        for offer_id, result in zip(offer_ids, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                log.error("offer %s: reconcile failed: %s", offer_id, type(result).__name__)
                outcomes.append((offer_id, None))
            else:
                outcomes.append((offer_id, result))
        return tuple(outcomes)

    # --- pulling ------------------------------------------------------------------------------

    def _pull_decision(
        self,
        supervised: tuple[tuple[str, Outcome | None], ...],
        session: ActiveSession | None,
    ) -> str:
        """Empty to pull; otherwise why not."""
        if any(outcome is None or outcome.stops_pulling for _, outcome in supervised):
            return "lease lost, terminal or unconfirmed stop this tick"
        if self._inbox.count(_NEEDS_RECOVERY):
            return "recovery pending"
        if self._unverified_process_alive():
            return "an unverified process is still alive"
        if session is None:
            return "no session"
        if not session.online:
            return "session draining"
        if self._room() <= 0:
            return "at capacity"
        return ""

    def _room(self) -> int:
        return self._settings.max_concurrency - self._inbox.count(OPEN_STATES)

    def _unverified_process_alive(self) -> bool:
        for record in self._inbox.quarantined(
            QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
        ):
            identity = identity_of(record)
            if identity is not None and self._processes.poll(identity) is None:
                return True
        return False

    async def _pull(self, session: ActiveSession) -> tuple[tuple[str, Outcome | None], ...] | str:
        worker_id = self._session.worker_id
        max_offers = min(self._room(), bounds.MAX_OFFERS_MAX)
        try:
            pulled = await self._client.pull_offers(
                ws.PullOffersRequest(
                    worker_id=worker_id,
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    max_offers=max_offers,
                )
            )
        except CallFailed as failure:
            return f"pull failed: {failure.label}"
        fresh = [
            offer.offer_id
            for offer in pulled.offers[:max_offers]
            if self._reconciler.admit(
                offer=offer,
                worker_id=worker_id,
                session_id=session.session_id,
                worker_generation=session.worker_generation,
            )
        ]
        return await self._reconcile_all(fresh)
