"""The Worker's session: open it, renew it on the server's cadence, resume it after a restart.

The session is persisted in the inbox, so a restarted daemon first tries to *renew* the
session it had. If that still works (the restart was shorter than the session's
lifetime), every inbox record keeps a valid fence and running executors are simply
supervised again. If the session was fenced or expired, a new one is opened: records of
the old session will then be refused as fenced and handled as a lost lease.

OpenSession is idempotent by request id (AIP-155); the id is persisted before the call,
so a retry after a lost answer returns the same session instead of a second one.

Draining (the daemon's graceful shutdown): :meth:`SessionKeeper.drain` sends
DrainSession — no new offers from then on, claimed work may finish — and from then on
the keeper only renews, it never opens another session. A later start that resumes a
session left draining keeps it while the inbox still has open records of it (they are
finished under it) and opens a fresh, online session once there are none.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Final

from qinglong.rpc.v1 import execution_pb2
from qinglong.worker.v1 import worker_pb2
from qinglong.worker.v1 import worker_service_pb2 as ws

from qinglong_worker.client import CallFailed, WorkerClient
from qinglong_worker.clock import boot_clock_seconds
from qinglong_worker.inbox import OPEN_STATES, Inbox, SessionRecord

log = logging.getLogger(__name__)
#: This Worker hands a Run's parameters to its executor (reconcile.py): it says so when
#: it opens and renews its session, so that placement offers it Runs that have some.
PASSES_RUN_PARAMETERS: Final = True

#: Renew after this fraction of the remaining lifetime when the server suggests nothing.
_RENEW_FRACTION: Final = 1 / 3
#: DrainSession is best effort at shutdown: it is not worth more than this.
_DRAIN_BUDGET_SECONDS: Final = 5.0
#: After OpenSession was refused for good (a disabled Worker, an identity no longer
#: enrolled), the next try waits this long, doubling up to the cap. Each refused call is a
#: security-audit row in ingress: without the wait, a disabled Worker wrote two a second
#: for as long as it ran. A transient failure is not waited for (the call retried it).
OPEN_BACKOFF_FIRST_SECONDS: Final = 1.0
OPEN_BACKOFF_MAX_SECONDS: Final = 60.0


def agent_version() -> str:
    try:
        return f"qinglong-worker/{metadata.version('qinglong-worker')}"
    except metadata.PackageNotFoundError:
        return "qinglong-worker"


@dataclass(frozen=True)
class ActiveSession:
    session_id: str
    worker_generation: int
    state: worker_pb2.SessionState.ValueType
    renew_at: float
    """Boot-clock time of the next renewal (in-memory only; never a durable fact)."""
    expires_at: float
    """Boot-clock time after which the session must be presumed expired (the boot clock
    counts a suspend, as the control plane's clock does: see `qinglong_worker.clock`)."""

    @property
    def online(self) -> bool:
        return self.state == worker_pb2.SESSION_STATE_ONLINE


class SessionKeeper:
    def __init__(
        self,
        *,
        inbox: Inbox,
        client: WorkerClient,
        worker_id: str,
        max_concurrency: int,
        labels: Mapping[str, str] | None = None,
        clock: Callable[[], float] = boot_clock_seconds,
    ) -> None:
        self._inbox = inbox
        self._client = client
        self._worker_id = worker_id
        self._max_concurrency = max_concurrency
        self._labels = dict(labels or {})
        self._clock = clock
        self._active: ActiveSession | None = None
        self._renew_interval: float | None = None
        self._draining = False
        self._open_backoff = 0.0
        self._open_not_before = 0.0

    @property
    def worker_id(self) -> str:
        return self._worker_id

    @property
    def active(self) -> ActiveSession | None:
        return self._active

    def forget(self, session_id: str) -> None:
        """The control plane refused ``session_id`` as fenced or expired (a pull, say):
        the next :meth:`ensure` renews or replaces it, rather than handing it out until
        its renewal is due."""
        if self._active is not None and self._active.session_id == session_id:
            self._active = None

    @property
    def draining(self) -> bool:
        """This process asked for its session to drain (it is shutting down)."""
        return self._draining

    async def ensure(self) -> ActiveSession | None:
        """The live session, renewed or (re)opened when due; None while unreachable.

        While draining, a session that is gone is not replaced (None)."""
        now = self._clock()
        active = self._active
        if active is not None and now < active.renew_at:
            if self._left_draining(active):
                return await self._open(self._inbox.session())
            return active
        stored = self._inbox.session()
        if (
            stored is not None
            and stored.worker_id == self._worker_id
            and stored.session_id is not None
            and stored.worker_generation is not None
        ):
            try:
                renewed = await self._renew(stored.session_id, stored.worker_generation, now)
            except CallFailed as failure:
                if failure.transient:
                    log.info("session renewal failed: %s", failure)
                    return self._still_valid(now)
                self._active = None
                if self._draining:
                    log.warning("session %s is gone (%s)", stored.session_id, failure)
                    return None
                log.warning("session %s is gone (%s); opening another", stored.session_id, failure)
            else:
                if not self._left_draining(renewed):
                    return renewed
        if self._draining:
            return None
        return await self._open(stored)

    async def drain(self) -> None:
        """DrainSession (best effort, bounded): the control plane places nothing more
        here. From now on this keeper only renews."""
        self._draining = True
        stored = self._inbox.session()
        if stored is None or stored.session_id is None or stored.worker_generation is None:
            return
        try:
            drained = await self._client.drain_session(
                ws.DrainSessionRequest(
                    worker_id=self._worker_id,
                    session_id=stored.session_id,
                    worker_generation=stored.worker_generation,
                ),
                budget_seconds=_DRAIN_BUDGET_SECONDS,
            )
        except CallFailed as failure:
            log.warning("draining session %s failed: %s", stored.session_id, failure)
            return
        log.info("session %s draining", stored.session_id)
        active = self._active
        if active is not None and active.session_id == stored.session_id:
            remaining = drained.session_remaining.ToMilliseconds() / 1000
            self._active = dataclasses.replace(
                active,
                state=drained.session_state,
                expires_at=min(active.expires_at, self._clock() + remaining),
            )

    def _left_draining(self, active: ActiveSession) -> bool:
        """A session an earlier run of this Worker drained, with nothing left to finish
        under it: time for a fresh one."""
        return (
            not self._draining
            and active.state == worker_pb2.SESSION_STATE_DRAINING
            and self._inbox.count(OPEN_STATES) == 0
        )

    async def _renew(self, session_id: str, generation: int, now: float) -> ActiveSession:
        sent = self._clock()
        # Retries end when the session would have expired anyway.
        active = self._active
        budget = None if active is None else max(0.0, active.expires_at - now)
        renewed = await self._client.renew_session(
            ws.RenewSessionRequest(
                worker_id=self._worker_id,
                session_id=session_id,
                worker_generation=generation,
                passes_run_parameters=PASSES_RUN_PARAMETERS,
                labels=self._labels,
                max_concurrent_attempts=self._max_concurrency,
            ),
            budget_seconds=budget,
        )
        remaining = renewed.session_remaining.ToMilliseconds() / 1000
        if self._active is None:
            log.info("session %s (generation %d) resumed", session_id, generation)
        self._active = ActiveSession(
            session_id,
            generation,
            renewed.session_state,
            renew_at=sent + self._interval(remaining),
            expires_at=sent + remaining,
        )
        return self._active

    async def _open(self, stored: SessionRecord | None) -> ActiveSession | None:
        if stored is None or stored.session_id is not None or stored.worker_id != self._worker_id:
            # A new incarnation: a new idempotency key, persisted before the call.
            stored = self._inbox.save_session(
                stored,
                SessionRecord(
                    revision=0, worker_id=self._worker_id, open_request_id=uuid.uuid4().hex
                ),
            )
        sent = self._clock()
        if sent < self._open_not_before:
            return None  # refused for good a moment ago: not yet again
        try:
            opened = await self._client.open_session(
                ws.OpenSessionRequest(
                    request_id=stored.open_request_id,
                    worker_id=self._worker_id,
                    agent_version=agent_version(),
                    executor_types=[execution_pb2.EXECUTOR_TYPE_REMOTE_WORKER],
                    max_concurrent_attempts=self._max_concurrency,
                    passes_run_parameters=PASSES_RUN_PARAMETERS,
                    labels=self._labels,
                )
            )
        except CallFailed as failure:
            if failure.transient:
                log.warning("opening a session failed: %s", failure)
            else:
                self._open_backoff = min(
                    max(OPEN_BACKOFF_FIRST_SECONDS, self._open_backoff * 2),
                    OPEN_BACKOFF_MAX_SECONDS,
                )
                self._open_not_before = self._clock() + self._open_backoff
                log.warning(
                    "opening a session was refused: %s; next try in %.0f s",
                    failure,
                    self._open_backoff,
                )
            if not failure.transient:
                # Refused for good under this request id (the session it opened was
                # replaced, has expired, or was opened on other terms): the next try is
                # a new incarnation with a new id, not this retry again for ever.
                self._inbox.save_session(
                    stored,
                    SessionRecord(
                        revision=stored.revision,
                        worker_id=self._worker_id,
                        open_request_id=uuid.uuid4().hex,
                    ),
                )
            return None
        self._inbox.save_session(
            stored,
            SessionRecord(
                revision=stored.revision,
                worker_id=self._worker_id,
                open_request_id=stored.open_request_id,
                session_id=opened.session_id,
                worker_generation=opened.worker_generation,
            ),
        )
        self._open_backoff = self._open_not_before = 0.0
        remaining = opened.session_remaining.ToMilliseconds() / 1000
        interval = opened.renew_interval.ToMilliseconds() / 1000
        self._renew_interval = interval if interval > 0 else None
        self._active = ActiveSession(
            opened.session_id,
            opened.worker_generation,
            opened.session_state,
            renew_at=sent + self._interval(remaining),
            expires_at=sent + remaining,
        )
        log.info("session %s opened (generation %d)", opened.session_id, opened.worker_generation)
        return self._active

    def _interval(self, remaining_seconds: float) -> float:
        fallback = remaining_seconds * _RENEW_FRACTION
        if self._renew_interval is None:
            return fallback
        return min(self._renew_interval, fallback) if fallback > 0 else self._renew_interval

    def _still_valid(self, now: float) -> ActiveSession | None:
        if self._active is not None and now < self._active.expires_at:
            return self._active
        self._active = None
        return None
