"""A task's concurrency limit (a plan's ``max_concurrent_runs``): at most that many of the
task's Runs hold a slot — queued or further, or ended while a lost executor may still be
stopping — and the rest wait ``created`` until admitted, in queue order, on rows and
Events, with real concurrent transactions."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool
from qinglong_control.db import definitions, placement, runs
from qinglong_control.db.concurrency_slots import ADMISSION, AdmissionCursor, admission_pages
from qinglong_control.db.convergence import converge_page, expire_leases
from qinglong_control.db.lease_control import complete_attempt
from qinglong_control.db.pool import open_runtime_pool
from qinglong_control.db.retries import retry_page
from qinglong_control.db.sql import SQL
from qinglong_control.db.start_facts import acknowledge_running, acknowledge_starting
from qinglong_control.domain.capability import parse_digest
from qinglong_control.domain.completion import CompletionReport
from qinglong_control.domain.ending_codes import ATTEMPTS_EXHAUSTED
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.start_facts import RunningReport
from qinglong_control.domain.timings import Timings
from qinglong_control.reconciler import Reconciler, ReconcilerLimits
from qinglong_protocol.pooling import PoolSizing

from tests.support.locks import until_waiting
from tests.support.plans import rows_examined
from tests.support.postgres import MigratedDatabase
from tests.support.world import OPERATOR, PROJECT, ClaimedWork, World

REPORT = RunningReport("pid:4242;start:1700000000", None, 1, parse_digest("ab" * 32))


async def states(world: World, *run_ids: uuid.UUID) -> list[str]:
    cursor = await world.conn.execute(
        "SELECT run_id, state FROM qinglong.runs WHERE run_id = ANY(%s)", (list(run_ids),)
    )
    by_run = dict(await cursor.fetchall())
    return [by_run[run_id] for run_id in run_ids]


async def timeline(world: World, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    cursor = await world.conn.execute(
        "SELECT event_type, actor_kind, actor_id, payload FROM qinglong.run_events"
        " WHERE run_id = %s ORDER BY sequence",
        (run_id,),
    )
    return list(await cursor.fetchall())


async def admit(world: World) -> int:
    """One reconcile cycle's admission step, page by page, on the test's connection."""
    page = admission_pages(world.conn, 128, world.timings)
    admitted = 0
    while True:
        done = await page()
        admitted += done.admitted
        if done.listed < 128:
            return admitted


async def running(world: World, work: ClaimedWork) -> None:
    await acknowledge_starting(world.conn, work.fence)
    await acknowledge_running(world.conn, work.fence, REPORT)


async def test_a_limited_task_queues_only_as_many_runs_as_its_limit(world: World) -> None:
    task_id = await world.task(max_concurrent_runs=2)
    first, second, third, fourth = [await world.run_of(task_id) for _ in range(4)]
    assert await states(world, first, second, third, fourth) == [
        "queued",
        "queued",
        "created",
        "created",
    ]
    assert [event[:3] for event in await timeline(world, first)] == [
        ("run.created", "user", "alice"),
        ("run.queued", "user", "alice"),
    ]
    created, queued = await timeline(world, second)
    assert created[3] == {"to_state": "created", "limit": 2}
    assert queued[3] == {
        "from_state": "created",
        "to_state": "queued",
        "slots_held": 1,
        "limit": 2,
    }
    assert [event[0] for event in await timeline(world, third)] == ["run.created"]
    offered = await world.offered(await world.session("worker-a"))
    assert set(offered) == {first, second}, "a waiting Run is offered to nobody"
    assert await admit(world) == 0, "no slot is free"


async def test_a_slot_freed_by_a_completion_admits_the_next_in_queue_order(
    world: World,
) -> None:
    task_id = await world.task(max_concurrent_runs=1)
    first = await world.run_of(task_id)
    older = await world.run_of(task_id)
    urgent = await world.run_of(task_id, priority=5)
    work = await world.claim(first, await world.session("worker-a"))
    await running(world, work)
    assert await admit(world) == 0, "a running Run holds its slot"
    await succeed_reported(world, work)
    assert await admit(world) == 1
    assert await states(world, first, older, urgent) == ["succeeded", "created", "queued"]
    assert (await timeline(world, urgent))[-1][:3] == (
        "run.queued",
        ADMISSION.kind,
        ADMISSION.id,
    )
    assert await admit(world) == 0, "the admitted Run holds the slot while queued"


async def succeed_reported(world: World, work: ClaimedWork) -> None:
    report = CompletionReport(REPORT.callback_sequence, "succeeded", 0, "")
    await complete_attempt(world.conn, work.fence, report)


async def test_runs_of_a_revision_without_a_limit_hold_slots_too(world: World) -> None:
    """A limit bounds the task: Runs triggered before it, of a revision without one,
    count."""
    task_id = await world.task()
    unlimited = [await world.run_of(task_id) for _ in range(2)]
    await definitions.create_revision(
        world.conn,
        definitions.NewRevision(
            PROJECT, task_id, "rev-2", "remote_worker", ["echo"], None, max_concurrent_runs=2
        ),
        OPERATOR.id,
    )
    limited = await world.run_of(task_id)
    assert await states(world, *unlimited, limited) == ["queued", "queued", "created"]


async def test_a_lost_run_that_ended_holds_its_slot_until_its_worker_must_have_stopped(
    world: World,
) -> None:
    """The lost Attempt's Worker, cut off, may still be stopping its executor for the stop
    bound after the lease ran out, though the Run ended at once (no retries): the next Run
    waits for that bound, as a lost Run's own retry does."""
    task_id = await world.task(max_concurrent_runs=1)
    first = await world.run_of(task_id)
    waiting = await world.run_of(task_id)
    work = await world.claim(first, await world.session("worker-a"))
    await running(world, work)
    await world.lease_ran_out(work.fence.attempt_id, 10_000)
    assert (await expire_leases(world.conn, 128)).expired == 1
    assert (await retry_page(world.conn, 128, world.timings)).exhausted == 1
    cursor = await world.conn.execute(
        "SELECT state, error_code FROM qinglong.runs WHERE run_id = %s", (first,)
    )
    assert await cursor.fetchone() == ("failed", ATTEMPTS_EXHAUSTED)
    # The lease ran out 10 s ago; the default stop bound is 30 s (a lease lifetime).
    assert world.timings.lost_executor_stop_ms > 10_000
    assert await admit(world) == 0, "within the stop bound the lost executor holds the slot"
    assert await states(world, waiting) == ["created"]
    quick = World(world.conn, Timings(lease_ttl_ms=5_000, worker_stop_ms=5_000))
    assert await admit(quick) == 1, "past a 5 s stop bound it holds nothing"
    assert await states(world, waiting) == ["queued"]


async def test_an_attempt_that_never_started_holds_no_slot_once_its_run_ended(
    world: World,
) -> None:
    """Only an Attempt that reached `starting` may have an executor to stop."""
    task_id = await world.task(max_concurrent_runs=1)
    first = await world.run_of(task_id)
    waiting = await world.run_of(task_id)
    work = await world.claim(first, await world.session("worker-a"))
    await world.cancel_intent(first)
    await world.lease_ran_out(work.fence.attempt_id)
    assert (await expire_leases(world.conn, 128)).expired == 1
    assert (await converge_page(world.conn, 128)).converged == 1
    assert await states(world, first) == ["cancelled"]
    assert await admit(world) == 1
    assert await states(world, waiting) == ["queued"]


async def test_a_waiting_run_with_a_cancel_intent_is_cancelled_not_admitted(
    world: World,
) -> None:
    task_id = await world.task(max_concurrent_runs=1)
    first = await world.run_of(task_id)
    cancelled, after = await world.run_of(task_id), await world.run_of(task_id)
    await world.cancel_intent(cancelled)
    assert (await converge_page(world.conn, 128)).converged == 1
    assert await states(world, first, cancelled, after) == ["queued", "cancelled", "created"]
    await world.cancel_intent(first)
    assert (await converge_page(world.conn, 128)).converged == 1
    assert await admit(world) == 1
    assert await states(world, after) == ["queued"]


@pytest.fixture
async def runtime_pool(database: MigratedDatabase) -> AsyncIterator[AsyncConnectionPool[Any]]:
    pool = await open_runtime_pool(database.urls.runtime, sizing=PoolSizing(8, 8))
    try:
        yield pool
    finally:
        await pool.close()


async def test_concurrent_triggers_never_queue_more_runs_than_the_limit(
    world: World, runtime_pool: AsyncConnectionPool[Any]
) -> None:
    """Triggers on eight connections at once each count the slots after the one before
    committed (the task's lock): without it, each counts none held."""
    task_id = await world.task(max_concurrent_runs=2)

    async def trigger() -> uuid.UUID:
        async with runtime_pool.connection() as conn:
            return await World(conn, world.timings).run_of(task_id)

    for _ in range(3):
        await asyncio.gather(*(trigger() for _ in range(8)))
    cursor = await world.conn.execute(
        "SELECT state, count(*) FROM qinglong.runs WHERE task_id = %s GROUP BY state",
        (task_id,),
    )
    assert dict(await cursor.fetchall()) == {"queued": 2, "created": 22}


async def test_replicas_admitting_at_once_never_exceed_the_limit(
    world: World, runtime_pool: AsyncConnectionPool[Any]
) -> None:
    task_id = await world.task(max_concurrent_runs=3)
    run_ids = [await world.run_of(task_id) for _ in range(12)]
    for run_id in run_ids[:3]:
        await world.cancel_intent(run_id)
    assert (await converge_page(world.conn, 128)).converged == 3
    replicas = [Reconciler(runtime_pool, ReconcilerLimits()) for _ in range(4)]
    reports = await asyncio.gather(*(replica.cycle() for replica in replicas))
    assert sum(report.runs_admitted for report in reports) == 3
    assert (await replicas[0].cycle()).runs_admitted == 0
    assert await states(world, *run_ids[3:]) == ["queued"] * 3 + ["created"] * 6


async def test_the_limit_is_part_of_the_plan_and_of_a_revisions_replay(world: World) -> None:
    task_id = await world.task(max_concurrent_runs=4)
    revision = await definitions.get_revision(world.conn, PROJECT, task_id, revision_number=1)
    assert revision.plan.max_concurrent_runs == 4
    again = definitions.NewRevision(
        PROJECT, task_id, "rev-x", "remote_worker", ["true"], None, max_concurrent_runs=1
    )
    await definitions.create_revision(world.conn, again, OPERATOR.id)
    other = definitions.NewRevision(
        PROJECT, task_id, "rev-x", "remote_worker", ["true"], None, max_concurrent_runs=2
    )
    with pytest.raises(Refused) as refused:
        await definitions.create_revision(world.conn, other, OPERATOR.id)
    assert refused.value.reason is Reason.REPLAY_MISMATCH


async def test_a_pull_never_sees_a_waiting_run(world: World) -> None:
    """Placement reads queued Runs only: a waiting Run cannot be offered, whatever the
    Worker's room."""
    task_id = await world.task(max_concurrent_runs=1)
    first, waiting = await world.run_of(task_id), await world.run_of(task_id)
    session = await world.session("worker-a")
    pulled = await placement.pull_offers(world.conn, session, 8, world.timings)
    assert [offer.run_id for offer in pulled.offers] == [first]
    assert await states(world, waiting) == ["created"]


async def test_the_admission_step_reads_a_task_once_however_many_runs_wait(
    world: World,
) -> None:
    """The step lists tasks by a skip scan of runs_waiting_for_slot: two tasks with 200
    waiting Runs each are two index probes, not 400 rows."""
    tasks = [await world.task(max_concurrent_runs=1) for _ in range(2)]
    for task_id in tasks:
        await world.run_of(task_id)
        await world.conn.execute(
            "INSERT INTO qinglong.runs (run_id, project_id, task_id, revision_id, state,"
            " executor_type, trigger_request_id, triggered_by, created_at_ms, updated_at_ms)"
            " SELECT gen_random_uuid(), project_id, task_id, revision_id, 'created',"
            " executor_type, 'bulk-' || task_id || '-' || n, 'user:alice', created_at_ms + n,"
            " created_at_ms + n"
            " FROM qinglong.runs, generate_series(1, 200) n WHERE task_id = %s"
            " AND state = 'queued'",
            (task_id,),
        )
    await world.conn.execute("ANALYZE qinglong.runs")
    page = admission_pages(world.conn, 128, world.timings)
    done = await page()
    assert (done.listed, done.admitted) == (2, 0)
    cursor = await world.conn.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + SQL["concurrency_slots.waiting_tasks"],
        {
            "after": uuid.UUID(int=0),
            "limit": 128,
            "lost_executor_stop_ms": world.timings.lost_executor_stop_ms,
        },
    )
    row = await cursor.fetchone()
    assert row is not None
    examined = rows_examined(row[0][0]["Plan"], "runs")
    assert 0 < examined <= 20, f"the listing read {examined} Runs of 402"


async def revise(world: World, task_id: uuid.UUID, limit: int | None) -> None:
    revision = definitions.NewRevision(
        PROJECT,
        task_id,
        f"rev-{uuid.uuid4().hex[:8]}",
        "remote_worker",
        ["echo"],
        None,
        max_concurrent_runs=limit,
    )
    await definitions.create_revision(world.conn, revision, OPERATOR.id)


async def test_the_newest_revisions_limit_is_the_tasks_whatever_revision_is_pinned(
    world: World,
) -> None:
    """Triggering an older revision without a limit does not get around the task's."""
    task_id = await world.task()
    await revise(world, task_id, 1)
    first = await world.run_of(task_id)
    pinned = await runs.trigger_run(
        world.conn,
        runs.TriggerRun(PROJECT, task_id, 1, f"t-{uuid.uuid4().hex[:8]}"),
        OPERATOR,
        world.timings,
    )
    assert (pinned.revision_number, pinned.state) == (1, "created")
    assert await states(world, first) == ["queued"]


async def test_a_revised_limit_applies_to_the_runs_still_waiting(world: World) -> None:
    task_id = await world.task(max_concurrent_runs=1)
    run_ids = [await world.run_of(task_id) for _ in range(5)]
    await revise(world, task_id, 3)
    assert await admit(world) == 2, "raised to 3: two more"
    assert await states(world, *run_ids) == ["queued"] * 3 + ["created"] * 2
    await revise(world, task_id, None)
    assert await admit(world) == 2, "no limit any more: every waiting Run"
    assert await states(world, *run_ids) == ["queued"] * 5


async def test_a_trigger_that_admits_an_earlier_waiting_run_leaves_it_to_the_admission(
    world: World,
) -> None:
    """A slot freed before the cadence came: the next trigger admits the Run waiting
    longest first, by the admission's actor, and its own Run waits."""
    task_id = await world.task(max_concurrent_runs=1)
    first, waiting = await world.run_of(task_id), await world.run_of(task_id)
    await world.cancel_intent(first)
    assert (await converge_page(world.conn, 128)).converged == 1
    newest = await world.run_of(task_id)
    assert await states(world, waiting, newest) == ["queued", "created"]
    assert (await timeline(world, waiting))[-1][:3] == (
        "run.queued",
        ADMISSION.kind,
        ADMISSION.id,
    )


async def test_a_waiting_run_with_a_cancel_intent_is_passed_over(world: World) -> None:
    """Before convergence ends it, a waiting Run with an intent is not admitted; the next
    one is."""
    task_id = await world.task(max_concurrent_runs=1)
    first = await world.run_of(task_id)
    doomed, after = await world.run_of(task_id), await world.run_of(task_id)
    await world.cancel_intent(doomed)
    await world.cancel_intent(first)
    cursor = await world.conn.execute(
        "UPDATE qinglong.runs SET state = 'cancelled', finished_at_ms = qinglong.db_now_ms()"
        " WHERE run_id = %s",
        (first,),
    )
    assert cursor.rowcount == 1
    assert await admit(world) == 1
    assert await states(world, doomed, after) == ["created", "queued"]


async def test_the_step_goes_on_after_its_last_page_from_one_cycle_to_the_next(
    world: World,
) -> None:
    """With one task a page and one page a cycle, a task held full ahead of another in
    task order cannot keep the other from being admitted: the next cycle reads on."""
    tasks = sorted([await world.task(max_concurrent_runs=1) for _ in range(2)])
    waiting = {}
    for task_id in tasks:
        running = await world.run_of(task_id)
        waiting[task_id] = await world.run_of(task_id)
    await world.cancel_intent(running)  # frees the later task's slot only
    assert (await converge_page(world.conn, 128)).converged == 1
    cursor = AdmissionCursor()
    cycles = [await admission_pages(world.conn, 1, world.timings, cursor)() for _ in range(3)]
    assert [(page.listed, page.admitted) for page in cycles] == [(1, 0), (1, 1), (0, 0)]
    assert cursor.after == uuid.UUID(int=0), "a page that found none starts over"

    assert await states(world, waiting[tasks[0]], waiting[tasks[1]]) == ["created", "queued"]


async def test_slots_held_reads_only_the_tasks_own_runs_planned_generically(
    world: World,
) -> None:
    """qinglong.task_slots_held's body, planned as the reconciler's pool plans it (a
    generic plan), reads the task's live Runs and those that ended within the stop bound,
    not its history of 300 ended Runs."""
    task_id = await world.task(max_concurrent_runs=1)
    await world.run_of(task_id)
    await world.conn.execute(
        "INSERT INTO qinglong.runs (run_id, project_id, task_id, revision_id, state,"
        " executor_type, trigger_request_id, triggered_by, created_at_ms, updated_at_ms,"
        " finished_at_ms)"
        " SELECT gen_random_uuid(), project_id, task_id, revision_id, 'succeeded',"
        " executor_type, 'old-' || n, 'user:alice', created_at_ms - 86400000,"
        " created_at_ms - 86400000, created_at_ms - 86400000 + n"
        " FROM qinglong.runs, generate_series(1, 300) n WHERE task_id = %s",
        (task_id,),
    )
    await world.conn.execute("ANALYZE qinglong.runs")
    cursor = await world.conn.execute(
        "SELECT prosrc FROM pg_proc WHERE proname = 'task_slots_held'"
    )
    row = await cursor.fetchone()
    assert row is not None
    body = row[0].replace("p_task_id", "$1").replace("p_lost_since_ms", "$2")
    await world.conn.execute("SET plan_cache_mode = force_generic_plan")
    await world.conn.execute(f"PREPARE slots_held (uuid, bigint) AS {body}")
    # EXECUTE takes no bound parameters; a UUID is safe to spell out.
    arguments = f"'{task_id}'::uuid, qinglong.db_now_ms() - 30000"
    cursor = await world.conn.execute(
        f"EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE slots_held({arguments})"
    )
    plan = await cursor.fetchone()
    assert plan is not None
    examined = rows_examined(plan[0][0]["Plan"], "runs")
    assert examined <= 5, f"read {examined} Runs of the task's 301"
    counted = await world.conn.execute(f"EXECUTE slots_held({arguments})")
    assert await counted.fetchone() == (1,)


async def test_a_trigger_racing_the_revision_that_adds_a_limit_is_held_to_it(
    world: World, database: MigratedDatabase
) -> None:
    """The trigger reads the limit under the task's lock shared: queued behind a revision
    that adds one (waiting for the task's lock), it sees the new limit and waits, where
    reading before that revision committed it would have queued a second Run."""
    task_id = await world.task()
    first = await world.run_of(task_id)
    holder = await psycopg.AsyncConnection.connect(database.urls.runtime)
    revising = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    triggering = await psycopg.AsyncConnection.connect(database.urls.runtime, autocommit=True)
    try:
        await holder.execute(
            "SELECT pg_advisory_xact_lock(hashtextextended('qinglong.task:' || %s, 0))",
            (str(task_id),),
        )
        revision = asyncio.create_task(revise(World(revising), task_id, 1))
        await until_waiting(world.conn, 1)
        trigger = asyncio.create_task(World(triggering, world.timings).run_of(task_id))
        await until_waiting(world.conn, 2)
        await holder.commit()
        await revision
        second = await trigger
    finally:
        for conn in (holder, revising, triggering):
            await conn.close()
    assert await states(world, first, second) == ["queued", "created"]
