"""A Worker limited to some projects is offered, and may claim, only their Runs
(docs/worker-operations.md, "Trust"): its tasks run as its own user and can act as the
Worker, so a Worker shared by projects joins their trust. The administrator sets the list;
placement and the claim read it."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest
from qinglong_control.db import admin, placement
from qinglong_control.domain.refusals import Reason, Refused
from qinglong_control.domain.sessions import SessionClaim

from tests.support.plans import rows_a_pull_examines
from tests.support.postgres import MigratedDatabase
from tests.support.world import OTHER_PROJECT, PROJECT, World, fresh_claim

OTHER = OTHER_PROJECT
Conn = psycopg.AsyncConnection[Any]


async def claim(
    world: World, session: SessionClaim, project: str, run_id: uuid.UUID, offer_id: uuid.UUID
) -> placement.Claimed:
    request, _ = fresh_claim(session, offer_id, run_id, project)
    return await placement.claim_offer(world.conn, request, world.timings)


async def test_placement_offers_only_the_workers_projects(world: World, admin_conn: Conn) -> None:
    ours = await world.queued_run()
    theirs = await world.queued_run(project=OTHER)
    scoped = await admin.set_worker_projects(admin_conn, "worker-a", (OTHER,))
    assert scoped.project_ids == (OTHER,)
    assert set(await world.offered(await world.session("worker-a"))) == {theirs}
    # Every project again (a new session: the old one's offers go with it).
    everywhere = await admin.set_worker_projects(admin_conn, "worker-a", None)
    assert everywhere.project_ids is None
    assert set(await world.offered(await world.session("worker-a"))) == {ours, theirs}


async def test_an_offer_made_before_the_projects_changed_is_void(
    world: World, admin_conn: Conn
) -> None:
    ours = await world.queued_run()
    session = await world.session("worker-a")
    offer_id = (await world.offered(session))[ours]
    await admin.set_worker_projects(admin_conn, "worker-a", (OTHER,))
    assert ours not in await world.offered(session)  # not shown again
    with pytest.raises(Refused) as void:
        await claim(world, session, PROJECT, ours, offer_id)
    assert void.value.reason is Reason.OFFER_EXPIRED
    # Nothing was claimed: once the Worker serves the project again, the offer is good.
    await admin.set_worker_projects(admin_conn, "worker-a", (PROJECT, OTHER))
    assert (await world.offered(session))[ours] == offer_id
    claimed = await claim(world, session, PROJECT, ours, offer_id)
    assert claimed.lease_version == 1


async def test_a_worker_created_for_projects_and_projects_it_cannot_serve(
    world: World, admin_conn: Conn
) -> None:
    enrolled = await admin.create_worker(
        admin_conn, "w-edge", "edge-1", "spiffe://qinglong.local/worker/edge-1", None, (OTHER,)
    )
    assert enrolled.worker.project_ids == (OTHER,)
    assert (await admin.get_worker(admin_conn, "edge-1")).project_ids == (OTHER,)
    with pytest.raises(Refused) as missing:
        await admin.set_worker_projects(admin_conn, "edge-1", (PROJECT, "no-such", "nor-this"))
    assert (missing.value.reason, missing.value.field) == (
        Reason.PROJECT_NOT_FOUND,
        "project_ids[1]",
    )
    await admin.disable_project(admin_conn, PROJECT)
    with pytest.raises(Refused) as archived:
        await admin.set_worker_projects(admin_conn, "edge-1", (OTHER, PROJECT))
    assert archived.value.field == "project_ids[1]"
    assert (await admin.get_worker(admin_conn, "edge-1")).project_ids == (OTHER,)
    with pytest.raises(Refused) as unknown_worker:
        await admin.set_worker_projects(admin_conn, "nobody", ("no-such",))
    assert unknown_worker.value.reason is Reason.WORKER_NOT_FOUND
    with pytest.raises(Refused) as created_for_missing:
        await admin.create_worker(
            admin_conn, "w-ghost", "ghost-1", "spiffe://qinglong.local/worker/ghost-1", None,
            ("no-such",),
        )  # fmt: skip
    assert created_for_missing.value.field == "project_ids[0]"
    with pytest.raises(Refused):
        await admin.get_worker(admin_conn, "ghost-1")


async def test_a_scoped_workers_pull_reads_only_its_projects_queues(
    world: World, admin_conn: Conn, database: MigratedDatabase
) -> None:
    """Its pull reads each served project's queue, never the queue of all: another
    project's backlog cost every pull of it a scan (80 ms with 85,000 Runs queued there,
    bench data). Read from the executed plan; the oldest of its projects' Runs still come
    first, across projects."""
    backlog = [await world.queued_run() for _ in range(12)]
    served = [await world.queued_run(project=OTHER) for _ in range(3)]
    await admin.set_worker_projects(admin_conn, "worker-a", (OTHER,))
    session = await world.session("worker-a")
    examined = rows_a_pull_examines(database.urls.runtime, session, 8)
    assert examined == len(served), "only its project's queued Runs"
    # Nor does it read its projects' Runs waiting for labels it has not declared.
    for _ in range(5):
        await world.queued_run(project=OTHER, worker_selector={"gpu": "nosuch"})
    examined = rows_a_pull_examines(database.urls.runtime, session, 8)
    assert examined == len(served), "none that needs a label"
    assert set(await world.offered(session)) == set(served)

    both = await world.session("worker-b")
    await admin.set_worker_projects(admin_conn, "worker-b", (PROJECT, OTHER))
    cursor = await world.conn.execute(
        "SELECT run_id FROM qinglong.runs r WHERE state = 'queued' AND NOT EXISTS"
        " (SELECT 1 FROM qinglong.offers o WHERE o.run_id = r.run_id AND o.state = 'open')"
        " ORDER BY created_at_ms, run_id LIMIT 2"
    )
    oldest = {run_id for (run_id,) in await cursor.fetchall()}
    assert oldest <= set(backlog), "the other project's Runs are the oldest not yet offered"
    offers = await placement.pull_offers(world.conn, both, 2, world.timings)
    assert {offer.run_id for offer in offers.offers} == oldest


async def test_a_scoped_worker_is_placed_on_the_same_conditions(
    world: World, admin_conn: Conn
) -> None:
    """The statement writes the conditions of placement once per kind of Worker: a
    scoped Worker too is offered no Run with a live offer elsewhere, none with a cancel
    intent, none with parameters when it does not pass them on, none whose selector its
    labels do not satisfy, and none of a disabled project."""
    offered_elsewhere = await world.queued_run(project=OTHER)
    assert set(await world.offered(await world.session("worker-b"))) == {offered_elsewhere}
    cancelled = await world.queued_run(project=OTHER)
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (cancelled,),
    )
    placeable = await world.queued_run(project=OTHER)
    with_parameters = await world.queued_run(project=OTHER, parameters={"TARGET": "eu"})
    needs_gpu = await world.queued_run(project=OTHER, worker_selector={"gpu": "a100"})
    cancelled_gpu = await world.queued_run(project=OTHER, worker_selector={"gpu": "a100"})
    await world.conn.execute(
        "UPDATE qinglong.runs SET cancel_requested_at_ms = qinglong.db_now_ms(),"
        " cancel_reason = 'user' WHERE run_id = %s",
        (cancelled_gpu,),
    )
    await admin.set_worker_projects(admin_conn, "worker-a", (OTHER,))
    scoped = await world.session("worker-a", passes_parameters=False)
    assert set(await world.offered(scoped)) == {placeable}
    # Its next session (its offers withdrawn), passing parameters on, takes both.
    passing = await world.session("worker-a")
    assert set(await world.offered(passing)) == {placeable, with_parameters}
    labelled = await world.session("worker-a", labels={"gpu": "a100"})
    assert set(await world.offered(labelled)) == {placeable, with_parameters, needs_gpu}
    labelled_old = await world.session("worker-a", labels={"gpu": "a100"}, passes_parameters=False)
    with_parameters_gpu = await world.queued_run(
        project=OTHER, worker_selector={"gpu": "a100"}, parameters={"X": "1"}
    )
    assert with_parameters_gpu not in await world.offered(labelled_old)
    await admin.disable_project(admin_conn, OTHER)
    await world.queued_run(project=PROJECT)  # another project's: not its to take either
    fresh = await world.session("worker-a")
    assert await world.offered(fresh) == {}
