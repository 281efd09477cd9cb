"""Placement (pull) and claim: offering queued Runs to a Session, and claiming an offer."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.domain.claim import (
    ClaimedRunRow,
    ClaimRequest,
    ExistingClaim,
    NewClaim,
    OfferRow,
    decide_claim,
)
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionClaim, SessionRow, check_session
from qinglong_control.domain.states import RunState
from qinglong_control.domain.timings import Timings

_LOCK_SESSION_SHARED = """
SELECT session_id, worker_id, generation, status, expires_at_ms
  FROM qinglong.worker_sessions WHERE session_id = %s FOR SHARE
"""

_DB_NOW = "SELECT qinglong.db_now_ms()"

# Pulls of one session take turns, so concurrent pulls cannot each see the same free room
# and together place more offers than the session may run. (ACKs do not take it.)
_LOCK_SESSION_PULL = "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.pull:' || %s, 0))"

_SESSION_ROOM = """
SELECT s.max_concurrency - (SELECT count(*) FROM qinglong.attempts a
                              WHERE a.session_id = s.session_id
                                AND a.state IN ('claimed', 'starting', 'running'))
  FROM qinglong.worker_sessions s WHERE s.session_id = %s
"""

# Oldest queued Runs of an executor type this session runs, with no intent to cancel and
# no live offer elsewhere. SKIP LOCKED lets many sessions pull at once without waiting or
# ever taking the same Run. The session's room is computed in the same statement, so the
# whole read side is one round trip: new placements never exceed what the answer carries
# (max_offers minus offers already open) nor what the session may run (max_concurrency
# minus live Attempts and open offers). A session that is not the caller's live, online,
# unexpired incarnation has no room at all; the caller is then refused in Python.
_LOCK_CANDIDATES = """
WITH session AS (
    SELECT s.session_id, s.executor_types, s.max_concurrency,
           (SELECT count(*) FROM qinglong.attempts a
             WHERE a.session_id = s.session_id
               AND a.state IN ('claimed', 'starting', 'running')) AS live_attempts,
           (SELECT count(*) FROM qinglong.offers o
             WHERE o.session_id = s.session_id AND o.state = 'open'
               AND o.expires_at_ms > qinglong.db_now_ms()) AS open_offers
      FROM qinglong.worker_sessions s
     WHERE s.session_id = %(session_id)s AND s.worker_id = %(worker_id)s
       AND s.generation = %(generation)s AND s.status = 'online'
       AND s.expires_at_ms > qinglong.db_now_ms()
)
SELECT r.run_id
  FROM qinglong.runs r, session
 WHERE r.state = 'queued'
   AND r.cancel_requested_at_ms IS NULL
   AND r.executor_type = ANY(session.executor_types)
   AND NOT EXISTS (SELECT 1 FROM qinglong.offers o
                    WHERE o.run_id = r.run_id AND o.state = 'open'
                      AND o.expires_at_ms > qinglong.db_now_ms())
 ORDER BY r.created_at_ms, r.run_id
 LIMIT coalesce((SELECT greatest(0, least(%(max_offers)s - open_offers,
                                          max_concurrency - live_attempts - open_offers))
                   FROM session), 0)
   FOR UPDATE OF r SKIP LOCKED
"""

_EXPIRE_STALE_OFFERS = """
UPDATE qinglong.offers SET state = 'expired'
 WHERE run_id = ANY(%(run_ids)s) AND state = 'open' AND expires_at_ms <= %(now)s
"""

_INSERT_OFFERS = """
INSERT INTO qinglong.offers
       (offer_id, run_id, session_id, worker_id, worker_generation, state,
        created_at_ms, expires_at_ms)
SELECT gen_random_uuid(), run_id, %(session_id)s, %(worker_id)s, %(generation)s, 'open',
       %(now)s, %(expires)s
  FROM unnest(%(run_ids)s::uuid[]) AS run_id
-- A concurrent pull may have committed an offer for the same Run after this statement's
-- candidate snapshot; that Run is simply not ours.
ON CONFLICT (run_id) WHERE state = 'open' DO NOTHING
"""

# Everything the session holds open, with the pinned plan (stable offer ids on re-pull).
_OPEN_OFFERS = """
SELECT o.offer_id, o.run_id, r.project_id, r.task_id, tr.revision_id, tr.revision_number,
       tr.executor_type, tr.command, tr.timeout_ms, o.expires_at_ms
  FROM qinglong.offers o
  JOIN qinglong.runs r ON r.run_id = o.run_id
  JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
 WHERE o.session_id = %(session_id)s AND o.state = 'open' AND o.expires_at_ms > %(now)s
 ORDER BY o.created_at_ms, r.created_at_ms, r.run_id
"""


@dataclass(frozen=True)
class PlacedOffer:
    offer_id: uuid.UUID
    run_id: uuid.UUID
    project_id: str
    task_id: uuid.UUID
    revision_id: uuid.UUID
    revision_number: int
    executor_type: str
    command: list[str]
    timeout_ms: int | None
    expires_at_ms: int


@dataclass(frozen=True)
class Offers:
    offers: list[PlacedOffer]
    now_ms: int


async def pull_offers(
    conn: AsyncConnection[Any], claim: SessionClaim, max_offers: int, timings: Timings
) -> Offers:
    """Place at most `max_offers` queued Runs on the session and return its open offers.

    Round trip 1 locks the session, reads DB time and locks the candidate Runs; round
    trip 2 writes the offers, reads back everything the session holds open, and commits.
    """
    values: dict[str, object] = {
        "session_id": claim.session_id,
        "worker_id": claim.worker_id,
        "generation": claim.worker_generation,
        "max_offers": max_offers,
    }
    async with command_transaction(conn) as tx:
        locked = await tx.execute(
            "lock.session", _LOCK_SESSION_SHARED, (claim.session_id,), kwargs_row(SessionRow)
        )
        await tx.execute("lock.session_pull", _LOCK_SESSION_PULL, (str(claim.session_id),))
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        candidates = await tx.execute("lock.candidates", _LOCK_CANDIDATES, values, scalar_row)
        now_ms: int = await now.fetchone() or 0
        check_session(claim, await locked.fetchone(), now_ms)
        run_ids = list(await candidates.fetchall())
        values.update(run_ids=run_ids, now=now_ms, expires=now_ms + timings.offer_ttl_ms)
        if run_ids:
            await tx.execute("offers.expire_stale", _EXPIRE_STALE_OFFERS, values)
            await tx.execute("offers.insert", _INSERT_OFFERS, values)
        open_offers = await tx.execute("offers.open", _OPEN_OFFERS, values, kwargs_row(PlacedOffer))
    # Read after COMMIT: the rows arrived with the commit's round trip.
    return Offers(list(await open_offers.fetchall()), now_ms)


_LOCK_CLAIM_RUN = """
SELECT run_id, project_id, state, attempt_count, event_sequence, cancel_requested_at_ms
  FROM qinglong.runs WHERE run_id = %s FOR UPDATE
"""

_LOCK_OFFER = """
SELECT offer_id, run_id, session_id, worker_id, worker_generation, state, expires_at_ms
  FROM qinglong.offers WHERE offer_id = %s FOR UPDATE
"""

_EXISTING_CLAIM = """
SELECT a.attempt_id, l.lease_generation, l.version AS lease_version, l.status AS lease_status,
       l.token_digest, l.expires_at_ms
  FROM qinglong.attempts a JOIN qinglong.run_leases l ON l.attempt_id = a.attempt_id
 WHERE a.offer_id = %s
"""

_PLAN = """
SELECT tr.executor_type, tr.command, tr.timeout_ms, tr.revision_id, tr.revision_number,
       r.task_id
  FROM qinglong.runs r JOIN qinglong.task_revisions tr ON tr.revision_id = r.revision_id
 WHERE r.run_id = %s
"""

_CLAIM_OFFER = """
UPDATE qinglong.offers SET state = 'claimed', claimed_at_ms = %(now)s
 WHERE offer_id = %(offer_id)s
"""

_RUN_DISPATCHING = """
UPDATE qinglong.runs
   SET state = 'dispatching', attempt_count = %(attempt_number)s, version = version + 1,
       updated_at_ms = %(now)s
 WHERE run_id = %(run_id)s
"""

_INSERT_ATTEMPT = """
INSERT INTO qinglong.attempts
       (attempt_id, run_id, attempt_number, state, executor_type, worker_id, session_id,
        worker_generation, offer_id, lease_generation, lease_version, lease_token_digest,
        claimed_at_ms)
VALUES (%(attempt_id)s, %(run_id)s, %(attempt_number)s, 'claimed', %(executor_type)s,
        %(worker_id)s, %(session_id)s, %(generation)s, %(offer_id)s, %(lease_generation)s, 1,
        %(token_digest)s, %(now)s)
"""

_INSERT_LEASE = """
INSERT INTO qinglong.run_leases
       (attempt_id, run_id, worker_id, session_id, worker_generation, offer_id,
        lease_generation, token_digest, version, status, acquired_at_ms, renewed_at_ms,
        expires_at_ms)
VALUES (%(attempt_id)s, %(run_id)s, %(worker_id)s, %(session_id)s, %(generation)s,
        %(offer_id)s, %(lease_generation)s, %(token_digest)s, 1, 'leased', %(now)s, %(now)s,
        %(lease_expires)s)
"""


@dataclass(frozen=True)
class Plan:
    executor_type: str
    command: list[str]
    timeout_ms: int | None
    revision_id: uuid.UUID
    revision_number: int
    task_id: uuid.UUID


@dataclass(frozen=True)
class Claimed:
    attempt_id: uuid.UUID
    lease_generation: int
    lease_version: int
    lease_remaining_ms: int
    plan: Plan
    replayed: bool


async def claim_offer(
    conn: AsyncConnection[Any], request: ClaimRequest, timings: Timings
) -> Claimed:
    """Create the Attempt (`claimed`), the Run Lease (v1) and move the Run to `dispatching`.

    Lock order: session, Run, offer — the same session-before-Run order as every ACK.
    """
    async with command_transaction(conn) as tx:
        locked_session = await tx.execute(
            "lock.session", _LOCK_SESSION_SHARED, (request.session_id,), kwargs_row(SessionRow)
        )
        locked_run = await tx.execute(
            "lock.run", _LOCK_CLAIM_RUN, (request.run_id,), kwargs_row(_claimed_run_row)
        )
        locked_offer = await tx.execute(
            "lock.offer", _LOCK_OFFER, (request.offer_id,), kwargs_row(OfferRow)
        )
        earlier = await tx.execute(
            "claim.existing", _EXISTING_CLAIM, (request.offer_id,), kwargs_row(ExistingClaim)
        )
        plan_cursor = await tx.execute("claim.plan", _PLAN, (request.run_id,), kwargs_row(Plan))
        room = await tx.execute("session.room", _SESSION_ROOM, (request.session_id,), scalar_row)
        now = await tx.execute("db_now", _DB_NOW, (), scalar_row)
        now_ms: int = await now.fetchone() or 0
        session = check_session(
            SessionClaim(request.worker_id, request.session_id, request.worker_generation),
            await locked_session.fetchone(),
            now_ms,
        )
        run = await locked_run.fetchone()
        decision = decide_claim(
            request,
            session,
            await locked_offer.fetchone(),
            run,
            await earlier.fetchone(),
            now_ms,
            session_room=await room.fetchone() or 0,
        )
        plan = await plan_cursor.fetchone()
        if plan is None:
            raise Refused(Reason.RUN_NOT_FOUND, "run has no pinned revision")
        if isinstance(decision, ExistingClaim):
            return Claimed(
                decision.attempt_id,
                decision.lease_generation,
                decision.lease_version,
                max(0, decision.expires_at_ms - now_ms),
                plan,
                replayed=True,
            )
        assert run is not None  # decide_claim refuses a missing Run
        return await _create_claim(tx, request, decision, plan, run.event_sequence, now_ms, timings)


async def _create_claim(
    tx: CommandTx,
    request: ClaimRequest,
    decision: NewClaim,
    plan: Plan,
    event_sequence: int,
    now_ms: int,
    timings: Timings,
) -> Claimed:
    attempt_id = uuid.uuid4()
    values = {
        "attempt_id": attempt_id,
        "run_id": request.run_id,
        "attempt_number": decision.attempt_number,
        "executor_type": plan.executor_type,
        "worker_id": request.worker_id,
        "session_id": request.session_id,
        "generation": request.worker_generation,
        "offer_id": request.offer_id,
        "lease_generation": decision.lease_generation,
        "token_digest": request.token_digest.hex,
        "now": now_ms,
        "lease_expires": now_ms + timings.lease_ttl_ms,
    }
    await tx.execute("offer.claim", _CLAIM_OFFER, values)
    await tx.execute("run.dispatching", _RUN_DISPATCHING, values)
    await tx.execute("attempt.insert", _INSERT_ATTEMPT, values)
    await tx.execute("lease.insert", _INSERT_LEASE, values)
    await append_events(
        tx,
        request.run_id,
        event_sequence,
        Actor("worker", request.worker_id),
        now_ms,
        [
            NewEvent(
                "attempt.claimed",
                attempt_id,
                {
                    "worker_id": request.worker_id,
                    "session_id": str(request.session_id),
                    "offer_id": str(request.offer_id),
                    "lease_generation": decision.lease_generation,
                    "attempt_number": decision.attempt_number,
                },
            ),
            NewEvent(
                "run.dispatching",
                attempt_id,
                {"from_state": RunState.QUEUED.value, "to_state": RunState.DISPATCHING.value},
            ),
        ],
    )
    return Claimed(attempt_id, decision.lease_generation, 1, timings.lease_ttl_ms, plan, False)


def _claimed_run_row(**columns: Any) -> ClaimedRunRow:
    return ClaimedRunRow(**{**columns, "state": RunState(columns["state"])})
