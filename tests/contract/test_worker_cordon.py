"""A cordoned Worker (migration 0041) is offered no new Run and may claim none, while the
Attempts it runs go on, renew and report; uncordoned, it is offered Runs again. The
administrator sets the flag; placement and the claim read it."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from qinglong_control.db import admin, placement, sessions
from qinglong_control.db.lease_control import complete_attempt, control_lease
from qinglong_control.db.sql import SQL
from qinglong_control.db.start_facts import acknowledge_running, acknowledge_starting
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.completion import CompletionReport
from qinglong_control.domain.lease_control import LeaseAnswer
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningReport

from tests.support.postgres import MigratedDatabase
from tests.support.seed import FAR_FUTURE_MS
from tests.support.world import PROJECT, World, fresh_claim, with_version

Conn = psycopg.AsyncConnection[Any]
REPORT = RunningReport("pid:4242;start:1700000000", None, 1, parse_digest("ab" * 32))


async def test_a_cordoned_worker_is_offered_nothing_until_uncordoned(
    world: World, admin_conn: Conn
) -> None:
    queued = await world.queued_run()
    session = await world.session("worker-a")
    cordoned = await admin.set_worker_cordoned(admin_conn, "worker-a", True)
    assert cordoned.cordoned
    assert await world.offered(session) == {}
    # Another Worker takes nothing from it: the Run is simply still there for others.
    other = await world.session("worker-b")
    assert set(await world.offered(other)) == {queued}
    later = await world.queued_run()
    assert await world.offered(session) == {}, "not even a Run queued after the cordon"
    uncordoned = await admin.set_worker_cordoned(admin_conn, "worker-a", False)
    assert not uncordoned.cordoned
    assert set(await world.offered(session)) == {later}


async def test_an_offer_held_when_the_cordon_came_is_not_shown_nor_claimable(
    world: World, admin_conn: Conn
) -> None:
    run_id = await world.queued_run()
    session = await world.session("worker-a")
    offer_id = (await world.offered(session))[run_id]
    await admin.set_worker_cordoned(admin_conn, "worker-a", True)
    assert run_id not in await world.offered(session)
    request, _ = fresh_claim(session, offer_id, run_id)
    with pytest.raises(Refused) as refused:
        await placement.claim_offer(world.conn, request, world.timings)
    assert refused.value.reason is Reason.OFFER_EXPIRED
    # Nothing was claimed: uncordoned, the same offer is good again.
    await admin.set_worker_cordoned(admin_conn, "worker-a", False)
    assert (await world.offered(session))[run_id] == offer_id
    request, _ = fresh_claim(session, offer_id, run_id)
    claimed = await placement.claim_offer(world.conn, request, world.timings)
    assert claimed.lease_version == 1


async def test_running_attempts_of_a_cordoned_worker_go_on_and_report(
    world: World, admin_conn: Conn
) -> None:
    work = await world.claimed("worker-a")
    await acknowledge_starting(world.conn, work.fence)
    await acknowledge_running(world.conn, work.fence, REPORT)
    cordoned = await admin.set_worker_cordoned(admin_conn, "worker-a", True)
    assert cordoned.live_attempts == 1  # what an administrator waits to see reach 0
    renewed = await control_lease(world.conn, work.fence, world.timings)
    assert renewed.answer is LeaseAnswer.RENEWED
    assert renewed.new_lease_version is not None
    ended = await complete_attempt(
        world.conn,
        with_version(work.fence, renewed.new_lease_version),
        CompletionReport(REPORT.callback_sequence, "succeeded", 0, ""),
    )
    assert ended.run_state.value == "succeeded"
    assert (await admin.get_worker(admin_conn, "worker-a")).live_attempts == 0


async def test_cordon_is_idempotent_and_names_an_enrolled_worker(
    world: World, admin_conn: Conn
) -> None:
    for _ in range(2):
        assert (await admin.set_worker_cordoned(admin_conn, "worker-a", True)).cordoned
    assert (await admin.get_worker(admin_conn, "worker-a")).cordoned
    assert not (await admin.get_worker(admin_conn, "worker-b")).cordoned
    with pytest.raises(Refused) as unknown:
        await admin.set_worker_cordoned(admin_conn, "nobody", True)
    assert unknown.value.reason is Reason.WORKER_NOT_FOUND
    # A restarted Worker (a new session) stays cordoned: the flag is the Worker's.
    await world.queued_run()
    assert await world.offered(await world.session("worker-a")) == {}
    cursor = await world.conn.execute(
        "SELECT count(*) FROM qinglong.offers o JOIN qinglong.runs r USING (run_id)"
        " WHERE o.worker_id = 'worker-a' AND r.project_id = %s",
        (PROJECT,),
    )
    assert await cursor.fetchone() == (0,)


async def test_a_pull_under_way_when_the_cordon_came_has_its_offers_withdrawn(
    world: World, admin_conn: Conn, database: MigratedDatabase
) -> None:
    """A pull that read the Worker before the cordon committed places its offers after
    it: the withdrawal waits for that pull (its session's pull lock, held until it
    commits) and withdraws them too. Here the pull is held open half-way, on a real
    connection, with the statements the pull runs."""
    run_id = await world.queued_run()
    session = await world.session("worker-a")
    async with await psycopg.AsyncConnection.connect(database.urls.runtime) as pulling:
        await pulling.execute(SQL["placement.lock_session_pull"], (str(session.session_id),))
        await pulling.execute(
            SQL["placement.insert_offers"],
            {
                "session_id": session.session_id,
                "worker_id": session.worker_id,
                "generation": session.worker_generation,
                "now": 0,
                "expires": FAR_FUTURE_MS,
                "run_ids": [run_id],
            },
        )
        await admin.set_worker_cordoned(admin_conn, "worker-a", True)
        withdrawal = asyncio.create_task(sessions.withdraw_worker_offers(world.conn, "worker-a"))
        await asyncio.sleep(0.5)
        assert not withdrawal.done(), "it waits for the pull under way"
        await pulling.commit()
    await asyncio.wait_for(withdrawal, 10)
    cursor = await world.conn.execute(
        "SELECT state FROM qinglong.offers WHERE run_id = %s", (run_id,)
    )
    assert await cursor.fetchall() == [("withdrawn",)]
    assert set(await world.offered(await world.session("worker-b"))) == {run_id}
