"""The queue timeout (a plan's ``queue_timeout_ms``): a Run that waited queued longer than
its plan allows ends ``timed_out`` / ``QUEUE_TIMED_OUT``, once, on rows and Events."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from qinglong_control.db import definitions, placement, runs
from qinglong_control.db.convergence import converge_page, expire_leases
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.db.queue_timeouts import time_out_queued_runs
from qinglong_control.db.sql import SQL
from qinglong_control.domain.convergence import derived_event_id
from qinglong_control.domain.ending_codes import QUEUE_TIMED_OUT
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_protocol.pooling import PoolSizing

from tests.support.plans import rows_examined
from tests.support.postgres import MigratedDatabase
from tests.support.world import OPERATOR, PROJECT, World, fresh_claim

WAIT_MS = 60_000


async def queued_for(world: World, run_id: uuid.UUID, waited_ms: int) -> int:
    """Make the Run look queued ``waited_ms`` ago (DB time); when that was."""
    cursor = await world.conn.execute(
        "UPDATE qinglong.runs SET updated_at_ms = qinglong.db_now_ms() - %s"
        " WHERE run_id = %s RETURNING updated_at_ms",
        (waited_ms, run_id),
    )
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0])


async def run_state(world: World, run_id: uuid.UUID) -> tuple[Any, ...]:
    cursor = await world.conn.execute(
        "SELECT state, error_code, finished_at_ms IS NOT NULL FROM qinglong.runs WHERE run_id = %s",
        (run_id,),
    )
    row = await cursor.fetchone()
    assert row is not None
    return tuple(row)


async def events(world: World, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    cursor = await world.conn.execute(
        "SELECT sequence, event_type, actor_kind, actor_id, event_id, payload"
        " FROM qinglong.run_events WHERE run_id = %s ORDER BY sequence",
        (run_id,),
    )
    return list(await cursor.fetchall())


async def test_a_run_that_waited_too_long_ends_timed_out_once(world: World) -> None:
    run_id = await world.queued_run(queue_timeout_ms=WAIT_MS)
    queued_at = await queued_for(world, run_id, WAIT_MS + 1)
    assert await time_out_queued_runs(world.conn, 128) == 1
    assert await run_state(world, run_id) == ("timed_out", QUEUE_TIMED_OUT, True)
    first, (sequence, event_type, kind, actor, event_id, payload) = await events(world, run_id)
    assert first[1] == "run.queued"
    assert (sequence, event_type, kind, actor) == (
        2,
        "run.timed_out",
        "reconciler",
        "queue-timeout",
    )
    assert payload == {
        "from_state": "queued",
        "to_state": "timed_out",
        "error_code": QUEUE_TIMED_OUT,
    }
    assert event_id == derived_event_id("qinglong.queue-timeout.run", run_id, queued_at)
    assert await time_out_queued_runs(world.conn, 128) == 0, "ended once"
    assert len(await events(world, run_id)) == 2


async def test_a_run_within_its_wait_or_without_a_bound_stays_queued(world: World) -> None:
    within = await world.queued_run(queue_timeout_ms=WAIT_MS)
    await queued_for(world, within, WAIT_MS - 5_000)
    unbounded = await world.queued_run()
    await queued_for(world, unbounded, 365 * 24 * 3600 * 1000)
    assert await time_out_queued_runs(world.conn, 128) == 0
    assert (await run_state(world, within))[0] == "queued"
    assert (await run_state(world, unbounded))[0] == "queued"


async def test_the_open_offer_is_withdrawn_and_cannot_be_claimed(world: World) -> None:
    run_id = await world.queued_run(queue_timeout_ms=WAIT_MS)
    session = await world.session("worker-a")
    pulled = await placement.pull_offers(world.conn, session, 8, world.timings)
    (offer,) = [placed for placed in pulled.offers if placed.run_id == run_id]
    await queued_for(world, run_id, WAIT_MS)
    assert await time_out_queued_runs(world.conn, 128) == 1
    cursor = await world.conn.execute(
        "SELECT state FROM qinglong.offers WHERE offer_id = %s", (offer.offer_id,)
    )
    assert await cursor.fetchone() == ("withdrawn",)
    again = await placement.pull_offers(world.conn, session, 8, world.timings)
    assert run_id not in {placed.run_id for placed in again.offers}
    request, _ = fresh_claim(session, offer.offer_id, run_id)
    with pytest.raises(Refused) as refused:
        await placement.claim_offer(world.conn, request, world.timings)
    assert refused.value.reason is Reason.OFFER_EXPIRED
    assert (await run_state(world, run_id))[0] == "timed_out"


async def test_a_claimed_run_is_not_timed_out_and_a_requeued_one_waits_again(
    world: World,
) -> None:
    """The wait counts from each time the Run is queued: a Run claimed just in time is the
    claim's, and when that claim's lease runs out the Run waits its whole bound again."""
    run_id = await world.queued_run(queue_timeout_ms=WAIT_MS)
    await queued_for(world, run_id, WAIT_MS - 1_000)
    work = await world.claim(run_id, await world.session("worker-a"))
    await queued_for(world, run_id, 10 * WAIT_MS)  # a dispatching Run's age means nothing
    assert await time_out_queued_runs(world.conn, 128) == 0
    await world.conn.execute(
        "UPDATE qinglong.run_leases SET renewed_at_ms = qinglong.db_now_ms() - 2,"
        " expires_at_ms = qinglong.db_now_ms() - 1 WHERE attempt_id = %s",
        (work.fence.attempt_id,),
    )
    assert (await expire_leases(world.conn, 128)).expired == 1
    assert (await run_state(world, run_id))[0] == "queued"
    assert await time_out_queued_runs(world.conn, 128) == 0, "requeued just now"
    await queued_for(world, run_id, WAIT_MS)
    assert await time_out_queued_runs(world.conn, 128) == 1
    assert await run_state(world, run_id) == ("timed_out", QUEUE_TIMED_OUT, True)


async def test_a_run_with_a_cancel_intent_is_left_to_convergence(world: World) -> None:
    run_id = await world.queued_run(queue_timeout_ms=WAIT_MS)
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user', updated_at_ms = qinglong.db_now_ms() - %s"
        " WHERE run_id = %s",
        (2 * WAIT_MS, run_id),
    )
    assert await time_out_queued_runs(world.conn, 128) == 0
    await converge_page(world.conn, 128)
    assert await run_state(world, run_id) == ("cancelled", "EXECUTION_CANCELLED", True)


async def test_the_plan_keeps_its_queue_timeout_and_each_run_a_copy(world: World) -> None:
    task_id = await world.task(queue_timeout_ms=WAIT_MS)
    first = await definitions.get_revision(world.conn, PROJECT, task_id, revision_number=1)
    assert first.plan.queue_timeout_ms == WAIT_MS
    # A retried revision must ask for the same wait.
    retried = definitions.NewRevision.of(
        PROJECT, task_id, "rev-1", definitions.RevisionPlan(**{**vars(first.plan)})
    )
    assert (await definitions.create_revision(world.conn, retried, OPERATOR.id)) == first
    other = definitions.RevisionPlan(**{**vars(first.plan), "queue_timeout_ms": WAIT_MS + 1})
    with pytest.raises(Refused) as refused:
        await definitions.create_revision(
            world.conn, definitions.NewRevision.of(PROJECT, task_id, "rev-1", other), OPERATOR.id
        )
    assert refused.value.reason is Reason.REPLAY_MISMATCH
    run = await runs.trigger_run(world.conn, runs.TriggerRun(PROJECT, task_id, None, "t"), OPERATOR)
    # A later revision with another bound changes no Run already triggered.
    await definitions.create_revision(
        world.conn, definitions.NewRevision.of(PROJECT, task_id, "rev-2", other), OPERATOR.id
    )
    cursor = await world.conn.execute(
        "SELECT queue_timeout_ms FROM qinglong.runs WHERE run_id = %s", (run.run_id,)
    )
    assert await cursor.fetchone() == (WAIT_MS,)


async def test_the_page_reads_only_runs_whose_wait_is_over(
    world: World, database: MigratedDatabase
) -> None:
    """Every cycle of every replica runs this page: it must not read the queue. With 3,300
    Runs queued (100 of them with a bound not yet reached) and 2 overdue, the executed plan
    examines the 2 overdue Runs and nothing else. (With a few hundred, reading them all
    and sorting costs the planner about as much as the index, and a busy machine's
    statistics could tip it either way.)"""
    plain = await world.queued_run()
    await world.conn.execute(
        "INSERT INTO qinglong.runs (run_id, project_id, task_id, revision_id, state,"
        " executor_type, trigger_request_id, triggered_by, created_at_ms, updated_at_ms)"
        " SELECT gen_random_uuid(), project_id, task_id, revision_id, 'queued', executor_type,"
        " 'bulk-' || n, triggered_by, created_at_ms + n, updated_at_ms + n"
        " FROM qinglong.runs, generate_series(1, 3199) n WHERE run_id = %s",
        (plain,),
    )
    for _ in range(100):
        await world.queued_run(queue_timeout_ms=WAIT_MS)
    for _ in range(2):
        await queued_for(world, await world.queued_run(queue_timeout_ms=WAIT_MS), WAIT_MS)
    explain = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + SQL["queue_timeouts.lock_overdue"]
    with psycopg.connect(database.urls.runtime) as conn:
        conn.execute("ANALYZE qinglong.runs")
        row = conn.execute(explain, {"limit": 128}).fetchone()
        conn.rollback()  # EXPLAIN ANALYZE ran the statement: its locks go now
    assert row is not None
    assert rows_examined(row[0][0]["Plan"], "runs") == 2


@pytest.fixture
async def runtime_pool(database: MigratedDatabase) -> AsyncIterator[Any]:
    pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(1, 4))
    try:
        yield pool
    finally:
        await pool.close()


async def test_replicas_time_out_each_run_once(world: World, runtime_pool: Any) -> None:
    """Two replicas' cycles side by side share the overdue Runs (SKIP LOCKED): every Run
    ends once, with one Event, and the reports add up."""
    overdue = [await world.queued_run(queue_timeout_ms=WAIT_MS) for _ in range(40)]
    for run_id in overdue:
        await queued_for(world, run_id, WAIT_MS)
    limits = ReconcilerLimits(page_size=3, max_pages=64)
    replicas = [Reconciler(runtime_pool, limits) for _ in range(2)]
    reports = await asyncio.gather(*(replica.cycle() for replica in replicas))
    ended = sum(report.queue_timeouts for report in reports)
    again = await replicas[0].cycle()
    cursor = await world.conn.execute(
        "SELECT count(*) FILTER (WHERE state = 'timed_out' AND error_code = %s),"
        " (SELECT count(*) FROM qinglong.run_events"
        "   WHERE run_id = ANY(%s) AND event_type = 'run.timed_out')"
        " FROM qinglong.runs WHERE run_id = ANY(%s)",
        (QUEUE_TIMED_OUT, overdue, overdue),
    )
    timed_out, timed_out_events = await cursor.fetchone() or (0, 0)
    print(f"queue timeout, two replicas: ended {ended} + {again.queue_timeouts} of 40")
    assert (timed_out, timed_out_events) == (40, 40)
    assert ended + again.queue_timeouts == 40
