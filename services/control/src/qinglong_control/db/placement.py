"""Placement (pull) and claim: offering queued Runs to a Session, and claiming an offer."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from psycopg import AsyncConnection
from psycopg.rows import kwargs_row, scalar_row

from qinglong_control.db.command_tx import CommandTx, command_transaction
from qinglong_control.db.events import Actor, NewEvent, append_events
from qinglong_control.db.sql import SQL
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

_LOCK_SESSION_SHARED = SQL["placement.lock_session_shared"]

_DB_NOW = SQL["clock.db_now"]

_LOCK_SESSION_PULL = SQL["placement.lock_session_pull"]

_SESSION_ROOM = SQL["placement.session_room"]

_LOCK_CANDIDATES = SQL["placement.lock_candidates"]

_EXPIRE_STALE_OFFERS = SQL["placement.expire_stale_offers"]

_INSERT_OFFERS = SQL["placement.insert_offers"]

_OPEN_OFFERS = SQL["placement.open_offers"]


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
    parameters: dict[str, str]
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
    async with command_transaction(conn, durable_answer=False) as tx:
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


_LOCK_CLAIM_RUN = SQL["placement.lock_claim_run"]

_LOCK_OFFER = SQL["placement.lock_offer"]

_EXISTING_CLAIM = SQL["placement.existing_claim"]

_PLAN = SQL["placement.plan"]

_CLAIM_OFFER = SQL["placement.claim_offer"]

_RUN_DISPATCHING = SQL["placement.run_dispatching"]

_INSERT_ATTEMPT = SQL["placement.insert_attempt"]

_INSERT_LEASE = SQL["placement.insert_lease"]


@dataclass(frozen=True)
class Plan:
    executor_type: str
    command: list[str]
    timeout_ms: int | None
    revision_id: uuid.UUID
    revision_number: int
    task_id: uuid.UUID
    parameters: dict[str, str]


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
            "lock.run",
            _LOCK_CLAIM_RUN,
            {"run_id": request.run_id, "worker_id": request.worker_id},
            kwargs_row(_claimed_run_row),
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
