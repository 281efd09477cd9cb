"""The headless lifecycle (SPEC R-W-4): one loop, one tick interval, nothing per run.

Each tick:

0. verifies the inbox file (SQLite does not notice a file overwritten underneath it);
1. keeps the session (renew when due, reopen when fenced);
2. supervises at most ``supervise_limit`` (1..64) open inbox records, taken in a stable
   round-robin order by a cursor over the inbox's admission sequence. A record is
   reconciled when it needs it: anything not yet running (recovery: claim, start,
   completion), a process that exited, a lease whose local estimate ran out, a lease
   due for control (the Reconciler's ``lease_control_seconds``, and always before a
   third of its remaining time is used up), or output the control plane does not hold
   yet (R-OPS-1: a bounded part per pass, lease control first when it is due). The tick
   waits at most ``reconcile_wait_seconds`` for them: a reconcile still retrying goes
   on and the next tick joins it, so one slow Run does not hold back the session's
   renewal or the other Runs' leases;
3. ships output of closed records, best effort and without a lease (R-OPS-1): at most
   :data:`CLOSED_SHIPPING_PER_TICK` records whose file the control plane does not hold
   whole yet (completed ones, and ones closed by a lost lease, a terminal answer or a
   shutdown), in a round-robin order like step 2's, each a bounded pass, waited for
   only for what is left of step 2's ``reconcile_wait_seconds`` (a slow one goes on,
   and the next tick joins it); their outcomes do not decide pulling;
4. only then decides whether to Pull: not when this tick lost a lease, met a
   control-plane terminal, a refusal, a reconcile still in flight or could not confirm
   a stop; not while a durable recovery fact is open (a record other than
   ``running_acknowledged`` still needs work, or a quarantined process that could not
   be verified stopped is still alive); not without an online session; not while
   draining; and never beyond ``max_concurrency`` open records.

Open records are the inbox states that still need work: ``claiming`` … ``exited``
(the start facts and the completion are recovered by the same supervision as
``launching|started|running_acknowledged``).

Shutdown (:meth:`Lifecycle.run`): the first SIGTERM/SIGINT starts a *drain*: no more
pulling and no new start, DrainSession, and the ticks go on supervising (lease control
keeps renewing) so running Attempts can finish within ``drain_grace_seconds``. When the
grace runs out — or at a second signal — the in-flight reconciles are aborted and the
remaining executors are stopped by their verified identities and reported CANCELLED with
``stop_reason = SHUTDOWN`` within ``shutdown_report_seconds``; whatever still runs after
that is stopped without reporting (a restarted Worker reports what was persisted).

An inbox that becomes unreadable is fatal: the executors this process remembers are
stopped (their identities are in memory; the inbox cannot be read), and
:class:`InboxFailed` is raised.

No timer, watcher, queue or connection exists per run; shutdown aborts the reconciles
in flight (their RPCs end CANCELLED) before it returns, so the caller can close the
channel and the inbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Final

from qinglong.worker.v1 import worker_service_pb2 as ws
from qinglong_protocol import bounds

from qinglong_worker.client import CallFailed, WorkerClient
from qinglong_worker.clock import wall_clock_ms
from qinglong_worker.heartbeat import Heartbeat
from qinglong_worker.inbox import (
    OPEN_STATES,
    Inbox,
    InboxRecord,
    InboxUnreadable,
    QuarantineReason,
    RecordState,
)
from qinglong_worker.process import ProcessController
from qinglong_worker.reconcile import Mode, Outcome, Reconciler, identity_of
from qinglong_worker.retention import DEFAULT_RETENTION_DAYS, PRUNE_EVERY_SECONDS, prune
from qinglong_worker.session import ActiveSession, SessionKeeper
from qinglong_worker.supervisor import LEASES_REVOKED_FILE

log = logging.getLogger(__name__)

#: How long a tick waits for an executor it stops again (see Lifecycle._stop_unverified).
_RESTOP_KILL_WAIT_SECONDS = 1.0

SUPERVISE_LIMIT_MAX: Final = 64
#: Closed records whose remaining output one tick ships (a bounded pass each).
CLOSED_SHIPPING_PER_TICK: Final = 2
#: The least a tick waits for them (so each gets going even after slow supervision).
_CLOSED_SHIPPING_MIN_WAIT_SECONDS: Final = 0.1
#: How long a Worker takes no new work after it could not start one for a fault of its
#: own machine (a full disk, no file descriptors): pulling on would give back every Run
#: of the queue, each a lease lifetime late, while the fault lasts.
WORKER_FAULT_PAUSE_SECONDS: Final = 60.0
_NEEDS_RECOVERY: Final = tuple(s for s in OPEN_STATES if s is not RecordState.RUNNING_ACKNOWLEDGED)
#: Records a drain waits for: an executor may run, or its completion is still unreported.
#: (`claiming`/`claimed` are held: their leases expire and the Runs return to the queue.)
_DRAIN_WAITS_FOR: Final = (
    RecordState.LAUNCHING,
    RecordState.STARTED,
    RecordState.RUNNING_ACKNOWLEDGED,
    RecordState.EXITED,
)


@dataclass(frozen=True)
class LifecycleSettings:
    tick_seconds: float = 0.5
    max_concurrency: int = 4
    """Open records (and the session's max_concurrent_attempts): 1..64."""
    supervise_limit: int = 0
    """Records supervised per tick, 1..64; 0 means ``max_concurrency``."""
    drain_grace_seconds: float = 30.0
    """After the first shutdown signal: how long running Attempts may still finish."""
    reconcile_wait_seconds: float = 2.0
    """How long a tick waits for its reconciles before it moves on without them."""
    shutdown_report_seconds: float = 5.0
    """After the grace: the bound on stopping (beyond the TERM→KILL grace) and reporting."""
    retention_seconds: float = DEFAULT_RETENTION_DAYS * 86_400
    """How long a closed record that owes nothing, and its files, are kept (0: for ever);
    see :mod:`qinglong_worker.retention`."""

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
        if not self.drain_grace_seconds >= 0:
            raise ValueError("drain_grace_seconds must not be negative")
        if not (self.reconcile_wait_seconds > 0 and self.shutdown_report_seconds > 0):
            raise ValueError("reconcile_wait_seconds and shutdown_report_seconds must be positive")
        if not self.retention_seconds >= 0:
            raise ValueError("retention_seconds must not be negative")

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


class ShutdownSignals:
    """SIGTERM/SIGINT as the lifecycle sees them: the first asks for a drain, any later
    one to stop at once."""

    def __init__(self) -> None:
        self.drain = asyncio.Event()
        self.now = asyncio.Event()

    def signal(self) -> None:
        if self.drain.is_set():
            self.now.set()
        else:
            self.drain.set()


class InboxFailed(Exception):
    """The inbox became unreadable; the executors this process knew were stopped."""

    def __init__(self, cause: InboxUnreadable, stopped: int) -> None:
        super().__init__(f"{cause}; stopped {stopped} executor(s)")
        self.cause = cause
        self.stopped = stopped


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
        heartbeat: Heartbeat | None = None,
    ) -> None:
        """``heartbeat``: beaten as each tick begins, for a liveness probe."""
        self._settings = settings
        self._heartbeat = heartbeat
        self._inbox = inbox
        self._client = client
        self._reconciler = reconciler
        self._processes = processes
        self._session = session
        self._cursor = 0
        self._closed_cursor = 0
        self._ensuring: asyncio.Task[ActiveSession | None] | None = None
        self._pruned_at: float | None = None
        # Loop time until which nothing is pulled (a fault of this machine, above).
        self._paused_until = 0.0

    async def run(self, signals: ShutdownSignals) -> None:
        """Tick until the first signal; drain; stop what is left; return. Raises
        :class:`InboxFailed` (after stopping the executors it knows) if the inbox
        becomes unreadable."""
        status_dir = self._processes.status_dir
        if status_dir is not None:
            # An earlier run's mark (it lost its inbox) has done its work: its executors
            # were stopped then. From now on a stop is this run's, read as such.
            (status_dir / LEASES_REVOKED_FILE).unlink(missing_ok=True)
        try:
            await self._tick_until(signals.drain, deadline=None)
            # A renewal still retrying from the last tick must not race the drain's calls.
            await self._stop_ensuring()
            if not signals.now.is_set():
                await self._drain(signals)
            await self._stop_remaining()
        except InboxUnreadable as error:
            await self._reconciler.abort()
            stopped = await self._reconciler.stop_remembered()
            raise InboxFailed(error, stopped) from None
        finally:
            await self._stop_ensuring()
            await self._reconciler.abort()

    async def _stop_ensuring(self) -> None:
        if self._ensuring is not None and not self._ensuring.done():
            self._ensuring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ensuring

    async def tick(self) -> TickReport:
        self._inbox.verify()
        if self._reconciler.fatal is not None:
            raise self._reconciler.fatal
        session = await self._session_within(self._settings.reconcile_wait_seconds)
        started = asyncio.get_running_loop().time()
        await self._stop_unverified()
        supervised = await self._supervise()
        left = self._settings.reconcile_wait_seconds - (asyncio.get_running_loop().time() - started)
        await self._ship_closed(max(_CLOSED_SHIPPING_MIN_WAIT_SECONDS, left))
        self._prune_if_due()
        decision = self._pull_decision(supervised, session)
        if decision or session is None:
            return TickReport(supervised, decision or "no session")
        admitted = await self._pull(session)
        if isinstance(admitted, str):
            return TickReport(supervised, admitted)
        self._pause_after_a_fault(admitted)
        return TickReport(supervised, f"pulled {len(admitted)}", admitted)

    async def _session_within(self, seconds: float) -> ActiveSession | None:
        """The session, waited for at most ``seconds`` (None after that: no pulling this
        tick). Renewing or opening it retries for as long as the session may still be
        valid while ingress cannot be reached, and no tick may wait that long before it
        supervises: a local lease may be running out meanwhile (R-W-2). The attempt goes
        on across ticks; a cancelled tick (shutdown) takes it with it, as before."""
        ensuring = self._ensuring
        if ensuring is not None and ensuring.done():
            self._ensuring = None  # raised once: the tick after it tries again
            if not ensuring.cancelled():
                ensuring.result()  # the last one's failure (an unreadable inbox) is this tick's
            ensuring = None
        if ensuring is None:
            ensuring = self._ensuring = asyncio.create_task(self._session.ensure(), name="session")
        try:
            done, _ = await asyncio.wait({ensuring}, timeout=seconds)
        except asyncio.CancelledError:
            ensuring.cancel()
            raise
        return ensuring.result() if done else None

    # --- the loop and shutdown ----------------------------------------------------------------

    async def _tick_until(self, event: asyncio.Event, *, deadline: float | None) -> None:
        """Tick every ``tick_seconds`` until ``event`` is set, the loop-time ``deadline``
        passes or (draining) nothing is left to wait for. A tick still running then is
        cancelled; the reconciles it started go on (the caller decides about those)."""
        loop = asyncio.get_running_loop()
        waiter = asyncio.create_task(event.wait())
        try:
            while not event.is_set():
                if deadline is not None and loop.time() >= deadline:
                    return
                if self._reconciler.mode is not Mode.NORMAL and self._drained():
                    return
                if self._heartbeat is not None:
                    self._heartbeat.beat()
                tick = asyncio.create_task(self.tick())
                timeout = None if deadline is None else max(0.0, deadline - loop.time())
                await asyncio.wait(
                    {tick, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
                )
                if not tick.done():
                    tick.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await tick
                    return
                # Cancelled: a reconcile it waited for was aborted; the next tick goes on.
                error = None if tick.cancelled() else tick.exception()
                if isinstance(error, InboxUnreadable):
                    raise error
                if error is not None:
                    log.error("tick failed: %s", type(error).__name__)
                pause = self._settings.tick_seconds
                if deadline is not None:
                    pause = max(0.0, min(pause, deadline - loop.time()))
                await asyncio.wait({waiter}, timeout=pause)
        finally:
            waiter.cancel()

    def _drained(self) -> bool:
        if self._inbox.count(_DRAIN_WAITS_FOR):
            return False
        # A `claimed` record held by the drain starts nothing, but one whose reconcile is
        # in flight may have AcknowledgeStarting on the wire: once control commits it the
        # Attempt is `starting`, and cut off here it would start nothing and end lost,
        # using up an attempt. The drain lets that start land (then waits for the
        # executor like any other).
        return not any(
            self._reconciler.reconciling(record.offer_id)
            for record in self._inbox.records((RecordState.CLAIMED,))
        )

    async def _drain(self, signals: ShutdownSignals) -> None:
        grace = self._settings.drain_grace_seconds
        log.info("draining: no new work; running Attempts may finish within %.0f s", grace)
        self._reconciler.set_mode(Mode.DRAINING)
        deadline = asyncio.get_running_loop().time() + grace
        await _until_set(self._session.drain(), signals.now)
        await self._tick_until(signals.now, deadline=deadline)
        if signals.now.is_set():
            log.info("second signal: stopping now")
        elif not self._drained():
            log.info("drain grace over")

    async def _stop_remaining(self) -> None:
        """Stop what still runs, report it within a bound, then stop anything left."""
        await self._reconciler.abort()
        self._reconciler.set_mode(Mode.STOPPING)
        self._inbox.verify()
        pending = [record.offer_id for record in self._inbox.records(_DRAIN_WAITS_FOR)]
        if pending:
            log.info("stopping %d Attempt(s) for shutdown", len(pending))
            bound = self._reconciler.stop_grace_seconds + self._settings.shutdown_report_seconds
            round_ = asyncio.create_task(self._reconcile_each(pending))
            done, _ = await asyncio.wait({round_}, timeout=bound)
            if round_ in done:
                error = round_.exception()
                if isinstance(error, InboxUnreadable):
                    raise error
            else:
                round_.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await round_
                await self._reconciler.abort()
        stopped = await self._reconciler.stop_everything()
        if stopped:
            log.warning("stopped %d executor(s) whose completion is not yet reported", stopped)
        left = self._inbox.count(_DRAIN_WAITS_FOR)
        if left:
            log.warning("%d record(s) left for the next start to report", left)

    async def _reconcile_each(self, offer_ids: list[str]) -> None:
        results = await asyncio.gather(
            *(self._reconciler.reconcile(offer_id) for offer_id in offer_ids),
            return_exceptions=True,
        )
        for offer_id, result in zip(offer_ids, results, strict=True):
            if isinstance(result, InboxUnreadable):
                raise result
            if isinstance(result, BaseException):
                log.error("offer %s: shutdown stop failed: %s", offer_id, type(result).__name__)

    # --- supervision ------------------------------------------------------------------------

    async def _supervise(self) -> tuple[tuple[str, Outcome | None], ...]:
        limit = self._settings.effective_supervise_limit
        batch = self._inbox.open_records(after_seq=self._cursor, limit=limit)
        if not batch and self._cursor:
            batch = self._inbox.open_records(after_seq=0, limit=limit)
        # A short batch reached the end: the next tick starts from the beginning again.
        self._cursor = batch[-1][0] if len(batch) == limit else 0
        due = [record.offer_id for _, record in batch if self._due(record)]
        return await self._reconcile_all(due)

    def _due(self, record: InboxRecord) -> bool:
        if record.state is not RecordState.RUNNING_ACKNOWLEDGED:
            return True
        identity = identity_of(record)
        if identity is None or self._processes.poll(identity) is not None:
            return True
        return (
            # On the Reconciler's lease clock, the one its reconciles judge by.
            self._reconciler.lease_control_due(record)
            or self._reconciler.lease_lost_locally(record)
            or self._reconciler.output_pending(record)
        )

    async def _ship_closed(self, wait_seconds: float) -> None:
        """Step 3: the output closed records still owe, after the live records' lease
        control; the tick takes no longer for it than the reconciles' wait, and nothing
        here decides pulling."""
        limit = CLOSED_SHIPPING_PER_TICK
        batch = self._inbox.closed_with_output(after_seq=self._closed_cursor, limit=limit)
        if not batch and self._closed_cursor:
            batch = self._inbox.closed_with_output(limit=limit)
        # Round-robin like supervision: a record that keeps failing holds no one up.
        self._closed_cursor = batch[-1][0] if len(batch) == limit else 0
        await self._reconcile_all([record.offer_id for _, record in batch], wait_seconds)

    async def _reconcile_all(
        self, offer_ids: list[str], wait_seconds: float | None = None
    ) -> tuple[tuple[str, Outcome | None], ...]:
        if not offer_ids:
            return ()
        waiters = [
            asyncio.ensure_future(self._reconciler.reconcile(offer_id)) for offer_id in offer_ids
        ]
        try:
            wait = self._settings.reconcile_wait_seconds if wait_seconds is None else wait_seconds
            _, pending = await asyncio.wait(waiters, timeout=wait)
        except asyncio.CancelledError:
            # Only the waiting is cancelled: the shared reconciles go on (abort() ends them).
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
            raise
        for waiter in pending:
            waiter.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        outcomes: list[tuple[str, Outcome | None]] = []
        for offer_id, waiter in zip(offer_ids, waiters, strict=True):
            if waiter in pending:
                outcomes.append((offer_id, Outcome.IN_FLIGHT))
                continue
            if waiter.cancelled():
                raise asyncio.CancelledError  # the reconcile itself was aborted
            error = waiter.exception()
            if isinstance(error, InboxUnreadable):
                raise error
            if error is not None:
                log.error("offer %s: reconcile failed: %s", offer_id, type(error).__name__)
                outcomes.append((offer_id, None))
            else:
                outcomes.append((offer_id, waiter.result()))
        return tuple(outcomes)

    # --- pulling ------------------------------------------------------------------------------

    def _pause_after_a_fault(self, outcomes: tuple[tuple[str, Outcome | None], ...]) -> None:
        if any(outcome is Outcome.WORKER_FAULT for _, outcome in outcomes):
            now = asyncio.get_running_loop().time()
            self._paused_until = now + WORKER_FAULT_PAUSE_SECONDS

    def _pull_decision(
        self,
        supervised: tuple[tuple[str, Outcome | None], ...],
        session: ActiveSession | None,
    ) -> str:
        """Empty to pull; otherwise why not."""
        if self._reconciler.mode is not Mode.NORMAL:
            return "draining"
        self._pause_after_a_fault(supervised)
        if asyncio.get_running_loop().time() < self._paused_until:
            return "paused: a start failed for a fault of this machine (disk, descriptors)"
        if any(outcome is None or outcome.stops_pulling for _, outcome in supervised):
            return "lease lost, terminal, refused, in flight or unconfirmed stop this tick"
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

    def _prune_if_due(self) -> None:
        """Closed records past their retention go, a batch at most every
        :data:`~qinglong_worker.retention.PRUNE_EVERY_SECONDS` (the first at start)."""
        retention = self._settings.retention_seconds
        now = asyncio.get_running_loop().time()
        if not retention or (
            self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY_SECONDS
        ):
            return
        self._pruned_at = now
        prune(
            self._inbox,
            self._processes,
            self._reconciler.log_dir,
            updated_before_unix_ms=wall_clock_ms() - int(retention * 1000),
        )

    def _room(self) -> int:
        return self._settings.max_concurrency - self._inbox.count(OPEN_STATES)

    async def _stop_unverified(self) -> None:
        """Stop again, every tick, each executor whose stop could not be confirmed when its
        lease was lost or its Run ended (a transient failure to pin or read the process):
        its lease is gone, so the control plane may start the Run elsewhere, and it must
        not run on. The TERM grace was spent on the first try: SIGKILL at once, and wait
        for it only briefly (the next tick tries again; a process that cannot be killed
        must not hold up the other records' lease control — nor may several: they are
        stopped together, so the tick waits one kill wait however many there are)."""
        alive = [
            (record, identity)
            for record in self._inbox.quarantined(
                QuarantineReason.LEASE_LOST_LOCAL_EXECUTION_UNVERIFIED
            )
            if (identity := identity_of(record)) is not None
            and self._processes.poll(identity) is None
        ]
        results = await asyncio.gather(
            *(
                self._processes.stop(
                    identity, grace_seconds=0.0, kill_wait_seconds=_RESTOP_KILL_WAIT_SECONDS
                )
                for _, identity in alive
            )
        )
        for (record, _), stopped in zip(alive, results, strict=True):
            log.warning(
                "offer %s: its executor outlived its lease; stopped again: %s",
                record.offer_id,
                stopped,
            )

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
            # Within the tick's wait, like the rest of it: the next tick's supervision (a
            # lease that ran out) must not wait behind a slow pull.
            pulled = await self._client.pull_offers(
                ws.PullOffersRequest(
                    worker_id=worker_id,
                    session_id=session.session_id,
                    worker_generation=session.worker_generation,
                    max_offers=max_offers,
                ),
                budget_seconds=self._settings.reconcile_wait_seconds,
            )
        except CallFailed as failure:
            if failure.fenced:
                self._session.forget(session.session_id)  # the next tick replaces it
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


async def _until_set(work: Coroutine[Any, Any, None], event: asyncio.Event) -> None:
    """Run ``work`` unless or until ``event`` is set (then cancel it)."""
    task = asyncio.create_task(work)
    waiter = asyncio.create_task(event.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
