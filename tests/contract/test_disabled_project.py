"""A disabled project's Runs are stopped (R-ADM-1, R-CAN): none starts any more, and the
reconciler records a stop intent on each one still going — none of its people can cancel
once the project is inactive — which convergence and lease control then carry out."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from qinglong_control.db import placement, runs
from qinglong_control.db.cancellation import PROJECT_DISABLED, stop_runs_of_disabled_projects
from qinglong_control.db.convergence import converge_page
from qinglong_control.db.lease_control import control_lease
from qinglong_control.db.sql import SQL
from qinglong_control.db.start_facts import acknowledge_running, acknowledge_starting
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.lease_control import LeaseAnswer
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningReport

from tests.support.plans import pages_read, scans_of
from tests.support.postgres import MigratedDatabase
from tests.support.world import OPERATOR, PROJECT, World, fresh_claim

REPORT = RunningReport("pid:4242;start:1700000000", None, 1, parse_digest("ab" * 32))


async def run_state(world: World, run_id: uuid.UUID) -> tuple[str, str | None, str | None]:
    cursor = await world.conn.execute(
        "SELECT state, cancel_reason, cancel_requested_by FROM qinglong.runs WHERE run_id = %s",
        (run_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return str(row[0]), row[1], row[2]


def disable_project(database: MigratedDatabase) -> None:
    """What DisableProject writes (db/admin.disable_project)."""
    with psycopg.connect(database.urls.migration, autocommit=True) as admin:
        admin.execute(
            "UPDATE qinglong.projects SET status = 'archived', version = version + 1"
            " WHERE project_id = %s",
            (PROJECT,),
        )


async def test_a_disabled_projects_runs_are_stopped_and_none_starts(
    world: World, database: MigratedDatabase
) -> None:
    running = await world.claimed()
    await acknowledge_starting(world.conn, running.fence)
    await acknowledge_running(world.conn, running.fence, REPORT)
    queued = await world.queued_run()
    disable_project(database)
    session = await world.session("worker-b")
    offered = await placement.pull_offers(world.conn, session, 8, world.timings)
    assert [offer.run_id for offer in offered.offers] == [], "a disabled project's Run started"

    assert await stop_runs_of_disabled_projects(world.conn, 128) == 2
    assert await stop_runs_of_disabled_projects(world.conn, 128) == 0, "one intent each"
    await converge_page(world.conn, 128)
    assert await run_state(world, queued) == ("cancelled", "policy", PROJECT_DISABLED.id)
    assert await run_state(world, running.fence.run_id) == (
        "running",
        "policy",
        PROJECT_DISABLED.id,
    )
    # The running Attempt's Worker learns it at its next lease control.
    answer = await control_lease(world.conn, running.fence, world.timings)
    assert answer.answer is LeaseAnswer.STOP_REQUESTED
    assert answer.cancel_reason == "policy", "nobody asked: the Worker is not told a user did"
    cursor = await world.conn.execute(
        "SELECT actor_kind, actor_id FROM qinglong.run_events"
        " WHERE run_id = %s AND event_type = 'run.cancel_requested'",
        (queued,),
    )
    assert await cursor.fetchall() == [("reconciler", PROJECT_DISABLED.id)]


async def test_an_offer_made_before_the_project_was_disabled_cannot_be_claimed(
    world: World, database: MigratedDatabase
) -> None:
    """The offer was placed while the project was active; the claim re-reads it under the
    Run's lock: a disabled project's Run starts on no Worker, whatever it was offered."""
    queued = await world.queued_run()
    session = await world.session("worker-b")
    [offer] = (await placement.pull_offers(world.conn, session, 8, world.timings)).offers
    disable_project(database)
    request, _ = fresh_claim(session, offer.offer_id, queued)
    with pytest.raises(Refused) as refused:
        await placement.claim_offer(world.conn, request, world.timings)
    assert refused.value.reason is Reason.OFFER_EXPIRED
    assert await run_state(world, queued) == ("queued", None, None)
    cursor = await world.conn.execute(
        "SELECT count(*) FROM qinglong.attempts WHERE run_id = %s", (queued,)
    )
    assert await cursor.fetchone() == (0,)


async def test_a_disabled_project_takes_no_new_run_but_answers_a_retried_trigger(
    world: World, database: MigratedDatabase
) -> None:
    """TriggerRun re-reads the project in its transaction: ingress admitted the call
    while the project was active, and a disable that committed since refuses it. The
    retry of a trigger that committed before still answers its Run."""
    task = await world.task()
    earlier = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task, None, "trigger-1"), OPERATOR
    )
    disable_project(database)
    with pytest.raises(Refused) as refused:
        await runs.trigger_run(
            world.conn, runs.TriggerRun(PROJECT, task, None, "trigger-2"), OPERATOR
        )
    assert refused.value.reason is Reason.PROJECT_NOT_FOUND
    again = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task, None, "trigger-1"), OPERATOR
    )
    assert again.run_id == earlier.run_id
    cursor = await world.conn.execute(
        "SELECT count(*) FROM qinglong.runs WHERE project_id = %s", (PROJECT,)
    )
    assert await cursor.fetchone() == (1,)


async def test_the_sweep_reads_no_run_while_no_project_is_disabled(
    world: World, database: MigratedDatabase
) -> None:
    """Every cycle on every replica runs the sweep, and a project is seldom disabled: with
    none disabled it must not read the Runs of the active ones (it once scanned them all,
    25 ms a cycle with 100,000 waiting). Read from the plan actually executed."""
    await world.queued_run()
    await world.claimed()
    statement = SQL["cancellation.runs_of_disabled_projects"]
    explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement
    with psycopg.connect(database.urls.runtime) as conn:
        row = conn.execute(explain, {"limit": 128}).fetchone()
        conn.rollback()  # EXPLAIN ANALYZE ran the statement: its locks go now
    assert row is not None
    scans = scans_of(row[0][0]["Plan"], "runs")
    assert scans, "the plan reads qinglong.runs somewhere"
    pages = [pages_read(node) for node in scans]
    assert pages == [0] * len(scans), f"pages of qinglong.runs or its indexes read: {pages}"
