"""Builds the runtime world a Worker command needs, through the real repository.

Enrollment is the administrator's (migration role); everything after it — tasks, runs,
sessions, offers, claims — goes through the same repository functions the service uses,
as the runtime role.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from qinglong_control.db import definitions, placement, runs, sessions
from qinglong_control.db.events import Actor
from qinglong_control.db.identities import enroll_worker, ensure_project
from qinglong_control.domain.capability import digest_of_capability
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.fence import Fence
from qinglong_control.domain.retry import NO_RETRY, RetryPolicy
from qinglong_control.domain.sessions import SessionClaim
from qinglong_control.domain.timings import Timings
from qinglong_protocol.bounds import encode_lease_capability

from tests.support.postgres import MigratedDatabase

PROJECT = "proj-a"
#: A second project (enrolled by the contract suite's ``admin_conn`` fixture).
OTHER_PROJECT = "proj-b"
OPERATOR = Actor("user", "alice")


def enroll(database: MigratedDatabase, *workers: str, project: str = PROJECT) -> None:
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        ensure_project(admin, project, project)
        for worker_id in workers:
            enroll_worker(admin, worker_id, f"spiffe://qinglong.local/worker/{worker_id}")


@dataclass(frozen=True)
class ClaimedWork:
    fence: Fence
    capability: str
    session: SessionClaim


class World:
    def __init__(self, conn: psycopg.AsyncConnection[Any], timings: Timings | None = None) -> None:
        self.conn = conn
        self.timings = timings or Timings()

    async def task(
        self,
        timeout_ms: int | None = 60_000,
        retry_policy: RetryPolicy = NO_RETRY,
        project: str = PROJECT,
        worker_selector: dict[str, str] | None = None,
        queue_timeout_ms: int | None = None,
        max_concurrent_runs: int | None = None,
    ) -> uuid.UUID:
        task = await definitions.create_task(
            self.conn, project, "sample", {}, f"task-{uuid.uuid4().hex[:12]}", OPERATOR.id
        )
        await definitions.create_revision(
            self.conn,
            definitions.NewRevision(
                project,
                task.task_id,
                "rev-1",
                "remote_worker",
                ["echo", "hi"],
                timeout_ms,
                retry_policy,
                worker_selector or {},
                queue_timeout_ms,
                max_concurrent_runs,
            ),
            OPERATOR.id,
        )
        return task.task_id

    async def queued_run(
        self,
        timeout_ms: int | None = 60_000,
        retry_policy: RetryPolicy = NO_RETRY,
        project: str = PROJECT,
        parameters: dict[str, str] | None = None,
        worker_selector: dict[str, str] | None = None,
        queue_timeout_ms: int | None = None,
        priority: int = 0,
    ) -> uuid.UUID:
        task_id = await self.task(
            timeout_ms, retry_policy, project, worker_selector, queue_timeout_ms
        )
        return await self.run_of(task_id, project, parameters, priority)

    async def run_of(
        self,
        task_id: uuid.UUID,
        project: str = PROJECT,
        parameters: dict[str, str] | None = None,
        priority: int = 0,
    ) -> uuid.UUID:
        """A new Run of ``task_id``'s newest revision (queued, or waiting for a slot)."""
        trigger = runs.TriggerRun(
            project,
            task_id,
            None,
            f"trigger-{uuid.uuid4().hex[:12]}",
            parameters or {},
            priority,
        )
        run = await runs.trigger_run(self.conn, trigger, OPERATOR, self.timings)
        return run.run_id

    async def cancel_intent(self, run_id: uuid.UUID) -> None:
        """Write a user's cancel intent and its Event on the Run directly (as CancelRun
        would), leaving convergence to act on it."""
        await self.conn.execute(
            "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
            " cancel_reason = 'user', event_sequence = event_sequence + 1 WHERE run_id = %s",
            (run_id,),
        )
        await self.conn.execute(
            "INSERT INTO qinglong.run_events (event_id, run_id, sequence, event_type,"
            " actor_kind, actor_id, occurred_at_ms) SELECT gen_random_uuid(), run_id,"
            " event_sequence, 'run.cancel_requested', 'user', 'alice', qinglong.db_now_ms()"
            " FROM qinglong.runs WHERE run_id = %s",
            (run_id,),
        )

    async def lease_ran_out(
        self,
        attempt_id: uuid.UUID,
        expired_ms_ago: int = 1,
        renewed_ms_ago: int | None = None,
    ) -> int:
        """Move the Attempt's lease's expiry ``expired_ms_ago`` into the past (DB time),
        and its last renewal ``renewed_ms_ago`` (by default as far); the expiry."""
        cursor = await self.conn.execute(
            "UPDATE qinglong.run_leases SET renewed_at_ms = qinglong.db_now_ms() - %s,"
            " expires_at_ms = qinglong.db_now_ms() - %s WHERE attempt_id = %s"
            " RETURNING expires_at_ms",
            (
                expired_ms_ago if renewed_ms_ago is None else renewed_ms_ago,
                expired_ms_ago,
                attempt_id,
            ),
        )
        row = await cursor.fetchone()
        assert row is not None
        return int(row[0])

    async def session(
        self,
        worker_id: str,
        request_id: str | None = None,
        *,
        passes_parameters: bool = True,
        labels: dict[str, str] | None = None,
    ) -> SessionClaim:
        opened = await sessions.open_session(
            self.conn,
            sessions.OpenSession(
                worker_id,
                request_id or uuid.uuid4().hex,
                ("remote_worker",),
                8,
                "test",
                passes_parameters,
                labels or {},
            ),
            self.timings,
        )
        return SessionClaim(worker_id, opened.session_id, opened.worker_generation)

    async def offered(self, session: SessionClaim) -> dict[uuid.UUID, uuid.UUID]:
        """The session's open offers after a pull: run id -> offer id."""
        offers = await placement.pull_offers(self.conn, session, 8, self.timings)
        return {offer.run_id: offer.offer_id for offer in offers.offers}

    async def claimed(
        self,
        worker_id: str = "worker-a",
        timeout_ms: int | None = 60_000,
        retry_policy: RetryPolicy = NO_RETRY,
    ) -> ClaimedWork:
        run_id = await self.queued_run(timeout_ms, retry_policy)
        return await self.claim(run_id, await self.session(worker_id))

    async def claim(self, run_id: uuid.UUID, session: SessionClaim) -> ClaimedWork:
        """Pull and claim the queued Run `run_id` on `session` with a fresh capability."""
        worker_id = session.worker_id
        offers = await placement.pull_offers(self.conn, session, 8, self.timings)
        offer = next(o for o in offers.offers if o.run_id == run_id)
        request, capability = fresh_claim(session, offer.offer_id, run_id)
        claimed = await placement.claim_offer(self.conn, request, self.timings)
        fence = Fence(
            worker_id=worker_id,
            session_id=session.session_id,
            worker_generation=session.worker_generation,
            project_id=PROJECT,
            run_id=run_id,
            attempt_id=claimed.attempt_id,
            offer_id=offer.offer_id,
            lease_generation=claimed.lease_generation,
            token_digest=digest_of_capability(capability),
            expected_lease_version=claimed.lease_version,
        )
        return ClaimedWork(fence, capability, session)


def with_version(fence: Fence, version: int) -> Fence:
    return replace(fence, expected_lease_version=version)


def fresh_claim(
    session: SessionClaim, offer_id: uuid.UUID, run_id: uuid.UUID, project: str = PROJECT
) -> tuple[ClaimRequest, str]:
    """A claim of ``offer_id`` (of Run ``run_id`` in ``project``) on ``session`` with a
    new lease capability; the request and the capability."""
    capability = encode_lease_capability(secrets.token_bytes(32))
    request = ClaimRequest(
        session.worker_id,
        session.session_id,
        session.worker_generation,
        offer_id,
        project,
        run_id,
        digest_of_capability(capability),
    )
    return request, capability
