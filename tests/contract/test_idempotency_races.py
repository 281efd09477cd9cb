"""Retries racing their originals, and retries after the original's authority ended."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from qinglong_control.db import definitions, placement, runs, sessions
from qinglong_control.db.start_facts import acknowledge_starting, report_start_failure
from qinglong_control.domain.capability import digest_of_capability
from qinglong_control.domain.claim import ClaimRequest
from qinglong_control.domain.fence import Fence
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionClaim
from qinglong_protocol.bounds import encode_lease_capability

from tests.support.postgres import MigratedDatabase
from tests.support.world import OPERATOR, PROJECT, World


@pytest.fixture
async def connections(
    database: MigratedDatabase,
) -> AsyncIterator[list[psycopg.AsyncConnection[Any]]]:
    conns = [
        await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
        for _ in range(6)
    ]
    try:
        yield conns
    finally:
        for conn in conns:
            await conn.close()


async def test_concurrent_trigger_retries_return_one_run(
    world: World, connections: list[psycopg.AsyncConnection[Any]]
) -> None:
    task_id = await world.task()
    command = runs.TriggerRun(PROJECT, task_id, None, "same-request")
    answers = await asyncio.gather(
        *(runs.trigger_run(conn, command, OPERATOR) for conn in connections)
    )
    assert len({run.run_id for run in answers}) == 1


async def test_concurrent_create_task_retries_return_one_task(
    world: World, connections: list[psycopg.AsyncConnection[Any]]
) -> None:
    answers = await asyncio.gather(
        *(
            definitions.create_task(conn, PROJECT, "t", {}, "same-create", "alice")
            for conn in connections
        )
    )
    assert len({task.task_id for task in answers}) == 1


async def test_concurrent_pulls_never_exceed_the_sessions_capacity(
    world: World, connections: list[psycopg.AsyncConnection[Any]]
) -> None:
    for _ in range(6):
        await world.queued_run()
    opened = await sessions.open_session(
        world.conn,
        sessions.OpenSession("worker-a", "boot", ("remote_worker",), 1, "test"),
        world.timings,
    )
    claim = SessionClaim("worker-a", opened.session_id, opened.worker_generation)
    await asyncio.gather(
        *(placement.pull_offers(conn, claim, 4, world.timings) for conn in connections)
    )
    cursor = await world.conn.execute(
        "SELECT count(*) FROM qinglong.offers WHERE session_id = %s AND state = 'open'",
        (opened.session_id,),
    )
    assert await cursor.fetchone() == (1,)


async def test_claim_retry_after_the_lease_ended_is_refused(world: World) -> None:
    run_id = await world.queued_run()
    session = await world.session("worker-a")
    [offer] = (await placement.pull_offers(world.conn, session, 1, world.timings)).offers
    request = ClaimRequest(
        "worker-a",
        session.session_id,
        session.worker_generation,
        offer.offer_id,
        PROJECT,
        run_id,
        digest_of_capability(encode_lease_capability(secrets.token_bytes(32))),
    )
    claimed = await placement.claim_offer(world.conn, request, world.timings)
    fence = Fence(
        worker_id=request.worker_id,
        session_id=request.session_id,
        worker_generation=request.worker_generation,
        project_id=request.project_id,
        run_id=request.run_id,
        attempt_id=claimed.attempt_id,
        offer_id=request.offer_id,
        lease_generation=claimed.lease_generation,
        token_digest=request.token_digest,
        expected_lease_version=claimed.lease_version,
    )
    await acknowledge_starting(world.conn, fence)
    await report_start_failure(world.conn, fence, "no such binary")
    with pytest.raises(Refused) as ended:
        await placement.claim_offer(world.conn, request, world.timings)
    assert ended.value.reason is Reason.LEASE_NOT_LEASED


async def test_open_session_retry_of_a_replaced_session_is_fenced(world: World) -> None:
    await world.session("worker-a", request_id="boot-1")
    await world.session("worker-a", request_id="boot-2")
    with pytest.raises(Refused) as fenced:
        await world.session("worker-a", request_id="boot-1")
    assert fenced.value.reason is Reason.SESSION_FENCED
