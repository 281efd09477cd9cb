"""A Run's priority (TriggerRunRequest.priority, migrations 0042, 0043): placement offers a
higher priority first and the oldest first among equals, in every part of the pull."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from qinglong_control.db import admin, placement, runs
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionClaim

from tests.support.plans import rows_a_pull_examines
from tests.support.postgres import MigratedDatabase
from tests.support.world import OPERATOR, OTHER_PROJECT, PROJECT, World, fresh_claim

OTHER = OTHER_PROJECT
Conn = psycopg.AsyncConnection[Any]


async def queued(world: World, **options: Any) -> uuid.UUID:
    """A queued Run created at least a millisecond after the one before: among equal
    priorities age decides, and two Runs of the same millisecond would be ordered by
    their random ids."""
    await asyncio.sleep(0.002)
    return await world.queued_run(**options)


async def taken_in_order(world: World, session: SessionClaim, count: int) -> list[uuid.UUID]:
    """Pull one offer at a time and claim it (so the next pull takes the next Run): the
    order in which placement hands out the queue."""
    order = []
    for _ in range(count):
        pulled = await placement.pull_offers(world.conn, session, 1, world.timings)
        (offer,) = pulled.offers
        request, _ = fresh_claim(session, offer.offer_id, offer.run_id, offer.project_id)
        await placement.claim_offer(world.conn, request, world.timings)
        order.append(offer.run_id)
    return order


async def test_a_higher_priority_is_taken_first_then_the_oldest(world: World) -> None:
    low = await queued(world, priority=-5)
    first_default = await queued(world)
    second_default = await queued(world)
    high = await queued(world, priority=10)
    urgent = await queued(world, priority=100)
    session = await world.session("worker-a")
    taken = await taken_in_order(world, session, 5)
    assert taken == [urgent, high, first_default, second_default, low]


async def test_priority_orders_runs_with_and_without_a_selector_together(world: World) -> None:
    """A labelled Worker reads both parts of the queue; in each, a newer Run of a higher
    priority goes before an older one, and across them the higher priority wins and age
    decides between equals."""
    plain_old = await queued(world)
    selective_old = await queued(world, worker_selector={"gpu": "a100"})
    plain_high = await queued(world, priority=3)
    selective_high = await queued(world, priority=4, worker_selector={"gpu": "a100"})
    session = await world.session("worker-a", labels={"gpu": "a100"})
    taken = await taken_in_order(world, session, 4)
    assert taken == [selective_high, plain_high, plain_old, selective_old]


async def test_a_worker_of_some_projects_takes_the_higher_priority_across_them(
    world: World, admin_conn: Conn
) -> None:
    """Each of its projects' two parts is read in priority order too."""
    eu = {"zone": "eu"}
    here_old = await queued(world)
    there_old = await queued(world, project=OTHER)
    labelled_old = await queued(world, project=OTHER, worker_selector=eu)
    here_high = await queued(world, priority=1)
    there_high = await queued(world, project=OTHER, priority=2)
    labelled_high = await queued(world, project=OTHER, priority=3, worker_selector=eu)
    await admin.set_worker_projects(admin_conn, "worker-a", (PROJECT, OTHER))
    session = await world.session("worker-a", labels=eu)
    taken = await taken_in_order(world, session, 6)
    assert taken == [labelled_high, there_high, here_high, here_old, there_old, labelled_old]


async def test_a_retried_trigger_must_ask_for_the_same_priority(world: World) -> None:
    task_id = await world.task()
    first = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task_id, None, "urgent-1", {}, 7), OPERATOR
    )
    assert first.priority == 7
    again = await runs.trigger_run(
        world.conn, runs.TriggerRun(PROJECT, task_id, None, "urgent-1", {}, 7), OPERATOR
    )
    assert again.run_id == first.run_id
    with pytest.raises(Refused) as refused:
        await runs.trigger_run(
            world.conn, runs.TriggerRun(PROJECT, task_id, None, "urgent-1", {}, 0), OPERATOR
        )
    assert refused.value.reason is Reason.REPLAY_MISMATCH
    shown = await runs.get_run(world.conn, PROJECT, first.run_id)
    listed = await runs.list_runs(world.conn, PROJECT, limit=10)
    assert shown.priority == 7
    assert [run.priority for run in listed.runs if run.run_id == first.run_id] == [7]


async def test_the_pull_reads_the_queue_in_priority_order_from_its_index(
    world: World, database: MigratedDatabase
) -> None:
    """With 200 Runs queued at the default priority and one urgent Run queued last, a pull
    of one reads the urgent Run and no other: the order comes from migration 0043's
    index, not from sorting the queue."""
    for _ in range(200):
        await world.queued_run()
    await world.queued_run(priority=50)
    session = await world.session("worker-a")
    with psycopg.connect(database.urls.runtime, autocommit=True) as conn:
        conn.execute("ANALYZE qinglong.runs")
    assert rows_a_pull_examines(database.urls.runtime, session, 1) == 1


async def test_one_pulls_answer_lists_its_offers_in_priority_order(world: World) -> None:
    """An answer cut short (wire.offers_that_fit) or a Worker that takes fewer keeps the
    first: the most urgent."""
    older = await queued(world)
    urgent = await queued(world, priority=9)
    assert list(await world.offered(await world.session("worker-a"))) == [urgent, older]


async def test_the_operators_view_keeps_the_columns_of_migration_0003(world: World) -> None:
    """Control replicas of an earlier version read ``v.*`` of this view into a fixed set
    of fields: a column added to it fails them during a rolling upgrade, so later columns
    (the priority) are read from runs beside it."""
    cursor = await world.conn.execute("SELECT * FROM qinglong.run_projection LIMIT 0")
    assert cursor.description is not None
    assert [column.name for column in cursor.description] == [
        "run_id", "project_id", "task_id", "revision_id", "revision_number", "state",
        "attempt_count", "latest_attempt_id", "latest_attempt_state", "version",
        "event_sequence", "cancel_reason", "cancel_requested_at_ms", "deadline_at_ms",
        "created_at_ms", "started_at_ms", "finished_at_ms", "error_code", "retry_at_ms",
        "max_attempts",
    ]  # fmt: skip
